//! `POST /v1/chat/completions`: an OpenAI-compatible chat endpoint with deterministic replies.

use axum::Json;
use axum::body::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::CHAT_CREATED;
use crate::error::{RequestError, parse_json};
use crate::{fnv, intent};

/// The part of an OpenAI chat-completions request the mock reads. Other fields (`tools`,
/// `temperature`, `stream`, ...) are accepted and ignored.
#[derive(Debug, Deserialize)]
struct ChatRequest {
    model: String,
    messages: Vec<ChatMessage>,
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
pub(crate) async fn complete(body: Bytes) -> Result<Json<ChatCompletion>, RequestError> {
    let request: ChatRequest = parse_json(&body)?;
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
    Ok(Json(completion))
}

/// A stand-in for a tokenizer: whitespace-separated words.
fn word_count(text: &str) -> u64 {
    u64::try_from(text.split_whitespace().count()).unwrap_or(u64::MAX)
}
