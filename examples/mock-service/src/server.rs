//! The HTTP server: the route table, call counting, and the handle that runs it.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, RETRY_AFTER};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::counts::{Answer, Counts, MockState, Seen};
use crate::{
    DELAY_HEADER, IDEMPOTENCY_KEY_HEADER, MAX_DELAY_MS, THROTTLE_HEADER,
    THROTTLE_RETRY_AFTER_HEADER, THROTTLE_STATUS_HEADER, chat, tools,
};

/// The mock's routes (see the crate documentation), serving and counting into `state`.
///
/// Use this to embed the mock in another server; [`MockService::start`] runs it on its own.
pub fn router(state: MockState) -> Router {
    let counted = Router::new()
        .route("/v1/chat/completions", post(chat::complete))
        .route("/tools/orders.lookup", post(tools::orders_lookup))
        .route("/tools/enrich.company", post(tools::enrich_company))
        .route("/tools/enrich.person", post(tools::enrich_person))
        .route("/tools/{name}", post(tools::echo))
        .route("/tools/{name}/status", get(reconcile))
        // A route layer runs only for requests that matched a route, before the body is
        // read, so rejected bodies are counted too: they reached the remote all the same.
        .route_layer(middleware::from_fn_with_state(state.clone(), count_call));

    Router::new()
        .route("/counts", get(get_counts))
        .route("/counts/reset", post(reset_counts))
        .route("/healthz", get(|| async { "ok" }))
        .merge(counted)
        .fallback(not_found)
        .with_state(state)
}

async fn count_call(State(state): State<MockState>, request: Request, next: Next) -> Response {
    if request.method() == Method::POST {
        let headers = request.headers();
        let key = headers
            .get(IDEMPOTENCY_KEY_HEADER)
            .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned());
        let authorized = headers.contains_key(AUTHORIZATION);
        let route = request.uri().path();
        tracing::debug!(route, key = key.as_deref(), "call");
        let calls = state.record(route, key.as_deref(), authorized);
        if let Some(refused) = throttled(headers, calls) {
            return refused;
        }
        // A tool call's answer is kept by its key, for `GET /tools/NAME/status`: running
        // from now, answered once the tool has answered.
        let tool_call = key
            .filter(|_| route.starts_with("/tools/"))
            .map(|key| (route.to_owned(), key));
        if let Some((route, key)) = &tool_call {
            state.started(route, key);
        }
        let delay = (headers.get(DELAY_HEADER))
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.trim().parse::<u64>().ok());
        if let Some(delay) = delay {
            tokio::time::sleep(std::time::Duration::from_millis(delay.min(MAX_DELAY_MS))).await;
        }
        if let Some((route, key)) = tool_call {
            // In a task of its own: a caller that goes away mid-call (a killed host) drops
            // this handler, and the call would otherwise stay "running" for ever.
            let state = state.clone();
            let answering = tokio::spawn(async move {
                let response = next.run(request).await;
                let (parts, body) = response.into_parts();
                let body = axum::body::to_bytes(body, usize::MAX)
                    .await
                    .unwrap_or_default();
                let answer = Answer {
                    status: parts.status.as_u16(),
                    body: body.clone(),
                };
                state.answered(&route, &key, answer);
                Response::from_parts(parts, axum::body::Body::from(body))
            });
            return match answering.await {
                Ok(response) => response,
                Err(error) => {
                    (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response()
                }
            };
        }
    }
    next.run(request).await
}

/// `GET /tools/NAME/status` with a call's `Idempotency-Key`: a reconcile endpoint, as
/// `in-doubt = "reconcile"` asks it. 200 with the answer the call got; 503 with
/// `Retry-After` while the call still runs (a 404 then would have the host make it a
/// second time); 404 only for a key the tool never saw.
async fn reconcile(
    State(state): State<MockState>,
    axum::extract::Path(name): axum::extract::Path<String>,
    headers: HeaderMap,
) -> Response {
    let Some(key) = headers
        .get(IDEMPOTENCY_KEY_HEADER)
        .and_then(|v| v.to_str().ok())
    else {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": "no Idempotency-Key: which call?"})),
        )
            .into_response();
    };
    match state.seen(&format!("/tools/{name}"), key) {
        Seen::Never => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": format!("no call of {name} under this key")})),
        )
            .into_response(),
        Seen::Running => (
            StatusCode::SERVICE_UNAVAILABLE,
            [(RETRY_AFTER, HeaderValue::from_static("1"))],
            Json(json!({"status": "running"})),
        )
            .into_response(),
        Seen::Answered(answer) => {
            let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::BAD_GATEWAY);
            (
                status,
                [(axum::http::header::CONTENT_TYPE, "application/json")],
                answer.body,
            )
                .into_response()
        }
    }
}

/// The answer to a call refused by [`THROTTLE_HEADER`]: its key's `calls`-th.
fn throttled(headers: &HeaderMap, calls: u64) -> Option<Response> {
    let header = |name: &str| headers.get(name).and_then(|value| value.to_str().ok());
    let first = header(THROTTLE_HEADER)?.trim().parse::<u64>().ok()?;
    if calls == 0 || calls > first {
        return None;
    }
    let status = header(THROTTLE_STATUS_HEADER)
        .and_then(|status| status.trim().parse::<u16>().ok())
        .and_then(|status| StatusCode::from_u16(status).ok())
        .unwrap_or(StatusCode::TOO_MANY_REQUESTS);
    let retry_after = header(THROTTLE_RETRY_AFTER_HEADER)
        .unwrap_or("1")
        .to_owned();
    let body = Json(json!({
        "error": format!("refused call {calls} of this key (the first {first} are)"),
        "code": "throttled",
    }));
    let mut response = (status, body).into_response();
    if let Ok(value) = HeaderValue::from_str(&retry_after) {
        response.headers_mut().insert(RETRY_AFTER, value);
    }
    Some(response)
}

async fn get_counts(State(state): State<MockState>) -> Json<Counts> {
    Json(state.counts())
}

async fn reset_counts(State(state): State<MockState>) -> Json<Counts> {
    Json(state.reset())
}

async fn not_found(method: Method, uri: Uri) -> (StatusCode, Json<Value>) {
    (
        StatusCode::NOT_FOUND,
        Json(
            json!({ "error": format!("no route for {method} {}", uri.path()), "code": "not-found" }),
        ),
    )
}

/// Runs the mock as a server of its own.
#[derive(Debug)]
pub struct MockService;

impl MockService {
    /// Binds `addr` and serves the mock on the current tokio runtime until the returned
    /// handle is shut down or dropped. Port 0 picks a free port; [`MockHandle::addr`] tells
    /// which.
    ///
    /// Fails if the address cannot be bound. Must be called within a tokio runtime.
    pub async fn start(addr: SocketAddr) -> io::Result<MockHandle> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let state = MockState::new();
        let app = router(state.clone());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    // A dropped sender means the handle is gone: stop too.
                    stopped.await.ok();
                })
                .await
        });
        tracing::debug!(%addr, "rewind-mock started");
        Ok(MockHandle {
            addr,
            state,
            stop: Some(stop),
            task: Some(task),
        })
    }
}

/// A running mock server. Dropping it stops the server at once; [`MockHandle::shutdown`]
/// stops it gracefully.
#[derive(Debug)]
pub struct MockHandle {
    addr: SocketAddr,
    state: MockState,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<io::Result<()>>>,
}

impl MockHandle {
    /// The address the server listens on, with the actual port when started on port 0.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The URL to reach the server at, e.g. `http://127.0.0.1:7181` (no trailing slash).
    ///
    /// When listening on an unspecified address (`0.0.0.0` or `::`) this names the loopback
    /// address of the same family, which is reachable from this machine.
    pub fn base_url(&self) -> String {
        let ip = match self.addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        format!("http://{}", SocketAddr::new(ip, self.addr.port()))
    }

    /// A snapshot of the calls received so far.
    pub fn counts(&self) -> Counts {
        self.state.counts()
    }

    /// Zeroes the counters, returning the counts as they were just before.
    pub fn reset(&self) -> Counts {
        self.state.reset()
    }

    /// Stops accepting connections, lets requests in flight finish, and returns the final
    /// counts.
    ///
    /// Fails if the server had stopped with an I/O error, or its task panicked.
    pub async fn shutdown(mut self) -> io::Result<Counts> {
        if let Some(stop) = self.stop.take() {
            // An error means the server already stopped; awaiting the task says why.
            stop.send(()).ok();
        }
        if let Some(task) = self.task.take() {
            task.await.map_err(io::Error::other)??;
        }
        Ok(self.state.counts())
    }
}

impl Drop for MockHandle {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}
