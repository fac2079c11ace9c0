//! Client of a VM's supervisor socket: one connection per request.

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
    #[error("the VM's supervisor is not running ({path})")]
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
        let mut s =
            UnixStream::connect(&self.socket)
                .await
                .map_err(|source| ClientError::Connect {
                    path: self.socket.clone(),
                    source,
                })?;
        write_frame(&mut s, req).await?;
        let reply: Reply = read_frame(&mut s).await?;
        Ok(reply?)
    }

    /// Sends a request to the guest agent.
    pub async fn guest(&self, req: HostRequest) -> Result<GuestResponse, ClientError> {
        match self.request(&SupervisorRequest::Guest(req)).await? {
            SupervisorResponse::Guest(g) => Ok(g),
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
}
