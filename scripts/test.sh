#!/usr/bin/env bash
# Runs every check and test: formatting, clippy with warnings as errors, all tests.
# Works on a fresh machine with only the Rust toolchain: installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

for component in rustfmt clippy; do
    if ! rustup component list --installed | grep -q "^$component"; then
        rustup component add "$component"
    fi
done
scripts/guests.sh

# The JetStream tests run Debian's nats-server on loopback.
if ! command -v nats-server >/dev/null 2>&1 && [ ! -x /usr/sbin/nats-server ]; then
    echo "== installing nats-server"
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq nats-server
fi

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
# The core alone, as an embedder takes it (no server, no JetStream): checked, not built.
echo "== cargo clippy --no-default-features"
cargo clippy --workspace --no-default-features --all-targets -- -D warnings
echo "== cargo test"
cargo test --workspace
