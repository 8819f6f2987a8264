#!/usr/bin/env bash
# The demo: builds what it needs, starts the mock service on loopback, runs the support
# agent over its sample inputs, runs the same command again (it resumes from its checkpoint),
# runs the polyglot agent (Rust, Python and JavaScript actions in one pipeline), and shows
# that each call reached the service once.
set -euo pipefail
cd "$(dirname "$0")/.."

addr=127.0.0.1:7181
scripts/guests.sh
cargo build --quiet -p rewind -p rewind-mock

state=$(mktemp -d)
log=$(mktemp)
target/debug/rewind-mock --addr "$addr" >"$log" 2>&1 &
mock=$!
trap 'kill "$mock" 2>/dev/null || true; rm -rf "$state" "$log"' EXIT
for _ in $(seq 50); do
    grep -q listening "$log" && break
    kill -0 "$mock" 2>/dev/null || { cat "$log"; echo "the mock service did not start (is $addr taken?)"; exit 1; }
    sleep 0.1
done

echo "== first run: every call reaches the mock service"
target/debug/rewind run examples/support/agent.toml \
    --input examples/support/inputs.jsonl --state "$state" --output "$state/outputs.jsonl"
echo
echo "== outputs"
cat "$state/outputs.jsonl"
echo
echo "== the same command again: it resumes from its last checkpoint and calls nothing"
target/debug/rewind run examples/support/agent.toml \
    --input examples/support/inputs.jsonl --state "$state" --output "$state/outputs.jsonl"
echo "outputs: $(wc -l < "$state/outputs.jsonl") lines, one per ticket"
echo
echo "== what was recorded for one customer"
target/debug/rewind inspect --state "$state" --key cust-ana
echo
echo "== one agent, three languages: intake (Rust) -> classify (Python) -> resolve (JavaScript)"
target/debug/rewind run examples/polyglot/agent.toml --input examples/polyglot/inputs.jsonl \
    --state "$state/polyglot" --output "$state/polyglot/outputs.jsonl"
cat "$state/polyglot/outputs.jsonl"
echo
echo "== what one customer's actions recorded: calls, clock readings, randomness"
target/debug/rewind inspect --state "$state/polyglot" --key cust-ben
echo
echo "== calls the mock service received, per idempotency key (each should be 1)"
kill -TERM "$mock"
wait "$mock" || true
grep -o '"by_idempotency_key":{[^}]*}' "$log" | tr ',' '\n'
grep -o '"repeated_keys":\[[^]]*\]' "$log"
