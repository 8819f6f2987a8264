//! Integration tests of rewind-host: real components built from source, real wasmtime,
//! real HTTP servers on loopback.

#[macro_use]
mod support;

mod ambient;
mod bounds;
mod calls;
mod cli;
mod concurrency;
mod drivers;
mod first_agent;
mod functions;
mod idempotency;
mod in_doubt;
mod kill;
mod kit;
mod mcp;
mod model;
mod nats;
mod operator;
mod polyglot;
mod readme;
mod recovery;
mod remote;
mod sandbox;
mod serve;
mod store;
