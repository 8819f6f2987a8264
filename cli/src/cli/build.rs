//! `rewind build [agent.toml]`: builds each action's component from its source, whatever
//! its language, into the path its `component` names.
//!
//! An action's source is the directory its `source` names (default `actions/NAME`, beside
//! agent.toml), and its language is what that directory holds:
//! - `Cargo.toml`: Rust, built by cargo for `wasm32-wasip2` (the target is added when
//!   missing), the crate's cdylib copied to `component`;
//! - `action.py`: Python. The directory's `requirements.txt` (the SDK among them) is
//!   installed into a directory of its own, then componentize-py makes the component;
//! - `action.js`: JavaScript. `npm install` runs when its `package.json` changed, esbuild
//!   bundles the action with its imports, componentize-js makes the component.
//!
//! The Python and JavaScript tools are pinned by files the binary carries (`sdk`) and
//! installed into the cache directory once per version of them. A Python or JavaScript
//! component is rebuilt only when a file that goes into it changed (its sources, its local
//! dependencies, the tools): a digest of them is kept beside it; cargo decides for Rust.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use anyhow::{Context as _, bail};
use rewind_host::agent::AgentFile;
use sha2::Digest as _;

use super::sdk;

#[derive(Debug, clap::Args)]
pub struct BuildArgs {
    /// The agent whose actions to build.
    #[arg(default_value = "agent.toml")]
    pub agent: PathBuf,
    /// Build only this action (by name); may be given more than once.
    #[arg(long = "action", value_name = "NAME")]
    pub actions: Vec<String>,
}

pub fn build(args: BuildArgs, cache_dir: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    let agent = AgentFile::load(&args.agent)?;
    let builder = Builder::new(cache_dir)?;
    let mut sources = sources(&agent)?;
    for name in &args.actions {
        if !sources.iter().any(|source| &source.action == name) {
            bail!(
                "{}: no action `{name}` with a source to build (actions with one: {})",
                args.agent.display(),
                names(&sources)
            );
        }
    }
    if !args.actions.is_empty() {
        sources.retain(|source| args.actions.contains(&source.action));
    }
    for source in &sources {
        builder.build(source)?;
    }
    Ok(ExitCode::SUCCESS)
}

fn names(sources: &[Source]) -> String {
    let names: Vec<&str> = sources
        .iter()
        .map(|source| source.action.as_str())
        .collect();
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

/// The language of an action's source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lang {
    Rust,
    Python,
    Js,
}

impl Lang {
    pub fn name(self) -> &'static str {
        match self {
            Self::Rust => "rust",
            Self::Python => "python",
            Self::Js => "js",
        }
    }
}

/// An action to build: its source directory, language and component.
#[derive(Debug, Clone)]
pub struct Source {
    pub action: String,
    pub lang: Lang,
    pub dir: PathBuf,
    pub component: PathBuf,
}

/// The actions of `agent` that have a source, in its order. An action whose source
/// directory is missing is left as it is when its component exists (built elsewhere), and
/// is an error when it does not.
pub fn sources(agent: &AgentFile) -> anyhow::Result<Vec<Source>> {
    let base = agent.path.parent().unwrap_or_else(|| Path::new("."));
    let mut sources = Vec::new();
    for action in &agent.config.actions {
        let dir = match &action.source {
            Some(source) => base.join(source),
            None => base.join("actions").join(&action.name),
        };
        let component = agent.component_path(action);
        if !dir.is_dir() {
            if action.source.is_none() && component.is_file() {
                continue;
            }
            bail!(
                "{}: action `{}` has no source at {} and no component at {} (set `source` in \
                 its [[actions]] entry to the directory that holds its Cargo.toml, action.py \
                 or action.js)",
                agent.path.display(),
                action.name,
                dir.display(),
                component.display()
            );
        }
        let lang = if dir.join("Cargo.toml").is_file() {
            Lang::Rust
        } else if dir.join("action.py").is_file() {
            Lang::Python
        } else if dir.join("action.js").is_file() {
            Lang::Js
        } else {
            bail!(
                "{}: the source of action `{}`, {}, holds no Cargo.toml (Rust), action.py \
                 (Python) or action.js (JavaScript)",
                agent.path.display(),
                action.name,
                dir.display()
            );
        };
        sources.push(Source {
            action: action.name.clone(),
            lang,
            dir,
            component,
        });
    }
    Ok(sources)
}

/// What a build did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Built {
    /// The component was written anew.
    Fresh,
    /// Nothing that goes into it changed.
    UpToDate,
}

/// Builds actions, installing the tools they need into `tools` (under the cache
/// directory) as they are first needed.
#[derive(Debug)]
pub struct Builder {
    cache: PathBuf,
    tools: PathBuf,
    rust_target: std::sync::OnceLock<()>,
}

impl Builder {
    pub fn new(cache_dir: Option<PathBuf>) -> anyhow::Result<Self> {
        let cache = cache_dir
            .or_else(rewind_host::sandbox::ComponentCache::default_dir)
            .context(
                "no cache directory for the build tools: set --cache-dir or REWIND_CACHE_DIR \
                 (HOME is not set)",
            )?;
        Ok(Self {
            tools: cache.join("tools"),
            cache,
            rust_target: std::sync::OnceLock::new(),
        })
    }

    /// The cache directory: compiled components, and the build tools under `tools/`.
    pub fn cache_dir(&self) -> &Path {
        &self.cache
    }

    /// Builds `source` unless it is up to date.
    pub fn build(&self, source: &Source) -> anyhow::Result<Built> {
        if let Some(parent) = source.component.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        let built = match source.lang {
            Lang::Rust => self.build_rust(source),
            Lang::Python => self.build_python(source),
            Lang::Js => self.build_js(source),
        }
        .with_context(|| {
            format!(
                "building action `{}` ({}, {}) failed",
                source.action,
                source.lang.name(),
                source.dir.display()
            )
        })?;
        match built {
            Built::Fresh => eprintln!(
                "   built {} ({}) -> {}",
                source.action,
                source.lang.name(),
                source.component.display()
            ),
            Built::UpToDate => eprintln!("   {}: unchanged", source.action),
        }
        Ok(built)
    }

    fn build_rust(&self, source: &Source) -> anyhow::Result<Built> {
        self.rust_target()?;
        let manifest = source.dir.join("Cargo.toml");
        let output = Command::new(cargo())
            .args(["build", "--release", "--target", "wasm32-wasip2"])
            .args([
                "--message-format",
                "json-render-diagnostics",
                "--manifest-path",
            ])
            .arg(&manifest)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .context("running cargo")?;
        if !output.status.success() {
            bail!(
                "cargo could not build {} (its errors are above)",
                manifest.display()
            );
        }
        let manifest = manifest.canonicalize()?;
        let mut wasm = None;
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            // Both sides canonical: cargo's path may go through a symlink ours does not.
            let theirs =
                (message["manifest_path"].as_str()).and_then(|p| Path::new(p).canonicalize().ok());
            let ours = message["reason"] == "compiler-artifact"
                && theirs.as_deref() == Some(manifest.as_path())
                && (message["target"]["crate_types"].as_array())
                    .is_some_and(|types| types.iter().any(|kind| kind == "cdylib"));
            if !ours {
                continue;
            }
            let files = message["filenames"].as_array().into_iter().flatten();
            wasm = files
                .filter_map(serde_json::Value::as_str)
                .find(|file| file.ends_with(".wasm"))
                .map(PathBuf::from);
        }
        let wasm = wasm.with_context(|| {
            format!(
                "{} builds no component: it needs `crate-type = [\"cdylib\"]` under [lib]",
                manifest.display()
            )
        })?;
        let same = source
            .component
            .canonicalize()
            .is_ok_and(|component| component == wasm);
        let before = digest_file(&source.component);
        if !same {
            copy_into_place(&wasm, &source.component)?;
        }
        Ok(
            if before.is_some() && before == digest_file(&source.component) {
                Built::UpToDate
            } else {
                Built::Fresh
            },
        )
    }

    /// Adds the `wasm32-wasip2` target with rustup when it is missing, once per builder.
    fn rust_target(&self) -> anyhow::Result<()> {
        if self.rust_target.get().is_some() {
            return Ok(());
        }
        let installed = Command::new("rustup")
            .args(["target", "list", "--installed"])
            .stderr(Stdio::inherit())
            .output();
        match installed {
            Ok(output) if output.status.success() => {
                let listed = String::from_utf8_lossy(&output.stdout);
                if !listed.lines().any(|line| line.trim() == "wasm32-wasip2") {
                    eprintln!("   adding the wasm32-wasip2 target (rustup target add)");
                    run(Command::new("rustup").args(["target", "add", "wasm32-wasip2"]))?;
                }
            }
            // Without rustup, the toolchain is someone else's: cargo says if it lacks the
            // target.
            _ => {}
        }
        let _ = self.rust_target.set(());
        Ok(())
    }

    fn build_python(&self, source: &Source) -> anyhow::Result<Built> {
        let tools = self.python_tools()?;
        let requirements = source.dir.join("requirements.txt");
        let local = local_dependencies(source)?;
        let tools_digest = sdk::digest(sdk::PYTHON_TOOLS);
        let inputs = digest_paths(
            std::iter::once(source.dir.as_path()).chain(local.iter().map(PathBuf::as_path)),
            &tools_digest,
        )?;
        if up_to_date(&source.component, &inputs) {
            return Ok(Built::UpToDate);
        }
        let work = work_dir(&source.component);
        let site = work.join("site");
        // What is installed: the requirements and the local packages they name.
        let installed = digest_paths(local.iter().map(PathBuf::as_path), &{
            let text = std::fs::read(&requirements).unwrap_or_default();
            format!("{tools_digest}{}", hex::encode(sha2::Sha256::digest(&text)))
        })?;
        let marker = site.join(".rewind-inputs");
        if std::fs::read_to_string(&marker).ok().as_deref() != Some(installed.as_str()) {
            remove_dir(&site)?;
            std::fs::create_dir_all(&site)?;
            if requirements.is_file() {
                run(Command::new(tools.join("bin/pip"))
                    .args(["install", "--quiet", "--disable-pip-version-check"])
                    .args(["--no-build-isolation", "--target"])
                    .arg(site.canonicalize()?)
                    .args(["-r", "requirements.txt"])
                    .current_dir(&source.dir))
                .with_context(|| format!("installing {}", requirements.display()))?;
            }
            std::fs::write(&marker, &installed)?;
        }
        let out = work.join("component.wasm");
        // An empty virtual environment: componentize-py adds the one it runs in to the
        // path otherwise, bundling the tools with the action.
        let empty = work.join("no-venv");
        std::fs::create_dir_all(&empty)?;
        run(Command::new(tools.join("bin/componentize-py"))
            .env("VIRTUAL_ENV", &empty)
            .args(["-w", "action", "componentize", "-p"])
            .arg(&source.dir)
            .arg("-p")
            .arg(&site)
            .args(["action", "-o"])
            .arg(&out))?;
        copy_into_place(&out, &source.component)?;
        std::fs::write(inputs_path(&source.component), &inputs)?;
        Ok(Built::Fresh)
    }

    fn build_js(&self, source: &Source) -> anyhow::Result<Built> {
        let tools = self.js_tools()?;
        let package = source.dir.join("package.json");
        let local = local_dependencies(source)?;
        if package.is_file() {
            let installed = digest_paths(local.iter().map(PathBuf::as_path), &{
                let text = std::fs::read(&package)?;
                hex::encode(sha2::Sha256::digest(&text))
            })?;
            let marker = source.dir.join("node_modules/.rewind-inputs");
            if std::fs::read_to_string(&marker).ok().as_deref() != Some(installed.as_str()) {
                run(Command::new(NPM)
                    .args(["install", "--no-audit", "--no-fund", "--silent"])
                    .current_dir(&source.dir))
                .with_context(|| format!("installing {}", package.display()))?;
                std::fs::create_dir_all(source.dir.join("node_modules"))?;
                std::fs::write(&marker, &installed)?;
            }
        }
        // After `npm install`, which writes the action's package-lock.json.
        let inputs = digest_paths(
            std::iter::once(source.dir.as_path()).chain(local.iter().map(PathBuf::as_path)),
            &sdk::digest(sdk::JS_TOOLS),
        )?;
        if up_to_date(&source.component, &inputs) {
            return Ok(Built::UpToDate);
        }
        let work = work_dir(&source.component);
        std::fs::create_dir_all(&work)?;
        let out = work.join("component.wasm");
        run(Command::new(NODE)
            .arg(tools.join("build.mjs"))
            .arg(source.dir.join("action.js"))
            .arg(&out)
            .arg(tools.join("wit")))?;
        copy_into_place(&out, &source.component)?;
        std::fs::write(inputs_path(&source.component), &inputs)?;
        Ok(Built::Fresh)
    }

    /// The virtual environment with componentize-py, made when missing.
    fn python_tools(&self) -> anyhow::Result<PathBuf> {
        let dir = (self.tools).join(format!("python-{}", sdk::digest(sdk::PYTHON_TOOLS)));
        self.install(&dir, |dir| {
            eprintln!("   installing componentize-py into {}", dir.display());
            run(Command::new(PYTHON).args(["-m", "venv"]).arg(dir))
                .context("building Python actions needs python3 (3.11 or newer) with venv")?;
            sdk::write(dir, sdk::PYTHON_TOOLS)?;
            run(Command::new(dir.join("bin/pip"))
                .args(["install", "--quiet", "--disable-pip-version-check", "-r"])
                .arg(dir.join("requirements.txt")))
        })
    }

    /// The directory with esbuild and componentize-js, made when missing.
    fn js_tools(&self) -> anyhow::Result<PathBuf> {
        let dir = (self.tools).join(format!("js-{}", sdk::digest(sdk::JS_TOOLS)));
        self.install(&dir, |dir| {
            eprintln!(
                "   installing esbuild and componentize-js into {}",
                dir.display()
            );
            sdk::write(dir, sdk::JS_TOOLS)?;
            run(Command::new(NPM)
                .args(["ci", "--no-audit", "--no-fund", "--silent"])
                .current_dir(dir))
            .context("building JavaScript actions needs node (20 or newer) and npm")
        })
    }

    /// `dir`, made by `make` unless it was made before: one process at a time makes it
    /// (a lock beside it), and it counts as made once `make` returned.
    fn install(
        &self,
        dir: &Path,
        make: impl FnOnce(&Path) -> anyhow::Result<()>,
    ) -> anyhow::Result<PathBuf> {
        let ready = dir.join(".rewind-ready");
        if ready.is_file() {
            return Ok(dir.to_owned());
        }
        std::fs::create_dir_all(&self.tools)
            .with_context(|| format!("creating {}", self.tools.display()))?;
        let lock_path = self.tools.join(".lock");
        let lock = std::fs::File::create(&lock_path)
            .with_context(|| format!("opening {}", lock_path.display()))?;
        lock.lock()
            .with_context(|| format!("locking {}", lock_path.display()))?;
        if !ready.is_file() {
            remove_dir(dir)?;
            std::fs::create_dir_all(dir)?;
            make(dir)
                .with_context(|| format!("installing the build tools into {}", dir.display()))?;
            std::fs::write(&ready, b"")?;
        }
        Ok(dir.to_owned())
    }
}

const PYTHON: &str = "python3";
const NPM: &str = "npm";
const NODE: &str = "node";

fn cargo() -> std::ffi::OsString {
    std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into())
}

/// Runs `command`, its output kept; when it fails, the output is the error.
fn run(command: &mut Command) -> anyhow::Result<()> {
    let program = command.get_program().to_string_lossy().into_owned();
    let output = command
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {program}"))?;
    if output.status.success() {
        return Ok(());
    }
    let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stderr));
    // componentize-py follows its error with a backtrace of its own code: the error is
    // what helps.
    let text = match text.find("\nStack backtrace:") {
        Some(at) => &text[..at],
        None => &text,
    };
    bail!("{program} failed ({}):\n{}", output.status, text.trim_end())
}

/// Where the intermediate files of `component`'s build go.
fn work_dir(component: &Path) -> PathBuf {
    let mut name = component
        .file_name()
        .unwrap_or(OsStr::new("component"))
        .to_owned();
    name.push(".build");
    component.with_file_name(name)
}

/// The digest of the files `component` was built from, kept beside it.
fn inputs_path(component: &Path) -> PathBuf {
    let mut name = component
        .file_name()
        .unwrap_or(OsStr::new("component"))
        .to_owned();
    name.push(".inputs");
    component.with_file_name(name)
}

fn up_to_date(component: &Path, inputs: &str) -> bool {
    component.is_file()
        && std::fs::read_to_string(inputs_path(component))
            .ok()
            .as_deref()
            == Some(inputs)
}

/// Copies `from` to `to` through a temporary file beside `to`, this process's own, so that
/// a reader never sees half a component (nor one build another's half).
fn copy_into_place(from: &Path, to: &Path) -> anyhow::Result<()> {
    let mut temporary = to.as_os_str().to_owned();
    temporary.push(format!(".tmp.{}", std::process::id()));
    let temporary = PathBuf::from(temporary);
    std::fs::copy(from, &temporary)
        .with_context(|| format!("copying {} to {}", from.display(), temporary.display()))?;
    std::fs::rename(&temporary, to).with_context(|| format!("writing {}", to.display()))?;
    Ok(())
}

fn remove_dir(dir: &Path) -> anyhow::Result<()> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(error).with_context(|| format!("removing {}", dir.display())),
    }
}

fn digest_file(path: &Path) -> Option<Vec<u8>> {
    let bytes = std::fs::read(path).ok()?;
    Some(sha2::Sha256::digest(&bytes).to_vec())
}

/// Directories a walk skips: what tools write beside sources, bytecode, installed packages
/// and package metadata at any depth; at a walked directory's top (`top`), setuptools'
/// and cargo's build directories.
fn skipped(name: &OsStr, top: bool) -> bool {
    let name = name.to_string_lossy();
    name == "__pycache__"
        || name == "node_modules"
        || name.ends_with(".egg-info")
        || name.starts_with('.')
        || top && (name == "build" || name == "target")
}

/// A digest of `paths`, in order: a directory's every file (paths relative to it, and
/// contents), a file's contents; and of `salt`.
pub fn digest_paths<'a>(
    paths: impl IntoIterator<Item = &'a Path>,
    salt: &str,
) -> anyhow::Result<String> {
    let mut hasher = sha2::Sha256::new();
    hasher.update(salt.as_bytes());
    for path in paths {
        hasher.update([0xff]);
        let mut files = Vec::new();
        if path.is_file() {
            // A file (a wheel, a tarball, agent.toml): its bytes.
            files.push((String::new(), path.to_owned()));
        } else {
            walk(path, path, &mut files)?;
        }
        files.sort();
        for (relative, path) in files {
            let bytes =
                std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
            hasher.update(relative.as_bytes());
            hasher.update([0]);
            hasher.update(u64::try_from(bytes.len()).unwrap_or(u64::MAX).to_le_bytes());
            hasher.update(&bytes);
        }
    }
    Ok(hex::encode(hasher.finalize()))
}

fn walk(root: &Path, dir: &Path, files: &mut Vec<(String, PathBuf)>) -> anyhow::Result<()> {
    let entries = std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?;
    for entry in entries {
        let entry = entry?;
        let path = entry.path();
        if path.is_dir() {
            if !skipped(&entry.file_name(), dir == root) {
                walk(root, &path, files)?;
            }
        } else if path.is_file() && !entry.file_name().to_string_lossy().ends_with(".pyc") {
            let relative = path.strip_prefix(root).unwrap_or(&path);
            files.push((relative.to_string_lossy().into_owned(), path));
        }
    }
    Ok(())
}

/// The local packages `source`'s component is built from beside its directory: those its
/// `requirements.txt` (Python) or `package.json` (JavaScript) names. (Cargo tracks a Rust
/// action's own.)
pub fn local_dependencies(source: &Source) -> anyhow::Result<Vec<PathBuf>> {
    let requirements = source.dir.join("requirements.txt");
    let package = source.dir.join("package.json");
    match source.lang {
        Lang::Python if requirements.is_file() => {
            python_local_dependencies(&source.dir, &requirements)
        }
        Lang::Js if package.is_file() => js_local_dependencies(&source.dir, &package),
        _ => Ok(Vec::new()),
    }
}

/// The local packages a `requirements.txt` names, with paths as `pip` reads them, from the
/// action's directory: path lines (`./pkg`, `../sdk/python[extra]`, `-e ./pkg`, a wheel's
/// path), `NAME @ file:...` URLs, and those of the files it includes with `-r` (each named
/// from beside the file that includes it, read once), those files among them.
fn python_local_dependencies(dir: &Path, requirements: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut local = Vec::new();
    let mut read = vec![requirements.to_owned()];
    let mut pending = vec![requirements.to_owned()];
    while let Some(file) = pending.pop() {
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        let beside = file.parent().unwrap_or(dir);
        for line in text.lines() {
            // Comments, then environment markers, go.
            let line = match line.find('#') {
                Some(0) => "",
                Some(at) if line[..at].ends_with(char::is_whitespace) => &line[..at],
                _ => line,
            };
            let line = line.split(';').next().unwrap_or_default().trim();
            for flag in ["-r", "--requirement"] {
                if let Some(included) = line
                    .strip_prefix(flag)
                    .filter(|rest| rest.starts_with([' ', '=']))
                {
                    let included = beside.join(included.trim_start_matches('=').trim());
                    if !read.contains(&included) {
                        read.push(included.clone());
                        local.push(included.clone());
                        pending.push(included);
                    }
                }
            }
            let line = ["-e", "--editable"]
                .iter()
                .find_map(|flag| {
                    line.strip_prefix(flag)
                        .filter(|rest| rest.starts_with([' ', '=']))
                })
                .map_or(line, |rest| rest.trim_start_matches('=').trim());
            let path = match line.split_once(" @ ") {
                Some((_, url)) => url
                    .trim()
                    .strip_prefix("file://")
                    .or_else(|| url.trim().strip_prefix("file:")),
                None if line.starts_with(['.', '/']) => Some(line),
                None => None,
            };
            // Extras (`pkg[extra]`) are not part of the path.
            let Some(path) = path.map(|path| path.split('[').next().unwrap_or(path)) else {
                continue;
            };
            let path = dir.join(path);
            if path.exists() {
                local.push(path);
            }
        }
    }
    Ok(local)
}

/// The local packages a `package.json` depends on (`file:` dependencies: directories and
/// tarballs).
fn js_local_dependencies(dir: &Path, package: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(package)
        .with_context(|| format!("reading {}", package.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not JSON", package.display()))?;
    let mut local = Vec::new();
    for field in ["dependencies", "devDependencies"] {
        for spec in json[field]
            .as_object()
            .into_iter()
            .flat_map(|deps| deps.values())
        {
            if let Some(path) = spec.as_str().and_then(|spec| spec.strip_prefix("file:")) {
                let path = dir.join(path);
                if path.exists() {
                    local.push(path);
                }
            }
        }
    }
    Ok(local)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every way a requirements file names a local package is tracked, and nothing else.
    #[test]
    fn a_requirements_files_local_packages_are_found_however_written() {
        let dir = tempfile::tempdir().expect("tempdir");
        let action = dir.path().join("action");
        for made in ["sdk", "pkg", "editable", "url", "nested/inner"] {
            std::fs::create_dir_all(dir.path().join(made)).expect("mkdir");
        }
        std::fs::create_dir_all(&action).expect("mkdir");
        std::fs::write(dir.path().join("wheel.whl"), b"w").expect("write");
        std::fs::write(
            dir.path().join("nested/more.txt"),
            "# paths from the action's directory, as pip reads them\n../nested/inner\n",
        )
        .expect("write");
        std::fs::write(
            action.join("requirements.txt"),
            "# a comment\n\
             ../sdk  # the SDK\n\
             ../pkg[extra] ; python_version >= \"3.11\"\n\
             -e ../editable\n\
             --editable=../editable\n\
             thing @ file:../url\n\
             ../wheel.whl\n\
             -r ../nested/more.txt\n\
             requests==2.32.0\n\
             ../missing\n",
        )
        .expect("write");
        let found =
            python_local_dependencies(&action, &action.join("requirements.txt")).expect("read");
        let found: Vec<String> = found
            .iter()
            .map(|path| {
                let path = path.canonicalize().expect("exists");
                let base = dir.path().canonicalize().expect("exists");
                path.strip_prefix(&base)
                    .expect("under")
                    .display()
                    .to_string()
            })
            .collect();
        assert_eq!(
            found,
            [
                "sdk",
                "pkg",
                "editable",
                "editable",
                "url",
                "wheel.whl",
                "nested/more.txt",
                "nested/inner"
            ]
        );
    }
}
