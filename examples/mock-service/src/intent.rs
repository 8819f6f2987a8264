//! The deterministic "model" behind the chat endpoint: a user message is classified into an
//! intent, and the reply is that intent as JSON text.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What a user message asks for, as the mock's chat model sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IntentKind {
    /// The message names an order id and does not mention a refund.
    OrderStatus,
    /// The message mentions "refund" (in any letter case).
    Refund,
    /// Anything else.
    General,
}

impl IntentKind {
    /// The name used in the reply's `intent` field: `order-status`, `refund` or `general`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::OrderStatus => "order-status",
            Self::Refund => "refund",
            Self::General => "general",
        }
    }
}

/// A classified user message: the content of the mock's chat replies.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Intent {
    /// What the message asks for.
    pub intent: IntentKind,
    /// The first order id in the message, if any (see [`find_order_id`]).
    pub order_id: Option<String>,
}

impl Intent {
    /// The reply text: compact JSON with `intent` first, e.g.
    /// `{"intent":"order-status","order_id":"A1234"}` or `{"intent":"general","order_id":null}`.
    pub fn to_json(&self) -> String {
        let order_id = self.order_id.clone().map_or(Value::Null, Value::String);
        format!(
            r#"{{"intent":{},"order_id":{}}}"#,
            Value::from(self.intent.as_str()),
            order_id
        )
    }
}

/// Classifies a user message.
///
/// A message mentioning "refund" (any case) is [`IntentKind::Refund`], with its order id if
/// it has one; otherwise a message with an order id is [`IntentKind::OrderStatus`]; anything
/// else is [`IntentKind::General`].
pub fn classify(text: &str) -> Intent {
    let order_id = find_order_id(text).map(str::to_owned);
    let intent = if text.to_lowercase().contains("refund") {
        IntentKind::Refund
    } else if order_id.is_some() {
        IntentKind::OrderStatus
    } else {
        return Intent {
            intent: IntentKind::General,
            order_id: None,
        };
    };
    Intent { intent, order_id }
}

/// The first order id in `text`: an ASCII capital letter followed by three or more ASCII
/// digits (the regular expression `[A-Z]\d{3,}`), with all of its digits.
pub fn find_order_id(text: &str) -> Option<&str> {
    let bytes = text.as_bytes();
    bytes.iter().enumerate().find_map(|(start, byte)| {
        if !byte.is_ascii_uppercase() {
            return None;
        }
        let digits = bytes
            .get(start + 1..)
            .unwrap_or_default()
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count();
        // Both ends sit next to ASCII bytes, so they are char boundaries.
        (digits >= 3)
            .then(|| text.get(start..=start + digits))
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_order_ids() {
        assert_eq!(find_order_id("where is A1234?"), Some("A1234"));
        assert_eq!(find_order_id("order #B987654 please"), Some("B987654"));
        assert_eq!(find_order_id("xA1234"), Some("A1234"));
        assert_eq!(find_order_id("ñ Z999 ü"), Some("Z999"));
        assert_eq!(find_order_id("A12 and a1234"), None);
        assert_eq!(find_order_id(""), None);
        assert_eq!(find_order_id("A12 then C345"), Some("C345"));
    }

    #[test]
    fn classifies_the_three_intents() {
        assert_eq!(
            classify("Where is my order A1234?").to_json(),
            r#"{"intent":"order-status","order_id":"A1234"}"#
        );
        assert_eq!(
            classify("I want a REFUND for A1234").to_json(),
            r#"{"intent":"refund","order_id":"A1234"}"#
        );
        assert_eq!(
            classify("Refunds?").to_json(),
            r#"{"intent":"refund","order_id":null}"#
        );
        assert_eq!(
            classify("hello there").to_json(),
            r#"{"intent":"general","order_id":null}"#
        );
    }

    #[test]
    fn reply_text_round_trips_through_serde() {
        let intent = classify("refund A1234");
        let parsed: Intent = serde_json::from_str(&intent.to_json()).expect("reply is JSON");
        assert_eq!(parsed, intent);
    }
}
