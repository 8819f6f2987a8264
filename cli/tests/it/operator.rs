//! Operator commands on a run that is going: a parked input skipped or retried, a call in
//! doubt resolved, an input cancelled, from outside the process, through the state
//! directory's commands.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use rewind_host::agent::input::{InputLine, LineError};
use rewind_host::agent::{Agent, JsonlSink};
use rewind_host::checkpoint::Ended;
use rewind_host::checkpoint::{Checkpoint, CheckpointStore as _, FileCheckpoints};
use rewind_host::commands::{
    CallAnswer, Command, CommandDir, CommandQueue, CommandsError, Done, Outcome, Verb,
};
use rewind_host::functions::{CallRequest, Function, FunctionError};
use rewind_host::keys::{Checkpointing, RunOptions, Summary, run_inputs};
use serde_json::{Value, json};
use tokio::sync::{Semaphore, mpsc};

use crate::support::{agent_toml, agent_with, memory_store};

/// Longer than anything here takes on a loaded machine: only a lost command reaches it.
const PATIENCE: Duration = Duration::from_secs(120);

/// A run of an agent whose inputs fail on `{"fail": ...}` (2 attempts), fed line by line
/// from the test, with the commands of `state`; checkpoints every 20 ms, or (`Untimed`)
/// only at each input accepted and when a command asks for one.
#[derive(Clone, Copy)]
enum Cadence {
    Timed,
    Untimed,
}

struct Going {
    lines: mpsc::UnboundedSender<Result<InputLine, LineError>>,
    fed: usize,
    checkpoints: Arc<FileCheckpoints>,
    commands: CommandDir,
    /// How often the run has looked for commands.
    looked: Arc<AtomicU64>,
    run: tokio::task::JoinHandle<(Summary, String)>,
}

impl Going {
    fn start(state: &std::path::Path, checkpoints: Cadence) -> Self {
        let toml = agent_toml("caller", "", "[retry]\nattempts = 2\ninitial-ms = 1\n");
        Self::start_with(state, &toml, checkpoints, &[])
    }

    fn start_with(
        state: &std::path::Path,
        toml: &str,
        cadence: Cadence,
        functions: &[(&str, Arc<dyn Function>)],
    ) -> Self {
        let agent = Arc::new(agent_with(toml, memory_store(), functions));
        let checkpoints = Arc::new(FileCheckpoints::new(state.join("checkpoints")));
        let commands = CommandDir::of(state);
        let looked = Arc::new(AtomicU64::new(0));
        let watched = Watched {
            dir: commands.clone(),
            looked: Arc::clone(&looked),
        };
        let (lines, rx) = mpsc::unbounded_channel();
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|line| (line, rx))
        })
        .boxed();
        let run = tokio::spawn(run(
            agent,
            stream,
            Arc::clone(&checkpoints),
            watched,
            cadence,
        ));
        Self {
            lines,
            fed: 0,
            checkpoints,
            commands,
            looked,
            run,
        }
    }

    /// Returns once the run has carried out every command left before this was called:
    /// it has looked for commands twice since (it carries out what it finds before it
    /// looks again).
    async fn taken(&self) {
        let since = self.looked.load(Ordering::SeqCst);
        let started = Instant::now();
        while self.looked.load(Ordering::SeqCst) < since + 2 {
            assert!(
                started.elapsed() < PATIENCE,
                "the run stopped looking for commands"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn feed(&mut self, key: &str, payload: &Value) {
        self.fed += 1;
        let line = InputLine {
            id: None,
            line: self.fed,
            key: key.to_owned(),
            payload: payload.to_string(),
        };
        self.lines.send(Ok(line)).expect("the run takes lines");
    }

    /// The newest checkpoint, once `until` holds of it.
    async fn checkpoint(&self, until: impl Fn(&Checkpoint) -> bool) -> Checkpoint {
        let started = Instant::now();
        loop {
            let latest = self.checkpoints.latest().await.expect("read checkpoints");
            if let Some(latest) = latest.filter(|c| until(c)) {
                return latest;
            }
            assert!(started.elapsed() < PATIENCE, "no such checkpoint was taken");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// What came of the command `id`, once the run has carried it out.
    async fn outcome(&self, id: &str) -> Done {
        let started = Instant::now();
        loop {
            if let Some(done) = self.commands.outcome(id).expect("read the outcome") {
                return done;
            }
            assert!(
                started.elapsed() < PATIENCE,
                "command {id} was not carried out"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn end(self) -> (Summary, String) {
        drop(self.lines);
        self.run.await.expect("the run ends")
    }
}

async fn run(
    agent: Arc<Agent>,
    lines: futures_util::stream::BoxStream<'static, Result<InputLine, LineError>>,
    checkpoints: Arc<FileCheckpoints>,
    commands: Watched,
    cadence: Cadence,
) -> (Summary, String) {
    let (every_inputs, every) = match cadence {
        Cadence::Timed => (None, Some(Duration::from_millis(20))),
        Cadence::Untimed => (Some(1), None),
    };
    let checkpointing = Checkpointing {
        store: checkpoints,
        every_inputs,
        every,
        keep: 3,
        retention: Vec::new(),
    };
    let mut sink = JsonlSink::new(Vec::new());
    let options = RunOptions {
        checkpointing: Some(&checkpointing),
        resume: None,
        commands: Some(&commands),
        until_waits_end: false,
        end_when_held: false,
        deltas: None,
    };
    let summary = run_inputs(agent, lines, &mut sink, &(), options)
        .await
        .expect("the run");
    (
        summary,
        String::from_utf8(sink.into_inner()).expect("utf-8"),
    )
}

/// A state directory's commands, counting how often the run looks for them.
#[derive(Debug)]
struct Watched {
    dir: CommandDir,
    looked: Arc<AtomicU64>,
}

#[async_trait::async_trait]
impl CommandQueue for Watched {
    async fn pending(&self) -> Result<Vec<Command>, CommandsError> {
        let pending = self.dir.pending().await;
        self.looked.fetch_add(1, Ordering::SeqCst);
        pending
    }

    async fn finish(&self, command: &Command, outcome: &Outcome) -> Result<(), CommandsError> {
        self.dir.finish(command, outcome).await
    }
}

/// Whether `checkpoint` has `key`'s input `sequence` parked.
fn parked(checkpoint: &Checkpoint, key: &str, sequence: u64) -> bool {
    checkpoint
        .pending
        .iter()
        .any(|p| p.key == key && p.sequence == sequence && p.parked.is_some())
}

/// (key, sequence) of every output written.
fn outputs(written: &str) -> Vec<(String, u64)> {
    written
        .lines()
        .map(|line| {
            let output: Value = serde_json::from_str(line).expect("an output line");
            let key = output["key"].as_str().expect("key").to_owned();
            (key, output["sequence"].as_u64().expect("sequence"))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skip_left_while_a_run_goes_is_checkpointed_then_done_and_the_key_goes_on() {
    let state = tempfile::tempdir().expect("tempdir");
    // Checkpoints come only with inputs and commands: the one that holds the skip can only
    // be the skip's own.
    let mut going = Going::start(state.path(), Cadence::Untimed);
    going.feed("k", &json!({ "fail": "the payload is bad" }));
    going.feed("k", &json!({}));
    let started = Instant::now();
    let at_park = loop {
        going.feed("tick", &json!({}));
        let latest = going.checkpoint(|_| true).await;
        if parked(&latest, "k", 1) {
            break latest;
        }
        assert!(started.elapsed() < PATIENCE, "k #1 was not parked");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let pending: Vec<u64> = at_park
        .pending
        .iter()
        .filter(|p| p.key == "k")
        .map(|p| p.sequence)
        .collect();
    assert_eq!(pending, [1, 2], "the input behind the parked one waits");
    let error = &at_park.pending[0].parked.as_ref().expect("parked").error;
    assert!(error.contains("the payload is bad"), "{error}");

    let reason = "bad payload, refunded by hand".to_owned();
    let skip = going
        .commands
        .submit(
            "k",
            Some(1),
            "alice",
            Verb::Skip {
                reason: reason.clone(),
            },
        )
        .expect("left");
    let done = going.outcome(&skip.id).await;
    assert_eq!(done.outcome, Outcome::Applied { sequence: 1 });
    // Done only once a checkpoint holds the skip: a crash now does not undo it.
    let latest = going
        .checkpoints
        .latest()
        .await
        .expect("read")
        .expect("one");
    let skipped: Vec<_> = latest
        .skipped
        .iter()
        .map(|s| (s.key.as_str(), s.sequence, s.by.as_str(), s.reason.as_str()))
        .collect();
    assert_eq!(skipped, [("k", 1, "alice", reason.as_str())]);
    assert!(latest.pending.iter().all(|p| p.sequence != 1), "{latest:?}");

    let (summary, written) = going.end().await;
    let of_k: Vec<_> = outputs(&written)
        .into_iter()
        .filter(|(key, _)| key == "k")
        .collect();
    assert_eq!(of_k, [("k".to_owned(), 2)], "#2 ran once, #1 never");
    assert!(summary.parked.is_empty(), "{summary:?}");
    assert!(summary.all_completed(), "{summary:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_left_while_a_run_goes_runs_the_parked_input_again_and_a_stray_one_is_refused() {
    let state = tempfile::tempdir().expect("tempdir");
    let mut going = Going::start(state.path(), Cadence::Timed);
    going.feed("k", &json!({ "fail": "still failing" }));
    going.checkpoint(|c| parked(c, "k", 1)).await;

    let stray = going
        .commands
        .submit("other", None, "bob", Verb::Retry)
        .expect("left");
    let done = going.outcome(&stray.id).await;
    let Outcome::Refused { error } = done.outcome else {
        panic!("a key with nothing parked: {done:?}");
    };
    assert!(error.contains("key other has no parked input"), "{error}");

    let retry = going
        .commands
        .submit("k", None, "bob", Verb::Retry)
        .expect("left");
    let done = going.outcome(&retry.id).await;
    assert_eq!(done.outcome, Outcome::Applied { sequence: 1 });
    let (summary, written) = going.end().await;
    assert!(written.is_empty(), "{written}");
    // Two attempts, parked, retried: two attempts more, one retry between each pair.
    assert_eq!(summary.retries, 2, "{summary:?}");
    assert_eq!(summary.parked.len(), 1, "parked again: {summary:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_in_doubt_answered_by_an_operator_lets_its_parked_input_complete_without_calling_again()
 {
    let (payments, base) = crate::in_doubt::payments(1, true).await;
    let mut toml = crate::in_doubt::pay_agent(&base, "fail", "/charge/status");
    toml.push_str("\n[retry]\nattempts = 2\ninitial-ms = 1\n");
    let state = tempfile::tempdir().expect("tempdir");
    let mut going = Going::start_with(state.path(), &toml, Cadence::Timed, &[]);
    let pay = json!({ "calls": [{ "function": "pay", "args": { "amount": 5 } }] });
    going.feed("ana", &pay);
    let at_park = going.checkpoint(|c| parked(c, "ana", 1)).await;
    let error = &at_park.pending[0].parked.as_ref().expect("parked").error;
    assert!(error.contains("in doubt"), "{error}");

    let answer = Verb::Resolve {
        call: 1,
        action: None,
        answer: CallAnswer::Result(r#"{"charged": 5}"#.to_owned()),
    };
    let wrong = going
        .commands
        .submit("ana", None, "carol", answer)
        .expect("left");
    let Outcome::Refused { error } = going.outcome(&wrong.id).await.outcome else {
        panic!("call 1 was never made");
    };
    assert!(error.contains("has no call 1 in doubt"), "{error}");

    let answer = Verb::Resolve {
        call: 0,
        action: None,
        answer: CallAnswer::Result(r#"{"charged": 5}"#.to_owned()),
    };
    let resolve = going
        .commands
        .submit("ana", Some(1), "carol", answer)
        .expect("left");
    let done = going.outcome(&resolve.id).await;
    assert_eq!(done.outcome, Outcome::Applied { sequence: 1 });
    let (summary, written) = going.end().await;
    assert_eq!(outputs(&written), [("ana".to_owned(), 1)], "{summary:?}");
    assert!(
        written.contains("charged"),
        "the answer is what the action got: {written}"
    );
    assert!(summary.all_completed(), "{summary:?}");
    assert_eq!(
        payments.posts.load(Ordering::SeqCst),
        1,
        "the charge was made once, before it was in doubt"
    );
}

/// A custom function whose calls each wait until the test opens the gate for one, saying
/// when one has come.
#[derive(Debug)]
struct Gate {
    calls: AtomicU64,
    came: mpsc::UnboundedSender<u64>,
    open: Semaphore,
}

impl Gate {
    fn new() -> (Arc<Self>, mpsc::UnboundedReceiver<u64>) {
        let (came, rx) = mpsc::unbounded_channel();
        let gate = Self {
            calls: AtomicU64::new(0),
            came,
            open: Semaphore::new(0),
        };
        (Arc::new(gate), rx)
    }
}

#[async_trait::async_trait]
impl Function for Gate {
    async fn call(&self, _: CallRequest<'_>) -> Result<String, FunctionError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let _ = self.came.send(n);
        self.open.acquire().await.expect("the gate stays").forget();
        Ok(json!({ "n": n }).to_string())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_left_while_an_input_runs_stops_it_at_its_next_call_and_its_key_goes_on() {
    let (gate, mut came) = Gate::new();
    let toml = agent_toml("caller", "", "");
    let state = tempfile::tempdir().expect("tempdir");
    let functions: [(&str, Arc<dyn Function>); 1] = [("gate", gate.clone())];
    let mut going = Going::start_with(state.path(), &toml, Cadence::Timed, &functions);
    let two_calls = json!({ "calls": [
        { "function": "gate", "args": { "step": 1 } },
        { "function": "gate", "args": { "step": 2 } },
    ] });
    going.feed("k", &two_calls);
    going.feed("k", &json!({}));
    let first = tokio::time::timeout(PATIENCE, came.recv()).await;
    assert_eq!(first.expect("call 0 came"), Some(1));

    let cancel = Verb::Cancel {
        reason: "the customer withdrew".to_owned(),
    };
    let cancel = going
        .commands
        .submit("k", Some(1), "dora", cancel)
        .expect("left");
    // A second operator cancels it too, before it stops: both are done by its one end.
    let again = Verb::Cancel {
        reason: String::new(),
    };
    let again = going
        .commands
        .submit("k", None, "erin", again)
        .expect("left");
    // Call 0 is in flight: the cancel waits for the run to reach its next call.
    going.taken().await;
    assert!(
        going.commands.outcome(&cancel.id).expect("read").is_none(),
        "done before the input stopped"
    );
    gate.open.add_permits(1);
    let done = going.outcome(&cancel.id).await;
    assert_eq!(done.outcome, Outcome::Applied { sequence: 1 });
    let done = going.outcome(&again.id).await;
    assert_eq!(done.outcome, Outcome::Applied { sequence: 1 });
    // Done only once a checkpoint holds the cancel.
    let latest = going
        .checkpoints
        .latest()
        .await
        .expect("read")
        .expect("one");
    let ended: Vec<_> = latest
        .skipped
        .iter()
        .map(|s| {
            (
                s.key.as_str(),
                s.sequence,
                s.ended,
                s.by.as_str(),
                s.reason.as_str(),
            )
        })
        .collect();
    assert_eq!(
        ended,
        [("k", 1, Ended::Cancelled, "dora", "the customer withdrew")]
    );
    // Both commands are kept with it: found done after a crash, not carried out again.
    assert_eq!(latest.skipped[0].command, cancel.id);
    assert_eq!(latest.skipped[0].also, std::slice::from_ref(&again.id));

    let (summary, written) = going.end().await;
    assert_eq!(
        gate.calls.load(Ordering::SeqCst),
        1,
        "call 1 came after the cancel: not made"
    );
    assert_eq!(
        outputs(&written),
        [("k".to_owned(), 2)],
        "#2 ran; #1 sent nothing"
    );
    assert_eq!(summary.ended, [("k".to_owned(), 1, Ended::Cancelled)]);
    assert!(summary.all_completed(), "{summary:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_ends_an_input_waiting_to_retry_without_another_attempt() {
    let toml = agent_toml(
        "caller",
        "",
        "[retry]\nattempts = 3\ninitial-ms = 600000\nmax-ms = 600000\n",
    );
    let state = tempfile::tempdir().expect("tempdir");
    let mut going = Going::start_with(state.path(), &toml, Cadence::Timed, &[]);
    going.feed("k", &json!({ "fail": "not yet" }));
    going.feed("k", &json!({}));
    let retrying = going
        .checkpoint(|c| c.pending.iter().any(|p| p.key == "k" && p.sequence == 2))
        .await;
    assert!(retrying.skipped.is_empty());
    let cancel = going
        .commands
        .submit(
            "k",
            None,
            "erin",
            Verb::Cancel {
                reason: String::new(),
            },
        )
        .expect("left");
    let done = going.outcome(&cancel.id).await;
    assert_eq!(done.outcome, Outcome::Applied { sequence: 1 });
    // Cancelled once: a second cancel of it is refused, saying why.
    let late = going
        .commands
        .submit(
            "k",
            Some(1),
            "erin",
            Verb::Cancel {
                reason: String::new(),
            },
        )
        .expect("left");
    let Outcome::Refused { error } = going.outcome(&late.id).await.outcome else {
        panic!("k #1 is finished");
    };
    assert!(
        error == "key k: it has no unfinished input"
            || error == "key k: #1 is not an unfinished input of it",
        "{error}"
    );
    let (summary, written) = going.end().await;
    assert_eq!(outputs(&written), [("k".to_owned(), 2)]);
    assert!(summary.all_completed(), "{summary:?}");
}
