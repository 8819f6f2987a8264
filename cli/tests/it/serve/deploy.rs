//! Defining agents: checked, versioned, components pinned; and tenant B sees nothing of A's.

use reqwest::StatusCode;
use serde_json::{Value, json};

use super::{Server, agent, send};

#[tokio::test]
async fn a_bad_agent_definition_is_refused_with_what_is_wrong() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), "").await;
    let acme = server.tenant("acme").await;
    server.upload("acme", &acme, "worker", "caller").await;
    for (toml, status, code, says) in [
        (
            "name = \"a\"\nparalelism = 2\n".to_owned(),
            StatusCode::BAD_REQUEST,
            "bad-agent",
            "paralelism",
        ),
        (
            agent("a", "nothing-here", ""),
            StatusCode::UNPROCESSABLE_ENTITY,
            "unknown-component",
            "nothing-here",
        ),
        (
            agent("a", "worker", "[state]\npartitions = 200\n"),
            StatusCode::BAD_REQUEST,
            "bad-agent",
            "[state] partitions = 200: a server keeps 1 to 64",
        ),
        (
            agent("a", "worker", "[state]\ncheckpoint-every-ms = 5\n"),
            StatusCode::BAD_REQUEST,
            "bad-agent",
            "checkpoint-every-ms = 5",
        ),
        (
            agent("Not A Name", "worker", ""),
            StatusCode::BAD_REQUEST,
            "bad-agent",
            "Not A Name",
        ),
        (
            // An action's name names its pinned component's file: never a path.
            "name = \"a\"\n[[actions]]\nname = \"../../../globex/components/worker\"\n\
             component = \"worker\"\non = [\"input\"]\n"
                .to_owned(),
            StatusCode::BAD_REQUEST,
            "bad-agent",
            "action name",
        ),
        (
            agent("a", "worker", "[functions.x]\nkind = \"custom\"\n"),
            StatusCode::UNPROCESSABLE_ENTITY,
            "cannot-build",
            "no handler",
        ),
    ] {
        let (got, body) = server.define("acme", &acme, &toml).await;
        assert_eq!(
            (got, body["code"].as_str()),
            (status, Some(code)),
            "{toml}: {body}"
        );
        let error = body["error"].as_str().unwrap_or_default();
        assert!(error.contains(says), "{toml}: {error}");
    }
    let (status, body) = send(
        server.client.get(server.url("/v1/tenants/acme/agents")),
        Some(&acme),
    )
    .await;
    assert_eq!(
        (status, body["agents"].clone()),
        (StatusCode::OK, json!([])),
        "nothing refused was kept"
    );
}

/// A new version takes new inputs; an input accepted before runs on its own version, and a
/// component uploaded again does not change a version defined before.
#[tokio::test]
async fn inputs_in_flight_finish_on_the_version_they_started_with() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (addr, endpoint) = super::Endpoint::start(std::time::Duration::from_millis(600), "").await;
    let server = Server::start(
        dir.path(),
        &format!("[tenants.acme]\nallow-hosts = [\"{addr}\"]\n"),
    )
    .await;
    let acme = server.tenant("acme").await;
    let slow = format!("[functions.slow]\nkind = \"http\"\nurl = \"http://{addr}/\"\n");
    server.deploy("acme", &acme, "bot", "caller", &slow).await;

    // v1 runs the caller; its input waits on a slow call while v2 is defined.
    let (status, first) = server
        .submit("acme", &acme, "bot", "e1", "k", super::one_call("slow"))
        .await;
    assert_eq!(
        (status, first["version"].clone()),
        (StatusCode::ACCEPTED, json!(1))
    );
    server.upload("acme", &acme, "worker", "hostile").await;
    let (status, defined) = server
        .define("acme", &acme, &agent("bot", "worker", &slow))
        .await;
    assert_eq!(
        (status, defined["version"].clone()),
        (StatusCode::CREATED, json!(2)),
        "{defined}"
    );
    let (status, second) = server
        .submit("acme", &acme, "bot", "e2", "k", json!({ "mode": "print" }))
        .await;
    assert_eq!(
        (status, second["version"].clone()),
        (StatusCode::ACCEPTED, json!(2))
    );

    let outputs = server.wait_outputs("acme", &acme, 2).await;
    assert_eq!(outputs.len(), 2, "{outputs:?}");
    // The hostile guest cannot read the caller's script: e1 completed on v1's caller.
    assert_eq!(outputs[0]["event_id"], "e1");
    assert_eq!(outputs[0]["payload"]["results"][0]["ok"]["n"], 1);
    assert_eq!(outputs[1]["event_id"], "e2");
    assert_eq!(outputs[1]["payload"], json!({ "printed": true }));
    assert_eq!(endpoint.count(), 1);

    let history = server.settled_history("acme", &acme, "bot", "k").await;
    let versions: Vec<&Value> = history["inputs"]
        .as_array()
        .expect("inputs")
        .iter()
        .map(|i| &i["version"])
        .collect();
    assert_eq!(versions, [&json!(1), &json!(2)]);
    let (status, shown) = send(
        server.client.get(server.url("/v1/tenants/acme/agents/bot")),
        Some(&acme),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        (shown["current"].clone(), shown["versions"].clone()),
        (json!(2), json!([1, 2]))
    );
}

/// Tenant B's token cannot read, deploy, submit or inspect anything of A's, and a guessed
/// name fails exactly as a real one does.
#[tokio::test]
async fn another_tenants_token_reaches_nothing_and_guesses_fail_the_same_way() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), "").await;
    let acme = server.tenant("acme").await;
    let globex = server.tenant("globex").await;
    server.deploy("acme", &acme, "bot", "caller", "").await;
    let (status, _) = server
        .submit("acme", &acme, "bot", "e1", "k", json!(null))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    server.wait_outputs("acme", &acme, 1).await;

    let wasm = std::fs::read(crate::support::guest("noop")).expect("noop");
    let event = json!({ "id": "x", "key": "k", "payload": null });
    let requests = |tenant: &str, agent: &str, key: &str| {
        let c = &server.client;
        let u = |path: String| server.url(&format!("/v1/tenants/{tenant}{path}"));
        vec![
            c.get(u(String::new())),
            c.get(u("/components".into())),
            c.put(u("/components/worker".into())).body(wasm.clone()),
            c.get(u("/agents".into())),
            c.post(u("/agents".into())).body(agent_toml_for(agent)),
            c.get(u(format!("/agents/{agent}"))),
            c.post(u(format!("/agents/{agent}/events"))).json(&event),
            c.get(u("/outputs".into())),
            c.get(u("/outputs/stream".into())),
            c.get(u(format!("/agents/{agent}/keys/{key}/history"))),
        ]
    };
    let real = requests("acme", "bot", "k");
    let guessed = requests("initech", "nobot", "nokey");
    for (real, guessed) in real.into_iter().zip(guessed) {
        let real = real.build().expect("request");
        let what = format!("{} {}", real.method(), real.url().path());
        let real = server
            .client
            .execute(with_token(real, &globex))
            .await
            .expect("answers");
        let guessed = server
            .client
            .execute(with_token(guessed.build().expect("request"), &globex))
            .await
            .expect("answers");
        let (real_status, guessed_status) = (real.status(), guessed.status());
        let real_body = real.text().await.unwrap_or_default();
        let guessed_body = guessed.text().await.unwrap_or_default();
        assert_eq!(real_status, StatusCode::FORBIDDEN, "{what}: {real_body}");
        assert_eq!(
            (real_status, real_body),
            (guessed_status, guessed_body),
            "{what}"
        );
    }
    // Nothing of globex's attempts reached acme.
    let outputs = server.outputs("acme", &acme, 0).await;
    assert_eq!(outputs.len(), 1);
    let (_, agents) = send(
        server.client.get(server.url("/v1/tenants/acme/agents")),
        Some(&acme),
    )
    .await;
    assert_eq!(agents["agents"][0]["versions"], json!([1]));
}

fn agent_toml_for(name: &str) -> String {
    agent(name, "worker", "")
}

fn with_token(mut request: reqwest::Request, token: &str) -> reqwest::Request {
    request.headers_mut().insert(
        reqwest::header::AUTHORIZATION,
        format!("Bearer {token}").parse().expect("a header"),
    );
    request
}

/// An agent's `[state]` under `serve`: its own state log, with the partitions it asks for
/// (the default otherwise); its partitions and marker are fixed for its life on the server,
/// its compaction cadence is the newest version's.
#[tokio::test]
async fn each_agent_keeps_its_state_as_its_state_section_says_and_fixed_for_its_life() {
    use rewind_host::log::FileLog;

    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), "").await;
    let acme = server.tenant("acme").await;
    let refresh = "[state]\npartitions = 2\nmarker = \"refresh\"\ncheckpoint-every-inputs = 1\n";
    server.deploy("acme", &acme, "bot", "caller", refresh).await;
    let (status, body) = server
        .define("acme", &acme, &agent("plain", "worker", ""))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    for (i, agent_name) in ["bot", "plain", "bot"].iter().enumerate() {
        let payload = json!({ "memory_set": { "n": i } });
        let (status, body) = server
            .submit("acme", &acme, agent_name, &format!("e{i}"), "k", payload)
            .await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    }
    server.wait_outputs("acme", &acme, 3).await;
    let states = dir.path().join("tenants/acme/states");
    let partitions = |agent: &str| FileLog::partitions_in(&states.join(agent)).expect("read");
    assert_eq!(
        (partitions("bot"), partitions("plain")),
        (Some(2), Some(8)),
        "the partitions asked for, and the default"
    );

    for (changed, says) in [
        (
            "[state]\npartitions = 2\n",
            "marker = \"offsets\" (its state keeps \"refresh\")",
        ),
        (
            "[state]\npartitions = 3\nmarker = \"refresh\"\n",
            "partitions = 3 (its state log has 2)",
        ),
    ] {
        let (status, body) = server
            .define("acme", &acme, &agent("bot", "worker", changed))
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{changed}: {body}");
        let error = body["error"].as_str().unwrap_or_default();
        assert!(
            error.contains(says) && error.contains("fixed for its life"),
            "{changed}: {error}"
        );
    }
    // A version that leaves partitions out takes the state's, and may change the cadence
    // (how it is kept to: the unit tests of server/states.rs).
    let cadence = "[state]\nmarker = \"refresh\"\ncheckpoint-every-ms = 500\n";
    let (status, body) = server
        .define("acme", &acme, &agent("bot", "worker", cadence))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, body) = server
        .submit("acme", &acme, "bot", "e3", "k", json!({}))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    server.wait_outputs("acme", &acme, 4).await;

    // A first definition that fails fixes nothing: the next one makes the state it asks.
    let broken = "[state]\npartitions = 4\n[functions.x]\nkind = \"custom\"\n";
    let (status, body) = server
        .define("acme", &acme, &agent("late", "worker", broken))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(!states.join("late").exists(), "no state is left behind");
    let (status, body) = server
        .define(
            "acme",
            &acme,
            &agent("late", "worker", "[state]\npartitions = 6\n"),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(partitions("late"), Some(6));
}
