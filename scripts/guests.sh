#!/usr/bin/env bash
# Builds every guest component (tests/guests/ and examples/*/actions/) into
# target/guests/wasm32-wasip2/release/: the Rust ones with cargo for wasm32-wasip2 (the
# target is installed when missing), the Python and JavaScript ones with scripts/polyglot.sh;
# and installs the MCP test server's Python SDK.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! rustup target list --installed | grep -qx wasm32-wasip2; then
    rustup target add wasm32-wasip2
fi

packages=()
for manifest in tests/guests/*/Cargo.toml examples/*/actions/*/Cargo.toml; do
    [[ -f $manifest ]] || continue
    name=$(sed -n 's/^name = "\(.*\)"$/\1/p' "$manifest" | head -n 1)
    packages+=(-p "$name")
done
cargo build --quiet --release --target wasm32-wasip2 --target-dir target/guests "${packages[@]}"
scripts/polyglot.sh

# The test tooling's Model Context Protocol server (tests/mcp/server.py) runs on the
# reference Python SDK, pinned in tests/mcp/requirements.txt, installed into .venv.
if ! cmp -s tests/mcp/requirements.txt .venv/rewind-mcp-requirements.txt; then
    echo "== installing the MCP test server's Python SDK into .venv"
    [ -x .venv/bin/pip ] || python3 -m venv .venv
    .venv/bin/pip install --quiet --disable-pip-version-check -r tests/mcp/requirements.txt
    cp tests/mcp/requirements.txt .venv/rewind-mcp-requirements.txt
fi
