#!/usr/bin/env bash
# Creates, idempotently, the Python venv holding the official MCP SDK (PyPI `mcp`) that
# crates/warren-api/tests/mcp_client.py needs: the MCP end-to-end test talks to warrend through
# a real third-party client rather than through our own code.
#
#   WARREN_MCP_VENV  where the venv lives (default /var/cache/warren-test/mcp-venv)
#
# Prints one line when it (re)creates the venv, nothing when the venv is already good.
# Concurrent runs (parallel tests) serialise on a lock file beside the venv.
set -euo pipefail

# Pinned: the newest release installable on Debian 12's Python 3.11 when this was written.
# Changing it recreates the venv on the next run.
MCP_VERSION=2.3.0

venv="${WARREN_MCP_VENV:-/var/cache/warren-test/mcp-venv}"
stamp="$venv/.warren-mcp-$MCP_VERSION"
python="${PYTHON:-python3}"

imports_ok() {
    "$venv/bin/python" -c 'import mcp.client.streamable_http' >/dev/null 2>&1
}
venv_ok() {
    [ -f "$stamp" ] && imports_ok
}

venv_ok && exit 0

mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
# Another run may have built it while we waited for the lock.
venv_ok && exit 0

# Debian ships `venv` without `ensurepip` unless python3-venv is installed, so check both.
if ! "$python" -c 'import venv, ensurepip' >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "mcp-venv: $python cannot create venvs; install python3-venv (as root)" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq python3-venv >/dev/null
fi

rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
    "mcp==$MCP_VERSION"
imports_ok || { echo "mcp-venv: mcp $MCP_VERSION installed but does not import" >&2; exit 1; }
touch "$stamp"
echo "mcp-venv: mcp $MCP_VERSION ready in $venv"
