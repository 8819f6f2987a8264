//! One partition on the host that holds its lease: recovered from its last checkpoint, then
//! run until the host lets it go.

use std::sync::Arc;

use async_nats::jetstream;
use futures_util::StreamExt as _;

use super::commands::ClusterCommands;
use super::error::ClusterError;
use super::events::Events;
use super::lease::Lease;
use super::outputs::StreamSink;
use super::{Layout, inputs};
use crate::agent::{Agent, AgentFile};
use crate::checkpoint::{CheckpointStore, LogCheckpoints, recover_store};
use crate::keys::{Checkpointing, Retention, RunOptions, Summary, run_inputs};
use crate::log::{Authority, JetStreamLog, Log, StreamSpec};
use crate::sandbox::Sandbox;
use crate::store::Incarnation;

impl Layout {
    pub fn state_stream(&self, partition: u32) -> StreamSpec {
        StreamSpec::new(
            format!("{}-state-{partition}", self.prefix),
            format!("{}.state.{partition}", self.prefix),
            self.replicas,
        )
        .group_commit(self.group_commit)
    }

    /// Where the partition's store sets aside the states of inputs at a durable wait.
    pub fn shelf_stream(&self, partition: u32) -> StreamSpec {
        StreamSpec::new(
            format!("{}-shelf-{partition}", self.prefix),
            format!("{}.shelf.{partition}", self.prefix),
            self.replicas,
        )
        .group_commit(self.group_commit)
    }

    pub fn checkpoint_stream(&self, partition: u32) -> StreamSpec {
        StreamSpec::new(
            format!("{}-checkpoints-{partition}", self.prefix),
            format!("{}.checkpoints.{partition}", self.prefix),
            self.replicas,
        )
        .group_commit(self.group_commit)
    }
}

/// What a partition runs with.
#[derive(Clone, Debug)]
pub struct PartitionContext {
    pub context: jetstream::Context,
    pub layout: Layout,
    /// The cluster's, recorded by its first host: every partition's states are in it.
    pub incarnation: Incarnation,
    /// The event ids the cluster has accepted.
    pub events: Events,
    /// Operators' commands on the agent's inputs.
    pub commands: ClusterCommands,
    pub tenant: String,
    pub file: AgentFile,
    pub sandbox: Arc<Sandbox>,
}

/// Opens partition `partition`'s stream `spec` as a log fenced by `lease`.
async fn fenced(
    context: &jetstream::Context,
    spec: StreamSpec,
    lease: &Arc<Lease>,
) -> Result<Arc<dyn Log>, ClusterError> {
    let name = spec.name.clone();
    let authority: Arc<dyn Authority> = Arc::clone(lease) as Arc<dyn Authority>;
    let log = JetStreamLog::open(context.clone(), vec![spec], Some(authority))
        .await
        .map_err(ClusterError::log(|| format!("opening {name}")))?;
    Ok(Arc::new(log))
}

/// Recovers partition `lease.partition` from its newest checkpoint and runs its inputs
/// until `stop` resolves; then finishes the inputs it accepted and takes a last checkpoint.
pub async fn run(
    partition: &PartitionContext,
    lease: Arc<Lease>,
    stop: impl Future<Output = ()> + Send,
) -> Result<Summary, ClusterError> {
    let number = lease.partition;
    let layout = &partition.layout;
    let context = &partition.context;
    let config = &partition.file.config;
    // Fencing first: from here on no earlier holder writes to these streams.
    let state_log = fenced(context, layout.state_stream(number), &lease).await?;
    let shelf_log = fenced(context, layout.shelf_stream(number), &lease).await?;
    let output_log = fenced(context, layout.output_stream(number), &lease).await?;
    let checkpoint_log = fenced(context, layout.checkpoint_stream(number), &lease).await?;
    let checkpoints = Arc::new(LogCheckpoints::new(checkpoint_log, 0));
    let latest = checkpoints
        .latest()
        .await
        .map_err(|source| ClusterError::Checkpoint {
            what: format!("partition {number}: reading its newest checkpoint"),
            source,
        })?;
    let store = (config.state)
        .store(Arc::clone(&state_log), shelf_log, partition.incarnation)
        .map(Arc::new)
        .map_err(|source| ClusterError::Store {
            what: format!("partition {number}: opening its store"),
            source,
        })?;
    recover_store(
        &*store,
        &*state_log,
        latest.as_ref(),
        &partition.tenant,
        &config.name,
    )
    .await
    .map_err(|source| ClusterError::Store {
        what: format!("partition {number}: recovering its states"),
        source,
    })?;
    let agent = Arc::new(
        Agent::builder(partition.file.clone(), Arc::clone(&partition.sandbox))
            .tenant(partition.tenant.clone())
            .store(Arc::clone(&store) as _)
            .build()?,
    );
    let mut sink = StreamSink::open(
        output_log,
        latest.as_ref().and_then(|c| c.output_position).unwrap_or(0),
    )
    .await?;
    let after = latest.as_ref().map_or(0, |c| c.input_position);
    let lines = inputs::subscribe(
        context,
        layout,
        &partition.events,
        &partition.tenant,
        &config.name,
        number,
        after,
    )
    .await?
    .take_until(Box::pin(stop));
    tracing::info!(
        partition = number,
        checkpoint = latest.as_ref().map(|c| c.id),
        after,
        "partition taken: running its inputs"
    );
    let checkpointing = Checkpointing::new(
        checkpoints,
        &config.state,
        vec![
            Arc::clone(&store) as Arc<dyn Retention>,
            Arc::new(inputs::InputRetention::new(
                context,
                layout,
                &partition.tenant,
                &config.name,
                number,
            )),
        ],
    );
    let commands = partition.commands.of_partition(number);
    let options = RunOptions {
        checkpointing: Some(&checkpointing),
        resume: latest.as_ref(),
        commands: Some(&commands),
        until_waits_end: false,
        end_when_held: false,
        deltas: None,
    };
    let summary = run_inputs(agent, Box::pin(lines), &mut sink, &(), options)
        .await
        .map_err(|source| ClusterError::Run {
            what: format!("partition {number}: running its inputs"),
            source,
        })?;
    Ok(summary)
}
