//! Client requests of a cache: READ (hits, misses, fills queued), WRITE,
//! TRIM, WRITE_ZEROES and FLUSH, in either mode.
use super::lines::WriteLocks;
use super::{CacheVolume, Fill, Start, BS, FILL_QUEUE_MAX_BYTES};
use cvol_engine::error::VolError;
use cvol_format::cache::CacheMode;
use std::sync::atomic::Ordering;

/// A line a read missed, and its slot's generation then.
struct Missing {
    line: u64,
    generation: u64,
}

/// Runs of equal values in `v`: (start, end, value).
pub(super) fn runs(v: &[bool]) -> Vec<(usize, usize, bool)> {
    let mut out: Vec<(usize, usize, bool)> = Vec::new();
    for (i, &b) in v.iter().enumerate() {
        match out.last_mut() {
            Some(r) if r.2 == b => r.1 = i + 1,
            _ => out.push((i, i + 1, b)),
        }
    }
    out
}

impl CacheVolume {
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), VolError> {
        self.check_range(offset, buf.len() as u64)?;
        self.check_ok()?;
        if buf.is_empty() {
            return Ok(());
        }
        if offset.is_multiple_of(BS) && (buf.len() as u64).is_multiple_of(BS) {
            return self.read_blocks(offset / BS, buf);
        }
        let first = offset / BS;
        let end = (offset + buf.len() as u64).div_ceil(BS);
        let mut tmp = vec![0u8; ((end - first) * BS) as usize];
        self.read_blocks(first, &mut tmp)?;
        let head = (offset - first * BS) as usize;
        buf.copy_from_slice(&tmp[head..head + buf.len()]);
        Ok(())
    }

    /// Whole blocks: the cache's where it holds them, the origin's (whole
    /// lines, queued for a fill) where it does not.
    fn read_blocks(&self, lba: u64, buf: &mut [u8]) -> Result<(), VolError> {
        let n = buf.len() / BS as usize;
        if self.start == Start::Bypass {
            self.counters.misses.fetch_add(n as u64, Ordering::Relaxed);
            return self.origin_read(lba * BS, buf);
        }
        let (l0, l1) = self.lines_of(lba * BS, buf.len() as u64);
        let locks = self.slots.lock_read(l0, l1);
        let present = self.vol.mapped_blocks(lba, n)?;
        let hits = present.iter().filter(|p| **p).count();
        self.counters.hits.fetch_add(hits as u64, Ordering::Relaxed);
        self.mark(&self.referenced, l0, l1);
        if hits == n {
            return self.vol.read_at(lba * BS, buf);
        }
        let mut missing_lines = Vec::new();
        for (a, b, held) in runs(&present) {
            let part = &mut buf[a * BS as usize..b * BS as usize];
            if held {
                self.vol.read_at((lba + a as u64) * BS, part)?;
                continue;
            }
            let first = (lba + a as u64) / self.line_blocks;
            let last = (lba + b as u64 - 1) / self.line_blocks;
            for l in first..=last {
                if missing_lines.last().is_none_or(|m: &Missing| m.line != l) {
                    missing_lines.push(Missing {
                        line: l,
                        generation: locks.generation(l),
                    });
                }
            }
        }
        drop(locks);
        self.counters
            .misses
            .fetch_add((n - hits) as u64, Ordering::Relaxed);
        self.read_missing(lba, buf, &present, &missing_lines)
    }

    /// Reads the lines holding the blocks not `present` from the origin,
    /// copies those blocks into `buf` and queues the lines for a fill.
    fn read_missing(
        &self,
        lba: u64,
        buf: &mut [u8],
        present: &[bool],
        lines: &[Missing],
    ) -> Result<(), VolError> {
        let mut i = 0;
        while i < lines.len() {
            // Consecutive lines in one origin read.
            let mut j = i + 1;
            while j < lines.len() && lines[j].line == lines[j - 1].line + 1 {
                j += 1;
            }
            let (first_lba, nblocks) = self.line_span(lines[i].line, lines[j - 1].line + 1);
            let mut data = vec![0u8; (nblocks * BS) as usize];
            self.origin_read(first_lba * BS, &mut data)?;
            for b in first_lba..first_lba + nblocks {
                let k = b.wrapping_sub(lba);
                if k < present.len() as u64 && !present[k as usize] {
                    let src = ((b - first_lba) * BS) as usize;
                    let dst = (k * BS) as usize;
                    buf[dst..dst + BS as usize].copy_from_slice(&data[src..src + BS as usize]);
                }
            }
            if !self.read_only {
                let asked = (lba, lba + present.len() as u64);
                self.queue_fills(&lines[i..j], first_lba, &data, asked);
            }
            i = j;
        }
        Ok(())
    }

    /// Queues the fills of `lines` (read from the origin from `first_lba`
    /// into `data`): the whole line where reads show spatial locality
    /// (`whole_line`), else only the blocks the client asked for (`asked`,
    /// a range of blocks) — a random reader's one hot block does not bring
    /// a line of cold ones into the cache.
    fn queue_fills(&self, lines: &[Missing], first_lba: u64, data: &[u8], asked: (u64, u64)) {
        let mut q = self.fills.lock().unwrap_or_else(|e| e.into_inner());
        for m in lines {
            let (lba, n) = self.line_span(m.line, m.line + 1);
            let (from, to) = match self.whole_line(m.line) {
                true => (lba, lba + n),
                false => (asked.0.max(lba), asked.1.min(lba + n)),
            };
            let bytes = (to - from) * BS;
            if q.1 + bytes > FILL_QUEUE_MAX_BYTES {
                self.counters.fills_dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            q.1 += bytes;
            let at = ((from - first_lba) * BS) as usize;
            q.0.push_back(Fill {
                line: m.line,
                generation: m.generation,
                first: from,
                data: data[at..at + bytes as usize].to_vec(),
            });
        }
        drop(q);
        self.fill_ready.notify_one();
    }

    /// Whether a miss in `line` fills the whole line: the cache is under
    /// `WHOLE_LINE_BELOW_PERCENT` full (prefetch is free), or the line, or
    /// the one before it, missed among the last `RECENT_MISSES` missed
    /// lines (a sequential reader, or a second block wanted from the same
    /// line). Notes the miss.
    fn whole_line(&self, line: u64) -> bool {
        let roomy = self.fullness_hint.load(Ordering::Relaxed) < super::WHOLE_LINE_BELOW_PERCENT;
        let mut r = self.recent_misses.lock().unwrap_or_else(|e| e.into_inner());
        let before = line.checked_sub(1);
        let near = r.0.iter().any(|&m| m == line || Some(m) == before);
        let at = r.1;
        r.0[at] = line;
        r.1 = (at + 1) % r.0.len();
        roomy || near
    }

    pub fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), VolError> {
        self.check_write(offset, data.len() as u64)?;
        if data.is_empty() {
            return Ok(());
        }
        let (l0, l1) = self.lines_of(offset, data.len() as u64);
        // No generation bump: a write leaves its blocks mapped, and a fill
        // writes only blocks still unmapped. Where the cache forgets
        // blocks instead (`invalidate`), it bumps.
        let mut locks = self.slots.lock_write(l0, l1);
        let r = match self.mode {
            CacheMode::WriteThrough => self.write_through(offset, data, fua, &mut locks),
            CacheMode::WriteBack => self.write_back(offset, data, fua, &mut locks),
        };
        drop(locks);
        if r.is_ok() {
            self.mark(&self.referenced, l0, l1);
        }
        r
    }

    /// The origin first (synced for FUA), then the cache's whole blocks;
    /// partial blocks at the edges are forgotten (the origin has them).
    fn write_through(
        &self,
        offset: u64,
        data: &[u8],
        fua: bool,
        locks: &mut WriteLocks<'_>,
    ) -> Result<(), VolError> {
        self.origin_write(offset, data)?;
        if fua || self.sync_writes {
            self.origin.sync().map_err(super::io_err)?;
        }
        if self.start == Start::Bypass {
            return Ok(());
        }
        let first = offset.div_ceil(BS);
        let end = (offset + data.len() as u64) / BS;
        let (head, tail) = (offset / BS, (offset + data.len() as u64 - 1) / BS);
        for edge in [head, tail] {
            // A block the write covers only in part (once, if both edges).
            if (edge < first || edge >= end) && (edge == head || tail != head) {
                self.invalidate(edge, 1, locks)?;
            }
        }
        if first >= end {
            return Ok(());
        }
        let inner = &data[(first * BS - offset) as usize..(end * BS - offset) as usize];
        match self.vol.write_at(first * BS, inner, false) {
            Ok(()) => {
                let (l0, l1) = self.lines_of(first * BS, inner.len() as u64);
                self.mark(&self.resident, l0, l1);
                Ok(())
            }
            Err(VolError::NoSpace) => {
                self.wake_maintenance();
                self.invalidate(first, end - first, locks)
            }
            Err(e) => Err(e),
        }
    }

    /// The cache only (whole blocks; partial edges merged with the block's
    /// current content), the lines marked dirty. Without room, the origin
    /// takes the write (synced) and the cache forgets those blocks.
    fn write_back(
        &self,
        offset: u64,
        data: &[u8],
        fua: bool,
        locks: &mut WriteLocks<'_>,
    ) -> Result<(), VolError> {
        let first = offset / BS;
        let end = (offset + data.len() as u64).div_ceil(BS);
        let aligned = first * BS == offset && end * BS == offset + data.len() as u64;
        let merged;
        let whole: &[u8] = if aligned {
            data
        } else {
            let mut buf = vec![0u8; ((end - first) * BS) as usize];
            for b in [first, end - 1] {
                let at = ((b - first) * BS) as usize;
                self.read_locked(b, &mut buf[at..at + BS as usize])?;
            }
            let head = (offset - first * BS) as usize;
            buf[head..head + data.len()].copy_from_slice(data);
            merged = buf;
            &merged
        };
        let (l0, l1) = self.lines_of(first * BS, whole.len() as u64);
        match self.vol.write_at(first * BS, whole, fua) {
            Ok(()) => {
                self.mark(&self.resident, l0, l1);
                self.mark(&self.dirty, l0, l1);
                self.mark(&self.touched, l0, l1);
                Ok(())
            }
            Err(VolError::NoSpace) => {
                self.wake_maintenance();
                self.origin_write(first * BS, whole)?;
                self.origin.sync().map_err(super::io_err)?;
                self.invalidate(first, end - first, locks)?;
                // The cache must not bring older copies of these blocks back
                // after a crash (a recovered start writes back all it holds):
                // for a FUA write, its TRIM, and an eviction's before it
                // (the trim is then a no-op), are made durable now. Found by
                // scripts/e2e/cache.sh (kill -9, write-back, 8 MiB cache).
                if fua || self.sync_writes {
                    self.vol.flush()?;
                }
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// One block with its line's slot already held: the cache's copy, or
    /// the origin's.
    pub(super) fn read_locked(&self, lba: u64, out: &mut [u8]) -> Result<(), VolError> {
        if self.vol.mapped_blocks(lba, 1)?[0] {
            self.vol.read_at(lba * BS, out)
        } else {
            self.origin_read(lba * BS, out)
        }
    }

    /// TRIM: forgotten by the cache, discarded at the origin (whole blocks;
    /// TRIM promises nothing about what later reads return).
    pub fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), VolError> {
        self.check_write(offset, len)?;
        let (first, end) = (offset.div_ceil(BS), (offset + len) / BS);
        if first >= end {
            return Ok(());
        }
        let (l0, l1) = self.lines_of(first * BS, (end - first) * BS);
        let mut locks = self.slots.lock_write(l0, l1);
        if self.start != Start::Bypass {
            self.invalidate(first, end - first, &mut locks)?;
        }
        self.origin
            .discard(first * BS, (end - first) * BS)
            .map_err(super::io_err)?;
        drop(locks);
        if fua || self.sync_writes {
            self.flush()?;
        }
        Ok(())
    }

    /// WRITE_ZEROES: zero blocks in the cache (held, not holes) and, in
    /// write-through, zeros at the origin; partial edges as writes.
    pub fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), VolError> {
        self.check_write(offset, len)?;
        let (first, end) = (offset.div_ceil(BS), (offset + len) / BS);
        if first >= end {
            return self.write_at(offset, &vec![0u8; len as usize], fua);
        }
        let head = first * BS - offset;
        let tail = offset + len - end * BS;
        if head > 0 {
            self.write_at(offset, &vec![0u8; head as usize], false)?;
        }
        if tail > 0 {
            self.write_at(end * BS, &vec![0u8; tail as usize], false)?;
        }
        let (l0, l1) = self.lines_of(first * BS, (end - first) * BS);
        let mut locks = self.slots.lock_write(l0, l1);
        let r = self.zero_blocks(first, end, &mut locks);
        drop(locks);
        r?;
        if fua || self.sync_writes {
            self.flush()?;
        }
        Ok(())
    }

    fn zero_blocks(
        &self,
        first: u64,
        end: u64,
        locks: &mut WriteLocks<'_>,
    ) -> Result<(), VolError> {
        let (off, len) = (first * BS, (end - first) * BS);
        if self.mode == CacheMode::WriteThrough {
            self.origin.write_zeroes(off, len).map_err(super::io_err)?;
            self.counters
                .origin_written
                .fetch_add(len, Ordering::Relaxed);
        }
        if self.start == Start::Bypass {
            return Ok(());
        }
        let (l0, l1) = self.lines_of(off, len);
        match self.vol.write_zeroes(off, len, true, false) {
            Ok(()) => {
                self.mark(&self.resident, l0, l1);
                if self.mode == CacheMode::WriteBack {
                    self.mark(&self.dirty, l0, l1);
                    self.mark(&self.touched, l0, l1);
                }
                Ok(())
            }
            Err(VolError::NoSpace) if self.mode == CacheMode::WriteThrough => {
                self.invalidate(first, end - first, locks)
            }
            Err(VolError::NoSpace) => {
                self.origin.write_zeroes(off, len).map_err(super::io_err)?;
                self.origin.sync().map_err(super::io_err)?;
                self.invalidate(first, end - first, locks)
            }
            Err(e) => Err(e),
        }
    }

    /// FLUSH: write-through syncs the origin, then the cache; write-back
    /// makes the cache durable (dirty lines are safe there).
    pub fn flush(&self) -> Result<(), VolError> {
        self.check_ok()?;
        if self.read_only {
            return Ok(());
        }
        if self.mode == CacheMode::WriteThrough {
            self.origin.sync().map_err(super::io_err)?;
            if self.start == Start::Bypass {
                return Ok(());
            }
        }
        self.vol.flush()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn runs_split_at_each_change() {
        assert_eq!(
            super::runs(&[true, true, false, true]),
            vec![(0, 2, true), (2, 3, false), (3, 4, true)]
        );
        assert!(super::runs(&[]).is_empty());
    }
}
