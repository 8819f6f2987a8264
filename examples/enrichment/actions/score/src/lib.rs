//! `score`: scores an enriched lead and emits the input's output.
//!
//! Handles the `score` event sent by `person`. Output: `{"email", "source", "company",
//! "person", "score", "grade", "seen_before", "leads_for_account"}`.
//!
//! The score (0 to 100) adds up company size, the person's seniority, how strong a signal
//! the lead's source is, and whether the person has come back.

use rewind_guest::{Action, Context, Error, Event};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

#[derive(Debug, Deserialize)]
struct Enriched {
    email: String,
    source: String,
    seen_before: bool,
    leads_for_account: u64,
    company: Map<String, Value>,
    person: Map<String, Value>,
}

#[derive(Debug, Serialize)]
struct Summary<'a> {
    email: &'a str,
    source: &'a str,
    company: &'a Map<String, Value>,
    person: &'a Map<String, Value>,
    score: u64,
    grade: &'a str,
    seen_before: bool,
    leads_for_account: u64,
}

/// Scores the lead and summarises it.
#[derive(Debug)]
struct Score;

impl Action for Score {
    fn run(ctx: &mut Context, event: Event) -> Result<(), Error> {
        let lead: Enriched = event.payload()?;
        let score = score(&lead);
        let grade = match score {
            70.. => "hot",
            40..70 => "warm",
            _ => "cold",
        };
        ctx.info(&format!("{} scored {score} ({grade})", lead.email));
        ctx.output(&Summary {
            email: &lead.email,
            source: &lead.source,
            company: &lead.company,
            person: &lead.person,
            score,
            grade,
            seen_before: lead.seen_before,
            leads_for_account: lead.leads_for_account,
        })
    }
}

fn score(lead: &Enriched) -> u64 {
    let employees = lead
        .company
        .get("employees")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let size = match employees {
        1000.. => 40,
        200..1000 => 30,
        50..200 => 20,
        _ => 10,
    };

    let title = lead
        .person
        .get("title")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_lowercase();
    let senior = [
        "chief",
        "vp",
        "vice president",
        "head",
        "director",
        "founder",
    ];
    let seniority = if senior.iter().any(|word| title.contains(word)) {
        30
    } else if title.contains("manager") || title.contains("lead") {
        15
    } else {
        5
    };

    let signal = match lead.source.as_str() {
        "demo-request" => 20,
        "trial" => 15,
        "webinar" => 10,
        _ => 5,
    };
    let returning = if lead.seen_before { 10 } else { 0 };

    (size + seniority + signal + returning).min(100)
}

rewind_guest::export_action!(Score);
