//! The local chunk cache: the sparse cache file holding the bytes of the
//! chunks in use. Reads fill what is not valid locally with ranged GETs of
//! the chunk's object (64 KiB at least); writes land in the file (dirty
//! until a sync or an upload takes them); whole-chunk discards; clean
//! chunks are evicted, least recently used first, when the file outgrows
//! its budget.
//!
//! Depends on: `state`, `config`, `error`.
use super::config::Config;
use super::error::Error;
use super::state::{err, lock, Inner};
use crate::bits::Bits;
use crate::format::{Descriptor, ObjId, SECTOR};
use cvol_storage::{FileStorage, Storage};
use object_store::path::Path as ObjPath;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Least bytes a miss fetches (aligned), in sectors: 64 KiB.
const FETCH_SECTORS: u64 = 128;

/// Makes the cache directory and the volume's cache file in it (empty,
/// locked by this process); its path and storage.
pub(super) fn open_cache_file(
    cfg: &Config,
    d: &Descriptor,
) -> Result<(PathBuf, FileStorage), Error> {
    std::fs::create_dir_all(&cfg.cache_dir).map_err(|source| Error::CacheDir {
        dir: cfg.cache_dir.clone(),
        source,
    })?;
    let file = cfg
        .cache_dir
        .join(format!("{}.cache", cache_name(&cfg.label)));
    match FileStorage::create_private(&file, d.size_bytes) {
        Ok(local) => Ok((file, local)),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Err(Error::CacheInUse { file }),
        Err(source) => Err(Error::CacheFile { file, source }),
    }
}

/// A file name for a volume's cache: its label with anything but
/// letters, digits, `.`, `-` and `_` replaced.
pub(super) fn cache_name(label: &str) -> String {
    label
        .trim_start_matches("s3://")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || ".-_".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

impl Inner {
    /// Makes sectors `[from, to)` of chunk `c` valid locally, fetching what
    /// is not; true when nothing had to be fetched.
    pub(super) fn ensure_valid(&self, c: u32, from: u64, to: u64) -> io::Result<bool> {
        let n = self.sectors(c);
        let mut hit = true;
        for _ in 0..100 {
            let (runs, obj) = {
                let mut ch = lock(&self.chunks[c as usize]);
                ch.last_use = self.now();
                if ch.valid.runs(from, to, false).is_empty() {
                    return Ok(hit);
                }
                let wf = from / FETCH_SECTORS * FETCH_SECTORS;
                let wt = to
                    .div_ceil(FETCH_SECTORS)
                    .saturating_mul(FETCH_SECTORS)
                    .min(n);
                (ch.valid.runs(wf, wt, false), ch.object)
            };
            hit = false;
            let Some(obj) = obj else {
                // Invalid sectors exist only in chunks with an object.
                debug_assert!(false, "chunk {c} has invalid sectors and no object");
                lock(&self.chunks[c as usize]).valid = Bits::All;
                continue;
            };
            self.fetch(c, obj, &runs)?;
        }
        Err(err(format!(
            "chunk {c}: could not fill it (it kept changing)"
        )))
    }

    /// GETs sector runs of chunk `c`'s object `obj` and writes those still
    /// invalid to the cache file (none if the chunk changed object meanwhile).
    fn fetch(&self, c: u32, obj: ObjId, runs: &[(u64, u64)]) -> io::Result<()> {
        let n = self.sectors(c);
        let ranges: Vec<std::ops::Range<u64>> =
            runs.iter().map(|&(a, b)| a * SECTOR..b * SECTOR).collect();
        let name = ObjPath::from(self.names.chunk(c, obj));
        let got = self
            .block(self.store.get_ranges(&name, &ranges))
            .map_err(err)?;
        self.c
            .gets
            .fetch_add(ranges.len() as u64, Ordering::Relaxed);
        let (start, _) = self.d.chunk_range(c);
        let mut ch = lock(&self.chunks[c as usize]);
        if ch.object != Some(obj) {
            return Ok(());
        }
        for (&(a, b), data) in runs.iter().zip(&got) {
            if data.len() as u64 != (b - a) * SECTOR {
                return Err(err(format!(
                    "chunk {c}: object {} returned {} bytes for {} asked",
                    self.names.chunk(c, obj),
                    data.len(),
                    (b - a) * SECTOR
                )));
            }
            self.c
                .get_bytes
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            // Only sectors still invalid: a write may have come meanwhile.
            for (x, y) in ch.valid.runs(a, b, false) {
                let part = &data[((x - a) * SECTOR) as usize..((y - a) * SECTOR) as usize];
                self.local.write_at(start + x * SECTOR, part)?;
                ch.valid.assign(x, y, true, n);
            }
        }
        Ok(())
    }

    /// `[offset, offset + len)` cut at chunk boundaries: (chunk, from, to).
    fn pieces(&self, offset: u64, len: u64) -> Vec<(u32, u64, u64)> {
        let mut v = Vec::new();
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let c = self.d.chunk_of(at);
            let (start, clen) = self.d.chunk_range(c);
            let to = end.min(start + clen);
            v.push((c, at, to));
            at = to;
        }
        v
    }

    fn check_range(&self, offset: u64, len: usize) -> io::Result<()> {
        cvol_storage::check_range(offset, len, self.d.size_bytes)
    }

    pub(super) fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check_range(offset, buf.len())?;
        let pieces = self.pieces(offset, buf.len() as u64);
        let mut hit = true;
        for _ in 0..100 {
            for &(c, a, b) in &pieces {
                let (start, _) = self.d.chunk_range(c);
                hit &= self.ensure_valid(c, (a - start) / SECTOR, (b - start).div_ceil(SECTOR))?;
            }
            // The local bytes are read under the chunks' locks (ascending:
            // no other path holds two), so no eviction punches them meanwhile.
            let guards: Vec<_> = pieces
                .iter()
                .map(|&(c, _, _)| lock(&self.chunks[c as usize]))
                .collect();
            let valid = pieces.iter().zip(&guards).all(|(&(c, a, b), ch)| {
                let (start, _) = self.d.chunk_range(c);
                ch.valid
                    .runs((a - start) / SECTOR, (b - start).div_ceil(SECTOR), false)
                    .is_empty()
            });
            if !valid {
                // Evicted between the fill and the lock: fill again.
                continue;
            }
            self.local.read_at(offset, buf)?;
            drop(guards);
            let counter = if hit { &self.c.hits } else { &self.c.misses };
            counter.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        Err(err(format!(
            "read at {offset}: the cache kept evicting what it fetched (--cache-size too small?)"
        )))
    }

    pub(super) fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.check_range(offset, data.len())?;
        if self.read_only {
            return Err(io::Error::new(io::ErrorKind::PermissionDenied, "read-only"));
        }
        self.check_failed()?;
        let mut done = 0usize;
        for (c, a, b) in self.pieces(offset, data.len() as u64) {
            let part = &data[done..done + (b - a) as usize];
            done += part.len();
            self.write_piece(c, a, b, part)?;
            lock(&self.changed).insert(c);
        }
        Ok(())
    }

    /// Writes bytes `[a, b)` of the volume, all in chunk `c`, to the cache
    /// file: dirty, valid, and the chunk's write time and end noted.
    fn write_piece(&self, c: u32, a: u64, b: u64, part: &[u8]) -> io::Result<()> {
        let (start, clen) = self.d.chunk_range(c);
        let n = clen / SECTOR;
        let (from, to) = ((a - start) / SECTOR, (b - start).div_ceil(SECTOR));
        loop {
            // Partial sectors at the edges need their old bytes.
            if !a.is_multiple_of(SECTOR) {
                self.ensure_valid(c, from, from + 1)?;
            }
            if !b.is_multiple_of(SECTOR) {
                self.ensure_valid(c, to - 1, to)?;
            }
            let mut ch = lock(&self.chunks[c as usize]);
            let edges_ok = (a.is_multiple_of(SECTOR) || ch.valid.get(from))
                && (b.is_multiple_of(SECTOR) || ch.valid.get(to - 1));
            if !edges_ok {
                continue;
            }
            self.local.write_at(a, part)?;
            ch.valid.assign(from, to, true, n);
            ch.dirty.assign(from, to, true, n);
            ch.last_write = self.now();
            ch.last_use = ch.last_write;
            ch.wrote_end |= to == n;
            return Ok(());
        }
    }

    pub(super) fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        if self.read_only || len == 0 {
            return Ok(());
        }
        self.check_range(offset, len as usize)?;
        for (c, a, b) in self.pieces(offset, len) {
            let (start, clen) = self.d.chunk_range(c);
            if a != start || b != start + clen {
                continue; // advisory: only whole chunks are dropped
            }
            let mut ch = lock(&self.chunks[c as usize]);
            self.local.discard(start, clen)?;
            ch.gen += 1;
            ch.valid = Bits::All;
            ch.dirty = Bits::None;
            ch.wrote_end = false;
            ch.pending = Some(None);
            drop(ch);
            lock(&self.changed).insert(c);
        }
        Ok(())
    }

    pub(super) fn next_data(&self, offset: u64) -> io::Result<Option<u64>> {
        if offset >= self.d.size_bytes {
            return Ok(None);
        }
        // A chunk with an object may hold data anywhere; one without holds
        // only what the cache file holds (written or applied from deltas).
        let local = self.local.next_data(offset)?;
        for c in self.d.chunk_of(offset)..self.d.chunk_count() as u32 {
            let (start, len) = self.d.chunk_range(c);
            if lock(&self.chunks[c as usize]).object.is_some() {
                return Ok(Some(offset.max(start)));
            }
            if let Some(x) = local.filter(|&x| x < start + len) {
                return Ok(Some(x));
            }
        }
        Ok(None)
    }

    /// Evicts clean chunks, least recently used first, while the cache
    /// file holds more than its budget (at most every half second).
    pub(super) fn evict_if_needed(&self, last: &mut Instant) {
        if last.elapsed() < Duration::from_millis(500) {
            return;
        }
        *last = Instant::now();
        let Some(used) = self.local.allocated_bytes() else {
            return;
        };
        if used <= self.cache_bytes {
            return;
        }
        let target = self.cache_bytes / 10 * 9;
        let mut cands: Vec<(u64, u32)> = (0..self.chunks.len())
            .filter_map(|c| {
                let ch = lock(&self.chunks[c]);
                ch.evictable().then_some((ch.last_use, c as u32))
            })
            .collect();
        cands.sort_unstable();
        let mut used = used;
        for (_, c) in cands {
            if used <= target {
                break;
            }
            let (start, len) = self.d.chunk_range(c);
            let mut ch = lock(&self.chunks[c as usize]);
            if !ch.evictable() {
                continue;
            }
            let held = ch.valid.count(len / SECTOR) * SECTOR;
            if self.local.discard(start, len).is_err() {
                continue;
            }
            ch.valid = Bits::None;
            used = used.saturating_sub(held);
            self.c.evictions.fetch_add(1, Ordering::Relaxed);
        }
    }
}
