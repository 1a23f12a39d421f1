//! Bringing the liveness tables a checkpoint persisted up to date with the
//! map changes roll-forward replayed after it: each changed record's
//! references are counted from the pages as they were and as they are, and
//! applied to the tables; any disagreement gives up (`MetaError::Disagree`)
//! and the open rebuilds the tables from the map instead.

use super::{Geometry, RebuiltSegments};
use crate::dedup::{OffsetMap, Shared, SharedTable, UnitLive};
use crate::error::MetaError;
use crate::map::{unit_identity, BlockMap, Page, PageSource, PAGE_BLOCKS};
use crate::segments::SegState;
use crate::stats::MapCounters;
use cvol_format::record::{RecordHeader, RecordKind, RECORD_HEADER_BYTES};
use cvol_format::tables::TABLE_SEGMENTS;

// A table per segment: the shared table's share of a segment is its rows.
const _: () = assert!(TABLE_SEGMENTS == 1);
use super::tables::TableBooks;
use cvol_format::{CodecTag, EntryState, MapEntry};
use std::collections::{BTreeSet, HashMap, HashSet};
/// What recovery's roll-forward did after the tables' snapshot.
pub(crate) struct Replay<'a> {
    /// Map records (DATA, ZERO, TRIM, REF) replayed.
    pub(crate) records: u64,
    /// Offsets of the DATA records replayed (records born since).
    pub(crate) new_records: &'a [u64],
    /// Segments recovery needs, with their newest seq.
    pub(crate) needed: &'a HashMap<u64, u64>,
    /// The log head (segment, seq).
    pub(crate) open: Option<(u64, u64)>,
    /// Where to read what neither the tables nor the pages replayed say
    /// (None: nothing was replayed).
    pub(crate) source: Option<ReplaySource<'a>>,
}

/// What `apply_replay` may read: map pages, and record headers (the
/// window of a unit that ref entries replayed point into, when the
/// tables have no row for it and no owner entry of it changed).
pub(crate) struct ReplaySource<'a> {
    pub(crate) pages: &'a dyn PageSource,
    /// The header of the record at an offset, None if it cannot be read.
    pub(crate) header: &'a dyn Fn(u64) -> Option<RecordHeader>,
}

/// The tables being brought up to date.
pub(super) struct Tables<'a> {
    pub(super) counters: &'a mut MapCounters,
    pub(super) shared: &'a mut SharedTable,
    pub(super) segs: &'a mut RebuiltSegments,
    pub(super) books: &'a mut TableBooks,
    pub(super) geometry: Geometry,
}

/// The entries pointing at one record in the pages roll-forward changed:
/// as the checkpoint had them (`_a`) and as they are now (`_b`).
#[derive(Default)]
struct Touched {
    refs_a: u32,
    owners_a: u32,
    refs_b: u32,
    owners_b: u32,
    len: u32,
    codec: Option<CodecTag>,
    crc: u32,
    unit: bool,
    mixed: bool,
    /// For a unit: an LBA of its window (an owner entry that changed, or
    /// its header's).
    home: Option<u64>,
    /// Another record held its offset at the snapshot (its segment was
    /// emptied, freed by a flush and reused since): this one had no entry
    /// then, and no row of the tables is its.
    fresh: bool,
}

/// A record among those roll-forward's changes point at: its offset, its
/// identity (the crc its entries carry; for a unit, `unit_identity`) and
/// whether it is a unit. One offset may name two records: one live at the
/// snapshot, and one appended after its segment was reused.
type RecordKey = (u64, u32, bool);

/// The pages roll-forward changed, before and after.
struct Changed<'m> {
    map: &'m BlockMap,
    /// As read from their records (pages faulted in and left unchanged
    /// too).
    before: HashMap<usize, Page>,
    /// Changed since their records (those not in `before` were made by
    /// roll-forward).
    dirty: HashSet<usize>,
}

impl Changed<'_> {
    /// Page `p` now (None: it has no entries).
    fn now(&self, p: usize) -> Result<Option<&Page>, MetaError> {
        if !self.map.is_allocated(p) {
            return Ok(None);
        }
        match self.map.resident(p) {
            Some(page) => Ok(Some(page)),
            None => Err(MetaError::Damaged(format!("map page {p} is not in memory"))),
        }
    }

    /// Page `p` as the checkpoint had it.
    fn was(&self, p: usize) -> Result<Option<&Page>, MetaError> {
        match self.before.get(&p) {
            Some(page) => Ok(Some(page)),
            None if self.dirty.contains(&p) => Ok(None),
            None => self.now(p),
        }
    }

    /// Owner entries of the unit at `offset` in the window of `lba`:
    /// (at the checkpoint, now).
    fn window_owners(&self, lba: u64, offset: u64, ident: u32) -> Result<(u32, u32), MetaError> {
        let (p, i) = (lba as usize / PAGE_BLOCKS, lba as usize % PAGE_BLOCKS);
        let count =
            |page: Option<&Page>| page.map_or(0, |pg| pg.window_owners(i, offset, Some(ident)));
        Ok((count(self.was(p)?), count(self.now(p)?)))
    }
}

/// Brings tables of the snapshot up to date with the map: the entries of
/// the pages roll-forward changed are counted out as they were and in as
/// they are; a record's entries elsewhere (pages it did not change) are
/// what the snapshot's tables say minus those counted out. A record in no
/// table had one owner entry if it was live at the snapshot, that is, if
/// roll-forward did not append it (`new_records`). A unit's owner entries
/// all lie in its window: they are counted there, before and after.
pub(super) fn apply_replay(
    map: &mut BlockMap,
    originals: Vec<(usize, Page)>,
    replay: &Replay<'_>,
    t: &mut Tables<'_>,
) -> Result<(), MetaError> {
    let mut recs = changed_records(map, &originals, t.counters)?;
    find_homes(map, &mut recs, replay.source.as_ref(), t.shared)?;
    let changed = Changed {
        map,
        dirty: map.dirty_indexes().into_iter().collect(),
        before: originals.into_iter().collect(),
    };
    let new_records: HashSet<u64> = replay.new_records.iter().copied().collect();
    // The record an offset held at the snapshot first (it died before its
    // segment was reused), then the one appended there since.
    let mut order: Vec<(RecordKey, Touched)> = recs.into_iter().collect();
    order.sort_unstable_by_key(|&((offset, ..), ref d)| (offset, d.fresh));
    for ((offset, _, unit), d) in order {
        if unit {
            apply_unit(&changed, offset, &d, t)?;
        } else {
            apply_record(offset, &d, new_records.contains(&offset), t)?;
        }
    }
    Ok(())
}

/// The records the entries of the pages roll-forward changed point at,
/// as they did and as they do; the map's counters brought up to date on
/// the way.
fn changed_records(
    map: &BlockMap,
    originals: &[(usize, Page)],
    counters: &mut MapCounters,
) -> Result<HashMap<RecordKey, Touched>, MetaError> {
    let mut pages: BTreeSet<usize> = originals.iter().map(|(p, _)| *p).collect();
    pages.extend(map.dirty_indexes());
    let before: HashMap<usize, &Page> = originals.iter().map(|(p, a)| (*p, a)).collect();
    let mut recs: HashMap<RecordKey, Touched> = HashMap::new();
    let mut note = |e: MapEntry, now: bool, lba: u64| {
        let EntryState::Data {
            offset,
            len,
            shared: is_ref,
            unit,
            codec,
        } = e.state_valid()
        else {
            return;
        };
        let ident = if unit { unit_identity(e.crc) } else { e.crc };
        let d = recs.entry((offset, ident, unit)).or_default();
        if d.codec.is_none() {
            (d.len, d.codec, d.crc, d.unit) = (len, Some(codec), e.crc, unit);
        }
        d.mixed |= d.unit != unit || d.len != len;
        if unit && !is_ref {
            d.home = Some(lba);
        }
        let n = match (now, is_ref) {
            (false, true) => &mut d.refs_a,
            (false, false) => &mut d.owners_a,
            (true, true) => &mut d.refs_b,
            (true, false) => &mut d.owners_b,
        };
        *n += 1;
    };
    for p in pages {
        let now = map.is_allocated(p).then(|| map.resident(p));
        let Some(now) = now.map_or(Some(None), |r| r.map(Some)) else {
            return Err(MetaError::Damaged(
                "a page roll-forward changed is not in memory".into(),
            ));
        };
        let was = before.get(&p).copied();
        if was.zip(now).is_some_and(|(a, b)| Page::same(a, b)) {
            continue;
        }
        Page::for_each_change(was, now, &mut |i, a, b| {
            let lba = (p * PAGE_BLOCKS + i) as u64;
            counters.remove(a);
            counters.add(b);
            note(a, false, lba);
            note(b, true, lba);
        });
    }
    // Where one offset names several records, those without an entry at
    // the snapshot are fresh.
    let mut per_offset: OffsetMap<u32> = OffsetMap::default();
    recs.keys()
        .for_each(|&(o, ..)| *per_offset.entry(o).or_default() += 1);
    for (&(offset, ..), d) in recs.iter_mut() {
        d.fresh = per_offset[&offset] > 1 && d.refs_a + d.owners_a == 0;
    }
    Ok(recs)
}

/// The windows of the units ref entries replayed point into that the
/// tables have no row for and no changed owner entry names: from their
/// records' headers, their window's page brought into memory.
fn find_homes(
    map: &mut BlockMap,
    recs: &mut HashMap<RecordKey, Touched>,
    source: Option<&ReplaySource<'_>>,
    shared: &SharedTable,
) -> Result<(), MetaError> {
    for (&(offset, ..), d) in recs.iter_mut() {
        let row = shared.unit(offset).is_some() && !d.fresh;
        if !d.unit || d.home.is_some() || row {
            continue;
        }
        let src = source.ok_or(MetaError::Damaged(
            "a unit's window to find, and nothing to read it from".into(),
        ))?;
        let h = (src.header)(offset)
            .filter(|h| h.kind == RecordKind::Data && h.nblocks >= 2 && (d.crc ^ h.crc) < h.nblocks)
            .ok_or_else(|| {
                MetaError::Damaged(format!(
                    "the header of the unit at {offset} does not name its blocks"
                ))
            })?;
        map.fault_in(h.lba, h.lba + 1, src.pages)?;
        d.home = Some(h.lba);
    }
    Ok(())
}

/// Why `apply_replay` gives up on the record at `offset` (open then
/// rebuilds the tables from the map).
fn disagree(offset: u64, what: &str) -> Result<(), MetaError> {
    Err(MetaError::Disagree(format!(
        "tables and map disagree on the record at {offset}: {what}"
    )))
}

/// `apply_replay` for a unit: its owner entries counted in its window, its
/// ref entries as for any record; a row while ref entries point at it.
fn apply_unit(
    changed: &Changed<'_>,
    offset: u64,
    d: &Touched,
    t: &mut Tables<'_>,
) -> Result<(), MetaError> {
    let bad = |what: &str| disagree(offset, what);
    if d.mixed {
        return bad("entries of another shape");
    }
    let row = t.shared.unit(offset).copied().filter(|_| !d.fresh);
    if d.fresh && t.shared.unit(offset).is_some() {
        return bad("the record its offset held at the snapshot is still live");
    }
    let (owners_a, owners_b) = match (d.home, row) {
        (Some(lba), _) => changed.window_owners(lba, offset, unit_identity(d.crc))?,
        (None, Some(r)) => (u32::from(r.owners), u32::from(r.owners)),
        (None, None) => return bad("its window is unknown"),
    };
    if row.is_some_and(|r| u32::from(r.owners) != owners_a) {
        return bad("its row counts other owners than its window holds");
    }
    let refs_s = row.map_or(0, |r| r.refs);
    let Some(refs) = refs_s.checked_sub(d.refs_a).map(|r| r + d.refs_b) else {
        return bad("more ref entries counted out than it had");
    };
    let Ok(owners) = u16::try_from(owners_b) else {
        return bad("unit owners");
    };
    t.shared
        .put_unit(offset, (refs > 0).then_some(UnitLive { refs, owners }));
    let (was, is) = (refs_s + owners_a > 0, refs + owners_b > 0);
    count_liveness(offset, d, was, is, t)
}

/// `apply_replay` for a single-block record.
fn apply_record(offset: u64, d: &Touched, new: bool, t: &mut Tables<'_>) -> Result<(), MetaError> {
    let bad = |what: &str| disagree(offset, what);
    if d.mixed {
        return bad("entries of another shape");
    }
    let row = t.shared.record(offset).filter(|_| !d.fresh);
    if row.is_some_and(|s| s.crc != d.crc) || (d.fresh && t.shared.record(offset).is_some()) {
        return bad("a row of another record at its offset");
    }
    let (refs_s, owners_s) = if let Some(s) = row {
        (s.refs, s.owners)
    } else if d.fresh {
        (0, 0)
    } else if d.owners_a > 0 || !new {
        (0, 1)
    } else {
        (0, 0)
    };
    let (Some(refs_u), Some(owners_u)) = (
        refs_s.checked_sub(d.refs_a),
        owners_s.checked_sub(d.owners_a),
    ) else {
        return bad("more entries counted out than it had");
    };
    let (refs, owners) = (refs_u + d.refs_b, owners_u + d.owners_b);
    if owners > 1 {
        return bad("two owners");
    }
    if refs > 0 {
        let s = Shared {
            refs,
            owners,
            crc: d.crc,
            fp: 0,
        };
        t.shared.insert_record(offset, s);
    } else {
        t.shared.remove_record(offset);
    }
    let (was, is) = (refs_s + owners_s > 0, refs + owners > 0);
    count_liveness(offset, d, was, is, t)
}

/// A replayed record was live (`was`) and is (`is`): its bytes follow.
fn count_liveness(
    offset: u64,
    d: &Touched,
    was: bool,
    is: bool,
    t: &mut Tables<'_>,
) -> Result<(), MetaError> {
    let bad = |what: &str| disagree(offset, what);
    let s = t.geometry.segment_of(offset);
    let codec = d.codec.expect("set with the first entry");
    let payload = u64::from(d.len) - RECORD_HEADER_BYTES as u64;
    t.books.touch(s);
    if was && !is {
        if t.segs.usage.live_bytes(s) < u64::from(d.len) {
            return bad("its segment holds fewer live bytes");
        }
        t.segs.usage.sub_live(s, u64::from(d.len));
        t.counters.record_died(codec, payload);
    } else if is && !was {
        if t.segs.usage.live_bytes(s) + u64::from(d.len) > t.geometry.segment_size_bytes {
            return bad("its segment would hold more live bytes than it has");
        }
        t.segs.usage.add_live(s, u64::from(d.len));
        t.counters.record_born(codec, payload);
        if t.segs.table.state(s) == SegState::Free {
            t.segs.table.mark(s, SegState::Sealed, 0);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (e2e kill9, about one run in eight): a flush freed a
    /// segment whose unit, live at the snapshot, had died, and a unit of
    /// the same length appended after its reuse sat at the same offset.
    /// Keyed by offset alone, roll-forward's accounting took the two for
    /// one record (counting the first's window for both: the second's
    /// bytes were never counted live).
    #[test]
    fn regression_a_reused_offset_names_two_records() {
        let (o, len) = (5u64 << 20, 300u32);
        let (crc_x, crc_y) = (0xAAAA_0000u32, 0xBBBB_0000u32);
        for y_first in [4u64, 16] {
            // y_first 4: the second unit in the first's window; 16: in the next.
            let mut map = BlockMap::new(1024);
            for k in 0..4u64 {
                map.set(k, MapEntry::unit(CodecTag::Lz4, o, len, crc_x, k as u32));
            }
            let before = map.resident(0).expect("page 0").clone();
            for k in 0..4u64 {
                let single = MapEntry::data(CodecTag::Lz4, (6 << 20) + k * 400, 300, k as u32 + 1);
                map.set(k, single);
                let y = MapEntry::unit(CodecTag::Lz4, o, len, crc_y, k as u32);
                map.set(y_first + k, y);
            }
            let originals = vec![(0usize, before)];
            let mut counters = MapCounters {
                data_blocks: 100,
                codec_blocks: [0, 100, 0],
                ..MapCounters::default()
            };
            let recs = changed_records(&map, &originals, &mut counters).unwrap();
            let x = &recs[&(o, unit_identity(crc_x), true)];
            let y = &recs[&(o, unit_identity(crc_y), true)];
            assert!(
                !x.fresh && y.fresh,
                "the record at the snapshot is not fresh"
            );
            assert_eq!(
                (x.owners_a, x.owners_b, y.owners_a, y.owners_b),
                (4, 0, 0, 4)
            );
            let changed = Changed {
                map: &map,
                dirty: map.dirty_indexes().into_iter().collect(),
                before: originals.into_iter().collect(),
            };
            let count = |d: &Touched| {
                let home = d.home.expect("an owner changed");
                changed
                    .window_owners(home, o, unit_identity(d.crc))
                    .unwrap()
            };
            assert_eq!(count(x), (4, 0), "the first died");
            assert_eq!(count(y), (0, 4), "the second was born");
        }
    }
}
