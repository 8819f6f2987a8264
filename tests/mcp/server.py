"""A Model Context Protocol server for Rewind's tests, on the reference Python SDK.

    python server.py COUNTS_FILE [--sse]

Serves streamable HTTP at /mcp on a free port of 127.0.0.1, printing `port N` on stdout
once it listens. Its tools:

- `charge(amount)`: a payment that honours the idempotency key Rewind puts in the call's
  `_meta` ("dev.rewind/idempotency-key"): the first call of a key charges, a call again
  with it answers the first call's result and charges nothing;
- `echo(text)`: answers its text;
- `fail()`: a tool error (`isError`);
- `secret()`: a tool agents are not meant to reach (tests keep it off their allow-lists).

After every call it writes COUNTS_FILE whole: {"requests": {key: n}, "charges": n,
"meta": [the _meta of each call]}. Without --sse it answers each request as one JSON
document, without sessions; with --sse it keeps sessions and answers as event streams.
"""

import json
import os
import socket
import sys

import uvicorn
from mcp.server.mcpserver import Context, MCPServer

KEY = "dev.rewind/idempotency-key"

counts_file = sys.argv[1]
sse = "--sse" in sys.argv[2:]
state = {"requests": {}, "charges": 0, "meta": []}
charged = {}


def note(ctx: Context) -> str:
    meta = dict(ctx.request_context.meta or {})
    key = str(meta.get(KEY, ""))
    state["meta"].append(meta)
    state["requests"][key] = state["requests"].get(key, 0) + 1
    return key


def save():
    temporary = counts_file + ".tmp"
    with open(temporary, "w") as out:
        json.dump(state, out)
    os.replace(temporary, counts_file)


server = MCPServer("rewind-test")


@server.tool()
def charge(amount: int, ctx: Context) -> dict:
    """Charge an amount, once per idempotency key."""
    key = note(ctx)
    if key not in charged:
        state["charges"] += 1
        charged[key] = {"charged": amount, "charge": state["charges"]}
    save()
    return charged[key]


@server.tool()
def echo(text: str, ctx: Context) -> str:
    """Answer the text."""
    note(ctx)
    save()
    return text


@server.tool()
def fail(ctx: Context) -> str:
    """Fail, as a tool does."""
    note(ctx)
    save()
    raise ValueError("the card was declined")


@server.tool()
def secret(ctx: Context) -> str:
    """What no agent may read."""
    note(ctx)
    save()
    return "the vault's combination"


if __name__ == "__main__":
    app = server.streamable_http_app(stateless_http=not sse, json_response=not sse)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    # Listening before the port is said: a client that connects at once (rewind run's
    # preflight) waits in the backlog until the server takes it, rather than being refused.
    listener.listen(128)
    print(f"port {listener.getsockname()[1]}", flush=True)
    save()
    config = uvicorn.Config(app, log_level="warning")
    uvicorn.Server(config).run(sockets=[listener])
