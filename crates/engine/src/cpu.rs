//! The machine's CPU load, passed in like the time (`crate::clock`): the
//! elastic codec policy asks how busy the whole machine's cores are, so that
//! inline compression steps down to the busy codec when the CPU, which the
//! clients need too, is the bottleneck ([EDC] picks the codec by the
//! bottleneck; the I/O rate alone misses a database whose commits are few
//! but whose CPU is spent).
//!
//! The same gauge tells the NBD server's busy polling (`cvol serve
//! --busy-poll`) whether threads are waiting for a core: the kernel's CPU
//! pressure (`/proc/pressure/cpu`), the share of time at least one runnable
//! task waited. Polling for a client's next request is only worth its CPU
//! while nobody else wants that CPU.
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

    /// Percent of the time over about the last second during which at
    /// least one runnable task waited for a core (the kernel's CPU
    /// pressure, "some"), or None when the kernel does not report it.
    fn pressure_percent(&self) -> Option<u32> {
        None
    }
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
    /// The last CPU pressure percentage, `UNKNOWN` likewise.
    pressure: AtomicU32,
    /// The previous sample.
    last: Mutex<Sample>,
}

/// `/proc/stat`'s (busy, total) jiffies and the CPU pressure's stall
/// microseconds, with when they were read.
#[derive(Debug, Default, Clone, Copy)]
struct Sample {
    jiffies: Option<(u64, u64)>,
    stall: Option<(u64, Instant)>,
}

const SAMPLE_MS: u64 = 250;
const UNKNOWN: u32 = u32::MAX;

impl MachineCpu {
    pub fn new() -> MachineCpu {
        let g = MachineCpu {
            start: Instant::now(),
            next_ms: AtomicU64::new(0),
            percent: AtomicU32::new(UNKNOWN),
            pressure: AtomicU32::new(UNKNOWN),
            last: Mutex::new(Sample::default()),
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

    /// Takes a sample and updates the percentages over the time since the
    /// previous one (a quarter to about a second: the previous sample is
    /// kept until at least `SAMPLE_MS` passed). A file that cannot be read
    /// makes its figure unknown; when neither can, sampling stops.
    fn sample(&self) {
        let Ok(mut last) = self.last.try_lock() else {
            return; // another caller is sampling
        };
        self.next_ms
            .store(self.now_ms() + SAMPLE_MS, Ordering::Relaxed);
        let jiffies = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| busy_total(&s));
        let stall = std::fs::read_to_string("/proc/pressure/cpu")
            .ok()
            .and_then(|s| some_stall_us(&s))
            .map(|us| (us, Instant::now()));
        update(&self.percent, last.jiffies, jiffies, busy_percent_between);
        update(&self.pressure, last.stall, stall, stall_percent_between);
        if jiffies.is_none() && stall.is_none() {
            self.next_ms.store(u64::MAX, Ordering::Relaxed);
        }
        *last = Sample { jiffies, stall };
    }

    /// Samples if the last sample is stale.
    fn refresh(&self) {
        if self.now_ms() >= self.next_ms.load(Ordering::Relaxed) {
            self.sample();
        }
    }
}

/// Sets `gauge` to `between(prev, now)` when both samples exist, to
/// unknown when the new one could not be read; keeps it otherwise.
fn update<T: Copy>(
    gauge: &AtomicU32,
    prev: Option<T>,
    now: Option<T>,
    between: impl Fn(T, T) -> Option<u32>,
) {
    match (prev, now) {
        (_, None) => gauge.store(UNKNOWN, Ordering::Relaxed),
        (Some(prev), Some(now)) => {
            if let Some(p) = between(prev, now) {
                gauge.store(p, Ordering::Relaxed);
            }
        }
        (None, Some(_)) => {}
    }
}

impl Default for MachineCpu {
    fn default() -> Self {
        MachineCpu::new()
    }
}

impl CpuGauge for MachineCpu {
    fn busy_percent(&self) -> Option<u32> {
        self.refresh();
        match self.percent.load(Ordering::Relaxed) {
            UNKNOWN => None,
            p => Some(p),
        }
    }

    fn pressure_percent(&self) -> Option<u32> {
        self.refresh();
        match self.pressure.load(Ordering::Relaxed) {
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

/// The microseconds some task waited for a core, from the first line of
/// `/proc/pressure/cpu` (`some avg10=.. avg60=.. avg300=.. total=US`).
fn some_stall_us(pressure: &str) -> Option<u64> {
    let line = pressure.lines().find(|l| l.starts_with("some "))?;
    let total = line
        .split_ascii_whitespace()
        .find_map(|f| f.strip_prefix("total="))?;
    total.parse().ok()
}

/// Stall percent of the wall time between two samples; None if less than
/// a millisecond passed or the counter went back.
fn stall_percent_between(a: (u64, Instant), b: (u64, Instant)) -> Option<u32> {
    let wall_us = u64::try_from(b.1.checked_duration_since(a.1)?.as_micros()).ok()?;
    if wall_us < 1000 {
        return None;
    }
    let stall_us = b.0.checked_sub(a.0)?.min(wall_us);
    Some((stall_us * 100 / wall_us) as u32)
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
    fn cpu_pressure_is_the_stalled_share_of_the_wall_time() {
        let psi = "some avg10=1.50 avg60=13.52 avg300=33.81 total=10913021197\n\
                   full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
        assert_eq!(some_stall_us(psi), Some(10_913_021_197));
        assert_eq!(some_stall_us("full avg10=0.00 total=5\n"), None);
        assert_eq!(some_stall_us("some avg10=0.00 total=x\n"), None);
        assert_eq!(some_stall_us(""), None);
        let t = Instant::now();
        let later = |ms| t + std::time::Duration::from_millis(ms);
        assert_eq!(
            stall_percent_between((0, t), (650_000, later(1000))),
            Some(65)
        );
        assert_eq!(stall_percent_between((0, t), (2_000, later(1))), Some(100));
        assert_eq!(
            stall_percent_between((0, t), (5, t)),
            None,
            "no time passed"
        );
        assert_eq!(stall_percent_between((9, t), (5, later(500))), None);
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
        let q = g.pressure_percent();
        let psi = std::fs::read_to_string("/proc/pressure/cpu").is_ok();
        assert_eq!(q.is_some(), psi, "{q:?}");
        assert!(q.is_none_or(|q| q <= 100), "{q:?}");
    }
}
