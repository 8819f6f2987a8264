#!/usr/bin/env bash
# Builds every guest component (tests/guests/ and examples/*/actions/) into
# target/guests/wasm32-wasip2/release/ with `rewind build`, one agent at a time: Rust ones
# with cargo for wasm32-wasip2, Python ones with componentize-py, JavaScript ones with
# esbuild and componentize-js (the target and the tools are installed when missing; a
# component is rebuilt only when what goes into it changed). Then installs the MCP test
# server's Python SDK.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --quiet -p rewind
export CARGO_TARGET_DIR=target/guests
for agent in tests/guests/agent.toml examples/*/agent.toml; do
    target/debug/rewind build "$agent"
done

# The test tooling's Model Context Protocol server (tests/mcp/server.py) runs on the
# reference Python SDK, pinned in tests/mcp/requirements.txt, installed into .venv.
if ! cmp -s tests/mcp/requirements.txt .venv/rewind-mcp-requirements.txt; then
    echo "== installing the MCP test server's Python SDK into .venv"
    [ -x .venv/bin/pip ] || python3 -m venv .venv
    .venv/bin/pip install --quiet --disable-pip-version-check -r tests/mcp/requirements.txt
    cp tests/mcp/requirements.txt .venv/rewind-mcp-requirements.txt
fi
