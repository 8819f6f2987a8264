//! `POST /v1/chat/completions`: an OpenAI-compatible chat endpoint with deterministic replies.

use std::convert::Infallible;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt as _;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::error::{RequestError, parse_json};
use crate::{CHAT_CREATED, CHUNK_DELAY_HEADER, MAX_DELAY_MS};
use crate::{fnv, intent};

/// The part of an OpenAI chat-completions request the mock reads. Other fields (`tools`,
/// `temperature`, ...) are accepted and ignored.
#[derive(Debug, Deserialize)]
struct ChatRequest {
    model: String,
    messages: Vec<ChatMessage>,
    /// Answer as server-sent events, a chunk at a time.
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    /// A last chunk with no choices and the usage.
    #[serde(default)]
    include_usage: bool,
}

#[derive(Debug, Deserialize)]
struct ChatMessage {
    role: String,
    /// A string, an array of content parts, or null (an assistant turn with tool calls).
    #[serde(default)]
    content: Value,
}

impl ChatMessage {
    /// The message's text: the string content, or the `text` of each text part joined by
    /// newlines.
    fn text(&self) -> String {
        match &self.content {
            Value::String(text) => text.clone(),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|part| part.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        }
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct ChatCompletion {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    choices: [Choice; 1],
    usage: Usage,
}

#[derive(Debug, Serialize)]
struct Choice {
    index: u32,
    message: AssistantMessage,
    finish_reason: &'static str,
}

#[derive(Debug, Serialize)]
struct AssistantMessage {
    role: &'static str,
    content: String,
}

#[derive(Debug, Serialize)]
struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
}

/// Answers with the intent of the last user message as the assistant's content.
///
/// The reply, id included, depends only on the request, so a replayed call and the original
/// get the same answer.
///
/// With `"stream": true` the same reply comes as server-sent events, as OpenAI sends them:
/// chunks of `delta`s (the role, then the content in a few pieces), one with the
/// `finish_reason`, one with the `usage` when `stream_options.include_usage` asks, then
/// `[DONE]`.
pub(crate) async fn complete(headers: HeaderMap, body: Bytes) -> Result<Response, RequestError> {
    let pause = (headers.get(CHUNK_DELAY_HEADER))
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse::<u64>().ok())
        .map(|ms| Duration::from_millis(ms.min(MAX_DELAY_MS)));
    let request: ChatRequest = parse_json(&body)?;
    let streamed = request.stream;
    let include_usage = request
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage);
    let last_user = request
        .messages
        .iter()
        .rev()
        .find(|message| message.role == "user")
        .map(ChatMessage::text)
        .unwrap_or_default();
    let content = intent::classify(&last_user).to_json();

    let prompt_tokens = request
        .messages
        .iter()
        .map(|message| word_count(&message.text()))
        .sum();
    let completion_tokens = word_count(&content);
    let id = fnv::hash(format!("{}\n{}", request.model, last_user).as_bytes());

    let completion = ChatCompletion {
        id: format!("chatcmpl-{id:016x}"),
        object: "chat.completion",
        created: CHAT_CREATED,
        model: request.model,
        choices: [Choice {
            index: 0,
            message: AssistantMessage {
                role: "assistant",
                content,
            },
            finish_reason: "stop",
        }],
        usage: Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        },
    };
    if streamed {
        return Ok(stream(completion, include_usage, pause).into_response());
    }
    Ok(Json(completion).into_response())
}

/// `completion` as the chunks of a streamed answer.
fn stream(
    completion: ChatCompletion,
    include_usage: bool,
    pause: Option<Duration>,
) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>> {
    let [choice] = completion.choices;
    let chunk = |choices: Value, usage: Option<&Usage>| {
        let mut chunk = json!({
            "id": completion.id,
            "object": "chat.completion.chunk",
            "created": completion.created,
            "model": completion.model,
            "choices": choices,
        });
        if let Some(usage) = usage {
            chunk["usage"] = json!(usage);
        }
        chunk.to_string()
    };
    let delta = |delta: Value, finish: Option<&str>| json!([{ "index": 0, "delta": delta, "finish_reason": finish }]);
    let mut data = vec![chunk(
        delta(json!({ "role": "assistant", "content": "" }), None),
        None,
    )];
    let content: Vec<char> = choice.message.content.chars().collect();
    for piece in content.chunks(content.len().div_ceil(3).max(1)) {
        let piece: String = piece.iter().collect();
        data.push(chunk(delta(json!({ "content": piece }), None), None));
    }
    data.push(chunk(delta(json!({}), Some(choice.finish_reason)), None));
    if include_usage {
        data.push(chunk(json!([]), Some(&completion.usage)));
    }
    data.push("[DONE]".to_owned());
    let events = futures_util::stream::iter(data.into_iter().enumerate()).then(
        move |(at, data)| async move {
            if let Some(pause) = pause.filter(|_| at > 0) {
                tokio::time::sleep(pause).await;
            }
            Ok(Event::default().data(data))
        },
    );
    Sse::new(events)
}

/// A stand-in for a tokenizer: whitespace-separated words.
fn word_count(text: &str) -> u64 {
    u64::try_from(text.split_whitespace().count()).unwrap_or(u64::MAX)
}
