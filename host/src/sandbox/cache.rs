//! Precompiled components on disk, keyed by the component's content hash and the engine's
//! settings, so that each component is compiled once per machine; and in memory, so that a
//! component loaded by several agents or tests at once is compiled or read once per process.
//! Only a component that fits the world is kept, on disk or in memory; memory keeps the
//! [`MAX_KEPT`] loaded last.
//!
//! wasmtime runs a precompiled file as the native code it is, without verifying it, so the
//! disk cache is trusted code and is guarded as such:
//! - the directory is made 0700; one that exists and belongs to another user, or that group
//!   or others can write, is not used (a warning says why, and components are compiled in
//!   memory);
//! - each entry `NAME.cwasm` has `NAME.cwasm.mac` beside it: an HMAC-SHA256 of the entry's
//!   name and bytes under the installation's key, a secret of 32 random bytes kept outside
//!   the directory, in `DIR.key` (0600, made at first use; refused when others can read or
//!   write it). The MAC is checked before the file is loaded; an entry that does not match,
//!   or that others could have written, is compiled again, with a warning;
//! - files are written through temporary files of random names, created exclusively.
//!
//! A loaded component stays mapped from its file (its memory images are copy-on-write views
//! of it), so files are only ever replaced by rename, never rewritten in place: a file cut
//! short under a running process would fault it.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use hmac::{Hmac, Mac as _};
use rand::RngCore as _;
use sha2::{Digest, Sha256};

use crate::private;
use wasmtime::Engine;
use wasmtime::component::Component;

/// Components kept in memory; past it, the one loaded first is let go (whoever holds it
/// keeps it; a later load reads it from disk again).
const MAX_KEPT: usize = 64;

/// Where precompiled components are kept; `None` compiles every time (but once per
/// process). Clones share the in-memory cache.
#[derive(Clone, Debug, Default)]
pub struct ComponentCache {
    dir: Option<PathBuf>,
    /// Where the installation's key is: `DIR.key` of the cache this one was made from.
    key_file: Option<PathBuf>,
    /// The directory and the key, once the first load has checked them (`None`: not used).
    disk: Arc<OnceLock<Option<Disk>>>,
    loaded: Arc<Mutex<Loaded>>,
}

/// A cache directory found fit to hold trusted code, and the key that signs its entries.
#[derive(Debug)]
struct Disk {
    dir: PathBuf,
    key: [u8; KEY_BYTES],
}

const KEY_BYTES: usize = 32;

/// The components in memory, and the order they came in.
#[derive(Debug, Default)]
struct Loaded {
    slots: HashMap<String, Slot>,
    order: VecDeque<String>,
}

/// One component's place in memory: empty until its first load finishes.
type Slot = Arc<Mutex<Option<Component>>>;

impl ComponentCache {
    pub fn new(dir: Option<PathBuf>) -> Self {
        let key_file = dir.as_deref().map(|dir| {
            let mut name = dir.file_name().unwrap_or_default().to_owned();
            name.push(".key");
            dir.with_file_name(name)
        });
        Self {
            dir,
            key_file,
            disk: Arc::default(),
            loaded: Arc::default(),
        }
    }

    /// A cache in `dir` signed with this one's key (one key per installation): a server
    /// keeps each tenant's compiled components apart.
    pub fn with_dir(&self, dir: Option<PathBuf>) -> Self {
        Self {
            key_file: dir.as_ref().and(self.key_file.clone()),
            dir,
            disk: Arc::default(),
            loaded: Arc::default(),
        }
    }

    /// The directory and key, checked at the first use: `None` when there is no directory
    /// or it cannot be trusted (said once, as a warning).
    fn disk(&self) -> Option<&Disk> {
        self.disk
            .get_or_init(|| {
                let (dir, key_file) = (self.dir.as_ref()?, self.key_file.as_ref()?);
                match open_disk(dir, key_file) {
                    Ok(disk) => Some(disk),
                    Err(why) => {
                        tracing::warn!(
                            "not keeping compiled components in {}: {why}; each is compiled \
                             in memory instead",
                            dir.display()
                        );
                        None
                    }
                }
            })
            .as_ref()
    }

    /// The default directory: `$REWIND_CACHE_DIR`, else `$XDG_CACHE_HOME/rewind`, else
    /// `$HOME/.cache/rewind`.
    pub fn default_dir() -> Option<PathBuf> {
        if let Some(dir) = std::env::var_os("REWIND_CACHE_DIR") {
            return Some(PathBuf::from(dir));
        }
        if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
            return Some(PathBuf::from(dir).join("rewind"));
        }
        std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache").join("rewind"))
    }

    /// The directory it keeps compiled components in.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The compiled form of `wasm`: from memory when this process loaded it before, else
    /// from the disk cache when it holds one this engine can run, else compiled now. Loads
    /// of the same component at once wait for one compilation. A component compiled now is
    /// kept (on disk and in memory) only when `fits` says it fits: one that does not writes
    /// nothing. A cache that cannot be written only costs speed.
    pub fn component(
        &self,
        engine: &Engine,
        wasm: &[u8],
        fits: &dyn Fn(&Component) -> bool,
    ) -> wasmtime::Result<Component> {
        let key = cache_key(engine, wasm);
        let slot = {
            let mut loaded = self.lock();
            match loaded.slots.get(&key) {
                Some(slot) => Arc::clone(slot),
                None => {
                    let slot = Slot::default();
                    loaded.slots.insert(key.clone(), Arc::clone(&slot));
                    loaded.order.push_back(key.clone());
                    while loaded.order.len() > MAX_KEPT {
                        if let Some(first) = loaded.order.pop_front() {
                            loaded.slots.remove(&first);
                        }
                    }
                    slot
                }
            }
        };
        let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(component) = &*slot {
            return Ok(component.clone());
        }
        let loaded = self.load(engine, wasm, &key, fits);
        match &loaded {
            Ok(component) if fits(component) => *slot = Some(component.clone()),
            _ => self.forget(&key),
        }
        loaded
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Loaded> {
        self.loaded.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn forget(&self, key: &str) {
        let mut loaded = self.lock();
        loaded.slots.remove(key);
        loaded.order.retain(|k| k != key);
    }

    /// Deletes the compiled forms of the component whose SHA-256 is `sha256` (hex), for
    /// every engine: no agent needs it any more. Memory lets go of it too.
    pub fn evict(&self, sha256: &str) {
        let prefix = format!("{sha256}-");
        {
            let mut loaded = self.lock();
            loaded.slots.retain(|k, _| !k.starts_with(&prefix));
            loaded.order.retain(|k| !k.starts_with(&prefix));
        }
        let Some(dir) = &self.dir else { return };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            if name.to_str().is_some_and(|n| n.starts_with(&prefix))
                && let Err(e) = std::fs::remove_file(entry.path())
            {
                tracing::warn!(path = %entry.path().display(), "evicting a compiled component: {e}");
            }
        }
    }

    fn load(
        &self,
        engine: &Engine,
        wasm: &[u8],
        key: &str,
        fits: &dyn Fn(&Component) -> bool,
    ) -> wasmtime::Result<Component> {
        let Some(disk) = self.disk() else {
            return Component::from_binary(engine, wasm);
        };
        let name = format!("{key}.cwasm");
        let path = disk.dir.join(&name);
        if path.exists() {
            match disk.verify(&name, &path) {
                Ok(()) => match deserialize_file(engine, &path) {
                    Ok(component) => return Ok(component),
                    Err(e) => tracing::warn!(
                        path = %path.display(),
                        "recompiling: cached component unusable: {e:#}"
                    ),
                },
                Err(why) => tracing::warn!(path = %path.display(), "recompiling: {why}"),
            }
        }
        let compiled = engine.precompile_component(wasm)?;
        let component = deserialize(engine, &compiled)?;
        if !fits(&component) {
            return Ok(component);
        }
        match disk.store(&name, &path, &compiled) {
            // Mapped from its file, a component's memory images are copy-on-write.
            Ok(()) => Ok(deserialize_file(engine, &path).unwrap_or(component)),
            Err(e) => {
                tracing::warn!(dir = %disk.dir.display(), "cannot cache the compiled component: {e}");
                Ok(component)
            }
        }
    }
}

/// Checks `dir` (made 0700 when missing) and reads the key in `key_file` (made when
/// missing); `Err` says why they cannot be trusted.
fn open_disk(dir: &Path, key_file: &Path) -> Result<Disk, String> {
    private::create_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    private::check(dir)?;
    let mut fresh = [0; KEY_BYTES];
    rand::rng().fill_bytes(&mut fresh);
    private::write_new(key_file, hex::encode(fresh).as_bytes())
        .map_err(|e| format!("{}: {e}", key_file.display()))?;
    private::check(key_file)?;
    let metadata =
        std::fs::metadata(key_file).map_err(|e| format!("{}: {e}", key_file.display()))?;
    if metadata.permissions().mode() & 0o077 != 0 {
        return Err(format!(
            "{} can be read by others (mode {:o}): the key must be secret",
            key_file.display(),
            metadata.permissions().mode() & 0o777
        ));
    }
    let text =
        std::fs::read_to_string(key_file).map_err(|e| format!("{}: {e}", key_file.display()))?;
    let key = hex::decode(text.trim())
        .ok()
        .and_then(|bytes| <[u8; KEY_BYTES]>::try_from(bytes).ok())
        .ok_or_else(|| {
            format!(
                "{} is not a key of {KEY_BYTES} bytes in hex",
                key_file.display()
            )
        })?;
    Ok(Disk {
        dir: dir.to_owned(),
        key,
    })
}

impl Disk {
    /// The MAC of the entry `name` holding `bytes`: the name is in it, so that one signed
    /// entry cannot stand in for another.
    fn mac(&self, name: &str, bytes: &[u8]) -> Hmac<Sha256> {
        let mut mac = <Hmac<Sha256>>::new_from_slice(&self.key).expect("HMAC takes any key");
        mac.update(&(name.len() as u64).to_le_bytes());
        mac.update(name.as_bytes());
        mac.update(bytes);
        mac
    }

    fn mac_path(path: &Path) -> PathBuf {
        let mut name = path.as_os_str().to_owned();
        name.push(".mac");
        PathBuf::from(name)
    }

    /// Whether the entry at `path` is one this installation wrote: owned by this user,
    /// writable by no one else, and matching its MAC.
    fn verify(&self, name: &str, path: &Path) -> Result<(), String> {
        let mac_path = Self::mac_path(path);
        private::check(path)?;
        private::check(&mac_path)?;
        let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let expected = std::fs::read_to_string(&mac_path)
            .ok()
            .and_then(|text| hex::decode(text.trim()).ok())
            .ok_or_else(|| format!("{} is not a MAC", mac_path.display()))?;
        self.mac(name, &bytes).verify_slice(&expected).map_err(|_| {
            "it does not match its MAC: it was not written by this installation".to_owned()
        })
    }

    /// Writes the entry and then its MAC (an entry without its MAC is compiled again).
    fn store(&self, name: &str, path: &Path, compiled: &[u8]) -> std::io::Result<()> {
        let mac = hex::encode(self.mac(name, compiled).finalize().into_bytes());
        private::write(path, compiled)?;
        private::write(&Self::mac_path(path), mac.as_bytes())
    }
}

/// Content hash of the component plus a hash of every engine setting that affects the code.
fn cache_key(engine: &Engine, wasm: &[u8]) -> String {
    let content = hex::encode(Sha256::digest(wasm));
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut hasher);
    format!("{content}-{:016x}", hasher.finish())
}

#[allow(
    unsafe_code,
    reason = "wasmtime trusts precompiled code; a file is loaded only from a directory \
              only this user can write, with a MAC under the installation's key that shows \
              this host wrote it with Engine::precompile_component"
)]
fn deserialize_file(engine: &Engine, path: &Path) -> wasmtime::Result<Component> {
    // SAFETY: see the reason above; the file was produced by `precompile_component` of an
    // engine with the same compatibility hash (it is part of the file name and the MAC).
    unsafe { Component::deserialize_file(engine, path) }
}

#[allow(
    unsafe_code,
    reason = "the bytes were produced by Engine::precompile_component just now"
)]
fn deserialize(engine: &Engine, compiled: &[u8]) -> wasmtime::Result<Component> {
    // SAFETY: `compiled` comes straight from `engine.precompile_component`.
    unsafe { Component::deserialize(engine, compiled) }
}
