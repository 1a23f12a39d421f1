//! Counts panics in every thread of the process.
//!
//! The NBD server runs client input on its own connection and worker
//! threads; a panic there ends only that thread, and the client merely sees
//! the connection close. libFuzzer's panic hook aborts the process on any
//! panic, but the stable replay test has no such hook, so the targets install
//! this counting hook (chained to the previous one) and fail the input when
//! the count moved while it ran.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;

static PANICS: AtomicUsize = AtomicUsize::new(0);
static INSTALL: Once = Once::new();

/// Installs the counting hook (once per process).
pub fn install() {
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            previous(info);
        }));
    });
}

/// Panics seen so far, in any thread.
pub fn count() -> usize {
    PANICS.load(Ordering::SeqCst)
}
