//! `rewind inspect [--state DIR] [--json]`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::bail;
use rewind_host::store::{ActionState, CallOutcome};

use rewind_host::agent::StateConfig;
use rewind_host::checkpoint::{Checkpoint, CheckpointStore, PendingInput};
use rewind_host::commands::{CommandDir, Outcome};
use rewind_host::log::{FileLog, Recovery};
use rewind_host::store::ActionStateStore;

use super::state;

#[derive(Debug, clap::Args)]
pub struct InspectArgs {
    /// The state directory a run wrote.
    #[arg(long, default_value = ".rewind")]
    state: PathBuf,
    /// Only this key.
    #[arg(long)]
    key: Option<String>,
    /// Print JSON instead of text: `{"inputs": [...], "skipped": [...], "commands":
    /// {"pending": [...], "done": [...]}, "keys": {"TENANT/AGENT/KEY": [states]}}`.
    #[arg(long)]
    json: bool,
}

/// A key's unfinished inputs at the newest checkpoint, in the words of docs/SEMANTICS.md.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
struct KeyInputs {
    key: String,
    /// The first unfinished input: parked, waiting (at a durable wait) or accepted.
    sequence: u64,
    status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    attempts: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    /// At a durable wait: the action that waits, until when (RFC 3339) and for which
    /// signals.
    #[serde(skip_serializing_if = "Option::is_none")]
    wait: Option<WaitView>,
    /// Sequences of the key's later inputs, accepted and waiting behind it.
    waiting: Vec<u64>,
}

/// A durable wait as `inspect` shows it.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
struct WaitView {
    action: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    until: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    signals: Vec<String>,
    /// What `rewind inspect` prints: "for signal approve or reject until …".
    described: String,
}

/// Per key, its first unfinished input and the ones behind it.
fn key_inputs(checkpoint: Option<&Checkpoint>, only: Option<&str>) -> Vec<KeyInputs> {
    let mut by_key: BTreeMap<&str, Vec<&PendingInput>> = BTreeMap::new();
    for pending in checkpoint.map_or(&[][..], |c| &c.pending) {
        if only.is_none_or(|k| k == pending.key) {
            by_key.entry(&pending.key).or_default().push(pending);
        }
    }
    by_key
        .into_iter()
        .filter_map(|(key, mut inputs)| {
            inputs.sort_by_key(|p| p.sequence);
            let (first, rest) = inputs.split_first()?;
            Some(KeyInputs {
                key: key.to_owned(),
                sequence: first.sequence,
                status: match (&first.parked, &first.waiting) {
                    (Some(_), _) => "parked",
                    (None, Some(_)) => "waiting",
                    (None, None) => "accepted",
                },
                wait: first.waiting.as_ref().map(|waiting| WaitView {
                    action: waiting.action.clone(),
                    until: waiting.wait.until_text(),
                    signals: waiting.wait.signals.clone(),
                    described: waiting.wait.to_string(),
                }),
                attempts: first.parked.as_ref().map(|p| p.attempts),
                error: first.parked.as_ref().map(|p| p.error.clone()),
                waiting: rest.iter().map(|p| p.sequence).collect(),
            })
        })
        .collect()
}

pub async fn inspect(args: InspectArgs) -> anyhow::Result<ExitCode> {
    let Some(partitions) = FileLog::partitions_in(&state::log_dir(&args.state))? else {
        bail!(
            "{} holds no state log; run `rewind run --state {}` first",
            args.state.display(),
            args.state.display()
        );
    };
    // Read only, without the directory's lock: inspecting changes nothing, and works while
    // the run that writes it is still going (it shows the log as it was at open).
    let config = StateConfig {
        partitions,
        ..StateConfig::default()
    };
    let recovered = state::recover(
        &args.state,
        &config,
        Recovery::ReadOnly,
        state::Load::WholeLog,
    )
    .await?;
    let store = &recovered.store;
    let states: Vec<ActionState> = store
        .scopes()
        .iter()
        .flat_map(|s| store.states(s))
        .collect();
    let latest = recovered.latest.as_ref();
    let only = args.key.as_deref();
    let inputs = key_inputs(latest, only);
    let skipped: Vec<_> = latest
        .map_or(&[][..], |c| &c.skipped)
        .iter()
        .filter(|s| only.is_none_or(|k| k == s.key))
        .collect();
    let commands = CommandDir::of(&args.state);
    let pending_commands = commands.pending_now()?;
    let done_commands = commands.done()?;
    if !args.json {
        let ids = recovered.checkpoints.list().await?;
        match &recovered.latest {
            Some(c) => println!(
                "checkpoints: {ids:?}; newest {}: input after line {}, {} pending inputs, marker {:?}",
                c.id,
                c.input_position,
                c.pending.len(),
                c.marker.offsets
            ),
            None => println!("checkpoints: none yet"),
        }
        let mut bounds = Vec::new();
        for partition in 0..recovered.log.partitions() {
            bounds.push(recovered.log.bounds(partition).await?);
        }
        println!("log partitions [start, end): {bounds:?}");
        print_inputs(&inputs);
        for skip in &skipped {
            println!(
                "{}: {} #{} by {}: {}",
                skip.ended.name(),
                skip.key,
                skip.sequence,
                skip.by,
                shorten(&skip.reason)
            );
        }
        for command in &pending_commands {
            println!(
                "command {} pending: {}",
                command.id,
                super::operator::describe(command)
            );
        }
        for done in &done_commands {
            let outcome = match &done.outcome {
                Outcome::Applied { sequence } => format!("done (#{sequence})"),
                Outcome::Refused { error } => format!("refused: {error}"),
            };
            let what = done
                .command
                .as_ref()
                .map_or_else(|| "not a command".to_owned(), super::operator::describe);
            println!("command {}: {what}: {outcome}", done.id);
        }
    }
    let mut by_key: BTreeMap<String, Vec<ActionState>> = BTreeMap::new();
    // A key's index of signal ids is the host's bookkeeping, not a run of the key's.
    for state in states.into_iter().filter(|s| !s.key.is_signal_ids()) {
        if args.key.as_ref().is_none_or(|k| *k == state.key.scope.key) {
            by_key
                .entry(state.key.scope.to_string())
                .or_default()
                .push(state);
        }
    }
    for states in by_key.values_mut() {
        // In the order they were first written within each input: the order they ran.
        states.sort_by_key(|s| (s.key.sequence, s.version));
    }
    if args.json {
        let shown = serde_json::json!({
            "inputs": inputs,
            "skipped": skipped,
            "commands": { "pending": pending_commands, "done": done_commands },
            "keys": by_key,
        });
        println!("{}", serde_json::to_string_pretty(&shown)?);
        return Ok(ExitCode::SUCCESS);
    }
    for (scope, states) in &by_key {
        println!("{scope}");
        for state in states {
            let status = if state.key.is_signals() {
                "signals delivered to the input"
            } else if state.is_completed() {
                "completed"
            } else {
                "pending"
            };
            println!(
                "  #{} {} [{status}] trigger {} ({}), version {}",
                state.key.sequence,
                state.key.action,
                state.trigger.kind,
                state.key.trigger.short(),
                state.version
            );
            println!("    event: {}", shorten(&state.trigger.payload));
            for (index, call) in state.calls.iter().enumerate() {
                let detail = match &call.outcome {
                    CallOutcome::Pending => String::new(),
                    CallOutcome::Succeeded(v) | CallOutcome::Failed(v) => shorten(v),
                    CallOutcome::Waiting(wait) => format!("waits {wait}"),
                };
                println!(
                    "    call {index}: {} {} key {} -> {detail}",
                    call.function,
                    call.outcome.status(),
                    call.idempotency_key
                );
            }
            let ambient = &state.ambient;
            if !ambient.is_empty() {
                println!(
                    "    read: {} wall-clock and {} monotonic-clock readings{}",
                    ambient.wall.len(),
                    ambient.monotonic.len(),
                    if ambient.random_key.is_some() {
                        ", randomness (its key recorded)"
                    } else {
                        ""
                    }
                );
            }
            if let Some(completion) = &state.completion {
                for event in &completion.sent {
                    println!("    sent {}: {}", event.kind, shorten(&event.payload));
                }
                for write in &completion.memory {
                    println!("    memory {} = {}", write.name, shorten(&write.value));
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The unfinished inputs at the newest checkpoint, a line per key.
fn print_inputs(inputs: &[KeyInputs]) {
    for input in inputs {
        let behind = match (input.waiting.first(), input.waiting.last()) {
            (Some(first), Some(last)) if first == last => format!("; #{first} waits behind it"),
            (Some(first), Some(last)) => format!(
                "; {} inputs (#{first} to #{last}) wait behind it",
                input.waiting.len()
            ),
            _ => String::new(),
        };
        match (&input.error, input.attempts) {
            _ if input.wait.is_some() => {
                let wait = input.wait.as_ref().map_or("", |w| w.described.as_str());
                let action = input.wait.as_ref().map_or("", |w| w.action.as_str());
                println!(
                    "input {} #{}: at a durable wait: action `{action}` waits {wait}{behind}",
                    input.key, input.sequence
                );
            }
            (Some(error), Some(attempts)) => println!(
                "input {} #{}: parked after {attempts} attempts: {}{behind}",
                input.key,
                input.sequence,
                shorten(error)
            ),
            _ => println!("input {} #{}: accepted{behind}", input.key, input.sequence),
        }
    }
}

fn shorten(text: &str) -> String {
    const MAX: usize = 120;
    if text.chars().count() <= MAX {
        return text.to_owned();
    }
    let head: String = text.chars().take(MAX).collect();
    format!("{head}…")
}
