//! The action-state decoder (`rewind_host::store::encoding::decode`) on arbitrary bytes:
//! it never panics, and what it accepts encodes back to a state that decodes the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rewind_host::store::encoding;

fuzz_target!(|bytes: &[u8]| {
    if let Ok(state) = encoding::decode(bytes) {
        let again = encoding::encode(&state).expect("a decoded state encodes");
        assert_eq!(encoding::decode(&again).expect("and decodes"), state);
    }
});
