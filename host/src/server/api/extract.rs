//! What a request's path and query string hold, and how the document describes them: the
//! extractors answer what they cannot read in the API's error shape (400 `bad-path`,
//! `bad-query`), never in axum's plain text; the parameters carry their patterns and
//! lengths into the OpenAPI document.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;
use utoipa::IntoParams;

use super::ApiError;

/// [`axum::extract::Path`], rejecting as [`ApiError`] (400 `bad-path`).
#[derive(Debug)]
pub(super) struct Path<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(Self(value)),
            Err(rejection) if rejection.status().is_server_error() => {
                tracing::error!("a route's path parameters: {}", rejection.body_text());
                Err(ApiError::internal("the server could not read this path"))
            }
            Err(rejection) => Err(ApiError::new(
                rejection.status(),
                "bad-path",
                rejection.body_text(),
            )),
        }
    }
}

/// [`axum::extract::Query`], rejecting as [`ApiError`] (400 `bad-query`).
#[derive(Debug)]
pub(super) struct Query<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(Self(value)),
            Err(rejection) => Err(ApiError::new(
                rejection.status(),
                "bad-query",
                rejection.body_text(),
            )),
        }
    }
}

/// `{tenant}`. Its pattern is a tenant name's (see `tenants::check_name`).
#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)] // Only its description is used.
pub(super) struct TenantPath {
    /// The tenant: 1 to 63 characters of a-z, 0-9 and '-', starting with a letter or digit.
    #[param(pattern = "^[a-z0-9][a-z0-9-]{0,62}$", min_length = 1, max_length = 63)]
    tenant: String,
}

/// `{agent}`.
#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)] // Only its description is used.
pub(super) struct AgentPath {
    /// The agent's name, as its agent.toml gives it: 1 to 63 characters of a-z, 0-9 and
    /// '-', starting with a letter or digit.
    #[param(pattern = "^[a-z0-9][a-z0-9-]{0,62}$", min_length = 1, max_length = 63)]
    agent: String,
}

/// `{name}`: a component.
#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)] // Only its description is used.
pub(super) struct ComponentPath {
    /// The component: 1 to 63 characters of a-z, 0-9 and '-', starting with a letter or
    /// digit.
    #[param(pattern = "^[a-z0-9][a-z0-9-]{0,62}$", min_length = 1, max_length = 63)]
    name: String,
}

/// `{key}`.
#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)] // Only its description is used.
pub(super) struct KeyPath {
    /// The key, as events give it (percent-encoded in the path).
    #[param(min_length = 1, max_length = 1024)]
    key: String,
}

/// `{id}`: a token's.
#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)] // Only its description is used.
pub(super) struct TokenPath {
    /// The token's id, as it was issued or is listed.
    #[param(pattern = "^tok_[0-9a-f]{16}$", min_length = 20, max_length = 20)]
    id: String,
}

/// `{sequence}`: an input's, within its key.
#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)] // Only its description is used.
pub(super) struct SequencePath {
    /// The input's sequence within its key, from 1.
    #[param(minimum = 1, maximum = 9_223_372_036_854_775_807_i64)]
    sequence: u64,
}

#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)] // Only its description is used.
pub(super) struct SignalPath {
    /// The signal's name: one an action of the agent declares (`signals` in agent.toml).
    #[param(min_length = 1, max_length = 128)]
    name: String,
}

#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)] // Only its description is used.
pub(super) struct CallPath {
    /// The call's index in its action's run, from 0 (a key's history lists them).
    #[param(minimum = 0, maximum = 4_294_967_295_i64)]
    call: usize,
}
