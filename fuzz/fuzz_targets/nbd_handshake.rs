//! The NBD handshake (and whatever follows) as raw client bytes against the real server.
//! Body: `cvol_fuzzlib::nbd::handshake` (replayed on stable by `cargo test -p cvol-fuzzlib`).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| cvol_fuzzlib::nbd::handshake(data));
