//! Dedup index warm-up after open. The index is not persisted: at open it
//! is empty, and this pass refills it from the data already on the volume,
//! walking the map in LBA order, reading and fingerprinting blocks in
//! batches, and filling only free slots (what live writes taught the index
//! wins). It pauses while clients are busy, like the background cleaner,
//! and stops when the index is nearly full or the map is done.
use super::{Next, Worker};
use crate::dedup;
use crate::volume::{Volume, BS};
use cvol_format::{EntryState, MapEntry};
use std::sync::Arc;
use std::time::Duration;

/// Blocks read per batch.
const WARM_BATCH_BLOCKS: u64 = 256;
/// The warm-up stops once the index is this full (tenths).
const WARM_FULL_TENTHS: u64 = 9;
/// Pause while clients are busy.
const BUSY_PAUSE: Duration = Duration::from_millis(20);

impl Volume {
    /// Starts refilling the dedup index in the background (volumes with
    /// dedup on; otherwise a handle with no thread).
    pub fn start_index_warmup(self: &Arc<Self>) -> Worker {
        if self.dedup.is_none() {
            return Worker::none();
        }
        let mut lba = 0;
        Worker::spawn("cvol-index-warmup", self, Duration::ZERO, move |v| {
            if v.activity.clients_busy() {
                return Next::After(BUSY_PAUSE);
            }
            match v.warm_index_batch(lba) {
                Some(next) => {
                    lba = next;
                    Next::After(Duration::ZERO)
                }
                None => Next::Stop,
            }
        })
    }

    /// Refills the dedup index from the whole volume now (tests, tools).
    /// Returns the blocks indexed.
    pub fn warm_index(&self) -> u64 {
        let before = self.index_entries();
        let mut lba = 0;
        while let Some(next) = self.warm_index_batch(lba) {
            lba = next;
        }
        self.index_entries() - before
    }

    fn index_entries(&self) -> u64 {
        self.lock_index().ok().flatten().map_or(0, |ix| ix.entries)
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
        let seed = self.dedup.as_ref()?.seed;
        {
            let ix = self.lock_index().ok()??;
            if ix.entries * 10 >= ix.capacity() * WARM_FULL_TENTHS {
                return None;
            }
        }
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
        let mut ix = self.lock_index().ok()??;
        for (i, b) in data.chunks_exact(BS).enumerate() {
            let e = before[i];
            let EntryState::Data { shared, unit, .. } = e.state_valid() else {
                continue;
            };
            if after[i] != e || (shared && unit) {
                continue; // changed; or a unit block, offered through its owner only
            }
            let fp = dedup::fingerprint(seed, b);
            let owner_form = e.as_owner_entry();
            if !ix.insert_if_room(fp, owner_form, first + i as u64) && ix.entries >= ix.capacity() {
                return None;
            }
        }
        Some(first + n)
    }
}
