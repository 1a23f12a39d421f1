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

    /// Bytes it holds: its payload until decoded.
    pub fn payload_bytes(&self) -> usize {
        if self.decoded.get().is_some() {
            0
        } else {
            self.payload.len()
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
