#!/usr/bin/env bash
# Installs, idempotently, the pinned third-party MCP clients of tests/mcp_conformance.rs
# (the official conformance suite and the MCP Inspector's CLI, from the npm registry, exactly
# as package-lock.json pins them) for Node.js 20, into a cache directory:
#
#   WARREN_MCP_CONFORMANCE_DIR  where (default /var/cache/warren-test/mcp-conformance)
#
# Prints one line when it (re)installs, nothing when the install matches the lock file.
# Concurrent runs serialise on a lock file beside the directory.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir="${WARREN_MCP_CONFORMANCE_DIR:-/var/cache/warren-test/mcp-conformance}"
command -v node >/dev/null && command -v npm >/dev/null || {
  echo "mcp-conformance: node and npm are required (apt-get install nodejs npm)" >&2
  exit 1
}
major=$(node -p 'process.versions.node.split(".")[0]')
[ "$major" -ge 20 ] || { echo "mcp-conformance: Node.js >= 20 is required, found $(node --version)" >&2; exit 1; }
key=$(cat "$here/package.json" "$here/package-lock.json" | sha256sum | cut -c1-16)
stamp="$dir/.installed-$key"
[ -f "$stamp" ] && exit 0
mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9
[ -f "$stamp" ] && exit 0
rm -rf "$dir"
mkdir -p "$dir"
cp "$here/package.json" "$here/package-lock.json" "$dir/"
(cd "$dir" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >/dev/null)
touch "$stamp"
echo "mcp-conformance: installed $(cd "$dir" && node -p 'require("./package.json").dependencies' | tr -d '\n ') in $dir"
