//! How long a connection's reads take, to decide where they run.
//!
//! A READ whose data is in memory (the volume's caches, the host's page
//! cache) costs a few microseconds; handing it to a worker costs as much
//! again: a queue, a wake-up, and a switch between threads, and the
//! connection's reader, quick to go back to `recv`, then wakes for every
//! request where a busier one would take several at once. So a connection
//! whose reads have been quick runs its small reads on its reader thread,
//! one after another, and a connection whose reads wait for a device (a
//! page-cache miss, an object store) hands them to the workers, which wait
//! in parallel. The measure is a moving average of each read's time in the
//! backend, wherever it ran, so a connection moves back and forth as its
//! reads change. (One connection's quick reads then use one core; on two
//! cores shared with the client, reading one volume at queue depth 32 went
//! from 144-155k to 195-199k IOPS this way, and four connections to one
//! server from 0.84-0.89x to 0.88-1.02x of four servers of one connection
//! each.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Reads averaging at most this long run on the connection's thread.
pub(super) const QUICK_READ_MAX: Duration = Duration::from_micros(30);
/// Weight of the newest read in the average: 1 / 2^SHIFT.
const SHIFT: u32 = 3;

/// A moving average of a connection's read times, in nanoseconds. It
/// starts at zero: a new connection tries its reads inline, and its first
/// slow ones send the rest to the workers.
#[derive(Default)]
pub(super) struct ReadCost {
    average_ns: AtomicU64,
}

impl ReadCost {
    /// Whether the connection's reads have been quick lately.
    pub(super) fn quick(&self) -> bool {
        self.average_ns.load(Ordering::Relaxed) <= QUICK_READ_MAX.as_nanos() as u64
    }

    /// Adds one read's time. Racing updates from two workers may lose one
    /// of the two samples: it is an estimate.
    pub(super) fn add(&self, took: Duration) {
        let sample = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        let old = self.average_ns.load(Ordering::Relaxed);
        let new = if sample >= old {
            old + ((sample - old) >> SHIFT)
        } else {
            old - ((old - sample) >> SHIFT)
        };
        self.average_ns.store(new, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quick_reads_stay_inline_and_slow_ones_move_to_the_workers_and_back() {
        let cost = ReadCost::default();
        assert!(cost.quick(), "a new connection tries its reads inline");
        for _ in 0..100 {
            cost.add(Duration::from_micros(4));
        }
        assert!(cost.quick());
        // Reads start to wait for a device (100 us each): a few of them
        // are enough to send the connection's reads to the workers.
        let mut slow = 0;
        while cost.quick() {
            cost.add(Duration::from_micros(100));
            slow += 1;
        }
        assert!(slow <= 4, "{slow} slow reads before moving");
        // One read preempted for a millisecond moves it too, for a while.
        let mut quick = 0;
        while !cost.quick() {
            cost.add(Duration::from_micros(4));
            quick += 1;
        }
        assert!(
            (1..=32).contains(&quick),
            "{quick} quick reads to move back"
        );
        cost.add(Duration::from_millis(1));
        assert!(!cost.quick());
        // A steady mix of one miss in ten (100 us) and hits (4 us)
        // averages 13.6 us: inline.
        for i in 0..1000 {
            cost.add(Duration::from_micros(if i % 10 == 0 { 100 } else { 4 }));
        }
        assert!(cost.quick());
    }
}
