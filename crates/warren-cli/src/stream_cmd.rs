//! `warren attach`, `warren port-forward` and `warren vm cp`: guest streams from the command
//! line (`crate::stream_link` opens them through the service or in process).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use warren_protocol::stream::StreamTarget;

use crate::cli::Cli;
use crate::progress::Progress;
use crate::stream_link::{Chunk, Opener, Rx, ServiceArgs};

/// Chunk size moved at once.
const CHUNK: usize = 256 * 1024;

/// `warren attach`: stdin to the guest port, the port to stdout. Exit 0 when the guest
/// closed normally, 1 otherwise.
pub async fn attach(
    cli: &Cli,
    service: &ServiceArgs,
    vm: &str,
    port: u16,
    ignore_stdin_eof: bool,
) -> Result<i32> {
    let opener = Opener::new(cli, service).await?;
    let (mut tx, mut rx) = opener.open(vm, &StreamTarget::Tcp { port }).await?;
    // A thread of its own: a blocking stdin read must not hold the process at exit.
    let (in_tx, mut in_rx) = tokio::sync::mpsc::channel::<Option<Vec<u8>>>(4);
    std::thread::Builder::new()
        .name("stdin".into())
        .spawn(move || {
            let mut stdin = std::io::stdin().lock();
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) | Err(_) => {
                        let _ = in_tx.blocking_send(None);
                        return;
                    }
                    Ok(n) => {
                        if in_tx.blocking_send(Some(buf[..n].to_vec())).is_err() {
                            return;
                        }
                    }
                }
            }
        })?;
    let up = async {
        while let Some(Some(data)) = in_rx.recv().await {
            tx.send(&data).await?;
        }
        if !ignore_stdin_eof {
            tx.eof().await?;
        }
        std::future::pending::<()>().await;
        Ok::<(), anyhow::Error>(())
    };
    let down = async {
        let mut out = tokio::io::stdout();
        loop {
            match rx.next().await? {
                Chunk::Data(d) => {
                    out.write_all(&d).await?;
                    out.flush().await?;
                }
                Chunk::End { ok, reason } => return Ok::<_, anyhow::Error>((ok, reason)),
            }
        }
    };
    let (ok, reason) = tokio::select! {
        r = down => r?,
        r = up => { r?; unreachable!("the input side never ends on its own") }
    };
    if ok {
        Ok(0)
    } else {
        eprintln!(
            "{}",
            crate::term::Term::new(cli.raw).failure("stream closed", &reason)
        );
        Ok(1)
    }
}

/// Parses `[LOCAL:]GUEST`.
pub fn parse_forward(spec: &str) -> Result<(u16, u16)> {
    let bad = || anyhow!("{spec:?}: give [LOCAL:]GUEST ports");
    match spec.split_once(':') {
        Some((l, g)) => Ok((l.parse().map_err(|_| bad())?, g.parse().map_err(|_| bad())?)),
        None => {
            let g: u16 = spec.parse().map_err(|_| bad())?;
            Ok((g, g))
        }
    }
}

/// `warren port-forward`: each connection to host loopback's LOCAL goes to the guest's
/// GUEST port, until interrupted. Prints the listening address first.
pub async fn port_forward(cli: &Cli, service: &ServiceArgs, vm: &str, spec: &str) -> Result<i32> {
    let (local, guest) = parse_forward(spec)?;
    let opener = std::sync::Arc::new(Opener::new(cli, service).await?);
    let listener = tokio::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, local))
        .await
        .with_context(|| format!("listening on 127.0.0.1:{local}"))?;
    let addr = listener.local_addr()?;
    println!("{addr}");
    let _ = std::io::stdout().flush();
    eprintln!("warren: forwarding {addr} to port {guest} of VM {vm}; Ctrl-C stops");
    let term = crate::term::Term::new(cli.raw);
    loop {
        let (conn, peer) = tokio::select! {
            r = listener.accept() => r?,
            _ = tokio::signal::ctrl_c() => return Ok(0),
        };
        let opener = opener.clone();
        let vm = vm.to_string();
        tokio::spawn(async move {
            if let Err(e) = forward_one(&opener, &vm, guest, conn).await {
                eprintln!("{}", term.failure(&format!("connection from {peer}"), &e));
            }
        });
    }
}

async fn forward_one(
    opener: &Opener,
    vm: &str,
    port: u16,
    conn: tokio::net::TcpStream,
) -> Result<()> {
    let _ = conn.set_nodelay(true);
    let (mut tx, mut rx) = opener.open(vm, &StreamTarget::Tcp { port }).await?;
    let (mut rd, mut wr) = conn.into_split();
    let up = async {
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = rd.read(&mut buf).await?;
            if n == 0 {
                tx.eof().await?;
                std::future::pending::<()>().await;
            }
            tx.send(&buf[..n]).await?;
        }
        #[allow(unreachable_code)]
        Ok::<(), anyhow::Error>(())
    };
    let down = async {
        loop {
            match rx.next().await? {
                Chunk::Data(d) => wr.write_all(&d).await?,
                Chunk::End { ok, reason } => {
                    let _ = wr.shutdown().await;
                    if !ok {
                        bail!("stream closed: {reason}");
                    }
                    return Ok::<(), anyhow::Error>(());
                }
            }
        }
    };
    tokio::select! {
        r = down => r,
        r = up => r,
    }
}

/// A `vm cp` operand: a host path, or `VM:/absolute/guest/path`.
#[derive(Debug, PartialEq, Eq)]
pub enum Place {
    Host(PathBuf),
    Guest { vm: String, path: String },
}

pub fn parse_place(s: &str) -> Place {
    if let Some((vm, path)) = s.split_once(':') {
        let vm_like = !vm.is_empty()
            && vm
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if vm_like && path.starts_with('/') {
            return Place::Guest {
                vm: vm.to_string(),
                path: path.to_string(),
            };
        }
    }
    Place::Host(PathBuf::from(s))
}

/// Shows bytes moved on a terminal (stderr), at most a few times a second.
/// `warren vm cp SRC DST`: a host file or tree into a guest directory, or a guest file or
/// tree into a host directory (both created when missing). The copy lands under its own
/// name; an existing one is never replaced.
pub async fn cp(
    cli: &Cli,
    service: &ServiceArgs,
    src: &str,
    dst: &str,
    max_mib: Option<u64>,
) -> Result<i32> {
    match (parse_place(src), parse_place(dst)) {
        (Place::Host(from), Place::Guest { vm, path }) => {
            let opener = Opener::new(cli, service).await?;
            upload(&opener, &from, &vm, &path).await
        }
        (Place::Guest { vm, path }, Place::Host(to)) => {
            let opener = Opener::new(cli, service).await?;
            download(&opener, &vm, &path, &to, max_mib).await
        }
        _ => bail!("one side of vm cp is VM:/absolute/path, the other a host path"),
    }
}

/// Free space kept on the destination of a copy out of a VM without `--max-mib`: 5% of its
/// file system, at least this much.
const MIN_KEPT_FREE: u64 = 1 << 30;

/// How much file content a copy out of a VM into `to` may hold: `max_mib` when given,
/// else what `to`'s file system has free less 5% of its size (at least [`MIN_KEPT_FREE`]);
/// and the words that say so.
fn download_limit(to: &Path, max_mib: Option<u64>) -> Result<(u64, String)> {
    if let Some(mib) = max_mib {
        return Ok((mib.saturating_mul(1 << 20), format!("--max-mib {mib}")));
    }
    let fs = nix::sys::statvfs::statvfs(to)
        .with_context(|| format!("free space of {}", to.display()))?;
    let unit = fs.fragment_size();
    let size = fs.blocks().saturating_mul(unit);
    let free = fs.blocks_available().saturating_mul(unit);
    let keep = (size / 20).max(MIN_KEPT_FREE);
    Ok((
        free.saturating_sub(keep),
        format!(
            "the free space of {} less {} MiB; --max-mib sets it",
            to.display(),
            keep >> 20
        ),
    ))
}

pub(crate) async fn upload(opener: &Opener, from: &Path, vm: &str, dir: &str) -> Result<i32> {
    if from.file_name().is_none() {
        bail!("{}: name a file or directory", from.display());
    }
    std::fs::symlink_metadata(from).with_context(|| from.display().to_string())?;
    let total = crate::copy::content_size(from);
    let (mut tx, mut rx) = opener
        .open(vm, &StreamTarget::TarExtract { dir: dir.into() })
        .await?;
    let (chunks_tx, mut chunks) = tokio::sync::mpsc::channel::<Vec<u8>>(8);
    let src = from.to_path_buf();
    let packer = tokio::task::spawn_blocking(move || {
        let w = ChannelWriter {
            tx: chunks_tx,
            buf: Vec::with_capacity(CHUNK),
        };
        crate::copy::pack(&src, w)
    });
    let progress = Progress::bytes(format!("{} -> {vm}:{dir}", from.display()), Some(total));
    let send = async {
        while let Some(c) = chunks.recv().await {
            progress.inc(c.len() as u64);
            tx.send(&c).await?;
        }
        // The packer is done (it dropped its writer). An archive it could not finish is
        // never ended: the stream is dropped instead, and the guest places nothing (tar
        // would stop at the end marker a failed packer still writes, and succeed).
        packer.await.map_err(|e| anyhow!("packing: {e}"))??;
        tx.eof().await?;
        Ok::<(), anyhow::Error>(())
    };
    tokio::select! {
        r = send => r?,
        end = wait_end(&mut rx) => {
            end?;
            bail!("the guest ended the copy before it was sent");
        }
    };
    wait_end(&mut rx).await?;
    progress.finish(None);
    Ok(0)
}

/// Waits for the guest's end of the stream: an error unless it ended normally. Data before
/// it is unexpected on an upload and dropped.
async fn wait_end(rx: &mut Rx) -> Result<()> {
    loop {
        match rx.next().await? {
            Chunk::Data(_) => {}
            Chunk::End { ok: true, .. } => return Ok(()),
            Chunk::End { ok: false, reason } => bail!("the guest side failed: {reason}"),
        }
    }
}

pub(crate) async fn download(
    opener: &Opener,
    vm: &str,
    path: &str,
    to: &Path,
    max_mib: Option<u64>,
) -> Result<i32> {
    let name = Path::new(path)
        .file_name()
        .ok_or_else(|| anyhow!("{path}: name a guest file or directory"))?
        .to_owned();
    std::fs::create_dir_all(to).with_context(|| to.display().to_string())?;
    let dest = to.join(&name);
    if std::fs::symlink_metadata(&dest).is_ok() {
        bail!("{} exists; remove it or copy elsewhere", dest.display());
    }
    // Installed before anything is written: a copy stopped by a signal (the guest may send
    // without end) removes what it made instead of leaving it in `to`.
    let stop = stopped()?;
    let (limit, how) = download_limit(to, max_mib)?;
    let staging = tempdir_in(to)?;
    let result = download_into(opener, vm, path, &name, &staging, limit, stop)
        .await
        .with_context(|| format!("copying {vm}:{path} (at most {limit} bytes of content: {how})"));
    let moved = result.and_then(|n| {
        nix::fcntl::renameat2(
            nix::fcntl::AT_FDCWD,
            &staging.join(&name),
            nix::fcntl::AT_FDCWD,
            &dest,
            nix::fcntl::RenameFlags::RENAME_NOREPLACE,
        )
        .with_context(|| format!("moving the copy to {}", dest.display()))?;
        Ok(n)
    });
    // Without recursion: the tree is the guest's shape (see `warren_session::remove_tree`).
    if let Err(e) = warren_session::remove_tree(&staging) {
        eprintln!(
            "warren: the staging directory {} could not be removed: {e}",
            staging.display()
        );
    }
    let done = moved?;
    if done.skipped > 0 {
        eprintln!(
            "warren: {} device, FIFO or unknown entries were left out",
            done.skipped
        );
    }
    Ok(0)
}

async fn download_into(
    opener: &Opener,
    vm: &str,
    path: &str,
    name: &std::ffi::OsStr,
    staging: &Path,
    max_bytes: u64,
    stop: impl std::future::Future<Output = Stopped>,
) -> Result<crate::copy::Unpacked> {
    let (mut tx, mut rx) = opener
        .open(vm, &StreamTarget::TarCreate { path: path.into() })
        .await?;
    tx.eof().await?;
    let (chunks_tx, chunks) = std::sync::mpsc::sync_channel::<Vec<u8>>(8);
    let root = staging.to_path_buf();
    let name = name.to_owned();
    let unpacker = tokio::task::spawn_blocking(move || {
        let mut r = ChannelReader {
            rx: chunks,
            cur: Vec::new(),
            pos: 0,
        };
        let unpacked = crate::copy::unpack(&mut r, &root, &name, max_bytes)?;
        // tar pads its output to whole records after the end-of-archive blocks, and that
        // padding may arrive after the unpacker saw the end: take it (bounded) so the
        // sender does not find the unpacker gone.
        let trailing = std::io::copy(&mut (&mut r).take(MAX_TRAILING + 1), &mut std::io::sink())?;
        if trailing > MAX_TRAILING {
            bail!("more than {MAX_TRAILING} bytes follow the end of the archive");
        }
        Ok(unpacked)
    });
    let progress = Progress::bytes(format!("{vm}:{path}"), None);
    let received = async {
        let mut unpacker_done = false;
        let mut dropped = 0u64;
        tokio::pin!(stop);
        loop {
            let next = tokio::select! {
                next = rx.next() => next?,
                why = &mut stop => return Err(why.into()),
            };
            match next {
                Chunk::Data(d) => {
                    progress.inc(d.len() as u64);
                    if unpacker_done {
                        // Bounded: a guest that goes on sending after the archive is refused.
                        dropped += d.len() as u64;
                        if dropped > MAX_TRAILING {
                            bail!("more than {MAX_TRAILING} bytes follow the end of the archive");
                        }
                        continue;
                    }
                    let tx = chunks_tx.clone();
                    // The unpacker may lag: hand over without blocking the runtime. It stops
                    // at the archive's end marker (or an error, reported below): what follows
                    // (tar pads its output to whole records) is read and dropped.
                    unpacker_done = tokio::task::spawn_blocking(move || tx.send(d))
                        .await
                        .map_err(|e| anyhow!("{e}"))?
                        .is_err();
                }
                Chunk::End { ok: true, .. } => return Ok::<(), anyhow::Error>(()),
                Chunk::End { ok: false, reason } => bail!("the guest side failed: {reason}"),
            }
        }
    };
    let received = received.await;
    drop(chunks_tx);
    // Waited for even when stopped, so nothing writes in the staging directory once it is
    // removed.
    let unpacked = unpacker.await.map_err(|e| anyhow!("unpacking: {e}"))?;
    match received {
        Err(e) if e.is::<Stopped>() => Err(e),
        received => {
            // The unpacker's own error says why it stopped taking data; report that one
            // first.
            let unpacked = unpacked?;
            received?;
            progress.finish(None);
            Ok(unpacked)
        }
    }
}

/// A copy stopped by a signal.
#[derive(Debug)]
pub(crate) struct Stopped(&'static str);

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: the copy was stopped and nothing of it was kept",
            self.0
        )
    }
}

impl std::error::Error for Stopped {}

/// Resolves at the first SIGINT, SIGTERM or SIGHUP (their handlers installed now).
fn stopped() -> Result<impl std::future::Future<Output = Stopped>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt()).context("installing a signal handler")?;
    let mut term = signal(SignalKind::terminate()).context("installing a signal handler")?;
    let mut hup = signal(SignalKind::hangup()).context("installing a signal handler")?;
    Ok(async move {
        tokio::select! {
            _ = int.recv() => Stopped("interrupted"),
            _ = term.recv() => Stopped("terminated"),
            _ = hup.recv() => Stopped("hung up"),
        }
    })
}

/// A private directory in `parent` for a copy being made.
fn tempdir_in(parent: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    for n in 0..100u32 {
        let p = parent.join(format!(".warren-cp-{}-{n}", std::process::id()));
        match std::fs::DirBuilder::new().mode(0o700).create(&p) {
            Ok(()) => return Ok(p),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e).with_context(|| p.display().to_string()),
        }
    }
    bail!("no staging directory could be made in {}", parent.display())
}

/// `Write` into a channel of chunks (the packer runs on a blocking thread).
struct ChannelWriter {
    tx: tokio::sync::mpsc::Sender<Vec<u8>>,
    buf: Vec<u8>,
}

impl Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            self.flush()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK));
        self.tx
            .blocking_send(chunk)
            .map_err(|_| std::io::Error::other("the stream closed"))
    }
}

impl Drop for ChannelWriter {
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

/// Bytes accepted after a downloaded archive's end (tar's record padding: the guest's helper
/// writes 64 KiB records, so at most 64 KiB).
const MAX_TRAILING: u64 = 1 << 20;

/// `Read` from a channel of chunks (the unpacker runs on a blocking thread).
struct ChannelReader {
    rx: std::sync::mpsc::Receiver<Vec<u8>>,
    cur: Vec<u8>,
    pos: usize,
}

impl Read for ChannelReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.pos == self.cur.len() {
            match self.rx.recv() {
                Ok(c) => {
                    self.cur = c;
                    self.pos = 0;
                }
                Err(_) => return Ok(0),
            }
        }
        let n = out.len().min(self.cur.len() - self.pos);
        out[..n].copy_from_slice(&self.cur[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_places_and_forward_specs() {
        assert_eq!(
            parse_place("abc-12:/tmp/x"),
            Place::Guest {
                vm: "abc-12".into(),
                path: "/tmp/x".into()
            }
        );
        assert_eq!(parse_place("./a:/b"), Place::Host("./a:/b".into()));
        assert_eq!(parse_place("vm:rel"), Place::Host("vm:rel".into()));
        assert_eq!(parse_forward("8080").expect("one"), (8080, 8080));
        assert_eq!(parse_forward("0:3000").expect("two"), (0, 3000));
        assert!(parse_forward("x:1").is_err());
    }
}
