//! Seed selection shared by the simulations: one seed from `$one` (to
//! reproduce a failure), else seeds `0..$many` (default `default`), from
//! `CVOL_SEED_FROM` when set, run on `CVOL_SIM_THREADS` threads (default:
//! every core; seeds are independent, and each seed's run is deterministic
//! whatever thread runs it).
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// Runs `run` for the chosen seeds, each thread into its own coverage `C`,
/// merged with `merge`. Returns how many seeds ran from the range and the
/// merged coverage, or None when a single seed was asked for, or
/// `CVOL_SEED_FROM` lies past the range (no coverage to assert). A seed
/// that panics stops the other threads at their next seed, and the panic
/// fails the test.
pub fn run_seeds<C: Default + Send>(
    one: &str,
    many: &str,
    default: u64,
    run: impl Fn(u64, &mut C) + Sync,
    merge: impl Fn(&mut C, C),
) -> Option<(u64, C)> {
    if let Ok(s) = std::env::var(one) {
        run(
            s.parse().unwrap_or_else(|_| panic!("{one} is a number")),
            &mut C::default(),
        );
        return None;
    }
    let env = |k: &str| std::env::var(k).ok().and_then(|s| s.parse::<u64>().ok());
    let n = env(many).unwrap_or(default);
    // `CVOL_SEED_FROM=K`: resume a long run at seed K (seeds K..n).
    let asked = env("CVOL_SEED_FROM").unwrap_or(0);
    if n > 0 && asked >= n {
        // A soak that starts every suite at K, past this suite's count:
        // no seed runs, so there is no coverage to assert.
        eprintln!("{many}={n} and CVOL_SEED_FROM={asked}: no seeds in range, none run");
        return None;
    }
    let from = asked.min(n);
    let threads = env("CVOL_SIM_THREADS")
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |p| p.get() as u64))
        .max(1);
    let next = AtomicU64::new(from);
    let failed = AtomicBool::new(false);
    let done = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut cov = C::default();
                let _stop = StopOthers(&failed);
                while !failed.load(Ordering::SeqCst) {
                    let seed = next.fetch_add(1, Ordering::SeqCst);
                    if seed >= n {
                        break;
                    }
                    let _named = NameOnPanic(seed);
                    run(seed, &mut cov);
                }
                done.lock().expect("no panic while held").push(cov);
            });
        }
    });
    let mut total = C::default();
    for c in done.into_inner().expect("threads joined") {
        merge(&mut total, c);
    }
    Some((n - from, total))
}

/// Tells the other threads to stop when its thread unwinds from a panic.
struct StopOthers<'a>(&'a AtomicBool);

impl Drop for StopOthers<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::SeqCst);
        }
    }
}

/// Names the seed that was running when its thread panics (a panic deep
/// in the engine does not say which seed it ran).
struct NameOnPanic(u64);

impl Drop for NameOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("seed {} failed", self.0);
        }
    }
}
