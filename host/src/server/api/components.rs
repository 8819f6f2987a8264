//! Components: uploaded as raw wasm, checked against the world and precompiled.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;

use super::extract::{ComponentPath, Path, TenantPath};
use axum::http::{HeaderMap, StatusCode};
use serde::Serialize;
use utoipa::ToSchema;

use super::{ApiError, ErrorBody, TenantErrors, open_tenant};
use crate::sandbox::LoadError;
use crate::server::ServerState;
use crate::server::components::{self, UploadError};
use crate::server::tenants::check_name;

/// Seconds a client turned away for want of a compile slot is asked to wait.
const COMPILE_RETRY_AFTER_S: u64 = 5;

/// A stored component.
#[derive(Debug, Serialize, ToSchema)]
pub(super) struct ComponentView {
    component: String,
    bytes: u64,
    /// SHA-256 of its bytes, hex.
    #[serde(skip_serializing_if = "Option::is_none")]
    sha256: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub(super) struct ComponentList {
    components: Vec<ComponentView>,
}

/// Uploads a component under a name (replacing one of that name): the raw wasm body,
/// checked against the world as `rewind check` does, and precompiled. Agents defined
/// before keep the component they were defined with.
#[utoipa::path(put, path = "/v1/tenants/{tenant}/components/{name}", tag = "components",
    params(TenantPath, ComponentPath),
    request_body(content = Vec<u8>, content_type = "application/wasm"),
    responses(
        (status = 201, description = "Stored", body = ComponentView),
        (status = 400, description = "`not-wasm`, `core-module`, `invalid-component` or `bad-name`", body = ErrorBody),
        (status = 413, description = "Larger than `max-component-mib`", body = ErrorBody),
        (status = 422, description = "`wrong-world`: imports outside the world, or no `run` export", body = ErrorBody),
        (status = 429, description = "Over the `stored-bytes` or `compiles-per-minute` quota", body = ErrorBody),
        (status = 503, description = "`busy`: every compile slot is taken and the queue is full; `Retry-After` says when to try again", body = ErrorBody),
        TenantErrors,
    ))]
pub(super) async fn upload_component(
    State(state): State<Arc<ServerState>>,
    Path((tenant, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<(StatusCode, Json<ComponentView>), ApiError> {
    let runtime = open_tenant(&state, &headers, &tenant).await?;
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
    let bytes = wasm.len() as u64;
    let sha256 = components::upload(&runtime, &state.compiles, &name, wasm)
        .await
        .map_err(upload_error)?;
    Ok((
        StatusCode::CREATED,
        Json(ComponentView {
            component: name,
            bytes,
            sha256: Some(sha256),
        }),
    ))
}

/// The tenant's components, by name, with their sizes.
#[utoipa::path(get, path = "/v1/tenants/{tenant}/components", tag = "components",
    params(TenantPath),
    responses(
        (status = 200, description = "The components", body = ComponentList),
        TenantErrors,
    ))]
pub(super) async fn list_components(
    State(state): State<Arc<ServerState>>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
) -> Result<Json<ComponentList>, ApiError> {
    let runtime = open_tenant(&state, &headers, &tenant).await?;
    let dir = runtime.dir().join("components");
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
                components.push(ComponentView {
                    component: name.to_owned(),
                    bytes: entry.metadata().map(|m| m.len()).unwrap_or_default(),
                    sha256: None,
                });
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::error!(dir = %dir.display(), "listing components: {e}");
            return Err(ApiError::internal(
                "the server could not list the components; try again",
            ));
        }
    }
    components.sort_by(|a, b| a.component.cmp(&b.component));
    Ok(Json(ComponentList { components }))
}

fn upload_error(error: UploadError) -> ApiError {
    match error {
        UploadError::Quota(quota) => quota.into(),
        UploadError::Busy(busy) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "busy", busy.to_string())
                .retry_after(COMPILE_RETRY_AFTER_S)
        }
        UploadError::Load(error) => {
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
            ApiError::new(status, code, error.to_string())
        }
        UploadError::Io(error) => {
            tracing::error!("storing a component: {error}");
            ApiError::internal("the server could not store the component; try again")
        }
    }
}
