//! The machine's CPU load, passed in like the time (`crate::clock`): the
//! elastic codec policy asks how busy the whole machine's cores are, so that
//! inline compression steps down to the busy codec when the CPU, which the
//! clients need too, is the bottleneck ([EDC] picks the codec by the
//! bottleneck; the I/O rate alone misses a database whose commits are few
//! but whose CPU is spent).
//!
//! A volume gets a gauge only where the server asks for one
//! (`OpenOptions::cpu`): the simulations and tests leave it out, so no
//! decision of theirs depends on what else the machine runs.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// How busy the machine's cores are.
pub trait CpuGauge: Send + Sync + std::fmt::Debug {
    /// Percent of all cores' time that was busy (every process, the kernel
    /// included; I/O wait counts as idle) over about the last second, or
    /// None when it cannot be known.
    fn busy_percent(&self) -> Option<u32>;
}

/// The gauge of a running server: `/proc/stat`'s totals, sampled at most
/// every `SAMPLE_MS` by whichever caller finds the last sample stale (one
/// read of a small procfs file; every other call is two atomic loads).
#[derive(Debug)]
pub struct MachineCpu {
    start: Instant,
    /// When the next sample is due, in ms since `start`.
    next_ms: AtomicU64,
    /// The last computed percentage; `UNKNOWN` until two samples exist or
    /// when `/proc/stat` cannot be read.
    percent: AtomicU32,
    /// The previous sample's (busy, total) jiffies.
    last: Mutex<Option<(u64, u64)>>,
}

const SAMPLE_MS: u64 = 250;
const UNKNOWN: u32 = u32::MAX;

impl MachineCpu {
    pub fn new() -> MachineCpu {
        let g = MachineCpu {
            start: Instant::now(),
            next_ms: AtomicU64::new(0),
            percent: AtomicU32::new(UNKNOWN),
            last: Mutex::new(None),
        };
        g.sample();
        g
    }

    /// A shared gauge, for `OpenOptions::cpu`.
    pub fn shared() -> Arc<dyn CpuGauge> {
        Arc::new(MachineCpu::new())
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Takes a sample and updates the percentage over the time since the
    /// previous one (a quarter to about a second: the previous sample is
    /// kept until at least `SAMPLE_MS` passed).
    fn sample(&self) {
        let Ok(mut last) = self.last.try_lock() else {
            return; // another caller is sampling
        };
        self.next_ms
            .store(self.now_ms() + SAMPLE_MS, Ordering::Relaxed);
        let Some(now) = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| busy_total(&s))
        else {
            self.percent.store(UNKNOWN, Ordering::Relaxed);
            self.next_ms.store(u64::MAX, Ordering::Relaxed);
            return;
        };
        if let Some(p) = last.and_then(|prev| busy_percent_between(prev, now)) {
            self.percent.store(p, Ordering::Relaxed);
        }
        *last = Some(now);
    }
}

impl Default for MachineCpu {
    fn default() -> Self {
        MachineCpu::new()
    }
}

impl CpuGauge for MachineCpu {
    fn busy_percent(&self) -> Option<u32> {
        if self.now_ms() >= self.next_ms.load(Ordering::Relaxed) {
            self.sample();
        }
        match self.percent.load(Ordering::Relaxed) {
            UNKNOWN => None,
            p => Some(p),
        }
    }
}

/// A gauge that reports what it is told: tests.
#[derive(Debug)]
pub struct FixedCpu(pub AtomicU32);

impl FixedCpu {
    pub fn shared(percent: u32) -> Arc<FixedCpu> {
        Arc::new(FixedCpu(AtomicU32::new(percent)))
    }

    pub fn set(&self, percent: u32) {
        self.0.store(percent, Ordering::Relaxed);
    }
}

impl CpuGauge for FixedCpu {
    fn busy_percent(&self) -> Option<u32> {
        Some(self.0.load(Ordering::Relaxed))
    }
}

/// The busy and total jiffies of `/proc/stat`'s first line (`cpu  user
/// nice system idle iowait irq softirq steal guest guest_nice`): busy is
/// everything but idle and iowait; guest time is already in user and nice.
fn busy_total(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().next()?;
    let mut fields = line.split_ascii_whitespace();
    if fields.next()? != "cpu" {
        return None;
    }
    let v: Vec<u64> = fields
        .take(8)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    if v.len() < 5 {
        return None; // idle and iowait at least
    }
    let total: u64 = v.iter().sum();
    Some((total - v[3] - v[4], total))
}

/// Busy percent between two samples; None if no time passed (or the
/// counters went back, which they do not).
fn busy_percent_between(a: (u64, u64), b: (u64, u64)) -> Option<u32> {
    let total = b.1.checked_sub(a.1).filter(|&t| t > 0)?;
    let busy = b.0.checked_sub(a.0)?.min(total);
    Some((busy * 100 / total) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_first_line_parses_busy_and_total() {
        let s = "cpu  100 5 50 800 40 3 2 0 0 0\ncpu0 50 2 25 400 20 1 1 0 0 0\n";
        assert_eq!(busy_total(s), Some((160, 1000)));
        // An old kernel's four-field line has no iowait: refused, not guessed.
        assert_eq!(busy_total("cpu  1 2 3 4\n"), None);
        assert_eq!(busy_total("intr 5\n"), None);
        assert_eq!(busy_total(""), None);
        assert_eq!(busy_total("cpu  1 x 3 4 5\n"), None);
    }

    #[test]
    fn busy_percent_is_the_busy_share_of_the_interval() {
        assert_eq!(busy_percent_between((100, 1000), (175, 1100)), Some(75));
        assert_eq!(busy_percent_between((100, 1000), (100, 1000)), None);
        assert_eq!(busy_percent_between((100, 1000), (50, 1100)), None);
    }

    #[test]
    fn the_machine_gauge_reads_this_machine() {
        let g = MachineCpu::new();
        std::thread::sleep(std::time::Duration::from_millis(SAMPLE_MS + 50));
        let p = g.busy_percent();
        if std::path::Path::new("/proc/stat").exists() {
            assert!(p.is_some_and(|p| p <= 100), "{p:?}");
        } else {
            assert_eq!(p, None);
        }
    }
}
