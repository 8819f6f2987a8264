//! Errors: why a durable call returned no value, and why an action failed.

use core::fmt;

use crate::bindings::rewind::action::types::CallError as WitCallError;

/// Why a durable call ([`Context::call`](crate::Context::call)) returned no value.
///
/// Only [`Failed`](CallError::Failed) is recorded by the host: when the same input runs
/// again, the call fails again the same way without running. The other variants are not
/// recorded; the call can succeed on a later run.
///
/// # Example
///
/// ```no_run
/// use rewind_guest::{CallError, Context};
/// use serde_json::{Value, json};
///
/// fn lookup(ctx: &mut Context) -> Option<Value> {
///     match ctx.call::<_, Value>("orders.lookup", &json!({ "order_id": "A1234" })) {
///         Ok(order) => Some(order),
///         Err(CallError::Failed(message)) => {
///             ctx.warn(&format!("lookup failed: {message}"));
///             None
///         }
///         Err(other) => {
///             ctx.error(&other.to_string());
///             None
///         }
///     }
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CallError {
    /// The function ran and failed. Recorded, and returned again on replay.
    Failed(String),
    /// The action may not use this function now (not granted, quota spent). Not recorded.
    Denied(String),
    /// No function of that name is declared for this agent. Not recorded.
    UnknownFunction(String),
    /// The function succeeded, but its result was not the JSON the caller asked for.
    ///
    /// The call itself is recorded as a success; running the input again returns the
    /// same result, so this error repeats until the caller's type changes.
    Decode {
        /// The function that was called.
        function: String,
        /// What did not match.
        message: String,
    },
    /// The args could not be serialised to JSON (a map with non-string keys, for
    /// instance), so the function was not called.
    Encode {
        /// The function that would have been called.
        function: String,
        /// Why serialisation failed.
        message: String,
    },
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Failed(message) => write!(f, "durable call failed: {message}"),
            Self::Denied(message) => write!(f, "durable call denied: {message}"),
            Self::UnknownFunction(message) => write!(f, "unknown function: {message}"),
            Self::Decode { function, message } => {
                write!(
                    f,
                    "result of `{function}` is not the expected JSON: {message}"
                )
            }
            Self::Encode { function, message } => {
                write!(
                    f,
                    "args for `{function}` cannot be encoded as JSON: {message}"
                )
            }
        }
    }
}

impl std::error::Error for CallError {}

impl From<WitCallError> for CallError {
    fn from(error: WitCallError) -> Self {
        match error {
            WitCallError::Failed(message) => Self::Failed(message),
            WitCallError::Denied(message) => Self::Denied(message),
            WitCallError::UnknownFunction(message) => Self::UnknownFunction(message),
        }
    }
}

/// Why an action failed: the text the host reports for a failed run.
///
/// Every error type converts into it, so `?` works on call errors, JSON errors and any
/// other [`std::error::Error`] inside [`Action::run`](crate::Action::run). The text is the
/// error's message followed by its sources, separated by `": "`.
///
/// `Error` does not implement [`std::error::Error`] itself; that is what lets every error
/// type convert into it.
///
/// # Example
///
/// ```
/// use rewind_guest::Error;
///
/// fn check(amount: i64) -> Result<(), Error> {
///     if amount < 0 {
///         return Err(Error::msg(format!("refund amount {amount} is negative")));
///     }
///     let _parsed: u32 = "42".parse()?; // any std error converts with `?`
///     Ok(())
/// }
///
/// assert_eq!(check(-5).unwrap_err().to_string(), "refund amount -5 is negative");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Error {
    message: String,
}

impl Error {
    /// An error with the given message.
    ///
    /// # Example
    ///
    /// ```
    /// let error = rewind_guest::Error::msg("ticket has no text");
    /// assert_eq!(error.to_string(), "ticket has no text");
    /// ```
    pub fn msg(message: impl fmt::Display) -> Self {
        Self {
            message: message.to_string(),
        }
    }

    /// This error with `context` put in front of its message, separated by `": "`.
    ///
    /// # Example
    ///
    /// ```
    /// let error = rewind_guest::Error::msg("timed out").context("looking up order A1234");
    /// assert_eq!(error.to_string(), "looking up order A1234: timed out");
    /// ```
    #[must_use]
    pub fn context(self, context: impl fmt::Display) -> Self {
        Self {
            message: format!("{context}: {}", self.message),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl<E: std::error::Error> From<E> for Error {
    fn from(error: E) -> Self {
        let mut message = error.to_string();
        let mut source = error.source();
        while let Some(cause) = source {
            message.push_str(": ");
            message.push_str(&cause.to_string());
            source = cause.source();
        }
        Self { message }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Outer(std::io::Error);

    impl fmt::Display for Outer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("reading the price list")
        }
    }

    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn an_error_keeps_its_sources_in_the_message() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let error = Error::from(Outer(io));
        assert_eq!(error.to_string(), "reading the price list: no such file");
    }

    #[test]
    fn question_mark_converts_call_errors() {
        fn run() -> Result<(), Error> {
            Err(CallError::Denied("quota spent".to_string()))?
        }
        assert_eq!(
            run().err().map(|error| error.to_string()),
            Some("durable call denied: quota spent".to_string())
        );
    }

    #[test]
    fn each_wit_call_error_maps_to_its_variant() {
        let cases = [
            (
                WitCallError::Failed("f".into()),
                CallError::Failed("f".into()),
            ),
            (
                WitCallError::Denied("d".into()),
                CallError::Denied("d".into()),
            ),
            (
                WitCallError::UnknownFunction("u".into()),
                CallError::UnknownFunction("u".into()),
            ),
        ];
        for (wit, expected) in cases {
            assert_eq!(CallError::from(wit), expected);
        }
    }

    #[test]
    fn a_decode_error_names_the_function() {
        let error = CallError::Decode {
            function: "orders.lookup".to_string(),
            message: "missing field `status`".to_string(),
        };
        assert_eq!(
            error.to_string(),
            "result of `orders.lookup` is not the expected JSON: missing field `status`"
        );
    }
}
