//! Checks on the shape of the workspace's source, run by `cargo test`
//! (`cargo test -p cvol-layout`); the crate has no code of its own.
//!
//! - `tests/layout.rs::fn_lengths`: every function in `crates/*/src` and
//!   `fuzz/fuzz_targets` is at most 80 lines long, signature and closing
//!   brace included.
//! - `tests/layout.rs::file_sizes`: every `.rs` file under `crates/*/src`
//!   and `crates/*/tests` is under 900 lines.
//!
//! Each test names today's known offenders in an `ALLOWED` list that must
//! shrink to empty: an offender not listed fails the test, and so does a
//! listed entry that no longer offends, so the list cannot go stale.
