//! A minimal QMP client: greeting, `qmp_capabilities`, then one command at a time.
//! Asynchronous events are skipped while waiting for a command's reply.

use std::path::Path;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

use crate::backend::{BoxFuture, VmControl};
use crate::error::VmmError;

/// The longest QMP message accepted: the VMM may be compromised, so its output is bounded.
pub const MAX_LINE: u64 = 1 << 20;

pub struct Qmp {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
}

impl Qmp {
    pub async fn connect(path: &Path) -> Result<Self, VmmError> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|source| VmmError::QmpConnect {
                path: path.to_path_buf(),
                source,
            })?;
        let (r, w) = stream.into_split();
        let mut q = Qmp {
            reader: BufReader::new(r),
            writer: w,
        };
        let greeting = q.read_msg().await?;
        if greeting.get("QMP").is_none() {
            return Err(VmmError::QmpProtocol(format!(
                "unexpected greeting {greeting}"
            )));
        }
        q.execute("qmp_capabilities", None).await?;
        Ok(q)
    }

    async fn read_msg(&mut self) -> Result<Value, VmmError> {
        let mut line = String::new();
        let n = (&mut self.reader)
            .take(MAX_LINE)
            .read_line(&mut line)
            .await
            .map_err(VmmError::QmpIo)?;
        if n == 0 {
            return Err(VmmError::QmpIo(std::io::ErrorKind::UnexpectedEof.into()));
        }
        if !line.ends_with('\n') {
            return Err(VmmError::QmpProtocol(format!(
                "a message longer than {MAX_LINE} bytes"
            )));
        }
        serde_json::from_str(&line).map_err(|e| VmmError::QmpProtocol(e.to_string()))
    }

    /// Runs one command and returns its `return` value.
    pub async fn execute(&mut self, command: &str, args: Option<Value>) -> Result<Value, VmmError> {
        let mut msg = json!({ "execute": command });
        if let Some(a) = args {
            msg["arguments"] = a;
        }
        let mut line = msg.to_string();
        line.push('\n');
        self.writer
            .write_all(line.as_bytes())
            .await
            .map_err(VmmError::QmpIo)?;
        loop {
            let v = self.read_msg().await?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(VmmError::QmpCommand {
                    command: command.to_string(),
                    desc: e
                        .get("desc")
                        .and_then(Value::as_str)
                        .unwrap_or("unknown error")
                        .to_string(),
                });
            }
            // An event: skip.
        }
    }
}

impl VmControl for Qmp {
    fn pause(&mut self) -> BoxFuture<'_, Result<(), VmmError>> {
        Box::pin(async move { self.execute("stop", None).await.map(|_| ()) })
    }

    fn resume(&mut self) -> BoxFuture<'_, Result<(), VmmError>> {
        Box::pin(async move { self.execute("cont", None).await.map(|_| ()) })
    }

    fn quit(&mut self) -> BoxFuture<'_, Result<(), VmmError>> {
        Box::pin(async move {
            match self.execute("quit", None).await {
                Ok(_) => Ok(()),
                // QEMU may close the socket before its reply arrives.
                Err(VmmError::QmpIo(_)) => Ok(()),
                Err(e) => Err(e),
            }
        })
    }
}
