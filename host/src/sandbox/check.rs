//! Whether a component fits the `rewind:action/action` world.

use wasmtime::Engine;
use wasmtime::component::Component;
use wasmtime::component::types::ComponentItem;

/// The world's own interfaces, at each version this host runs (a component imports one
/// version's).
const WORLD_IMPORTS: [&str; 6] = [
    "rewind:action/types@0.2.0",
    "rewind:action/durable@0.2.0",
    "rewind:action/context@0.2.0",
    "rewind:action/types@0.1.0",
    "rewind:action/durable@0.1.0",
    "rewind:action/context@0.1.0",
];

/// WASI 0.2 packages linked into the sandbox (with nothing granted: no files, no sockets).
const WASI_PACKAGES: [&str; 6] = ["cli", "clocks", "filesystem", "io", "random", "sockets"];

/// What `rewind check` reports about a component.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CheckReport {
    pub imports: Vec<String>,
    pub exports: Vec<String>,
    /// Why the component does not fit; empty when it does.
    pub problems: Vec<String>,
}

impl CheckReport {
    pub fn fits(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Whether `name` is an import the sandbox provides.
pub fn import_allowed(name: &str) -> bool {
    if WORLD_IMPORTS.contains(&name) {
        return true;
    }
    let Some(rest) = name.strip_prefix("wasi:") else {
        return false;
    };
    let Some((path, version)) = rest.split_once('@') else {
        return false;
    };
    let package = path.split('/').next().unwrap_or_default();
    WASI_PACKAGES.contains(&package) && version.starts_with("0.2.")
}

/// Checks the imports and exports of a compiled component against the world.
pub fn check(engine: &Engine, component: &Component) -> CheckReport {
    let ty = component.component_type();
    let mut report = CheckReport::default();
    for (name, _) in ty.imports(engine) {
        if !import_allowed(name) {
            report.problems.push(format!(
                "imports `{name}`, which is neither part of the rewind:action world (0.2.0 or \
                 0.1.0) nor WASI 0.2 (cli, clocks, filesystem, io, random, sockets)"
            ));
        }
        report.imports.push(name.to_owned());
    }
    let mut has_run = false;
    for (name, item) in ty.exports(engine) {
        if name == "run" {
            match item.ty {
                ComponentItem::ComponentFunc(_) => has_run = true,
                _ => report
                    .problems
                    .push("exports `run`, but not as a function".to_owned()),
            }
        }
        report.exports.push(name.to_owned());
    }
    if !has_run {
        report.problems.push(
            "does not export `run: func(event: event) -> result<_, string>` (world \
             rewind:action/action)"
                .to_owned(),
        );
    }
    report
}

#[cfg(test)]
mod tests {
    use super::import_allowed;

    #[test]
    fn world_and_wasi_p2_imports_are_allowed() {
        assert!(import_allowed("rewind:action/durable@0.1.0"));
        assert!(import_allowed("rewind:action/durable@0.2.0"));
        assert!(import_allowed("wasi:cli/environment@0.2.6"));
        assert!(import_allowed("wasi:io/streams@0.2.0"));
    }

    #[test]
    fn other_imports_are_refused() {
        assert!(!import_allowed("wasi:http/outgoing-handler@0.2.0"));
        assert!(!import_allowed("wasi:cli/environment@0.3.0"));
        assert!(!import_allowed("acme:evil/net@1.0.0"));
        assert!(!import_allowed("rewind:action/durable@0.3.0"));
    }
}
