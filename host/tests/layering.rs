//! The layering ARCHITECTURE.md draws, held: each module of the library may name (as
//! `crate::MODULE`) only the modules its line of the `layers` block allows, the block is
//! acyclic, and every module of `lib.rs` has a line. A new arrow is drawn in the document
//! first, or this test says where the code crossed it. (It reads `crate::` paths: a
//! `super::` path that climbed out of a module's own tree would pass unseen.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn host() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The `layers` block of ARCHITECTURE.md: each module and the modules it may use.
fn layers() -> BTreeMap<String, BTreeSet<String>> {
    let path = host().join("../ARCHITECTURE.md");
    let text = std::fs::read_to_string(&path).expect("ARCHITECTURE.md");
    let block = text
        .split("```layers\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("ARCHITECTURE.md has a ```layers block");
    let mut layers = BTreeMap::new();
    for (n, line) in block.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let (module, uses) = line
            .split_once(':')
            .unwrap_or_else(|| panic!("layers line {}: `MODULE: USES...`: {line:?}", n + 1));
        let uses = uses.split_whitespace().map(str::to_owned).collect();
        assert!(
            layers.insert(module.trim().to_owned(), uses).is_none(),
            "layers line {}: {module} twice",
            n + 1
        );
    }
    layers
}

/// The modules `lib.rs` declares.
fn library_modules() -> BTreeSet<String> {
    let lib = std::fs::read_to_string(host().join("src/lib.rs")).expect("lib.rs");
    lib.lines()
        .filter_map(|line| {
            let line = line.trim();
            let rest = line
                .strip_prefix("pub mod ")
                .or_else(|| line.strip_prefix("mod "))?;
            Some(rest.trim_end_matches(';').trim().to_owned())
        })
        .collect()
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, into: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a source directory") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            sources(&path, into);
        } else if path.extension().is_some_and(|e| e == "rs") {
            into.push(path);
        }
    }
}

/// The top-level modules `code` names through `crate::`, each with the line it is on:
/// `crate::store::X`, and each first name of a group, `crate::{log::Log, store}` (over
/// several lines too). Comments are not code.
fn named(code: &str) -> Vec<(usize, String)> {
    let code: String = code
        .lines()
        .map(|line| line.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n");
    let line_of = |at: usize| code[..at].matches('\n').count() + 1;
    let mut names = Vec::new();
    let mut from = 0;
    while let Some(found) = code[from..].find("crate::") {
        let at = from + found;
        from = at + "crate::".len();
        let rest = &code[from..];
        let Some(group) = rest.strip_prefix('{') else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            names.push((line_of(at), name));
            continue;
        };
        // The group's first names, at its own depth.
        let (mut depth, mut name, mut first) = (0, String::new(), true);
        for c in group.chars() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                _ if depth > 0 => {}
                ',' => {
                    if !name.is_empty() {
                        names.push((line_of(at), std::mem::take(&mut name)));
                    }
                    first = true;
                }
                c if first && (c.is_ascii_alphanumeric() || c == '_') => name.push(c),
                _ if first && !name.is_empty() => {
                    names.push((line_of(at), std::mem::take(&mut name)));
                    first = false;
                }
                _ => {}
            }
        }
        if !name.is_empty() {
            names.push((line_of(at), name));
        }
    }
    names
}

#[test]
fn the_code_keeps_the_layering_architecture_md_draws() {
    let layers = layers();
    let modules = library_modules();
    let drawn: BTreeSet<String> = layers.keys().cloned().collect();
    assert_eq!(
        drawn, modules,
        "ARCHITECTURE.md's layers block and lib.rs name different modules"
    );
    for (module, uses) in &layers {
        for used in uses {
            assert!(
                layers.contains_key(used),
                "layers: {module} uses {used}, which has no line"
            );
        }
    }
    // Acyclic: take the modules that use nothing left, until none is left.
    let mut left = layers.clone();
    while !left.is_empty() {
        let free: Vec<String> = left
            .iter()
            .filter(|(_, uses)| uses.iter().all(|u| !left.contains_key(u)))
            .map(|(m, _)| m.clone())
            .collect();
        assert!(
            !free.is_empty(),
            "the layers go round in a cycle among {:?}",
            left.keys().collect::<Vec<_>>()
        );
        for module in free {
            left.remove(&module);
        }
    }

    let src = host().join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let mut crossings = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&src).expect("under src");
        let Some(first) = relative.components().next() else {
            continue;
        };
        let module = first
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_owned();
        let Some(allowed) = layers.get(&module) else {
            // lib.rs, and the binary's main.rs and cli/.
            continue;
        };
        let text = std::fs::read_to_string(file).expect("a source file");
        for (line, used) in named(&text) {
            if used != module && modules.contains(&used) && !allowed.contains(&used) {
                crossings.push(format!(
                    "src/{}:{line}: {module} uses {used}",
                    relative.display()
                ));
            }
        }
    }
    assert!(
        crossings.is_empty(),
        "uses the layering in ARCHITECTURE.md does not allow (draw the arrow there, or \
         move the code):\n{}",
        crossings.join("\n")
    );
}

#[test]
fn code_names_the_modules_it_uses_through_crate() {
    let names = |code: &str| -> Vec<String> { named(code).into_iter().map(|(_, n)| n).collect() };
    assert_eq!(names("use crate::store::{Digest, KeyScope};"), ["store"]);
    assert_eq!(
        names("use crate::{log::{Log, Offset}, store, text::bound};"),
        ["log", "store", "text"]
    );
    assert_eq!(
        named("use crate::{\n    log::Log,\n    store,\n};\nfn f() { crate::event::x() }"),
        [
            (1, "log".to_owned()),
            (1, "store".to_owned()),
            (5, "event".to_owned())
        ]
    );
    assert_eq!(
        names("let x = crate::durable::call(crate::event::Event::new());"),
        ["durable", "event"]
    );
    assert_eq!(names("// crate::server in a comment"), Vec::<String>::new());
}
