//! A TLS-required server fed raw client bytes (after STARTTLS: the TLS
//! stream, i.e. a mutated ClientHello and onwards).
//! Body: `cvol_fuzzlib::nbd::tls` (replayed on stable by `cargo test -p cvol-fuzzlib`).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| cvol_fuzzlib::nbd::tls(data));
