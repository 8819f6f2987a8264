#!/usr/bin/env bash
# Builds every guest component (tests/guests/ and examples/*/actions/) for wasm32-wasip2
# into target/guests/wasm32-wasip2/release/. Installs the target when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! rustup target list --installed | grep -qx wasm32-wasip2; then
    rustup target add wasm32-wasip2
fi

packages=()
for manifest in tests/guests/*/Cargo.toml examples/*/actions/*/Cargo.toml; do
    name=$(sed -n 's/^name = "\(.*\)"$/\1/p' "$manifest" | head -n 1)
    packages+=(-p "$name")
done
cargo build --quiet --release --target wasm32-wasip2 --target-dir target/guests "${packages[@]}"
