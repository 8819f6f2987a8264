//! Signals from outside to a key's input (a person's approval, a webhook's news), which a
//! durable wait of the input takes.

// `#[utoipa::path]` expands `params(SomeQuery)` into paths this lint flags.
#![allow(unused_qualifications)]

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use utoipa::ToSchema;

use super::extract::{AgentPath, KeyPath, Path, SequencePath, SignalPath, TenantPath};
use super::{ApiError, ErrorBody, TenantErrors, open_tenant, read_body};
use crate::agent::{MAX_SIGNAL_PAYLOAD_BYTES, SignalError, SignalIn};
use crate::server::ServerState;

/// The largest body of a signal: its payload and id, with room for the JSON around them.
const MAX_SIGNAL_BODY: usize = MAX_SIGNAL_PAYLOAD_BYTES + (4 << 10);

/// A signal's body; no body is a signal with a `null` payload and a new id.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct SendSignal {
    /// Its payload: any JSON (default `null`), at most 64 KiB.
    #[schema(value_type = Object)]
    #[serde(default)]
    payload: Option<Box<RawValue>>,
    /// Your id for it, 1 to 128 bytes: sent again with the same id it is delivered once.
    /// Default: a new id, so each request is a new signal.
    #[schema(min_length = 1, max_length = 128)]
    id: Option<String>,
}

/// A signal delivered.
#[derive(Debug, Serialize, ToSchema)]
pub(super) struct SignalSent {
    key: String,
    /// The input it was delivered to.
    sequence: u64,
    name: String,
    id: String,
    /// Whether a signal with this id was delivered to the input before (this one changed
    /// nothing).
    repeat: bool,
}

/// Sends a signal to the key's first unfinished input: into its inbox, durably, where a
/// wait of the input for the signal's name (`await-signal`) takes it, now if the input
/// waits for it, or when it reaches that wait. Refused (and sent to no other input) when
/// the key has no unfinished input or no action of the agent declares the name.
#[utoipa::path(post, path = "/v1/tenants/{tenant}/agents/{agent}/keys/{key}/signals/{name}", tag = "inputs",
    params(TenantPath, AgentPath, KeyPath, SignalPath),
    request_body(content = Option<SendSignal>, description = "Optional: its payload and id"),
    responses(
        (status = 200, description = "Delivered", body = SignalSent),
        (status = 400, description = "`bad-signal`: not a valid body, payload or id", body = ErrorBody),
        (status = 409, description = "`no-unfinished-input`: the key has none; `input-finished`: it finished as the signal came; `inbox-full`: it holds 1000 signals", body = ErrorBody),
        (status = 413, description = "`too-large`: a body over 68 KiB", body = ErrorBody),
        (status = 429, description = "Over the `signals-per-minute` quota", body = ErrorBody),
        (status = 503, description = "`unavailable`: the signal could not be recorded", body = ErrorBody),
        TenantErrors,
    ))]
pub(super) async fn signal_key(
    State(state): State<Arc<ServerState>>,
    Path((tenant, agent, key, name)): Path<(String, String, String, String)>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Json<SignalSent>, ApiError> {
    send(&state, &headers, (tenant, agent, key, None, name), body).await
}

/// Sends a signal to input `sequence` of the key, as to its first unfinished input. Refused
/// (and sent to no other input) when that input is finished or the key never had it.
#[utoipa::path(post, path = "/v1/tenants/{tenant}/agents/{agent}/keys/{key}/inputs/{sequence}/signals/{name}", tag = "inputs",
    params(TenantPath, AgentPath, KeyPath, SequencePath, SignalPath),
    request_body(content = Option<SendSignal>, description = "Optional: its payload and id"),
    responses(
        (status = 200, description = "Delivered", body = SignalSent),
        (status = 400, description = "`bad-signal`: not a valid body, payload or id", body = ErrorBody),
        (status = 409, description = "`input-finished`: the input is finished; `inbox-full`: it holds 1000 signals", body = ErrorBody),
        (status = 413, description = "`too-large`: a body over 68 KiB", body = ErrorBody),
        (status = 429, description = "Over the `signals-per-minute` quota", body = ErrorBody),
        (status = 503, description = "`unavailable`: the signal could not be recorded", body = ErrorBody),
        TenantErrors,
    ))]
pub(super) async fn signal_input(
    State(state): State<Arc<ServerState>>,
    Path((tenant, agent, key, sequence, name)): Path<(String, String, String, u64, String)>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Json<SignalSent>, ApiError> {
    send(
        &state,
        &headers,
        (tenant, agent, key, Some(sequence), name),
        body,
    )
    .await
}

/// Delivers the signal `name` of `body` to `key`'s input `sequence` (or its first
/// unfinished one), in a task of its own: a client that goes away does not stop it half way.
async fn send(
    state: &ServerState,
    headers: &HeaderMap,
    (tenant, agent, key, sequence, name): (String, String, String, Option<u64>, String),
    body: axum::body::Body,
) -> Result<Json<SignalSent>, ApiError> {
    let runtime = open_tenant(state, headers, &tenant).await?;
    if !runtime.agents().contains_key(&agent) {
        return Err(ApiError::not_found(format!("no agent {agent}")));
    }
    let body = read_body(body, MAX_SIGNAL_BODY, "a signal").await?;
    let sent: SendSignal = if body.iter().all(u8::is_ascii_whitespace) {
        SendSignal::default()
    } else {
        serde_json::from_slice::<Option<SendSignal>>(&body)
            .map(Option::unwrap_or_default)
            .map_err(|e| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "bad-signal",
                    format!("expected {{\"payload\": <JSON>, \"id\": \"...\"}} or no body: {e}"),
                )
            })?
    };
    let signal = SignalIn {
        name,
        payload: sent
            .payload
            .map_or_else(|| "null".to_owned(), |p| p.get().to_owned()),
        id: sent
            .id
            .unwrap_or_else(|| format!("sig_{}", hex::encode(rand::random::<[u8; 12]>()))),
    };
    runtime.take_signal()?;
    let delivered = {
        let signal = signal.clone();
        let (agent, key) = (agent.clone(), key.clone());
        tokio::spawn(async move { runtime.signal(&agent, &key, sequence, &signal).await })
            .await
            .map_err(|e| ApiError::internal(format!("the signal failed: {e}")))?
    };
    let delivered = delivered.map_err(|error| refused(&tenant, &error))?;
    Ok(Json(SignalSent {
        key,
        sequence: delivered.sequence,
        name: signal.name,
        id: signal.id,
        repeat: delivered.repeat,
    }))
}

fn refused(tenant: &str, error: &SignalError) -> ApiError {
    let (status, code) = match error {
        SignalError::Invalid { .. } => (StatusCode::BAD_REQUEST, "bad-signal"),
        SignalError::Undeclared { .. } => (StatusCode::NOT_FOUND, "undeclared-signal"),
        SignalError::NoSuchInput { .. } => (StatusCode::NOT_FOUND, "no-such-input"),
        SignalError::NoInput { .. } => (StatusCode::CONFLICT, "no-unfinished-input"),
        SignalError::Finished { .. } => (StatusCode::CONFLICT, "input-finished"),
        SignalError::Full { .. } => (StatusCode::CONFLICT, "inbox-full"),
        SignalError::Host { .. } => {
            tracing::error!(tenant, "{error}");
            (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
        }
    };
    ApiError::new(status, code, error.to_string())
}
