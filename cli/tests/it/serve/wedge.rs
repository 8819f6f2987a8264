//! One tenant cannot wedge itself: an input whose end is larger than a journal record fails,
//! saying so, and is parked; skipped, its key goes on, and the tenant takes the next event,
//! before and after a restart.

use reqwest::StatusCode;
use serde_json::{Value, json};

use super::{Server, statuses};

/// Raised so that a key's memory can outgrow a journal record (64 MiB).
const ROOMY: &str = "[tenants.acme.quotas]\nmemory-mib = 512\n\
    memory-set-bytes = 67_108_864\nmemory-bytes = 268_435_456\nfuel = 20_000_000_000\n";

const LIMITS: &str = "[limits]\nmemory-mib = 512\nmemory-set-bytes = 67_108_864\n\
    memory-bytes = 268_435_456\nfuel = 20_000_000_000\n";

/// Sets one memory value of `mib` MiB under a name `name_bytes` long.
fn write(mib: usize, name_bytes: usize) -> Value {
    json!({ "mode": "memory", "count": 1, "bytes": mib << 20, "name-bytes": name_bytes })
}

async fn submit(server: &Server, token: &str, id: &str, payload: Value) {
    let (status, body) = server.submit("acme", token, "bot", id, "k", payload).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
}

#[tokio::test]
async fn an_input_whose_end_outgrows_a_journal_record_is_parked_and_once_skipped_the_key_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), ROOMY).await;
    let token = server.tenant("acme").await;
    server
        .deploy("acme", &token, "bot", "hostile", LIMITS)
        .await;

    // 36 MiB of memory, then 36 more under another name: 72 MiB, more than a record.
    submit(&server, &token, "first", write(36, 0)).await;
    submit(&server, &token, "second", write(36, 8)).await;
    submit(&server, &token, "third", write(1, 9)).await;
    let history = server.settled_history("acme", &token, "bot", "k").await;
    let inputs = history["inputs"].as_array().expect("inputs");
    assert_eq!(
        statuses(&history),
        ["done", "parked", "accepted"],
        "{history:.2000}"
    );
    let error = inputs[1]["error"].as_str().expect("an error");
    assert!(
        error.contains("more than the 67108864 the tenant's journal takes in one record"),
        "{error}"
    );
    assert!(error.len() < 1024, "a bounded error: {error}");
    // Skipped, it lets the key go on.
    let (status, body) = server
        .skip("acme", &token, "bot", "k", 2, "its memory cannot be kept")
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let history = server.settled_history("acme", &token, "bot", "k").await;
    assert_eq!(
        statuses(&history),
        ["done", "skipped", "done"],
        "{history:.2000}"
    );

    // Started again, the tenant reads its journal back and takes the next event.
    server.stop().await;
    let server = Server::start(dir.path(), ROOMY).await;
    submit(&server, &token, "fourth", write(1, 10)).await;
    let history = server.settled_history("acme", &token, "bot", "k").await;
    assert_eq!(
        statuses(&history),
        ["done", "skipped", "done", "done"],
        "{history:.2000}"
    );
}
