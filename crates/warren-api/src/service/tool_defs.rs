//! The tools' definitions as both transports advertise them: name, description, and the
//! JSON schemas of the arguments and the result (from the `tools` types).

use schemars::JsonSchema;
use serde_json::{Map, Value};

use warren_core::output::OutputPage;

use crate::tools::*;

/// One tool as both transports advertise it.
#[derive(Debug, Clone)]
pub struct ToolDef {
    pub name: &'static str,
    pub description: &'static str,
    pub input_schema: Map<String, Value>,
    pub output_schema: Map<String, Value>,
}

fn schema_of<T: JsonSchema>() -> Map<String, Value> {
    match serde_json::to_value(schemars::schema_for!(T)) {
        Ok(Value::Object(m)) => m,
        _ => Map::new(),
    }
}

fn tool<A: JsonSchema, R: JsonSchema>(name: &'static str, description: &'static str) -> ToolDef {
    ToolDef {
        name,
        description,
        input_schema: schema_of::<A>(),
        output_schema: schema_of::<R>(),
    }
}

/// Every tool with its schemas; `vm_create.image` becomes an enum of `images`.
pub fn tool_defs(images: &[String]) -> Vec<ToolDef> {
    let mut tools = vec![
        tool::<VmCreateArgs, VmInfo>(
            "vm_create",
            "Create and boot a private Linux VM (Debian) for this workspace. Returns once the guest answers.",
        ),
        tool::<NoArgs, VmList>("vm_list", "List this workspace's VMs."),
        tool::<VmRef, VmStatus>(
            "vm_status",
            "A VM's state, image, accelerator, memory, vCPUs, generation, job counts, the jobs that left background processes running, and failure reason.",
        ),
        tool::<VmExecArgs, ExecResult>(
            "vm_exec",
            "Start a command in a VM as an unprivileged user, in /workspace. With wait_ms, returns its output and exit code if it ends in time; otherwise read more with vm_job_output. Processes it leaves in the background (cmd &, nohup, a server) keep running after it exits, until they exit or vm_job_cancel stops them; their later output stays readable with vm_job_output.",
        ),
        tool::<JobRef, JobStatus>(
            "vm_job_status",
            "A job's state and exit status. Never wakes a suspended VM: then it is the job as last seen before the suspension (stale: true, with vm_state).",
        ),
        tool::<JobOutputArgs, OutputPage>(
            "vm_job_output",
            "Read a job's stdout and stderr from byte cursors (pass the previous next_cursor). Non-destructive; at most 16 KiB per stream per call.",
        ),
        tool::<JobRef, JobCancelled>(
            "vm_job_cancel",
            "Kill a job and every process it started: a running job, or the background processes a finished job left running.",
        ),
        tool::<ReadFileArgs, FileContent>(
            "vm_read_file",
            "Read up to 128 KiB of a file below /workspace, base64-encoded, with the file's version (SHA-256 of its content).",
        ),
        tool::<WriteFileArgs, FileWritten>(
            "vm_write_file",
            "Write up to 128 KiB, base64-encoded, to a file below /workspace: atomically replace it (optionally only if it does not exist yet, or only if its version is still expected_version), or append. Returns the new version.",
        ),
        tool::<EditFileArgs, FileEdited>(
            "vm_edit_file",
            "Replace one exact occurrence of old_string with new_string in a file below /workspace (it must occur exactly once), optionally only if the file's version is still expected_version. Returns the new version.",
        ),
        tool::<GlobArgs, GlobOutput>(
            "vm_glob",
            "List files below /workspace whose path matches a glob, sorted, skipping .gitignore'd files and .git.",
        ),
        tool::<GrepArgs, GrepOutput>(
            "vm_grep",
            "Search the text files below /workspace for lines matching a regular expression (Rust regex), skipping .gitignore'd and binary files. Returns path, line number and text, sorted.",
        ),
        tool::<VmRef, VmDestroyed>(
            "vm_destroy",
            "Stop a VM and delete it with its disk.",
        ),
        tool::<VmSuspendArgs, VmInfo>(
            "vm_suspend",
            "Suspend a VM: pause (vCPUs stopped, memory kept) or hibernate (memory written to disk, no host memory held). Running processes continue on resume; any later exec or file operation resumes it.",
        ),
        tool::<VmRef, VmInfo>(
            "vm_resume",
            "Resume a paused or hibernated VM where it was.",
        ),
        tool::<VmForkArgs, VmForked>(
            "vm_fork",
            "Make count independent copies of a running VM (processes, memory and files), each with its own identity, secrets and network namespace (with the VM's egress policy); open TCP connections are dead in the copies, and userspace random state of copied processes is duplicated. A session's VM: each copy is a new session (session_ids) with a copy of the session's files, taken while the VM is held stopped. Admitted against the limits as one request; the VM pauses briefly and runs on.",
        ),
        tool::<NoArgs, PoolReport>(
            "pool_status",
            "The warm pools the operator configured: per image, the target size and how many VMs are ready or starting.",
        ),
        tool::<SessionCreateArgs, SessionInfo>(
            "session_create",
            "Create a session: a private copy of a host git repository (staged, unstaged and untracked files included; ignored ones not) with its own git directory, mounted read-write at /workspace of a new VM; direct mounts the directory itself. The path is checked as the caller (local callers, or the operator's host roots).",
        ),
        tool::<NoArgs, SessionList>("session_list", "List this workspace's sessions."),
        tool::<SessionRef, SessionStatus>(
            "session_status",
            "What deleting a session would lose: uncommitted paths and commits not exported to the source repository.",
        ),
        tool::<SessionExportArgs, SessionExported>(
            "session_export",
            "Bring a session's commits into its source repository as a branch (created, or fast-forwarded only).",
        ),
        tool::<SessionDeleteArgs, SessionDeleted>(
            "session_delete",
            "Destroy a session's VM and its copy; refused while it has uncommitted changes or unexported commits unless force.",
        ),
    ];
    let names: Vec<Value> = images.iter().map(|n| Value::String(n.clone())).collect();
    for t in tools
        .iter_mut()
        .filter(|t| t.name == "vm_create" || t.name == "session_create")
    {
        if let Some(img) = t
            .input_schema
            .get_mut("properties")
            .and_then(|p| p.get_mut("image"))
        {
            *img = serde_json::json!({
                "description": "A configured image name; the default image when omitted.",
                "type": "string",
                "enum": names,
            });
        }
    }
    tools
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_tool_defs_complete_schemas_and_image_enum() {
        let defs = tool_defs(&["dev".into(), "minimal".into()]);
        assert_eq!(defs.len(), 22);
        for d in &defs {
            assert_eq!(
                d.input_schema.get("type"),
                Some(&Value::from("object")),
                "{}",
                d.name
            );
            assert_eq!(
                d.output_schema.get("type"),
                Some(&Value::from("object")),
                "{}",
                d.name
            );
        }
        let img = &defs[0].input_schema["properties"]["image"];
        assert_eq!(img["enum"], serde_json::json!(["dev", "minimal"]));
        let exec = &defs[3].input_schema;
        assert_eq!(exec["additionalProperties"], Value::Bool(false));
        assert!(exec["required"]
            .as_array()
            .is_some_and(|r| r.contains(&Value::from("request_id"))));
    }
}
