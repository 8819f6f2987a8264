//! `rewind.toml`: where the server listens, where it keeps its state, where its admin token
//! comes from. Kebab-case keys; an unknown key is an error that names it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use super::quota::Quotas;
use super::tenants::check_name;
use crate::functions::AllowedHosts;

/// The server's configuration.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ServerConfig {
    /// Default 127.0.0.1:7070.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Every tenant's state, each in its own namespace. Relative to the config file.
    /// Default `rewind-state` beside it.
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
    /// The largest component a tenant may upload, in MiB. Default 64.
    #[serde(default = "default_max_component_mib")]
    pub max_component_mib: u32,
    /// Component uploads compiled at once, every tenant's together. Default: half the
    /// cores, at least 1.
    #[serde(default = "default_compile_slots")]
    pub compile_slots: usize,
    /// Uploads that may wait for a compile slot; past them an upload gets 503 with
    /// `Retry-After`. Default 8.
    #[serde(default = "default_compile_queue")]
    pub compile_queue: usize,
    /// How long a shutdown waits for inputs in flight before it exits (they resume at the
    /// next start), in milliseconds. Default 10,000.
    #[serde(default = "default_shutdown_grace_ms")]
    pub shutdown_grace_ms: u64,
    /// Serve over TLS. Required to listen on an address other than loopback, unless
    /// `allow-plaintext`.
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// Serve plain HTTP on an address other machines reach: only behind a proxy that
    /// terminates TLS. Default false.
    #[serde(default)]
    pub allow_plaintext: bool,
    pub admin_token: AdminToken,
    /// Every tenant's quotas ([`Quotas`], as written), unless its own section overrides
    /// them.
    #[serde(default)]
    pub quotas: toml::Table,
    /// What the operator grants each tenant, by name; a tenant not named here gets the
    /// default quotas, no hosts and no secrets.
    #[serde(default)]
    pub tenants: BTreeMap<String, TenantConfig>,
}

/// `[tls]`: the certificate chain and its private key, PEM files, relative to the config
/// file.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// `[tenants.NAME]`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct TenantConfig {
    /// Hosts the tenant's functions may reach: `host` (any port) or `host:port`.
    #[serde(default)]
    pub allow_hosts: Vec<String>,
    /// The MCP tools the tenant's agents may call and list, by name; any when absent.
    #[serde(default)]
    pub allow_mcp_tools: Option<Vec<String>>,
    /// Secrets the tenant's agent.toml may name (in `secret-headers` and `api-key-env`);
    /// their values stay in the host.
    #[serde(default)]
    pub secrets: BTreeMap<String, SecretSource>,
    /// Any of [`Quotas`], over `[quotas]`.
    #[serde(default)]
    pub quotas: toml::Table,
}

/// Where a secret's value is read from: exactly one of the two.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct SecretSource {
    pub env: Option<String>,
    /// Relative to the config file; trailing whitespace ignored.
    pub file: Option<PathBuf>,
}

/// What one tenant is granted, resolved at startup.
#[derive(Clone, Debug)]
pub struct TenantPolicy {
    pub quotas: Quotas,
    pub allowed_hosts: AllowedHosts,
    /// `allow-mcp-tools`: the MCP tools its agents may call; `None`: any.
    pub mcp_tools: Option<std::collections::BTreeSet<String>>,
    pub secrets: Arc<BTreeMap<String, String>>,
}

/// Where the admin token is read from: exactly one of the two.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct AdminToken {
    /// The environment variable that holds it.
    pub env: Option<String>,
    /// A file that holds it (trailing whitespace ignored). Relative to the config file.
    pub file: Option<PathBuf>,
}

/// The quotas of `[quotas]` with a tenant's `over` them.
fn quotas_of(base: &toml::Table, over: &toml::Table) -> Result<Quotas, String> {
    let mut merged = base.clone();
    merged.extend(over.clone());
    toml::Value::Table(merged)
        .try_into()
        .map_err(|e: toml::de::Error| e.message().to_owned())
}

/// The shortest admin token accepted.
pub const MIN_ADMIN_TOKEN: usize = 16;

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 7070))
}

fn default_shutdown_grace_ms() -> u64 {
    10_000
}

fn default_compile_slots() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
}

fn default_compile_queue() -> usize {
    8
}

fn default_max_component_mib() -> u32 {
    64
}

fn default_state_dir() -> PathBuf {
    PathBuf::from("rewind-state")
}

/// Why the configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
    #[error("{path}: the admin token: {message}")]
    AdminToken { path: String, message: String },
}

impl ServerConfig {
    /// Reads `path`; relative paths in it are made relative to its directory.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
            path: path.display().to_string(),
            error,
        })?;
        Self::parse(path, &text)
    }

    /// Parses `text`, read from `path`.
    pub fn parse(path: &Path, text: &str) -> Result<Self, ConfigError> {
        let mut config: Self = toml::from_str(text).map_err(|e| ConfigError::Invalid {
            path: path.display().to_string(),
            message: e.message().to_owned()
                + &e.span()
                    .map(|span| format!(" (at byte {})", span.start))
                    .unwrap_or_default(),
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        config.state_dir = base.join(&config.state_dir);
        if let Some(file) = &mut config.admin_token.file {
            *file = base.join(&*file);
        }
        if let Some(tls) = &mut config.tls {
            tls.cert = base.join(&tls.cert);
            tls.key = base.join(&tls.key);
        }
        let invalid = |message: String| ConfigError::Invalid {
            path: path.display().to_string(),
            message,
        };
        if !config.listen.ip().is_loopback() && config.tls.is_none() && !config.allow_plaintext {
            return Err(invalid(format!(
                "listen = \"{}\" is reachable from other machines, and tokens would cross the \
                 network in plain text: set [tls] cert and key (PEM files), or \
                 allow-plaintext = true when a proxy in front terminates TLS",
                config.listen
            )));
        }
        quotas_of(&config.quotas, &toml::Table::new())
            .map_err(|e| invalid(format!("[quotas]: {e}")))?;
        for (tenant, section) in &mut config.tenants {
            check_name(tenant).map_err(|e| invalid(format!("[tenants.{tenant}]: {e}")))?;
            quotas_of(&config.quotas, &section.quotas)
                .map_err(|e| invalid(format!("[tenants.{tenant}.quotas]: {e}")))?;
            AllowedHosts::new(&section.allow_hosts)
                .map_err(|e| invalid(format!("[tenants.{tenant}] allow-hosts: {e}")))?;
            for (name, secret) in &mut section.secrets {
                if let Some(file) = &mut secret.file {
                    *file = base.join(&*file);
                }
                if secret.env.is_some() == secret.file.is_some() {
                    return Err(invalid(format!(
                        "[tenants.{tenant}.secrets] {name}: set exactly one of `env` and `file`"
                    )));
                }
            }
        }
        match (&config.admin_token.env, &config.admin_token.file) {
            (Some(_), None) | (None, Some(_)) => Ok(config),
            _ => Err(ConfigError::AdminToken {
                path: path.display().to_string(),
                message: "set exactly one of `env` and `file` in [admin-token]".to_owned(),
            }),
        }
    }

    /// What `tenant` is granted: its quotas, allowed hosts and secrets (read now: a secret
    /// that cannot be read is an error naming it).
    pub fn tenant_policy(
        &self,
        config_path: &Path,
        tenant: &str,
    ) -> Result<TenantPolicy, ConfigError> {
        let section = self.tenants.get(tenant).cloned().unwrap_or_default();
        let error = |message: String| ConfigError::Invalid {
            path: config_path.display().to_string(),
            message: format!("[tenants.{tenant}]: {message}"),
        };
        let mut secrets = BTreeMap::new();
        for (name, source) in &section.secrets {
            let value = match (&source.env, &source.file) {
                (Some(var), _) => std::env::var(var).map_err(|_| {
                    error(format!(
                        "secret {name}: the environment variable {var} is not set"
                    ))
                })?,
                (None, Some(file)) => std::fs::read_to_string(file)
                    .map_err(|e| {
                        error(format!(
                            "secret {name}: cannot read {}: {e}",
                            file.display()
                        ))
                    })?
                    .trim_end()
                    .to_owned(),
                (None, None) => return Err(error(format!("secret {name}: no source"))),
            };
            secrets.insert(name.clone(), value);
        }
        Ok(TenantPolicy {
            quotas: quotas_of(&self.quotas, &section.quotas).map_err(error)?,
            allowed_hosts: AllowedHosts::new(&section.allow_hosts).map_err(error)?,
            mcp_tools: (section.allow_mcp_tools.clone()).map(|tools| tools.into_iter().collect()),
            secrets: Arc::new(secrets),
        })
    }

    /// The admin token, from the environment or its file; refused when shorter than
    /// [`MIN_ADMIN_TOKEN`] characters.
    pub fn admin_token(&self, config_path: &Path) -> Result<String, ConfigError> {
        let error = |message: String| ConfigError::AdminToken {
            path: config_path.display().to_string(),
            message,
        };
        let token = match (&self.admin_token.env, &self.admin_token.file) {
            (Some(var), _) => std::env::var(var)
                .map_err(|_| error(format!("the environment variable {var} is not set")))?,
            (None, Some(file)) => std::fs::read_to_string(file)
                .map_err(|e| error(format!("cannot read {}: {e}", file.display())))?,
            (None, None) => return Err(error("no source".to_owned())),
        };
        let token = token.trim_end().to_owned();
        if token.chars().count() < MIN_ADMIN_TOKEN {
            return Err(error(format!(
                "it is {} characters; use at least {MIN_ADMIN_TOKEN}",
                token.chars().count()
            )));
        }
        Ok(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_relative_paths() {
        let config = ServerConfig::parse(
            Path::new("/etc/rewind/rewind.toml"),
            "[admin-token]\nfile = \"admin.token\"\n",
        )
        .expect("parses");
        assert_eq!(config.listen, default_listen());
        assert_eq!(config.state_dir, Path::new("/etc/rewind/rewind-state"));
        assert_eq!(
            config.admin_token.file.as_deref(),
            Some(Path::new("/etc/rewind/admin.token"))
        );
    }

    #[test]
    fn an_unknown_key_is_named() {
        let error = ServerConfig::parse(
            Path::new("rewind.toml"),
            "listne = \"127.0.0.1:1\"\n[admin-token]\nenv = \"T\"\n",
        )
        .expect_err("unknown key")
        .to_string();
        assert!(
            error.contains("listne") && error.contains("rewind.toml"),
            "{error}"
        );
    }

    #[test]
    fn the_admin_token_has_exactly_one_source_and_a_length() {
        let both = "[admin-token]\nenv = \"T\"\nfile = \"t\"\n";
        let error = ServerConfig::parse(Path::new("r.toml"), both).expect_err("two sources");
        assert!(error.to_string().contains("exactly one"), "{error}");

        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("admin.token");
        std::fs::write(&file, "short\n").expect("write");
        let path = dir.path().join("rewind.toml");
        let config =
            ServerConfig::parse(&path, "[admin-token]\nfile = \"admin.token\"\n").expect("parses");
        let error = config
            .admin_token(&path)
            .expect_err("too short")
            .to_string();
        assert!(error.contains("5 characters"), "{error}");
        std::fs::write(&file, "a-long-enough-admin-token\n").expect("write");
        assert_eq!(
            config.admin_token(&path).expect("read"),
            "a-long-enough-admin-token"
        );
    }
}
