//! `intake`: accepts a lead and remembers which people of the account have shown up.
//!
//! Input payload: `{"email": "jo@acme.com", "source": "webinar"}`; the input's key is the
//! account (the company's domain). Sends one `lead` event, which both `crm` and `company`
//! handle: `{"email", "source", "domain", "seen_before", "leads_for_account"}`.
//!
//! Memory: `leads`, the sorted list of the account's lead emails.

use rewind_guest::{Action, Context, Error, Event};
use serde::{Deserialize, Serialize};

#[derive(Debug, Deserialize)]
struct Input {
    email: String,
    #[serde(default = "unknown_source")]
    source: String,
}

fn unknown_source() -> String {
    "unknown".to_string()
}

/// The `lead` event.
#[derive(Debug, Serialize)]
struct Lead<'a> {
    email: &'a str,
    source: &'a str,
    domain: &'a str,
    seen_before: bool,
    leads_for_account: usize,
}

/// Validates a lead, counts it against its account and passes it on.
#[derive(Debug)]
struct Intake;

impl Action for Intake {
    fn run(ctx: &mut Context, event: Event) -> Result<(), Error> {
        let input: Input = event.payload()?;
        let email = input.email.trim().to_lowercase();
        let domain = match email.split_once('@') {
            Some((local, domain)) if !local.is_empty() && domain.contains('.') => domain,
            _ => {
                return Err(Error::msg(format!(
                    "`{}` is not an email address",
                    input.email
                )));
            }
        };
        let account = ctx.key();
        if domain != account {
            ctx.warn(&format!("lead {email} filed under account {account}"));
        }

        let mut leads: Vec<String> = ctx.memory("leads")?.unwrap_or_default();
        let seen_before = match leads.binary_search(&email) {
            Ok(_) => true,
            Err(position) => {
                leads.insert(position, email.clone());
                false
            }
        };
        ctx.set_memory("leads", &leads)?;

        ctx.send(
            "lead",
            &Lead {
                email: &email,
                source: &input.source,
                domain,
                seen_before,
                leads_for_account: leads.len(),
            },
        )
    }
}

rewind_guest::export_action!(Intake);
