//! `rewind:action/durable`: the only way out of the sandbox, and the run's durable waits.

use crate::durable::{CallError, WaitFor};
use crate::sandbox::bindings::rewind::action::durable::Host;
use crate::sandbox::bindings::rewind::action::types;
use crate::sandbox::run::{RunError, RunState};

impl RunState {
    /// A durable wait: the signal that ended it (none when its time came), or the run
    /// stops here with [`RunError::Waiting`] until it can be over.
    async fn wait(&mut self, what: WaitFor) -> wasmtime::Result<Option<types::Signal>> {
        // Like a call's, a wait's time is not the run's.
        let in_call = self.running.in_call();
        let waited = self.durable.wait(what).await;
        drop(in_call);
        match waited {
            Ok(Ok(signal)) => Ok(signal.map(|s| types::Signal {
                name: s.name,
                payload: s.payload,
            })),
            Ok(Err(wait)) => Err(self.stop(RunError::Waiting(wait))),
            Err(fault) => Err(self.stop(fault.into())),
        }
    }
}

impl Host for RunState {
    async fn call(
        &mut self,
        function: String,
        args: String,
    ) -> wasmtime::Result<Result<String, types::CallError>> {
        // The call's time is not the run's: `timeout-ms` does not count it.
        let in_call = self.running.in_call();
        let called = self.durable.call(&function, &args).await;
        drop(in_call);
        match called {
            Ok(Ok(result)) => Ok(Ok(result)),
            Ok(Err(error)) => Ok(Err(match error {
                CallError::Failed(m) => types::CallError::Failed(m),
                CallError::Denied(m) => types::CallError::Denied(m),
                CallError::UnknownFunction(m) => types::CallError::UnknownFunction(m),
            })),
            Err(fault) => Err(self.stop(fault.into())),
        }
    }

    async fn sleep(&mut self, ms: u64) -> wasmtime::Result<()> {
        self.wait(WaitFor::Sleep { ms }).await.map(drop)
    }

    async fn sleep_until(&mut self, unix_ms: u64) -> wasmtime::Result<()> {
        self.wait(WaitFor::SleepUntil { unix_ms }).await.map(drop)
    }

    async fn await_signal(
        &mut self,
        names: Vec<String>,
        timeout_ms: Option<u64>,
    ) -> wasmtime::Result<Option<types::Signal>> {
        self.wait(WaitFor::Signal { names, timeout_ms }).await
    }
}
