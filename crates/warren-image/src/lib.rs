//! Guest images: recipes, builds, digests and the image store.
//!
//! An image is four read-only files under `<image_dir>/<image id>/`: the uncompressed PVH
//! `vmlinux`, a base `initramfs.cpio` (agent as `/init` plus the virtio/vsock/overlay modules),
//! the ext4 `rootfs.ext4` and the `manifest.json` whose SHA-256 is the image id.
//!
//! - [`recipe`]: recipe files (the built-in `minimal`, `dev`, `agents` are such files), strict
//!   parsing, the canonical description and its digest.
//! - [`agent_cli`]: a recipe's pinned npm packages (the agent CLIs): fetch, verify, unpack.
//! - [`browser`]: where the `agents` image keeps its browser block (the DevTools MCP server's
//!   wrapper and the agents' MCP configuration).
//! - [`python`]: a recipe's pinned Python wheels: fetched and verified on the host, installed
//!   offline.
//! - `chroot`: running a recipe's commands confined (namespaces, `/proc`, a minimal `/dev`).
//! - [`tree`]: working beneath a root tree that may hold hostile names (`openat2`).
//! - [`unpack`]: the untrusted-tar unpacker (OCI layers with whiteouts; `vm cp`).
//! - [`policy`]: the operator's image policy (keys, required attestations, version, expiry).
//! - [`oci`], [`pull`]: OCI registries (bounded, verified fetches) and pulling an image by
//!   digest into the store.
//! - [`trust`]: cosign-compatible signatures and DSSE attestations: verify, sign.
//! - [`build`]: debootstrap, kernel and module staging, rootfs creation (the slow part, cached).
//! - [`kernel`]: fetching the Debian cloud kernel, extracting `vmlinux`, module closure.
//! - [`initramfs`]: the newc cpio writer and the per-VM secret archive.
//! - [`digest`]: SHA-256 helpers, canonical JSON, file identities for cheap re-verification.
//! - [`store`]: the on-disk store: build cache, list, resolve, verify, remove.
#![forbid(unsafe_code)]

pub mod agent_cli;
pub mod browser;
pub mod build;
mod chroot;
mod command;
pub mod digest;
mod error;
pub mod initramfs;
pub mod kernel;
pub mod manifest;
pub mod oci;
pub mod policy;
pub mod pull;
pub mod python;
pub mod recipe;
pub mod store;
pub mod tree;
pub mod trust;
pub mod unpack;

pub use error::ImageError;
pub use initramfs::write_vm_initramfs;
pub use recipe::Recipe;
pub use store::{BuildProgress, ImageId, ImageInfo, ImageStore, VerifiedImage};
