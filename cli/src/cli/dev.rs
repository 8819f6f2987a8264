//! `rewind dev agent.toml --input FILE`: the loop of writing an agent. On every change of
//! its sources, agent.toml or the inputs, the changed actions are built again and the
//! inputs run again into a fresh state, their outputs printed.
//!
//! The agent's `http` and `openai-chat` functions are pointed at the kit's simulator
//! (`rewind_host::kit`), which answers from a recording (the `rewind test --responses`
//! format, default responses.jsonl beside agent.toml): a call it holds costs nothing and
//! reaches no service; a call it lacks goes to the function's service, and its answer is
//! appended, so the next run is served it. `--offline` makes a call the recording lacks
//! fail instead; `--live` sends every call to its service and leaves the recording alone;
//! `--refresh` records anew.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use rewind_host::agent::AgentFile;
use rewind_host::kit::{Misses, Script, Simulator, read_scripts, rewrite};

use super::build::{Builder, digest_paths, local_dependencies, sources};

#[derive(Debug, clap::Args)]
pub struct DevArgs {
    /// The agent.
    #[arg(default_value = "agent.toml")]
    agent: PathBuf,
    /// Its inputs, JSON Lines, run on every change.
    #[arg(long)]
    input: PathBuf,
    /// The recording the agent's calls are answered from (default: responses.jsonl
    /// beside agent.toml); answers of calls it lacks are appended.
    #[arg(long)]
    responses: Option<PathBuf>,
    /// Every call goes to its service; the recording is neither read nor written.
    #[arg(long, conflicts_with_all = ["offline", "refresh"])]
    live: bool,
    /// A call the recording lacks fails (and is counted) instead of reaching its service.
    #[arg(long, conflicts_with = "refresh")]
    offline: bool,
    /// Records anew: the first run's calls all go to their services, and their answers
    /// replace the recording.
    #[arg(long)]
    refresh: bool,
    /// Build and run once, then exit: non-zero when the build or the run failed, or a call
    /// was not in the recording under --offline.
    #[arg(long)]
    once: bool,
}

/// How often the sources are looked at for a change.
const POLL: Duration = Duration::from_millis(300);

pub async fn dev(args: DevArgs, cache_dir: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    let base = args.agent.parent().filter(|p| !p.as_os_str().is_empty());
    let base = base.unwrap_or(Path::new(".")).to_owned();
    let responses = args
        .responses
        .clone()
        .unwrap_or_else(|| base.join("responses.jsonl"));
    let work = base.join(".rewind-dev");
    let builder = Builder::new(cache_dir)?;
    let mut refresh = args.refresh;
    let mut round = 0u64;
    loop {
        round += 1;
        eprintln!("== rewind dev: run {round}");
        // What the sources were as the round began; once built, as they were built.
        let mut seen = fingerprint(&args).unwrap_or_default();
        let outcome = once(&args, &builder, &responses, &work, refresh, &mut seen).await;
        let ok = match outcome {
            Ok(ok) => {
                // Recorded anew once: the next rounds are served from it.
                refresh = false;
                ok
            }
            Err(error) => {
                eprintln!("error: {error:#}");
                false
            }
        };
        if args.once {
            return Ok(if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            });
        }
        eprintln!(
            "== waiting for a change to {}, its actions or {}",
            args.agent.display(),
            args.input.display()
        );
        loop {
            tokio::time::sleep(POLL).await;
            // A file caught half-written is read again at the next look.
            if fingerprint(&args).ok().is_some_and(|now| now != seen) {
                break;
            }
        }
    }
}

/// What a change is looked for in: agent.toml, the inputs, and each action's sources with
/// their local dependencies.
fn fingerprint(args: &DevArgs) -> anyhow::Result<String> {
    let mut paths = vec![args.agent.clone(), args.input.clone()];
    if let Ok(agent) = AgentFile::load(&args.agent) {
        for source in sources(&agent).unwrap_or_default() {
            paths.extend(local_dependencies(&source).unwrap_or_default());
            paths.push(source.dir);
        }
    }
    digest_paths(paths.iter().map(PathBuf::as_path), "")
}

/// One round: build, run into a fresh state against the simulator, keep new answers.
/// Whether all went well. `seen` becomes what the sources were when built (taken after
/// the build: `npm install` writes a lockfile among them).
async fn once(
    args: &DevArgs,
    builder: &Builder,
    responses: &Path,
    work: &Path,
    refresh: bool,
    seen: &mut String,
) -> anyhow::Result<bool> {
    let agent = AgentFile::load(&args.agent)?;
    for source in sources(&agent)? {
        builder.build(&source)?;
    }
    *seen = fingerprint(args).unwrap_or_default();
    let known = if responses.exists() {
        read_scripts(responses)?
    } else {
        Vec::new()
    };
    let scripts = if args.live || refresh {
        Vec::new()
    } else {
        known.clone()
    };
    let recorded = scripts.len();
    let misses = if args.offline {
        Misses::Fail
    } else {
        Misses::Forward
    };
    // The simulator's address is known once it listens; the agent is rewritten to it.
    let rewritten = rewrite(&args.agent, |_| String::new(), &[])?;
    let simulator = Simulator::start_with(rewritten.upstreams, scripts, misses).await?;
    let rewritten = rewrite(&args.agent, |name| simulator.url(name), &[])?;
    if work.exists() {
        std::fs::remove_dir_all(work).with_context(|| format!("emptying {}", work.display()))?;
    }
    std::fs::create_dir_all(work)?;
    let agent_path = work.join("agent.toml");
    std::fs::write(&agent_path, &rewritten.toml)?;
    let exe = std::env::current_exe().context("finding the rewind binary")?;
    let cache_dir = builder.cache_dir().to_owned();
    let state = work.join("state");
    let input = args.input.clone();
    let status = tokio::task::spawn_blocking(move || {
        Command::new(exe)
            .arg("--cache-dir")
            .arg(&cache_dir)
            .arg("run")
            .arg(&agent_path)
            .arg("--input")
            .arg(&input)
            .arg("--state")
            .arg(&state)
            .stdin(Stdio::null())
            .status()
    })
    .await?
    .context("running rewind run")?;

    // One answer per function and args: the recording's own, else the first that came.
    let mut live = simulator.live_answers();
    let mut seen: Vec<(String, Option<serde_json::Value>)> = if refresh {
        Vec::new()
    } else {
        known
            .iter()
            .map(|script| (script.function.clone(), script.args.clone()))
            .collect()
    };
    live.retain(|answer| {
        let id = (answer.function.clone(), answer.args.clone());
        let new = !seen.contains(&id);
        seen.push(id);
        new
    });
    let missed = simulator.misses();
    if !args.live && (refresh || !live.is_empty()) {
        keep(responses, &live, refresh)?;
    }
    let served = simulator.scripted();
    let mut said = format!(
        "== {} calls answered from {} ({} answers in it), {} made live",
        served,
        responses.display(),
        recorded,
        simulator.forwarded_live()
    );
    if args.live {
        said.push_str(" (--live: the recording is left as it is)");
    } else if !live.is_empty() {
        said.push_str(&format!(", {} answers appended", live.len()));
    }
    if missed > 0 {
        said.push_str(&format!(
            "; {missed} calls not in the recording failed (--offline: run without it, or \
             with --refresh, to record them)"
        ));
    }
    eprintln!("{said}");
    Ok(status.success() && missed == 0)
}

/// Appends `answers` to the recording at `path` (on a line of their own), or replaces it
/// with them (`--refresh`: written whole beside it, then renamed into place).
fn keep(path: &Path, answers: &[Script], replace: bool) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut text = String::new();
    for answer in answers {
        text.push_str(&serde_json::to_string(answer)?);
        text.push('\n');
    }
    if replace {
        let mut temporary = path.as_os_str().to_owned();
        temporary.push(".tmp");
        std::fs::write(&temporary, &text)
            .with_context(|| format!("writing {}", Path::new(&temporary).display()))?;
        std::fs::rename(&temporary, path).with_context(|| format!("writing {}", path.display()))?;
        return Ok(());
    }
    let before = std::fs::read(path).unwrap_or_default();
    if before.last().is_some_and(|last| *last != b'\n') {
        text.insert(0, '\n');
    }
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    file.write_all(text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
