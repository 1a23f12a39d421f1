//! A cache's background work: fills after misses, CLOCK eviction within
//! the physical size, write-back of dirty lines, and the clean close.
use super::lines::WriteLocks;
use super::{CacheVolume, Fill, Start, BS, EVICT_HIGH_PERCENT, EVICT_LOW_PERCENT};
use cvol_engine::error::VolError;
use cvol_engine::volume::Writer;
use cvol_format::cache::CacheMode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

/// Lines looked at per eviction batch, at most, and evicted per batch.
const EVICT_BATCH_LINES: usize = 64;
/// Dirty lines written back per background round (write-back).
const WRITEBACK_BATCH_LINES: usize = 64;
/// How often the background thread looks at space and dirty lines.
const TICK: Duration = Duration::from_millis(50);

/// Handle of a cache's background thread (stops when dropped).
pub struct CacheWorker {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Drop for CacheWorker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl CacheVolume {
    /// Starts the thread that fills, evicts and writes back.
    pub fn start_background(self: &Arc<Self>) -> CacheWorker {
        let stop = Arc::new(AtomicBool::new(false));
        let (weak, flag): (Weak<CacheVolume>, _) = (Arc::downgrade(self), stop.clone());
        let handle = std::thread::Builder::new()
            .name("cvol-cache".into())
            .spawn(move || {
                while !flag.load(Ordering::SeqCst) {
                    let Some(c) = weak.upgrade() else { return };
                    if let Err(e) = c.background_round(&flag) {
                        tracing::warn!("cache background work: {e}");
                        std::thread::sleep(TICK);
                    }
                }
            })
            .expect("spawn the cache thread");
        CacheWorker {
            stop,
            handle: Some(handle),
        }
    }

    /// Fills until the queue is empty or a tick passed, then evicts and
    /// writes back as needed.
    fn background_round(&self, stop: &AtomicBool) -> Result<(), VolError> {
        let deadline = std::time::Instant::now() + TICK;
        while !stop.load(Ordering::SeqCst) {
            let Some(f) = self.next_fill(deadline) else {
                break;
            };
            self.apply_fill(f)?;
            if std::time::Instant::now() >= deadline {
                break;
            }
        }
        self.maintain()
    }

    fn next_fill(&self, deadline: std::time::Instant) -> Option<Fill> {
        let mut q = self.fills.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(f) = q.0.pop_front() {
                q.1 -= f.data.len() as u64;
                return Some(f);
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return None;
            }
            q = self
                .fill_ready
                .wait_timeout(q, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    pub(super) fn wake_maintenance(&self) {
        self.fill_ready.notify_one();
    }

    /// Runs every queued fill, then eviction and write-back, on this
    /// thread (tests and simulations drive the cache so).
    pub fn run_maintenance(&self) -> Result<(), VolError> {
        loop {
            let f = {
                let mut q = self.fills.lock().unwrap_or_else(|e| e.into_inner());
                let f = q.0.pop_front();
                if let Some(f) = &f {
                    q.1 -= f.data.len() as u64;
                }
                f
            };
            match f {
                Some(f) => self.apply_fill(f)?,
                None => break,
            }
        }
        self.maintain()
    }

    /// Eviction when the cache is full, then a round of write-back.
    fn maintain(&self) -> Result<(), VolError> {
        if self.read_only || self.start == Start::Bypass {
            return Ok(());
        }
        self.check_ok()?;
        self.evict_if_full()?; // also refreshes `fullness_hint`
        if self.mode == CacheMode::WriteBack {
            self.write_back_round(false)?;
        }
        Ok(())
    }

    /// Live bytes over the log's room for them, in percent.
    fn fullness_percent(&self) -> Result<u64, VolError> {
        let (live, room) = self.vol.live_and_room_bytes()?;
        let pct = live * 100 / room.max(1);
        self.fullness_hint.store(pct, Ordering::Relaxed);
        Ok(pct)
    }

    /// Writes a filled line's blocks the cache still lacks, unless blocks of
    /// the line were unmapped or written back since its miss (the slot's
    /// generation rose), or the cache is full.
    fn apply_fill(&self, f: Fill) -> Result<(), VolError> {
        if self.fullness_percent()? >= EVICT_HIGH_PERCENT {
            self.evict_if_full()?;
            if self.fullness_percent()? >= EVICT_HIGH_PERCENT {
                self.counters.fills_dropped.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
        }
        let locks = self.slots.lock_write(f.line, f.line);
        if locks.generation(f.line) != f.generation {
            self.counters.fills_dropped.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        let (lba, n) = (f.first, f.data.len() as u64 / BS);
        debug_assert!(self.line_span(f.line, f.line + 1).0 <= lba);
        let present = self.vol.mapped_blocks(lba, n as usize)?;
        let mut wrote = 0;
        for (a, b, held) in super::io_path_runs(&present) {
            if held {
                continue;
            }
            let part = &f.data[a * BS as usize..b * BS as usize];
            // Fills are off every client's path: the idle codec.
            match self
                .vol
                .write_as(Writer::Background, (lba + a as u64) * BS, part, false)
            {
                Ok(()) => wrote += part.len() as u64,
                Err(VolError::NoSpace) => break,
                Err(e) => return Err(e),
            }
        }
        if wrote > 0 {
            self.resident.set(f.line);
            self.referenced.set(f.line);
            self.counters.fill_bytes.fetch_add(wrote, Ordering::Relaxed);
        }
        drop(locks);
        Ok(())
    }

    /// Evicts cold lines while live bytes are above the high mark, down to
    /// the low mark.
    fn evict_if_full(&self) -> Result<(), VolError> {
        if self.fullness_percent()? < EVICT_HIGH_PERCENT {
            return Ok(());
        }
        // Each batch trims at most EVICT_BATCH_LINES; give up after a
        // sweep that frees nothing (every line busy, dirty or recently used).
        let mut idle = 0;
        while self.fullness_percent()? > EVICT_LOW_PERCENT && idle < 3 {
            match self.evict_batch()? {
                0 => idle += 1,
                _ => idle = 0,
            }
        }
        Ok(())
    }

    /// One CLOCK sweep step: up to EVICT_BATCH_LINES victims (dirty ones
    /// written back and synced at the origin first), trimmed. Lines evicted.
    fn evict_batch(&self) -> Result<usize, VolError> {
        let victims = self.clock_victims();
        let mut wrote_back = false;
        for &line in &victims {
            if self.dirty.get(line) {
                if let Some(mut locks) = self.slots.try_write(line) {
                    self.write_back_line(line, &mut locks)?;
                    wrote_back = true;
                }
            }
        }
        if wrote_back {
            self.sync_origin()?;
        }
        let mut evicted = 0;
        for line in victims {
            evicted += usize::from(self.evict_line(line)?);
        }
        Ok(evicted)
    }

    /// Trims a resident line that is clean at the origin (written back and
    /// synced there), unless a client holds its slot. Whether it went.
    fn evict_line(&self, line: u64) -> Result<bool, VolError> {
        let Some(mut locks) = self.slots.try_write(line) else {
            return Ok(false);
        };
        if self.dirty.get(line) || self.unsynced.get(line) || !self.resident.get(line) {
            return Ok(false);
        }
        // A fill read before a write that the cache held must not land on
        // the blocks this trim unmaps.
        locks.bump();
        let (lba, n) = self.line_span(line, line + 1);
        self.vol.trim(lba * BS, n * BS, false)?;
        self.resident.clear(line);
        self.referenced.clear(line);
        self.counters.evictions.fetch_add(1, Ordering::Relaxed);
        drop(locks);
        Ok(true)
    }

    /// The next victims under CLOCK: resident lines whose second chance is
    /// spent (the hand clears the bit of each line it passes).
    fn clock_victims(&self) -> Vec<u64> {
        let mut hand = self.hand.lock().unwrap_or_else(|e| e.into_inner());
        let mut victims = Vec::new();
        // Two turns at most: the first may only clear second chances.
        for _ in 0..2 * self.lines {
            let line = *hand;
            *hand = (line + 1) % self.lines;
            if self.resident.get(line) && !self.referenced.clear(line) {
                victims.push(line);
                if victims.len() == EVICT_BATCH_LINES {
                    break;
                }
            }
        }
        victims
    }

    /// Writes a dirty line's cached blocks to the origin (its slot held).
    /// The line is clean but unsynced until the next `sync_origin`. The
    /// slot's generation rises: a fill read from the origin before this
    /// write-back holds older data than the origin now does, and must not
    /// land once the line is evicted (found by `tests/cache_sim.rs`).
    fn write_back_line(&self, line: u64, held: &mut WriteLocks<'_>) -> Result<(), VolError> {
        if !self.dirty.get(line) {
            return Ok(());
        }
        held.bump();
        let (lba, n) = self.line_span(line, line + 1);
        let present = self.vol.mapped_blocks(lba, n as usize)?;
        let _gate = self.wb_gate.read().unwrap_or_else(|e| e.into_inner());
        self.unsynced.set(line);
        self.dirty.clear(line);
        for (a, b, held) in super::io_path_runs(&present) {
            if !held {
                continue;
            }
            let mut buf = vec![0u8; (b - a) * BS as usize];
            let at = (lba + a as u64) * BS;
            let r = self
                .vol
                .read_at(at, &mut buf)
                .and_then(|()| self.origin_write(at, &buf));
            if let Err(e) = r {
                self.dirty.set(line);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Syncs the origin and marks every line written back so far synced.
    fn sync_origin(&self) -> Result<(), VolError> {
        let _gate = self.wb_gate.write().unwrap_or_else(|e| e.into_inner());
        self.origin.sync().map_err(super::io_err)?;
        // No write-back runs while the gate is held: every unsynced line's
        // writes completed before the sync.
        for line in self.unsynced.collect_from(0, self.lines, usize::MAX) {
            self.unsynced.clear(line);
        }
        Ok(())
    }

    /// Writes back dirty lines: those not written since the write-back hand
    /// last passed them (the others get their mark cleared), or with `all`
    /// every one (waiting for busy lines); then syncs the origin.
    fn write_back_round(&self, all: bool) -> Result<(), VolError> {
        if self.dirty.count() == 0 {
            return Ok(());
        }
        let batch = if all {
            usize::MAX
        } else {
            WRITEBACK_BATCH_LINES
        };
        let start = *self.wb_hand.lock().unwrap_or_else(|e| e.into_inner());
        let lines = self.dirty.collect_from(start, self.lines, batch);
        let mut wrote = false;
        for &line in &lines {
            if !all && self.touched.clear(line) {
                continue;
            }
            let locks = match all {
                true => Some(self.slots.lock_write(line, line)),
                false => self.slots.try_write(line),
            };
            if let Some(mut locks) = locks {
                self.write_back_line(line, &mut locks)?;
                wrote = true;
            }
        }
        if let Some(&last) = lines.last() {
            *self.wb_hand.lock().unwrap_or_else(|e| e.into_inner()) = (last + 1) % self.lines;
        }
        if wrote {
            self.sync_origin()?;
        }
        Ok(())
    }

    /// A clean close: dirty lines written back and the origin synced, the
    /// cache closed, then the label marked clean with the origin's stamp.
    /// After a failure the label stays open: the next start is cold
    /// (write-through) or recovered (write-back).
    pub fn close(&self) -> Result<(), VolError> {
        if self.read_only {
            return Ok(());
        }
        self.check_ok()?;
        {
            let mut q = self.fills.lock().unwrap_or_else(|e| e.into_inner());
            q.0.clear();
            q.1 = 0;
        }
        if self.mode == CacheMode::WriteBack && self.start != Start::Bypass {
            while self.dirty.count() > 0 {
                self.write_back_round(true)?;
            }
        }
        self.origin.sync().map_err(super::io_err)?;
        self.vol.close()?;
        let stamp = (self.stamp)().map_err(super::io_err)?;
        let mut label = self.label.lock().unwrap_or_else(|e| e.into_inner());
        label.clean = true;
        label.stamp = stamp;
        super::write_label(&**self.vol.storage(), &mut label)
    }

    /// Writes back and evicts every line no client holds now (tests, and
    /// a cache to be emptied). Lines evicted.
    pub fn evict_all(&self) -> Result<u64, VolError> {
        self.write_back_all()?;
        let mut evicted = 0;
        for line in self.resident.collect_from(0, self.lines, usize::MAX) {
            evicted += u64::from(self.evict_line(line)?);
        }
        Ok(evicted)
    }

    /// Writes back every dirty line and syncs the origin (tests).
    pub fn write_back_all(&self) -> Result<(), VolError> {
        while self.dirty.count() > 0 {
            self.write_back_round(true)?;
        }
        Ok(())
    }
}
