//! The liveness tables a checkpoint persists (`cvol_format::tables`): the
//! map's counters, the live bytes of data records per segment and the
//! shared table, as they were at the checkpoint's snapshot. An open that
//! replays no map change since takes them as they are instead of reading
//! every map page to rebuild them (`LiveMap::from_tables`).
//!
//! A group's table is rewritten when something in its segments changed
//! (a stamp per group, so that a change during the checkpoint's append
//! keeps it dirty); the root with every checkpoint whose changed groups
//! could all be written.
use super::loaded::{LoadedGroup, LoadedTables};
use super::replay::{apply_replay, Replay, Tables};
use super::{rebuild, FpSnapshot, Geometry, LiveMap, Rebuilt, RebuiltSegments};
use crate::dedup::{GroupRows, PackedShare, SegShared, ShareRow, SharedTable};
use crate::error::MetaError;
use crate::map::{BlockMap, Page};
use crate::segments::{SegState, SegmentTable, SegmentUsage};
use crate::stats::MapCounters;
use cvol_format::checkpoint::PageRef;
use cvol_format::checkpoint::DIR_ENTRY_BYTES;
use cvol_format::fprints::directory_tables;
use cvol_format::record::RECORD_OVERHEAD_MAX_BYTES;
use cvol_format::tables::{
    GroupHead, TableGroup, TableRoot, TableRow, COUNTER_WORDS, GROUP_COUNTS_BYTES,
    GROUP_HEADER_BYTES, PACKED_LEN_BYTES, ROOT_BYTES, ROW_MAX_BYTES, TABLE_PAYLOAD_MAX_BYTES,
    TABLE_SEGMENTS,
};

// A table per segment: the shared table's share of a segment is its rows.
const _: () = assert!(TABLE_SEGMENTS == 1);
use cvol_format::superblock::FLAG_UNIT_WINDOWS;
use cvol_format::Superblock;
use std::collections::HashMap;
use std::sync::Arc;

/// Which tables changed since their records, and the live bytes of the
/// map's own records (part of `SegmentUsage`, not of the tables).
pub(crate) struct TableBooks {
    meta_live: Vec<u64>,
    /// Per group: 0 while its record (or its absence: an empty group)
    /// holds its table, else the stamp of its last change.
    dirty: Vec<u64>,
    stamp: u64,
}

impl TableBooks {
    /// Books for `segments` segments, every group changed (nothing written
    /// yet, or tables rebuilt from the map) or none (tables just loaded).
    pub(crate) fn new(segments: u64, changed: bool) -> TableBooks {
        let groups = segments.div_ceil(TABLE_SEGMENTS) as usize;
        TableBooks {
            meta_live: vec![0; segments as usize],
            dirty: vec![u64::from(changed); groups],
            stamp: 1,
        }
    }

    /// Books for `segments` segments: groups added are unchanged (an empty
    /// group has no record), groups dropped are forgotten.
    pub(crate) fn resize(&mut self, segments: u64) {
        self.meta_live.resize(segments as usize, 0);
        let groups = segments.div_ceil(TABLE_SEGMENTS) as usize;
        self.dirty.resize(groups, 0);
    }

    /// Something of segment `s` changed.
    pub(crate) fn touch(&mut self, s: u64) {
        self.stamp += 1;
        self.dirty[(s / TABLE_SEGMENTS) as usize] = self.stamp;
    }

    pub(crate) fn meta_born(&mut self, s: u64, len: u32) {
        self.meta_born_bytes(s, u64::from(len));
    }

    /// `meta_born` of records of segment `s` holding `bytes` in all.
    pub(crate) fn meta_born_bytes(&mut self, s: u64, bytes: u64) {
        self.meta_live[s as usize] += bytes;
    }

    pub(crate) fn meta_died(&mut self, s: u64, len: u32) {
        let l = &mut self.meta_live[s as usize];
        *l = l
            .checked_sub(u64::from(len))
            .expect("map record bytes of a segment underflow");
    }
}

/// The tables a checkpoint writes, taken with its snapshot (under the
/// state lock; encoded outside it, `encode`).
#[derive(Default)]
pub(crate) struct TableSnapshot {
    /// The root's payload, unless the map is empty.
    root: Option<Vec<u8>>,
    /// Every changed segment with live data.
    groups: Vec<SegmentSnapshot>,
    /// Every changed fingerprint table.
    fps: Vec<FpSnapshot>,
}

/// A changed segment's table at the snapshot.
struct SegmentSnapshot {
    table: usize,
    stamp: u64,
    segment: u64,
    /// Live bytes of its data records.
    live: u64,
    /// Its share of the shared table.
    share: Option<Arc<SegShared>>,
}

/// The table records a checkpoint appends (MAP_TABLE records, codec none):
/// (table, stamp, payload), a group head-first (its rows lz4-compressed
/// after its head, `head_first`), None for one too large to write; the
/// root's payload, raw.
#[derive(Default)]
pub(crate) struct EncodedTables {
    pub(crate) groups: Vec<(usize, u64, Option<Vec<u8>>)>,
    pub(crate) root: Option<Vec<u8>>,
    /// Fingerprint tables: (table, stamp, payload).
    pub(crate) fps: Vec<(usize, u64, Vec<u8>)>,
}

impl EncodedTables {
    /// Lengths of the payloads to append.
    pub(crate) fn payload_lens(&self) -> Vec<usize> {
        let groups = self.groups.iter().filter_map(|(_, _, p)| p.as_ref());
        let fps = self.fps.iter().map(|(_, _, p)| p);
        groups.chain(fps).chain(&self.root).map(Vec::len).collect()
    }
}

impl TableSnapshot {
    /// Encodes and compresses the tables, outside the state lock and right
    /// after the snapshot: the shares it holds are released before client
    /// writes would copy them.
    pub(crate) fn encode(self) -> EncodedTables {
        let groups = (self.groups.into_iter())
            .map(|g| {
                let (head, rows) = group_parts(g.segment, g.live, g.share.as_deref());
                let fits = head.len() + rows.len() <= TABLE_PAYLOAD_MAX_BYTES;
                (g.table, g.stamp, fits.then(|| head_first(head, &rows)))
            })
            .collect();
        EncodedTables {
            groups,
            root: self.root,
            fps: (self.fps.iter()).map(FpSnapshot::encode).collect(),
        }
    }
}

/// A group's head-first payload: its head as is, then its rows lz4 with
/// their length prepended (`GroupHead::decode_head_first`): open reads the
/// head alone.
fn head_first(mut head: Vec<u8>, rows: &[u8]) -> Vec<u8> {
    head.extend_from_slice(&lz4_flex::block::compress_prepend_size(rows));
    head
}

/// Segment `segment`'s table payload in its two parts (head, rows): its
/// data live bytes and its share's rows (records and units merged in
/// offset order, not collected).
fn group_parts(segment: u64, live: u64, share: Option<&SegShared>) -> (Vec<u8>, Vec<u8>) {
    let empty = SegShared::default();
    let share = share.unwrap_or(&empty);
    let mut records = (share.records.iter())
        .map(|(&offset, s)| TableRow {
            offset,
            refs: s.refs,
            owners: s.owners,
            crc: s.crc,
            unit: false,
        })
        .peekable();
    let mut units = (share.units.iter())
        .map(|(&offset, u)| TableRow {
            offset,
            refs: u.refs,
            owners: u32::from(u.owners),
            crc: 0,
            unit: true,
        })
        .peekable();
    let merged = std::iter::from_fn(|| match (records.peek(), units.peek()) {
        (Some(r), Some(u)) if r.offset < u.offset => records.next(),
        (_, Some(_)) => units.next(),
        _ => records.next(),
    });
    let counts = crate::dedup::counts_of(share);
    TableGroup::encode_parts(segment, &[live], Some(counts), merged)
}

fn counter_words(c: &MapCounters) -> [u64; COUNTER_WORDS] {
    let [n, l, z] = c.codec_blocks;
    let [sn, sl, sz] = c.stored_codec_bytes;
    [
        c.data_blocks,
        c.zero_blocks,
        c.lost_blocks,
        n,
        l,
        z,
        c.stored_payload_bytes,
        sn,
        sl,
        sz,
    ]
}

fn counters_of(w: &[u64; COUNTER_WORDS]) -> MapCounters {
    MapCounters {
        data_blocks: w[0],
        zero_blocks: w[1],
        lost_blocks: w[2],
        codec_blocks: [w[3], w[4], w[5]],
        stored_payload_bytes: w[6],
        stored_codec_bytes: [w[7], w[8], w[9]],
    }
}

impl LiveMap {
    /// The tables that changed, for a checkpoint, taken with its snapshot
    /// (under the state lock: live bytes copied, each segment's share of
    /// the shared table shared copy-on-write): segments without live data
    /// lose their record at once.
    /// `head`: the log head's offset (its fingerprint part stays in memory).
    pub(crate) fn table_snapshot(&mut self, head: u64) -> TableSnapshot {
        let mut snap = TableSnapshot::default();
        if self.map.tables() == 0 {
            return snap;
        }
        snap.fps = self.fp_snapshot(head, true);
        for g in 0..self.books.dirty.len() {
            let stamp = self.books.dirty[g];
            if stamp == 0 {
                continue;
            }
            let s = g as u64;
            let live = self.usage.live_bytes(s) - self.books.meta_live[g];
            let share = self.shared.segment(s);
            if live == 0 && share.is_none() {
                self.map.set_table_ref(1 + g, None);
                self.books.dirty[g] = 0;
                continue;
            }
            snap.groups.push(SegmentSnapshot {
                table: 1 + g,
                stamp,
                segment: s,
                live,
                share,
            });
        }
        // An empty map needs no tables (open rebuilds them for nothing):
        // a new volume's first records are not held live by a root.
        if self.map.allocated_pages() > 0 {
            let root = TableRoot {
                segments: self.usage.count(),
                counters: counter_words(&self.counters),
            };
            snap.root = Some(root.encode());
        }
        snap
    }

    /// The tables of a checkpoint that does not write the liveness tables
    /// (`Tables::WhenDue`): the root is named no more (the groups it would
    /// vouch for are stale), changed groups stay changed; of the
    /// fingerprint tables only the parts the log head has left.
    pub(crate) fn light_table_snapshot(&mut self, head: u64) -> TableSnapshot {
        if self.map.tables() == 0 {
            return TableSnapshot::default();
        }
        self.map.set_table_ref(0, None);
        TableSnapshot {
            fps: self.fp_snapshot(head, false),
            ..TableSnapshot::default()
        }
    }

    /// Whether the changed liveness tables are cheap beside the dirty map
    /// pages a checkpoint writes anyway (at most a quarter of their
    /// bytes, a page record taken as 1 KiB): then a checkpoint that falls
    /// due early writes them too, and an open after a crash that follows
    /// it need not rebuild them from the whole map. Each changed table
    /// costs its record (~64 bytes) and ~8 bytes per row (records with
    /// dedup references; units have rows only while those point into
    /// them).
    pub(crate) fn tables_cheap(&self) -> bool {
        if self.map.tables() == 0 {
            return true;
        }
        let pages = self.map.dirty_pages() as u64 * 1024;
        let mut bytes = 0u64;
        for (g, &stamp) in self.books.dirty.iter().enumerate() {
            if stamp != 0 {
                let rows = self
                    .shared
                    .segment(g as u64)
                    .map_or(0, |s| s.records.len() + s.units.len());
                bytes += 64 + 8 * rows as u64;
                if bytes * 4 > pages {
                    return false;
                }
            }
        }
        true
    }

    /// Upper bound on the log bytes of every table record (a checkpoint's
    /// reserve): per segment a record header, the group header, its live
    /// bytes and row counts, the rows' length and lz4's overhead, its
    /// first row's longer offset and a directory entry; a row per shared
    /// record and unit; the root.
    pub(crate) fn table_bytes_bound(&self) -> u64 {
        if self.map.tables() == 0 {
            return 0;
        }
        let head = GROUP_HEADER_BYTES + 8 + GROUP_COUNTS_BYTES;
        let per_table = (RECORD_OVERHEAD_MAX_BYTES + head + PACKED_LEN_BYTES + 20 + 2) as u64
            + (DIR_ENTRY_BYTES + 1) as u64;
        let rows = (self.shared.record_count() + self.shared.unit_count()) as u64;
        self.usage.count() * per_table
            + rows * (ROW_MAX_BYTES as u64 + 1)
            + (ROOT_BYTES + RECORD_OVERHEAD_MAX_BYTES + 64) as u64
            + self.fp_bytes_bound()
    }

    /// Table `t` could not be written (too large; for the root: a table
    /// could not be, or the map is empty): its old record, stale, is named
    /// no more, and it stays changed.
    pub(crate) fn table_unwritten(&mut self, t: usize) {
        self.map.set_table_ref(t, None);
    }

    /// Names `r` as table `t`'s record, written from the snapshot of
    /// `stamp`: the group is clean unless it changed since.
    pub(crate) fn table_written(&mut self, t: usize, stamp: u64, r: PageRef) {
        self.map_record_born(&r);
        self.map.set_table_ref(t, Some(r));
        if let Some(g) = t.checked_sub(1) {
            if self.books.dirty[g] == stamp {
                self.books.dirty[g] = 0;
            }
        }
    }

    /// Table `t`'s record must be written again (the cleaner moves it).
    pub(crate) fn table_moved(&mut self, t: usize) {
        if let Some(g) = t.checked_sub(1) {
            self.books.touch(g as u64 * TABLE_SEGMENTS);
        }
    }

    /// The map and the tables its checkpoint persisted, brought up to date
    /// with what roll-forward replayed (`tables_of`). Err (with the map
    /// back) if the tables do not fit the volume or the map: open then
    /// rebuilds them from the whole map.
    pub(crate) fn from_tables(
        sb: &Superblock,
        mut map: BlockMap,
        t: LoadedTables,
        replay: Replay<'_>,
    ) -> Result<(LiveMap, SegmentTable), Box<(BlockMap, MetaError)>> {
        let originals = map.take_originals();
        let tables = match tables_of(sb, &mut map, &t, originals, &replay) {
            Ok(x) => x,
            Err(e) => return Err(Box::new((map, e))),
        };
        Ok(LiveMap::from_parts(sb, map, tables, replay.records, true))
    }
}

/// The tables a checkpoint persisted, brought up to date with what
/// roll-forward replayed (`replay.records` map records, among them the
/// DATA records at `replay.new_records`): the pages it changed are counted
/// out as the checkpoint had them (`originals`) and in as they are now
/// (`apply_replay`), and the records the map names are counted live.
fn tables_of(
    sb: &Superblock,
    map: &mut BlockMap,
    t: &LoadedTables,
    originals: Option<Vec<(usize, Page)>>,
    replay: &Replay<'_>,
) -> Result<Rebuilt, MetaError> {
    let geometry = Geometry::of(sb);
    let segments = sb.segment_count();
    if map.tables() as u64 != directory_tables(sb.table_segments(), sb.segment_size_bytes) {
        return Err(MetaError::Damaged("the map has no table slots".into()));
    }
    let mut segs = RebuiltSegments {
        table: SegmentTable::for_volume(sb),
        usage: SegmentUsage::new(segments, sb.segment_size_bytes),
    };
    let mut shared = SharedTable::new(geometry.data_offset_bytes, geometry.segment_size_bytes);
    let mut upgrade = false;
    for g in &t.groups {
        load_group(sb, g, &mut segs, &mut shared, &mut upgrade)?;
    }
    let mut books = TableBooks::new(segments, upgrade);
    let mut counters = counters_of(&t.root.counters);
    if replay.records > 0 {
        let originals = originals.ok_or(MetaError::Damaged(
            "the pages replayed were not kept".into(),
        ))?;
        let mut tables = Tables {
            counters: &mut counters,
            shared: &mut shared,
            segs: &mut segs,
            books: &mut books,
            geometry,
        };
        apply_replay(map, originals, replay, &mut tables)?;
        shared.recount_extra();
    }
    count_map_records(map, geometry, &mut segs, &mut books)?;
    free_emptied(&mut segs);
    mark_segments(&mut segs.table, replay.needed, replay.open);
    Ok(Rebuilt {
        segments: segs,
        shared,
        counters,
        books,
    })
}

/// `cvol check`: the tables the checkpoint persisted against those a
/// rebuild from `map` (whole in memory, nothing replayed since) gives.
pub(crate) fn check_tables(
    sb: &Superblock,
    map: &mut BlockMap,
    t: &LoadedTables,
) -> Result<(), MetaError> {
    let none = HashMap::new();
    let replay = Replay {
        records: 0,
        new_records: &[],
        needed: &none,
        open: None,
        source: None,
    };
    let got = tables_of(sb, map, t, None, &replay)?;
    let fresh = rebuild(sb, map, None, &none, None)?;
    let mut errors: Vec<String> = got.shared.damaged_rows().into_iter().collect();
    errors.extend(super::shared_differences(&got.shared, &fresh.shared));
    if got.counters != fresh.counters {
        errors.push(format!(
            "map counters: persisted {:?}, from the map {:?}",
            got.counters, fresh.counters
        ));
    }
    for s in 0..sb.segment_count() {
        let (a, b) = (got.segments.live_bytes(s), fresh.segments.live_bytes(s));
        if a != b {
            errors.push(format!(
                "segment {s}: live bytes persisted {a}, from the map {b}"
            ));
        }
    }
    errors.truncate(20);
    if errors.is_empty() {
        Ok(())
    } else {
        Err(MetaError::Disagree(errors.join("; ")))
    }
}

/// A group's live bytes per segment, into the segment usage and states.
fn load_group_live(
    sb: &Superblock,
    live: &[u64],
    first: u64,
    segs: &mut RebuiltSegments,
) -> Result<(), MetaError> {
    for (i, &live) in live.iter().enumerate() {
        let s = first + i as u64;
        if live > sb.segment_size_bytes {
            return Err(MetaError::Damaged(format!(
                "table: segment {s} with {live} live bytes"
            )));
        }
        if live > 0 {
            segs.usage.add_live(s, live);
            segs.table.mark(s, SegState::Sealed, 0);
        }
    }
    Ok(())
}

/// Adds group `g`'s live bytes and its rows: its segment's share of the
/// shared table is left packed (`PackedShare`). A table that carries its
/// row counts is taken at its word, its rows checked when first decoded;
/// one without (written before the counts) is checked and counted here
/// (`check_group_rows`), and marks the tables changed (`upgrade`): the
/// next checkpoint writes them again, with counts. So does a table of the
/// older layout (lz4 as a whole, `GroupRows::Whole`: its whole payload
/// decompressed at open), to be written head-first.
fn load_group(
    sb: &Superblock,
    g: &LoadedGroup,
    segs: &mut RebuiltSegments,
    shared: &mut SharedTable,
    upgrade: &mut bool,
) -> Result<(), MetaError> {
    let first = g.head.group * TABLE_SEGMENTS;
    load_group_live(sb, &g.head.live, first, segs)?;
    let counts = match g.head.counts {
        Some(c) => check_claimed_counts(&g.head, c),
        None => {
            *upgrade = true;
            (g.payload.rows()).and_then(|rows| check_group_rows(sb, &g.head, &rows))
        }
    };
    let counts = counts.map_err(|why| MetaError::Damaged(format!("table: {why}")))?;
    if matches!(*g.payload, GroupRows::Whole(_)) {
        *upgrade = true;
    }
    if counts[..2] != [0, 0] {
        let unit_windows = sb.flags & FLAG_UNIT_WINDOWS != 0;
        let geometry = Geometry::of(sb);
        let start = geometry.data_offset_bytes + first * geometry.segment_size_bytes;
        let span = start..start + geometry.segment_size_bytes;
        let head = g.head.clone();
        let rows = PackedShare::new(g.payload.clone(), head, unit_windows, span, counts);
        shared.insert_packed_segment(first, rows);
    }
    Ok(())
}

/// The row counts a group table carries (records, units, blocks served),
/// if they could be its rows': no more records and units than rows, no
/// rows in a segment without live data, and blocks served no more than
/// rows could serve (2^33 each: refs and owners are 32-bit). The rows
/// themselves are checked when decoded (`PackedShare`).
fn check_claimed_counts(head: &GroupHead, c: [u64; 3]) -> Result<[u64; 3], String> {
    let rows = head.count as u64;
    let live = head.live.first().is_some_and(|&l| l > 0);
    if c[0].saturating_add(c[1]) > rows
        || (rows > 0 && !live)
        || c[2] > rows.saturating_mul(1 << 33)
    {
        return Err(format!(
            "row counts {c:?} for {rows} rows (live data: {live})"
        ));
    }
    Ok(c)
}

/// Checks the rows of a group table read at open (its header `head`, its
/// payload): each must lie in one of the group's segments with live data
/// and be a row the shared table takes (`ShareRow`). Counts its records,
/// units and the blocks they serve (`SharedTable::extra_refs`).
fn check_group_rows(sb: &Superblock, head: &GroupHead, payload: &[u8]) -> Result<[u64; 3], String> {
    let geometry = Geometry::of(sb);
    let unit_windows = sb.flags & FLAG_UNIT_WINDOWS != 0;
    // A table per segment (asserted above): its rows lie in its segment,
    // which must hold live data.
    let start = geometry.data_offset_bytes + head.group * geometry.segment_size_bytes;
    let segment = start..start + geometry.segment_size_bytes;
    let live = head.live.first().is_some_and(|&l| l > 0);
    let mut counts = [0u64; 3];
    let mut rows = head.rows(payload);
    for r in rows.by_ref() {
        let r = r.map_err(|e| e.to_string())?;
        if !live || !segment.contains(&r.offset) {
            return Err(format!(
                "a row at {} outside its group's live segments",
                r.offset
            ));
        }
        let row = ShareRow::of(&r, unit_windows)?;
        match row {
            ShareRow::Record(_) => counts[0] += 1,
            ShareRow::Unit(_) => counts[1] += 1,
            ShareRow::None => continue,
        }
        counts[2] += row.extra();
    }
    rows.finish().map_err(|e| e.to_string())?;
    Ok(counts)
}

/// Counts the records the map names, and those it retired, live (they
/// are the map's own: `books.meta_live`): summed per segment first, a
/// slot each (a map names a record per page: hundreds of thousands with
/// many snapshots).
pub(super) fn count_map_records(
    map: &BlockMap,
    geometry: Geometry,
    segs: &mut RebuiltSegments,
    books: &mut TableBooks,
) -> Result<(), MetaError> {
    // Per segment: bytes, and whether any record lies there.
    let mut per: Vec<(u64, bool)> = vec![(0, false); segs.table.count() as usize];
    let mut outside = None;
    let mut note = |offset: u64, len: u32| {
        let s = geometry.segment_of(offset);
        match per.get_mut(s as usize) {
            Some(p) => *p = (p.0 + u64::from(len), true),
            None => outside = Some(s),
        }
    };
    map.retired().iter().for_each(|r| note(r.offset, r.len));
    let mut packed = Vec::new();
    map.for_each_record_use(&mut note, |u| packed.push((u.segment, u.bytes)));
    // The page records of directory blocks open left packed, by their
    // summaries (per segment already).
    for (s, bytes) in packed {
        match per.get_mut(s as usize) {
            Some(p) => *p = (p.0 + bytes, true),
            None => outside = Some(s),
        }
    }
    if let Some(s) = outside {
        return Err(MetaError::Damaged(format!(
            "a map record in segment {s}, beyond the volume's"
        )));
    }
    for (s, (bytes, any)) in per.into_iter().enumerate() {
        let s = s as u64;
        if !any {
            continue;
        }
        if segs.usage.live_bytes(s) + bytes > geometry.segment_size_bytes {
            return Err(MetaError::Damaged(format!(
                "segment {s} would hold more live bytes than it has"
            )));
        }
        if segs.table.state(s) == SegState::Free {
            segs.table.mark(s, SegState::Sealed, 0);
        }
        segs.usage.add_live(s, bytes);
        books.meta_born_bytes(s, bytes);
    }
    Ok(())
}

/// Segments the tables had live but roll-forward emptied, and no map
/// record holds, are free, as a rebuild from the map would have them (and
/// as the run that emptied them may have had them: a flush frees a segment
/// whose records are all older than the durable checkpoint once the
/// records that emptied it are durable). Those holding records roll-forward
/// replayed are marked needed right after.
fn free_emptied(segs: &mut RebuiltSegments) {
    for s in 0..segs.table.count() {
        if segs.table.state(s) == SegState::Sealed && segs.usage.live_bytes(s) == 0 {
            segs.table.mark(s, SegState::Free, 0);
        }
    }
}

/// Marks the segments recovery needs (sealed with their newest seq) and
/// the log head's.
pub(super) fn mark_segments(
    table: &mut SegmentTable,
    needed: &HashMap<u64, u64>,
    open: Option<(u64, u64)>,
) {
    for (&s, &max_seq) in needed {
        table.mark(s, SegState::Sealed, max_seq);
    }
    if let Some((s, seq)) = open {
        table.mark(s, SegState::Open, seq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::TableError;
    use cvol_format::tables::TableRow;
    use cvol_format::CodecTag;

    /// A record row (`unit`: a unit row) at `offset`.
    fn row(offset: u64, unit: bool) -> TableRow {
        TableRow {
            offset,
            refs: 2,
            owners: u32::from(!unit),
            crc: 7,
            unit,
        }
    }

    /// Group 2's table of `rows` as read from its record (`codec`: lz4, an
    /// older table compressed whole; none, head-first).
    fn loaded(
        sb: &Superblock,
        codec: CodecTag,
        counts: Option<[u64; 3]>,
        rows: Vec<TableRow>,
    ) -> Result<LoadedGroup, TableError> {
        let (head, rows) = TableGroup::encode_parts(2, &[4096], counts, rows.into_iter());
        let payload = match codec {
            CodecTag::Lz4 => lz4_flex::block::compress_prepend_size(&[head, rows].concat()),
            _ => head_first(head, &rows),
        };
        let mut rec = vec![0u8; cvol_format::record::RECORD_HEADER_BYTES];
        rec.extend_from_slice(&payload);
        LoadedGroup::decode(3, codec, rec, sb.segment_count())
    }

    /// Records of either layout read to the same head; another codec, or
    /// a length beyond any table written, is refused before anything is
    /// decompressed; head-first rows without counts that do not
    /// decompress refuse the tables at open (they are checked there).
    #[test]
    fn group_records_of_both_layouts_read_and_bad_ones_are_refused() {
        let mut sb = crate::test_util::small_superblock();
        sb.flags |= FLAG_UNIT_WINDOWS;
        let at = sb.data_offset_bytes + 2 * sb.segment_size_bytes;
        let rows = vec![row(at, false), row(at + 100, true)];
        let old = loaded(&sb, CodecTag::Lz4, Some([1, 1, 4]), rows.clone()).unwrap();
        let new = loaded(&sb, CodecTag::None, Some([1, 1, 4]), rows.clone()).unwrap();
        assert_eq!(
            (old.head.counts, old.head.count),
            (new.head.counts, new.head.count)
        );
        let old_rows = old.payload.rows().unwrap();
        assert_eq!(&old_rows[old.head.rows_at..], &*new.payload.rows().unwrap());
        assert!(matches!(&*new.payload, GroupRows::Lz4 { .. }));
        let zstd = loaded(&sb, CodecTag::Zstd, None, rows.clone());
        assert!(matches!(zstd, Err(TableError::Codec { .. })));
        // An lz4 payload claiming 4 GiB (its block a good table's):
        // refused, nothing allocated.
        let (head, body) = TableGroup::encode_parts(2, &[4096], None, rows.clone().into_iter());
        let mut rec = vec![0u8; cvol_format::record::RECORD_HEADER_BYTES];
        rec.extend_from_slice(&lz4_flex::block::compress_prepend_size(
            &[head, body].concat(),
        ));
        let n = cvol_format::record::RECORD_HEADER_BYTES;
        assert!(LoadedGroup::decode(3, CodecTag::Lz4, rec.clone(), 256).is_ok());
        rec[n..n + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        let huge = LoadedGroup::decode(3, CodecTag::Lz4, rec, 256);
        assert!(matches!(huge, Err(TableError::Group { .. })));
        // Head-first, no counts, rows that do not decompress: refused.
        let mut g = loaded(&sb, CodecTag::None, None, rows).unwrap();
        if let Some(GroupRows::Lz4 { record, at, .. }) = Arc::get_mut(&mut g.payload) {
            record.truncate(*at);
            record.push(0xf0);
        }
        let mut segs = RebuiltSegments {
            table: SegmentTable::for_volume(&sb),
            usage: SegmentUsage::new(sb.segment_count(), sb.segment_size_bytes),
        };
        let mut shared = SharedTable::new(sb.data_offset_bytes, sb.segment_size_bytes);
        let r = load_group(&sb, &g, &mut segs, &mut shared, &mut false);
        assert!(matches!(r, Err(MetaError::Damaged(ref why)) if why.contains("decompress")));
    }

    /// Group 2's rows are checked against segment 2 and its live bytes.
    #[test]
    fn a_groups_rows_must_lie_in_its_live_segment() {
        let mut sb = crate::test_util::small_superblock();
        sb.flags |= FLAG_UNIT_WINDOWS;
        let seg = sb.segment_size_bytes;
        let at = sb.data_offset_bytes + 2 * seg;
        let check = |live: u64, rows: Vec<TableRow>| {
            let payload = TableGroup::encode_rows(2, &[live], None, rows.into_iter());
            let head = GroupHead::decode(&payload, 2, sb.segment_count()).unwrap();
            check_group_rows(&sb, &head, &payload)
        };
        let ok = vec![row(at, false), row(at + seg - 100, true)];
        assert_eq!(check(4096, ok.clone()), Ok([1, 1, 2 + 2]));
        assert!(check(0, ok).is_err(), "a segment without live data");
        assert!(
            check(4096, vec![row(at - 100, false)]).is_err(),
            "before it"
        );
        assert!(check(4096, vec![row(at + seg, false)]).is_err(), "after it");
        let no_refs = TableRow {
            refs: 0,
            ..row(at, false)
        };
        assert!(check(4096, vec![no_refs]).is_err(), "a row it cannot hold");
    }
    /// A group table without row counts is checked at open and marks the
    /// tables changed (the next checkpoint writes every table again, with
    /// counts), as does one of the older layout (written again
    /// head-first); one with counts is taken at its word, its rows left
    /// packed.
    #[test]
    fn tables_without_counts_are_written_again() {
        let mut sb = crate::test_util::small_superblock();
        sb.flags |= FLAG_UNIT_WINDOWS;
        let at = sb.data_offset_bytes + 2 * sb.segment_size_bytes;
        let rows = vec![row(at, false), row(at + 100, true)];
        let load = |counts: Option<[u64; 3]>, codec| {
            let g = loaded(&sb, codec, counts, rows.clone()).unwrap();
            let mut segs = RebuiltSegments {
                table: SegmentTable::for_volume(&sb),
                usage: SegmentUsage::new(sb.segment_count(), sb.segment_size_bytes),
            };
            let geometry = Geometry::of(&sb);
            let mut shared =
                SharedTable::new(geometry.data_offset_bytes, geometry.segment_size_bytes);
            let mut upgrade = false;
            load_group(&sb, &g, &mut segs, &mut shared, &mut upgrade).unwrap();
            (
                upgrade,
                shared.packed_at_their_word(),
                shared.record_count(),
            )
        };
        for codec in [CodecTag::Lz4, CodecTag::None] {
            assert_eq!(load(None, codec), (true, 0, 1));
        }
        // With counts: taken at their word; of the older layout, written
        // again (head-first).
        assert_eq!(load(Some([1, 1, 4]), CodecTag::None), (false, 1, 1));
        assert_eq!(load(Some([1, 1, 4]), CodecTag::Lz4), (true, 1, 1));
        // Counts no rows could have: the tables are refused at open.
        let payload = TableGroup::encode_rows(2, &[4096], Some([5, 0, 0]), rows.into_iter());
        let head = GroupHead::decode(&payload, 2, sb.segment_count()).unwrap();
        assert!(check_claimed_counts(&head, [5, 0, 0]).is_err());
        // Crafted counts that would overflow a sum: refused, no panic.
        assert!(check_claimed_counts(&head, [u64::MAX, 2, 0]).is_err());
        assert!(check_claimed_counts(&head, [1, 1, u64::MAX]).is_err());
    }
}
