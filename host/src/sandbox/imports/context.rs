//! `rewind:action/context`: what an action knows and can do inside its agent.

use crate::event::Event;
use crate::sandbox::bindings::rewind::action::context::Host;
use crate::sandbox::bindings::rewind::action::types::{self, Level};
use crate::sandbox::run::RunState;
use crate::store::MemoryWrite;

/// Events one run may send; a guest that sends more is stopped.
const MAX_SENT_EVENTS: usize = 1024;
/// Bytes of one memory value.
const MAX_MEMORY_VALUE: usize = 1 << 20;

impl Host for RunState {
    fn key(&mut self) -> wasmtime::Result<String> {
        Ok(self.labels.key.clone())
    }

    fn sequence(&mut self) -> wasmtime::Result<u64> {
        Ok(self.labels.sequence)
    }

    fn send(&mut self, event: types::Event) -> wasmtime::Result<()> {
        if self.sent.len() >= MAX_SENT_EVENTS {
            wasmtime::bail!("send: a run may send at most {MAX_SENT_EVENTS} events");
        }
        if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(&event.payload) {
            wasmtime::bail!(
                "send: the payload of an event of kind `{}` is not JSON: {e}",
                event.kind
            );
        }
        self.sent.push(Event::new(event.kind, event.payload));
        Ok(())
    }

    fn memory_get(&mut self, name: String) -> wasmtime::Result<Option<String>> {
        // Writes apply when the run completes (WIT `context`), so a run reads the memory as
        // it was when the run started, its own writes not included.
        Ok(self.memory.get(&name).cloned())
    }

    fn memory_set(&mut self, name: String, value: String) -> wasmtime::Result<()> {
        if value.len() > MAX_MEMORY_VALUE {
            wasmtime::bail!(
                "memory-set `{name}`: {} bytes is more than the {MAX_MEMORY_VALUE} a value may hold",
                value.len()
            );
        }
        self.writes.push(MemoryWrite { name, value });
        Ok(())
    }

    fn log(&mut self, level: Level, message: String) -> wasmtime::Result<()> {
        let l = &self.labels;
        macro_rules! emit {
            ($level:expr) => {
                tracing::event!(target: "rewind::guest", $level, agent = %l.agent, key = %l.key,
                    sequence = l.sequence, action = %l.action, "{message}")
            };
        }
        match level {
            Level::Trace => emit!(tracing::Level::TRACE),
            Level::Debug => emit!(tracing::Level::DEBUG),
            Level::Info => emit!(tracing::Level::INFO),
            Level::Warn => emit!(tracing::Level::WARN),
            Level::Error => emit!(tracing::Level::ERROR),
        }
        Ok(())
    }
}
