//! A cluster on a nats-server that speaks TLS only, verifies clients' certificates and
//! takes a user and password: hosts, publishers and readers reach it with `--nats-ca`,
//! `--nats-cert`/`--nats-key`, `--nats-user` and `$REWIND_NATS_PASSWORD`; the password is
//! never shown, in a log or in an error.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use rewind_host::testing::nats::NatsServers;
use serde_json::json;

use super::cluster::{Host, world};
use crate::support::{TestCa, workspace_root};

const PASSWORD: &str = "pw-never-shown-7f3a";

fn rewind(args: &[String], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rewind"))
        .arg("--cache-dir")
        .arg(workspace_root().join("target").join("rewind-test-cache"))
        .args(args)
        .env_remove("REWIND_NATS_PASSWORD")
        .envs(env.iter().copied())
        .output()
        .expect("rewind runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_reaches_nats_over_tls_with_a_client_certificate_and_a_user() {
    let certs = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::new(certs.path());
    let (server_cert, server_key) = ca.issue("nats");
    let (client_cert, client_key) = ca.issue("client");
    let servers = NatsServers::single_with_config(&format!(
        "tls {{ cert_file: {server_cert:?}, key_file: {server_key:?}, ca_file: {:?}, verify: true }}\n\
         authorization {{ users = [ {{ user: rewind, password: \"{PASSWORD}\" }} ] }}\n",
        ca.ca_pem
    ))
    .expect("nats-server starts");
    let world = world(servers).await;
    let (url, dir) = (world.url.clone(), world.dir.path());
    let path = |p: &std::path::Path| p.display().to_string();
    let secure: Vec<String> = [
        "--nats-ca",
        &path(&ca.ca_pem),
        "--nats-cert",
        &path(&client_cert),
        "--nats-key",
        &path(&client_key),
        "--nats-user",
        "rewind",
    ]
    .map(str::to_owned)
    .to_vec();
    let password = [("REWIND_NATS_PASSWORD", PASSWORD)];
    let flags: Vec<&str> = secure.iter().map(String::as_str).collect();
    let host = Host::start_in_env(dir, &url, "a", 1, &flags, &password);
    host.joined().await;

    let input = dir.join("inputs.jsonl");
    let lines: Vec<String> = (1..=2)
        .map(|i| {
            json!({ "id": format!("e{i}"), "key": "k", "payload": {
                "calls": [{ "function": "charge", "args": { "input": i } }] } })
            .to_string()
        })
        .collect();
    std::fs::write(&input, lines.join("\n")).expect("inputs");
    let at = |command: &[&str]| -> Vec<String> {
        let mut args: Vec<String> = ["cluster"]
            .iter()
            .chain(command)
            .map(|s| (*s).to_owned())
            .collect();
        args.extend(["--nats", &url, "--prefix", "t"].map(str::to_owned));
        args
    };
    let mut publish = at(&["publish", "billing", "--input", &path(&input)]);
    publish.extend(secure.iter().cloned());
    let published = rewind(&publish, &password);
    assert!(published.status.success(), "{}", text(&published.stderr));

    let mut read = at(&["outputs"]);
    read.extend(secure.iter().cloned());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let outputs = rewind(&read, &password);
        assert!(outputs.status.success(), "{}", text(&outputs.stderr));
        if text(&outputs.stdout).lines().count() == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "no outputs: {}", host.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Refused without what the server asks for, saying where, never the password.
    let in_url = url.replacen("nats://", &format!("nats://rewind:{PASSWORD}@"), 1);
    let without_client_cert: Vec<String> =
        secure[..2].iter().chain(&secure[6..]).cloned().collect();
    for (what, url_given, flags, env) in [
        (
            "a wrong password",
            url.as_str(),
            secure.clone(),
            [("REWIND_NATS_PASSWORD", "wrong-pw")],
        ),
        (
            "no client certificate",
            url.as_str(),
            without_client_cert,
            password,
        ),
        ("an untrusted server", in_url.as_str(), Vec::new(), password),
    ] {
        let mut args: Vec<String> = ["cluster", "outputs", "--nats", url_given, "--prefix", "t"]
            .map(str::to_owned)
            .to_vec();
        args.extend(flags);
        let refused = rewind(&args, &env);
        let stderr = text(&refused.stderr);
        assert!(!refused.status.success(), "{what}: {stderr}");
        assert!(
            stderr.contains("cannot connect to NATS at nats://"),
            "{what}: {stderr}"
        );
        assert!(
            !stderr.contains(PASSWORD) && !stderr.contains("wrong-pw"),
            "{what}: {stderr}"
        );
    }
    let log = host.log();
    assert!(!log.contains(PASSWORD), "{log}");
}

#[test]
fn credentials_of_two_kinds_or_a_user_without_a_password_are_refused_before_connecting() {
    let dir = tempfile::tempdir().expect("tempdir");
    let creds = dir.path().join("user.creds");
    for (flags, env, says) in [
        (
            vec!["--nats-user", "rewind"],
            vec![],
            "--nats-user rewind needs its password in $REWIND_NATS_PASSWORD",
        ),
        (
            vec!["--nats-creds", creds.to_str().expect("utf-8")],
            vec![("REWIND_NATS_TOKEN", "tok-never-shown")],
            "REWIND_NATS_TOKEN and --nats-creds",
        ),
    ] {
        let mut args: Vec<String> = ["cluster", "outputs", "--nats", "nats://127.0.0.1:9"]
            .map(str::to_owned)
            .to_vec();
        args.extend(flags.iter().map(|s| (*s).to_owned()));
        let refused = rewind(&args, &env);
        let stderr = text(&refused.stderr);
        assert!(!refused.status.success(), "{stderr}");
        assert!(stderr.contains(says), "{stderr}");
        assert!(!stderr.contains("tok-never-shown"), "{stderr}");
    }
}
