//! One `rewind run` writes a state directory at a time; `rewind inspect` reads it meanwhile.

use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::json;

use super::{rewind, text, write};
use crate::remote::{Remote, serve};
use crate::support::guest;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_run_on_one_state_directory_is_refused_and_inspect_reads_meanwhile() {
    let remote = Remote::default();
    // The first run's one call takes long enough for the second to start meanwhile.
    *remote.slow.lock().expect("lock") = Duration::from_secs(3);
    let url = serve(remote.clone()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let agent = write(
        dir.path(),
        "agent.toml",
        &format!(
            "name = \"locked\"\n[[actions]]\nname = \"work\"\ncomponent = {:?}\non = [\"input\"]\n\n[functions.charge]\nkind = \"http\"\nurl = \"{url}\"\n",
            guest("caller").display().to_string()
        ),
    );
    let payload = json!({ "calls": [{ "function": "charge", "args": { "amount": 5 } }] });
    let input = write(
        dir.path(),
        "in.jsonl",
        &format!("{}\n", json!({ "key": "k", "payload": payload })),
    );
    let state = dir.path().join("state");
    let run = || {
        let mut command = rewind(dir.path());
        command
            .arg("run")
            .arg(&agent)
            .arg("--input")
            .arg(&input)
            .arg("--state")
            .arg(&state);
        command
    };

    let first = run()
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the first run starts");
    // It holds the directory once its call reached the remote.
    let deadline = Instant::now() + Duration::from_secs(120);
    while remote.total() == 0 {
        assert!(Instant::now() < deadline, "the first run never called out");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let second = run().output().expect("the second run");
    let said = text(&second.stderr);
    assert_eq!(second.status.code(), Some(1), "{said}");
    assert!(
        said.contains(&state.display().to_string())
            && said.contains("in use by another rewind process")
            && said.contains(&format!("pid {}", first.id())),
        "{said}"
    );

    let inspected = rewind(dir.path())
        .arg("inspect")
        .arg("--state")
        .arg(&state)
        .output()
        .expect("inspect");
    assert!(
        inspected.status.success(),
        "inspect reads without the lock: {}",
        text(&inspected.stderr)
    );

    let finished = tokio::task::spawn_blocking(move || first.wait_with_output())
        .await
        .expect("join")
        .expect("the first run ends");
    assert!(finished.status.success(), "{finished:?}");
    assert_eq!(
        (remote.keys().len(), remote.total()),
        (1, 1),
        "the call was made once, by the first run only"
    );
}
