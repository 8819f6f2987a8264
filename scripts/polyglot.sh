#!/usr/bin/env bash
# Builds every Python and JavaScript guest into target/guests/wasm32-wasip2/release/, beside
# the Rust ones. A directory under examples/*/actions/ or tests/guests/ with `action.py` is a
# Python action (componentize-py), one with `action.js` a JavaScript action (esbuild, then
# componentize-js). Names follow the Rust guests': examples/E/actions/A makes E_A.wasm,
# tests/guests/G makes guest_G.wasm, dashes made underscores.
#
# Installs what is missing: componentize-py, pinned in guest-sdk/python/requirements.txt,
# into .venv; componentize-js and esbuild, pinned by guest-sdk/js/package-lock.json, with
# `npm ci`. A component is rebuilt only when its sources, its SDK, the WIT or the tools
# changed (a fingerprint is kept beside it).
set -euo pipefail
cd "$(dirname "$0")/.."

out=target/guests/wasm32-wasip2/release
mkdir -p "$out" target/guests/logs

python_actions=()
js_actions=()
for dir in examples/*/actions/* tests/guests/*; do
    [[ -f $dir/action.py ]] && python_actions+=("$dir")
    [[ -f $dir/action.js ]] && js_actions+=("$dir")
done

name_of() {
    local dir=$1 name
    case $dir in
        examples/*) name=${dir#examples/}; name="${name%%/*}_${dir##*/}" ;;
        *) name="guest_${dir##*/}" ;;
    esac
    echo "${name//-/_}"
}

# The hash of every file that goes into a component, in a stable order.
fingerprint() {
    find "$@" -type f ! -name '*.pyc' ! -path '*/node_modules/*' -print0 | sort -z |
        xargs -0 sha256sum | sha256sum | cut -d' ' -f1
}

if ((${#python_actions[@]})) &&
    ! cmp -s guest-sdk/python/requirements.txt .venv/rewind-requirements.txt; then
    echo "== installing componentize-py into .venv"
    python3 -m venv .venv
    .venv/bin/pip install --quiet --disable-pip-version-check -r guest-sdk/python/requirements.txt
    cp guest-sdk/python/requirements.txt .venv/rewind-requirements.txt
fi
if ((${#js_actions[@]})) &&
    ! cmp -s guest-sdk/js/package-lock.json guest-sdk/js/node_modules/.rewind-lock.json; then
    echo "== installing componentize-js and esbuild (npm ci)"
    (cd guest-sdk/js && npm ci --silent --no-audit --no-fund)
    cp guest-sdk/js/package-lock.json guest-sdk/js/node_modules/.rewind-lock.json
fi

build_python() {
    local dir=$1 wasm=$2
    .venv/bin/componentize-py -d wit -w action componentize \
        -p guest-sdk/python -p "$dir" action -o "$wasm"
}

build_js() {
    local dir=$1 wasm=$2
    node guest-sdk/js/build.mjs "$dir/action.js" "$wasm" wit
}

# Builds one component unless its fingerprint is unchanged; its output goes to a log,
# shown if it fails.
build() {
    local language=$1 dir=$2
    local name wasm print log
    name=$(name_of "$dir")
    wasm="$out/$name.wasm"
    print=$(fingerprint "$dir" wit "guest-sdk/$language")
    if [[ -f $wasm ]] && [[ $(cat "$wasm.inputs" 2>/dev/null) == "$print" ]]; then
        return 0
    fi
    log="target/guests/logs/$name.log"
    echo "== $language: $dir -> $wasm"
    rm -f "$wasm.inputs"
    if ! "build_$language" "$dir" "$wasm.tmp" >"$log" 2>&1; then
        cat "$log" >&2
        echo "building $dir failed (log: $log)" >&2
        return 1
    fi
    mv "$wasm.tmp" "$wasm"
    echo "$print" >"$wasm.inputs"
}

# Two builds at a time: each is mostly one process on one core.
pids=()
failed=0
for action in "${python_actions[@]/#/python:}" "${js_actions[@]/#/js:}"; do
    [[ $action == *: ]] && continue
    build "${action%%:*}" "${action#*:}" &
    pids+=($!)
    if ((${#pids[@]} >= 2)); then
        wait "${pids[0]}" || failed=1
        pids=("${pids[@]:1}")
    fi
done
for pid in "${pids[@]}"; do
    wait "$pid" || failed=1
done
if ((failed)); then
    echo "some Python or JavaScript guests did not build" >&2
    exit 1
fi
