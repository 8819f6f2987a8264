//! The Python and JavaScript SDKs keep the Rust one's meaning: a failure raised in an action
//! fails the run with its text and keeps its calls recorded; a call's failure reaches the
//! action as the SDK's error; the three languages mix in one agent.

use serde_json::json;

use crate::support::{
    Counting, agent_toml, agent_with, first_output, input, memory_store, workspace_root,
};

in_every_language!(
    a_failure_raised_in_the_action_fails_the_run_with_its_text_and_keeps_its_calls,
    an_error_of_the_action_itself_is_reported_with_what_it_names,
    a_failed_call_reaches_the_action_as_a_call_failure,
    a_panic_or_an_exception_fails_the_run_saying_what_and_where,
);

async fn a_failure_raised_in_the_action_fails_the_run_with_its_text_and_keeps_its_calls(
    caller: &str,
) {
    let count = Counting::new();
    let agent = agent_with(
        &agent_toml(caller, "", ""),
        memory_store(),
        &[("count", count.clone())],
    );
    let payload = json!({
        "calls": [{ "function": "count" }],
        "memory_set": { "seen": true },
        "fail": "ticket T-9 has no customer",
    });
    let first = agent
        .process(&input("k", 1, payload.clone()), &Default::default())
        .await;
    let error = first.error.expect("the run fails").to_string();
    assert!(error.contains("ticket T-9 has no customer"), "{error}");
    assert!(first.outputs.is_empty());
    assert_eq!(
        first.memory.get("seen"),
        None,
        "a failed run writes nothing"
    );

    let again = agent
        .process(&input("k", 1, payload), &Default::default())
        .await;
    assert!(again.error.is_some());
    assert_eq!(count.calls(), 1, "the call stays recorded and is served");
}

async fn an_error_of_the_action_itself_is_reported_with_what_it_names(caller: &str) {
    let agent = agent_with(&agent_toml(caller, "", ""), memory_store(), &[]);
    let report = agent
        .process(
            &input("k", 1, json!({ "colour": "blue" })),
            &Default::default(),
        )
        .await;
    let error = report.error.expect("the run fails").to_string();
    assert!(error.contains("colour"), "{error}");
}

/// Rust panics, Python raises `ValueError` and JavaScript throws `RangeError`, each in a
/// function `raise` of the action's file: the error names the failure, its message, and
/// where (the panic's place, or the trace's frames with file and line).
async fn a_panic_or_an_exception_fails_the_run_saying_what_and_where(caller: &str) {
    let agent = agent_with(&agent_toml(caller, "", ""), memory_store(), &[]);
    let report = agent
        .process(
            &input("k", 1, json!({ "raise": "no route to T-9" })),
            &Default::default(),
        )
        .await;
    let error = report.error.expect("the run fails").to_string();
    let expected: &[&str] = match caller {
        "caller" => &["panicked at", "src/lib.rs:", "no route to T-9"],
        "caller_py" => &[
            "Traceback (most recent call last)",
            "action.py",
            "line ",
            "in _raise",
            "ValueError: no route to T-9",
        ],
        _ => &["RangeError: no route to T-9", "raise@", "action.js:"],
    };
    for part in expected {
        assert!(error.contains(part), "`{part}` is not in: {error}");
    }
    assert!(
        !error.contains("unreachable") && error.len() < 4096,
        "{error}"
    );
}

async fn a_failed_call_reaches_the_action_as_a_call_failure(caller: &str) {
    let agent = agent_with(
        &agent_toml(caller, "", ""),
        memory_store(),
        &[("pay", Counting::failing("card declined"))],
    );
    let report = agent
        .process(
            &input(
                "k",
                1,
                json!({ "calls": [{ "function": "pay" }, { "function": "nope" }] }),
            ),
            &Default::default(),
        )
        .await;
    assert!(report.error.is_none(), "{report:?}");
    let results = &first_output(&report)["results"];
    assert_eq!(
        results[0],
        json!({ "error": { "failed": "card declined" } })
    );
    assert!(
        results[1]["error"]["unknown-function"]
            .as_str()
            .is_some_and(|m| m.contains("nope")),
        "{results}"
    );
}

/// The polyglot example: a Rust, a Python and a JavaScript action in one pipeline, against
/// the example mock service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_agent_runs_rust_python_and_javascript_actions_in_one_pipeline() {
    crate::support::guest("caller");
    let mock = rewind_mock::MockService::start("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("mock");
    let dir = workspace_root().join("examples").join("polyglot");
    let toml = std::fs::read_to_string(dir.join("agent.toml"))
        .expect("agent.toml")
        .replace("http://127.0.0.1:7181", &mock.base_url());
    let file = rewind_host::agent::AgentFile::parse(&dir.join("agent.toml"), &toml)
        .expect("the example's agent.toml");
    let agent = rewind_host::agent::Agent::builder(file, crate::support::sandbox())
        .store(memory_store())
        .build()
        .expect("the agent loads");
    let report = agent
        .process(&input(
            "cust-ben",
            1,
            json!({ "request_id": "R-1", "text": "I'd like a refund for order B2001, it arrived cracked." }),
        ), &Default::default())
        .await;
    assert!(report.error.is_none(), "{report:?}");
    assert_eq!(report.runs, 3, "intake, classify and resolve ran");
    let output = first_output(&report);
    assert_eq!(output["intent"], "refund");
    assert_eq!(output["order_id"], "B2001");
    let refund_id = output["refund_id"].as_str().expect("a refund id");
    assert_eq!(refund_id.len(), 36, "a UUID: {refund_id}");
}
