//! `agent.toml`: an agent's actions, functions and limits.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use crate::durable::{DivergencePolicy, InDoubtPolicy};
use crate::log::Log;
use crate::sandbox::Limits;
use crate::store::{Incarnation, LogStore, MarkerStrategy, StoreError};

/// Keys processed at once, unless `parallelism` says otherwise.
pub const DEFAULT_PARALLELISM: usize = 8;

/// An agent as declared in `agent.toml`. Keys are kebab-case; unknown keys are errors.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct AgentConfig {
    pub name: String,
    /// Keys processed at once (inputs of one key are always one at a time). Default 8.
    #[serde(default = "default_parallelism")]
    pub parallelism: usize,
    /// What a replay does when an action makes a different call than the one recorded.
    /// Default `truncate`.
    #[serde(default)]
    pub divergence: DivergencePolicy,
    /// What becomes of an event of a kind no action handles: `drop` (default: dropped,
    /// warned of and counted) or `fail` (its input fails).
    #[serde(default)]
    pub unhandled_events: UnhandledEvents,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub actions: Vec<ActionConfig>,
    #[serde(default)]
    pub functions: BTreeMap<String, FunctionConfig>,
    #[serde(default)]
    pub state: StateConfig,
    #[serde(default)]
    pub retry: RetryConfig,
}

/// `[retry]`: how an input whose run failed (a trap, a limit, the action's own error, a
/// function that could not be reached) is run again before it is parked. Each retry waits a
/// random time between 0 and `initial-ms` × 2^(retry − 1), at most `max-ms` (exponential
/// backoff with full jitter); its recorded calls are served, not made again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Runs of an input before it is parked, the first one included. Default 3; 1 parks an
    /// input at its first failure.
    pub attempts: u32,
    /// The bound on the first retry's wait, in milliseconds. Default 1000.
    pub initial_ms: u64,
    /// The bound on any retry's wait, in milliseconds. Default 60,000.
    pub max_ms: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            attempts: 3,
            initial_ms: 1000,
            max_ms: 60_000,
        }
    }
}

/// `unhandled-events`: what becomes of an event of a kind no action's `on` names (and not
/// `output`, which leaves the agent).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum UnhandledEvents {
    /// Dropped, with a warning, and counted in the run's summary.
    #[default]
    Drop,
    /// Its input fails, naming the kind.
    Fail,
}

/// `[state]`: the log, its markers and checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct StateConfig {
    /// Partitions of the state log; fixed when the state directory is created. Default 8.
    pub partitions: u32,
    /// How checkpoints keep recorded calls reachable: `offsets` (default) or `refresh`.
    pub marker: MarkerStrategy,
    /// Take a checkpoint this often, in milliseconds. Default 1000.
    pub checkpoint_every_ms: u64,
    /// And after this many accepted inputs. Default 1000.
    pub checkpoint_every_inputs: u64,
    /// Checkpoints kept; retention keeps the log data the oldest of them needs. Default 3.
    pub keep_checkpoints: usize,
    /// States a `refresh` checkpoint re-appends at a time. Default 4096.
    pub refresh_batch: usize,
}

impl Default for StateConfig {
    fn default() -> Self {
        Self {
            partitions: 8,
            marker: MarkerStrategy::default(),
            checkpoint_every_ms: 1000,
            checkpoint_every_inputs: 1000,
            keep_checkpoints: 3,
            refresh_batch: crate::store::DEFAULT_REFRESH_BATCH,
        }
    }
}

impl StateConfig {
    /// The store over `log` this `[state]` asks for: its marker strategy and refresh batch,
    /// setting the states of waiting inputs aside on `shelf` (as many partitions as `log`).
    pub fn store(
        &self,
        log: Arc<dyn Log>,
        shelf: Arc<dyn Log>,
        incarnation: Incarnation,
    ) -> Result<LogStore, StoreError> {
        LogStore::new(log, self.marker, incarnation)
            .with_refresh_batch(self.refresh_batch)
            .with_shelf(shelf)
    }
}

fn default_parallelism() -> usize {
    DEFAULT_PARALLELISM
}

/// One `[[actions]]` entry.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ActionConfig {
    pub name: String,
    /// Path of the component, relative to `agent.toml`.
    pub component: PathBuf,
    /// Event kinds that trigger it.
    pub on: Vec<String>,
    /// The signals it may wait for (`await-signal`); a signal no action of the agent
    /// declares is refused when it is sent.
    #[serde(default)]
    pub signals: Vec<String>,
    /// Where its source is, relative to `agent.toml` (default `actions/NAME`): what
    /// `rewind build` builds `component` from. Running the agent does not read it.
    #[serde(default)]
    pub source: Option<PathBuf>,
}

/// What a function is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FunctionKind {
    Http,
    OpenaiChat,
    Time,
    Random,
    /// The tools of a Model Context Protocol server, over streamable HTTP.
    Mcp,
    /// Provided by the embedding program through the Rust API.
    Custom,
}

/// One `[functions."name"]` entry. Which keys apply depends on `kind`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct FunctionConfig {
    pub kind: FunctionKind,
    /// `http`: where to POST.
    pub url: Option<String>,
    /// `openai-chat`: e.g. `https://api.openai.com/v1`.
    pub base_url: Option<String>,
    /// `openai-chat`: the model to ask.
    pub model: Option<String>,
    /// `openai-chat`: environment variable holding the API key.
    pub api_key_env: Option<String>,
    /// `http`, `openai-chat`: per attempt. Default 10,000 (60,000 for `openai-chat`).
    pub timeout_ms: Option<u64>,
    /// `http`, `openai-chat`: how failed requests are tried again.
    pub retry: Option<FunctionRetryConfig>,
    /// `http`, `openai-chat`: the earlier form of `retry.attempts` (requests after the first),
    /// still read, with a warning.
    pub retries: Option<u32>,
    /// `http`, `openai-chat`: headers sent with every request.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// `http`, `openai-chat`: header name to the environment variable holding its value.
    #[serde(default)]
    pub secret_headers: BTreeMap<String, String>,
    /// Actions allowed to call it; every action when absent.
    pub actions: Option<Vec<String>>,
    /// Overrides the agent's `divergence` for calls of this function.
    pub divergence: Option<DivergencePolicy>,
    /// What a call found pending on replay means: `retry` (default), `reconcile`, `fail`.
    pub in_doubt: Option<InDoubtPolicy>,
    /// `http` with `in-doubt = "reconcile"`: where to ask what became of a call.
    pub reconcile_url: Option<String>,
    /// `mcp`: the tools it may call and list; every tool the server has when absent.
    pub tools: Option<Vec<String>>,
    /// `http`, `openai-chat`: bytes of an answer read (a call's, or a reconcile's); a
    /// longer answer is a recorded failure, "response larger than N bytes". Default
    /// 4 MiB.
    pub max_response_bytes: Option<u64>,
}

/// `[functions."name".retry]`: how a function's failed requests are tried again. A request
/// is tried again after a transport error, a 5xx, or a 408, 409 or 429 answer; any other
/// answer is final at once. Each wait is exponential backoff with full jitter, and at least
/// what a 429's or 503's `Retry-After` asks. The last answer is the call's outcome (the one
/// recorded); none of the attempts before it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
pub struct FunctionRetryConfig {
    /// Requests in all, the first included. Default 4; 1 never tries again.
    pub attempts: u32,
    /// The bound on the first wait, in milliseconds. Default 100.
    pub initial_ms: u64,
    /// The bound on any backoff wait, in milliseconds (a `Retry-After` may ask for more).
    /// Default 2,000.
    pub max_ms: u64,
    /// No request starts later than this after the first, in milliseconds: a backoff wait
    /// is cut to the time left, and a `Retry-After` that would end past it ends the retries.
    /// Default 60,000; at most a day.
    pub deadline_ms: u64,
}

/// The longest `retry.deadline-ms`: a day.
pub const MAX_RETRY_DEADLINE_MS: u64 = 24 * 60 * 60 * 1000;

impl Default for FunctionRetryConfig {
    fn default() -> Self {
        Self {
            attempts: 4,
            initial_ms: 100,
            max_ms: 2_000,
            deadline_ms: 60_000,
        }
    }
}

impl FunctionRetryConfig {
    /// The policy `retry` and the earlier `retries` (`None` and `None`: the default) say.
    pub fn from_keys(retry: Option<Self>, retries: Option<u32>) -> Self {
        match (retry, retries) {
            (Some(retry), _) => retry,
            (None, Some(retries)) => Self {
                attempts: retries.saturating_add(1),
                ..Self::default()
            },
            (None, None) => Self::default(),
        }
    }
}

/// Why an agent could not be loaded. Names the file and what is wrong in it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// A parsed `agent.toml` and the directory its relative paths start from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentFile {
    pub path: PathBuf,
    pub config: AgentConfig,
}

impl AgentFile {
    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(path, &text)
    }

    /// Parses and validates `text` as if read from `path`.
    pub fn parse(path: &Path, text: &str) -> Result<Self, ConfigError> {
        let config: AgentConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string().trim_end().to_owned(),
        })?;
        config.validate().map_err(|message| ConfigError::Invalid {
            path: path.to_owned(),
            message,
        })?;
        Ok(Self {
            path: path.to_owned(),
            config,
        })
    }

    /// Where the component of `action` is.
    pub fn component_path(&self, action: &ActionConfig) -> PathBuf {
        let base = self.path.parent().unwrap_or_else(|| Path::new("."));
        base.join(&action.component)
    }
}

impl AgentConfig {
    /// The signals its actions declare (`signals = [...]`), each once.
    pub fn signals(&self) -> Vec<&str> {
        let all = (self.actions.iter()).flat_map(|action| action.signals.iter());
        let names: std::collections::BTreeSet<&str> = all.map(String::as_str).collect();
        names.into_iter().collect()
    }

    fn validate(&self) -> Result<(), String> {
        if self.name.trim().is_empty() {
            return Err("`name` is empty".to_owned());
        }
        if self.state.partitions == 0
            || self.state.keep_checkpoints == 0
            || self.state.refresh_batch == 0
        {
            return Err("`state.partitions`, `state.keep-checkpoints` and \
                 `state.refresh-batch` must be at least 1"
                .to_owned());
        }
        if self.parallelism == 0 {
            return Err("`parallelism` must be at least 1".to_owned());
        }
        if self.retry.attempts == 0 {
            return Err("`retry.attempts` must be at least 1 (the first run counts)".to_owned());
        }
        if self.retry.max_ms < self.retry.initial_ms {
            return Err(format!(
                "`retry.max-ms` ({}) is less than `retry.initial-ms` ({})",
                self.retry.max_ms, self.retry.initial_ms
            ));
        }
        if self.actions.is_empty() {
            return Err("no `[[actions]]`: an agent needs at least one action".to_owned());
        }
        let mut names = std::collections::BTreeSet::new();
        for action in &self.actions {
            if !names.insert(action.name.as_str()) {
                return Err(format!("action `{}` is declared twice", action.name));
            }
            if action.name.starts_with('@') {
                return Err(format!(
                    "action `{}`: names starting with `@` are the host's",
                    action.name
                ));
            }
            let mut signals = std::collections::BTreeSet::new();
            for signal in &action.signals {
                if signal.is_empty() || signal.len() > crate::durable::MAX_SIGNAL_NAME_BYTES {
                    return Err(format!(
                        "action `{}`: signal name {signal:?} is empty or longer than {} bytes",
                        action.name,
                        crate::durable::MAX_SIGNAL_NAME_BYTES
                    ));
                }
                if !signals.insert(signal) {
                    return Err(format!(
                        "action `{}`: signal `{signal}` is declared twice",
                        action.name
                    ));
                }
            }
            if action.on.is_empty() {
                return Err(format!(
                    "action `{}`: `on` is empty, so nothing would trigger it",
                    action.name
                ));
            }
            if action
                .on
                .iter()
                .any(|kind| kind == crate::event::OUTPUT_KIND)
            {
                return Err(format!(
                    "action `{}`: `on` lists \"output\", but output events leave the agent",
                    action.name
                ));
            }
        }
        for (name, function) in &self.functions {
            if name.starts_with('@') {
                return Err(format!(
                    "function `{name}`: names starting with `@` are the host's (its waits)"
                ));
            }
            function
                .validate()
                .map_err(|message| format!("function `{name}`: {message}"))?;
            if let Some(retries) = function.retries {
                tracing::warn!(
                    "function `{name}`: `retries = {retries}` is read as `[functions.\"{name}\".retry] \
                     attempts = {}`; write that instead",
                    retries.saturating_add(1)
                );
            }
            for action in function.actions.iter().flatten() {
                if !names.contains(action.as_str()) {
                    return Err(format!(
                        "function `{name}`: `actions` names `{action}`, which is not an action of this agent"
                    ));
                }
            }
        }
        Ok(())
    }
}

impl FunctionConfig {
    fn validate(&self) -> Result<(), String> {
        let given = [
            ("url", self.url.is_some()),
            ("base-url", self.base_url.is_some()),
            ("model", self.model.is_some()),
            ("api-key-env", self.api_key_env.is_some()),
            ("timeout-ms", self.timeout_ms.is_some()),
            ("retry", self.retry.is_some()),
            ("retries", self.retries.is_some()),
            ("headers", !self.headers.is_empty()),
            ("secret-headers", !self.secret_headers.is_empty()),
            ("reconcile-url", self.reconcile_url.is_some()),
            ("max-response-bytes", self.max_response_bytes.is_some()),
            ("tools", self.tools.is_some()),
        ];
        // What every kind that reaches a remote over HTTP takes, beside its own keys.
        const REMOTE: &[&str] = &[
            "timeout-ms",
            "retry",
            "retries",
            "headers",
            "secret-headers",
            "max-response-bytes",
        ];
        let (required, own, remote): (&[&str], &[&str], &[&str]) = match self.kind {
            FunctionKind::Http => (&["url"], &["url", "reconcile-url"], REMOTE),
            FunctionKind::OpenaiChat => (
                &["base-url", "model"],
                &["base-url", "model", "api-key-env"],
                REMOTE,
            ),
            FunctionKind::Mcp => (&["url"], &["url", "tools"], REMOTE),
            FunctionKind::Time | FunctionKind::Random | FunctionKind::Custom => (&[], &[], &[]),
        };
        for (key, present) in given {
            if present && !own.contains(&key) && !remote.contains(&key) {
                return Err(format!(
                    "`{key}` does not apply to kind `{}`",
                    self.kind_name()
                ));
            }
        }
        for key in required {
            if !given.iter().any(|(k, present)| k == key && *present) {
                return Err(format!("kind `{}` needs `{key}`", self.kind_name()));
            }
        }
        for url in [&self.url, &self.base_url].into_iter().flatten() {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(format!("`{url}` is not an http:// or https:// URL"));
            }
        }
        if self.retry.is_some() && self.retries.is_some() {
            return Err(
                "`retries` and `retry` both say how requests are tried again: keep `retry` \
                 (`retries = N` is `retry.attempts = N + 1`)"
                    .to_owned(),
            );
        }
        if let Some(retry) = &self.retry {
            if retry.attempts == 0 {
                return Err("`retry.attempts` is 0: it counts the first request too".to_owned());
            }
            if retry.deadline_ms > MAX_RETRY_DEADLINE_MS {
                return Err(format!(
                    "`retry.deadline-ms` ({}) is above a day ({MAX_RETRY_DEADLINE_MS})",
                    retry.deadline_ms
                ));
            }
            if retry.initial_ms > retry.max_ms {
                return Err(format!(
                    "`retry.initial-ms` ({}) is above `retry.max-ms` ({})",
                    retry.initial_ms, retry.max_ms
                ));
            }
        }
        Ok(())
    }

    pub fn kind_name(&self) -> &'static str {
        match self.kind {
            FunctionKind::Http => "http",
            FunctionKind::OpenaiChat => "openai-chat",
            FunctionKind::Time => "time",
            FunctionKind::Random => "random",
            FunctionKind::Mcp => "mcp",
            FunctionKind::Custom => "custom",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<AgentFile, ConfigError> {
        AgentFile::parse(Path::new("agent.toml"), text)
    }

    const MINIMAL: &str = r#"
name = "a"
[[actions]]
name = "x"
component = "x.wasm"
on = ["input"]
"#;

    #[test]
    fn minimal_agent_gets_documented_defaults() {
        let file = parse(MINIMAL).expect("valid");
        assert_eq!(file.config.parallelism, DEFAULT_PARALLELISM);
        assert_eq!(file.config.divergence, DivergencePolicy::Truncate);
        assert_eq!(file.config.limits, Limits::default());
    }

    #[test]
    fn unknown_key_is_named() {
        let err = parse(&format!("{MINIMAL}\n[limits]\nmemory-mb = 3\n")).expect_err("unknown");
        let message = err.to_string();
        assert!(message.contains("memory-mb"), "{message}");
        assert!(message.contains("agent.toml"), "{message}");
    }

    #[test]
    fn a_functions_retry_is_its_table_or_the_earlier_retries_and_bad_ones_are_named() {
        let http = "[functions.f]\nkind = \"http\"\nurl = \"http://127.0.0.1:1/\"\n";
        let retry_of = |extra: &str| {
            let file = parse(&format!("{MINIMAL}\n{http}{extra}")).expect("valid");
            let f = &file.config.functions["f"];
            FunctionRetryConfig::from_keys(f.retry, f.retries)
        };
        assert_eq!(retry_of(""), FunctionRetryConfig::default());
        assert_eq!(retry_of("retries = 5\n").attempts, 6);
        let retry = retry_of("retry = { attempts = 2, deadline-ms = 500 }\n");
        assert_eq!(
            (retry.attempts, retry.deadline_ms, retry.max_ms),
            (2, 500, 2_000)
        );
        for (extra, says) in [
            ("retries = 1\nretry = { attempts = 2 }\n", "both say"),
            ("retry = { attempts = 0 }\n", "`retry.attempts` is 0"),
            ("retry = { initial-ms = 5000 }\n", "above `retry.max-ms`"),
            ("retry = { deadline-ms = 90_000_000 }\n", "above a day"),
            ("retry = { tries = 3 }\n", "tries"),
        ] {
            let error = parse(&format!("{MINIMAL}\n{http}{extra}")).expect_err(extra);
            assert!(error.to_string().contains(says), "{extra}: {error}");
        }
    }

    #[test]
    fn function_key_of_another_kind_is_refused() {
        let err = parse(&format!(
            "{MINIMAL}\n[functions.f]\nkind = \"http\"\nurl = \"http://127.0.0.1:1/\"\nmodel = \"m\"\n"
        ))
        .expect_err("model is not for http");
        assert!(
            err.to_string()
                .contains("`model` does not apply to kind `http`"),
            "{err}"
        );
    }

    #[test]
    fn a_zero_state_setting_is_named() {
        for key in ["partitions", "keep-checkpoints", "refresh-batch"] {
            let err = parse(&format!("{MINIMAL}\n[state]\n{key} = 0\n")).expect_err("zero");
            assert!(
                err.to_string().contains("must be at least 1"),
                "{key}: {err}"
            );
        }
        let file = parse(&format!("{MINIMAL}\n[state]\nrefresh-batch = 16\n")).expect("valid");
        assert_eq!(file.config.state.refresh_batch, 16);
    }

    #[test]
    fn retry_settings_are_read_and_checked() {
        let file = parse(MINIMAL).expect("valid");
        assert_eq!(file.config.retry, RetryConfig::default());
        let file = parse(&format!(
            "{MINIMAL}\n[retry]\nattempts = 5\ninitial-ms = 10\nmax-ms = 20\n"
        ))
        .expect("valid");
        assert_eq!(
            file.config.retry,
            RetryConfig {
                attempts: 5,
                initial_ms: 10,
                max_ms: 20
            }
        );
        let err = parse(&format!("{MINIMAL}\n[retry]\nattempts = 0\n")).expect_err("zero");
        assert!(err.to_string().contains("`retry.attempts`"), "{err}");
        let err = parse(&format!(
            "{MINIMAL}\n[retry]\ninitial-ms = 10\nmax-ms = 5\n"
        ))
        .expect_err("max below initial");
        assert!(err.to_string().contains("`retry.max-ms` (5)"), "{err}");
        let err = parse(&format!("{MINIMAL}\n[retry]\ntries = 2\n")).expect_err("unknown");
        assert!(err.to_string().contains("tries"), "{err}");
    }

    #[test]
    fn unknown_function_kind_is_named() {
        let err = parse(&format!("{MINIMAL}\n[functions.f]\nkind = \"ftp\"\n")).expect_err("kind");
        assert!(err.to_string().contains("ftp"), "{err}");
    }

    #[test]
    fn grant_to_missing_action_is_refused() {
        let err = parse(&format!(
            "{MINIMAL}\n[functions.t]\nkind = \"time\"\nactions = [\"nope\"]\n"
        ))
        .expect_err("no such action");
        assert!(err.to_string().contains("`nope`"), "{err}");
    }
}
