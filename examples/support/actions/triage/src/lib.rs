//! `triage`: classifies a support ticket with the model and routes it.
//!
//! Input payload: `{"ticket_id": "T-1", "text": "Where is my order A1234?"}`.
//!
//! The model is asked for `{"intent": .., "order_id": ..}`. A ticket about an order goes
//! on to `lookup` as a `lookup` event `{"ticket_id", "order_id", "intent"}`; any other
//! ticket is answered here with an output `{"ticket_id", "intent", "order_id": null,
//! "status": null, "reply"}`.

use rewind_guest::{Action, Context, Error, Event};
use serde::{Deserialize, Serialize};
use serde_json::json;

const SYSTEM_PROMPT: &str = "You triage customer support tickets for an online shop. \
Classify the ticket and extract the order id it mentions, if any. \
Answer with a single JSON object and nothing else: \
{\"intent\": \"order-status\" | \"refund\" | \"general\", \"order_id\": string or null}.";

#[derive(Debug, Deserialize)]
struct Ticket {
    ticket_id: String,
    text: String,
}

/// The assistant message `llm.chat` returns.
#[derive(Debug, Deserialize)]
struct AssistantMessage {
    #[serde(default)]
    content: Option<String>,
}

/// What the model is asked to answer with.
#[derive(Debug, Deserialize)]
struct Classification {
    intent: String,
    #[serde(default)]
    order_id: Option<String>,
}

/// The event `lookup` handles.
#[derive(Debug, Serialize)]
struct Lookup<'a> {
    ticket_id: &'a str,
    order_id: &'a str,
    intent: &'a str,
}

/// Classifies a ticket and routes it.
#[derive(Debug)]
struct Triage;

impl Action for Triage {
    fn run(ctx: &mut Context, event: Event) -> Result<(), Error> {
        let ticket: Ticket = event.payload()?;
        let answer: AssistantMessage = ctx.call(
            "llm.chat",
            &json!({
                "messages": [
                    { "role": "system", "content": SYSTEM_PROMPT },
                    { "role": "user", "content": ticket.text },
                ],
            }),
        )?;
        let classification = classify(ctx, &ticket, answer.content.as_deref().unwrap_or(""));
        let intent = classification.intent.as_str();
        ctx.info(&format!(
            "ticket {} classified as {intent}",
            ticket.ticket_id
        ));

        match classification.order_id.as_deref() {
            Some(order_id) if !order_id.is_empty() => ctx.send(
                "lookup",
                &Lookup {
                    ticket_id: &ticket.ticket_id,
                    order_id,
                    intent,
                },
            ),
            _ => ctx.output(&json!({
                "ticket_id": ticket.ticket_id,
                "intent": intent,
                "order_id": null,
                "status": null,
                "reply": reply_without_order(intent),
            })),
        }
    }
}

/// Reads the model's answer; an answer that is not the JSON asked for is treated as a
/// general question rather than failing the ticket.
fn classify(ctx: &Context, ticket: &Ticket, content: &str) -> Classification {
    match serde_json::from_str::<Classification>(content.trim()) {
        Ok(classification) => classification,
        Err(error) => {
            ctx.warn(&format!(
                "ticket {}: model answer is not the expected JSON ({error}); treating it as general",
                ticket.ticket_id
            ));
            Classification {
                intent: "general".to_string(),
                order_id: None,
            }
        }
    }
}

fn reply_without_order(intent: &str) -> &'static str {
    match intent {
        "refund" => {
            "We're sorry to hear that. Please reply with your order number (it looks like \
             A1234) and we'll start the refund right away."
        }
        "order-status" => {
            "Happy to check on your order. Please reply with your order number (it looks \
             like A1234)."
        }
        _ => {
            "Thanks for reaching out! A member of our support team will get back to you \
             within one business day."
        }
    }
}

rewind_guest::export_action!(Triage);
