//! Tenants and their tokens (admin only), and what a tenant may see of itself.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;

use super::extract::{Path, TenantPath, TokenPath};
use axum::http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{
    ApiError, Caller, ErrorBody, MAX_TENANT_BODY, TenantErrors, caller, open_tenant, reach_tenant,
    read_body,
};
use crate::server::ServerState;
use crate::server::quota::Quotas;
use crate::server::tenants::{Issued, TokenInfo};

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct NewTenant {
    /// 1 to 63 characters of a-z, 0-9 and '-', starting with a letter or digit.
    #[schema(pattern = "^[a-z0-9][a-z0-9-]{0,62}$", min_length = 1, max_length = 63)]
    name: String,
}

/// A token, shown once: only its hash is stored.
#[derive(Debug, Serialize, ToSchema)]
pub(super) struct IssuedToken {
    tenant: String,
    /// Names the token, to list or revoke it; not a secret.
    id: String,
    token: String,
}

impl IssuedToken {
    fn new(tenant: String, issued: Issued) -> Self {
        Self {
            tenant,
            id: issued.id,
            token: issued.token,
        }
    }
}

/// A tenant's token as it is listed: never the token itself.
#[derive(Debug, Serialize, ToSchema)]
pub(super) struct TokenView {
    id: String,
    /// When it was issued, in milliseconds since the Unix epoch (0: issued before tokens
    /// had ids).
    created_ms: u64,
    /// When it was last used, in milliseconds since the Unix epoch, to the minute; null
    /// when never used.
    last_used_ms: Option<u64>,
}

impl From<TokenInfo> for TokenView {
    fn from(token: TokenInfo) -> Self {
        Self {
            id: token.id,
            created_ms: token.created_ms,
            last_used_ms: token.last_used_ms,
        }
    }
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
    let issued = state.tenants.create(&request.name)?;
    state.runtime(&request.name).await?;
    Ok((
        StatusCode::CREATED,
        Json(IssuedToken::new(request.name, issued)),
    ))
}

/// Issues another token for a tenant (admin only).
#[utoipa::path(post, path = "/v1/tenants/{tenant}/tokens", tag = "tenants",
    params(TenantPath),
    responses(
        (status = 201, description = "Issued", body = IssuedToken),
        (status = 400, description = "A path segment that cannot be read", body = ErrorBody),
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
    let issued = state.tenants.issue(&tenant)?;
    Ok((StatusCode::CREATED, Json(IssuedToken::new(tenant, issued))))
}

/// A tenant's tokens: their ids, when each was issued and last used; never a token (the
/// admin, or the tenant itself).
#[utoipa::path(get, path = "/v1/tenants/{tenant}/tokens", tag = "tenants",
    params(TenantPath),
    responses(
        (status = 200, description = "The tenant's tokens, oldest first", body = [TokenView]),
        TenantErrors,
    ))]
pub(super) async fn list_tokens(
    State(state): State<Arc<ServerState>>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
) -> Result<Json<Vec<TokenView>>, ApiError> {
    reach_tenant(&state, &headers, &tenant)?;
    let tokens = state.tenants.tokens(&tenant)?;
    Ok(Json(tokens.into_iter().map(TokenView::from).collect()))
}

/// Revokes a tenant's token (the admin, or the tenant itself, with this token or another):
/// from now on, and after a restart, it gets 401.
#[utoipa::path(delete, path = "/v1/tenants/{tenant}/tokens/{id}", tag = "tenants",
    params(TenantPath, TokenPath),
    responses(
        (status = 204, description = "Revoked"),
        TenantErrors,
    ))]
pub(super) async fn revoke_token(
    State(state): State<Arc<ServerState>>,
    Path((tenant, id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<StatusCode, ApiError> {
    reach_tenant(&state, &headers, &tenant)?;
    state.tenants.revoke(&tenant, &id)?;
    Ok(StatusCode::NO_CONTENT)
}

/// A tenant's quotas and usage.
#[utoipa::path(get, path = "/v1/tenants/{tenant}", tag = "tenants",
    params(TenantPath),
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
