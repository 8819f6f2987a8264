//! `kind = "openai-chat"`: an OpenAI-compatible chat-completions endpoint.
//!
//! Args are `{"messages": [...], "tools"?: [...], ...}` (any other chat-completions field
//! passes through); the result is the assistant message (`choices[0].message`).

use async_trait::async_trait;

use super::http::{HttpConfig, JsonPoster, json_result};
use super::{CallRequest, Function, FunctionError};

/// Where and how to reach the chat endpoint.
#[derive(Clone, Debug)]
pub struct OpenAiChatConfig {
    /// For example `https://api.openai.com/v1`; `/chat/completions` is appended.
    pub base_url: String,
    pub model: String,
    /// Connection settings; its `url` is ignored and headers may carry the API key.
    pub http: HttpConfig,
}

#[derive(Clone, Debug)]
pub struct OpenAiChatFunction {
    poster: JsonPoster,
    model: String,
}

impl OpenAiChatFunction {
    pub fn new(config: OpenAiChatConfig) -> Self {
        let mut http = config.http;
        http.url = format!("{}/chat/completions", config.base_url.trim_end_matches('/'));
        Self {
            poster: JsonPoster::new(http),
            model: config.model,
        }
    }
}

#[async_trait]
impl Function for OpenAiChatFunction {
    async fn call(&self, request: CallRequest<'_>) -> Result<String, FunctionError> {
        let mut body = match serde_json::from_str::<serde_json::Value>(request.args) {
            Ok(serde_json::Value::Object(body))
                if body.get("messages").is_some_and(|m| m.is_array()) =>
            {
                body
            }
            _ => {
                return Err(FunctionError::Failed(
                    "openai-chat args must be an object with a `messages` array".to_owned(),
                ));
            }
        };
        body.entry("model")
            .or_insert_with(|| serde_json::Value::String(self.model.clone()));
        let answer = self
            .poster
            .post(
                serde_json::Value::Object(body).to_string(),
                request.idempotency_key,
            )
            .await?;
        let response = json_result(self.poster.url(), answer)?;
        match response.pointer("/choices/0/message") {
            Some(message) => Ok(message.to_string()),
            None => Err(FunctionError::Failed(format!(
                "{} answered without choices[0].message: {response}",
                self.poster.url()
            ))),
        }
    }

    fn endpoint(&self) -> Option<&str> {
        Some(self.poster.url())
    }
}
