//! `rewind retry|skip|resolve|cancel|signal --state DIR --key K [--sequence N]`: operator
//! commands on a state directory, carried out by the `rewind run` that holds it, or by the
//! next one.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use rewind_host::commands::{CallAnswer, Command, CommandDir, Done, Outcome, Verb};

use super::state;

/// Which input a command is for, who asks, and whether to wait for its outcome.
#[derive(Debug, clap::Args)]
pub struct Which {
    /// The key whose input it is (its parked one; for a cancel, its first unfinished one).
    #[arg(long)]
    key: String,
    /// The input's sequence (default: whichever input of the key is parked, or first).
    #[arg(long)]
    sequence: Option<u64>,
    /// Who asks, recorded with the command (default: $USER).
    #[arg(long)]
    by: Option<String>,
    /// Wait up to this many seconds for the command to be carried out, and say how it
    /// went (default: leave it and return).
    #[arg(long, value_name = "SECONDS")]
    wait: Option<u64>,
}

#[cfg(feature = "jetstream")]
impl Which {
    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn sequence(&self) -> Option<u64> {
        self.sequence
    }

    pub fn wait(&self) -> Option<u64> {
        self.wait
    }
}

impl Which {
    pub fn by(&self) -> String {
        self.by.clone().unwrap_or_else(|| {
            std::env::var("USER")
                .map_or_else(|_| "operator".to_owned(), |user| format!("user {user}"))
        })
    }
}

/// A state directory's input.
#[derive(Debug, clap::Args)]
pub struct Target {
    /// The state directory a run writes.
    #[arg(long, default_value = ".rewind")]
    state: PathBuf,
    #[command(flatten)]
    which: Which,
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
    #[command(flatten)]
    verb: SkipVerb,
}

#[derive(Debug, clap::Args)]
pub struct SkipVerb {
    /// Why it is skipped, kept in the state's history.
    #[arg(long)]
    reason: String,
}

impl SkipVerb {
    pub fn verb(self) -> anyhow::Result<Verb> {
        if self.reason.trim().is_empty() {
            bail!("--reason is empty: say why the input is skipped; it is kept in the history");
        }
        Ok(Verb::Skip {
            reason: self.reason,
        })
    }
}

#[derive(Debug, clap::Args)]
pub struct CancelArgs {
    #[command(flatten)]
    target: Target,
    #[command(flatten)]
    verb: CancelVerb,
}

#[derive(Debug, clap::Args)]
pub struct CancelVerb {
    /// Why it is cancelled, kept in the state's history.
    #[arg(long, default_value = "")]
    reason: String,
}

impl CancelVerb {
    pub fn verb(self) -> Verb {
        Verb::Cancel {
            reason: self.reason,
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct ResolveArgs {
    #[command(flatten)]
    target: Target,
    #[command(flatten)]
    verb: ResolveVerb,
}

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("answer").required(true).args(["result", "error", "not_made"])))]
pub struct ResolveVerb {
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

impl ResolveVerb {
    pub fn verb(self) -> anyhow::Result<Verb> {
        let answer = match (self.result, self.error) {
            (Some(result), _) => {
                serde_json::from_str::<serde_json::Value>(&result)
                    .with_context(|| format!("--result is not JSON: {result}"))?;
                CallAnswer::Result(result)
            }
            (None, Some(error)) => CallAnswer::Error(error),
            (None, None) => CallAnswer::NotMade,
        };
        Ok(Verb::Resolve {
            call: self.call,
            action: self.action,
            answer,
        })
    }
}

#[derive(Debug, clap::Args)]
pub struct SignalArgs {
    #[command(flatten)]
    target: Target,
    #[command(flatten)]
    verb: SignalVerb,
}

#[derive(Debug, clap::Args)]
pub struct SignalVerb {
    /// The signal's name: one an action of the agent declares (`signals = [...]`).
    #[arg(long)]
    name: String,
    /// Its payload, JSON.
    #[arg(long, value_name = "JSON", default_value = "null")]
    payload: String,
    /// Your id for it: sent again with the same id, it is delivered once (default: a new
    /// one, so each `rewind signal` is a new signal).
    #[arg(long)]
    id: Option<String>,
}

impl SignalVerb {
    pub fn verb(self) -> anyhow::Result<Verb> {
        serde_json::from_str::<serde_json::Value>(&self.payload)
            .with_context(|| format!("--payload is not JSON: {}", self.payload))?;
        let id = match self.id {
            Some(id) if id.trim().is_empty() => bail!("--id is empty"),
            Some(id) => id,
            // The command's own id.
            None => String::new(),
        };
        Ok(Verb::Signal {
            name: self.name,
            payload: self.payload,
            signal_id: id,
        })
    }
}

pub async fn signal(args: SignalArgs) -> anyhow::Result<ExitCode> {
    leave(args.target, args.verb.verb()?).await
}

pub async fn resolve(args: ResolveArgs) -> anyhow::Result<ExitCode> {
    leave(args.target, args.verb.verb()?).await
}

pub async fn retry(args: RetryArgs) -> anyhow::Result<ExitCode> {
    leave(args.target, Verb::Retry).await
}

pub async fn skip(args: SkipArgs) -> anyhow::Result<ExitCode> {
    leave(args.target, args.verb.verb()?).await
}

pub async fn cancel(args: CancelArgs) -> anyhow::Result<ExitCode> {
    leave(args.target, args.verb.verb()).await
}

async fn leave(target: Target, verb: Verb) -> anyhow::Result<ExitCode> {
    let state = target.state.display();
    if !state::log_dir(&target.state).is_dir() {
        bail!("{state} holds no state: run `rewind run --state {state}` first");
    }
    let which = &target.which;
    let commands = CommandDir::of(&target.state);
    let command = commands
        .submit(&which.key, which.sequence, &which.by(), verb)
        .with_context(|| format!("leaving the command in {state}"))?;
    let left = format!(
        "the `rewind run` that holds {state} carries it out within a second, or the next one \
         does; `rewind inspect --state {state}` shows what came of it"
    );
    let nobody = format!("no run holds {state} (the next one carries it out)");
    wait(&command, which.wait, &left, &nobody, || async {
        Ok(commands.outcome(&command.id)?)
    })
    .await
}

/// Says where `command` was left (`left`), or, with `wait`, waits up to that many seconds
/// for its `outcome` and says what came of it (`nobody`: why it may not have come).
pub async fn wait<F: Future<Output = anyhow::Result<Option<Done>>>>(
    command: &Command,
    wait: Option<u64>,
    left: &str,
    nobody: &str,
    outcome: impl Fn() -> F,
) -> anyhow::Result<ExitCode> {
    let Some(seconds) = wait else {
        eprintln!(
            "left command {} ({}); {left}",
            command.id,
            describe(command)
        );
        return Ok(ExitCode::SUCCESS);
    };
    let deadline = Instant::now() + Duration::from_secs(seconds);
    loop {
        if let Some(done) = outcome().await? {
            return Ok(match done.outcome {
                Outcome::Applied { sequence } => {
                    eprintln!("{}: done (#{sequence})", describe(command));
                    ExitCode::SUCCESS
                }
                Outcome::Refused { error } => {
                    eprintln!("{}: refused: {error}", describe(command));
                    ExitCode::FAILURE
                }
            });
        }
        if Instant::now() >= deadline {
            eprintln!(
                "command {} ({}) not carried out in {seconds} s: {nobody}",
                command.id,
                describe(command),
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
        Verb::Signal { name, .. } => format!(" `{name}`"),
        Verb::Retry | Verb::Skip { .. } | Verb::Cancel { .. } => String::new(),
    };
    format!(
        "{} of key {}{which}{call} by {}",
        command.verb.name(),
        command.key,
        command.by
    )
}
