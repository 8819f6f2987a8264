//! `kind = "mcp"`: the tools of a Model Context Protocol server, over streamable HTTP.
//!
//! A call's args name the method, as MCP does:
//!
//! - `{"method": "tools/call", "params": {"name": TOOL, "arguments": {...}}}`: the tool's
//!   result (`{"content": [...], "structuredContent"?: ...}`); a tool that reports an
//!   error (`isError`) is a recorded failure carrying that result;
//! - `{"method": "tools/list"}`: `{"tools": [...]}`, every page, only the tools the
//!   function's `tools` allow, so that an action can hand the list to a model.
//!
//! Each call opens its own session (`initialize`, then `notifications/initialized`; the
//! server's `Mcp-Session-Id` and the protocol version it agreed to are sent with what
//! follows), then sends its request, with the call's idempotency key in the request's
//! `_meta` (as [`IDEMPOTENCY_META`]) and in the `Idempotency-Key` header, and ends the
//! session. A server may answer a request with one JSON document or with an event stream;
//! both are read, the stream as its events come. Requests are tried again as the function's
//! `retry` says, like any HTTP function's.

use std::collections::BTreeSet;

use async_trait::async_trait;
use serde_json::{Map, Value, json};

use super::http::{Ask, EventReader, HttpConfig, JsonPoster, json_result};
use super::{CallRequest, Function, FunctionError};

/// Where a `tools/call` carries the call's idempotency key, in its `params._meta`.
pub const IDEMPOTENCY_META: &str = "dev.rewind/idempotency-key";

/// The protocol version the host asks for; the server's answer is what is sent after.
pub const PROTOCOL_VERSION: &str = "2025-06-18";

/// Pages of `tools/list` read at most: a server that pages on past it is refused.
const MAX_PAGES: usize = 64;

/// Where the server is and what the function may reach there.
#[derive(Clone, Debug)]
pub struct McpConfig {
    /// Connection settings: its `url` is the server's MCP endpoint (`.../mcp`).
    pub http: HttpConfig,
    /// The tools this function may call and list; `None`: every tool the server has.
    pub tools: Option<BTreeSet<String>>,
}

#[derive(Clone, Debug)]
pub struct McpFunction {
    poster: JsonPoster,
    tools: Option<BTreeSet<String>>,
}

/// What a call asks of the server.
enum Asked {
    Call { name: String, arguments: Value },
    List,
}

/// A session the server opened for one call.
struct Session {
    /// `Mcp-Session-Id`, when the server keeps sessions.
    id: Option<String>,
    /// The protocol version the server agreed to.
    version: String,
}

impl McpFunction {
    pub fn new(config: McpConfig) -> Self {
        Self {
            poster: JsonPoster::new(config.http),
            tools: config.tools,
        }
    }

    fn failed(&self, message: impl std::fmt::Display) -> FunctionError {
        FunctionError::Failed(format!("{}: {message}", self.poster.url()))
    }

    fn allowed(&self, tool: &str) -> bool {
        self.tools.as_ref().is_none_or(|tools| tools.contains(tool))
    }

    /// The method and params a call's args ask for, refused (a recorded failure) when they
    /// are not one of this function's, or name a tool it may not call.
    fn asked(&self, args: &str) -> Result<Asked, FunctionError> {
        let args: Value = serde_json::from_str(args)
            .map_err(|e| self.failed(format!("args are not JSON: {e}")))?;
        match args.get("method").and_then(Value::as_str) {
            Some("tools/list") => Ok(Asked::List),
            Some("tools/call") => {
                let params = &args["params"];
                let Some(name) = params.get("name").and_then(Value::as_str) else {
                    return Err(self.failed("tools/call needs params.name, the tool's name"));
                };
                if !self.allowed(name) {
                    return Err(self.failed(format!(
                        "tool `{name}` is not among the tools this function may call ({})",
                        self.tools_named()
                    )));
                }
                let arguments = params.get("arguments").cloned().unwrap_or(json!({}));
                if !arguments.is_object() {
                    return Err(self.failed("tools/call: params.arguments must be an object"));
                }
                Ok(Asked::Call {
                    name: name.to_owned(),
                    arguments,
                })
            }
            _ => Err(self.failed(
                "args must be {\"method\": \"tools/call\", \"params\": {\"name\", \"arguments\"}} \
                 or {\"method\": \"tools/list\"}",
            )),
        }
    }

    fn tools_named(&self) -> String {
        match &self.tools {
            Some(tools) => tools.iter().cloned().collect::<Vec<_>>().join(", "),
            None => "any".to_owned(),
        }
    }

    /// Sends one JSON-RPC message; with an `id`, waits for its response and returns its
    /// `result` (a JSON-RPC error is a recorded failure).
    async fn send(
        &self,
        request: &CallRequest<'_>,
        session: Option<&Session>,
        id: Option<u64>,
        method: &str,
        params: Value,
    ) -> Result<(Option<Value>, Option<String>), FunctionError> {
        let mut message = json!({ "jsonrpc": "2.0", "method": method, "params": params });
        if let Some(id) = id {
            message["id"] = json!(id);
        }
        let mut headers = vec![(
            "accept".to_owned(),
            "application/json, text/event-stream".to_owned(),
        )];
        if let Some(session) = session {
            headers.push(("mcp-protocol-version".to_owned(), session.version.clone()));
            if let Some(id) = &session.id {
                headers.push(("mcp-session-id".to_owned(), id.clone()));
            }
        }
        // The call's own key for its tools/call; a key of its own for each other message,
        // so that a gateway that honours the header does not take them for one request.
        let key = match method {
            "tools/call" => request.idempotency_key.to_owned(),
            other => format!("{}/{other}", request.idempotency_key),
        };
        let ask = Ask {
            method: reqwest::Method::POST,
            url: self.poster.url(),
            body: Some(message.to_string()),
            idempotency_key: &key,
            slot: request.slot,
            streams: true,
            headers: &headers,
        };
        let mut answer = self.poster.send(ask).await?;
        // The server lost the session (restarted, or another replica answered): nothing is
        // recorded, and the call is made again, in a new session.
        if session.is_some_and(|s| s.id.is_some())
            && answer.status == reqwest::StatusCode::NOT_FOUND
        {
            return Err(FunctionError::Unavailable(format!(
                "{}: the server no longer knows the session ({method})",
                self.poster.url()
            )));
        }
        let session_id = answer.header("mcp-session-id");
        let Some(id) = id else {
            // A notification: accepted, nothing to read.
            if !answer.status.is_success() {
                json_result(self.poster.url(), answer)?;
            }
            return Ok((None, session_id));
        };
        let response = match answer.stream.take() {
            Some(stream) => self.response_in(stream, id).await?,
            None => json_result(self.poster.url(), answer)?,
        };
        if let Some(error) = response.get("error") {
            return Err(self.failed(format!("{method} answered an error: {error}")));
        }
        let result = response.get("result").cloned().ok_or_else(|| {
            self.failed(format!("{method} answered without a result: {response}"))
        })?;
        Ok((Some(result), session_id))
    }

    /// The response with `id` among the messages of an event stream (the server may send
    /// notifications and requests of its own first).
    async fn response_in(
        &self,
        stream: reqwest::Response,
        id: u64,
    ) -> Result<Value, FunctionError> {
        let url = self.poster.url();
        let mut events = EventReader::new(
            stream.bytes_stream(),
            self.poster.max_response_bytes(),
            self.poster.timeout(),
        );
        loop {
            let event = match events.next().await {
                Ok(Some(event)) => event,
                Ok(None) => {
                    return Err(FunctionError::Unavailable(format!(
                        "{url}: the event stream ended before the response to request {id}"
                    )));
                }
                Err(cut) => return Err(cut.into_error(url)),
            };
            let Ok(message) = serde_json::from_str::<Value>(&event.data) else {
                continue;
            };
            // Its response: our id, and not a request of the server's own.
            if message.get("id") == Some(&json!(id)) && message.get("method").is_none() {
                return Ok(message);
            }
        }
    }

    /// Opens a session: `initialize`, then `notifications/initialized`.
    async fn open(&self, request: &CallRequest<'_>) -> Result<Session, FunctionError> {
        let params = json!({
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {},
            "clientInfo": { "name": "rewind", "version": env!("CARGO_PKG_VERSION") },
        });
        let (result, id) = self
            .send(request, None, Some(1), "initialize", params)
            .await?;
        let version = (result.as_ref())
            .and_then(|r| r.get("protocolVersion"))
            .and_then(Value::as_str)
            .unwrap_or(PROTOCOL_VERSION)
            .to_owned();
        let session = Session { id, version };
        let initialized = "notifications/initialized";
        let sent = (self.send(request, Some(&session), None, initialized, json!({}))).await;
        if let Err(error) = sent {
            self.close(request, &session).await;
            return Err(error);
        }
        Ok(session)
    }

    /// Ends a session the server keeps. Best effort: a server may refuse (405), or forget
    /// it on its own.
    async fn close(&self, request: &CallRequest<'_>, session: &Session) {
        let Some(id) = &session.id else { return };
        let headers = [("mcp-session-id".to_owned(), id.clone())];
        let key = format!("{}/close", request.idempotency_key);
        let ask = Ask {
            method: reqwest::Method::DELETE,
            url: self.poster.url(),
            body: None,
            idempotency_key: &key,
            slot: request.slot,
            streams: false,
            headers: &headers,
        };
        if let Err(error) = self.poster.send(ask).await {
            tracing::debug!(url = self.poster.url(), "an MCP session not ended: {error}");
        }
    }

    async fn ask(&self, request: &CallRequest<'_>, asked: Asked) -> Result<Value, FunctionError> {
        let session = self.open(request).await?;
        let answered = match asked {
            Asked::Call { name, arguments } => {
                let params = json!({
                    "name": name,
                    "arguments": arguments,
                    "_meta": { IDEMPOTENCY_META: request.idempotency_key },
                });
                (self
                    .send(request, Some(&session), Some(2), "tools/call", params)
                    .await)
                    .map(|(result, _)| result.unwrap_or(Value::Null))
            }
            Asked::List => self.list(request, &session).await,
        };
        self.close(request, &session).await;
        answered
    }

    /// Every page of `tools/list`, the tools this function may not call left out.
    async fn list(
        &self,
        request: &CallRequest<'_>,
        session: &Session,
    ) -> Result<Value, FunctionError> {
        let mut tools = Vec::new();
        let mut cursor: Option<String> = None;
        for page in 0..MAX_PAGES {
            let params = match &cursor {
                Some(cursor) => json!({ "cursor": cursor }),
                None => json!({}),
            };
            let id = 2 + page as u64;
            let (result, _) = self
                .send(request, Some(session), Some(id), "tools/list", params)
                .await?;
            let result = result.unwrap_or(Value::Null);
            let Some(listed) = result.get("tools").and_then(Value::as_array) else {
                return Err(self.failed(format!("tools/list answered without tools: {result}")));
            };
            tools.extend(
                (listed.iter())
                    .filter(|tool| tool["name"].as_str().is_some_and(|name| self.allowed(name)))
                    .cloned(),
            );
            cursor = (result.get("nextCursor").and_then(Value::as_str)).map(str::to_owned);
            if cursor.is_none() {
                return Ok(json!({ "tools": tools }));
            }
        }
        Err(self.failed(format!("tools/list went on past {MAX_PAGES} pages")))
    }
}

#[async_trait]
impl Function for McpFunction {
    async fn call(&self, request: CallRequest<'_>) -> Result<String, FunctionError> {
        let asked = self.asked(request.args)?;
        let result = self.ask(&request, asked).await?;
        // A tool that failed says so in its result: recorded as the call's failure.
        if result.get("isError").and_then(Value::as_bool) == Some(true) {
            let mut result = result;
            if let Value::Object(fields) = &mut result {
                fields.remove("isError");
            }
            return Err(FunctionError::Failed(result.to_string()));
        }
        let mut result = match result {
            Value::Object(fields) => fields,
            other => Map::from_iter([("result".to_owned(), other)]),
        };
        result.remove("isError");
        Ok(Value::Object(result).to_string())
    }

    fn endpoint(&self) -> Option<&str> {
        Some(self.poster.url())
    }
}
