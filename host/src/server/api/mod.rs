//! The routes, authentication, and errors as JSON: `{"error": "...", "code": "..."}`.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use sha2::Digest as _;

use super::ServerState;
use super::tenants::{TenantError, check_name, hash};
use crate::sandbox::LoadError;

/// The API's routes over `state`.
pub fn router(state: Arc<ServerState>) -> Router {
    Router::new()
        .route("/v1/tenants", post(create_tenant))
        .route("/v1/tenants/{tenant}", get(show_tenant))
        .route("/v1/tenants/{tenant}/tokens", post(issue_token))
        .route("/v1/tenants/{tenant}/components", get(list_components))
        .route(
            "/v1/tenants/{tenant}/components/{name}",
            // The size limit is the server's own (413 with a JSON body), not axum's.
            put(upload_component).layer(DefaultBodyLimit::disable()),
        )
        .fallback(not_found)
        .with_state(state)
}

/// Who made a request.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Caller {
    Admin,
    Tenant(String),
}

/// An error response.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
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
        let mut response = (
            self.status,
            Json(json!({ "error": self.message, "code": self.code })),
        )
            .into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl From<TenantError> for ApiError {
    fn from(error: TenantError) -> Self {
        let (status, code) = match &error {
            TenantError::BadName(_) => (StatusCode::BAD_REQUEST, "bad-name"),
            TenantError::Exists(_) => (StatusCode::CONFLICT, "exists"),
            TenantError::Missing(_) => (StatusCode::NOT_FOUND, "not-found"),
            TenantError::Unreadable { .. } | TenantError::Write { .. } => {
                tracing::error!("tenant registry: {error}");
                return Self::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "the server could not record this; try again",
                );
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
        .tenant_of(token)
        .map(Caller::Tenant)
        .ok_or_else(ApiError::unauthorized)
}

/// The caller may act for `tenant`: the admin, or that tenant's own token.
fn reaches(caller: &Caller, tenant: &str) -> Result<(), ApiError> {
    match caller {
        Caller::Admin => Ok(()),
        Caller::Tenant(own) if own == tenant => Ok(()),
        Caller::Tenant(_) => Err(ApiError::forbidden()),
    }
}

/// Authenticates a request for a tenant's resources: the caller reaches `tenant` (403
/// otherwise, before anything about it is looked up), and it exists (404, which only the
/// admin and the tenant itself can see).
fn open_tenant(state: &ServerState, headers: &HeaderMap, tenant: &str) -> Result<(), ApiError> {
    reaches(&caller(state, headers)?, tenant)?;
    if state.tenants.exists(tenant) {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not-found",
            format!("no tenant {tenant}"),
        ))
    }
}

/// Compares two digests in time that does not depend on where they differ.
fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewTenant {
    name: String,
}

async fn create_tenant(
    State(state): State<Arc<ServerState>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<serde_json::Value>), ApiError> {
    if caller(&state, &headers)? != Caller::Admin {
        return Err(ApiError::admin_only());
    }
    let request: NewTenant = serde_json::from_slice(&body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad-request",
            format!("expected {{\"name\": \"...\"}}: {e}"),
        )
    })?;
    let token = state.tenants.create(&request.name)?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "tenant": request.name, "token": token })),
    ))
}

async fn issue_token(
    State(state): State<Arc<ServerState>>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
) -> Result<(StatusCode, Json<serde_json::Value>), ApiError> {
    if caller(&state, &headers)? != Caller::Admin {
        return Err(ApiError::admin_only());
    }
    let token = state.tenants.issue(&tenant)?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "tenant": tenant, "token": token })),
    ))
}

async fn show_tenant(
    State(state): State<Arc<ServerState>>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>, ApiError> {
    open_tenant(&state, &headers, &tenant)?;
    Ok(Json(json!({ "tenant": tenant })))
}

/// Uploads a component: the raw wasm body, checked against the world as `rewind check`
/// does, precompiled, and kept under the tenant's namespace.
async fn upload_component(
    State(state): State<Arc<ServerState>>,
    Path((tenant, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<(StatusCode, Json<serde_json::Value>), ApiError> {
    open_tenant(&state, &headers, &tenant)?;
    check_name(&name).map_err(|_| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad-name",
            format!(
                "component name {name:?} is not 1 to 63 characters of a-z, 0-9 and '-', starting with a letter or digit"
            ),
        )
    })?;
    let limit = state.max_component_bytes;
    let wasm = axum::body::to_bytes(body, limit).await.map_err(|_| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too-large",
            format!("a component may be at most {limit} bytes (max-component-mib)"),
        )
    })?;
    let origin = format!("component {name}");
    let checked = Arc::clone(&state);
    let bytes = wasm.clone();
    let loaded = tokio::task::spawn_blocking(move || checked.sandbox.load(&origin, &bytes))
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                format!("checking the component failed: {e}"),
            )
        })?;
    if let Err(error) = loaded {
        let code = match &error {
            LoadError::NotWasm { .. } => "not-wasm",
            LoadError::CoreModule { .. } => "core-module",
            LoadError::Invalid { .. } => "invalid-component",
            LoadError::World { .. } => "wrong-world",
            LoadError::Read { .. } => "internal",
        };
        let status = if code == "wrong-world" {
            StatusCode::UNPROCESSABLE_ENTITY
        } else {
            StatusCode::BAD_REQUEST
        };
        return Err(ApiError::new(status, code, error.to_string()));
    }
    let dir = state.tenant_dir(&tenant).join("components");
    let path = dir.join(format!("{name}.wasm"));
    write_atomically(&dir, &path, &wasm).map_err(|e| {
        tracing::error!(path = %path.display(), "storing a component: {e}");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "the server could not store the component; try again",
        )
    })?;
    let digest = hex::encode(sha2::Sha256::digest(&wasm));
    Ok((
        StatusCode::CREATED,
        Json(json!({ "component": name, "bytes": wasm.len(), "sha256": digest })),
    ))
}

/// The tenant's components, by name, with their sizes.
async fn list_components(
    State(state): State<Arc<ServerState>>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>, ApiError> {
    open_tenant(&state, &headers, &tenant)?;
    let dir = state.tenant_dir(&tenant).join("components");
    let mut components = Vec::new();
    match std::fs::read_dir(&dir) {
        Ok(entries) => {
            for entry in entries.flatten() {
                let path = entry.path();
                let Some(name) = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_suffix(".wasm"))
                    .filter(|n| !n.starts_with('.'))
                else {
                    continue;
                };
                let bytes = entry.metadata().map(|m| m.len()).unwrap_or_default();
                components.push(json!({ "component": name, "bytes": bytes }));
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::error!(dir = %dir.display(), "listing components: {e}");
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "the server could not list the components; try again",
            ));
        }
    }
    components.sort_by(|a, b| a["component"].as_str().cmp(&b["component"].as_str()));
    Ok(Json(json!({ "components": components })))
}

/// A temporary file, synced, renamed into place, and the directory synced.
fn write_atomically(
    dir: &std::path::Path,
    path: &std::path::Path,
    bytes: &[u8],
) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    // Unique, so that two uploads of one name at once do not write one temporary file.
    let temp = dir.join(format!(".upload-{:016x}.tmp", rand::random::<u64>()));
    let mut out = std::fs::File::create(&temp)?;
    std::io::Write::write_all(&mut out, bytes)?;
    out.sync_all()?;
    std::fs::rename(&temp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

async fn not_found(State(state): State<Arc<ServerState>>, headers: HeaderMap) -> ApiError {
    // Authentication first: an unauthenticated caller learns nothing about the routes.
    match caller(&state, &headers) {
        Err(error) => error,
        Ok(_) => ApiError::new(StatusCode::NOT_FOUND, "not-found", "no such route"),
    }
}
