#!/usr/bin/env bash
# Builds the guest agent as a static glibc binary (the musl target cannot be installed here).
# The explicit --target keeps +crt-static away from host build scripts and proc macros.
set -euo pipefail
cd "$(dirname "$0")/.."
RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --release -p warren-guest --target x86_64-unknown-linux-gnu
echo "$(pwd)/target/x86_64-unknown-linux-gnu/release/warren-guest"
