//! Dedup index warm-up after open. The index is memory only; this pass
//! refills it in the background (pausing while clients are busy, like the
//! background cleaner). Lookups meanwhile use what is loaded, never wait.
//! - The hook index first: its persisted snapshot (`volume/hooksnap.rs`),
//!   each entry accepted only if its fingerprint table is unchanged since,
//!   then the fingerprint tables written after the snapshot, oldest first
//!   (all of them when there is no usable snapshot): a hook for each
//!   sampled row, newest wins. Their rows also go into free slots of the
//!   exact hot index. `dedup_hook_load` turns "ready" after this.
//! - Then the older tables, newest first, into the hot index only, while
//!   it is below its fill mark: one read per table of up to 7000
//!   fingerprints, no data read, nothing hashed.
//! - Then, only when segments without any fingerprint table hold more than
//!   an eighth of the live bytes (a volume written by an older cvol, or a
//!   long roll-forward after a crash), from the data: walking the map in
//!   LBA order, reading and fingerprinting blocks in batches.
use super::{Next, Worker};
use crate::dedup::{self, HookLoad};
use crate::liveness::read_fp_table;
use crate::volume::{Volume, BS};
use cvol_format::checkpoint::PageRef;
use cvol_format::{EntryState, MapEntry};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Blocks read per batch.
const WARM_BATCH_BLOCKS: u64 = 256;
/// The warm-up stops once the index is this full (tenths).
const WARM_FULL_TENTHS: u64 = 9;
/// Pause while clients are busy.
const BUSY_PAUSE: Duration = Duration::from_millis(20);
/// The data is read when segments without fingerprint tables hold more
/// than this fraction of the live bytes (1/n).
const UNCOVERED_DIVISOR: u64 = 8;

/// What is left to warm from.
struct Warmup {
    /// Fingerprint tables newer than the hook snapshot (all of them
    /// without one), replayed into the hook index and the hot index: the
    /// oldest last (taken from the end).
    replay: Vec<(usize, PageRef)>,
    /// Older tables, into the hot index only while it has room: the
    /// newest last.
    hot_only: Vec<(usize, PageRef)>,
    /// The LBA the data pass goes on from, if it is needed.
    data: Option<u64>,
}

impl Volume {
    /// Starts refilling the dedup index in the background (volumes with
    /// dedup on; otherwise a handle with no thread).
    pub fn start_index_warmup(self: &Arc<Self>) -> Worker {
        if self.dedup.is_none() {
            return Worker::none();
        }
        let mut plan: Option<Warmup> = None;
        Worker::spawn("cvol-index-warmup", self, Duration::ZERO, move |v| {
            if v.activity.clients_busy() {
                return Next::After(BUSY_PAUSE);
            }
            let w = match &mut plan {
                Some(w) => w,
                None => match v.warm_plan() {
                    Some(w) => plan.insert(w),
                    None => return Next::Stop,
                },
            };
            match v.warm_step(w) {
                true => Next::After(Duration::ZERO),
                false => Next::Stop,
            }
        })
    }

    /// Refills the dedup index now, as the background warm-up would
    /// (tests, tools). Returns the fingerprints indexed.
    pub fn warm_index(&self) -> u64 {
        let before = self.index_entries();
        if let Some(mut w) = self.warm_plan() {
            while self.warm_step(&mut w) {}
        }
        self.index_entries() - before
    }

    /// How many fingerprint tables the map directory names (tests, tools).
    pub fn fingerprint_tables_named(&self) -> u64 {
        self.lock_state()
            .map_or(0, |st| st.live.fp_tables().len() as u64)
    }

    /// Loads the hook snapshot, if one fits, and plans the rest: the
    /// tables to replay, those for the hot index only, and whether the
    /// data must be read too; None without dedup or once poisoned.
    fn warm_plan(&self) -> Option<Warmup> {
        self.dedup.as_ref()?;
        let (tables, uncovered, live) = {
            let st = self.lock_state().ok()?;
            let (uncovered, live) = st.live.fp_uncovered_live();
            (st.live.fp_tables(), uncovered, live)
        };
        let buckets = self.lock_index().ok()??.hooks.bucket_count();
        let since = self.read_hook_snapshot(buckets).map(|snap| {
            let named: HashMap<u32, u64> = (tables.iter())
                .filter_map(|(t, r)| Some((u32::try_from(*t).ok()?, r.seq)))
                .collect();
            self.import_hook_snapshot(&snap, &named);
            snap.root.snapshot_seq
        });
        // Oldest first (popped from the end): a newer row of the same
        // fingerprint replaces an older one.
        let (mut replay, hot_only): (Vec<_>, Vec<_>) =
            (tables.into_iter()).partition(|(_, r)| since.is_none_or(|s| r.seq > s));
        replay.reverse();
        let data = (uncovered * UNCOVERED_DIVISOR > live).then_some(0);
        tracing::debug!(
            replay = replay.len(),
            hot_only = hot_only.len(),
            snapshot_seq = since,
            uncovered_bytes = uncovered,
            live_bytes = live,
            "dedup index warm-up"
        );
        Some(Warmup {
            replay,
            hot_only,
            data,
        })
    }

    /// One table or one batch of data; false when done (nothing left, the
    /// index nearly full, or the volume poisoned).
    fn warm_step(&self, w: &mut Warmup) -> bool {
        if let Some((t, r)) = w.replay.pop() {
            return self.warm_from_table(t, &r, true).is_some();
        }
        if let Ok(Some(mut ix)) = self.lock_index() {
            ix.load = HookLoad::Ready;
        }
        if let Some((t, r)) = w.hot_only.pop() {
            if self.index_room().is_some() {
                return self.warm_from_table(t, &r, false).is_some();
            }
            w.hot_only.clear();
        }
        match w.data.map(|lba| self.warm_index_batch(lba)) {
            Some(Some(next)) => {
                w.data = Some(next);
                true
            }
            _ => false,
        }
    }

    /// Replays fingerprint table `t` (record `r`): a hook for each sampled
    /// row, and its rows into the hot index's free slots while it is below
    /// the fill mark. None when poisoned. A table that cannot be read is
    /// skipped: its rows are hints.
    fn warm_from_table(&self, t: usize, r: &PageRef, hooks: bool) -> Option<()> {
        let rows = match read_fp_table(&*self.storage, &self.sb, t, r) {
            Ok(rows) => rows,
            Err(e) => {
                tracing::debug!("fingerprint table {t} skipped: {e}");
                return Some(());
            }
        };
        let table = u32::try_from(t).ok()?;
        let mut ix = self.lock_index().ok()??;
        let hot_room = ix.hot.entries * 10 < ix.hot.capacity() * WARM_FULL_TENTHS;
        let before = ix.hot.entries;
        for row in &rows {
            if hot_room {
                let fp = u128::from(row.fp) << 64;
                ix.hot.learn(fp, row.entry(), u64::from(row.owner));
            }
            if hooks {
                ix.hooks.note(row.fp, table);
            }
        }
        let c = &self.counters.warm_table_fingerprints;
        c.fetch_add(ix.hot.entries - before, Ordering::Relaxed);
        if hooks {
            let c = &self.counters.window.replayed_tables;
            c.fetch_add(1, Ordering::Relaxed);
        }
        Some(())
    }

    /// Some while the index is below the warm-up's fill mark.
    fn index_room(&self) -> Option<()> {
        let ix = self.lock_index().ok()??;
        (ix.hot.entries * 10 < ix.hot.capacity() * WARM_FULL_TENTHS).then_some(())
    }

    fn index_entries(&self) -> u64 {
        self.lock_index()
            .ok()
            .flatten()
            .map_or(0, |ix| ix.hot.entries)
    }

    /// The map entries of `n` blocks from `first`.
    fn entries_at(&self, first: u64, n: u64) -> Option<Vec<MapEntry>> {
        let mut st = self.lock_state().ok()?;
        self.fault(&mut st, first, first + n).ok()?;
        Some((first..first + n).map(|l| st.live.get(l)).collect())
    }

    /// Indexes the data blocks of one batch from `lba`; returns where the
    /// next batch starts, or None when done (end of map, index nearly full,
    /// no dedup, or the volume poisoned).
    fn warm_index_batch(&self, lba: u64) -> Option<u64> {
        let seed = self.dedup.as_ref()?.seed.clone();
        self.index_room()?;
        let blocks = self.sb.logical_blocks();
        let first = self
            .lock_state()
            .ok()?
            .live
            .map()
            .next_allocated_page_lba(lba)?;
        if first >= blocks {
            return None;
        }
        let n = WARM_BATCH_BLOCKS.min(blocks - first);
        let before = self.entries_at(first, n)?;
        let mut data = vec![0u8; (n as usize) * BS];
        // Unreadable blocks are simply not indexed; a client read reports them.
        if self.read_blocks_once(first, &mut data, false).is_err() {
            return Some(first + n);
        }
        // Index a block only if the map named the same record before and
        // after the read (a record's crc includes its seq: no ABA).
        let after = self.entries_at(first, n)?;
        let c = &self.counters.warm_data_blocks;
        c.fetch_add(
            before.iter().filter(|e| !e.is_unmapped()).count() as u64,
            Ordering::Relaxed,
        );
        let mut ix = self.lock_index().ok()??;
        for (i, b) in data.chunks_exact(BS).enumerate() {
            let e = before[i];
            let EntryState::Data { shared, unit, .. } = e.state_valid() else {
                continue;
            };
            if after[i] != e || (shared && unit) {
                continue; // changed; or a unit block, offered through its owner only
            }
            let fp = dedup::fingerprint(&seed, b);
            let owner_form = e.as_owner_entry();
            if !ix.hot.insert_if_room(fp, owner_form, first + i as u64)
                && ix.hot.entries >= ix.hot.capacity()
            {
                return None;
            }
        }
        Some(first + n)
    }
}
