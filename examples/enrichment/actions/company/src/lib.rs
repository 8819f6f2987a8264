//! `company`: attaches the account's company profile to a lead.
//!
//! Handles the `lead` event. The profile comes from memory when an earlier input of the
//! same account already fetched it, and from `enrich.company` otherwise. Sends a `person`
//! event: the lead plus `company`.
//!
//! Memory: `company`, the profile `enrich.company` returned for this account.

use rewind_guest::{Action, Context, Error, Event};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

#[derive(Debug, Deserialize, Serialize)]
struct Lead {
    email: String,
    source: String,
    domain: String,
    seen_before: bool,
    leads_for_account: u64,
}

/// The `person` event.
#[derive(Debug, Serialize)]
struct WithCompany {
    #[serde(flatten)]
    lead: Lead,
    company: Map<String, Value>,
}

/// Looks up (or remembers) the lead's company.
#[derive(Debug)]
struct Company;

impl Action for Company {
    fn run(ctx: &mut Context, event: Event) -> Result<(), Error> {
        let lead: Lead = event.payload()?;
        let company = match ctx.memory::<Map<String, Value>>("company")? {
            Some(company) => {
                ctx.debug(&format!("company {} from memory", lead.domain));
                company
            }
            None => {
                let company: Map<String, Value> =
                    ctx.call("enrich.company", &json!({ "domain": lead.domain }))?;
                ctx.set_memory("company", &company)?;
                ctx.info(&format!("company {} enriched", lead.domain));
                company
            }
        };
        ctx.send("person", &WithCompany { lead, company })
    }
}

rewind_guest::export_action!(Company);
