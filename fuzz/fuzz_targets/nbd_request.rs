//! NBD transmission-phase requests after a generated handshake, against the real server.
//! Body: `cvol_fuzzlib::nbd::request` (replayed on stable by `cargo test -p cvol-fuzzlib`).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| cvol_fuzzlib::nbd::request(data));
