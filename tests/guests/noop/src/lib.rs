//! The trivial action: does nothing and completes. Measures the cost of starting and
//! running a component.

use rewind_guest::{Action, Context, Error, Event};

/// Completes without calling, sending or remembering anything.
#[derive(Debug)]
struct Noop;

impl Action for Noop {
    fn run(_ctx: &mut Context, _event: Event) -> Result<(), Error> {
        Ok(())
    }
}

rewind_guest::export_action!(Noop);
