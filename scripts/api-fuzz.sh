#!/usr/bin/env bash
# Fuzzes a running `rewind serve` from its OpenAPI document with Schemathesis (pinned in
# scripts/api-fuzz-requirements.txt, installed into .venv when missing).
#
#   scripts/api-fuzz.sh URL TOKEN [--config-file schemathesis.toml] [RUN OPTIONS...]
#
# URL is the server's base (http://127.0.0.1:7070); TOKEN is sent as the bearer token of
# every request; a config file may fix parameters (`[parameters] "path.tenant" = "acme"`). The tests run it with a fixed seed and few examples per operation; for a
# longer run by hand, give more: `--max-examples 500 --seed $RANDOM`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
url=$1 token=$2
shift 2
config=()
if [ "${1:-}" = "--config-file" ]; then
    config=(--config-file "$2")
    shift 2
fi

if [ ! -x "$root/.venv/bin/schemathesis" ] ||
    ! cmp -s "$root/scripts/api-fuzz-requirements.txt" "$root/.venv/rewind-api-fuzz-requirements.txt"; then
    echo "== installing Schemathesis into .venv" >&2
    [ -x "$root/.venv/bin/pip" ] || python3 -m venv "$root/.venv"
    "$root/.venv/bin/pip" install --quiet --disable-pip-version-check \
        -r "$root/scripts/api-fuzz-requirements.txt"
    cp "$root/scripts/api-fuzz-requirements.txt" "$root/.venv/rewind-api-fuzz-requirements.txt"
fi

export PYTHONPATH="$root/scripts${PYTHONPATH:+:$PYTHONPATH}"
export SCHEMATHESIS_HOOKS=api_fuzz_hooks
exec "$root/.venv/bin/schemathesis" "${config[@]}" run "$url/v1/openapi.json" \
    --header "Authorization: Bearer $token" \
    --no-color --generation-database none "$@"
