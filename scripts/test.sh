#!/usr/bin/env bash
# The full test suite: install, build, build the test images, then lints and all three test
# tiers (unit, integration, real VM) under nextest.
set -euo pipefail
cd "$(dirname "$0")/.."
# A full run builds every crate once: incremental caches would only take disk (gigabytes).
export CARGO_INCREMENTAL=0
scripts/setup.sh
if ! command -v cargo-nextest >/dev/null; then cargo install --locked cargo-nextest; fi
# Test-only tools: curl and setpriv drive the local socket as other uids; ip and nft build the
# egress tests' network namespaces; python3-venv holds
# the official MCP Python SDK the MCP end-to-end test speaks through; docker-registry, skopeo
# and umoci are the OCI tests' registry (started by the test on loopback), push tool and
# layout builder, and python3-cryptography signs for them (an implementation independent of
# Warren's); e2fsprogs' debugfs reads images' file systems (~10 s to install the four).
test_pkgs=()
# Packaging tests (issue 19): dpkg-dev and lintian build and check the Debian packages,
# systemd-container boots fresh Debian roots (debootstrap) for them, umoci builds the OCI
# image, zstd packs the cached roots. docker-registry, skopeo and python3-cryptography serve
# the OCI pull tests (tests/oci.rs).
for p in curl util-linux python3-venv iproute2 nftables docker-registry skopeo umoci python3-cryptography e2fsprogs dpkg-dev lintian systemd-container debootstrap zstd; do
  dpkg -s "$p" >/dev/null 2>&1 || test_pkgs+=("$p")
done
if [ ${#test_pkgs[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${test_pkgs[@]}"
fi
# Debian starts a registry service on :5000 when the package is installed; the tests start
# their own on loopback, so none is left listening.
if command -v systemctl >/dev/null && systemctl is-active --quiet docker-registry 2>/dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO systemctl disable --now docker-registry >/dev/null 2>&1 || true
fi
echo "==> MCP client venv (PyPI mcp)"
scripts/mcp-venv.sh
echo "==> MCP conformance suite and Inspector CLI (npm registry, Node.js 20)"
scripts/mcp-conformance/install.sh

export WARREN_GUEST_AGENT="$(pwd)/target/x86_64-unknown-linux-gnu/release/warren-guest"
# Images outlive the checkout, keyed by recipe digest: a rerun on the same machine reuses them.
export WARREN_TEST_IMAGE_DIR="${WARREN_TEST_IMAGE_DIR:-/var/cache/warren-test/images}"
mkdir -p "$WARREN_TEST_IMAGE_DIR"
state=$(mktemp -d)
trap 'rm -rf "$state"' EXIT
for recipe in minimal dev agents; do
  echo "==> image $recipe"
  target/release/warren --state-dir "$state" --image-dir "$WARREN_TEST_IMAGE_DIR" image build --recipe "$recipe"
done

echo "==> cargo fmt --check"
cargo fmt --all -- --check
echo "==> cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "==> cargo doc"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps -q
echo "==> tests"
cargo nextest run --workspace --no-fail-fast

# Shipping (issue 19): packages built offline after a fetch, lintian-clean; installed, run,
# upgraded, removed and purged in booted bookworm and trixie roots; the OCI image and the
# Kubernetes manifests. Their caches live under /var/cache/warren-test.
echo "==> Debian packages"
scripts/build-debs --fetch
WARREN_VIRTIOFSD_TARGET=/var/cache/warren-test/virtiofsd-target scripts/build-debs target/debian
WARREN_TEST_DEBS=target/debian scripts/test-debs
echo "==> OCI image"
WARREN_ROOT_CACHE=/var/cache/warren-test/debs scripts/test-oci target/debian
echo "==> Kubernetes manifests"
scripts/test-k8s

