//! `rewind run AGENT.toml --input FILE.jsonl [--output FILE.jsonl]`.

use std::io::{BufReader, IsTerminal as _, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use indicatif::{ProgressBar, ProgressStyle};
use rewind_host::agent::{Agent, AgentFile, JsonlSink, Progress, Summary, input, run_inputs};
use rewind_host::sandbox::Sandbox;
use rewind_host::store::{ActionState, InMemoryStore};

/// The file, in the state directory, that keeps recorded states between runs.
pub const STATES_FILE: &str = "states.json";

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
    /// Where recorded states are kept between runs.
    #[arg(long, default_value = ".rewind")]
    state: PathBuf,
    /// Do not check that every function's endpoint accepts connections before starting.
    #[arg(long)]
    no_preflight: bool,
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

pub async fn run(args: RunArgs, sandbox: Sandbox) -> anyhow::Result<ExitCode> {
    let file = AgentFile::load(&args.agent)?;
    let store = Arc::new(InMemoryStore::default());
    let states_path = args.state.join(STATES_FILE);
    if let Some(states) = load_states(&states_path)? {
        store.restore(states);
    }
    let agent = Arc::new(
        Agent::builder(file, Arc::new(sandbox))
            .store(store.clone())
            .build()?,
    );
    if !args.no_preflight {
        preflight(&agent).await?;
    }
    let reader = std::fs::File::open(&args.input)
        .with_context(|| format!("cannot open the input file {}", args.input.display()))?;
    let writer: Box<dyn Write> = match &args.output {
        Some(path) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(path)
                .with_context(|| format!("cannot create the output file {}", path.display()))?,
        )),
        None => Box::new(std::io::stdout().lock()),
    };
    let mut sink = JsonlSink::new(writer);
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
    let lines = input::read_lines(BufReader::new(reader));
    let summary = run_inputs(Arc::clone(&agent), lines, &mut sink, &Bar(bar.clone())).await;
    bar.finish_and_clear();
    // Whatever happened to the outputs, keep what was recorded.
    save_states(&args.state, &states_path, store.snapshot())?;
    let summary = summary.context("writing the outputs")?;
    print_summary(&summary);
    Ok(
        if summary.failed.is_empty() && summary.malformed.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        },
    )
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

pub fn load_states(path: &Path) -> anyhow::Result<Option<Vec<ActionState>>> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .with_context(|| format!("{} is not a states file written by rewind", path.display()))
            .map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
    }
}

fn save_states(dir: &Path, path: &Path, states: Vec<ActionState>) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let temp = path.with_extension("json.tmp");
    std::fs::write(&temp, serde_json::to_vec(&states)?)
        .with_context(|| format!("cannot write {}", temp.display()))?;
    std::fs::rename(&temp, path).with_context(|| format!("cannot write {}", path.display()))
}

fn print_summary(summary: &Summary) {
    eprintln!(
        "inputs: {} accepted, {} completed, {} failed, {} malformed lines",
        summary.inputs,
        summary.completed,
        summary.failed.len(),
        summary.malformed.len()
    );
    eprintln!(
        "actions: {} runs, {} re-applied from records",
        summary.runs, summary.reapplied
    );
    eprintln!(
        "calls: {} made, {} served from records",
        summary.calls.live, summary.calls.replayed
    );
    eprintln!(
        "outputs: {} written, {} replayed duplicates dropped",
        summary.outputs, summary.duplicates
    );
    eprintln!("time: {:.2?}", summary.elapsed);
    for error in summary.malformed.iter().take(10) {
        eprintln!("malformed input {error}");
    }
    for error in summary.failed.iter().take(10) {
        eprintln!("failed: {error}");
    }
}
