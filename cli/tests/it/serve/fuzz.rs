//! The OpenAPI document is the contract: Schemathesis fuzzes a live server from
//! `/v1/openapi.json` (`scripts/api-fuzz.sh`, with every check it has, a fixed seed and a
//! few examples per operation), as the admin and as a tenant, and finds no answer the
//! document does not describe, no 5xx, no response out of its schema.

use std::path::Path;
use std::process::Command;

use reqwest::StatusCode;
use serde_json::json;

use super::{ADMIN, Server};
use crate::support::workspace_root;

/// Operations every run configures alike. An agent.toml and a component are opaque bytes
/// to JSON Schema: whether they parse and fit is the server's to say (400, 422), and each
/// upload counts against `compiles-per-minute` (429); a tenant the stateful phase names
/// may not exist (404). The output stream stays open until
/// the server stops, so a fuzzer would wait out its timeout on every request: the
/// `serve::openapi` test exercises it.
const OPERATIONS: &str = r#"
[[operations]]
include-operation-id = ["define_agent", "upload_component"]
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "404", "422", "429"]

[[operations]]
include-operation-id = "stream_outputs"
enabled = false
"#;

/// Runs Schemathesis against `server` with `token` and the configuration `config`; its
/// report when it finds something.
async fn fuzz(server: &Server, token: &str, config: &Path) -> Result<(), String> {
    let mut command = Command::new(workspace_root().join("scripts").join("api-fuzz.sh"));
    // Its working directory gets what it keeps between runs (`.schemathesis/`).
    command
        .current_dir(config.parent().expect("a directory"))
        .args([&server.base, token, "--config-file"])
        .arg(config)
        .args(["--seed", "1", "--max-examples", "10", "--workers", "1"]);
    let output = tokio::task::spawn_blocking(move || command.output())
        .await
        .expect("the fuzzer's thread")
        .expect("scripts/api-fuzz.sh runs");
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_nothing_the_document_does_not_describe() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), "").await;
    let acme = server.tenant("acme").await;
    server.deploy("acme", &acme, "bot", "caller", "").await;
    let (status, body) = server
        .submit("acme", &acme, "bot", "e0", "k", json!({ "output": true }))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let before = server.wait_outputs("acme", &acme, 1).await;

    let configs = tempfile::tempdir().expect("tempdir");
    let admin = configs.path().join("admin.toml");
    std::fs::write(&admin, OPERATIONS).expect("write");
    // The tenant's run reaches its own data; it may not revoke the token it runs with (the
    // admin's run tries that route).
    let tenant = configs.path().join("tenant.toml");
    std::fs::write(
        &tenant,
        format!(
            "[parameters]\n\"path.tenant\" = \"acme\"\n\"path.agent\" = \"bot\"\n\
             \"path.key\" = \"k\"\n{OPERATIONS}\n[[operations]]\n\
             include-operation-id = \"revoke_token\"\nenabled = false\n"
        ),
    )
    .expect("write");

    for (who, token, config) in [("the admin", ADMIN, &admin), ("a tenant", &*acme, &tenant)] {
        if let Err(report) = fuzz(&server, token, config).await {
            panic!("fuzzed as {who}, Schemathesis found:\n{report}");
        }
    }
    // What the tenant had is as it was, and its token still works.
    let after = server.outputs("acme", &acme, 0).await;
    assert_eq!(
        after[..before.len()],
        before[..],
        "the accepted outputs are unchanged"
    );
}
