//! Guest images: recipes, builds, digests and the image store.
//!
//! An image is four read-only files under `<image_dir>/<image id>/`: the uncompressed PVH
//! `vmlinux`, a base `initramfs.cpio` (agent as `/init` plus the virtio/vsock/overlay modules),
//! the ext4 `rootfs.ext4` and the `manifest.json` whose SHA-256 is the image id.
//!
//! - [`recipe`]: what goes into an image (`minimal`, `dev`, `agents`) and its canonical digest.
//! - [`agent_cli`]: the agent CLIs' pinned npm packages: fetch, verify, unpack.
//! - [`build`]: debootstrap, kernel and module staging, rootfs creation (the slow part, cached).
//! - [`kernel`]: fetching the Debian cloud kernel, extracting `vmlinux`, module closure.
//! - [`initramfs`]: the newc cpio writer and the per-VM secret archive.
//! - [`digest`]: SHA-256 helpers, canonical JSON, file identities for cheap re-verification.
//! - [`store`]: the on-disk store: build cache, list, resolve, verify, remove.
#![forbid(unsafe_code)]

pub mod agent_cli;
pub mod build;
mod command;
pub mod digest;
mod error;
pub mod initramfs;
pub mod kernel;
pub mod manifest;
pub mod recipe;
pub mod store;

pub use error::ImageError;
pub use initramfs::write_vm_initramfs;
pub use recipe::Recipe;
pub use store::{BuildProgress, ImageId, ImageInfo, ImageStore, VerifiedImage};
