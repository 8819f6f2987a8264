//! The event ids a cluster has accepted, so that an event published again is dropped: in a
//! KV bucket `PREFIX-events`, for as long as the bucket lives (JetStream's own
//! `Nats-Msg-Id` window drops a repeat for 45 seconds only).
//!
//! The key of an event is `TENANT.AGENT.DIGEST`, the digest of its id (an id may hold any
//! character; a key may not). Its value says where the event was first seen (partition
//! and position in the input stream) and a digest of its key and payload (in canonical
//! JSON). The reader of a partition asks, for each input in order, whether it is the first
//! of its id:
//! - no entry: it is; the entry is made (compare-and-set: one writer wins);
//! - an entry for this very message: it is (read again after a host took the partition
//!   over, or restarted);
//! - an entry for another message with the same key and payload: a repeat, dropped;
//! - an entry for another key or payload: an id used for two events, refused.
//!
//! Every reader of a partition reads its messages in order, so each finds the same first
//! message of an id, whichever host reads it and however often.

use async_nats::jetstream;
use async_nats::jetstream::kv;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::error::ClusterError;
use super::lease::{Created, create_or_read, open_bucket};
use super::{Layout, RECORD_FORMAT};
use crate::agent::input::InputLine;
use crate::durable::digest::input_trigger;
use crate::store::Digest;
use crate::version::{self, Versioned};

/// Where an event id was first seen.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Seen {
    partition: u32,
    position: u64,
    /// Of the event's key and payload.
    digest: String,
}

/// What the reader does with an input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The first message of its id (or it has none): run it.
    First,
    /// A repeat of the event first seen at `position` of `partition`: drop it.
    Repeat { partition: u32, position: u64 },
    /// Its id was first seen with another key or payload: refuse it.
    Reused { partition: u32, position: u64 },
}

/// The cluster's accepted event ids.
#[derive(Debug, Clone)]
pub struct Events {
    kv: kv::Store,
    bucket: String,
}

impl Layout {
    pub fn events_bucket(&self) -> String {
        format!("{}-events", self.prefix)
    }
}

impl Events {
    /// Opens (creating it when new) the cluster's bucket of event ids.
    pub async fn open(context: &jetstream::Context, layout: &Layout) -> Result<Self, ClusterError> {
        let bucket = layout.events_bucket();
        let kv = open_bucket(context, &bucket, layout.replicas, "event id bucket").await?;
        Ok(Self { kv, bucket })
    }

    /// Whether `input`, at `position` of `partition`'s stream of `tenant`'s `agent`, is the
    /// first message of its event id. Retried while NATS does not answer, up to
    /// [`RETRY_FOR`](crate::log::jetstream::RETRY_FOR).
    pub async fn verdict(
        &self,
        tenant: &str,
        agent: &str,
        partition: u32,
        position: u64,
        input: &InputLine,
    ) -> Result<Verdict, ClusterError> {
        let Some(id) = &input.id else {
            return Ok(Verdict::First);
        };
        let key = format!("{tenant}.{agent}.{}", Digest::of(&[id.as_bytes()]));
        let seen = Seen {
            partition,
            position,
            // The payload's canonical form: a repeat re-encoded (keys in another order,
            // other whitespace) is the same event.
            digest: Digest::of(&[input.key.as_bytes(), &input_trigger(&input.payload).0])
                .to_string(),
        };
        let value = Bytes::from(
            serde_json::to_vec(&Versioned {
                format: RECORD_FORMAT,
                value: &seen,
            })
            .map_err(ClusterError::record(|| "an event id's entry"))?,
        );
        let what = format!("{}: recording event {id:?}", self.bucket);
        Ok(match create_or_read(&self.kv, &key, &value, &what).await? {
            Created::Made(_) => Verdict::First,
            Created::Found(entry) => {
                let what = format!("{}: the entry of event {id:?}", self.bucket);
                let first: Seen = version::decode(&entry.value, RECORD_FORMAT, &what)?;
                judge(&first, &seen)
            }
        })
    }
}

fn judge(first: &Seen, this: &Seen) -> Verdict {
    if first.partition == this.partition && first.position == this.position {
        Verdict::First
    } else if first.digest == this.digest {
        Verdict::Repeat {
            partition: first.partition,
            position: first.position,
        }
    } else {
        Verdict::Reused {
            partition: first.partition,
            position: first.position,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_message_of_an_id_runs_a_repeat_is_dropped_and_a_reuse_refused() {
        let first = Seen {
            partition: 1,
            position: 7,
            digest: "a".to_owned(),
        };
        assert_eq!(judge(&first, &first), Verdict::First, "read again");
        let repeat = Seen {
            position: 9,
            ..first.clone()
        };
        assert_eq!(
            judge(&first, &repeat),
            Verdict::Repeat {
                partition: 1,
                position: 7
            }
        );
        let reused = Seen {
            partition: 2,
            position: 3,
            digest: "b".to_owned(),
        };
        assert_eq!(
            judge(&first, &reused),
            Verdict::Reused {
                partition: 1,
                position: 7
            }
        );
    }
}
