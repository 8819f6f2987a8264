//! Input files: JSON Lines of `{"key": "...", "payload": <json>}`.

use std::io::BufRead;

use serde::Deserialize;

/// The longest event id a line may carry, in bytes.
pub const MAX_EVENT_ID: usize = 256;

/// One accepted input line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputLine {
    /// 1-based line number in its file.
    pub line: usize,
    /// The event's id, when the line gives one (`"id"`): a front end that de-duplicates
    /// (`rewind cluster publish`) drops an event whose id it has accepted before.
    pub id: Option<String>,
    pub key: String,
    /// JSON text.
    pub payload: String,
}

/// A line that is not a valid input. The line is skipped and counted; the run goes on.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", self.place())]
pub struct LineError {
    /// The line number, or for a message of a stream its position there.
    pub line: usize,
    pub message: String,
    /// The stream the input was a message of; `None` for a line of a file.
    pub stream: Option<String>,
}

impl LineError {
    /// Where the input was: `line 3`, or `message 3 of stream S`.
    pub fn place(&self) -> String {
        match &self.stream {
            Some(stream) => format!("message {} of stream {stream}", self.line),
            None => format!("line {}", self.line),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    #[serde(default)]
    id: Option<String>,
    key: String,
    payload: Box<serde_json::value::RawValue>,
}

/// Parses line `line` (1-based). Blank lines are `Ok(None)`.
pub fn parse_line(line: usize, text: &str) -> Result<Option<InputLine>, LineError> {
    if text.trim().is_empty() {
        return Ok(None);
    }
    let raw: Raw = serde_json::from_str(text).map_err(|e| LineError {
        line,
        message: format!(
            "not an input ({e}); expected {{\"key\": \"...\", \"payload\": <json>}}, with an \
             optional \"id\": \"...\""
        ),
        stream: None,
    })?;
    if raw.key.is_empty() {
        return Err(LineError {
            line,
            message: "`key` is empty".to_owned(),
            stream: None,
        });
    }
    if let Some(id) = &raw.id
        && (id.is_empty() || id.len() > MAX_EVENT_ID)
    {
        return Err(LineError {
            line,
            message: format!(
                "`id` is {} bytes: an event id is 1 to {MAX_EVENT_ID} bytes",
                id.len()
            ),
            stream: None,
        });
    }
    Ok(Some(InputLine {
        line,
        id: raw.id,
        key: raw.key,
        payload: raw.payload.get().to_owned(),
    }))
}

/// The inputs of a JSONL reader, line by line; a line that cannot be read as text is an
/// error for that line, not for the file.
pub fn read_lines(reader: impl BufRead) -> impl Iterator<Item = Result<InputLine, LineError>> {
    reader
        .split(b'\n')
        .enumerate()
        .filter_map(|(index, bytes)| {
            let line = index + 1;
            let parsed = match bytes {
                Err(e) => Err(LineError {
                    line,
                    message: format!("cannot read: {e}"),
                    stream: None,
                }),
                Ok(bytes) => match String::from_utf8(bytes) {
                    Err(_) => Err(LineError {
                        line,
                        message: "not UTF-8 text".to_owned(),
                        stream: None,
                    }),
                    Ok(text) => parse_line(line, &text),
                },
            };
            parsed.transpose()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_inputs_and_reports_bad_lines_by_number() {
        let text = b"{\"key\":\"a\",\"payload\":{\"x\":1}}\n\nnot json\n{\"key\":\"b\"}\n{\"key\":\"c\",\"payload\":2,\"extra\":1}\n\xff\n{\"key\":\"d\",\"payload\":[1]}\n";
        let lines: Vec<_> = read_lines(&text[..]).collect();
        assert_eq!(lines.len(), 6, "{lines:?}");
        assert_eq!(
            lines[0],
            Ok(InputLine {
                id: None,
                line: 1,
                key: "a".into(),
                payload: "{\"x\":1}".into()
            })
        );
        let errors: Vec<usize> = lines
            .iter()
            .filter_map(|l| l.as_ref().err().map(|e| e.line))
            .collect();
        assert_eq!(errors, vec![3, 4, 5, 6]);
        assert!(
            lines[2]
                .as_ref()
                .is_err_and(|e| e.message.contains("payload"))
        );
        assert_eq!(lines[5].as_ref().map(|l| l.line), Ok(7));
    }
}
