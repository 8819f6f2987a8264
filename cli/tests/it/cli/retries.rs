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
