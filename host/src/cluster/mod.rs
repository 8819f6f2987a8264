//! Several hosts sharing one agent's partitions over NATS JetStream (`rewind cluster`).
//!
//! Per partition P, under a deployment's prefix:
//! - `PREFIX-in-P`: the inputs (subjects `PREFIX.in.TENANT.AGENT.P`, [`inputs`]);
//! - `PREFIX-state-P`: the action-state log of the partition's `LogStore`;
//! - `PREFIX-shelf-P`: its shelf, where the states of inputs at a durable wait are set aside;
//! - `PREFIX-out-P`: the outputs ([`outputs`]);
//! - `PREFIX-checkpoints-P`: the checkpoints (`checkpoint::LogCheckpoints`);
//! - the key `partition-P` of the bucket `PREFIX-leases`: who holds it ([`lease`]).
//!
//! A host runs the partitions whose leases it holds, each from its newest checkpoint, and
//! takes its share of the others: ⌈partitions / live hosts⌉, live hosts being those whose
//! heartbeat key moved within a lease TTL. A host above its share lets partitions go (each
//! finishes what it accepted, checkpoints, and releases its lease); a host below it takes
//! free and expired ones. The state, output and checkpoint streams of a partition are
//! fenced by its lease: a host that lost it cannot write to them any more.

pub mod commands;
mod error;
pub mod events;
pub mod inputs;
pub mod lease;
pub mod outputs;
mod partition;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::agent::AgentFile;
use crate::keys::Summary;
use crate::log::jetstream::{RETRY_FOR, backoff};
use crate::sandbox::Sandbox;
use crate::store::Incarnation;
use crate::version::{self, Versioned};
use commands::ClusterCommands;
pub use error::ClusterError;
use error::ensure;
use events::Events;
use lease::{Created, Lease, Leases, Renewal, create_or_read};
pub use partition::PartitionContext;

/// Where a deployment's streams are and how they are laid out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// The first token of every stream, subject and bucket name.
    pub prefix: String,
    pub partitions: u32,
    /// Replicas of every stream and bucket: 3 in production (JetStream 2.9 acknowledges
    /// before fsync; durability comes from replication).
    pub replicas: usize,
    /// Whether the state, output and checkpoint streams put appends that wait for a
    /// publish in one message (see `StreamSpec::group_commit`). A layout recorded before
    /// this existed is without.
    #[serde(default)]
    pub group_commit: bool,
}

impl Layout {
    /// "4 partitions of 1 replica, with group commit": what hosts must agree on.
    fn describe(&self) -> String {
        format!(
            "{} partitions of {} {}, {} group commit",
            self.partitions,
            self.replicas,
            if self.replicas == 1 {
                "replica"
            } else {
                "replicas"
            },
            if self.group_commit { "with" } else { "without" }
        )
    }

    /// The `rewind cluster run` options that give this layout.
    fn flags(&self) -> String {
        format!(
            "--partitions {} --replicas {}{}",
            self.partitions,
            self.replicas,
            if self.group_commit {
                " --group-commit"
            } else {
                ""
            }
        )
    }

    pub fn lease_bucket(&self) -> String {
        format!("{}-leases", self.prefix)
    }

    /// The layout of the cluster `prefix`, as its first host recorded it.
    pub async fn load(context: &jetstream::Context, prefix: &str) -> Result<Self, ClusterError> {
        let bucket = format!("{prefix}-leases");
        let missing = || {
            ClusterError::Refused(format!(
                "there is no cluster `{prefix}` on this NATS: start a host first (rewind \
                 cluster run)"
            ))
        };
        match context.get_stream(format!("KV_{bucket}")).await {
            Ok(_) => {}
            Err(e)
                if matches!(e.kind(), GetStreamErrorKind::JetStream(e)
                    if e.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
            {
                return Err(missing());
            }
            Err(e) => {
                return Err(ClusterError::nats(|| {
                    format!("reading the lease bucket {bucket}")
                })(e));
            }
        }
        let leases = context
            .get_key_value(&bucket)
            .await
            .map_err(ClusterError::nats(|| {
                format!("opening the lease bucket {bucket}")
            }))?;
        let layout = leases
            .get("layout")
            .await
            .map_err(ClusterError::nats(|| {
                format!("{bucket}: reading the layout")
            }))?
            .ok_or_else(missing)?;
        Ok(version::decode(
            &layout,
            RECORD_FORMAT,
            &format!("{bucket}: the recorded layout"),
        )?)
    }

    /// Fails, naming the agents it does run, unless a host of this cluster was started
    /// with `tenant`'s `agent`: inputs published for an agent no host runs would wait for
    /// ever.
    pub async fn check_runs(
        &self,
        context: &jetstream::Context,
        tenant: &str,
        agent: &str,
    ) -> Result<(), ClusterError> {
        use futures_util::TryStreamExt as _;
        let bucket = self.lease_bucket();
        let reading = || format!("{bucket}: reading the agents it runs");
        let leases = context
            .get_key_value(&bucket)
            .await
            .map_err(ClusterError::nats(|| {
                format!("opening the lease bucket {bucket}")
            }))?;
        if leases
            .get(lease::agent_key(tenant, agent))
            .await
            .map_err(ClusterError::nats(reading))?
            .is_some()
        {
            return Ok(());
        }
        // The keys from the stream's subjects, not from a consumer (see `Leases::live_hosts`).
        let prefix = format!("$KV.{bucket}.agent.");
        let mut runs: Vec<String> = context
            .get_stream_no_info(format!("KV_{bucket}"))
            .await
            .map_err(ClusterError::nats(reading))?
            .info_with_subjects(format!("{prefix}*.*"))
            .await
            .map_err(ClusterError::nats(reading))?
            .try_collect::<Vec<(String, usize)>>()
            .await
            .map_err(ClusterError::nats(reading))?
            .into_iter()
            .filter_map(|(subject, _)| {
                subject
                    .strip_prefix(&prefix)
                    .map(|agent| agent.replacen('.', "/", 1))
            })
            .collect();
        runs.sort();
        Err(ClusterError::Refused(format!(
            "the cluster `{}` runs no agent `{agent}` for tenant `{tenant}` (it runs: {}): \
             start a host with that agent's agent.toml first",
            self.prefix,
            if runs.is_empty() {
                "none yet".to_owned()
            } else {
                runs.join(", ")
            }
        )))
    }

    /// What a host does as it starts, before it takes any partition: opens the lease bucket
    /// (as `host`, with leases of `ttl`), records this layout or checks it against the one
    /// recorded, and makes the input streams. Any number of hosts may do this at once.
    ///
    /// Returns the leases and the cluster's incarnation, made by its first host.
    pub async fn join(
        &self,
        context: &jetstream::Context,
        host: &str,
        ttl: Duration,
    ) -> Result<(Leases, Incarnation), ClusterError> {
        let mut leases =
            Leases::open(context, &self.lease_bucket(), self.replicas, host, ttl).await?;
        let incarnation = self.agree(leases.store()).await?;
        leases.claim_name(&self.prefix).await?;
        self.create_input_streams(context).await?;
        Ok((leases, incarnation))
    }

    /// Records the layout in the lease bucket when it is the first, with a new incarnation
    /// for the cluster, or checks that it is the one recorded: hosts that disagree on the
    /// partitions would split keys apart. Returns the cluster's incarnation.
    async fn agree(&self, leases: &kv::Store) -> Result<Incarnation, ClusterError> {
        let record = |layout: &Layout| -> Result<(Bytes, Incarnation), ClusterError> {
            let incarnation = Incarnation::random();
            let recorded = Recorded {
                layout: layout.clone(),
                incarnation: Some(incarnation),
            };
            let versioned = Versioned {
                format: RECORD_FORMAT,
                value: &recorded,
            };
            let bytes =
                serde_json::to_vec(&versioned).map_err(ClusterError::record(|| "the layout"))?;
            Ok((Bytes::from(bytes), incarnation))
        };
        let (mine, incarnation) = record(self)?;
        let what = format!("recording the layout of cluster `{}`", self.prefix);
        let started = Instant::now();
        let mut attempt = 0;
        loop {
            // The entry there may be this host's own, made by a create whose answer was
            // lost: it is read back like another host's.
            let entry = match create_or_read(leases, "layout", &mine, &what).await? {
                Created::Made(_) => return Ok(incarnation),
                Created::Found(entry) => entry,
            };
            let recorded: Recorded =
                version::decode(&entry.value, RECORD_FORMAT, "the recorded layout")?;
            ensure(&recorded.layout == self, || {
                format!(
                    "the cluster `{}` has {}; this host was started with {}: start it with \
                     the cluster's layout ({}), or give it another --prefix for a new cluster",
                    self.prefix,
                    recorded.layout.describe(),
                    self.describe(),
                    recorded.layout.flags(),
                )
            })?;
            if let Some(incarnation) = recorded.incarnation {
                return Ok(incarnation);
            }
            // Recorded before clusters had an incarnation: it gets one, by the one host
            // whose compare-and-set lands; the others, and this one when its answer was
            // lost, read it at the next look.
            let (with, incarnation) = record(self)?;
            if leases.update("layout", with, entry.revision).await.is_ok() {
                return Ok(incarnation);
            }
            if started.elapsed() >= RETRY_FOR {
                return Err(ClusterError::Nats {
                    what: format!("{what} (retried for {RETRY_FOR:?})"),
                    source: "the layout kept changing".into(),
                });
            }
            attempt += 1;
            tokio::time::sleep(backoff(attempt)).await;
        }
    }
}

/// What the cluster's first host records in the lease bucket under `layout`.
#[derive(Debug, Serialize, Deserialize)]
struct Recorded {
    #[serde(flatten)]
    layout: Layout,
    /// The cluster's incarnation (`store::Incarnation`): every partition's states are in it.
    /// A layout recorded by an earlier build has none until a host records one.
    #[serde(default)]
    incarnation: Option<Incarnation>,
}

/// The format of the records a cluster keeps in its buckets (the layout, event ids) that
/// this build writes, and the newest it reads (see [`crate::version`]).
pub const RECORD_FORMAT: u32 = 1;

/// How one host joins.
#[derive(Clone, Debug)]
pub struct HostOptions {
    /// Where NATS is, and how to authenticate to it.
    pub nats: crate::log::NatsConnect,
    pub layout: Layout,
    /// This host's name, unique among the hosts.
    pub host: String,
    pub tenant: String,
    /// A lease whose revision has not moved for this long has expired.
    pub lease_ttl: Duration,
}

/// A partition this host runs.
#[derive(Debug)]
struct Running {
    lease: Arc<Lease>,
    stop: watch::Sender<bool>,
    task: JoinHandle<Result<Summary, ClusterError>>,
    /// Lost to another host: not to be released.
    lost: bool,
    /// Since when it has been asked to stop (let go, lost, or the host leaving): it finishes
    /// what it accepted and checkpoints meanwhile, its lease still renewed.
    stopping: Option<Instant>,
}

impl Running {
    /// Asks the run to finish what it accepted, checkpoint, and end.
    fn ask_to_stop(&mut self) {
        if self.stopping.is_none() {
            self.stopping = Some(Instant::now());
            let _ = self.stop.send(true);
        }
    }
}

/// Runs this host's share of the agent's partitions until `shutdown` resolves; then lets
/// each finish what it accepted, checkpoint, and go.
pub async fn run_host(
    options: HostOptions,
    file: AgentFile,
    sandbox: Arc<Sandbox>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ClusterError> {
    let layout = options.layout.clone();
    inputs::check_token("agent", &file.config.name)?;
    inputs::check_token("tenant", &options.tenant)?;
    inputs::check_token("prefix", &layout.prefix)?;
    inputs::check_token("host", &options.host)?;
    // An agent that cannot be built fails here, once, not in every partition it takes.
    crate::agent::Agent::builder(file.clone(), Arc::clone(&sandbox))
        .tenant(options.tenant.clone())
        .build()?;
    let client = options
        .nats
        .connect()
        .await
        .map_err(ClusterError::log(|| "connecting to NATS"))?;
    let mut context = jetstream::new(client);
    // Requests to a stream whose server just died wait this long for nothing; every
    // request here is retried, so a short wait moves on sooner.
    context.set_timeout(REQUEST_TIMEOUT);
    let (mut leases, incarnation) = layout
        .join(&context, &options.host, options.lease_ttl)
        .await?;
    leases.runs(&options.tenant, &file.config.name).await?;
    let events = Events::open(&context, &layout).await?;
    let commands =
        ClusterCommands::open(&context, &layout, &options.tenant, &file.config.name).await?;
    let partition = PartitionContext {
        context,
        layout: layout.clone(),
        incarnation,
        events,
        commands,
        tenant: options.tenant.clone(),
        file,
        sandbox,
    };
    let mut hosted = Hosted::default();
    let tick = options.lease_ttl / 3;
    tracing::info!(host = %options.host, partitions = layout.partitions, "joined");
    tokio::pin!(shutdown);
    let mut name_taken = None;
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            () = tokio::time::sleep(tick) => {}
        }
        if let Err(taken) = leases.heartbeat().await {
            tracing::error!("{taken}");
            name_taken = Some(taken);
            break;
        }
        step(&mut leases, &partition, &mut hosted).await;
    }
    tracing::info!(host = %options.host, "leaving: letting every partition finish");
    for run in hosted.running.values_mut() {
        run.ask_to_stop();
    }
    // The leases are renewed (every tick, as before) while the partitions finish; those
    // that end are reaped sooner.
    let mut renewed = Instant::now();
    while !hosted.running.is_empty() {
        if renewed.elapsed() >= tick {
            renew(&mut leases, &mut hosted).await;
            renewed = Instant::now();
        }
        reap(&mut hosted).await;
        if !hosted.running.is_empty() {
            tokio::time::sleep(tick.min(Duration::from_millis(200))).await;
        }
    }
    match name_taken {
        // The heartbeat key is the other host's now: it stays.
        Some(taken) => Err(taken),
        None => {
            leases.leave().await;
            Ok(())
        }
    }
}

/// What a host runs, and the partitions whose run failed, not to be taken again before a
/// backoff.
#[derive(Debug, Default)]
struct Hosted {
    running: BTreeMap<u32, Running>,
    /// Per partition: not before, and the next backoff.
    failed: BTreeMap<u32, (Instant, Duration)>,
    /// Live hosts as last counted.
    live: u32,
}

/// How long a request to NATS may take before it is retried.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);

/// The first wait before a partition whose run failed is taken again; it doubles up to
/// [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// How long a partition asked to stop may take to finish what it accepted and checkpoint.
/// Past it, the run is ended where it is, as a crash would end it: the next holder recovers
/// the partition from its newest checkpoint and reruns what was pending.
const FINISH_WITHIN: Duration = Duration::from_secs(60);

/// One round: renew what this host holds, reap what ended, and take or give partitions
/// toward this host's share.
async fn step(leases: &mut Leases, partition: &PartitionContext, hosted: &mut Hosted) {
    renew(leases, hosted).await;
    reap(hosted).await;
    let Hosted {
        running,
        failed,
        live,
    } = hosted;
    let partitions = partition.layout.partitions;
    match leases.live_hosts().await {
        Ok(counted) => *live = counted.max(1),
        Err(e) => tracing::debug!("counting live hosts (as {live} until it works): {e}"),
    }
    let share = partitions.div_ceil((*live).max(1)) as usize;
    let kept = running
        .values()
        .filter(|run| run.stopping.is_none())
        .count();
    if kept > share {
        // The highest-numbered partitions go first, so hosts agree on which move.
        for (number, run) in running
            .iter_mut()
            .rev()
            .filter(|(_, run)| run.stopping.is_none())
            .take(kept - share)
        {
            tracing::info!(
                partition = number,
                share,
                "above this host's share: letting it go"
            );
            run.ask_to_stop();
        }
    }
    // Partitions still finishing count: they are this host's until they end.
    for number in 0..partitions {
        if running.len() >= share {
            break;
        }
        if running.contains_key(&number)
            || failed
                .get(&number)
                .is_some_and(|&(until, _)| Instant::now() < until)
        {
            continue;
        }
        let lease = match leases.try_acquire(number).await {
            Ok(Some(lease)) => lease,
            Ok(None) => continue,
            Err(e) => {
                tracing::debug!(partition = number, "taking the lease: {e}");
                continue;
            }
        };
        let lease = Arc::new(lease);
        let (stop_tx, mut stop_rx) = watch::channel(false);
        let context = partition.clone();
        let task_lease = Arc::clone(&lease);
        let task = tokio::spawn(async move {
            let stop = async move {
                let _ = stop_rx.wait_for(|stop| *stop).await;
            };
            partition::run(&context, task_lease, stop).await
        });
        running.insert(
            number,
            Running {
                lease,
                stop: stop_tx,
                task,
                lost: false,
                stopping: None,
            },
        );
    }
}

/// Renews every lease this host holds, also of partitions that are finishing; a partition
/// whose lease is lost (or could not be renewed for a TTL) is asked to stop.
async fn renew(leases: &mut Leases, hosted: &mut Hosted) {
    for (number, run) in hosted.running.iter_mut() {
        if run.lost {
            continue;
        }
        let lost = match run.lease.renew().await {
            Renewal::Renewed => false,
            Renewal::Lost => true,
            Renewal::Unknown => run.lease.since_renewed() >= leases.ttl(),
        };
        if lost {
            tracing::warn!(partition = number, "lease lost: stopping the partition");
            run.lost = true;
            run.ask_to_stop();
        }
    }
}

/// Ends the runs that have ended, or were asked to stop longer than [`FINISH_WITHIN`] ago,
/// and releases their leases; a run that failed is not taken again before a backoff.
async fn reap(hosted: &mut Hosted) {
    let Hosted {
        running, failed, ..
    } = hosted;
    let ended: Vec<u32> = running
        .iter()
        .filter(|(_, run)| {
            run.task.is_finished()
                || run
                    .stopping
                    .is_some_and(|since| since.elapsed() >= FINISH_WITHIN)
        })
        .map(|(&number, _)| number)
        .collect();
    for number in ended {
        let Some(run) = running.remove(&number) else {
            continue;
        };
        if stop(run).await {
            failed.remove(&number);
        } else {
            let backoff = failed.get(&number).map_or(FIRST_BACKOFF, |&(_, b)| b);
            let next = (backoff * 2).min(MAX_BACKOFF);
            failed.insert(number, (Instant::now() + backoff, next));
        }
    }
}

/// Collects a partition's run, which has ended or is ended now (it did not finish within
/// [`FINISH_WITHIN`]), and releases its lease unless it was lost. Returns whether the run
/// ended well.
async fn stop(run: Running) -> bool {
    let number = run.lease.partition;
    if !run.task.is_finished() {
        tracing::warn!(
            partition = number,
            "did not finish within {FINISH_WITHIN:?} of being asked to stop: ending it here; \
             the next holder recovers it from its newest checkpoint"
        );
        run.task.abort();
    }
    let ok = match run.task.await {
        Ok(Ok(summary)) => {
            tracing::info!(
                partition = number,
                completed = summary.completed,
                parked = summary.parked.len(),
                stopped = summary.stopped.len(),
                waiting = summary.waiting_inputs(),
                "partition stopped"
            );
            true
        }
        Ok(Err(e)) => {
            tracing::error!(partition = number, "partition stopped: {e:#}");
            false
        }
        Err(e) if e.is_cancelled() => false,
        Err(e) => {
            tracing::error!(partition = number, "partition panicked: {e}");
            false
        }
    };
    if !run.lost {
        run.lease.release().await;
    }
    ok
}
