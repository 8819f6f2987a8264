//! `rewind inspect [--state DIR] [--json]`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::bail;
use rewind_host::store::{ActionState, CallOutcome};

use rewind_host::agent::StateConfig;
use rewind_host::checkpoint::CheckpointStore;
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
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
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
    }
    let mut by_key: BTreeMap<String, Vec<ActionState>> = BTreeMap::new();
    for state in states {
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
        println!("{}", serde_json::to_string_pretty(&by_key)?);
        return Ok(ExitCode::SUCCESS);
    }
    for (scope, states) in &by_key {
        println!("{scope}");
        for state in states {
            let status = if state.is_completed() {
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

fn shorten(text: &str) -> String {
    const MAX: usize = 120;
    if text.chars().count() <= MAX {
        return text.to_owned();
    }
    let head: String = text.chars().take(MAX).collect();
    format!("{head}…")
}
