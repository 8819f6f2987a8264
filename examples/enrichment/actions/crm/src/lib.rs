//! `crm`: records every lead in the CRM as soon as it arrives.
//!
//! Handles the `lead` event (alongside `company`, which enriches it). Its call,
//! `crm.upsert`, changes the outside world, which is why it must happen once per lead even
//! when the agent is killed and resumed. Sends nothing.

use rewind_guest::{Action, Context, Error, Event};
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Deserialize)]
struct Lead {
    email: String,
    source: String,
    domain: String,
    seen_before: bool,
}

/// The CRM record.
#[derive(Debug, Serialize)]
struct Upsert<'a> {
    email: &'a str,
    account: &'a str,
    source: &'a str,
    lifecycle_stage: &'a str,
}

/// Writes the lead to the CRM.
#[derive(Debug)]
struct Crm;

impl Action for Crm {
    fn run(ctx: &mut Context, event: Event) -> Result<(), Error> {
        let lead: Lead = event.payload()?;
        let stage = if lead.seen_before { "engaged" } else { "new" };
        let _receipt: Value = ctx.call(
            "crm.upsert",
            &Upsert {
                email: &lead.email,
                account: &lead.domain,
                source: &lead.source,
                lifecycle_stage: stage,
            },
        )?;
        ctx.info(&format!("crm: {} recorded as {stage}", lead.email));
        Ok(())
    }
}

rewind_guest::export_action!(Crm);
