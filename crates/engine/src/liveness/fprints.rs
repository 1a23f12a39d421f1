//! The fingerprint tables a checkpoint persists (`cvol_format::fprints`):
//! the fingerprint of every block appended with dedup on, kept per part of
//! its record's segment until a checkpoint wrote the part, so that an open
//! refills the dedup index from them (`Volume::start_index_warmup`)
//! instead of reading and hashing the stored data.
//!
//! Only the part holding the log head takes new rows (records are appended
//! there, the cleaner's copies too); it stays in memory until the head
//! leaves it, every other part only until its table is written. A table is
//! a hint: rows of records that died since stay until the segment is freed.
use super::LiveMap;
use crate::error::MetaError;
use cvol_format::checkpoint::MAP_PAGE_BLOCKS;
use cvol_format::checkpoint::{PageRef, DIR_ENTRY_BYTES};
use cvol_format::fprints::{
    fp_parts, fp_table_index, FpRow, FpTable, FP_HEADER_BYTES, FP_PART_BYTES, FP_ROW_BYTES,
    FP_ROW_MAX_BYTES, FP_TABLE_MAX_ROWS,
};
use cvol_format::hooks::hook_root_table;
use cvol_format::record::{RecordKind, RECORD_HEADER_BYTES, RECORD_OVERHEAD_MAX_BYTES};
use cvol_format::tables::table_count;
use cvol_format::Superblock;
use std::collections::HashMap;
use std::sync::Arc;

/// Per part: its rows, and 0 while its record holds them, else the stamp
/// of its last change.
struct Part {
    rows: Arc<Vec<FpRow>>,
    dirty: u64,
}

pub(crate) struct FpBooks {
    data_offset: u64,
    segment_size: u64,
    segments: u64,
    /// The segment count table indexes are numbered for
    /// (`Superblock::table_segments`).
    layout: u64,
    parts: HashMap<usize, Part>,
    /// The part of the last row noted: the log head's (it takes the next
    /// rows, so it stays in memory when written).
    last: Option<usize>,
    stamp: u64,
    /// Rows of changed parts (kept rows only), for the checkpoint reserve.
    dirty_rows: u64,
    dirty_parts: u64,
}

/// A changed part's rows, taken with a checkpoint's snapshot.
pub(crate) struct FpSnapshot {
    pub(crate) table: usize,
    pub(crate) stamp: u64,
    segment: u64,
    part: u32,
    rows: Arc<Vec<FpRow>>,
}

impl FpSnapshot {
    /// The table record to append: (table, stamp, payload), the payload
    /// lz4-compressed as every table record's.
    pub(crate) fn encode(&self) -> (usize, u64, Vec<u8>) {
        let raw = FpTable::encode_rows(self.segment, self.part, &self.rows);
        let payload = lz4_flex::block::compress_prepend_size(&raw);
        (self.table, self.stamp, payload)
    }
}

impl FpBooks {
    pub(crate) fn new(sb: &Superblock) -> FpBooks {
        FpBooks {
            data_offset: sb.data_offset_bytes,
            segment_size: sb.segment_size_bytes,
            segments: sb.segment_count(),
            layout: sb.table_segments(),
            parts: HashMap::new(),
            last: None,
            stamp: 1,
            dirty_rows: 0,
            dirty_parts: 0,
        }
    }

    /// The fingerprint table index of the part holding `offset`.
    pub(crate) fn table_of(&self, offset: u64) -> usize {
        let rel = offset - self.data_offset;
        let (s, k) = (
            rel / self.segment_size,
            rel % self.segment_size / FP_PART_BYTES,
        );
        fp_table_index(self.layout, self.segment_size, s, k) as usize
    }

    /// Segment and part of fingerprint table `t`, if it is one.
    pub(crate) fn part_of(&self, t: usize) -> Option<(u64, u32)> {
        let i = (t as u64).checked_sub(table_count(self.layout))?;
        let per = fp_parts(self.segment_size);
        (i < self.segments * per).then(|| (i / per, (i % per) as u32))
    }

    /// Part `t` changed, `added` of its rows new (all of them count once
    /// it was clean).
    fn mark(&mut self, t: usize, added: usize) {
        self.stamp += 1;
        let part = self.parts.get_mut(&t).expect("a part in memory");
        if part.dirty == 0 {
            self.dirty_parts += 1;
            self.dirty_rows += part.rows.len() as u64;
        } else {
            self.dirty_rows += added as u64;
        }
        part.dirty = self.stamp;
    }

    /// Block fingerprint `row` was appended (at `row.entry`'s offset).
    /// Returns the table that keeps the row, None when its part is full.
    pub(crate) fn note(&mut self, offset: u64, row: FpRow) -> Option<usize> {
        let t = self.table_of(offset);
        self.last = Some(t);
        let part = self.parts.entry(t).or_insert_with(|| Part {
            rows: Arc::new(Vec::new()),
            dirty: 0,
        });
        if part.rows.len() >= FP_TABLE_MAX_ROWS {
            return None; // the first rows are kept: hints
        }
        Arc::make_mut(&mut part.rows).push(row);
        self.mark(t, 1);
        Some(t)
    }

    /// Part `t`'s rows while memory holds them (the head's part, or one
    /// not written since it changed).
    fn rows(&self, t: usize) -> Option<Arc<Vec<FpRow>>> {
        self.parts.get(&t).map(|p| Arc::clone(&p.rows))
    }

    /// Part `t`'s rows as its record has them (open: the head's part,
    /// which takes the next rows).
    fn resume(&mut self, t: usize, rows: Vec<FpRow>) {
        let part = Part {
            rows: Arc::new(rows),
            dirty: 0,
        };
        if let Some(old) = self.parts.insert(t, part) {
            self.forget_dirty(&old);
        }
        self.last = Some(t);
    }

    /// Part `t`'s rows as its record has them, to be written again (the
    /// cleaner moves the record). A part in memory (the head's, or one
    /// not written since) holds those rows and any noted since: it is only
    /// marked changed.
    pub(crate) fn reload(&mut self, t: usize, rows: Vec<FpRow>) {
        self.parts.entry(t).or_insert_with(|| Part {
            rows: Arc::new(rows),
            dirty: 0,
        });
        self.mark(t, 0);
    }

    fn forget_dirty(&mut self, p: &Part) {
        if p.dirty != 0 {
            self.dirty_parts -= 1;
            self.dirty_rows -= p.rows.len() as u64;
        }
    }

    /// The changed parts, shared copy-on-write (the one holding `head`, the
    /// log head's offset, only `with_head`: it takes more rows, and a
    /// checkpoint that falls due often need not rewrite it each time);
    /// parts neither changed nor holding the head leave memory.
    fn snapshot(&mut self, head: u64, with_head: bool) -> Vec<FpSnapshot> {
        let head_t = self.table_of(head);
        let last = self.last;
        self.parts
            .retain(|&t, p| p.dirty != 0 || t == head_t || Some(t) == last);
        let mut out: Vec<FpSnapshot> = (self.parts.iter())
            .filter(|(&t, p)| p.dirty != 0 && (with_head || t != head_t))
            .map(|(&t, p)| {
                let (segment, part) = self.part_of(t).expect("a fingerprint table's part");
                FpSnapshot {
                    table: t,
                    stamp: p.dirty,
                    segment,
                    part,
                    rows: Arc::clone(&p.rows),
                }
            })
            .collect();
        out.sort_unstable_by_key(|s| s.table);
        out
    }

    /// Part `t`'s table was written from the snapshot of `stamp`: unless it
    /// changed since or takes the next rows, it leaves memory.
    fn written(&mut self, t: usize, stamp: u64) {
        let Some(p) = self.parts.get_mut(&t) else {
            return;
        };
        if p.dirty == stamp {
            p.dirty = 0;
            self.dirty_parts -= 1;
            self.dirty_rows -= p.rows.len() as u64;
            if self.last != Some(t) {
                self.parts.remove(&t);
            }
        }
    }

    /// Segment `s` was freed: its parts' rows are gone.
    fn freed(&mut self, s: u64) -> Vec<usize> {
        let per = fp_parts(self.segment_size);
        let first = fp_table_index(self.layout, self.segment_size, s, 0) as usize;
        let tables: Vec<usize> = (first..first + per as usize).collect();
        for t in &tables {
            if let Some(p) = self.parts.remove(t) {
                self.forget_dirty(&p);
            }
        }
        tables
    }

    /// Upper bound on the log bytes of the changed parts' records.
    fn bytes_bound(&self) -> u64 {
        let per_table = (RECORD_OVERHEAD_MAX_BYTES + FP_HEADER_BYTES + 32 + DIR_ENTRY_BYTES) as u64;
        self.dirty_parts * per_table + self.dirty_rows * (FP_ROW_MAX_BYTES as u64 + 1)
    }
}

impl LiveMap {
    /// A block fingerprint to persist: `row.entry` was just appended.
    /// Returns the fingerprint table that keeps the row (None: its part
    /// keeps no more rows), for the dedup hook index.
    pub(crate) fn fp_note(&mut self, row: FpRow) -> Option<u32> {
        let offset = data_offset(&row.entry())?;
        let t = self.fps.note(offset, row)?;
        u32::try_from(t).ok()
    }

    /// Fingerprint table `t`'s rows if memory holds them (see `FpBooks`).
    pub(crate) fn fp_rows(&self, t: usize) -> Option<Arc<Vec<FpRow>>> {
        self.fps.rows(t)
    }

    /// Fingerprint table `t`'s record, if the directory names one.
    pub(crate) fn fp_table_ref(&self, t: usize) -> Option<PageRef> {
        (self.is_fp_table(t) && t < self.map.tables())
            .then(|| self.map.table_ref(t))
            .flatten()
    }

    /// Fingerprint table `t` (the cleaner moves its record) holds `rows`:
    /// they are written again.
    pub(crate) fn fp_reload(&mut self, t: usize, rows: Vec<FpRow>) {
        self.fps.reload(t, rows);
    }

    /// Fingerprint table `t` (the head's part, at open) holds `rows`.
    pub(crate) fn fp_resume(&mut self, t: usize, rows: Vec<FpRow>) {
        self.fps.resume(t, rows);
    }

    /// Decodes fingerprint table `t`'s record payload (`FpBooks::decode`).
    pub(crate) fn fp_decode(&self, t: usize, payload: &[u8]) -> Result<Vec<FpRow>, MetaError> {
        self.fps.decode(t, payload)
    }

    /// Whether table `t` is a fingerprint table.
    pub(crate) fn is_fp_table(&self, t: usize) -> bool {
        self.fps.part_of(t).is_some()
    }

    /// The fingerprint table index of the part holding `offset`.
    pub(crate) fn fp_table_of(&self, offset: u64) -> usize {
        self.fps.table_of(offset)
    }

    /// The changed fingerprint tables, for a checkpoint (none for a map
    /// without their directory slots; see `FpBooks::snapshot`).
    pub(crate) fn fp_snapshot(&mut self, head: u64, with_head: bool) -> Vec<FpSnapshot> {
        if self.map.tables() as u64 <= table_count(self.fps.layout) {
            return Vec::new();
        }
        self.fps.snapshot(head, with_head)
    }

    /// Names `r` as fingerprint table `t`'s record, written from the
    /// snapshot of `stamp`.
    pub(crate) fn fp_written(&mut self, t: usize, stamp: u64, r: PageRef) {
        self.map_record_born(&r);
        self.map.set_table_ref(t, Some(r));
        self.fps.written(t, stamp);
    }

    /// Segments just freed: their fingerprint tables are named no more.
    pub(crate) fn fp_segments_freed(&mut self, freed: &[u64]) {
        if self.map.tables() as u64 <= table_count(self.fps.layout) {
            return;
        }
        for &s in freed {
            for t in self.fps.freed(s) {
                self.map.set_table_ref(t, None);
            }
        }
    }

    /// The data store now has `segments` segments (a pool's physical
    /// resize): the fingerprint tables of segments dropped (free: their
    /// rows went when they were freed) are named no more.
    pub(crate) fn fp_set_segments(&mut self, segments: u64) {
        let dropped: Vec<u64> = (segments..self.fps.segments).collect();
        self.fp_segments_freed(&dropped);
        self.fps.segments = segments;
    }

    /// Bytes of the fingerprint rows not yet in a table.
    pub(crate) fn fp_pending_bytes(&self) -> u64 {
        self.fps.dirty_rows * FP_ROW_BYTES as u64
    }

    /// Upper bound on the log bytes of the changed fingerprint tables.
    pub(crate) fn fp_bytes_bound(&self) -> u64 {
        self.fps.bytes_bound()
    }

    /// Live bytes of the segments with no fingerprint table (named or in
    /// memory), and of all segments.
    pub(crate) fn fp_uncovered_live(&self) -> (u64, u64) {
        let per = fp_parts(self.fps.segment_size) as usize;
        let first = table_count(self.fps.layout) as usize;
        let (mut uncovered, mut all) = (0, 0);
        for s in 0..self.fps.segments {
            let live = self.usage.live_bytes(s);
            all += live;
            let t0 = first + s as usize * per;
            let covered = (t0..t0 + per).any(|t| {
                self.fps.parts.contains_key(&t)
                    || (t < self.map.tables() && self.map.table_ref(t).is_some())
            });
            if !covered {
                uncovered += live;
            }
        }
        (uncovered, all)
    }

    /// The directory slot of the hook snapshot's root (its chunks follow).
    pub(crate) fn hook_root_table(&self) -> usize {
        hook_root_table(self.fps.layout, self.fps.segment_size) as usize
    }

    /// Directory slots a checkpoint may have to name: the map's allocated
    /// pages, every liveness and fingerprint table slot, and the hook
    /// snapshot's slots that name a record (4,097 slots, mostly empty on a
    /// small volume: counting them all would inflate its checkpoint bound).
    pub(crate) fn directory_slots_bound(&self) -> u64 {
        let per = fp_parts(self.fps.segment_size);
        let tables = table_count(self.fps.segments) + self.fps.segments * per;
        let hooks = (self.map)
            .table_refs(self.hook_root_table(), self.map.tables())
            .len() as u64;
        self.map.allocated_pages() as u64 + tables + hooks
    }

    /// Names `r` as hook snapshot record `t` (root or chunk; a hint like
    /// the fingerprint tables: the next commit names it).
    pub(crate) fn hook_written(&mut self, t: usize, r: PageRef) {
        debug_assert!(t >= self.hook_root_table() && t < self.map.tables());
        self.map_record_born(&r);
        self.map.set_table_ref(t, Some(r));
    }

    /// Hook snapshot record `t`, if the directory names one.
    pub(crate) fn hook_ref(&self, t: usize) -> Option<PageRef> {
        (t >= self.hook_root_table() && t < self.map.tables())
            .then(|| self.map.table_ref(t))
            .flatten()
    }

    /// Drops hook snapshot record `t` from the directory (the cleaner
    /// moves it: it is written again from memory).
    pub(crate) fn hook_unnamed(&mut self, t: usize) {
        if t >= self.hook_root_table() && t < self.map.tables() {
            self.map.set_table_ref(t, None);
        }
    }

    /// The named fingerprint tables: (table, record), oldest record first.
    pub(crate) fn fp_tables(&self) -> Vec<(usize, PageRef)> {
        let first = table_count(self.fps.layout) as usize;
        let mut v = self.map.table_refs(first, self.hook_root_table());
        v.sort_unstable_by_key(|(_, r)| r.seq);
        v
    }
}

/// The offset of a data entry's record.
fn data_offset(e: &cvol_format::MapEntry) -> Option<u64> {
    match e.state() {
        Ok(cvol_format::EntryState::Data { offset, .. }) => Some(offset),
        _ => None,
    }
}

impl FpBooks {
    /// Decodes fingerprint table `t`'s record payload (lz4): the part it
    /// must be, every row's record in that part.
    pub(crate) fn decode(&self, t: usize, payload: &[u8]) -> Result<Vec<FpRow>, MetaError> {
        let (s, k) = self
            .part_of(t)
            .ok_or(MetaError::Damaged("not a fingerprint table".into()))?;
        let raw = lz4_flex::block::decompress_size_prepended(payload)
            .map_err(|e| MetaError::Damaged(e.to_string()))?;
        let table = FpTable::decode(&raw, s, k).map_err(|e| MetaError::Damaged(e.to_string()))?;
        let first = self.data_offset + s * self.segment_size + u64::from(k) * FP_PART_BYTES;
        let end = (first + FP_PART_BYTES).min(self.data_offset + (s + 1) * self.segment_size);
        for r in &table.rows {
            if !data_offset(&r.entry()).is_some_and(|o| (first..end).contains(&o)) {
                return Err(MetaError::Damaged(format!(
                    "a row outside part {k} of segment {s}"
                )));
            }
        }
        Ok(table.rows)
    }
}

/// Reads fingerprint table `t`'s record `r` from `storage` and decodes it.
pub(crate) fn read_fp_table(
    storage: &dyn cvol_storage::Storage,
    sb: &Superblock,
    t: usize,
    r: &PageRef,
) -> Result<Vec<FpRow>, MetaError> {
    let (h, rec) = crate::logread::read_record(storage, sb, r.offset, r.len)
        .map_err(|e| MetaError::Damaged(e.to_string()))?;
    decode_fp_record(sb, t, r, &h, &rec)
}

/// Decodes fingerprint table `t` from its record `r` (header `h`, bytes
/// `rec`, already checked by `logread::verify_record`).
pub(crate) fn decode_fp_record(
    sb: &Superblock,
    t: usize,
    r: &PageRef,
    h: &cvol_format::record::RecordHeader,
    rec: &[u8],
) -> Result<Vec<FpRow>, MetaError> {
    let books = FpBooks::new(sb);
    let (s, k) = books
        .part_of(t)
        .ok_or(MetaError::Damaged("not a fingerprint table".into()))?;
    let slot = sb.logical_blocks().div_ceil(MAP_PAGE_BLOCKS) + t as u64;
    if h.kind != RecordKind::MapTable || h.crc != r.crc || h.lba != slot * MAP_PAGE_BLOCKS {
        return Err(MetaError::Damaged(format!(
            "fingerprint table of part {k} of segment {s}: not the record the directory names"
        )));
    }
    books.decode(t, &rec[RECORD_HEADER_BYTES..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use cvol_format::{CodecTag, MapEntry, DATA_OFFSET_BYTES};

    fn books() -> FpBooks {
        FpBooks::new(&crate::test_util::small_superblock())
    }

    fn row(offset: u64) -> FpRow {
        let e = MapEntry::data(CodecTag::Lz4, offset, 100, offset as u32);
        FpRow {
            fp: offset << 3 | 1,
            loc: e.loc,
            crc: e.crc,
            owner: 0,
        }
    }

    #[test]
    fn written_parts_leave_memory_but_the_heads_keeps_its_rows() {
        let mut b = books();
        let base = DATA_OFFSET_BYTES;
        for i in 0..3 {
            b.note(base + i * 1000, row(base + i * 1000)); // part 0
        }
        let next = base + FP_PART_BYTES;
        b.note(next, row(next)); // part 1: the head's now
        let head = next + 100;
        let snap = b.snapshot(head, true);
        assert_eq!(snap.len(), 2);
        assert_eq!(b.dirty_rows, 4);
        for s in &snap {
            b.written(s.table, s.stamp);
        }
        assert_eq!((b.dirty_rows, b.dirty_parts), (0, 0));
        let (t0, t1) = (snap[0].table, snap[1].table);
        assert!(!b.parts.contains_key(&t0), "a written part stays in memory");
        assert!(b.parts.contains_key(&t1), "the head's part left memory");
        // The cleaner moves the head part's record (one row) while memory
        // holds two: none is lost, and the part is written again.
        b.note(next + 200, row(next + 200));
        b.written(t1, b.parts[&t1].dirty);
        b.reload(t1, vec![row(next)]);
        assert_eq!(b.parts[&t1].rows.len(), 2);
        assert_eq!((b.dirty_rows, b.dirty_parts), (2, 1));
        // A light checkpoint leaves the head's part out.
        assert!(b.snapshot(head, false).is_empty());
        assert_eq!(b.snapshot(head, true).len(), 1);
    }
}
