//! The event an action handles.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::Error;

/// An event moving through an agent: its `kind` decides which actions it triggers, its
/// `payload` is JSON text.
///
/// An input enters the agent as an event of kind `"input"`; other kinds are whatever the
/// agent's actions [`send`](crate::Context::send).
///
/// # Example
///
/// ```
/// use rewind_guest::Event;
///
/// let event = Event::new("lookup", &serde_json::json!({ "order_id": "A1234" }))?;
/// assert_eq!(event.kind, "lookup");
/// assert_eq!(event.payload, r#"{"order_id":"A1234"}"#);
/// # Ok::<(), rewind_guest::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Event {
    /// The event's kind: `"input"` for an input, otherwise the kind it was sent with.
    pub kind: String,
    /// The payload as JSON text.
    pub payload: String,
}

impl Event {
    /// Builds an event whose payload is `payload` serialised to JSON.
    ///
    /// Fails only when `payload` cannot be represented as JSON (a map with non-string
    /// keys, for instance).
    ///
    /// # Example
    ///
    /// ```
    /// use rewind_guest::Event;
    ///
    /// let event = Event::new("input", &vec![1, 2, 3])?;
    /// assert_eq!(event.payload, "[1,2,3]");
    /// # Ok::<(), rewind_guest::Error>(())
    /// ```
    pub fn new<T: Serialize + ?Sized>(kind: impl Into<String>, payload: &T) -> Result<Self, Error> {
        Ok(Self {
            kind: kind.into(),
            payload: serde_json::to_string(payload)?,
        })
    }

    /// Parses the payload as JSON into `T`.
    ///
    /// The error names the event's kind and says what did not match.
    ///
    /// # Example
    ///
    /// ```
    /// use rewind_guest::Event;
    /// use serde::Deserialize;
    ///
    /// #[derive(Deserialize)]
    /// struct Ticket {
    ///     ticket_id: String,
    /// }
    ///
    /// let event = Event {
    ///     kind: "input".to_string(),
    ///     payload: r#"{"ticket_id":"T-1"}"#.to_string(),
    /// };
    /// let ticket: Ticket = event.payload()?;
    /// assert_eq!(ticket.ticket_id, "T-1");
    ///
    /// let wrong: Result<Vec<u8>, _> = event.payload();
    /// assert!(wrong.is_err());
    /// # Ok::<(), rewind_guest::Error>(())
    /// ```
    pub fn payload<T: DeserializeOwned>(&self) -> Result<T, Error> {
        serde_json::from_str(&self.payload).map_err(|error| {
            Error::msg(format!(
                "payload of event `{}` is not what the action expects: {error}",
                self.kind
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_round_trips() -> Result<(), Error> {
        let event = Event::new("lookup", &("T-1", 3))?;
        let (ticket, attempt): (String, u32) = event.payload()?;
        assert_eq!((ticket.as_str(), attempt), ("T-1", 3));
        Ok(())
    }

    #[test]
    fn a_payload_error_names_the_event_kind() {
        let event = Event {
            kind: "lookup".to_string(),
            payload: "not json".to_string(),
        };
        let error = event.payload::<u32>().err().map(|error| error.to_string());
        assert!(
            error
                .as_deref()
                .is_some_and(|message| message.starts_with("payload of event `lookup`")),
            "{error:?}"
        );
    }
}
