//! The `rewind` binary, as a user runs it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{Value, json};

use crate::support::{guest, guests_dir, workspace_root};

mod approval;
mod formats;
mod lock;
mod parked;
mod retries;
mod waits;

pub(super) fn rewind(dir: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rewind"));
    command
        .current_dir(dir)
        .arg("--cache-dir")
        .arg(workspace_root().join("target").join("rewind-test-cache"))
        .env_remove("RUST_LOG");
    command
}

pub(super) fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

pub(super) fn write(dir: &Path, name: &str, content: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, content).expect("write");
    path
}

pub(super) fn caller_agent(dir: &Path, extra: &str) -> PathBuf {
    write(
        dir,
        "agent.toml",
        &format!(
            "name = \"cli\"\n[[actions]]\nname = \"work\"\ncomponent = {:?}\non = [\"input\"]\n{extra}",
            guest("caller").display().to_string()
        ),
    )
}

/// A component built against `rewind:action@0.1.0`, before durable waits, still runs: its
/// call is made, recorded, and served on a replay.
#[test]
fn a_component_of_the_world_before_waits_still_runs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = write(
        dir.path(),
        "agent.toml",
        &format!(
            "name = \"old\"\n[[actions]]\nname = \"work\"\ncomponent = {:?}\non = \
             [\"input\"]\n[functions.clock]\nkind = \"time\"\n",
            guest("v0_1").display().to_string()
        ),
    );
    let input = write(
        dir.path(),
        "in.jsonl",
        "{\"key\":\"k\",\"payload\":{\"function\":\"clock\"}}\n",
    );
    let out = run(dir.path(), &agent, &input);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let line: Value = serde_json::from_str(text(&out.stdout).trim()).expect("one output");
    let output = &line["payload"];
    assert_eq!(
        (&output["key"], &output["sequence"]),
        (&json!("k"), &json!(1))
    );
    assert!(output["result"]["unix_ms"].as_u64().is_some(), "{output}");
    assert!(
        text(&out.stderr).contains("calls: 1 made"),
        "{}",
        text(&out.stderr)
    );
}

fn run(dir: &Path, agent: &Path, input: &Path) -> Output {
    rewind(dir)
        .arg("run")
        .arg(agent)
        .arg("--input")
        .arg(input)
        .output()
        .expect("rewind runs")
}

#[test]
fn malformed_input_lines_are_reported_by_line_number_and_the_run_goes_on() {
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = caller_agent(dir.path(), "");
    let input = write(
        dir.path(),
        "in.jsonl",
        "{\"key\":\"a\",\"payload\":{}}\n{\"key\":\"a\",\"payload\":\n{\"key\":\"b\",\"payload\":{}}\n",
    );
    let out = run(dir.path(), &agent, &input);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("line 2"), "{stderr}");
    assert!(
        stderr.contains(
            "2 accepted, 2 completed, 0 parked, 0 at a durable wait, 0 waiting behind an \
             earlier input of their key, 1 malformed"
        ),
        "{stderr}"
    );
    assert_eq!(
        text(&out.stdout).lines().count(),
        2,
        "both good lines produce their output"
    );
}

#[test]
fn an_unknown_key_in_agent_toml_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = caller_agent(dir.path(), "[limits]\nmemory = 5\n");
    let input = write(dir.path(), "in.jsonl", "");
    let out = run(dir.path(), &agent, &input);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr.contains("unknown field `memory`") && stderr.contains("agent.toml"),
        "{stderr}"
    );
}

#[test]
fn a_missing_component_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = write(
        dir.path(),
        "agent.toml",
        "name = \"x\"\n[[actions]]\nname = \"gone\"\ncomponent = \"nowhere/gone.wasm\"\non = [\"input\"]\n",
    );
    let input = write(dir.path(), "in.jsonl", "");
    let out = run(dir.path(), &agent, &input);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr.contains("action `gone`") && stderr.contains("nowhere/gone.wasm"),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("No such file").count(),
        1,
        "the cause is said once: {stderr}"
    );
}

#[test]
fn an_unreachable_function_url_stops_the_run_with_one_message() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Bind and drop a listener: nothing listens on that port now.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let agent = caller_agent(
        dir.path(),
        &format!("[functions.tool]\nkind = \"http\"\nurl = \"http://127.0.0.1:{port}/x\"\n"),
    );
    let input = write(dir.path(), "in.jsonl", "{\"key\":\"a\",\"payload\":{}}\n");
    let out = run(dir.path(), &agent, &input);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr.contains("function `tool` is unreachable"),
        "{stderr}"
    );
    assert!(text(&out.stdout).is_empty(), "nothing ran");
}

#[test]
fn check_says_whether_a_component_fits_the_world() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (caller, version) in [
        ("caller", "0.2.0"),
        ("caller_py", "0.2.0"),
        ("caller_js", "0.2.0"),
        ("v0_1", "0.1.0"),
    ] {
        let ok = rewind(dir.path())
            .arg("check")
            .arg(guest(caller))
            .output()
            .expect("runs");
        assert!(ok.status.success(), "{caller}: {}", text(&ok.stderr));
        let stdout = text(&ok.stdout);
        assert!(
            stdout.contains(&format!("rewind:action/durable@{version}  [ok]"))
                && stdout.contains("fits"),
            "{caller}: {stdout}"
        );
    }

    let evil = write(
        dir.path(),
        "evil.wat",
        r#"(component (import "acme:evil/net@1.0.0" (instance)))"#,
    );
    let refused = rewind(dir.path())
        .arg("check")
        .arg(&evil)
        .output()
        .expect("runs");
    assert_eq!(refused.status.code(), Some(1));
    let stdout = text(&refused.stdout);
    assert!(
        stdout.contains("acme:evil/net@1.0.0  [REFUSED]"),
        "{stdout}"
    );
}

/// The support example against the mock service: run twice with the same state directory;
/// the second run resumes from the first one's final checkpoint, and each idempotency key
/// reached the mock once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_support_example_calls_each_function_once_across_runs() {
    let mock = rewind_mock::MockService::start("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("mock");
    let dir = tempfile::tempdir().expect("tempdir");
    let example = workspace_root().join("examples").join("support");
    let toml = std::fs::read_to_string(example.join("agent.toml"))
        .expect("example agent.toml")
        .replace("http://127.0.0.1:7181", &mock.base_url())
        .replace(
            "../../target/guests/wasm32-wasip2/release",
            &guests_dir().display().to_string(),
        );
    let agent = write(dir.path(), "agent.toml", &toml);
    let input = example.join("inputs.jsonl");
    let inputs = std::fs::read_to_string(&input)
        .expect("inputs")
        .lines()
        .filter(|l| !l.trim().is_empty())
        .count();

    let dir_path = dir.path().to_owned();
    let out = dir.path().join("out.jsonl");
    let run_with_output = {
        let (dir, agent, input, out) =
            (dir_path.clone(), agent.clone(), input.clone(), out.clone());
        move || {
            rewind(&dir)
                .arg("run")
                .arg(&agent)
                .arg("--input")
                .arg(&input)
                .arg("--output")
                .arg(&out)
                .output()
                .expect("rewind runs")
        }
    };
    let first = tokio::task::spawn_blocking(run_with_output.clone())
        .await
        .expect("join");
    assert!(first.status.success(), "{}", text(&first.stderr));
    let made = mock.counts();
    assert!(made.total > 0);
    let written = std::fs::read_to_string(&out).expect("outputs");

    // The same command again: it resumes from the final checkpoint and has nothing to do.
    let second = tokio::task::spawn_blocking(run_with_output)
        .await
        .expect("join");
    assert!(second.status.success(), "{}", text(&second.stderr));
    assert!(
        text(&second.stderr).contains("resuming from checkpoint"),
        "{}",
        text(&second.stderr)
    );
    assert_eq!(
        mock.counts().total,
        made.total,
        "the second run calls nothing"
    );
    assert!(
        mock.counts().by_idempotency_key.values().all(|&n| n == 1),
        "{:?}",
        mock.counts()
    );
    assert_eq!(
        std::fs::read_to_string(&out).expect("outputs"),
        written,
        "no output twice"
    );
    let outputs: Vec<Value> = written
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON"))
        .collect();
    assert_eq!(outputs.len(), inputs, "one reply per ticket");
    assert!(
        outputs.iter().any(|o| o["payload"]["status"].is_string()),
        "{outputs:?}"
    );

    let inspect = rewind(&dir_path)
        .args(["inspect", "--json"])
        .output()
        .expect("runs");
    assert!(inspect.status.success(), "{}", text(&inspect.stderr));
    let recorded: Value = serde_json::from_slice(&inspect.stdout).expect("JSON");
    assert!(
        recorded["keys"]
            .as_object()
            .is_some_and(|keys| !keys.is_empty()),
        "{recorded}"
    );
    assert_eq!(
        recorded["inputs"],
        serde_json::json!([]),
        "every input completed"
    );
}

#[test]
fn an_unknown_function_kind_and_a_custom_function_without_handler_are_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let input = write(dir.path(), "in.jsonl", "");
    let agent = caller_agent(dir.path(), "[functions.search]\nkind = \"grpc\"\n");
    let stderr = text(&run(dir.path(), &agent, &input).stderr);
    assert!(
        stderr.contains("grpc") && stderr.contains("agent.toml"),
        "{stderr}"
    );

    let agent = caller_agent(dir.path(), "[functions.search]\nkind = \"custom\"\n");
    let out = run(dir.path(), &agent, &input);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr.contains("function `search`") && stderr.contains("no handler"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_chat_sends_the_api_key_from_the_environment_and_inspect_shows_the_call() {
    let mock = rewind_mock::MockService::start("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("mock");
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = caller_agent(
        dir.path(),
        &format!(
            "[functions.chat]\nkind = \"openai-chat\"\nbase-url = \"{}/v1\"\nmodel = \"m\"\napi-key-env = \"REWIND_TEST_OPENAI_KEY\"\n",
            mock.base_url()
        ),
    );
    let args = serde_json::json!({ "messages": [{ "role": "user", "content": "refund please" }] });
    let line = serde_json::json!({ "key": "ana", "payload": { "calls": [{ "function": "chat", "args": args }] } });
    let input = write(dir.path(), "in.jsonl", &format!("{line}\n"));
    let out = tokio::task::spawn_blocking({
        let (dir, agent, input) = (dir.path().to_owned(), agent.clone(), input.clone());
        move || {
            rewind(&dir)
                .env("REWIND_TEST_OPENAI_KEY", "sk-test")
                .arg("run")
                .arg(&agent)
                .arg("--input")
                .arg(&input)
                .output()
                .expect("runs")
        }
    })
    .await
    .expect("join");
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(mock.counts().with_authorization, 1);
    assert!(
        !text(&out.stdout).contains("sk-test"),
        "the key reached the guest"
    );

    let inspect = rewind(dir.path())
        .args(["inspect", "--key", "ana"])
        .output()
        .expect("runs");
    let shown = text(&inspect.stdout);
    assert!(shown.contains("default/cli/ana"), "{shown}");
    assert!(shown.contains("call 0: chat succeeded key rw-"), "{shown}");
    assert!(
        shown.contains("refund"),
        "the recorded result is shown: {shown}"
    );
}

#[test]
fn test_runs_one_crash_with_scripted_answers_and_prints_the_table() {
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = caller_agent(
        dir.path(),
        "[functions.charge]\nkind = \"http\"\nurl = \"http://127.0.0.1:9/charge\"\nin-doubt = \"reconcile\"\nreconcile-url = \"http://127.0.0.1:9/charge/status\"\n",
    );
    let input = write(
        dir.path(),
        "in.jsonl",
        // One key, two calls one after the other: the crash after the second call finds
        // the first recorded and the second in doubt, whatever the timing. (Two keys ran
        // at once: the first key's call could still be unrecorded at the crash.)
        "{\"key\":\"a\",\"payload\":{\"calls\":[{\"function\":\"charge\",\"args\":{\"n\":1}},{\"function\":\"charge\",\"args\":{\"n\":2}}]}}\n",
    );
    let responses = write(
        dir.path(),
        "answers.jsonl",
        "{\"function\":\"charge\",\"result\":{\"charged\":true}}\n",
    );
    let out = rewind(dir.path())
        .arg("test")
        .arg(&agent)
        .arg("--input")
        .arg(&input)
        .arg("--responses")
        .arg(&responses)
        .arg("--crash-at")
        .arg("after-call:2")
        .arg("--work")
        .arg(dir.path().join("work"))
        .output()
        .expect("rewind runs");
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    let row = stdout
        .lines()
        .find(|l| l.starts_with("after-call"))
        .unwrap_or_else(|| panic!("a row for after-call: {stdout}"));
    // cases, recovered, repeated, reconciled, refused, not reached, failed
    let figures: Vec<&str> = row.split_whitespace().skip(1).collect();
    assert_eq!(figures, ["1", "1", "0", "1", "0", "0", "0"], "{stdout}");

    let out = rewind(dir.path())
        .arg("test")
        .arg(&agent)
        .arg("--input")
        .arg(&input)
        .arg("--crash-at")
        .arg("after-cal:2")
        .output()
        .expect("rewind runs");
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("no crash point is named `after-cal`"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_missing_agent_file_is_named_and_its_cause_said_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let input = write(dir.path(), "in.jsonl", "");
    let out = run(dir.path(), &dir.path().join("absent.toml"), &input);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr.contains("absent.toml"), "{stderr}");
    assert_eq!(stderr.matches("No such file").count(), 1, "{stderr}");
}

#[test]
fn an_event_no_action_handles_is_counted_or_fails_its_input_as_agent_toml_says() {
    let dir = tempfile::tempdir().expect("tempdir");
    let input = write(
        dir.path(),
        "in.jsonl",
        "{\"key\":\"a\",\"payload\":{\"send\":[{\"kind\":\"nobody\",\"payload\":{}}]}}\n{\"key\":\"b\",\"payload\":{}}\n",
    );
    let dropped = run(dir.path(), &caller_agent(dir.path(), ""), &input);
    let stderr = text(&dropped.stderr);
    assert_eq!(dropped.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("events: 1 of a kind no action handles, dropped"),
        "{stderr}"
    );
    assert_eq!(
        text(&dropped.stdout).lines().count(),
        2,
        "both inputs' outputs"
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let agent = caller_agent(dir.path(), "");
    let toml = std::fs::read_to_string(&agent).expect("agent.toml");
    std::fs::write(
        &agent,
        toml.replacen(
            "name = \"cli\"\n",
            "name = \"cli\"\nunhandled-events = \"fail\"\n",
            1,
        ),
    )
    .expect("agent.toml");
    let input = write(
        dir.path(),
        "in.jsonl",
        "{\"key\":\"a\",\"payload\":{\"send\":[{\"kind\":\"nobody\",\"payload\":{}}]}}\n{\"key\":\"b\",\"payload\":{}}\n",
    );
    let failed = run(dir.path(), &agent, &input);
    let stderr = text(&failed.stderr);
    assert_eq!(failed.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("an event of kind `nobody` was sent, and no action handles it"),
        "{stderr}"
    );
    assert_eq!(text(&failed.stdout).lines().count(), 1, "b's output only");
}

/// `rewind test` against a real endpoint: each call reaches it once over the whole kit run
/// (the uninterrupted run and the crashed one), and the report says what became of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_sends_each_call_to_the_real_endpoint_once_and_says_what_became_of_the_calls() {
    let remote = crate::remote::Remote::default();
    let url = crate::remote::serve(remote.clone()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = caller_agent(
        dir.path(),
        &format!("[functions.charge]\nkind = \"http\"\nurl = \"{url}\"\n"),
    );
    let lines: String = (0..12)
        .map(|i| {
            format!(
                "{{\"key\":\"k{i}\",\"payload\":{{\"calls\":[{{\"function\":\"charge\",\"args\":{{\"n\":{i}}}}}]}}}}\n"
            )
        })
        .collect();
    let input = write(dir.path(), "in.jsonl", &lines);
    let work = dir.path().join("work");
    let out = tokio::task::spawn_blocking({
        let dir = dir.path().to_owned();
        move || {
            rewind(&dir)
                .arg("test")
                .arg(&agent)
                .arg("--input")
                .arg(&input)
                .arg("--crash-at")
                .arg("after-call:3")
                .arg("--work")
                .arg(&work)
                .arg("-v")
                .output()
                .expect("rewind runs")
        }
    })
    .await
    .expect("join");
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert_eq!(
        (remote.keys().len(), remote.repeats()),
        (12, 0),
        "each key reached the endpoint once: {stdout}"
    );
    assert!(
        stdout.contains("charge: 12 made; 12 sent to the function"),
        "{stdout}"
    );
    // Every call in flight when the crash killed the run is in doubt: the one whose answer
    // reached the crash point, and any other key's call sent meanwhile (the run has
    // parallelism). Each is made again once, and listed.
    let made_again: usize = stdout
        .lines()
        .filter(|line| line.trim_start().starts_with("charge:"))
        .flat_map(|line| line.split("; "))
        .find_map(|part| part.strip_suffix(" made again under the same key"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("a count of calls made again: {stdout}"));
    let listed: Vec<&str> = stdout
        .lines()
        .filter(|line| line.contains("after-call:3: charge rw-"))
        .collect();
    assert!(
        made_again >= 1
            && listed.len() == made_again
            && listed
                .iter()
                .all(|line| line.ends_with("made again 1 time")),
        "the calls in doubt at the crash, listed: {stdout}"
    );
}

#[test]
fn a_test_hook_in_the_environment_stops_serve_and_cluster_from_starting_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = write(
        dir.path(),
        "rewind.toml",
        "listen = \"127.0.0.1:0\"\n[admin-token]\nenv = \"REWIND_TEST_ADMIN\"\n",
    );
    let agent = caller_agent(dir.path(), "");
    let counts = dir.path().join("counts.json");
    for (variable, value) in [
        ("REWIND_CRASH_AT", "after-call:1".as_ref()),
        ("REWIND_CRASH_COUNT", counts.as_os_str()),
        ("REWIND_AMBIENT_SEED", "7".as_ref()),
    ] {
        for (server, args) in [
            (
                "rewind serve",
                vec!["serve".as_ref(), "--config".as_ref(), config.as_os_str()],
            ),
            (
                "rewind cluster",
                // Nothing listens at port 9: refused before it would try to connect.
                vec![
                    "cluster".as_ref(),
                    "run".as_ref(),
                    agent.as_os_str(),
                    "--nats".as_ref(),
                    "nats://127.0.0.1:9".as_ref(),
                ],
            ),
        ] {
            let out = rewind(dir.path())
                .args(&args)
                .env(variable, value)
                // Unset: were the variable not refused, serve would stop at the token
                // (with another error) rather than serve on.
                .env_remove("REWIND_TEST_ADMIN")
                .output()
                .expect("rewind runs");
            let stderr = text(&out.stderr);
            assert!(!out.status.success(), "{server} with {variable}: {stderr}");
            assert!(
                stderr.contains(&format!("{variable} is set: it is a test hook"))
                    && stderr.contains(&format!("`{server}` does not start")),
                "{server} with {variable}: {stderr}"
            );
        }
    }
    assert!(
        !dir.path().join("rewind-state").exists(),
        "the refused server made no state"
    );
    assert!(!counts.exists(), "nor counted anything");
}
