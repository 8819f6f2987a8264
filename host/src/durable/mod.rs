//! Durable calls: every call out of the sandbox is recorded before the guest sees its
//! result, and served from that record when the run is replayed.
//!
//! docs/SEMANTICS.md, "The durable call", is the contract this module implements.

mod ambient;
mod call;
pub mod digest;
mod resolve;
mod wait;

pub use ambient::{AmbientSource, RandomStream, SEED_ENV, Seeded, seed, seed_from_env, seeded};

pub use call::{
    CallBudget, CallError, CallPolicy, CallStats, CallsByFunction, DivergencePolicy, DurableCalls,
    Fault, InDoubtPolicy,
};
pub use resolve::{Answer, ResolveError, Resolved, resolve};
pub use wait::{
    AWAIT_SIGNAL, MAX_SIGNAL_NAME_BYTES, MAX_SIGNAL_NAMES, Reached, SLEEP, SLEEP_UNTIL, Signal,
    SignalScript, WaitFor, taken_signals, unix_ms,
};
