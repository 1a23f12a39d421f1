//! A segment's share of the shared table left as its liveness table's
//! rows at open: open checks and counts the rows (what the table's totals
//! need) and builds the segment's maps only when something first reads or
//! changes them. A pool's snapshots add hundreds of thousands of shared
//! rows that an open, a `cvol stat` or a read of one volume never looks at.
use super::{SegShared, Shared, UnitLive};
use cvol_format::tables::{GroupHead, TableRow, PACKED_LEN_BYTES};
use cvol_format::FormatError;
use std::borrow::Cow;
use std::ops::Range;
use std::sync::{Arc, OnceLock};

/// A group table's rows as open read them: the whole payload decompressed
/// (an older table, whose record is lz4 as a whole: its rows at the
/// head's `rows_at`), or still compressed (a head-first table: only its
/// head was read at open; `GroupHead::decode_head_first`).
#[derive(Debug)]
pub enum GroupRows {
    Whole(Vec<u8>),
    /// The record read (`record`), its rows an lz4 block from byte `at` to
    /// the end that must decompress to `len` bytes (bounded at open).
    Lz4 {
        record: Vec<u8>,
        at: usize,
        len: usize,
    },
}

impl GroupRows {
    /// The head-first payload of group `group` (of a volume of `segments`
    /// segments) from byte `start` of `record` (`GroupHead::decode_head_first`):
    /// its head, and its rows left compressed in `record`.
    pub fn head_first(
        record: Vec<u8>,
        start: usize,
        group: u64,
        segments: u64,
    ) -> Result<(GroupHead, GroupRows), FormatError> {
        let payload = record
            .get(start..)
            .ok_or(FormatError::Invalid("group table length"))?;
        let (head, packed) = GroupHead::decode_head_first(payload, group, segments)?;
        let (at, len) = (start + packed.at + PACKED_LEN_BYTES, packed.len);
        Ok((head, GroupRows::Lz4 { record, at, len }))
    }

    /// The rows' bytes, decompressed if need be (a buffer the caller
    /// drops once it has read them), or why they do not decompress.
    pub fn rows(&self) -> Result<Cow<'_, [u8]>, String> {
        match self {
            GroupRows::Whole(b) => Ok(Cow::Borrowed(b)),
            GroupRows::Lz4 { record, at, len } => {
                let block = record.get(*at..).ok_or("rows beyond the record")?;
                let mut out = vec![0u8; *len];
                let n = lz4_flex::block::decompress_into(block, &mut out)
                    .map_err(|e| format!("its rows do not decompress: {e}"))?;
                if n != *len {
                    return Err(format!("its rows decompress to {n} bytes, not {len}"));
                }
                Ok(Cow::Owned(out))
            }
        }
    }

    /// Bytes held.
    pub fn held_bytes(&self) -> usize {
        match self {
            GroupRows::Whole(b) => b.capacity(),
            GroupRows::Lz4 { record, .. } => record.capacity(),
        }
    }
}

/// What one table row is in the shared table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShareRow {
    Record(Shared),
    Unit(UnitLive),
    /// A unit row of an older volume's table without refs: the unit is
    /// live through its owner entries, which its segment's bytes count.
    None,
}

impl ShareRow {
    /// Row `r` of a volume's table (`unit_windows`: a volume whose tables
    /// hold a unit only while ref entries point into it), or why it cannot
    /// be one.
    pub fn of(r: &TableRow, unit_windows: bool) -> Result<ShareRow, &'static str> {
        if r.unit {
            let owners = u16::try_from(r.owners).map_err(|_| "unit owners")?;
            return match (r.refs, owners) {
                (0, 0) => Err("a unit without entries"),
                (0, _) if unit_windows => Err("a row for a unit no ref entry points at"),
                (0, _) => Ok(ShareRow::None),
                (refs, owners) => Ok(ShareRow::Unit(UnitLive { refs, owners })),
            };
        }
        if r.refs == 0 || r.owners > 1 {
            return Err("a shared record without refs");
        }
        Ok(ShareRow::Record(Shared {
            refs: r.refs,
            owners: r.owners,
            crc: r.crc,
            fp: 0,
        }))
    }

    /// The blocks the row serves without a record of their own
    /// (`SharedTable::extra_refs`).
    pub fn extra(&self) -> u64 {
        match self {
            ShareRow::Record(s) => s.extra(),
            ShareRow::Unit(u) => u64::from(u.refs),
            ShareRow::None => 0,
        }
    }
}

/// A segment's rows as its table holds them, decoded on first use (and
/// decompressed then, in a head-first table: once per group, as a group
/// is one segment, `TABLE_SEGMENTS`; the decompressed bytes are dropped
/// once decoded, the compressed ones kept: `held_bytes`). Open
/// either checked every row (a table without counts) or took the counts
/// its table carries (`GroupHead::counts`) and checked only that the rows
/// could be that many: then the rows are checked here, as they are
/// decoded. A row the shared table cannot hold (`ShareRow::of`), outside
/// the segment, or after a row that does not decode, is left out and the
/// segment's rows are marked damaged (`damage`): the simulations and
/// `cvol check` report it; a volume serving them meets what it would meet
/// with wrong counts in well-formed rows, which no open-time check sees.
#[derive(Debug)]
pub struct PackedShare {
    payload: Arc<GroupRows>,
    head: GroupHead,
    unit_windows: bool,
    /// Where the segment lies: its rows' offsets.
    span: Range<u64>,
    /// The counts the shared table's totals took for these rows.
    claimed: [u64; 3],
    decoded: OnceLock<Decoded>,
}

#[derive(Debug)]
struct Decoded {
    share: Arc<SegShared>,
    /// Why rows were left out, if any were.
    damage: Option<String>,
}

impl PackedShare {
    /// The rows of `payload` (its header `head`) of the segment at bytes
    /// `span`, counted `claimed` by the shared table's totals (records,
    /// units, blocks served): the counts `head` carries, or those open
    /// counted.
    pub fn new(
        payload: Arc<GroupRows>,
        head: GroupHead,
        unit_windows: bool,
        span: Range<u64>,
        claimed: [u64; 3],
    ) -> PackedShare {
        PackedShare {
            payload,
            head,
            unit_windows,
            span,
            claimed,
            decoded: OnceLock::new(),
        }
    }

    /// Whether the counts were its table's word (`GroupHead::counts`), the
    /// rows unchecked until decoded, rather than counted by open.
    pub fn at_its_word(&self) -> bool {
        self.head.counts == Some(self.claimed)
    }

    /// The segment's share, built on the first call.
    pub fn share(&self) -> &Arc<SegShared> {
        &self.decoded().share
    }

    /// The counts the shared table's totals took for these rows.
    pub fn claimed(&self) -> [u64; 3] {
        self.claimed
    }

    /// Whether the rows were decoded (the share built).
    pub fn is_decoded(&self) -> bool {
        self.decoded.get().is_some()
    }

    /// Bytes of the table's rows held (compressed, or the older whole
    /// payload), whether decoded or not: the share built is counted apart.
    pub fn held_bytes(&self) -> usize {
        self.payload.held_bytes()
    }

    /// Why the rows, decoded, are not what open counted: rows left out,
    /// or counts that differ from the claimed ones.
    pub fn damage(&self) -> Option<String> {
        let d = self.decoded();
        if let Some(why) = &d.damage {
            return Some(why.clone());
        }
        let got = counts_of(&d.share);
        (got != self.claimed).then(|| {
            format!(
                "rows count {got:?} (records, units, blocks served), its table said {:?}",
                self.claimed
            )
        })
    }

    fn decoded(&self) -> &Decoded {
        self.decoded.get_or_init(|| {
            let d = self.decode();
            if let Some(why) = &d.damage {
                tracing::error!(
                    "liveness table of the segment at byte {}: {why}; rows left out \
                     (`cvol check` reports it)",
                    self.span.start
                );
            }
            d
        })
    }

    fn decode(&self) -> Decoded {
        let (mut records, mut units) = (Vec::new(), Vec::new());
        let mut damage = None;
        let bytes = match self.payload.rows() {
            Ok(b) => b,
            // Every row of the group is left out.
            Err(why) => {
                return Decoded {
                    share: Arc::default(),
                    damage: Some(why),
                }
            }
        };
        let mut rows = self.head.rows(&bytes);
        for r in rows.by_ref() {
            let r = match r {
                Ok(r) => r,
                Err(e) => {
                    damage = Some(format!("a row does not decode: {e}"));
                    break;
                }
            };
            if !self.span.contains(&r.offset) {
                damage = Some(format!("a row at {} outside its segment", r.offset));
                continue;
            }
            match ShareRow::of(&r, self.unit_windows) {
                Ok(ShareRow::Record(s)) => records.push((r.offset, s)),
                Ok(ShareRow::Unit(u)) => units.push((r.offset, u)),
                Ok(ShareRow::None) => {}
                Err(why) => damage = Some(format!("a row at {}: {why}", r.offset)),
            }
        }
        if damage.is_none() {
            damage = rows.finish().err().map(|e| e.to_string());
        }
        Decoded {
            share: Arc::new(SegShared {
                records: records.into_iter().collect(),
                units: units.into_iter().collect(),
            }),
            damage,
        }
    }
}

/// A share's counts: records, units, blocks served (`ShareRow::extra`).
pub fn counts_of(s: &SegShared) -> [u64; 3] {
    let extra = s.records.values().map(Shared::extra).sum::<u64>()
        + s.units.values().map(|u| u64::from(u.refs)).sum::<u64>();
    [s.records.len() as u64, s.units.len() as u64, extra]
}

/// A segment's slot in the shared table: its share, or its rows still
/// packed.
#[derive(Debug, Clone)]
pub enum ShareSlot {
    Share(Arc<SegShared>),
    Packed(Arc<PackedShare>),
}

impl ShareSlot {
    pub fn share(&self) -> &Arc<SegShared> {
        match self {
            ShareSlot::Share(s) => s,
            ShareSlot::Packed(p) => p.share(),
        }
    }

    /// The share, to change (a share, not packed rows: `SharedTable`
    /// decodes packed rows first, to correct its totals).
    pub fn share_mut(&mut self) -> &mut SegShared {
        match self {
            ShareSlot::Share(s) => Arc::make_mut(s),
            ShareSlot::Packed(_) => unreachable!("packed rows are decoded before they change"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::SharedTable;
    use super::*;
    use cvol_format::tables::TableGroup;

    const SEG: u64 = 1 << 20;

    fn row(offset: u64, refs: u32, owners: u32, unit: bool) -> TableRow {
        let crc = if unit { 0 } else { offset as u32 ^ 0x5a5a };
        TableRow {
            offset,
            refs,
            owners,
            crc,
            unit,
        }
    }

    /// Segment 1's rows: two shared records and a unit.
    fn rows() -> Vec<TableRow> {
        vec![
            row(SEG + 100, 2, 1, false),
            row(SEG + 5000, 1, 0, false),
            row(SEG + 9000, 3, 4, true),
        ]
    }

    /// The counts of `rows`, as a table carries them.
    fn counts(rows: &[TableRow]) -> [u64; 3] {
        let mut counts = [0u64; 3];
        for r in rows {
            let s = ShareRow::of(r, true).unwrap();
            counts[usize::from(matches!(s, ShareRow::Unit(_)))] += 1;
            counts[2] += s.extra();
        }
        counts
    }

    /// Segment 1's table of `rows`, its counts `claimed`, head-first (as
    /// written now: its rows lz4-compressed after its head).
    fn head_first(rows: Vec<TableRow>, claimed: [u64; 3]) -> Vec<u8> {
        let (mut head, rows) =
            TableGroup::encode_parts(1, &[SEG / 2], Some(claimed), rows.into_iter());
        head.extend_from_slice(&lz4_flex::block::compress_prepend_size(&rows));
        head
    }

    /// A table holding segment 1's head-first `payload`, its totals
    /// `claimed`.
    fn packed_from(payload: Vec<u8>, claimed: [u64; 3]) -> SharedTable {
        let mut t = SharedTable::new(0, SEG);
        let (head, rows) = GroupRows::head_first(payload, 0, 1, 4).unwrap();
        let p = PackedShare::new(Arc::new(rows), head, true, SEG..2 * SEG, claimed);
        t.insert_packed_segment(1, p);
        t
    }

    /// A table holding `rows` packed in segment 1, its totals `claimed`.
    fn packed_table(rows: Vec<TableRow>, claimed: [u64; 3]) -> SharedTable {
        packed_from(head_first(rows, claimed), claimed)
    }

    /// The same, in an older table (lz4 as a whole: decompressed at open).
    fn packed_whole(rows: Vec<TableRow>, claimed: [u64; 3]) -> SharedTable {
        let mut t = SharedTable::new(0, SEG);
        let payload = TableGroup::encode_rows(1, &[SEG / 2], Some(claimed), rows.into_iter());
        let head = GroupHead::decode(&payload, 1, 4).unwrap();
        let rows = Arc::new(GroupRows::Whole(payload));
        t.insert_packed_segment(1, PackedShare::new(rows, head, true, SEG..2 * SEG, claimed));
        t
    }

    /// A table holding `rows` in segment 1: packed, or built row by row.
    fn table(packed: bool) -> SharedTable {
        if packed {
            return packed_table(rows(), counts(&rows()));
        }
        let mut t = SharedTable::new(0, SEG);
        let mut share = SegShared::default();
        for r in rows() {
            match ShareRow::of(&r, true).unwrap() {
                ShareRow::Record(s) => drop(share.records.insert(r.offset, s)),
                ShareRow::Unit(u) => drop(share.units.insert(r.offset, u)),
                ShareRow::None => {}
            }
        }
        t.insert_segment(1, share);
        t
    }

    /// A packed segment whose first change replaces a unit's row: the
    /// caller takes the old row's refs off the totals before the segment
    /// is decoded (found by the crash simulation with overflow checks on:
    /// the totals' correction subtracted first and underflowed; where
    /// overflow wraps, the result was right).
    #[test]
    fn regression_a_unit_row_replaced_first_keeps_the_totals() {
        let (mut packed, mut built) = (table(true), table(false));
        for t in [&mut packed, &mut built] {
            t.put_unit(SEG + 9000, Some(UnitLive { refs: 1, owners: 4 }));
        }
        assert_eq!(contents(&packed), contents(&built));
        assert_eq!(contents(&packed).2, [2, 1, 2 + 1]);
        let mut packed = table(true);
        packed.put_unit(SEG + 9000, None);
        assert_eq!(contents(&packed).2, [2, 0, 2]);
    }

    /// Rows a table cannot hold, taken at their table's counts at open:
    /// left out when decoded, never a panic, and reported; the totals
    /// take what the rows hold once the segment changes.
    #[test]
    fn damaged_rows_taken_at_their_counts_are_left_out_and_reported() {
        let bad = vec![
            row(SEG + 100, 2, 1, false),
            row(SEG + 200, 0, 1, false), // a shared record without refs
            row(3 * SEG, 1, 1, false),   // in another segment
        ];
        let claimed = [3, 0, 6];
        let mut t = packed_table(bad, claimed);
        assert_eq!((t.record_count(), t.extra_refs), (3, 6), "open's totals");
        assert_eq!(t.get(SEG + 100).map(|s| s.refs), Some(2));
        assert_eq!(t.get(SEG + 200), None);
        let why = t.damaged_rows().expect("damage reported");
        assert!(why.contains("segment 1"), "{why}");
        // A change decodes the segment: the totals take its one row.
        assert_eq!(t.release(SEG + 100, true), Some(false));
        assert_eq!((t.record_count(), t.extra_refs), (1, 1));
        assert!(t.damaged_rows().is_some(), "still reported once decoded");
        // Rows that decode but differ from their counts are damage too.
        let t = packed_table(rows(), [9, 9, 9]);
        assert!(t.damaged_rows().unwrap().contains("its table said"));
        assert_eq!(table(true).damaged_rows(), None);
    }

    /// A table's records, units and counts.
    type Contents = (Vec<(u64, Shared)>, Vec<(u64, UnitLive)>, [u64; 3]);

    fn contents(t: &SharedTable) -> Contents {
        let records = t.records().map(|(o, s)| (o, *s)).collect();
        let units = t.units().map(|(o, u)| (o, *u)).collect();
        let counts = [t.record_count() as u64, t.unit_count() as u64, t.extra_refs];
        (records, units, counts)
    }

    #[test]
    fn a_packed_segment_reads_and_counts_as_one_built_row_by_row() {
        let (packed, built) = (table(true), table(false));
        assert_eq!(contents(&packed), contents(&built));
        let whole = packed_whole(rows(), counts(&rows()));
        assert_eq!(contents(&whole), contents(&built), "an older table");
        assert_eq!(contents(&packed).2, [2, 1, 2 + 3]);
        assert_eq!(packed.get(SEG + 9000), built.get(SEG + 9000));
        assert_eq!(packed.segment(1), built.segment(1));
    }

    #[test]
    fn a_packed_segment_is_decoded_before_it_changes() {
        let (mut packed, mut built) = (table(true), table(false));
        for t in [&mut packed, &mut built] {
            // The record with one ref and no owner loses its last entry.
            assert_eq!(t.release(SEG + 5000, true), Some(true));
            t.acquire(SEG + 100, (SEG + 100) as u32 ^ 0x5a5a, 7);
            t.put_unit(SEG + 9000, None);
        }
        assert_eq!(contents(&packed), contents(&built));
        assert_eq!(contents(&packed).2, [1, 0, 3]);
    }

    /// A head-first table whose compressed rows are corrupt (its record's
    /// checksum right): open takes its counts; its first use leaves every
    /// row of the group out and reports it, no panic; the totals then take
    /// what is left (nothing) once the segment changes.
    #[test]
    fn rows_that_do_not_decompress_are_all_left_out_and_reported() {
        let claimed = counts(&rows());
        let good = head_first(rows(), claimed);
        let at = match GroupRows::head_first(good.clone(), 0, 1, 4).unwrap().1 {
            GroupRows::Lz4 { at, .. } => at,
            GroupRows::Whole(_) => unreachable!(),
        };
        let mut bad = good.clone();
        // A match offset of 0 into nothing: the block cannot decompress.
        bad.truncate(at);
        bad.extend_from_slice(&[0x1f, 0x00, 0x00]);
        let declared_more = {
            let mut b = good.clone();
            b[at - PACKED_LEN_BYTES] += 1;
            b
        };
        for payload in [bad, declared_more] {
            let mut t = packed_from(payload, claimed);
            assert_eq!((t.record_count(), t.extra_refs), (2, 5), "open's totals");
            assert_eq!(t.get(SEG + 100), None);
            let why = t.damaged_rows().expect("damage reported");
            assert!(
                why.contains("segment 1") && why.contains("decompress"),
                "{why}"
            );
            assert!(t.memory_bytes() > 0);
            t.put_unit(SEG + 7, Some(UnitLive { refs: 1, owners: 1 }));
            assert_eq!(contents(&t).2, [0, 1, 1], "the totals take what is left");
            assert!(t.damaged_rows().is_some(), "still reported once changed");
        }
    }

    /// A packed segment counts the bytes its table holds until decoded,
    /// then its share as built too.
    #[test]
    fn memory_counts_compressed_rows_until_built() {
        let many: Vec<TableRow> = (0..2000).map(|i| row(SEG + 64 * i, 2, 1, false)).collect();
        let claimed = counts(&many);
        let payload = head_first(many.clone(), claimed);
        let held = payload.capacity() as u64;
        let t = packed_from(payload, claimed);
        let packed = t.memory_bytes();
        let _ = t.get(SEG); // decodes the segment
        let decoded = t.memory_bytes();
        assert!(packed < decoded, "{packed} < {decoded}");
        assert!(packed >= held && packed < held + 1024, "{packed} vs {held}");
    }

    #[test]
    fn rows_a_table_cannot_hold_are_refused() {
        assert!(ShareRow::of(&row(SEG, 0, 0, true), false).is_err());
        assert!(ShareRow::of(&row(SEG, 0, 2, true), true).is_err());
        assert_eq!(
            ShareRow::of(&row(SEG, 0, 2, true), false),
            Ok(ShareRow::None)
        );
        assert!(ShareRow::of(&row(SEG, 1, 1 << 16, true), true).is_err());
        assert!(ShareRow::of(&row(SEG, 0, 1, false), true).is_err());
        assert!(ShareRow::of(&row(SEG, 1, 2, false), true).is_err());
    }
    proptest::proptest! {
        /// Whatever bytes follow a table's header, taken at its counts:
        /// reading, changing and checking the segment never panics, and
        /// the totals follow what the rows hold once it changes. In a
        /// head-first table (`packed`): the bytes as its rows compressed,
        /// or (`lz4`) compressed, whatever length they claim.
        #[test]
        fn any_rows_taken_at_their_counts_decode_without_a_panic(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..120),
            count in 0usize..40,
            claimed in proptest::prelude::any::<[u16; 3]>(),
            packed in proptest::prelude::any::<bool>(),
            lz4 in proptest::prelude::any::<bool>(),
            len in proptest::prelude::any::<u32>(),
        ) {
            let claimed = claimed.map(u64::from);
            let mut payload = TableGroup::encode_rows(1, &[SEG / 2], Some(claimed), [].into_iter());
            let rows = if lz4 { lz4_flex::block::compress(&bytes) } else { bytes.clone() };
            let len = if lz4 && len % 2 == 0 { bytes.len() as u32 } else { len % 300 };
            if packed {
                payload.extend_from_slice(&len.to_le_bytes());
                payload.extend_from_slice(&rows);
            } else {
                payload.extend_from_slice(&bytes);
            }
            payload[12..16].copy_from_slice(&(count as u32).to_le_bytes());
            let read = if packed {
                GroupRows::head_first(payload, 0, 1, 4)
            } else {
                GroupHead::decode(&payload, 1, 4).map(|h| (h, GroupRows::Whole(payload)))
            };
            let Ok((head, rows)) = read else {
                return Ok(());
            };
            let mut t = SharedTable::new(0, SEG);
            let p = PackedShare::new(Arc::new(rows), head, true, SEG..2 * SEG, claimed);
            t.insert_packed_segment(1, p);
            let _ = t.damaged_rows();
            let n = t.records().count() + t.units().count();
            proptest::prop_assert!(n <= count);
            t.put_unit(SEG + 7, Some(UnitLive { refs: 1, owners: 1 }));
            let got = t.segment(1).map(|s| counts_of(&s)).unwrap_or_default();
            proptest::prop_assert_eq!(
                (t.record_count() as u64, t.unit_count() as u64, t.extra_refs),
                (got[0], got[1], got[2])
            );
        }
    }
}
