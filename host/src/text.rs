//! Text that comes from outside the host (a guest's errors and log lines, a remote's
//! answers): bounded before it is kept, and escaped before it reaches a log line, so that it
//! can neither grow a record without end nor forge a line of the host's own.
//! (Leaf: depends on nothing in the crate.)

use std::borrow::Cow;
use std::fmt::Write as _;

/// Bytes of one error kept: an action's error, a trap, a host's account of either. What is
/// past it is cut, saying how much.
pub const MAX_ERROR_BYTES: usize = 4096;

/// `text` with every control character escaped (`\n`, `\r`, `\t`, `\u{1b}`, ...) and the
/// Unicode line and paragraph separators too, so that it stays on the line it is put on.
pub fn escaped(text: &str) -> Cow<'_, str> {
    if !text.chars().any(breaks_lines) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if breaks_lines(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

fn breaks_lines(c: char) -> bool {
    c.is_control() || matches!(c, '\u{2028}' | '\u{2029}')
}

/// An error from outside, as the host keeps it: escaped (as [`escaped`]), and cut to at
/// most [`MAX_ERROR_BYTES`] of escaped text, followed by how many bytes of `text` were cut.
pub fn outside_error(text: &str) -> String {
    let mut kept = String::new();
    for (at, c) in text.char_indices() {
        let before = kept.len();
        if breaks_lines(c) {
            kept.extend(c.escape_default());
        } else {
            kept.push(c);
        }
        if kept.len() > MAX_ERROR_BYTES {
            kept.truncate(before);
            let _ = write!(kept, " … ({} more bytes)", text.len() - at);
            break;
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_and_line_separators_are_escaped() {
        assert_eq!(escaped("plain text"), Cow::Borrowed("plain text"));
        assert_eq!(
            escaped("a\nINFO forged\r\u{1b}[2K\u{2028}b"),
            "a\\nINFO forged\\r\\u{1b}[2K\\u{2028}b"
        );
    }

    #[test]
    fn an_outside_error_is_escaped_and_bounded() {
        let huge = "\u{1}".repeat(1 << 20);
        let kept = outside_error(&huge);
        assert!(kept.len() <= MAX_ERROR_BYTES + 64, "{}", kept.len());
        assert!(kept.starts_with("\\u{1}\\u{1}"), "{kept:.40}");
        assert!(!kept.chars().any(char::is_control), "no control left");
        assert!(
            kept.ends_with(" more bytes)"),
            "{}",
            &kept[kept.len() - 40..]
        );
        assert_eq!(outside_error("it broke"), "it broke");
    }
}
