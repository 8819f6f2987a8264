//! The crash-injection kit (`rewind_host::testing`, `rewind test`) over the example agents
//! at every crash point, and over in-doubt policies.

use std::path::PathBuf;

use rewind_host::crash::CrashPoint;
use rewind_host::kit::{CrashAt, Kit, Outcome, Report, Script};
use serde_json::json;

use crate::support::{guest, workspace_root};

fn kit(agent: PathBuf, input: PathBuf, work: &str) -> Kit {
    Kit {
        rewind: PathBuf::from(env!("CARGO_BIN_EXE_rewind")),
        agent,
        input,
        work: workspace_root().join("target").join("kit").join(work),
        cache_dir: Some(workspace_root().join("target").join("rewind-test-cache")),
        rewrites: Vec::new(),
        scripts: Vec::new(),
        signals: None,
    }
}

/// Every case passed, and every kind of point in `kinds` was exercised.
fn assert_passed(report: &Report, kinds: &[CrashPoint]) {
    let failures: Vec<String> = report
        .failures()
        .map(|case| format!("{}: {:?}", case.crash, case.outcome))
        .collect();
    assert!(
        failures.is_empty(),
        "{}\n{}",
        report.table(),
        failures.join("\n")
    );
    for kind in kinds {
        assert!(
            report
                .cases
                .iter()
                .any(|c| c.crash.point == *kind && matches!(c.outcome, Outcome::Recovered { .. })),
            "{kind} was exercised:\n{}",
            report.table()
        );
    }
}

/// The example agents against the example mock service, at every point they reach. The
/// polyglot agent's Python and JavaScript actions read the clock and draw random numbers
/// (a refund's id): its outputs must still equal the uninterrupted run's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_example_agent_survives_a_crash_at_every_durable_boundary() {
    guest("caller");
    let mock = rewind_mock::MockService::start("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("mock");
    for example in ["support", "enrichment", "polyglot", "approval"] {
        let dir = workspace_root().join("examples").join(example);
        let mut kit = kit(dir.join("agent.toml"), dir.join("inputs.jsonl"), example);
        kit.rewrites = vec![("http://127.0.0.1:7181".to_owned(), mock.base_url())];
        // A person's answers, delivered as each request reaches its wait.
        let signals = dir.join("signals.jsonl");
        kit.signals = signals.exists().then_some(signals);
        let report = kit.run(&CrashAt::Every).await.expect("the kit runs");
        assert_passed(
            &report,
            &[
                CrashPoint::BeforeCall,
                CrashPoint::AfterCall,
                CrashPoint::AfterRecord,
                CrashPoint::CheckpointSave,
                CrashPoint::CheckpointSaved,
                CrashPoint::TornWrite,
            ],
        );
        if example == "approval" {
            let out = std::fs::read_to_string(kit.work.join("reference").join("out.jsonl"))
                .expect("the uninterrupted run's outputs");
            let mut statuses: Vec<(String, String)> = (out.lines())
                .map(|line| serde_json::from_str::<serde_json::Value>(line).expect("an output"))
                .map(|output| {
                    let payload = &output["payload"];
                    let status = payload["status"].as_str().unwrap_or_default().to_owned();
                    (
                        payload["request_id"]
                            .as_str()
                            .unwrap_or_default()
                            .to_owned(),
                        status,
                    )
                })
                .collect();
            statuses.sort();
            let expected = [("R-1", "refunded"), ("R-2", "rejected")]
                .map(|(id, status)| (id.to_owned(), status.to_owned()));
            assert_eq!(statuses, expected, "the script's answers: {out}");
        }
        // The real endpoint saw each call once, however many cases made it.
        let counts = mock.counts();
        assert!(
            counts.repeated_keys.is_empty(),
            "{example}: keys sent to the endpoint more than once: {:?}",
            counts.repeated_keys
        );
        for (function, calls) in &report.functions {
            assert_eq!(
                calls.forwarded,
                calls.made,
                "{example}: `{function}` reached its endpoint once per call:\n{}",
                report.calls(false)
            );
            // Approval's two keys run at once, so the records a numbered crash point lands
            // after differ from run to run; a function only one request calls may never
            // have a crash after its record. Its chat model, which both call, always does.
            if example != "approval" || function == "llm.chat" {
                assert!(calls.served > 0, "{example}: {}", report.calls(false));
            }
        }
        assert!(
            report.calls(false).contains("sent to the function"),
            "{}",
            report.calls(false)
        );
    }
}

/// The test guest making two calls per input to `charge`, declared `in-doubt = policy`,
/// answered by a script.
fn charging(policy: &str, marker: &str, work: &str) -> Kit {
    let dir = workspace_root()
        .join("target")
        .join("kit")
        .join(format!("{work}-agent"));
    std::fs::create_dir_all(&dir).expect("agent dir");
    let agent = dir.join("agent.toml");
    std::fs::write(
        &agent,
        format!(
            "name = \"charging\"\n\n[state]\nmarker = \"{marker}\"\n\n[[actions]]\nname = \"work\"\ncomponent = {:?}\non = [\"input\"]\n\n[functions.charge]\nkind = \"http\"\nurl = \"http://127.0.0.1:9/charge\"\nin-doubt = \"{policy}\"\nreconcile-url = \"http://127.0.0.1:9/charge/status\"\n",
            guest("caller").display().to_string()
        ),
    )
    .expect("agent.toml");
    let input = dir.join("inputs.jsonl");
    let lines: Vec<String> = (0..6)
        .map(|i| {
            json!({ "key": format!("k{}", i % 3), "payload": { "calls": [
                { "function": "charge", "args": { "i": i, "part": 1 } },
                { "function": "charge", "args": { "i": i, "part": 2 } },
            ] } })
            .to_string()
        })
        .collect();
    std::fs::write(&input, lines.join("\n")).expect("inputs");
    let mut kit = kit(agent, input, work);
    kit.scripts = vec![Script {
        function: "charge".to_owned(),
        args: None,
        result: json!({ "charged": true }),
    }];
    kit
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_reconcile_no_call_is_made_twice_and_calls_in_doubt_are_asked_about() {
    let report = charging("reconcile", "refresh", "reconcile")
        .run(&CrashAt::Every)
        .await
        .expect("the kit runs");
    assert_passed(
        &report,
        &[
            CrashPoint::AfterCall,
            CrashPoint::CheckpointRefresh,
            CrashPoint::TornWrite,
        ],
    );
    let (mut repeated, mut reconciled) = (0, 0);
    for case in &report.cases {
        if let Outcome::Recovered {
            repeated: r,
            reconciled: a,
        } = case.outcome
        {
            repeated += r;
            reconciled += a;
        }
    }
    assert_eq!(repeated, 0, "{}", report.table());
    assert!(
        reconciled >= 12,
        "every after-call crash asked: {}",
        report.table()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_fail_a_crash_after_a_call_stops_the_run_naming_it() {
    // Under `offsets`, every point is reached as often on every run.
    let kit = charging("fail", "offsets", "fail");
    let report = kit
        .run(&CrashAt::Random { seed: 7, runs: 6 })
        .await
        .expect("the kit runs");
    assert_passed(&report, &[]);
    let again = kit
        .run(&CrashAt::Random { seed: 7, runs: 6 })
        .await
        .expect("the kit runs");
    let picked = |r: &Report| r.cases.iter().map(|c| c.crash).collect::<Vec<_>>();
    assert_eq!(
        picked(&report),
        picked(&again),
        "the same seed, the same crash points"
    );

    let after_call = kit
        .run(&CrashAt::One(
            "after-call:3".parse().expect("a crash point"),
        ))
        .await
        .expect("the kit runs");
    assert_eq!(after_call.cases.len(), 1);
    assert_eq!(
        after_call.cases[0].outcome,
        Outcome::Refused,
        "{}",
        after_call.table()
    );
}

/// The charging agent, its action declaring signal `approve`, with four inputs (keys k0
/// and k1, two each) that charge, take the steps `waits(i)` gives input `i`, and charge
/// again.
fn waiting(work: &str, waits: impl Fn(usize) -> Vec<serde_json::Value>) -> Kit {
    let mut kit = charging("retry", "offsets", work);
    let dir = kit.agent.parent().expect("the agent's dir").to_owned();
    let toml = std::fs::read_to_string(&kit.agent)
        .expect("agent.toml")
        .replace(
            "on = [\"input\"]\n",
            "on = [\"input\"]\nsignals = [\"approve\"]\n",
        );
    std::fs::write(&kit.agent, toml).expect("agent.toml");
    let lines: Vec<String> = (0..4)
        .map(|i| {
            let mut calls = vec![json!({ "function": "charge", "args": { "i": i, "part": 1 } })];
            calls.extend(waits(i));
            calls.push(json!({ "function": "charge", "args": { "i": i, "part": 2 } }));
            json!({ "key": format!("k{}", i % 2), "payload": { "calls": calls } }).to_string()
        })
        .collect();
    kit.input = dir.join("waits.jsonl");
    std::fs::write(&kit.input, lines.join("\n")).expect("inputs");
    kit
}

/// `rewind test` skips time: an agent that sleeps a day and waits an hour for a signal
/// nobody sends between its charges is tested in moments (each run would otherwise take a
/// day and an hour per input), crashed at every wait and wake too, each case ending as the
/// uninterrupted run did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_skips_and_every_wait_and_wake_survives_a_crash() {
    let kit = waiting("kit-waits", |_| {
        vec![
            json!({ "sleep_ms": 86_400_000 }),
            json!({ "await": ["approve"], "timeout_ms": 3_600_000 }),
        ]
    });
    let report = kit.run(&CrashAt::Every).await.expect("the kit runs");
    assert_passed(
        &report,
        &[
            CrashPoint::AtWait,
            CrashPoint::AtWake,
            CrashPoint::AfterCall,
        ],
    );
    let reference = std::fs::read_to_string(kit.work.join("reference").join("out.jsonl"))
        .expect("the uninterrupted run's outputs");
    assert_eq!(
        reference.lines().count(),
        4,
        "every input finished: {reference}"
    );
    for line in reference.lines() {
        let output: serde_json::Value = serde_json::from_str(line).expect("an output");
        let results = &output["payload"]["results"];
        assert_eq!(
            (&results[1], &results[2]),
            (&json!({ "slept": true }), &json!({ "timed_out": true })),
            "{output}"
        );
    }
}

/// `rewind test --signals`: a script approves where a person would, at a wait or after a
/// call, for the inputs it names; each input takes its signal once, the same way at every
/// crash point, and an input no line names times out (time skipping).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_of_signals_is_delivered_at_its_wait_or_call_at_every_crash_point() {
    let mut kit = waiting("kit-signals", |_| {
        vec![json!({ "await": ["approve"], "timeout_ms": 3_600_000 })]
    });
    let script = kit.work.with_extension("signals.jsonl");
    let lines = [
        "# every input of k0, at its first wait",
        r#"{"name": "approve", "payload": {"by": "ana"}, "key": "k0"}"#,
        "",
        r#"{"name": "approve", "payload": {"by": "bo"}, "key": "k1", "sequence": 2, "after_call": 1}"#,
    ];
    std::fs::write(&script, lines.join("\n")).expect("script");
    kit.signals = Some(script);
    let report = kit.run(&CrashAt::Every).await.expect("the kit runs");
    assert_passed(
        &report,
        &[
            CrashPoint::AtWake,
            CrashPoint::AfterCall,
            CrashPoint::AfterRecord,
        ],
    );
    let reference = std::fs::read_to_string(kit.work.join("reference").join("out.jsonl"))
        .expect("the uninterrupted run's outputs");
    let mut waited: Vec<(String, u64, serde_json::Value)> = reference
        .lines()
        .map(|line| {
            let output: serde_json::Value = serde_json::from_str(line).expect("an output");
            let key = output["key"].as_str().expect("a key").to_owned();
            let sequence = output["sequence"].as_u64().expect("a sequence");
            (key, sequence, output["payload"]["results"][1].clone())
        })
        .collect();
    waited.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    let signal = |by: &str| json!({ "signal": { "name": "approve", "payload": { "by": by } } });
    assert_eq!(
        waited,
        vec![
            ("k0".to_owned(), 1, signal("ana")),
            ("k0".to_owned(), 2, signal("ana")),
            ("k1".to_owned(), 1, json!({ "timed_out": true })),
            ("k1".to_owned(), 2, signal("bo")),
        ]
    );
}

/// A script naming a signal no action declares is refused before anything runs, naming
/// its line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_with_an_undeclared_signal_is_refused_naming_its_line() {
    let mut kit = waiting("kit-bad-signals", |_| Vec::new());
    let script = kit.work.with_extension("signals.jsonl");
    let lines = [r#"{"name": "approve"}"#, r#"{"name": "refund"}"#];
    std::fs::write(&script, lines.join("\n")).expect("script");
    kit.signals = Some(script);
    let error = kit
        .run(&CrashAt::Every)
        .await
        .expect_err("refused")
        .to_string();
    assert!(
        error.contains("line 2") && error.contains("`refund`") && error.contains("approve"),
        "{error}"
    );
    assert!(!kit.work.join("reference").exists(), "nothing ran: {error}");
}
