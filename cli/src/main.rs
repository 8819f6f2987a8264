//! `rewind`: run agents over input files, check components, inspect what runs recorded.

mod cli;

use clap::Parser;

/// Every durable call allocates (its record, the state's encoding, the log's message), on
/// whichever worker thread runs it: mimalloc's per-thread heaps keep that cheap where
/// with glibc's, the host's CPU time per call on the JetStream log was about 60 % higher
/// (BENCHMARKS.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    let args = cli::Cli::parse();
    cli::init_tracing(args.verbose);
    let counts = match cli::test_hooks(&args) {
        Ok(counts) => counts,
        Err(e) => {
            eprintln!("error: {}", describe(&e));
            return std::process::ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let code = match runtime.block_on(cli::main(args)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", describe(&e));
            std::process::ExitCode::FAILURE
        }
    };
    if let Some(path) = counts {
        let counts = serde_json::to_string(&rewind_host::crash::counts()).unwrap_or_default();
        if let Err(e) = std::fs::write(&path, counts) {
            eprintln!(
                "error: writing crash point counts to {}: {e}",
                path.display()
            );
        }
    }
    code
}

/// The error and its causes, each said once: many errors here already print their cause in
/// their own message.
fn describe(error: &anyhow::Error) -> String {
    let mut message = error.to_string();
    for cause in error.chain().skip(1) {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
    }
    message
}
