//! The sandbox: one engine, components compiled once and cached on disk, a fresh store per
//! action run, and nothing reachable from inside but the world's imports.

mod bindings;
mod cache;
mod check;
mod imports;
mod limits;
mod run;
mod running;
mod wasi;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Enabled, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

pub use cache::ComponentCache;
pub use check::{CheckReport, import_allowed};
pub use limits::{Limit, Limits};
pub use run::{RunError, RunInput, RunLabels, RunOutput};

use bindings::ActionPre;
use run::RunState;

/// Why a component could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    // The cause is in the message, not chained as a source: `{:#}` would print it again.
    #[error("cannot read component {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(
        "{origin} is a core WebAssembly module, not a component; build it for wasm32-wasip2 (or wrap it with `wasm-tools component new`)"
    )]
    CoreModule { origin: String },
    #[error("{origin} is not WebAssembly")]
    NotWasm { origin: String },
    #[error("{origin} is not a valid component: {message}")]
    Invalid { origin: String, message: String },
    #[error("{origin} does not fit the rewind:action world: {}", problems.join("; "))]
    World {
        origin: String,
        problems: Vec<String>,
    },
}

/// Bytes of each pooled table and stack kept resident and reset in place.
const KEEP_RESIDENT: usize = 2 << 20;

/// Bytes of each pooled linear memory kept resident and reset in place. Python's runtime
/// dirties a few MiB of its heap in every run: resetting those pages in place rather than
/// dropping them (and faulting them in again at the next run) took a trivial Python
/// action's start + run from 2.1 to 1.6 ms (BENCHMARKS.md). 8 MiB holds what Python and
/// JavaScript dirty (64 MiB measured no faster), and is all a slot keeps of a run that
/// filled its memory: what a guest takes beyond it goes back to the system when the run
/// ends. With `pagemap_scan` (Linux 6.7+) only the pages a run dirtied are reset and stay
/// resident; older kernels reset the whole resident prefix.
const MEMORY_KEEP_RESIDENT: usize = 8 << 20;

/// How a [`Sandbox`] is set up.
#[derive(Clone, Debug)]
pub struct SandboxBuilder {
    cache: ComponentCache,
    instances: u32,
    max_memory_mib: u32,
}

impl Default for SandboxBuilder {
    fn default() -> Self {
        Self {
            cache: ComponentCache::new(ComponentCache::default_dir()),
            instances: 256,
            max_memory_mib: 1024,
        }
    }
}

impl SandboxBuilder {
    /// Where compiled components are cached; `None` compiles on every load.
    pub fn cache_dir(mut self, dir: Option<PathBuf>) -> Self {
        self.cache = ComponentCache::new(dir);
        self
    }

    /// Runs that may be live at once in this sandbox (its instance pool). Default 256.
    pub fn instances(mut self, instances: u32) -> Self {
        self.instances = instances.max(1);
        self
    }

    /// The highest memory ceiling any agent may set, in MiB (the pool's slot size).
    /// Default 1024.
    pub fn max_memory_mib(mut self, mib: u32) -> Self {
        self.max_memory_mib = mib.max(1);
        self
    }

    pub fn build(self) -> wasmtime::Result<Sandbox> {
        let mut pool = PoolingAllocationConfig::default();
        pool.total_component_instances(self.instances)
            .total_core_instances(self.instances.saturating_mul(8))
            .total_memories(self.instances.saturating_mul(2))
            .total_tables(self.instances.saturating_mul(4))
            .total_stacks(self.instances)
            .max_memory_size(
                usize::try_from(u64::from(self.max_memory_mib) << 20).unwrap_or(usize::MAX),
            )
            // A run usually dirties a few pages of its memory, tables and stack. Resetting
            // those with memset (pagemap_scan finds which ones, on Linux 6.7+) is cheaper
            // than madvise, whose page faults and TLB flushes dominated an action's start.
            .pagemap_scan(Enabled::Auto)
            .linear_memory_keep_resident(MEMORY_KEEP_RESIDENT)
            .table_keep_resident(KEEP_RESIDENT)
            .async_stack_keep_resident(KEEP_RESIDENT);
        let mut config = Config::new();
        config
            .wasm_component_model(true)
            .consume_fuel(true)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&config)?;
        let mut linker = Linker::new(&engine);
        run::add_to_linker(&mut linker)?;
        Ok(Sandbox {
            engine,
            linker: Arc::new(linker),
            cache: self.cache,
            instances: self.instances,
            max_memory_mib: self.max_memory_mib,
        })
    }
}

/// Compiles, checks and runs action components.
pub struct Sandbox {
    engine: Engine,
    linker: Arc<Linker<RunState>>,
    cache: ComponentCache,
    instances: u32,
    max_memory_mib: u32,
}

impl fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sandbox")
            .field("cache", &self.cache)
            .field("max_memory_mib", &self.max_memory_mib)
            .finish_non_exhaustive()
    }
}

impl Sandbox {
    pub fn builder() -> SandboxBuilder {
        SandboxBuilder::default()
    }

    /// The same sandbox (its engine, instance pool and linker), keeping compiled components
    /// in `dir` instead, signed with the same key: a server gives each tenant its own.
    pub fn with_cache_dir(&self, dir: Option<PathBuf>) -> Self {
        Self {
            engine: self.engine.clone(),
            linker: Arc::clone(&self.linker),
            cache: self.cache.with_dir(dir),
            instances: self.instances,
            max_memory_mib: self.max_memory_mib,
        }
    }

    /// Where this sandbox keeps compiled components.
    pub fn cache(&self) -> &ComponentCache {
        &self.cache
    }

    /// Runs that may be live at once here.
    pub fn instances(&self) -> u32 {
        self.instances
    }

    /// The highest memory ceiling a run may have here.
    pub fn max_memory_mib(&self) -> u32 {
        self.max_memory_mib
    }

    /// Loads the component at `path`: read, compiled (or taken from the cache), checked
    /// against the world, and pre-instantiated.
    pub fn load_file(&self, path: &Path) -> Result<ActionComponent, LoadError> {
        let wasm = std::fs::read(path).map_err(|error| LoadError::Read {
            path: path.to_owned(),
            error,
        })?;
        self.load(&path.display().to_string(), &wasm)
    }

    /// Loads a component from its bytes (binary or, for tests, WAT text); `origin` names it
    /// in errors.
    pub fn load(&self, origin: &str, wasm: &[u8]) -> Result<ActionComponent, LoadError> {
        let component = self.compile(origin, wasm)?;
        let report = check::check(&self.engine, &component);
        if !report.fits() {
            return Err(LoadError::World {
                origin: origin.to_owned(),
                problems: report.problems,
            });
        }
        let pre = self
            .linker
            .instantiate_pre(&component)
            .and_then(ActionPre::new)
            .map_err(|e| LoadError::World {
                origin: origin.to_owned(),
                problems: vec![format!("{e:#}")],
            })?;
        Ok(ActionComponent {
            origin: origin.to_owned(),
            pre,
        })
    }

    /// What `rewind check` says about a component.
    pub fn check(&self, origin: &str, wasm: &[u8]) -> Result<CheckReport, LoadError> {
        let component = self.compile(origin, wasm)?;
        let mut report = check::check(&self.engine, &component);
        if report.fits()
            && let Err(e) = self.linker.instantiate_pre(&component)
        {
            report.problems.push(format!("{e:#}"));
        }
        Ok(report)
    }

    fn compile(&self, origin: &str, wasm: &[u8]) -> Result<Component, LoadError> {
        let wasm: std::borrow::Cow<'_, [u8]> = if wasm.starts_with(b"\0asm") {
            std::borrow::Cow::Borrowed(wasm)
        } else {
            match std::str::from_utf8(wasm).ok().map(wat::parse_str) {
                Some(Ok(bytes)) => std::borrow::Cow::Owned(bytes),
                _ => {
                    return Err(LoadError::NotWasm {
                        origin: origin.to_owned(),
                    });
                }
            }
        };
        // Layer 1 is a core module; components have layer 1 in the header's upper half.
        if wasm.len() >= 8 && wasm[4..8] == [1, 0, 0, 0] {
            return Err(LoadError::CoreModule {
                origin: origin.to_owned(),
            });
        }
        let fits = |component: &Component| {
            check::check(&self.engine, component).fits()
                && self.linker.instantiate_pre(component).is_ok()
        };
        self.cache
            .component(&self.engine, &wasm, &fits)
            .map_err(|e| LoadError::Invalid {
                origin: origin.to_owned(),
                message: format!("{e:#}"),
            })
    }

    /// Runs `input` in a fresh store of `component`.
    pub async fn run(&self, component: &ActionComponent, input: RunInput) -> RunOutput {
        run::run(&self.engine, &component.pre, input).await
    }
}

/// A compiled, checked, pre-instantiated action component.
pub struct ActionComponent {
    origin: String,
    pre: ActionPre<RunState>,
}

impl fmt::Debug for ActionComponent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ActionComponent")
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}
