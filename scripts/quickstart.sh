#!/usr/bin/env bash
# Warren's main job, end to end: install, build, build the dev image, boot a VM, run a
# command in it, and remove the VM again.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
warren=target/release/warren
export WARREN_GUEST_AGENT="$(pwd)/target/x86_64-unknown-linux-gnu/release/warren-guest"
echo "==> building the dev image (cached by recipe digest; first build takes a few minutes)"
$warren image build --recipe dev
echo "==> booting a VM"
vm=$($warren vm create --image dev)
trap '$warren vm destroy "$vm"' EXIT
echo "==> running a command in $vm"
$warren vm exec "$vm" -- sh -c 'echo "hello from $(uname -sr) in $(. /etc/os-release; echo $PRETTY_NAME) as $(id -un)"; python3 --version'
