//! `lookup`: looks an order up and answers the ticket.
//!
//! Event payload (sent by `triage`): `{"ticket_id", "order_id", "intent"}`. Output:
//! `{"ticket_id", "intent", "order_id", "status", "reply"}`.

use rewind_guest::{Action, CallError, Context, Error, Event};
use serde::{Deserialize, Serialize};
use serde_json::json;

#[derive(Debug, Deserialize)]
struct Lookup {
    ticket_id: String,
    order_id: String,
    intent: String,
}

#[derive(Debug, Serialize)]
struct OrderQuery<'a> {
    order_id: &'a str,
}

/// What `orders.lookup` answers.
#[derive(Debug, Deserialize)]
struct Order {
    status: String,
    #[serde(default)]
    eta_days: Option<u32>,
}

/// Looks up the order a ticket is about and replies to the customer.
#[derive(Debug)]
struct OrderLookup;

impl Action for OrderLookup {
    fn run(ctx: &mut Context, event: Event) -> Result<(), Error> {
        let lookup: Lookup = event.payload()?;
        let query = OrderQuery {
            order_id: &lookup.order_id,
        };
        let (status, reply) = match ctx.call::<_, Order>("orders.lookup", &query) {
            Ok(order) => {
                let reply = reply(&lookup, &order);
                (order.status, reply)
            }
            // The order service answered, and the answer was "no": tell the customer. The
            // failure is recorded, so a rerun gives the same reply without asking again.
            Err(CallError::Failed(message)) => {
                ctx.warn(&format!("order {} not found: {message}", lookup.order_id));
                let reply = format!(
                    "We couldn't find an order {}. Could you double-check the number?",
                    lookup.order_id
                );
                ("unknown".to_string(), reply)
            }
            Err(other) => return Err(other.into()),
        };
        ctx.output(&json!({
            "ticket_id": lookup.ticket_id,
            "intent": lookup.intent,
            "order_id": lookup.order_id,
            "status": status,
            "reply": reply,
        }))
    }
}

/// The sentence the customer gets.
fn reply(lookup: &Lookup, order: &Order) -> String {
    let id = &lookup.order_id;
    let eta = match order.eta_days {
        Some(1) => "in about 1 day".to_string(),
        Some(days) => format!("in about {days} days"),
        None => "soon".to_string(),
    };
    match (lookup.intent.as_str(), order.status.as_str()) {
        ("refund", "delivered") => format!(
            "We've started a refund for order {id}. You'll see it on your statement within \
             5 business days."
        ),
        ("refund", status) => format!(
            "Order {id} hasn't been delivered yet (it is {status}). We can cancel it for a \
             full refund; just reply to confirm."
        ),
        (_, "shipped") => format!("Good news: order {id} has shipped and should arrive {eta}."),
        (_, "processing") => {
            format!("Order {id} is being prepared in our warehouse and should arrive {eta}.")
        }
        (_, "delivered") => format!(
            "Our records show order {id} was delivered. If you can't find it, reply and \
             we'll open an investigation."
        ),
        (_, status) => format!("Order {id} is currently {status}."),
    }
}

rewind_guest::export_action!(OrderLookup);
