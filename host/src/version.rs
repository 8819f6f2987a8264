//! Format versions. Every file and record this build writes to disk or to JetStream as JSON
//! names its format (`"format": N`), so that a later build reads it, or refuses it naming
//! the format and what to do. What earlier builds wrote names none, and reads as
//! [`FIRST`]. (Binary formats carry theirs in their own header: a state's version byte, a
//! log's `log.json`.) A leaf: anything may use it.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// The format of what was written before formats were named.
pub const FIRST: u32 = 1;

/// `value` written with its format: `{"format": N, ...its fields}`.
#[derive(Debug, Serialize)]
pub struct Versioned<'a, T: Serialize> {
    pub format: u32,
    #[serde(flatten)]
    pub value: &'a T,
}

/// Why what was read is not of a format this build reads.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error(
        "{what} is format {found}, and this build reads format {reads} and older: open it \
         with the build that wrote it, or a newer one"
    )]
    TooNew {
        what: String,
        found: u32,
        reads: u32,
    },
    #[error("{what}: {source}")]
    Json {
        what: String,
        #[source]
        source: serde_json::Error,
    },
}

/// The `format` a JSON object names ([`FIRST`] when it names none).
pub fn format_of(bytes: &[u8], what: &str) -> Result<u32, FormatError> {
    #[derive(serde::Deserialize)]
    struct Named {
        #[serde(default = "first")]
        format: u32,
    }
    serde_json::from_slice::<Named>(bytes)
        .map(|named| named.format)
        .map_err(|source| FormatError::Json {
            what: what.to_owned(),
            source,
        })
}

/// Refuses `found` when it is newer than `reads`; `what` names the file or record.
pub fn check(found: u32, reads: u32, what: &str) -> Result<(), FormatError> {
    if found > reads {
        return Err(FormatError::TooNew {
            what: what.to_owned(),
            found,
            reads,
        });
    }
    Ok(())
}

/// `bytes` as a `T`, once the format they name is one this build reads (`reads` and older).
pub fn decode<T: DeserializeOwned>(bytes: &[u8], reads: u32, what: &str) -> Result<T, FormatError> {
    check(format_of(bytes, what)?, reads, what)?;
    serde_json::from_slice(bytes).map_err(|source| FormatError::Json {
        what: what.to_owned(),
        source,
    })
}

fn first() -> u32 {
    FIRST
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Thing {
        name: String,
    }

    #[test]
    fn a_record_is_written_with_its_format_and_one_without_reads_as_the_first() {
        let thing = Thing {
            name: "a".to_owned(),
        };
        let bytes = serde_json::to_vec(&Versioned {
            format: 2,
            value: &thing,
        })
        .expect("encodes");
        assert_eq!(bytes, br#"{"format":2,"name":"a"}"#);
        assert_eq!(decode::<Thing>(&bytes, 2, "a thing").expect("reads"), thing);
        assert_eq!(
            format_of(br#"{"name":"a"}"#, "a thing").expect("reads"),
            FIRST
        );
    }

    #[test]
    fn a_newer_format_is_refused_naming_both() {
        let error = decode::<Thing>(br#"{"format":3,"name":"a"}"#, 2, "the thing at x")
            .expect_err("too new");
        assert_eq!(
            error.to_string(),
            "the thing at x is format 3, and this build reads format 2 and older: open it with \
             the build that wrote it, or a newer one"
        );
    }
}
