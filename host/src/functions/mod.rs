//! Functions: what a durable call reaches.
//!
//! An agent declares its functions in `agent.toml`; each becomes a [`Function`] in the
//! agent's [`Functions`]. Embedders add their own with [`Functions::register`].

mod builtin;
mod hosts;
mod http;
mod mcp;
mod openai;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;

pub use builtin::{Clock, RandomFunction, SKIP_TIME_ENV, SkippingClock, SystemClock, TimeFunction};
pub use hosts::AllowedHosts;
pub use http::{DEFAULT_MAX_RESPONSE_BYTES, HttpConfig, HttpFunction, RetryPolicy};
pub use mcp::{IDEMPOTENCY_META, McpConfig, McpFunction, PROTOCOL_VERSION};
pub use openai::{OpenAiChatConfig, OpenAiChatFunction, completion_of_stream};

/// The run slot a call's run holds, which a function lets go of while it waits between
/// attempts (a 429's `Retry-After`, a backoff), so that another input runs meanwhile.
#[async_trait]
pub trait RunSlot: Send + Sync {
    /// Waits for `wait`, having let go of the run slot when the host allows (it bounds how
    /// many runs are away at once: their instances stay alive), then takes a slot again
    /// (waiting for one to be free, as the run's start did). `false`: no slot could be
    /// taken again (the host is stopping); the call should end, unavailable.
    async fn away<'a>(
        &'a self,
        wait: std::pin::Pin<Box<dyn Future<Output = ()> + Send + 'a>>,
    ) -> bool;
}

impl fmt::Debug for dyn RunSlot + '_ {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RunSlot")
    }
}

/// Where a call's function sends the pieces of a streamed answer as they come (the chunks'
/// deltas), for the host to forward to whoever follows the outputs. Never recorded.
pub trait CallDeltas: Send + Sync {
    fn delta(&self, delta: &serde_json::Value);
}

impl fmt::Debug for dyn CallDeltas + '_ {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CallDeltas")
    }
}

/// One call of a function, as its handler sees it.
#[derive(Clone, Copy, Debug)]
pub struct CallRequest<'a> {
    /// The name the agent declared the function under.
    pub function: &'a str,
    /// JSON text.
    pub args: &'a str,
    /// Stable across replays of the same call: pass it to the remote side so that it can
    /// drop a repeat (`Idempotency-Key` for HTTP).
    pub idempotency_key: &'a str,
    /// The run slot the call's run holds, when the host lends it ([`RunSlot`]).
    pub slot: Option<&'a dyn RunSlot>,
    /// Where a streamed answer's pieces go as they come, when someone follows them.
    pub deltas: Option<&'a dyn CallDeltas>,
}

/// Why a function returned no result.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FunctionError {
    /// The function ran and failed. Recorded, and returned again on replay.
    #[error("{0}")]
    Failed(String),
    /// The function could not be reached; nobody knows whether it ran. Not recorded: the
    /// run fails, and running the input again calls it again with the same idempotency key.
    #[error("unavailable: {0}")]
    Unavailable(String),
}

/// What the remote side says became of a call left in doubt (docs/SEMANTICS.md, "In-doubt
/// calls").
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reconciled {
    /// It ran and answered this JSON: recorded as the call's result.
    Succeeded(String),
    /// It ran and failed: recorded as the call's failure.
    Failed(String),
    /// It never ran: the call is made now, with the same idempotency key.
    NotRun,
}

/// The handler behind a declared function.
#[async_trait]
pub trait Function: Send + Sync + fmt::Debug {
    /// Runs one call. Returns the JSON text of the result.
    async fn call(&self, request: CallRequest<'_>) -> Result<String, FunctionError>;

    /// Whether [`reconcile`](Self::reconcile) can ask the remote side; a function declared
    /// `in-doubt = "reconcile"` must be able to.
    fn can_reconcile(&self) -> bool {
        false
    }

    /// Asks the remote side what became of the call `request` describes, which a crash
    /// left pending with no result. `Err(Unavailable)` when it cannot be asked now: the run
    /// fails, the call stays pending, and the next run asks again. `Err(Failed)` is taken
    /// as [`Reconciled::Failed`].
    async fn reconcile(&self, request: CallRequest<'_>) -> Result<Reconciled, FunctionError> {
        Err(FunctionError::Unavailable(format!(
            "`{}` has no reconcile handler",
            request.function
        )))
    }

    /// Where the function reaches out to, if anywhere (checked before a run starts).
    fn endpoint(&self) -> Option<&str> {
        None
    }
}

/// A declared function with its grant.
#[derive(Clone, Debug)]
pub struct Declared {
    pub handler: Arc<dyn Function>,
    /// Actions allowed to call it; `None` means every action of the agent.
    pub actions: Option<Vec<String>>,
}

impl Declared {
    /// Whether `action` may call this function.
    pub fn grants(&self, action: &str) -> bool {
        self.actions
            .as_ref()
            .is_none_or(|actions| actions.iter().any(|a| a == action))
    }
}

/// The functions one agent may call, by name.
#[derive(Clone, Debug, Default)]
pub struct Functions {
    declared: BTreeMap<String, Declared>,
}

impl Functions {
    pub fn new() -> Self {
        Self::default()
    }

    /// Declares `name`, callable by every action unless `actions` restricts it. A later
    /// registration under the same name replaces the earlier one.
    pub fn register(
        &mut self,
        name: impl Into<String>,
        handler: Arc<dyn Function>,
        actions: Option<Vec<String>>,
    ) -> &mut Self {
        self.declared
            .insert(name.into(), Declared { handler, actions });
        self
    }

    pub fn get(&self, name: &str) -> Option<&Declared> {
        self.declared.get(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Declared)> {
        self.declared.iter().map(|(k, v)| (k.as_str(), v))
    }
}
