//! Time, passed in. The elastic codec policy decides by the load over the
//! last second and by the CPU time inline compression spent; both read
//! the volume's [`Clock`] (`OpenOptions::clock`) rather than the wall
//! clock, so a simulation that passes a [`ManualClock`] fixes every
//! decision its seed makes (TigerBeetle's rule: time is an input).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A monotonic clock.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Nanoseconds since a fixed start; never decreases.
    fn now_ns(&self) -> u64;
}

/// The clock of a running volume: the monotonic system clock.
#[derive(Debug)]
pub struct SystemClock {
    start: Instant,
}

impl SystemClock {
    pub fn new() -> SystemClock {
        SystemClock {
            start: Instant::now(),
        }
    }

    /// A shared system clock (the default of `OpenOptions::clock`).
    pub fn shared() -> Arc<dyn Clock> {
        Arc::new(SystemClock::new())
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock::new()
    }
}

impl Clock for SystemClock {
    fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }
}

/// A clock that moves only when told: simulations and tests.
#[derive(Debug, Default)]
pub struct ManualClock {
    ns: AtomicU64,
}

impl ManualClock {
    pub fn new() -> ManualClock {
        ManualClock::default()
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.ns.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now_ns(&self) -> u64 {
        self.ns.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let c = ManualClock::new();
        assert_eq!(c.now_ns(), 0);
        c.advance(Duration::from_millis(3));
        assert_eq!(c.now_ns(), 3_000_000);
        let s = SystemClock::new();
        let a = s.now_ns();
        assert!(s.now_ns() >= a);
    }
}
