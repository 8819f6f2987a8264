#!/usr/bin/env bash
# Measures, per language, the time from `rewind new agent` to a first passing `rewind
# test` on a warm machine (the build tools installed, the crates downloaded), and the size
# of the new action's component. Rust is measured twice: in the agent's own target
# directory (its first build compiles the SDK's dependencies) and sharing one already warm.
# Usage: scripts/bench-first-agent.sh [RUNS]   (results: BENCHMARKS.md, "Your first agent")
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
# The dev build, as the tests and scripts/demo.sh use it (wasmtime and cranelift optimised).
cargo build --quiet -p rewind
rewind=$PWD/target/debug/rewind
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
warm=$work/warm-target

first_test() {
    local lang=$1 dir=$2 start end
    start=$(date +%s.%N)
    (cd "$dir" && "$rewind" new agent hello --lang "$lang" >/dev/null 2>&1 &&
        cd hello && "$rewind" build >/dev/null 2>&1 &&
        "$rewind" test agent.toml --input inputs.jsonl >/dev/null 2>&1)
    end=$(date +%s.%N)
    awk "BEGIN { printf \"%.1f\", $end - $start }"
}

# Warm the shared target directory and the tools once, unmeasured.
for lang in rust python js; do
    CARGO_TARGET_DIR=$warm first_test "$lang" "$(mktemp -d -p "$work")" >/dev/null
done

printf '%-22s %s\n' "language" "seconds per run (new → build → test passing), component bytes"
for case in rust-own-target rust-shared-target python js; do
    times=()
    size=0
    for _ in $(seq "$runs"); do
        dir=$(mktemp -d -p "$work")
        case $case in
            rust-own-target) times+=("$(CARGO_TARGET_DIR=$dir/target first_test rust "$dir")") ;;
            rust-shared-target) times+=("$(CARGO_TARGET_DIR=$warm first_test rust "$dir")") ;;
            *) times+=("$(first_test "$case" "$dir")") ;;
        esac
        size=$(stat -c %s "$dir/hello/build/greet.wasm")
    done
    printf '%-22s %s, %s\n' "$case" "${times[*]}" "$size"
done
