//! `rewind test AGENT.toml --input FILE.jsonl [--crash-at every|random|POINT:N]`: the
//! crash-injection kit (`rewind_host::testing`).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use rewind_host::crash::Crash;
use rewind_host::kit::{CrashAt, Kit, Outcome, read_scripts};

#[derive(Debug, clap::Args)]
pub struct TestArgs {
    /// The agent to test.
    agent: PathBuf,
    /// Its inputs, JSON Lines.
    #[arg(long)]
    input: PathBuf,
    /// `every` durable boundary the uninterrupted run reaches, `random` ones (with --seed
    /// and --runs), or one: `POINT:N`.
    #[arg(long, default_value = "every")]
    crash_at: String,
    /// Seed for `--crash-at random`: the same seed, the same crash points.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Crashes for `--crash-at random`.
    #[arg(long, default_value_t = 20)]
    runs: usize,
    /// Scripted answers, JSON Lines: {"function": NAME, "args": {..}, "result": {..}};
    /// without `args`, an answer for every call of the function. Calls no line answers go
    /// to the function's own endpoint, once per idempotency key for the whole kit run (a
    /// retryable answer, 5xx, 429 or 408, is not kept).
    #[arg(long)]
    responses: Option<PathBuf>,
    /// Signals to deliver, JSON Lines: {"name": NAME, "payload": {..}, "key": KEY,
    /// "sequence": N, "at_wait": N | "after_call": N}; only `name` is needed. Each is put
    /// in an input's inbox as the action reaches its Nth wait (default the first) or once
    /// its Nth durable call is recorded, once per input; without `key` or `sequence`, for
    /// every input. Time skips in every run, so a day's wait for a person takes no time.
    #[arg(long)]
    signals: Option<PathBuf>,
    /// `FROM=TO`: replace URL prefix FROM of the agent's endpoints with TO.
    #[arg(long = "rewrite", value_name = "FROM=TO")]
    rewrites: Vec<String>,
    /// Where the runs keep their state and outputs (emptied first).
    #[arg(long, default_value = ".rewind-test")]
    work: PathBuf,
}

/// Runs the kit; `verbose` lists every call made again under the same key, by case.
pub async fn test(
    args: TestArgs,
    cache_dir: Option<PathBuf>,
    verbose: bool,
) -> anyhow::Result<ExitCode> {
    let at = match args.crash_at.as_str() {
        "every" => CrashAt::Every,
        "random" => CrashAt::Random {
            seed: args.seed,
            runs: args.runs,
        },
        one => CrashAt::One(
            one.parse::<Crash>()
                .map_err(|e| anyhow::anyhow!("--crash-at {e}"))?,
        ),
    };
    let mut rewrites = Vec::new();
    for rewrite in &args.rewrites {
        let Some((from, to)) = rewrite.split_once('=') else {
            bail!("--rewrite {rewrite:?}: expected FROM=TO");
        };
        rewrites.push((from.to_owned(), to.to_owned()));
    }
    let scripts = match &args.responses {
        Some(path) => read_scripts(path)?,
        None => Vec::new(),
    };
    let kit = Kit {
        rewind: std::env::current_exe().context("finding the rewind binary")?,
        agent: args.agent.clone(),
        input: args.input.clone(),
        work: args.work.clone(),
        cache_dir,
        rewrites,
        scripts,
        signals: args.signals.clone(),
    };
    let report = kit.run(&at).await?;
    print!("{}", report.table());
    println!();
    print!("{}", report.calls(verbose));
    let mut failed = false;
    for case in report.failures() {
        failed = true;
        let Outcome::Failed(why) = &case.outcome else {
            continue;
        };
        println!();
        println!(
            "FAILED at {}{}: {why}",
            case.crash,
            match report.seed {
                Some(seed) => format!(" (seed {seed})"),
                None => String::new(),
            }
        );
        let mut rerun = format!(
            "rewind test {} --input {} --crash-at {}",
            args.agent.display(),
            args.input.display(),
            case.crash
        );
        for rewrite in &args.rewrites {
            rerun.push_str(&format!(" --rewrite {rewrite}"));
        }
        if let Some(responses) = &args.responses {
            rerun.push_str(&format!(" --responses {}", responses.display()));
        }
        if let Some(signals) = &args.signals {
            rerun.push_str(&format!(" --signals {}", signals.display()));
        }
        println!("rerun: {rerun}");
    }
    if report.cases.is_empty() {
        println!("no crash point was reached: the inputs make no durable call or checkpoint");
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}
