#!/bin/bash
# rewind run, old binary against new: 64 keys (12,800 inputs of 4 durable calls each) and
# one key (1,000 inputs of one call), each binary in turn, 5 rounds, a fresh state each run;
# prints the time each run reports. The calls are the embedded `random` function: what is
# measured is the runtime and its log, not a remote.
#   scripts/bench-run.sh OLD_REWIND NEW_REWIND
# Needs the guests (scripts/guests.sh). Results: BENCHMARKS.md.
set -euo pipefail
old=$1
new=$2
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/agent.toml" <<TOML
name = "bench"
parallelism = 8
[state]
checkpoint-every-ms = 1000
[[actions]]
name = "work"
component = "$root/target/guests/wasm32-wasip2/release/guest_caller.wasm"
on = ["input"]
[functions.r]
kind = "random"
TOML
python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
with open(f"{work}/keys64.jsonl", "w") as f:
    for i in range(200):
        for k in range(64):
            calls = [{"function": "r", "args": {"i": i, "c": c}} for c in range(4)]
            f.write(json.dumps({"key": f"k{k}", "payload": {"calls": calls}}) + "\n")
with open(f"{work}/key1.jsonl", "w") as f:
    for i in range(1000):
        f.write(json.dumps({"key": "one", "payload": {"calls": [{"function": "r", "args": {"i": i}}]}}) + "\n")
PY
cd "$work"
for round in 1 2 3 4 5; do
  for which in old new; do
    binary=${!which}
    for input in keys64 key1; do
      rm -rf state out.jsonl
      took=$("$binary" run agent.toml --input "$input.jsonl" --state state --output out.jsonl 2>&1 \
        | awk '/^time:/ {print $2}')
      echo "$round $which $input $took"
    done
  done
done
