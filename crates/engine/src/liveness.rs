//! The block map and everything derived from it about records, behind one
//! type whose only mutator keeps them exact: `LiveMap::set`.
//!
//! Derived from the map: the block counters (`MapCounters`), the live bytes
//! of every segment (`SegmentUsage`), the stored payload bytes, and the
//! shared table (records with dedup references, and live units). Rebuilt
//! from the map at open (`rebuild`), cross-checked by `LiveMap::verify`
//! (`Volume::verify_refcounts`, the crash simulation) and by `cvol check`.
//!
//! Rules (see crate::dedup): a record has at most one *owner* entry per
//! block (the LBAs in its header, created once, when the record is appended
//! or moved) and any number of *ref* entries (dedup). A record with ref
//! entries, and every live unit, is in the shared table; a record is live
//! while any entry points at it, and then its bytes count once in its
//! segment's live bytes and in the stored bytes.
use crate::dedup::{Fingerprint, OffsetMap, Shared, SharedTable, UnitLive};
use crate::error::MetaError;
use crate::map::{BlockMap, Page, PageSource};
use crate::segments::{CompactionHints, SegState, SegmentTable, SegmentUsage};
use crate::stats::MapCounters;
use cvol_format::checkpoint::PageRef;
use cvol_format::record::RECORD_HEADER_BYTES;
use cvol_format::{CodecTag, EntryState, MapEntry, Superblock};
use fprints::FpBooks;
pub(crate) use fprints::{decode_fp_record, read_fp_table, FpSnapshot};
pub(crate) use loaded::{decode_root, LoadedGroup, LoadedTables};
pub(crate) use replay::{Replay, ReplaySource};
use std::collections::HashMap;
use tables::TableBooks;
pub(crate) use tables::{check_tables, EncodedTables, TableSnapshot};

mod fprints;
mod loaded;
mod replay;
mod tables;

/// Where segments lie, to find a record's segment.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    data_offset_bytes: u64,
    segment_size_bytes: u64,
}

impl Geometry {
    fn of(sb: &Superblock) -> Geometry {
        Geometry {
            data_offset_bytes: sb.data_offset_bytes,
            segment_size_bytes: sb.segment_size_bytes,
        }
    }

    fn segment_of(&self, offset: u64) -> u64 {
        let rel = offset
            .checked_sub(self.data_offset_bytes)
            .expect("a record lies in the data area");
        rel / self.segment_size_bytes
    }
}

/// A unit whose entries a `LiveMap::set` changes, as it was before.
struct UnitBefore {
    offset: u64,
    len: u32,
    codec: CodecTag,
    refs: u32,
    owners: u32,
}

/// The block map and the tables derived from it.
pub(crate) struct LiveMap {
    map: BlockMap,
    counters: MapCounters,
    shared: SharedTable,
    usage: SegmentUsage,
    geometry: Geometry,
    /// Map changes since open (starting from those recovery replayed).
    changes: u64,
    books: TableBooks,
    /// Block fingerprints not yet in a fingerprint table.
    fps: FpBooks,
    /// The tables came from a checkpoint's records (`from_tables`).
    loaded_tables: bool,
    /// Why the checkpoint's tables could not be used, if they could not.
    tables_rejected: Option<String>,
    /// What compacting each segment's units would save (memory only).
    hints: CompactionHints,
}

impl LiveMap {
    /// The empty map of a new volume (one change: it needs a checkpoint).
    pub(crate) fn empty(sb: &Superblock) -> LiveMap {
        LiveMap {
            map: crate::logread::volume_map(sb),
            counters: MapCounters::default(),
            shared: SharedTable::new(sb.data_offset_bytes, sb.segment_size_bytes),
            usage: SegmentUsage::new(sb.segment_count(), sb.segment_size_bytes),
            geometry: Geometry::of(sb),
            changes: 1,
            books: TableBooks::new(sb.segment_count(), true),
            fps: FpBooks::new(sb),
            loaded_tables: false,
            tables_rejected: None,
            hints: CompactionHints::new(sb.segment_count()),
        }
    }

    /// A recovered map and the tables `rebuild` derived from it, with
    /// `changes` map records replayed since the checkpoint (at least one
    /// when the volume persists tables of a map with entries: the rebuilt
    /// ones are to be written).
    pub(crate) fn recovered(
        sb: &Superblock,
        map: BlockMap,
        tables: Rebuilt,
        changes: u64,
    ) -> (LiveMap, SegmentTable) {
        let map_tables = map.tables() > 0 && map.allocated_pages() > 0;
        let changes = changes.max(u64::from(map_tables));
        LiveMap::from_parts(sb, map, tables, changes, false)
    }

    /// The map and its tables, `changes` map changes since the checkpoint;
    /// `loaded_tables`: the tables came from the checkpoint.
    fn from_parts(
        sb: &Superblock,
        map: BlockMap,
        tables: Rebuilt,
        changes: u64,
        loaded_tables: bool,
    ) -> (LiveMap, SegmentTable) {
        let live = LiveMap {
            map,
            counters: tables.counters,
            shared: tables.shared,
            usage: tables.segments.usage,
            geometry: Geometry::of(sb),
            changes,
            books: tables.books,
            fps: FpBooks::new(sb),
            loaded_tables,
            tables_rejected: None,
            hints: CompactionHints::new(sb.segment_count()),
        };
        (live, tables.segments.table)
    }

    pub(crate) fn map(&self) -> &BlockMap {
        &self.map
    }

    pub(crate) fn get(&self, lba: u64) -> MapEntry {
        self.map.get(lba)
    }

    pub(crate) fn blocks(&self) -> u64 {
        self.map.blocks()
    }

    pub(crate) fn counters(&self) -> &MapCounters {
        &self.counters
    }

    pub(crate) fn shared(&self) -> &SharedTable {
        &self.shared
    }

    pub(crate) fn usage(&self) -> &SegmentUsage {
        &self.usage
    }

    pub(crate) fn loaded_tables(&self) -> bool {
        self.loaded_tables
    }

    pub(crate) fn tables_rejected(&self) -> Option<&str> {
        self.tables_rejected.as_deref()
    }

    pub(crate) fn set_tables_rejected(&mut self, why: Option<String>) {
        self.tables_rejected = why;
    }

    pub(crate) fn changes(&self) -> u64 {
        self.changes
    }

    /// The data store now has `segments` segments (a pool's physical
    /// resize): every per-segment book follows. Segments dropped must be
    /// free (no live record); their liveness tables are named no more,
    /// and the next checkpoint's root counts `segments`.
    pub(crate) fn set_segment_count(&mut self, segments: u64) {
        let old = self.usage.count();
        if self.map.tables() > 0 {
            for s in segments..old {
                let t = 1 + s as usize;
                if t < self.map.tables() && self.map.table_ref(t).is_some() {
                    self.map.set_table_ref(t, None);
                }
            }
        }
        self.fp_set_segments(segments);
        self.usage.resize(segments);
        self.books.resize(segments);
        self.hints.resize(segments);
    }

    /// Sets one map entry and keeps every derived table exact: the new
    /// entry's record gains an entry (it is new, or live already), the old
    /// one loses one and dies with its last. `segs` is the log's segment
    /// table (a live record never lies in a free segment); `fp` the block's
    /// fingerprint, 0 if unknown. A first ref entry to a unit needs its
    /// home (`set_with_home`).
    pub(crate) fn set(&mut self, segs: &SegmentTable, lba: u64, e: MapEntry, fp: Fingerprint) {
        self.set_with_home(segs, lba, e, fp, None);
    }

    /// `set`, with `home`: an LBA of the unit window of the unit `e` names
    /// (one of its owners' or its header's), needed when `e` is a ref
    /// entry to a unit no ref entry pointed at yet; its page must be in
    /// memory.
    pub(crate) fn set_with_home(
        &mut self,
        segs: &SegmentTable,
        lba: u64,
        e: MapEntry,
        fp: Fingerprint,
        home: Option<u64>,
    ) {
        assert!(lba < self.map.blocks(), "lba {lba} beyond the map");
        self.changes += 1;
        let old = self.map.get(lba);
        let units = self.units_before(lba, old, e, home);
        let old = self.map.set(lba, e);
        debug_assert_eq!(self.map.get(lba), e);
        self.counters.remove(old);
        self.counters.add(e);
        for u in units.into_iter().flatten() {
            self.unit_changed(segs, lba, old, e, u);
        }
        if let EntryState::Data {
            offset,
            len,
            shared,
            unit: false,
            codec,
        } = e.state_valid()
        {
            self.books.touch(self.geometry.segment_of(offset));
            if shared {
                self.shared.acquire(offset, e.crc, fp);
            } else {
                assert!(
                    self.shared.get(offset).is_none(),
                    "owner entry of a shared record at {offset}"
                );
                self.record_born(segs, offset, len, codec);
            }
        }
        if let EntryState::Data {
            offset,
            len,
            shared,
            unit: false,
            codec,
        } = old.state_valid()
        {
            self.books.touch(self.geometry.segment_of(offset));
            let dead = self.shared.release(offset, shared).unwrap_or_else(|| {
                assert!(!shared, "ref entry of an unshared record at {offset}");
                true
            });
            if dead {
                self.record_died(offset, len, codec);
            }
        }
    }

    /// The units `old` and `e` name (one, if the same), each as it was
    /// before `lba` changes from `old` to `e`.
    fn units_before(
        &self,
        lba: u64,
        old: MapEntry,
        e: MapEntry,
        home: Option<u64>,
    ) -> [Option<UnitBefore>; 2] {
        let unit_of = |x: MapEntry| match x.state_valid() {
            EntryState::Data {
                offset,
                len,
                codec,
                unit: true,
                ..
            } => Some((offset, len, codec)),
            _ => None,
        };
        let (a, b) = (unit_of(old), unit_of(e));
        let before = |u| self.unit_before(lba, u, old, e, home);
        let b = b.filter(|&(o, ..)| a.is_none_or(|(oa, ..)| oa != o));
        [a.map(before), b.map(before)]
    }

    /// The entries pointing at the unit at `offset` before `lba` changes
    /// from `old` to `e`: its row's when ref entries point at it, else its
    /// owner entries counted in its window (`lba`'s when `old` or `e` is
    /// one of them, else `home`'s).
    fn unit_before(
        &self,
        lba: u64,
        (offset, len, codec): (u64, u32, CodecTag),
        old: MapEntry,
        e: MapEntry,
        home: Option<u64>,
    ) -> UnitBefore {
        let (refs, owners) = match self.shared.unit(offset) {
            Some(row) => (row.refs, u32::from(row.owners)),
            None => {
                assert!(
                    !old.is_unit_ref_of(offset),
                    "a ref entry to the unit at {offset}, which has no row"
                );
                let at = if old.is_unit_owner_of(offset) || e.is_unit_owner_of(offset) {
                    lba
                } else {
                    home.unwrap_or_else(|| {
                        panic!("a first ref entry to the unit at {offset} without its home")
                    })
                };
                (0, self.map.window_owners(at, offset))
            }
        };
        UnitBefore {
            offset,
            len,
            codec,
            refs,
            owners,
        }
    }

    /// Keeps the unit `u` exact once `lba` changed from `old` to `e`: its
    /// row (while ref entries point at it), its liveness.
    fn unit_changed(
        &mut self,
        segs: &SegmentTable,
        lba: u64,
        old: MapEntry,
        e: MapEntry,
        u: UnitBefore,
    ) {
        let o = u.offset;
        let step = |n: u32, gain: bool, lose: bool| {
            (n + u32::from(gain))
                .checked_sub(u32::from(lose))
                .unwrap_or_else(|| panic!("entries of the unit at {o} underflow"))
        };
        let refs = step(u.refs, e.is_unit_ref_of(o), old.is_unit_ref_of(o));
        let owners = step(u.owners, e.is_unit_owner_of(o), old.is_unit_owner_of(o));
        debug_assert!(
            !(old.is_unit_owner_of(o) || e.is_unit_owner_of(o))
                || self.shared.unit(o).is_some()
                || self.map.window_owners(lba, o) == owners,
            "the owners of the unit at {o} lie outside its window"
        );
        let row = (refs > 0).then(|| UnitLive {
            refs,
            owners: u16::try_from(owners).expect("a unit has at most 16 blocks"),
        });
        let (was, is) = (u.refs + u.owners > 0, refs + owners > 0);
        let row_changed = row.as_ref() != self.shared.unit(o);
        if row_changed {
            self.shared.put_unit(o, row);
        }
        if row_changed || was != is {
            // Its segment's table (its row, or the live bytes) changed.
            self.books.touch(self.geometry.segment_of(o));
        }
        if is && !was {
            self.record_born(segs, o, u.len, u.codec);
        } else if was && !is {
            self.record_died(o, u.len, u.codec);
        }
        self.note_compaction(o, &u, old.is_unit_owner_of(o), (was, is));
    }

    /// Keeps the compaction hints of the unit `u`'s segment: a raw unit
    /// born or dead, a block of a live unit gone (`lost_owner`).
    fn note_compaction(
        &mut self,
        o: u64,
        u: &UnitBefore,
        lost_owner: bool,
        (was, is): (bool, bool),
    ) {
        let s = self.geometry.segment_of(o);
        let raw = u.codec == CodecTag::None;
        match (was, is) {
            (false, true) if raw => self.hints.raw_born(s, u64::from(u.len)),
            (true, false) if raw => self.hints.raw_died(s, u64::from(u.len)),
            (true, true) if lost_owner && u.refs == 0 && !raw => {
                let share = u64::from(u.len) / u64::from(u.owners.max(1));
                self.hints.unit_block_died(s, share);
            }
            _ => {}
        }
    }

    /// What compacting each segment's units would save (the cleaner's).
    pub(crate) fn hints(&self) -> &CompactionHints {
        &self.hints
    }

    /// The segments were cleaned or freed: their hints go.
    pub(crate) fn hints_reset(&mut self, segments: &[u64]) {
        for &s in segments {
            self.hints.reset(s);
        }
    }

    fn record_born(&mut self, segs: &SegmentTable, offset: u64, len: u32, codec: CodecTag) {
        let s = self.geometry.segment_of(offset);
        assert_ne!(
            segs.state(s),
            SegState::Free,
            "a live record in free segment {s}"
        );
        self.usage.add_live(s, u64::from(len));
        self.counters
            .record_born(codec, u64::from(len) - RECORD_HEADER_BYTES as u64);
    }

    fn record_died(&mut self, offset: u64, len: u32, codec: CodecTag) {
        let s = self.geometry.segment_of(offset);
        self.usage.sub_live(s, u64::from(len));
        self.counters
            .record_died(codec, u64::from(len) - RECORD_HEADER_BYTES as u64);
    }

    /// Makes sure the map pages of [first, end) are in memory (see
    /// `BlockMap::fault_in`).
    pub(crate) fn fault_in(
        &mut self,
        first: u64,
        end: u64,
        src: &dyn PageSource,
    ) -> Result<(), MetaError> {
        self.map.fault_in(first, end, src)
    }

    /// Drops clean map pages beyond `max_bytes` of them.
    pub(crate) fn evict(&mut self, max_bytes: u64) -> usize {
        self.map.evict(max_bytes)
    }

    /// The dirty map pages, for a checkpoint (`BlockMap::take_dirty`).
    pub(crate) fn dirty_pages(&self) -> Vec<(usize, Page)> {
        self.map.take_dirty()
    }

    /// A map record just appended (a page or a directory block) is live.
    fn map_record_born(&mut self, r: &PageRef) {
        let s = self.geometry.segment_of(r.offset);
        self.usage.add_live(s, u64::from(r.len));
        self.books.meta_born(s, r.len);
    }

    /// Names `r` as page `p`'s record (`BlockMap::page_written`).
    pub(crate) fn page_written(&mut self, p: usize, snap: &Page, r: PageRef) {
        self.map_record_born(&r);
        self.map.page_written(p, snap, r);
    }

    /// The dirty directory blocks (`BlockMap::take_dirty_dirs`).
    pub(crate) fn dirty_dirs(&mut self) -> Vec<(usize, Vec<(u64, PageRef)>)> {
        self.map.take_dirty_dirs()
    }

    /// Names `r` as directory block `b`'s record, and `list` as that of
    /// its list when the list lies apart.
    pub(crate) fn dir_written(&mut self, b: usize, r: PageRef, list: Option<PageRef>) {
        for r in std::iter::once(&r).chain(&list) {
            self.map_record_born(r);
        }
        self.map.dir_written(b, r, list);
    }

    /// Map records superseded so far (the first of them a checkpoint's
    /// commit no longer names: `release`).
    pub(crate) fn retired_count(&self) -> usize {
        self.map.retired().len()
    }

    /// The first `n` superseded map records, which a durable checkpoint no
    /// longer names: their bytes are dead.
    pub(crate) fn release(&mut self, n: usize) {
        for r in self.map.take_retired(n) {
            let s = self.geometry.segment_of(r.offset);
            self.usage.sub_live(s, u64::from(r.len));
            self.books.meta_died(s, r.len);
        }
    }

    /// The map, to change its pages' state (dirty marks) directly.
    pub(crate) fn map_mut(&mut self) -> &mut BlockMap {
        &mut self.map
    }

    /// Is the record `e` (indexed with LBA `owner`) still live, and still
    /// holding that block? For a unit block, exactly when its owner still
    /// points at it (conservative: a unit block whose owner moved on is
    /// not offered for dedup).
    pub(crate) fn record_live(&self, e: MapEntry, owner: u64) -> bool {
        let EntryState::Data { offset, unit, .. } = e.state_valid() else {
            return false;
        };
        if !unit {
            if let Some(s) = self.shared.get(offset) {
                return s.crc == e.crc;
            }
        }
        owner < self.map.blocks() && self.map.get(owner) == e
    }

    /// Recomputes every derived table from the map and compares it with the
    /// running one.
    pub(crate) fn verify(&self, sb: &Superblock, src: &dyn PageSource) -> Result<(), MetaError> {
        let fresh = rebuild(sb, &self.map, Some(src), &HashMap::new(), None)?;
        let mut errors = shared_differences(&self.shared, &fresh.shared);
        if fresh.counters != self.counters {
            errors.push(format!(
                "map counters: running {:?}, from the map {:?}",
                self.counters, fresh.counters
            ));
        }
        for s in 0..self.usage.count() {
            let (a, b) = (self.usage.live_bytes(s), fresh.segments.usage.live_bytes(s));
            if a != b {
                errors.push(format!(
                    "segment {s}: live bytes running {a}, from the map {b}"
                ));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            errors.truncate(20);
            Err(MetaError::Disagree(errors.join("; ")))
        }
    }
}

/// How a running shared table differs from one rebuilt from the map (a
/// rebuilt one knows no fingerprints).
fn shared_differences(running: &SharedTable, fresh: &SharedTable) -> Vec<String> {
    let mut errors = Vec::new();
    for (off, s) in running.records() {
        match fresh.record(off) {
            Some(f) if f == s || (f.fp == 0 && Shared { fp: 0, ..*s } == *f) => {}
            other => errors.push(format!(
                "record at {off}: running {s:?}, from the map {other:?}"
            )),
        }
    }
    for (off, f) in fresh.records() {
        if running.record(off).is_none() {
            errors.push(format!(
                "record at {off}: shared per the map ({f:?}), not in the table"
            ));
        }
    }
    let differ = (running.units())
        .filter(|&(o, u)| fresh.unit(o) != Some(u))
        .count();
    if differ > 0 || running.unit_count() != fresh.unit_count() {
        errors.push(format!(
            "units: {} running, {} from the map, {differ} differ",
            running.unit_count(),
            fresh.unit_count()
        ));
    }
    if fresh.extra_refs != running.extra_refs {
        errors.push(format!(
            "extra refs: running {}, from the map {}",
            running.extra_refs, fresh.extra_refs
        ));
    }
    errors
}

/// The segment table and usage a rebuild yields (what `check` cross-checks
/// against the segments themselves).
pub(crate) struct RebuiltSegments {
    pub(crate) table: SegmentTable,
    pub(crate) usage: SegmentUsage,
}

impl RebuiltSegments {
    pub(crate) fn count(&self) -> u64 {
        self.table.count()
    }

    pub(crate) fn free_count(&self) -> u64 {
        self.table.free_count()
    }

    pub(crate) fn live_bytes(&self, s: u64) -> u64 {
        self.usage.live_bytes(s)
    }

    pub(crate) fn total_live_bytes(&self) -> u64 {
        self.usage.total_live_bytes()
    }
}

/// Everything derived from a map, rebuilt.
pub(crate) struct Rebuilt {
    pub(crate) segments: RebuiltSegments,
    pub(crate) shared: SharedTable,
    pub(crate) counters: MapCounters,
    /// Every table to be written (they were not read).
    books: TableBooks,
}

/// Entries of the map per record that liveness needs, from a first pass:
/// the length and codec of every record ref entries point at, and their
/// ref entries (units and single-block records apart).
#[derive(Default)]
struct Census {
    lens: OffsetMap<(u32, CodecTag)>,
    shared: OffsetMap<Shared>,
    unit_refs: OffsetMap<u32>,
}

impl Census {
    /// The census of `map`, counting every entry into `counters` on the
    /// way (one pass over the map).
    fn of(
        map: &BlockMap,
        src: Option<&dyn PageSource>,
        counters: &mut MapCounters,
    ) -> Result<Census, MetaError> {
        let mut c = Census::default();
        map.scan(src, |_, e| {
            counters.add(e);
            if let EntryState::Data {
                offset,
                len,
                shared: true,
                unit,
                codec,
            } = e.state_valid()
            {
                c.lens.insert(offset, (len, codec));
                if unit {
                    *c.unit_refs.entry(offset).or_default() += 1;
                } else {
                    let fresh = Shared {
                        refs: 0,
                        owners: 0,
                        crc: e.crc,
                        fp: 0,
                    };
                    c.shared.entry(offset).or_insert(fresh).refs += 1;
                }
            }
        })?;
        Ok(c)
    }
}

/// The owner entries of units in one unit window of the map, as a scan
/// meets them (every owner of a unit lies in its window).
#[derive(Default)]
struct WindowUnits {
    window: u64,
    units: Vec<(u64, u32, CodecTag, u16)>,
}

impl WindowUnits {
    fn note(
        &mut self,
        lba: u64,
        offset: u64,
        len: u32,
        codec: CodecTag,
        done: &mut impl FnMut(u64, u32, CodecTag, u16),
    ) {
        let w = lba / crate::map::UNIT_WINDOW_BLOCKS as u64;
        if w != self.window {
            self.finish(done);
            self.window = w;
        }
        match self.units.iter_mut().find(|u| u.0 == offset) {
            Some(u) => u.3 += 1,
            None => self.units.push((offset, len, codec, 1)),
        }
    }

    /// Hands every unit of the window to `done(offset, len, codec, owners)`.
    fn finish(&mut self, done: &mut impl FnMut(u64, u32, CodecTag, u16)) {
        for (offset, len, codec, owners) in self.units.drain(..) {
            done(offset, len, codec, owners);
        }
    }
}

/// A rebuild's tables, counting records live.
struct Born<'a> {
    geometry: Geometry,
    segments: &'a mut RebuiltSegments,
    counters: &'a mut MapCounters,
}

impl Born<'_> {
    /// The record at `offset` is live (counted once).
    fn live(&mut self, offset: u64, len: u32, codec: CodecTag) {
        let s = self.geometry.segment_of(offset);
        if self.segments.table.state(s) == SegState::Free {
            self.segments.table.mark(s, SegState::Sealed, 0);
        }
        self.segments.usage.add_live(s, u64::from(len));
        self.counters
            .record_born(codec, u64::from(len) - RECORD_HEADER_BYTES as u64);
    }
}

/// A rebuild's units: the ref entries of each (census) until its owners
/// are met, then its row.
struct Units {
    refs: OffsetMap<u32>,
    rows: OffsetMap<UnitLive>,
}

impl Units {
    /// The rows, once every window is done: the units only ref entries
    /// point at (their owners all moved on) are live too.
    fn finish(self, born: &mut Born<'_>, lens: &OffsetMap<(u32, CodecTag)>) -> OffsetMap<UnitLive> {
        let mut rows = self.rows;
        for (offset, refs) in self.refs {
            let (len, codec) = lens[&offset];
            born.live(offset, len, codec);
            rows.insert(offset, UnitLive { refs, owners: 0 });
        }
        rows
    }

    /// The unit at `offset` has `owners` owner entries (all of them: its
    /// window is done); it is live, with a row if ref entries point at it.
    fn done(&mut self, born: &mut Born<'_>, offset: u64, len: u32, codec: CodecTag, owners: u16) {
        born.live(offset, len, codec);
        if let Some(refs) = self.refs.remove(&offset) {
            self.rows.insert(offset, UnitLive { refs, owners });
        }
    }
}

/// Rebuilds the derived tables from a map: live bytes per segment (each
/// record once), the shared table (records with ref entries, and units),
/// the counters. `needed` marks segments recovery needs (sealed with their
/// newest seq); `open` is the log head (segment, seq).
pub(crate) fn rebuild(
    sb: &Superblock,
    map: &BlockMap,
    src: Option<&dyn PageSource>,
    needed: &HashMap<u64, u64>,
    open: Option<(u64, u64)>,
) -> Result<Rebuilt, MetaError> {
    let mut counters = MapCounters::default();
    let census = Census::of(map, src, &mut counters)?;
    let geometry = Geometry::of(sb);
    let mut segments = RebuiltSegments {
        table: SegmentTable::for_volume(sb),
        usage: SegmentUsage::new(sb.segment_count(), sb.segment_size_bytes),
    };
    let mut born = Born {
        geometry,
        segments: &mut segments,
        counters: &mut counters,
    };
    let mut shared = census.shared;
    let mut units = Units {
        refs: census.unit_refs,
        rows: OffsetMap::default(),
    };
    let mut window = WindowUnits::default();
    map.scan(src, |lba, e| match e.state_valid() {
        EntryState::Data {
            offset,
            len,
            shared: false,
            unit: false,
            codec,
        } => match shared.get_mut(&offset) {
            Some(s) => s.owners = 1,
            None => born.live(offset, len, codec),
        },
        EntryState::Data {
            offset,
            len,
            shared: false,
            unit: true,
            codec,
        } => window.note(lba, offset, len, codec, &mut |o, l, c, n| {
            units.done(&mut born, o, l, c, n)
        }),
        _ => {}
    })?;
    window.finish(&mut |o, l, c, n| units.done(&mut born, o, l, c, n));
    let unit_rows = units.finish(&mut born, &census.lens);
    let mut extra = 0u64;
    for (&offset, s) in &shared {
        let (len, codec) = census.lens[&offset];
        born.live(offset, len, codec);
        extra += s.extra();
    }
    extra += unit_rows.values().map(|u| u64::from(u.refs)).sum::<u64>();
    // The map's own records: those it names, and those it superseded
    // (while replaying the log: a page emptied, say) that the durable
    // checkpoint still names, until the next one is durable.
    let mut books = TableBooks::new(sb.segment_count(), true);
    tables::count_map_records(map, geometry, &mut segments, &mut books)?;
    tables::mark_segments(&mut segments.table, needed, open);
    Ok(Rebuilt {
        segments,
        shared: {
            let mut t = SharedTable::new(sb.data_offset_bytes, sb.segment_size_bytes);
            shared.into_iter().for_each(|(o, r)| t.insert_record(o, r));
            unit_rows.into_iter().for_each(|(o, u)| t.insert_unit(o, u));
            t.extra_refs = extra;
            t
        },
        counters,
        books,
    })
}
