//! `warren preflight`: what this host can run, each check `ok`, `fail` or `info`.

use anyhow::Result;

use crate::cli::Cli;
use crate::commands::open;

/// `warren preflight [--json]`: each check is `ok`, `fail` or `info`; exit 1 on any failure.
pub(crate) fn preflight(cli: &Cli, json: bool) -> Result<i32> {
    let mut checks: Vec<(&'static str, String, String)> = Vec::new();
    let mut line = |ok: bool, what: &str, detail: String| {
        checks.push((if ok { "ok" } else { "fail" }, what.to_string(), detail));
    };
    match warren_vmm::accel::find_qemu() {
        Ok(q) => {
            let v = std::process::Command::new(&q).arg("--version").output();
            let v = v
                .ok()
                .map(|o| {
                    String::from_utf8_lossy(&o.stdout)
                        .lines()
                        .next()
                        .unwrap_or("")
                        .to_string()
                })
                .unwrap_or_default();
            line(
                v.contains("version 1") || v.contains("version 9"),
                "qemu",
                format!("{} ({v})", q.display()),
            );
        }
        Err(e) => line(false, "qemu", e.to_string()),
    }
    line(
        std::path::Path::new(warren_vmm::qemu::QBOOT).exists(),
        "qboot firmware",
        warren_vmm::qemu::QBOOT.to_string(),
    );
    let qimg = std::process::Command::new("qemu-img")
        .arg("--version")
        .output()
        .is_ok();
    line(
        qimg,
        "qemu-img",
        if qimg {
            "present".into()
        } else {
            "missing (apt-get install qemu-utils)".into()
        },
    );
    let kvm = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm");
    let kvm = format!(
        "/dev/kvm {}; `auto` probes it once per host boot and falls back to TCG",
        if kvm.is_ok() {
            "opens"
        } else {
            "is unavailable"
        }
    );
    checks.push(("info", "accelerator".into(), kvm));
    let mut line = |ok: bool, what: &str, detail: String| {
        checks.push((if ok { "ok" } else { "fail" }, what.to_string(), detail));
    };
    let root = nix::unistd::geteuid().is_root();
    line(
        true,
        "privileges",
        if root {
            "root: each VMM runs as its own unprivileged uid".into()
        } else {
            "not root: VMMs run as your uid and no host cgroup is used".into()
        },
    );
    match warren_vmm::sys::cgroup::Hierarchy::detect() {
        Some(h) => {
            line(
                true,
                "cgroup v2",
                format!("{} (membership and cgroup.kill)", h.root.display()),
            );
            let homes = warren_vmm::sys::cgroup::controller_homes(&h.vm_cgroup("<vm>"));
            let missing: Vec<&str> = homes
                .iter()
                .filter(|(_, home)| home.is_none())
                .map(|(c, _)| *c)
                .collect();
            let found: Vec<String> = homes
                .iter()
                .filter_map(|(c, home)| {
                    home.as_ref().map(|h| match h {
                        warren_vmm::sys::cgroup::Home::V2(_) => format!("{c} (v2)"),
                        warren_vmm::sys::cgroup::Home::V1(_) => format!("{c} (v1)"),
                    })
                })
                .collect();
            line(
                !root || missing.is_empty(),
                "limits",
                if missing.is_empty() {
                    format!("per-VM limits through {}", found.join(", "))
                } else {
                    format!(
                        "no {missing:?} controller in cgroup v2 or v1: VMs started as root \
                         are refused (per-VM memory, CPU and pids limits cannot be applied)"
                    )
                },
            );
        }
        None => line(
            false,
            "cgroup v2",
            "no cgroup2 mount found: VM processes cannot be tracked".into(),
        ),
    }
    // Session storage limits: a filesystem of its own per limited session copy.
    let missing: Vec<String> = warren_session::volume::host_support()
        .into_iter()
        .filter_map(|(what, r)| r.err().map(|e| format!("{what}: {e}")))
        .collect();
    line(
        missing.is_empty() || !root,
        "session storage",
        if missing.is_empty() {
            "loop devices (/dev/loop-control), mkfs.ext4 (e2fsprogs) and mount permission: \
             each session copy under a storage limit gets an ext4 image of its own"
                .into()
        } else {
            format!(
                "{}: sessions under a storage limit are refused (needs /dev/loop-control, \
                 mkfs.ext4 and tune2fs from e2fsprogs, and root to mount)",
                missing.join("; ")
            )
        },
    );
    let w = open(cli, None)?;
    let imgs = w.images().list()?;
    line(
        !imgs.is_empty(),
        "images",
        format!("{} built (warren image build)", imgs.len()),
    );
    let failed = checks.iter().any(|(status, _, _)| *status == "fail");
    if json {
        let list: Vec<_> = checks
            .iter()
            .map(|(status, check, detail)| {
                serde_json::json!({"check": check, "status": status, "detail": detail})
            })
            .collect();
        let v = serde_json::json!({"ok": !failed, "checks": list});
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        for (status, check, detail) in &checks {
            let tag = match *status {
                "ok" => "ok  ",
                "fail" => "FAIL",
                _ => "info",
            };
            println!("{tag} {check}: {detail}");
        }
    }
    Ok(if failed { 1 } else { 0 })
}
