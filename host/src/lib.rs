//! Rewind runs agent actions as sandboxed WebAssembly components whose external calls are
//! durable: each call's result is recorded before the action sees it, and served from the
//! record when the action runs again.
//!
//! The modules, from the outside in (each uses only those below it):
//! - [`server`] and [`cluster`]: the other ways in beside `rewind run`: many tenants over
//!   HTTP on one machine, and one agent's partitions shared by hosts over NATS JetStream;
//! - [`keys`]: the per-key core (each key's inputs in order, its memory, retries and
//!   parked inputs) and `rewind run`'s front end over it, which takes checkpoints;
//! - [`agent`]: an agent's actions and functions, and the path of one input through them;
//! - [`checkpoint`]: checkpoints (the cut and its marker) and where they are kept;
//! - [`sandbox`]: compiling, checking and running components, with limits;
//! - [`durable`]: the durable call (hit, miss, divergence), over a store and functions;
//! - [`functions`]: what a durable call reaches (HTTP, chat, time, random, custom);
//! - [`store`]: action states, the store trait, the in-memory and log-backed stores;
//! - [`log`]: the partitioned durable log (in memory, the embedded file log, JetStream);
//! - [`event`]: events, inputs and outputs;
//! - [`text`]: text from outside (a guest's errors and logs), bounded and escaped;
//! - [`crash`]: crash points at the durable boundaries, for tests that kill the process;
//! - [`state_dir`]: a directory that holds state: one writer at a time, and its incarnation;
//! - [`commands`]: operator commands (retry, skip) left for the process that runs a state.

pub mod agent;
pub mod backoff;
pub mod checkpoint;
#[cfg(feature = "jetstream")]
pub mod cluster;
pub mod commands;
pub mod crash;
pub mod durable;
pub mod event;
pub mod functions;
pub mod keys;
pub mod kit;
pub mod log;
pub mod private;
pub mod sandbox;
#[cfg(feature = "server")]
pub mod server;
pub mod state_dir;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;
pub mod text;
pub mod version;
