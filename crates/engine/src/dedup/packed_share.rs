//! A segment's share of the shared table left as its liveness table's
//! rows at open: open checks and counts the rows (what the table's totals
//! need) and builds the segment's maps only when something first reads or
//! changes them. A pool's snapshots add hundreds of thousands of shared
//! rows that an open, a `cvol stat` or a read of one volume never looks at.
use super::{SegShared, Shared, UnitLive};
use cvol_format::tables::{GroupHead, TableRow};
use std::sync::{Arc, OnceLock};

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

/// A segment's rows as its table holds them, checked (every row a
/// `ShareRow`, the payload whole), decoded on first use.
#[derive(Debug)]
pub struct PackedShare {
    payload: Arc<Vec<u8>>,
    head: GroupHead,
    unit_windows: bool,
    decoded: OnceLock<Arc<SegShared>>,
}

impl PackedShare {
    /// The rows of `payload` (its header `head`), every one of which
    /// `ShareRow::of` took (the caller checked them all).
    pub fn new(payload: Arc<Vec<u8>>, head: GroupHead, unit_windows: bool) -> PackedShare {
        PackedShare {
            payload,
            head,
            unit_windows,
            decoded: OnceLock::new(),
        }
    }

    /// The segment's share, built on the first call.
    pub fn share(&self) -> &Arc<SegShared> {
        self.decoded.get_or_init(|| Arc::new(self.decode()))
    }

    fn decode(&self) -> SegShared {
        let (mut records, mut units) = (Vec::new(), Vec::new());
        for r in self.head.rows(&self.payload) {
            let r = r.expect("rows checked when the table was read");
            match ShareRow::of(&r, self.unit_windows).expect("rows checked when read") {
                ShareRow::Record(s) => records.push((r.offset, s)),
                ShareRow::Unit(u) => units.push((r.offset, u)),
                ShareRow::None => {}
            }
        }
        SegShared {
            records: records.into_iter().collect(),
            units: units.into_iter().collect(),
        }
    }
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

    /// The share, to change (a packed slot becomes its decoded share).
    pub fn share_mut(&mut self) -> &mut SegShared {
        if let ShareSlot::Packed(p) = self {
            let s = p.share().clone();
            *self = ShareSlot::Share(s);
        }
        match self {
            ShareSlot::Share(s) => Arc::make_mut(s),
            ShareSlot::Packed(_) => unreachable!("made a share above"),
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

    /// A table holding `rows` in segment 1: packed, or built row by row.
    fn table(packed: bool) -> SharedTable {
        let mut t = SharedTable::new(0, SEG);
        if packed {
            let payload = TableGroup::encode_rows(1, &[SEG / 2], rows().into_iter());
            let head = GroupHead::decode(&payload, 1, 4).unwrap();
            let mut counts = [0u64; 3];
            for r in rows() {
                let s = ShareRow::of(&r, true).unwrap();
                counts[usize::from(matches!(s, ShareRow::Unit(_)))] += 1;
                counts[2] += s.extra();
            }
            let p = PackedShare::new(Arc::new(payload), head, true);
            t.insert_packed_segment(1, p, counts);
        } else {
            let mut share = SegShared::default();
            for r in rows() {
                match ShareRow::of(&r, true).unwrap() {
                    ShareRow::Record(s) => drop(share.records.insert(r.offset, s)),
                    ShareRow::Unit(u) => drop(share.units.insert(r.offset, u)),
                    ShareRow::None => {}
                }
            }
            t.insert_segment(1, share);
        }
        t
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
}
