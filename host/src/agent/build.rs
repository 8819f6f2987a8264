//! Loading an agent: its components into the sandbox, its functions from their config.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use super::config::{AgentFile, FunctionConfig, FunctionKind, FunctionRetryConfig};
use super::script::{Delivering, Script};
use super::{Action, Agent, DEFAULT_TENANT};
use crate::backoff::Backoff;
use crate::durable::{CallBudget, CallPolicy, InDoubtPolicy, SignalScript};
use crate::functions::{
    AllowedHosts, Clock, DEFAULT_MAX_RESPONSE_BYTES, Function, Functions, HttpConfig, HttpFunction,
    McpConfig, McpFunction, OpenAiChatConfig, OpenAiChatFunction, RandomFunction, RetryPolicy,
    SystemClock, TimeFunction,
};
use crate::sandbox::{self, Sandbox};
use crate::store::{ActionStateStore, InMemoryStore};

const DEFAULT_HTTP_TIMEOUT_MS: u64 = 10_000;
const DEFAULT_CHAT_TIMEOUT_MS: u64 = 60_000;

/// Why an agent could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("{agent}: action `{action}`: {error}")]
    Component {
        agent: String,
        action: String,
        error: sandbox::LoadError,
    },
    #[error("{agent}: function `{function}`: {message}")]
    Function {
        agent: String,
        function: String,
        message: String,
    },
    #[error("{agent}: {message}")]
    Limits { agent: String, message: String },
    #[error(
        "{agent}: the host registers a handler for `{function}`, which agent.toml does not \
         declare; declare it with kind = \"custom\" (and `actions` to say who may call it)"
    )]
    Undeclared { agent: String, function: String },
}

/// Where the secrets an agent.toml names (`secret-headers`, `api-key-env`) come from.
#[derive(Clone, Default)]
pub enum Secrets {
    /// The host's environment variables (`rewind run`).
    #[default]
    Environment,
    /// A tenant's own secrets, by name (`rewind serve`); nothing else is reachable.
    Named {
        tenant: String,
        values: Arc<BTreeMap<String, String>>,
    },
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Environment => f.write_str("Secrets::Environment"),
            Self::Named { tenant, values } => f
                .debug_struct("Secrets::Named")
                .field("tenant", tenant)
                .field("names", &values.keys().collect::<Vec<_>>())
                .finish(),
        }
    }
}

impl Secrets {
    /// The value of `name`, or what to tell the user. `what` says who asked for it.
    fn get(&self, name: &str, what: &str) -> Result<String, String> {
        match self {
            Self::Environment => std::env::var(name).map_err(|_| {
                format!("{what} reads environment variable `{name}`, which is not set")
            }),
            Self::Named { tenant, values } => values.get(name).cloned().ok_or_else(|| {
                format!(
                    "{what} names secret `{name}`, which tenant {tenant} does not have (the \
                     operator sets it in rewind.toml, [tenants.{tenant}.secrets])"
                )
            }),
        }
    }
}

/// Sets up an [`Agent`] from its file.
#[derive(Debug)]
pub struct AgentBuilder {
    file: AgentFile,
    sandbox: Arc<Sandbox>,
    tenant: String,
    store: Option<Arc<dyn ActionStateStore>>,
    custom: BTreeMap<String, Arc<dyn Function>>,
    clock: Arc<dyn Clock>,
    secrets: Secrets,
    allowed_hosts: Option<AllowedHosts>,
    /// The MCP tools a tenant's agents may call (`allow-mcp-tools`); `None`: any.
    allowed_tools: Option<BTreeSet<String>>,
    budget: Option<Arc<dyn CallBudget>>,
    script: Option<Script>,
}

impl AgentBuilder {
    pub(super) fn new(file: AgentFile, sandbox: Arc<Sandbox>) -> Self {
        Self {
            file,
            sandbox,
            tenant: DEFAULT_TENANT.to_owned(),
            store: None,
            custom: BTreeMap::new(),
            clock: Arc::new(SystemClock),
            secrets: Secrets::default(),
            allowed_hosts: None,
            allowed_tools: None,
            budget: None,
            script: None,
        }
    }

    /// Signals delivered as runs reach calls and waits: a test's script (`rewind test
    /// --signals`), read with the agent's declared signals ([`AgentConfig::signals`]).
    pub fn signal_script(mut self, script: Script) -> Self {
        self.script = Some(script);
        self
    }

    /// Where named secrets come from. Default: the environment.
    pub fn secrets(mut self, secrets: Secrets) -> Self {
        self.secrets = secrets;
        self
    }

    /// Only these hosts may be reached by the agent's functions: a function whose URL is
    /// elsewhere is an error at [`build`](Self::build), and a redirect elsewhere fails the
    /// call. Default: any host.
    /// Only these MCP tools may be called or listed (a tenant's `allow-mcp-tools`): an `mcp`
    /// function's `tools` must be among them, and one without `tools` gets them.
    pub fn allowed_tools(mut self, tools: Option<BTreeSet<String>>) -> Self {
        self.allowed_tools = tools;
        self
    }

    pub fn allowed_hosts(mut self, hosts: AllowedHosts) -> Self {
        self.allowed_hosts = Some(hosts);
        self
    }

    /// Live calls of every action take from `budget`; a call it refuses is denied.
    pub fn call_budget(mut self, budget: Arc<dyn CallBudget>) -> Self {
        self.budget = Some(budget);
        self
    }

    pub fn tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = tenant.into();
        self
    }

    /// The store calls are recorded in. Default: a new [`InMemoryStore`].
    pub fn store(mut self, store: Arc<dyn ActionStateStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// Provides the handler of a function declared in `agent.toml` with `kind = "custom"`.
    /// Functions are denied by default: a handler for a function the file does not declare
    /// is an error at [`build`](Self::build).
    pub fn function(mut self, name: impl Into<String>, handler: Arc<dyn Function>) -> Self {
        self.custom.insert(name.into(), handler);
        self
    }

    /// The clock behind `kind = "time"` functions.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Compiles (or takes from the cache) and checks every component, and sets up every
    /// function. Fails on the first thing that is wrong, naming it.
    pub fn build(mut self) -> Result<Agent, BuildError> {
        let config = &self.file.config;
        let agent = config.name.clone();
        if config.parallelism > self.sandbox.instances() as usize {
            return Err(BuildError::Limits {
                agent,
                message: format!(
                    "parallelism is {} but this host runs at most {} actions at once",
                    config.parallelism,
                    self.sandbox.instances()
                ),
            });
        }
        if config.limits.memory_mib > self.sandbox.max_memory_mib() {
            return Err(BuildError::Limits {
                agent,
                message: format!(
                    "limits.memory-mib is {} but this host allows at most {}",
                    config.limits.memory_mib,
                    self.sandbox.max_memory_mib()
                ),
            });
        }
        let mut actions = Vec::with_capacity(config.actions.len());
        for action in &config.actions {
            let path = self.file.component_path(action);
            let component =
                self.sandbox
                    .load_file(&path)
                    .map_err(|error| BuildError::Component {
                        agent: agent.clone(),
                        action: action.name.clone(),
                        error,
                    })?;
            actions.push(Action {
                name: action.name.clone(),
                on: action.on.clone(),
                component,
            });
        }

        let mut functions = Functions::new();
        let mut divergence_by_function = BTreeMap::new();
        let mut in_doubt_by_function = BTreeMap::new();
        for (name, function) in &config.functions {
            let fail = |message: String| BuildError::Function {
                agent: agent.clone(),
                function: name.clone(),
                message,
            };
            let handler: Arc<dyn Function> = match function.kind {
                FunctionKind::Custom => self.custom.remove(name).ok_or_else(|| {
                    fail(
                        "declared with kind \"custom\" but this host registers no handler for it"
                            .to_owned(),
                    )
                })?,
                _ => build_function(
                    function,
                    &self.clock,
                    &self.secrets,
                    (self.allowed_hosts.as_ref(), self.allowed_tools.as_ref()),
                )
                .map_err(fail)?,
            };
            let in_doubt = function.in_doubt.unwrap_or_default();
            if in_doubt == InDoubtPolicy::Reconcile && !handler.can_reconcile() {
                return Err(fail(format!(
                    "in-doubt = \"reconcile\" needs a reconcile handler, and kind `{}` has none{}",
                    function.kind_name(),
                    if function.kind == FunctionKind::Http {
                        ": set `reconcile-url`"
                    } else {
                        ""
                    }
                )));
            }
            functions.register(name.clone(), handler, function.actions.clone());
            if let Some(policy) = function.divergence {
                divergence_by_function.insert(name.clone(), policy);
            }
            if in_doubt != InDoubtPolicy::default() {
                in_doubt_by_function.insert(name.clone(), in_doubt);
            }
        }
        if let Some(function) = self.custom.keys().next() {
            return Err(BuildError::Undeclared {
                agent,
                function: function.clone(),
            });
        }
        let store = (self.store).unwrap_or_else(|| Arc::new(InMemoryStore::default()));
        Ok(Agent {
            tenant: self.tenant,
            name: agent,
            actions,
            functions: Arc::new(functions),
            policy: Arc::new(CallPolicy {
                divergence: config.divergence,
                divergence_by_function,
                in_doubt_by_function,
                calls_per_run: config.limits.calls_per_run,
                clock_readings_per_run: config.limits.clock_readings_per_run,
                budget: self.budget,
                signals: config
                    .actions
                    .iter()
                    .filter(|action| !action.signals.is_empty())
                    .map(|action| (action.name.clone(), action.signals.clone()))
                    .collect(),
                clock: Some(Arc::clone(&self.clock)),
                script: self.script.map(|script| {
                    let store = Arc::clone(&store);
                    Arc::new(Delivering { script, store }) as Arc<dyn SignalScript>
                }),
            }),
            limits: config.limits,
            unhandled_events: config.unhandled_events,
            parallelism: config.parallelism,
            retry: config.retry,
            sandbox: self.sandbox,
            store,
        })
    }
}

fn build_function(
    config: &FunctionConfig,
    clock: &Arc<dyn Clock>,
    secrets: &Secrets,
    (allowed_hosts, allowed_tools): (Option<&AllowedHosts>, Option<&BTreeSet<String>>),
) -> Result<Arc<dyn Function>, String> {
    if let Some(hosts) = allowed_hosts {
        for url in [&config.url, &config.base_url, &config.reconcile_url]
            .into_iter()
            .flatten()
        {
            hosts.check(url)?;
        }
    }
    let http = |url: String, default_timeout: u64| -> Result<HttpConfig, String> {
        let mut headers: Vec<(String, String)> = config
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (header, name) in &config.secret_headers {
            let value = secrets.get(name, &format!("secret header `{header}`"))?;
            headers.push((header.clone(), value));
        }
        let retry = FunctionRetryConfig::from_keys(config.retry, config.retries);
        let retry = RetryPolicy {
            attempts: retry.attempts,
            backoff: Backoff::from_millis(retry.initial_ms, retry.max_ms),
            deadline: Duration::from_millis(retry.deadline_ms),
        };
        Ok(HttpConfig {
            url,
            timeout: Duration::from_millis(config.timeout_ms.unwrap_or(default_timeout)),
            retry,
            headers,
            reconcile_url: config.reconcile_url.clone(),
            allowed_hosts: allowed_hosts.cloned(),
            max_response_bytes: config
                .max_response_bytes
                .map_or(DEFAULT_MAX_RESPONSE_BYTES, |bytes| {
                    usize::try_from(bytes).unwrap_or(usize::MAX)
                }),
        })
    };
    Ok(match config.kind {
        FunctionKind::Http => {
            let url = config.url.clone().unwrap_or_default();
            Arc::new(HttpFunction::new(http(url, DEFAULT_HTTP_TIMEOUT_MS)?))
        }
        FunctionKind::OpenaiChat => {
            let mut http = http(String::new(), DEFAULT_CHAT_TIMEOUT_MS)?;
            if let Some(name) = &config.api_key_env {
                let key = secrets.get(name, "`api-key-env`")?;
                http.headers
                    .push(("authorization".to_owned(), format!("Bearer {key}")));
            }
            Arc::new(OpenAiChatFunction::new(OpenAiChatConfig {
                base_url: config.base_url.clone().unwrap_or_default(),
                model: config.model.clone().unwrap_or_default(),
                http,
            }))
        }
        FunctionKind::Mcp => {
            let url = config.url.clone().unwrap_or_default();
            let tools = match (&config.tools, allowed_tools) {
                (Some(tools), Some(allowed)) => {
                    if let Some(tool) = tools.iter().find(|tool| !allowed.contains(*tool)) {
                        return Err(format!(
                            "tool `{tool}` is not among the MCP tools this tenant may call \
                             ({})",
                            allowed.iter().cloned().collect::<Vec<_>>().join(", ")
                        ));
                    }
                    Some(tools.iter().cloned().collect())
                }
                (Some(tools), None) => Some(tools.iter().cloned().collect()),
                (None, allowed) => allowed.cloned(),
            };
            Arc::new(McpFunction::new(McpConfig {
                http: http(url, DEFAULT_HTTP_TIMEOUT_MS)?,
                tools,
            }))
        }
        FunctionKind::Time => Arc::new(TimeFunction::new(Arc::clone(clock))),
        FunctionKind::Random => Arc::new(RandomFunction::new(
            crate::durable::seeded().map(|s| s.seed),
        )),
        FunctionKind::Custom => {
            return Err("kind \"custom\" needs a handler from the embedding program".to_owned());
        }
    })
}
