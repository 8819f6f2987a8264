//! An agent's inputs as an operator sees them: a key's history, the inputs parked (or
//! retrying, running, stopped) across keys; an operator's retry or skip of a parked one, the
//! answer for a call of it in doubt, and the cancel of a key's first unfinished input.

// `#[utoipa::path]` expands `params(SomeQuery)` into paths this lint flags.
#![allow(unused_qualifications)]

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::extract::{AgentPath, CallPath, KeyPath, Path, Query, SequencePath, TenantPath};
use super::{
    ApiError, Caller, ErrorBody, MAX_COMMAND_BODY, TenantErrors, caller, open_tenant, read_body,
};
use crate::durable::Answer;
use crate::keys::Cancelling;
use crate::server::ServerState;
use crate::server::runtime::{CommandRefused, HeadInput, HistoryEntry, InputStatus, TenantRuntime};

/// The largest `after`: positions and sequences are documented as 64-bit signed integers.
pub(super) const MAX_AFTER: u64 = i64::MAX as u64;

/// `after` of a list, refused past [`MAX_AFTER`].
pub(super) fn checked_after(after: u64) -> Result<u64, ApiError> {
    if after > MAX_AFTER {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad-query",
            format!("after must be 0 to {MAX_AFTER}, not {after}"),
        ));
    }
    Ok(after)
}

/// `limit` of a list: `default` when not given; refused outside 1 to `max`.
pub(super) fn checked_limit(
    limit: Option<usize>,
    default: usize,
    max: usize,
) -> Result<usize, ApiError> {
    match limit {
        None => Ok(default),
        Some(limit) if (1..=max).contains(&limit) => Ok(limit),
        Some(limit) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad-query",
            format!("limit must be 1 to {max}, not {limit}"),
        )),
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct HistoryQuery {
    /// Inputs with a sequence after this one (0, the default: from the first).
    #[serde(default)]
    #[param(minimum = 0, maximum = 9_223_372_036_854_775_807_i64)]
    after: u64,
    /// At most this many (default 100, at most 1000).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<usize>,
}

/// Inputs returned by one history request, by default and at most.
const DEFAULT_HISTORY: usize = 100;
const MAX_HISTORY: usize = 1000;

#[derive(Debug, Serialize, ToSchema)]
pub(super) struct KeyHistory {
    agent: String,
    key: String,
    /// Oldest first.
    inputs: Vec<HistoryEntry>,
    /// When more inputs follow: ask again with `after` = this.
    #[serde(skip_serializing_if = "Option::is_none")]
    next: Option<u64>,
}

/// What happened to one key of an agent: each input, with its status (`accepted`,
/// `running`, `retrying`, `parked`, `stopped`, `done`, `skipped`; `failed` for inputs
/// finished by builds before retries), its actions, and their recorded calls.
#[utoipa::path(get, path = "/v1/tenants/{tenant}/agents/{agent}/keys/{key}/history", tag = "inputs",
    params(TenantPath, AgentPath, KeyPath, HistoryQuery),
    responses(
        (status = 200, description = "The key's history, a page at a time", body = KeyHistory),
        TenantErrors,
    ))]
pub(super) async fn key_history(
    State(state): State<Arc<ServerState>>,
    Path((tenant, agent, key)): Path<(String, String, String)>,
    Query(query): Query<HistoryQuery>,
    headers: HeaderMap,
) -> Result<Json<KeyHistory>, ApiError> {
    let runtime = open_tenant(&state, &headers, &tenant).await?;
    known_agent(&runtime, &agent)?;
    let limit = checked_limit(query.limit, DEFAULT_HISTORY, MAX_HISTORY)?;
    let after = checked_after(query.after)?;
    let (inputs, more) = runtime
        .history(&agent, &key, after, limit)
        .await
        .map_err(|e| {
            tracing::error!(tenant, agent, "reading a key's history: {e}");
            ApiError::internal("the server could not read the history; try again")
        })?
        .ok_or_else(|| ApiError::not_found(format!("agent {agent} has no inputs for key {key}")))?;
    let next = more.then(|| inputs.last().map_or(after, |i| i.sequence));
    Ok(Json(KeyHistory {
        agent,
        key,
        inputs,
        next,
    }))
}

/// Which inputs a list across keys shows: those at the head of their key.
#[derive(Clone, Copy, Debug, Deserialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub(super) enum HeadStatus {
    Running,
    Retrying,
    Parked,
    Stopped,
    Waiting,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct InputsQuery {
    /// `parked` (the default), `retrying`, `running`, `stopped` or `waiting` (at a durable
    /// wait).
    #[param(inline)]
    status: Option<HeadStatus>,
}

#[derive(Debug, Serialize, ToSchema)]
pub(super) struct InputList {
    agent: String,
    /// By key; each the first unfinished input of its key.
    inputs: Vec<HeadInput>,
}

/// The agent's inputs that hold up their key, across keys: by default the parked ones
/// (every attempt failed; an operator retries or skips them), with their last error and
/// how many of the key's inputs wait behind each.
#[utoipa::path(get, path = "/v1/tenants/{tenant}/agents/{agent}/inputs", tag = "inputs",
    params(TenantPath, AgentPath, InputsQuery),
    responses(
        (status = 200, description = "The inputs", body = InputList),
        TenantErrors,
    ))]
pub(super) async fn list_inputs(
    State(state): State<Arc<ServerState>>,
    Path((tenant, agent)): Path<(String, String)>,
    Query(query): Query<InputsQuery>,
    headers: HeaderMap,
) -> Result<Json<InputList>, ApiError> {
    let runtime = open_tenant(&state, &headers, &tenant).await?;
    known_agent(&runtime, &agent)?;
    let status = match query.status.unwrap_or(HeadStatus::Parked) {
        HeadStatus::Running => InputStatus::Running,
        HeadStatus::Retrying => InputStatus::Retrying,
        HeadStatus::Parked => InputStatus::Parked,
        HeadStatus::Stopped => InputStatus::Stopped,
        HeadStatus::Waiting => InputStatus::Waiting,
    };
    let inputs = runtime.inputs(&agent, status);
    Ok(Json(InputList { agent, inputs }))
}

/// An operator's retry of a parked input.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RetryInput {
    /// The agent version to run it on: the one it ran on (the default) or a newer one.
    #[schema(minimum = 1)]
    version: Option<u32>,
}

/// An operator's skip of a parked input.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct SkipInput {
    /// Why it is skipped, for the key's history. 1 to 1000 characters.
    #[schema(min_length = 1, max_length = 1000)]
    reason: String,
}

/// The longest reason a skip records, in characters.
const MAX_REASON: usize = 1000;

/// An operator's cancel of an input.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct CancelInput {
    /// Why it is cancelled, for the key's history. Up to 1000 characters.
    #[schema(max_length = 1000)]
    #[serde(default)]
    reason: String,
}

/// An operator's answer for a call in doubt: `{"result": <JSON>}` (the call ran and the
/// remote answered that), `{"error": "..."}` (it ran and failed) or `"not-made"` (it never
/// reached the remote; the next attempt makes it, under the same idempotency key).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub(super) enum ResolveCall {
    Result(RemoteAnswered),
    Error(RemoteFailed),
    NotMade(NeverMade),
}

/// The call ran, and the remote answered `result`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RemoteAnswered {
    result: serde_json::Value,
}

/// The call ran, and failed with `error`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RemoteFailed {
    error: String,
}

/// The call never reached the remote.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub(super) enum NeverMade {
    NotMade,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct ResolveQuery {
    /// The action whose call it is, needed when more than one action of the input has
    /// that call in doubt.
    action: Option<String>,
}

/// The largest body of a resolve: the answer of a call (a model's reply) may be long.
const MAX_RESOLVE_BODY: usize = 1 << 20;

/// What an operator's command did.
#[derive(Debug, Serialize, ToSchema)]
pub(super) struct CommandDone {
    key: String,
    sequence: u64,
    /// `retried`, `skipped`, `cancelled`, or `cancelling` (it stops at its next durable
    /// call; its history says `cancelled` then).
    done: String,
    /// Who did it, as the history records it: `admin`, or `tenant token tok_…` (the id of
    /// the tenant's token that asked).
    by: String,
}

/// Runs a parked input again, from its first attempt (its recorded calls are served, not
/// made again), optionally on a newer version of the agent. Its key's later inputs run
/// after it. Recorded in the journal: a restart does not park it again.
#[utoipa::path(post, path = "/v1/tenants/{tenant}/agents/{agent}/keys/{key}/inputs/{sequence}/retry", tag = "inputs",
    params(TenantPath, AgentPath, KeyPath, SequencePath),
    request_body(content = Option<RetryInput>, description = "Optional: the version to run it on"),
    responses(
        (status = 200, description = "It runs again", body = CommandDone),
        (status = 400, description = "Not a valid body", body = ErrorBody),
        (status = 409, description = "`not-parked`: the input is not parked (not yet, or no more); or `older-version`", body = ErrorBody),
        (status = 413, description = "`too-large`: a body over 4 KiB", body = ErrorBody),
        (status = 503, description = "`unavailable`: the tenant's journal failed a write", body = ErrorBody),
        TenantErrors,
    ))]
pub(super) async fn retry_input(
    State(state): State<Arc<ServerState>>,
    Path((tenant, agent, key, sequence)): Path<(String, String, String, u64)>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Json<CommandDone>, ApiError> {
    let (by, runtime, body) = command_request(&state, &headers, &tenant, body, "a retry").await?;
    let retry: RetryInput = optional_body(&body, "{\"version\": <number>}")?;
    let command = {
        let (agent, key, by) = (agent.clone(), key.clone(), by.clone());
        async move {
            let retried = runtime.retry(&agent, &key, Some(sequence), retry.version, &by);
            retried.await.map(|sequence| (sequence, RETRIED))
        }
    };
    run_command(&tenant, key, by, command).await
}

/// Skips a parked input: it is finished as `skipped` (nothing it did is applied: no
/// outputs, no memory writes), with who skipped it and why, and its key's next input runs.
#[utoipa::path(post, path = "/v1/tenants/{tenant}/agents/{agent}/keys/{key}/inputs/{sequence}/skip", tag = "inputs",
    params(TenantPath, AgentPath, KeyPath, SequencePath),
    request_body = SkipInput,
    responses(
        (status = 200, description = "Skipped", body = CommandDone),
        (status = 400, description = "Not a valid body", body = ErrorBody),
        (status = 409, description = "`not-parked`: the input is not parked (not yet, or no more)", body = ErrorBody),
        (status = 413, description = "`too-large`: a body over 4 KiB", body = ErrorBody),
        (status = 503, description = "`unavailable`: the tenant's journal failed a write", body = ErrorBody),
        TenantErrors,
    ))]
pub(super) async fn skip_input(
    State(state): State<Arc<ServerState>>,
    Path((tenant, agent, key, sequence)): Path<(String, String, String, u64)>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Json<CommandDone>, ApiError> {
    let (by, runtime, body) = command_request(&state, &headers, &tenant, body, "a skip").await?;
    let skip: SkipInput = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("expected {{\"reason\": \"...\"}}: {e}")))?;
    if skip.reason.trim().is_empty() || skip.reason.chars().count() > MAX_REASON {
        return Err(ApiError::bad_request(format!(
            "`reason` must be 1 to {MAX_REASON} characters, not blank"
        )));
    }
    let command = {
        let (agent, key, by) = (agent.clone(), key.clone(), by.clone());
        async move {
            let skipped = runtime.skip(&agent, &key, Some(sequence), &by, &skip.reason);
            skipped.await.map(|sequence| (sequence, "skipped"))
        }
    };
    run_command(&tenant, key, by, command).await
}

/// Cancels an input, its key's first unfinished one: a parked input is finished as
/// `cancelled` at once (200); one that runs, retries or waits for its turn stops at its next
/// durable call, which is not made, and is then finished as `cancelled` (202, `cancelling`).
/// Nothing it did is applied (no outputs, no memory writes); who cancelled it and why are in
/// the key's history, and its key's next input runs.
#[utoipa::path(post, path = "/v1/tenants/{tenant}/agents/{agent}/keys/{key}/inputs/{sequence}/cancel", tag = "inputs",
    params(TenantPath, AgentPath, KeyPath, SequencePath),
    request_body(content = Option<CancelInput>, description = "Optional: why"),
    responses(
        (status = 200, description = "Cancelled (it was parked)", body = CommandDone),
        (status = 202, description = "Cancelling: it stops at its next durable call", body = CommandDone),
        (status = 400, description = "Not a valid body", body = ErrorBody),
        (status = 409, description = "`not-cancellable`: not the key's first unfinished input, finished, completing, or stopped by a host fault", body = ErrorBody),
        (status = 413, description = "`too-large`: a body over 4 KiB", body = ErrorBody),
        (status = 503, description = "`unavailable`: the tenant's journal failed a write", body = ErrorBody),
        TenantErrors,
    ))]
pub(super) async fn cancel_input(
    State(state): State<Arc<ServerState>>,
    Path((tenant, agent, key, sequence)): Path<(String, String, String, u64)>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<(StatusCode, Json<CommandDone>), ApiError> {
    let (by, runtime, body) = command_request(&state, &headers, &tenant, body, "a cancel").await?;
    let cancel: CancelInput = optional_body(&body, "{\"reason\": \"...\"}")?;
    if cancel.reason.chars().count() > MAX_REASON {
        return Err(ApiError::bad_request(format!(
            "`reason` must be at most {MAX_REASON} characters"
        )));
    }
    let command = {
        let (agent, key, by) = (agent.clone(), key.clone(), by.clone());
        async move {
            let cancelled = runtime.cancel(&agent, &key, Some(sequence), &by, &cancel.reason);
            cancelled.await.map(|cancelling| match cancelling {
                Cancelling::Ended(sequence) => (sequence, "cancelled"),
                Cancelling::Requested(sequence) => (sequence, CANCELLING),
            })
        }
    };
    let done = run_command(&tenant, key, by, command).await?;
    let status = if done.done == CANCELLING {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    Ok((status, done))
}

/// What a command that retries its input did.
const RETRIED: &str = "retried";
/// What a cancel of an input that still runs did: asked it to stop.
const CANCELLING: &str = "cancelling";

/// Records what became of a call of a parked input left in doubt (`in-doubt = "fail"`), as
/// the operator found out: the remote's answer (`result`), its failure (`error`), or that it
/// never reached the remote (`not-made`: made again under the same idempotency key). Then
/// the input runs again, and the call is served the answer.
#[utoipa::path(post, path = "/v1/tenants/{tenant}/agents/{agent}/keys/{key}/inputs/{sequence}/calls/{call}/resolve", tag = "inputs",
    params(TenantPath, AgentPath, KeyPath, SequencePath, CallPath, ResolveQuery),
    request_body = ResolveCall,
    responses(
        (status = 200, description = "Recorded; the input runs again", body = CommandDone),
        (status = 400, description = "Not a valid body", body = ErrorBody),
        (status = 409, description = "`not-parked`: the input is not parked; or `not-in-doubt`: that call is not in doubt (or in doubt in several actions: name one)", body = ErrorBody),
        (status = 413, description = "`too-large`: a body over 1 MiB", body = ErrorBody),
        (status = 503, description = "`unavailable`: the tenant's journal failed a write", body = ErrorBody),
        TenantErrors,
    ))]
pub(super) async fn resolve_call(
    State(state): State<Arc<ServerState>>,
    Path((tenant, agent, key, sequence, call)): Path<(String, String, String, u64, usize)>,
    Query(query): Query<ResolveQuery>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Json<CommandDone>, ApiError> {
    let by = by(&state, &headers)?;
    let runtime = open_tenant(&state, &headers, &tenant).await?;
    let body = read_body(body, MAX_RESOLVE_BODY, "a resolve").await?;
    let asked: ResolveCall = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(format!(
            "expected {{\"result\": <JSON>}}, {{\"error\": \"...\"}} or \"not-made\": {e}"
        ))
    })?;
    let answer = match asked {
        ResolveCall::Result(answered) => Answer::Result(answered.result.to_string()),
        ResolveCall::Error(failed) => Answer::Error(failed.error),
        ResolveCall::NotMade(NeverMade::NotMade) => Answer::NotMade,
    };
    let command = {
        let (agent, key, by) = (agent.clone(), key.clone(), by.clone());
        async move {
            let resolved = runtime.resolve(&agent, &key, sequence, query.action, call, answer, &by);
            resolved.await.map(|sequence| (sequence, RETRIED))
        }
    };
    run_command(&tenant, key, by, command).await
}

/// A body that may be left out (or be whitespace or `null`): its default then; else it must
/// be the `expected` JSON.
fn optional_body<T: serde::de::DeserializeOwned + Default>(
    body: &[u8],
    expected: &str,
) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice::<Option<T>>(body)
        .map(Option::unwrap_or_default)
        .map_err(|e| ApiError::bad_request(format!("expected {expected}, null or no body: {e}")))
}

/// An operator's command for `tenant`: who makes it, the tenant's runtime, and its body.
async fn command_request(
    state: &ServerState,
    headers: &HeaderMap,
    tenant: &str,
    body: axum::body::Body,
    what: &str,
) -> Result<(String, Arc<TenantRuntime>, axum::body::Bytes), ApiError> {
    let by = by(state, headers)?;
    let runtime = open_tenant(state, headers, tenant).await?;
    let body = read_body(body, MAX_COMMAND_BODY, what).await?;
    Ok((by, runtime, body))
}

/// Carries out `command` in a task of its own (a client that goes away does not stop it
/// half way): it says which input of `key` it was, and what it did.
async fn run_command(
    tenant: &str,
    key: String,
    by: String,
    command: impl Future<Output = Result<(u64, &'static str), CommandRefused>> + Send + 'static,
) -> Result<Json<CommandDone>, ApiError> {
    let (sequence, done) = tokio::spawn(command)
        .await
        .map_err(|e| ApiError::internal(format!("the command failed: {e}")))?
        .map_err(|e| refused(tenant, e))?;
    Ok(Json(CommandDone {
        key,
        sequence,
        done: done.to_owned(),
        by,
    }))
}

/// Who makes a command, as its record names them.
fn by(state: &ServerState, headers: &HeaderMap) -> Result<String, ApiError> {
    Ok(match caller(state, headers)? {
        Caller::Admin => "admin".to_owned(),
        Caller::Tenant { token, .. } => format!("tenant token {token}"),
    })
}

fn known_agent(runtime: &TenantRuntime, agent: &str) -> Result<(), ApiError> {
    if !runtime.agents().contains_key(agent) {
        return Err(ApiError::not_found(format!("no agent {agent}")));
    }
    Ok(())
}

fn refused(tenant: &str, error: CommandRefused) -> ApiError {
    match &error {
        CommandRefused::UnknownAgent(_) | CommandRefused::UnknownVersion { .. } => {
            ApiError::not_found(error.to_string())
        }
        CommandRefused::OlderVersion { .. } => {
            ApiError::new(StatusCode::CONFLICT, "older-version", error.to_string())
        }
        CommandRefused::NotParked(_) => {
            ApiError::new(StatusCode::CONFLICT, "not-parked", error.to_string())
        }
        CommandRefused::NotCancellable(_) => {
            ApiError::new(StatusCode::CONFLICT, "not-cancellable", error.to_string())
        }
        CommandRefused::NotInDoubt(_) => {
            ApiError::new(StatusCode::CONFLICT, "not-in-doubt", error.to_string())
        }
        CommandRefused::Record(_) => {
            tracing::error!(tenant, "{error}");
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "the tenant's journal did not take the command; it takes commands again once \
                 the server is restarted",
            )
        }
        CommandRefused::State(_) => {
            tracing::error!(tenant, "{error}");
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "the agent's recorded calls could not be read back; try again",
            )
        }
    }
}
