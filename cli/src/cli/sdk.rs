//! What the `rewind` binary carries so that an agent can be written and built outside this
//! repository: the three SDK packages as their registries would hold them (each with its
//! own copy of the WIT contract), and the pinned tools `rewind build` installs for Python
//! and JavaScript. `rewind new` writes the packages beside an agent; `rewind build` writes
//! the tools into its cache.
//!
//! The lists name every file of each package; `cli::sdk` in the tests checks them against
//! what `cargo package`, a built wheel and `npm pack` hold, so a file added to an SDK and
//! not here fails a test.

use std::path::Path;

use anyhow::Context as _;

/// One carried file: where it goes, under the directory it is written to, and its bytes.
#[derive(Debug, Clone, Copy)]
pub struct Carried {
    pub path: &'static str,
    pub bytes: &'static [u8],
}

/// `Carried { path, bytes }` of a file of this repository, by its path from the root.
macro_rules! carried {
    ($path:literal => $source:literal) => {
        Carried {
            path: $path,
            bytes: include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/../", $source)),
        }
    };
}

/// The Rust crate `rewind-guest` (`guest-sdk/`).
pub const RUST: &[Carried] = &[
    carried!("Cargo.toml" => "guest-sdk/Cargo.toml"),
    carried!("README.md" => "guest-sdk/README.md"),
    carried!("src/bindings.rs" => "guest-sdk/src/bindings.rs"),
    carried!("src/context.rs" => "guest-sdk/src/context.rs"),
    carried!("src/error.rs" => "guest-sdk/src/error.rs"),
    carried!("src/event.rs" => "guest-sdk/src/event.rs"),
    carried!("src/level.rs" => "guest-sdk/src/level.rs"),
    carried!("src/lib.rs" => "guest-sdk/src/lib.rs"),
    carried!("src/signal.rs" => "guest-sdk/src/signal.rs"),
    carried!("wit/action.wit" => "guest-sdk/wit/action.wit"),
];

/// The Python package `rewind-guest`, module `rewind` (`guest-sdk/python/`). Its WIT is
/// the crate's: in the repository `rewind/wit` links to it, here it is a copy.
pub const PYTHON: &[Carried] = &[
    carried!("pyproject.toml" => "guest-sdk/python/pyproject.toml"),
    carried!("README.md" => "guest-sdk/python/README.md"),
    carried!("rewind/__init__.py" => "guest-sdk/python/rewind/__init__.py"),
    carried!("rewind/componentize-py.toml" => "guest-sdk/python/rewind/componentize-py.toml"),
    carried!("rewind/py.typed" => "guest-sdk/python/rewind/py.typed"),
    carried!("rewind/wit/action.wit" => "guest-sdk/wit/action.wit"),
];

/// The npm package `rewind-guest` (`guest-sdk/js/`), which actions import as `rewind`.
pub const JS: &[Carried] = &[
    carried!("package.json" => "guest-sdk/js/package.json"),
    carried!("README.md" => "guest-sdk/js/README.md"),
    carried!("rewind.d.ts" => "guest-sdk/js/rewind.d.ts"),
    carried!("rewind.js" => "guest-sdk/js/rewind.js"),
];

/// What `rewind build` installs componentize-py from (`cli/tools/python/`).
pub const PYTHON_TOOLS: &[Carried] =
    &[carried!("requirements.txt" => "cli/tools/python/requirements.txt")];

/// What `rewind build` installs esbuild and componentize-js from, and its script that
/// drives them (`cli/tools/js/`), with the WIT componentize-js reads.
pub const JS_TOOLS: &[Carried] = &[
    carried!("package.json" => "cli/tools/js/package.json"),
    carried!("package-lock.json" => "cli/tools/js/package-lock.json"),
    carried!("build.mjs" => "cli/tools/js/build.mjs"),
    carried!("wit/action.wit" => "guest-sdk/wit/action.wit"),
];

/// The workspace's lockfile, from which a new agent's is cut.
const WORKSPACE_LOCK: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.lock"));

/// Writes `files` under `dir`, creating what is missing and replacing what is there.
pub fn write(dir: &Path, files: &[Carried]) -> anyhow::Result<()> {
    for file in files {
        let path = dir.join(file.path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(&path, file.bytes).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// A digest of `files`, paths and contents: what names a version of them.
pub fn digest(files: &[Carried]) -> String {
    use sha2::Digest as _;
    let mut hasher = sha2::Sha256::new();
    for file in files {
        hasher.update(file.path.as_bytes());
        hasher.update([0]);
        hasher.update(
            u64::try_from(file.bytes.len())
                .unwrap_or(u64::MAX)
                .to_le_bytes(),
        );
        hasher.update(file.bytes);
    }
    hex::encode(&hasher.finalize()[..8])
}

/// A `Cargo.lock` for a new agent's workspace: the workspace's own entries for
/// `rewind-guest` and everything it depends on, so that a new agent's Rust actions build
/// with the versions this release was tested with (and, sharing a target directory with
/// this repository, reuse its builds). Cargo adds the agent's own packages to it.
pub fn rust_lockfile() -> String {
    lockfile_closure(WORKSPACE_LOCK, "rewind-guest")
}

/// The entries of `lock` that `root` depends on, transitively, with `root`'s, in the
/// lockfile's order under its header.
fn lockfile_closure(lock: &str, root: &str) -> String {
    let mut blocks = lock.split("\n[[package]]\n");
    let header = blocks.next().unwrap_or_default();
    let packages: Vec<(&str, &str, &str)> = blocks
        .map(|block| {
            let field = |name: &str| {
                block
                    .lines()
                    .find_map(|line| line.strip_prefix(name)?.strip_prefix(" = \""))
                    .and_then(|rest| rest.strip_suffix('"'))
                    .unwrap_or_default()
            };
            (field("name"), field("version"), block)
        })
        .collect();
    let mut wanted = vec![(root.to_owned(), None::<String>)];
    let mut kept = std::collections::BTreeSet::new();
    while let Some((name, version)) = wanted.pop() {
        for (index, (n, v, block)) in packages.iter().enumerate() {
            if *n != name || version.as_deref().is_some_and(|version| version != *v) {
                continue;
            }
            if !kept.insert(index) {
                continue;
            }
            let dependencies = block
                .split_once("dependencies = [")
                .map(|(_, rest)| rest.split_once(']').map_or(rest, |(list, _)| list))
                .unwrap_or_default();
            for dependency in dependencies.split(',') {
                let dependency = dependency.trim().trim_matches('"');
                let mut words = dependency.split(' ');
                if let Some(name) = words.next().filter(|name| !name.is_empty()) {
                    wanted.push((name.to_owned(), words.next().map(str::to_owned)));
                }
            }
        }
    }
    let mut out = String::from(header.trim_end());
    out.push('\n');
    for index in kept {
        out.push_str("\n[[package]]\n");
        out.push_str(packages[index].2.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lockfile_is_cut_to_what_the_root_depends_on() {
        let lock = "# header\nversion = 4\n\n[[package]]\nname = \"a\"\nversion = \"1.0.0\"\ndependencies = [\n \"b 2.0.0\",\n \"c\",\n]\n\n[[package]]\nname = \"b\"\nversion = \"1.0.0\"\n\n[[package]]\nname = \"b\"\nversion = \"2.0.0\"\n\n[[package]]\nname = \"c\"\nversion = \"0.1.0\"\n\n[[package]]\nname = \"unrelated\"\nversion = \"9.0.0\"\n";
        let cut = lockfile_closure(lock, "a");
        assert_eq!(
            cut,
            "# header\nversion = 4\n\n[[package]]\nname = \"a\"\nversion = \"1.0.0\"\ndependencies = [\n \"b 2.0.0\",\n \"c\",\n]\n\n[[package]]\nname = \"b\"\nversion = \"2.0.0\"\n\n[[package]]\nname = \"c\"\nversion = \"0.1.0\"\n"
        );
    }

    #[test]
    fn the_sdk_lockfile_holds_the_sdk_and_its_dependencies() {
        let lock = rust_lockfile();
        for name in ["rewind-guest", "wit-bindgen", "serde", "serde_json"] {
            assert!(
                lock.contains(&format!("\nname = \"{name}\"\n")),
                "{name} missing"
            );
        }
        assert!(
            !lock.contains("name = \"wasmtime\""),
            "the host's dependencies are not the SDK's"
        );
    }
}
