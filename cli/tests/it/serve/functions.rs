//! A tenant's functions reach only the hosts the operator allows it, with its own secrets.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use super::{Endpoint, Server, agent, send};

const SECRET: &str = "s3cret-of-acme";

#[tokio::test]
async fn functions_reach_allowed_hosts_only_and_secrets_stay_in_the_host() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("acme.key"), format!("{SECRET}\n")).expect("secret");
    let (addr, endpoint) = Endpoint::start(Duration::ZERO, "").await;
    // `localhost` is the same machine, but not on the list: a redirect there is refused.
    let hop_to = format!("http://localhost:{}/", addr.port());
    let (hop_addr, hopper) = Endpoint::start(Duration::ZERO, &hop_to).await;
    let server = Server::start(
        dir.path(),
        &format!(
            "[tenants.acme]\nallow-hosts = [\"{addr}\", \"{hop_addr}\"]\n\
             [tenants.acme.secrets]\nAPI_KEY = {{ file = \"acme.key\" }}\n\
             [tenants.globex]\nallow-hosts = [\"{addr}\"]\n"
        ),
    )
    .await;
    let acme = server.tenant("acme").await;
    let globex = server.tenant("globex").await;
    let functions = format!(
        "[functions.f]\nkind = \"http\"\nurl = \"http://{addr}/\"\n\
         [functions.f.secret-headers]\nauthorization = \"API_KEY\"\n\
         [functions.hop]\nkind = \"http\"\nurl = \"http://{hop_addr}/hop\"\nretries = 0\n"
    );
    server
        .deploy("acme", &acme, "bot", "caller", &functions)
        .await;
    let (status, _) = server
        .submit(
            "acme",
            &acme,
            "bot",
            "e1",
            "k",
            json!({ "calls": [{ "function": "f" }, { "function": "hop" }] }),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let outputs = server.wait_outputs("acme", &acme, 1).await;
    let results = &outputs[0]["payload"]["results"];
    assert_eq!(results[0]["ok"]["n"], 1, "{results}");
    let failed = results[1]["error"]["failed"].as_str().unwrap_or_default();
    assert!(failed.contains("allow-list"), "{results}");
    assert_eq!(endpoint.count(), 1, "the redirect did not reach localhost");
    assert_eq!(hopper.count(), 0, "/hop redirects before counting");
    let seen = endpoint.requests.lock().expect("lock")[0].clone();
    assert_eq!(seen.get("authorization").map(String::as_str), Some(SECRET));

    // The tenant sees its secrets' names, never their values.
    let (_, shown) = send(
        server.client.get(server.url("/v1/tenants/acme")),
        Some(&acme),
    )
    .await;
    assert_eq!(shown["secrets"], json!(["API_KEY"]));
    for path in [
        "/v1/tenants/acme",
        "/v1/tenants/acme/agents/bot",
        "/v1/tenants/acme/agents/bot/keys/k/history",
    ] {
        let response = server
            .client
            .get(server.url(path))
            .bearer_auth(&acme)
            .send()
            .await
            .expect("answers");
        let text = response.text().await.unwrap_or_default();
        assert!(!text.contains(SECRET), "{path}: {text}");
    }
    let outputs = server.outputs("acme", &acme, 0).await;
    assert!(
        !serde_json::to_string(&outputs)
            .unwrap_or_default()
            .contains(SECRET)
    );

    // Globex: a host it is not allowed, and a secret it does not have (acme's).
    server.upload("globex", &globex, "worker", "caller").await;
    let hop_only = format!("[functions.hop]\nkind = \"http\"\nurl = \"http://{hop_addr}/hop\"\n");
    let only_f = format!(
        "[functions.f]\nkind = \"http\"\nurl = \"http://{addr}/\"\n\
         [functions.f.secret-headers]\nauthorization = \"API_KEY\"\n"
    );
    for (functions, says) in [
        (
            hop_only,
            vec![hop_addr.to_string(), "allow-list".to_owned()],
        ),
        (only_f, vec!["API_KEY".to_owned(), "globex".to_owned()]),
    ] {
        let (status, body) = server
            .define("globex", &globex, &agent("bot", "worker", &functions))
            .await;
        assert_eq!(
            (status, body["code"].as_str()),
            (StatusCode::UNPROCESSABLE_ENTITY, Some("cannot-build")),
            "{body}"
        );
        let error = body["error"].as_str().unwrap_or_default();
        assert!(says.iter().all(|s| error.contains(s.as_str())), "{error}");
        assert!(!error.contains(SECRET));
    }
    // A function of its own, to an allowed host, works; it only reaches what it declares.
    let plain = format!("[functions.f]\nkind = \"http\"\nurl = \"http://{addr}/\"\n");
    let (status, body) = server
        .define("globex", &globex, &agent("bot", "worker", &plain))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let (status, _) = server
        .submit(
            "globex",
            &globex,
            "bot",
            "e1",
            "k",
            json!({ "calls": [{ "function": "f" }, { "function": "hop" }] }),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let outputs = server.wait_outputs("globex", &globex, 1).await;
    let results = &outputs[0]["payload"]["results"];
    assert!(
        results[1]["error"]["unknown-function"].is_string(),
        "{results}"
    );
    let seen = endpoint.requests.lock().expect("lock")[1].clone();
    assert_eq!(
        seen.get("authorization"),
        None,
        "globex's call carries no secret"
    );
}
