//! A small HTTP benchmark for `warren bench`: connection latency (connect, one small request,
//! full response) and single-connection download throughput, over whatever `connect`
//! returns (a direct connection, one redirected through the proxy, or a TLS stream on top).
//! The caller provides the topology and runs it twice (direct and through the egress) to get
//! a ratio. Bounded: `rounds` connections and one download of `download_bytes`.

use std::future::Future;
use std::io;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// What to measure.
#[derive(Debug, Clone)]
pub struct HttpBenchParams {
    /// `Host` header sent.
    pub host: String,
    /// Path of a small resource (latency rounds).
    pub small_path: String,
    /// Path of a large resource (throughput), expected to be `Content-Length` framed.
    pub large_path: String,
    /// Number of latency rounds (one new connection each).
    pub rounds: u32,
    /// Give up after this long overall.
    pub timeout: Duration,
}

/// Measured figures.
#[derive(Debug, Clone)]
pub struct HttpBenchReport {
    /// Median of connect + request + response on a new connection.
    pub request_p50: Duration,
    /// 95th percentile of the same.
    pub request_p95: Duration,
    /// Bytes of the large body read.
    pub download_bytes: u64,
    /// Throughput of that download, MiB/s.
    pub download_mib_s: f64,
}

async fn one_request<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    host: &str,
    path: &str,
) -> io::Result<u64> {
    let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await?;
    s.flush().await?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut byte).await? == 0 || head.len() > 64 * 1024 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "no response head",
            ));
        }
        head.push(byte[0]);
    }
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut resp = httparse::Response::new(&mut headers);
    resp.parse(&head)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad response"))?;
    if resp.code != Some(200) {
        return Err(io::Error::other(format!("status {:?}", resp.code)));
    }
    let len: u64 = resp
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-length"))
        .and_then(|h| std::str::from_utf8(h.value).ok()?.trim().parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no Content-Length"))?;
    let copied = tokio::io::copy(&mut (&mut *s).take(len), &mut tokio::io::sink()).await?;
    if copied != len {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "short body"));
    }
    Ok(len)
}

/// Runs the benchmark; `connect` opens one new connection per call.
pub async fn http_bench<C, F, S>(
    connect: C,
    params: &HttpBenchParams,
) -> io::Result<HttpBenchReport>
where
    C: Fn() -> F,
    F: Future<Output = io::Result<S>>,
    S: AsyncRead + AsyncWrite + Unpin,
{
    let work = async {
        let mut times = Vec::with_capacity(params.rounds as usize);
        for _ in 0..params.rounds.max(1) {
            let t = Instant::now();
            let mut s = connect().await?;
            one_request(&mut s, &params.host, &params.small_path).await?;
            times.push(t.elapsed());
        }
        times.sort();
        let pick = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
        let mut s = connect().await?;
        let t = Instant::now();
        let bytes = one_request(&mut s, &params.host, &params.large_path).await?;
        let secs = t.elapsed().as_secs_f64().max(1e-9);
        Ok(HttpBenchReport {
            request_p50: pick(0.5),
            request_p95: pick(0.95),
            download_bytes: bytes,
            download_mib_s: bytes as f64 / (1024.0 * 1024.0) / secs,
        })
    };
    tokio::time::timeout(params.timeout, work)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "benchmark timed out"))?
}
