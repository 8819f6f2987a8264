//! One action run: a fresh store from a pre-instantiated component, with its limits.

use std::collections::BTreeMap;
use std::sync::Arc;

use wasmtime::component::HasSelf;
use wasmtime::{Engine, Store, Trap};
use wasmtime_wasi::{WasiCtxView, WasiView};

use super::bindings::ActionPre;
use super::bindings::rewind::action::types;
use super::limits::{Limit, Limits, MemoryCeiling};
use super::wasi::GuestWasi;
use crate::durable::{DurableCalls, Fault};
use crate::event::Event;
use crate::store::{MemoryWrite, StoreError, Wait};
use crate::text;

use super::running::RunningTime;

/// Fuel a guest may burn between yields to the async executor, so that a CPU-bound guest
/// cannot hold a worker thread past its timeout.
const FUEL_PER_YIELD: u64 = 1_000_000;

/// Who is running: attached to every log line of the run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunLabels {
    pub agent: String,
    pub key: String,
    pub sequence: u64,
    pub action: String,
}

/// Everything a run starts from.
#[derive(Debug)]
pub struct RunInput {
    pub labels: RunLabels,
    pub event: Event,
    /// The key's short-term memory as the run starts.
    pub memory: Arc<BTreeMap<String, String>>,
    pub durable: DurableCalls,
    pub limits: Limits,
}

/// What a run left behind, whether or not it completed.
#[derive(Debug)]
pub struct RunOutput {
    pub result: Result<(), RunError>,
    /// The run's calls, to complete the action state with.
    pub durable: DurableCalls,
    pub sent: Vec<Event>,
    pub memory: Vec<MemoryWrite>,
}

/// Why a run did not complete. The texts that come from the guest are escaped and bounded
/// ([`text::outside_error`]).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The action returned an error.
    #[error("the action returned an error: {0}")]
    Failed(String),
    #[error("limit exceeded: {0}")]
    Limit(Limit),
    /// The action panicked: the message and where, as Rust's panic hook wrote them to the
    /// guest's stderr before the component aborted.
    #[error("the action {0}")]
    Panicked(String),
    #[error("the action trapped: {0}")]
    Trap(String),
    /// The action asked the host for something it does not do (an event whose payload is
    /// not JSON).
    #[error("the host refused the action: {0}")]
    Refused(String),
    #[error(transparent)]
    Fault(Fault),
    #[error("the component could not be instantiated: {0}")]
    Instantiate(String),
    /// The host could not set up the run (a bug in the host, not in the action).
    #[error("the host could not set up the run: {0}")]
    Host(String),
    /// The run stopped at a durable wait that is not over (recorded): not a failure. The
    /// input runs again once the wait can be over.
    #[error("the run waits {0}")]
    Waiting(Wait),
}

impl From<Fault> for RunError {
    /// A fault that is a limit (of the run, or the log's on one state) is reported as one.
    fn from(fault: Fault) -> Self {
        match fault {
            Fault::CallLimit { limit } => Self::Limit(Limit::CallsPerRun { calls: limit }),
            Fault::ClockReadingLimit { limit } => {
                Self::Limit(Limit::ClockReadings { readings: limit })
            }
            Fault::Store {
                source: StoreError::TooLarge { size, max, .. },
                ..
            } => Self::Limit(Limit::StateBytes { bytes: size, max }),
            fault => Self::Fault(fault),
        }
    }
}

/// What a run has written so far, counted against its limits.
#[derive(Debug, Default)]
pub(super) struct Used {
    pub memory_set_bytes: u64,
    /// The key's memory, in bytes, with the run's writes so far: counted at the first write.
    pub memory_bytes: Option<u64>,
    pub memory_set_entries: u32,
    pub sent_bytes: u64,
}

/// The data of one run's store: the guest's view of the host.
#[derive(Debug)]
pub(crate) struct RunState {
    pub(super) wasi: GuestWasi,
    ceiling: MemoryCeiling,
    pub(super) labels: RunLabels,
    pub(super) limits: Limits,
    pub(super) used: Used,
    pub(super) durable: DurableCalls,
    /// Why a host import ended the run, kept to report it as itself rather than as a trap.
    pub(super) stop: Option<RunError>,
    pub(super) memory: Arc<BTreeMap<String, String>>,
    pub(super) writes: Vec<MemoryWrite>,
    pub(super) sent: Vec<Event>,
    /// What `timeout-ms` bounds: the run's time outside its durable calls.
    pub(super) running: Arc<RunningTime>,
}

impl WasiView for RunState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi.ctx,
            table: &mut self.wasi.table,
        }
    }
}

pub(super) fn add_to_linker(
    linker: &mut wasmtime::component::Linker<RunState>,
) -> wasmtime::Result<()> {
    wasmtime_wasi::p2::add_to_linker_async(linker)?;
    super::bindings::Action::add_to_linker::<_, HasSelf<RunState>>(linker, |state| state)?;
    super::bindings::v0_1::Action::add_to_linker::<_, HasSelf<RunState>>(linker, |state| state)
}

pub(super) async fn run(engine: &Engine, pre: &ActionPre<RunState>, input: RunInput) -> RunOutput {
    let RunInput {
        labels,
        event,
        memory,
        durable,
        limits,
    } = input;
    let running = RunningTime::start();
    let mut store = Store::new(
        engine,
        RunState {
            wasi: GuestWasi::new(durable.ambient(), limits.log_bytes),
            ceiling: MemoryCeiling::new(limits.memory_bytes()),
            labels,
            limits,
            used: Used::default(),
            durable,
            stop: None,
            memory,
            writes: Vec::new(),
            sent: Vec::new(),
            running: Arc::clone(&running),
        },
    );
    store.limiter(|state| &mut state.ceiling);
    if let Err(e) = store
        .set_fuel(limits.fuel)
        .and_then(|()| store.fuel_async_yield_interval(Some(FUEL_PER_YIELD)))
    {
        return RunOutput {
            result: Err(RunError::Host(format!("setting the run's fuel: {e:#}"))),
            durable: store.into_data().durable,
            sent: Vec::new(),
            memory: Vec::new(),
        };
    }

    let guest_event = types::Event {
        kind: event.kind,
        payload: event.payload,
    };
    let run = async {
        let action = match pre.instantiate_async(&mut store).await {
            Ok(action) => action,
            Err(e) => return Err((e, true)),
        };
        action
            .call_run(&mut store, &guest_event)
            .await
            .map_err(|e| (e, false))
    };
    let outcome = tokio::select! {
        outcome = run => Ok(outcome),
        () = running.reached(limits.timeout()) => Err(()),
    };

    let result = match outcome {
        Err(()) => {
            let labels = &store.data().labels;
            tracing::warn!(agent = %labels.agent, key = %labels.key, sequence = labels.sequence,
                action = %labels.action, "run stopped at its timeout");
            Err(RunError::Limit(Limit::Timeout {
                ms: limits.timeout_ms,
            }))
        }
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(message))) => Err(RunError::Failed(text::outside_error(&message))),
        Ok(Err((error, instantiating))) => {
            Err(classify(store.data_mut(), &limits, &error, instantiating))
        }
    };
    let state = store.into_data();
    // A run that read the clock past its limit does not complete: those readings were not
    // recorded, and what it would send may hold them.
    let result = result.and_then(|()| {
        if state.durable.ambient().exceeded() {
            Err(RunError::Limit(Limit::ClockReadings {
                readings: limits.clock_readings_per_run,
            }))
        } else {
            Ok(())
        }
    });
    log_output(&state);
    RunOutput {
        result,
        durable: state.durable,
        sent: state.sent,
        memory: state.writes,
    }
}

fn classify(
    state: &mut RunState,
    limits: &Limits,
    error: &wasmtime::Error,
    instantiating: bool,
) -> RunError {
    if let Some(stop) = state.stop.take() {
        return stop;
    }
    if error.downcast_ref::<Trap>() == Some(&Trap::OutOfFuel) {
        return RunError::Limit(Limit::Fuel { fuel: limits.fuel });
    }
    if state.ceiling.hit {
        return RunError::Limit(Limit::Memory {
            mib: limits.memory_mib,
        });
    }
    if instantiating {
        return RunError::Instantiate(text::outside_error(&format!("{error:#}")));
    }
    if error.downcast_ref::<Trap>() == Some(&Trap::UnreachableCodeReached)
        && let Some(panic) = panic_report(&state.wasi.stderr.peek())
    {
        return RunError::Panicked(text::outside_error(&panic));
    }
    RunError::Trap(text::outside_error(&described_trap(error)))
}

/// The last panic Rust's default hook wrote to `stderr` (`thread '<unnamed>' panicked at
/// FILE:LINE:COL:`, then the message, then a note about `RUST_BACKTRACE`), as `panicked at
/// FILE:LINE:COL: MESSAGE`.
fn panic_report(stderr: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(stderr);
    let start = text.rfind("panicked at ")?;
    let rest = &text[start + "panicked at ".len()..];
    let (place, message) = rest.split_once(":\n")?;
    let message: Vec<&str> = message
        .lines()
        .take_while(|line| !line.starts_with("note: run with `RUST_BACKTRACE"))
        .collect();
    Some(format!("panicked at {place}: {}", message.join("\n")))
}

/// Frames of a trap's backtrace kept in its error, innermost first.
const TRAP_FRAMES: usize = 12;

/// What a trap was (stack overflow, out-of-bounds memory access, `unreachable`: an abort)
/// and where: the innermost [`TRAP_FRAMES`] frames of its wasm backtrace, demangled.
fn described_trap(error: &wasmtime::Error) -> String {
    let mut described = match error.downcast_ref::<Trap>() {
        Some(Trap::StackOverflow) => "stack overflow: the call stack is exhausted".to_owned(),
        Some(Trap::MemoryOutOfBounds) => "out-of-bounds memory access".to_owned(),
        Some(Trap::UnreachableCodeReached) => {
            "`unreachable` executed: the action aborted".to_owned()
        }
        Some(trap) => trap.to_string(),
        None => error.root_cause().to_string(),
    };
    let Some(backtrace) = error.downcast_ref::<wasmtime::WasmBacktrace>() else {
        return described;
    };
    let frames = backtrace.frames();
    for frame in frames.iter().take(TRAP_FRAMES) {
        let name = frame.func_name().map_or_else(
            || format!("function {}", frame.func_index()),
            |name| format!("{:#}", rustc_demangle::demangle(name)),
        );
        described.push_str("\n  at ");
        described.extend(name.chars().take(200));
    }
    if frames.len() > TRAP_FRAMES {
        described.push_str(&format!(
            "\n  ... {} more frames",
            frames.len() - TRAP_FRAMES
        ));
    }
    described
}

/// The run's stdout and stderr, line by line, escaped; and one warning when the run wrote
/// more log than `log-bytes` kept.
fn log_output(state: &RunState) {
    let labels = &state.labels;
    for (stream, capture) in [
        ("stdout", &state.wasi.stdout),
        ("stderr", &state.wasi.stderr),
    ] {
        for line in String::from_utf8_lossy(&capture.take()).lines() {
            tracing::info!(target: "rewind::guest", agent = %labels.agent, key = %labels.key,
                sequence = labels.sequence, action = %labels.action, stream,
                "{}", text::escaped(line));
        }
    }
    let (dropped, limit) = state.wasi.log.dropped();
    if dropped > 0 {
        tracing::warn!(target: "rewind::guest", agent = %labels.agent, key = %labels.key,
            sequence = labels.sequence, action = %labels.action,
            "{dropped} bytes of the run's log dropped: a run may log log-bytes ({limit} bytes)");
    }
}
