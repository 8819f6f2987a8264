//! Leases: which host holds which partition, in a JetStream KV bucket.
//!
//! A partition's lease is the key `partition-P`, whose value names its holder and a token
//! drawn at each acquisition. Every change is a compare-and-set on the key's revision: one
//! host wins a race to take a lease. The holder renews it (a CAS that only moves the
//! revision) every third of the TTL. A lease has expired when its revision has not moved for
//! a whole TTL, as the host looking at it has seen on its own clock: hosts' clocks need not
//! agree. Another host may then take it over by CAS. NATS 2.9 has no per-key TTL; the bucket
//! keeps one revision per key.
//!
//! A lease is also an [`Authority`] for a fenced log: the host holds the partition while the
//! key still carries its token. Timing decides only who gets a partition and when; fencing
//! (`log::jetstream`) makes sure a former holder can no longer write, whatever its clock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::kv::{self, CreateErrorKind, Operation, UpdateErrorKind};
use async_nats::jetstream::stream;
use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::error::ClusterError;
use crate::log::Authority;
use crate::log::jetstream::{RETRY_FOR, backoff, ensure_stream, retrying};

/// What a lease key holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Holding {
    holder: String,
    token: String,
}

/// A host's view of the lease bucket.
#[derive(Debug)]
pub struct Leases {
    kv: kv::Store,
    context: async_nats::jetstream::Context,
    bucket: String,
    host: String,
    ttl: Duration,
    /// Per key: the revision last seen and since when, on this host's clock.
    seen: HashMap<String, (u64, Instant)>,
    /// Drawn at open: what this process writes to its heartbeat key, so that another
    /// process under the same name is told apart.
    instance: Bytes,
    /// The revision of this host's last write of its heartbeat key.
    beat: u64,
}

/// A lease this host holds.
#[derive(Debug)]
pub struct Lease {
    kv: kv::Store,
    pub partition: u32,
    key: String,
    holding: Holding,
    /// The revision of this host's last write of the key.
    revision: AtomicU64,
    /// When the last renewal succeeded.
    renewed: std::sync::Mutex<Instant>,
}

/// What renewing a lease found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Renewal {
    Renewed,
    /// Another host holds it now.
    Lost,
    /// NATS did not answer; the lease is still this host's as far as it knows.
    Unknown,
}

fn key(partition: u32) -> String {
    format!("partition-{partition}")
}

/// The key that says a cluster runs `tenant`'s `agent`.
pub fn agent_key(tenant: &str, agent: &str) -> String {
    format!("agent.{tenant}.{agent}")
}

/// Opens the KV bucket `bucket` of `replicas` replicas (`what` names it in errors), making
/// it when there is none, with any number of hosts doing the same at once.
pub(super) async fn open_bucket(
    context: &async_nats::jetstream::Context,
    bucket: &str,
    replicas: usize,
    what: &str,
) -> Result<kv::Store, ClusterError> {
    // The bucket's stream, as async-nats would make it; its own `create_key_value` first
    // asks for account details that nats-server 2.9 answers in a shape it does not read.
    let config = stream::Config {
        name: format!("KV_{bucket}"),
        subjects: vec![format!("$KV.{bucket}.>")],
        max_messages_per_subject: 1,
        allow_rollup: true,
        deny_delete: true,
        // Reads go to the bucket's leader: a direct get may be answered by a replica that
        // has not yet applied a takeover, and a former holder asking whether it still holds
        // its partition (after reading a stream the new holder has already fenced) would
        // hear yes.
        allow_direct: false,
        discard: stream::DiscardPolicy::New,
        num_replicas: replicas,
        ..stream::Config::default()
    };
    ensure_stream(context, &config)
        .await
        .map_err(ClusterError::log(|| format!("making the {what} {bucket}")))?;
    retrying(&format!("opening the {what} {bucket}"), || {
        context.get_key_value(bucket)
    })
    .await
    .map_err(ClusterError::log(|| format!("opening the {what} {bucket}")))
}

/// What [`create_or_read`] found.
pub(super) enum Created {
    /// This caller's create made the key, at this revision.
    Made(u64),
    /// The key was there: its entry, which may be this caller's own (a create of it landed
    /// and its answer was lost).
    Found(kv::Entry),
}

/// Creates `key` holding `value` (compare-and-set: of any number of callers at once, one
/// makes it), or reads back the entry that is there. A request NATS does not answer is
/// retried with backoff for up to [`RETRY_FOR`] (`what` names the key in the error past
/// it); a key deleted between the create and the read is created again.
pub(super) async fn create_or_read(
    kv: &kv::Store,
    key: &str,
    value: &Bytes,
    what: &str,
) -> Result<Created, ClusterError> {
    let started = Instant::now();
    let mut attempt = 0;
    loop {
        let failed = match kv.create(key, value.clone()).await {
            Ok(revision) => return Ok(Created::Made(revision)),
            Err(e) if e.kind() == CreateErrorKind::AlreadyExists => match kv.entry(key).await {
                Ok(Some(entry)) if entry.operation == Operation::Put => {
                    return Ok(Created::Found(entry));
                }
                Ok(_) => "deleted between its create and its read".to_owned(),
                Err(e) => e.to_string(),
            },
            Err(e) => e.to_string(),
        };
        if started.elapsed() >= RETRY_FOR {
            return Err(ClusterError::Nats {
                what: format!("{what} (retried for {RETRY_FOR:?})"),
                source: failed.into(),
            });
        }
        attempt += 1;
        tracing::debug!(attempt, "{what}: {failed}; retrying");
        tokio::time::sleep(backoff(attempt)).await;
    }
}

impl Leases {
    /// Opens (creating it when new) the bucket `bucket` with `replicas` replicas, as `host`.
    ///
    /// A bucket another host has just made may refuse writes for a moment (nats-server 2.9
    /// answers "no responders" until the new stream listens on its subjects): a host opens
    /// it through `Layout::join`, whose first write is retried.
    pub async fn open(
        context: &async_nats::jetstream::Context,
        bucket: &str,
        replicas: usize,
        host: &str,
        ttl: Duration,
    ) -> Result<Self, ClusterError> {
        let kv = open_bucket(context, bucket, replicas, "lease bucket").await?;
        Ok(Self {
            kv,
            context: context.clone(),
            bucket: bucket.to_owned(),
            host: host.to_owned(),
            ttl,
            seen: HashMap::new(),
            instance: Bytes::from(format!("{:032x}", rand::random::<u128>())),
            beat: 0,
        })
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    pub fn store(&self) -> &kv::Store {
        &self.kv
    }

    fn host_key(&self) -> String {
        format!("host.{}", self.host)
    }

    /// Says this host is alive: moves its `host.NAME` key's revision (compare-and-set on
    /// the revision of its last beat). An error when another process goes by this host's
    /// name now: this host's beats stopped for longer than a TTL (a pause, a partition from
    /// NATS), it was taken for dead, and a host started under its name took the name over.
    /// Two hosts must not go by one name, so this one is to stop. NATS not answering is no
    /// error: the next beat tries again.
    pub async fn heartbeat(&mut self) -> Result<(), ClusterError> {
        let key = self.host_key();
        let failed = match self.kv.update(&key, self.instance.clone(), self.beat).await {
            Ok(revision) => {
                self.beat = revision;
                return Ok(());
            }
            Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => {
                match self.own_revision(&key).await {
                    // Its own beat, whose answer was lost.
                    Ok(Some(revision)) => {
                        self.beat = revision;
                        return Ok(());
                    }
                    Ok(None) => {
                        return Err(ClusterError::Refused(format!(
                            "another process goes by this host's name `{}` now: this host's \
                             heartbeat stopped for longer than the lease TTL ({:?}), and a \
                             host started under its name took the name over; this host stops",
                            self.host, self.ttl
                        )));
                    }
                    Err(e) => e.to_string(),
                }
            }
            Err(e) => e.to_string(),
        };
        tracing::debug!("heartbeat: {failed}");
        Ok(())
    }

    /// How many hosts are alive: this one, and those whose heartbeat moved within a TTL
    /// as this host has seen.
    pub async fn live_hosts(&mut self) -> Result<u32, ClusterError> {
        use futures_util::TryStreamExt as _;
        let bucket = self.bucket.clone();
        let counting = || format!("{bucket}: counting live hosts");
        // The keys from the stream's subjects, not from a consumer: nats-server 2.9 may
        // place a consumer on a server that has died.
        let stream = self
            .context
            .get_stream_no_info(format!("KV_{}", self.bucket))
            .await
            .map_err(ClusterError::nats(counting))?;
        let prefix = format!("$KV.{}.", self.bucket);
        let subjects: Vec<(String, usize)> = stream
            .info_with_subjects(format!("{prefix}host.*"))
            .await
            .map_err(ClusterError::nats(counting))?
            .try_collect()
            .await
            .map_err(ClusterError::nats(counting))?;
        let mine = self.host_key();
        let mut live = 1;
        for (subject, _) in subjects {
            let Some(key) = subject.strip_prefix(&prefix) else {
                continue;
            };
            if key == mine {
                continue;
            }
            let Some(entry) = self
                .kv
                .entry(key)
                .await
                .map_err(ClusterError::nats(counting))?
            else {
                continue;
            };
            if entry.operation == Operation::Put && !self.expired(key, entry.revision) {
                live += 1;
            }
        }
        Ok(live)
    }

    /// Takes this host's name in the cluster `cluster`, refusing it while a live host goes
    /// by it. A name nobody has is taken at once (its heartbeat key made, compare-and-set:
    /// of hosts starting together under one name, one gets it). A name whose heartbeat key
    /// is there is watched for a TTL: it is refused at the key's first move, and taken over
    /// (compare-and-set) when it does not move: its host died.
    pub async fn claim_name(&mut self, cluster: &str) -> Result<(), ClusterError> {
        let key = self.host_key();
        let alive = || {
            ClusterError::Refused(format!(
                "a host named `{}` is alive in cluster `{cluster}` (its heartbeat moved within \
                 the last {:?}): give this host another --host name",
                self.host, self.ttl
            ))
        };
        let what = format!("claiming host name `{}` in cluster `{cluster}`", self.host);
        let found = match create_or_read(&self.kv, &key, &self.instance, &what).await? {
            Created::Made(revision) => {
                self.beat = revision;
                return Ok(());
            }
            // Its own create, whose answer was lost.
            Created::Found(entry) if entry.value == self.instance => {
                self.beat = entry.revision;
                return Ok(());
            }
            Created::Found(entry) => entry.revision,
        };
        let watched = Instant::now();
        while watched.elapsed() < self.ttl {
            tokio::time::sleep(self.ttl / 10).await;
            let entry = retrying(&what, || self.kv.entry(&key))
                .await
                .map_err(ClusterError::log(|| what.as_str()))?;
            match entry {
                Some(entry) if entry.revision == found => {}
                // Moved: a heartbeat, or the host leaving just now.
                _ => return Err(alive()),
            }
        }
        let taken = retrying(&what, || async {
            match self.kv.update(&key, self.instance.clone(), found).await {
                Ok(revision) => Ok(Some(revision)),
                Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => Ok(None),
                Err(e) => Err(e),
            }
        })
        .await
        .map_err(ClusterError::log(|| what.as_str()))?;
        // Not taken: another host's heartbeat moved the key, or this host's update landed
        // and its answer was lost (then the key holds this host's instance).
        self.beat = match taken {
            Some(revision) => revision,
            None => retrying(&what, || self.own_revision(&key))
                .await
                .map_err(ClusterError::log(|| what.as_str()))?
                .ok_or_else(alive)?,
        };
        Ok(())
    }

    /// The revision of `key` when it holds this process's instance: a write of this
    /// process's landed there last.
    async fn own_revision(&self, key: &str) -> Result<Option<u64>, kv::EntryError> {
        Ok(self
            .kv
            .entry(key)
            .await?
            .filter(|entry| entry.operation == Operation::Put && entry.value == self.instance)
            .map(|entry| entry.revision))
    }

    /// Records that this cluster runs `tenant`'s `agent` (for publishers to check).
    pub async fn runs(&self, tenant: &str, agent: &str) -> Result<(), ClusterError> {
        self.kv
            .put(agent_key(tenant, agent), Bytes::new())
            .await
            .map_err(ClusterError::nats(|| {
                format!("recording agent {tenant}/{agent}")
            }))?;
        Ok(())
    }

    /// Says this host has left: deletes its heartbeat key.
    pub async fn leave(&self) {
        if let Err(e) = self.kv.delete(self.host_key()).await {
            tracing::debug!("leaving: {e}");
        }
    }

    /// Tries to take partition `partition`: when its lease was never taken, was released,
    /// or has expired. `Ok(None)`: another host holds it (or won the race).
    pub async fn try_acquire(&mut self, partition: u32) -> Result<Option<Lease>, ClusterError> {
        let key = key(partition);
        let bucket = self.bucket.clone();
        let taking = || format!("{bucket}: taking {key}");
        let holding = Holding {
            holder: self.host.clone(),
            token: format!("{:032x}", rand::random::<u128>()),
        };
        let value = Bytes::from(
            serde_json::to_vec(&holding).map_err(ClusterError::record(|| "a lease's holding"))?,
        );
        let entry = self
            .kv
            .entry(&key)
            .await
            .map_err(ClusterError::nats(taking))?;
        let won = match entry {
            None => match self.kv.create(&key, value).await {
                Ok(revision) => Some(revision),
                Err(e) if e.kind() == CreateErrorKind::AlreadyExists => None,
                Err(e) => return Err(ClusterError::nats(taking)(e)),
            },
            Some(entry) => {
                let free = entry.operation != Operation::Put || self.expired(&key, entry.revision);
                if !free {
                    return Ok(None);
                }
                match self.kv.update(&key, value, entry.revision).await {
                    Ok(revision) => Some(revision),
                    Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => None,
                    Err(e) => return Err(ClusterError::nats(taking)(e)),
                }
            }
        };
        Ok(won.map(|revision| {
            self.seen.remove(&key);
            Lease {
                kv: self.kv.clone(),
                partition,
                key,
                holding,
                revision: AtomicU64::new(revision),
                renewed: std::sync::Mutex::new(Instant::now()),
            }
        }))
    }

    /// Whether `key` at `revision` has not moved for a whole TTL since this host first saw
    /// it at that revision.
    fn expired(&mut self, key: &str, revision: u64) -> bool {
        let now = Instant::now();
        let (seen, since) = self.seen.entry(key.to_owned()).or_insert((revision, now));
        if *seen != revision {
            *seen = revision;
            *since = now;
        }
        now.duration_since(*since) >= self.ttl
    }

    /// The hosts holding each partition of `0..partitions`, as the bucket says now.
    pub async fn holders(&self, partitions: u32) -> Result<Vec<Option<String>>, ClusterError> {
        let mut holders = Vec::with_capacity(partitions as usize);
        for partition in 0..partitions {
            let reading =
                ClusterError::nats(|| format!("{}: reading {}", self.bucket, key(partition)));
            let holder = match self.kv.entry(key(partition)).await.map_err(reading)? {
                Some(entry) if entry.operation == Operation::Put => {
                    serde_json::from_slice::<Holding>(&entry.value)
                        .ok()
                        .map(|h| h.holder)
                }
                _ => None,
            };
            holders.push(holder);
        }
        Ok(holders)
    }
}

impl Lease {
    /// Renews the lease: moves its revision, if it is still this host's.
    pub async fn renew(&self) -> Renewal {
        let value = match serde_json::to_vec(&self.holding) {
            Ok(value) => Bytes::from(value),
            Err(_) => return Renewal::Unknown,
        };
        let revision = self.revision.load(Ordering::Acquire);
        match self.kv.update(&self.key, value, revision).await {
            Ok(revision) => {
                self.revision.store(revision, Ordering::Release);
                *self.renewed.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
                Renewal::Renewed
            }
            // Moved by someone else, or by this host's own renewal whose answer was lost.
            Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => match self.entry().await {
                Ok(Some(revision)) => {
                    self.revision.store(revision, Ordering::Release);
                    *self.renewed.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
                    Renewal::Renewed
                }
                Ok(None) => Renewal::Lost,
                Err(e) => {
                    tracing::debug!(partition = self.partition, "reading the lease: {e}");
                    Renewal::Unknown
                }
            },
            Err(e) => {
                tracing::debug!(partition = self.partition, "renewing the lease: {e}");
                Renewal::Unknown
            }
        }
    }

    /// The lease's revision if its key holds this lease (this host's holding, this token).
    async fn entry(&self) -> Result<Option<u64>, kv::EntryError> {
        let entry = self.kv.entry(&self.key).await?;
        Ok(entry.and_then(|entry| {
            let mine = entry.operation == Operation::Put
                && serde_json::from_slice::<Holding>(&entry.value)
                    .ok()
                    .as_ref()
                    == Some(&self.holding);
            mine.then_some(entry.revision)
        }))
    }

    /// How long ago the last renewal (or the acquisition) succeeded.
    pub fn since_renewed(&self) -> Duration {
        self.renewed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed()
    }

    /// Gives the partition up: deletes the key if it is still this host's, so another host
    /// can take it at once instead of after a TTL.
    pub async fn release(&self) {
        let revision = self.revision.load(Ordering::Acquire);
        if let Err(e) = self
            .kv
            .delete_expect_revision(&self.key, Some(revision))
            .await
        {
            tracing::debug!(partition = self.partition, "releasing the lease: {e}");
        }
    }
}

#[async_trait]
impl Authority for Lease {
    async fn holds(&self) -> Result<bool, async_nats::Error> {
        Ok(self.entry().await?.is_some())
    }
}
