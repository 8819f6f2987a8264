//! `intake` (Rust): checks a customer request and passes it on to `classify` (Python).
//!
//! Input payload: `{"request_id": "R-1", "text": "I'd like a refund for order B2001"}`.
//! Sends `ticket` `{"request_id", "text", "customer"}`, the text trimmed; a request with no
//! id or no text fails with a message that says which.

use rewind_guest::{Action, Context, Error, Event};
use serde::{Deserialize, Serialize};

#[derive(Debug, Deserialize)]
struct Request {
    #[serde(default)]
    request_id: String,
    #[serde(default)]
    text: String,
}

#[derive(Debug, Serialize)]
struct Ticket<'a> {
    request_id: &'a str,
    text: &'a str,
    customer: &'a str,
}

#[derive(Debug)]
struct Intake;

impl Action for Intake {
    fn run(ctx: &mut Context, event: Event) -> Result<(), Error> {
        let request: Request = event.payload()?;
        if request.request_id.trim().is_empty() {
            return Err(Error::msg("the request has no `request_id`"));
        }
        let text = request.text.trim();
        if text.is_empty() {
            return Err(Error::msg(format!(
                "request {} has no `text`",
                request.request_id
            )));
        }
        let customer = ctx.key();
        ctx.send(
            "ticket",
            &Ticket {
                request_id: &request.request_id,
                text,
                customer: &customer,
            },
        )
    }
}

rewind_guest::export_action!(Intake);
