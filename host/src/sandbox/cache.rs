//! Precompiled components on disk, keyed by the component's content hash and the engine's
//! settings, so that each component is compiled once per machine; and in memory, so that a
//! component loaded by several agents or tests at once is compiled or read once per process.
//!
//! A loaded component stays mapped from its file (its memory images are copy-on-write views
//! of it), so files are only ever replaced by rename, never rewritten in place: a file cut
//! short under a running process would fault it.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

/// Where precompiled components are kept; `None` compiles every time (but once per
/// process). Clones share the in-memory cache.
#[derive(Clone, Debug, Default)]
pub struct ComponentCache {
    dir: Option<PathBuf>,
    loaded: Arc<Mutex<HashMap<String, Slot>>>,
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

    /// The compiled form of `wasm`: from memory when this process loaded it before, else
    /// from the disk cache when it holds one this engine can run, else compiled now and
    /// stored. Loads of the same component at once wait for one compilation. A cache that
    /// cannot be written only costs speed.
    pub fn component(&self, engine: &Engine, wasm: &[u8]) -> wasmtime::Result<Component> {
        let key = cache_key(engine, wasm);
        let slot = {
            let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
            Arc::clone(loaded.entry(key.clone()).or_default())
        };
        let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(component) = &*slot {
            return Ok(component.clone());
        }
        let component = self.load(engine, wasm, &key)?;
        *slot = Some(component.clone());
        Ok(component)
    }

    fn load(&self, engine: &Engine, wasm: &[u8], key: &str) -> wasmtime::Result<Component> {
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
        match store_atomically(dir, &path, &compiled) {
            // Mapped from its file, a component's memory images are copy-on-write.
            Ok(()) => deserialize_file(engine, &path).or_else(|_| deserialize(engine, &compiled)),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), "cannot cache the compiled component: {e}");
                deserialize(engine, &compiled)
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
