//! Operator commands on a cluster's state (retry, skip, resolve, cancel), whichever host
//! holds the input's partition, or none.
//!
//! In the stream `PREFIX-commands`:
//! - `PREFIX.commands.pending.TENANT.AGENT.P.ID`: a command for a key of partition P, until
//!   the host that holds P (or the next one to take it) carries it out;
//! - `PREFIX.commands.done.TENANT.AGENT.ID`: what came of it, written before the pending
//!   message is deleted.
//!
//! A partition's run looks for its commands as `rewind run` does in a state directory
//! ([`CommandQueue`]): every 250 ms, and once when it takes the partition, before it retries
//! what is still parked. A command's effect is in a checkpoint before it is done, so a host
//! that dies between the two leaves it pending, and the next holder finds it done.

use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::{self, stream};
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt as _;

use super::Layout;
use super::error::ClusterError;
use crate::commands::{Command, CommandQueue, CommandsError, Done, Outcome, Verb};
use crate::log::jetstream::ensure_stream;
use crate::store::KeyScope;

impl Layout {
    pub fn commands_stream(&self) -> String {
        format!("{}-commands", self.prefix)
    }

    fn pending_subject(&self, tenant: &str, agent: &str, partition: u32) -> String {
        format!(
            "{}.commands.pending.{tenant}.{agent}.{partition}",
            self.prefix
        )
    }

    fn done_subject(&self, tenant: &str, agent: &str, id: &str) -> String {
        format!("{}.commands.done.{tenant}.{agent}.{id}", self.prefix)
    }
}

/// The commands of `tenant`'s `agent` on a cluster.
#[derive(Clone, Debug)]
pub struct ClusterCommands {
    context: jetstream::Context,
    stream: stream::Stream,
    layout: Layout,
    tenant: String,
    agent: String,
}

impl ClusterCommands {
    /// Opens the cluster's command stream (creating it when new) for `tenant`'s `agent`.
    pub async fn open(
        context: &jetstream::Context,
        layout: &Layout,
        tenant: &str,
        agent: &str,
    ) -> Result<Self, ClusterError> {
        let config = stream::Config {
            name: layout.commands_stream(),
            subjects: vec![format!("{}.commands.>", layout.prefix)],
            num_replicas: layout.replicas,
            ..stream::Config::default()
        };
        let stream = ensure_stream(context, &config)
            .await
            .map_err(ClusterError::log(|| format!("making {}", config.name)))?;
        Ok(Self {
            context: context.clone(),
            stream,
            layout: layout.clone(),
            tenant: tenant.to_owned(),
            agent: agent.to_owned(),
        })
    }

    /// Leaves a command for `key` (its input `sequence`, or whichever the verb takes),
    /// asked by `by`, for the host that holds the key's partition. Returns it, with its id.
    pub async fn submit(
        &self,
        key: &str,
        sequence: Option<u64>,
        by: &str,
        verb: Verb,
    ) -> Result<Command, ClusterError> {
        let command = Command::new(key, sequence, by, verb).map_err(refused)?;
        let bytes = command.encode().map_err(refused)?;
        let partition =
            KeyScope::new(&self.tenant, &self.agent, key).partition(self.layout.partitions);
        let subject = format!(
            "{}.{}",
            self.layout
                .pending_subject(&self.tenant, &self.agent, partition),
            command.id
        );
        let what = || format!("leaving command {} on {subject}", command.id);
        self.context
            .publish(subject.clone(), Bytes::from(bytes))
            .await
            .map_err(ClusterError::nats(what))?
            .await
            .map_err(ClusterError::nats(what))?;
        Ok(command)
    }

    /// What came of the command `id`, once it is done.
    pub async fn outcome(&self, id: &str) -> Result<Option<Done>, ClusterError> {
        let subject = self.layout.done_subject(&self.tenant, &self.agent, id);
        let Some(message) = last(&self.stream, &subject)
            .await
            .map_err(ClusterError::nats(|| format!("reading {subject}")))?
        else {
            return Ok(None);
        };
        serde_json::from_slice(&message.payload)
            .map(Some)
            .map_err(ClusterError::record(|| {
                format!("{subject}: a command's outcome")
            }))
    }

    /// The commands of partition `partition`, as its run takes them.
    pub fn of_partition(&self, partition: u32) -> PartitionCommands {
        PartitionCommands {
            commands: self.clone(),
            pending: self
                .layout
                .pending_subject(&self.tenant, &self.agent, partition),
        }
    }
}

fn refused(error: CommandsError) -> ClusterError {
    ClusterError::Refused(error.to_string())
}

/// The commands of one partition: what its run carries out.
#[derive(Debug)]
pub struct PartitionCommands {
    commands: ClusterCommands,
    /// The subject its commands wait under, before their ids.
    pending: String,
}

impl PartitionCommands {
    /// Records `done` under the command's done subject, then deletes its pending message.
    async fn record(&self, done: &Done, sequence: u64) -> Result<(), CommandsError> {
        let commands = &self.commands;
        let subject = commands
            .layout
            .done_subject(&commands.tenant, &commands.agent, &done.id);
        let bytes = serde_json::to_vec(done).map_err(|e| CommandsError::Invalid {
            what: subject.clone(),
            message: e.to_string(),
        })?;
        commands
            .context
            .publish(subject.clone(), Bytes::from(bytes))
            .await
            .map_err(|e| nats(&subject, e))?
            .await
            .map_err(|e| nats(&subject, e))?;
        commands
            .stream
            .delete_message(sequence)
            .await
            .map_err(|e| nats(&self.pending, e))?;
        Ok(())
    }

    /// The pending message of command `id`, if it is still there.
    async fn message(&self, id: &str) -> Result<Option<StreamMessage>, CommandsError> {
        let subject = format!("{}.{id}", self.pending);
        last(&self.commands.stream, &subject)
            .await
            .map_err(|e| nats(&subject, e))
    }
}

#[async_trait]
impl CommandQueue for PartitionCommands {
    async fn pending(&self) -> Result<Vec<Command>, CommandsError> {
        let filter = format!("{}.*", self.pending);
        let mut subjects = self
            .commands
            .stream
            .info_with_subjects(&filter)
            .await
            .map_err(|e| nats(&filter, e))?;
        let mut ids = Vec::new();
        while let Some(subject) = subjects.next().await {
            let (subject, _) = subject.map_err(|e| nats(&filter, e))?;
            if let Some(id) = subject.rsplit('.').next() {
                ids.push(id.to_owned());
            }
        }
        // Ids sort in the order the commands were left.
        ids.sort();
        let mut commands = Vec::new();
        for id in ids {
            let Some(message) = self.message(&id).await? else {
                continue;
            };
            match Command::decode(&message.payload, &id, &message.subject) {
                Ok(command) => commands.push(command),
                Err(error) => {
                    tracing::warn!(subject = %message.subject, "refusing a command: {error}");
                    let refused = Outcome::Refused {
                        error: error.to_string(),
                    };
                    self.record(&Done::new(&id, None, &refused), message.sequence)
                        .await?;
                }
            }
        }
        Ok(commands)
    }

    async fn finish(&self, command: &Command, outcome: &Outcome) -> Result<(), CommandsError> {
        let Some(message) = self.message(&command.id).await? else {
            // Done already (by a holder that died before it said so to its run).
            return Ok(());
        };
        self.record(
            &Done::new(&command.id, Some(command), outcome),
            message.sequence,
        )
        .await
    }
}

/// The last message of `subject` in `stream`, if it has one.
async fn last(
    stream: &stream::Stream,
    subject: &str,
) -> Result<Option<StreamMessage>, stream::LastRawMessageError> {
    match stream.get_last_raw_message_by_subject(subject).await {
        Ok(message) => Ok(Some(message)),
        Err(e) if e.kind() == stream::LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) => Err(e),
    }
}

fn nats(subject: &str, error: impl Into<async_nats::Error>) -> CommandsError {
    CommandsError::Remote {
        what: subject.to_owned(),
        source: error.into(),
    }
}
