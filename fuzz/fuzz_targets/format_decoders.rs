//! Every on-disk decoder (superblock, pointer, record, map entry, checkpoint payloads) on arbitrary bytes.
//! Body: `cvol_fuzzlib::format::decoders` (replayed on stable by `cargo test -p cvol-fuzzlib`).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| cvol_fuzzlib::format::decoders(data));
