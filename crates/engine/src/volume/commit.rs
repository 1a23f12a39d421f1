//! Committing a write: under the state lock, each prepared record gets the
//! next seq, is copied into the open segment's buffer, and the map is
//! updated through `LiveMap::set` (the only way the map changes, which keeps
//! segment live bytes, stored bytes and the shared table exact). A dedup
//! candidate becomes a REF record only if its record is still live and not
//! being cleaned; otherwise it is compressed after all.
use super::layered::Layers;
use super::prepare::{DupTarget, Prepared};
use super::{space, State, Volume, BS};
use crate::dedup::{self, Fingerprint};
use crate::error::VolError;
use crate::log::{pack, Shape};
use crate::records::{full_mask, unit_entry};
use cvol_format::fprints::FpRow;
use cvol_format::record::{RecordKind, REF_PAYLOAD_BYTES};
use cvol_format::record::{
    EMPTY_RECORD_MAX_BYTES, RECORD_OVERHEAD_MAX_BYTES, REF_RECORD_MAX_BYTES,
};
use cvol_format::superblock::{Packing, PACKING_PAGE_BYTES};
use cvol_format::{EntryState, MapEntry, BLOCK_SIZE_BYTES};
use std::collections::HashMap;
use std::sync::atomic::Ordering;

/// Entries a commit gave each LBA (for duplicates inside one write).
pub(in crate::volume) type Committed = HashMap<u64, MapEntry>;

/// A dedup candidate handed back by a commit: its record can no longer be
/// referenced, so it is compressed and committed again.
pub(in crate::volume) struct Orphan<'a> {
    lba: u64,
    block: &'a [u8],
    fp: Fingerprint,
}

/// Who a write is for, which decides its codec under policy `auto`: a
/// client's write gets the codec for the current load; background work,
/// off every client's path (a cache's fills), the idle codec (EDC: the
/// strong codec where the CPU time is not a client's). Passed with each
/// write, so a simulation's seed fixes the choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writer {
    Client,
    Background,
}

impl Volume {
    /// A client's write of `data` at byte `offset` (FUA: durable when it
    /// returns).
    pub fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), VolError> {
        self.write_as(Writer::Client, offset, data, fua)
    }

    /// [`Volume::write_at`] on behalf of `who`.
    pub fn write_as(
        &self,
        who: Writer,
        offset: u64,
        data: &[u8],
        fua: bool,
    ) -> Result<(), VolError> {
        self.write_layered(who, offset, data, fua, &Layers::default())
    }

    /// [`Volume::write_as`] on a layered view (a pool's volume with
    /// snapshots, or a clone): the blocks' old content is kept first where
    /// `layers` asks (`Layers::keep`), and partial blocks are completed
    /// from what the view reads (`Layers::below`).
    pub fn write_layered(
        &self,
        who: Writer,
        offset: u64,
        data: &[u8],
        fua: bool,
        layers: &Layers,
    ) -> Result<(), VolError> {
        self.check_range(offset, data.len() as u64)?;
        self.check_writable()?;
        self.activity.note_client_io();
        if data.is_empty() {
            return Ok(());
        }
        self.activity.load.note(data.len() as u64);
        let _inflight = self.activity.load.enter();
        if offset.is_multiple_of(BLOCK_SIZE_BYTES) && data.len().is_multiple_of(BS) {
            let _shared = self.rmw_shared()?;
            self.write_blocks(offset / BLOCK_SIZE_BYTES, data, who, layers)?;
        } else {
            let _exclusive = self.rmw_exclusive()?;
            self.write_unaligned(offset, data, who, layers)?;
        }
        self.counters
            .client_bytes_written
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        self.after_write(fua)
    }

    pub(super) fn after_write(&self, fua: bool) -> Result<(), VolError> {
        if fua || self.options.sync_writes {
            self.flush()
        } else {
            Ok(())
        }
    }

    fn write_unaligned(
        &self,
        offset: u64,
        data: &[u8],
        who: Writer,
        layers: &Layers,
    ) -> Result<(), VolError> {
        let first = offset / BLOCK_SIZE_BYTES;
        let last = (offset + data.len() as u64 - 1) / BLOCK_SIZE_BYTES;
        let nblocks = (last - first + 1) as usize;
        let mut buf = vec![0u8; nblocks * BS];
        let head = (offset % BLOCK_SIZE_BYTES) as usize;
        let below_last = layers.below_at(last - first);
        if head != 0 {
            self.read_blocks(first, &mut buf[..BS], &layers.below)?;
        }
        let tail_end = head + data.len();
        if !tail_end.is_multiple_of(BS) && (last != first || head == 0) {
            self.read_blocks(last, &mut buf[(nblocks - 1) * BS..], &below_last)?;
        }
        buf[head..tail_end].copy_from_slice(data);
        self.write_blocks(first, &buf, who, layers)
    }

    fn write_blocks(
        &self,
        lba: u64,
        data: &[u8],
        who: Writer,
        layers: &Layers,
    ) -> Result<(), VolError> {
        assert!(data.len().is_multiple_of(BS));
        let n = (data.len() / BS) as u64;
        let mut items = self.prepare(lba, data, who)?;
        let ranges = layers.ranges(n, lba);
        let mut kept = layers.keep.is_none();
        loop {
            let packing = self.sb.packing();
            let need = log_bytes(&items, packing) + if kept { 0 } else { layers.keep_bytes(n) };
            // The map pages not in memory are read without the lock; the
            // hold that finds them all is this commit's.
            let mut st = self
                .lock_prefaulted_by(&ranges, || self.lock_with_space(space::commit_bytes(need)))?;
            if !kept {
                if !self.keep_old(&mut st, lba, n, layers, false)? {
                    drop(st);
                    self.wait_for_cleaning();
                    continue;
                }
                kept = true;
            }
            self.note_defer_room(&st);
            items = packed(packing, st.log.head.fill, items);
            let mut done = Committed::new();
            let mut orphans = Vec::new();
            for item in items {
                if let Some(o) = self.commit_one(&mut st, item, &mut done)? {
                    orphans.push(o);
                }
            }
            if orphans.is_empty() {
                // Without any FLUSH, the log and the dirty map pages grow
                // too: the background checkpointer (if one runs) bounds
                // them, and with them the memory and the recovery time.
                let due = self.checkpoint_due_by_writes(&st);
                let behind = st.log.claim_write_behind();
                drop(st);
                // The copy to storage runs outside the lock (a seal or a
                // flush of the segment waits for it).
                if let Some(w) = behind {
                    self.guard(w.run(&*self.storage))?;
                }
                if due {
                    self.jobs.checkpointer.hand_over();
                }
                return Ok(());
            }
            // Candidates whose record died (or is being cleaned) since they
            // were verified: compress them after all, outside the lock.
            drop(st);
            items = orphans
                .into_iter()
                .map(|o| self.compress_block(o.lba, o.block, o.fp, who))
                .collect();
        }
    }

    /// Notes whether the log has room to defer compression: at least the
    /// cleaner's stop threshold of segments free, and the raw units
    /// deferral already wrote at most half the usable free bytes (deferred
    /// units take their raw size until background recompression, or the
    /// cleaner when space runs short, compresses them: what deferral
    /// borrows stays well inside what is free, so a long burst cannot
    /// fill a thin volume with data it would have had room for compressed).
    pub(super) fn note_defer_room(&self, st: &State) {
        let (free, total) = (st.log.segments.free_count(), st.log.segments.count());
        let room = free * 100 >= self.options.cleaner.high_free_percent * total
            && st.live.hints().raw_total() <= self.usable_bytes(st) / 2;
        if self.activity.defer_room.load(Ordering::Relaxed) != room {
            self.activity.defer_room.store(room, Ordering::Relaxed);
        }
    }

    /// Commits one prepared item under the state lock. A dedup candidate
    /// whose record can no longer be referenced comes back, to be compressed.
    pub(in crate::volume) fn commit_one<'a>(
        &self,
        st: &mut State,
        item: Prepared<'a>,
        done: &mut Committed,
    ) -> Result<Option<Orphan<'a>>, VolError> {
        let (first, n) = match &item {
            Prepared::Data { lba, nblocks, .. } | Prepared::Zero { lba, nblocks } => {
                (*lba, *nblocks)
            }
            Prepared::Dup { lba, .. } => (*lba, 1),
        };
        self.fault(st, first, first + u64::from(n))?;
        match item {
            Prepared::Data { .. } => self.commit_data(st, item, done)?,
            Prepared::Zero { lba, nblocks } => {
                self.append(st, Shape::range(RecordKind::Zero, lba, nblocks), &[])?;
                for l in lba..lba + u64::from(nblocks) {
                    st.set_entry(l, MapEntry::ZERO, 0);
                }
            }
            Prepared::Dup {
                lba,
                fp,
                block,
                target,
            } => {
                let source = match target {
                    DupTarget::Record(_, _, source) => Some(source),
                    DupTarget::Earlier(_) => None,
                };
                let Some((target, home)) = self.dup_target(st, target, fp, done)? else {
                    self.count_verify_reject();
                    return Ok(Some(Orphan { lba, block, fp }));
                };
                self.commit_ref(st, lba, target, fp, home)?;
                done.insert(lba, target);
                self.counters.dedup_hits.fetch_add(1, Ordering::Relaxed);
                if let Some(source) = source {
                    self.count_dup_hit(source);
                }
            }
        }
        Ok(None)
    }

    /// Appends a DATA record and points its blocks at it; indexes their
    /// fingerprints.
    fn commit_data(
        &self,
        st: &mut State,
        item: Prepared<'_>,
        done: &mut Committed,
    ) -> Result<(), VolError> {
        let Prepared::Data {
            lba,
            nblocks,
            codec,
            level,
            payload,
            payload_crc,
            fps,
        } = item
        else {
            unreachable!("commit_data of a data item")
        };
        assert_eq!(fps.len(), nblocks as usize, "a fingerprint per block");
        let shape = Shape::data(codec, level, lba, nblocks, full_mask(nblocks));
        let p = self.append_with_crc(st, shape, &payload, payload_crc)?;
        assert_eq!(p.len as usize, self.sb.record_overhead() + payload.len());
        let mut indexed = Vec::new();
        for (k, &fp) in fps.iter().enumerate() {
            let e = unit_entry(codec, p.offset, p.len, p.crc, nblocks, k as u32);
            let l = lba + k as u64;
            st.set_entry(l, e, 0);
            if fp != 0 {
                indexed.push((fp, e, l));
            }
        }
        if indexed.is_empty() {
            return Ok(());
        }
        // The rows first (they say which table keeps each block), then one
        // hold of the index lock per record, its sets prefetched first so
        // that their cache misses overlap.
        let tables: Vec<Option<u32>> = (indexed.iter())
            .map(|&(fp, e, l)| st.live.fp_note(fp_row(fp, e, l)))
            .collect();
        if let Some(mut ix) = self.lock_index()? {
            for &(fp, ..) in &indexed {
                ix.hot.prefetch(fp);
            }
            for (&(fp, e, l), &t) in indexed.iter().zip(&tables) {
                ix.hot.insert(fp, e, l);
                if let Some(t) = t {
                    ix.learn_hook(dedup::key(fp), t);
                }
            }
            drop(ix);
            for (_, e, l) in indexed {
                done.insert(l, e);
            }
        }
        Ok(())
    }

    /// The entry a verified duplicate may reference now, if any: a stored
    /// record that is still live and not being cleaned (else the index
    /// forgets it), or an earlier block of this very commit; with the LBA
    /// of an owner entry of it where there is one (a unit's home window).
    fn dup_target(
        &self,
        st: &mut State,
        target: DupTarget,
        fp: Fingerprint,
        done: &Committed,
    ) -> Result<Option<(MapEntry, Option<u64>)>, VolError> {
        match target {
            DupTarget::Record(e, owner, _) => {
                if self.referable(st, e, owner)? {
                    return Ok(Some((e, Some(owner))));
                }
                if let Some(mut ix) = self.lock_index()? {
                    ix.hot.forget(fp, &e);
                }
                Ok(None)
            }
            // Committed earlier in this very lock hold, so still live; l0
            // is its home if it holds the entry itself (not a ref to it).
            DupTarget::Earlier(l0) => Ok(done
                .get(&l0)
                .map(|&e| (e, (st.live.get(l0) == e).then_some(l0)))),
        }
    }

    /// May a new reference point at record `e` (indexed with header LBA
    /// `owner`) now: is it live, and not in a segment being cleaned?
    fn referable(&self, st: &mut State, e: MapEntry, owner: u64) -> Result<bool, VolError> {
        let EntryState::Data { offset, .. } = e.state_valid() else {
            return Ok(false);
        };
        if st.cleaning.contains(&st.segment_of(offset)) {
            return Ok(false);
        }
        if owner < st.live.blocks() {
            self.fault(st, owner, owner + 1)?;
        }
        Ok(st.live.record_live(e, owner))
    }

    /// Points `lba` at the live record `target` (same content): a REF record
    /// in the log, a ref entry in the map, no new data. `home`: an LBA of
    /// the unit window of `target` if it is a unit (an owner's, or its
    /// header's), its page in memory.
    pub(in crate::volume) fn commit_ref(
        &self,
        st: &mut State,
        lba: u64,
        target: MapEntry,
        fp: Fingerprint,
        home: Option<u64>,
    ) -> Result<(), VolError> {
        self.fault(st, lba, lba + 1)?;
        if st.live.get(lba).same_record(&target) {
            return Ok(()); // the block holds this very record already
        }
        let e = target.as_ref_entry();
        let mut payload = [0u8; REF_PAYLOAD_BYTES];
        e.encode(&mut payload);
        self.append(st, Shape::reference(lba), &payload)?;
        st.live.set_with_home(&st.log.segments, lba, e, fp, home);
        debug_assert!(st.live.get(lba).same_record(&target));
        Ok(())
    }
}

/// Log bytes the records of `items` take, page padding included.
pub(in crate::volume) fn log_bytes(items: &[Prepared<'_>], packing: Packing) -> u64 {
    items.iter().map(|p| record_bytes(p, packing)).sum()
}

/// Log bytes a prepared item's record takes (with page packing, a DATA
/// record's page padding at most).
fn record_bytes(p: &Prepared<'_>, packing: Packing) -> u64 {
    match p {
        Prepared::Data { payload, .. } => {
            let pad = if packing.paged() {
                PACKING_PAGE_BYTES - 1
            } else {
                0
            };
            (RECORD_OVERHEAD_MAX_BYTES + payload.len()) as u64 + pad
        }
        Prepared::Zero { .. } => EMPTY_RECORD_MAX_BYTES as u64,
        Prepared::Dup { .. } => REF_RECORD_MAX_BYTES as u64,
    }
}

/// Page packing: the commit's DATA records in first-fit order
/// (`log::pack`) from the head at `fill`, its other records (ZERO, REF:
/// a REF may name a block committed before it in this write) after them
/// in their order. The blocks of one write are distinct, so the order
/// changes no block's content.
pub(in crate::volume) fn packed(
    packing: Packing,
    fill: usize,
    items: Vec<Prepared<'_>>,
) -> Vec<Prepared<'_>> {
    if !packing.paged() {
        return items;
    }
    let (data, rest): (Vec<_>, Vec<_>) = items
        .into_iter()
        .partition(|p| matches!(p, Prepared::Data { .. }));
    let sizes: Vec<usize> = data
        .iter()
        .map(|p| record_bytes(p, Packing::Compact) as usize)
        .collect();
    let mut slots: Vec<Option<Prepared<'_>>> = data.into_iter().map(Some).collect();
    let mut out: Vec<Prepared<'_>> = pack::commit_order(packing, fill, &sizes)
        .into_iter()
        .map(|i| slots[i].take().expect("a permutation"))
        .collect();
    out.extend(rest);
    out
}

/// A fingerprint table row: block `owner`'s fingerprint and entry.
pub(in crate::volume) fn fp_row(fp: Fingerprint, entry: MapEntry, owner: u64) -> FpRow {
    FpRow {
        fp: crate::dedup::key(fp),
        loc: entry.loc,
        crc: entry.crc,
        owner: u32::try_from(owner).expect("LBA below 2^32"),
    }
}
