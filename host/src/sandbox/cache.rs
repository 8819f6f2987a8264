//! Precompiled components on disk, keyed by the component's content hash and the engine's
//! settings, so that each component is compiled once per machine; and in memory, so that a
//! component loaded by several agents or tests at once is compiled or read once per process.
//! Only a component that fits the world is kept, on disk or in memory; memory keeps the
//! [`MAX_KEPT`] loaded last.
//!
//! A loaded component stays mapped from its file (its memory images are copy-on-write views
//! of it), so files are only ever replaced by rename, never rewritten in place: a file cut
//! short under a running process would fault it.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};
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
    loaded: Arc<Mutex<Loaded>>,
}

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
        Self {
            dir,
            loaded: Arc::default(),
        }
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
        let Some(dir) = &self.dir else {
            return Component::from_binary(engine, wasm);
        };
        let path = dir.join(format!("{key}.cwasm"));
        if path.exists() {
            match deserialize_file(engine, &path) {
                Ok(component) => return Ok(component),
                Err(e) => {
                    tracing::warn!(path = %path.display(), "recompiling: cached component unusable: {e:#}")
                }
            }
        }
        let compiled = engine.precompile_component(wasm)?;
        let component = deserialize(engine, &compiled)?;
        if !fits(&component) {
            return Ok(component);
        }
        match store_atomically(dir, &path, &compiled) {
            // Mapped from its file, a component's memory images are copy-on-write.
            Ok(()) => Ok(deserialize_file(engine, &path).unwrap_or(component)),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), "cannot cache the compiled component: {e}");
                Ok(component)
            }
        }
    }
}

/// Content hash of the component plus a hash of every engine setting that affects the code.
fn cache_key(engine: &Engine, wasm: &[u8]) -> String {
    let content = hex::encode(Sha256::digest(wasm));
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut hasher);
    format!("{content}-{:016x}", hasher.finish())
}

fn store_atomically(dir: &Path, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    // Compiled code is trusted: only this user may write where it is kept.
    std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
        .create(dir)?;
    let temp = tempfile_in(dir)?;
    std::fs::write(&temp, bytes)?;
    std::fs::rename(&temp, path)
}

fn tempfile_in(dir: &Path) -> std::io::Result<PathBuf> {
    let unique = format!(
        ".tmp-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    );
    Ok(dir.join(unique.replace(['(', ')'], "")))
}

#[allow(
    unsafe_code,
    reason = "wasmtime trusts precompiled code; the cache directory holds only files this \
              host wrote with Engine::precompile_component, and a file that fails wasmtime's \
              header and engine checks is recompiled"
)]
fn deserialize_file(engine: &Engine, path: &Path) -> wasmtime::Result<Component> {
    // SAFETY: see the reason above; the file was produced by `precompile_component` of an
    // engine with the same compatibility hash (it is part of the file name).
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
