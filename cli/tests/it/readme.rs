//! The README's walkthroughs, run as written: each shell block marked ```` ```sh
//! walkthrough=NAME ```` is taken from README.md, the blocks of one name joined in order,
//! and run by bash in an empty directory with the `rewind` and `rewind-mock` this build
//! made first on PATH. The only changes are the test's own: the ports, made free ones.
//! What a block starts in the background is stopped when the walkthrough ends.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::{guest, workspace_root};

/// The blocks of walkthrough `name`, joined.
fn walkthrough(name: &str) -> String {
    let readme = std::fs::read_to_string(workspace_root().join("README.md")).expect("README.md");
    let fence = format!("```sh walkthrough={name}");
    let mut script = String::new();
    let mut inside = false;
    for line in readme.lines() {
        if inside {
            if line.trim_end() == "```" {
                inside = false;
                script.push('\n');
            } else {
                script.push_str(line);
                script.push('\n');
            }
        } else if line.trim_end() == fence {
            inside = true;
        }
    }
    assert!(!script.is_empty(), "README.md has no walkthrough `{name}`");
    script
}

/// A port free now on loopback.
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

/// The directory the `rewind` binary under test is in, with `rewind-mock` beside it.
fn binaries() -> PathBuf {
    let dir = Path::new(env!("CARGO_BIN_EXE_rewind"))
        .parent()
        .expect("a directory")
        .to_owned();
    assert!(
        dir.join("rewind-mock").is_file(),
        "{} has no rewind-mock: `cargo build -p rewind-mock` (the workspace's tests build it)",
        dir.display()
    );
    dir
}

/// Runs walkthrough `name` with `ports` (as written, free one) replaced; its output when
/// it fails.
fn run(name: &str, ports: &[u16], env: &[(&str, &str)]) {
    let mut script = walkthrough(name);
    for port in ports {
        script = replace_number(&script, *port, free_port());
    }
    let dir = tempfile::tempdir().expect("tempdir");
    // Debian's nats-server is in /usr/sbin, which a user's PATH may lack.
    let path = format!(
        "{}:{}:/usr/sbin",
        binaries().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // What the walkthrough starts in the background is killed when it ends, however: its
    // state is the test's to throw away, and a graceful stop would only cost time.
    let prelude = "set -euo pipefail\ntrap 'kill -KILL $(jobs -p) 2>/dev/null || true; wait' EXIT\n\
                   trap 'exit 143' TERM\n";
    // Its output goes to files: background jobs share it and may outlive the script.
    let logs = tempfile::tempdir().expect("tempdir");
    let file = |name: &str| std::fs::File::create(logs.path().join(name)).expect("a log file");
    let mut child = {
        use std::os::unix::process::CommandExt as _;
        Command::new("bash")
            .arg("-c")
            .arg(format!("{prelude}{script}"))
            .current_dir(dir.path())
            .env("PATH", path)
            .env(
                "CARGO_TARGET_DIR",
                workspace_root().join("target").join("guests"),
            )
            .envs(env.iter().copied())
            .env_remove("RUST_LOG")
            .stdout(file("stdout"))
            .stderr(file("stderr"))
            .process_group(0)
            .spawn()
            .expect("bash runs")
    };
    // A walkthrough that waits for what never comes fails the test rather than hang it:
    // its whole process group is killed.
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if started.elapsed() > LIMIT {
            let group = rustix::process::Pid::from_raw(i32::try_from(child.id()).expect("a pid"))
                .expect("a pid");
            let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
            break child.wait().expect("wait");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let read = |name: &str| std::fs::read_to_string(logs.path().join(name)).unwrap_or_default();
    assert!(
        status.success(),
        "walkthrough `{name}` failed ({status}{}):\n--- script\n{script}\n--- stdout\n{}\n--- stderr\n{}",
        if started.elapsed() > LIMIT {
            ", killed past its time"
        } else {
            ""
        },
        read("stdout"),
        read("stderr")
    );
}

/// Replaces `from` with `to` where it stands as a number of its own (a port: `:4222`,
/// `-p 4222`), not inside a longer one.
fn replace_number(text: &str, from: u16, to: u16) -> String {
    let from = from.to_string();
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(&from) {
        let before = rest[..at].chars().next_back();
        let after = rest[at + from.len()..].chars().next();
        out.push_str(&rest[..at]);
        if before.is_some_and(|c| c.is_ascii_digit()) || after.is_some_and(|c| c.is_ascii_digit()) {
            out.push_str(&from);
        } else {
            out.push_str(&to.to_string());
        }
        rest = &rest[at + from.len()..];
    }
    out.push_str(rest);
    out
}

/// The longest a walkthrough may take.
const LIMIT: std::time::Duration = std::time::Duration::from_secs(300);

/// "Your first agent": new, build, run, test, then the dev loop against the mock service.
#[test]
fn your_first_agent() {
    guest("caller");
    run("first-agent", &[7181], &[]);
}

/// "Serving many tenants": a tenant made, a component built here uploaded, a server-side
/// agent.toml defined, an event run against the mock service its allow-list lets it reach.
#[test]
fn serving_many_tenants() {
    guest("caller");
    run("serve", &[7181, 7070], &[]);
}

/// "Several hosts on NATS JetStream": a nats-server on loopback, two hosts sharing the
/// agent's partitions, inputs published and every output read back.
#[test]
fn several_hosts_on_jetstream() {
    guest("caller");
    run("jetstream", &[4222, 8222], &[]);
}

/// "Running an agent": run, check, inspect.
#[test]
fn running_an_agent() {
    guest("caller");
    run("running", &[], &[]);
}

/// "Testing your agent": the kit at every boundary, at random ones, and at one.
#[test]
fn testing_your_agent() {
    guest("caller");
    run("testing", &[], &[]);
}
