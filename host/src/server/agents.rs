//! A tenant's agents. Each definition (an agent.toml) is a new version, kept on disk under
//! `agents/NAME/VERSION/` with the components it names pinned beside it, so that an input
//! accepted for a version runs on that version whatever is defined or uploaded after.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::config::TenantPolicy;
use super::quota::QuotaExceeded;
use super::states::{AgentState, StateError, States, Wanted};
use super::tenants::check_name;
use crate::agent::{Agent, AgentFile, Secrets, StateConfig};
use crate::durable::CallBudget;
use crate::private;
use crate::sandbox::Sandbox;
use crate::store::ActionStateStore;

/// Why a definition was refused.
#[derive(Debug, thiserror::Error)]
pub enum DefineError {
    /// Not a valid agent.toml, or one the server does not run.
    #[error("{0}")]
    Invalid(String),
    #[error(
        "action `{action}` names component `{component}`, which this tenant has not uploaded \
         (PUT /v1/tenants/{{tenant}}/components/{component})"
    )]
    UnknownComponent { action: String, component: String },
    #[error(transparent)]
    Quota(#[from] QuotaExceeded),
    /// The agent could not be built: a function's host or secret, a component.
    #[error("{0}")]
    Build(String),
    /// Its `[state]` is refused, or its agent's state could not be opened.
    #[error(transparent)]
    State(#[from] StateError),
    #[error("storing the definition: {0}")]
    Io(#[from] std::io::Error),
}

/// The versions of one agent; the newest takes new inputs.
#[derive(Debug, Default)]
pub struct Versions {
    pub versions: BTreeMap<u32, Version>,
}

/// One version of an agent, as the server holds it.
#[derive(Debug, Clone)]
pub enum Version {
    Loaded(Arc<Agent>),
    /// It could not be loaded at startup: why.
    Unloadable(String),
    /// Older than the `agent-versions-loaded` newest: built from disk when an input of it
    /// runs.
    LetGo,
}

impl Versions {
    pub fn current(&self) -> Option<u32> {
        self.versions.keys().next_back().copied()
    }

    /// Lets go of every loaded version but the newest `keep`.
    pub fn keep_newest(&mut self, keep: u32) {
        for version in self.versions.values_mut().rev().skip(keep.max(1) as usize) {
            if matches!(version, Version::Loaded(_)) {
                *version = Version::LetGo;
            }
        }
    }
}

/// What building a tenant's agents needs.
#[derive(Debug, Clone)]
pub struct Builder {
    pub tenant: String,
    pub sandbox: Arc<Sandbox>,
    pub states: Arc<States>,
    pub policy: TenantPolicy,
    pub budget: Arc<dyn CallBudget>,
}

const FILE: &str = "agent.toml";

/// A version built, with its agent's state, whose cache must be [ready](AgentState::ready)
/// before an input runs on it.
#[derive(Debug)]
pub struct Built {
    pub agent: Arc<Agent>,
    pub state: Arc<AgentState>,
    /// The version's `[state]`.
    pub config: StateConfig,
    /// Whether building it created its agent's state.
    created: bool,
}

/// A new version checked and built ([`Builder::prepare`]), not yet in place.
#[derive(Debug)]
pub struct Prepared {
    builder: Builder,
    pub name: String,
    pub version: u32,
    agent_dir: PathBuf,
    temp: PathBuf,
    pub built: Built,
}

impl Prepared {
    /// Puts the version in place, durably: from now on it is the agent's newest.
    pub fn commit(self) -> Result<(String, u32, Built), DefineError> {
        let dir = self.agent_dir.join(self.version.to_string());
        let placed = std::fs::File::open(&self.temp)
            .and_then(|temp| temp.sync_all())
            .and_then(|()| std::fs::rename(&self.temp, &dir));
        if let Err(error) = placed {
            self.abandon();
            return Err(error.into());
        }
        // In place: a restart loads it even when this last sync fails.
        std::fs::File::open(&self.agent_dir)?.sync_all()?;
        self.built.state.set_cadence(&self.built.config);
        Ok((self.name, self.version, self.built))
    }

    /// Drops the version: its directory goes, and the state it created, if it did.
    pub fn abandon(self) {
        let _ = std::fs::remove_dir_all(&self.temp);
        if self.built.created {
            self.builder.forget_state(&self.name, &self.built.state);
        }
    }
}

impl Builder {
    /// Builds the agent of `text`, whose components are in `components` by action name
    /// (`ACTION.wasm`). With `strict`, limits the file sets above a quota are refused;
    /// otherwise (loading a version defined earlier under other quotas) they are lowered.
    /// The agent's state is opened (created the first time); its cache is not rebuilt yet.
    fn build(&self, dir: &Path, text: &str, strict: bool) -> Result<Built, DefineError> {
        let mut file = AgentFile::parse(&dir.join(FILE), text)
            .map_err(|e| DefineError::Invalid(e.to_string()))?;
        check_actions(&file)?;
        let raw: toml::Table =
            toml::from_str(text).map_err(|e| DefineError::Invalid(e.to_string()))?;
        // A key agent.toml sets, by its path (limits it does not set are defaults).
        let raw = toml::Value::Table(raw);
        let given = |path: &[&str]| {
            strict
                && path
                    .iter()
                    .try_fold(&raw, |value, segment| value.get(segment))
                    .is_some()
        };
        let config = &mut file.config;
        self.policy.quotas.fit(config, &given)?;
        let wanted = Wanted {
            config: &config.state,
            partitions_given: raw.get("state").and_then(|s| s.get("partitions")).is_some(),
        };
        if strict {
            wanted.check()?;
        }
        let opened = self.states.of(&config.name, &wanted)?;
        let name = config.name.clone();
        let state_config = config.state;
        let built = (|| {
            if let Some(differs) = opened.differs {
                if strict {
                    return Err(DefineError::State(differs));
                }
                tracing::warn!(tenant = %self.tenant, agent = %name,
                    "{differs}: this version runs on the state as it is");
            }
            for action in &mut file.config.actions {
                action.component = PathBuf::from(format!("{}.wasm", action.name));
            }
            Agent::builder(file, Arc::clone(&self.sandbox))
                .tenant(&self.tenant)
                .store(Arc::clone(&opened.state.store) as Arc<dyn ActionStateStore>)
                .secrets(Secrets::Named {
                    tenant: self.tenant.clone(),
                    values: Arc::clone(&self.policy.secrets),
                })
                .allowed_hosts(self.policy.allowed_hosts.clone())
                .allowed_tools(self.policy.mcp_tools.clone())
                .call_budget(Arc::clone(&self.budget))
                .build()
                .map_err(|e| DefineError::Build(e.to_string()))
        })();
        match built {
            Ok(agent) => Ok(Built {
                agent: Arc::new(agent),
                state: opened.state,
                config: state_config,
                created: opened.created,
            }),
            Err(error) => {
                if opened.created {
                    self.forget_state(&name, &opened.state);
                }
                Err(error)
            }
        }
    }

    /// Takes back the state a definition of `agent` that failed created.
    fn forget_state(&self, agent: &str, state: &Arc<AgentState>) {
        if let Err(error) = self.states.forget(agent, state) {
            tracing::warn!(tenant = %self.tenant, agent,
                "taking back the state of a definition that failed: {error}");
        }
    }

    /// Checks and builds a new version of the agent in `text`, with the components it
    /// names pinned beside it, in a directory not yet in place: [`Prepared::commit`] puts
    /// it there once its state is ready. Callers define one agent of a tenant at a time.
    pub fn prepare(&self, tenant_dir: &Path, text: &str) -> Result<Prepared, DefineError> {
        let file = AgentFile::parse(Path::new(FILE), text)
            .map_err(|e| DefineError::Invalid(e.to_string()))?;
        let name = file.config.name.clone();
        check_name(&name).map_err(|_| {
            DefineError::Invalid(format!(
                "agent name {name:?} is not 1 to 63 characters of a-z, 0-9 and '-', starting \
                 with a letter or digit"
            ))
        })?;
        check_actions(&file)?;
        let agent_dir = tenant_dir.join("agents").join(&name);
        let version = versions_on_disk(&agent_dir)?.last().map_or(1, |v| v + 1);
        let temp = agent_dir.join(format!(".define-{:016x}", rand::random::<u64>()));
        private::create_dir(&temp)?;
        let built = (|| {
            for action in &file.config.actions {
                let component = action.component.to_string_lossy();
                let component = component.strip_suffix(".wasm").unwrap_or(&component);
                let source = tenant_dir
                    .join("components")
                    .join(format!("{component}.wasm"));
                if check_name(component).is_err() || !source.is_file() {
                    return Err(DefineError::UnknownComponent {
                        action: action.name.clone(),
                        component: component.to_owned(),
                    });
                }
                let pinned = temp.join(format!("{}.wasm", action.name));
                // Uploads replace a component by rename, so the linked file never changes.
                if std::fs::hard_link(&source, &pinned).is_err() {
                    std::fs::copy(&source, &pinned)?;
                }
            }
            private::write(&temp.join(FILE), text.as_bytes())?;
            self.build(&temp, text, true)
        })();
        match built {
            Ok(built) => Ok(Prepared {
                builder: self.clone(),
                name,
                version,
                agent_dir,
                temp,
                built,
            }),
            Err(error) => {
                let _ = std::fs::remove_dir_all(&temp);
                Err(error)
            }
        }
    }

    /// Loads every version of every agent under `tenant_dir/agents`.
    pub fn load_all(&self, tenant_dir: &Path) -> std::io::Result<BTreeMap<String, Versions>> {
        let mut agents = BTreeMap::new();
        let root = tenant_dir.join("agents");
        let entries = match std::fs::read_dir(&root) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(agents),
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = entry?;
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if name.starts_with('.') {
                continue;
            }
            let mut versions = Versions::default();
            let on_disk = versions_on_disk(&entry.path())?;
            let keep = self.policy.quotas.agent_versions_loaded.max(1) as usize;
            let first_kept = on_disk.len().saturating_sub(keep);
            for (at, version) in on_disk.into_iter().enumerate() {
                let loaded = if at < first_kept {
                    Version::LetGo
                } else {
                    match self.load(tenant_dir, &name, version) {
                        // Oldest first: the newest loaded version's cadence stays.
                        Ok(built) => {
                            built.state.set_cadence(&built.config);
                            Version::Loaded(built.agent)
                        }
                        Err(error) => {
                            tracing::error!(tenant = %self.tenant, agent = %name, version,
                                "this version cannot be loaded; its inputs fail: {error}");
                            Version::Unloadable(error)
                        }
                    }
                };
                versions.versions.insert(version, loaded);
            }
            agents.insert(name, versions);
        }
        Ok(agents)
    }
}

impl Builder {
    /// Builds version `version` of agent `agent` from its directory under `tenant_dir`. Its
    /// state's cache is not rebuilt yet: see [`AgentState::ready`].
    pub fn load(&self, tenant_dir: &Path, agent: &str, version: u32) -> Result<Built, String> {
        let dir = tenant_dir
            .join("agents")
            .join(agent)
            .join(version.to_string());
        std::fs::read_to_string(dir.join(FILE))
            .map_err(DefineError::Io)
            .and_then(|text| self.build(&dir, &text, false))
            .map_err(|e| format!("version {version} of agent {agent} cannot be loaded: {e}"))
    }
}

/// Action names become the file names of a version's pinned components: names, not paths.
fn check_actions(file: &AgentFile) -> Result<(), DefineError> {
    for action in &file.config.actions {
        check_name(&action.name).map_err(|_| {
            DefineError::Invalid(format!(
                "action name {:?} is not 1 to 63 characters of a-z, 0-9 and '-', starting \
                 with a letter or digit",
                action.name
            ))
        })?;
    }
    Ok(())
}

/// The agent.toml of a version, as it was posted.
pub fn definition(tenant_dir: &Path, agent: &str, version: u32) -> std::io::Result<String> {
    std::fs::read_to_string(
        tenant_dir
            .join("agents")
            .join(agent)
            .join(version.to_string())
            .join(FILE),
    )
}

/// The versions stored under `agent_dir`, in order.
fn versions_on_disk(agent_dir: &Path) -> std::io::Result<Vec<u32>> {
    let mut versions = Vec::new();
    match std::fs::read_dir(agent_dir) {
        Ok(entries) => {
            for entry in entries {
                if let Some(version) = entry?
                    .file_name()
                    .to_str()
                    .and_then(|n| n.parse::<u32>().ok())
                {
                    versions.push(version);
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    versions.sort_unstable();
    Ok(versions)
}
