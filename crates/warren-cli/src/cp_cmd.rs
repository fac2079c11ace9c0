//! `warren vm cp`: a host file or tree into a guest directory, or a guest file or tree into
//! a host directory, as a tar stream (packing and unpacking in [`crate::copy`]).
//!
//! Every step on the host side of a copy is made relative to a directory descriptor opened
//! once, never by path again: the destination or source may be a directory a guest can
//! write (a share), and a guest that renames a directory or plants a symlink while a copy
//! runs must not redirect the host's writes, renames or reads elsewhere.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use rustix::fs::{AtFlags, Mode, OFlags, RenameFlags};
use warren_protocol::stream::StreamTarget;

use crate::cli::Cli;
use crate::host_side::{open_dir, Shares};
use crate::progress::Progress;
use crate::stream_link::{Chunk, Opener, Rx, ServiceArgs};

/// Chunk size moved at once.
const CHUNK: usize = 256 * 1024;

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

/// `warren vm cp SRC DST`: a host file or tree into a guest directory, or a guest file or
/// tree into a host directory (both created when missing). The copy lands under its own
/// name; an existing one is never replaced.
pub async fn cp(
    cli: &Cli,
    service: &ServiceArgs,
    src: &str,
    dst: &str,
    max_mib: Option<u64>,
    idle_secs: u64,
) -> Result<i32> {
    if idle_secs == 0 {
        bail!("--idle-timeout must be at least 1 second");
    }
    let idle = Duration::from_secs(idle_secs);
    match (parse_place(src), parse_place(dst)) {
        (Place::Host(from), Place::Guest { vm, path }) => {
            let opener = Opener::new(cli, service).await?;
            let shares = Shares::of(cli, &opener).await?;
            upload(&opener, &from, &vm, &path, idle, &shares).await
        }
        (Place::Guest { vm, path }, Place::Host(to)) => {
            let opener = Opener::new(cli, service).await?;
            let shares = Shares::of(cli, &opener).await?;
            download(&opener, &vm, &path, &to, max_mib, idle, &shares).await
        }
        _ => bail!("one side of vm cp is VM:/absolute/path, the other a host path"),
    }
}

/// Free space kept on the destination of a copy out of a VM without `--max-mib`, or 5% of a
/// file system smaller than 20 GiB. The free space counted is what unprivileged users may
/// take (`f_bavail`): a file system's reserve for root is never counted, so this is a margin
/// on top of it. (A share of the whole size was too much: a 250 GiB disk whose root reserve
/// left 12 GiB free refused to copy a 10-byte file.)
const KEPT_FREE: u64 = 1 << 30;

/// Seconds a copy waits for the guest's next bytes (or for it to take ours) before it gives
/// up, unless `--idle-timeout` says otherwise.
pub const DEFAULT_IDLE_SECS: u64 = 120;

/// `fut`, or an error once `idle` passed without it finishing (the guest sent nothing, or
/// took nothing, for that long).
async fn within<T>(idle: Duration, fut: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    match tokio::time::timeout(idle, fut).await {
        Ok(r) => r,
        Err(_) => Err(Idle(idle.as_secs()).into()),
    }
}

/// A copy the guest stopped moving (see [`within`]).
#[derive(Debug)]
struct Idle(u64);

impl std::fmt::Display for Idle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the guest moved nothing for {} s (--idle-timeout)",
            self.0
        )
    }
}

impl std::error::Error for Idle {}

/// How much a copy out of a VM into the directory `to` (open as `to_fd`) may take on disk:
/// `max_mib` when given, else what its file system has free less [`KEPT_FREE`]; and the
/// words that say so.
fn download_limit(to_fd: &OwnedFd, to: &Path, max_mib: Option<u64>) -> Result<(u64, String)> {
    if let Some(mib) = max_mib {
        return Ok((mib.saturating_mul(1 << 20), format!("--max-mib {mib}")));
    }
    let fs =
        rustix::fs::fstatvfs(to_fd).with_context(|| format!("free space of {}", to.display()))?;
    let unit = fs.f_frsize;
    let size = fs.f_blocks.saturating_mul(unit);
    let free = fs.f_bavail.saturating_mul(unit);
    let keep = kept_free(size);
    Ok((
        free.saturating_sub(keep),
        format!(
            "the free space of {} less {} MiB; --max-mib sets it",
            to.display(),
            keep >> 20
        ),
    ))
}

/// What a copy out of a VM leaves free on a file system of `size` bytes ([`KEPT_FREE`]).
fn kept_free(size: u64) -> u64 {
    (size / 20).min(KEPT_FREE)
}

pub(crate) async fn upload(
    opener: &Opener,
    from: &Path,
    vm: &str,
    dir: &str,
    idle: Duration,
    shares: &Shares,
) -> Result<i32> {
    let Some(name) = from.file_name().map(|n| n.to_owned()) else {
        bail!("{}: name a file or directory", from.display());
    };
    // The source's directory by Warren's own walk (refused through a share), the source
    // itself by name in it: a share as the source is refused too.
    let parent = from
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let parent_fd = open_dir(parent, false, shares)?;
    let top = rustix::fs::statat(&parent_fd, &name, AtFlags::SYMLINK_NOFOLLOW)
        .with_context(|| from.display().to_string())?;
    if rustix::fs::FileType::from_raw_mode(top.st_mode) == rustix::fs::FileType::Directory {
        let fd = rustix::fs::openat(
            &parent_fd,
            &name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .with_context(|| from.display().to_string())?;
        shares.check(&fd, from)?;
    }
    let sized = from.to_path_buf();
    let total = tokio::task::spawn_blocking(move || crate::copy::content_size(&sized))
        .await
        .ok()
        .flatten();
    let (mut tx, mut rx) = within(
        idle,
        opener.open(vm, &StreamTarget::TarExtract { dir: dir.into() }),
    )
    .await?;
    let (chunks_tx, mut chunks) = tokio::sync::mpsc::channel::<Vec<u8>>(8);
    let shown = from.to_path_buf();
    let packer = tokio::task::spawn_blocking(move || {
        let w = ChannelWriter {
            tx: chunks_tx,
            buf: Vec::with_capacity(CHUNK),
        };
        crate::copy::pack(&parent_fd, &name, &shown, w)
    });
    let progress = Progress::bytes(format!("{} -> {vm}:{dir}", from.display()), total);
    let send = async {
        while let Some(c) = chunks.recv().await {
            progress.inc(c.len() as u64);
            within(idle, tx.send(&c)).await?;
        }
        // The packer is done (it dropped its writer). An archive it could not finish is
        // never ended: the stream is dropped instead, and the guest places nothing (tar
        // would stop at the end marker a failed packer still writes, and succeed).
        let packed = packer.await.map_err(|e| anyhow!("packing: {e}"))??;
        within(idle, tx.eof()).await?;
        Ok::<_, anyhow::Error>(packed)
    };
    let packed = tokio::select! {
        r = send => r?,
        end = wait_end(&mut rx, idle) => {
            end?;
            bail!("the guest ended the copy before it was sent");
        }
    };
    wait_end(&mut rx, idle).await?;
    progress.finish(None);
    if packed.skipped > 0 {
        eprintln!(
            "warren: {} socket, FIFO or device entries were left out",
            packed.skipped
        );
    }
    Ok(0)
}

/// Waits for the guest's end of the stream: an error unless it ended normally. Data before
/// it is unexpected on an upload and dropped.
async fn wait_end(rx: &mut Rx, idle: Duration) -> Result<()> {
    loop {
        match within(idle, rx.next()).await? {
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
    idle: Duration,
    shares: &Shares,
) -> Result<i32> {
    let name = Path::new(path)
        .file_name()
        .ok_or_else(|| anyhow!("{path}: name a guest file or directory"))?
        .to_owned();
    // The one time `to` is resolved, by Warren's own walk (refused through a share): the
    // staging directory, the check, the move into place and the clean-up are all relative
    // to this descriptor.
    let to_fd = open_dir(to, true, shares)?;
    let dest = to.join(&name);
    if rustix::fs::statat(&to_fd, &name, AtFlags::SYMLINK_NOFOLLOW).is_ok() {
        bail!("{} exists; remove it or copy elsewhere", dest.display());
    }
    // Installed before anything is written: a copy stopped by a signal (the guest may send
    // without end) removes what it made instead of leaving it in `to`.
    let stop = stopped()?;
    let (limit, how) = download_limit(&to_fd, to, max_mib)?;
    let (staging_name, staging) = staging_in(&to_fd, to)?;
    let result = match staging.try_clone() {
        Ok(root) => {
            let into = Unpack {
                root,
                name: name.clone(),
                max_bytes: limit,
            };
            download_into(opener, vm, path, into, idle, stop)
                .await
                .with_context(|| {
                    format!("copying {vm}:{path} (at most {limit} bytes on disk: {how})")
                })
        }
        Err(e) => Err(e.into()),
    };
    let moved = result.and_then(|n| {
        rustix::fs::renameat_with(&staging, &name, &to_fd, &name, RenameFlags::NOREPLACE)
            .with_context(|| format!("moving the copy to {}", dest.display()))?;
        Ok(n)
    });
    drop(staging);
    // Without recursion: the tree is the guest's shape (see `warren_session::remove_tree`).
    if let Err(e) = warren_session::remove_tree_at(&to_fd, Path::new(&staging_name)) {
        eprintln!(
            "warren: the staging directory {} could not be removed: {e}",
            to.join(&staging_name).display()
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

/// Where and how much a copy out unpacks.
struct Unpack {
    /// The staging directory.
    root: OwnedFd,
    /// The name asked for (every entry is it or beneath it).
    name: std::ffi::OsString,
    max_bytes: u64,
}

async fn download_into(
    opener: &Opener,
    vm: &str,
    path: &str,
    into: Unpack,
    idle: Duration,
    stop: impl std::future::Future<Output = Stopped>,
) -> Result<crate::copy::Unpacked> {
    let (mut tx, mut rx) = within(
        idle,
        opener.open(vm, &StreamTarget::TarCreate { path: path.into() }),
    )
    .await?;
    // A copy out sends the guest nothing but the end of its input. A service that already
    // sent the whole archive (a small file) and its close may have closed the connection
    // before this is sent: that send then fails, and what arrived is still read below,
    // which decides how the copy went.
    if let Err(e) = within(idle, tx.eof()).await {
        if e.is::<Idle>() {
            return Err(e);
        }
        tracing::debug!(error = %e, "the end of a copy out's input was not sent");
    }
    let (chunks_tx, chunks) = std::sync::mpsc::sync_channel::<Vec<u8>>(8);
    let unpacker = tokio::task::spawn_blocking(move || {
        let mut r = ChannelReader {
            rx: chunks,
            cur: Vec::new(),
            pos: 0,
        };
        let unpacked = crate::copy::unpack(&mut r, into.root, &into.name, into.max_bytes)?;
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
                next = within(idle, rx.next()) => next?,
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
        // Why the copy stopped, not the unpacker's "the archive ended early" that follows.
        Err(e) if e.is::<Stopped>() || e.is::<Idle>() => Err(e),
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

/// A private directory in the directory `parent` (shown as `shown`) for a copy being made:
/// its name there and its descriptor (opened `O_NOFOLLOW`: what was made, or a directory
/// something put in its place, never a symlink's target).
fn staging_in(parent: &OwnedFd, shown: &Path) -> Result<(std::ffi::OsString, OwnedFd)> {
    for n in 0..100u32 {
        let name = format!(".warren-cp-{}-{n}", std::process::id());
        match rustix::fs::mkdirat(parent, name.as_str(), Mode::RWXU) {
            Ok(()) => {}
            Err(rustix::io::Errno::EXIST) => continue,
            Err(e) => return Err(e).with_context(|| shown.join(&name).display().to_string()),
        }
        let fd = rustix::fs::openat(
            parent,
            name.as_str(),
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .with_context(|| shown.join(&name).display().to_string())?;
        return Ok((name.into(), fd));
    }
    bail!("no staging directory could be made in {}", shown.display())
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
    fn test_places() {
        assert_eq!(
            parse_place("abc-12:/tmp/x"),
            Place::Guest {
                vm: "abc-12".into(),
                path: "/tmp/x".into()
            }
        );
        assert_eq!(parse_place("./a:/b"), Place::Host("./a:/b".into()));
        assert_eq!(parse_place("vm:rel"), Place::Host("vm:rel".into()));
    }

    /// The margin a copy leaves is 1 GiB on a large disk (a share of its size refused a
    /// 10-byte copy on a 250 GiB disk with 12 GiB free) and 5% of a small one.
    #[test]
    fn test_kept_free_is_a_margin_not_a_share_of_a_large_disk() {
        assert_eq!(kept_free(250 << 30), 1 << 30);
        assert_eq!(kept_free(20 << 30), 1 << 30);
        assert_eq!(kept_free(2 << 30), (2u64 << 30) / 20);
        assert_eq!(kept_free(0), 0);
    }
}
