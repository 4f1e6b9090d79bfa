//! Any bytes: the decoder returns a typed error or a frame that round-trips; it never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use scd_transport::codec::{decode, encode, header_bytes, HEADER_LEN};

const MAX: u32 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    // Raw input, as a stream would deliver it.
    check(data);
    // The same bytes behind a valid header, so the archive validator sees them too.
    let mut framed = header_bytes(data.len() as u32).to_vec();
    framed.extend_from_slice(data);
    check(&framed);
});

fn check(bytes: &[u8]) {
    if let Ok((msg, used)) = decode(bytes, MAX) {
        assert!(used >= HEADER_LEN && used <= bytes.len());
        let again = encode(&msg, MAX).expect("a decoded frame re-encodes");
        assert_eq!(decode(&again, MAX).expect("and decodes").0, msg);
    }
}
