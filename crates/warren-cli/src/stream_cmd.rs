//! `warren attach` and `warren port-forward`: guest streams from the command line (`crate::stream_link` opens them through the service or in process).

use std::io::{Read, Write};

use anyhow::{anyhow, bail, Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use warren_protocol::stream::StreamTarget;

use crate::cli::Cli;
use crate::stream_link::{Chunk, Opener, ServiceArgs};

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
    let (mut tx, mut rx) = open_port(&opener, vm, port).await?;
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
        let sent = async {
            while let Some(Some(data)) = in_rx.recv().await {
                tx.send(&data).await?;
            }
            if !ignore_stdin_eof {
                tx.eof().await?;
            }
            Ok::<(), anyhow::Error>(())
        };
        // A send fails when the connection is gone, which a guest that answered and closed
        // (and a service that passed that on and closed) leaves behind: the receiving half
        // reads what arrived and says how the stream ended.
        if let Err(e) = sent.await {
            tracing::debug!(error = %e, "sending to the guest stopped");
        }
        std::future::pending::<()>().await
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
        () = up => unreachable!("the input side never ends on its own"),
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

/// Opens a stream to the guest's `port`, giving up after [`OPEN_TIMEOUT`].
async fn open_port(
    opener: &Opener,
    vm: &str,
    port: u16,
) -> Result<(crate::stream_link::Tx, crate::stream_link::Rx)> {
    tokio::time::timeout(OPEN_TIMEOUT, opener.open(vm, &StreamTarget::Tcp { port }))
        .await
        .map_err(|_| {
            anyhow!(
                "the stream did not open within {} s",
                OPEN_TIMEOUT.as_secs()
            )
        })?
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

/// How long a forwarded connection waits for its stream to open (a hibernated VM wakes
/// first).
const OPEN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// Connections one `port-forward` carries at once; more wait in the listen queue.
const MAX_FORWARDED: usize = 64;

/// `warren port-forward`: each connection to host loopback's LOCAL goes to the guest's
/// GUEST port, until interrupted. Prints the listening address first. A connection from
/// another uid than the caller's is closed unless `allow_other_users` (root's too: a root
/// daemon relaying a user's bytes would pass them on).
pub async fn port_forward(
    cli: &Cli,
    service: &ServiceArgs,
    vm: &str,
    spec: &str,
    allow_other_users: bool,
) -> Result<i32> {
    let (local, guest) = parse_forward(spec)?;
    let opener = std::sync::Arc::new(Opener::new(cli, service).await?);
    // 127.0.0.1 and ::1 both: a browser told `localhost:PORT` may try either, and
    // another user holding the other would receive what it sends.
    let mut listeners = warren_api::loopback::bind(std::net::SocketAddr::from((
        std::net::Ipv4Addr::LOCALHOST,
        local,
    )))
    .await
    .with_context(|| format!("listening on 127.0.0.1:{local}"))?;
    let sibling = listeners.split_off(1).pop();
    let listener = listeners
        .pop()
        .ok_or_else(|| anyhow!("no listener on 127.0.0.1:{local}"))?;
    let addr = listener.local_addr()?;
    let sibling_addr = sibling.as_ref().map(|l| l.local_addr()).transpose()?;
    println!("{addr}");
    let _ = std::io::stdout().flush();
    match sibling_addr {
        Some(v6) => {
            eprintln!("warren: forwarding {addr} and {v6} to port {guest} of VM {vm}; Ctrl-C stops")
        }
        None => eprintln!("warren: forwarding {addr} to port {guest} of VM {vm}; Ctrl-C stops"),
    }
    let term = crate::term::Term::new(cli.raw);
    let me = rustix::process::geteuid().as_raw();
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_FORWARDED));
    loop {
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => s?,
            _ = tokio::signal::ctrl_c() => return Ok(0),
        };
        let v6_accept = async {
            match &sibling {
                Some(l) => l.accept().await,
                None => std::future::pending().await,
            }
        };
        let ((conn, peer), ours) = tokio::select! {
            r = listener.accept() => (r?, addr),
            r = v6_accept => (r?, sibling_addr.unwrap_or(addr)),
            _ = tokio::signal::ctrl_c() => return Ok(0),
        };
        let opener = opener.clone();
        let vm = vm.to_string();
        tokio::spawn(async move {
            // Off the runtime: a netlink exchange with the kernel.
            let owner = tokio::task::spawn_blocking(move || {
                warren_api::loopback_peer::peer_uid(ours, peer)
            })
            .await;
            let refused = match owner {
                _ if allow_other_users => None,
                Ok(Ok(Some(uid))) if uid == me => None,
                Ok(Ok(Some(uid))) => Some(format!("uid {uid}")),
                Ok(Ok(None)) => Some("a socket no process holds".to_string()),
                Ok(Err(e)) => Some(format!("an unknown socket ({e})")),
                Err(e) => Some(format!("an unknown socket ({e})")),
            };
            if let Some(who) = refused {
                eprintln!(
                    "warren: refused a connection from {peer}: {who}, not yours \
                     (--allow-other-users forwards those)"
                );
                return;
            }
            if let Err(e) = forward_one(&opener, &vm, guest, conn).await {
                eprintln!("{}", term.failure(&format!("connection from {peer}"), &e));
            }
            drop(slot);
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
    let (mut tx, mut rx) = open_port(opener, vm, port).await?;
    let (mut rd, mut wr) = conn.into_split();
    let up = async {
        let mut buf = vec![0u8; CHUNK];
        loop {
            // The local client gone (an error) ends the forwarding.
            let n = rd.read(&mut buf).await?;
            let sent = if n == 0 {
                tx.eof().await
            } else {
                tx.send(&buf[..n]).await
            };
            if n == 0 {
                if let Err(e) = &sent {
                    tracing::debug!(error = %e, "the end of input was not forwarded");
                }
                std::future::pending::<()>().await;
            }
            if let Err(e) = sent {
                // As in `attach`: a failed send leaves the ending to the receiving half, but
                // the local client is still read (and dropped), so its leaving ends this.
                tracing::debug!(error = %e, "forwarding to the guest stopped");
                loop {
                    if rd.read(&mut buf).await? == 0 {
                        return Ok(());
                    }
                }
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_forward_specs() {
        assert_eq!(parse_forward("8080").expect("one"), (8080, 8080));
        assert_eq!(parse_forward("0:3000").expect("two"), (0, 3000));
        assert!(parse_forward("x:1").is_err());
    }
}
