//! `warren bench --suite streams`: guest streams, `vm cp` and the file API against the raw
//! virtio-serial port, all in one VM and one run.
//!
//! The VM gets a second virtio-serial port of the same device and chardev kind as the
//! channel's, with nothing of Warren's on it (a bench-only launch option,
//! `CreateVm::raw_bench_port`). One guest program, the same byte pump for both, serves that
//! port and a TCP port on the guest's loopback, and the host drives both with the same
//! commands (sink N bytes and acknowledge, send N bytes, echo single bytes):
//! (r) raw port: host->guest and guest->host MiB/s, 1-byte round trip;
//! (s) guest stream (`StreamTarget::Tcp`, through the supervisor and the channel): the same,
//!     with the guest's own loopback TCP between two pumps as its ceiling (every stream ends
//!     in a guest TCP connection, which costs the guest's vCPU as much again);
//! (p) channel ping against the port's round trip: an HTTP/2 PING on the channel, asked of
//!     the supervisor over its socket and timed here (so it includes that hop), with the
//!     supervisor's own timing of the PING alone; and the round trip of the agent's `Ping`
//!     request (a request's fixed cost: stream, headers, message, the agent's handler);
//! (f) file API: `FileWrite`/`FileRead` in 128 KiB chunks through the engine (what
//!     `vm_write_file` appends and the CLI's file commands use), a 1-byte read's latency;
//! (c) `vm cp` up and down (tar over a stream) of a tree holding one --mib MiB file against a
//!     stream moving the same bytes and against the file API, with the guest-local `tar`
//!     rates as the ceiling, and the latency of copying one small file up against an idle
//!     exec round trip (an upload starts one `tar`);
//! (x) exec round trip of `true`, idle and while a guest->host stream moves data as fast as
//!     it can, and what that stream moved meanwhile (job starts hold streams back, see
//!     `warren-guest`'s `bulk` module).
//!
//! Throughputs are medians of --boots repetitions of --mib MiB, latencies medians of
//! --iterations round trips; data is incompressible (1/256 of its bytes need escaping on the
//! channel), the same for every path.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use warren_core::{CreateVm, Warren};
use warren_protocol::stream::StreamTarget;
use warren_protocol::{HostRequest, Precondition};
use warren_supervisor::stream_frame::GuestStream;

use crate::bench::{discard_private_warren, exec_true, median, private_warren, run_argv, wait_job};
use crate::cli::{BenchArgs, Cli};

/// The guest's TCP port for the stream measurements, and a second pump for the guest's own
/// loopback TCP rate.
const PUMP_PORT: u16 = 7700;
const LOCAL_PORT: u16 = 7701;
const MIB: f64 = 1024.0 * 1024.0;
/// Largest piece the host writes at once.
const PIECE: usize = 1 << 20;

/// The guest's byte pump (perl is in every Debian image): `port DEV` serves the raw port,
/// `tcp PORT` a loopback listener, one connection after another. Commands are one letter
/// and a big-endian u64: `s N` reads N bytes then answers `k`; `g N` sends N bytes;
/// `e N` echoes N single bytes. On the port it first says `R` (ready). `local PORT N` is a
/// guest client of a `tcp` pump moving N bytes each way and printing the seconds each took
/// (`/proc/uptime`, 10 ms resolution): the guest's own loopback TCP, a stream's ceiling.
const PUMP: &str = r#"
use strict; use warnings; use Socket qw(IPPROTO_TCP TCP_NODELAY);
my ($mode, $arg) = @ARGV;
open(my $r, '<', '/dev/urandom') or die "urandom: $!";
my $blk = ''; sysread($r, $blk, 1048576 - length($blk), length($blk)) while length($blk) < 1048576;
close $r;
sub wr { my ($fh, $d) = @_; my $off = 0;
  while ($off < length $d) { my $w = syswrite($fh, $d, length($d) - $off, $off); die "write: $!" unless defined $w; $off += $w } }
sub rd { my ($fh, $n) = @_; my $b = '';
  while (length($b) < $n) { my $got = sysread($fh, $b, $n - length($b), length($b)); return undef unless $got } $b }
sub serve { my ($fh) = @_;
  while (defined(my $h = rd($fh, 9))) {
    my ($c, $n) = unpack('a1 Q>', $h);
    if ($c eq 's') { my $b; while ($n > 0) { my $got = sysread($fh, $b, $n < 1048576 ? $n : 1048576); return unless $got; $n -= $got } wr($fh, 'k') }
    elsif ($c eq 'g') { while ($n > 0) { my $k = $n < 1048576 ? $n : 1048576; wr($fh, substr($blk, 0, $k)); $n -= $k } }
    elsif ($c eq 'e') { for (1 .. $n) { my $b = rd($fh, 1); return unless defined $b; wr($fh, $b) } }
    else { return } } }
sub now { open(my $f, '<', '/proc/uptime') or die; my $l = <$f>; (split ' ', $l)[0] }
if ($mode eq 'local') {
  require IO::Socket::INET;
  my $c = IO::Socket::INET->new(PeerAddr => '127.0.0.1', PeerPort => $arg) or die "connect: $!";
  setsockopt($c, IPPROTO_TCP, TCP_NODELAY, 1); my $n = $ARGV[2]; my $t = now();
  wr($c, 's' . pack('Q>', $n)); my $left = $n;
  while ($left > 0) { my $k = $left < 1048576 ? $left : 1048576; wr($c, substr($blk, 0, $k)); $left -= $k }
  rd($c, 1) eq 'k' or die "no ack"; my $s = now() - $t; $t = now();
  wr($c, 'g' . pack('Q>', $n)); $left = $n; my $b;
  while ($left > 0) { my $got = sysread($c, $b, $left < 1048576 ? $left : 1048576); die "eof" unless $got; $left -= $got }
  printf "%.3f %.3f\n", $s, now() - $t; exit 0 }
if ($mode eq 'port') {
  open(my $fh, '+<', $arg) or die "$arg: $!"; binmode $fh; wr($fh, 'R');
  while (1) { serve($fh); select(undef, undef, undef, 0.01) } }
require IO::Socket::INET;
my $l = IO::Socket::INET->new(LocalAddr => '127.0.0.1', LocalPort => $arg, Listen => 4, ReuseAddr => 1) or die "listen: $!";
while (my $c = $l->accept) { setsockopt($c, IPPROTO_TCP, TCP_NODELAY, 1); serve($c); close $c }
"#;

#[derive(serde::Serialize, Default)]
struct Report {
    accel: String,
    repetitions: usize,
    mib: usize,
    raw_h2g_mib_s: f64,
    raw_g2h_mib_s: f64,
    raw_rtt_us_p50: f64,
    stream_h2g_mib_s: f64,
    stream_g2h_mib_s: f64,
    stream_rtt_us_p50: f64,
    stream_h2g_vs_raw: f64,
    stream_g2h_vs_raw: f64,
    guest_tcp_h2g_mib_s: f64,
    guest_tcp_g2h_mib_s: f64,
    ping_us_p50: f64,
    ping_vs_raw_rtt: f64,
    ping_in_supervisor_us_p50: f64,
    request_ping_us_p50: f64,
    request_ping_vs_raw_rtt: f64,
    file_write_mib_s: f64,
    file_read_mib_s: f64,
    file_read_1b_us_p50: f64,
    file_write_vs_raw: f64,
    file_read_vs_raw: f64,
    cp_up_mib_s: f64,
    cp_down_mib_s: f64,
    cp_up_vs_stream: f64,
    cp_down_vs_stream: f64,
    cp_up_vs_file_api: f64,
    cp_down_vs_file_api: f64,
    guest_tar_create_mib_s: f64,
    guest_tar_extract_mib_s: f64,
    cp_small_up_us_p50: f64,
    cp_small_up_vs_exec: f64,
    exec_idle_us_p50: f64,
    exec_under_stream_us_p50: f64,
    exec_under_stream_vs_idle: f64,
    stream_beside_execs_mib_s: f64,
    stream_beside_execs_vs_alone: f64,
}

pub async fn run(cli: &Cli, args: &BenchArgs) -> Result<i32> {
    if args.boots == 0 || args.iterations == 0 || args.mib == 0 {
        bail!("--boots, --iterations and --mib must be positive");
    }
    let (w, state) = private_warren(cli, args, "streams")?;
    let r = measure(args, &w, &state).await;
    discard_private_warren(&w, &state).await;
    let r = r?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print_report(&r);
    }
    Ok(0)
}

fn print_report(r: &Report) {
    println!(
        "accelerator: {}  (throughput: medians of {} x {} MiB; latency: medians)",
        r.accel, r.repetitions, r.mib
    );
    println!(
        "raw port        host->guest {:7.1} MiB/s   guest->host {:7.1} MiB/s   round trip {:6.0} us",
        r.raw_h2g_mib_s, r.raw_g2h_mib_s, r.raw_rtt_us_p50
    );
    println!(
        "stream          host->guest {:7.1} MiB/s   guest->host {:7.1} MiB/s   round trip {:6.0} us   vs raw {:.2} / {:.2} (target >= 0.5)",
        r.stream_h2g_mib_s, r.stream_g2h_mib_s, r.stream_rtt_us_p50, r.stream_h2g_vs_raw, r.stream_g2h_vs_raw
    );
    println!(
        "guest-local TCP (pump to pump, a stream's ceiling: every stream ends in it)   {:7.1} / {:7.1} MiB/s",
        r.guest_tcp_h2g_mib_s, r.guest_tcp_g2h_mib_s
    );
    println!(
        "channel ping    {:6.0} us   {:.2}x the raw round trip (target <= 3)   HTTP/2 PING, of which the supervisor's timing {:.0} us",
        r.ping_us_p50, r.ping_vs_raw_rtt, r.ping_in_supervisor_us_p50
    );
    println!(
        "agent request   {:6.0} us   {:.2}x the raw round trip (`Ping`: one request through the agent's handlers)",
        r.request_ping_us_p50, r.request_ping_vs_raw_rtt
    );
    println!(
        "file API        write {:7.1} MiB/s   read {:7.1} MiB/s   1-byte read {:6.0} us   vs raw {:.2} / {:.2}",
        r.file_write_mib_s, r.file_read_mib_s, r.file_read_1b_us_p50, r.file_write_vs_raw, r.file_read_vs_raw
    );
    println!(
        "vm cp           up {:7.1} MiB/s   down {:7.1} MiB/s   vs stream {:.2} / {:.2} (target >= 0.7)   vs file API {:.2} / {:.2}",
        r.cp_up_mib_s, r.cp_down_mib_s, r.cp_up_vs_stream, r.cp_down_vs_stream, r.cp_up_vs_file_api, r.cp_down_vs_file_api
    );
    println!(
        "guest-local tar create {:7.1} MiB/s   extract {:7.1} MiB/s (ceiling of cp)",
        r.guest_tar_create_mib_s, r.guest_tar_extract_mib_s
    );
    println!(
        "vm cp of one small file up {:6.0} us   {:.2}x an idle exec of `true` (it starts one `tar`)",
        r.cp_small_up_us_p50, r.cp_small_up_vs_exec
    );
    println!(
        "exec `true`     idle {:6.0} us   during a full-rate stream {:6.0} us   ratio {:.2} (target <= 2)",
        r.exec_idle_us_p50, r.exec_under_stream_us_p50, r.exec_under_stream_vs_idle
    );
    println!(
        "stream beside back-to-back execs {:7.1} MiB/s   {:.2} of its rate alone (job starts hold streams back, at most half the time)",
        r.stream_beside_execs_mib_s, r.stream_beside_execs_vs_alone
    );
}

/// Incompressible bytes (a multiplicative hash), the same on every run.
fn noise(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_add(seed).wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

fn header(cmd: u8, n: u64) -> [u8; 9] {
    let mut h = [cmd, 0, 0, 0, 0, 0, 0, 0, 0];
    h[1..].copy_from_slice(&n.to_be_bytes());
    h
}

/// One end of the pump: the raw port's socket or a guest stream.
enum Link {
    Raw(UnixStream, Vec<u8>),
    Stream(GuestStream, Vec<u8>),
}

impl Link {
    async fn send(&mut self, data: &[u8]) -> Result<()> {
        match self {
            Link::Raw(s, _) => s.write_all(data).await?,
            Link::Stream(s, _) => s.writer.send(data).await?,
        }
        Ok(())
    }

    /// Receives exactly `n` bytes (dropped); the last byte.
    async fn recv(&mut self, mut n: usize) -> Result<u8> {
        let mut last = 0;
        while n > 0 {
            let got = match self {
                Link::Raw(s, buf) => {
                    if buf.is_empty() {
                        buf.resize(PIECE, 0);
                    }
                    let want = n.min(buf.len());
                    let k = s.read(&mut buf[..want]).await?;
                    if k == 0 {
                        bail!("the raw port closed");
                    }
                    last = buf[k - 1];
                    k
                }
                Link::Stream(s, pending) => {
                    if pending.is_empty() {
                        match s.reader.next().await? {
                            Ok(d) => *pending = d,
                            Err(end) => bail!("the stream ended: {end:?}"),
                        }
                    }
                    let k = n.min(pending.len());
                    last = pending[k - 1];
                    pending.drain(..k);
                    k
                }
            };
            n -= got;
        }
        Ok(last)
    }

    /// Host -> guest: seconds to move `data` and get the guest's acknowledgement.
    async fn sink(&mut self, data: &[u8]) -> Result<f64> {
        let t = Instant::now();
        self.send(&header(b's', data.len() as u64)).await?;
        for piece in data.chunks(PIECE) {
            self.send(piece).await?;
        }
        if self.recv(1).await? != b'k' {
            bail!("the pump did not acknowledge");
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// Guest -> host: seconds to receive `n` bytes.
    async fn source(&mut self, n: usize) -> Result<f64> {
        let t = Instant::now();
        self.send(&header(b'g', n as u64)).await?;
        self.recv(n).await?;
        Ok(t.elapsed().as_secs_f64())
    }

    /// `count` 1-byte round trips, in microseconds.
    async fn echo(&mut self, count: usize) -> Result<Vec<f64>> {
        self.send(&header(b'e', count as u64)).await?;
        let mut v = Vec::with_capacity(count);
        for i in 0..count {
            let t = Instant::now();
            self.send(&[i as u8]).await?;
            if self.recv(1).await? != i as u8 {
                bail!("the pump echoed the wrong byte");
            }
            v.push(t.elapsed().as_secs_f64() * 1e6);
        }
        Ok(v)
    }
}

/// Throughput samples of one path.
#[derive(Default)]
struct Rates {
    h2g: Vec<f64>,
    g2h: Vec<f64>,
}

impl Rates {
    async fn add(&mut self, link: &mut Link, data: &[u8]) -> Result<()> {
        let mib = data.len() as f64 / MIB;
        self.h2g.push(mib / link.sink(data).await?);
        self.g2h.push(mib / link.source(data.len()).await?);
        Ok(())
    }
}

async fn measure(args: &BenchArgs, w: &Warren, state: &Path) -> Result<Report> {
    let reps = args.boots;
    let bytes = args.mib << 20;
    let data = noise(bytes, 1);
    let rec = w
        .create_vm(
            &CreateVm {
                image: Some(args.image.clone()),
                raw_bench_port: true,
                vcpus: Some(args.vcpus),
                ..Default::default()
            },
            &mut |m| eprintln!("warning: {m}"),
        )
        .await?;
    let vm = rec.id.clone();
    eprintln!("VM {vm} up; starting the pumps");

    // The raw port: connect first (bytes sent to a port the guest has not opened are
    // dropped), then start the pump, which says `R` once it holds the port.
    let sock = w.vm_dir_path(&vm).join("run").join("bench-port.sock");
    let raw = UnixStream::connect(&sock)
        .await
        .with_context(|| format!("connecting to {}", sock.display()))?;
    let dev = run_argv(
        w,
        &vm,
        vec![
            "sh".into(),
            "-c".into(),
            "for p in /sys/class/virtio-ports/*; do [ \"$(cat $p/name)\" = org.warren.bench.0 ] && echo /dev/${p##*/}; done".into(),
        ],
    )
    .await?;
    let dev = dev.trim().to_string();
    if dev.is_empty() {
        bail!("the guest has no bench port");
    }
    let mut pump = exec_true();
    pump.argv = vec!["perl".into(), "-e".into(), PUMP.into(), "port".into(), dev];
    let raw_job = w.exec_start(&vm, pump.clone()).await?;
    let mut raw = Link::Raw(raw, Vec::new());
    let ready = tokio::time::timeout(Duration::from_secs(60), raw.recv(1))
        .await
        .map_err(|_| anyhow!("the raw-port pump never answered"))??;
    if ready != b'R' {
        bail!("the raw-port pump said {ready:?}");
    }
    pump.argv[3] = "tcp".into();
    pump.argv[4] = PUMP_PORT.to_string();
    let tcp_job = w.exec_start(&vm, pump.clone()).await?;
    pump.argv[4] = LOCAL_PORT.to_string();
    let local_job = w.exec_start(&vm, pump.clone()).await?;
    let mut stream = open_pump(w, &vm).await?;

    let mut raw_rates = Rates::default();
    let mut stream_rates = Rates::default();
    let mut file_w = Vec::new();
    let mut file_r = Vec::new();
    let mut cp_up = Vec::new();
    let mut cp_down = Vec::new();
    let mut tar_c = Vec::new();
    let mut tar_x = Vec::new();
    let mut local = Rates::default();
    // vm cp's own path: an opener on the same engine.
    let opener = crate::stream_link::Opener::Local(Box::new(w.share()));
    let idle = std::time::Duration::from_secs(crate::cp_cmd::DEFAULT_IDLE_SECS);
    // The bench's own temporary directories: no VM shares them.
    let shares = crate::host_side::Shares::default();
    let tree = state.join("cp-src").join("tree");
    std::fs::create_dir_all(&tree)?;
    std::fs::write(tree.join("big"), &data)?;
    for name in ["a", "b", "c"] {
        std::fs::write(tree.join(name), name)?;
    }
    for i in 0..reps {
        eprintln!("repetition {}/{reps}", i + 1);
        raw_rates.add(&mut raw, &data).await?;
        stream_rates.add(&mut stream, &data).await?;
        let (wr, rd) = file_api(w, &vm, &data).await?;
        file_w.push(wr);
        file_r.push(rd);
        let mib = args.mib as f64;
        let t = Instant::now();
        let code =
            crate::cp_cmd::upload(&opener, &tree, &vm, &format!("/tmp/cp{i}"), idle, &shares)
                .await?;
        if code != 0 {
            bail!("vm cp up failed ({code})");
        }
        cp_up.push(mib / t.elapsed().as_secs_f64());
        let back = state.join(format!("cp-back-{i}"));
        let t = Instant::now();
        let code = crate::cp_cmd::download(
            &opener,
            &vm,
            &format!("/tmp/cp{i}/tree"),
            &back,
            None,
            idle,
            &shares,
        )
        .await?;
        if code != 0 {
            bail!("vm cp down failed ({code})");
        }
        cp_down.push(mib / t.elapsed().as_secs_f64());
        if std::fs::read(back.join("tree/big"))? != data {
            bail!("vm cp down returned other bytes");
        }
        let _ = std::fs::remove_dir_all(&back);
        let (c, x) = guest_tar(w, &vm, i, mib).await?;
        tar_c.push(c);
        tar_x.push(x);
        let (h2g, g2h) = guest_tcp(w, &vm, &pump.argv[2], bytes).await?;
        local.h2g.push(mib / h2g);
        local.g2h.push(mib / g2h);
    }

    let raw_rtt = median(&mut raw.echo(args.iterations).await?);
    let stream_rtt = median(&mut stream.echo(args.iterations).await?);
    let client = w.client(&vm)?;
    let mut ping = Vec::with_capacity(args.iterations);
    let mut ping_inside = Vec::with_capacity(args.iterations);
    for _ in 0..args.iterations {
        let t = Instant::now();
        let inside = client.channel_ping().await?;
        ping.push(t.elapsed().as_secs_f64() * 1e6);
        ping_inside.push(inside.as_secs_f64() * 1e6);
    }
    let mut request_ping = Vec::with_capacity(args.iterations);
    for _ in 0..args.iterations {
        let t = Instant::now();
        client.guest(HostRequest::Ping).await?;
        request_ping.push(t.elapsed().as_secs_f64() * 1e6);
    }
    w.write_file(&vm, "one.bin", &mut &b"x"[..], Precondition::None)
        .await?;
    let mut small = Vec::with_capacity(args.iterations);
    for _ in 0..args.iterations {
        let t = Instant::now();
        w.read_file_chunk(&vm, "one.bin", 0, 1).await?;
        small.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let tiny = state.join("cp-tiny");
    std::fs::create_dir_all(&tiny)?;
    std::fs::write(tiny.join("one"), "1")?;
    let mut cp_small = Vec::with_capacity(args.iterations);
    for i in 0..args.iterations.min(20) {
        let t = Instant::now();
        let code =
            crate::cp_cmd::upload(&opener, &tiny, &vm, &format!("/tmp/tiny{i}"), idle, &shares)
                .await?;
        if code != 0 {
            bail!("vm cp up of a small file failed ({code})");
        }
        cp_small.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let under = exec_under_load(w, &vm, stream, args).await?;
    let (idle, loaded) = (under.idle_us, under.loaded_us);
    for job in [raw_job, tcp_job, local_job] {
        let _ = w.job_cancel(&vm, job).await;
    }
    w.destroy_vm(&vm).await?;

    let mut r = Report {
        accel: rec.accel,
        repetitions: reps,
        mib: args.mib,
        raw_h2g_mib_s: median(&mut raw_rates.h2g),
        raw_g2h_mib_s: median(&mut raw_rates.g2h),
        raw_rtt_us_p50: raw_rtt,
        stream_h2g_mib_s: median(&mut stream_rates.h2g),
        stream_g2h_mib_s: median(&mut stream_rates.g2h),
        stream_rtt_us_p50: stream_rtt,
        guest_tcp_h2g_mib_s: median(&mut local.h2g),
        guest_tcp_g2h_mib_s: median(&mut local.g2h),
        ping_us_p50: median(&mut ping),
        ping_in_supervisor_us_p50: median(&mut ping_inside),
        request_ping_us_p50: median(&mut request_ping),
        file_write_mib_s: median(&mut file_w),
        file_read_mib_s: median(&mut file_r),
        file_read_1b_us_p50: median(&mut small),
        cp_up_mib_s: median(&mut cp_up),
        cp_down_mib_s: median(&mut cp_down),
        guest_tar_create_mib_s: median(&mut tar_c),
        guest_tar_extract_mib_s: median(&mut tar_x),
        cp_small_up_us_p50: median(&mut cp_small),
        exec_idle_us_p50: idle,
        exec_under_stream_us_p50: loaded,
        stream_beside_execs_mib_s: under.stream_mib_s,
        ..Default::default()
    };
    r.stream_h2g_vs_raw = r.stream_h2g_mib_s / r.raw_h2g_mib_s;
    r.stream_g2h_vs_raw = r.stream_g2h_mib_s / r.raw_g2h_mib_s;
    r.ping_vs_raw_rtt = r.ping_us_p50 / r.raw_rtt_us_p50;
    r.request_ping_vs_raw_rtt = r.request_ping_us_p50 / r.raw_rtt_us_p50;
    r.file_write_vs_raw = r.file_write_mib_s / r.raw_h2g_mib_s;
    r.file_read_vs_raw = r.file_read_mib_s / r.raw_g2h_mib_s;
    r.cp_up_vs_stream = r.cp_up_mib_s / r.stream_h2g_mib_s;
    r.cp_down_vs_stream = r.cp_down_mib_s / r.stream_g2h_mib_s;
    r.cp_up_vs_file_api = r.cp_up_mib_s / r.file_write_mib_s;
    r.cp_down_vs_file_api = r.cp_down_mib_s / r.file_read_mib_s;
    r.exec_under_stream_vs_idle = loaded / idle;
    r.stream_beside_execs_vs_alone = r.stream_beside_execs_mib_s / r.stream_g2h_mib_s;
    r.cp_small_up_vs_exec = r.cp_small_up_us_p50 / idle;
    Ok(r)
}

/// A stream to the guest's TCP pump, once it listens.
async fn open_pump(w: &Warren, vm: &str) -> Result<Link> {
    let t = Instant::now();
    loop {
        match w
            .open_stream(vm, StreamTarget::Tcp { port: PUMP_PORT })
            .await
        {
            Ok(s) => return Ok(Link::Stream(s, Vec::new())),
            Err(e) if t.elapsed() < Duration::from_secs(60) => {
                tracing::debug!(error = %e, "pump not listening yet");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e).context("the guest's TCP pump never listened"),
        }
    }
}

/// Seconds-based rates of writing `data` to a guest file and reading it back through the
/// engine's file API (chunked `FileWrite`/`FileRead`).
async fn file_api(w: &Warren, vm: &str, data: &[u8]) -> Result<(f64, f64)> {
    let mib = data.len() as f64 / MIB;
    let t = Instant::now();
    w.write_file(vm, "bench.bin", &mut &data[..], Precondition::None)
        .await?;
    let write = mib / t.elapsed().as_secs_f64();
    let mut got = 0usize;
    let t = Instant::now();
    w.read_file(vm, "bench.bin", &mut |d| {
        got += d.len();
        Ok(())
    })
    .await?;
    let read = mib / t.elapsed().as_secs_f64();
    if got != data.len() {
        bail!("the file API read {got} of {} bytes", data.len());
    }
    Ok((write, read))
}

/// The guest's own `tar` rates for the copied tree: create (to a pipe) and extract (from
/// a file), timed in the guest.
async fn guest_tar(w: &Warren, vm: &str, i: usize, mib: f64) -> Result<(f64, f64)> {
    let script = format!(
        "set -e; cd /tmp; a=$(date +%s%N); tar -cf - -C /tmp/cp{i} tree | cat >/dev/null; \
         b=$(date +%s%N); tar -cf /tmp/t{i}.tar -C /tmp/cp{i} tree; mkdir /tmp/x{i}; \
         c=$(date +%s%N); tar -xf /tmp/t{i}.tar -C /tmp/x{i}; d=$(date +%s%N); \
         rm -rf /tmp/t{i}.tar /tmp/x{i} /tmp/cp{i}; echo $((b-a)) $((d-c))"
    );
    let out = run_argv(w, vm, vec!["sh".into(), "-c".into(), script]).await?;
    let ns: Vec<f64> = out
        .split_whitespace()
        .filter_map(|x| x.parse::<f64>().ok())
        .collect();
    let [c, x] = ns[..] else {
        bail!("no tar timings in {out:?}");
    };
    Ok((mib / (c / 1e9), mib / (x / 1e9)))
}

/// Seconds the guest's own loopback TCP takes to move `bytes` into and out of a pump
/// (`local` mode of the pump against the `tcp` pump on [`LOCAL_PORT`], once it listens).
async fn guest_tcp(w: &Warren, vm: &str, pump: &str, bytes: usize) -> Result<(f64, f64)> {
    let t = Instant::now();
    let out = loop {
        let argv = vec![
            "perl".into(),
            "-e".into(),
            pump.into(),
            "local".into(),
            LOCAL_PORT.to_string(),
            bytes.to_string(),
        ];
        match run_argv(w, vm, argv).await {
            Ok(out) => break out,
            Err(e) if t.elapsed() < Duration::from_secs(60) => {
                tracing::debug!(error = %e, "local pump not listening yet");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e).context("the guest's loopback pump"),
        }
    };
    let s: Vec<f64> = out
        .split_whitespace()
        .filter_map(|x| x.parse::<f64>().ok())
        .collect();
    match s[..] {
        [h2g, g2h] if h2g > 0.0 && g2h > 0.0 => Ok((h2g, g2h)),
        _ => bail!("no loopback timings in {out:?}"),
    }
}

/// Exec round trips of `true`: idle, then while the stream sends guest->host at full rate.
async fn exec_under_load(
    w: &Warren,
    vm: &str,
    mut stream: Link,
    args: &BenchArgs,
) -> Result<ExecUnderLoad> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let count = args.iterations.clamp(5, 50);
    let mut idle = Vec::with_capacity(count);
    for _ in 0..count {
        idle.push(exec_rtt(w, vm).await?);
    }
    let (stop_tx, mut stop) = tokio::sync::oneshot::channel::<()>();
    let chunk = 1 << 20;
    let moved = std::sync::Arc::new(AtomicUsize::new(0));
    let mover = tokio::spawn({
        let moved = moved.clone();
        async move {
            loop {
                stream.source(chunk).await?;
                moved.fetch_add(chunk, Ordering::Relaxed);
                if stop.try_recv().is_ok() {
                    return Ok::<(), anyhow::Error>(());
                }
            }
        }
    });
    // Let the stream reach its full rate first.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut loaded = Vec::with_capacity(count);
    let (t, before) = (Instant::now(), moved.load(Ordering::Relaxed));
    for _ in 0..count {
        loaded.push(exec_rtt(w, vm).await?);
    }
    let during = (moved.load(Ordering::Relaxed) - before) as f64 / MIB / t.elapsed().as_secs_f64();
    let _ = stop_tx.send(());
    mover.await??;
    Ok(ExecUnderLoad {
        idle_us: median(&mut idle),
        loaded_us: median(&mut loaded),
        stream_mib_s: during,
    })
}

/// Exec round trips idle and beside a stream, and what the stream moved meanwhile.
struct ExecUnderLoad {
    idle_us: f64,
    loaded_us: f64,
    stream_mib_s: f64,
}

async fn exec_rtt(w: &Warren, vm: &str) -> Result<f64> {
    let t = Instant::now();
    let job = w.exec_start(vm, exec_true()).await?;
    wait_job(w, vm, job).await?;
    Ok(t.elapsed().as_secs_f64() * 1e6)
}
