//! `kind = "http"`: POSTs the call's args as JSON to a URL and returns the JSON body.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use reqwest::StatusCode;

use super::{AllowedHosts, CallRequest, Function, FunctionError, Reconciled};

/// Redirects followed before a call fails, as reqwest's default.
const MAX_REDIRECTS: usize = 10;

/// Bytes of an answer's body read before the call fails, unless `max-response-bytes` says
/// otherwise: 4 MiB.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 4 << 20;

/// Retries on transport errors and 5xx answers, with exponential backoff.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts after the first.
    pub retries: u32,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            retries: 3,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
        }
    }
}

impl RetryPolicy {
    fn backoff(&self, attempt: u32) -> Duration {
        let factor = 2u32.saturating_pow(attempt);
        self.initial_backoff
            .saturating_mul(factor)
            .min(self.max_backoff)
    }
}

/// How an [`HttpFunction`] reaches its endpoint.
#[derive(Clone)]
pub struct HttpConfig {
    pub url: String,
    /// Per attempt.
    pub timeout: Duration,
    pub retry: RetryPolicy,
    /// Sent with every request. Values may be secrets: they never reach a guest and are not
    /// printed by `Debug`.
    pub headers: Vec<(String, String)>,
    /// Asked, with the call's `Idempotency-Key`, what became of a call left in doubt
    /// (`in-doubt = "reconcile"`): `GET`; 200 with the call's JSON result, 404 when it never
    /// ran, another 4xx when it failed (recorded as the failure); 5xx or no answer: unknown
    /// yet, the run fails and the call stays pending.
    pub reconcile_url: Option<String>,
    /// When set, only these hosts are reached, redirects included.
    pub allowed_hosts: Option<AllowedHosts>,
    /// Bytes of an answer's body (a call's or a reconcile's) read; a longer one is a
    /// recorded failure, "response larger than N bytes", and is not asked for again.
    pub max_response_bytes: usize,
}

impl fmt::Debug for HttpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.headers.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("HttpConfig")
            .field("url", &self.url)
            .field("timeout", &self.timeout)
            .field("retry", &self.retry)
            .field("headers", &names)
            .field("reconcile_url", &self.reconcile_url)
            .field("allowed_hosts", &self.allowed_hosts)
            .field("max_response_bytes", &self.max_response_bytes)
            .finish()
    }
}

/// An HTTP answer that ended the retries: any status that is not 5xx, or the last 5xx.
#[derive(Debug)]
pub(super) struct Answer {
    pub status: StatusCode,
    pub body: String,
}

/// The part shared by every function that speaks JSON over HTTP.
#[derive(Clone, Debug)]
pub(super) struct JsonPoster {
    client: reqwest::Client,
    config: HttpConfig,
}

impl JsonPoster {
    pub fn new(config: HttpConfig) -> Self {
        let client = match &config.allowed_hosts {
            None => reqwest::Client::new(),
            Some(hosts) => {
                let hosts = hosts.clone();
                let redirects = reqwest::redirect::Policy::custom(move |attempt| {
                    if attempt.previous().len() >= MAX_REDIRECTS {
                        attempt.error("too many redirects")
                    } else if let Err(refused) = hosts.check(attempt.url().as_str()) {
                        attempt.error(format!("redirected to {refused}"))
                    } else {
                        attempt.follow()
                    }
                });
                reqwest::Client::builder()
                    .redirect(redirects)
                    .build()
                    // Building fails only when TLS cannot be set up, which `Client::new`
                    // also treats as fatal.
                    .expect("an HTTP client builds")
            }
        };
        Self { client, config }
    }

    pub fn url(&self) -> &str {
        &self.config.url
    }

    /// POSTs `body` with the idempotency key, retrying transport errors and 5xx.
    pub async fn post(&self, body: String, idempotency_key: &str) -> Result<Answer, FunctionError> {
        self.send(
            reqwest::Method::POST,
            &self.config.url,
            Some(body),
            idempotency_key,
        )
        .await
    }

    /// Sends `method url` with the idempotency key (and `body`, as JSON), retrying transport
    /// errors and 5xx.
    pub async fn send(
        &self,
        method: reqwest::Method,
        url: &str,
        body: Option<String>,
        idempotency_key: &str,
    ) -> Result<Answer, FunctionError> {
        let retry = self.config.retry;
        let mut attempt = 0;
        loop {
            let mut request = self
                .client
                .request(method.clone(), url)
                .timeout(self.config.timeout)
                .header("idempotency-key", idempotency_key);
            if let Some(body) = &body {
                request = request
                    .header("content-type", "application/json")
                    .body(body.clone());
            }
            for (name, value) in &self.config.headers {
                request = request.header(name, value);
            }
            let outcome = match request.send().await {
                Ok(response) => {
                    let status = response.status();
                    match read_body(response, self.config.max_response_bytes).await {
                        Ok(Body::Read(body)) => Ok(Answer { status, body }),
                        // Asked again, it would be as large: the call failed.
                        Ok(Body::TooLarge) => {
                            return Err(FunctionError::Failed(format!(
                                "{method} {url}: response larger than {} bytes",
                                self.config.max_response_bytes
                            )));
                        }
                        Err(e) => Err(describe(&e)),
                    }
                }
                // A redirect refused (off the allow-list, or too many) is an answer, not
                // an outage: the call failed, and trying again would fail the same way.
                Err(e) if e.is_redirect() => {
                    return Err(FunctionError::Failed(format!(
                        "{method} {url}: {}",
                        describe(&e)
                    )));
                }
                Err(e) => Err(describe(&e)),
            };
            let retryable = match &outcome {
                Ok(answer) => answer.status.is_server_error(),
                Err(_) => true,
            };
            if retryable && attempt < retry.retries {
                tracing::debug!(%url, attempt, "retrying after {:?}", outcome);
                tokio::time::sleep(retry.backoff(attempt)).await;
                attempt += 1;
                continue;
            }
            return outcome.map_err(|e| {
                FunctionError::Unavailable(format!(
                    "{method} {url} failed after {} attempts: {e}",
                    attempt + 1
                ))
            });
        }
    }
}

/// An answer's body, read as far as the cap.
enum Body {
    Read(String),
    TooLarge,
}

/// Reads `response`'s body as a stream, stopping as soon as it is larger than `max` bytes
/// (or says it will be): a remote cannot make the host hold more.
async fn read_body(mut response: reqwest::Response, max: usize) -> Result<Body, reqwest::Error> {
    if response
        .content_length()
        .is_some_and(|length| length > max as u64)
    {
        return Ok(Body::TooLarge);
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > max {
            return Ok(Body::TooLarge);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Body::Read(match String::from_utf8(body) {
        Ok(text) => text,
        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
    }))
}

fn describe(error: &reqwest::Error) -> String {
    use std::error::Error as _;
    let mut message = if error.is_timeout() {
        "timed out".to_owned()
    } else if error.is_connect() {
        "could not connect".to_owned()
    } else {
        error.to_string()
    };
    let mut source = error.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

/// Turns an answer into a result: 2xx with a JSON body is a result; anything else is a
/// recorded failure carrying the status and the body.
pub(super) fn json_result(url: &str, answer: Answer) -> Result<serde_json::Value, FunctionError> {
    let body: Option<serde_json::Value> = serde_json::from_str(&answer.body).ok();
    if !answer.status.is_success() {
        let body = body.unwrap_or(serde_json::Value::String(answer.body));
        return Err(FunctionError::Failed(
            serde_json::json!({ "status": answer.status.as_u16(), "body": body }).to_string(),
        ));
    }
    if answer.body.trim().is_empty() {
        return Ok(serde_json::Value::Null);
    }
    body.ok_or_else(|| {
        FunctionError::Failed(
            serde_json::json!({
                "status": answer.status.as_u16(),
                "error": format!("{url} answered with a body that is not JSON"),
                "body": answer.body,
            })
            .to_string(),
        )
    })
}

/// POSTs the args to a URL; the JSON body of a 2xx answer is the result.
#[derive(Clone, Debug)]
pub struct HttpFunction {
    poster: JsonPoster,
}

impl HttpFunction {
    pub fn new(config: HttpConfig) -> Self {
        Self {
            poster: JsonPoster::new(config),
        }
    }
}

#[async_trait]
impl Function for HttpFunction {
    async fn call(&self, request: CallRequest<'_>) -> Result<String, FunctionError> {
        let answer = self
            .poster
            .post(request.args.to_owned(), request.idempotency_key)
            .await?;
        json_result(self.poster.url(), answer).map(|value| value.to_string())
    }

    fn can_reconcile(&self) -> bool {
        self.poster.config.reconcile_url.is_some()
    }

    async fn reconcile(&self, request: CallRequest<'_>) -> Result<Reconciled, FunctionError> {
        let Some(url) = &self.poster.config.reconcile_url else {
            return Err(FunctionError::Unavailable(format!(
                "`{}` has no reconcile-url",
                request.function
            )));
        };
        let answer = self
            .poster
            .send(reqwest::Method::GET, url, None, request.idempotency_key)
            .await?;
        if answer.status == StatusCode::NOT_FOUND {
            return Ok(Reconciled::NotRun);
        }
        // Unlike a call's, a reconcile's last 5xx says nothing about the call: ask again later.
        if answer.status.is_server_error() {
            return Err(FunctionError::Unavailable(format!(
                "GET {url} answered {}",
                answer.status
            )));
        }
        match json_result(url, answer) {
            Ok(value) => Ok(Reconciled::Succeeded(value.to_string())),
            Err(FunctionError::Failed(error)) => Ok(Reconciled::Failed(error)),
            Err(other) => Err(other),
        }
    }

    fn endpoint(&self) -> Option<&str> {
        Some(self.poster.url())
    }
}
