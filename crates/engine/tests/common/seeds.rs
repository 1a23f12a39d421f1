//! Seed selection shared by the simulations: one seed from `$one` (to
//! reproduce a failure), else seeds `0..$many` (default `default`), from
//! `CVOL_SEED_FROM` when set.

/// Runs `run` for the chosen seeds. Returns how many seeds ran from the
/// range, or None when a single seed was asked for (no coverage to assert).
pub fn run_seeds(one: &str, many: &str, default: u64, mut run: impl FnMut(u64)) -> Option<u64> {
    if let Ok(s) = std::env::var(one) {
        run(s.parse().unwrap_or_else(|_| panic!("{one} is a number")));
        return None;
    }
    let n = std::env::var(many)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    // `CVOL_SEED_FROM=K`: resume a long run at seed K (seeds K..n).
    let from = std::env::var("CVOL_SEED_FROM")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0u64)
        .min(n);
    (from..n).for_each(&mut run);
    Some(n - from)
}
