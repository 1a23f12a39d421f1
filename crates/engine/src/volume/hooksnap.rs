//! The dedup hook index persisted: a *snapshot* of its buckets now and
//! then, plus the fingerprint tables written since, replayed at open
//! (docs/design/dedup-window.md, "Persistence"). The tables are the log,
//! the snapshot is its flush (as OpenZFS's dedup log is flushed into its
//! table), so an open reads the snapshot and the tables newer than it: the
//! changes, not the volume.
//!
//! Records (`cvol_format::hooks`): MAP_TABLE records in the directory
//! slots after the fingerprint tables, the chunks first, the root last,
//! each named at once and made durable by the next checkpoint commit (as
//! fingerprint tables spilled between checkpoints are). A crash in between
//! leaves the older snapshot named: every entry is a hint, accepted at
//! load only if the directory names its table with a record no newer than
//! the snapshot, and every candidate is compared byte for byte before use.
use super::Volume;
use crate::error::{MetaError, VolError};
use cvol_format::checkpoint::{PageRef, MAP_PAGE_BLOCKS};
use cvol_format::hooks::{HookChunk, HookRoot};
use cvol_format::record::{RecordKind, RECORD_HEADER_BYTES};
use cvol_format::superblock::FLAG_HOOK_SNAPSHOT;
use std::collections::HashMap;
use std::sync::atomic::Ordering;

/// Chunk payloads appended per hold of the state lock (bytes, at most).
const SNAPSHOT_BYTES_PER_HOLD: usize = 1 << 20;

/// A snapshot read back at open: its root, and its chunks' entries.
pub(in crate::volume) struct LoadedSnapshot {
    pub(in crate::volume) root: HookRoot,
    pub(in crate::volume) chunks: Vec<(u32, Vec<u64>)>,
}

impl Volume {
    /// Whether a snapshot of the hook index is due: enough fingerprint
    /// tables written since the last one, or the cleaner moved one of its
    /// records.
    pub(in crate::volume) fn hook_snapshot_due(&self) -> bool {
        if self.dedup.is_none() || self.sb.flags & FLAG_HOOK_SNAPSHOT == 0 {
            return false;
        }
        let c = &self.counters.window;
        let since =
            c.fp_table_bytes.load(Ordering::Relaxed) - c.snapshot_mark.load(Ordering::Relaxed);
        let last = c.snapshot_last_bytes.load(Ordering::Relaxed);
        c.snapshot_moved.load(Ordering::Relaxed)
            || since >= self.options.hook_snapshot_bytes.max(2 * last)
    }

    /// Writes a snapshot of the hook index if one is due and the index is
    /// loaded (a snapshot of a half-loaded index would lose hints). The
    /// checkpoint lock is held.
    pub(in crate::volume) fn hook_snapshot_if_due(&self) -> Result<(), VolError> {
        if !self.hook_snapshot_due() {
            return Ok(());
        }
        match self.write_hook_snapshot() {
            Err(VolError::NoSpace) => {
                self.counters
                    .window
                    .snapshot_skipped
                    .fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            r => r,
        }
    }

    /// Copies the hook index chunk by chunk (one short hold of the index
    /// lock each), appends the chunks and then the root, each named at
    /// once. NoSpace when the log has no room beside its checkpoint
    /// reserve (the older snapshot stays, with any chunks already written:
    /// hints either way).
    pub(in crate::volume) fn write_hook_snapshot(&self) -> Result<(), VolError> {
        let Some(d) = &self.dedup else {
            return Ok(());
        };
        let seq = self.lock_state()?.log.last_seq();
        let root = {
            let ix = self.note_poison(d.index.lock())?;
            if ix.load != crate::dedup::HookLoad::Ready {
                return Ok(());
            }
            let h = ix.hooks.stats();
            HookRoot::plan(ix.hooks.bucket_count() * 8, h.sample_bits, seq)
        };
        let c = &self.counters.window;
        let Some(root) = root else {
            c.snapshot_skipped.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        };
        let mark = c.fp_table_bytes.load(Ordering::Relaxed);
        c.snapshot_moved.store(false, Ordering::Relaxed);
        let root_t = self.lock_state()?.live.hook_root_table();
        let mut total = 0;
        let mut batch: Vec<(usize, Vec<u8>)> = Vec::new();
        let per = u64::from(root.buckets_per_chunk);
        for chunk in 0..root.chunks {
            let words = {
                let ix = self.note_poison(d.index.lock())?;
                ix.hooks
                    .export(u64::from(chunk) * per, u64::from(root.chunk_buckets(chunk)))
            };
            let raw = HookChunk::encode(chunk, &words);
            let payload = lz4_flex::block::compress_prepend_size(&raw);
            batch.push((root_t + 1 + chunk as usize, payload));
            if batch.iter().map(|b| b.1.len()).sum::<usize>() >= SNAPSHOT_BYTES_PER_HOLD {
                total += self.append_hook_records(std::mem::take(&mut batch))?;
            }
        }
        let payload = lz4_flex::block::compress_prepend_size(&root.encode());
        batch.push((root_t, payload));
        total += self.append_hook_records(batch)?;
        c.snapshot_mark.store(mark, Ordering::Relaxed);
        c.snapshot_last_bytes.store(total, Ordering::Relaxed);
        c.snapshots.fetch_add(1, Ordering::Relaxed);
        c.snapshot_bytes.fetch_add(total, Ordering::Relaxed);
        tracing::debug!(
            chunks = root.chunks,
            bytes = total,
            seq,
            "dedup hook snapshot"
        );
        Ok(())
    }

    /// Appends hook snapshot records (slot, lz4 payload) in one hold of
    /// the state lock, each named at once. Returns the bytes appended.
    fn append_hook_records(&self, records: Vec<(usize, Vec<u8>)>) -> Result<u64, VolError> {
        let lens: Vec<usize> = records.iter().map(|r| r.1.len()).collect();
        let mut st = self.lock_state()?;
        self.check_writable()?;
        let named = st.live.directory_slots_bound();
        let need = super::space::checkpoint_append_bytes(&lens, named, self.sb.segment_size_bytes);
        if st.log.meta_free_bytes() < need {
            return Err(VolError::NoSpace);
        }
        let mut total = 0;
        for (t, payload) in records {
            let placed = self.append_table(&mut st, t, &payload)?;
            st.live
                .hook_written(t, super::durability::page_ref(&placed));
            total += u64::from(placed.len);
        }
        Ok(total)
    }

    /// The snapshot the directory names, read and checked; None when there
    /// is none or it does not fit this open's hook index (another
    /// `--dedup-memory`), or a record is damaged (the tables are replayed
    /// instead, counted).
    pub(in crate::volume) fn read_hook_snapshot(&self, buckets: u64) -> Option<LoadedSnapshot> {
        let (root_t, root_ref) = {
            let st = self.lock_state().ok()?;
            let t = st.live.hook_root_table();
            (t, st.live.hook_ref(t)?)
        };
        let root = self
            .read_table_payload(root_t, &root_ref)
            .map_err(damaged)
            .and_then(|raw| HookRoot::decode(&raw).map_err(damaged));
        let root = match root {
            Ok(r) if r.buckets() == buckets => r,
            Ok(_) => return None, // sized for another budget: rebuilt
            Err(e) => {
                self.note_snapshot_damage(&e);
                return None;
            }
        };
        let mut chunks = Vec::with_capacity(root.chunks as usize);
        for c in 0..root.chunks {
            let t = root_t + 1 + c as usize;
            let Some(r) = self.lock_state().ok()?.live.hook_ref(t) else {
                continue; // moved by the cleaner: its hints are lost
            };
            let words = self
                .read_table_payload(t, &r)
                .and_then(|raw| HookChunk::decode(&raw, c).map_err(damaged));
            match words {
                Ok((n, w)) if n == root.chunk_buckets(c) => chunks.push((c, w)),
                Ok(_) => self.note_snapshot_damage(&MetaError::Damaged(format!(
                    "hook chunk {c}: not the size its root says"
                ))),
                Err(e) => self.note_snapshot_damage(&e),
            }
        }
        Some(LoadedSnapshot { root, chunks })
    }

    fn note_snapshot_damage(&self, e: &MetaError) {
        tracing::warn!("dedup hook snapshot: {e} (its hints are rebuilt from the tables)");
        self.counters
            .window
            .table_read_errors
            .fetch_add(1, Ordering::Relaxed);
    }

    /// The decompressed payload of MAP_TABLE record `r`, which the
    /// directory names for table `t`.
    fn read_table_payload(&self, t: usize, r: &PageRef) -> Result<Vec<u8>, MetaError> {
        let (h, rec) = crate::logread::read_record(&*self.storage, &self.sb, r.offset, r.len)
            .map_err(|e| MetaError::Damaged(e.to_string()))?;
        let slot = self.sb.logical_blocks().div_ceil(MAP_PAGE_BLOCKS) + t as u64;
        if h.kind != RecordKind::MapTable || h.crc != r.crc || h.lba != slot * MAP_PAGE_BLOCKS {
            return Err(MetaError::Damaged(format!(
                "table {t}: not the record the directory names"
            )));
        }
        lz4_flex::block::decompress_size_prepended(&rec[RECORD_HEADER_BYTES..])
            .map_err(|e| MetaError::Damaged(e.to_string()))
    }

    /// Loads a snapshot into the hook index: each entry whose table the
    /// directory names with a record no newer than the snapshot (`named`:
    /// table -> record seq). Returns the entries taken.
    pub(in crate::volume) fn import_hook_snapshot(
        &self,
        snap: &LoadedSnapshot,
        named: &HashMap<u32, u64>,
    ) -> u64 {
        let Ok(Some(mut ix)) = self.lock_index() else {
            return 0;
        };
        let per = u64::from(snap.root.buckets_per_chunk);
        let seq = snap.root.snapshot_seq;
        let accept = |t: u32| named.get(&t).is_some_and(|&s| s <= seq);
        let mut taken = 0;
        for (c, words) in &snap.chunks {
            let k = snap.root.sample_bits;
            taken += ix.hooks.import(u64::from(*c) * per, words, k, accept);
        }
        let w = &self.counters.window;
        w.snapshot_entries.fetch_add(taken, Ordering::Relaxed);
        taken
    }
}

fn damaged(e: impl std::fmt::Display) -> MetaError {
    MetaError::Damaged(e.to_string())
}
