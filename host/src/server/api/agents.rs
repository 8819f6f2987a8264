//! Agents: each agent.toml posted is a new version of its agent.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::extract::State;

use super::extract::{AgentPath, Path, TenantPath};
use axum::http::{HeaderMap, StatusCode};
use serde::Serialize;
use utoipa::ToSchema;

use super::{ApiError, ErrorBody, MAX_AGENT_BODY, TenantErrors, open_tenant, read_body};
use crate::server::ServerState;
use crate::server::agents::{DefineError, definition};

#[derive(Debug, Serialize, ToSchema)]
pub(super) struct Defined {
    agent: String,
    /// New inputs run on this version; inputs accepted before finish on theirs.
    version: u32,
}

#[derive(Debug, Serialize, ToSchema)]
pub(super) struct AgentSummary {
    agent: String,
    current: u32,
    versions: Vec<u32>,
}

#[derive(Debug, Serialize, ToSchema)]
pub(super) struct AgentList {
    agents: Vec<AgentSummary>,
}

#[derive(Debug, Serialize, ToSchema)]
pub(super) struct AgentView {
    agent: String,
    current: u32,
    versions: Vec<u32>,
    /// The current version's agent.toml, as posted.
    definition: String,
}

/// Defines an agent, or a new version of it, from its agent.toml. Each action's
/// `component` names a component the tenant uploaded; the version keeps it as it is now.
/// Functions may reach only the hosts the operator allows the tenant, and `secret-headers`
/// and `api-key-env` name the tenant's secrets.
#[utoipa::path(post, path = "/v1/tenants/{tenant}/agents", tag = "agents",
    params(TenantPath),
    request_body(content = String, content_type = "application/toml", description = "agent.toml"),
    responses(
        (status = 201, description = "Defined", body = Defined),
        (status = 400, description = "`bad-agent`: not a valid agent.toml", body = ErrorBody),
        (status = 413, description = "`too-large`: an agent.toml over 256 KiB", body = ErrorBody),
        (status = 422, description = "`unknown-component`; `cannot-build`: a host not allowed, a secret the tenant lacks; `quota-exceeded`: the agent asks for more than a quota allows (a limit, `parallelism`, `functions-per-agent`), which no retry fixes", body = ErrorBody),
        (status = 429, description = "`quota-exceeded`: over `stored-bytes`", body = ErrorBody),
        TenantErrors,
    ))]
pub(super) async fn define_agent(
    State(state): State<Arc<ServerState>>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<(StatusCode, Json<Defined>), ApiError> {
    let runtime = open_tenant(&state, &headers, &tenant).await?;
    let body = read_body(body, MAX_AGENT_BODY, "an agent.toml").await?;
    let body = String::from_utf8(body.to_vec()).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad-agent",
            format!("agent.toml is not UTF-8: {e}"),
        )
    })?;
    // In a task of its own: a client that goes away does not stop a definition half way.
    let defined = tokio::spawn(async move { runtime.define(body).await })
        .await
        .map_err(|e| ApiError::internal(format!("defining the agent failed: {e}")))?;
    match defined {
        Ok((agent, version)) => Ok((StatusCode::CREATED, Json(Defined { agent, version }))),
        Err(error) => Err(match error {
            DefineError::Invalid(_) => {
                ApiError::new(StatusCode::BAD_REQUEST, "bad-agent", error.to_string())
            }
            DefineError::UnknownComponent { .. } => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "unknown-component",
                error.to_string(),
            ),
            DefineError::Build(_) => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "cannot-build",
                error.to_string(),
            ),
            DefineError::State(state) if state.is_refusal() => {
                ApiError::new(StatusCode::BAD_REQUEST, "bad-agent", state.to_string())
            }
            DefineError::State(state) => {
                tracing::error!(tenant, "opening an agent's state: {state}");
                ApiError::internal("the server could not open the agent's state; try again")
            }
            // Asking for more than a quota allows is the definition's error: a retry
            // would get the same answer (429 would tell a client to retry).
            DefineError::Quota(quota) if quota.quota != "stored-bytes" => {
                ApiError::from(quota).with_status(StatusCode::UNPROCESSABLE_ENTITY)
            }
            DefineError::Quota(quota) => quota.into(),
            DefineError::Io(error) => {
                tracing::error!(tenant, "storing an agent: {error}");
                ApiError::internal("the server could not store the agent; try again")
            }
        }),
    }
}

/// The tenant's agents and their versions.
#[utoipa::path(get, path = "/v1/tenants/{tenant}/agents", tag = "agents",
    params(TenantPath),
    responses(
        (status = 200, description = "The agents", body = AgentList),
        TenantErrors,
    ))]
pub(super) async fn list_agents(
    State(state): State<Arc<ServerState>>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
) -> Result<Json<AgentList>, ApiError> {
    let runtime = open_tenant(&state, &headers, &tenant).await?;
    let agents = summaries(runtime.agents());
    Ok(Json(AgentList { agents }))
}

fn summaries(agents: BTreeMap<String, Vec<u32>>) -> Vec<AgentSummary> {
    agents
        .into_iter()
        .filter_map(|(agent, versions)| {
            Some(AgentSummary {
                agent,
                current: *versions.last()?,
                versions,
            })
        })
        .collect()
}

/// One agent: its versions and current agent.toml.
#[utoipa::path(get, path = "/v1/tenants/{tenant}/agents/{agent}", tag = "agents",
    params(TenantPath, AgentPath),
    responses(
        (status = 200, description = "The agent", body = AgentView),
        TenantErrors,
    ))]
pub(super) async fn show_agent(
    State(state): State<Arc<ServerState>>,
    Path((tenant, agent)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Json<AgentView>, ApiError> {
    let runtime = open_tenant(&state, &headers, &tenant).await?;
    let Some(summary) = summaries(runtime.agents())
        .into_iter()
        .find(|s| s.agent == agent)
    else {
        return Err(ApiError::not_found(format!("no agent {agent}")));
    };
    let definition = definition(runtime.dir(), &agent, summary.current).map_err(|e| {
        tracing::error!(tenant, agent, "reading an agent's definition: {e}");
        ApiError::internal("the server could not read the definition; try again")
    })?;
    Ok(Json(AgentView {
        agent,
        current: summary.current,
        versions: summary.versions,
        definition,
    }))
}
