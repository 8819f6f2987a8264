//! What an action knows and can do inside its agent.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::bindings::rewind::action::{context, durable, types};
use crate::{CallError, Error, Event, Level, Signal};

/// The action's handle on the host: durable calls, the input's key and sequence, events
/// to send, the key's memory, and logging.
///
/// One is passed to each [`Action::run`](crate::Action::run); it cannot be made any other
/// way.
///
/// Sends and memory writes are applied when the run completes (returns `Ok`); a failed
/// run applies neither.
///
/// # Example
///
/// ```no_run
/// use rewind_guest::{Action, Context, Error, Event};
/// use serde_json::{Value, json};
///
/// struct Greeter;
///
/// impl Action for Greeter {
///     fn run(ctx: &mut Context, _event: Event) -> Result<(), Error> {
///         let visits = ctx.memory::<u64>("visits")?.unwrap_or(0) + 1;
///         ctx.set_memory("visits", &visits)?;
///         let reply: Value = ctx.call("llm.chat", &json!({
///             "messages": [{ "role": "user", "content": format!("Greet visitor #{visits}") }],
///         }))?;
///         ctx.output(&json!({ "key": ctx.key(), "visits": visits, "reply": reply["content"] }))
///     }
/// }
///
/// rewind_guest::export_action!(Greeter);
/// # fn main() {}
/// ```
#[derive(Debug)]
pub struct Context {
    // Keeps construction inside the crate: a `Context` exists only inside a run.
    _private: (),
}

impl Context {
    pub(crate) fn new() -> Self {
        Self { _private: () }
    }

    /// The key of the input being processed (a user, a session, a ticket).
    ///
    /// # Example
    ///
    /// ```no_run
    /// # fn f(ctx: &rewind_guest::Context) {
    /// let customer = ctx.key();
    /// ctx.info(&format!("handling a ticket from {customer}"));
    /// # }
    /// ```
    pub fn key(&self) -> String {
        context::key()
    }

    /// The input's sequence number within its key: 1 for a key's first input, 2 for the
    /// next, and so on.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # fn f(ctx: &rewind_guest::Context) {
    /// if ctx.sequence() == 1 {
    ///     ctx.info("first input for this key");
    /// }
    /// # }
    /// ```
    pub fn sequence(&self) -> u64 {
        context::sequence()
    }

    /// Calls `function` with `args` serialised to JSON, and parses its JSON result as
    /// `Resp`.
    ///
    /// The call is durable: the first time a run reaches it, the host runs the function and
    /// records the result (or the failure) before returning it. When the same input runs
    /// again, the call at the same position with the same function and args is answered
    /// from that record and the function does not run. Make calls in a deterministic order
    /// so that a rerun reaches the same calls.
    ///
    /// # Errors
    ///
    /// - [`CallError::Failed`]: the function ran and failed (recorded).
    /// - [`CallError::Denied`], [`CallError::UnknownFunction`]: the function was not run.
    /// - [`CallError::Decode`]: the function succeeded but its result does not parse as
    ///   `Resp`.
    /// - [`CallError::Encode`]: `args` cannot be serialised to JSON; nothing was called.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use serde::{Deserialize, Serialize};
    ///
    /// #[derive(Serialize)]
    /// struct Lookup<'a> {
    ///     order_id: &'a str,
    /// }
    ///
    /// #[derive(Deserialize)]
    /// struct Order {
    ///     status: String,
    ///     eta_days: u32,
    /// }
    ///
    /// # fn f(ctx: &mut rewind_guest::Context) -> Result<(), rewind_guest::Error> {
    /// let order: Order = ctx.call("orders.lookup", &Lookup { order_id: "A1234" })?;
    /// ctx.info(&format!("{} (eta {} days)", order.status, order.eta_days));
    /// # Ok(())
    /// # }
    /// ```
    pub fn call<Req, Resp>(&mut self, function: &str, args: &Req) -> Result<Resp, CallError>
    where
        Req: Serialize + ?Sized,
        Resp: DeserializeOwned,
    {
        let args = serde_json::to_string(args).map_err(|error| CallError::Encode {
            function: function.to_string(),
            message: error.to_string(),
        })?;
        let result = self.call_json(function, &args)?;
        serde_json::from_str(&result).map_err(|error| CallError::Decode {
            function: function.to_string(),
            message: error.to_string(),
        })
    }

    /// Calls `function` with `args_json` (JSON text) and returns its result as JSON text.
    ///
    /// The untyped form of [`call`](Self::call), with the same durability. The host
    /// compares args by their canonical form, so formatting differences in `args_json` do
    /// not make a rerun diverge.
    ///
    /// # Errors
    ///
    /// [`CallError::Failed`], [`CallError::Denied`] or [`CallError::UnknownFunction`], as
    /// for [`call`](Self::call).
    ///
    /// # Example
    ///
    /// ```no_run
    /// # fn f(ctx: &mut rewind_guest::Context) -> Result<(), rewind_guest::Error> {
    /// let company = ctx.call_json("enrich.company", r#"{"domain":"acme.com"}"#)?;
    /// ctx.debug(&company);
    /// # Ok(())
    /// # }
    /// ```
    pub fn call_json(&mut self, function: &str, args_json: &str) -> Result<String, CallError> {
        durable::call(function, args_json).map_err(CallError::from)
    }

    /// Waits `duration`, durably.
    ///
    /// The wait is recorded and the run stops here, holding no instance, memory or run
    /// slot; when the time has come the input runs again from the start, its durable calls
    /// and earlier waits answered from their records, and this returns. A restart of the
    /// host neither shortens nor lengthens the wait. The key's later inputs wait behind
    /// it; other keys go on. Time spent waiting does not count against the run's
    /// `timeout-ms`.
    ///
    /// Code before the wait runs again when the input resumes: anything it does outside
    /// the sandbox must go through durable calls (as everything does).
    ///
    /// # Example
    ///
    /// ```no_run
    /// # fn f(ctx: &mut rewind_guest::Context) -> Result<(), rewind_guest::Error> {
    /// use std::time::Duration;
    /// ctx.sleep(Duration::from_secs(24 * 60 * 60)); // a reminder tomorrow
    /// ctx.output(&serde_json::json!({ "reminder": ctx.key() }))
    /// # }
    /// ```
    pub fn sleep(&mut self, duration: Duration) {
        durable::sleep(millis(duration));
    }

    /// Waits, as [`sleep`](Self::sleep) does, until `time` (a time already past returns
    /// at once).
    ///
    /// # Example
    ///
    /// ```no_run
    /// # fn f(ctx: &mut rewind_guest::Context) {
    /// use std::time::{Duration, SystemTime};
    /// ctx.sleep_until(SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000));
    /// # }
    /// ```
    pub fn sleep_until(&mut self, time: SystemTime) {
        let since_epoch = time.duration_since(UNIX_EPOCH).unwrap_or_default();
        durable::sleep_until(millis(since_epoch));
    }

    /// Waits, as [`sleep`](Self::sleep) does, for a signal delivered to this input whose
    /// name is one of `names`, and returns it; or returns `None` once `timeout` has passed
    /// without one (no timeout: it waits until a signal comes or an operator cancels the
    /// input).
    ///
    /// Each name must be among the action's `signals` in agent.toml, or the run fails
    /// naming it. A signal delivered before the wait is reached is kept for it; each
    /// signal is returned by one wait only.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # fn f(ctx: &mut rewind_guest::Context) -> Result<(), rewind_guest::Error> {
    /// use std::time::Duration;
    /// let day = Duration::from_secs(24 * 60 * 60);
    /// match ctx.await_signal(&["approve", "reject"], Some(day)) {
    ///     Some(signal) if signal.name == "approve" => ctx.info("approved"),
    ///     Some(_) => ctx.info("rejected"),
    ///     None => ctx.info("nobody answered within a day"),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn await_signal(&mut self, names: &[&str], timeout: Option<Duration>) -> Option<Signal> {
        let names: Vec<String> = names.iter().map(|name| (*name).to_owned()).collect();
        durable::await_signal(&names, timeout.map(millis)).map(|signal| Signal {
            name: signal.name,
            payload: signal.payload,
        })
    }

    /// Sends an event of `kind` with `payload` serialised to JSON.
    ///
    /// The event is delivered when the run completes: to the agent's actions bound to
    /// `kind`, or out of the agent when `kind` is `"output"` (see [`output`](Self::output)).
    /// Events sent by a run that fails are dropped.
    ///
    /// # Errors
    ///
    /// Fails only when `payload` cannot be serialised to JSON.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use serde_json::json;
    ///
    /// # fn f(ctx: &mut rewind_guest::Context) -> Result<(), rewind_guest::Error> {
    /// ctx.send("lookup", &json!({ "ticket_id": "T-1", "order_id": "A1234" }))?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn send<T: Serialize + ?Sized>(&mut self, kind: &str, payload: &T) -> Result<(), Error> {
        let event = Event::new(kind, payload)?;
        self.send_event(event);
        Ok(())
    }

    /// Sends an event that is already built; see [`send`](Self::send).
    ///
    /// # Example
    ///
    /// ```no_run
    /// use rewind_guest::Event;
    ///
    /// # fn f(ctx: &mut rewind_guest::Context, event: Event) {
    /// // Pass the triggering event on unchanged, under another kind.
    /// ctx.send_event(Event { kind: "audit".to_string(), ..event });
    /// # }
    /// ```
    pub fn send_event(&mut self, event: Event) {
        context::send(&types::Event {
            kind: event.kind,
            payload: event.payload,
        });
    }

    /// Sends an event of kind `"output"`: when the run completes it leaves the agent as
    /// one of the input's outputs.
    ///
    /// # Errors
    ///
    /// Fails only when `payload` cannot be serialised to JSON.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use serde_json::json;
    ///
    /// # fn f(ctx: &mut rewind_guest::Context) -> Result<(), rewind_guest::Error> {
    /// ctx.output(&json!({ "ticket_id": "T-1", "reply": "Your order has shipped." }))?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn output<T: Serialize + ?Sized>(&mut self, payload: &T) -> Result<(), Error> {
        self.send("output", payload)
    }

    /// Reads `name` from this key's memory and parses it as `T`; `None` when it was never
    /// set.
    ///
    /// Memory is kept per key across inputs. Writes apply when a run completes, so this
    /// returns the value as it stood when the run started.
    ///
    /// # Errors
    ///
    /// Fails when the stored JSON does not parse as `T`; the error names the entry.
    ///
    /// # Example
    ///
    /// ```no_run
    /// # fn f(ctx: &mut rewind_guest::Context) -> Result<(), rewind_guest::Error> {
    /// let seen: u32 = ctx.memory("leads")?.unwrap_or(0);
    /// ctx.set_memory("leads", &(seen + 1))?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn memory<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, Error> {
        let Some(json) = context::memory_get(name) else {
            return Ok(None);
        };
        serde_json::from_str(&json).map(Some).map_err(|error| {
            Error::msg(format!(
                "memory entry `{name}` is not what the action expects: {error}"
            ))
        })
    }

    /// Stores `value`, serialised to JSON, under `name` in this key's memory.
    ///
    /// The write applies when the run completes; a failed run writes nothing.
    ///
    /// # Errors
    ///
    /// Fails only when `value` cannot be serialised to JSON.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use serde_json::json;
    ///
    /// # fn f(ctx: &mut rewind_guest::Context) -> Result<(), rewind_guest::Error> {
    /// ctx.set_memory("company", &json!({ "domain": "acme.com", "name": "Acme" }))?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn set_memory<T: Serialize + ?Sized>(
        &mut self,
        name: &str,
        value: &T,
    ) -> Result<(), Error> {
        let json = serde_json::to_string(value)?;
        context::memory_set(name, &json);
        Ok(())
    }

    /// Writes `message` to the host's log at `level`, tagged with this run.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use rewind_guest::Level;
    ///
    /// # fn f(ctx: &rewind_guest::Context) {
    /// ctx.log(Level::Info, "classified ticket");
    /// # }
    /// ```
    pub fn log(&self, level: Level, message: &str) {
        context::log(level.into(), message);
    }

    /// Logs `message` at [`Level::Trace`].
    ///
    /// # Example
    ///
    /// ```no_run
    /// # fn f(ctx: &rewind_guest::Context) {
    /// ctx.trace("entering triage");
    /// # }
    /// ```
    pub fn trace(&self, message: &str) {
        self.log(Level::Trace, message);
    }

    /// Logs `message` at [`Level::Debug`].
    ///
    /// # Example
    ///
    /// ```no_run
    /// # fn f(ctx: &rewind_guest::Context) {
    /// ctx.debug("model answered");
    /// # }
    /// ```
    pub fn debug(&self, message: &str) {
        self.log(Level::Debug, message);
    }

    /// Logs `message` at [`Level::Info`].
    ///
    /// # Example
    ///
    /// ```no_run
    /// # fn f(ctx: &rewind_guest::Context) {
    /// ctx.info("ticket routed to lookup");
    /// # }
    /// ```
    pub fn info(&self, message: &str) {
        self.log(Level::Info, message);
    }

    /// Logs `message` at [`Level::Warn`].
    ///
    /// # Example
    ///
    /// ```no_run
    /// # fn f(ctx: &rewind_guest::Context) {
    /// ctx.warn("model answer was not JSON; treating as general");
    /// # }
    /// ```
    pub fn warn(&self, message: &str) {
        self.log(Level::Warn, message);
    }

    /// Logs `message` at [`Level::Error`].
    ///
    /// # Example
    ///
    /// ```no_run
    /// # fn f(ctx: &rewind_guest::Context) {
    /// ctx.error("order lookup failed");
    /// # }
    /// ```
    pub fn error(&self, message: &str) {
        self.log(Level::Error, message);
    }
}

/// `duration` in whole milliseconds, at most `u64::MAX`.
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
