// Write Rewind agent actions in JavaScript.
//
// An action is a WebAssembly component that handles one event. Everything it does outside
// its sandbox goes through a durable call (`ctx.call`): the host records each call's result,
// and when the same input is run again (after a crash, say) the recorded result is returned
// instead of calling the outside world again. `Date.now()`, `Math.random()` and
// `crypto.getRandomValues()` are durable too: a replay sees the values the first run saw.
//
//     import { action } from 'rewind';
//
//     export const run = action((ctx, event) => {
//       const ticket = event.payload;
//       const order = ctx.call('orders.lookup', { order_id: ticket.order_id });
//       ctx.info(`ticket ${ticket.ticket_id} is about order ${order.order_id}`);
//       ctx.output(order);
//     });
//
// `rewind build` builds it: esbuild bundles it with this module, then componentize-js makes
// the component of world `action` (without wasi:http). Types are in rewind.d.ts.

import {
  call as durableCall,
  sleep as durableSleep,
  sleepUntil as durableSleepUntil,
  awaitSignal as durableAwaitSignal,
} from 'rewind:action/durable@0.2.0';
import {
  key as contextKey,
  sequence as contextSequence,
  send as contextSend,
  memoryGet,
  memorySet,
  log as contextLog,
} from 'rewind:action/context@0.2.0';

/** Why an action failed: thrown out of the handler, its message is what the host reports. */
export class RewindError extends Error {
  constructor(message) {
    super(message);
    this.name = 'RewindError';
  }
}

/** Why a durable call returned no value; `fn` is the function called. */
export class CallError extends RewindError {
  constructor(fn, message, what) {
    super(`${what}: ${message}`);
    this.name = 'CallError';
    this.fn = fn;
    this.reason = message;
  }
}

/** The function ran and failed. Recorded: a replay throws it again without calling. */
export class CallFailed extends CallError {
  constructor(fn, message) {
    super(fn, message, 'durable call failed');
    this.name = 'CallFailed';
  }
}

/** The action may not use this function now (not granted, quota spent). Not recorded. */
export class CallDenied extends CallError {
  constructor(fn, message) {
    super(fn, message, 'durable call denied');
    this.name = 'CallDenied';
  }
}

/** No function of that name is declared for this agent. Not recorded. */
export class UnknownFunction extends CallError {
  constructor(fn, message) {
    super(fn, message, 'unknown function');
    this.name = 'UnknownFunction';
  }
}

const CALL_ERRORS = {
  failed: CallFailed,
  denied: CallDenied,
  'unknown-function': UnknownFunction,
};

function dumps(value, what) {
  let text;
  try {
    text = JSON.stringify(value);
  } catch (error) {
    throw new RewindError(`${what} cannot be encoded as JSON: ${error.message}`);
  }
  if (text === undefined) {
    throw new RewindError(`${what} cannot be encoded as JSON: ${typeof value}`);
  }
  return text;
}

function parse(text, what) {
  try {
    return JSON.parse(text);
  } catch (error) {
    throw new RewindError(`${what} is not JSON: ${error.message}`);
  }
}

/** An event: `kind` routes it, `payload` is its JSON, parsed. */
export class Event {
  constructor(kind, payloadJson) {
    this.kind = kind;
    this.payloadJson = payloadJson;
  }

  get payload() {
    return parse(this.payloadJson, `the payload of event \`${this.kind}\``);
  }
}

/** A signal delivered to the input, as `ctx.awaitSignal` returns it: `name`, and `payload` parsed. */
export class Signal {
  constructor(name, payloadJson) {
    this.name = name;
    this.payloadJson = payloadJson;
  }

  get payload() {
    return parse(this.payloadJson, `the payload of signal \`${this.name}\``);
  }
}

const MAX_U64 = 2n ** 64n - 1n;

/** `ms` (a Number of milliseconds, at least 0) as the host's u64. */
function millis(ms, what) {
  if (typeof ms !== 'number' || !Number.isFinite(ms) || ms < 0) {
    throw new RewindError(`${what} is ${String(ms)}: a number of milliseconds, at least 0`);
  }
  const whole = BigInt(Math.floor(ms));
  return whole > MAX_U64 ? MAX_U64 : whole;
}

/** The levels of `ctx.log`. */
export const Level = Object.freeze({
  trace: 'trace',
  debug: 'debug',
  info: 'info',
  warn: 'warn',
  error: 'error',
});

/** What an action can reach: durable calls, events, the key's memory, the host's log. */
export class Context {
  /** The key of the input being processed (a user, a session, a ticket). */
  get key() {
    return contextKey();
  }

  /** The input's sequence number within its key, starting at 1 (a Number). */
  get sequence() {
    return Number(contextSequence());
  }

  /**
   * Calls `fn` with `args` (anything JSON.stringify takes; undefined is `{}`) and returns
   * its result parsed from JSON. The first time a run reaches the call, the host runs the
   * function and records the result before returning it; a replay gets the record back.
   * Throws CallFailed, CallDenied or UnknownFunction.
   */
  call(fn, args = {}) {
    const result = this.callJson(fn, dumps(args, `args for \`${fn}\``));
    return parse(result, `result of \`${fn}\``);
  }

  /** `call` with JSON text in and out. */
  callJson(fn, argsJson) {
    try {
      return durableCall(fn, argsJson);
    } catch (thrown) {
      const error = thrown?.payload;
      const Kind = error && CALL_ERRORS[error.tag];
      if (Kind) {
        throw new Kind(fn, error.val);
      }
      throw thrown;
    }
  }

  /**
   * Waits `ms` milliseconds, durably. The wait is recorded and the run stops here, holding
   * no instance, memory or run slot; when the time has come the input runs again from the
   * start, its durable calls and earlier waits answered from their records, and this
   * returns. A restart of the host neither shortens nor lengthens it. The key's later
   * inputs wait behind it. Code before the wait runs again when the input resumes: what it
   * does outside the sandbox must go through durable calls.
   */
  sleep(ms) {
    durableSleep(millis(ms, "sleep's length"));
  }

  /** Waits, as `sleep` does, until `when` (a Date, or milliseconds since the Unix epoch). */
  sleepUntil(when) {
    const ms = when instanceof Date ? when.getTime() : when;
    durableSleepUntil(millis(ms, "sleepUntil's time"));
  }

  /**
   * Waits, as `sleep` does, for a signal delivered to this input whose name is one of
   * `names` (each among the action's `signals` in agent.toml), and returns it as a Signal;
   * or returns null once `timeoutMs` has passed without one (undefined: no timeout). A
   * signal delivered before the wait is reached is kept for it; each signal is returned
   * by one wait only.
   */
  awaitSignal(names, { timeoutMs } = {}) {
    const list = typeof names === 'string' ? [names] : Array.from(names, String);
    const timeout = timeoutMs === undefined || timeoutMs === null ? undefined : millis(timeoutMs, 'awaitSignal\'s timeoutMs');
    const signal = durableAwaitSignal(list, timeout);
    return signal === undefined || signal === null ? null : new Signal(signal.name, signal.payload);
  }

  /**
   * Sends an event of `kind`, delivered when the run completes: to the actions bound to
   * `kind`, or out of the agent when `kind` is "output".
   */
  send(kind, payload) {
    contextSend({ kind, payload: dumps(payload ?? null, `the payload of \`${kind}\``) });
  }

  /** Sends `payload` out of the agent: `send("output", payload)`. */
  output(payload) {
    this.send('output', payload);
  }

  /** The value of `name` in the key's memory as the run started, else `fallback`. */
  memory(name, fallback = undefined) {
    const value = memoryGet(name);
    return value === undefined || value === null ? fallback : parse(value, `memory \`${name}\``);
  }

  /** Sets `name` in the key's memory when the run completes. */
  setMemory(name, value) {
    memorySet(name, dumps(value ?? null, `memory \`${name}\``));
  }

  /** Writes `message` to the host's log, labelled with the run. */
  log(level, message) {
    contextLog(level, String(message));
  }

  trace(message) {
    this.log(Level.trace, message);
  }

  debug(message) {
    this.log(Level.debug, message);
  }

  info(message) {
    this.log(Level.info, message);
  }

  warn(message) {
    this.log(Level.warn, message);
  }

  error(message) {
    this.log(Level.error, message);
  }
}

/** Stack frames of an error kept in the run's error, innermost first. */
const STACK_FRAMES = 16;

/** An error with its stack: `Name: message` and the innermost frames (file and line). */
function described(error) {
  const head = `${error.name}: ${error.message}`;
  const frames = String(error.stack ?? '')
    .split('\n')
    .map((line) => line.trim())
    .filter((line) => line !== '' && line !== head && !line.startsWith(`${error.name}:`));
  const kept = frames.slice(0, STACK_FRAMES).map((frame) => `  ${frame.startsWith('at ') ? frame : `at ${frame}`}`);
  if (frames.length > STACK_FRAMES) {
    kept.push(`  ... ${frames.length - STACK_FRAMES} frames more`);
  }
  return [head, ...kept].join('\n');
}

/**
 * The component's `run` export for `handler(ctx, event)`: `export const run = action(...)`.
 *
 * Returning completes the run: the events it sent and the memory it set are applied.
 * Throwing fails it: its sends and memory writes are dropped and the error's text is
 * reported by the host (a RewindError's message as is, any other error with its name and
 * its stack, at most 16 frames).
 * Durable calls it made stay recorded.
 */
export function action(handler) {
  if (typeof handler !== 'function') {
    throw new TypeError('action() takes a function (ctx, event) => void');
  }
  return function run(event) {
    try {
      handler(new Context(), new Event(event.kind, event.payload));
    } catch (error) {
      // componentize-js returns a thrown value's `payload` as the result's error.
      const message =
        error instanceof RewindError
          ? error.message
          : error instanceof Error
            ? described(error)
            : `thrown: ${String(error)}`;
      throw { payload: message };
    }
  };
}
