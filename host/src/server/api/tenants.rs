//! Tenants and their tokens (admin only), and what a tenant may see of itself.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{
    ApiError, Caller, ErrorBody, MAX_TENANT_BODY, TenantErrors, caller, open_tenant, read_body,
};
use crate::server::ServerState;
use crate::server::quota::Quotas;

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct NewTenant {
    /// 1 to 63 characters of a-z, 0-9 and '-', starting with a letter or digit.
    name: String,
}

/// A token, shown once: only its hash is stored.
#[derive(Debug, Serialize, ToSchema)]
pub(super) struct IssuedToken {
    tenant: String,
    token: String,
}

/// A tenant as it sees itself: its quotas and what it uses of them.
#[derive(Debug, Serialize, ToSchema)]
pub(super) struct TenantView {
    tenant: String,
    quotas: Quotas,
    /// Bytes under the tenant's directory.
    stored_bytes: u64,
    /// Inputs accepted and not finished.
    queued_inputs: u64,
    /// Hosts its functions may reach.
    allowed_hosts: String,
    /// The names of its secrets (never their values).
    secrets: Vec<String>,
}

fn admin_only(state: &ServerState, headers: &HeaderMap) -> Result<(), ApiError> {
    if caller(state, headers)? != Caller::Admin {
        return Err(ApiError::admin_only());
    }
    Ok(())
}

/// Creates a tenant and its first token (admin only).
#[utoipa::path(post, path = "/v1/tenants", tag = "tenants", request_body = NewTenant,
    responses(
        (status = 201, description = "Created, with its first token", body = IssuedToken),
        (status = 400, description = "Not a valid name", body = ErrorBody),
        (status = 401, description = "No valid token", body = ErrorBody),
        (status = 403, description = "Not the admin token", body = ErrorBody),
        (status = 409, description = "The tenant exists", body = ErrorBody),
        (status = 413, description = "`too-large`: a body over 4 KiB", body = ErrorBody),
    ))]
pub(super) async fn create_tenant(
    State(state): State<Arc<ServerState>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<(StatusCode, Json<IssuedToken>), ApiError> {
    admin_only(&state, &headers)?;
    let body = read_body(body, MAX_TENANT_BODY, "a new tenant").await?;
    let request: NewTenant = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("expected {{\"name\": \"...\"}}: {e}")))?;
    let token = state.tenants.create(&request.name)?;
    state.runtime(&request.name).await?;
    Ok((
        StatusCode::CREATED,
        Json(IssuedToken {
            tenant: request.name,
            token,
        }),
    ))
}

/// Issues another token for a tenant (admin only).
#[utoipa::path(post, path = "/v1/tenants/{tenant}/tokens", tag = "tenants",
    params(("tenant" = String, Path)),
    responses(
        (status = 201, description = "Issued", body = IssuedToken),
        (status = 401, description = "No valid token", body = ErrorBody),
        (status = 403, description = "Not the admin token", body = ErrorBody),
        (status = 404, description = "No such tenant", body = ErrorBody),
    ))]
pub(super) async fn issue_token(
    State(state): State<Arc<ServerState>>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
) -> Result<(StatusCode, Json<IssuedToken>), ApiError> {
    admin_only(&state, &headers)?;
    let token = state.tenants.issue(&tenant)?;
    Ok((StatusCode::CREATED, Json(IssuedToken { tenant, token })))
}

/// A tenant's quotas and usage.
#[utoipa::path(get, path = "/v1/tenants/{tenant}", tag = "tenants",
    params(("tenant" = String, Path)),
    responses(
        (status = 200, description = "The tenant", body = TenantView),
        TenantErrors,
    ))]
pub(super) async fn show_tenant(
    State(state): State<Arc<ServerState>>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
) -> Result<Json<TenantView>, ApiError> {
    let runtime = open_tenant(&state, &headers, &tenant).await?;
    let policy = runtime.policy();
    Ok(Json(TenantView {
        tenant,
        quotas: policy.quotas,
        stored_bytes: runtime.stored_bytes(),
        queued_inputs: runtime.in_flight(),
        allowed_hosts: policy.allowed_hosts.to_string(),
        secrets: policy.secrets.keys().cloned().collect(),
    }))
}
