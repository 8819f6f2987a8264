//! The sandbox: limits, no ambient authority, refusal of foreign imports.

use std::sync::Arc;

use rewind_host::agent::input::InputLine;
use rewind_host::agent::{InputReport, JsonlSink};
use rewind_host::keys::{RunOptions, run_inputs};
use rewind_host::sandbox::LoadError;
use serde_json::json;

use crate::support::{
    agent_toml, agent_with, error_of, first_output, input, memory_store, sandbox,
};

async fn hostile(mode: &str, limits: &str) -> InputReport {
    let agent = agent_with(
        &agent_toml("hostile", "", &format!("[limits]\n{limits}")),
        memory_store(),
        &[],
    );
    agent
        .process(&input("k", 1, json!({ "mode": mode })), &Default::default())
        .await
}

#[tokio::test]
async fn a_guest_that_loops_forever_is_stopped_at_its_cpu_budget() {
    let report = hostile("loop", "fuel = 50_000_000\ntimeout-ms = 60_000").await;
    let error = error_of(&report);
    assert!(error.contains("limit exceeded: fuel"), "{error}");
}

#[tokio::test]
async fn a_guest_that_loops_forever_is_stopped_at_its_timeout() {
    let report = hostile("loop", "fuel = 1_000_000_000_000\ntimeout-ms = 300").await;
    let error = error_of(&report);
    assert!(
        error.contains("limit exceeded: timeout-ms (300 ms)"),
        "{error}"
    );
}

#[tokio::test]
async fn a_guest_that_allocates_without_end_is_stopped_at_its_memory_ceiling() {
    let report = hostile("alloc", "memory-mib = 16").await;
    let error = error_of(&report);
    assert!(
        error.contains("limit exceeded: memory-mib (16 MiB)"),
        "{error}"
    );
}

#[tokio::test]
async fn a_run_may_make_only_calls_per_run_calls() {
    let toml = agent_toml(
        "caller",
        "",
        "[limits]\ncalls-per-run = 2\n[functions.t]\nkind = \"time\"\n",
    );
    let agent = agent_with(&toml, memory_store(), &[]);
    let calls: Vec<_> = (0..3)
        .map(|_| json!({"function": "t", "args": {}}))
        .collect();
    let report = agent
        .process(
            &input("k", 1, json!({ "calls": calls })),
            &Default::default(),
        )
        .await;
    let error = error_of(&report);
    assert!(
        error.contains("limit exceeded: calls-per-run (2)"),
        "{error}"
    );
}

#[tokio::test]
async fn a_run_may_take_only_clock_readings_per_run_readings() {
    // The caller's `ambient` reads the wall clock once and the monotonic clock twice.
    let toml = agent_toml("caller", "", "[limits]\nclock-readings-per-run = 2\n");
    let agent = agent_with(&toml, memory_store(), &[]);
    let report = agent
        .process(
            &input("k", 1, json!({ "ambient": true })),
            &Default::default(),
        )
        .await;
    let error = error_of(&report);
    assert!(
        error.contains("limit exceeded: clock-readings-per-run (2)"),
        "{error}"
    );
    assert!(report.outputs.is_empty());

    let roomy = agent_toml("caller", "", "[limits]\nclock-readings-per-run = 3\n");
    let report = agent_with(&roomy, memory_store(), &[])
        .process(
            &input("k", 1, json!({ "ambient": true })),
            &Default::default(),
        )
        .await;
    assert!(report.error.is_none(), "{report:?}");
}

#[tokio::test]
async fn a_guest_cannot_read_files() {
    let report = hostile("read-file", "").await;
    assert!(report.error.is_none(), "{report:?}");
    let output = first_output(&report);
    assert!(
        output.get("content").is_none(),
        "the guest read a file: {output}"
    );
    assert!(output["error"].is_string(), "{output}");
}

#[tokio::test]
async fn a_guest_cannot_open_sockets() {
    // Something listens, so only the sandbox can be what refuses the connection.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let agent = agent_with(&agent_toml("hostile", "", ""), memory_store(), &[]);
    let report = agent
        .process(
            &input("k", 1, json!({ "mode": "socket", "port": port })),
            &Default::default(),
        )
        .await;
    assert!(report.error.is_none(), "{report:?}");
    let output = first_output(&report);
    assert!(
        output.get("connected").is_none() && output["error"].is_string(),
        "{output}"
    );
    let accepted =
        tokio::time::timeout(std::time::Duration::from_millis(100), listener.accept()).await;
    assert!(accepted.is_err(), "the guest reached the listener");
}

#[tokio::test]
async fn a_guest_that_panics_fails_the_run_with_the_panic_message_and_where() {
    let report = hostile("trap", "").await;
    let error = error_of(&report);
    assert!(
        error.contains("the action panicked at tests/guests/hostile/src/lib.rs:")
            && error.ends_with(": boom"),
        "{error}"
    );
}

#[tokio::test]
async fn a_trap_is_named_with_the_innermost_frames_of_its_backtrace() {
    for (mode, named, frame) in [
        ("stack-overflow", "stack overflow", "guest_hostile::deep"),
        (
            "out-of-bounds",
            "out-of-bounds memory access",
            "guest_hostile::past_the_end",
        ),
    ] {
        let report = hostile(mode, "").await;
        let error = error_of(&report);
        assert!(
            error.contains(&format!("the action trapped: {named}")) && error.contains(frame),
            "{mode}: {error}"
        );
        // The backtrace is bounded: a stack overflow has thousands of frames.
        assert!(error.len() < 4096, "{mode}: {} bytes", error.len());
    }
}

#[test]
fn a_component_importing_an_unknown_interface_is_refused_with_the_import_named() {
    let wat = r#"(component (import "acme:evil/net@1.0.0" (instance)))"#;
    let error = sandbox()
        .load("evil.wat", wat.as_bytes())
        .expect_err("refused");
    assert!(matches!(error, LoadError::World { .. }), "{error}");
    assert!(error.to_string().contains("acme:evil/net@1.0.0"), "{error}");
}

#[test]
fn a_core_module_is_refused_as_not_a_component() {
    let error = sandbox()
        .load("core.wat", b"(module)")
        .expect_err("refused");
    assert!(
        error
            .to_string()
            .contains("core WebAssembly module, not a component"),
        "{error}"
    );
}

#[test]
fn bytes_that_are_not_wasm_are_refused() {
    let error = sandbox().load("notes.txt", b"hello").expect_err("refused");
    assert!(
        error.to_string().contains("notes.txt is not WebAssembly"),
        "{error}"
    );
}

#[test]
fn a_component_without_the_run_export_is_refused() {
    let error = sandbox()
        .load("empty.wat", b"(component)")
        .expect_err("refused");
    assert!(
        error.to_string().contains("does not export `run"),
        "{error}"
    );
}

/// Remembers the order inputs finished in.
#[derive(Default)]
struct Order(std::sync::Mutex<Vec<(String, bool)>>);

impl rewind_host::keys::Progress for Order {
    fn finished(&self, input: &rewind_host::event::Input, completed: bool) {
        self.0
            .lock()
            .expect("lock")
            .push((input.key.clone(), completed));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_keys_keep_running_while_one_key_spins() {
    let toml = agent_toml(
        "hostile",
        "parallelism = 4",
        "[limits]\nfuel = 1_000_000_000_000\ntimeout-ms = 3000\n\n[retry]\nattempts = 1\n",
    );
    let agent = Arc::new(agent_with(&toml, memory_store(), &[]));
    let mut lines = vec![Ok(InputLine {
        id: None,
        line: 1,
        key: "spinner".into(),
        payload: json!({"mode": "loop"}).to_string(),
    })];
    for i in 0..20 {
        lines.push(Ok(InputLine {
            id: None,
            line: i + 2,
            key: format!("k{}", i % 5),
            payload: json!({"mode": "print"}).to_string(),
        }));
    }
    let mut sink = JsonlSink::new(Vec::new());
    let order = Order::default();
    let summary = run_inputs(
        agent,
        futures_util::stream::iter(lines),
        &mut sink,
        &order,
        RunOptions::default(),
    )
    .await
    .expect("run");
    assert_eq!(summary.completed, 20, "{summary:?}");
    let failure = summary.parked[0].to_string();
    assert!(
        failure.contains("spinner") && failure.contains("timeout-ms"),
        "{failure}"
    );
    let order = order.0.into_inner().expect("lock");
    assert_eq!(
        order.last(),
        Some(&("spinner".to_owned(), false)),
        "every other input finished while the spinner was still running: {order:?}"
    );
}

/// Collects what tracing writes, for the test that reads the guest's output from the log.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "current_thread")]
async fn guest_stdout_and_stderr_go_to_the_log_with_the_run_named() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let agent = agent_with(&agent_toml("hostile", "", ""), memory_store(), &[]);
    let report = agent
        .process(
            &input("printer", 4, json!({ "mode": "print" })),
            &Default::default(),
        )
        .await;
    assert!(report.error.is_none(), "{report:?}");

    let log = String::from_utf8(captured.0.lock().expect("lock").clone()).expect("utf-8");
    for (text, stream) in [
        ("hello from stdout", "stdout"),
        ("hello from stderr", "stderr"),
    ] {
        let line = log
            .lines()
            .find(|l| l.contains(text))
            .unwrap_or_else(|| panic!("`{text}` is not in the log:\n{log}"));
        for field in [
            "agent=test",
            "key=printer",
            "sequence=4",
            "action=work",
            &format!("stream=\"{stream}\""),
        ] {
            assert!(line.contains(field), "`{field}` missing from: {line}");
        }
    }
}

#[test]
fn a_compiled_component_is_cached_on_disk_and_a_broken_cache_file_is_recompiled() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A sandbox per load, as a new process would have: one sandbox keeps what it loaded in
    // memory (and mapped from its file) and would not look at the disk again.
    let sandbox = || {
        rewind_host::sandbox::Sandbox::builder()
            .cache_dir(Some(dir.path().to_owned()))
            .instances(4)
            .build()
            .expect("sandbox")
    };
    let cached = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(dir.path())
            .expect("cache dir")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "cwasm"))
            .collect()
    };
    let noop = crate::support::guest("noop");

    sandbox().load_file(&noop).expect("loads");
    let files = cached();
    assert_eq!(files.len(), 1, "one precompiled file per component");
    // An old mtime, so that a rewrite would show even with coarse timestamps.
    let old = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000);
    std::fs::File::options()
        .write(true)
        .open(&files[0])
        .and_then(|f| f.set_modified(old))
        .expect("set mtime");
    let written = std::fs::metadata(&files[0])
        .expect("meta")
        .modified()
        .expect("mtime");
    sandbox().load_file(&noop).expect("loads from the cache");
    let again = std::fs::metadata(&files[0])
        .expect("meta")
        .modified()
        .expect("mtime");
    assert_eq!(written, again, "a cached component is not compiled again");

    // Every sandbox that mapped the file is gone: it can be broken in place.
    std::fs::write(&files[0], b"not a compiled component").expect("corrupt");
    sandbox()
        .load_file(&noop)
        .expect("a broken cache file is recompiled");
    assert!(
        std::fs::metadata(&files[0]).expect("meta").len() > 1024,
        "and replaced"
    );
}

/// A sandbox caching compiled components in `dir`, as a new process would have.
fn sandbox_caching_in(dir: &std::path::Path) -> Arc<rewind_host::sandbox::Sandbox> {
    Arc::new(
        rewind_host::sandbox::Sandbox::builder()
            .cache_dir(Some(dir.to_owned()))
            .instances(4)
            .build()
            .expect("sandbox"),
    )
}

/// The files in `dir` whose names end in `suffix`.
fn files_ending(dir: &std::path::Path, suffix: &str) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("list")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .collect();
    files.sort();
    files
}

#[test]
fn a_cache_directory_others_can_write_or_with_a_key_others_can_read_is_not_used() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().expect("tempdir");
    let noop = crate::support::guest("noop");

    let open = dir.path().join("open");
    std::fs::create_dir(&open).expect("mkdir");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    sandbox_caching_in(&open)
        .load_file(&noop)
        .expect("compiled in memory instead");
    assert_eq!(
        std::fs::read_dir(&open).expect("list").count(),
        0,
        "nothing is written to a directory anyone can write"
    );
    assert!(!dir.path().join("open.key").exists(), "nor a key beside it");

    let shown = dir.path().join("shown");
    std::fs::write(dir.path().join("shown.key"), "00".repeat(32)).expect("key");
    std::fs::set_permissions(
        dir.path().join("shown.key"),
        std::fs::Permissions::from_mode(0o644),
    )
    .expect("chmod");
    sandbox_caching_in(&shown)
        .load_file(&noop)
        .expect("compiled in memory instead");
    assert!(
        files_ending(&shown, ".cwasm").is_empty(),
        "nothing is signed with a key others can read"
    );

    let fresh = dir.path().join("fresh");
    sandbox_caching_in(&fresh).load_file(&noop).expect("loads");
    assert_eq!(files_ending(&fresh, ".cwasm").len(), 1);
    for (path, mode) in [
        (fresh.clone(), 0o700),
        (dir.path().join("fresh.key"), 0o600),
        (files_ending(&fresh, ".cwasm")[0].clone(), 0o600),
        (files_ending(&fresh, ".cwasm.mac")[0].clone(), 0o600),
    ] {
        let found = std::fs::metadata(&path).expect("stat").permissions().mode() & 0o777;
        assert_eq!(found, mode, "{}: {found:o}", path.display());
    }
}

#[tokio::test]
async fn a_tampered_cache_entry_is_compiled_again_not_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = dir.path().join("cache");
    let noop = crate::support::guest("noop");
    let hostile = crate::support::guest("hostile");
    {
        let sandbox = sandbox_caching_in(&cache);
        sandbox.load_file(&noop).expect("loads");
        sandbox.load_file(&hostile).expect("loads");
    }
    let digest = |path: &std::path::Path| {
        use sha2::Digest as _;
        hex::encode(sha2::Sha256::digest(std::fs::read(path).expect("guest")))
    };
    let entry_of = |guest: &std::path::Path| {
        let prefix = digest(guest);
        files_ending(&cache, ".cwasm")
            .into_iter()
            .find(|p| {
                p.to_string_lossy()
                    .starts_with(&format!("{}/{prefix}", cache.display()))
            })
            .expect("an entry per component")
    };
    let (noop_entry, hostile_entry) = (entry_of(&noop), entry_of(&hostile));
    let mac = |entry: &std::path::Path| {
        let mut name = entry.as_os_str().to_owned();
        name.push(".mac");
        std::path::PathBuf::from(name)
    };
    // Someone who can write the directory puts hostile's signed entry under noop's name
    // (each file replaced by rename, as a running process may have the old one mapped).
    let hostile_bytes = std::fs::read(&hostile_entry).expect("read");
    for (from, to) in [
        (hostile_entry.clone(), noop_entry.clone()),
        (mac(&hostile_entry), mac(&noop_entry)),
    ] {
        let staged = cache.join("staged");
        std::fs::copy(&from, &staged).expect("copy");
        std::fs::rename(&staged, &to).expect("rename");
    }

    let toml = agent_toml("noop", "parallelism = 1", "");
    let agent = rewind_host::agent::Agent::builder(
        crate::support::agent_file(&toml),
        sandbox_caching_in(&cache),
    )
    .store(memory_store())
    .build()
    .expect("agent loads");
    // Hostile's code would trap on this input; noop completes.
    let report = agent
        .process(
            &input("k", 1, json!({ "mode": "trap" })),
            &Default::default(),
        )
        .await;
    assert!(report.error.is_none(), "the tampered entry ran: {report:?}");
    assert_ne!(
        std::fs::read(&noop_entry).expect("read"),
        hostile_bytes,
        "the entry is compiled again and replaced"
    );
}

#[tokio::test]
async fn a_guest_that_prints_more_than_is_kept_is_not_stopped() {
    let report = hostile("flood", "").await;
    assert!(report.error.is_none(), "{report:?}");
    assert_eq!(first_output(&report)["printed"], 262_144);
}

#[tokio::test]
async fn a_guest_has_no_environment_no_arguments_and_a_closed_stdin() {
    let report = hostile("ambient", "").await;
    assert!(report.error.is_none(), "{report:?}");
    let found = first_output(&report);
    assert_eq!(found["env"], 0, "{found}");
    assert_eq!(found["args"], 0, "{found}");
    assert_eq!(
        found["stdin"],
        json!({ "read": 0 }),
        "stdin is empty: {found}"
    );
}
