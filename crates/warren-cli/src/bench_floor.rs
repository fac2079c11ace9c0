//! The restore floor of `warren bench --suite instant`: plain QEMU restoring a template
//! (its RAM file mapped privately, its device state loaded with `migrate-incoming`) until
//! the vCPUs run, with none of Warren's stack (no supervisor, channel, rekey or exec).

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use warren_core::Warren;
use warren_vmm::backend::MemMib;
use warren_vmm::qemu::qmp::Qmp;
use warren_vmm::qemu::QemuBackend;
use warren_vmm::{LaunchSpec, VmControl};

/// Milliseconds from spawning QEMU on the template in `dir` to its vCPUs running.
pub(crate) async fn raw_restore(w: &Warren, dir: &std::path::Path) -> Result<f64> {
    let rec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("template.json"))?)?;
    let key = &rec["key"];
    let image_id = warren_image::ImageId::parse(key["image_id"].as_str().context("image id")?)?;
    let image = w.images().verify(&image_id)?;
    let run_dir = crate::bench::tempfile_dir()?.join("raw-restore");
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir)?;
    let disk = run_dir.join("disk.qcow2");
    let size = std::fs::metadata(&image.rootfs)?.len();
    warren_vmm::disk::create_overlay_of_layer(&dir.join("disk.qcow2"), size, &disk)?;
    let accel = match key["accel"].as_str() {
        Some("kvm") => warren_vmm::Accel::Kvm,
        Some("tcg") => warren_vmm::Accel::Tcg,
        other => bail!("template accelerator {other:?}"),
    };
    let spec = LaunchSpec {
        name: "bench-raw-restore".into(),
        run_dir: run_dir.clone(),
        stderr_log: run_dir.join("qemu.stderr"),
        kernel: image.kernel.clone(),
        initramfs: image.initramfs.clone(),
        disk,
        memory: MemMib(key["memory_mib"].as_u64().context("memory")? as u32),
        vcpus: key["vcpus"].as_u64().context("vcpus")? as u32,
        accel,
        cpu: key["cpu"].as_str().map(String::from),
        extra_cmdline: vec![],
        run_as: None,
        cgroup: None,
        incoming: true,
        shares: vec![],
        virtiofsd: None,
        ram_file: None,
        network: None,
        template_ram: Some(dir.join("ram")),
        clone_ram: None,
        fork_ram: None,
        named_ram: false,
        groups: vec![],
        bench_port: None,
        view_readable: vec![],
    };
    let backend = QemuBackend::new(warren_vmm::accel::find_qemu()?)?;
    let ep = QemuBackend::endpoints(&run_dir);
    let args =
        warren_vmm::qemu::qemu_args(&spec, warren_vmm::qemu::Attach::Paths(&ep), backend.tsc_khz);
    let t = Instant::now();
    let mut child = tokio::process::Command::new(&backend.qemu)
        .args(&args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let restored = async {
        let _con = warren_supervisor::console::connect(&ep.console, Duration::from_secs(10)).await?;
        let mut q = loop {
            match Qmp::connect(&ep.control).await {
                Ok(q) => break q,
                Err(_) if t.elapsed() < Duration::from_secs(30) => {
                    tokio::time::sleep(Duration::from_millis(2)).await
                }
                Err(e) => return Err(anyhow::Error::from(e)),
            }
        };
        q.execute(
            "migrate-set-capabilities",
            Some(serde_json::json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]})),
        )
        .await?;
        q.execute(
            "migrate-incoming",
            Some(serde_json::json!({"uri": format!("file:{}", dir.join("state").display())})),
        )
        .await?;
        loop {
            let v = q.execute("query-migrate", None).await?;
            match v.get("status").and_then(|s| s.as_str()) {
                Some("completed") => break,
                Some("failed") => bail!("raw restore failed: {v}"),
                _ => tokio::time::sleep(Duration::from_millis(1)).await,
            }
        }
        q.resume().await?;
        Ok(t.elapsed().as_secs_f64() * 1000.0)
    }
    .await;
    let _ = child.start_kill();
    let _ = child.wait().await;
    let _ = std::fs::remove_dir_all(&run_dir);
    restored
}
