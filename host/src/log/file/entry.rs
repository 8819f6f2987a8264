//! How one record is framed on disk.
//!
//! ```text
//! magic "RWLG" (4) | version (1) | payload length, u32 LE (4) | CRC-32 of version, length
//! and payload, u32 LE (4) | payload
//! ```

/// Marks the start of every record.
pub const MAGIC: [u8; 4] = *b"RWLG";
/// The framing version this code writes and reads.
pub const VERSION: u8 = 1;
/// Bytes before the payload.
pub const HEADER: usize = 13;
/// The largest payload a record may carry.
pub const MAX_PAYLOAD: usize = 64 << 20;

/// Frames `payload` for appending.
pub fn encode(payload: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(HEADER + payload.len());
    encode_into(&mut frame, &[payload]);
    frame
}

/// Appends to `out` the frame of the payload made of `parts`, one after the other.
pub fn encode_into(out: &mut Vec<u8>, parts: &[&[u8]]) {
    let size: usize = parts.iter().map(|part| part.len()).sum();
    let len = u32::try_from(size).unwrap_or(u32::MAX);
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&[VERSION]);
    hasher.update(&len.to_le_bytes());
    for part in parts {
        hasher.update(part);
    }
    out.reserve(HEADER + size);
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&hasher.finalize().to_le_bytes());
    for part in parts {
        out.extend_from_slice(part);
    }
}

fn checksum(len: u32, payload: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&[VERSION]);
    hasher.update(&len.to_le_bytes());
    hasher.update(payload);
    hasher.finalize()
}

/// What is at a position of a segment.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded {
    /// A whole record: its payload is `bytes[payload]`, the next record starts at `next`.
    Record {
        payload: std::ops::Range<usize>,
        next: usize,
    },
    /// The bytes end here, between records.
    End,
    /// The bytes end inside a record: an append that did not finish.
    Torn,
    /// The bytes here are not a record.
    Corrupt(String),
}

/// Decodes the record that starts at `at` in `bytes`.
pub fn decode(bytes: &[u8], at: usize) -> Decoded {
    let rest = &bytes[at.min(bytes.len())..];
    if rest.is_empty() {
        return Decoded::End;
    }
    if rest.len() < HEADER {
        return if MAGIC.starts_with(&rest[..rest.len().min(4)]) {
            Decoded::Torn
        } else {
            Decoded::Corrupt("bad magic".to_owned())
        };
    }
    if rest[..4] != MAGIC {
        return Decoded::Corrupt("bad magic".to_owned());
    }
    if rest[4] != VERSION {
        return Decoded::Corrupt(format!(
            "record framing version {} (this build reads version {VERSION})",
            rest[4]
        ));
    }
    let len = u32::from_le_bytes([rest[5], rest[6], rest[7], rest[8]]);
    let crc = u32::from_le_bytes([rest[9], rest[10], rest[11], rest[12]]);
    let size = usize::try_from(len).unwrap_or(usize::MAX);
    if size > MAX_PAYLOAD {
        return Decoded::Corrupt(format!("record length {size} is over the limit"));
    }
    if rest.len() < HEADER + size {
        return Decoded::Torn;
    }
    let payload = &rest[HEADER..HEADER + size];
    if checksum(len, payload) != crc {
        return Decoded::Corrupt("checksum mismatch".to_owned());
    }
    Decoded::Record {
        payload: at + HEADER..at + HEADER + size,
        next: at + HEADER + size,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_and_every_cut_of_it_is_torn() {
        let frame = encode(b"hello");
        let mut bytes = encode(b"first");
        let start = bytes.len();
        bytes.extend_from_slice(&frame);
        assert_eq!(
            decode(&bytes, start),
            Decoded::Record {
                payload: start + HEADER..bytes.len(),
                next: bytes.len()
            }
        );
        for cut in start + 1..bytes.len() {
            assert_eq!(decode(&bytes[..cut], start), Decoded::Torn, "cut at {cut}");
        }
        assert_eq!(decode(&bytes, bytes.len()), Decoded::End);
    }

    #[test]
    fn a_flipped_bit_is_corrupt() {
        let mut frame = encode(b"hello");
        let last = frame.len() - 1;
        frame[last] ^= 1;
        assert!(matches!(decode(&frame, 0), Decoded::Corrupt(m) if m.contains("checksum")));
    }
}
