//! What a fuzzer of the document cannot send: hostile path segments (`..`, percent-encoded
//! slashes and dots, NUL, overlong UTF-8, bytes that are not UTF-8, 10 KB names) and
//! foreign tokens on every route, as raw HTTP requests (a URL library would normalise the
//! dots away). Never a 5xx or a dropped connection (a panic), never a file outside the
//! state directory, and the tenant's accepted data unchanged.

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::{ADMIN, Server};

/// Segments that have broken servers: traversal, encoded separators, NUL, overlong UTF-8.
const KNOWN: &[&str] = &[
    "..",
    ".",
    "%2e%2e",
    "%2E%2E%2F%2E%2E%2Fetc",
    "..%2f..%2f..%2fetc%2fpasswd",
    "..%5c..%5cwindows",
    "%2F",
    "a%00b",
    "%00",
    "%C0%AE%C0%AE",
    "%ff%fe",
    "acme%2f..%2fglobex",
    "%252e%252e",
    "~",
    "con",
];

/// A path segment: a known bad one, any bytes percent-encoded, or a 10 KB name.
fn segment() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => proptest::sample::select(KNOWN).prop_map(str::to_owned),
        3 => proptest::collection::vec(any::<u8>(), 0..48)
            .prop_map(|bytes| bytes.iter().map(|b| format!("%{b:02X}")).collect()),
        1 => Just("x".repeat(10_000)),
        1 => "[a-z0-9.-]{1,20}",
    ]
}

/// The routes of the document, as (method, path template).
async fn routes(server: &Server) -> Vec<(String, String)> {
    let document: Value = server
        .client
        .get(server.url("/v1/openapi.json"))
        .send()
        .await
        .expect("answers")
        .json()
        .await
        .expect("JSON");
    let mut routes = Vec::new();
    for (path, item) in document["paths"].as_object().expect("paths") {
        for method in item.as_object().expect("an item").keys() {
            routes.push((method.to_uppercase(), path.clone()));
        }
    }
    routes
}

/// Sends a raw request and returns its status; `None` when the connection closed without
/// an answer.
async fn raw(base: &str, method: &str, path: &str, token: Option<&str>) -> Option<u16> {
    let address = base.strip_prefix("http://").expect("plain HTTP");
    let mut stream = tokio::net::TcpStream::connect(address).await.ok()?;
    let mut request =
        format!("{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n");
    if let Some(token) = token {
        request.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    if method == "POST" || method == "PUT" {
        request.push_str("Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}");
    } else {
        request.push_str("\r\n");
    }
    stream.write_all(request.as_bytes()).await.ok()?;
    // The status line only: the output stream's answer never ends.
    let mut answer = Vec::new();
    let mut byte = [0u8; 1];
    while !answer.ends_with(b"\r\n") && answer.len() < 256 {
        if stream.read(&mut byte).await.ok()? == 0 {
            break;
        }
        answer.push(byte[0]);
    }
    let line = String::from_utf8_lossy(&answer);
    line.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
}

/// Every file and directory under `root`, relative to it.
fn tree(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![root.to_owned()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).expect("list").flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path.clone());
            }
            found.push(path.strip_prefix(root).expect("inside").to_owned());
        }
    }
    found
}

#[test]
fn hostile_path_segments_and_foreign_tokens_never_reach_past_the_tenant() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let root = tempfile::tempdir().expect("tempdir");
    // Deep enough that a traversal of a few levels out of it would land inside `root`.
    let state = root.path().join("a").join("b").join("state");
    std::fs::create_dir_all(&state).expect("mkdir");
    let (server, acme, globex, routes, before) = runtime.block_on(async {
        let server = Server::start(&state, "").await;
        let acme = server.tenant("acme").await;
        let globex = server.tenant("globex").await;
        server.deploy("acme", &acme, "bot", "caller", "").await;
        let (status, _) = server
            .submit("acme", &acme, "bot", "e0", "k", json!({ "output": true }))
            .await;
        assert_eq!(status, StatusCode::ACCEPTED);
        let before = server.wait_outputs("acme", &acme, 1).await;
        let routes = routes(&server).await;
        (server, acme, globex, routes, before)
    });
    let outside_before: Vec<PathBuf> = tree(root.path())
        .into_iter()
        .filter(|p| !p.starts_with("a/b/state"))
        .collect();

    let tokens = [
        None,
        Some(ADMIN),
        Some(acme.as_str()),
        Some(globex.as_str()),
        Some("rwt_0000"),
    ];
    let mut runner = TestRunner::new(Config {
        cases: 256,
        failure_persistence: None,
        ..Config::default()
    });
    let cases = (
        0..routes.len(),
        proptest::collection::vec(segment(), 4),
        0..tokens.len(),
        any::<bool>(),
    );
    runner
        .run(&cases, |(route, segments, token, keep_tenant)| {
            let (method, template) = &routes[route];
            let mut path = template.clone();
            // Often the tenant is a real one, so that the later segments reach its data.
            let tenant = if keep_tenant {
                "acme"
            } else {
                segments[0].as_str()
            };
            path = path.replace("{tenant}", tenant);
            for (name, segment) in ["{agent}", "{name}", "{key}", "{id}"]
                .iter()
                .zip(&segments[1..])
            {
                path = path.replace(name, segment);
            }
            let status = runtime.block_on(raw(&server.base, method, &path, tokens[token]));
            match status {
                Some(status) if status < 500 => Ok(()),
                other => Err(TestCaseError::fail(format!(
                    "{method} {path} with token {token}: {other:?}"
                ))),
            }
        })
        .unwrap_or_else(|e| panic!("{e}"));

    let outside_after: Vec<PathBuf> = tree(root.path())
        .into_iter()
        .filter(|p| !p.starts_with("a/b/state"))
        .collect();
    assert_eq!(
        outside_after, outside_before,
        "nothing written outside the state directory"
    );
    runtime.block_on(async {
        let after = server.outputs("acme", &acme, 0).await;
        assert_eq!(
            after[..before.len()],
            before[..],
            "acme's outputs are unchanged"
        );
        let (status, _) = super::send(
            server.client.get(server.url("/v1/tenants/acme/agents/bot")),
            Some(&acme),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "acme's agent is still there");
        server.stop().await;
    });
}
