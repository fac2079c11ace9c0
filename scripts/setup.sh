#!/usr/bin/env bash
# Installs what Warren drives on a Debian 12 (bookworm) or 13 (trixie) host, then builds the
# warren binary and the static guest agent. Idempotent; run as root (or with sudo available).
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

need_pkgs=()
. /etc/os-release
if [ "${VERSION_CODENAME:-}" = "bookworm" ]; then
  # QEMU 10 lives in bookworm-backports (Debian 13's own version).
  if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    echo "deb http://deb.debian.org/debian bookworm-backports main" |
      $SUDO tee /etc/apt/sources.list.d/warren-backports.list >/dev/null
  fi
fi
qemu_ok() {
  command -v qemu-system-x86_64 >/dev/null &&
    qemu-system-x86_64 --version | grep -Eq 'version (1[0-9]|9)\.' &&
    [ -f /usr/share/qemu/qboot.rom ]
}
# libcap-ng-dev and libseccomp-dev: to build virtiofsd (not packaged in bookworm); git: sessions;
# iproute2 and nftables: guest networking (per-VM namespace, TAP device, redirect rules);
# curl: the agents recipe's npm tarballs (fetched on the host, verified against their pins);
# e2fsprogs: session volumes (mkfs.ext4); xfsprogs: the test that they work on an XFS host.
for p in debootstrap e2fsprogs xfsprogs kmod qemu-utils ca-certificates curl git pkg-config libcap-ng-dev libseccomp-dev iproute2 nftables; do
  dpkg -s "$p" >/dev/null 2>&1 || need_pkgs+=("$p")
done
if ! qemu_ok || [ ${#need_pkgs[@]} -gt 0 ]; then
  echo "==> installing packages: qemu-system-x86 ${need_pkgs[*]}"
  $SUDO apt-get update -qq
  if [ "${VERSION_CODENAME:-}" = "bookworm" ]; then
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -t bookworm-backports qemu-system-x86 qemu-utils
  else
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-system-x86 qemu-utils
  fi
  if [ ${#need_pkgs[@]} -gt 0 ]; then
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}"
  fi
fi
qemu_ok || { echo "QEMU >= 9 with qboot is required" >&2; exit 1; }

if ! command -v cargo >/dev/null; then
  echo "cargo is required (rustup toolchain from rust-toolchain.toml)" >&2
  exit 1
fi

# virtiofsd shares host directories (session workspaces, --mount) into guests. The daemon
# finds it on PATH or in ~/.cargo/bin (or WARREN_VIRTIOFSD).
VIRTIOFSD_VERSION=1.14.0
if ! { command -v virtiofsd || ls ~/.cargo/bin/virtiofsd; } >/dev/null 2>&1 ||
  ! { virtiofsd --version 2>/dev/null || ~/.cargo/bin/virtiofsd --version; } | grep -q "$VIRTIOFSD_VERSION"; then
  echo "==> installing virtiofsd $VIRTIOFSD_VERSION (crates.io)"
  cargo install --locked virtiofsd --version "$VIRTIOFSD_VERSION"
fi

echo "==> building warren and the static guest agent"
cargo build --release -p warren-cli
scripts/build-guest.sh
