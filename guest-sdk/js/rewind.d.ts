// Types of the Rewind JavaScript SDK (`rewind.js`). Import from 'rewind':
//
//     import { action } from 'rewind';
//     export const run = action((ctx, event) => ctx.output(event.payload));

/** Anything `JSON.stringify` takes. */
export type Json = unknown;

/** Why an action failed: thrown out of the handler, its message is what the host reports. */
export class RewindError extends Error {
  constructor(message: string);
}

/** Why a durable call returned no value; `fn` is the function called, `reason` the host's text. */
export class CallError extends RewindError {
  constructor(fn: string, message: string, what: string);
  readonly fn: string;
  readonly reason: string;
}

/** The function ran and failed. Recorded: a replay throws it again without calling. */
export class CallFailed extends CallError {
  constructor(fn: string, message: string);
}

/** The action may not use this function now (not granted, quota spent). Not recorded. */
export class CallDenied extends CallError {
  constructor(fn: string, message: string);
}

/** No function of that name is declared for this agent. Not recorded. */
export class UnknownFunction extends CallError {
  constructor(fn: string, message: string);
}

/** An event: `kind` routes it, `payload` is its JSON, parsed on each read. */
export class Event {
  readonly kind: string;
  /** The payload as the JSON text the host passed. */
  readonly payloadJson: string;
  /** The payload, parsed; throws RewindError when it is not JSON. */
  get payload(): any;
}

/** A signal delivered to the input, as `ctx.awaitSignal` returns it. */
export class Signal {
  readonly name: string;
  readonly payloadJson: string;
  /** The signal's payload, parsed. */
  get payload(): any;
}

/** The levels of `ctx.log`. */
export const Level: Readonly<{
  trace: 'trace';
  debug: 'debug';
  info: 'info';
  warn: 'warn';
  error: 'error';
}>;
export type Level = 'trace' | 'debug' | 'info' | 'warn' | 'error';

/**
 * What an action can reach: durable calls, events, the key's memory, the host's log.
 *
 * `key` and `sequence` are properties, as in Python (`ctx.key`); in Rust they are methods
 * (`ctx.key()`).
 */
export class Context {
  /** The key of the input being processed (a user, a session, a ticket). */
  get key(): string;
  /** The input's sequence number within its key, starting at 1. */
  get sequence(): number;

  /**
   * Calls `fn` with `args` (undefined is `{}`) and returns its result parsed from JSON.
   * The first time a run reaches the call, the host runs the function and records the
   * result before returning it; a replay gets the record back.
   *
   * @throws CallFailed, CallDenied or UnknownFunction.
   */
  call<T = any>(fn: string, args?: Json): T;
  /** `call` with JSON text in and out. */
  callJson(fn: string, argsJson: string): string;

  /**
   * Waits `ms` milliseconds, durably: the run stops here, holding nothing, and the input
   * runs again from the start once the time has come, its calls served from their records.
   */
  sleep(ms: number): void;
  /** Waits, as `sleep` does, until `when` (a Date, or milliseconds since the Unix epoch). */
  sleepUntil(when: Date | number): void;
  /**
   * Waits, as `sleep` does, for a signal named one of `names` (each among the action's
   * `signals` in agent.toml); null once `timeoutMs` has passed without one.
   */
  awaitSignal(names: string | Iterable<string>, options?: { timeoutMs?: number | null }): Signal | null;

  /** Sends an event of `kind`, delivered when the run completes ("output" leaves the agent). */
  send(kind: string, payload?: Json): void;
  /** Sends `payload` out of the agent: `send("output", payload)`. */
  output(payload?: Json): void;

  /** The value of `name` in the key's memory as the run started, else `fallback`. */
  memory<T = any>(name: string, fallback?: T): T;
  /** Sets `name` in the key's memory when the run completes. */
  setMemory(name: string, value: Json): void;

  /** Writes `message` to the host's log, labelled with the run. */
  log(level: Level, message: string): void;
  trace(message: string): void;
  debug(message: string): void;
  info(message: string): void;
  warn(message: string): void;
  error(message: string): void;
}

/** The event the host passes to `run`. */
export interface RawEvent {
  kind: string;
  payload: string;
}

/**
 * The component's `run` export for `handler(ctx, event)`: `export const run = action(...)`.
 *
 * Returning completes the run: the events it sent and the memory it set are applied.
 * Throwing fails it: its sends and memory writes are dropped and the error's text is
 * reported by the host (a RewindError's message as is, any other error with its name and
 * its stack, at most 16 frames). Durable calls it made stay recorded.
 */
export function action(handler: (ctx: Context, event: Event) => void): (event: RawEvent) => void;
