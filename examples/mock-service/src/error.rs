//! Why a request was rejected, and how that is told to the client.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::error::Category;

/// Why the mock rejected a request. Every variant is answered with `400 Bad Request` and the
/// body `{"error": <this error's message>, "code": <`Self::code`>}`.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The body was empty (or only whitespace) where a JSON document was expected.
    #[error("request body is empty; expected a JSON document")]
    EmptyBody,
    /// The body is not well-formed JSON.
    #[error("request body is not valid JSON: {0}")]
    MalformedJson(serde_json::Error),
    /// The body is JSON but not the shape the route expects (e.g. a required field is missing).
    #[error("request body does not match what this route expects: {0}")]
    WrongShape(serde_json::Error),
    /// A field is present but its value cannot be used.
    #[error("field `{field}` is invalid: {reason}")]
    InvalidField {
        /// The JSON field name.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
}

impl RequestError {
    /// A stable machine-readable code: `empty-body`, `malformed-json`, `wrong-shape` or
    /// `invalid-field`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::EmptyBody => "empty-body",
            Self::MalformedJson(_) => "malformed-json",
            Self::WrongShape(_) => "wrong-shape",
            Self::InvalidField { .. } => "invalid-field",
        }
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: String,
    code: &'a str,
}

impl IntoResponse for RequestError {
    fn into_response(self) -> Response {
        tracing::debug!(code = self.code(), error = %self, "rejected request");
        let body = ErrorBody {
            error: self.to_string(),
            code: self.code(),
        };
        (StatusCode::BAD_REQUEST, Json(body)).into_response()
    }
}

/// Parses a request body as JSON into `T`.
///
/// The `Content-Type` header is not checked: the mock takes any body that parses.
pub(crate) fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, RequestError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(RequestError::EmptyBody);
    }
    serde_json::from_slice(body).map_err(|error| match error.classify() {
        Category::Data => RequestError::WrongShape(error),
        Category::Syntax | Category::Eof | Category::Io => RequestError::MalformedJson(error),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    struct NeedsId {
        #[expect(dead_code, reason = "only its presence is tested")]
        id: String,
    }

    #[test]
    fn classifies_bad_bodies() {
        assert!(matches!(
            parse_json::<NeedsId>(b" \n"),
            Err(RequestError::EmptyBody)
        ));
        assert!(matches!(
            parse_json::<NeedsId>(b"{\"id\": "),
            Err(RequestError::MalformedJson(_))
        ));
        assert!(matches!(
            parse_json::<NeedsId>(b"{not json}"),
            Err(RequestError::MalformedJson(_))
        ));
        let shape = parse_json::<NeedsId>(b"{}").expect_err("id is missing");
        assert_eq!(shape.code(), "wrong-shape");
        assert!(shape.to_string().contains("missing field `id`"), "{shape}");
    }
}
