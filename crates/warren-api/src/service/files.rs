//! The workspace file tools (`vm_read_file`, `vm_write_file`, `vm_edit_file`, `vm_glob`,
//! `vm_grep`): argument checks here, the work in the guest through the engine.

use super::*;

impl Service {
    pub(super) async fn vm_read_file(
        &self,
        p: &Principal,
        a: ReadFileArgs,
    ) -> Result<Value, ApiError> {
        let rec = self
            .owned_for_work(p, &a.vm_id, a.expected_generation)
            .await?;
        let len = a.max_bytes.unwrap_or(MAX_FILE_CHUNK);
        if len == 0 || len > MAX_FILE_CHUNK {
            return Err(ApiError::invalid(format!(
                "max_bytes must be within 1..={MAX_FILE_CHUNK}"
            )));
        }
        let offset = a.offset.unwrap_or(0);
        let d = self
            .warren
            .read_file_versioned(&rec.id, &a.path, offset, len)
            .await?;
        to_value(FileContent {
            path: a.path,
            offset,
            content_base64: base64::engine::general_purpose::STANDARD.encode(&d.data),
            size: d.size,
            eof: d.eof,
            version: d.version.as_ref().map(version_hex),
        })
    }

    pub(super) async fn vm_write_file(
        &self,
        p: &Principal,
        a: WriteFileArgs,
    ) -> Result<Value, ApiError> {
        let rec = self
            .owned_for_work(p, &a.vm_id, a.expected_generation)
            .await?;
        let data = base64::engine::general_purpose::STANDARD
            .decode(a.content_base64.as_bytes())
            .map_err(|e| ApiError::invalid(format!("content_base64 is not base64: {e}")))?;
        if data.len() > MAX_FILE_CHUNK as usize {
            return Err(ApiError::invalid(format!(
                "content is {} bytes; at most {MAX_FILE_CHUNK} per call (use append for more)",
                data.len()
            )));
        }
        let precondition = match (a.create_only, a.expected_version.as_deref()) {
            (false, None) => Precondition::None,
            (true, None) => Precondition::CreateOnly,
            (false, Some(v)) => Precondition::IfVersion(parse_version(v)?),
            (true, Some(_)) => {
                return Err(ApiError::invalid(
                    "give at most one of create_only and expected_version",
                ))
            }
        };
        if a.append {
            if precondition != Precondition::None {
                return Err(ApiError::invalid(
                    "append cannot be combined with create_only or expected_version",
                ));
            }
            let n = self
                .warren
                .write_file_chunk(&rec.id, &a.path, WriteMode::Append, data)
                .await?;
            return to_value(FileWritten {
                path: a.path,
                bytes_written: n,
                version: None,
            });
        }
        let v = self
            .warren
            .write_file_checked(&rec.id, &a.path, data, precondition)
            .await?;
        to_value(FileWritten {
            path: a.path,
            bytes_written: v.size,
            version: Some(version_hex(&v.version)),
        })
    }

    pub(super) async fn vm_edit_file(
        &self,
        p: &Principal,
        a: EditFileArgs,
    ) -> Result<Value, ApiError> {
        let rec = self
            .owned_for_work(p, &a.vm_id, a.expected_generation)
            .await?;
        let expected_version = a
            .expected_version
            .as_deref()
            .map(parse_version)
            .transpose()?;
        let v = self
            .warren
            .edit_file(
                &rec.id,
                EditFile {
                    path: a.path.clone(),
                    old: a.old_string,
                    new: a.new_string,
                    expected_version,
                },
            )
            .await?;
        to_value(FileEdited {
            path: a.path,
            version: version_hex(&v.version),
            size: v.size,
        })
    }

    pub(super) async fn vm_glob(&self, p: &Principal, a: GlobArgs) -> Result<Value, ApiError> {
        let rec = self
            .owned_for_work(p, &a.vm_id, a.expected_generation)
            .await?;
        let limit = search_limit(a.limit, DEFAULT_GLOB_LIMIT)?;
        let r = self
            .warren
            .glob(
                &rec.id,
                GlobRequest {
                    pattern: a.pattern,
                    path: a.path,
                    limit,
                },
            )
            .await?;
        to_value(GlobOutput {
            paths: r.paths,
            truncated: r.truncated,
        })
    }

    pub(super) async fn vm_grep(&self, p: &Principal, a: GrepArgs) -> Result<Value, ApiError> {
        let rec = self
            .owned_for_work(p, &a.vm_id, a.expected_generation)
            .await?;
        let limit = search_limit(a.limit, DEFAULT_GREP_LIMIT)?;
        let r = self
            .warren
            .grep(
                &rec.id,
                GrepRequest {
                    pattern: a.pattern,
                    glob: a.glob,
                    path: a.path,
                    case_insensitive: a.case_insensitive,
                    limit,
                },
            )
            .await?;
        to_value(GrepOutput {
            matches: r
                .matches
                .into_iter()
                .map(|m| GrepLine {
                    path: m.path,
                    line: m.line,
                    text: m.text,
                })
                .collect(),
            truncated: r.truncated,
        })
    }
}
