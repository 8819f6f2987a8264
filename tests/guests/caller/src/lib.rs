//! A scriptable action for the host's tests: the event's payload says which durable calls
//! to make, which memory to write and read, which events to send, and whether to fail.
//!
//! Payload (every field optional; `null` is an empty script):
//!
//! ```json
//! {
//!   "calls": [{ "function": "f", "args": {} }],
//!   "memory_set": { "name": 1 },
//!   "memory_get": ["name"],
//!   "send": [{ "kind": "k", "payload": {} }],
//!   "fail": "message",
//!   "raise": "message",
//!   "output": true,
//!   "ambient": true,
//!   "stamp_calls": true
//! }
//! ```
//!
//! Steps, in this order: make the calls (`args` default to `{}`), write memory, read
//! memory, send the events; then fail with `fail` if it is set (the calls stay recorded,
//! the run does not complete), else, unless `output` is `false`, send an `output` event:
//!
//! ```json
//! {
//!   "kind": "<triggering event kind>",
//!   "key": "<key>",
//!   "sequence": 1,
//!   "results": [{ "ok": <result> }, { "error": { "failed": "..." } }],
//!   "memory": { "name": <value or null> }
//! }
//! ```
//!
//! A step of `calls` may be a durable wait instead of a call: `{"sleep_ms": N}`,
//! `{"sleep_until_ms": T}` (each reported as `{"slept": true}`), or `{"await": ["name"],
//! "timeout_ms": N}` (`timeout_ms` optional), reported as `{"signal": {"name": ..,
//! "payload": <JSON>}}` or `{"timed_out": true}`.
//!
//! A call's error is `{"failed": ..}`, `{"denied": ..}` or `{"unknown-function": ..}`; a
//! result that is not JSON is reported as `{"not-json": "<text>"}`. Events of any kind are
//! handled the same way, so a test can script a chain of actions.
//!
//! `raise` fails as the language's own failure does, after the sends: Rust panics with the
//! message, the Python twin raises `ValueError`, the JavaScript twin throws `RangeError`
//! (each from a function of its own, so that the failure's trace has a frame of this file).
//!
//! `stamp_calls` adds the wall-clock time (`stamped_at`, nanoseconds) and a random number
//! (`nonce`) to every call's args; `ambient` adds to the output what the run read from its
//! clocks and random sources: `{"wall_ns", "elapsed_ns", "random", "hash_order"}` (a number
//! from a generator seeded from WASI randomness, and a `HashMap`'s iteration order).
//! tests/guests/caller-py and caller-js run the same scripts.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use rand::{Rng as _, SeedableRng as _};
use rewind_guest::{Action, CallError, Context, Error, Event};
use serde::Deserialize;
use serde_json::{Map, Value, json};

/// What the event asks the action to do.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Script {
    calls: Vec<Call>,
    send: Vec<Send>,
    memory_set: Map<String, Value>,
    memory_get: Vec<String>,
    fail: Option<String>,
    raise: Option<String>,
    output: Option<bool>,
    ambient: bool,
    stamp_calls: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Call {
    #[serde(default)]
    function: String,
    #[serde(default = "empty_object")]
    args: Value,
    sleep_ms: Option<u64>,
    sleep_until_ms: Option<u64>,
    #[serde(rename = "await")]
    await_signals: Option<Vec<String>>,
    timeout_ms: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Send {
    kind: String,
    #[serde(default)]
    payload: Value,
}

/// Panics with `message`.
fn raise(message: &str) -> ! {
    panic!("{message}")
}

fn empty_object() -> Value {
    Value::Object(Map::new())
}

/// Runs the script in its triggering event.
#[derive(Debug)]
struct Caller;

impl Action for Caller {
    fn run(ctx: &mut Context, event: Event) -> Result<(), Error> {
        let script: Option<Script> = event.payload()?;
        let script = script.unwrap_or_default();

        let mut results = Vec::with_capacity(script.calls.len());
        for call in &script.calls {
            if let Some(waited) = wait(ctx, call) {
                results.push(waited);
                continue;
            }
            let mut args = call.args.clone();
            if script.stamp_calls
                && let Value::Object(fields) = &mut args
            {
                fields.insert("stamped_at".to_owned(), json!(wall_ns()));
                fields.insert("nonce".to_owned(), json!(rand::random::<u64>()));
            }
            let args = serde_json::to_string(&args)?;
            results.push(outcome(ctx.call_json(&call.function, &args)));
        }

        for (name, value) in &script.memory_set {
            ctx.set_memory(name, value)?;
        }
        let mut memory = Map::new();
        for name in &script.memory_get {
            let value: Option<Value> = ctx.memory(name)?;
            memory.insert(name.clone(), value.unwrap_or(Value::Null));
        }

        for send in &script.send {
            ctx.send(&send.kind, &send.payload)?;
        }

        if let Some(message) = script.fail {
            return Err(Error::msg(message));
        }
        if let Some(message) = script.raise {
            raise(&message);
        }
        if script.output.unwrap_or(true) {
            let mut output = json!({
                "kind": event.kind,
                "key": ctx.key(),
                "sequence": ctx.sequence(),
                "results": results,
                "memory": memory,
            });
            if script.ambient {
                output["ambient"] = ambient();
            }
            ctx.output(&output)?;
        }
        Ok(())
    }
}

fn wall_ns() -> u128 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|since| since.as_nanos())
        .unwrap_or_default()
}

/// What this run reads from its clocks and random sources.
fn ambient() -> Value {
    let started = Instant::now();
    let mut rng = rand::rngs::StdRng::from_os_rng();
    let order: HashMap<String, u8> = (0..8u8).map(|i| (format!("k{i}"), i)).collect();
    json!({
        "wall_ns": wall_ns().to_string(),
        "elapsed_ns": started.elapsed().as_nanos().to_string(),
        "random": rng.random::<u64>().to_string(),
        "hash_order": order.keys().collect::<Vec<_>>(),
    })
}

/// The step's durable wait, if it is one, and what it returned.
fn wait(ctx: &mut Context, call: &Call) -> Option<Value> {
    if let Some(ms) = call.sleep_ms {
        ctx.sleep(Duration::from_millis(ms));
    } else if let Some(ms) = call.sleep_until_ms {
        ctx.sleep_until(SystemTime::UNIX_EPOCH + Duration::from_millis(ms));
    } else if let Some(names) = &call.await_signals {
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let timeout = call.timeout_ms.map(Duration::from_millis);
        return Some(match ctx.await_signal(&names, timeout) {
            Some(signal) => {
                let payload: Value = signal.payload().unwrap_or(Value::Null);
                json!({ "signal": { "name": signal.name, "payload": payload } })
            }
            None => json!({ "timed_out": true }),
        });
    } else {
        return None;
    }
    Some(json!({ "slept": true }))
}

/// One call's result as the output reports it.
fn outcome(result: Result<String, CallError>) -> Value {
    match result {
        Ok(text) => match serde_json::from_str::<Value>(&text) {
            Ok(value) => json!({ "ok": value }),
            Err(_) => json!({ "not-json": text }),
        },
        Err(CallError::Failed(message)) => json!({ "error": { "failed": message } }),
        Err(CallError::Denied(message)) => json!({ "error": { "denied": message } }),
        Err(CallError::UnknownFunction(message)) => {
            json!({ "error": { "unknown-function": message } })
        }
        // `call_json` returns no other error today; report any future one by its text.
        Err(other) => json!({ "error": { "other": other.to_string() } }),
    }
}

rewind_guest::export_action!(Caller);
