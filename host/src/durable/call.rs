//! One action run's durable calls: hit, miss, divergence.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::ambient::AmbientSource;
use super::digest::{args_digest, idempotency_key};
use super::wait::{
    MAX_SIGNAL_NAME_BYTES, MAX_SIGNAL_NAMES, Reached, Signal, SignalScript, Taken, WaitFor, Woke,
    is_wait, taken_signals, unix_ms,
};
use crate::crash::{self, CrashPoint};
use crate::event::{Delta, Deltas};
use crate::functions::{
    CallDeltas, CallRequest, Clock, Function, FunctionError, Functions, Reconciled, RunSlot,
};
use crate::store::{
    ActionState, ActionStateStore, CallOutcome, CallRecord, Completion, Digest, StateKey,
    StoreError, Wait,
};

/// What to do when a replayed run makes a different call than the one recorded at its index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DivergencePolicy {
    /// Drop the records from that index on, persist that, run live, and warn.
    #[default]
    Truncate,
    /// Fail the run with an error naming both calls.
    Fail,
}

/// What a call found pending on replay (the process died while it ran) means
/// (docs/SEMANTICS.md, "In-doubt calls").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InDoubtPolicy {
    /// Write once, after the call; a call that died with the process runs again with the
    /// same idempotency key, for the remote side to drop the repeat.
    #[default]
    Retry,
    /// Write a pending record before the call; one found on replay asks the function's
    /// reconcile handler what happened, and records its answer.
    Reconcile,
    /// Write a pending record before the call; one found on replay fails the run.
    Fail,
}

/// A budget of live calls shared by many runs (a tenant's calls per minute, say).
///
/// Asked once for each call that is about to go out; calls served from records are free.
pub trait CallBudget: Send + Sync + std::fmt::Debug {
    /// Takes one call from the budget, or says why it is spent (the error's text is what
    /// the guest sees in [`CallError::Denied`]).
    fn take(&self) -> Result<(), Box<dyn std::error::Error + Send + Sync>>;
}

/// How an agent's durable calls behave.
#[derive(Clone, Debug, Default)]
pub struct CallPolicy {
    pub divergence: DivergencePolicy,
    /// Overrides of `divergence`, by the name of the function being called.
    pub divergence_by_function: BTreeMap<String, DivergencePolicy>,
    /// In-doubt policies other than the default, by function.
    pub in_doubt_by_function: BTreeMap<String, InDoubtPolicy>,
    /// Durable calls one run may make, replayed ones included.
    pub calls_per_run: u32,
    /// Clock readings one run may take, replayed ones included.
    pub clock_readings_per_run: u32,
    /// Live calls beyond the budget are denied (not recorded, no index taken).
    pub budget: Option<Arc<dyn CallBudget>>,
    /// The signals each action may wait for (its `signals` in agent.toml), by action.
    pub signals: BTreeMap<String, Vec<String>>,
    /// What a wait reads the time from: when it ends, whether its time has come. `None`:
    /// the system's clock.
    pub clock: Option<Arc<dyn Clock>>,
    /// A test's signals, delivered as runs reach calls and waits (`rewind test --signals`).
    pub script: Option<Arc<dyn SignalScript>>,
}

impl CallPolicy {
    fn divergence_for(&self, function: &str) -> DivergencePolicy {
        self.divergence_by_function
            .get(function)
            .copied()
            .unwrap_or(self.divergence)
    }

    /// Milliseconds since the Unix epoch, as waits see them.
    fn now_ms(&self) -> u64 {
        unix_ms(match &self.clock {
            Some(clock) => clock.now(),
            None => std::time::SystemTime::now(),
        })
    }

    fn in_doubt_for(&self, function: &str) -> InDoubtPolicy {
        self.in_doubt_by_function
            .get(function)
            .copied()
            .unwrap_or_default()
    }
}

/// Why a durable call returned no value, as the guest sees it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The function ran and failed. Recorded, and returned again on replay.
    #[error("failed: {0}")]
    Failed(String),
    /// The caller may not use this function now. Not recorded.
    #[error("denied: {0}")]
    Denied(String),
    /// No function of that name is declared for this agent. Not recorded.
    #[error("unknown function: {0}")]
    UnknownFunction(String),
}

/// A durable call that ends the run. Nothing about it is recorded.
#[derive(Debug, thiserror::Error)]
pub enum Fault {
    #[error(
        "divergence at call {index}: the record holds `{recorded_function}` (args digest \
         {recorded_args}) but the action now calls `{function}` (args digest {args}); the \
         action's code or input changed since the call was recorded (policy `fail`)"
    )]
    Divergence {
        index: usize,
        recorded_function: String,
        recorded_args: String,
        function: String,
        args: String,
    },
    #[error(
        "call {index} to `{function}` (idempotency key {idempotency_key}) is in doubt: it \
         was started and the process stopped before its result was recorded; in-doubt = \
         \"fail\" does not guess. Ask the remote side what became of it"
    )]
    InDoubt {
        index: usize,
        function: String,
        idempotency_key: String,
    },
    #[error("limit exceeded: calls-per-run ({limit})")]
    CallLimit { limit: u32 },
    #[error("limit exceeded: clock-readings-per-run ({limit})")]
    ClockReadingLimit { limit: u32 },
    #[error("durable call `{function}`: args are not valid JSON: {message}")]
    InvalidArgs { function: String, message: String },
    #[error("durable call `{function}` (idempotency key {idempotency_key}): {message}")]
    Unavailable {
        function: String,
        idempotency_key: String,
        message: String,
    },
    #[error("the store did not record {state}: {source}")]
    Store { state: String, source: StoreError },
    /// An operator cancelled the input: the run stops at its next durable call, which is
    /// not made.
    #[error("cancelled by an operator before call {index}; it was not made")]
    Cancelled { index: usize },
    /// A wait for signals its action does not declare, or for none, or for too many.
    #[error("await-signal: {0}")]
    BadSignalWait(String),
    /// A signal of the test's script could not be delivered.
    #[error("the test's signals script: {0}")]
    Script(String),
}

/// Counts of what one run's calls did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallStats {
    /// Calls whose function ran.
    pub live: u64,
    /// Calls answered from a record.
    pub replayed: u64,
    /// Records dropped because the run diverged from them.
    pub truncated: u64,
    /// Calls found in doubt and answered by their reconcile handler.
    pub reconciled: u64,
}

impl std::ops::AddAssign for CallStats {
    fn add_assign(&mut self, other: Self) {
        self.live += other.live;
        self.replayed += other.replayed;
        self.truncated += other.truncated;
        self.reconciled += other.reconciled;
    }
}

/// [`CallStats`] per function called.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CallsByFunction(pub BTreeMap<String, CallStats>);

impl std::ops::AddAssign<&CallsByFunction> for CallsByFunction {
    fn add_assign(&mut self, other: &CallsByFunction) {
        for (function, stats) in &other.0 {
            *self.0.entry(function.clone()).or_default() += *stats;
        }
    }
}

/// The durable calls of one action run, over that run's action state.
#[derive(Debug)]
pub struct DurableCalls {
    store: Arc<dyn ActionStateStore>,
    functions: Arc<Functions>,
    policy: Arc<CallPolicy>,
    state: ActionState,
    /// The run's clocks and random sources, recorded in `state` at each write.
    ambient: AmbientSource,
    /// Index of the next recorded call.
    next: usize,
    /// Calls made so far, counted against `calls_per_run`.
    made: u32,
    stats: CallStats,
    by_function: CallsByFunction,
    /// Cancelled by an operator: no further call is made.
    cancel: CancellationToken,
    /// The run slot the run holds, lent to its calls (they let go of it while they wait
    /// between attempts).
    slot: Option<Arc<dyn RunSlot>>,
    /// Where the pieces of its calls' streamed answers go as they come.
    deltas: Option<Arc<dyn Deltas>>,
    /// Inbox ids of the signals the input's other states took.
    taken: Taken,
}

impl DurableCalls {
    /// Starts a run over `state`: the state found in the store, or a new one. A new one
    /// (never written) belongs to the store's incarnation, which its calls' idempotency
    /// keys name.
    pub fn new(
        store: Arc<dyn ActionStateStore>,
        functions: Arc<Functions>,
        policy: Arc<CallPolicy>,
        mut state: ActionState,
    ) -> Self {
        if state.version == 0 && state.incarnation.is_none() {
            state.incarnation = Some(store.incarnation());
        }
        let ambient = AmbientSource::new(
            &state.key,
            std::mem::take(&mut state.ambient),
            policy.clock_readings_per_run,
        );
        Self {
            store,
            functions,
            policy,
            state,
            ambient,
            next: 0,
            made: 0,
            stats: CallStats::default(),
            by_function: CallsByFunction::default(),
            cancel: CancellationToken::new(),
            slot: None,
            deltas: None,
            taken: Taken::new(),
        }
    }

    /// The signals (by inbox id) the input's other action states took: a signal is taken
    /// by one wait of its input.
    #[must_use]
    pub fn with_signals_taken(mut self, taken: impl IntoIterator<Item = u64>) -> Self {
        self.taken.extend(taken);
        self
    }

    /// Stops the run at its next call once `cancel` is cancelled.
    #[must_use]
    pub fn cancelled_by(mut self, cancel: CancellationToken) -> Self {
        self.cancel = cancel;
        self
    }

    /// Lends the run's slot to its calls ([`RunSlot`]).
    #[must_use]
    pub fn holding(mut self, slot: Option<Arc<dyn RunSlot>>) -> Self {
        self.slot = slot;
        self
    }

    /// Forwards the pieces of its calls' streamed answers to `deltas` as they come.
    #[must_use]
    pub fn following(mut self, deltas: Option<Arc<dyn Deltas>>) -> Self {
        self.deltas = deltas;
        self
    }

    /// Counts what a call of `function` did, in the run's totals and its function's.
    fn count(&mut self, function: &str, what: impl Fn(&mut CallStats)) {
        what(&mut self.stats);
        // Looked up first: a run calls few functions, many times each, and a served call
        // takes a fraction of a microsecond, which a name allocated per call would add to.
        match self.by_function.0.get_mut(function) {
            Some(stats) => what(stats),
            None => what(self.by_function.0.entry(function.to_owned()).or_default()),
        }
    }

    /// The state as last written (its `ambient` is filled in at each write).
    pub fn state(&self) -> &ActionState {
        &self.state
    }

    /// The run's WASI clocks and random sources.
    pub fn ambient(&self) -> &AmbientSource {
        &self.ambient
    }

    pub fn stats(&self) -> CallStats {
        self.stats
    }

    /// The same counts, per function.
    pub fn by_function(&self) -> &CallsByFunction {
        &self.by_function
    }

    /// Makes the durable call `function(args)`.
    ///
    /// `Ok(Ok(json))` and `Ok(Err(CallError::Failed))` are recorded (and durable) before this
    /// returns; `Denied` and `UnknownFunction` are not recorded and do not take an index.
    pub async fn call(
        &mut self,
        function: &str,
        args: &str,
    ) -> Result<Result<String, CallError>, Fault> {
        let answer = self.make_call(function, args).await?;
        self.scripted(self.next, false).await?;
        Ok(answer)
    }

    /// Delivers what a test's script holds where the run stands: after its last call
    /// (counted over its records before `upto`), or with `wait` at the wait at `upto`.
    /// Without a script, nothing is counted: a durable call pays for none of this.
    async fn scripted(&self, upto: usize, wait: bool) -> Result<(), Fault> {
        let Some(script) = &self.policy.script else {
            return Ok(());
        };
        let before = (self.state.calls.iter().take(upto))
            .filter(|record| is_wait(&record.function) == wait)
            .count();
        let n = |count: usize| u32::try_from(count).unwrap_or(u32::MAX);
        let point = if wait {
            Reached::Wait(n(before + 1))
        } else {
            Reached::Call(n(before))
        };
        (script.reached(&self.state.key, point).await).map_err(Fault::Script)
    }

    async fn make_call(
        &mut self,
        function: &str,
        args: &str,
    ) -> Result<Result<String, CallError>, Fault> {
        self.take_index()?;
        let digest = args_digest(args).map_err(|e| Fault::InvalidArgs {
            function: function.to_owned(),
            message: e.to_string(),
        })?;

        // Refusals come first: a refused call takes no index, so it must not be compared
        // with (or truncate) the record that the next granted call will be compared with.
        let Some(declared) = self.functions.get(function) else {
            return Ok(Err(CallError::UnknownFunction(format!(
                "no function `{function}` is declared for agent `{}`",
                self.state.key.scope.agent
            ))));
        };
        if !declared.grants(&self.state.key.action) {
            return Ok(Err(CallError::Denied(format!(
                "action `{}` may not call `{function}`",
                self.state.key.action
            ))));
        }
        let handler = Arc::clone(&declared.handler);

        let index = self.next;
        // The key the call was made with when it is in doubt: a recorded call keeps its key.
        let mut pending = None;
        if let Some(record) = self.state.calls.get(index) {
            if record.function == function && record.args_digest == digest {
                let served = match &record.outcome {
                    CallOutcome::Succeeded(result) => Some(Ok(result.clone())),
                    CallOutcome::Failed(error) => Some(Err(CallError::Failed(error.clone()))),
                    // In doubt: the call may or may not have run.
                    CallOutcome::Pending => {
                        pending = Some(record.idempotency_key.clone());
                        None
                    }
                    // A wait's record, which no call has the name of (a wait's starts
                    // with `@`): made as if none were there.
                    CallOutcome::Waiting(_) => None,
                };
                if let Some(served) = served {
                    self.next += 1;
                    self.count(function, |s| s.replayed += 1);
                    return Ok(served);
                }
            } else {
                self.diverge(index, record.clone(), function, digest)
                    .await?;
            }
        }

        // Not served from a record: the call is (or was) made, under its idempotency key,
        // if the budget allows. A denial takes no index, like the refusals above.
        if let Some(budget) = &self.policy.budget
            && let Err(spent) = budget.take()
        {
            return Ok(Err(CallError::Denied(spent.to_string())));
        }
        let key = match &pending {
            Some(key) => key.clone(),
            None => idempotency_key(&self.state, index, function, &digest),
        };
        let slot = self.slot.clone();
        let followers = (self.deltas.clone()).map(|out| Followers {
            out,
            key: self.state.key.clone(),
            call: index as u64,
            function: function.to_owned(),
        });
        let request = CallRequest {
            function,
            args,
            idempotency_key: &key,
            slot: slot.as_deref(),
            deltas: followers.as_ref().map(|f| f as &dyn CallDeltas),
        };
        let in_doubt = self.policy.in_doubt_for(function);
        if pending.is_some() {
            if let Some(answer) = self.in_doubt(in_doubt, &*handler, index, request).await? {
                self.next += 1;
                return Ok(answer);
            }
        } else if in_doubt != InDoubtPolicy::Retry {
            // The pending record is durable before the call can have any effect.
            self.record(index, request, digest, CallOutcome::Pending)
                .await?;
        }
        self.run(&*handler, index, digest, request).await
    }

    /// A pending record at `index`: what the policy makes of it. `Some` is the call's answer
    /// (already recorded); `None` means the call is to be made now.
    async fn in_doubt(
        &mut self,
        policy: InDoubtPolicy,
        handler: &dyn Function,
        index: usize,
        request: CallRequest<'_>,
    ) -> Result<Option<Result<String, CallError>>, Fault> {
        match policy {
            // The call may or may not have run; it runs again with the same key.
            InDoubtPolicy::Retry => Ok(None),
            InDoubtPolicy::Fail => Err(Fault::InDoubt {
                index,
                function: request.function.to_owned(),
                idempotency_key: request.idempotency_key.to_owned(),
            }),
            InDoubtPolicy::Reconcile => {
                let answer = match handler.reconcile(request).await {
                    Ok(Reconciled::NotRun) => return Ok(None),
                    Ok(Reconciled::Succeeded(value)) => Ok(value),
                    Ok(Reconciled::Failed(error)) => Err(FunctionError::Failed(error)),
                    Err(error) => Err(error),
                };
                let answer = answered(answer, request, "reconciling a call in doubt: ")?;
                let digest = self.state.calls[index].args_digest;
                let answer = self.record_answer(index, request, digest, answer).await?;
                self.count(request.function, |s| s.reconciled += 1);
                Ok(Some(answer))
            }
        }
    }

    /// Nothing leaves the run once it read the clock past its limit: the readings past it
    /// were not recorded.
    fn readings_within_limit(&self) -> Result<(), Fault> {
        if self.ambient.exceeded() {
            return Err(Fault::ClockReadingLimit {
                limit: self.policy.clock_readings_per_run,
            });
        }
        Ok(())
    }

    /// Makes the call live and records its outcome at `index`.
    async fn run(
        &mut self,
        handler: &dyn Function,
        index: usize,
        digest: Digest,
        request: CallRequest<'_>,
    ) -> Result<Result<String, CallError>, Fault> {
        if self.ambient.unwritten() {
            // The args may hold a clock reading or random bytes: a replay must see them
            // again before it makes this call again.
            self.write().await?;
        }
        crash::reached(CrashPoint::BeforeCall);
        let answer = answered(handler.call(request).await, request, "")?;
        crash::reached(CrashPoint::AfterCall);
        let result = self.record_answer(index, request, digest, answer).await?;
        crash::reached(CrashPoint::AfterRecord);
        self.next += 1;
        self.count(request.function, |s| s.live += 1);
        Ok(result)
    }

    /// Records a function's answer at `index` and returns what the guest gets. An answer
    /// that would make the state larger than the log takes in one record is recorded as a
    /// failure saying so, which the guest gets instead: the call ran, and a replay must not
    /// make it again.
    async fn record_answer(
        &mut self,
        index: usize,
        request: CallRequest<'_>,
        digest: Digest,
        (outcome, result): (CallOutcome, Result<String, CallError>),
    ) -> Result<Result<String, CallError>, Fault> {
        let answer_bytes = match &outcome {
            CallOutcome::Succeeded(text) | CallOutcome::Failed(text) => text.len(),
            CallOutcome::Pending | CallOutcome::Waiting(_) => 0,
        };
        match self.record(index, request, digest, outcome).await {
            Err(Fault::Store {
                source: StoreError::TooLarge { size, max, .. },
                ..
            }) => {
                let error = format!(
                    "the answer of `{}` ({answer_bytes} bytes) would make the run's state \
                     {size} bytes, more than the {max} the log takes in one record",
                    request.function
                );
                self.record(index, request, digest, CallOutcome::Failed(error.clone()))
                    .await?;
                Ok(Err(CallError::Failed(error)))
            }
            Err(fault) => Err(fault),
            Ok(()) => Ok(result),
        }
    }

    /// Sets the record at `index` (dropping any after it) and writes the state.
    async fn record(
        &mut self,
        index: usize,
        request: CallRequest<'_>,
        digest: Digest,
        outcome: CallOutcome,
    ) -> Result<(), Fault> {
        self.state.calls.truncate(index);
        self.state.calls.push(CallRecord {
            function: request.function.to_owned(),
            args_digest: digest,
            idempotency_key: request.idempotency_key.to_owned(),
            outcome,
        });
        self.write().await
    }

    /// Writes the state as it is now; the guest sees nothing of it until this returns.
    async fn write(&mut self) -> Result<(), Fault> {
        self.state.ambient = self.ambient.values();
        match self.store.put(&self.state).await {
            Ok(version) => {
                self.state.version = version;
                self.ambient.written();
                Ok(())
            }
            Err(source) => Err(Fault::Store {
                state: self.state.key.to_string(),
                source,
            }),
        }
    }

    async fn diverge(
        &mut self,
        index: usize,
        recorded: CallRecord,
        function: &str,
        digest: Digest,
    ) -> Result<(), Fault> {
        match self.policy.divergence_for(function) {
            DivergencePolicy::Fail => Err(Fault::Divergence {
                index,
                recorded_function: recorded.function,
                recorded_args: recorded.args_digest.short(),
                function: function.to_owned(),
                args: digest.short(),
            }),
            DivergencePolicy::Truncate => {
                let dropped = self.state.calls.len() - index;
                tracing::warn!(
                    state = %self.state.key,
                    index,
                    recorded = %recorded.function,
                    recorded_args = %recorded.args_digest.short(),
                    called = %function,
                    called_args = %digest.short(),
                    dropped,
                    "divergence: the action now calls `{function}` where `{}` was recorded; \
                     dropping {dropped} record(s) from call {index} on and running live",
                    recorded.function,
                );
                self.state.calls.truncate(index);
                // A state an earlier build wrote made its keys from the index alone, which
                // would give the new call the dropped call's key (and a remote that honours
                // it, the dropped call's answer): its calls from here on are this build's.
                if self.state.incarnation.is_none() {
                    self.state.incarnation = Some(self.store.incarnation());
                }
                // Readings the old run took past this point are not this run's to replay.
                self.ambient.keep_read();
                self.write().await?;
                self.count(&recorded.function, |s| s.truncated += dropped as u64);
                Ok(())
            }
        }
    }

    /// Whether the run may make one more call or wait (not cancelled, within its clock
    /// readings and its `calls-per-run`): counts it if so.
    fn take_index(&mut self) -> Result<(), Fault> {
        if self.cancel.is_cancelled() {
            return Err(Fault::Cancelled { index: self.next });
        }
        self.readings_within_limit()?;
        if self.made >= self.policy.calls_per_run {
            return Err(Fault::CallLimit {
                limit: self.policy.calls_per_run,
            });
        }
        self.made += 1;
        Ok(())
    }

    /// A durable wait at the run's next index. `Ok(Ok(signal))`: the wait is over (a
    /// signal, or `None` when its time came), recorded before this returns. `Ok(Err(wait))`:
    /// it is not over, and the run is to stop here; its wait is recorded (the first time
    /// it is reached) and the input runs again once it can be over.
    pub async fn wait(&mut self, what: WaitFor) -> Result<Result<Option<Signal>, Wait>, Fault> {
        self.take_index()?;
        if let WaitFor::Signal { names, .. } = &what {
            self.check_signals(names)?;
        }
        let function = what.function();
        let args = what.args();
        let digest = args_digest(&args).map_err(|e| Fault::InvalidArgs {
            function: function.to_owned(),
            message: e.to_string(),
        })?;
        let index = self.next;
        let mut recorded = None;
        if let Some(record) = self.state.calls.get(index) {
            if record.function == function && record.args_digest == digest {
                match &record.outcome {
                    CallOutcome::Succeeded(json) => {
                        let woke: Woke = serde_json::from_str(json).map_err(|e| {
                            Fault::BadSignalWait(format!(
                                "the record of the wait at call {index} is not one: {e}"
                            ))
                        })?;
                        self.next += 1;
                        self.count(function, |s| s.replayed += 1);
                        return Ok(Ok(woke.signal()));
                    }
                    CallOutcome::Waiting(wait) => recorded = Some(wait.clone()),
                    // Not a wait's record: made again as if none were there.
                    CallOutcome::Pending | CallOutcome::Failed(_) => {}
                }
            } else {
                self.diverge(index, record.clone(), function, digest)
                    .await?;
            }
        }
        self.scripted(index, true).await?;
        let now = self.policy.now_ms();
        let first = recorded.is_none();
        let wait = recorded.unwrap_or_else(|| what.wait(now));
        let request = CallRequest {
            function,
            args: &args,
            idempotency_key: &idempotency_key(&self.state, index, function, &digest),
            slot: None,
            deltas: None,
        };
        let woke = match self.signal_for(&wait.signals) {
            Some(woke) => Some(woke),
            None => wait.until.filter(|&until| until <= now).map(|_| Woke::Time),
        };
        let Some(woke) = woke else {
            if first {
                self.record(index, request, digest, CallOutcome::Waiting(wait.clone()))
                    .await?;
                crash::reached(CrashPoint::AtWait);
            }
            return Ok(Err(wait));
        };
        // Not counted as a call made: nothing left the sandbox.
        self.record(index, request, digest, CallOutcome::Succeeded(woke.json()))
            .await?;
        crash::reached(CrashPoint::AtWake);
        self.next += 1;
        Ok(Ok(woke.signal()))
    }

    /// Refuses a wait for no signal, too many, or one the action does not declare.
    fn check_signals(&self, names: &[String]) -> Result<(), Fault> {
        let action = &self.state.key.action;
        let declared = self
            .policy
            .signals
            .get(action)
            .map_or(&[][..], Vec::as_slice);
        if names.is_empty() {
            return Err(Fault::BadSignalWait(
                "names no signal to wait for".to_owned(),
            ));
        }
        if names.len() > MAX_SIGNAL_NAMES {
            return Err(Fault::BadSignalWait(format!(
                "names {} signals, more than the {MAX_SIGNAL_NAMES} one wait may",
                names.len()
            )));
        }
        for name in names {
            if !declared.contains(name) {
                let shown: String = name.chars().take(MAX_SIGNAL_NAME_BYTES).collect();
                return Err(Fault::BadSignalWait(format!(
                    "action `{action}` waits for signal {shown:?}, which it does not declare \
                     (its `signals` in agent.toml: {declared:?})"
                )));
            }
        }
        Ok(())
    }

    /// The first signal in the input's inbox that one of `names` matches and no wait of
    /// the input took.
    fn signal_for(&self, names: &[String]) -> Option<Woke> {
        if names.is_empty() {
            return None;
        }
        let inbox = self.store.get(&StateKey::signals(
            &self.state.key.scope,
            self.state.key.sequence,
        ))?;
        let taken: Taken = taken_signals(&self.state).collect();
        inbox
            .calls
            .iter()
            .enumerate()
            .map(|(id, record)| (id as u64, record))
            .filter(|(id, _)| !taken.contains(id) && !self.taken.contains(id))
            .find(|(_, record)| names.contains(&record.function))
            .and_then(|(id, record)| match &record.outcome {
                CallOutcome::Succeeded(payload) => Some(Woke::Signal {
                    id,
                    name: record.function.clone(),
                    payload: payload.clone(),
                }),
                _ => None,
            })
    }

    /// Records that the run completed, with what it sent and wrote; returns the final state.
    pub async fn complete(mut self, completion: Completion) -> Result<ActionState, Fault> {
        self.readings_within_limit()?;
        // Records past the last call this run made belong to an older version of the run.
        self.state.calls.truncate(self.next);
        self.ambient.keep_read();
        self.state.completion = Some(completion);
        self.write().await?;
        Ok(self.state)
    }
}

/// A call's deltas, on their way to the front end's followers with where they come from.
struct Followers {
    out: Arc<dyn Deltas>,
    key: StateKey,
    call: u64,
    function: String,
}

impl CallDeltas for Followers {
    fn delta(&self, delta: &serde_json::Value) {
        self.out.send(Delta {
            tenant: self.key.scope.tenant.clone(),
            agent: self.key.scope.agent.clone(),
            key: self.key.scope.key.clone(),
            sequence: self.key.sequence,
            action: self.key.action.clone(),
            call: self.call,
            function: self.function.clone(),
            delta: delta.clone(),
        });
    }
}

/// A function's answer as the record to write and what the guest gets. `Unavailable` (said
/// after `context`) ends the run with nothing recorded.
fn answered(
    answer: Result<String, FunctionError>,
    request: CallRequest<'_>,
    context: &str,
) -> Result<(CallOutcome, Result<String, CallError>), Fault> {
    match answer {
        Ok(value) => Ok((CallOutcome::Succeeded(value.clone()), Ok(value))),
        Err(FunctionError::Failed(error)) => Ok((
            CallOutcome::Failed(error.clone()),
            Err(CallError::Failed(error)),
        )),
        Err(FunctionError::Unavailable(message)) => Err(Fault::Unavailable {
            function: request.function.to_owned(),
            idempotency_key: request.idempotency_key.to_owned(),
            message: format!("{context}{message}"),
        }),
    }
}
