//! `rewind check COMPONENT.wasm`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use rewind_host::sandbox::Sandbox;

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// The component to check.
    component: PathBuf,
}

pub fn check(args: CheckArgs, sandbox: Sandbox) -> anyhow::Result<ExitCode> {
    let wasm = std::fs::read(&args.component)
        .with_context(|| format!("cannot read {}", args.component.display()))?;
    let origin = args.component.display().to_string();
    let report = sandbox.check(&origin, &wasm)?;
    println!("{origin}");
    println!("imports:");
    for import in &report.imports {
        let mark = if rewind_host::sandbox::import_allowed(import) {
            "ok"
        } else {
            "REFUSED"
        };
        println!("  {import}  [{mark}]");
    }
    println!("exports:");
    for export in &report.exports {
        println!("  {export}");
    }
    if report.fits() {
        println!("fits the rewind:action@0.1.0 world");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("does not fit the rewind:action@0.1.0 world:");
        for problem in &report.problems {
            println!("  - {problem}");
        }
        Ok(ExitCode::FAILURE)
    }
}
