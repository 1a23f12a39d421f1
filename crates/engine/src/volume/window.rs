//! Finding a write's duplicates anywhere in the volume (the dedup window,
//! docs/design/dedup-window.md): the exact hot index first, then the
//! fingerprint tables a hook points at. Per write request, like a segment
//! of sparse indexing (Lillibridge et al., FAST '09):
//! - A, one hold of the index lock: every block is looked up in the hot
//!   index, then in the cached tables; a sampled block that missed both
//!   asks the hook index which table holds its row;
//! - B, no lock: the tables those hooks name are loaded (from memory, the
//!   log's buffer or the store) into the table cache, with any successor
//!   an earlier request queued;
//! - C, one hold: the blocks still without a candidate are looked up in
//!   the cache again, so the whole request rides on one hook.
//!
//! A candidate is a hint: `prepare` compares it byte for byte with the
//! stored block, and `commit` checks the record is still live.
use super::prepare::DupTarget;
use super::{Dedup, Volume, BS};
use crate::dedup::tables::CacheHit;
use crate::dedup::{self, Fingerprint, Index};
use crate::error::VolError;
use crate::liveness::{decode_fp_record, read_fp_table};
use crate::logread::verify_record;
use cvol_format::fprints::FpRow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Most tables one request loads for its hooks.
const LOADS_PER_REQUEST: usize = 8;

/// Where a dedup candidate came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::volume) enum Source {
    Hot,
    Table,
}

/// Counters of the window's lookups since open, for `stat`.
#[derive(Debug, Default)]
pub(in crate::volume) struct WindowCounters {
    pub(in crate::volume) hook_lookups: AtomicU64,
    pub(in crate::volume) hook_hits: AtomicU64,
    pub(in crate::volume) hook_misses: AtomicU64,
    pub(in crate::volume) hook_stale: AtomicU64,
    pub(in crate::volume) table_cache_hits: AtomicU64,
    pub(in crate::volume) table_cache_misses: AtomicU64,
    pub(in crate::volume) table_reads: AtomicU64,
    pub(in crate::volume) table_prefetches: AtomicU64,
    pub(in crate::volume) table_read_errors: AtomicU64,
    pub(in crate::volume) hits_hot: AtomicU64,
    pub(in crate::volume) hits_table: AtomicU64,
    pub(in crate::volume) verify_rejects: AtomicU64,
    pub(in crate::volume) replayed_tables: AtomicU64,
    /// Fingerprint table bytes appended since open, and their count when
    /// the last hook snapshot began; that snapshot's bytes.
    pub(in crate::volume) fp_table_bytes: AtomicU64,
    pub(in crate::volume) snapshot_mark: AtomicU64,
    pub(in crate::volume) snapshot_last_bytes: AtomicU64,
    /// The cleaner moved a record of the snapshot (it is written again).
    pub(in crate::volume) snapshot_moved: std::sync::atomic::AtomicBool,
    pub(in crate::volume) snapshots: AtomicU64,
    pub(in crate::volume) snapshot_bytes: AtomicU64,
    pub(in crate::volume) snapshot_skipped: AtomicU64,
    /// Hooks taken from the snapshot at open.
    pub(in crate::volume) snapshot_entries: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    if n != 0 {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// What the lookup found for one write.
pub(in crate::volume) struct Found {
    /// Per block: the same content earlier in this write, or a candidate.
    pub(in crate::volume) targets: Vec<Option<DupTarget>>,
    /// Blocks whose hook named a table (checked in phase C).
    hooked: Vec<(usize, u32)>,
    /// Tables to load in phase B, and how many of them are successors.
    wanted: Vec<u32>,
    prefetches: u64,
}

impl Found {
    fn want(&mut self, t: u32) {
        if !self.wanted.contains(&t) && self.wanted.len() < LOADS_PER_REQUEST {
            self.wanted.push(t);
        }
    }
}

/// The candidate a cached row gives, and the successor to queue when the
/// run it belongs to passed the middle of its table.
fn from_cache(ix: &mut Index, key: u64) -> Option<DupTarget> {
    let CacheHit {
        entry,
        owner,
        table,
        row,
        rows,
    } = ix.cache.lookup(key)?;
    if row >= rows / 2 {
        if let Some(next) = ix.successor(table) {
            if !ix.cache.contains(next) {
                ix.cache.want(next);
            }
        }
    }
    Some(DupTarget::Record(entry, owner, Source::Table))
}

/// A hook whose block no table held (its table gone, damaged, or without
/// the row) is stale: forgotten, it costs no more reads.
fn forget_stale(ix: &mut Index, found: &mut Found, fps: &[Fingerprint], c: &WindowCounters) {
    let mut stale = 0;
    for &(i, t) in &found.hooked {
        if found.targets[i].is_none() {
            ix.hooks.forget(dedup::key(fps[i]), t);
            stale += 1;
        }
    }
    found.hooked.clear();
    bump(&c.hook_stale, stale);
}

/// Phase C over tables too large for the cache: their rows by key.
fn search_uncached(found: &mut Found, fps: &[Fingerprint], tables: &[Arc<[FpRow]>]) {
    for rows in tables {
        let by_key: HashMap<u64, &FpRow> = rows.iter().map(|r| (r.fp, r)).collect();
        for (i, &fp) in fps.iter().enumerate() {
            if fp == 0 || found.targets[i].is_some() {
                continue;
            }
            if let Some(r) = by_key.get(&dedup::key(fp)) {
                let t = DupTarget::Record(r.entry(), u64::from(r.owner), Source::Table);
                found.targets[i] = Some(t);
            }
        }
    }
}

impl Volume {
    /// Candidates for the write's non-zero blocks `fps` (phases A-C);
    /// repeats inside the write are matched by bytes.
    pub(in crate::volume) fn window_lookup(
        &self,
        d: &Dedup,
        lba: u64,
        data: &[u8],
        fps: &[Fingerprint],
    ) -> Result<Found, VolError> {
        let mut found = self.phase_a(d, lba, data, fps)?;
        if found.wanted.is_empty() {
            return Ok(found);
        }
        let c = &self.counters.window;
        let mut loaded = Vec::new();
        for &t in &found.wanted {
            if let Some(rows) = self.load_fp_table(t) {
                loaded.push((t, rows));
            }
        }
        bump(&c.table_reads, found.wanted.len() as u64);
        bump(&c.table_prefetches, found.prefetches);
        let mut ix = self.note_poison(d.index.lock())?;
        // A table larger than the whole cache is not cached: this request
        // still searches it (a small `--dedup-memory` on very compressible
        // data, whose tables hold thousands of rows).
        let mut uncached = Vec::new();
        for (t, rows) in loaded {
            ix.cache.insert(t, Arc::clone(&rows));
            if !ix.cache.contains(t) {
                uncached.push(rows);
            }
        }
        self.phase_c(&mut ix, &mut found, fps);
        if !uncached.is_empty() {
            drop(ix);
            search_uncached(&mut found, fps, &uncached);
            ix = self.note_poison(d.index.lock())?;
        }
        forget_stale(&mut ix, &mut found, fps, c);
        Ok(found)
    }

    /// Phase A, one hold of the index lock: hot index, cached tables,
    /// hooks; in-write repeats by bytes.
    fn phase_a(
        &self,
        d: &Dedup,
        lba: u64,
        data: &[u8],
        fps: &[Fingerprint],
    ) -> Result<Found, VolError> {
        let nblocks = fps.len();
        let block = |i: usize| &data[i * BS..(i + 1) * BS];
        let mut found = Found {
            targets: vec![None; nblocks],
            hooked: Vec::new(),
            wanted: Vec::new(),
            prefetches: 0,
        };
        let (mut cache_hits, mut cache_misses, mut hook_lookups, mut hook_hits) = (0, 0, 0, 0);
        let mut ix = self.note_poison(d.index.lock())?;
        for &fp in fps.iter().filter(|&&fp| fp != 0) {
            ix.hot.prefetch(fp);
        }
        let mut first: HashMap<Fingerprint, usize> = HashMap::new();
        for (i, &fp) in fps.iter().enumerate().filter(|(_, &fp)| fp != 0) {
            if nblocks > 1 {
                match first.get(&fp) {
                    Some(&i0) if block(i0) == block(i) => {
                        found.targets[i] = Some(DupTarget::Earlier(lba + i0 as u64));
                        continue;
                    }
                    Some(_) => continue, // a collision inside one write: store it
                    None => {
                        first.insert(fp, i);
                    }
                }
            }
            if let Some((e, owner)) = ix.hot.lookup(fp) {
                found.targets[i] = Some(DupTarget::Record(e, owner, Source::Hot));
                continue;
            }
            let key = dedup::key(fp);
            if let Some(t) = from_cache(&mut ix, key) {
                found.targets[i] = Some(t);
                cache_hits += 1;
                continue;
            }
            cache_misses += 1;
            if ix.hooks.sampled(key) {
                hook_lookups += 1;
                if let Some(t) = ix.hooks.lookup(key) {
                    hook_hits += 1;
                    found.hooked.push((i, t));
                    if !ix.cache.contains(t) {
                        found.want(t);
                    }
                }
            }
        }
        while let Some(t) = ix.cache.take_wanted() {
            if found.wanted.len() < LOADS_PER_REQUEST && !found.wanted.contains(&t) {
                found.wanted.push(t);
                found.prefetches += 1;
            }
        }
        drop(ix);
        let c = &self.counters.window;
        bump(&c.table_cache_hits, cache_hits);
        bump(&c.table_cache_misses, cache_misses);
        bump(&c.hook_lookups, hook_lookups);
        bump(&c.hook_hits, hook_hits);
        bump(&c.hook_misses, hook_lookups - hook_hits);
        Ok(found)
    }

    /// Phase C: blocks still without a candidate, in the tables just
    /// loaded.
    fn phase_c(&self, ix: &mut Index, found: &mut Found, fps: &[Fingerprint]) {
        let mut cache_hits = 0;
        for (i, &fp) in fps.iter().enumerate() {
            if fp == 0 || found.targets[i].is_some() {
                continue;
            }
            if let Some(t) = from_cache(ix, dedup::key(fp)) {
                found.targets[i] = Some(t);
                cache_hits += 1;
            }
        }
        bump(&self.counters.window.table_cache_hits, cache_hits);
    }

    /// Fingerprint table `t`'s rows: from memory (a part not written
    /// since it changed), else its record (the log's buffer, else the
    /// store). None when it has none or it cannot be read or decoded (a
    /// hint lost, counted).
    fn load_fp_table(&self, t: u32) -> Option<Arc<[FpRow]>> {
        let t = t as usize;
        let (r, buffered) = {
            let st = self.lock_state().ok()?;
            if let Some(rows) = st.live.fp_rows(t) {
                return Some(Arc::from(rows.as_slice()));
            }
            let r = st.live.fp_table_ref(t)?;
            let buffered = st
                .log
                .buffered(r.offset, r.len as usize)
                .map(<[u8]>::to_vec);
            (r, buffered)
        };
        let rows = match buffered {
            Some(b) => verify_record(&self.sb, b)
                .map_err(|e| crate::error::MetaError::Damaged(e.to_string()))
                .and_then(|(h, rec)| decode_fp_record(&self.sb, t, &r, &h, &rec)),
            None => read_fp_table(&*self.storage, &self.sb, t, &r),
        };
        match rows {
            Ok(rows) => Some(Arc::from(rows)),
            Err(e) => {
                tracing::debug!("fingerprint table {t} not loaded: {e}");
                bump(&self.counters.window.table_read_errors, 1);
                None
            }
        }
    }

    /// Counts a candidate that became a reference, by where it came from.
    pub(in crate::volume) fn count_dup_hit(&self, source: Source) {
        let c = &self.counters.window;
        bump(
            match source {
                Source::Hot => &c.hits_hot,
                Source::Table => &c.hits_table,
            },
            1,
        );
    }

    /// The entry and owner of a candidate that failed verification.
    pub(in crate::volume) fn count_verify_reject(&self) {
        bump(&self.counters.window.verify_rejects, 1);
    }
}

impl Volume {
    /// The window's keys of `stat` (`distinct`: distinct blocks stored).
    pub(in crate::volume) fn window_stats(
        &self,
        s: &mut crate::stats::DedupStats,
        ix: Option<&Index>,
        distinct: u64,
    ) {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let c = &self.counters.window;
        let bs = BS as u64;
        if let Some(ix) = ix {
            let h = ix.hooks.stats();
            let by_hooks = h.entries << h.sample_bits;
            s.dedup_window_hot_bytes = ix.hot.entries.min(distinct) * bs;
            s.dedup_window_bytes = ix.hot.entries.max(by_hooks).min(distinct) * bs;
            s.dedup_hook_entries = h.entries;
            s.dedup_hook_capacity = h.capacity;
            s.dedup_hook_sample_log2 = u64::from(h.sample_bits);
            s.dedup_hook_memory_bytes = h.memory_bytes;
            s.dedup_hook_evictions = h.evictions;
            s.dedup_hook_sweeps = h.sweeps;
            s.dedup_hooks_full = h.full;
            s.dedup_hook_load = ix.load.name().to_string();
            s.dedup_table_cache_tables = ix.cache.tables();
            s.dedup_table_cache_bytes = ix.cache.memory_bytes();
        }
        s.dedup_hook_lookups = get(&c.hook_lookups);
        s.dedup_hook_hits = get(&c.hook_hits);
        s.dedup_hook_misses = get(&c.hook_misses);
        s.dedup_hook_stale = get(&c.hook_stale);
        s.dedup_hook_replayed_tables = get(&c.replayed_tables);
        s.dedup_hook_snapshot_entries = get(&c.snapshot_entries);
        s.dedup_hook_snapshots = get(&c.snapshots);
        s.dedup_hook_snapshot_bytes = get(&c.snapshot_bytes);
        s.dedup_hook_snapshot_skipped = get(&c.snapshot_skipped);
        s.dedup_table_cache_hits = get(&c.table_cache_hits);
        s.dedup_table_cache_misses = get(&c.table_cache_misses);
        s.dedup_table_reads = get(&c.table_reads);
        s.dedup_table_prefetches = get(&c.table_prefetches);
        s.dedup_table_read_errors = get(&c.table_read_errors);
        s.dedup_table_reads_per_lookup = match s.dedup_lookups {
            0 => 0.0,
            n => s.dedup_table_reads as f64 / n as f64,
        };
        s.dedup_hits_hot = get(&c.hits_hot);
        s.dedup_hits_table = get(&c.hits_table);
        s.dedup_verify_rejects = get(&c.verify_rejects);
    }
}
