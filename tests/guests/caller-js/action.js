// The JavaScript twin of tests/guests/caller: the event's payload is a script of durable
// calls, memory writes and reads, sends and a failure, run in that order (see its lib.rs).
// `ambient` reports Date.now(), performance.now(), Math.random() and crypto random bytes;
// `stamp_calls` adds the time and a random number to every call's args.

import { action, CallFailed, CallDenied, UnknownFunction, RewindError } from 'rewind';

const FIELDS = new Set([
  'calls',
  'send',
  'memory_set',
  'memory_get',
  'fail',
  'raise',
  'output',
  'ambient',
  'stamp_calls',
]);

function raise(message) {
  throw new RangeError(message);
}

// A step that is a durable wait (`sleep_ms`, `sleep_until_ms`, `await` with `timeout_ms`),
// and what it returned; undefined for a call.
function wait(ctx, step) {
  if (step.sleep_ms !== undefined) {
    ctx.sleep(step.sleep_ms);
  } else if (step.sleep_until_ms !== undefined) {
    ctx.sleepUntil(step.sleep_until_ms);
  } else if (step.await !== undefined) {
    const signal = ctx.awaitSignal(step.await, { timeoutMs: step.timeout_ms });
    return signal === null ? { timed_out: true } : { signal: { name: signal.name, payload: signal.payload } };
  } else {
    return undefined;
  }
  return { slept: true };
}

function outcome(ctx, fn, args) {
  let text;
  try {
    text = ctx.callJson(fn, JSON.stringify(args));
  } catch (error) {
    if (error instanceof CallFailed) return { error: { failed: error.reason } };
    if (error instanceof CallDenied) return { error: { denied: error.reason } };
    if (error instanceof UnknownFunction) return { error: { 'unknown-function': error.reason } };
    throw error;
  }
  try {
    return { ok: JSON.parse(text) };
  } catch {
    return { 'not-json': text };
  }
}

export const run = action((ctx, event) => {
  const script = event.payload ?? {};
  const unknown = Object.keys(script).filter((field) => !FIELDS.has(field));
  if (unknown.length > 0) {
    throw new RewindError(`unknown field(s) in the script: ${unknown.join(', ')}`);
  }

  const results = [];
  for (const call of script.calls ?? []) {
    const waited = wait(ctx, call);
    if (waited !== undefined) {
      results.push(waited);
      continue;
    }
    let args = call.args === undefined ? {} : call.args;
    if (script.stamp_calls && args !== null && typeof args === 'object' && !Array.isArray(args)) {
      args = { ...args, stamped_at: Date.now(), nonce: Math.floor(Math.random() * 2 ** 52) };
    }
    results.push(outcome(ctx, call.function, args));
  }

  for (const [name, value] of Object.entries(script.memory_set ?? {})) {
    ctx.setMemory(name, value);
  }
  const memory = {};
  for (const name of script.memory_get ?? []) {
    memory[name] = ctx.memory(name, null);
  }

  for (const send of script.send ?? []) {
    ctx.send(send.kind, send.payload ?? null);
  }

  if (script.fail !== undefined && script.fail !== null) {
    throw new RewindError(script.fail);
  }
  if (script.raise !== undefined && script.raise !== null) {
    raise(script.raise);
  }
  if (script.output !== false) {
    const output = {
      kind: event.kind,
      key: ctx.key,
      sequence: ctx.sequence,
      results,
      memory,
    };
    if (script.ambient) {
      const bytes = new Uint8Array(8);
      crypto.getRandomValues(bytes);
      output.ambient = {
        wall_ms: Date.now(),
        monotonic_ms: performance.now(),
        random: Math.random(),
        bytes: Array.from(bytes),
      };
    }
    ctx.output(output);
  }
});
