//! A small local service that stands in for the remotes Rewind's demo and tests call.
//!
//! It serves an OpenAI-compatible chat endpoint whose replies are a deterministic function
//! of the request, a handful of deterministic tools, and a count of every call it received,
//! per route and per `Idempotency-Key` header. The demo reads those counts to show that each
//! durable external call reached its remote exactly once, even across a crash and replay.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! let mock = rewind_mock::MockService::start("127.0.0.1:0".parse().expect("addr")).await?;
//! println!("chat endpoint: {}/v1/chat/completions", mock.base_url());
//! // ... run the code under test against mock.base_url() ...
//! let counts = mock.shutdown().await?;
//! assert!(counts.repeated_keys.is_empty(), "some call ran twice");
//! # Ok(())
//! # }
//! ```
//!
//! Routes (every `POST` below is counted; `GET`s and the reset are not):
//!
//! | route | what it answers |
//! |---|---|
//! | `POST /v1/chat/completions` | an OpenAI chat completion whose content is [`Intent::to_json`] of the last user message; with `"stream": true`, the same as server-sent chunks, then `[DONE]` |
//! | `POST /tools/orders.lookup` | `{"order_id","status","eta_days"}` derived from the order id |
//! | `POST /tools/enrich.company` | `{"domain","name","industry","employees"}` derived from the domain |
//! | `POST /tools/enrich.person` | `{"email","name","company","title"}` derived from the address |
//! | `POST /tools/{name}` | `{"tool": name, "echo": <request body>}` |
//! | `GET /tools/{name}/status` | a reconcile endpoint (`in-doubt = "reconcile"`), by the `Idempotency-Key` header: `200` with the answer the tool's call under that key got; `503` with `Retry-After: 1` while that call still runs (answering `404` then would have the host make the call a second time); `404` only for a key the tool never saw |
//! | `GET /counts` | the [`Counts`] as JSON |
//! | `POST /counts/reset` | zeroes the counts; answers with the counts as they were |
//! | `GET /healthz` | `ok` |
//!
//! A request body that is not JSON, or not the JSON a route expects, gets a `400` whose body
//! is `{"error": "<what is wrong>", "code": "<stable code>"}` (see [`RequestError`]).
//!
//! A caller can ask to be refused, to test how it copes with rate limits and outages: a
//! counted request with [`THROTTLE_HEADER`]` : N` is answered `429 Too Many Requests` (or the
//! status [`THROTTLE_STATUS_HEADER`] names) with `Retry-After: 1` (or what
//! [`THROTTLE_RETRY_AFTER_HEADER`] says) when it is one of the first N calls of its
//! `Idempotency-Key`; the calls after them are served. Refused calls are counted. A
//! request with [`DELAY_HEADER`]` : MS` is answered that many milliseconds late (at most
//! [`MAX_DELAY_MS`]), as a slow model is.

mod chat;
mod counts;
mod error;
mod fnv;
mod intent;
mod server;
mod tools;

pub use counts::{Counts, MockState};
pub use error::RequestError;
pub use intent::{Intent, IntentKind, classify, find_order_id};
pub use server::{MockHandle, MockService, router};

/// The request header whose value identifies one logical external call.
///
/// Calls are counted per distinct value of this header; a call without it is counted in
/// [`Counts::without_key`].
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";

/// `x-mock-delay-ms: MS`: the answer comes that many milliseconds late.
pub const DELAY_HEADER: &str = "x-mock-delay-ms";

/// The longest delay [`DELAY_HEADER`] asks for that the mock honours: 10 minutes.
pub const MAX_DELAY_MS: u64 = 600_000;

/// `x-mock-chunk-delay-ms: MS`: a streamed chat answer pauses that long before each chunk
/// after the first (as a model generating tokens does); at most [`MAX_DELAY_MS`].
pub const CHUNK_DELAY_HEADER: &str = "x-mock-chunk-delay-ms";

/// `x-mock-throttle: N`: the first N calls of the request's idempotency key are refused.
pub const THROTTLE_HEADER: &str = "x-mock-throttle";

/// `x-mock-throttle-status: 503`: the status of a refused call (default 429).
pub const THROTTLE_STATUS_HEADER: &str = "x-mock-throttle-status";

/// `x-mock-retry-after: VALUE`: the `Retry-After` of a refused call (default `1`).
pub const THROTTLE_RETRY_AFTER_HEADER: &str = "x-mock-retry-after";

/// The `created` timestamp of every chat completion, fixed so that replies are reproducible.
pub const CHAT_CREATED: u64 = 1_700_000_000;
