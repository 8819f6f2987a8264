//! Many tenants submitting at once: nothing lost, nothing done twice.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use reqwest::StatusCode;
use serde_json::json;

use super::{Server, send};

const TENANTS: usize = 10;
const EVENTS: usize = 100;

/// 1,000 submissions at once across 10 tenants, a tenth of them sent twice (a client's
/// retry): each event's output appears exactly once, in its own tenant's outputs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_submissions_across_ten_tenants_none_lost_or_doubled() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Arc::new(
        Server::start(
            dir.path(),
            "[quotas]\nconcurrent-runs = 8\ncalls-per-minute = 100000\n",
        )
        .await,
    );
    let mut tokens = BTreeMap::new();
    for t in 0..TENANTS {
        let tenant = format!("tenant-{t}");
        let token = server.tenant(&tenant).await;
        server.deploy(&tenant, &token, "bot", "caller", "").await;
        tokens.insert(tenant, token);
    }
    let tokens = Arc::new(tokens);
    let mut tasks = Vec::new();
    for i in 0..TENANTS * EVENTS {
        let sends = if i % 10 == 0 { 2 } else { 1 };
        for _ in 0..sends {
            let server = Arc::clone(&server);
            let tokens = Arc::clone(&tokens);
            tasks.push(tokio::spawn(async move {
                let tenant = format!("tenant-{}", i % TENANTS);
                let token = &tokens[&tenant];
                let request = server
                    .client
                    .post(server.url(&format!("/v1/tenants/{tenant}/agents/bot/events")))
                    .json(&json!({
                        "id": format!("event-{i}"),
                        "key": format!("key-{}", i % 37),
                        "payload": { "memory_set": { "last": i } },
                    }));
                loop {
                    let (status, body) =
                        send(request.try_clone().expect("clones"), Some(token)).await;
                    match status {
                        StatusCode::ACCEPTED | StatusCode::OK => return status,
                        // Its twin is being accepted right now: retry, as a client would.
                        StatusCode::CONFLICT if body["code"] == "event-in-progress" => {
                            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                        }
                        _ => panic!("{tenant} event-{i}: {status} {body}"),
                    }
                }
            }));
        }
    }
    let mut accepted = 0;
    for task in tasks {
        if task.await.expect("the submission task") == StatusCode::ACCEPTED {
            accepted += 1;
        }
    }
    assert_eq!(
        accepted,
        TENANTS * EVENTS,
        "each event accepted once, retries answered 200"
    );

    for (tenant, token) in tokens.iter() {
        let outputs = server.wait_outputs(tenant, token, EVENTS).await;
        let ids: BTreeSet<&str> = outputs
            .iter()
            .map(|o| o["event_id"].as_str().expect("an event id"))
            .collect();
        assert_eq!(outputs.len(), EVENTS, "{tenant}: none doubled");
        assert_eq!(ids.len(), EVENTS, "{tenant}: none lost");
        let t: usize = tenant
            .trim_start_matches("tenant-")
            .parse()
            .expect("a number");
        assert!(
            ids.iter().all(|id| {
                id.trim_start_matches("event-")
                    .parse::<usize>()
                    .is_ok_and(|i| i % TENANTS == t)
            }),
            "{tenant} sees only its own events"
        );
    }
}
