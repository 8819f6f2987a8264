//! `{{name}}`: greets each input by name, counts the key's visits in its memory, and draws
//! a lucky number with a durable call. The call's result is recorded: when the input runs
//! again after a crash, the same number comes back and the call is not made twice.
//!
//! Input payload: `{"name": "Ada"}`. Output: `{"greeting", "visits", "lucky"}`.

use rewind_guest::{Action, Context, Error, Event};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct Input {
    name: String,
}

/// What `dice.roll` (a `random` function in agent.toml) answers.
#[derive(Deserialize)]
struct Roll {
    u64: u64,
}

#[derive(Serialize)]
struct Greeting {
    greeting: String,
    visits: u64,
    lucky: u64,
}

struct {{Type}}Action;

impl Action for {{Type}}Action {
    fn run(ctx: &mut Context, event: Event) -> Result<(), Error> {
        let input: Input = event.payload()?;
        let visits = ctx.memory::<u64>("visits")?.unwrap_or(0) + 1;
        ctx.set_memory("visits", &visits)?;
        let roll: Roll = ctx.call("dice.roll", &serde_json::json!({}))?;
        ctx.info(&format!("greeting {} (visit {visits})", input.name));
        ctx.output(&Greeting {
            greeting: format!("Hello, {}!", input.name),
            visits,
            lucky: roll.u64 % 100,
        })
    }
}

rewind_guest::export_action!({{Type}}Action);
