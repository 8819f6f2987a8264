//! A function's retries under `rewind run`: the wait between attempts holds no run slot.

use serde_json::{Value, json};

use super::{run, text, write};
use crate::support::guest;

/// With one run slot (`parallelism = 1`), an input whose call is refused twice with 429
/// (`Retry-After: 1`) lets go of the slot while it waits: the input behind it, of another
/// key, runs and finishes meanwhile (its output comes first), and the refused call still
/// ends in one result after three requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_waiting_between_attempts_holds_no_run_slot() {
    use rewind_mock::{MockService, THROTTLE_HEADER, THROTTLE_RETRY_AFTER_HEADER};

    let mock = MockService::start("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("the mock starts");
    let dir = tempfile::tempdir().expect("temp dir");
    let agent = write(
        dir.path(),
        "agent.toml",
        &format!(
            "name = \"slots\"\nparallelism = 1\n[[actions]]\nname = \"work\"\ncomponent = \
             {:?}\non = [\"input\"]\n[functions.slow]\nkind = \"http\"\nurl = \
             \"{base}/tools/slow\"\nheaders = {{ \"{THROTTLE_HEADER}\" = \"2\", \
             \"{THROTTLE_RETRY_AFTER_HEADER}\" = \"1\" }}\n[functions.fast]\nkind = \
             \"http\"\nurl = \"{base}/tools/fast\"\n",
            guest("caller").display().to_string(),
            base = mock.base_url(),
        ),
    );
    let call = |function: &str| json!({ "calls": [{ "function": function, "args": {} }] });
    let lines = [("a", call("slow")), ("b", call("fast"))]
        .map(|(key, payload)| json!({ "key": key, "payload": payload }).to_string());
    let input = write(dir.path(), "in.jsonl", &lines.join("\n"));
    let at = dir.path().to_owned();
    let ran = tokio::task::spawn_blocking(move || run(&at, &agent, &input))
        .await
        .expect("join");
    assert!(ran.status.success(), "{}", text(&ran.stderr));
    // Printed as each input finishes.
    let keys: Vec<String> = text(&ran.stdout)
        .lines()
        .map(|line| serde_json::from_str::<Value>(line).expect("an output"))
        .map(|output| output["key"].as_str().expect("a key").to_owned())
        .collect();
    assert_eq!(
        keys,
        ["b", "a"],
        "the fast input ran while the slow one waited between attempts:\n{}",
        text(&ran.stderr)
    );
    let counts = mock.counts();
    assert_eq!(
        (
            counts.for_route("/tools/slow"),
            counts.for_route("/tools/fast")
        ),
        (3, 1),
        "{counts:?}"
    );
}

/// The same under `rewind serve`: with the agent's `parallelism = 1`, the input of another
/// key finishes while a throttled call waits between its attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_serve_a_call_waiting_between_attempts_holds_no_run_slot() {
    use rewind_mock::{MockService, THROTTLE_HEADER, THROTTLE_RETRY_AFTER_HEADER};

    let mock = MockService::start("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("the mock starts");
    let at = mock.base_url().trim_start_matches("http://").to_owned();
    let dir = tempfile::tempdir().expect("temp dir");
    let config = format!("[tenants.acme]\nallow-hosts = [\"{at}\"]\n");
    let server = crate::serve::Server::start(dir.path(), &config).await;
    let token = server.tenant("acme").await;
    let functions = format!(
        "[functions.slow]\nkind = \"http\"\nurl = \"{base}/tools/slow\"\nheaders = {{ \
         \"{THROTTLE_HEADER}\" = \"2\", \"{THROTTLE_RETRY_AFTER_HEADER}\" = \"1\" }}\n\
         [functions.fast]\nkind = \"http\"\nurl = \"{base}/tools/fast\"\n",
        base = mock.base_url(),
    );
    server.upload("acme", &token, "worker", "caller").await;
    let toml = crate::serve::agent("slots", "worker", &functions)
        .replace("name = \"slots\"\n", "name = \"slots\"\nparallelism = 1\n");
    let (status, body) = server.define("acme", &token, &toml).await;
    assert!(status.is_success(), "{status}: {body}");
    let call = |function: &str| json!({ "calls": [{ "function": function, "args": {} }] });
    for (id, key, function) in [("e1", "a", "slow"), ("e2", "b", "fast")] {
        let (status, body) = server
            .submit("acme", &token, "slots", id, key, call(function))
            .await;
        assert!(status.is_success(), "{status}: {body}");
    }
    let outputs = server.wait_outputs("acme", &token, 2).await;
    let keys: Vec<&str> = (outputs.iter())
        .map(|output| output["key"].as_str().expect("a key"))
        .collect();
    assert_eq!(keys, ["b", "a"], "in the order written: {outputs:?}");
    let counts = mock.counts();
    assert_eq!(counts.for_route("/tools/slow"), 3, "{counts:?}");
}
