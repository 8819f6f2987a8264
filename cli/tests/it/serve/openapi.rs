//! The OpenAPI document at /v1/openapi.json, and every route in it exercised.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use super::{ADMIN, Server, agent};
use crate::support::guest;

#[tokio::test]
async fn every_route_in_the_openapi_document_answers_as_it_documents() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A function slower than it waits: a call to it is left in doubt, to resolve.
    let (addr, _slow) = super::Endpoint::start(std::time::Duration::from_secs(30), "").await;
    let server = Server::start(
        dir.path(),
        &format!("[tenants.acme]\nallow-hosts = [\"{addr}\"]\n"),
    )
    .await;
    let acme = server.tenant("acme").await;
    let slow = format!(
        "signals = [\"worker\"]\n[functions.slow]\nkind = \"http\"\nurl = \"http://{addr}/\"\ntimeout-ms = 100\n\
         retries = 0\nin-doubt = \"fail\"\n"
    );
    server.deploy("acme", &acme, "bot", "caller", &slow).await;
    let (status, _) = server
        .submit("acme", &acme, "bot", "e0", "k", json!(null))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    server.wait_outputs("acme", &acme, 1).await;
    // Parked inputs to retry (key r), skip (key s) and cancel (key c).
    for key in ["r", "s", "c"] {
        let failing = json!({ "fail": "on purpose" });
        let (status, _) = server.submit("acme", &acme, "bot", key, key, failing).await;
        assert_eq!(status, StatusCode::ACCEPTED);
        server.settled_history("acme", &acme, "bot", key).await;
    }
    // A parked input whose call is in doubt, to resolve (key v).
    let (status, _) = server
        .submit("acme", &acme, "bot", "v", "v", super::one_call("slow"))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    server.settled_history("acme", &acme, "bot", "v").await;
    // An input that waits for two signals, to send them to (key w).
    let waits = json!({ "calls": [{ "await": ["worker"] }, { "await": ["worker"] }] });
    let (status, _) = server.submit("acme", &acme, "bot", "w", "w", waits).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    // A token to revoke.
    let (status, spare) = super::send(
        server.client.post(server.url("/v1/tenants/acme/tokens")),
        Some(ADMIN),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{spare}");
    let spare = spare["id"].as_str().expect("an id").to_owned();

    let response = server
        .client
        .get(server.url("/v1/openapi.json"))
        .send()
        .await
        .expect("answers");
    assert_eq!(response.status(), StatusCode::OK);
    let document: Value = response.json().await.expect("JSON");
    assert!(
        document["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3."))
    );
    let paths = document["paths"].as_object().expect("paths");
    let mut exercised = 0;
    for (path, item) in paths {
        let url = path
            .replace("{tenant}", "acme")
            .replace("{name}", "worker")
            .replace("{agent}", "bot")
            .replace("{key}", command_key(path))
            .replace("{sequence}", "1")
            .replace("{call}", "0")
            .replace("{id}", &spare);
        for (method, operation) in item.as_object().expect("a path item") {
            let Ok(method) = method.to_uppercase().parse::<Method>() else {
                continue;
            };
            let request = server.client.request(method.clone(), server.url(&url));
            let (request, token) = match (method.as_str(), path.as_str()) {
                ("POST", "/v1/tenants") => (request.json(&json!({ "name": "fresh" })), ADMIN),
                ("POST", "/v1/tenants/{tenant}/tokens") => (request, ADMIN),
                ("PUT", _) => (
                    request.body(std::fs::read(guest("caller")).expect("caller")),
                    acme.as_str(),
                ),
                ("POST", "/v1/tenants/{tenant}/agents") => {
                    (request.body(agent("bot", "worker", "")), acme.as_str())
                }
                ("POST", path) if path.ends_with("/skip") => (
                    request.json(&json!({ "reason": "the test says so" })),
                    acme.as_str(),
                ),
                ("POST", path)
                    if path.ends_with("/retry")
                        || path.ends_with("/cancel")
                        || path.ends_with("/signals/{name}") =>
                {
                    (request, acme.as_str())
                }
                ("POST", path) if path.ends_with("/resolve") => (
                    request.json(&json!({ "result": { "n": 1 } })),
                    acme.as_str(),
                ),
                ("POST", _) => (
                    request.json(&json!({ "id": "e1", "key": "k", "payload": null })),
                    acme.as_str(),
                ),
                _ => (request, acme.as_str()),
            };
            let response = request.bearer_auth(token).send().await.expect("answers");
            let status = response.status();
            let responses = operation["responses"].as_object().expect("responses");
            assert!(
                responses.contains_key("401") && responses.contains_key("403"),
                "{method} {path} documents its authentication errors"
            );
            let documented = responses.keys().any(|code| code == status.as_str());
            // A stream stays open: its headers are the answer.
            let body = if path.ends_with("/stream") {
                String::new()
            } else {
                response.text().await.unwrap_or_default()
            };
            assert!(
                status.is_success() && documented,
                "{method} {path}: {status} {body}"
            );
            exercised += 1;
        }
    }
    assert_eq!(exercised, 21, "every route of the API is in the document");
}

/// The key a route's `{key}` stands for: one with a parked input for a retry, a skip, a
/// resolve or a cancel.
fn command_key(path: &str) -> &'static str {
    if path.ends_with("/retry") {
        "r"
    } else if path.ends_with("/skip") {
        "s"
    } else if path.ends_with("/resolve") {
        "v"
    } else if path.ends_with("/cancel") {
        "c"
    } else if path.ends_with("/signals/{name}") {
        "w"
    } else {
        "k"
    }
}

#[tokio::test]
async fn a_method_a_route_does_not_take_is_405_in_the_error_shape_with_allow() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), "").await;
    let response = server
        .client
        .patch(server.url("/v1/tenants/acme/outputs"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .expect("answers");
    assert_eq!(response.status(), StatusCode::METHOD_NOT_ALLOWED);
    let allow = response.headers().get("allow").cloned();
    assert_eq!(
        allow.as_ref().and_then(|v| v.to_str().ok()),
        Some("GET,HEAD")
    );
    let body: Value = response.json().await.expect("a JSON error");
    assert_eq!(body["code"], "method-not-allowed", "{body}");
}
