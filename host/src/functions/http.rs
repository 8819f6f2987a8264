//! `kind = "http"`: POSTs the call's args as JSON to a URL and returns the JSON body.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use eventsource_stream::{Event, EventStreamError, Eventsource as _};
use reqwest::StatusCode;

use super::{AllowedHosts, CallRequest, Function, FunctionError, Reconciled, RunSlot};
use crate::backoff::{self, Backoff};

/// Redirects followed before a call fails, as reqwest's default.
const MAX_REDIRECTS: usize = 10;

/// Bytes of an answer's body read before the call fails, unless `max-response-bytes` says
/// otherwise: 4 MiB.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 4 << 20;

/// How a function's requests are tried again: after a transport error, a 5xx, or a 408,
/// 409 or 429 answer (any other answer is final at once). The wait is exponential backoff
/// with full jitter, and at least what a 429's or 503's `Retry-After` asks. Only the last
/// answer is the call's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Requests in all, the first included.
    pub attempts: u32,
    pub backoff: Backoff,
    /// No request starts later than this after the first: a wait that would end past it
    /// ends the retries.
    pub deadline: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            attempts: 4,
            backoff: Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_secs(2),
            },
            deadline: Duration::from_secs(60),
        }
    }
}

/// Whether an answer with `status` is worth asking again for.
fn retryable(status: StatusCode) -> bool {
    status.is_server_error()
        || matches!(
            status,
            StatusCode::REQUEST_TIMEOUT | StatusCode::CONFLICT | StatusCode::TOO_MANY_REQUESTS
        )
}

/// Where a function waits between attempts: the runtime's timer, or (in tests) a record of
/// the waits asked for.
#[async_trait]
pub(super) trait Pause: Send + Sync + fmt::Debug {
    async fn pause(&self, wait: Duration);
}

/// [`Pause`] on tokio's timer.
#[derive(Debug)]
struct Sleep;

#[async_trait]
impl Pause for Sleep {
    async fn pause(&self, wait: Duration) {
        tokio::time::sleep(wait).await;
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

/// An HTTP answer that ended the retries: one not worth asking again for, or the last.
#[derive(Debug)]
pub(super) struct Answer {
    pub status: StatusCode,
    pub body: String,
    /// A 2xx event stream, unread (`body` empty), when the caller reads streams itself
    /// ([`JsonPoster::post`] with `streams`).
    pub stream: Option<reqwest::Response>,
    /// Its `Content-Type` header, when it had one.
    pub content_type: Option<String>,
    /// Its `Retry-After` header, when it had one.
    retry_after: Option<String>,
    /// Its headers.
    headers: reqwest::header::HeaderMap,
}

impl Answer {
    /// Its header `name`, when it had one that is text.
    pub fn header(&self, name: &str) -> Option<String> {
        (self.headers.get(name))
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned)
    }
}

/// The part shared by every function that speaks JSON over HTTP.
#[derive(Clone, Debug)]
pub(super) struct JsonPoster {
    client: reqwest::Client,
    config: HttpConfig,
    pause: Arc<dyn Pause>,
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
        Self {
            client,
            config,
            pause: Arc::new(Sleep),
        }
    }

    /// Sends `headers` with every request instead.
    #[cfg(test)]
    pub fn with_headers(mut self, headers: Vec<(String, String)>) -> Self {
        self.config.headers = headers;
        self
    }

    /// Bounds each attempt (and a stream's gaps) by `timeout` instead.
    #[cfg(test)]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.config.timeout = timeout;
        self
    }

    /// Waits between attempts with `pause` instead of the timer.
    #[cfg(test)]
    pub fn pausing_with(mut self, pause: Arc<dyn Pause>) -> Self {
        self.pause = pause;
        self
    }

    pub fn url(&self) -> &str {
        &self.config.url
    }

    /// How long a request may take to answer, per attempt; for a stream read by its caller,
    /// how long it may go without a chunk.
    pub fn timeout(&self) -> Duration {
        self.config.timeout
    }

    /// The bytes of an answer read at most.
    pub fn max_response_bytes(&self) -> usize {
        self.config.max_response_bytes
    }

    /// POSTs `body` with the idempotency key, trying again as the [`RetryPolicy`] says (its
    /// run `slot`, when given, let go of between attempts). With `streams`, a 2xx answer
    /// that is an event stream comes back unread ([`Answer::stream`]), for the caller to
    /// read as it comes: the request's timeout then bounds the wait for its headers, not
    /// the stream.
    pub async fn post(
        &self,
        body: String,
        idempotency_key: &str,
        slot: Option<&dyn RunSlot>,
        streams: bool,
    ) -> Result<Answer, FunctionError> {
        let ask = Ask {
            method: reqwest::Method::POST,
            url: &self.config.url,
            body: Some(body),
            idempotency_key,
            slot,
            streams,
            headers: &[],
        };
        self.send(ask).await
    }

    /// Sends what `ask` says, trying again as the [`RetryPolicy`] says, letting go of the
    /// run slot (when given) while it waits between attempts. The last answer is returned;
    /// when the last attempt got no answer (a transport error), the remote is
    /// [`FunctionError::Unavailable`].
    pub async fn send(&self, ask: Ask<'_>) -> Result<Answer, FunctionError> {
        let Ask {
            method,
            url,
            body,
            idempotency_key,
            slot,
            streams,
            headers,
        } = ask;
        let retry = self.config.retry;
        let started = Instant::now();
        let mut attempt = 1;
        loop {
            let outcome = match self
                .attempt(
                    &method,
                    url,
                    body.as_deref(),
                    idempotency_key,
                    streams,
                    headers,
                )
                .await?
            {
                Ok(answer) if !retryable(answer.status) => return Ok(answer),
                outcome => outcome,
            };
            let asked = match &outcome {
                Ok(answer)
                    if matches!(
                        answer.status,
                        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
                    ) =>
                {
                    (answer.retry_after.as_deref())
                        .and_then(|value| backoff::retry_after(value, SystemTime::now()))
                }
                _ => None,
            };
            // The backoff's own wait is cut to the time left; a Retry-After is not.
            let left = retry.deadline.saturating_sub(started.elapsed());
            let asked = asked.unwrap_or_default();
            let wait = retry.backoff.delay(attempt).min(left).max(asked);
            let over = if attempt >= retry.attempts {
                Some(format!("after {attempt} attempts"))
            } else if wait > left || left.is_zero() {
                Some(format!(
                    "after {attempt} attempts: the next, in {wait:?}, would start past the \
                     {:?} deadline",
                    retry.deadline
                ))
            } else {
                None
            };
            if let Some(over) = over {
                return outcome.map_err(|error| {
                    FunctionError::Unavailable(format!("{method} {url} failed {over}: {error}"))
                });
            }
            tracing::debug!(%url, attempt, ?wait, "trying again after {outcome:?}");
            match slot {
                Some(slot) => {
                    if !slot.away(self.pause.pause(wait)).await {
                        return Err(FunctionError::Unavailable(format!(
                            "{method} {url}: the host is stopping; not tried again after \
                             {attempt} attempts"
                        )));
                    }
                }
                None => self.pause.pause(wait).await,
            }
            attempt += 1;
        }
    }

    /// One request: its answer, or why none came (a transport error). `Err` only for what
    /// asking again would not change (a redirect refused, an answer over the cap).
    async fn attempt(
        &self,
        method: &reqwest::Method,
        url: &str,
        body: Option<&str>,
        idempotency_key: &str,
        streams: bool,
        headers: &[(String, String)],
    ) -> Result<Result<Answer, String>, FunctionError> {
        let mut request =
            (self.client.request(method.clone(), url)).header("idempotency-key", idempotency_key);
        // A stream read by the caller is bounded by its gaps, not by its whole length.
        if !streams {
            request = request.timeout(self.config.timeout);
        }
        if let Some(body) = body {
            request = request
                .header("content-type", "application/json")
                .body(body.to_owned());
        }
        for (name, value) in self.config.headers.iter().chain(headers) {
            request = request.header(name, value);
        }
        let sent = match tokio::time::timeout(self.config.timeout, request.send()).await {
            Ok(sent) => sent,
            Err(_) => return Ok(Err(format!("timed out after {:?}", self.config.timeout))),
        };
        match sent {
            Ok(response) => {
                let status = response.status();
                let header = |name| {
                    (response.headers().get(name))
                        .and_then(|value| value.to_str().ok())
                        .map(str::to_owned)
                };
                let retry_after = header(reqwest::header::RETRY_AFTER);
                let content_type = header(reqwest::header::CONTENT_TYPE);
                let event_stream =
                    (content_type.as_deref()).is_some_and(|t| t.starts_with("text/event-stream"));
                let headers = response.headers().clone();
                if streams && status.is_success() && event_stream {
                    return Ok(Ok(Answer {
                        status,
                        body: String::new(),
                        stream: Some(response),
                        content_type,
                        retry_after,
                        headers,
                    }));
                }
                let read = read_body(response, self.config.max_response_bytes);
                let read = match tokio::time::timeout(self.config.timeout, read).await {
                    Ok(read) => read,
                    Err(_) => return Ok(Err(format!("timed out after {:?}", self.config.timeout))),
                };
                match read {
                    Ok(Body::Read(body)) => Ok(Ok(Answer {
                        status,
                        body,
                        stream: None,
                        content_type,
                        retry_after,
                        headers,
                    })),
                    // Asked again, it would be as large: the call failed.
                    Ok(Body::TooLarge) => Err(FunctionError::Failed(format!(
                        "{method} {url}: response larger than {} bytes",
                        self.config.max_response_bytes
                    ))),
                    Err(e) => Ok(Err(describe(&e))),
                }
            }
            // A redirect refused (off the allow-list, or too many) is an answer, not an
            // outage: the call failed, and trying again would fail the same way.
            Err(e) if e.is_redirect() => Err(FunctionError::Failed(format!(
                "{method} {url}: {}",
                describe(&e)
            ))),
            Err(e) => Ok(Err(describe(&e))),
        }
    }
}

/// A request for [`JsonPoster::send`].
pub(super) struct Ask<'a> {
    pub method: reqwest::Method,
    pub url: &'a str,
    /// JSON text, sent as the body.
    pub body: Option<String>,
    pub idempotency_key: &'a str,
    /// The run slot to let go of between attempts.
    pub slot: Option<&'a dyn RunSlot>,
    /// Whether a 2xx event stream comes back unread ([`Answer::stream`]).
    pub streams: bool,
    /// Headers sent besides the function's own.
    pub headers: &'a [(String, String)],
}

/// The events of a server-sent event stream, read as they come: at most `max_bytes` of it
/// in all, and at most `between_reads` without a chunk.
pub(super) struct EventReader {
    events: std::pin::Pin<
        Box<dyn futures_util::Stream<Item = Result<Event, EventStreamError<Cut>>> + Send>,
    >,
    between_reads: Duration,
}

/// Why an event stream stopped short of its end.
#[derive(Debug, thiserror::Error)]
pub(super) enum Cut {
    #[error("{0}")]
    Transport(String),
    #[error("larger than {0} bytes")]
    TooLarge(usize),
    #[error("not an event stream: {0}")]
    Unreadable(String),
    #[error("no chunk within {0:?}")]
    Quiet(Duration),
}

impl Cut {
    /// The call's error: a stream too large, or not one, is the answer (recorded); one cut
    /// short leaves the call to be made again under its key.
    pub fn into_error(self, url: &str) -> FunctionError {
        match self {
            Self::TooLarge(max) => {
                FunctionError::Failed(format!("{url}: response larger than {max} bytes"))
            }
            Self::Unreadable(_) => FunctionError::Failed(format!("{url}: {self}")),
            Self::Transport(_) | Self::Quiet(_) => {
                FunctionError::Unavailable(format!("{url}: the stream broke off: {self}"))
            }
        }
    }
}

impl EventReader {
    pub fn new<B, E>(
        bytes: impl futures_util::Stream<Item = Result<B, E>> + Send + 'static,
        max_bytes: usize,
        between_reads: Duration,
    ) -> Self
    where
        B: AsRef<[u8]> + Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        use futures_util::StreamExt as _;
        let mut read = 0usize;
        let counted = bytes.map(move |chunk| {
            let chunk = chunk.map_err(|e| Cut::Transport(e.to_string()))?;
            read += chunk.as_ref().len();
            if read > max_bytes {
                return Err(Cut::TooLarge(max_bytes));
            }
            Ok(chunk)
        });
        Self {
            events: Box::pin(counted.eventsource()),
            between_reads,
        }
    }

    /// The next event; `None` at the stream's end.
    pub async fn next(&mut self) -> Result<Option<Event>, Cut> {
        use futures_util::StreamExt as _;
        let next = tokio::time::timeout(self.between_reads, self.events.next()).await;
        match next.map_err(|_| Cut::Quiet(self.between_reads))? {
            None => Ok(None),
            Some(Ok(event)) => Ok(Some(event)),
            Some(Err(EventStreamError::Transport(cut))) => Err(cut),
            Some(Err(e)) => Err(Cut::Unreadable(e.to_string())),
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
            .post(
                request.args.to_owned(),
                request.idempotency_key,
                request.slot,
                false,
            )
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
        let ask = Ask {
            method: reqwest::Method::GET,
            url,
            body: None,
            idempotency_key: request.idempotency_key,
            slot: request.slot,
            streams: false,
            headers: &[],
        };
        let answer = self.poster.send(ask).await?;
        if answer.status == StatusCode::NOT_FOUND {
            return Ok(Reconciled::NotRun);
        }
        // Unlike a call's, a reconcile's last 5xx (or 408, 409, 429) says nothing about the
        // call: ask again later.
        if retryable(answer.status) {
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

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use rewind_mock::{
        MockHandle, MockService, THROTTLE_HEADER, THROTTLE_RETRY_AFTER_HEADER,
        THROTTLE_STATUS_HEADER,
    };

    use super::*;

    /// The waits asked for, not waited.
    #[derive(Debug, Default)]
    struct Waits(Mutex<Vec<Duration>>);

    #[async_trait]
    impl Pause for Waits {
        async fn pause(&self, wait: Duration) {
            self.0.lock().expect("lock").push(wait);
        }
    }

    /// A poster of the mock's echo tool, refused as `throttle` says, waiting into `waits`.
    fn echo_poster(
        base: &str,
        throttle: &[(&str, &str)],
        retry: RetryPolicy,
        waits: &Arc<Waits>,
    ) -> JsonPoster {
        let config = HttpConfig {
            url: format!("{base}/tools/echo"),
            timeout: Duration::from_secs(10),
            retry,
            headers: (throttle.iter())
                .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
                .collect(),
            reconcile_url: None,
            allowed_hosts: None,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
        };
        JsonPoster::new(config).pausing_with(Arc::clone(waits) as Arc<dyn Pause>)
    }

    async fn mock() -> MockHandle {
        MockService::start("127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("the mock starts")
    }

    fn waits_of(waits: &Waits) -> Vec<Duration> {
        waits.0.lock().expect("lock").clone()
    }

    #[tokio::test]
    async fn a_429_with_retry_after_twice_then_an_answer_is_three_requests_one_outcome() {
        let mock = mock().await;
        let waits = Arc::new(Waits::default());
        let throttle = [(THROTTLE_HEADER, "2"), (THROTTLE_RETRY_AFTER_HEADER, "3")];
        let poster = echo_poster(&mock.base_url(), &throttle, RetryPolicy::default(), &waits);
        let answer = poster
            .post("{}".to_owned(), "key-1", None, false)
            .await
            .expect("an answer");
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
        assert_eq!(mock.counts().for_key("key-1"), 3);
        // Retry-After (3 s) is above the backoff's bound (2 s): each wait is what it asked.
        assert_eq!(waits_of(&waits), [Duration::from_secs(3); 2]);
    }

    #[tokio::test]
    async fn a_503_past_its_attempts_is_the_outcome_and_a_400_is_final_at_once() {
        let mock = mock().await;
        let waits = Arc::new(Waits::default());
        let retry = RetryPolicy {
            attempts: 3,
            ..RetryPolicy::default()
        };
        let throttle = [
            (THROTTLE_HEADER, "10"),
            (THROTTLE_STATUS_HEADER, "503"),
            (THROTTLE_RETRY_AFTER_HEADER, "0"),
        ];
        let poster = echo_poster(&mock.base_url(), &throttle, retry, &waits);
        let answer = poster
            .post("{}".to_owned(), "key-2", None, false)
            .await
            .expect("the last answer");
        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            mock.counts().for_key("key-2"),
            3,
            "three attempts, then the last answer"
        );
        let waited = waits_of(&waits);
        assert_eq!(waited.len(), 2);
        assert!(
            waited
                .iter()
                .all(|wait| *wait <= Duration::from_millis(200)),
            "{waited:?}"
        );

        let refused = [(THROTTLE_HEADER, "1"), (THROTTLE_STATUS_HEADER, "400")];
        let poster = echo_poster(&mock.base_url(), &refused, RetryPolicy::default(), &waits);
        let answer = poster
            .post("{}".to_owned(), "key-3", None, false)
            .await
            .expect("an answer");
        assert_eq!(answer.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            mock.counts().for_key("key-3"),
            1,
            "a 400 is not asked again"
        );
    }

    #[tokio::test]
    async fn a_retry_after_past_the_deadline_ends_the_retries_at_once() {
        let mock = mock().await;
        let waits = Arc::new(Waits::default());
        let retry = RetryPolicy {
            deadline: Duration::from_secs(30),
            ..RetryPolicy::default()
        };
        let throttle = [
            (THROTTLE_HEADER, "5"),
            (THROTTLE_RETRY_AFTER_HEADER, "3600"),
        ];
        let poster = echo_poster(&mock.base_url(), &throttle, retry, &waits);
        let answer = poster
            .post("{}".to_owned(), "key-4", None, false)
            .await
            .expect("the answer");
        assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(mock.counts().for_key("key-4"), 1);
        assert!(waits_of(&waits).is_empty(), "no wait past the deadline");
        // A remote's Retry-After is outside input: the largest number is a day, not a panic.
        let huge = [
            (THROTTLE_HEADER, "5"),
            (THROTTLE_RETRY_AFTER_HEADER, "18446744073709551615"),
        ];
        let poster = echo_poster(&mock.base_url(), &huge, retry, &waits);
        let answer = poster
            .post("{}".to_owned(), "key-6", None, false)
            .await
            .expect("the answer");
        assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS);
        assert!(waits_of(&waits).is_empty());
    }

    #[tokio::test]
    async fn no_answer_after_the_attempts_leaves_the_remote_unavailable() {
        // A port nothing listens on.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        drop(listener);
        let waits = Arc::new(Waits::default());
        let poster = echo_poster(&base, &[], RetryPolicy::default(), &waits);
        let error = poster
            .post("{}".to_owned(), "key-5", None, false)
            .await
            .expect_err("no answer");
        assert!(
            matches!(&error, FunctionError::Unavailable(message) if message.contains("after 4 attempts")),
            "{error:?}"
        );
        assert_eq!(waits_of(&waits).len(), 3);
    }
}
