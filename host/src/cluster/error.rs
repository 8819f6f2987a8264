//! Why a cluster operation failed: each kind with what was being done and its cause.

use crate::agent::BuildError;
use crate::checkpoint::CheckpointError;
use crate::log::LogError;
use crate::store::StoreError;
use crate::version::FormatError;

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A request to NATS failed, or was not answered (after the retries it gets).
    #[error("{what}: {source}")]
    Nats {
        what: String,
        #[source]
        source: async_nats::Error,
    },
    /// A partition's log (its state, output or checkpoint stream) failed.
    #[error("{what}: {source}")]
    Log {
        what: String,
        #[source]
        source: LogError,
    },
    #[error("{what}: {source}")]
    Checkpoint {
        what: String,
        #[source]
        source: CheckpointError,
    },
    /// A partition's states could not be recovered.
    #[error("{what}: {source}")]
    Store {
        what: String,
        #[source]
        source: StoreError,
    },
    /// A record the cluster keeps (the layout, an event id's entry, an output) is not what
    /// this build reads.
    #[error("{what}: {source}")]
    Record {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    /// A record the cluster keeps is of a newer format than this build reads (or not JSON
    /// of one).
    #[error(transparent)]
    Format(#[from] FormatError),
    /// Running a partition's inputs failed: its sink, or a run of checkpoints failing.
    #[error("{what}: {source}")]
    Run {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// The agent cannot be built.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// What was asked cannot be done as asked, and saying it again will not help: a name
    /// that cannot be a subject, a layout other than the cluster's, a host name a live
    /// host goes by, an agent the cluster does not run, a cluster that is not there.
    #[error("{0}")]
    Refused(String),
}

impl ClusterError {
    // Each takes what was being done as a closure, called only on failure: these wrap
    // requests made for every input (an event id's verdict, a publish).

    /// A NATS request's error, doing `what()`.
    pub(crate) fn nats<E: Into<async_nats::Error>, W: Into<String>>(
        what: impl FnOnce() -> W,
    ) -> impl FnOnce(E) -> Self {
        move |source| Self::Nats {
            what: what().into(),
            source: source.into(),
        }
    }

    /// A log's error, doing `what()`.
    pub(crate) fn log<W: Into<String>>(what: impl FnOnce() -> W) -> impl FnOnce(LogError) -> Self {
        move |source| Self::Log {
            what: what().into(),
            source,
        }
    }

    /// A record that does not decode, named by `what()`.
    pub(crate) fn record<W: Into<String>>(
        what: impl FnOnce() -> W,
    ) -> impl FnOnce(serde_json::Error) -> Self {
        move |source| Self::Record {
            what: what().into(),
            source,
        }
    }
}

/// Refuses with `message` unless `condition` holds.
pub(crate) fn ensure(
    condition: bool,
    message: impl FnOnce() -> String,
) -> Result<(), ClusterError> {
    if condition {
        Ok(())
    } else {
        Err(ClusterError::Refused(message()))
    }
}
