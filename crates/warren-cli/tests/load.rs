//! The load suite in a small configuration: `warren bench --suite load` end to end (its own
//! private service, two workspaces with a VM each, four clients over HTTP, MCP with a
//! session and stateless MCP), under the service's default caps. It must finish with no
//! error and no crossed output, and every transport must have carried execs and output
//! reads.

mod common;

use std::process::Command;
use std::time::Instant;

use serde_json::Value;

#[test]
fn test_load_small_mixed_clients_no_errors_no_crossed_outputs() {
    let image = common::image_id("minimal");
    let env = common::TestEnv::new();
    // The bench's private state goes below TMPDIR: here, a directory of this test's own.
    let tmp = env.state.path().join("tmp");
    std::fs::create_dir_all(&tmp).expect("tmp dir");
    let t = Instant::now();
    let out = Command::new(common::WARREN)
        .env("TMPDIR", &tmp)
        .arg("--state-dir")
        .arg(env.state.path())
        .arg("--image-dir")
        .arg(&env.image_dir)
        .args(["bench", "--suite", "load", "--image", &image, "--json"])
        .args(["--clients", "4", "--workspaces", "2", "--requests", "40"])
        .args([
            "--accel",
            &std::env::var("WARREN_ACCEL").unwrap_or_else(|_| "auto".into()),
        ])
        .output()
        .expect("run warren bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON report ({e}), exit {:?}: {}\n{stderr}",
            out.status,
            String::from_utf8_lossy(&out.stdout)
        )
    });
    eprintln!(
        "load: {:.1} s in all, {} requests in {:.1} s",
        t.elapsed().as_secs_f64(),
        report["requests"],
        report["wall_s"].as_f64().unwrap_or(0.0)
    );

    assert_eq!(report["errors_total"], 0, "errors: {report:#}");
    assert_eq!(report["crossed"], 0, "crossed outputs: {report:#}");
    // The physical floor was measured in the same run: the guest's own fork+exec.
    let floor = report["guest_fork_exec_ms"].as_f64().unwrap_or(0.0);
    assert!(floor > 0.0, "no fork+exec floor: {report:#}");
    assert!(
        report["exec_p50_over_floor"].as_f64().unwrap_or(0.0) >= 1.0,
        "an exec through the service cannot beat the guest's own fork+exec: {report:#}"
    );
    assert!(out.status.success(), "exit {:?}: {stderr}", out.status);
    assert!(
        report["requests"].as_u64().unwrap_or(0) >= 160,
        "fewer requests than asked: {report:#}"
    );
    let ops = report["ops"].as_array().expect("ops");
    let count = |op: &str, transport: &str| {
        ops.iter()
            .find(|o| o["op"] == op && o["transport"] == transport)
            .and_then(|o| o["n"].as_u64())
            .unwrap_or(0)
    };
    for transport in ["http", "mcp-session", "mcp-stateless"] {
        for op in ["exec", "output"] {
            assert!(
                count(op, transport) > 0,
                "no {op} over {transport}: {report:#}"
            );
        }
    }
    for op in ["read_file", "write_file", "status", "list"] {
        assert!(count(op, "all") > 0, "no {op}: {report:#}");
    }
    // The bench removed its private service's state (VMs included).
    let left: Vec<_> = std::fs::read_dir(&tmp)
        .expect("tmp dir")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}
