//! The API over TLS, and the refusal to serve tokens in plain text to other machines.

use std::path::Path;

use reqwest::StatusCode;
use rewind_host::server::{ServerConfig, ServerState};
use serde_json::json;

use super::{ADMIN, Server, send};
use crate::support::{TestCa, sandbox};

/// `[tls]` lines for the certificate `name` of `ca`.
fn tls_section(ca: &TestCa, name: &str) -> String {
    let (cert, key) = ca.issue(name);
    format!("[tls]\ncert = {cert:?}\nkey = {key:?}\n")
}

#[tokio::test]
async fn with_tls_the_api_answers_over_https_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(dir.path());
    let server = Server::start(dir.path(), &tls_section(&ca, "server")).await;
    assert!(server.base.starts_with("https://"), "{}", server.base);

    let client = ca.client();
    let (status, body) = send(
        client
            .post(server.url("/v1/tenants"))
            .json(&json!({ "name": "acme" })),
        Some(ADMIN),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");

    // Plain HTTP to the same port gets no answer: the token would have crossed in clear.
    let plain = server.base.replacen("https://", "http://", 1);
    let answer = reqwest::Client::new()
        .get(format!("{plain}/v1/tenants/acme"))
        .bearer_auth(ADMIN)
        .send()
        .await;
    assert!(answer.is_err(), "{answer:?}");

    // A client that does not trust the certificate is refused by its own side.
    let untrusting = reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .build()
        .expect("client");
    let answer = untrusting.get(server.url("/v1/openapi.json")).send().await;
    assert!(answer.is_err(), "{answer:?}");

    // And a server that is still serving: the failed handshakes cost it nothing.
    let (status, _) = send(client.get(server.url("/v1/tenants/acme")), Some(ADMIN)).await;
    assert_eq!(status, StatusCode::OK);
    server.stop().await;
}

/// The error of a server started with `text` as its rewind.toml in `dir`.
async fn refused(dir: &Path, text: &str) -> String {
    let path = dir.join("rewind.toml");
    let text = format!("{text}\n[admin-token]\nenv = \"UNUSED\"\n");
    let config = match ServerConfig::parse(&path, &text) {
        Ok(config) => config,
        Err(error) => return error.to_string(),
    };
    match ServerState::start(config, &path, ADMIN, sandbox()).await {
        Ok(_) => panic!("started with:\n{text}"),
        Err(error) => error.to_string(),
    }
}

#[tokio::test]
async fn a_server_other_machines_reach_needs_tls_or_says_plaintext_is_meant() {
    let dir = tempfile::tempdir().expect("tempdir");
    for listen in ["0.0.0.0:7070", "[::]:7070", "192.0.2.1:7070"] {
        let error = refused(dir.path(), &format!("listen = \"{listen}\"")).await;
        assert!(
            error.contains(&format!("listen = \"{listen}\""))
                && error.contains("[tls] cert and key")
                && error.contains("allow-plaintext = true"),
            "{error}"
        );
    }
    let path = dir.path().join("rewind.toml");
    for allowed in [
        "listen = \"0.0.0.0:7070\"\nallow-plaintext = true\n",
        "listen = \"127.0.0.1:7070\"\n",
        "listen = \"[::1]:7070\"\n",
    ] {
        let text = format!("{allowed}[admin-token]\nenv = \"UNUSED\"\n");
        ServerConfig::parse(&path, &text).unwrap_or_else(|e| panic!("{allowed}: {e}"));
    }
}

#[tokio::test]
async fn a_certificate_or_key_that_cannot_be_used_is_named_and_the_key_never_shown() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(dir.path());
    let (cert, key) = ca.issue("server");
    let (other_cert, _) = ca.issue("other");
    let missing = dir.path().join("missing.pem");
    let error = refused(
        dir.path(),
        &format!("[tls]\ncert = {missing:?}\nkey = {key:?}\n"),
    )
    .await;
    assert!(
        error.contains("[tls] cert") && error.contains("missing.pem"),
        "{error}"
    );
    let error = refused(
        dir.path(),
        &format!("[tls]\ncert = {cert:?}\nkey = {cert:?}\n"),
    )
    .await;
    assert!(
        error.contains("[tls] key") && error.contains("server.pem"),
        "{error}"
    );
    let error = refused(
        dir.path(),
        &format!("[tls]\ncert = {other_cert:?}\nkey = {key:?}\n"),
    )
    .await;
    assert!(error.contains("does not fit"), "{error}");
    let secret = std::fs::read_to_string(&key).expect("key");
    let body: String = secret.lines().filter(|l| !l.starts_with("-----")).collect();
    assert!(!error.contains(&body[..32]), "{error}");
}
