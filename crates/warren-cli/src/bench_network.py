# The client of `warren bench --suite network`, run unchanged in the guest and on the host.
# argv[1] is JSON: cases (name, url, host, headers), n, warmup, bulk_bytes, bulk_rounds,
# cadata (extra CAs to trust, PEM) and pin (host -> address; empty: resolve each host through
# the system resolver, timing the lookups, then pin the answer). Every sample opens a new
# connection (urllib never reuses one; no TLS session is resumed: Python resumes only when
# asked to). Only the TLS configuration (SSLContext) is shared. Prints JSON: per case the
# latency samples in ms and the bulk throughputs in MiB/s, and the DNS lookup samples in ms.
import json
import socket
import ssl
import sys
import time
import urllib.request

cfg = json.loads(sys.argv[1])
cases = cfg["cases"]
ctx = ssl.create_default_context()  # honours SSL_CERT_FILE (the guest's Warren CA bundle)
ctx.load_verify_locations(cadata=cfg["cadata"])
opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=ctx))

pin = dict(cfg["pin"])
dns_ms = []
if not pin:
    for i in range(cfg["warmup"] + cfg["n"]):
        for host in sorted({c["host"] for c in cases}):
            t = time.perf_counter()
            addr = socket.getaddrinfo(host, 80, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
            if i >= cfg["warmup"]:
                dns_ms.append((time.perf_counter() - t) * 1000)
            pin[host] = addr
real_getaddrinfo = socket.getaddrinfo


def pinned(host, *args, **kwargs):
    return real_getaddrinfo(pin.get(host, host), *args, **kwargs)


# http.client connects through socket.create_connection, which looks getaddrinfo up in the
# socket module at each call; SNI and Host still carry the name.
socket.getaddrinfo = pinned


def fetch(case, path):
    req = urllib.request.Request(case["url"] + path, headers=case["headers"])
    n = 0
    with opener.open(req, timeout=120) as r:
        while True:
            b = r.read(1 << 20)
            if not b:
                return n
            n += len(b)


lat = {c["name"]: [] for c in cases}
mib_s = {c["name"]: [] for c in cases}
# Interleaved, so every case sees the same load; the first rounds warm caches (the TCG
# translation cache, the proxy's per-name leaf certificate) and are not recorded.
for i in range(cfg["warmup"] + cfg["n"]):
    for c in cases:
        t = time.perf_counter()
        fetch(c, "/small")
        if i >= cfg["warmup"]:
            lat[c["name"]].append((time.perf_counter() - t) * 1000)
for c in cases:
    fetch(c, "/bytes/%d" % (1 << 20))
for _ in range(cfg["bulk_rounds"]):
    for c in cases:
        t = time.perf_counter()
        n = fetch(c, "/bytes/%d" % cfg["bulk_bytes"])
        if n != cfg["bulk_bytes"]:
            sys.exit("%s: short body: %d bytes" % (c["name"], n))
        mib_s[c["name"]].append(n / (1 << 20) / (time.perf_counter() - t))
print(json.dumps({"latency_ms": lat, "mib_s": mib_s, "dns_ms": dns_ms}))
