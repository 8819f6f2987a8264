//! `rewind retry|skip|resolve|cancel --state DIR --key K [--sequence N]`: operator commands
//! on a state directory, carried out by the `rewind run` that holds it, or by the next one.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use rewind_host::commands::{CallAnswer, Command, CommandDir, Outcome, Verb};

use super::state;

/// Which parked input, of which state.
#[derive(Debug, clap::Args)]
pub struct Target {
    /// The state directory a run writes.
    #[arg(long, default_value = ".rewind")]
    state: PathBuf,
    /// The key whose input it is (its parked one; for a cancel, its first unfinished one).
    #[arg(long)]
    key: String,
    /// The input's sequence (default: whichever input of the key is parked, or first).
    #[arg(long)]
    sequence: Option<u64>,
    /// Who asks, recorded with the command (default: $USER).
    #[arg(long)]
    by: Option<String>,
    /// Wait up to this many seconds for a run to carry the command out, and say how it
    /// went (default: leave it and return).
    #[arg(long, value_name = "SECONDS")]
    wait: Option<u64>,
}

#[derive(Debug, clap::Args)]
pub struct RetryArgs {
    #[command(flatten)]
    target: Target,
}

#[derive(Debug, clap::Args)]
pub struct SkipArgs {
    #[command(flatten)]
    target: Target,
    /// Why it is skipped, kept in the state's history.
    #[arg(long)]
    reason: String,
}

#[derive(Debug, clap::Args)]
pub struct CancelArgs {
    #[command(flatten)]
    target: Target,
    /// Why it is cancelled, kept in the state's history.
    #[arg(long, default_value = "")]
    reason: String,
}

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("answer").required(true).args(["result", "error", "not_made"])))]
pub struct ResolveArgs {
    #[command(flatten)]
    target: Target,
    /// The call's index in its action's run, from 0 (`rewind inspect` lists them as
    /// `call N`).
    #[arg(long)]
    call: usize,
    /// The action whose call it is, when more than one action of the input has call N in
    /// doubt.
    #[arg(long)]
    action: Option<String>,
    /// The call ran, and the remote answered this JSON.
    #[arg(long, value_name = "JSON")]
    result: Option<String>,
    /// The call ran, and failed with this error.
    #[arg(long, value_name = "TEXT")]
    error: Option<String>,
    /// The call never reached the remote: it is made again, under the same idempotency key.
    #[arg(long)]
    not_made: bool,
}

pub async fn resolve(args: ResolveArgs) -> anyhow::Result<ExitCode> {
    let answer = match (args.result, args.error) {
        (Some(result), _) => {
            serde_json::from_str::<serde_json::Value>(&result)
                .with_context(|| format!("--result is not JSON: {result}"))?;
            CallAnswer::Result(result)
        }
        (None, Some(error)) => CallAnswer::Error(error),
        (None, None) => CallAnswer::NotMade,
    };
    let verb = Verb::Resolve {
        call: args.call,
        action: args.action,
        answer,
    };
    leave(args.target, verb).await
}

pub async fn retry(args: RetryArgs) -> anyhow::Result<ExitCode> {
    leave(args.target, Verb::Retry).await
}

pub async fn skip(args: SkipArgs) -> anyhow::Result<ExitCode> {
    if args.reason.trim().is_empty() {
        bail!("--reason is empty: say why the input is skipped; it is kept in the history");
    }
    leave(
        args.target,
        Verb::Skip {
            reason: args.reason,
        },
    )
    .await
}

pub async fn cancel(args: CancelArgs) -> anyhow::Result<ExitCode> {
    leave(
        args.target,
        Verb::Cancel {
            reason: args.reason,
        },
    )
    .await
}

async fn leave(target: Target, verb: Verb) -> anyhow::Result<ExitCode> {
    if !state::log_dir(&target.state).is_dir() {
        bail!(
            "{} holds no state: run `rewind run --state {}` first",
            target.state.display(),
            target.state.display()
        );
    }
    let by = target.by.clone().unwrap_or_else(|| {
        std::env::var("USER").map_or_else(|_| "operator".to_owned(), |user| format!("user {user}"))
    });
    let commands = CommandDir::of(&target.state);
    let command = commands
        .submit(&target.key, target.sequence, &by, verb)
        .with_context(|| format!("leaving the command in {}", target.state.display()))?;
    let Some(seconds) = target.wait else {
        eprintln!(
            "left command {} ({}); the `rewind run` that holds {} carries it out within a \
             second, or the next one does; `rewind inspect --state {}` shows what came of it",
            command.id,
            describe(&command),
            target.state.display(),
            target.state.display()
        );
        return Ok(ExitCode::SUCCESS);
    };
    let deadline = Instant::now() + Duration::from_secs(seconds);
    loop {
        if let Some(done) = commands.outcome(&command.id)? {
            return Ok(match done.outcome {
                Outcome::Applied { sequence } => {
                    eprintln!("{}: done (#{sequence})", describe(&command));
                    ExitCode::SUCCESS
                }
                Outcome::Refused { error } => {
                    eprintln!("{}: refused: {error}", describe(&command));
                    ExitCode::FAILURE
                }
            });
        }
        if Instant::now() >= deadline {
            eprintln!(
                "command {} ({}) not carried out in {seconds} s: no run holds {} (the next \
                 one carries it out)",
                command.id,
                describe(&command),
                target.state.display()
            );
            return Ok(ExitCode::FAILURE);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `skip of key K #N by B`; a resolve names its call.
pub fn describe(command: &Command) -> String {
    let which = command
        .sequence
        .map_or_else(String::new, |sequence| format!(" #{sequence}"));
    let call = match &command.verb {
        Verb::Resolve { call, action, .. } => match action {
            Some(action) => format!(" call {call} of `{action}`"),
            None => format!(" call {call}"),
        },
        Verb::Retry | Verb::Skip { .. } | Verb::Cancel { .. } => String::new(),
    };
    format!(
        "{} of key {}{which}{call} by {}",
        command.verb.name(),
        command.key,
        command.by
    )
}
