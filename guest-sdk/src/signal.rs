//! A signal delivered to an input from outside, as a wait returns it.

use serde::de::DeserializeOwned;

use crate::Error;

/// A signal a [`Context::await_signal`](crate::Context::await_signal) returned: its name,
/// one of those the wait listed, and its payload as JSON text.
///
/// # Example
///
/// ```
/// use rewind_guest::Signal;
///
/// let signal = Signal { name: "approve".into(), payload: r#"{"by":"ana"}"#.into() };
/// let approval: serde_json::Value = signal.payload()?;
/// assert_eq!(approval["by"], "ana");
/// # Ok::<(), rewind_guest::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Signal {
    /// Its name.
    pub name: String,
    /// The payload as JSON text.
    pub payload: String,
}

impl Signal {
    /// Parses the payload as JSON into `T`.
    ///
    /// The error names the signal and says what did not match.
    pub fn payload<T: DeserializeOwned>(&self) -> Result<T, Error> {
        serde_json::from_str(&self.payload).map_err(|error| {
            Error::msg(format!(
                "payload of signal `{}` is not what the action expects: {error}",
                self.name
            ))
        })
    }
}
