//! QEMU and kernel command lines.

use crate::backend::{LaunchSpec, VmEndpoints};

/// The TAP device in a VM's network namespace.
pub const TAP_NAME: &str = "tap0";
/// The descriptor number the TAP device gets in the VMM.
pub const TAP_FD: i32 = 3;
/// Listening sockets Warren binds outside the VMM's reach and passes to it: serial console,
/// agent channel, QMP.
pub const CONSOLE_FD: i32 = 4;
pub const CHANNEL_FD: i32 = 5;
pub const QMP_FD: i32 = 6;
/// Share `i` (in `LaunchSpec::shares` order) is a vhost-user connection already made to its
/// virtiofsd, at descriptor `SHARE_FD_BASE + i`.
pub const SHARE_FD_BASE: i32 = 7;
/// A clone's RAM memfd (`LaunchSpec::clone_ram`), past the shares' descriptors.
pub const RAM_FD: i32 = SHARE_FD_BASE + 32;

/// How the VMM reaches its endpoints.
#[derive(Debug, Clone, Copy)]
pub enum Attach<'a> {
    /// Descriptors passed at launch (`CONSOLE_FD`, `CHANNEL_FD`, `QMP_FD`,
    /// `SHARE_FD_BASE`): what Warren's backend does, so nothing the supervisor connects to
    /// lives in a directory the VMM can write.
    Fds,
    /// Sockets QEMU itself creates at these paths (the raw-QEMU baseline of `warren bench`).
    Paths(&'a VmEndpoints),
}

/// The rate of QEMU's local APIC timer clock, emulated (TCG) or in KVM: one count per
/// nanosecond before the guest's divider.
pub const APIC_BUS_KHZ: u64 = 1_000_000;

/// Kernel arguments measured in PLATFORM.md: quiet console, no crypto self-tests, trusted TSC
/// and CPU RNG, one UART, no legacy keyboard probing, and always `tsc_early_khz`; plus the
/// APIC timer's clock, against which the agent checks the kernel's calibration of it.
pub fn kernel_cmdline(tsc_khz: u64, extra: &[String]) -> String {
    let mut s = String::from(
        "console=ttyS0 quiet loglevel=0 cryptomgr.notests no_timer_check tsc=reliable \
         random.trust_cpu=on 8250.nr_uarts=1 nowatchdog audit=0 panic=-1 \
         i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd",
    );
    s.push_str(&format!(
        " {}={APIC_BUS_KHZ}",
        warren_protocol::APIC_BUS_ARG
    ));
    if tsc_khz > 0 {
        s.push_str(&format!(" tsc_early_khz={tsc_khz}"));
    }
    for e in extra {
        s.push(' ');
        s.push_str(e);
    }
    s
}

/// The full QEMU argument list for `spec`.
pub fn qemu_args(spec: &LaunchSpec, attach: Attach<'_>, tsc_khz: u64) -> Vec<String> {
    // The chardev backend of each endpoint: `fd=` (Warren's listening socket) or `path=`.
    let server = |fd: i32, path: fn(&VmEndpoints) -> &std::path::Path| match attach {
        Attach::Fds => format!("fd={fd}"),
        Attach::Paths(ep) => format!("path={}", path(ep).display()),
    };
    let mut a: Vec<String> = Vec::new();
    let mut push = |xs: &[&str]| a.extend(xs.iter().map(|s| s.to_string()));
    push(&[
        "-name",
        &format!("warren-{},process=warren-{}", spec.name, spec.name),
    ]);
    if let Some(fr) = &spec.fork_ram {
        // The parent's saved pages, mapped privately at their offset in its checkpoint (opened
        // by the backend and passed at `RAM_FD`, its path kept off this command line): the
        // copy's writes stay its own, and it loads no page (`mapped_ram`). The block keeps the
        // parent's name, which the checkpoint's device state refers to.
        let id = if spec.named_ram {
            "mem"
        } else {
            super::mapped_ram::DEFAULT_RAM_ID
        };
        push(&[
            "-object",
            &format!(
                "memory-backend-file,id={id},size={}M,mem-path=/proc/self/fd/{RAM_FD},offset={},share=off,readonly=on,rom=off,x-use-canonical-path-for-ramblock-id=off",
                spec.memory.0,
                fr.offset
            ),
            "-M",
            &format!("microvm,acpi=on,memory-backend={id}"),
        ]);
    } else if let Some(ram) = &spec.template_ram {
        // A template's RAM file, mapped privately: the clone reads the template's pages and
        // its writes stay its own (`readonly=on`: the file is opened read-only; `rom=off`:
        // the guest may still write its private copy).
        push(&[
            "-object",
            &format!(
                "memory-backend-file,id=mem,size={}M,mem-path={},share=off,readonly=on,rom=off",
                spec.memory.0,
                ram.display()
            ),
            "-M",
            "microvm,acpi=on,memory-backend=mem",
        ]);
    } else if spec.clone_ram.is_some() {
        // The clone's own memfd holding the template's RAM, passed at `RAM_FD` and opened
        // again through /proc (QEMU takes a RAM file by path only).
        push(&[
            "-object",
            &format!(
                "memory-backend-file,id=mem,size={}M,mem-path=/proc/self/fd/{RAM_FD},share=on",
                spec.memory.0
            ),
            "-M",
            "microvm,acpi=on,memory-backend=mem",
        ]);
    } else if let Some(ram) = &spec.ram_file {
        // Guest RAM in a per-VM file (shared, so device backends can map it too).
        push(&[
            "-object",
            &format!(
                "memory-backend-file,id=mem,size={}M,mem-path={},share=on",
                spec.memory.0,
                ram.display()
            ),
            "-M",
            "microvm,acpi=on,memory-backend=mem",
        ]);
    } else if spec.shares.is_empty() && !spec.named_ram {
        push(&["-M", "microvm,acpi=on"]);
    } else if spec.shares.is_empty() {
        push(&[
            "-object",
            &format!("memory-backend-ram,id=mem,size={}M", spec.memory.0),
            "-M",
            "microvm,acpi=on,memory-backend=mem",
        ]);
    } else {
        // vhost-user devices need guest RAM the device backend can map: a shared memfd
        // (released with the process; hibernate still writes it into the checkpoint).
        push(&[
            "-object",
            &format!(
                "memory-backend-memfd,id=mem,size={}M,share=on",
                spec.memory.0
            ),
            "-M",
            "microvm,acpi=on,memory-backend=mem",
        ]);
    }
    push(&spec.accel.qemu_args());
    match (&spec.cpu, spec.accel) {
        (Some(model), _) => push(&["-cpu", model]),
        (None, crate::Accel::Kvm) => push(&["-cpu", "host"]),
        (None, crate::Accel::Tcg) => {}
    }
    push(&[
        "-bios",
        super::QBOOT,
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
    ]);
    push(&[
        "-m",
        &spec.memory.0.to_string(),
        "-smp",
        &spec.vcpus.to_string(),
    ]);
    push(&[
        "-kernel",
        &spec.kernel.display().to_string(),
        "-initrd",
        &spec.initramfs.display().to_string(),
        "-append",
        &kernel_cmdline(tsc_khz, &spec.extra_cmdline),
    ]);
    push(&[
        "-chardev",
        &format!(
            "socket,id=con,{},server=on,wait=on",
            server(CONSOLE_FD, |e| &e.console)
        ),
        "-serial",
        "chardev:con",
    ]);
    push(&[
        "-device",
        "virtio-serial-device",
        "-chardev",
        &format!(
            "socket,id=agent,{},server=on,wait=off",
            server(CHANNEL_FD, |e| &e.channel)
        ),
        "-device",
        "virtserialport,chardev=agent,name=org.warren.agent.0",
    ]);
    if let Some(path) = &spec.bench_port {
        // The raw-port baseline: the same device and chardev kind, no protocol on it.
        push(&[
            "-chardev",
            &format!("socket,id=bench,path={},server=on,wait=off", path.display()),
            "-device",
            "virtserialport,chardev=bench,name=org.warren.bench.0",
        ]);
    }
    push(&[
        "-drive",
        &format!(
            "id=root,file={},format=qcow2,if=none,discard=unmap",
            spec.disk.display()
        ),
        "-device",
        "virtio-blk-device,drive=root",
    ]);
    for (i, share) in spec.shares.iter().enumerate() {
        let id = format!("fs-{}", share.tag);
        let conn = match attach {
            Attach::Fds => format!("fd={}", SHARE_FD_BASE + i as i32),
            Attach::Paths(_) => format!(
                "path={}",
                super::virtiofs::socket_path(&spec.run_dir, &share.tag).display()
            ),
        };
        push(&[
            "-chardev",
            &format!("socket,id={id},{conn}"),
            "-device",
            &format!("vhost-user-fs-device,chardev={id},tag={}", share.tag),
        ]);
    }
    if let Some(net) = &spec.network {
        push(&[
            "-netdev",
            &format!("tap,id=net0,fd={TAP_FD},vhost=off"),
            "-device",
            &format!("virtio-net-device,netdev=net0,mac={}", net.mac),
        ]);
    }
    push(&[
        "-chardev",
        &format!(
            "socket,id=qmp,{},server=on,wait=off",
            server(QMP_FD, |e| &e.control)
        ),
        "-mon",
        "chardev=qmp,mode=control",
    ]);
    if spec.incoming {
        push(&["-incoming", "defer"]);
    }
    // QEMU's seccomp filter: no obsolete syscalls, no privilege changes, no fork/exec,
    // no scheduler/resource tweaks.
    push(&[
        "-sandbox",
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
    ]);
    a
}

/// The CPU model a new VM gets: `host` under KVM; under TCG `max` without ERMS and FSRM
/// ([`TCG_CPU`]).
pub fn default_cpu(accel: crate::Accel) -> &'static str {
    match accel {
        crate::Accel::Kvm => "host",
        crate::Accel::Tcg => TCG_CPU,
    }
}

/// The TCG CPU model. `max` (every feature TCG emulates), because QEMU's default TCG model
/// (qemu64) lacks SSSE3, SSE4, POPCNT and AVX, so binaries built for newer x86-64 levels die
/// with SIGILL (the Bun-built Claude Code and opencode CLIs of the agents image). Minus the
/// "enhanced/fast `rep movsb`" bits: with them the guest kernel copies and clears memory
/// (socket and pipe copies, `copy_from_user`, every zeroed page) with `rep movsb`/`rep stosb`,
/// which TCG runs one byte per iteration, and glibc uses `rep movsb` for large `memcpy`s.
/// Without them both use 8-byte or vector moves: `warren bench --suite streams` measured the
/// guest's own loopback TCP 0.3 -> 0.9 GB/s, the raw port guest->host 3x, streams and `vm cp`
/// about 2x. A VM keeps the model it was created with (its checkpoints need it).
pub const TCG_CPU: &str = "max,-erms,-fsrm";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MemMib;
    use crate::Accel;
    use std::path::PathBuf;

    fn spec() -> LaunchSpec {
        LaunchSpec {
            name: "t".into(),
            run_dir: PathBuf::from("/r"),
            stderr_log: PathBuf::from("/l"),
            kernel: PathBuf::from("/k"),
            initramfs: PathBuf::from("/i"),
            disk: PathBuf::from("/d.qcow2"),
            memory: MemMib(512),
            vcpus: 1,
            accel: Accel::Tcg,
            cpu: Some(default_cpu(Accel::Tcg).into()),
            extra_cmdline: vec![],
            run_as: None,
            cgroup: None,
            incoming: false,
            shares: vec![],
            virtiofsd: None,
            ram_file: None,
            network: None,
            bench_port: None,
            view_readable: vec![],
            template_ram: None,
            clone_ram: None,
            fork_ram: None,
            named_ram: false,
            groups: vec![],
        }
    }

    #[test]
    fn test_qemu_args_template_ram_private_readonly_file() {
        let mut sp = spec();
        sp.template_ram = Some(PathBuf::from("/t/template.ram"));
        let s = qemu_args(&sp, Attach::Fds, 1).join(" ");
        assert!(
            s.contains("memory-backend-file,id=mem,size=512M,mem-path=/t/template.ram,share=off,readonly=on,rom=off"),
            "{s}"
        );
        assert!(s.contains("microvm,acpi=on,memory-backend=mem"), "{s}");
        let mut resumed = spec();
        resumed.named_ram = true;
        let s = qemu_args(&resumed, Attach::Fds, 1).join(" ");
        assert!(s.contains("memory-backend-ram,id=mem,size=512M"), "{s}");
        assert!(s.contains("memory-backend=mem"), "{s}");
    }

    #[test]
    fn test_qemu_args_fork_ram_private_mapping_at_offset_under_the_parents_block_name() {
        let mut sp = spec();
        sp.fork_ram = Some(crate::backend::ForkRam {
            path: PathBuf::from("/f/state"),
            offset: 1 << 20,
        });
        let s = qemu_args(&sp, Attach::Fds, 1).join(" ");
        assert!(
            s.contains("memory-backend-file,id=microvm.ram,size=512M,mem-path=/proc/self/fd/39,offset=1048576,share=off,readonly=on,rom=off"),
            "{s}"
        );
        assert!(
            !s.contains("/f/state"),
            "the path stays off the command line: {s}"
        );
        assert!(
            s.contains("microvm,acpi=on,memory-backend=microvm.ram"),
            "{s}"
        );
        sp.named_ram = true;
        let s = qemu_args(&sp, Attach::Fds, 1).join(" ");
        assert!(s.contains("memory-backend-file,id=mem,"), "{s}");
        assert!(s.contains("memory-backend=mem"), "{s}");
    }

    #[test]
    fn test_qemu_args_clone_ram_shared_file_under_the_template_block_name() {
        let mut sp = spec();
        sp.clone_ram = Some(PathBuf::from("/t/template.ram"));
        sp.shares = vec![crate::backend::Share {
            tag: "fs0".into(),
            host_dir: PathBuf::from("/s"),
            read_only: false,
            owner: None,
            identity: None,
        }];
        let s = qemu_args(&sp, Attach::Fds, 1).join(" ");
        assert!(
            s.contains("memory-backend-file,id=mem,size=512M,mem-path=/proc/self/fd/39,share=on"),
            "{s}"
        );
        assert!(!s.contains("memory-backend-memfd"), "{s}");
        assert!(
            !s.contains("template.ram"),
            "the template's file is never QEMU's: {s}"
        );
    }

    #[test]
    fn test_qemu_args_tcg_fast_boot_recipe() {
        let a = qemu_args(&spec(), Attach::Fds, 2445406);
        let s = a.join(" ");
        assert!(s.contains("-M microvm,acpi=on"));
        assert!(s.contains("-bios /usr/share/qemu/qboot.rom"));
        assert!(s.contains("tsc_early_khz=2445406"));
        assert!(s.contains("-sandbox on,"));
        assert!(s.contains("name=org.warren.agent.0"));
        assert!(!s.contains("-cpu host"));
        assert!(
            s.contains("-cpu max,-erms,-fsrm "),
            "TCG guests get every emulated CPU feature but byte-wise rep moves: {s}"
        );
        // A VM created with the plain `max` model keeps it (its checkpoints need it).
        let mut older = spec();
        older.cpu = Some("max".into());
        let o = qemu_args(&older, Attach::Fds, 1).join(" ");
        assert!(o.contains("-cpu max ") && !o.contains("erms"), "{o}");
        // A VM created before Warren chose a model keeps QEMU's default, so its
        // checkpoints still load.
        let mut legacy = spec();
        legacy.cpu = None;
        let old = qemu_args(&legacy, Attach::Fds, 2_000_000).join(" ");
        assert!(!old.contains("-cpu"), "{old}");
        assert!(!s.contains("-netdev"), "no NIC without network");
        assert!(
            !s.contains("org.warren.bench"),
            "no bench port in a normal VM"
        );
        let mut bench = spec();
        bench.bench_port = Some(PathBuf::from("/r/bench.sock"));
        let b = qemu_args(&bench, Attach::Fds, 1).join(" ");
        assert!(
            b.contains("socket,id=bench,path=/r/bench.sock,server=on,wait=off")
                && b.contains("virtserialport,chardev=bench,name=org.warren.bench.0"),
            "{b}"
        );
    }

    #[test]
    fn test_qemu_args_endpoints_are_passed_descriptors() {
        let mut sp = spec();
        sp.shares = vec![crate::backend::Share {
            tag: "ws0".into(),
            host_dir: PathBuf::from("/tmp"),
            read_only: false,
            owner: None,
            identity: None,
        }];
        let s = qemu_args(&sp, Attach::Fds, 1).join(" ");
        assert!(s.contains("socket,id=con,fd=4,server=on,wait=on"), "{s}");
        assert!(s.contains("socket,id=agent,fd=5,server=on,wait=off"), "{s}");
        assert!(s.contains("socket,id=qmp,fd=6,server=on,wait=off"), "{s}");
        assert!(s.contains("socket,id=fs-ws0,fd=7"), "{s}");
        assert!(!s.contains("path="), "no endpoint by path: {s}");
        assert!(!s.contains("-qmp"), "{s}");
    }

    #[test]
    fn test_qemu_args_network_tap_fd() {
        let mut sp = spec();
        sp.network = Some(crate::backend::NetSpec {
            netns: "warren-x".into(),
            mac: "52:54:00:12:34:56".into(),
            upstream_dns: "203.0.113.53:53".parse().expect("addr"),
            outbound_netns: None,
            allow: vec![],
            deny: vec![],
            secrets: vec![],
            upstream_roots: None,
            intercepts: vec![],
            blocked_cidrs: vec![],
            intercept_all_tls: false,
            mode: Default::default(),
            host_ca_store: false,
            secret_headers: vec![],
        });
        let s = qemu_args(&sp, Attach::Fds, 1).join(" ");
        assert!(s.contains("-netdev tap,id=net0,fd=3,vhost=off"));
        assert!(s.contains("virtio-net-device,netdev=net0,mac=52:54:00:12:34:56"));
    }

    #[test]
    fn test_kernel_cmdline_no_secret_material() {
        // The per-VM secret travels in the initramfs, never on the world-readable cmdline.
        let c = kernel_cmdline(1, &[]);
        assert!(!c.contains("secret"));
    }

    #[test]
    fn test_kernel_cmdline_names_the_apic_timer_clock() {
        // The agent checks the kernel's calibration against it (`warren-guest` `clock`).
        let c = kernel_cmdline(1, &[]);
        assert!(c.contains(" warren.apic_bus_khz=1000000"), "{c}");
    }
}
