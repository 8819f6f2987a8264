//! `rewind:action@0.1.0`'s imports, for components built before durable waits: each one
//! is 0.2.0's, whose types it converts.

use crate::sandbox::bindings::rewind::action::types as now;
use crate::sandbox::bindings::v0_1::rewind::action::{context, durable, types};
use crate::sandbox::run::RunState;

impl types::Host for RunState {}

impl durable::Host for RunState {
    async fn call(
        &mut self,
        function: String,
        args: String,
    ) -> wasmtime::Result<Result<String, types::CallError>> {
        let called = <Self as crate::sandbox::bindings::rewind::action::durable::Host>::call(
            self, function, args,
        )
        .await?;
        Ok(called.map_err(|error| match error {
            now::CallError::Failed(m) => types::CallError::Failed(m),
            now::CallError::Denied(m) => types::CallError::Denied(m),
            now::CallError::UnknownFunction(m) => types::CallError::UnknownFunction(m),
        }))
    }
}

impl context::Host for RunState {
    fn key(&mut self) -> wasmtime::Result<String> {
        <Self as crate::sandbox::bindings::rewind::action::context::Host>::key(self)
    }

    fn sequence(&mut self) -> wasmtime::Result<u64> {
        <Self as crate::sandbox::bindings::rewind::action::context::Host>::sequence(self)
    }

    fn send(&mut self, event: types::Event) -> wasmtime::Result<()> {
        let event = now::Event {
            kind: event.kind,
            payload: event.payload,
        };
        <Self as crate::sandbox::bindings::rewind::action::context::Host>::send(self, event)
    }

    fn memory_get(&mut self, name: String) -> wasmtime::Result<Option<String>> {
        <Self as crate::sandbox::bindings::rewind::action::context::Host>::memory_get(self, name)
    }

    fn memory_set(&mut self, name: String, value: String) -> wasmtime::Result<()> {
        <Self as crate::sandbox::bindings::rewind::action::context::Host>::memory_set(
            self, name, value,
        )
    }

    fn log(&mut self, level: types::Level, message: String) -> wasmtime::Result<()> {
        let level = match level {
            types::Level::Trace => now::Level::Trace,
            types::Level::Debug => now::Level::Debug,
            types::Level::Info => now::Level::Info,
            types::Level::Warn => now::Level::Warn,
            types::Level::Error => now::Level::Error,
        };
        <Self as crate::sandbox::bindings::rewind::action::context::Host>::log(self, level, message)
    }
}
