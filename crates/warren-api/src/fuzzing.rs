//! A narrow entry point into [`crate::service::Service::call`]'s argument handling, for the
//! fuzz targets in `crates/warren-fuzz` and their corpus replay test. Not an API: hidden
//! from the docs. It needs no engine, so it stops where a handler first asks the engine
//! (ownership of the VM): the checks that come after that are not reached.

use serde::Serialize;
use serde_json::Value;
use warren_core::workspace_ops::parse_version;

use crate::error::ApiError;
use crate::receipts::{args_hash, validate_request_id};
use crate::service::{parse, parse_job};
use crate::tools::*;

/// Every tool [`crate::service::Service::call`] dispatches.
pub const TOOLS: &[&str] = &[
    "vm_create",
    "vm_list",
    "vm_status",
    "vm_exec",
    "vm_job_status",
    "vm_job_output",
    "vm_job_cancel",
    "vm_read_file",
    "vm_write_file",
    "vm_edit_file",
    "vm_glob",
    "vm_grep",
    "vm_destroy",
    "vm_suspend",
    "vm_fork",
    "pool_status",
    "session_create",
    "session_list",
    "session_status",
    "session_export",
    "session_delete",
    "vm_resume",
];

/// Parses `args` as `tool`'s arguments exactly as the service does (an object or null,
/// unknown fields refused) and runs the checks that need no engine: request ids, job ids,
/// versions. Returns the receipt hash of the parsed arguments and their re-serialised form.
pub fn tool_args(tool: &str, args: Value) -> Result<(String, Value), ApiError> {
    fn done<T: Serialize>(a: &T) -> Result<(String, Value), ApiError> {
        let v = serde_json::to_value(a).map_err(|e| ApiError::internal(e.to_string()))?;
        Ok((args_hash(a), v))
    }
    match tool {
        "vm_create" => {
            let a: VmCreateArgs = parse(args)?;
            validate_request_id(&a.request_id)?;
            done(&a)
        }
        "vm_exec" => {
            let a: VmExecArgs = parse(args)?;
            validate_request_id(&a.request_id)?;
            done(&a)
        }
        "vm_list" | "session_list" => done(&parse::<NoArgs>(args)?),
        "vm_status" | "vm_destroy" | "vm_resume" => done(&parse::<VmRef>(args)?),
        "vm_job_status" | "vm_job_cancel" => {
            let a: JobRef = parse(args)?;
            parse_job(&a.job_id)?;
            done(&a)
        }
        "vm_job_output" => {
            let a: JobOutputArgs = parse(args)?;
            parse_job(&a.job_id)?;
            done(&a)
        }
        "vm_read_file" => done(&parse::<ReadFileArgs>(args)?),
        "vm_write_file" => {
            let a: WriteFileArgs = parse(args)?;
            if let Some(v) = &a.expected_version {
                parse_version(v).map_err(ApiError::from)?;
            }
            done(&a)
        }
        "vm_edit_file" => {
            let a: EditFileArgs = parse(args)?;
            if let Some(v) = &a.expected_version {
                parse_version(v).map_err(ApiError::from)?;
            }
            done(&a)
        }
        "vm_glob" => done(&parse::<GlobArgs>(args)?),
        "vm_grep" => done(&parse::<GrepArgs>(args)?),
        "vm_suspend" => done(&parse::<VmSuspendArgs>(args)?),
        "vm_fork" => done(&parse::<VmForkArgs>(args)?),
        "pool_status" => done(&parse::<NoArgs>(args)?),
        "session_create" => done(&parse::<SessionCreateArgs>(args)?),
        "session_status" => done(&parse::<SessionRef>(args)?),
        "session_export" => done(&parse::<SessionExportArgs>(args)?),
        "session_delete" => done(&parse::<SessionDeleteArgs>(args)?),
        _ => Err(ApiError::new("unknown_tool", format!("no tool {tool:?}"))),
    }
}
