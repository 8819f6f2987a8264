"""Schemathesis hooks for Rewind's API: how to send the bodies that are not JSON.

An agent definition is TOML text (`application/toml`) and a component is WebAssembly bytes
(`application/wasm`): Schemathesis generates a string or bytes for them and sends them as
they are.
"""

import schemathesis


@schemathesis.serializer("application/toml")
def _toml(ctx, value):
    if value is None:
        return None
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


@schemathesis.serializer("application/wasm")
def _wasm(ctx, value):
    if value is None:
        return None
    return value if isinstance(value, bytes) else str(value).encode("utf-8")
