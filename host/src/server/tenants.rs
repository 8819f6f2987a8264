//! The tenants and their tokens, kept in `tenants.json` under the state directory. Only a
//! token's SHA-256 is stored; a token is shown once, when it is issued. Each token has an id
//! that names it (to list or revoke it) without being it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use rand::RngCore as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::private;
use crate::version::{self, FormatError};

/// Why the registry refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum TenantError {
    #[error(
        "tenant name {0:?} is not 1 to 63 characters of a-z, 0-9 and '-', starting with a letter or digit"
    )]
    BadName(String),
    #[error("tenant {0} already exists")]
    Exists(String),
    #[error("no tenant {0}")]
    Missing(String),
    #[error("tenant {tenant} has no token {id}")]
    NoToken { tenant: String, id: String },
    #[error("{path}: {message}")]
    Unreadable { path: String, message: String },
    /// Not JSON of a registry, or of a newer format than this build reads.
    #[error(transparent)]
    Format(Box<FormatError>),
    #[error("writing {path}: {error}")]
    Write { path: String, error: std::io::Error },
}

/// The format of `tenants.json` this build writes, and the newest it reads; files written
/// before formats were named are format 1.
const FORMAT: u32 = 1;

/// The file's contents.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default = "first_format")]
    format: u32,
    /// Tenant name to its tokens.
    tenants: BTreeMap<String, Vec<StoredToken>>,
}

impl Default for File {
    fn default() -> Self {
        Self {
            format: FORMAT,
            tenants: BTreeMap::new(),
        }
    }
}

fn first_format() -> u32 {
    version::FIRST
}

/// A token as the registry keeps it.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(from = "TokenForm")]
struct StoredToken {
    id: String,
    /// SHA-256 of the token, hex.
    sha256: String,
    /// When it was issued, in milliseconds since the Unix epoch (0: before ids were kept).
    created_ms: u64,
    /// When it was last used, to the minute (see [`LAST_USED_EVERY_MS`]).
    last_used_ms: Option<u64>,
}

/// What a token in the file may look like: a bare hash, as registries written before tokens
/// had ids kept them (its id is then made from the hash, the same at every start until the
/// file is written again), or a whole entry.
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenForm {
    Hash(String),
    Token {
        id: String,
        sha256: String,
        created_ms: u64,
        #[serde(default)]
        last_used_ms: Option<u64>,
    },
}

impl From<TokenForm> for StoredToken {
    fn from(form: TokenForm) -> Self {
        match form {
            TokenForm::Hash(sha256) => Self {
                id: format!("tok_{}", sha256.get(..16).unwrap_or(&sha256)),
                sha256,
                created_ms: 0,
                last_used_ms: None,
            },
            TokenForm::Token {
                id,
                sha256,
                created_ms,
                last_used_ms,
            } => Self {
                id,
                sha256,
                created_ms,
                last_used_ms,
            },
        }
    }
}

/// A token's last use is written when it is this much newer than the one written before:
/// a request does not cost a write of the registry.
pub const LAST_USED_EVERY_MS: u64 = 60_000;

/// A token as it is listed: never the token itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenInfo {
    pub id: String,
    /// Milliseconds since the Unix epoch; 0 for a token issued before ids were kept.
    pub created_ms: u64,
    /// Milliseconds since the Unix epoch, to the minute; `None` when never used.
    pub last_used_ms: Option<u64>,
}

/// A token just issued: the only time it is shown.
#[derive(Clone, Debug)]
pub struct Issued {
    pub id: String,
    pub token: String,
}

/// The tenant registry.
#[derive(Debug)]
pub struct Tenants {
    path: PathBuf,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    file: File,
    /// Token hash to its tenant and id.
    by_token: BTreeMap<[u8; 32], (String, String)>,
}

impl Tenants {
    /// Opens the registry under `state_dir`, creating the directory when missing.
    pub fn open(state_dir: &Path) -> Result<Self, TenantError> {
        let path = state_dir.join("tenants.json");
        let unreadable = |message: String| TenantError::Unreadable {
            path: path.display().to_string(),
            message,
        };
        let mut file: File = match std::fs::read(&path) {
            Ok(bytes) => version::decode(&bytes, FORMAT, &path.display().to_string())
                .map_err(|e| TenantError::Format(Box::new(e)))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => File::default(),
            Err(e) => return Err(unreadable(e.to_string())),
        };
        // Written back in this build's format.
        file.format = FORMAT;
        let mut by_token = BTreeMap::new();
        for (tenant, tokens) in &file.tenants {
            for token in tokens {
                let mut bytes = [0u8; 32];
                hex::decode_to_slice(&token.sha256, &mut bytes).map_err(|e| {
                    unreadable(format!("token {} of tenant {tenant}: {e}", token.id))
                })?;
                by_token.insert(bytes, (tenant.clone(), token.id.clone()));
            }
        }
        Ok(Self {
            path,
            inner: Mutex::new(Inner { file, by_token }),
        })
    }

    /// Creates `name` and issues its first token.
    pub fn create(&self, name: &str) -> Result<Issued, TenantError> {
        check_name(name)?;
        let mut inner = self.lock();
        if inner.file.tenants.contains_key(name) {
            return Err(TenantError::Exists(name.to_owned()));
        }
        inner.file.tenants.insert(name.to_owned(), Vec::new());
        let issued = self.issue_locked(&mut inner, name);
        if issued.is_err() {
            inner.file.tenants.remove(name);
        }
        issued
    }

    /// Issues another token for `name`.
    pub fn issue(&self, name: &str) -> Result<Issued, TenantError> {
        let mut inner = self.lock();
        if !inner.file.tenants.contains_key(name) {
            return Err(TenantError::Missing(name.to_owned()));
        }
        self.issue_locked(&mut inner, name)
    }

    /// The tenant a token belongs to and the token's id, `None` for a token never issued or
    /// revoked. Notes the
    /// use (written at most once a minute per token; a failure to write it only warns).
    pub fn authenticate(&self, token: &str) -> Option<(String, String)> {
        let mut inner = self.lock();
        let (tenant, id) = inner.by_token.get(&hash(token)).cloned()?;
        let now = now_ms();
        let stored = inner
            .file
            .tenants
            .get_mut(&tenant)
            .and_then(|tokens| tokens.iter_mut().find(|t| t.id == id));
        if let Some(stored) = stored
            && stored
                .last_used_ms
                .is_none_or(|last| now.saturating_sub(last) >= LAST_USED_EVERY_MS)
        {
            stored.last_used_ms = Some(now - now % LAST_USED_EVERY_MS);
            if let Err(error) = self.save(&inner.file) {
                tracing::warn!("noting when token {id} of tenant {tenant} was used: {error}");
            }
        }
        Some((tenant, id))
    }

    /// The tokens of `name`, in the order they were issued.
    pub fn tokens(&self, name: &str) -> Result<Vec<TokenInfo>, TenantError> {
        let inner = self.lock();
        let tokens = inner
            .file
            .tenants
            .get(name)
            .ok_or_else(|| TenantError::Missing(name.to_owned()))?;
        Ok(tokens
            .iter()
            .map(|t| TokenInfo {
                id: t.id.clone(),
                created_ms: t.created_ms,
                last_used_ms: t.last_used_ms,
            })
            .collect())
    }

    /// Revokes token `id` of `name`: from now on, and after a restart, it is refused. The
    /// change is durable before this returns.
    pub fn revoke(&self, name: &str, id: &str) -> Result<(), TenantError> {
        let mut inner = self.lock();
        let tokens = inner
            .file
            .tenants
            .get_mut(name)
            .ok_or_else(|| TenantError::Missing(name.to_owned()))?;
        let at = tokens
            .iter()
            .position(|t| t.id == id)
            .ok_or_else(|| TenantError::NoToken {
                tenant: name.to_owned(),
                id: id.to_owned(),
            })?;
        let revoked = tokens.remove(at);
        if let Err(error) = self.save(&inner.file) {
            // Not durable, so not revoked.
            if let Some(tokens) = inner.file.tenants.get_mut(name) {
                tokens.insert(at, revoked);
            }
            return Err(error);
        }
        inner
            .by_token
            .retain(|_, (tenant, token)| !(tenant == name && token == id));
        Ok(())
    }

    /// Every tenant, in order.
    pub fn names(&self) -> Vec<String> {
        self.lock().file.tenants.keys().cloned().collect()
    }

    pub fn exists(&self, name: &str) -> bool {
        self.lock().file.tenants.contains_key(name)
    }

    fn issue_locked(&self, inner: &mut Inner, name: &str) -> Result<Issued, TenantError> {
        let mut secret = [0u8; 32];
        rand::rng().fill_bytes(&mut secret);
        let token = format!("rwt_{}", hex::encode(secret));
        let mut id = [0u8; 8];
        rand::rng().fill_bytes(&mut id);
        let id = format!("tok_{}", hex::encode(id));
        let hashed = hash(&token);
        inner
            .file
            .tenants
            .entry(name.to_owned())
            .or_default()
            .push(StoredToken {
                id: id.clone(),
                sha256: hex::encode(hashed),
                created_ms: now_ms(),
                last_used_ms: None,
            });
        if let Err(error) = self.save(&inner.file) {
            // Not durable, so not issued.
            if let Some(tokens) = inner.file.tenants.get_mut(name) {
                tokens.pop();
            }
            return Err(error);
        }
        inner.by_token.insert(hashed, (name.to_owned(), id.clone()));
        Ok(Issued { id, token })
    }

    /// Writes the registry whole, readable by this user only.
    fn save(&self, file: &File) -> Result<(), TenantError> {
        let error = |error| TenantError::Write {
            path: self.path.display().to_string(),
            error,
        };
        let bytes = serde_json::to_vec_pretty(file).map_err(|e| error(std::io::Error::other(e)))?;
        private::write(&self.path, &bytes).map_err(error)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// SHA-256 of a token.
pub(super) fn hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// A tenant name is a namespace on disk and in URLs: `[a-z0-9][a-z0-9-]{0,62}`; so is a
/// component's name.
pub(super) fn check_name(name: &str) -> Result<(), TenantError> {
    let ok = (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(TenantError::BadName(name.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_registry_names_its_format_and_a_newer_one_is_refused_saying_so() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tenants = Tenants::open(dir.path()).expect("opens");
        tenants.create("acme").expect("created");
        let path = dir.path().join("tenants.json");
        let text = std::fs::read_to_string(&path).expect("read");
        let json: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(json["format"], 1, "{text}");
        std::fs::write(&path, text.replacen("\"format\": 1", "\"format\": 2", 1)).expect("write");
        let error = Tenants::open(dir.path()).expect_err("too new").to_string();
        assert!(
            error.contains("tenants.json is format 2, and this build reads format 1 and older"),
            "{error}"
        );
    }

    #[test]
    fn tokens_survive_a_reopen_and_only_their_hashes_are_stored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tenants = Tenants::open(dir.path()).expect("opens");
        let token = tenants.create("acme").expect("created").token;
        let second = tenants.issue("acme").expect("issued").token;
        assert_ne!(token, second);
        assert!(matches!(
            tenants.create("acme"),
            Err(TenantError::Exists(_))
        ));
        assert!(matches!(
            tenants.issue("nope"),
            Err(TenantError::Missing(_))
        ));

        let stored = std::fs::read_to_string(dir.path().join("tenants.json")).expect("file");
        assert!(!stored.contains(&token) && !stored.contains(&token[4..]));
        let reopened = Tenants::open(dir.path()).expect("reopens");
        assert_eq!(
            reopened.authenticate(&token).map(|t| t.0).as_deref(),
            Some("acme")
        );
        assert_eq!(
            reopened.authenticate(&second).map(|t| t.0).as_deref(),
            Some("acme")
        );
        assert_eq!(reopened.authenticate("rwt_guess"), None);
    }

    #[test]
    fn a_revoked_token_is_refused_at_once_and_after_a_reopen_and_the_others_stay() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tenants = Tenants::open(dir.path()).expect("opens");
        let first = tenants.create("acme").expect("created");
        let second = tenants.issue("acme").expect("issued");
        assert_eq!(
            tenants.authenticate(&first.token).map(|t| t.0).as_deref(),
            Some("acme")
        );
        let listed = tenants.tokens("acme").expect("listed");
        assert_eq!(
            listed.iter().map(|t| t.id.as_str()).collect::<Vec<_>>(),
            [first.id.as_str(), second.id.as_str()]
        );
        assert!(listed[0].last_used_ms.is_some() && listed[1].last_used_ms.is_none());
        assert!(listed[0].created_ms > 0);
        let kept = Tenants::open(dir.path()).expect("reopens").tokens("acme");
        assert_eq!(kept.expect("listed"), listed, "a use is kept");

        tenants.revoke("acme", &first.id).expect("revoked");
        assert_eq!(tenants.authenticate(&first.token), None);
        assert!(matches!(
            tenants.revoke("acme", &first.id),
            Err(TenantError::NoToken { .. })
        ));
        let reopened = Tenants::open(dir.path()).expect("reopens");
        assert_eq!(reopened.authenticate(&first.token), None);
        assert_eq!(
            reopened.authenticate(&second.token).map(|t| t.0).as_deref(),
            Some("acme")
        );
    }

    #[test]
    fn a_registry_written_before_tokens_had_ids_is_read_with_ids_made_from_the_hashes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let token = "rwt_an-old-token";
        let sha256 = hex::encode(hash(token));
        std::fs::write(
            dir.path().join("tenants.json"),
            format!("{{\"tenants\": {{\"acme\": [\"{sha256}\"]}}}}"),
        )
        .expect("write");
        let tenants = Tenants::open(dir.path()).expect("opens");
        assert_eq!(
            tenants.authenticate(token).map(|t| t.0).as_deref(),
            Some("acme")
        );
        let id = format!("tok_{}", &sha256[..16]);
        assert_eq!(tenants.tokens("acme").expect("listed")[0].id, id);
        tenants.revoke("acme", &id).expect("revoked by that id");
        assert_eq!(
            Tenants::open(dir.path())
                .expect("reopens")
                .authenticate(token),
            None
        );
    }

    #[test]
    fn names_are_checked() {
        for bad in ["", "Acme", "-x", "a/b", "a b", &"x".repeat(64)] {
            assert!(
                matches!(check_name(bad), Err(TenantError::BadName(_))),
                "{bad:?}"
            );
        }
        for good in ["a", "acme-2", &"x".repeat(63)] {
            assert!(check_name(good).is_ok(), "{good:?}");
        }
    }
}
