//! `kind = "openai-chat"`: an OpenAI-compatible chat-completions endpoint.
//!
//! Args are `{"messages": [...], "tools"?: [...], ...}` (any other chat-completions field
//! passes through; `model` defaults to the function's). The answer is asked for streamed
//! (`"stream": true`, with the usage), and its server-sent chunks are put together into the
//! one result recorded: the assistant message (`role`, `content`, `tool_calls` when the
//! model calls tools, their arguments joined from their pieces), with the choice's
//! `finish_reason` and the answer's `usage` beside its fields when the endpoint gives them.
//! An endpoint that answers with one JSON completion instead is read as such.

use async_trait::async_trait;
use std::time::Duration;

use serde_json::{Map, Value, json};

use super::http::{EventReader, HttpConfig, JsonPoster, json_result};
use super::{CallDeltas, CallRequest, Function, FunctionError};
use crate::crash::{self, CrashPoint};

/// Where and how to reach the chat endpoint.
#[derive(Clone, Debug)]
pub struct OpenAiChatConfig {
    /// For example `https://api.openai.com/v1`; `/chat/completions` is appended.
    pub base_url: String,
    pub model: String,
    /// Connection settings; its `url` is ignored and headers may carry the API key.
    pub http: HttpConfig,
}

/// How many times the bytes of the message it carries a streamed answer may take (each
/// chunk wraps a few characters in an envelope of about 200 bytes): with the default cap,
/// 64 MiB read for a message of up to about a million characters. The answer is read whole
/// before it is put together.
const STREAM_OVERHEAD: usize = 16;

#[derive(Clone, Debug)]
pub struct OpenAiChatFunction {
    poster: JsonPoster,
    model: String,
    /// The largest result (the message put together): the config's `max_response_bytes`.
    /// The answer as sent may take [`STREAM_OVERHEAD`] times as many bytes.
    max_message_bytes: usize,
}

impl OpenAiChatFunction {
    pub fn new(config: OpenAiChatConfig) -> Self {
        let mut http = config.http;
        http.url = format!("{}/chat/completions", config.base_url.trim_end_matches('/'));
        let max_message_bytes = http.max_response_bytes;
        http.max_response_bytes = max_message_bytes.saturating_mul(STREAM_OVERHEAD);
        Self {
            poster: JsonPoster::new(http),
            model: config.model,
            max_message_bytes,
        }
    }

    /// `message` as the call's result, unless it is larger than the cap.
    fn result(&self, message: &Value) -> Result<String, FunctionError> {
        let text = message.to_string();
        if text.len() > self.max_message_bytes {
            return Err(FunctionError::Failed(format!(
                "{}: the answer's message is larger than {} bytes",
                self.poster.url(),
                self.max_message_bytes
            )));
        }
        Ok(text)
    }
}

#[async_trait]
impl Function for OpenAiChatFunction {
    async fn call(&self, request: CallRequest<'_>) -> Result<String, FunctionError> {
        let mut body = match serde_json::from_str::<Value>(request.args) {
            Ok(Value::Object(body)) if body.get("messages").is_some_and(|m| m.is_array()) => body,
            _ => {
                return Err(FunctionError::Failed(
                    "openai-chat args must be an object with a `messages` array".to_owned(),
                ));
            }
        };
        body.entry("model")
            .or_insert_with(|| Value::String(self.model.clone()));
        body.insert("stream".to_owned(), Value::Bool(true));
        let options = body.entry("stream_options").or_insert_with(|| json!({}));
        if let Value::Object(options) = options {
            options.insert("include_usage".to_owned(), Value::Bool(true));
        }
        let body = Value::Object(body).to_string();
        let key = request.idempotency_key;
        let mut answer = (self.poster.post(body, key, request.slot, true)).await?;
        let reading = Reading {
            url: self.poster.url(),
            max_bytes: self.max_message_bytes.saturating_mul(STREAM_OVERHEAD),
            between_reads: self.poster.timeout(),
            deltas: request.deltas,
        };
        if let Some(stream) = answer.stream.take() {
            return self.result(&assemble(&reading, stream.bytes_stream()).await?);
        }
        // By its type, or by its first field when something between lost the type (a
        // proxy; `rewind test`'s simulator): a JSON completion starts with `{`.
        let streamed = answer.status.is_success()
            && ((answer.content_type.as_deref())
                .is_some_and(|t| t.starts_with("text/event-stream"))
                || ["data:", "event:", "id:", ":"]
                    .iter()
                    .any(|field| answer.body.trim_start().starts_with(field)));
        if streamed {
            let whole = futures_util::stream::iter([Ok::<_, std::convert::Infallible>(
                bytes::Bytes::from(answer.body),
            )]);
            return self.result(&assemble(&reading, whole).await?);
        }
        let response = json_result(self.poster.url(), answer)?;
        let Some(Value::Object(mut message)) = response.pointer("/choices/0/message").cloned()
        else {
            return Err(FunctionError::Failed(format!(
                "{} answered without an object at choices[0].message: {response}",
                self.poster.url()
            )));
        };
        for (field, at) in [
            ("finish_reason", "/choices/0/finish_reason"),
            ("usage", "/usage"),
        ] {
            if let Some(value) = response.pointer(at).filter(|value| !value.is_null()) {
                message.insert(field.to_owned(), value.clone());
            }
        }
        self.result(&Value::Object(message))
    }

    fn endpoint(&self) -> Option<&str> {
        Some(self.poster.url())
    }
}

/// A whole streamed chat answer (its server-sent events, as `url` sent them) as the one
/// JSON completion an endpoint that does not stream answers with: `choices[0].message`,
/// its `finish_reason`, and `usage`. A function given that completion gets the message the
/// stream makes up; `rewind dev` records streamed answers so.
pub async fn completion_of_stream(url: &str, events: &str) -> Result<Value, FunctionError> {
    let reading = Reading {
        url,
        max_bytes: usize::MAX,
        between_reads: Duration::from_secs(60),
        deltas: None,
    };
    let whole = futures_util::stream::iter([Ok::<_, std::convert::Infallible>(
        bytes::Bytes::from(events.to_owned()),
    )]);
    let mut message = assemble(&reading, whole).await?;
    let (finish_reason, usage) = match message.as_object_mut() {
        Some(fields) => (fields.remove("finish_reason"), fields.remove("usage")),
        None => (None, None),
    };
    let finish_reason = finish_reason.unwrap_or(Value::Null);
    let mut completion = json!({
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
    });
    if let Some(usage) = usage {
        completion["usage"] = usage;
    }
    Ok(completion)
}

/// How a streamed answer is read.
struct Reading<'a> {
    url: &'a str,
    /// Bytes of the answer as sent, at most.
    max_bytes: usize,
    /// The longest the stream may go without a chunk.
    between_reads: Duration,
    /// Where each chunk's delta goes as it comes.
    deltas: Option<&'a dyn CallDeltas>,
}

/// The message a streamed answer's chunks make up, as the result of a call, read as the
/// chunks come: each one's delta is forwarded as it is read, the answer may take at most
/// `max_bytes`, and at most `between_reads` may pass without a chunk.
async fn assemble<B, E>(
    reading: &Reading<'_>,
    bytes: impl futures_util::Stream<Item = Result<B, E>> + Send + 'static,
) -> Result<Value, FunctionError>
where
    B: AsRef<[u8]> + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let url = reading.url;
    let failed = |message: String| FunctionError::Failed(format!("{url}: {message}"));
    let mut events = EventReader::new(bytes, reading.max_bytes, reading.between_reads);
    let mut message = Map::new();
    let mut content: Option<String> = None;
    let mut tool_calls: Vec<Value> = Vec::new();
    let (mut finish_reason, mut usage) = (Value::Null, Value::Null);
    let mut done = false;
    let mut chunks = 0usize;
    loop {
        // Cut short: nothing is recorded, and the call is made again under its key.
        let Some(event) = events.next().await.map_err(|cut| cut.into_error(url))? else {
            break;
        };
        if event.data.trim() == "[DONE]" {
            done = true;
            break;
        }
        chunks += 1;
        if chunks == 1 {
            crash::reached(CrashPoint::MidStream);
        }
        let chunk: Value = serde_json::from_str(&event.data).map_err(|e| {
            failed(format!(
                "chunk {chunks} of the streamed answer is not JSON: {e}"
            ))
        })?;
        if let Some(error) = chunk.get("error") {
            // Most often passing (overloaded): nothing is recorded, the call is made again.
            return Err(FunctionError::Unavailable(format!(
                "{url}: the streamed answer ended with an error: {error}"
            )));
        }
        if let Some(given) = chunk.get("usage").filter(|u| !u.is_null()) {
            usage = given.clone();
        }
        let choices = chunk.get("choices").and_then(Value::as_array);
        // The first choice: `index` 0, or the first listed when the endpoint leaves it out.
        let Some(choice) = choices.and_then(|c| {
            c.iter()
                .find(|c| c.get("index").is_none_or(|index| *index == 0))
        }) else {
            continue;
        };
        if let Some(reason) = choice.get("finish_reason").filter(|r| !r.is_null()) {
            finish_reason = reason.clone();
        }
        let delta = &choice["delta"];
        if let Some(deltas) = reading.deltas
            && carries_text(delta)
        {
            deltas.delta(delta);
        }
        if let Some(role) = delta.get("role").filter(|r| r.is_string()) {
            message.insert("role".to_owned(), role.clone());
        }
        if let Some(piece) = delta.get("content").and_then(Value::as_str) {
            content.get_or_insert_with(String::new).push_str(piece);
        }
        // Any other text the message streams (`refusal`, `reasoning_content`, …) is joined
        // as its content is.
        for (field, piece) in delta.as_object().into_iter().flatten() {
            if let (false, Some(piece)) = (
                ["role", "content", "tool_calls"].contains(&field.as_str()),
                piece.as_str(),
            ) {
                let joined = message
                    .entry(field.clone())
                    .or_insert_with(|| Value::String(String::new()));
                if let Value::String(joined) = joined {
                    joined.push_str(piece);
                }
            }
        }
        for call in delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            join_tool_call(&mut tool_calls, call).map_err(failed)?;
        }
    }
    if !done {
        // Cut short: nothing is recorded, and the call is made again under its key.
        return Err(FunctionError::Unavailable(format!(
            "{url}: the streamed answer ended after {chunks} chunks without [DONE]"
        )));
    }
    message
        .entry("role")
        .or_insert_with(|| Value::String("assistant".to_owned()));
    message.insert(
        "content".to_owned(),
        content.map_or(Value::Null, Value::String),
    );
    if !tool_calls.is_empty() {
        message.insert("tool_calls".to_owned(), Value::Array(tool_calls));
    }
    for (field, value) in [("finish_reason", finish_reason), ("usage", usage)] {
        if !value.is_null() {
            message.insert(field.to_owned(), value);
        }
    }
    Ok(Value::Object(message))
}

/// Whether a chunk's delta carries a piece of the message (not only its role, or nothing).
fn carries_text(delta: &Value) -> bool {
    (delta.as_object().into_iter().flatten()).any(|(field, piece)| match piece {
        Value::String(text) => field != "role" && !text.is_empty(),
        Value::Null => false,
        Value::Array(items) => !items.is_empty(),
        _ => true,
    })
}

/// Tool calls one answer may make: a remote's `index` beyond it is refused, not allocated.
const MAX_TOOL_CALLS: usize = 128;

/// Adds a streamed piece of a tool call to the calls so far: the first piece of a call (by
/// its `index`) gives its `id`, `type` and function `name`; its `arguments` come in pieces.
fn join_tool_call(calls: &mut Vec<Value>, piece: &Value) -> Result<(), String> {
    let index = match piece["index"].as_u64() {
        None => calls.len(),
        Some(index) => usize::try_from(index).unwrap_or(usize::MAX),
    };
    if index >= MAX_TOOL_CALLS {
        return Err(format!(
            "a streamed tool call at index {index}: an answer makes at most {MAX_TOOL_CALLS}"
        ));
    }
    while calls.len() <= index {
        calls.push(json!({ "id": null, "type": "function", "function": { "name": null, "arguments": "" } }));
    }
    let call = &mut calls[index];
    for field in ["id", "type"] {
        if let Some(value) = piece.get(field).filter(|v| !v.is_null()) {
            call[field] = value.clone();
        }
    }
    let function = &piece["function"];
    if let Some(name) = function.get("name").filter(|n| !n.is_null()) {
        call["function"]["name"] = name.clone();
    }
    if let Some(more) = function.get("arguments").and_then(Value::as_str)
        && let Value::String(arguments) = &mut call["function"]["arguments"]
    {
        arguments.push_str(more);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::functions::{DEFAULT_MAX_RESPONSE_BYTES, RetryPolicy};

    #[tokio::test]
    async fn the_result_is_the_message_with_its_finish_reason_and_usage() {
        let mock = rewind_mock::MockService::start("127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("the mock starts");
        let chat = chat_at(
            &format!("{}/v1", mock.base_url()),
            DEFAULT_MAX_RESPONSE_BYTES,
        );
        let args = r#"{"messages": [{"role": "user", "content": "where is order A-1?"}]}"#;
        let result = chat
            .call(CallRequest {
                function: "llm.chat",
                args,
                idempotency_key: "key-1",
                slot: None,
                deltas: None,
            })
            .await
            .expect("an answer");
        let result: Value = serde_json::from_str(&result).expect("JSON");
        assert_eq!(result["role"], "assistant", "{result}");
        assert!(result["content"].is_string(), "{result}");
        assert_eq!(result["finish_reason"], "stop", "{result}");
        assert!(result["usage"]["total_tokens"].is_u64(), "{result}");
    }

    /// A chat endpoint on loopback that answers every request with `body` as `content_type`;
    /// its base URL. (An axum router: a dependency of the `server` feature.)
    #[cfg(feature = "server")]
    async fn answering(body: String, content_type: &'static str) -> String {
        let app = axum::Router::new().route(
            "/v1/chat/completions",
            axum::routing::post(move || async move {
                ([(axum::http::header::CONTENT_TYPE, content_type)], body)
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}/v1")
    }

    async fn ask(chat: &OpenAiChatFunction) -> Result<String, FunctionError> {
        chat.call(CallRequest {
            function: "llm.chat",
            args: r#"{"messages": []}"#,
            idempotency_key: "key-1",
            slot: None,
            deltas: None,
        })
        .await
    }

    /// An endpoint that ignores `stream` and answers one JSON completion is read as such.
    #[cfg(feature = "server")]
    #[tokio::test]
    async fn a_json_completion_from_an_endpoint_that_does_not_stream_is_read_as_before() {
        let completion = json!({
            "choices": [{ "index": 0, "finish_reason": "stop",
                "message": { "role": "assistant", "content": "plain" } }],
            "usage": { "total_tokens": 3 },
        });
        let base = answering(completion.to_string(), "application/json").await;
        let result = ask(&chat_at(&base, DEFAULT_MAX_RESPONSE_BYTES))
            .await
            .expect("an answer");
        let result: Value = serde_json::from_str(&result).expect("JSON");
        assert_eq!(
            result,
            json!({ "role": "assistant", "content": "plain", "finish_reason": "stop",
                "usage": { "total_tokens": 3 } })
        );
    }

    /// A streamed answer kept as its whole completion (`rewind dev`'s recording) gives the
    /// function the message the stream gave it.
    #[cfg(feature = "server")]
    #[tokio::test]
    async fn a_stream_kept_as_its_completion_gives_the_same_message() {
        let chunk = |delta: Value, finish: Value| {
            format!(
                "data: {}\n\n",
                json!({ "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }] })
            )
        };
        let stream = [
            chunk(
                json!({ "role": "assistant", "content": "Hel" }),
                Value::Null,
            ),
            chunk(json!({ "content": "lo" }), json!("stop")),
            format!(
                "data: {}\n\n",
                json!({ "choices": [], "usage": { "total_tokens": 7 } })
            ),
            "data: [DONE]\n\n".to_owned(),
        ]
        .concat();
        let streamed = answering(stream.clone(), "text/event-stream").await;
        let from_stream = ask(&chat_at(&streamed, DEFAULT_MAX_RESPONSE_BYTES))
            .await
            .expect("an answer");
        let completion = completion_of_stream("llm.chat", &stream)
            .await
            .expect("a completion");
        assert_eq!(completion["choices"][0]["finish_reason"], "stop");
        let kept = answering(completion.to_string(), "application/json").await;
        let from_completion = ask(&chat_at(&kept, DEFAULT_MAX_RESPONSE_BYTES))
            .await
            .expect("an answer");
        assert_eq!(from_completion, from_stream);
        let message: Value = serde_json::from_str(&from_stream).expect("JSON");
        assert_eq!(message["content"], "Hello");
        assert_eq!(message["usage"]["total_tokens"], 7);
    }

    /// `max-response-bytes` caps the message a stream is put together into (a recorded
    /// failure), while the stream itself may take more bytes than that.
    #[cfg(feature = "server")]
    #[tokio::test]
    async fn a_streamed_message_over_the_cap_is_a_recorded_failure() {
        let piece = "x".repeat(400);
        let chunk = |content: &str| {
            format!(
                "data: {}\n\n",
                json!({ "choices": [{ "index": 0, "delta": { "content": content } }] })
            )
        };
        let stream = [chunk(&piece), chunk(&piece), "data: [DONE]\n\n".to_owned()].concat();
        let base = answering(stream, "text/event-stream").await;
        let error = ask(&chat_at(&base, 500)).await.expect_err("over the cap");
        assert!(
            matches!(&error, FunctionError::Failed(m) if m.ends_with("message is larger than 500 bytes")),
            "{error:?}"
        );
        assert!(ask(&chat_at(&base, 2000)).await.is_ok(), "under the cap");
    }

    /// Each piece of a streamed answer goes to the call's deltas as it is read, in order,
    /// and the pieces joined are the recorded content; a model that goes quiet mid-answer
    /// for longer than the function's timeout is cut there, unavailable (nothing recorded:
    /// made again under its key), whatever its answer's whole length.
    #[tokio::test]
    async fn pieces_go_out_as_they_come_and_a_stream_quiet_past_the_timeout_is_cut() {
        #[derive(Default)]
        struct Collected(std::sync::Mutex<Vec<Value>>);
        impl CallDeltas for Collected {
            fn delta(&self, delta: &Value) {
                self.0.lock().expect("lock").push(delta.clone());
            }
        }
        let mock = rewind_mock::MockService::start("127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("the mock starts");
        let chat = |pause_ms: u64, timeout: Duration| {
            let mut chat = chat_at(&format!("{}/v1", mock.base_url()), 1 << 20);
            chat.poster = chat.poster.with_headers(vec![(
                rewind_mock::CHUNK_DELAY_HEADER.to_owned(),
                pause_ms.to_string(),
            )]);
            chat.poster = chat.poster.with_timeout(timeout);
            chat
        };
        let args = json!({ "messages": [{ "role": "user", "content": "Where is A1234?" }] });
        let args = args.to_string();
        let collected = Collected::default();
        let request = CallRequest {
            function: "llm.chat",
            args: &args,
            idempotency_key: "key-1",
            slot: None,
            deltas: Some(&collected),
        };
        // Slower than the timeout in all (six chunks 300 ms apart), never between reads.
        let slow = chat(300, Duration::from_secs(1));
        let result = slow.call(request).await.expect("an answer");
        let result: Value = serde_json::from_str(&result).expect("JSON");
        let pieces = collected.0.lock().expect("lock").clone();
        let joined: String = (pieces.iter())
            .filter_map(|delta| delta["content"].as_str())
            .collect();
        assert!(pieces.len() >= 2, "{pieces:?}");
        assert_eq!(
            Some(joined.as_str()),
            result["content"].as_str(),
            "{pieces:?}"
        );

        let quiet = chat(2_000, Duration::from_millis(200));
        let request = CallRequest {
            idempotency_key: "key-2",
            deltas: None,
            ..request
        };
        let error = quiet.call(request).await.expect_err("cut");
        assert!(
            matches!(&error, FunctionError::Unavailable(m) if m.contains("no chunk within 200ms")),
            "{error:?}"
        );
    }

    fn chat_at(base_url: &str, max_response_bytes: usize) -> OpenAiChatFunction {
        OpenAiChatFunction::new(OpenAiChatConfig {
            base_url: base_url.to_owned(),
            model: "gpt-test".to_owned(),
            http: HttpConfig {
                url: String::new(),
                timeout: Duration::from_secs(10),
                retry: RetryPolicy::default(),
                headers: Vec::new(),
                reconcile_url: None,
                allowed_hosts: None,
                max_response_bytes,
            },
        })
    }

    /// The message `body`, a whole streamed answer, makes up.
    async fn assembled(body: String) -> Result<Value, FunctionError> {
        let reading = Reading {
            url: "http://model",
            max_bytes: usize::MAX,
            between_reads: Duration::from_secs(10),
            deltas: None,
        };
        let whole = [Ok::<_, std::convert::Infallible>(body.into_bytes())];
        assemble(&reading, futures_util::stream::iter(whole)).await
    }

    #[tokio::test]
    async fn streamed_tool_calls_are_joined_from_their_pieces() {
        let chunk = |delta: Value, finish: Value| {
            format!(
                "data: {}\n\n",
                json!({ "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }] })
            )
        };
        let body = [
            chunk(json!({ "role": "assistant", "content": null }), Value::Null),
            chunk(
                json!({ "tool_calls": [{ "index": 0, "id": "call_1", "type": "function",
                    "function": { "name": "lookup", "arguments": "{\"order" } }] }),
                Value::Null,
            ),
            chunk(
                json!({ "tool_calls": [{ "index": 0, "function": { "arguments": "_id\": \"A-1\"}" } }] }),
                Value::Null,
            ),
            chunk(json!({}), json!("tool_calls")),
            format!("data: {}\n\n", json!({ "choices": [], "usage": { "total_tokens": 9 } })),
            "data: [DONE]\n\n".to_owned(),
        ]
        .concat();
        let message = assembled(body).await.expect("assembled");
        assert_eq!(
            message,
            json!({
                "role": "assistant",
                "content": null,
                "tool_calls": [{ "id": "call_1", "type": "function",
                    "function": { "name": "lookup", "arguments": "{\"order_id\": \"A-1\"}" } }],
                "finish_reason": "tool_calls",
                "usage": { "total_tokens": 9 },
            })
        );
        let far = chunk(
            json!({ "tool_calls": [{ "index": 1_000_000_000u64, "function": { "name": "x" } }] }),
            Value::Null,
        );
        let error = assembled(far).await.expect_err("an index past the bound");
        assert!(error.to_string().contains("at most 128"), "{error}");
        // The first choice when the endpoint leaves `index` out; a refusal joined like the
        // content; an error in the stream leaves the remote unavailable (nothing recorded).
        let unindexed = [
            format!(
                "data: {}\n\n",
                json!({ "choices": [{ "delta": { "refusal": "I can" } }] })
            ),
            format!(
                "data: {}\n\n",
                json!({ "choices": [{ "delta": { "refusal": "not." }, "finish_reason": "stop" }] })
            ),
            "data: [DONE]\n\n".to_owned(),
        ]
        .concat();
        let message = assembled(unindexed).await.expect("assembled");
        assert_eq!(message["refusal"], "I cannot.", "{message}");
        assert_eq!(message["finish_reason"], "stop", "{message}");
        let failing = format!(
            "data: {}\n\n",
            json!({ "error": { "message": "overloaded" } })
        );
        let error = assembled(failing)
            .await
            .expect_err("an error in the stream");
        assert!(matches!(error, FunctionError::Unavailable(_)), "{error:?}");
        let cut = chunk(json!({ "content": "Hel" }), Value::Null);
        let error = assembled(cut).await.expect_err("no [DONE]");
        assert!(
            matches!(&error, FunctionError::Unavailable(m) if m.contains("without [DONE]")),
            "not recorded, made again: {error:?}"
        );
    }
}
