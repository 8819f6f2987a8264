//! `rewind:action/context`: what an action knows and can do inside its agent.

use crate::event::Event;
use crate::sandbox::bindings::rewind::action::context::Host;
use crate::sandbox::bindings::rewind::action::types::{self, Level};
use crate::sandbox::limits::Limit;
use crate::sandbox::run::{RunError, RunState};
use crate::store::MemoryWrite;
use crate::text;

impl RunState {
    /// Ends the run with `error`: kept to be reported as itself, not as the trap it causes.
    pub(super) fn stop(&mut self, error: RunError) -> wasmtime::Error {
        let message = error.to_string();
        self.stop = Some(error);
        wasmtime::Error::msg(message)
    }
}

impl RunState {
    /// The bytes of the key's memory once `name` holds an entry of `size` bytes, its name
    /// included: the memory as the run started, with the run's writes so far.
    fn memory_bytes_with(&mut self, name: &str, size: usize) -> u64 {
        let entry = |name: &str, value: &str| (name.len() + value.len()) as u64;
        let total = *self
            .used
            .memory_bytes
            .get_or_insert_with(|| self.memory.iter().map(|(n, v)| entry(n, v)).sum());
        // The run's own newest write of `name` replaces what the memory held.
        let replaced = match self.writes.iter().rev().find(|w| w.name == name) {
            Some(write) => entry(&write.name, &write.value),
            None => self.memory.get(name).map_or(0, |value| entry(name, value)),
        };
        total - replaced + size as u64
    }
}

/// `used` + `more`, unless that passes `limit`.
fn within(used: u64, more: usize, limit: u64) -> Option<u64> {
    used.checked_add(u64::try_from(more).ok()?)
        .filter(|&total| total <= limit)
}

impl Host for RunState {
    fn key(&mut self) -> wasmtime::Result<String> {
        Ok(self.labels.key.clone())
    }

    fn sequence(&mut self) -> wasmtime::Result<u64> {
        Ok(self.labels.sequence)
    }

    fn send(&mut self, event: types::Event) -> wasmtime::Result<()> {
        let limits = self.limits;
        if self.sent.len() >= limits.sends_per_run as usize {
            return Err(self.stop(RunError::Limit(Limit::SendsPerRun {
                events: limits.sends_per_run,
            })));
        }
        let size = event.kind.len() + event.payload.len();
        if size as u64 > limits.send_payload_bytes {
            return Err(self.stop(RunError::Limit(Limit::SendPayloadBytes {
                bytes: limits.send_payload_bytes,
            })));
        }
        let Some(sent) = within(self.used.sent_bytes, size, limits.send_bytes) else {
            return Err(self.stop(RunError::Limit(Limit::SendBytes {
                bytes: limits.send_bytes,
            })));
        };
        if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(&event.payload) {
            return Err(self.stop(RunError::Refused(text::outside_error(&format!(
                "send: the payload of an event of kind `{}` is not JSON: {e}",
                event.kind
            )))));
        }
        self.used.sent_bytes = sent;
        self.sent.push(Event::new(event.kind, event.payload));
        Ok(())
    }

    fn memory_get(&mut self, name: String) -> wasmtime::Result<Option<String>> {
        // Writes apply when the run completes (WIT `context`), so a run reads the memory as
        // it was when the run started, its own writes not included.
        Ok(self.memory.get(&name).cloned())
    }

    fn memory_set(&mut self, name: String, value: String) -> wasmtime::Result<()> {
        let limits = self.limits;
        if self.used.memory_set_entries >= limits.memory_set_entries {
            return Err(self.stop(RunError::Limit(Limit::MemorySetEntries {
                entries: limits.memory_set_entries,
            })));
        }
        if name.len() as u64 > u64::from(limits.memory_name_bytes) {
            return Err(self.stop(RunError::Limit(Limit::MemoryNameBytes {
                bytes: limits.memory_name_bytes,
            })));
        }
        let size = name.len() + value.len();
        let Some(written) = within(self.used.memory_set_bytes, size, limits.memory_set_bytes)
        else {
            return Err(self.stop(RunError::Limit(Limit::MemorySetBytes {
                bytes: limits.memory_set_bytes,
            })));
        };
        let total = self.memory_bytes_with(&name, size);
        if total > limits.memory_bytes {
            return Err(self.stop(RunError::Limit(Limit::MemoryBytes {
                bytes: limits.memory_bytes,
            })));
        }
        self.used.memory_set_entries += 1;
        self.used.memory_set_bytes = written;
        self.used.memory_bytes = Some(total);
        self.writes.push(MemoryWrite { name, value });
        Ok(())
    }

    fn log(&mut self, level: Level, message: String) -> wasmtime::Result<()> {
        // A message is kept whole or dropped whole (and counted, for the run's warning).
        if !self.wasi.log.take_whole(message.len()) {
            return Ok(());
        }
        let message = text::escaped(&message);
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
