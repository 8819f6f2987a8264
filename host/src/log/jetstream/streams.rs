//! Making a stream: get it, or create it, with any number of hosts doing the same at once.
//!
//! The hosts of a cluster start together and each opens the same streams and lease bucket.
//! A create that loses the race is answered "stream name already in use" or "subjects
//! overlap with an existing stream" (nats-server checks the subjects of the stream being
//! made against those of the stream another request has just made). Neither is a failure
//! here: the stream the other host made is read back and checked against what this one
//! asks for, field by field, and used when it agrees. Only a stream that disagrees, or
//! subjects held by a stream of another name, fail, naming what is wrong.

use std::time::Instant;

use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::{CreateStreamErrorKind, GetStreamErrorKind};
use async_nats::jetstream::{self, stream};

use super::{RETRY_FOR, backoff, io};
use crate::log::LogError;

/// What one look at the stream found.
enum Step {
    Found(Box<stream::Stream>),
    /// Not answered, or made by another host and not readable yet: look again.
    Again(String),
}

/// The stream `wanted.name`: the one that exists, or one made now with `wanted`.
///
/// Safe to call from many hosts at once: whoever creates it, every caller gets it. An
/// existing stream must agree with `wanted` on what its users rely on (its subjects,
/// replicas, retention, storage, discard policy, rollups, deletes, direct gets, messages
/// per subject, and a duplicate window at least as long): otherwise
/// [`LogError::StreamConflict`]. Subjects that another stream holds are
/// [`LogError::SubjectsTaken`]. An unanswered request is retried for up to [`RETRY_FOR`].
pub(crate) async fn ensure_stream(
    context: &jetstream::Context,
    wanted: &stream::Config,
) -> Result<stream::Stream, LogError> {
    let started = Instant::now();
    let mut attempt = 0;
    loop {
        match look(context, wanted).await? {
            Step::Found(stream) => {
                check_compatible(wanted, &stream.cached_info().config)?;
                return Ok(*stream);
            }
            Step::Again(why) if started.elapsed() >= RETRY_FOR => {
                return Err(io(
                    format!("making stream {} (retried for {RETRY_FOR:?})", wanted.name),
                    why,
                ));
            }
            Step::Again(why) => {
                attempt += 1;
                tracing::debug!(stream = %wanted.name, attempt, "making the stream: {why}; again");
                tokio::time::sleep(backoff(attempt)).await;
            }
        }
    }
}

/// Reads the stream; when there is none, creates it.
async fn look(context: &jetstream::Context, wanted: &stream::Config) -> Result<Step, LogError> {
    let name = &wanted.name;
    let error = match context.get_stream(name).await {
        Ok(stream) => return Ok(Step::Found(Box::new(stream))),
        Err(error) => error,
    };
    match error.kind() {
        GetStreamErrorKind::JetStream(e) if e.error_code() == ErrorCode::STREAM_NOT_FOUND => {}
        GetStreamErrorKind::Request => return Ok(Step::Again(error.to_string())),
        _ => return Err(io(format!("reading stream {name}"), error)),
    }
    let error = match context.create_stream(wanted.clone()).await {
        Ok(stream) => {
            tracing::debug!(stream = %name, "stream created");
            return Ok(Step::Found(Box::new(stream)));
        }
        Err(error) => error,
    };
    match error.kind() {
        // Another host made it first (with another configuration, it will say so when read).
        CreateStreamErrorKind::JetStream(e) if e.error_code() == ErrorCode::STREAM_NAME_EXIST => {
            Ok(Step::Again(error.to_string()))
        }
        // Made first by another host, or the subjects belong to another stream: ask which.
        CreateStreamErrorKind::JetStream(e)
            if e.error_code() == ErrorCode::STREAM_SUBJECT_OVERLAP =>
        {
            holder_of_subjects(context, wanted, error.to_string()).await
        }
        CreateStreamErrorKind::TimedOut
        | CreateStreamErrorKind::Response
        | CreateStreamErrorKind::JetStreamUnavailable => Ok(Step::Again(error.to_string())),
        _ => Err(io(format!("creating stream {name}"), error)),
    }
}

/// After "subjects overlap": the stream is this one (made by another host: read it again),
/// or another one, which is an error that names it.
async fn holder_of_subjects(
    context: &jetstream::Context,
    wanted: &stream::Config,
    why: String,
) -> Result<Step, LogError> {
    for subject in &wanted.subjects {
        match context.stream_by_subject(subject.as_str()).await {
            Ok(holder) if holder != wanted.name => {
                return Err(LogError::SubjectsTaken {
                    stream: wanted.name.clone(),
                    subject: subject.clone(),
                    holder,
                });
            }
            Ok(_) => return Ok(Step::Again(why)),
            // Not answered, or no stream holds this one: try the next, then look again.
            Err(_) => {}
        }
    }
    Ok(Step::Again(why))
}

/// Whether a stream found as `found` serves as one made with `wanted`.
fn check_compatible(wanted: &stream::Config, found: &stream::Config) -> Result<(), LogError> {
    let differs = |field: &'static str, a: String, b: String| -> Result<(), LogError> {
        if a == b {
            Ok(())
        } else {
            Err(LogError::StreamConflict {
                stream: wanted.name.clone(),
                field,
                wanted: a,
                found: b,
            })
        }
    };
    let mut subjects = wanted.subjects.clone();
    subjects.sort();
    let mut found_subjects = found.subjects.clone();
    found_subjects.sort();
    differs("subjects", subjects.join(", "), found_subjects.join(", "))?;
    differs(
        "replicas",
        wanted.num_replicas.max(1).to_string(),
        found.num_replicas.max(1).to_string(),
    )?;
    differs(
        "retention",
        format!("{:?}", wanted.retention),
        format!("{:?}", found.retention),
    )?;
    differs(
        "storage",
        format!("{:?}", wanted.storage),
        format!("{:?}", found.storage),
    )?;
    differs(
        "discard policy",
        format!("{:?}", wanted.discard),
        format!("{:?}", found.discard),
    )?;
    differs(
        "messages per subject",
        per_subject(wanted.max_messages_per_subject),
        per_subject(found.max_messages_per_subject),
    )?;
    differs(
        "rollups allowed",
        wanted.allow_rollup.to_string(),
        found.allow_rollup.to_string(),
    )?;
    differs(
        "deletes denied",
        wanted.deny_delete.to_string(),
        found.deny_delete.to_string(),
    )?;
    differs(
        "direct gets",
        wanted.allow_direct.to_string(),
        found.allow_direct.to_string(),
    )?;
    // A longer window only costs the server memory; a shorter one could forget the id of a
    // publish that is still being retried.
    if !wanted.duplicate_window.is_zero() && found.duplicate_window < wanted.duplicate_window {
        return Err(LogError::StreamConflict {
            stream: wanted.name.clone(),
            field: "duplicate window",
            wanted: format!("at least {:?}", wanted.duplicate_window),
            found: format!("{:?}", found.duplicate_window),
        });
    }
    Ok(())
}

/// Messages kept per subject; the server stores "no limit" as -1 where it was asked 0.
fn per_subject(max: i64) -> String {
    if max <= 0 {
        "no limit".to_owned()
    } else {
        max.to_string()
    }
}
