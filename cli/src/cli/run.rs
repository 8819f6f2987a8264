//! `rewind run AGENT.toml --input FILE.jsonl [--output FILE.jsonl]`.

use std::io::{BufReader, IsTerminal as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use indicatif::{ProgressBar, ProgressStyle};
use rewind_host::agent::script::Script;
use rewind_host::agent::{Agent, AgentFile, JsonlSink, input};
use rewind_host::commands::{CommandDir, Outcome};
use rewind_host::event::{Delta, Deltas};
use rewind_host::keys::{Checkpointing, Progress, RunOptions, Summary, run_inputs};
use rewind_host::log::Recovery;
use rewind_host::sandbox::Sandbox;

use super::state;

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The agent's agent.toml.
    agent: PathBuf,
    /// JSON Lines of {"key": "...", "payload": <json>}.
    #[arg(long)]
    input: PathBuf,
    /// Where outputs go, as JSON Lines (default: standard output).
    #[arg(long)]
    output: Option<PathBuf>,
    /// The state directory: the log of recorded calls and the checkpoints. A run started
    /// again with the same directory recovers from its newest checkpoint.
    #[arg(long, default_value = ".rewind")]
    state: PathBuf,
    /// Do not check that every function's endpoint accepts connections before starting.
    #[arg(long)]
    no_preflight: bool,
    /// Keep running until inputs at a durable wait (a sleep, a wait for a signal) finish,
    /// rather than ending once only they (and parked inputs) are left.
    #[arg(long)]
    wait: bool,
    /// Print the pieces of streamed model answers to stderr as they come, one JSON line
    /// each (`{"delta": {"key", "sequence", "action", "call", "function", "delta"}}`); they
    /// are not recorded, and a replayed call prints none.
    #[arg(long)]
    follow: bool,
}

/// `--follow`: each delta as a JSON line on stderr, written whole.
#[derive(Debug)]
struct Printed;

impl Deltas for Printed {
    fn send(&self, delta: Delta) {
        let mut line = serde_json::json!({ "delta": delta }).to_string();
        line.push('\n');
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
}

struct Bar(ProgressBar);

impl Progress for Bar {
    fn accepted(&self) {
        self.0.inc_length(1);
    }
    fn finished(&self, _input: &rewind_host::event::Input, _completed: bool) {
        self.0.inc(1);
    }
}

/// The exit code of a run that ended with inputs at a durable wait, and nothing parked,
/// stopped or malformed: not a failure, but not finished either.
pub const WAITS_PENDING: u8 = 3;

pub async fn run(args: RunArgs, sandbox: Sandbox) -> anyhow::Result<ExitCode> {
    let file = AgentFile::load(&args.agent)?;
    let config = file.config.state;
    let agent_name = file.config.name.clone();
    let recovered = state::recover(
        &args.state,
        &config,
        Recovery::TruncateTornTail,
        state::Load::Recovery { agent: &agent_name },
    )
    .await?;
    if let Some(checkpoint) = &recovered.latest {
        eprintln!(
            "resuming from checkpoint {} in {}: {} pending inputs, input resumes after line {}",
            checkpoint.id,
            args.state.display(),
            checkpoint.pending.len(),
            checkpoint.input_position
        );
    }
    // A test hook (`rewind test --signals`): signals delivered as runs reach calls and waits.
    let script = match std::env::var_os(rewind_host::agent::script::SIGNALS_ENV) {
        Some(path) => Some(Script::read(Path::new(&path), &file.config.signals())?),
        None => None,
    };
    let mut builder = Agent::builder(file, Arc::new(sandbox)).store(recovered.store.clone());
    // A test hook (`rewind test`): durable waits end at once, in order.
    if std::env::var_os(rewind_host::functions::SKIP_TIME_ENV).is_some() {
        tracing::warn!("time skips: durable waits end at once");
        builder = builder.clock(Arc::new(rewind_host::functions::SkippingClock::default()));
    }
    if let Some(script) = script {
        tracing::warn!(
            signals = script.signals.len(),
            "delivering the script's signals"
        );
        builder = builder.signal_script(script);
    }
    let agent = Arc::new(builder.build()?);
    if !args.no_preflight {
        preflight(&agent).await?;
    }
    let reader = std::fs::File::open(&args.input)
        .with_context(|| format!("cannot open the input file {}", args.input.display()))?;
    let bar = if std::io::stderr().is_terminal() {
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template("{spinner} {pos}/{len} inputs {wide_bar} {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar
    } else {
        ProgressBar::hidden()
    };
    let checkpointing = Checkpointing::new(
        recovered.checkpoints.clone(),
        &config,
        vec![Arc::clone(&recovered.store) as _],
    );
    let commands = CommandDir::of(&args.state);
    let follow = args.follow.then(|| Arc::new(Printed) as Arc<dyn Deltas>);
    let options = RunOptions {
        checkpointing: Some(&checkpointing),
        resume: recovered.latest.as_ref(),
        commands: Some(&commands),
        until_waits_end: args.wait,
        end_when_held: !args.wait,
        deltas: follow.as_ref(),
    };
    let lines = futures_util::stream::iter(input::read_lines(BufReader::new(reader)));
    let progress = Bar(bar.clone());
    let summary = match &args.output {
        Some(path) => {
            let mut sink = JsonlSink::resume(path)
                .with_context(|| format!("cannot open the output file {}", path.display()))?;
            run_inputs(Arc::clone(&agent), lines, &mut sink, &progress, options).await
        }
        None => {
            let mut sink = JsonlSink::new(std::io::stdout());
            run_inputs(Arc::clone(&agent), lines, &mut sink, &progress, options).await
        }
    };
    bar.finish_and_clear();
    let summary = summary.context("writing the outputs")?;
    print_summary(&summary);
    if let Some(path) = std::env::var_os(rewind_host::kit::CALLS_ENV) {
        write_calls(Path::new(&path), &summary)
            .with_context(|| format!("writing the calls to {}", path.display()))?;
    }
    Ok(if summary.all_completed() {
        ExitCode::SUCCESS
    } else if summary.only_waits() {
        ExitCode::from(WAITS_PENDING)
    } else {
        ExitCode::FAILURE
    })
}

/// Fails with one clear message when a function's endpoint does not accept connections.
async fn preflight(agent: &Agent) -> anyhow::Result<()> {
    for (name, declared) in agent.functions().iter() {
        let Some(endpoint) = declared.handler.endpoint() else {
            continue;
        };
        let url = reqwest::Url::parse(endpoint)
            .with_context(|| format!("function `{name}`: `{endpoint}` is not a URL"))?;
        let host = url.host_str().unwrap_or_default().to_owned();
        let port = url.port_or_known_default().unwrap_or(80);
        let connect = tokio::net::TcpStream::connect((host.as_str(), port));
        match tokio::time::timeout(Duration::from_secs(3), connect).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => bail!(
                "function `{name}` is unreachable: {endpoint}: {e} (is the service running? \
                 --no-preflight skips this check)"
            ),
            Err(_) => bail!("function `{name}` is unreachable: {endpoint}: no answer in 3 s"),
        }
    }
    Ok(())
}

/// Appends the run's calls per function, one JSON line, for the crash kit.
fn write_calls(path: &Path, summary: &Summary) -> anyhow::Result<()> {
    let mut line = serde_json::to_vec(&summary.calls_by_function)?;
    line.push(b'\n');
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    std::io::Write::write_all(&mut file, &line)?;
    Ok(())
}

fn print_summary(summary: &Summary) {
    eprintln!(
        "inputs: {} accepted, {} completed, {} parked, {} at a durable wait, {} waiting behind \
         an earlier input of their key, {} malformed lines; {} failed attempts retried",
        summary.inputs,
        summary.completed,
        summary.parked.len(),
        summary.waits.len(),
        summary.waiting_inputs(),
        summary.malformed.len(),
        summary.retries
    );
    if !summary.stopped.is_empty() {
        eprintln!(
            "inputs: {} stopped by a fault of the host (not failed: run again by the next run)",
            summary.stopped.len()
        );
    }
    eprintln!(
        "actions: {} runs, {} re-applied from records",
        summary.runs, summary.reapplied
    );
    if summary.unhandled > 0 {
        eprintln!(
            "events: {} of a kind no action handles, dropped (unhandled-events = \"fail\" \
             fails their inputs instead)",
            summary.unhandled
        );
    }
    eprintln!(
        "calls: {} made, {} served from records{}",
        summary.calls.live,
        summary.calls.replayed,
        match summary.calls.reconciled {
            0 => String::new(),
            n => format!(", {n} in doubt answered by reconcile"),
        }
    );
    eprintln!(
        "outputs: {} written, {} replayed duplicates dropped",
        summary.outputs, summary.duplicates
    );
    eprintln!("time: {:.2?}", summary.elapsed);
    for error in summary.malformed.iter().take(10) {
        eprintln!("malformed input {error}");
    }
    for error in summary.parked.iter().take(10) {
        eprintln!("parked: {error}");
    }
    if summary.parked.len() > 10 {
        eprintln!("parked: {} more inputs", summary.parked.len() - 10);
    }
    for (key, sequence, fault) in summary.stopped.iter().take(10) {
        eprintln!("stopped: {key} #{sequence}: {fault}");
    }
    for (key, sequence, waiting) in summary.waits.iter().take(10) {
        eprintln!(
            "at a wait: {key} #{sequence}: action `{}` waits {}",
            waiting.action, waiting.wait
        );
    }
    if summary.waits.len() > 10 {
        eprintln!("at a wait: {} more inputs", summary.waits.len() - 10);
    }
    if let Some(line) = summary.held_at {
        eprintln!(
            "input: stopped reading after line {line}: the run holds as many inputs at a \
             durable wait as it may ({} per unit of parallelism), and nothing else runs; the \
             same command again goes on from line {}",
            rewind_host::keys::HELD_PER_KEY_SLOT,
            line + 1
        );
    }
    if !summary.waits.is_empty() {
        let next = summary
            .waits
            .iter()
            .filter_map(|(_, _, w)| w.wait.until_text())
            .min();
        let when = match next {
            Some(next) => format!("the next wait's time comes at {next}; "),
            None => String::new(),
        };
        eprintln!(
            "{when}running the same command again (on the same --state) after it, or after \
             `rewind signal --state DIR --key K --name NAME`, goes on with them (or run with \
             --wait to keep running until they finish)"
        );
    }
    for (key, waiting) in summary.waiting.iter().take(10) {
        let which = if waiting.inputs == 1 {
            format!("1 input (#{})", waiting.first)
        } else {
            format!(
                "{} inputs (#{} to #{})",
                waiting.inputs, waiting.first, waiting.last
            )
        };
        eprintln!(
            "waiting: {key}: {which} not run, because #{} of this key did not complete first \
             (inputs of a key run in order)",
            waiting.behind
        );
    }
    if summary.waiting.len() > 10 {
        eprintln!("waiting: {} more keys", summary.waiting.len() - 10);
    }
    for (command, outcome) in &summary.commands {
        let described = super::operator::describe(command);
        match outcome {
            Outcome::Applied { sequence } => eprintln!("operator: {described}: done (#{sequence})"),
            Outcome::Refused { error } => eprintln!("operator: {described}: refused: {error}"),
        }
    }
    if !summary.parked.is_empty() || !summary.stopped.is_empty() {
        eprintln!(
            "running the same command again (on the same --state) retries every parked input, \
             then the inputs waiting behind it; `rewind skip --state DIR --key K --reason WHY` \
             skips one instead"
        );
    }
}
