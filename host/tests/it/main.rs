//! Integration tests of rewind-host: real components built from source, real wasmtime,
//! real HTTP servers on loopback.

mod calls;
mod cli;
mod concurrency;
mod functions;
mod in_doubt;
mod kill;
mod kit;
mod model;
mod recovery;
mod sandbox;
mod store;
mod support;
