//! From nothing to a tested agent, as a newcomer goes: `rewind new agent`, `rewind build`,
//! `rewind run`, `rewind test`, in each language, in a directory outside this repository,
//! against the SDK packages the binary carries; and the SDKs as packages.
//!
//! Rust builds share the guests' target directory (target/guests): the new agent's
//! lockfile pins the versions this workspace builds with, so nothing is built twice.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

use crate::support::{guest, workspace_root};

/// `rewind ARGS` in `dir`, with the build tools in the default cache (where
/// scripts/guests.sh installs them) and Rust builds in target/guests.
fn rewind(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rewind"))
        .current_dir(dir)
        .args(args)
        .env(
            "CARGO_TARGET_DIR",
            workspace_root().join("target").join("guests"),
        )
        .env_remove("RUST_LOG")
        .output()
        .expect("rewind runs")
}

fn ok(output: Output, what: &str) -> Output {
    assert!(
        output.status.success(),
        "{what} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// The outputs' payloads of a run, in the order written.
fn payloads(stdout: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(stdout)
        .lines()
        .map(|line| serde_json::from_str::<Value>(line).expect("an output line is JSON"))
        .map(|output| output["payload"].clone())
        .collect()
}

/// A new agent whose first action is in `lang`: made, built, run over its sample inputs
/// (each greeted, Ada's visits counted across her two inputs), and passing `rewind test`.
/// Then an action in `other` is added and built beside it. The agent's directory.
fn new_agent_builds_runs_and_passes_its_test(lang: &str, other: &str) -> tempfile::TempDir {
    // Outside the repository: nothing here can reach its workspace or its SDK sources.
    let home = tempfile::tempdir().expect("tempdir");
    assert!(!home.path().starts_with(workspace_root()));
    ok(
        rewind(home.path(), &["new", "agent", "hello", "--lang", lang]),
        "rewind new agent",
    );
    let dir = home.path().join("hello");
    for file in [
        "agent.toml",
        "inputs.jsonl",
        "sdk/rust/Cargo.toml",
        "sdk/python/pyproject.toml",
        "sdk/js/package.json",
    ] {
        assert!(dir.join(file).is_file(), "rewind new agent writes {file}");
    }

    let built = ok(rewind(&dir, &["build"]), "rewind build");
    assert!(
        String::from_utf8_lossy(&built.stderr).contains(&format!("built greet ({lang})")),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    assert!(dir.join("build/greet.wasm").is_file());

    let run = ok(
        rewind(&dir, &["run", "agent.toml", "--input", "inputs.jsonl"]),
        "rewind run",
    );
    let mut greetings: Vec<(String, u64)> = payloads(&run.stdout)
        .iter()
        .map(|payload| {
            let lucky = payload["lucky"].as_u64().expect("a lucky number");
            assert!(lucky < 100, "{payload}");
            (
                payload["greeting"].as_str().expect("a greeting").to_owned(),
                payload["visits"].as_u64().expect("visits"),
            )
        })
        .collect();
    greetings.sort();
    assert_eq!(
        greetings,
        [
            ("Hello, Ada!".to_owned(), 1),
            ("Hello, Ada!".to_owned(), 2),
            ("Hello, Alan!".to_owned(), 1)
        ]
    );

    ok(
        rewind(&dir, &["test", "agent.toml", "--input", "inputs.jsonl"]),
        "rewind test",
    );

    // Built again unchanged, nothing is built.
    let again = ok(rewind(&dir, &["build"]), "rewind build, again");
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("greet: unchanged"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );

    ok(
        rewind(&dir, &["new", "action", "shout", "--lang", other]),
        "rewind new action",
    );
    let built = ok(
        rewind(&dir, &["build", "--action", "shout"]),
        "rewind build --action shout",
    );
    let said = String::from_utf8_lossy(&built.stderr);
    assert!(said.contains(&format!("built shout ({other})")), "{said}");
    assert!(!said.contains("greet"), "only the action asked for: {said}");
    assert!(dir.join("build/shout.wasm").is_file());
    home
}

#[test]
fn a_new_rust_agent_builds_runs_and_passes_its_test() {
    guest("caller");
    new_agent_builds_runs_and_passes_its_test("rust", "python");
}

#[test]
fn a_new_python_agent_builds_runs_and_passes_its_test() {
    guest("caller");
    let home = new_agent_builds_runs_and_passes_its_test("python", "js");
    // The action was built against the SDK installed as a wheel: componentize-py found
    // the world in the installed package, not in the SDK's sources.
    let record = std::fs::read_to_string(
        home.path()
            .join("hello/build/greet.wasm.build/site/rewind_guest-0.1.0.dist-info/RECORD"),
    )
    .expect("the SDK was installed from its package");
    for file in [
        "rewind/__init__.py",
        "rewind/componentize-py.toml",
        "rewind/py.typed",
        "rewind/wit/action.wit",
    ] {
        assert!(record.contains(file), "the wheel lacks {file}:\n{record}");
    }
}

#[test]
fn a_new_javascript_agent_builds_runs_and_passes_its_test() {
    guest("caller");
    let home = new_agent_builds_runs_and_passes_its_test("js", "rust");
    // Built again from the SDK as `npm pack` packs it.
    let dir = home.path().join("hello");
    let packed = Command::new("npm")
        .args(["pack", "--silent", "--pack-destination", ".."])
        .current_dir(dir.join("sdk/js"))
        .output()
        .expect("npm runs");
    let tarball = String::from_utf8_lossy(&ok(packed, "npm pack").stdout)
        .trim()
        .to_owned();
    assert_eq!(tarball, "rewind-guest-0.1.0.tgz");
    let package = dir.join("actions/greet/package.json");
    let text = std::fs::read_to_string(&package).expect("package.json");
    std::fs::write(
        &package,
        text.replace("file:../../sdk/js", "file:../../sdk/rewind-guest-0.1.0.tgz"),
    )
    .expect("write");
    let built = ok(rewind(&dir, &["build"]), "rewind build from the packed SDK");
    assert!(String::from_utf8_lossy(&built.stderr).contains("built greet (js)"));
    // (Its bundle is the packed SDK's rewind.js: esbuild fails on an import it cannot find.
    // Running it again would only compile another copy: componentize-js writes the paths
    // of its temporary directories into the component.)
    assert!(dir.join("build/greet.wasm").is_file());
}

/// A build that fails says which action, where, and shows the compiler's own error.
#[test]
fn a_failed_build_names_the_action_its_source_and_the_compilers_error() {
    guest("caller");
    let home = tempfile::tempdir().expect("tempdir");
    for lang in ["rust", "python", "js"] {
        let name = format!("broken-{lang}");
        ok(
            rewind(home.path(), &["new", "agent", &name, "--lang", lang]),
            "rewind new agent",
        );
        let dir = home.path().join(&name);
        let (file, broken) = match lang {
            "rust" => ("actions/greet/src/lib.rs", "fn run( {"),
            "python" => ("actions/greet/action.py", "def run(:\n"),
            _ => ("actions/greet/action.js", "export const run = ((;\n"),
        };
        std::fs::write(dir.join(file), broken).expect("write");
        let output = rewind(&dir, &["build"]);
        assert!(!output.status.success(), "{lang}: a broken action builds");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains(&format!("building action `greet` ({lang}, "))
                && stderr.contains("actions/greet"),
            "{lang}: {stderr}"
        );
        let compiler = match lang {
            "rust" => "could not compile",
            "python" => "SyntaxError",
            _ => "action.js",
        };
        assert!(
            stderr.contains(compiler),
            "{lang}: the compiler's error is not shown:\n{stderr}"
        );
    }
}

/// The SDK packages: what the binary carries is what each package holds, and the Rust
/// crate builds from its own `.crate` (`cargo package` verifies it).
#[test]
fn each_sdk_package_holds_what_the_binary_carries() {
    guest("caller");
    let home = tempfile::tempdir().expect("tempdir");
    ok(
        rewind(home.path(), &["new", "agent", "pkg"]),
        "rewind new agent",
    );
    let sdk = home.path().join("pkg/sdk");
    let carried = |dir: &str| -> Vec<String> {
        let mut files = Vec::new();
        list(&sdk.join(dir), &sdk.join(dir), &mut files);
        files.sort();
        files
    };

    // cargo package: built from the `.crate` alone, in a target directory of its own (the
    // tests' cargo holds target/).
    let target = workspace_root().join("target").join("package-check");
    let packaged = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
        .current_dir(workspace_root())
        .args([
            "package",
            "-p",
            "rewind-guest",
            "--allow-dirty",
            "--target-dir",
        ])
        .arg(&target)
        .output()
        .expect("cargo runs");
    ok(packaged, "cargo package -p rewind-guest");
    let listed = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
        .current_dir(workspace_root())
        .args(["package", "-p", "rewind-guest", "--allow-dirty", "--list"])
        .output()
        .expect("cargo runs");
    let mut listed: Vec<String> =
        String::from_utf8_lossy(&ok(listed, "cargo package --list").stdout)
            .lines()
            .filter(|file| {
                !matches!(
                    *file,
                    "Cargo.toml.orig" | "Cargo.lock" | ".cargo_vcs_info.json"
                )
            })
            .map(str::to_owned)
            .collect();
    listed.sort();
    assert_eq!(
        listed,
        carried("rust"),
        "the crate and the binary's copy differ"
    );

    // npm pack: the JavaScript package, with its type declarations.
    let packed = Command::new("npm")
        .args(["pack", "--dry-run", "--json"])
        .current_dir(workspace_root().join("guest-sdk/js"))
        .output()
        .expect("npm runs");
    let packed: Value =
        serde_json::from_slice(&ok(packed, "npm pack --dry-run").stdout).expect("JSON");
    let mut files: Vec<String> = packed[0]["files"]
        .as_array()
        .expect("files")
        .iter()
        .map(|file| file["path"].as_str().expect("a path").to_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        carried("js"),
        "the npm package and the binary's copy differ"
    );
    assert!(files.contains(&"rewind.d.ts".to_owned()));

    // The Python package's sources: the repository's, with its link to the WIT followed.
    let mut python = Vec::new();
    let root = workspace_root().join("guest-sdk/python");
    list(&root, &root, &mut python);
    // The world before 0.2.0 is the host's to run, not the package's to build against
    // (its package data takes `wit/*.wit`).
    python.retain(|file| !file.starts_with("rewind/wit/0.1.0/"));
    python.sort();
    assert_eq!(
        python,
        carried("python"),
        "the Python package and the binary's copy differ"
    );
}

/// The files under `dir`, relative to `root`, without what builds leave.
fn list(root: &Path, dir: &Path, files: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).expect("a directory") {
        let path: PathBuf = entry.expect("an entry").path();
        let name = path
            .file_name()
            .expect("a name")
            .to_string_lossy()
            .into_owned();
        if path.is_dir() {
            if !matches!(name.as_str(), "__pycache__" | "build" | "node_modules")
                && !name.ends_with(".egg-info")
            {
                list(root, &path, files);
            }
        } else {
            files.push(
                path.strip_prefix(root)
                    .expect("under root")
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
}

/// `rewind dev`: the first run's calls reach the service and are recorded; after a change
/// to the action's source, it is built and run again on its own, served from the
/// recording, and no call reaches the service. Under `--offline`, a call the recording
/// lacks fails the run, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewind_dev_runs_again_on_a_change_served_from_its_recording() {
    use std::io::BufRead as _;

    guest("caller");
    let mock = rewind_mock::MockService::start("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("mock");
    let home = tempfile::tempdir().expect("tempdir");
    ok(
        rewind(home.path(), &["new", "agent", "dev", "--lang", "rust"]),
        "rewind new agent",
    );
    let dir = home.path().join("dev");
    let agent = dir.join("agent.toml");
    let mut toml = std::fs::read_to_string(&agent).expect("agent.toml");
    toml.push_str(&format!(
        "\n[functions.\"orders.lookup\"]\nkind = \"http\"\nurl = \"{}/tools/orders.lookup\"\n",
        mock.base_url()
    ));
    std::fs::write(&agent, toml).expect("write");
    // Rust: its builds share the guests' target directory, and its component is small, so
    // a round is quick.
    let action = dir.join("actions/greet/src/lib.rs");
    let source = |greeting: &str| {
        format!(
            "use rewind_guest::{{Action, Context, Error, Event}};\n\
             struct Greet;\n\
             impl Action for Greet {{\n\
                 fn run(ctx: &mut Context, event: Event) -> Result<(), Error> {{\n\
                     let input: serde_json::Value = event.payload()?;\n\
                     let order: serde_json::Value =\n\
                         ctx.call(\"orders.lookup\", &serde_json::json!({{\"order_id\": \"A1234\"}}))?;\n\
                     ctx.output(&serde_json::json!({{\n\
                         \"greeting\": format!(\"{greeting}, {{}}\", input[\"name\"].as_str().unwrap_or_default()),\n\
                         \"status\": order[\"status\"],\n\
                     }}))\n\
                 }}\n\
             }}\n\
             rewind_guest::export_action!(Greet);\n"
        )
    };
    std::fs::write(&action, source("Hello")).expect("write");

    /// Kills `rewind dev` however the test ends.
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut dev = Command::new(env!("CARGO_BIN_EXE_rewind"))
        .current_dir(&dir)
        .args(["dev", "agent.toml", "--input", "inputs.jsonl"])
        .env(
            "CARGO_TARGET_DIR",
            workspace_root().join("target").join("guests"),
        )
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("rewind dev starts");
    let (lines, outputs) = std::sync::mpsc::channel::<Value>();
    let stdout = dev.stdout.take().expect("stdout");
    let dev = Killed(dev);
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Ok(output) = serde_json::from_str::<Value>(&line) {
                let _ = lines.send(output["payload"].clone());
            }
        }
    });
    let three = |outputs: &std::sync::mpsc::Receiver<Value>| -> Vec<String> {
        let mut greetings: Vec<String> = (0..3)
            .map(|_| {
                let payload = outputs
                    .recv_timeout(std::time::Duration::from_secs(180))
                    .expect("rewind dev writes the run's outputs");
                assert_eq!(payload["status"], "processing", "{payload}");
                payload["greeting"].as_str().expect("a greeting").to_owned()
            })
            .collect();
        greetings.sort();
        greetings
    };

    assert_eq!(three(&outputs), ["Hello, Ada", "Hello, Ada", "Hello, Alan"]);
    let calls = mock.counts().for_route("/tools/orders.lookup");
    assert_eq!(calls, 3, "the first run's calls reach the service");
    // The recording is written once the run has ended, after its outputs.
    let recorded = std::time::Instant::now();
    let recording = loop {
        match std::fs::read_to_string(dir.join("responses.jsonl")) {
            Ok(text) if text.ends_with('\n') => break text,
            _ if recorded.elapsed() > std::time::Duration::from_secs(60) => {
                panic!("rewind dev wrote no recording")
            }
            _ => std::thread::sleep(std::time::Duration::from_millis(50)),
        }
    };
    assert_eq!(
        recording.lines().count(),
        1,
        "one answer per function and args:\n{recording}"
    );

    std::fs::write(&action, source("Hi")).expect("write");
    assert_eq!(three(&outputs), ["Hi, Ada", "Hi, Ada", "Hi, Alan"]);
    assert_eq!(
        mock.counts().for_route("/tools/orders.lookup"),
        calls,
        "a run after a change is served from the recording"
    );
    drop(dev);

    // Offline, a call the recording lacks fails, and nothing reaches the service.
    std::fs::write(dir.join("responses.jsonl"), "").expect("write");
    let offline = rewind(
        &dir,
        &[
            "dev",
            "agent.toml",
            "--input",
            "inputs.jsonl",
            "--once",
            "--offline",
        ],
    );
    assert!(!offline.status.success());
    let stderr = String::from_utf8_lossy(&offline.stderr);
    assert!(
        stderr.contains("not in the recording failed (--offline"),
        "{stderr}"
    );
    assert_eq!(mock.counts().for_route("/tools/orders.lookup"), calls);
}
