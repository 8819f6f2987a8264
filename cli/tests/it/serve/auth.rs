//! Tenants, tokens, who may reach what, and uploads.

use std::io::{BufRead as _, BufReader};
use std::process::{Command, Stdio};

use reqwest::StatusCode;
use serde_json::json;

use super::{ADMIN, Server, create, send};
use crate::support::guest;

/// A server over `state_dir`; its base URL.
async fn start(state_dir: &std::path::Path) -> String {
    start_with(state_dir, "").await
}

/// The same, with `extra` lines at the top of its rewind.toml.
async fn start_with(state_dir: &std::path::Path, extra: &str) -> String {
    Server::start(state_dir, extra).await.base
}

#[tokio::test]
async fn every_request_needs_a_valid_token() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = start(dir.path()).await;
    let client = reqwest::Client::new();
    for token in [
        None,
        Some(""),
        Some("rwt_0000"),
        Some("admin-token-for-the-test"),
    ] {
        for url in ["/v1/tenants/acme", "/v1/no-such-route"] {
            let (status, body) = send(client.get(format!("{base}{url}")), token).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{url} {token:?}: {body}");
            assert_eq!(body["code"], "unauthorized");
        }
        let (status, _) = send(
            client
                .post(format!("{base}/v1/tenants"))
                .json(&json!({ "name": "x" })),
            token,
        )
        .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
    }
}

#[tokio::test]
async fn a_tenant_token_reaches_only_its_tenant_and_guesses_fail_like_others() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = start(dir.path()).await;
    let client = reqwest::Client::new();
    let acme = create(&client, &base, "acme").await;
    let _globex = create(&client, &base, "globex").await;

    let (status, body) = send(client.get(format!("{base}/v1/tenants/acme")), Some(&acme)).await;
    assert_eq!(
        (status, body["tenant"].clone()),
        (StatusCode::OK, json!("acme"))
    );

    // Another tenant that exists and one that does not: the same answer.
    let (existing, existing_body) =
        send(client.get(format!("{base}/v1/tenants/globex")), Some(&acme)).await;
    let (guessed, guessed_body) = send(
        client.get(format!("{base}/v1/tenants/initech")),
        Some(&acme),
    )
    .await;
    assert_eq!(existing, StatusCode::FORBIDDEN);
    assert_eq!((existing, existing_body), (guessed, guessed_body));

    // Only the admin creates tenants and issues tokens.
    let (status, _) = send(
        client
            .post(format!("{base}/v1/tenants"))
            .json(&json!({ "name": "mine" })),
        Some(&acme),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, _) = send(
        client.post(format!("{base}/v1/tenants/acme/tokens")),
        Some(&acme),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
}

#[tokio::test]
async fn the_admin_creates_tenants_with_checked_names_and_tokens_survive_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), "").await;
    let base = server.base.clone();
    let client = reqwest::Client::new();
    let first = create(&client, &base, "acme").await;

    for (body, code) in [
        (json!({ "name": "acme" }), StatusCode::CONFLICT),
        (json!({ "name": "Not OK" }), StatusCode::BAD_REQUEST),
        (json!({ "nom": "acme" }), StatusCode::BAD_REQUEST),
    ] {
        let (status, answer) = send(
            client.post(format!("{base}/v1/tenants")).json(&body),
            Some(ADMIN),
        )
        .await;
        assert_eq!(status, code, "{body}: {answer}");
        assert!(answer["error"].as_str().is_some_and(|e| !e.is_empty()));
    }
    let (status, body) = send(
        client.post(format!("{base}/v1/tenants/acme/tokens")),
        Some(ADMIN),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    let second = body["token"].as_str().expect("a token").to_owned();

    // Stored hashed: neither token is in the state directory.
    let stored = std::fs::read_to_string(dir.path().join("tenants.json")).expect("registry");
    assert!(!stored.contains(&first) && !stored.contains(&second));

    // Another server over the same state, once the first has stopped: both tokens still
    // work.
    server.stop().await;
    let again = start(dir.path()).await;
    for token in [&first, &second] {
        let (status, _) = send(client.get(format!("{again}/v1/tenants/acme")), Some(token)).await;
        assert_eq!(status, StatusCode::OK);
    }
}

/// The binary: configured by rewind.toml, stops on SIGTERM.
#[tokio::test]
async fn rewind_serve_starts_from_its_config_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("admin.token"), format!("{ADMIN}\n")).expect("token");
    std::fs::write(
        dir.path().join("rewind.toml"),
        "listen = \"127.0.0.1:0\"\n\n[admin-token]\nfile = \"admin.token\"\n",
    )
    .expect("config");
    let mut child = Command::new(env!("CARGO_BIN_EXE_rewind"))
        .args(["serve", "--config"])
        .arg(dir.path().join("rewind.toml"))
        .stderr(Stdio::piped())
        .spawn()
        .expect("rewind serve starts");
    let mut stderr = BufReader::new(child.stderr.take().expect("stderr"));
    let mut line = String::new();
    stderr.read_line(&mut line).expect("a line");
    let base = line
        .trim()
        .rsplit_once(' ')
        .map(|(_, url)| url.to_owned())
        .expect("listening on URL");
    assert!(base.starts_with("http://127.0.0.1:"), "{line}");

    let client = reqwest::Client::new();
    let token = create(&client, &base, "acme").await;
    let (status, _) = send(client.get(format!("{base}/v1/tenants/acme")), Some(&token)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        dir.path()
            .join("rewind-state")
            .join("tenants.json")
            .exists()
    );

    let pid = rustix::process::Pid::from_raw(child.id().cast_signed()).expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("SIGTERM");
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .expect("joined")
        .expect("waits");
    assert!(status.success(), "{status}");
}

#[test]
fn a_config_with_an_unknown_key_or_a_missing_token_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("rewind.toml");
    for (text, expected) in [
        (
            "lisen = \"127.0.0.1:0\"\n[admin-token]\nenv = \"X\"\n",
            "lisen",
        ),
        (
            "[admin-token]\nenv = \"REWIND_TEST_NO_SUCH_VARIABLE\"\n",
            "REWIND_TEST_NO_SUCH_VARIABLE is not set",
        ),
    ] {
        std::fs::write(&config, text).expect("config");
        let output = Command::new(env!("CARGO_BIN_EXE_rewind"))
            .args(["serve", "--config"])
            .arg(&config)
            .env_remove("REWIND_TEST_NO_SUCH_VARIABLE")
            .output()
            .expect("runs");
        assert!(!output.status.success());
        let said = String::from_utf8_lossy(&output.stderr);
        assert!(
            said.contains(expected) && said.contains("rewind.toml"),
            "{said}"
        );
    }
}

#[tokio::test]
async fn a_component_upload_is_checked_and_each_bad_one_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = start_with(dir.path(), "max-component-mib = 1").await;
    let client = reqwest::Client::new();
    let acme = create(&client, &base, "acme").await;
    let globex = create(&client, &base, "globex").await;
    let upload = |tenant: &str, name: &str, body: Vec<u8>, token: &str| {
        let request = client
            .put(format!("{base}/v1/tenants/{tenant}/components/{name}"))
            .body(body)
            .bearer_auth(token);
        send(request, None)
    };

    let noop = std::fs::read(guest("noop")).expect("the noop guest");
    let (status, body) = upload("acme", "noop", noop.clone(), &acme).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["bytes"], noop.len());
    assert!(
        dir.path()
            .join("tenants/acme/components/noop.wasm")
            .exists()
    );

    let forbidden_import = br#"(component (import "acme:evil/net@1.0.0" (instance)))"#.to_vec();
    for (body, expected, code) in [
        (b"hello".to_vec(), StatusCode::BAD_REQUEST, "not-wasm"),
        (b"(module)".to_vec(), StatusCode::BAD_REQUEST, "core-module"),
        (
            forbidden_import,
            StatusCode::UNPROCESSABLE_ENTITY,
            "wrong-world",
        ),
        (vec![0; 2 << 20], StatusCode::PAYLOAD_TOO_LARGE, "too-large"),
    ] {
        let (status, answer) = upload("acme", "bad", body, &acme).await;
        assert_eq!(
            (status, answer["code"].as_str()),
            (expected, Some(code)),
            "{answer}"
        );
    }
    let (status, answer) = upload("acme", "Bad Name", noop.clone(), &acme).await;
    assert_eq!(
        (status, answer["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("bad-name"))
    );
    assert!(!dir.path().join("tenants/acme/components/bad.wasm").exists());

    let list = |tenant: &str, token: &str| {
        let request = client
            .get(format!("{base}/v1/tenants/{tenant}/components"))
            .bearer_auth(token);
        send(request, None)
    };
    let (status, listed) = list("acme", &acme).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        listed["components"],
        json!([{ "component": "noop", "bytes": noop.len() }]),
        "only the upload that was accepted"
    );
    let (status, listed) = list("globex", &globex).await;
    assert_eq!(
        (status, listed["components"].clone()),
        (StatusCode::OK, json!([]))
    );
    let (status, _) = list("acme", &globex).await;
    assert_eq!(status, StatusCode::FORBIDDEN);

    // Another tenant's token cannot deploy into acme, nor learn whether a tenant exists.
    let (into_acme, _) = upload("acme", "noop", noop.clone(), &globex).await;
    let (into_nobody, _) = upload("initech", "noop", noop, &globex).await;
    assert_eq!(
        (into_acme, into_nobody),
        (StatusCode::FORBIDDEN, StatusCode::FORBIDDEN)
    );
}

#[tokio::test]
async fn a_revoked_token_gets_401_at_once_and_after_a_restart_and_tokens_are_listed_without_secrets()
 {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(dir.path(), "").await;
    let (base, client) = (server.base.clone(), server.client.clone());
    let (status, created) = send(
        client
            .post(format!("{base}/v1/tenants"))
            .json(&json!({ "name": "acme" })),
        Some(ADMIN),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let (first, first_id) = (
        created["token"].as_str().expect("token").to_owned(),
        created["id"].as_str().expect("id").to_owned(),
    );
    let (status, issued) = send(
        client.post(format!("{base}/v1/tenants/acme/tokens")),
        Some(ADMIN),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{issued}");
    let second = issued["token"].as_str().expect("token").to_owned();
    let globex = create(&client, &base, "globex").await;

    // Listed by the tenant itself, or the admin: ids and times, never a token.
    let tokens_url = format!("{base}/v1/tenants/acme/tokens");
    for token in [first.as_str(), ADMIN] {
        let (status, listed) = send(client.get(&tokens_url), Some(token)).await;
        assert_eq!(status, StatusCode::OK, "{listed}");
        let ids: Vec<_> = listed
            .as_array()
            .expect("a list")
            .iter()
            .map(|t| t["id"].as_str().expect("id"))
            .collect();
        assert_eq!(ids, [first_id.as_str(), issued["id"].as_str().expect("id")]);
        assert!(listed[0]["last_used_ms"].is_u64(), "{listed}");
        let text = listed.to_string();
        assert!(
            !text.contains(&first[4..]) && !text.contains(&second[4..]),
            "{text}"
        );
    }
    // Another tenant learns nothing: its token gets the same 403 for acme's tokens, whether
    // the id exists or not, and for a tenant that does not exist.
    let revoke_url = |tenant: &str, id: &str| format!("{base}/v1/tenants/{tenant}/tokens/{id}");
    let mut answers = Vec::new();
    for url in [
        tokens_url.clone(),
        revoke_url("acme", &first_id),
        revoke_url("acme", "tok_0000000000000000"),
        revoke_url("initech", &first_id),
    ] {
        let request = if url == tokens_url {
            client.get(&url)
        } else {
            client.delete(&url)
        };
        answers.push(send(request, Some(&globex)).await);
    }
    assert!(
        answers.iter().all(|a| a == &answers[0]) && answers[0].0 == StatusCode::FORBIDDEN,
        "{answers:?}"
    );

    // The tenant revokes its first token with its second: refused at once.
    let (status, body) = send(client.delete(revoke_url("acme", &first_id)), Some(&second)).await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    let (status, body) = send(client.get(format!("{base}/v1/tenants/acme")), Some(&first)).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::UNAUTHORIZED, Some("unauthorized")),
        "{body}"
    );
    let (status, body) = send(client.delete(revoke_url("acme", &first_id)), Some(&second)).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not-found")),
        "{body}"
    );
    server.stop().await;

    let server = Server::start(dir.path(), "").await;
    let base = server.base.clone();
    let (status, _) = send(client.get(format!("{base}/v1/tenants/acme")), Some(&first)).await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "revoked after a restart too"
    );
    let (status, listed) = send(
        client.get(format!("{base}/v1/tenants/acme/tokens")),
        Some(&second),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    // A tenant may revoke the token it uses: the next request with it is refused.
    let own = listed[0]["id"].as_str().expect("id").to_owned();
    let (status, _) = send(
        client.delete(format!("{base}/v1/tenants/acme/tokens/{own}")),
        Some(&second),
    )
    .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, _) = send(client.get(format!("{base}/v1/tenants/acme")), Some(&second)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn the_state_directory_and_every_file_in_it_are_private_to_the_user() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().expect("tempdir");
    // A directory made by someone with a lax umask is taken private too.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let server = Server::start(dir.path(), "").await;
    let acme = server.tenant("acme").await;
    server.deploy("acme", &acme, "bot", "caller", "").await;
    let (status, body) = server
        .submit("acme", &acme, "bot", "e1", "k", json!({ "output": true }))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    server.wait_outputs("acme", &acme, 1).await;
    server.stop().await;

    let mut seen = Vec::new();
    let mut open = Vec::new();
    let mut pending = vec![dir.path().to_owned()];
    while let Some(path) = pending.pop() {
        let metadata = std::fs::symlink_metadata(&path).expect("stat");
        let mode = metadata.permissions().mode() & 0o777;
        let name = path.strip_prefix(dir.path()).expect("inside").to_owned();
        if mode & 0o077 != 0 {
            open.push(format!("{} ({mode:o})", name.display()));
        }
        if metadata.is_dir() {
            for entry in std::fs::read_dir(&path).expect("list") {
                pending.push(entry.expect("entry").path());
            }
        }
        seen.push(name);
    }
    for expected in ["tenants.json", "tenants/acme/components/worker.wasm"] {
        assert!(
            seen.iter().any(|p| p.as_os_str() == expected),
            "{expected} is not in {seen:?}"
        );
    }
    assert!(
        seen.iter().any(|p| p.starts_with("tenants/acme/compiled")),
        "{seen:?}"
    );
    assert!(open.is_empty(), "others may read: {open:?}");
}
