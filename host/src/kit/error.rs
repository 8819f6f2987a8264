//! Why the kit could not test an agent: each kind with what it was doing and its cause.

use crate::agent::ConfigError;
use crate::agent::script::ScriptError;
use crate::state_dir::StateDirError;

#[derive(Debug, thiserror::Error)]
pub enum KitError {
    /// A file or directory of the kit's work, or a `rewind run` it starts.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// The agent.toml under test is not an agent.
    #[error(transparent)]
    Agent(#[from] ConfigError),
    #[error(transparent)]
    StateDir(#[from] StateDirError),
    /// The script of signals (`--signals`) is not one.
    #[error(transparent)]
    Script(#[from] ScriptError),
    #[error("{what}: {source}")]
    Toml {
        what: String,
        #[source]
        source: toml::de::Error,
    },
    /// A file of scripted answers, or what a run wrote for the kit, is not what it reads.
    #[error("{what}: {source}")]
    Json {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    /// What cannot be tested as it is: an agent.toml the kit cannot point at its
    /// simulator, an uninterrupted run that failed.
    #[error("{0}")]
    Cannot(String),
}

impl KitError {
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |source| Self::Io { what, source }
    }

    pub(crate) fn json(what: impl Into<String>) -> impl FnOnce(serde_json::Error) -> Self {
        let what = what.into();
        move |source| Self::Json { what, source }
    }
}
