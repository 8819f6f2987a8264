"""The Python twin of tests/guests/caller: the event's payload is a script of durable calls,
memory writes and reads, sends and a failure, run in that order (see its lib.rs).

Besides the Rust caller's fields, ``"ambient": true`` adds what the run read from its clocks
and random sources to the output, and ``"stamp_calls": true`` adds the wall-clock time and a
random number to every call's args.
"""

import json
import os
import random
import time

import rewind

_FIELDS = {
    "calls",
    "send",
    "memory_set",
    "memory_get",
    "fail",
    "raise",
    "output",
    "ambient",
    "stamp_calls",
}


def _raise(message: str) -> None:
    raise ValueError(message)


def _wait(ctx: rewind.Context, step: dict):
    """The step's durable wait (``sleep_ms``, ``sleep_until_ms``, ``await`` with
    ``timeout_ms``) and what it returned; ``None`` for a call."""
    if "sleep_ms" in step:
        ctx.sleep(step["sleep_ms"] / 1000)
    elif "sleep_until_ms" in step:
        ctx.sleep_until(step["sleep_until_ms"] / 1000)
    elif "await" in step:
        timeout = step.get("timeout_ms")
        signal = ctx.await_signal(step["await"], None if timeout is None else timeout / 1000)
        if signal is None:
            return {"timed_out": True}
        return {"signal": {"name": signal.name, "payload": signal.payload}}
    else:
        return None
    return {"slept": True}


def _outcome(ctx: rewind.Context, function: str, args: dict) -> dict:
    try:
        text = ctx.call_json(function, json.dumps(args))
    except rewind.CallFailed as error:
        return {"error": {"failed": error.message}}
    except rewind.CallDenied as error:
        return {"error": {"denied": error.message}}
    except rewind.UnknownFunction as error:
        return {"error": {"unknown-function": error.message}}
    try:
        return {"ok": json.loads(text)}
    except ValueError:
        return {"not-json": text}


class Caller(rewind.Action):
    def run(self, ctx: rewind.Context, event: rewind.Event) -> None:
        script = event.payload or {}
        unknown = set(script) - _FIELDS
        if unknown:
            raise rewind.Error(f"unknown field(s) in the script: {sorted(unknown)}")

        results = []
        for call in script.get("calls", []):
            waited = _wait(ctx, call)
            if waited is not None:
                results.append(waited)
                continue
            args = call.get("args", {})
            if script.get("stamp_calls") and isinstance(args, dict):
                args = dict(args, stamped_at=time.time_ns(), nonce=random.getrandbits(64))
            results.append(_outcome(ctx, call["function"], args))

        for name, value in script.get("memory_set", {}).items():
            ctx.set_memory(name, value)
        memory = {name: ctx.memory(name) for name in script.get("memory_get", [])}

        for send in script.get("send", []):
            ctx.send(send["kind"], send.get("payload"))

        if script.get("fail") is not None:
            raise rewind.Error(script["fail"])
        if script.get("raise") is not None:
            _raise(script["raise"])
        if script.get("output") is not False:
            output = {
                "kind": event.kind,
                "key": ctx.key,
                "sequence": ctx.sequence,
                "results": results,
                "memory": memory,
            }
            if script.get("ambient"):
                output["ambient"] = {
                    "wall_ns": time.time_ns(),
                    "monotonic_ns": time.monotonic_ns(),
                    "random": random.random(),
                    "urandom": os.urandom(8).hex(),
                }
            ctx.output(output)


WitWorld = rewind.export(Caller)
