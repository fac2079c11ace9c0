//! Real-VM tests of file operations through the guest agent.

mod common;

use common::*;
use std::io::Write;
use std::process::Stdio;

fn write(vm: &TestVm, path: &str, data: &[u8]) -> std::process::Output {
    let mut c = vm
        .env
        .cmd()
        .args(["vm", "write", &vm.id, path])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    c.stdin
        .take()
        .expect("stdin")
        .write_all(data)
        .expect("write");
    c.wait_with_output().expect("wait")
}

#[test]
fn test_files_roundtrip_larger_than_chunk() {
    let vm = TestVm::boot();
    let data: Vec<u8> = (0..300 * 1024u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let out = write(&vm, "dir/sub/blob.bin", &data);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = vm.warren(&["vm", "read", &vm.id, "dir/sub/blob.bin"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout.len(), data.len());
    assert!(out.stdout == data, "content differs");
    // The guest sees the same bytes, owned by the unprivileged user.
    let r = vm.sh("wc -c < dir/sub/blob.bin; stat -c %u dir/sub/blob.bin");
    assert_eq!(r.stdout, format!("{}\n1000\n", data.len()));

    // A reader that goes away (`vm read | head`) ends the read quietly with the status of a
    // process SIGPIPE ended (141, as for `vm list | head`): the first write that fails stops
    // it, nothing more is asked of the guest (before, the whole file was still read, then the
    // CLI failed with "Broken pipe").
    let r = vm.sh("truncate -s 256M big.bin && echo ok");
    assert_eq!(r.stdout, "ok\n", "{}", r.stderr);
    let mut c = vm
        .env
        .cmd()
        .args(["vm", "read", &vm.id, "big.bin"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut head = [0u8; 4096];
    std::io::Read::read_exact(&mut c.stdout.take().expect("stdout"), &mut head).expect("head");
    assert_eq!(head, [0u8; 4096]);
    let started = std::time::Instant::now();
    let out = c.wait_with_output().expect("wait");
    eprintln!("vm read after its reader left: {:?}", started.elapsed());
    assert_eq!(
        out.status.code(),
        Some(141),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn test_files_escapes_refused() {
    let vm = TestVm::boot();
    vm.sh("ln -s /etc /workspace/etc-link; ln -s /etc/passwd /workspace/passwd-link");
    for bad in [
        "../etc/passwd",
        "/etc/passwd",
        "etc-link/passwd",
        "passwd-link",
        "a//b",
        "",
    ] {
        let out = vm.warren(&["vm", "read", &vm.id, bad]);
        assert_eq!(out.status.code(), Some(125), "read {bad:?} was allowed");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("invalid_argument") || err.contains("forbidden"),
            "read {bad:?}: {err}"
        );
    }
    let out = write(&vm, "etc-link/evil", b"x");
    assert_eq!(out.status.code(), Some(125));
    let r = vm.sh("test -e /etc/evil && echo present || echo absent");
    assert_eq!(r.stdout, "absent\n");
    let out = vm.warren(&["vm", "read", &vm.id, "missing.txt"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("not_found"));
}

#[test]
fn test_files_two_vms_disks_isolated() {
    let a = TestVm::boot();
    let b = TestVm::boot();
    let r = a.sh("echo only-a > /home/user/marker && cat /home/user/marker");
    assert_eq!(r.stdout, "only-a\n");
    let r = b.sh("cat /home/user/marker 2>/dev/null || echo absent");
    assert_eq!(r.stdout, "absent\n");
}
