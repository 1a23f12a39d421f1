//! Durability: the EPOCH record an open for writing starts with, flush
//! (pad to a sector, write, sync; concurrent flushes batch; a SYNCED record
//! certifies the previous sync), checkpoints (MAP_CHUNK records, a
//! CKPT_COMMIT, then the pointer slot), and the reuse of emptied segments
//! once that is safe. The argument is in docs/FORMAT.md.
use super::dirwrite::{dir_list_payload, dir_record, named_dir};
use super::{space, State, Volume};
use crate::error::VolError;
use crate::liveness::{EncodedTables, TableSnapshot};
use crate::log::{Log, Placed, Shape};
use crate::map::Page;
use cvol_format::checkpoint::{push_run, run_bytes, ChunkRef, CommitPayload, PageRef, Resume};
use cvol_format::checkpoint::{DIR_PAGES, MAP_PAGE_BLOCKS};
use cvol_format::flushmark::FlushMark;
use cvol_format::record::RecordKind;
use cvol_format::superblock::{FLAG_DIR_LIST_APART, FLAG_DIR_NAMED, FLAG_DIR_SUMMARY};
use cvol_format::{CheckpointPointer, CodecTag, MapEntry};
use std::sync::atomic::Ordering;

/// A flush also checkpoints when this share of the segments (at least
/// `CHECKPOINT_EMPTY_SEGMENTS_MIN`) only waits for one to be reused.
const CHECKPOINT_EMPTY_SEGMENTS_DIVISOR: u64 = 8;
const CHECKPOINT_EMPTY_SEGMENTS_MIN: u64 = 4;
/// Log written between checkpoints, at least, per byte the last checkpoint
/// took: the whole map is written each time, so on a large volume the
/// interval grows with it and checkpoints cost at most a quarter of the
/// log (at 128 GiB mapped a checkpoint is ~200 MiB: every 800 MiB rather
/// than every 256 MiB). Recovery after a crash replays at most that much.
const CHECKPOINT_LOG_PER_CHECKPOINT_BYTE: u64 = 4;
/// A checkpoint syncs its own records after this many bytes, outside the
/// flush lock: a client FLUSH's sync (of the whole file) then never has a
/// checkpoint's worth of dirty pages to write back (at 128 GiB mapped a
/// checkpoint is 100+ MiB, a second of writeback), nor does its commit.
const CHECKPOINT_SYNC_BYTES: u64 = 8 << 20;
/// Dirty map pages that make a checkpoint due, at least (as many bytes of
/// dense pages; the map cache's bytes otherwise): a small cache does not
/// checkpoint every few writes.
const DIRTY_PAGES_MIN: u64 = 256;
/// Page records a checkpoint appends per hold of the state lock.
const PAGES_PER_HOLD: usize = 64;
/// Table records a checkpoint appends per hold of the state lock stop
/// after this many bytes (a fingerprint table is up to 124 KiB: 64 of
/// them held client writes for 50 ms).
const TABLE_BYTES_PER_HOLD: usize = 256 << 10;

/// Splits table records (table, stamp, payload) into the batches one hold
/// of the state lock appends: at most `PAGES_PER_HOLD` records, and no
/// more once `TABLE_BYTES_PER_HOLD` bytes are in.
fn hold_batches<T>(
    records: &[(usize, u64, T)],
    len: impl Fn(&T) -> usize,
) -> Vec<&[(usize, u64, T)]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, r) in records.iter().enumerate() {
        bytes += len(&r.2);
        if i + 1 - start >= PAGES_PER_HOLD || bytes >= TABLE_BYTES_PER_HOLD {
            out.push(&records[start..=i]);
            (start, bytes) = (i + 1, 0);
        }
    }
    if start < records.len() {
        out.push(&records[start..]);
    }
    out
}

impl Volume {
    /// Starts a new epoch: an EPOCH record, made durable before any other
    /// record of this epoch, so stale records of a crashed epoch never rejoin the chain.
    pub(super) fn begin_epoch(&self) -> Result<(), VolError> {
        let _f = self.lock_flush()?;
        let mut st = self.lock_state()?;
        st.log.epoch = st.log.epoch.checked_add(1).expect("epochs never run out");
        self.append(&mut st, Shape::meta(RecordKind::Epoch, CodecTag::None), &[])?;
        self.guard(st.log.pad_and_write(&*self.storage))?;
        let (epoch, seq) = (st.log.epoch, st.log.last_seq());
        drop(st);
        self.guard(self.storage.sync().map_err(VolError::Io))?;
        self.lock_state()?.synced_seq = seq;
        // Both flush mark slots name the EPOCH record, synced: after a
        // repair that accepted losing flushed records, a mark of the
        // epoch before (certifying them) would refuse every open.
        for slot in 0..2 {
            self.write_flush_mark(slot, epoch, seq)?;
        }
        self.guard(self.storage.sync().map_err(VolError::Io))
    }

    /// Makes every write that completed before this call durable. When a
    /// checkpoint is due it is handed to the background checkpointer if
    /// one runs (this flush does not wait for it), else written here after
    /// the flush itself is done.
    ///
    /// Group commit: what this call must make durable was appended before
    /// it (up to `covers`); a flush that synced past that while this one
    /// waited for the flush lock already did (`write_for_sync`). Flushes
    /// that wait together thus cost one sync after the one in progress,
    /// not one each (fio's `fsync=N` queues a FLUSH in every free slot of
    /// a client: 15 syncs in a row otherwise).
    pub fn flush(&self) -> Result<(), VolError> {
        let covers = self.lock_state()?.log.last_seq();
        let due = {
            let _f = self.lock_flush()?;
            if self.poisoned.load(Ordering::SeqCst) {
                return Err(VolError::Poisoned);
            }
            let Some((target, candidates)) = self.write_for_sync(covers)? else {
                return Ok(());
            };
            self.guard(self.storage.sync().map_err(VolError::Io))?;
            self.reclaim(&candidates)?;
            let mut st = self.lock_state()?;
            st.synced_seq = st.synced_seq.max(target);
            self.checkpoint_due(&st) || self.fp_spill_due(&st) || self.hook_snapshot_due()
        };
        if due && !self.jobs.checkpointer.hand_over() {
            self.checkpoint_if_due()?;
        }
        Ok(())
    }

    /// Writes a checkpoint if one is (still) due: another thread may have
    /// written one meanwhile. A log too full for one is no error here.
    /// Fingerprint rows over their bound are spilled instead, when no
    /// checkpoint is due.
    pub(in crate::volume) fn checkpoint_if_due(&self) -> Result<(), VolError> {
        let _c = self.lock_checkpoint()?;
        let (due, spill) = {
            let st = self.lock_state()?;
            (self.checkpoint_due(&st), self.fp_spill_due(&st))
        };
        let done = match (due, spill) {
            (false, false) => Ok(()),
            (false, true) => self.spill_fingerprints(),
            (true, _) => self.checkpoint_serialized(Tables::WhenDue, || {}),
        };
        match done.and_then(|()| self.hook_snapshot_if_due()) {
            Ok(()) | Err(VolError::NoSpace) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Writes the fingerprint tables of the changed parts the log head has
    /// left, between checkpoints (the checkpoint lock held), so that their
    /// rows leave memory without every dirty map page being rewritten with
    /// them. Each record is named in the map directory at once, like a
    /// checkpoint's: the next commit names it (the directory block that
    /// holds its slot is dirty), and the record it supersedes is retired
    /// until then. A crash before that commit leaves the new records
    /// unnamed, dead space for the cleaner, and the older commit's tables
    /// (hints either way). Falls back to a checkpoint when the log has no
    /// room for the records beside the checkpoint reserve.
    fn spill_fingerprints(&self) -> Result<(), VolError> {
        self.check_writable()?;
        let (snap, named) = {
            let mut st = self.lock_state()?;
            let (_, fill) = st.log.data_position();
            let head = st.log.segment_base() + fill as u64;
            let named = st.live.directory_slots_bound();
            (st.live.fp_snapshot(head, false), named)
        };
        let fps: Vec<(usize, u64, Vec<u8>)> = snap.iter().map(|f| f.encode()).collect();
        let lens: Vec<usize> = fps.iter().map(|f| f.2.len()).collect();
        let need = space::checkpoint_append_bytes(&lens, named, self.sb.segment_size_bytes);
        if self.lock_state()?.log.meta_free_bytes() < need {
            return self.checkpoint_serialized(Tables::WhenDue, || {});
        }
        let (bytes, _) = self.append_fp_tables(fps)?;
        self.counters.fp_spills.fetch_add(1, Ordering::Relaxed);
        self.counters
            .fp_spill_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        Ok(())
    }

    /// Hands everything appended to the store (padded to a sector) for the
    /// sync to come, and returns the seq it will make durable and the
    /// segments reusable once it has. Segments emptied by records this sync
    /// makes durable, and older than the durable checkpoint, are reusable
    /// once it returns. None when every record up to `covers` is synced
    /// already.
    pub(in crate::volume) fn write_for_sync(
        &self,
        covers: u64,
    ) -> Result<Option<(u64, Vec<u64>)>, VolError> {
        let mut st = self.lock_state()?;
        if st.synced_seq >= covers {
            // Nothing to sync: and nothing to reclaim either. A segment
            // empty now may have been emptied by records appended since
            // the last sync; only a sync after this moment makes that
            // durable (regression: write_behind.rs found segments freed
            // and punched while the durable map still pointed into them).
            return Ok(None);
        }
        let candidates = st
            .log
            .segments
            .reclaimable(st.live.usage(), st.durable_snapshot_seq);
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
            // The same outside the log, made durable by this flush's sync:
            // damage to the log's tail that takes the SYNCED records with
            // what they certify leaves the mark.
            let slot = (st.flush_marks % 2) as usize;
            st.flush_marks += 1;
            self.write_flush_mark(slot, st.log.epoch, seq)?;
        }
        Ok(())
    }

    /// Writes flush mark `slot` (not synced): records up to `seq` are durable.
    fn write_flush_mark(&self, slot: usize, epoch: u32, seq: u64) -> Result<(), VolError> {
        let mark = FlushMark {
            volume_tag: self.sb.volume_tag(),
            epoch,
            seq,
        };
        let at = cvol_format::flushmark::FLUSH_MARK_OFFSETS[slot];
        self.guard(
            self.storage
                .write_at(at, &mark.encode())
                .map_err(VolError::Io),
        )
    }

    /// A checkpoint is due after `checkpoint_interval_bytes` of log, or
    /// `CHECKPOINT_LOG_PER_CHECKPOINT_BYTE` times the last checkpoint's
    /// size if that is more, or when the dirty map pages fill the map cache
    /// (only a checkpoint makes them clean, so droppable), or when
    /// enough segments only wait for one to be reused (after a large TRIM,
    /// say), so the host gets its space back.
    fn checkpoint_due(&self, st: &State) -> bool {
        let empty = st.log.segments.empty_sealed_count(st.live.usage());
        let enough = (st.log.segments.count() / CHECKPOINT_EMPTY_SEGMENTS_DIVISOR)
            .max(CHECKPOINT_EMPTY_SEGMENTS_MIN);
        self.map_checkpoint_due(st) || empty >= enough
    }

    /// Whether the checkpointer has work, cheap enough to ask after every
    /// write: a checkpoint due by what writes change (the log written, the
    /// dirty map pages), or fingerprint rows to spill.
    pub(in crate::volume) fn checkpoint_due_by_writes(&self, st: &State) -> bool {
        self.map_checkpoint_due(st) || self.fp_spill_due(st)
    }

    /// The part of `checkpoint_due` that writes change.
    fn map_checkpoint_due(&self, st: &State) -> bool {
        let last = self.counters.checkpoint_last_bytes.load(Ordering::Relaxed);
        let interval = self
            .options
            .checkpoint_interval_bytes
            .max(last.saturating_mul(CHECKPOINT_LOG_PER_CHECKPOINT_BYTE));
        let dirty_max = (self.map_cache_bytes).max(DIRTY_PAGES_MIN * crate::map::PAGE_MEMORY_BYTES);
        st.log.appended_bytes - st.appended_at_checkpoint >= interval
            || st.live.map().dirty_bytes() > dirty_max
    }

    /// Whether the fingerprint rows in memory call for a spill
    /// (`OpenOptions::fingerprint_spill_bytes`, at most 1/128 of the data
    /// store: the reserve every write keeps free counts the rows' tables,
    /// and on a small thin volume 32 MiB of rows, which random overwrites
    /// and the cleaner's moves add to, kept 15% of the log from the
    /// writers until the next checkpoint).
    fn fp_spill_due(&self, st: &State) -> bool {
        let store = self.sb.data_segment_count() * self.sb.segment_size_bytes;
        let limit = self
            .options
            .fingerprint_spill_bytes
            .min((store / FP_SPILL_STORE_DIVISOR).max(FP_SPILL_MIN_BYTES));
        st.live.fp_pending_bytes() > limit
    }

    /// Writes a checkpoint of the map and makes it the recovery start.
    pub fn checkpoint(&self) -> Result<(), VolError> {
        let _c = self.lock_checkpoint()?;
        self.checkpoint_serialized(Tables::Always, || {})
    }

    /// `checkpoint`, running `between` on another thread after the
    /// snapshot was taken and the first map chunk appended, and waiting for
    /// it before appending the rest: the tests put client writes there,
    /// which then lie between the checkpoint's records as a concurrent
    /// client's would, deterministically. Since the checkpoint holds the
    /// checkpoint lock meanwhile, `between` must not need it: no
    /// checkpoint, no write that has to wait for the cleaner.
    #[doc(hidden)]
    pub fn checkpoint_interleaved(&self, between: impl FnOnce() + Send) -> Result<(), VolError> {
        let _c = self.lock_checkpoint()?;
        self.checkpoint_serialized(Tables::Always, || {
            std::thread::scope(|s| {
                if s.spawn(between).join().is_err() {
                    panic!("the interleaved client panicked");
                }
            })
        })
    }

    /// The checkpoint proper, with the checkpoint lock held: the map pages
    /// changed since the last one (a MAP_CHUNK each), the directory blocks
    /// that changed with them (a MAP_DIR each), the commit naming every
    /// directory block, then the pointer. The state lock is held only to
    /// take the dirty pages (shared copy-on-write) with the log head, for
    /// each batch of page records appended, and for the directory and the
    /// commit (appended together: their seqs follow one another); pages
    /// are encoded and compressed outside it, and client writes and
    /// flushes go on between the batches. The flush lock is taken for the
    /// directory and commit. The commit names the head at the snapshot,
    /// where roll-forward resumes (docs/FORMAT.md).
    fn checkpoint_serialized(
        &self,
        tables: Tables,
        between: impl FnOnce(),
    ) -> Result<(), VolError> {
        self.check_writable()?;
        let started = std::time::Instant::now();
        self.mark_metadata_victims()?;
        let mut snap = self.checkpoint_snapshot(tables)?;
        let pages = std::mem::take(&mut snap.pages);
        let npages = pages.len();
        let tables = std::mem::take(&mut snap.tables).encode();
        let page_bytes = self.append_pages(pages, &tables, between)?;
        let (table_bytes, table_records) = self.append_tables(tables)?;
        snap.own_records = npages as u64 + table_records;
        // The pages and tables written so far reach the media before the
        // flush lock is taken: client FLUSHes wait only for the commit's
        // small sync, not for this one (group commit keeps them short).
        self.guard(self.storage.sync().map_err(VolError::Io))?;
        let _f = self.lock_flush()?;
        let (ptr, retired) = self.append_commit(&snap)?;
        let bytes = page_bytes + table_bytes + u64::from(ptr.commit_len);
        self.guard(self.storage.sync().map_err(VolError::Io))?;
        self.publish(&ptr)?;
        let micros = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        {
            let mut st = self.lock_state()?;
            assert!(ptr.generation > st.checkpoint_generation);
            // The counters change under the state lock with the generation,
            // so `stats` (which reads both under it) never shows one without
            // the other.
            let c = &self.counters;
            c.checkpoints.fetch_add(1, Ordering::Relaxed);
            c.checkpoint_last_bytes.store(bytes, Ordering::Relaxed);
            c.checkpoint_bytes_total.fetch_add(bytes, Ordering::Relaxed);
            c.checkpoint_last_micros.store(micros, Ordering::Relaxed);
            st.checkpoint_generation = ptr.generation;
            st.synced_seq = st.synced_seq.max(ptr.commit_seq);
            st.appended_at_checkpoint = st.log.appended_bytes;
            if let Some(at) = snap.tables_at {
                st.appended_at_tables = at;
            }
            st.durable_snapshot_seq = snap.seq;
            st.live.release(retired);
        }
        self.reclaim(&snap.candidates)?;
        tracing::debug!(
            generation = ptr.generation,
            seq = ptr.commit_seq,
            snapshot_seq = snap.seq,
            pages = npages,
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

    /// The dirty map pages, the seq they reflect and the log head, taken at
    /// once under the state lock; and the segments the checkpoint will let
    /// be reused.
    fn checkpoint_snapshot(&self, tables: Tables) -> Result<CheckpointSnapshot, VolError> {
        let mut st = self.lock_state()?;
        let seq = st.log.last_seq();
        let (segment, fill) = st.log.data_position();
        let head = st.log.segment_base() + fill as u64;
        st.changes_at_checkpoint = st.live.changes();
        st.map_records_moved = false;
        let since = st.log.appended_bytes - st.appended_at_tables;
        let full = tables == Tables::Always
            || since >= self.options.checkpoint_interval_bytes
            || st.live.tables_cheap();
        Ok(CheckpointSnapshot {
            pages: st.live.dirty_pages(),
            tables: match full {
                true => st.live.table_snapshot(head),
                false => st.live.light_table_snapshot(head),
            },
            tables_at: full.then_some(st.log.appended_bytes),
            seq,
            resume: Resume {
                segment,
                offset: fill as u64,
            },
            meta_resume: st.log.meta_position().map(|(segment, fill)| Resume {
                segment,
                offset: fill as u64,
            }),
            candidates: st.log.segments.reclaimable(st.live.usage(), seq),
            own_records: 0,
        })
    }

    /// Appends the page records, a batch per hold of the state lock, each
    /// named as its page's record at once (one record per page); returns
    /// the bytes appended.
    /// Pages are encoded a batch at a time outside the lock, and each
    /// batch's snapshot dropped once written: a checkpoint holds a batch
    /// of encoded pages, and a page changed after it was written is not
    /// copied.
    fn append_pages(
        &self,
        pages: Vec<(usize, Page)>,
        tables: &EncodedTables,
        between: impl FnOnce(),
    ) -> Result<u64, VolError> {
        // Refuse before appending anything: a half-written checkpoint only
        // wastes space. (Client writes appended meanwhile leave the reserve,
        // room for a whole checkpoint, free.)
        let mut bounds: Vec<usize> = pages.iter().map(|(_, p)| page_payload_bound(p)).collect();
        bounds.extend(tables.payload_lens());
        let named = {
            let st = self.lock_state()?;
            st.live.directory_slots_bound()
        };
        let need = space::checkpoint_append_bytes(&bounds, named, self.sb.segment_size_bytes);
        if self.lock_state()?.log.meta_free_bytes() < need {
            return Err(VolError::NoSpace);
        }
        let mut between = Some(between);
        let (mut total, mut unsynced) = (0u64, 0u64);
        let mut rest = pages.into_iter();
        loop {
            let batch: Vec<(usize, Page)> = rest.by_ref().take(PAGES_PER_HOLD).collect();
            if batch.is_empty() {
                break;
            }
            let encoded: Vec<Vec<u8>> = batch
                .iter()
                .map(|(p, page)| encode_page(*p, page))
                .collect();
            let mut st = self.lock_state()?;
            self.check_writable()?;
            for ((p, page), payload) in batch.iter().zip(&encoded) {
                let lba = *p as u64 * MAP_PAGE_BLOCKS;
                let shape = Shape::map_meta(RecordKind::MapChunk, lba);
                let placed = self.append(&mut st, shape, payload)?;
                st.live.page_written(*p, page, page_ref(&placed));
                total += u64::from(placed.len);
                unsynced += u64::from(placed.len);
            }
            drop(st);
            if let Some(f) = between.take() {
                f();
            }
            if unsynced >= CHECKPOINT_SYNC_BYTES {
                self.guard(self.storage.sync().map_err(VolError::Io))?;
                unsynced = 0;
            }
        }
        if let Some(f) = between.take() {
            f();
        }
        if unsynced > 0 {
            self.guard(self.storage.sync().map_err(VolError::Io))?;
        }
        Ok(total)
    }

    /// Appends the table records, a batch per hold of the state lock, each
    /// named as its table's record at once; the root last, if every
    /// changed table could be written (one too large names no record, and
    /// then neither does the root). Returns the bytes and records appended.
    fn append_tables(&self, tables: EncodedTables) -> Result<(u64, u64), VolError> {
        let (mut total, mut records) = self.append_fp_tables(tables.fps)?;
        let mut complete = true;
        let root = std::iter::once((0, 0, tables.root));
        let all: Vec<(usize, u64, Option<Vec<u8>>)> =
            tables.groups.into_iter().chain(root).collect();
        for batch in hold_batches(&all, |p| p.as_ref().map_or(0, Vec::len)) {
            let mut st = self.lock_state()?;
            self.check_writable()?;
            for (t, stamp, payload) in batch {
                let payload = payload.as_ref().filter(|_| *t > 0 || complete);
                let Some(payload) = payload else {
                    complete = false;
                    st.live.table_unwritten(*t);
                    continue;
                };
                let placed = self.append_table(&mut st, *t, payload)?;
                st.live.table_written(*t, *stamp, page_ref(&placed));
                records += 1;
                total += u64::from(placed.len);
            }
        }
        Ok((total, records))
    }

    /// Appends table `t`'s MAP_TABLE record (header lba: its directory
    /// slot's, after the map's pages). A liveness table (the root and the
    /// groups) frames its payload itself, a group's head uncompressed and
    /// its rows lz4 after it: codec none (an older cvol refuses it and
    /// rebuilds its tables from the map). Fingerprint and hook snapshot
    /// tables are lz4 payloads, as their codec says.
    pub(in crate::volume) fn append_table(
        &self,
        st: &mut State,
        t: usize,
        payload: &[u8],
    ) -> Result<Placed, VolError> {
        let npages = self.sb.logical_blocks().div_ceil(MAP_PAGE_BLOCKS);
        let lba = (npages + t as u64) * MAP_PAGE_BLOCKS;
        let liveness = (t as u64) < cvol_format::tables::table_count(self.sb.table_segments());
        let shape = Shape {
            codec: if liveness {
                CodecTag::None
            } else {
                CodecTag::Lz4
            },
            ..Shape::map_meta(RecordKind::MapTable, lba)
        };
        self.append(st, shape, payload)
    }

    /// Appends the fingerprint table records, a batch per hold of the
    /// state lock, each named as its table's record at once. Returns the
    /// bytes and records appended.
    fn append_fp_tables(&self, fps: Vec<(usize, u64, Vec<u8>)>) -> Result<(u64, u64), VolError> {
        let (mut total, mut records) = (0, 0);
        for batch in hold_batches(&fps, Vec::len) {
            let mut st = self.lock_state()?;
            self.check_writable()?;
            for (t, stamp, payload) in batch {
                let placed = self.append_table(&mut st, *t, payload)?;
                st.live.fp_written(*t, *stamp, page_ref(&placed));
                records += 1;
                total += u64::from(placed.len);
            }
        }
        let c = &self.counters.window.fp_table_bytes;
        c.fetch_add(total, Ordering::Relaxed);
        Ok((total, records))
    }

    /// Appends the changed directory blocks and the CKPT_COMMIT record and
    /// hands the log to the store (the flush lock held); returns the
    /// pointer to publish once synced, and how many of the superseded map
    /// records its commit no longer names (the first ones).
    fn append_commit(
        &self,
        snap: &CheckpointSnapshot,
    ) -> Result<(CheckpointPointer, usize), VolError> {
        let mut st = self.lock_state()?;
        self.check_writable()?;
        let (snapshot_seq, resume, meta_resume) = resume_point(snap, &st.log, &self.sb);
        let summarized = self.sb.flags & FLAG_DIR_SUMMARY != 0;
        let apart = summarized && self.sb.flags & FLAG_DIR_LIST_APART != 0;
        let dirty = st.live.dirty_dirs();
        // Lists kept apart go first, side by side, then the summaries that
        // name them, side by side too: open reads the summaries alone.
        let mut lists = Vec::with_capacity(dirty.len());
        for (b, pages) in dirty.iter().filter(|_| apart) {
            let lba = *b as u64 * DIR_PAGES * MAP_PAGE_BLOCKS;
            let payload = dir_list_payload(pages);
            let placed =
                self.append(&mut st, Shape::map_meta(RecordKind::MapDir, lba), &payload)?;
            lists.push(page_ref(&placed));
        }
        let mut lists = lists.into_iter();
        for (b, pages) in dirty {
            let lba = b as u64 * DIR_PAGES * MAP_PAGE_BLOCKS;
            let list = lists.next();
            let (shape, payload) = dir_record(&self.sb, lba, pages, (summarized, list));
            let placed = self.append(&mut st, shape, &payload)?;
            st.live.dir_written(b, page_ref(&placed), list);
        }
        let dirs = (st.live.map().dir_records()).expect("every directory block was just written");
        let chunks = dirs
            .iter()
            .map(|(_, r)| ChunkRef {
                offset: r.offset,
                len: r.len,
                crc: r.crc,
            })
            .collect();
        let named =
            (self.sb.flags & FLAG_DIR_NAMED != 0).then(|| named_dir(&self.sb, &mut st, &dirs));
        let commit = CommitPayload {
            snapshot_seq,
            logical_blocks: self.sb.logical_blocks(),
            chunks,
            resume,
            meta_resume,
            named,
        }
        .encode();
        let shape = Shape::meta(RecordKind::CkptCommit, CodecTag::None);
        let p = self.append(&mut st, shape, &commit)?;
        self.guard(st.log.pad_and_write(&*self.storage))?;
        assert!(p.seq > snap.seq, "the commit follows its snapshot");
        let ptr = CheckpointPointer {
            generation: st.checkpoint_generation + 1,
            commit_offset: p.offset,
            commit_len: p.len,
            commit_epoch: st.log.epoch,
            commit_seq: p.seq,
        };
        Ok((ptr, st.live.retired_count()))
    }

    /// Frees the candidates that are still empty and returns their space to
    /// the host. Callers pass candidates chosen before a sync that made their
    /// emptiness (and a checkpoint covering their records) durable.
    fn reclaim(&self, candidates: &[u64]) -> Result<(), VolError> {
        if candidates.is_empty() {
            return Ok(());
        }
        // Space goes back to the host *before* the segments are free: once
        // free, the log head may open one and write to it at any moment,
        // and a hole punched after that would zero the new records. Sealed
        // segments never gain live bytes, and every reclaim runs under the
        // flush lock, so the ones empty now are still empty below.
        // Up to the warm pool's room keep their host space: the log head
        // reuses them first (`SegmentTable::split_warm`).
        let (empty, warm, punch) = {
            let st = self.lock_state()?;
            let usage = st.live.usage();
            let empty: Vec<u64> = candidates
                .iter()
                .copied()
                .filter(|&s| st.log.segments.is_sealed_empty(usage, s))
                .collect();
            let (warm, punch) = st.log.segments.split_warm(&empty);
            (empty, warm, punch)
        };
        self.release_segments(&punch);
        let freed = {
            let mut st = self.lock_state()?;
            let State { log, live, .. } = &mut *st;
            let freed = log.segments.free_empty(live.usage(), &empty);
            log.segments.add_warm(&warm);
            live.fp_segments_freed(&freed);
            live.hints_reset(&freed);
            // Hooks into the freed segments' tables die with them.
            if let Some(mut ix) = self.lock_index()? {
                for &s in &freed {
                    ix.segment_freed(s);
                }
            }
            freed
        };
        assert_eq!(freed, empty, "reclaims run one at a time");
        self.counters
            .cleaner
            .segments_reclaimed
            .fetch_add(freed.len() as u64, Ordering::Relaxed);
        if !freed.is_empty() {
            tracing::debug!(segments = freed.len(), "segments reclaimed");
        }
        Ok(())
    }

    /// Returns the host space of the free segments the warm pool kept
    /// (`SegmentTable::split_warm`), oldest first, each under the state
    /// lock so that the log head cannot open it meanwhile. With
    /// `stop_at_client` it stops at the first client request. Returns how
    /// many were punched.
    pub fn punch_warm(&self, stop_at_client: bool) -> Result<u64, VolError> {
        let mut n = 0;
        loop {
            if stop_at_client && self.activity.clients_busy() {
                return Ok(n);
            }
            let mut st = self.lock_state()?;
            let Some(s) = st.log.segments.take_warm() else {
                return Ok(n);
            };
            self.release_segments(&[s]);
            drop(st);
            n += 1;
        }
    }

    /// Returns the tail of the open data segment past its records to the
    /// host (on a file or device: `recompress_within_host_bytes`), once per
    /// head position. A head opened on a segment kept warm (or one the
    /// zeros ahead prepared) holds its whole segment on the host while
    /// records fill only part of it: on a settled idle volume that is up to
    /// a segment of `du` holding nothing. The tail then reads as zeros, as
    /// in a segment opened free, where recovery stops as at any hole
    /// (docs/FORMAT.md "Zeros ahead of the head"); no write is pending
    /// there (records and their write-behinds lie below the fill, and the
    /// state lock is held). Returns the bytes given back.
    pub fn punch_head_tail(&self) -> Result<u64, VolError> {
        if !self.options.elastic.recompress_within_host_bytes || self.options.read_only {
            return Ok(0);
        }
        let mut st = self.lock_state()?;
        let size = self.sb.segment_size_bytes as usize;
        let head = &mut st.log.head;
        let key = (head.segment, head.fill);
        {
            let mut last = self
                .jobs
                .tail_punched
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if *last == Some(key) {
                return Ok(0);
            }
            *last = Some(key);
        }
        let from = head.fill.next_multiple_of(TAIL_PUNCH_ALIGN).min(size);
        if from >= size {
            return Ok(0);
        }
        let off = self.sb.segment_offset(head.segment) + from as u64;
        let len = (size - from) as u64;
        if let Err(e) = self.storage.discard(off, len) {
            tracing::debug!("discard of the open segment's tail failed: {e}");
            return Ok(0);
        }
        head.prepared = head.prepared.min(from);
        Ok(len)
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
    }
}

/// The open segment's tail is given back from the first 4 KiB page past
/// its records (a host block, a flash page).
const TAIL_PUNCH_ALIGN: usize = 4096;

/// Fingerprint rows wait in memory for at most this share of the data
/// store (`fp_spill_due`)...
const FP_SPILL_STORE_DIVISOR: u64 = 128;
/// ...but for at least this many bytes (a spill has a fixed cost).
const FP_SPILL_MIN_BYTES: u64 = 1 << 20;

/// Whether a checkpoint writes the liveness tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tables {
    /// Always (explicit checkpoints: close, the cleaner, tools).
    Always,
    /// Only once `checkpoint_interval_bytes` of log were appended since the
    /// last checkpoint that wrote them, or when they are cheap beside the
    /// dirty pages (`LiveMap::tables_cheap`; checkpoints that fall due:
    /// with a small `--map-cache` the dirty pages call for one every few
    /// thousand random writes, and rewriting every segment's table each
    /// time cost 0.72x the random-write IOPS while units had rows). One
    /// that does not names no root, so an open right after it rebuilds
    /// the tables from the map.
    WhenDue,
}

/// What a checkpoint writes, taken under the state lock.
struct CheckpointSnapshot {
    /// The dirty map pages, by page index.
    pages: Vec<(usize, Page)>,
    /// The changed liveness tables.
    tables: TableSnapshot,
    /// `log.appended_bytes` at the snapshot, if the tables are written.
    tables_at: Option<u64>,
    /// The last seq the map reflects.
    seq: u64,
    /// The log head then: record `seq + 1` is there or later.
    resume: Resume,
    /// The metadata head then, if one was open.
    meta_resume: Option<Resume>,
    /// Segments reusable once this checkpoint is durable.
    candidates: Vec<u64>,
    /// Records the checkpoint appended after `seq`: its pages and tables.
    own_records: u64,
}

/// Where roll-forward resumes from the commit of `snap`, appended next to
/// `log`: (snapshot seq, data head, metadata head). When every record
/// appended since the snapshot is the checkpoint's own (its pages and
/// tables: no client write, cleaning or flush record came in between), the
/// map is still the snapshot's at the log's last seq, so the commit names
/// that seq and no resume position: roll-forward starts after the commit,
/// instead of reading and checking every page and directory record the
/// checkpoint wrote (a clean close after random writes over 64 GiB: 320
/// MB of pages, twice). With a metadata device it names the heads now, where
/// the directory blocks begin (the data head's place is known only so).
/// Otherwise, the snapshot's.
fn resume_point(
    snap: &CheckpointSnapshot,
    log: &Log,
    sb: &cvol_format::Superblock,
) -> (u64, Option<Resume>, Option<Resume>) {
    if log.last_seq() != snap.seq + snap.own_records {
        return (snap.seq, Some(snap.resume), snap.meta_resume);
    }
    if !sb.has_metadata_device() {
        return (log.last_seq(), None, None);
    }
    let at = |(segment, fill): (u64, usize)| Resume {
        segment,
        offset: fill as u64,
    };
    let meta = log.meta_position().map(at);
    (log.last_seq(), Some(at(log.data_position())), meta)
}

pub(in crate::volume) fn page_ref(p: &Placed) -> PageRef {
    PageRef {
        offset: p.offset,
        len: p.len,
        crc: p.crc,
        seq: p.seq,
    }
}

/// The most bytes `encode_page` can make of `page`: every entry a run of
/// its own, lz4's worst expansion and length prefix.
fn page_payload_bound(page: &Page) -> usize {
    let raw = page.used() as usize * run_bytes(1);
    4 + raw + raw / 255 + 16
}

/// A page's MAP_CHUNK payload: its entries as runs, lz4-compressed.
fn encode_page(p: usize, page: &Page) -> Vec<u8> {
    let mut raw = Vec::new();
    let mut run: Vec<MapEntry> = Vec::new();
    let mut run_start = 0u64;
    page.for_each_mapped(p, &mut |lba, e| {
        if !run.is_empty() && lba != run_start + run.len() as u64 {
            push_run(&mut raw, run_start, &run);
            run.clear();
        }
        if run.is_empty() {
            run_start = lba;
        }
        run.push(e);
    });
    assert!(!run.is_empty(), "a dirty page with entries");
    push_run(&mut raw, run_start, &run);
    lz4_flex::block::compress_prepend_size(&raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hold_batches_stop_at_the_count_or_the_bytes() {
        let small: Vec<(usize, u64, usize)> = (0..130).map(|i| (i, 0, 100)).collect();
        let b = hold_batches(&small, |&l| l);
        assert_eq!(b.iter().map(|x| x.len()).collect::<Vec<_>>(), [64, 64, 2]);
        let big: Vec<(usize, u64, usize)> = (0..5).map(|i| (i, 0, 100 << 10)).collect();
        let b = hold_batches(&big, |&l| l);
        assert_eq!(b.iter().map(|x| x.len()).collect::<Vec<_>>(), [3, 2]);
        assert!(hold_batches(&big[..0], |&l| l).is_empty());
    }
}
