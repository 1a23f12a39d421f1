//! Durability: the EPOCH record an open for writing starts with, flush
//! (pad to a sector, write, sync; concurrent flushes batch; a SYNCED record
//! certifies the previous sync), checkpoints (MAP_CHUNK records, a
//! CKPT_COMMIT, then the pointer slot), and the reuse of emptied segments
//! once that is safe. The argument is in docs/FORMAT.md.
use super::{space, State, Volume};
use crate::error::VolError;
use crate::log::Shape;
use crate::map::BlockMap;
use cvol_format::checkpoint::{push_run, ChunkRef, CommitPayload};
use cvol_format::mapentry::MAP_ENTRY_BYTES;
use cvol_format::record::RecordKind;
use cvol_format::{CheckpointPointer, CodecTag, MapEntry};
use std::sync::atomic::Ordering;

/// A flush also checkpoints when this share of the segments (at least
/// `CHECKPOINT_EMPTY_SEGMENTS_MIN`) only waits for one to be reused.
const CHECKPOINT_EMPTY_SEGMENTS_DIVISOR: u64 = 8;
const CHECKPOINT_EMPTY_SEGMENTS_MIN: u64 = 4;

impl Volume {
    /// Starts a new epoch: an EPOCH record, made durable before any other
    /// record of this epoch, so stale records of a crashed epoch never rejoin the chain.
    pub(super) fn begin_epoch(&self) -> Result<(), VolError> {
        let _f = self.lock_flush()?;
        let mut st = self.lock_state()?;
        st.log.epoch = st.log.epoch.checked_add(1).expect("epochs never run out");
        self.append(&mut st, Shape::meta(RecordKind::Epoch, CodecTag::None), &[])?;
        self.guard(st.log.pad_and_write(&*self.storage))?;
        drop(st);
        self.guard(self.storage.sync().map_err(VolError::Io))?;
        let mut st = self.lock_state()?;
        st.synced_seq = st.log.last_seq();
        Ok(())
    }

    /// Makes every write that completed before this call durable.
    pub fn flush(&self) -> Result<(), VolError> {
        let _f = self.lock_flush()?;
        if self.poisoned.load(Ordering::SeqCst) {
            return Err(VolError::Poisoned);
        }
        let Some((target, candidates)) = self.write_for_sync()? else {
            return Ok(());
        };
        self.guard(self.storage.sync().map_err(VolError::Io))?;
        self.reclaim(&candidates)?;
        let due = {
            let mut st = self.lock_state()?;
            st.synced_seq = st.synced_seq.max(target);
            self.checkpoint_due(&st)
        };
        if due {
            match self.checkpoint_locked() {
                Ok(()) | Err(VolError::NoSpace) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Hands everything appended to the store (padded to a sector) for the
    /// sync to come, and returns the seq it will make durable and the
    /// segments reusable once it has. Segments emptied by records this sync
    /// makes durable, and older than the durable checkpoint, are reusable
    /// once it returns. None when everything is synced already.
    fn write_for_sync(&self) -> Result<Option<(u64, Vec<u64>)>, VolError> {
        let mut st = self.lock_state()?;
        let candidates = st
            .log
            .segments
            .reclaimable(st.live.usage(), st.durable_snapshot_seq);
        if st.log.last_seq() == st.synced_seq {
            drop(st);
            self.reclaim(&candidates)?;
            return Ok(None);
        }
        self.certify_previous_sync(&mut st)?;
        self.guard(st.log.pad_and_write(&*self.storage))?;
        assert!(
            st.log.last_seq() > st.synced_seq,
            "a sync has records to make durable"
        );
        Ok(Some((st.log.last_seq(), candidates)))
    }

    /// Certifies the previous sync in the log (lazily: with this flush's
    /// data, no extra write), so that recovery can tell damage at rest from
    /// a crash's unsynced tail.
    fn certify_previous_sync(&self, st: &mut State) -> Result<(), VolError> {
        if st.synced_seq > st.synced_marked {
            let seq = st.synced_seq;
            assert!(
                seq <= st.log.last_seq(),
                "only appended records were synced"
            );
            let shape = Shape::meta(RecordKind::Synced, CodecTag::None);
            self.append(st, shape, &seq.to_le_bytes())?;
            st.synced_marked = seq;
        }
        Ok(())
    }

    /// A checkpoint is due after `checkpoint_interval_bytes` of log, or when
    /// enough segments only wait for one to be reused (after a large TRIM,
    /// say), so the host gets its space back.
    fn checkpoint_due(&self, st: &State) -> bool {
        let empty = st.log.segments.empty_sealed_count(st.live.usage());
        let enough = (st.log.segments.count() / CHECKPOINT_EMPTY_SEGMENTS_DIVISOR)
            .max(CHECKPOINT_EMPTY_SEGMENTS_MIN);
        st.log.appended_bytes - st.appended_at_checkpoint >= self.options.checkpoint_interval_bytes
            || empty >= enough
    }

    /// Writes a checkpoint of the map and makes it the recovery start.
    pub fn checkpoint(&self) -> Result<(), VolError> {
        let _f = self.lock_flush()?;
        self.checkpoint_locked()
    }

    fn checkpoint_locked(&self) -> Result<(), VolError> {
        self.check_writable()?;
        let (ptr, snapshot_seq, candidates) = {
            let mut st = self.lock_state()?;
            let snapshot_seq = st.log.last_seq();
            let candidates = st.log.segments.reclaimable(st.live.usage(), snapshot_seq);
            let ptr = self.append_checkpoint(&mut st)?;
            self.guard(st.log.pad_and_write(&*self.storage))?;
            assert!(
                ptr.commit_seq > snapshot_seq,
                "the commit follows its snapshot"
            );
            (ptr, snapshot_seq, candidates)
        };
        self.guard(self.storage.sync().map_err(VolError::Io))?;
        self.publish(&ptr)?;
        {
            let mut st = self.lock_state()?;
            assert!(ptr.generation > st.checkpoint_generation);
            st.checkpoint_generation = ptr.generation;
            st.synced_seq = st.synced_seq.max(ptr.commit_seq);
            st.appended_at_checkpoint = st.log.appended_bytes;
            st.durable_snapshot_seq = snapshot_seq;
        }
        self.reclaim(&candidates)?;
        tracing::debug!(
            generation = ptr.generation,
            seq = ptr.commit_seq,
            "checkpoint written"
        );
        Ok(())
    }

    /// Writes and syncs the pointer slot of `ptr`'s generation: from here
    /// on recovery starts at its checkpoint.
    fn publish(&self, ptr: &CheckpointPointer) -> Result<(), VolError> {
        let slot = CheckpointPointer::slot_offset(ptr.slot());
        let written = self.storage.write_at(slot, &ptr.encode());
        self.guard(written.map_err(VolError::Io))?;
        self.guard(self.storage.sync().map_err(VolError::Io))
    }

    /// Appends MAP_CHUNK records and the CKPT_COMMIT record; returns the pointer to publish.
    fn append_checkpoint(&self, st: &mut State) -> Result<CheckpointPointer, VolError> {
        let snapshot_seq = st.log.last_seq();
        let raw_max = space::chunk_raw_max_bytes(self.sb.segment_size_bytes);
        let chunks = encode_map_chunks(st.live.map(), raw_max);
        // Refuse before appending anything: a half-written checkpoint only wastes space.
        let lens: Vec<usize> = chunks.iter().map(Vec::len).collect();
        if st.log.free_bytes() < space::checkpoint_append_bytes(&lens, self.sb.segment_size_bytes) {
            return Err(VolError::NoSpace);
        }
        st.changes_at_checkpoint = st.live.changes();
        let mut refs = Vec::with_capacity(chunks.len());
        for c in &chunks {
            let p = self.append(st, Shape::meta(RecordKind::MapChunk, CodecTag::Lz4), c)?;
            refs.push(ChunkRef {
                offset: p.offset,
                len: p.len,
                crc: p.crc,
            });
        }
        let commit = CommitPayload {
            snapshot_seq,
            logical_blocks: self.sb.logical_blocks(),
            chunks: refs,
        }
        .encode();
        let shape = Shape::meta(RecordKind::CkptCommit, CodecTag::None);
        let p = self.append(st, shape, &commit)?;
        Ok(CheckpointPointer {
            generation: st.checkpoint_generation + 1,
            commit_offset: p.offset,
            commit_len: p.len,
            commit_epoch: st.log.epoch,
            commit_seq: p.seq,
        })
    }

    /// Frees the candidates that are still empty and returns their space to
    /// the host. Callers pass candidates chosen before a sync that made their
    /// emptiness (and a checkpoint covering their records) durable.
    fn reclaim(&self, candidates: &[u64]) -> Result<(), VolError> {
        if candidates.is_empty() {
            return Ok(());
        }
        let freed = {
            let mut st = self.lock_state()?;
            let State { log, live, .. } = &mut *st;
            log.segments.free_empty(live.usage(), candidates)
        };
        self.counters
            .cleaner
            .segments_reclaimed
            .fetch_add(freed.len() as u64, Ordering::Relaxed);
        self.release_segments(&freed);
        Ok(())
    }

    /// Returns freed segments' space to the host (hole punch / discard).
    fn release_segments(&self, freed: &[u64]) {
        for &s in freed {
            let off = self.sb.segment_offset(s);
            if let Err(e) = self.storage.discard(off, self.sb.segment_size_bytes) {
                tracing::debug!(
                    segment = s,
                    "discard failed (space stays allocated on the host): {e}"
                );
            }
        }
        if !freed.is_empty() {
            tracing::debug!(segments = freed.len(), "segments reclaimed");
        }
    }
}

/// Encodes the map's non-unmapped entries as lz4-compressed chunk payloads
/// of runs, each at most about `raw_max` bytes before compression.
fn encode_map_chunks(map: &BlockMap, raw_max: usize) -> Vec<Vec<u8>> {
    let mut chunks = Vec::new();
    let mut raw = Vec::new();
    let mut run: Vec<MapEntry> = Vec::new();
    let mut run_start = 0u64;
    map.for_each_mapped(|lba, e| {
        if !run.is_empty() && lba != run_start + run.len() as u64 {
            push_run(&mut raw, run_start, &run);
            run.clear();
        }
        if run.is_empty() {
            run_start = lba;
        }
        run.push(e);
        if raw.len() + run.len() * MAP_ENTRY_BYTES >= raw_max {
            push_run(&mut raw, run_start, &run);
            run.clear();
            chunks.push(lz4_flex::block::compress_prepend_size(&raw));
            raw.clear();
        }
    });
    if !run.is_empty() {
        push_run(&mut raw, run_start, &run);
    }
    if !raw.is_empty() {
        chunks.push(lz4_flex::block::compress_prepend_size(&raw));
    }
    chunks
}
