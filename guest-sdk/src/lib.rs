//! Write Rewind agent actions in Rust.
//!
//! An action is a WebAssembly component that handles one event. Everything it does outside
//! its sandbox goes through a durable call ([`Context::call`]): the host records each
//! call's result, and when the same input is run again (after a crash, say) the recorded
//! result is returned instead of calling the outside world again.
//!
//! Implement [`Action`] for a type and export it with [`export_action!`]:
//!
//! ```no_run
//! use rewind_guest::{Action, Context, Error, Event};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Deserialize)]
//! struct Ticket {
//!     ticket_id: String,
//!     order_id: String,
//! }
//!
//! #[derive(Serialize)]
//! struct Lookup<'a> {
//!     order_id: &'a str,
//! }
//!
//! #[derive(Deserialize, Serialize)]
//! struct Order {
//!     order_id: String,
//!     status: String,
//! }
//!
//! struct Status;
//!
//! impl Action for Status {
//!     fn run(ctx: &mut Context, event: Event) -> Result<(), Error> {
//!         let ticket: Ticket = event.payload()?;
//!         let order: Order = ctx.call("orders.lookup", &Lookup { order_id: &ticket.order_id })?;
//!         ctx.info(&format!("ticket {} is about order {}", ticket.ticket_id, order.order_id));
//!         ctx.output(&order)
//!     }
//! }
//!
//! rewind_guest::export_action!(Status);
//! # fn main() {}
//! ```
//!
//! Build the crate as a `cdylib` for `wasm32-wasip2`; the `.wasm` file cargo writes is
//! the component to name in `agent.toml`.

// Lets the generated code and `export_action!` use one path, `::rewind_guest`, both here
// and in user crates.
extern crate self as rewind_guest;

mod context;
mod error;
mod event;
mod level;
mod signal;

#[doc(hidden)]
pub mod bindings;

pub use context::Context;
pub use error::{CallError, Error};
pub use event::Event;
pub use level::Level;
pub use signal::Signal;

/// An agent action: the code run for each event whose kind the action is bound to.
///
/// The type implementing it is never instantiated; it only names the action, so a unit
/// struct is enough. Export it as the component's entry point with [`export_action!`].
///
/// # Contract
///
/// - Returning `Ok(())` completes the run: the events it sent and the memory it set are
///   applied.
/// - Returning `Err` fails the run: its sends and memory writes are dropped, and the error's
///   text is reported by the host. Durable calls it made stay recorded, so running the
///   same input again gets the same results without calling out again.
/// - A panic fails the run too: the host reports it with the message and place that Rust's
///   panic hook writes to stderr (`panicked at src/lib.rs:12:9: ...`). (The SDK installs
///   no hook of its own: `std::panic::set_hook` links the formatting machinery into every
///   component, which made a trivial one four times larger and its start 60 % slower.)
///
/// # Example
///
/// ```no_run
/// use rewind_guest::{Action, Context, Error, Event};
///
/// struct Echo;
///
/// impl Action for Echo {
///     fn run(ctx: &mut Context, event: Event) -> Result<(), Error> {
///         let payload: serde_json::Value = event.payload()?;
///         ctx.output(&payload)
///     }
/// }
///
/// rewind_guest::export_action!(Echo);
/// # fn main() {}
/// ```
pub trait Action {
    /// Handles one event.
    ///
    /// `ctx` reaches the host (durable calls, sends, memory, logging); `event` is the
    /// event that triggered this run.
    fn run(ctx: &mut Context, event: Event) -> Result<(), Error>;
}

/// Exports a type implementing [`Action`] as the component's `run` entry point.
///
/// Use it once per crate, at module level, in a `cdylib` crate built for
/// `wasm32-wasip2`.
///
/// # Example
///
/// ```no_run
/// use rewind_guest::{Action, Context, Error, Event};
///
/// struct Noop;
///
/// impl Action for Noop {
///     fn run(_ctx: &mut Context, _event: Event) -> Result<(), Error> {
///         Ok(())
///     }
/// }
///
/// rewind_guest::export_action!(Noop);
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! export_action {
    ($action:ty) => {
        const _: () = {
            type __RewindExportedAction = $crate::__private::Exported<$action>;
            $crate::bindings::export!(
                __RewindExportedAction with_types_in $crate::bindings
            );
        };
    };
}

/// Support for [`export_action!`]; not part of the public API.
#[doc(hidden)]
pub mod __private {
    use core::marker::PhantomData;

    pub use wit_bindgen;

    use crate::bindings;
    use crate::{Action, Context, Event};

    /// Adapts an [`Action`] to the generated `Guest` trait.
    #[derive(Debug)]
    pub struct Exported<A>(PhantomData<A>);

    impl<A: Action> bindings::Guest for Exported<A> {
        fn run(event: bindings::Event) -> Result<(), String> {
            let mut ctx = Context::new();
            let event = Event {
                kind: event.kind,
                payload: event.payload,
            };
            A::run(&mut ctx, event).map_err(|error| error.to_string())
        }
    }
}
