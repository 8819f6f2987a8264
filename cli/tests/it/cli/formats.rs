//! State written by earlier builds opens:
//! - a `rewind run` state directory of the format this build writes is in
//!   `host/tests/fixtures/run-state` (written by the build of 2026-12-07, before every file
//!   carried a format version: a parked input, a skip, memory, a recorded call), and a run
//!   resumes from it;
//! - a `rewind serve` state directory of the build before each agent had a state log of its
//!   own is in `host/tests/fixtures/serve-state` (written by 9d7ebf4, killed at
//!   `after-record:1`: tenant `acme`, agent `bot`, key `k`'s input #1 done, #2 killed with
//!   its `clock` call recorded in the tenant's one state log; its token in `token`; the
//!   components left out, put back from the guests built here), and a server resumes it.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::parked::{inspect, run_to_the_end};
use super::{rewind, text, write};
use crate::support::{guest, workspace_root};

/// Copies `from` into `to` as a state directory is kept (directories 0700, files 0600).
fn copy_state(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    for entry in std::fs::read_dir(from).expect("read the fixture") {
        let entry = entry.expect("an entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("a type").is_dir() {
            copy_state(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy");
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600))
                .expect("chmod");
        }
    }
}

#[test]
fn a_run_state_of_the_format_before_versions_opens_and_a_run_resumes_from_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fixture = workspace_root().join("host/tests/fixtures/run-state");
    copy_state(&fixture, &dir.path().join(".rewind"));
    let input = dir.path().join("inputs.jsonl");
    std::fs::rename(dir.path().join(".rewind/inputs.jsonl"), &input).expect("move the inputs");
    let agent = write(
        dir.path(),
        "agent.toml",
        &format!(
            "name = \"fixture\"\n[retry]\nattempts = 1\n[state]\ncheckpoint-every-inputs = 1\n\
             [[actions]]\nname = \"work\"\ncomponent = {:?}\non = [\"input\"]\n\
             [functions.echo]\nkind = \"random\"\n",
            guest("caller").display().to_string()
        ),
    );

    let shown = inspect(dir.path());
    for line in [
        "input bo #1: parked after 1 attempts: action `work`: the action returned an error: \
         the payload is bad; #2 waits behind it",
        "skipped: cy #1 by fixture: kept as a fixture",
        "skip of key cy by fixture: done (#1)",
        "call 0: echo succeeded",
        "memory seen = 1",
    ] {
        assert!(shown.contains(line), "{line:?} not in:\n{shown}");
    }

    let skip = rewind(dir.path())
        .args([
            "skip",
            "--key",
            "bo",
            "--by",
            "t",
            "--reason",
            "done by hand",
        ])
        .output()
        .expect("skip runs");
    assert!(skip.status.success(), "{}", text(&skip.stderr));
    let resumed = run_to_the_end(dir.path(), &agent, &input);
    assert!(resumed.status.success(), "{}", text(&resumed.stderr));
    let outputs = std::fs::read_to_string(dir.path().join("out.jsonl")).expect("outputs");
    let ran: Vec<(String, u64)> = outputs
        .lines()
        .map(|line| {
            let output: Value = serde_json::from_str(line).expect("an output line");
            (
                output["key"].as_str().expect("key").to_owned(),
                output["sequence"].as_u64().expect("sequence"),
            )
        })
        .collect();
    assert_eq!(
        ran,
        [("bo".to_owned(), 2)],
        "only the input waiting behind the skipped one ran; the rest was done"
    );
    assert!(
        inspect(dir.path()).contains("skipped: bo #1 by t: done by hand"),
        "the fixture's history goes on"
    );
}

/// The serve state of `host/tests/fixtures/serve-state`, copied into `dir`, with its guests:
/// written by the build before per-agent state logs (9d7ebf4), killed at after-record:1. The
/// tenant `acme`'s agent `bot` (version 1, a `clock` function) finished #1 of key `k`, and
/// #2's clock call is recorded. Returns the state directory, the tenant's, and its token.
fn serve_fixture(dir: &Path) -> (PathBuf, PathBuf, String) {
    let fixture = workspace_root().join("host/tests/fixtures/serve-state");
    let state = dir.join("state");
    copy_state(&fixture.join("state"), &state);
    let tenant = state.join("tenants/acme");
    for pinned in ["components/worker.wasm", "agents/bot/1/work.wasm"] {
        let path = tenant.join(pinned);
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir");
        std::fs::copy(guest("caller"), path).expect("the guest");
    }
    let token = std::fs::read_to_string(fixture.join("token")).expect("the token");
    (state, tenant, token.trim().to_owned())
}

fn now_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("a clock")
        .as_millis()
}

/// That #2 of the fixture's key `k` ran on the clock reading recorded before the kill (so
/// the call was not made again after `started_ms`), with the memory #1 left.
fn assert_resumed_on_its_record(outputs: &[Value], started_ms: u128) {
    assert_eq!(
        outputs.len(),
        2,
        "#1's output, kept; #2's, once: {outputs:?}"
    );
    let second = &outputs[1]["payload"];
    assert_eq!(second["memory"]["n"], 1, "the memory #1 left: {second}");
    let recorded = second["results"][0]["ok"]["unix_ms"]
        .as_u64()
        .expect("the clock's answer");
    assert!(
        u128::from(recorded) < started_ms,
        "the clock call recorded before the kill is served from its record ({recorded}), not \
         made again now ({started_ms})"
    );
}

#[tokio::test]
async fn a_serve_state_of_the_build_before_per_agent_state_logs_resumes_its_input_in_flight() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (state, tenant, token) = serve_fixture(dir.path());
    let token = token.as_str();
    let started_ms = now_ms();

    let server = crate::serve::Server::start(&state, "").await;
    let outputs = server.wait_outputs("acme", token, 2).await;
    assert_resumed_on_its_record(&outputs, started_ms);

    // The agent defined then keeps the tenant's one state log; a new agent has its own.
    let (status, body) = server
        .define("acme", token, &crate::serve::agent("fresh", "worker", ""))
        .await;
    assert_eq!(status, reqwest::StatusCode::CREATED, "{body}");
    assert!(tenant.join("states/fresh").is_dir());
    assert!(!tenant.join("states/bot").exists());
    let (status, body) = server
        .submit(
            "acme",
            token,
            "bot",
            "e2",
            "k",
            serde_json::json!({ "memory_get": ["n"] }),
        )
        .await;
    assert_eq!(status, reqwest::StatusCode::ACCEPTED, "{body}");
    let outputs = server.wait_outputs("acme", token, 3).await;
    assert_eq!(outputs[2]["payload"]["memory"]["n"], 2, "{outputs:?}");
}

/// A version let go of (older than `agent-versions-loaded`) is built again for its input in
/// flight; its agent's state, opened then for the first time in the process, is rebuilt
/// from its log before the input runs, so the input's recorded call is served.
#[tokio::test]
async fn an_input_of_a_version_let_go_runs_on_its_recorded_calls() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (state, tenant, token) = serve_fixture(dir.path());
    // A newer version that does not load (its file damaged): with one version loaded, no
    // version of `bot` opens its state at the start, and #2's (version 1) is let go of.
    let newer = tenant.join("agents/bot/2");
    std::fs::create_dir_all(&newer).expect("mkdir");
    std::fs::write(newer.join("agent.toml"), "name = \"bot\"\n[[actions]\n").expect("write");
    let started_ms = now_ms();

    let server =
        crate::serve::Server::start(&state, "[tenants.acme.quotas]\nagent-versions-loaded = 1")
            .await;
    let outputs = server.wait_outputs("acme", &token, 2).await;
    assert_resumed_on_its_record(&outputs, started_ms);
}
