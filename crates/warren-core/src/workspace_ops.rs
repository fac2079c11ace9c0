//! File operations with versions, edits and searches in a VM's workspace: thin requests to
//! the guest agent, which does the work (see `warren-guest`'s `workspace_ops`). Each is
//! work: it wakes a suspended VM first.
//!
//! A version is the SHA-256 of a file's content, written as 64 lowercase hex digits at the
//! edges (CLI, API) and as 32 bytes on the wire.

use std::io::Read;

use warren_protocol::limits::{MAX_FILE_CHUNK, MAX_WHOLE_FILE};
use warren_protocol::{
    EditFile, FileVersion, GlobRequest, GlobResult, GrepRequest, GrepResult, GuestResponse,
    HostRequest, Precondition, ReadVersioned, Version, VersionedData, WriteChecked, WriteMode,
};

use crate::error::CoreError;
use crate::vm::{unexpected, Warren};

/// The largest file a whole-file read takes (16 TiB, ext4's largest file): the end of such a
/// read is where the guest said the file ends, so a guest's own figure must not leave it
/// unbounded.
const MAX_READ_FILE: u64 = 1 << 44;

/// Parses a version given as 64 hex digits.
pub fn parse_version(s: &str) -> Result<Version, CoreError> {
    let mut v = [0u8; 32];
    hex::decode_to_slice(s.trim(), &mut v).map_err(|_| {
        CoreError::InvalidArgument(format!(
            "version {s:?} is not 64 hex digits (the SHA-256 of the file's content)"
        ))
    })?;
    Ok(v)
}

/// A version as the CLI and the API write it.
pub fn version_hex(v: &Version) -> String {
    hex::encode(v)
}

impl Warren {
    async fn workspace_call(&self, id: &str, req: HostRequest) -> Result<GuestResponse, CoreError> {
        Ok(self.awake_client(id).await?.guest(req).await?)
    }

    /// Reads up to `len` bytes (at most `MAX_WHOLE_FILE`) at `offset`, with the version of
    /// the whole file as read through the same open file (none above `MAX_VERSIONED_FILE`).
    pub async fn read_file_versioned(
        &self,
        id: &str,
        path: &str,
        offset: u64,
        len: u32,
    ) -> Result<VersionedData, CoreError> {
        let req = HostRequest::ReadVersioned(ReadVersioned {
            path: path.to_string(),
            offset,
            len,
        });
        match self.workspace_call(id, req).await? {
            GuestResponse::VersionedData(d) if d.data.len() > len as usize => {
                Err(too_long(d.data.len(), len))
            }
            GuestResponse::VersionedData(d) => Ok(d),
            _ => Err(unexpected()),
        }
    }

    /// Replaces the whole file atomically (temp file + rename in the guest) if
    /// `precondition` holds, creating missing parent directories. `Conflict` otherwise.
    pub async fn write_file_checked(
        &self,
        id: &str,
        path: &str,
        data: Vec<u8>,
        precondition: Precondition,
    ) -> Result<FileVersion, CoreError> {
        let req = HostRequest::WriteChecked(WriteChecked {
            path: path.to_string(),
            data,
            precondition,
            create_parents: true,
        });
        match self.workspace_call(id, req).await? {
            GuestResponse::FileVersioned(v) => Ok(v),
            _ => Err(unexpected()),
        }
    }

    /// Replaces the one occurrence of `req.old` in the file.
    pub async fn edit_file(&self, id: &str, req: EditFile) -> Result<FileVersion, CoreError> {
        match self.workspace_call(id, HostRequest::Edit(req)).await? {
            GuestResponse::FileVersioned(v) => Ok(v),
            _ => Err(unexpected()),
        }
    }

    pub async fn glob(&self, id: &str, req: GlobRequest) -> Result<GlobResult, CoreError> {
        match self.workspace_call(id, HostRequest::Glob(req)).await? {
            GuestResponse::Glob(r) => Ok(r),
            _ => Err(unexpected()),
        }
    }

    pub async fn grep(&self, id: &str, req: GrepRequest) -> Result<GrepResult, CoreError> {
        match self.workspace_call(id, HostRequest::Grep(req)).await? {
            GuestResponse::Grep(r) => Ok(r),
            _ => Err(unexpected()),
        }
    }

    /// Reads a whole file into `sink`; returns its size and version. A file of at most
    /// `MAX_WHOLE_FILE` bytes takes one request. A larger one is read in chunks and its
    /// version asked again at the end: if it changed in between, the read fails with
    /// `conflict` (what `sink` got is then a mix). A `sink` that fails ends the read at once
    /// with its error (no more of the file is asked for: `vm read | head`).
    pub async fn read_file(
        &self,
        id: &str,
        path: &str,
        sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<(u64, Option<Version>), CoreError> {
        let mut sink = |d: &[u8]| sink(d).map_err(|e| CoreError::io("write", "<output>", e));
        let first = self
            .read_file_versioned(id, path, 0, MAX_WHOLE_FILE)
            .await?;
        if first.size > MAX_READ_FILE {
            return Err(CoreError::GuestProtocol(format!(
                "{path}: the guest says it has {} bytes, more than the {MAX_READ_FILE} a read \
                 takes",
                first.size
            )));
        }
        sink(&first.data)?;
        let mut offset = first.data.len() as u64;
        if first.eof || first.data.is_empty() {
            return Ok((offset, first.version));
        }
        loop {
            let d = self
                .read_file_chunk(id, path, offset, MAX_FILE_CHUNK)
                .await?;
            offset += d.data.len() as u64;
            // A guest that never says `eof` would keep this loop (and the caller's sink)
            // going forever: the file may not grow past the size it had when the read began
            // (a file that really grows fails the same way, as one that changed).
            if offset > first.size {
                return Err(CoreError::Conflict(format!(
                    "{path} grew past the {} bytes it had when the read began; read it again",
                    first.size
                )));
            }
            sink(&d.data)?;
            if d.eof || d.data.is_empty() {
                break;
            }
        }
        if first.version.is_some() {
            let last = self.read_file_versioned(id, path, 0, 0).await?;
            if last.version != first.version || last.size != offset {
                return Err(CoreError::Conflict(format!(
                    "{path} changed while it was read; read it again"
                )));
            }
        }
        Ok((offset, first.version))
    }

    /// Writes a whole file from `source`. Content of at most `MAX_WHOLE_FILE` bytes replaces
    /// the file atomically under `precondition` and returns the new version. Larger content
    /// is written in place in chunks, only unconditionally, and has no version.
    pub async fn write_file(
        &self,
        id: &str,
        path: &str,
        source: &mut dyn std::io::Read,
        precondition: Precondition,
    ) -> Result<(u64, Option<Version>), CoreError> {
        let whole = MAX_WHOLE_FILE as usize;
        let mut head = Vec::with_capacity(whole + 1);
        source
            .take(whole as u64 + 1)
            .read_to_end(&mut head)
            .map_err(|e| CoreError::io("read", "<input>", e))?;
        if head.len() <= whole {
            let v = self
                .write_file_checked(id, path, head, precondition)
                .await?;
            return Ok((v.size, Some(v.version)));
        }
        if precondition != Precondition::None {
            return Err(CoreError::InvalidArgument(format!(
                "create-only and conditional writes are limited to {whole} bytes"
            )));
        }
        let mut total = 0u64;
        let chunk = MAX_FILE_CHUNK as usize;
        let mut pending = head;
        loop {
            while pending.len() < chunk {
                let mut buf = vec![0u8; chunk - pending.len()];
                let n = source
                    .read(&mut buf)
                    .map_err(|e| CoreError::io("read", "<input>", e))?;
                if n == 0 {
                    break;
                }
                pending.extend_from_slice(&buf[..n]);
            }
            if pending.is_empty() {
                return Ok((total, None));
            }
            let rest = pending.split_off(pending.len().min(chunk));
            let mode = if total == 0 {
                WriteMode::Truncate
            } else {
                WriteMode::At(total)
            };
            total += self.write_file_chunk(id, path, mode, pending).await?;
            pending = rest;
        }
    }
}

/// A read answered with more bytes than it asked for.
fn too_long(got: usize, asked: u32) -> CoreError {
    CoreError::GuestProtocol(format!(
        "a read of at most {asked} bytes was answered with {got}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_parse_version_roundtrip_and_bad_input_invalid() {
        let v = [0xabu8; 32];
        assert_eq!(parse_version(&version_hex(&v)).expect("parse"), v);
        for bad in ["", "abc", &"g".repeat(64), &"a".repeat(66)] {
            let e = parse_version(bad).expect_err(bad);
            assert_eq!(e.code(), "invalid_argument");
        }
    }
}
