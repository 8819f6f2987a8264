//! The routes, authentication, and errors as JSON: `{"error": "...", "code": "..."}`.
//!
//! Every route is declared with `#[utoipa::path]` and registered through `routes!`, so the
//! OpenAPI document served at `/v1/openapi.json` is generated from the same code that routes.

mod agents;
mod components;
mod events;
mod extract;
mod inputs;
mod signals;
mod tenants;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use serde::Serialize;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::quota::QuotaExceeded;
use super::runtime::TenantRuntime;
use super::tenants::{TenantError, hash};
use super::{ServerState, StartError};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Rewind",
        description = "Hosts many tenants' agents: components, agents, events, outputs, histories."
    ),
    modifiers(&BearerAuth),
    security(("bearer" = []))
)]
struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        openapi
            .components
            .get_or_insert_default()
            .add_security_scheme(
                "bearer",
                SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
            );
    }
}

/// The routes and the OpenAPI document that describes them.
fn routes() -> (Router<Arc<ServerState>>, utoipa::openapi::OpenApi) {
    let (schemas, paths, upload) = routes!(components::upload_component);
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(tenants::create_tenant))
        .routes(routes!(tenants::show_tenant))
        .routes(routes!(tenants::issue_token, tenants::list_tokens))
        .routes(routes!(tenants::revoke_token))
        .routes(routes!(components::list_components))
        // The size limit is the server's own (413 with a JSON body), not axum's.
        .routes((schemas, paths, upload.layer(DefaultBodyLimit::disable())))
        .routes(routes!(agents::define_agent, agents::list_agents))
        .routes(routes!(agents::show_agent))
        .routes(routes!(events::submit_event))
        .routes(routes!(events::list_outputs))
        .routes(routes!(events::stream_outputs))
        .routes(routes!(inputs::key_history))
        .routes(routes!(inputs::list_inputs))
        .routes(routes!(inputs::retry_input))
        .routes(routes!(inputs::skip_input))
        .routes(routes!(inputs::resolve_call))
        .routes(routes!(inputs::cancel_input))
        .routes(routes!(signals::signal_key))
        .routes(routes!(signals::signal_input))
        .split_for_parts()
}

/// The OpenAPI document of the API.
pub fn openapi() -> utoipa::openapi::OpenApi {
    routes().1
}

/// The API's routes over `state`, and `/v1/openapi.json`.
pub fn router(state: Arc<ServerState>) -> Router {
    let (router, document) = routes();
    let document = document.to_json().unwrap_or_default();
    router
        .route(
            "/v1/openapi.json",
            axum::routing::get(move || async move {
                ([(header::CONTENT_TYPE, "application/json")], document)
            }),
        )
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .with_state(state)
}

/// The body of every error.
#[derive(Debug, Serialize, ToSchema)]
pub(super) struct ErrorBody {
    /// What is wrong, for a person.
    error: String,
    /// What is wrong, for a program: `unauthorized`, `forbidden`, `not-found`,
    /// `quota-exceeded`, `bad-request`, ...
    code: String,
    /// With `quota-exceeded`: the quota's name as in rewind.toml.
    #[serde(skip_serializing_if = "Option::is_none")]
    quota: Option<String>,
}

/// Who made a request.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Caller {
    Admin,
    /// A tenant's token, with its id (not a secret).
    Tenant {
        tenant: String,
        token: String,
    },
}

/// What every request for a tenant's resources may answer, besides its own responses.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)] // Only its description is used.
pub(super) enum TenantErrors {
    /// A path segment or query parameter that cannot be read: not UTF-8, not a number,
    /// out of range (`bad-path`, `bad-query`).
    #[response(status = 400)]
    BadRequest(ErrorBody),
    /// No valid token.
    #[response(status = 401)]
    Unauthorized(ErrorBody),
    /// The token does not reach this tenant: the same answer whether or not it exists.
    #[response(status = 403)]
    Forbidden(ErrorBody),
    /// No such tenant, or no such thing of the tenant's as the path names.
    #[response(status = 404)]
    NotFound(ErrorBody),
}

/// The largest body of each route that takes one (components have `max-component-mib`):
/// past it, 413 `too-large` naming the limit.
pub(super) const MAX_TENANT_BODY: usize = 4 << 10;
pub(super) const MAX_AGENT_BODY: usize = 256 << 10;
pub(super) const MAX_EVENT_BODY: usize = 2 << 20;
pub(super) const MAX_COMMAND_BODY: usize = 4 << 10;

/// Reads a request body of at most `limit` bytes; `what` names the body in the error.
async fn read_body(
    body: axum::body::Body,
    limit: usize,
    what: &str,
) -> Result<axum::body::Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|_| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too-large",
            format!("{what} may be at most {limit} bytes"),
        )
    })
}

/// An error response.
#[derive(Debug)]
pub(super) struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    quota: Option<&'static str>,
    /// Seconds to wait before trying again (`Retry-After`).
    retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            quota: None,
            retry_after: None,
        }
    }

    fn with_status(self, status: StatusCode) -> Self {
        Self { status, ..self }
    }

    fn retry_after(self, seconds: u64) -> Self {
        Self {
            retry_after: Some(seconds),
            ..self
        }
    }

    fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }

    fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not-found", message)
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad-request", message)
    }

    fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a valid token is required: Authorization: Bearer <token>",
        )
    }

    /// The same answer whether or not what was asked for exists.
    fn forbidden() -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "this token does not reach that tenant",
        )
    }

    fn admin_only() -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "only the admin token may do this",
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: self.message,
            code: self.code.to_owned(),
            quota: self.quota.map(str::to_owned),
        };
        let mut response = (self.status, Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

impl From<QuotaExceeded> for ApiError {
    fn from(error: QuotaExceeded) -> Self {
        Self {
            quota: Some(error.quota),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "quota-exceeded",
                error.to_string(),
            )
        }
    }
}

impl From<StartError> for ApiError {
    fn from(error: StartError) -> Self {
        tracing::error!("opening a tenant: {error}");
        Self::internal("the server could not open this tenant; try again")
    }
}

impl From<TenantError> for ApiError {
    fn from(error: TenantError) -> Self {
        let (status, code) = match &error {
            TenantError::BadName(_) => (StatusCode::BAD_REQUEST, "bad-name"),
            TenantError::Exists(_) => (StatusCode::CONFLICT, "exists"),
            TenantError::Missing(_) | TenantError::NoToken { .. } => {
                (StatusCode::NOT_FOUND, "not-found")
            }
            TenantError::Unreadable { .. } | TenantError::Format(_) | TenantError::Write { .. } => {
                tracing::error!("tenant registry: {error}");
                return Self::internal("the server could not record this; try again");
            }
        };
        Self::new(status, code, error.to_string())
    }
}

/// Authenticates a request by its bearer token.
fn caller(state: &ServerState, headers: &HeaderMap) -> Result<Caller, ApiError> {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|token| !token.is_empty())
        .ok_or_else(ApiError::unauthorized)?;
    if same(&hash(token), &state.admin) {
        return Ok(Caller::Admin);
    }
    state
        .tenants
        .authenticate(token)
        .map(|(tenant, token)| Caller::Tenant { tenant, token })
        .ok_or_else(ApiError::unauthorized)
}

/// The caller may act for `tenant`: the admin, or that tenant's own token.
fn reaches(caller: &Caller, tenant: &str) -> Result<(), ApiError> {
    match caller {
        Caller::Admin => Ok(()),
        Caller::Tenant { tenant: own, .. } if own == tenant => Ok(()),
        Caller::Tenant { .. } => Err(ApiError::forbidden()),
    }
}

/// Authenticates a request for a tenant's resources: the caller reaches `tenant` (403
/// otherwise, before anything about it is looked up), and it exists (404, which only the
/// admin and the tenant itself can see).
fn reach_tenant(state: &ServerState, headers: &HeaderMap, tenant: &str) -> Result<(), ApiError> {
    reaches(&caller(state, headers)?, tenant)?;
    if !state.tenants.exists(tenant) {
        return Err(ApiError::not_found(format!("no tenant {tenant}")));
    }
    Ok(())
}

/// [`reach_tenant`], then the tenant's runtime.
async fn open_tenant(
    state: &ServerState,
    headers: &HeaderMap,
    tenant: &str,
) -> Result<Arc<TenantRuntime>, ApiError> {
    reach_tenant(state, headers, tenant)?;
    Ok(state.runtime(tenant).await?)
}

/// Compares two digests in time that does not depend on where they differ.
fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A route asked with a method it does not have: 405 in the API's error shape.
async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method-not-allowed",
        "this route does not take that method (the OpenAPI document lists each route's)",
    )
}

async fn not_found(State(state): State<Arc<ServerState>>, headers: HeaderMap) -> ApiError {
    // Authentication first: an unauthenticated caller learns nothing about the routes.
    match caller(&state, &headers) {
        Err(error) => error,
        Ok(_) => ApiError::not_found("no such route"),
    }
}
