//! `kind = "openai-chat"`: an OpenAI-compatible chat-completions endpoint.
//!
//! Args are `{"messages": [...], "tools"?: [...], ...}` (any other chat-completions field
//! passes through; `model` defaults to the function's). The result is the assistant message
//! (`choices[0].message`: `role`, `content`, `tool_calls` when the model calls tools), with
//! the choice's `finish_reason` and the answer's `usage` beside its fields when the endpoint
//! gives them.

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
        let Some(serde_json::Value::Object(mut message)) =
            response.pointer("/choices/0/message").cloned()
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
        Ok(serde_json::Value::Object(message).to_string())
    }

    fn endpoint(&self) -> Option<&str> {
        Some(self.poster.url())
    }
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
        let chat = OpenAiChatFunction::new(OpenAiChatConfig {
            base_url: format!("{}/v1", mock.base_url()),
            model: "gpt-test".to_owned(),
            http: HttpConfig {
                url: String::new(),
                timeout: Duration::from_secs(10),
                retry: RetryPolicy::default(),
                headers: Vec::new(),
                reconcile_url: None,
                allowed_hosts: None,
                max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            },
        });
        let args = r#"{"messages": [{"role": "user", "content": "where is order A-1?"}]}"#;
        let result = chat
            .call(CallRequest {
                function: "llm.chat",
                args,
                idempotency_key: "key-1",
            })
            .await
            .expect("an answer");
        let result: serde_json::Value = serde_json::from_str(&result).expect("JSON");
        assert_eq!(result["role"], "assistant", "{result}");
        assert!(result["content"].is_string(), "{result}");
        assert_eq!(result["finish_reason"], "stop", "{result}");
        assert!(result["usage"]["total_tokens"].is_u64(), "{result}");
    }
}
