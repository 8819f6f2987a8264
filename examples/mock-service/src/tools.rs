//! `POST /tools/{name}`: the tool API. Known tools answer with values derived from their
//! input by a stable hash, so the same input always gets the same answer; any other tool
//! name echoes its request.

use axum::Json;
use axum::body::Bytes;
use axum::extract::Path;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{RequestError, parse_json};
use crate::fnv;

#[derive(Debug, Deserialize)]
struct OrderLookup {
    order_id: String,
}

#[derive(Debug, Serialize)]
pub(crate) struct OrderStatus {
    order_id: String,
    status: &'static str,
    eta_days: u64,
}

/// `orders.lookup`: the status of an order and the days until it arrives (0 once delivered).
pub(crate) async fn orders_lookup(body: Bytes) -> Result<Json<OrderStatus>, RequestError> {
    let OrderLookup { order_id } = parse_json(&body)?;
    Ok(Json(order_status(order_id)))
}

fn order_status(order_id: String) -> OrderStatus {
    let hash = fnv::hash(order_id.as_bytes());
    let status = fnv::pick(hash, &["processing", "shipped", "delivered"]);
    let eta_days = match status {
        "processing" => 3 + (hash >> 8) % 5,
        "shipped" => 1 + (hash >> 8) % 3,
        _ => 0,
    };
    OrderStatus {
        order_id,
        status,
        eta_days,
    }
}

#[derive(Debug, Deserialize)]
struct CompanyQuery {
    domain: String,
}

#[derive(Debug, Serialize)]
pub(crate) struct Company {
    domain: String,
    name: String,
    industry: &'static str,
    employees: u64,
}

const INDUSTRIES: &[&str] = &[
    "Software",
    "Retail",
    "Manufacturing",
    "Logistics",
    "Healthcare",
    "Financial Services",
];

/// `enrich.company`: a company profile for a web domain; `acme.com` is named "Acme".
pub(crate) async fn enrich_company(body: Bytes) -> Result<Json<Company>, RequestError> {
    let CompanyQuery { domain } = parse_json(&body)?;
    let normalized = domain.trim().to_ascii_lowercase();
    let name = company_name(&normalized).ok_or(RequestError::InvalidField {
        field: "domain",
        reason: "expected a domain name like example.com",
    })?;
    let hash = fnv::hash(normalized.as_bytes());
    Ok(Json(Company {
        name,
        industry: fnv::pick(hash, INDUSTRIES),
        employees: 10 + (hash >> 16) % 5000,
        domain,
    }))
}

#[derive(Debug, Deserialize)]
struct PersonQuery {
    email: String,
}

#[derive(Debug, Serialize)]
pub(crate) struct Person {
    email: String,
    name: String,
    company: String,
    title: &'static str,
}

const TITLES: &[&str] = &[
    "Software Engineer",
    "Product Manager",
    "Head of Sales",
    "Designer",
    "CTO",
    "Support Lead",
];

/// `enrich.person`: a person profile for an email address; `jo@acme.com` is "Jo" at "Acme".
pub(crate) async fn enrich_person(body: Bytes) -> Result<Json<Person>, RequestError> {
    const INVALID_EMAIL: RequestError = RequestError::InvalidField {
        field: "email",
        reason: "expected an address like name@example.com",
    };
    let PersonQuery { email } = parse_json(&body)?;
    let normalized = email.trim().to_ascii_lowercase();
    let (local, domain) = normalized.split_once('@').ok_or(INVALID_EMAIL)?;
    // `jo+news@...` is still Jo.
    let local = local.split('+').next().unwrap_or_default();
    let name = title_case(local, &['.', '_', '-']);
    let company = company_name(domain);
    let (Some(company), false) = (company, name.is_empty()) else {
        return Err(INVALID_EMAIL);
    };
    let hash = fnv::hash(normalized.as_bytes());
    Ok(Json(Person {
        email,
        name,
        company,
        title: fnv::pick(hash, TITLES),
    }))
}

#[derive(Debug, Serialize)]
pub(crate) struct Echo {
    tool: String,
    echo: Value,
}

/// Any other tool: answers with its name and the request body it was given.
pub(crate) async fn echo(
    Path(tool): Path<String>,
    body: Bytes,
) -> Result<Json<Echo>, RequestError> {
    let echo = parse_json(&body)?;
    Ok(Json(Echo { tool, echo }))
}

/// The company name for a lowercase domain: its first label (after any `www.`), title-cased
/// with dashes as spaces. `None` if there is no such label.
fn company_name(domain: &str) -> Option<String> {
    let domain = domain.strip_prefix("www.").unwrap_or(domain);
    let label = domain.split('.').next().unwrap_or_default();
    let name = title_case(label, &['-']);
    (!name.is_empty()).then_some(name)
}

/// Splits `text` at `separators` and capitalizes each word: `jane.doe` → `Jane Doe`.
fn title_case(text: &str, separators: &[char]) -> String {
    text.split(separators)
        .filter(|word| !word.is_empty())
        .map(|word| {
            let mut chars = word.chars();
            chars
                .next()
                .map(|first| first.to_uppercase().chain(chars).collect::<String>())
                .unwrap_or_default()
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pinned so that a change to the derivation, which would break recorded demo runs,
    /// shows up here first.
    #[test]
    fn order_status_is_pinned() {
        let status = order_status("A1234".to_owned());
        assert_eq!((status.status, status.eta_days), ("processing", 4));
    }

    #[test]
    fn names_from_domains_and_addresses() {
        assert_eq!(company_name("acme.com").as_deref(), Some("Acme"));
        assert_eq!(company_name("www.acme.co.uk").as_deref(), Some("Acme"));
        assert_eq!(company_name("big-corp.io").as_deref(), Some("Big Corp"));
        assert_eq!(company_name(".com"), None);
        assert_eq!(title_case("jane.doe", &['.']), "Jane Doe");
        assert_eq!(title_case("jo", &['.']), "Jo");
    }
}
