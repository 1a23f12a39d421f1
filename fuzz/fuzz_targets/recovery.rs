//! check + open + reads (+ writes) of a volume image damaged by the input.
//! Body: `cvol_fuzzlib::recovery::recovery` (replayed on stable by `cargo test -p cvol-fuzzlib`).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| cvol_fuzzlib::recovery::recovery(data));
