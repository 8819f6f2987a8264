//! A stable 64-bit FNV-1a hash.
//!
//! The mock derives its "random-looking" answers from the request with this hash rather than
//! `std`'s `DefaultHasher`, whose output is allowed to change between Rust releases: replies
//! must stay the same across builds so recorded runs can be compared with fresh ones.

const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const PRIME: u64 = 0x0100_0000_01b3;

/// Hashes `bytes` with FNV-1a (64-bit).
pub(crate) fn hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(OFFSET_BASIS, |acc, &byte| {
        (acc ^ u64::from(byte)).wrapping_mul(PRIME)
    })
}

/// Picks one of `items` by `hash`; `items` must not be empty.
pub(crate) fn pick<'a>(hash: u64, items: &[&'a str]) -> &'a str {
    let len = u64::try_from(items.len()).unwrap_or(u64::MAX);
    // The remainder is smaller than `items.len()`, so it always fits in a usize.
    let index = usize::try_from(hash % len.max(1)).unwrap_or(0);
    items.get(index).copied().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_published_fnv1a_vectors() {
        assert_eq!(hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(hash(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(hash(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn pick_stays_in_range() {
        let items = ["a", "b", "c"];
        for h in [0, 1, 2, 3, u64::MAX] {
            assert!(items.contains(&pick(h, &items)));
        }
    }
}
