//! The agent under test, rewritten to run against the simulator.

use std::collections::BTreeMap;
use std::path::Path;

use super::error::KitError;
use toml::{Table, Value};

use crate::durable::InDoubtPolicy;

/// The agent.toml the kit runs, and what it needs to know of the original.
#[derive(Debug)]
pub struct Rewritten {
    pub toml: String,
    /// Function name to its endpoint in the original (after `rewrites`).
    pub upstreams: BTreeMap<String, String>,
    /// Functions whose `in-doubt` is not `retry`.
    pub in_doubt: BTreeMap<String, InDoubtPolicy>,
}

/// Reads `path` and points every `http` and `openai-chat` function at `simulator(name)`;
/// makes component paths absolute; checkpoints after every input and never on a timer, so
/// that every checkpoint boundary is reached, as often on every run. `rewrites` (`from`, `to`) replace URL prefixes of the original
/// endpoints, for the simulator to forward to.
pub fn rewrite(
    path: &Path,
    simulator: impl Fn(&str) -> String,
    rewrites: &[(String, String)],
) -> Result<Rewritten, KitError> {
    let text = std::fs::read_to_string(path)
        .map_err(KitError::io(format!("reading {}", path.display())))?;
    // Parsed as an agent first, so that a bad file gets the same errors as `rewind run`.
    crate::agent::AgentFile::parse(path, &text)?;
    let mut table: Table = text.parse().map_err(|source| KitError::Toml {
        what: format!("parsing {}", path.display()),
        source,
    })?;
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
    let base = std::path::absolute(parent.unwrap_or(Path::new("."))).map_err(KitError::io(
        format!("finding the directory of {}", path.display()),
    ))?;
    if let Some(Value::Array(actions)) = table.get_mut("actions") {
        for action in actions {
            if let Some(Value::String(component)) = action.get_mut("component") {
                let absolute = base.join(&*component);
                *component = absolute.display().to_string();
            }
        }
    }
    let state = table
        .entry("state")
        .or_insert_with(|| Value::Table(Table::new()));
    if let Value::Table(state) = state {
        state.insert("checkpoint-every-inputs".to_owned(), Value::Integer(1));
        // No checkpoints on a timer: how often each point is reached should not depend on
        // how fast the machine is.
        state.insert("checkpoint-every-ms".to_owned(), Value::Integer(86_400_000));
        // One state per refresh append, so that a crash lands after k of n of them.
        state.insert("refresh-batch".to_owned(), Value::Integer(1));
    }
    let mut upstreams = BTreeMap::new();
    let mut in_doubt = BTreeMap::new();
    if let Some(Value::Table(functions)) = table.get_mut("functions") {
        for (name, function) in functions.iter_mut() {
            let Value::Table(function) = function else {
                return Err(KitError::Cannot(format!(
                    "{}: [functions.{name}] is not a table",
                    path.display()
                )));
            };
            let field = match function.get("kind").and_then(Value::as_str) {
                Some("http") => "url",
                Some("openai-chat") => "base-url",
                _ => continue,
            };
            if let Some(Value::String(url)) = function.get(field) {
                let mut url = url.clone();
                for (from, to) in rewrites {
                    if let Some(rest) = url.strip_prefix(from.as_str()) {
                        url = format!("{to}{rest}");
                    }
                }
                upstreams.insert(name.clone(), url);
            }
            function.insert(field.to_owned(), Value::String(simulator(name)));
            match function.get("in-doubt").and_then(Value::as_str) {
                Some("reconcile") => {
                    in_doubt.insert(name.clone(), InDoubtPolicy::Reconcile);
                    function.insert(
                        "reconcile-url".to_owned(),
                        Value::String(format!("{}/~status", simulator(name))),
                    );
                }
                Some("fail") => {
                    in_doubt.insert(name.clone(), InDoubtPolicy::Fail);
                }
                _ => {}
            }
        }
    }
    Ok(Rewritten {
        toml: toml::to_string(&table)
            .map_err(|e| KitError::Cannot(format!("{}: writing it back: {e}", path.display())))?,
        upstreams,
        in_doubt,
    })
}
