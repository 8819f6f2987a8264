//! `kind = "mcp"` against a real Model Context Protocol server: tests/mcp/server.py on the
//! reference Python SDK (installed into .venv by scripts/guests.sh), over streamable HTTP,
//! answering with JSON documents and, with `--sse`, with event streams in sessions.

use std::io::{BufRead as _, BufReader};
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde_json::{Value, json};

use crate::kill::rewind_run;
use crate::support::{guest, workspace_root};

/// The test MCP server, stopped when dropped.
struct McpServer {
    child: Child,
    url: String,
    counts: PathBuf,
    _dir: tempfile::TempDir,
}

impl McpServer {
    /// Starts tests/mcp/server.py, with event streams and sessions when `sse`.
    fn start(sse: bool) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let counts = dir.path().join("counts.json");
        let root = workspace_root();
        let mut command = Command::new(root.join(".venv").join("bin").join("python"));
        command
            .arg(root.join("tests").join("mcp").join("server.py"))
            .arg(&counts)
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if sse {
            command.arg("--sse");
        }
        let mut child = command
            .spawn()
            .expect("the MCP test server starts (scripts/guests.sh installs its SDK)");
        let mut first = String::new();
        let stdout = child.stdout.take().expect("its stdout");
        BufReader::new(stdout)
            .read_line(&mut first)
            .expect("it says its port");
        let port: u16 = (first.trim().strip_prefix("port "))
            .and_then(|port| port.parse().ok())
            .unwrap_or_else(|| panic!("`port N`, not {first:?}"));
        Self {
            child,
            url: format!("http://127.0.0.1:{port}/mcp"),
            counts,
            _dir: dir,
        }
    }

    /// What the server counted: requests per idempotency key, charges made, each `_meta`.
    fn counts(&self) -> Value {
        serde_json::from_slice(&std::fs::read(&self.counts).expect("counts")).expect("JSON")
    }
}

impl Drop for McpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An agent whose action (the caller guest) may use the server's tools `charge`, `echo`
/// and `fail` (not `secret`).
fn agent(dir: &Path, server: &McpServer) -> PathBuf {
    let path = dir.join("agent.toml");
    std::fs::write(
        &path,
        format!(
            "name = \"tools\"\n[[actions]]\nname = \"work\"\ncomponent = {:?}\non = \
             [\"input\"]\n[functions.tools]\nkind = \"mcp\"\nurl = \"{}\"\ntools = \
             [\"charge\", \"echo\", \"fail\"]\n",
            guest("caller").display().to_string(),
            server.url,
        ),
    )
    .expect("agent.toml");
    path
}

fn call(method: &str, params: Value) -> Value {
    json!({ "function": "tools", "args": { "method": method, "params": params } })
}

/// What the runs in `dir` said (`rewind_run` keeps it in stderr.log).
fn said(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default()
}

fn outputs(dir: &Path) -> Vec<Value> {
    (std::fs::read_to_string(dir.join("out.jsonl"))
        .expect("outputs")
        .lines())
    .map(|line| serde_json::from_str(line).expect("an output"))
    .collect()
}

/// An action lists the tools it may use, calls one (its idempotency key in the request's
/// `_meta`), gets a tool's error as a failure, and is refused a tool off its allow-list
/// without the server hearing of it; with the server answering JSON, and event streams.
#[test]
fn an_action_lists_and_calls_the_tools_it_may_and_no_other() {
    for sse in [false, true] {
        let server = McpServer::start(sse);
        let dir = tempfile::tempdir().expect("temp dir");
        let agent = agent(dir.path(), &server);
        let calls = json!({ "calls": [
            call("tools/list", json!({})),
            call("tools/call", json!({ "name": "charge", "arguments": { "amount": 7 } })),
            call("tools/call", json!({ "name": "fail" })),
            call("tools/call", json!({ "name": "secret" })),
        ] });
        let inputs = dir.path().join("inputs.jsonl");
        let line = json!({ "key": "k", "payload": calls });
        std::fs::write(&inputs, format!("{line}\n")).expect("inputs");
        let ran = rewind_run(dir.path(), &agent, &inputs)
            .output()
            .expect("rewind runs");
        assert!(ran.status.success(), "sse {sse}: {}", said(dir.path()));
        let outputs = outputs(dir.path());
        let results = &outputs[0]["payload"]["results"];
        let listed: Vec<&str> = (results[0]["ok"]["tools"].as_array())
            .unwrap_or_else(|| panic!("sse {sse}: a list: {results}"))
            .iter()
            .filter_map(|tool| tool["name"].as_str())
            .collect();
        assert_eq!(listed, ["charge", "echo", "fail"], "sse {sse}");
        let charged = &results[1]["ok"]["content"][0]["text"];
        let charged: Value = serde_json::from_str(charged.as_str().expect("text")).expect("JSON");
        assert_eq!(charged["charged"], 7, "sse {sse}: {results}");
        let failed = results[2]["error"]["failed"].as_str().expect("a failure");
        assert!(
            failed.contains("Error executing tool fail"),
            "sse {sse}: {failed}"
        );
        let refused = results[3]["error"]["failed"].as_str().expect("a failure");
        assert!(
            refused.contains("tool `secret` is not among the tools this function may call"),
            "sse {sse}: {refused}"
        );
        let counts = server.counts();
        assert_eq!(counts["charges"], 1, "sse {sse}: {counts}");
        let metas = counts["meta"].as_array().expect("metas");
        assert_eq!(
            metas.len(),
            2,
            "charge and fail reached it, secret did not: {counts}"
        );
        assert!(
            (metas.iter()).all(|meta| meta["dev.rewind/idempotency-key"]
                .as_str()
                .is_some_and(|key| !key.is_empty())),
            "each call's key in its _meta: {counts}"
        );
    }
}

/// A tool call whose answer the process did not live to record is made again under the
/// same idempotency key, which the server honours: the charge is made once, and the
/// output appears once.
#[test]
fn a_tool_call_across_a_crash_is_made_once() {
    let server = McpServer::start(false);
    let dir = tempfile::tempdir().expect("temp dir");
    let agent = agent(dir.path(), &server);
    let line = json!({ "key": "k", "payload": { "calls": [
        call("tools/call", json!({ "name": "charge", "arguments": { "amount": 5 } })),
    ] } });
    let inputs = dir.path().join("inputs.jsonl");
    std::fs::write(&inputs, format!("{line}\n")).expect("inputs");
    let killed = rewind_run(dir.path(), &agent, &inputs)
        .env("REWIND_CRASH_AT", "after-call:1")
        .output()
        .expect("rewind runs");
    assert_eq!(killed.status.signal(), Some(9), "killed after the call");
    let ran = rewind_run(dir.path(), &agent, &inputs)
        .env_remove("REWIND_CRASH_AT")
        .output()
        .expect("rewind runs");
    assert!(ran.status.success(), "{}", said(dir.path()));
    let counts = server.counts();
    assert_eq!(counts["charges"], 1, "{counts}");
    let requests = counts["requests"].as_object().expect("requests");
    assert_eq!(requests.len(), 1, "one key: {counts}");
    let (key, asked) = requests.iter().next().expect("a key");
    assert!(!key.is_empty(), "the call's key, from its _meta: {counts}");
    assert_eq!(asked, &json!(2), "asked twice: {counts}");
    assert_eq!(outputs(dir.path()).len(), 1);
}

/// Under `rewind serve`, a tenant's `allow-mcp-tools` bounds its agents' MCP tools: an
/// agent asking for a tool off it is refused when defined, naming the tool; one that names
/// none gets the tenant's (`tools/list` shows only them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_allowed_tools_bound_its_agents() {
    let server = tokio::task::spawn_blocking(|| McpServer::start(false))
        .await
        .expect("join");
    let at = server
        .url
        .trim_start_matches("http://")
        .trim_end_matches("/mcp");
    let dir = tempfile::tempdir().expect("temp dir");
    let config = format!(
        "[tenants.acme]\nallow-hosts = [\"{at}\"]\nallow-mcp-tools = [\"charge\", \"echo\"]\n"
    );
    let serve = crate::serve::Server::start(dir.path(), &config).await;
    let token = serve.tenant("acme").await;
    serve.upload("acme", &token, "worker", "caller").await;
    let agent = |name: &str, tools: &str| {
        crate::serve::agent(
            name,
            "worker",
            &format!(
                "[functions.tools]\nkind = \"mcp\"\nurl = \"{}\"\n{tools}",
                server.url
            ),
        )
    };
    let (status, body) = serve
        .define(
            "acme",
            &token,
            &agent("greedy", "tools = [\"charge\", \"secret\"]\n"),
        )
        .await;
    assert!(status.is_client_error(), "{status}: {body}");
    assert!(
        body.to_string()
            .contains("tool `secret` is not among the MCP tools this tenant may call"),
        "{body}"
    );
    let (status, body) = serve.define("acme", &token, &agent("bot", "")).await;
    assert!(status.is_success(), "{status}: {body}");
    let payload = json!({ "calls": [call("tools/list", json!({}))] });
    let (status, body) = serve
        .submit("acme", &token, "bot", "e1", "k", payload)
        .await;
    assert!(status.is_success(), "{status}: {body}");
    let outputs = serve.wait_outputs("acme", &token, 1).await;
    let listed: Vec<&str> = (outputs[0]["payload"]["results"][0]["ok"]["tools"].as_array())
        .unwrap_or_else(|| panic!("a list: {outputs:?}"))
        .iter()
        .filter_map(|tool| tool["name"].as_str())
        .collect();
    assert_eq!(listed, ["charge", "echo"]);
}
