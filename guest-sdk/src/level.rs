//! Log levels.

use crate::bindings::rewind::action::types::Level as WitLevel;

/// How much a log line matters, from [`Trace`](Level::Trace) (least) to
/// [`Error`](Level::Error) (most).
///
/// The host writes guest log lines to its own log, tagged with the run they came from.
///
/// # Example
///
/// ```no_run
/// use rewind_guest::{Context, Level};
///
/// fn report(ctx: &Context, retries: u32) {
///     let level = if retries > 3 { Level::Warn } else { Level::Debug };
///     ctx.log(level, &format!("took {retries} retries"));
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Fine-grained detail, usually off.
    Trace,
    /// Detail useful when debugging an action.
    Debug,
    /// Normal progress.
    Info,
    /// Something unexpected that the action handled.
    Warn,
    /// Something failed.
    Error,
}

impl From<Level> for WitLevel {
    fn from(level: Level) -> Self {
        match level {
            Level::Trace => Self::Trace,
            Level::Debug => Self::Debug,
            Level::Info => Self::Info,
            Level::Warn => Self::Warn,
            Level::Error => Self::Error,
        }
    }
}
