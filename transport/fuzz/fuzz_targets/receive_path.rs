//! The receiver's path from bytes to the job tracker; the body is
//! `scd_transport::fuzz::receive_path`, which the stable harness in
//! `transport/tests/fuzz_receive.rs` runs in `cargo test` too (the properties are listed there).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    scd_transport::fuzz::receive_path(data);
});
