//! `person`: attaches the person's profile to a lead.
//!
//! Handles the `person` event sent by `company`, calls `enrich.person`, and sends a
//! `score` event: the lead plus `person`.

use rewind_guest::{Action, Context, Error, Event};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

/// The `person` event. Fields this action does not use are carried along unchanged.
#[derive(Debug, Deserialize, Serialize)]
struct Lead {
    email: String,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// The `score` event.
#[derive(Debug, Serialize)]
struct WithPerson {
    #[serde(flatten)]
    lead: Lead,
    person: Map<String, Value>,
}

/// Looks up the person behind the lead's email.
#[derive(Debug)]
struct Person;

impl Action for Person {
    fn run(ctx: &mut Context, event: Event) -> Result<(), Error> {
        let lead: Lead = event.payload()?;
        let person: Map<String, Value> =
            ctx.call("enrich.person", &json!({ "email": lead.email }))?;
        ctx.send("score", &WithPerson { lead, person })
    }
}

rewind_guest::export_action!(Person);
