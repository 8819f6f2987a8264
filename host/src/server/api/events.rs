//! Events in, outputs out (listed or followed as server-sent events).

// `#[utoipa::path]` expands `params(SomeQuery)` into paths this lint flags.
#![allow(unused_qualifications)]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::State;

use super::extract::{AgentPath, Path, Query, TenantPath};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use futures_util::Stream;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use tokio::sync::{broadcast, watch};
use utoipa::{IntoParams, ToSchema};

use super::inputs::{MAX_AFTER, checked_after, checked_limit};
use super::{ApiError, ErrorBody, MAX_EVENT_BODY, TenantErrors, open_tenant, read_body};
use crate::event::Delta;
use crate::server::ServerState;
use crate::server::runtime::{PositionedOutput, Submission, SubmitError, Submitted, TenantRuntime};

/// The longest event id and key accepted, in characters.
const MAX_ID: usize = 256;
const MAX_KEY: usize = 1024;

/// Outputs returned at most by one list request.
const MAX_OUTPUTS: usize = 1000;

/// An event for one of the agent's keys.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct NewEvent {
    /// The client's id for this event: submitting it again (a retry) does not process it
    /// twice, and returns what the first submission got. 1 to 256 characters.
    #[schema(min_length = 1, max_length = 256)]
    id: String,
    /// Inputs of one key run one at a time, in the order they were accepted. 1 to 1024
    /// characters.
    #[schema(min_length = 1, max_length = 1024)]
    key: String,
    /// Any JSON; the agent's `input` event carries it.
    #[schema(value_type = Object)]
    payload: Box<RawValue>,
}

/// Submits an event for a key. Accepted (202) once it is durable in the tenant's journal;
/// a retry with the same `id` gets 200 and what the first submission got.
#[utoipa::path(post, path = "/v1/tenants/{tenant}/agents/{agent}/events", tag = "events",
    params(TenantPath, AgentPath),
    request_body = NewEvent,
    responses(
        (status = 202, description = "Accepted", body = Submitted),
        (status = 200, description = "Accepted before (a retry); nothing new done", body = Submitted),
        (status = 400, description = "Not a valid event", body = ErrorBody),
        (status = 409, description = "`event-id-reused` for another event, or `event-in-progress`", body = ErrorBody),
        (status = 413, description = "`too-large`: an event over 2 MiB", body = ErrorBody),
        (status = 429, description = "Over `queued-inputs`, `calls-per-minute` or `stored-bytes`", body = ErrorBody),
        (status = 503, description = "`stopping`, or `unavailable`: the agent's current version cannot be loaded, or the tenant's journal failed", body = ErrorBody),
        TenantErrors,
    ))]
pub(super) async fn submit_event(
    State(state): State<Arc<ServerState>>,
    Path((tenant, agent)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<(StatusCode, Json<Submitted>), ApiError> {
    let runtime = open_tenant(&state, &headers, &tenant).await?;
    let body = read_body(body, MAX_EVENT_BODY, "an event").await?;
    let event: NewEvent = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(format!(
            "expected {{\"id\": \"...\", \"key\": \"...\", \"payload\": <json>}}: {e}"
        ))
    })?;
    for (what, value, max) in [("id", &event.id, MAX_ID), ("key", &event.key, MAX_KEY)] {
        if value.is_empty() || value.chars().count() > max {
            return Err(ApiError::bad_request(format!(
                "`{what}` must be 1 to {max} characters"
            )));
        }
    }
    let submission = Submission {
        agent,
        event_id: event.id,
        key: event.key,
        payload: event.payload,
    };
    // In a task of its own: a client that goes away does not stop an acceptance half way.
    let submitted = tokio::spawn(async move { runtime.submit(submission).await })
        .await
        .map_err(|e| ApiError::internal(format!("accepting the event failed: {e}")))?
        .map_err(|error| match error {
            SubmitError::UnknownAgent(_) => ApiError::not_found(error.to_string()),
            SubmitError::Reused { .. } => {
                ApiError::new(StatusCode::CONFLICT, "event-id-reused", error.to_string())
            }
            SubmitError::InProgress { .. } => {
                ApiError::new(StatusCode::CONFLICT, "event-in-progress", error.to_string())
            }
            SubmitError::Quota(quota) => quota.into(),
            SubmitError::Stopping => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "stopping",
                error.to_string(),
            ),
            SubmitError::Unavailable(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                error.to_string(),
            ),
            SubmitError::Log(_) => {
                tracing::error!(tenant, "accepting an event: {error}");
                ApiError::internal("the server could not accept the event; try again")
            }
        })?;
    let status = if submitted.duplicate {
        StatusCode::OK
    } else {
        StatusCode::ACCEPTED
    };
    Ok((status, Json(submitted)))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct OutputsQuery {
    /// Outputs after this position (0, the default: from the first).
    #[serde(default)]
    #[param(minimum = 0, maximum = 9_223_372_036_854_775_807_i64)]
    after: u64,
    /// At most this many (default and most: 1000).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<usize>,
}

#[derive(Debug, Serialize, ToSchema)]
pub(super) struct OutputList {
    outputs: Vec<PositionedOutput>,
    /// Where the next request starts: `after` = this.
    next: u64,
}

/// The tenant's outputs after a position, oldest first. Positions are the tenant's own:
/// 1 for its first output, one more for each after.
#[utoipa::path(get, path = "/v1/tenants/{tenant}/outputs", tag = "events",
    params(TenantPath, OutputsQuery),
    responses(
        (status = 200, description = "The outputs", body = OutputList),
        TenantErrors,
    ))]
pub(super) async fn list_outputs(
    State(state): State<Arc<ServerState>>,
    Path(tenant): Path<String>,
    Query(query): Query<OutputsQuery>,
    headers: HeaderMap,
) -> Result<Json<OutputList>, ApiError> {
    let runtime = open_tenant(&state, &headers, &tenant).await?;
    let limit = checked_limit(query.limit, MAX_OUTPUTS, MAX_OUTPUTS)?;
    let after = checked_after(query.after)?;
    let outputs = runtime.outputs_after(after, limit).await.map_err(|e| {
        tracing::error!(tenant, "reading outputs: {e}");
        ApiError::internal("the server could not read the outputs; try again")
    })?;
    let next = outputs.last().map_or(after, |o| o.position);
    Ok(Json(OutputList { outputs, next }))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct StreamQuery {
    /// Outputs after this position; a `Last-Event-ID` header, sent by a reconnecting
    /// client, takes precedence. Default 0: from the first.
    #[serde(default)]
    #[param(minimum = 0, maximum = 9_223_372_036_854_775_807_i64)]
    after: u64,
}

/// Follows the tenant's outputs as server-sent events: each is an `output` event whose id
/// is its position and whose data is the output as `GET .../outputs` lists it. The stream
/// stays open, sending outputs as they are written, until the server stops. Between them
/// come `delta` events, without an id: the pieces of streamed model answers as the
/// tenant's inputs' calls read them (`{"agent", "key", "sequence", "action", "call",
/// "function", "delta"}`), never recorded nor sent again; a follower that falls behind by
/// more than 1,024 loses the oldest.
#[utoipa::path(get, path = "/v1/tenants/{tenant}/outputs/stream", tag = "events",
    params(TenantPath, StreamQuery,
        ("Last-Event-ID" = Option<u64>, Header, minimum = 0, maximum = 9_223_372_036_854_775_807_i64, description = "Resume after this position")),
    responses(
        (status = 200, description = "A stream of `output` events, and `delta` events as model answers stream", content_type = "text/event-stream", body = String),
        TenantErrors,
    ))]
pub(super) async fn stream_outputs(
    State(state): State<Arc<ServerState>>,
    Path(tenant): Path<String>,
    Query(query): Query<StreamQuery>,
    headers: HeaderMap,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let runtime = open_tenant(&state, &headers, &tenant).await?;
    let after = match headers.get("last-event-id") {
        None => checked_after(query.after)?,
        Some(id) => id
            .to_str()
            .ok()
            .and_then(|id| id.trim().parse().ok())
            .filter(|&id| id <= MAX_AFTER)
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "bad-header",
                    format!("Last-Event-ID must be a position, 0 to {MAX_AFTER}"),
                )
            })?,
    };
    let follow = Follow {
        changes: runtime.watch_outputs(),
        deltas: runtime.follow_deltas(),
        runtime,
        position: after,
        buffer: VecDeque::new(),
        closing: state.lifecycle.closing(),
    };
    let stream = futures_util::stream::unfold(follow, |mut follow| async move {
        let event = follow.next().await?;
        Some((Ok(event), follow))
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}

/// A client following the outputs.
struct Follow {
    runtime: Arc<TenantRuntime>,
    changes: watch::Receiver<u64>,
    deltas: broadcast::Receiver<Delta>,
    position: u64,
    buffer: VecDeque<PositionedOutput>,
    closing: watch::Receiver<bool>,
}

impl Follow {
    /// The next output event; `None` when the stream ends (the server is stopping).
    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(output) = self.buffer.pop_front() {
                return Some(
                    Event::default()
                        .event("output")
                        .id(output.position.to_string())
                        .json_data(&output)
                        .unwrap_or_else(|_| Event::default().comment("unencodable output")),
                );
            }
            if *self.closing.borrow() {
                return None;
            }
            // Seen before reading: a write after this read wakes the wait below.
            self.changes.borrow_and_update();
            match self.runtime.outputs_after(self.position, 256).await {
                Ok(batch) if !batch.is_empty() => {
                    self.position = batch.last().map_or(self.position, |o| o.position);
                    self.buffer.extend(batch);
                }
                Ok(_) => {
                    tokio::select! {
                        changed = self.changes.changed() => changed.ok()?,
                        _ = self.closing.changed() => return None,
                        delta = self.deltas.recv() => match delta {
                            Ok(delta) => return Some(delta_event(&delta)),
                            Err(broadcast::error::RecvError::Lagged(lost)) => {
                                return Some(Event::default().comment(format!(
                                    "{lost} deltas lost: this follower fell behind"
                                )));
                            }
                            Err(broadcast::error::RecvError::Closed) => return None,
                        },
                    }
                }
                Err(error) => {
                    tracing::error!(tenant = %self.runtime.name(), "following outputs: {error}");
                    return None;
                }
            }
        }
    }
}

/// A `delta` event: the delta without its tenant (the stream's own).
fn delta_event(delta: &Delta) -> Event {
    let data = serde_json::json!({
        "agent": delta.agent,
        "key": delta.key,
        "sequence": delta.sequence,
        "action": delta.action,
        "call": delta.call,
        "function": delta.function,
        "delta": delta.delta,
    });
    Event::default().event("delta").data(data.to_string())
}
