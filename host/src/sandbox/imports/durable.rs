//! `rewind:action/durable`: the only way out of the sandbox.

use crate::durable::CallError;
use crate::sandbox::bindings::rewind::action::durable::Host;
use crate::sandbox::bindings::rewind::action::types;
use crate::sandbox::run::RunState;

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
}
