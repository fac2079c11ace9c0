#!/usr/bin/env python3
"""Test helper for tests/oci.rs: an implementation of cosign's signature and attestation
formats independent of Warren's (Python's `cryptography` for ECDSA P-256, JSON and DSSE by
hand), hostile OCI layouts, and pushes to a registry on loopback over the distribution API.

Commands:
  keygen DIR NAME                          -> DIR/NAME.key (PKCS#8 PEM), DIR/NAME.pub (SPKI PEM)
  sign REGISTRY REPO DIGEST KEY [SIGNED]   -> pushes REPO:sha256-<hex>.sig signing SIGNED
                                              (default DIGEST) as cosign does
  attest REGISTRY REPO DIGEST KEY TYPE BUILDER
                                           -> pushes REPO:sha256-<hex>.att (in-toto statement in
                                              a DSSE envelope)
  verify-trust TRUST_JSON PUB SUBJECT      -> exits 0 if a signature and an attestation in
                                              Warren's trust.json verify under PUB for SUBJECT
  hostile-layout DIR KIND                  -> an OCI layout at DIR (tag `t`) whose one layer is
                                              hostile: abs, dotdot, symlink-escape,
                                              hardlink-escape, special (device + set-id, allowed),
                                              or plain
  big-layout DIR MIB                       -> an OCI layout whose one layer holds MIB MiB of
                                              random bytes (uncompressed)
  layer-digest REGISTRY REPO DIGEST        -> the digest of a pushed image's first layer
"""
import base64
import hashlib
import io
import json
import os
import sys
import tarfile
import urllib.request

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec


def sha256(b):
    return "sha256:" + hashlib.sha256(b).hexdigest()


def keygen(d, name):
    key = ec.generate_private_key(ec.SECP256R1())
    with open(os.path.join(d, name + ".key"), "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    with open(os.path.join(d, name + ".pub"), "wb") as f:
        f.write(key.public_key().public_bytes(serialization.Encoding.PEM,
                                              serialization.PublicFormat.SubjectPublicKeyInfo))


def load_key(path):
    with open(path, "rb") as f:
        return serialization.load_pem_private_key(f.read(), None)


def request(method, url, data=None, headers=None):
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status, dict(r.headers), r.read()


def push_blob(registry, repo, data):
    d = sha256(data)
    _, h, _ = request("POST", f"http://{registry}/v2/{repo}/blobs/uploads/")
    loc = h["Location"]
    if loc.startswith("/"):
        loc = f"http://{registry}{loc}"
    sep = "&" if "?" in loc else "?"
    request("PUT", f"{loc}{sep}digest={d}", data,
            {"Content-Type": "application/octet-stream"})
    return d


def push_artifact(registry, repo, tag, layers):
    """layers: [(media_type, bytes, annotations)] -> an OCI manifest at tag."""
    config = b"{}"
    cd = push_blob(registry, repo, config)
    descs = []
    for mt, data, ann in layers:
        d = push_blob(registry, repo, data)
        desc = {"mediaType": mt, "digest": d, "size": len(data)}
        if ann:
            desc["annotations"] = ann
        descs.append(desc)
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd,
                   "size": len(config)},
        "layers": descs,
    }).encode()
    request("PUT", f"http://{registry}/v2/{repo}/manifests/{tag}", manifest,
            {"Content-Type": "application/vnd.oci.image.manifest.v1+json"})


def sign(registry, repo, digest, key_path, signed=None):
    key = load_key(key_path)
    payload = json.dumps({
        "critical": {
            "identity": {"docker-reference": f"{registry}/{repo}"},
            "image": {"docker-manifest-digest": signed or digest},
            "type": "cosign container image signature",
        },
        "optional": None,
    }).encode()
    sig = key.sign(payload, ec.ECDSA(hashes.SHA256()))
    push_artifact(registry, repo, digest.replace(":", "-") + ".sig", [(
        "application/vnd.dev.cosign.simplesigning.v1+json", payload,
        {"dev.cosignproject.cosign/signature": base64.b64encode(sig).decode()})])


def pae(payload_type, payload):
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def attest(registry, repo, digest, key_path, predicate_type, builder):
    key = load_key(key_path)
    statement = json.dumps({
        "_type": "https://in-toto.io/Statement/v1",
        "subject": [{"name": f"{registry}/{repo}", "digest": {"sha256": digest.split(":")[1]}}],
        "predicateType": predicate_type,
        "predicate": {"buildDefinition": {"buildType": "https://example.com/test/v1"},
                      "runDetails": {"builder": {"id": builder}}},
    }).encode()
    pt = "application/vnd.in-toto+json"
    sig = key.sign(pae(pt, statement), ec.ECDSA(hashes.SHA256()))
    envelope = json.dumps({"payloadType": pt, "payload": base64.b64encode(statement).decode(),
                           "signatures": [{"keyid": "", "sig": base64.b64encode(sig).decode()}]})
    push_artifact(registry, repo, digest.replace(":", "-") + ".att",
                  [("application/vnd.dsse.envelope.v1+json", envelope.encode(), None)])


def verify_trust(trust_path, pub_path, subject):
    with open(pub_path, "rb") as f:
        pub = serialization.load_pem_public_key(f.read())
    with open(trust_path) as f:
        trust = json.load(f)
    ok_sig = ok_att = False
    for s in trust["signatures"]:
        payload = base64.b64decode(s["payload"])
        try:
            pub.verify(base64.b64decode(s["signature"]), payload, ec.ECDSA(hashes.SHA256()))
        except Exception:
            continue
        doc = json.loads(payload)
        if doc["critical"]["image"]["docker-manifest-digest"] == subject and \
                doc["critical"]["type"] == "cosign container image signature":
            ok_sig = True
    for env in trust["attestations"]:
        payload = base64.b64decode(env["payload"])
        for s in env["signatures"]:
            try:
                pub.verify(base64.b64decode(s["sig"]), pae(env["payloadType"], payload),
                           ec.ECDSA(hashes.SHA256()))
            except Exception:
                continue
            st = json.loads(payload)
            if any(x["digest"]["sha256"] == subject.split(":")[1] for x in st["subject"]):
                ok_att = True
    print(f"signature={ok_sig} attestation={ok_att}")
    sys.exit(0 if ok_sig and ok_att else 1)


def tar_layer(kind):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        def add(name, typ=tarfile.REGTYPE, data=b"x", mode=0o644, link=""):
            ti = tarfile.TarInfo(name)
            ti.type, ti.mode, ti.linkname = typ, mode, link
            ti.size = len(data) if typ == tarfile.REGTYPE else 0
            t.addfile(ti, io.BytesIO(data) if typ == tarfile.REGTYPE else None)
        add("etc/", tarfile.DIRTYPE, mode=0o755)
        add("etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\n")
        add("etc/group", data=b"root:x:0:\n")
        if kind == "abs":
            add("/etc/evil")
        elif kind == "dotdot":
            add("etc/../../evil")
        elif kind == "symlink-escape":
            add("out", tarfile.SYMTYPE, link="/tmp")
            add("out/evil")
        elif kind == "hardlink-escape":
            add("hard", tarfile.LNKTYPE, link="../../../etc/shadow")
        elif kind == "special":
            add("dev/", tarfile.DIRTYPE, mode=0o755)
            ti = tarfile.TarInfo("dev/evil-null")
            ti.type, ti.mode, ti.devmajor, ti.devminor = tarfile.CHRTYPE, 0o666, 1, 3
            t.addfile(ti)
            add("usr/", tarfile.DIRTYPE, mode=0o755)
            add("usr/suid", data=b"#!/bin/sh\n", mode=0o4755)
            add("link-out", tarfile.SYMTYPE, link="/etc/shadow")
        elif kind == "plain":
            pass
        else:
            raise SystemExit(f"unknown kind {kind}")
    return buf.getvalue()


def big_layer(mib):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        data = os.urandom(int(mib) << 20)
        ti = tarfile.TarInfo("big.bin")
        ti.size, ti.mode = len(data), 0o644
        t.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def big_layout(d, mib):
    write_layout(d, big_layer(mib))


def layer_digest(registry, repo, digest):
    _, _, body = request("GET", f"http://{registry}/v2/{repo}/manifests/{digest}", None,
                         {"Accept": "application/vnd.oci.image.manifest.v1+json, "
                                    "application/vnd.docker.distribution.manifest.v2+json"})
    print(json.loads(body)["layers"][0]["digest"])


def hostile_layout(d, kind):
    write_layout(d, tar_layer(kind))


def write_layout(d, layer):
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Env": ["PATH=/usr/bin:/bin"]},
                         "rootfs": {"type": "layers", "diff_ids": [sha256(layer)]}}).encode()
    os.makedirs(os.path.join(d, "blobs", "sha256"), exist_ok=True)

    def blob(b):
        dg = sha256(b)
        with open(os.path.join(d, "blobs", "sha256", dg.split(":")[1]), "wb") as f:
            f.write(b)
        return dg
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": blob(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": blob(layer), "size": len(layer)}],
    }).encode()
    md = blob(manifest)
    with open(os.path.join(d, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)
    with open(os.path.join(d, "index.json"), "w") as f:
        json.dump({"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md,
            "size": len(manifest), "annotations": {"org.opencontainers.image.ref.name": "t"}}]},
            f)
    print(md)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    {"keygen": keygen, "sign": sign, "attest": attest, "verify-trust": verify_trust,
     "hostile-layout": hostile_layout, "big-layout": big_layout,
     "layer-digest": layer_digest}[cmd](*args)
