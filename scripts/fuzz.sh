#!/usr/bin/env bash
# Builds and runs Warren's libFuzzer targets with the pinned stable toolchain (no nightly, no
# sanitizer: coverage instrumentation comes from the stable `-Cpasses=sancov-module` and
# `-Cllvm-args` code generation options, as `cargo fuzz --sanitizer none` would pass them).
#
#   scripts/fuzz.sh list                      the targets
#   scripts/fuzz.sh build TARGET              build fuzz/target/.../release/TARGET
#   scripts/fuzz.sh run TARGET [ARGS...]      fuzz, growing fuzz/corpus/TARGET (ARGS go to
#                                             libFuzzer, e.g. -max_total_time=600)
#   scripts/fuzz.sh cmin TARGET               minimise fuzz/corpus/TARGET in place
#
# Crashes land in fuzz/artifacts/TARGET/. The ordinary test run replays every corpus file
# (`cargo nextest run -p warren-fuzz`, test `corpus_replay`). See docs/fuzzing.md.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

# target -> the warren-fuzz feature it needs
declare -A FEATURE=(
  [framing]=protocol [guest_messages]=protocol
  [http1]=egress [tls_client_hello]=egress [dns_query]=egress
  [configs]=api [api_json]=api
)

host=$(rustc -vV | sed -n 's/^host: //p')
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"

need_target() {
  if [ -z "${1:-}" ] || [ -z "${FEATURE[$1]:-}" ]; then
    echo "unknown target ${1:-}; one of: ${!FEATURE[*]}" >&2
    exit 2
  fi
}

build() {
  # --target keeps the instrumentation off build scripts and proc macros.
  cargo build --release --target "$host" --features "${FEATURE[$1]}" --bin "$1"
}

bin() { echo "target/$host/release/$1"; }

cmd=${1:-}
shift || true
case "$cmd" in
  list) printf '%s\n' "${!FEATURE[@]}" | sort ;;
  build) need_target "${1:-}"; build "$1" ;;
  run)
    need_target "${1:-}"; t=$1; shift
    build "$t"
    mkdir -p "corpus/$t" "artifacts/$t"
    "$(bin "$t")" -artifact_prefix="artifacts/$t/" "$@" "corpus/$t"
    ;;
  cmin)
    need_target "${1:-}"; t=$1
    build "$t"
    tmp=$(mktemp -d)
    "$(bin "$t")" -merge=1 "$tmp" "corpus/$t"
    rm -rf "corpus/$t"
    mv "$tmp" "corpus/$t"
    ;;
  *) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
