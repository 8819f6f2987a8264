//! An action built against `rewind:action@0.1.0` (guest-sdk/wit/0.1.0/), the world before durable
//! waits, with wit-bindgen directly: hosts of later versions must still run it. It calls
//! `durable.call(payload.function, "{}")` and sends an output with the result and its key
//! and sequence.

// The generated bindings and export glue are unsafe code, as the SDK's are.
#![allow(unsafe_code)]

wit_bindgen::generate!({
    path: "../../../guest-sdk/wit/0.1.0",
    world: "action",
});

use rewind::action::{context, durable, types};

struct V0;

impl Guest for V0 {
    fn run(event: types::Event) -> Result<(), String> {
        let function = event
            .payload
            .split('"')
            .nth(3)
            .ok_or_else(|| format!("expected {{\"function\": \"...\"}}, got {}", event.payload))?
            .to_owned();
        let result = durable::call(&function, "{}").map_err(|error| format!("{error:?}"))?;
        context::send(&types::Event {
            kind: "output".to_owned(),
            payload: format!(
                "{{\"key\":\"{}\",\"sequence\":{},\"result\":{result}}}",
                context::key(),
                context::sequence()
            ),
        });
        Ok(())
    }
}

export!(V0);
