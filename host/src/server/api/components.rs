//! Components: uploaded as raw wasm, checked against the world and precompiled.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use serde::Serialize;
use sha2::Digest as _;
use utoipa::ToSchema;

use super::{ApiError, ErrorBody, TenantErrors, open_tenant};
use crate::sandbox::LoadError;
use crate::server::ServerState;
use crate::server::tenants::check_name;

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
    params(("tenant" = String, Path), ("name" = String, Path, description = "1 to 63 of a-z, 0-9, '-'")),
    request_body(content = Vec<u8>, content_type = "application/wasm"),
    responses(
        (status = 201, description = "Stored", body = ComponentView),
        (status = 400, description = "`not-wasm`, `core-module`, `invalid-component` or `bad-name`", body = ErrorBody),
        (status = 413, description = "Larger than `max-component-mib`", body = ErrorBody),
        (status = 422, description = "`wrong-world`: imports outside the world, or no `run` export", body = ErrorBody),
        (status = 429, description = "Over the `stored-bytes` quota", body = ErrorBody),
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
    runtime.check_storage(wasm.len() as u64)?;
    let origin = format!("component {name}");
    let sandbox = Arc::clone(&state.sandbox);
    let bytes = wasm.clone();
    let loaded = tokio::task::spawn_blocking(move || sandbox.load(&origin, &bytes))
        .await
        .map_err(|e| ApiError::internal(format!("checking the component failed: {e}")))?;
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
    let dir = runtime.dir().join("components");
    let path = dir.join(format!("{name}.wasm"));
    write_atomically(&dir, &path, &wasm).map_err(|e| {
        tracing::error!(path = %path.display(), "storing a component: {e}");
        ApiError::internal("the server could not store the component; try again")
    })?;
    Ok((
        StatusCode::CREATED,
        Json(ComponentView {
            component: name,
            bytes: wasm.len() as u64,
            sha256: Some(hex::encode(sha2::Sha256::digest(&wasm))),
        }),
    ))
}

/// The tenant's components, by name, with their sizes.
#[utoipa::path(get, path = "/v1/tenants/{tenant}/components", tag = "components",
    params(("tenant" = String, Path)),
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
