//! The tenants and their tokens, kept in `tenants.json` under the state directory. Only a
//! token's SHA-256 is stored; a token is shown once, when it is issued.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use rand::RngCore as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::private;

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
    #[error("{path}: {message}")]
    Unreadable { path: String, message: String },
    #[error("writing {path}: {error}")]
    Write { path: String, error: std::io::Error },
}

/// The file's contents.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    /// Tenant name to the SHA-256 (hex) of each of its tokens.
    tenants: BTreeMap<String, Vec<String>>,
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
    /// Token hash to tenant.
    by_token: BTreeMap<[u8; 32], String>,
}

impl Tenants {
    /// Opens the registry under `state_dir`, creating the directory when missing.
    pub fn open(state_dir: &Path) -> Result<Self, TenantError> {
        let path = state_dir.join("tenants.json");
        let file = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| TenantError::Unreadable {
                path: path.display().to_string(),
                message: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => File::default(),
            Err(e) => {
                return Err(TenantError::Unreadable {
                    path: path.display().to_string(),
                    message: e.to_string(),
                });
            }
        };
        let mut by_token = BTreeMap::new();
        for (tenant, hashes) in &file.tenants {
            for hash in hashes {
                let mut bytes = [0u8; 32];
                hex::decode_to_slice(hash, &mut bytes).map_err(|e| TenantError::Unreadable {
                    path: path.display().to_string(),
                    message: format!("a token hash of tenant {tenant}: {e}"),
                })?;
                by_token.insert(bytes, tenant.clone());
            }
        }
        Ok(Self {
            path,
            inner: Mutex::new(Inner { file, by_token }),
        })
    }

    /// Creates `name` and issues its first token.
    pub fn create(&self, name: &str) -> Result<String, TenantError> {
        check_name(name)?;
        let mut inner = self.lock();
        if inner.file.tenants.contains_key(name) {
            return Err(TenantError::Exists(name.to_owned()));
        }
        inner.file.tenants.insert(name.to_owned(), Vec::new());
        self.issue_locked(&mut inner, name)
    }

    /// Issues another token for `name`.
    pub fn issue(&self, name: &str) -> Result<String, TenantError> {
        let mut inner = self.lock();
        if !inner.file.tenants.contains_key(name) {
            return Err(TenantError::Missing(name.to_owned()));
        }
        self.issue_locked(&mut inner, name)
    }

    /// The tenant a token belongs to.
    pub fn tenant_of(&self, token: &str) -> Option<String> {
        self.lock().by_token.get(&hash(token)).cloned()
    }

    /// Every tenant, in order.
    pub fn names(&self) -> Vec<String> {
        self.lock().file.tenants.keys().cloned().collect()
    }

    pub fn exists(&self, name: &str) -> bool {
        self.lock().file.tenants.contains_key(name)
    }

    fn issue_locked(&self, inner: &mut Inner, name: &str) -> Result<String, TenantError> {
        let mut secret = [0u8; 32];
        rand::rng().fill_bytes(&mut secret);
        let token = format!("rwt_{}", hex::encode(secret));
        let hashed = hash(&token);
        inner
            .file
            .tenants
            .entry(name.to_owned())
            .or_default()
            .push(hex::encode(hashed));
        if let Err(error) = self.save(&inner.file) {
            // Not durable, so not issued.
            if let Some(hashes) = inner.file.tenants.get_mut(name) {
                hashes.pop();
            }
            return Err(error);
        }
        inner.by_token.insert(hashed, name.to_owned());
        Ok(token)
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
    fn tokens_survive_a_reopen_and_only_their_hashes_are_stored() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tenants = Tenants::open(dir.path()).expect("opens");
        let token = tenants.create("acme").expect("created");
        let second = tenants.issue("acme").expect("issued");
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
        assert_eq!(reopened.tenant_of(&token).as_deref(), Some("acme"));
        assert_eq!(reopened.tenant_of(&second).as_deref(), Some("acme"));
        assert_eq!(reopened.tenant_of("rwt_guess"), None);
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
