//! The guest kernel: fetching Debian's cloud kernel package, extracting the uncompressed PVH
//! `vmlinux` from its bzImage, and computing the module set the agent loads.
//!
//! Steps, all run by the builder thread:
//! 1. `apt-cache depends` on the metapackage inside the debootstrapped chroot names the
//!    versioned package; `apt-get download` fetches it (only Debian's registry is used, and
//!    the package is never installed into the rootfs).
//! 2. `dpkg-deb -x` unpacks it into the build directory.
//! 3. The bzImage's payload (zstd on 6.12) is decompressed with `ruzstd` from its magic; the
//!    result must be an ELF with a Xen PVH entry note (QEMU's direct `-kernel` boot needs it).
//! 4. `depmod -b` builds `modules.dep`; the requested modules plus their dependencies are
//!    ordered so every module follows its dependencies. Built-in modules are skipped.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::command::run_output;
use crate::ImageError;

const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];
const ELF_MAGIC: [u8; 4] = [0x7f, b'E', b'L', b'F'];
/// `XEN_ELFNOTE_PHYS32_ENTRY`: the PVH entry point note.
const XEN_ELFNOTE_PHYS32_ENTRY: u32 = 18;

/// Returns true for names apt/dpkg accept as package names (used before passing a name that
/// came from apt's output into a shell command line).
fn is_package_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "+-.".contains(c))
}

/// Resolves `metapackage` to the versioned kernel package it depends on, using apt inside the
/// chroot at `root` (whose package lists debootstrap left in place).
pub fn resolve_kernel_package(root: &Path, metapackage: &str) -> Result<String, ImageError> {
    let mut cmd = Command::new("chroot");
    cmd.arg(root).args(["apt-cache", "depends", metapackage]);
    let out = run_output(cmd)?.map_err(|f| {
        ImageError::KernelFetch(format!("apt-cache depends {metapackage}: {}", f.log_tail))
    })?;
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("Depends:"))
        .map(str::trim)
        .find(|p| p.starts_with("linux-image-") && is_package_name(p))
        .map(str::to_string)
        .ok_or_else(|| {
            ImageError::KernelFetch(format!("{metapackage} depends on no linux-image package"))
        })
}

/// Downloads `package` with apt inside the chroot and moves the `.deb` to `dest_dir`.
pub fn download_package(
    root: &Path,
    package: &str,
    dest_dir: &Path,
) -> Result<PathBuf, ImageError> {
    if !is_package_name(package) {
        return Err(ImageError::KernelFetch(format!(
            "bad package name {package:?}"
        )));
    }
    let inner = Path::new("var/tmp/warren-kernel");
    let host_dir = root.join(inner);
    std::fs::create_dir_all(&host_dir).map_err(ImageError::io("create", &host_dir))?;
    let mut cmd = Command::new("chroot");
    cmd.arg(root).args([
        "sh",
        "-c",
        &format!("cd /{} && apt-get -q download {package}", inner.display()),
    ]);
    run_output(cmd)?.map_err(|f| {
        ImageError::KernelFetch(format!("apt-get download {package}: {}", f.log_tail))
    })?;
    let entries = std::fs::read_dir(&host_dir).map_err(ImageError::io("read dir", &host_dir))?;
    let mut deb = None;
    for e in entries {
        let e = e.map_err(ImageError::io("read dir", &host_dir))?;
        if e.file_name().to_string_lossy().ends_with(".deb") {
            deb = Some(e.path());
        }
    }
    let deb = deb.ok_or_else(|| ImageError::KernelFetch(format!("no .deb for {package}")))?;
    let dest = dest_dir.join(deb.file_name().unwrap_or_default());
    std::fs::rename(&deb, &dest).map_err(ImageError::io("move", &deb))?;
    std::fs::remove_dir_all(&host_dir).map_err(ImageError::io("remove", &host_dir))?;
    Ok(dest)
}

/// Unpacks a `.deb` into `dest` with `dpkg-deb -x`.
pub fn unpack_deb(deb: &Path, dest: &Path) -> Result<(), ImageError> {
    let mut cmd = Command::new("dpkg-deb");
    cmd.arg("-x").arg(deb).arg(dest);
    run_output(cmd)?
        .map_err(|f| ImageError::KernelExtract(format!("dpkg-deb -x: {}", f.log_tail)))?;
    Ok(())
}

/// An unpacked kernel package.
#[derive(Debug, Clone)]
pub struct UnpackedKernel {
    /// `uname -r` of the kernel, e.g. `6.12.117+deb13-cloud-amd64`.
    pub release: String,
    /// The compressed bzImage (`boot/vmlinuz-<release>`).
    pub bzimage: PathBuf,
    /// `usr/lib/modules/<release>` (or `lib/modules/<release>`).
    pub modules_dir: PathBuf,
    /// The directory `depmod -b` must be given so that it finds `modules_dir`.
    pub depmod_base: PathBuf,
}

/// Finds the kernel release, bzImage and module tree inside an unpacked package.
pub fn locate(unpacked: &Path) -> Result<UnpackedKernel, ImageError> {
    let boot = unpacked.join("boot");
    let entries = std::fs::read_dir(&boot).map_err(ImageError::io("read dir", &boot))?;
    let mut release = None;
    for e in entries {
        let e = e.map_err(ImageError::io("read dir", &boot))?;
        if let Some(r) = e.file_name().to_string_lossy().strip_prefix("vmlinuz-") {
            release = Some(r.to_string());
        }
    }
    let release =
        release.ok_or_else(|| ImageError::KernelExtract("no boot/vmlinuz-* in package".into()))?;
    for base in [unpacked.join("usr"), unpacked.to_path_buf()] {
        let modules_dir = base.join("lib/modules").join(&release);
        if modules_dir.is_dir() {
            return Ok(UnpackedKernel {
                bzimage: boot.join(format!("vmlinuz-{release}")),
                release,
                modules_dir,
                depmod_base: base,
            });
        }
    }
    Err(ImageError::KernelExtract(format!(
        "no module tree for {release}"
    )))
}

/// Extracts the uncompressed ELF `vmlinux` from a zstd-compressed bzImage.
pub fn extract_vmlinux(bzimage: &[u8]) -> Result<Vec<u8>, ImageError> {
    use std::io::Read;
    let start = bzimage
        .windows(4)
        .position(|w| w == ZSTD_MAGIC)
        .ok_or_else(|| ImageError::KernelExtract("no zstd payload in bzImage".into()))?;
    let mut input = &bzimage[start..];
    let mut decoder = ruzstd::decoding::StreamingDecoder::new(&mut input)
        .map_err(|e| ImageError::KernelExtract(format!("zstd frame header: {e}")))?;
    let mut out = Vec::with_capacity(64 << 20);
    decoder
        .read_to_end(&mut out)
        .map_err(|e| ImageError::KernelExtract(format!("zstd decode: {e}")))?;
    if out.get(..4) != Some(&ELF_MAGIC[..]) {
        return Err(ImageError::KernelExtract(
            "decompressed payload is not an ELF".into(),
        ));
    }
    if !has_pvh_note(&out) {
        return Err(ImageError::KernelExtract(
            "vmlinux has no PVH entry note (CONFIG_PVH)".into(),
        ));
    }
    Ok(out)
}

/// True when a 64-bit little-endian ELF has a `Xen` note of type PHYS32_ENTRY in a PT_NOTE
/// segment.
pub fn has_pvh_note(elf: &[u8]) -> bool {
    let u16_at = |o: usize| elf.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |o: usize| {
        elf.get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |o: usize| {
        elf.get(o..o + 8).map(|b| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            u64::from_le_bytes(a)
        })
    };
    // ELFCLASS64, little endian.
    if elf.get(4) != Some(&2) || elf.get(5) != Some(&1) {
        return false;
    }
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38))
    else {
        return false;
    };
    for i in 0..usize::from(phnum) {
        let ph = phoff as usize + i * usize::from(phentsize);
        let (Some(ptype), Some(off), Some(size)) = (u32_at(ph), u64_at(ph + 8), u64_at(ph + 0x20))
        else {
            return false;
        };
        if ptype != 4 {
            continue;
        }
        let (mut p, end) = (off as usize, (off + size) as usize);
        while p + 12 <= end {
            let (Some(namesz), Some(descsz), Some(ntype)) =
                (u32_at(p), u32_at(p + 4), u32_at(p + 8))
            else {
                return false;
            };
            let name = elf.get(p + 12..p + 12 + namesz as usize);
            if ntype == XEN_ELFNOTE_PHYS32_ENTRY && name == Some(b"Xen\0") {
                return true;
            }
            p += 12 + (namesz as usize).div_ceil(4) * 4 + (descsz as usize).div_ceil(4) * 4;
        }
    }
    false
}

/// Runs `depmod -b` so `modules.dep` exists for the unpacked tree.
pub fn depmod(kernel: &UnpackedKernel) -> Result<(), ImageError> {
    let mut cmd = Command::new("depmod");
    cmd.arg("-b").arg(&kernel.depmod_base).arg(&kernel.release);
    run_output(cmd)?.map_err(|f| ImageError::Modules(format!("depmod: {}", f.log_tail)))?;
    Ok(())
}

/// Module name of a path in `modules.dep` / `modules.builtin`: basename without `.ko*`, with
/// `-` normalised to `_` as the kernel does.
fn module_name(path: &str) -> String {
    let base = path.rsplit('/').next().unwrap_or(path);
    let stem = base.split(".ko").next().unwrap_or(base);
    stem.replace('-', "_")
}

/// Computes the load order for `wanted` from the text of `modules.dep` and `modules.builtin`.
/// Returns module paths relative to the module directory; every module comes after all its
/// dependencies, and the order of `wanted` is otherwise kept. Built-in modules are skipped;
/// a module that is neither built in nor in `modules.dep` is an error.
pub fn load_order(
    modules_dep: &str,
    modules_builtin: &str,
    wanted: &[&str],
) -> Result<Vec<String>, ImageError> {
    let mut deps: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
    for line in modules_dep.lines() {
        let Some((path, rest)) = line.split_once(':') else {
            continue;
        };
        let path = path.trim().to_string();
        let list = rest.split_whitespace().map(str::to_string).collect();
        deps.insert(module_name(&path), (path, list));
    }
    let builtin: BTreeSet<String> = modules_builtin.lines().map(module_name).collect();

    let mut order = Vec::new();
    let mut seen = BTreeSet::new();
    for want in wanted {
        let name = module_name(want);
        if !deps.contains_key(&name) {
            if builtin.contains(&name) {
                continue;
            }
            return Err(ImageError::Modules(format!(
                "module {want} is neither built in nor in modules.dep"
            )));
        }
        visit(&name, &deps, &mut seen, &mut BTreeSet::new(), &mut order)?;
    }
    Ok(order)
}

fn visit(
    name: &str,
    deps: &BTreeMap<String, (String, Vec<String>)>,
    seen: &mut BTreeSet<String>,
    stack: &mut BTreeSet<String>,
    order: &mut Vec<String>,
) -> Result<(), ImageError> {
    if seen.contains(name) {
        return Ok(());
    }
    if !stack.insert(name.to_string()) {
        return Err(ImageError::Modules(format!("dependency cycle at {name}")));
    }
    let (path, list) = deps.get(name).ok_or_else(|| {
        ImageError::Modules(format!("dependency {name} missing from modules.dep"))
    })?;
    // modules.dep lists dependencies so that the last one must load first.
    for dep in list.iter().rev() {
        visit(&module_name(dep), deps, seen, stack, order)?;
    }
    stack.remove(name);
    seen.insert(name.to_string());
    order.push(path.clone());
    Ok(())
}

/// Reads a module file and returns the plain `.ko` bytes (decompressing `.ko.xz`/`.ko.zst`).
pub fn read_module_plain(path: &Path) -> Result<Vec<u8>, ImageError> {
    let raw = std::fs::read(path).map_err(ImageError::io("read", path))?;
    let name = path.to_string_lossy();
    let plain = if name.ends_with(".ko.xz") {
        let mut out = Vec::new();
        lzma_rs::xz_decompress(&mut raw.as_slice(), &mut out)
            .map_err(|e| ImageError::Modules(format!("xz {name}: {e}")))?;
        out
    } else if name.ends_with(".ko.zst") {
        use std::io::Read;
        let mut input = raw.as_slice();
        let mut dec = ruzstd::decoding::StreamingDecoder::new(&mut input)
            .map_err(|e| ImageError::Modules(format!("zstd {name}: {e}")))?;
        let mut out = Vec::new();
        dec.read_to_end(&mut out)
            .map_err(|e| ImageError::Modules(format!("zstd {name}: {e}")))?;
        out
    } else {
        raw
    };
    if plain.get(..4) != Some(&ELF_MAGIC[..]) {
        return Err(ImageError::Modules(format!("{name} is not an ELF module")));
    }
    Ok(plain)
}

/// File name a module gets in the initramfs: `<name>.ko`.
pub fn plain_file_name(dep_path: &str) -> String {
    let base = dep_path.rsplit('/').next().unwrap_or(dep_path);
    let stem = base.split(".ko").next().unwrap_or(base);
    format!("{stem}.ko")
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEP: &str = "\
kernel/fs/overlayfs/overlay.ko.xz:
kernel/drivers/virtio/virtio_mmio.ko.xz:
kernel/drivers/block/virtio_blk.ko.xz:
kernel/drivers/net/virtio_net.ko.xz: kernel/drivers/net/net_failover.ko.xz kernel/net/core/failover.ko.xz
kernel/drivers/net/net_failover.ko.xz: kernel/net/core/failover.ko.xz
kernel/net/core/failover.ko.xz:
kernel/net/vmw_vsock/vsock.ko.xz:
kernel/net/vmw_vsock/vmw_vsock_virtio_transport.ko.xz: kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko.xz kernel/net/vmw_vsock/vsock.ko.xz
kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko.xz: kernel/net/vmw_vsock/vsock.ko.xz
";
    const BUILTIN: &str = "kernel/drivers/virtio/virtio.ko\nkernel/drivers/virtio/virtio_ring.ko\n";

    #[test]
    fn test_load_order_deps_first_builtin_skipped() {
        let order = load_order(
            DEP,
            BUILTIN,
            &[
                "virtio",
                "virtio_mmio",
                "virtio_net",
                "vmw_vsock_virtio_transport",
                "overlay",
            ],
        )
        .expect("order");
        let names: Vec<String> = order.iter().map(|p| module_name(p)).collect();
        assert_eq!(
            names,
            [
                "virtio_mmio",
                "failover",
                "net_failover",
                "virtio_net",
                "vsock",
                "vmw_vsock_virtio_transport_common",
                "vmw_vsock_virtio_transport",
                "overlay"
            ]
        );
    }

    #[test]
    fn test_load_order_unknown_module_fails() {
        assert!(load_order(DEP, BUILTIN, &["nonexistent"]).is_err());
    }

    #[test]
    fn test_plain_file_name_strips_compression() {
        assert_eq!(
            plain_file_name("kernel/fs/overlayfs/overlay.ko.xz"),
            "overlay.ko"
        );
    }

    #[test]
    fn test_extract_vmlinux_non_zstd_rejected() {
        assert!(extract_vmlinux(b"MZ not a kernel").is_err());
    }
}
