//! Waiting for a queue-depth-1 client's next request without sleeping.
//!
//! A client that sends one request at a time sends its next one a few tens
//! of microseconds after our reply. If the connection's reader sleeps in
//! `recv(2)` meanwhile, the next request has to wake it: in a virtual
//! machine whose idle vCPUs halt at once (no guest halt-polling), that
//! wake-up is an inter-processor interrupt and a vCPU the host must resume,
//! 20-35 µs that every request pays on top of its work. So, like the
//! kernel's socket busy-polling (`SO_BUSY_POLL`) and KVM's halt-polling,
//! the reader of a connection with nothing in flight first watches the
//! socket for a short window, yielding the core to any thread that wants
//! it, and only then sleeps.
//!
//! The window adapts per connection, as the guest halt-poll governor's
//! does: a request that came after the window closed but within the
//! configured maximum doubles it; a wait longer than the maximum (a client
//! that paused, or is gone) halves it, down to nothing. A client that
//! pauses between requests therefore costs a few short windows and then no
//! polling at all. At most `ServerConfig::busy_poll_threads` readers poll
//! at once, server-wide: the polling uses cores that would otherwise idle,
//! and never more of them than that.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// A window that has shrunk below this is closed (no polling until a
/// request comes within the maximum again).
const MIN_WINDOW: Duration = Duration::from_micros(1);

/// One connection's polling window.
#[derive(Debug)]
pub(super) struct BusyPoll {
    /// How long the reader polls before it sleeps; zero: it does not.
    window: Duration,
    /// `ServerConfig::busy_poll` (zero: off).
    max: Duration,
}

impl BusyPoll {
    /// A window starts closed; the first request that comes within `max`
    /// of the reader starting to wait opens it.
    pub(super) fn new(max: Duration) -> BusyPoll {
        BusyPoll {
            window: Duration::ZERO,
            max,
        }
    }

    /// How long to poll before sleeping.
    pub(super) fn window(&self) -> Duration {
        self.window
    }

    /// Whether polling is configured at all.
    pub(super) fn enabled(&self) -> bool {
        !self.max.is_zero()
    }

    /// Adjusts the window after a wait of `waited` (from the reader
    /// starting to wait to the request's first bytes): a request within
    /// the window keeps it; one after it but within the maximum doubles it
    /// (at least a quarter of the maximum); a longer wait halves it.
    pub(super) fn adjust(&mut self, waited: Duration) {
        if waited <= self.window {
            return;
        }
        if waited <= self.max {
            let start = self.max / 4;
            self.window = (self.window * 2).max(start).min(self.max);
        } else {
            self.window /= 2;
            if self.window < MIN_WINDOW {
                self.window = Duration::ZERO;
            }
        }
    }
}

/// Server-wide count of readers polling, capped.
#[derive(Debug, Default)]
pub(crate) struct Pollers {
    polling: AtomicUsize,
}

impl Pollers {
    /// Takes one of `max` polling places; `None` if all are taken.
    pub(super) fn enter(&self, max: usize) -> Option<PollerPlace<'_>> {
        self.polling
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| PollerPlace { pollers: self })
    }
}

/// A polling place, given back when dropped.
pub(super) struct PollerPlace<'a> {
    pollers: &'a Pollers,
}

impl Drop for PollerPlace<'_> {
    fn drop(&mut self) {
        self.pollers.polling.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(50);

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn a_steady_client_opens_the_window_and_keeps_it() {
        let mut p = BusyPoll::new(MAX);
        assert_eq!(p.window(), Duration::ZERO, "starts closed");
        p.adjust(us(30)); // came 30 µs after the reader began to wait
        assert_eq!(p.window(), us(12) + Duration::from_nanos(500));
        p.adjust(us(30));
        assert_eq!(p.window(), us(25));
        p.adjust(us(30));
        assert_eq!(p.window(), MAX, "doubling stops at the maximum");
        for _ in 0..100 {
            p.adjust(us(20)); // within the window: unchanged
        }
        assert_eq!(p.window(), MAX);
    }

    #[test]
    fn a_client_that_pauses_closes_the_window_in_a_few_waits() {
        let mut p = BusyPoll::new(MAX);
        p.adjust(us(40));
        p.adjust(us(40));
        p.adjust(us(40));
        assert_eq!(p.window(), MAX);
        let mut waits = 0;
        while p.window() > Duration::ZERO {
            p.adjust(Duration::from_millis(5));
            waits += 1;
            assert!(waits < 10, "the window must close: {:?}", p.window());
        }
        // 50 µs halves to below 1 µs in 6 waits: about 100 µs polled in all.
        assert_eq!(waits, 6);
        p.adjust(Duration::from_secs(60));
        assert_eq!(p.window(), Duration::ZERO, "stays closed");
    }

    #[test]
    fn off_never_opens() {
        let mut p = BusyPoll::new(Duration::ZERO);
        assert!(!p.enabled());
        for w in [0, 1, 10, 1000] {
            p.adjust(us(w));
            assert_eq!(p.window(), Duration::ZERO);
        }
    }

    #[test]
    fn pollers_are_capped_and_places_come_back() {
        let pollers = Pollers::default();
        let a = pollers.enter(2).expect("first place");
        let b = pollers.enter(2).expect("second place");
        assert!(pollers.enter(2).is_none(), "the cap holds");
        drop(a);
        let c = pollers.enter(2).expect("a place came back");
        assert!(pollers.enter(0).is_none(), "no places: no polling");
        drop((b, c));
        assert_eq!(pollers.polling.load(Ordering::Acquire), 0);
    }
}
