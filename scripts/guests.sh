#!/usr/bin/env bash
# Builds every guest component (tests/guests/ and examples/*/actions/) into
# target/guests/wasm32-wasip2/release/: the Rust ones with cargo for wasm32-wasip2 (the
# target is installed when missing), the Python and JavaScript ones with scripts/polyglot.sh.
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
