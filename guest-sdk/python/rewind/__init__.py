"""Write Rewind agent actions in Python.

An action is a WebAssembly component that handles one event. Everything it does outside
its sandbox goes through a durable call (``Context.call``): the host records each call's
result, and when the same input is run again (after a crash, say) the recorded result is
returned instead of calling the outside world again. ``time.time()``, ``random.random()``
and the other clocks and random sources are durable too: a replay sees the values the first
run saw.

Subclass ``Action`` and export it as the component's world::

    import rewind

    class Status(rewind.Action):
        def run(self, ctx: rewind.Context, event: rewind.Event) -> None:
            ticket = event.payload
            order = ctx.call("orders.lookup", {"order_id": ticket["order_id"]})
            ctx.info(f"ticket {ticket['ticket_id']} is about order {order['order_id']}")
            ctx.output(order)

    WitWorld = rewind.export(Status)

Build it with ``rewind build``: the action's ``requirements.txt`` (this package among
them) is installed into a directory of its own, then componentize-py makes the component of
world ``action``, whose WIT this package carries (``rewind/wit``, named by
``rewind/componentize-py.toml``, so componentize-py finds it once the package is installed).

``Context.key`` and ``Context.sequence`` are properties here, as in JavaScript
(``ctx.key``); in Rust they are methods (``ctx.key()``).
"""

import datetime
import json
import math
import traceback
from typing import Any, Optional, Sequence, Union

import wit_world
from componentize_py_types import Err
from wit_world.imports import context as _context
from wit_world.imports import durable as _durable
from wit_world.imports import types as _types

__all__ = [
    "Action",
    "CallDenied",
    "CallError",
    "CallFailed",
    "Context",
    "Error",
    "Event",
    "Level",
    "Signal",
    "UnknownFunction",
    "export",
]

Level = _types.Level


class Error(Exception):
    """Why an action failed: raised out of ``run``, its message is what the host reports."""


class CallError(Error):
    """Why a durable call returned no value. ``function`` is the function called."""

    def __init__(self, function: str, message: str) -> None:
        super().__init__(message)
        self.function = function
        self.message = message


class CallFailed(CallError):
    """The function ran and failed. Recorded: a replay raises it again without calling."""

    def __str__(self) -> str:
        return f"durable call failed: {self.message}"


class CallDenied(CallError):
    """The action may not use this function now (not granted, quota spent). Not recorded."""

    def __str__(self) -> str:
        return f"durable call denied: {self.message}"


class UnknownFunction(CallError):
    """No function of that name is declared for this agent. Not recorded."""

    def __str__(self) -> str:
        return f"unknown function: {self.message}"


_CALL_ERRORS = {
    _types.CallError_Failed: CallFailed,
    _types.CallError_Denied: CallDenied,
    _types.CallError_UnknownFunction: UnknownFunction,
}


_NO_ARGS: Any = object()


def _dumps(value: Any, what: str) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as error:
        raise Error(f"{what} cannot be encoded as JSON: {error}") from None


def _loads(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as error:
        raise Error(f"{what} is not JSON: {error}") from None


class Event:
    """An event: ``kind`` routes it, ``payload`` is its JSON, parsed."""

    def __init__(self, kind: str, payload_json: str) -> None:
        self.kind = kind
        self.payload_json = payload_json

    @property
    def payload(self) -> Any:
        """The payload parsed from JSON (``None`` for ``null``)."""
        return _loads(self.payload_json, f"the payload of event `{self.kind}`")

    def __repr__(self) -> str:
        return f"Event(kind={self.kind!r}, payload={self.payload_json!r})"


class Signal:
    """A signal delivered to the input, as ``Context.await_signal`` returns it: its
    ``name`` and its ``payload``, JSON parsed."""

    def __init__(self, name: str, payload_json: str) -> None:
        self.name = name
        self.payload_json = payload_json

    @property
    def payload(self) -> Any:
        """The payload parsed from JSON (``None`` for ``null``)."""
        return _loads(self.payload_json, f"the payload of signal `{self.name}`")

    def __repr__(self) -> str:
        return f"Signal(name={self.name!r}, payload={self.payload_json!r})"


def _millis(seconds: float, what: str) -> int:
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds)) or seconds < 0:
        raise Error(f"{what} is {seconds!r}: a number of seconds, at least 0")
    return min(round(seconds * 1000), 2**64 - 1)


class Context:
    """What an action can reach: durable calls, events, the key's memory, the host's log,
    durable waits."""

    @property
    def key(self) -> str:
        """The key of the input being processed (a user, a session, a ticket)."""
        return _context.key()

    @property
    def sequence(self) -> int:
        """The input's sequence number within its key, starting at 1."""
        return _context.sequence()

    def call(self, function: str, args: Any = _NO_ARGS) -> Any:
        """Calls ``function`` with ``args`` (anything ``json.dumps`` takes; without args,
        ``{}``) and returns its result parsed from JSON.

        The first time a run reaches the call, the host runs the function and records the
        result before returning it; a replay of the same input gets the record back.
        Raises ``CallFailed``, ``CallDenied`` or ``UnknownFunction``.
        """
        args_json = _dumps({} if args is _NO_ARGS else args, f"args for `{function}`")
        result = self.call_json(function, args_json)
        return _loads(result, f"result of `{function}`")

    def call_json(self, function: str, args_json: str) -> str:
        """``call`` with JSON text in and out."""
        try:
            return _durable.call(function, args_json)
        except Err as err:
            error = err.value
            raise _CALL_ERRORS[type(error)](function, error.value) from None

    def sleep(self, seconds: float) -> None:
        """Waits ``seconds``, durably.

        The wait is recorded and the run stops here, holding no instance, memory or run
        slot; when the time has come the input runs again from the start, its durable calls
        and earlier waits answered from their records, and this returns. A restart of the
        host neither shortens nor lengthens it. The key's later inputs wait behind it.
        Code before the wait runs again when the input resumes: what it does outside the
        sandbox must go through durable calls.
        """
        _durable.sleep(_millis(seconds, "sleep's length"))

    def sleep_until(self, when: Union[datetime.datetime, float]) -> None:
        """Waits, as ``sleep`` does, until ``when``: a timezone-aware ``datetime`` or seconds
        since the Unix epoch. A time already past returns at once."""
        if isinstance(when, datetime.datetime):
            if when.tzinfo is None:
                raise Error("sleep_until takes a timezone-aware datetime (or Unix seconds)")
            when = when.timestamp()
        _durable.sleep_until(_millis(when, "sleep_until's time"))

    def await_signal(
        self, names: Sequence[str], timeout: Optional[float] = None
    ) -> Optional[Signal]:
        """Waits, as ``sleep`` does, for a signal delivered to this input whose name is one
        of ``names`` (each among the action's ``signals`` in agent.toml), and returns it; or
        ``None`` once ``timeout`` seconds have passed without one (``None``: no timeout).

        A signal delivered before the wait is reached is kept for it; each signal is
        returned by one wait only.
        """
        if isinstance(names, str):
            names = [names]
        timeout_ms = None if timeout is None else _millis(timeout, "await_signal's timeout")
        signal = _durable.await_signal(list(names), timeout_ms)
        return None if signal is None else Signal(signal.name, signal.payload)

    def send(self, kind: str, payload: Any) -> None:
        """Sends an event of ``kind``, delivered when the run completes: to the actions bound
        to ``kind``, or out of the agent when ``kind`` is ``"output"``."""
        _context.send(_types.Event(kind, _dumps(payload, f"the payload of `{kind}`")))

    def output(self, payload: Any) -> None:
        """Sends ``payload`` out of the agent: ``send("output", payload)``."""
        self.send("output", payload)

    def memory(self, name: str, default: Any = None) -> Any:
        """The value of ``name`` in the key's memory as the run started, else ``default``."""
        value = _context.memory_get(name)
        if value is None:
            return default
        return _loads(value, f"memory `{name}`")

    def set_memory(self, name: str, value: Any) -> None:
        """Sets ``name`` in the key's memory when the run completes."""
        _context.memory_set(name, _dumps(value, f"memory `{name}`"))

    def log(self, level: Level, message: str) -> None:
        """Writes ``message`` to the host's log, labelled with the run."""
        _context.log(level, message)

    def trace(self, message: str) -> None:
        self.log(Level.TRACE, message)

    def debug(self, message: str) -> None:
        self.log(Level.DEBUG, message)

    def info(self, message: str) -> None:
        self.log(Level.INFO, message)

    def warn(self, message: str) -> None:
        self.log(Level.WARN, message)

    def error(self, message: str) -> None:
        self.log(Level.ERROR, message)


class Action:
    """An agent action: the code run for each event whose kind the action is bound to.

    Returning from ``run`` completes the run: the events it sent and the memory it set are
    applied. Raising fails it: its sends and memory writes are dropped and the exception's
    text is reported by the host (``Error``'s message as is, any other exception with its
    type's name and its traceback, at most 16 frames). Durable calls it made stay recorded.
    """

    def run(self, ctx: Context, event: Event) -> None:
        raise NotImplementedError


_TRACEBACK_FRAMES = 16


def _described(error: BaseException) -> str:
    """The exception and its traceback, innermost frame last, as Python prints them: the
    frames below the SDK's own, at most ``_TRACEBACK_FRAMES`` of them (the innermost)."""
    frames = traceback.extract_tb(error.__traceback__)[1:]
    lines = ["Traceback (most recent call last):"]
    if len(frames) > _TRACEBACK_FRAMES:
        lines.append(f"  ... {len(frames) - _TRACEBACK_FRAMES} frames more")
        frames = frames[-_TRACEBACK_FRAMES:]
    lines.extend(f'  File "{f.filename}", line {f.lineno}, in {f.name}' for f in frames)
    lines.append(f"{type(error).__name__}: {error}")
    return "\n".join(lines)


def export(action: type) -> type:
    """The world class for componentize-py: ``WitWorld = rewind.export(MyAction)``."""
    if not (isinstance(action, type) and issubclass(action, Action)):
        raise TypeError(f"rewind.export takes a subclass of rewind.Action, not {action!r}")

    class Exported(wit_world.WitWorld):
        def run(self, event: _types.Event) -> None:
            try:
                action().run(Context(), Event(event.kind, event.payload))
            except Error as error:
                raise Err(str(error)) from None
            except Exception as error:  # noqa: BLE001 - every failure is the run's
                raise Err(_described(error)) from None

    Exported.__name__ = f"WitWorld[{action.__name__}]"
    return Exported
