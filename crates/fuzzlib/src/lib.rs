//! # cvol-fuzzlib: the bodies of the cvol fuzz targets
//!
//! Each fuzz target in `fuzz/fuzz_targets/` is one line calling a function
//! here, so the same code runs under libFuzzer (`scripts/fuzz`, nightly) and
//! from the stable test suite (`tests/fuzz_corpus.rs` replays every file of
//! `fuzz/corpus/<target>/` and `fuzz/regressions/<target>/`).
//!
//! Every target's property is "no panic, no hang" on arbitrary input, plus
//! cheap oracles where the code under test promises more (decoders
//! round-trip what they accept; validated NBD requests lie in range).
//! A panic in any thread — including the NBD server's connection and worker
//! threads — fails the input (see [`panics::count`]).
//!
//! | target | function | input |
//! |---|---|---|
//! | `nbd_handshake` | [`nbd::handshake`] | raw client bytes from the first byte after the greeting |
//! | `nbd_tls` | [`nbd::tls`] | mode bit, then client bytes to a TLS-required server (after STARTTLS: the TLS stream) |
//! | `nbd_request` | [`nbd::request`] | mode byte, then transmission-phase bytes after a generated handshake |
//! | `format_decoders` | [`format::decoders`] | bytes for every on-disk decoder, also with checksums fixed up |
//! | `recovery` | [`recovery::recovery`] | flags, then patch operations on a committed volume image |

pub mod format;
pub mod input;
pub mod nbd;
pub mod panics;
pub mod recovery;

/// A target body.
pub type Body = fn(&[u8]);

/// Every target: name (as in `fuzz/fuzz_targets/<name>.rs` and
/// `fuzz/corpus/<name>/`) and body.
pub const TARGETS: &[(&str, Body)] = &[
    ("nbd_handshake", nbd::handshake),
    ("nbd_request", nbd::request),
    ("nbd_tls", nbd::tls),
    ("format_decoders", format::decoders),
    ("recovery", recovery::recovery),
];

/// Runs the target called `name` on `data`; panics on an unknown name.
pub fn run(name: &str, data: &[u8]) {
    let (_, body) = TARGETS
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("unknown fuzz target {name}"));
    body(data);
}
