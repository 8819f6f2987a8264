//! An action that misbehaves on request, for the host's sandbox tests.
//!
//! Payload: `{"mode": "<mode>"}`:
//!
//! | mode | does |
//! |---|---|
//! | `loop` | spins forever without allocating |
//! | `alloc` | allocates 1 MiB blocks, each filled with nonzero bytes, until stopped |
//! | `read-file` | reads `/etc/passwd`; outputs `{"content": ..}` or `{"error": ..}` |
//! | `socket` | connects to `127.0.0.1:<port>` (`port`, default 80); outputs `{"connected": true}` or `{"error": ..}` |
//! | `print` | writes a line to stdout and one to stderr; outputs `{"printed": true}` |
//! | `flood` | prints 256 KiB to stdout; outputs `{"printed": 262144}` |
//! | `ambient` | reports what it finds of environment, arguments and stdin |
//! | `trap` | panics with `boom` |
//! | `stack-overflow` | recurses until the call stack is exhausted |
//! | `out-of-bounds` | reads memory past the end of its linear memory |
//! | `memory` | sets `count` memory values of `bytes` bytes (names `m0`, `m1`, ...; `name-bytes` makes each name that long) |
//! | `sends` | sends `count` events of kind `flood` whose payload is a JSON string of `bytes` bytes |
//! | `logs` | logs `count` lines of `bytes` bytes through the host's log |
//! | `forge` | logs a message and prints a line holding a newline and a forged host log line |
//! | `fail` | returns an error of `bytes` bytes of control characters |

use std::hint::black_box;
use std::io::Write;

use rewind_guest::{Action, Context, Error, Event};
use serde::Deserialize;
use serde_json::json;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Mode {
    Loop,
    Alloc,
    ReadFile,
    Socket,
    Print,
    Flood,
    Ambient,
    Trap,
    StackOverflow,
    OutOfBounds,
    Memory,
    Sends,
    Logs,
    Forge,
    Fail,
}

#[derive(Debug, Deserialize)]
struct Script {
    mode: Mode,
    /// `socket`: the loopback port to connect to (default 80).
    #[serde(default = "default_port")]
    port: u16,
    /// The floods: how many times.
    #[serde(default)]
    count: usize,
    /// The floods: bytes of each value, payload, line or error.
    #[serde(default)]
    bytes: usize,
    /// `memory`: bytes of each name (default: as short as `m<index>`).
    #[serde(default, rename = "name-bytes")]
    name_bytes: usize,
}

fn default_port() -> u16 {
    80
}

/// Does what its payload's `mode` asks.
#[derive(Debug)]
struct Hostile;

impl Action for Hostile {
    fn run(ctx: &mut Context, event: Event) -> Result<(), Error> {
        let script: Script = event.payload()?;
        match script.mode {
            Mode::Loop => spin(),
            Mode::Alloc => hoard(),
            Mode::ReadFile => match std::fs::read_to_string("/etc/passwd") {
                Ok(content) => ctx.output(&json!({ "content": content })),
                Err(error) => ctx.output(&json!({ "error": error.to_string() })),
            },
            Mode::Socket => match std::net::TcpStream::connect(("127.0.0.1", script.port)) {
                Ok(_stream) => ctx.output(&json!({ "connected": true })),
                Err(error) => ctx.output(&json!({ "error": error.to_string() })),
            },
            Mode::Print => {
                println!("hello from stdout");
                eprintln!("hello from stderr");
                // Make sure the lines reach the host before the run ends.
                std::io::stdout().flush()?;
                ctx.output(&json!({ "printed": true }))
            }
            Mode::Flood => {
                let line = "x".repeat(1023);
                for _ in 0..256 {
                    println!("{line}");
                }
                std::io::stdout().flush()?;
                ctx.output(&json!({ "printed": 256 * 1024 }))
            }
            Mode::Ambient => {
                let mut stdin = String::new();
                let read = std::io::Read::read_to_string(&mut std::io::stdin(), &mut stdin);
                ctx.output(&json!({
                    "env": std::env::vars().count(),
                    "args": std::env::args().count(),
                    "stdin": match read {
                        Ok(n) => json!({ "read": n }),
                        Err(error) => json!({ "error": error.to_string() }),
                    },
                }))
            }
            Mode::Trap => panic!("boom"),
            Mode::StackOverflow => ctx.output(&json!({ "depth": deep(0) })),
            Mode::OutOfBounds => ctx.output(&json!({ "read": past_the_end() })),
            Mode::Memory => {
                // A JSON string of `bytes` bytes, quotes included, made once: the flood
                // costs the guest little fuel.
                let value = serde_json::to_string(&"m".repeat(script.bytes.saturating_sub(2)))?;
                for index in 0..script.count {
                    let mut name = format!("m{index}");
                    if name.len() < script.name_bytes {
                        name.push_str(&"n".repeat(script.name_bytes - name.len()));
                    }
                    rewind_guest::bindings::rewind::action::context::memory_set(&name, &value);
                }
                ctx.output(&json!({ "set": script.count }))
            }
            Mode::Sends => {
                let event = Event::new("flood", &"s".repeat(script.bytes.saturating_sub(2)))?;
                for _ in 0..script.count {
                    ctx.send_event(event.clone());
                }
                ctx.output(&json!({ "sent": script.count }))
            }
            Mode::Logs => {
                let line = "l".repeat(script.bytes);
                for _ in 0..script.count {
                    ctx.info(&line);
                }
                ctx.output(&json!({ "logged": script.count }))
            }
            Mode::Forge => {
                let forged = "INFO rewind: the host says all is well";
                ctx.warn(&format!("innocent\n{forged}\r\u{1b}[2K"));
                println!("printed\r{forged}");
                std::io::stdout().flush()?;
                ctx.output(&json!({ "forged": true }))
            }
            Mode::Fail => Err(Error::msg("\u{1}".repeat(script.bytes))),
        }
    }
}

/// Recurses without end: each call is a frame of the wasm call stack, which the host
/// bounds; `black_box` keeps the recursion from being turned into a loop.
#[allow(unconditional_recursion, reason = "the stack must run out")]
fn deep(depth: u64) -> u64 {
    black_box(deep(black_box(depth + 1))) + 1
}

/// Reads a byte at the top of the 32-bit address space, far past any memory the guest
/// may grow: the host traps the access.
#[inline(never)]
#[allow(
    unsafe_code,
    reason = "a test guest that must make an out-of-bounds access"
)]
fn past_the_end() -> u8 {
    let address = black_box(usize::MAX - 15) as *const u8;
    // SAFETY: none; that the access traps instead of reading is what is tested.
    unsafe { std::ptr::read_volatile(address) }
}

/// Burns CPU forever; `black_box` keeps the loop from being optimised away.
fn spin() -> ! {
    let mut counter = 0_u64;
    loop {
        counter = black_box(counter.wrapping_add(1));
    }
}

/// Takes memory until the host stops it. Each block is written (nonzero), so the pages
/// are really touched.
fn hoard() -> ! {
    const BLOCK: usize = 1 << 20;
    let mut blocks: Vec<Vec<u8>> = Vec::new();
    loop {
        blocks.push(black_box(vec![0xA5_u8; BLOCK]));
        black_box(&blocks);
    }
}

rewind_guest::export_action!(Hostile);
