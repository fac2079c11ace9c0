//! Image recipes: what each named image contains, and the canonical description whose digest
//! keys the build caches.
//!
//! Invariant: everything that changes the bytes of a built image (suite, packages, sizes,
//! kernel package, module list, pinned agent CLIs, builder logic version) is part of
//! [`Recipe::description`], so an unchanged digest means the cached stage can be reused.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::agent_cli::{NpmAgentCli, AGENT_CLIS};
use crate::digest;
use crate::ImageError;

/// Bump whenever the build logic changes what ends up in an image.
pub const BUILDER_FORMAT: u32 = 1;

/// Debian suite all recipes are built from.
pub const SUITE: &str = "trixie";

/// Debian mirror used by debootstrap and apt inside the chroot.
pub const MIRROR: &str = "http://deb.debian.org/debian";

/// The metapackage that points at the current cloud kernel of the suite.
pub const KERNEL_METAPACKAGE: &str = "linux-image-cloud-amd64";

/// Modules the guest agent loads, in load order (dependencies are added by the builder;
/// modules built into the kernel are skipped).
pub const AGENT_MODULES: &[&str] = &[
    "virtio_mmio",
    "virtio_blk",
    "failover",
    "net_failover",
    "virtio_net",
    "vsock",
    "vmw_vsock_virtio_transport_common",
    "vmw_vsock_virtio_transport",
    "overlay",
    "fuse",
    "virtiofs",
];

/// UID and GID of the unprivileged guest user `user`.
pub const USER_ID: u32 = 1000;

const GIB: u64 = 1024 * 1024 * 1024;

/// A named image recipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Recipe {
    /// debootstrap minbase only: small and fast, for tests.
    Minimal,
    /// A development image: compilers, python3 with pip and venv, git, Node.js with npm and
    /// the command-line tools agents reach for (curl, jq, ripgrep, fd, ...).
    Dev,
    /// `dev` plus the agent CLIs (Claude Code, Codex, opencode): their native binaries from
    /// the npm registry, pinned in [`AGENT_CLIS`].
    Agents,
}

/// DEV's packages.
const DEV_PACKAGES: &[&str] = &[
    "bash",
    "coreutils",
    "python3",
    "git",
    "gcc",
    "build-essential",
    "nodejs",
    "npm",
    "ca-certificates",
    // What agents reach for first.
    "curl",
    "wget",
    "jq",
    "ripgrep",
    "fd-find",
    "zip",
    "unzip",
    "xz-utils",
    "openssh-client",
    "less",
    "procps",
    "file",
    "make",
    "python3-pip",
    "python3-venv",
];

/// DEV's links `(link, target)`: Debian's `fd-find` installs `fdfind`, agents call `fd`.
const DEV_LINKS: &[(&str, &str)] = &[("/usr/local/bin/fd", "/usr/bin/fdfind")];

/// The canonical, hashed description of a recipe (the agent is hashed separately).
#[derive(Debug, Clone, Serialize)]
pub struct RecipeDescription {
    pub builder_format: u32,
    pub name: &'static str,
    pub suite: &'static str,
    pub mirror: &'static str,
    pub variant: &'static str,
    pub packages: Vec<&'static str>,
    pub rootfs_size: u64,
    pub kernel_package: &'static str,
    pub modules: Vec<&'static str>,
    pub user_id: u32,
    /// Pinned npm packages of the agent CLIs. Left out when empty, so recipes without them
    /// keep the digests they had before the field existed.
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub agent_clis: &'static [NpmAgentCli],
    /// Symbolic links `(link, target)` made in the root tree after the packages. Left out
    /// when empty, like `agent_clis`.
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub links: &'static [(&'static str, &'static str)],
}

impl Recipe {
    /// Every recipe, in display order.
    pub const ALL: [Recipe; 3] = [Recipe::Minimal, Recipe::Dev, Recipe::Agents];

    /// The recipe's name as used on the command line and in manifests.
    pub fn name(self) -> &'static str {
        match self {
            Recipe::Minimal => "minimal",
            Recipe::Dev => "dev",
            Recipe::Agents => "agents",
        }
    }

    /// Packages installed on top of `debootstrap --variant=minbase`.
    pub fn packages(self) -> &'static [&'static str] {
        match self {
            Recipe::Minimal => &[],
            Recipe::Dev | Recipe::Agents => DEV_PACKAGES,
        }
    }

    /// Symbolic links `(link, target)` made after the packages are installed.
    pub fn links(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Recipe::Minimal => &[],
            Recipe::Dev | Recipe::Agents => DEV_LINKS,
        }
    }

    /// Agent CLIs installed from the npm registry into `/usr/local/bin`.
    pub fn agent_clis(self) -> &'static [NpmAgentCli] {
        match self {
            Recipe::Minimal | Recipe::Dev => &[],
            Recipe::Agents => AGENT_CLIS,
        }
    }

    /// Virtual size of the ext4 root disk in bytes (the file is sparse).
    pub fn rootfs_size(self) -> u64 {
        match self {
            Recipe::Minimal => 2 * GIB,
            Recipe::Dev => 4 * GIB,
            // The agent CLIs' binaries add ~1.1 GiB.
            Recipe::Agents => 6 * GIB,
        }
    }

    /// The canonical description hashed into the stage digest.
    pub fn description(self) -> RecipeDescription {
        RecipeDescription {
            builder_format: BUILDER_FORMAT,
            name: self.name(),
            suite: SUITE,
            mirror: MIRROR,
            variant: "minbase",
            packages: self.packages().to_vec(),
            rootfs_size: self.rootfs_size(),
            kernel_package: KERNEL_METAPACKAGE,
            modules: AGENT_MODULES.to_vec(),
            user_id: USER_ID,
            agent_clis: self.agent_clis(),
            links: self.links(),
        }
    }

    /// Digest of the recipe alone: keys the expensive stage (rootfs, kernel, modules).
    pub fn stage_digest(self) -> String {
        digest::sha256_hex(&digest::canonical_json(&self.description()))
    }

    /// Digest of the recipe plus the agent binary's SHA-256: keys the finished image.
    pub fn recipe_digest(self, agent_sha256: &str) -> String {
        #[derive(Serialize)]
        struct Full<'a> {
            recipe: RecipeDescription,
            agent_sha256: &'a str,
        }
        digest::sha256_hex(&digest::canonical_json(&Full {
            recipe: self.description(),
            agent_sha256,
        }))
    }
}

impl fmt::Display for Recipe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Recipe {
    type Err = ImageError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Recipe::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| ImageError::UnknownRecipe(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_recipe_parse_display_roundtrip() {
        for r in Recipe::ALL {
            assert_eq!(r.to_string().parse::<Recipe>().ok(), Some(r));
        }
        assert!("bogus".parse::<Recipe>().is_err());
    }

    #[test]
    fn test_recipe_digest_agent_changes_digest() {
        let a = Recipe::Minimal.recipe_digest(&"a".repeat(64));
        let b = Recipe::Minimal.recipe_digest(&"b".repeat(64));
        assert_ne!(a, b);
        assert_eq!(a, Recipe::Minimal.recipe_digest(&"a".repeat(64)));
        assert_ne!(Recipe::Minimal.stage_digest(), Recipe::Dev.stage_digest());
        assert_ne!(Recipe::Dev.stage_digest(), Recipe::Agents.stage_digest());
    }

    #[test]
    fn test_description_agent_clis_only_in_agents_recipe() {
        let dev =
            String::from_utf8(digest::canonical_json(&Recipe::Dev.description())).expect("utf-8");
        assert!(!dev.contains("agent_clis"), "{dev}");
        let agents = String::from_utf8(digest::canonical_json(&Recipe::Agents.description()))
            .expect("utf-8");
        for cli in AGENT_CLIS {
            assert!(agents.contains(cli.integrity), "{agents}");
            assert!(agents.contains(cli.version), "{agents}");
        }
    }
}
