//! Dedup index warm-up after open. The index is not persisted: at open it
//! is empty, and this pass refills it from the data already on the volume,
//! walking the map in LBA order, reading and fingerprinting blocks in
//! batches, and filling only free slots (what live writes taught the index
//! wins). It pauses while clients are busy, like the background cleaner,
//! and stops when the index is nearly full or the map is done.
use super::*;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// Blocks read per batch.
const WARM_BATCH_BLOCKS: u64 = 256;

/// Handle of the warm-up thread; it stops when the handle drops.
pub struct IndexWarmup {
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Drop for IndexWarmup {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Volume {
    /// Starts refilling the dedup index in the background (volumes with
    /// dedup on; otherwise a no-op handle).
    pub fn start_index_warmup(self: &Arc<Self>) -> IndexWarmup {
        let stop = Arc::new(AtomicBool::new(false));
        let handle = self.index.is_some().then(|| {
            let (vol, flag) = (Arc::downgrade(self), stop.clone());
            std::thread::Builder::new()
                .name("cvol-index-warmup".into())
                .spawn(move || {
                    let mut lba = 0;
                    while !flag.load(Ordering::SeqCst) {
                        let Some(v) = vol.upgrade() else { return };
                        if v.clients_busy() {
                            drop(v);
                            std::thread::sleep(Duration::from_millis(20));
                            continue;
                        }
                        match v.warm_index_batch(lba) {
                            Some(next) => lba = next,
                            None => return,
                        }
                    }
                })
                .expect("spawn index warm-up thread")
        });
        IndexWarmup { stop, handle }
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
        self.index
            .as_ref()
            .map_or(0, |i| i.lock().expect("index lock").entries)
    }

    /// Indexes the data blocks of one batch from `lba`; returns where the
    /// next batch starts, or None when done (end of map, index nearly full,
    /// or no dedup).
    fn warm_index_batch(&self, lba: u64) -> Option<u64> {
        let (seed, index) = (self.dedup_seed?, self.index.as_ref()?);
        {
            let ix = index.lock().expect("index lock");
            if ix.entries * 10 >= ix.capacity() * 9 {
                return None;
            }
        }
        let blocks = self.sb.logical_blocks();
        let first = self.lock_state().map.next_allocated_page_lba(lba)?;
        if first >= blocks {
            return None;
        }
        let n = WARM_BATCH_BLOCKS.min(blocks - first);
        let snapshot = || -> Vec<MapEntry> {
            let st = self.lock_state();
            (first..first + n).map(|l| st.map.get(l)).collect()
        };
        let before = snapshot();
        let mut data = vec![0u8; (n as usize) * BS];
        // Unreadable blocks are simply not indexed; a client read reports them.
        if self.read_blocks_once(first, &mut data, false).is_err() {
            return Some(first + n);
        }
        // Index a block only if the map named the same record before and
        // after the read (a record's crc includes its seq: no ABA).
        let after = snapshot();
        let entries: Vec<MapEntry> = before
            .iter()
            .zip(&after)
            .map(|(b, a)| if a == b { *a } else { MapEntry::UNMAPPED })
            .collect();
        let mut ix = index.lock().expect("index lock");
        for (i, (e, b)) in entries.iter().zip(data.chunks_exact(BS)).enumerate() {
            let EntryState::Data { shared, unit, .. } = e.state_valid() else {
                continue;
            };
            if shared && unit {
                continue; // a unit block is offered for dedup through its owner only
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
