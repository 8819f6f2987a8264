//! `rewind new agent NAME` and `rewind new action NAME`: a new agent that builds, runs and
//! passes `rewind test` at once, and an action added to one.
//!
//! A new agent holds agent.toml, one action, sample inputs, and the three SDK packages the
//! binary carries (`sdk/rust`, `sdk/python`, `sdk/js`), which its actions depend on by path
//! until the SDKs are published. Rust actions share one Cargo workspace at the agent's
//! root, with a lockfile pinned to the versions this release was built with.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use rewind_host::agent::AgentFile;

use super::sdk::{self, Carried};

#[derive(Debug, clap::Args)]
pub struct NewArgs {
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, clap::Subcommand)]
enum What {
    /// A new agent in directory NAME: agent.toml, one action (`greet`), sample inputs,
    /// and the SDKs its actions build against.
    Agent {
        /// The agent's name, and its directory's.
        name: String,
        /// The language of its first action.
        #[arg(long, value_enum, default_value_t = Language::Rust)]
        lang: Language,
        /// Where to make it (default: ./NAME).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// A new action in an agent: its source in actions/NAME, an [[actions]] entry run by
    /// events of kind NAME.
    Action {
        /// The action's name, and the event kind that runs it.
        name: String,
        #[arg(long, value_enum)]
        lang: Language,
        /// The agent to add it to.
        #[arg(long, default_value = "agent.toml")]
        agent: PathBuf,
    },
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Language {
    Rust,
    Python,
    Js,
}

/// The name of a new agent's first action.
const FIRST_ACTION: &str = "greet";

macro_rules! template {
    ($path:literal => $source:literal) => {
        Carried {
            path: $path,
            bytes: include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/templates/", $source)),
        }
    };
}

const AGENT: &[Carried] = &[
    template!("agent.toml" => "agent/agent.toml"),
    template!("inputs.jsonl" => "agent/inputs.jsonl"),
    template!("README.md" => "agent/README.md"),
    template!(".gitignore" => "agent/gitignore"),
];

const WORKSPACE: Carried = template!("Cargo.toml" => "agent/Cargo.toml");

const RUST_ACTION: &[Carried] = &[
    template!("Cargo.toml" => "rust/Cargo.toml"),
    template!("src/lib.rs" => "rust/src/lib.rs"),
];

const PYTHON_ACTION: &[Carried] = &[
    template!("action.py" => "python/action.py"),
    template!("requirements.txt" => "python/requirements.txt"),
];

const JS_ACTION: &[Carried] = &[
    template!("action.js" => "js/action.js"),
    template!("package.json" => "js/package.json"),
];

pub fn new(args: NewArgs) -> anyhow::Result<ExitCode> {
    match args.what {
        What::Agent { name, lang, dir } => {
            let dir = dir.unwrap_or_else(|| PathBuf::from(&name));
            new_agent(&name, lang, &dir)?;
            eprintln!(
                "made agent `{name}` in {}; next:\n  cd {}\n  rewind build\n  rewind run agent.toml --input inputs.jsonl\n  rewind test agent.toml --input inputs.jsonl",
                dir.display(),
                dir.display()
            );
        }
        What::Action { name, lang, agent } => {
            new_action(&name, lang, &agent)?;
            eprintln!(
                "added action `{name}` to {} (source actions/{name}, run by events of kind \
                 `{name}`: send one with ctx.send(\"{name}\", ...)); `rewind build` builds it",
                agent.display()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn new_agent(name: &str, lang: Language, dir: &Path) -> anyhow::Result<()> {
    check_name("agent", name)?;
    if dir.exists() && std::fs::read_dir(dir)?.next().is_some() {
        bail!(
            "{} exists and is not empty: choose another name or --dir",
            dir.display()
        );
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let fill = |text: &str| {
        text.replace("{{agent}}", name)
            .replace("{{action}}", FIRST_ACTION)
    };
    write_filled(dir, AGENT, fill)?;
    add_sdks(dir)?;
    add_source(dir, name, FIRST_ACTION, lang)?;
    AgentFile::load(&dir.join("agent.toml")).context("the new agent.toml")?;
    Ok(())
}

fn new_action(name: &str, lang: Language, agent_path: &Path) -> anyhow::Result<()> {
    check_name("action", name)?;
    let agent = AgentFile::load(agent_path)?;
    if agent
        .config
        .actions
        .iter()
        .any(|action| action.name == name)
    {
        bail!("{} has an action `{name}` already", agent_path.display());
    }
    let dir = agent_path.parent().unwrap_or_else(|| Path::new("."));
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    if dir.join("actions").join(name).exists() {
        bail!(
            "{} exists already: remove it, or choose another name",
            dir.join("actions").join(name).display()
        );
    }
    // The new entry is checked before anything is written, so that a refusal leaves
    // nothing behind.
    let mut text = std::fs::read_to_string(agent_path)?;
    if !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(&format!(
        "\n[[actions]]\nname = \"{name}\"\ncomponent = \"build/{name}.wasm\"\non = [\"{name}\"]\n"
    ));
    AgentFile::parse(agent_path, &text).context("agent.toml with the new action")?;
    add_sdks(dir)?;
    add_source(dir, &agent.config.name, name, lang)?;
    std::fs::write(agent_path, text)
        .with_context(|| format!("writing {}", agent_path.display()))?;
    Ok(())
}

/// Writes the SDK packages the agent's actions depend on, where they are missing.
fn add_sdks(dir: &Path) -> anyhow::Result<()> {
    for (name, files) in [
        ("rust", sdk::RUST),
        ("python", sdk::PYTHON),
        ("js", sdk::JS),
    ] {
        let path = dir.join("sdk").join(name);
        if !path.exists() {
            sdk::write(&path, files)?;
        }
    }
    Ok(())
}

/// Writes the source of action `name` of agent `agent` in `lang` to `dir/actions/name`,
/// and for Rust makes it a member of the agent's workspace. A Rust action's package is
/// named `AGENT-ACTION`: cargo names a cdylib by its package alone, so two agents' `greet`
/// built in one target directory would overwrite each other's component.
fn add_source(dir: &Path, agent: &str, name: &str, lang: Language) -> anyhow::Result<()> {
    let source = dir.join("actions").join(name);
    let type_name = type_name(name);
    let package: String = format!("{agent}-{name}")
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '_' => c,
            'A'..='Z' => c.to_ascii_lowercase(),
            _ => '-',
        })
        .collect();
    let fill = |text: &str| {
        text.replace("{{name}}", name)
            .replace("{{crate}}", &package)
            .replace("{{Type}}", &type_name)
    };
    match lang {
        Language::Rust => {
            write_filled(&source, RUST_ACTION, fill)?;
            add_member(dir, &format!("actions/{name}"))?;
        }
        Language::Python => write_filled(&source, PYTHON_ACTION, fill)?,
        Language::Js => write_filled(&source, JS_ACTION, fill)?,
    }
    Ok(())
}

/// Adds `member` to the workspace at `dir`, making it (with the SDK's pinned lockfile)
/// when there is none.
fn add_member(dir: &Path, member: &str) -> anyhow::Result<()> {
    let manifest = dir.join("Cargo.toml");
    if !manifest.exists() {
        sdk::write(dir, &[WORKSPACE])?;
        std::fs::write(dir.join("Cargo.lock"), sdk::rust_lockfile())?;
    }
    let text = std::fs::read_to_string(&manifest)?;
    let added = with_member(&text, member)
        .filter(|added| {
            // What cargo will read: the member among the workspace's members.
            let table: Option<toml::Table> = added.parse().ok();
            let members = table
                .as_ref()
                .and_then(|t| t.get("workspace")?.get("members")?.as_array().cloned());
            members.is_some_and(|members| members.iter().any(|m| m.as_str() == Some(member)))
        })
        .with_context(|| {
            format!(
                "{}: cannot add \"{member}\" to its workspace's `members = [...]`: add it by hand",
                manifest.display()
            )
        })?;
    std::fs::write(&manifest, added).with_context(|| format!("writing {}", manifest.display()))?;
    Ok(())
}

/// `manifest` with `member` added at the end of the `members = [...]` that starts a line,
/// the rest (comments, layout) as it was; `None` without one.
fn with_member(manifest: &str, member: &str) -> Option<String> {
    let start = manifest
        .match_indices("members")
        .map(|(at, _)| at)
        .find(|&at| {
            (at == 0 || manifest[..at].ends_with('\n'))
                && manifest[at + "members".len()..]
                    .trim_start()
                    .starts_with('=')
        })?;
    let open = start + manifest[start..].find('[')?;
    let close = open + manifest[open..].find(']')?;
    let inside = &manifest[open + 1..close];
    let empty = inside
        .lines()
        .map(|line| line.split('#').next().unwrap_or_default().trim())
        .all(str::is_empty);
    let trimmed = inside.trim_end();
    // A list over several lines gets a line of its own (its last item's comma is the
    // list's: without one, the caller's parse refuses the result); one on a line, an item.
    let added = if inside.contains('\n') {
        format!("{trimmed}\n    \"{member}\",\n")
    } else if empty {
        format!("\"{member}\"")
    } else {
        format!("{}, \"{member}\"", trimmed.trim_end_matches(','))
    };
    Some(format!(
        "{}{added}{}",
        &manifest[..open + 1],
        &manifest[close..]
    ))
}

fn write_filled(
    dir: &Path,
    files: &[Carried],
    fill: impl Fn(&str) -> String,
) -> anyhow::Result<()> {
    for file in files {
        let path = dir.join(file.path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let text = std::str::from_utf8(file.bytes).context("a template is not UTF-8")?;
        std::fs::write(&path, fill(text)).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// A name is a Cargo package's, an event kind's and a directory's: a lowercase letter, then
/// lowercase letters, digits, `-` or `_`.
fn check_name(what: &str, name: &str) -> anyhow::Result<()> {
    let mut chars = name.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_lowercase());
    if !first_ok
        || !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
    {
        bail!(
            "`{name}` is not a usable {what} name: a lowercase letter, then lowercase letters, \
             digits, `-` or `_`"
        );
    }
    Ok(())
}

/// `order-lookup` as a type's name: `OrderLookup`.
fn type_name(name: &str) -> String {
    name.split(['-', '_'])
        .map(|word| {
            let mut chars = word.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_ascii_uppercase().to_string() + chars.as_str()
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_is_added_to_the_list_that_starts_a_line() {
        let manifest =
            "[workspace]\ndefault-members = [\"a\"]\nmembers = [\n  \"a\", # the first\n]\n";
        assert_eq!(
            with_member(manifest, "actions/b").as_deref(),
            Some(
                "[workspace]\ndefault-members = [\"a\"]\nmembers = [\n  \"a\", # the first\n    \"actions/b\",\n]\n"
            )
        );
        assert_eq!(
            with_member("[workspace]\nmembers = []\n", "x").as_deref(),
            Some("[workspace]\nmembers = [\"x\"]\n")
        );
        assert_eq!(
            with_member("[workspace]\nmembers = [\"a\"]\n", "x").as_deref(),
            Some("[workspace]\nmembers = [\"a\", \"x\"]\n")
        );
        assert_eq!(with_member("[workspace]\n", "x"), None);
    }
}
