//! Client of a VM's supervisor socket: one connection per request, each bounded by the
//! deadline of its kind ([`crate::deadline::client_limit`]), so a supervisor that stops
//! answering fails its own VM's calls with [`ClientError::Timeout`] and holds nobody else.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::net::UnixStream;
use warren_protocol::{GuestResponse, HostRequest};

use crate::proto::{
    read_frame, write_frame, FrameError, Reply, StatusInfo, SupervisorError, SupervisorRequest,
    SupervisorResponse,
};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connecting to the VM's supervisor at {path} failed")]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("talking to the supervisor failed")]
    Frame(#[from] FrameError),
    #[error(transparent)]
    Supervisor(#[from] SupervisorError),
    #[error("unexpected supervisor reply")]
    Unexpected,
    /// The supervisor did not answer within the request's deadline.
    #[error("the VM's supervisor did not answer within {0:?}")]
    Timeout(Duration),
}

#[derive(Debug, Clone)]
pub struct SupervisorClient {
    socket: PathBuf,
}

impl SupervisorClient {
    pub fn new(socket: &Path) -> Self {
        Self {
            socket: socket.to_path_buf(),
        }
    }

    pub async fn request(
        &self,
        req: &SupervisorRequest,
    ) -> Result<SupervisorResponse, ClientError> {
        let limit = crate::deadline::client_limit(req);
        let exchange = async {
            let mut s = self.connect().await?;
            write_frame(&mut s, req).await?;
            let reply: Reply = read_frame(&mut s).await?;
            Ok::<_, ClientError>(reply?)
        };
        // Dropping the connection on the deadline also cancels the request in the supervisor.
        tokio::time::timeout(limit, exchange)
            .await
            .map_err(|_| ClientError::Timeout(limit))?
    }

    /// Connects, retrying briefly on a transient refusal (a full accept backlog answers
    /// EAGAIN on UNIX sockets); a missing socket or a dead supervisor fails at once.
    async fn connect(&self) -> Result<UnixStream, ClientError> {
        let mut attempt = 0;
        loop {
            match UnixStream::connect(&self.socket).await {
                Ok(s) => return Ok(s),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && attempt < 100 => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(source) => {
                    return Err(ClientError::Connect {
                        path: self.socket.clone(),
                        source,
                    })
                }
            }
        }
    }

    /// Opens a guest stream on a connection of its own (`crate::stream_frame`).
    pub async fn open_stream(
        &self,
        target: warren_protocol::stream::StreamTarget,
    ) -> Result<crate::stream_frame::GuestStream, ClientError> {
        let req = SupervisorRequest::OpenStream(target);
        let limit = crate::deadline::client_limit(&req);
        let open = async {
            let mut s = self.connect().await?;
            write_frame(&mut s, &req).await?;
            let reply: Reply = read_frame(&mut s).await?;
            match reply? {
                SupervisorResponse::StreamOpened => Ok(s),
                _ => Err(ClientError::Unexpected),
            }
        };
        let s = tokio::time::timeout(limit, open)
            .await
            .map_err(|_| ClientError::Timeout(limit))??;
        let (rd, wr) = s.into_split();
        Ok(crate::stream_frame::GuestStream {
            reader: crate::stream_frame::StreamReader(crate::stream_frame::FrameReader::new(rd)),
            writer: crate::stream_frame::StreamWriter(wr),
        })
    }

    /// Sends a request to the guest agent.
    pub async fn guest(&self, req: HostRequest) -> Result<GuestResponse, ClientError> {
        match self.request(&SupervisorRequest::Guest(req)).await? {
            SupervisorResponse::Guest(g) => Ok(g),
            _ => Err(ClientError::Unexpected),
        }
    }

    /// The channel's round trip (an HTTP/2 PING), as the supervisor measured it.
    pub async fn channel_ping(&self) -> Result<Duration, ClientError> {
        match self.request(&SupervisorRequest::ChannelPing).await? {
            SupervisorResponse::ChannelPong { rtt_ns } => Ok(Duration::from_nanos(rtt_ns)),
            _ => Err(ClientError::Unexpected),
        }
    }

    pub async fn status(&self) -> Result<StatusInfo, ClientError> {
        match self.request(&SupervisorRequest::Status).await? {
            SupervisorResponse::Status(s) => Ok(s),
            _ => Err(ClientError::Unexpected),
        }
    }

    pub async fn wait_ready(&self, timeout: Duration) -> Result<StatusInfo, ClientError> {
        let req = SupervisorRequest::WaitReady {
            timeout_ms: timeout.as_millis() as u64,
        };
        match self.request(&req).await? {
            SupervisorResponse::Status(s) => Ok(s),
            _ => Err(ClientError::Unexpected),
        }
    }

    pub async fn stop(&self) -> Result<(), ClientError> {
        self.request(&SupervisorRequest::Stop).await.map(|_| ())
    }

    pub async fn pause(&self) -> Result<(), ClientError> {
        self.request(&SupervisorRequest::Pause).await.map(|_| ())
    }

    pub async fn resume(&self) -> Result<(), ClientError> {
        self.request(&SupervisorRequest::Resume).await.map(|_| ())
    }

    /// See [`SupervisorRequest::ForkSave`]; `hold`: [`SupervisorRequest::ForkSaveHeld`].
    pub async fn fork_save(
        &self,
        state: &std::path::Path,
        disk: &std::path::Path,
        max_disk_bytes: u64,
        hold: bool,
    ) -> Result<(u64, u64), ClientError> {
        let (state, disk) = (state.to_path_buf(), disk.to_path_buf());
        let req = if hold {
            SupervisorRequest::ForkSaveHeld {
                state,
                disk,
                max_disk_bytes,
            }
        } else {
            SupervisorRequest::ForkSave {
                state,
                disk,
                max_disk_bytes,
            }
        };
        match self.request(&req).await? {
            SupervisorResponse::ForkSaved { size, paused_ms } => Ok((size, paused_ms)),
            _ => Err(ClientError::Unexpected),
        }
    }

    /// See [`SupervisorRequest::ForkRelease`].
    pub async fn fork_release(&self) -> Result<(), ClientError> {
        self.request(&SupervisorRequest::ForkRelease)
            .await
            .map(|_| ())
    }

    pub async fn hibernate(&self) -> Result<crate::proto::CheckpointInfo, ClientError> {
        match self.request(&SupervisorRequest::Hibernate).await? {
            SupervisorResponse::Hibernated(i) => Ok(i),
            _ => Err(ClientError::Unexpected),
        }
    }
}
