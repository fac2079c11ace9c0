//! Guest work through a VM's supervisor: exec, job output, listing and cancel, file chunks.
//! Work wakes a suspended VM and counts as activity ([`Warren::awake_client`]); status
//! never does ([`Warren::client`]).

use warren_protocol::{
    ExecStart, FileRead, FileWrite, GuestResponse, HostRequest, JobId, JobOutput, JobOutputRequest,
    WriteMode,
};
use warren_supervisor::SupervisorClient;

use super::{now_unix, unexpected, Warren};
use crate::error::CoreError;
use crate::store::VmState;

impl Warren {
    /// A client for the VM, resuming it first if it is suspended (work wakes a VM).
    pub async fn awake_client(&self, id: &str) -> Result<SupervisorClient, CoreError> {
        self.store.touch(id, now_unix())?;
        let rec = self.get_vm(id)?;
        if matches!(rec.state, VmState::Paused | VmState::Hibernated) {
            self.resume_vm(id).await?;
        }
        self.client(id)
    }

    /// A client for a running VM.
    pub fn client(&self, id: &str) -> Result<SupervisorClient, CoreError> {
        let rec = self.get_vm(id)?;
        if rec.state != VmState::Running {
            return Err(CoreError::VmNotRunning {
                id: rec.id,
                state: rec.state.as_str().to_string(),
                reason: rec.reason,
            });
        }
        Ok(SupervisorClient::new(&self.vm_dir(id).socket()))
    }

    pub async fn exec_start(&self, id: &str, req: ExecStart) -> Result<JobId, CoreError> {
        match self
            .awake_client(id)
            .await?
            .guest(HostRequest::ExecStart(req))
            .await?
        {
            GuestResponse::ExecStarted(j) => Ok(j),
            _ => Err(unexpected()),
        }
    }

    pub async fn job_output(
        &self,
        id: &str,
        req: JobOutputRequest,
    ) -> Result<JobOutput, CoreError> {
        match self
            .awake_client(id)
            .await?
            .guest(HostRequest::JobOutput(req))
            .await?
        {
            GuestResponse::JobOutput(o) => Ok(o),
            _ => Err(unexpected()),
        }
    }

    /// The jobs the guest retains, oldest first.
    pub async fn job_list(&self, id: &str) -> Result<Vec<warren_protocol::JobSummary>, CoreError> {
        match self.client(id)?.guest(HostRequest::JobList).await? {
            GuestResponse::Jobs(j) => Ok(j),
            _ => Err(unexpected()),
        }
    }

    pub async fn job_cancel(&self, id: &str, job: JobId) -> Result<(), CoreError> {
        match self
            .awake_client(id)
            .await?
            .guest(HostRequest::JobCancel(job))
            .await?
        {
            GuestResponse::JobCancelled => Ok(()),
            _ => Err(unexpected()),
        }
    }

    /// Reads one chunk of a file (at most `MAX_FILE_CHUNK` bytes).
    pub async fn read_file_chunk(
        &self,
        id: &str,
        path: &str,
        offset: u64,
        len: u32,
    ) -> Result<warren_protocol::FileData, CoreError> {
        let req = HostRequest::FileRead(FileRead {
            path: path.to_string(),
            offset,
            len,
        });
        match self.awake_client(id).await?.guest(req).await? {
            GuestResponse::FileData(d) if d.data.len() > len as usize => {
                Err(CoreError::GuestProtocol(format!(
                    "a read of at most {len} bytes was answered with {}",
                    d.data.len()
                )))
            }
            GuestResponse::FileData(d) => Ok(d),
            _ => Err(unexpected()),
        }
    }

    /// Writes one chunk (at most `MAX_FILE_CHUNK` bytes), creating parent directories.
    pub async fn write_file_chunk(
        &self,
        id: &str,
        path: &str,
        mode: WriteMode,
        data: Vec<u8>,
    ) -> Result<u64, CoreError> {
        let n = data.len() as u64;
        let req = HostRequest::FileWrite(FileWrite {
            path: path.to_string(),
            mode,
            data,
            create_parents: true,
        });
        match self.awake_client(id).await?.guest(req).await? {
            GuestResponse::FileWritten(_) => Ok(n),
            _ => Err(unexpected()),
        }
    }
}
