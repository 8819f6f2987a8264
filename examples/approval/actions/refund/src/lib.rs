//! `refund`: drafts a refund with the chat model, waits for a person to approve or reject
//! it, then pays it or tells the customer why not.
//!
//! Input payload: `{"request_id": "R-1", "order_id": "A1234", "amount_cents": 2500,
//! "reason": "..."}`, and optionally `"approval_timeout_ms"` (default a day: how long the
//! approver has).
//!
//! It waits for signal `approve` (payload `{"by": "ana"}`) or `reject` (payload `{"by":
//! "ana", "why": "..."}`); while it waits it holds nothing, and a restart of the host
//! neither loses nor repeats the draft. Its output: `{"request_id", "order_id", "draft",
//! "status": "refunded" | "rejected" | "expired", "by", "payment"}`.

use std::time::Duration;

use rewind_guest::{Action, Context, Error, Event};
use serde::Deserialize;
use serde_json::{Value, json};

/// How long the approver has, unless the request says otherwise.
const APPROVAL_TIMEOUT: Duration = Duration::from_secs(24 * 60 * 60);

const SYSTEM_PROMPT: &str = "You write short, friendly refund notes for an online shop. \
Given the customer's reason, write two sentences to the customer confirming the refund.";

#[derive(Debug, Deserialize)]
struct Request {
    request_id: String,
    order_id: String,
    amount_cents: u64,
    reason: String,
    #[serde(default)]
    approval_timeout_ms: Option<u64>,
}

/// The assistant message `llm.chat` returns.
#[derive(Debug, Deserialize)]
struct AssistantMessage {
    #[serde(default)]
    content: Option<String>,
}

/// What an approver sends with `approve` or `reject`.
#[derive(Debug, Default, Deserialize)]
struct Decision {
    #[serde(default)]
    by: Option<String>,
    #[serde(default)]
    why: Option<String>,
}

#[derive(Debug)]
struct Refund;

impl Action for Refund {
    fn run(ctx: &mut Context, event: Event) -> Result<(), Error> {
        let request: Request = event.payload()?;
        let drafted: AssistantMessage = ctx.call(
            "llm.chat",
            &json!({
                "messages": [
                    { "role": "system", "content": SYSTEM_PROMPT },
                    { "role": "user", "content": request.reason },
                ],
            }),
        )?;
        let draft = drafted.content.unwrap_or_default();
        ctx.info(&format!(
            "refund {} drafted; waiting for `approve` or `reject`",
            request.request_id
        ));

        let timeout = request
            .approval_timeout_ms
            .map_or(APPROVAL_TIMEOUT, Duration::from_millis);
        let signal = ctx.await_signal(&["approve", "reject"], Some(timeout));
        let decision: Decision = match &signal {
            Some(signal) => signal.payload().unwrap_or_default(),
            None => Decision::default(),
        };
        let (status, payment) = match signal.as_ref().map(|s| s.name.as_str()) {
            Some("approve") => {
                let paid: Value = ctx.call(
                    "payments.refund",
                    &json!({
                        "order_id": request.order_id,
                        "amount_cents": request.amount_cents,
                        "approved_by": decision.by,
                    }),
                )?;
                ("refunded", paid)
            }
            outcome => {
                let (status, message) = match outcome {
                    Some(_) => (
                        "rejected",
                        decision
                            .why
                            .clone()
                            .unwrap_or_else(|| "Your refund was not approved.".to_owned()),
                    ),
                    None => (
                        "expired",
                        "Nobody could review your refund in time; we will be in touch.".to_owned(),
                    ),
                };
                let _sent: Value = ctx.call(
                    "notify.customer",
                    &json!({ "order_id": request.order_id, "message": message }),
                )?;
                (status, Value::Null)
            }
        };
        ctx.output(&json!({
            "request_id": request.request_id,
            "order_id": request.order_id,
            "draft": draft,
            "status": status,
            "by": decision.by,
            "payment": payment,
        }))
    }
}

rewind_guest::export_action!(Refund);
