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
use super::{Geometry, LiveMap, RebuiltSegments};
use crate::dedup::{Shared, SharedTable, UnitLive};
use crate::map::BlockMap;
use crate::segments::{SegState, SegmentTable, SegmentUsage};
use crate::stats::MapCounters;
use cvol_format::checkpoint::PageRef;
use cvol_format::tables::{
    table_count, TableGroup, TableRoot, TableRow, COUNTER_WORDS, TABLE_PAYLOAD_MAX_BYTES,
    TABLE_SEGMENTS,
};
use cvol_format::Superblock;
use std::collections::HashMap;

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

    /// Something of segment `s` changed.
    pub(crate) fn touch(&mut self, s: u64) {
        self.stamp += 1;
        self.dirty[(s / TABLE_SEGMENTS) as usize] = self.stamp;
    }

    pub(crate) fn meta_born(&mut self, s: u64, len: u32) {
        self.meta_live[s as usize] += u64::from(len);
    }

    pub(crate) fn meta_died(&mut self, s: u64, len: u32) {
        let l = &mut self.meta_live[s as usize];
        *l = l
            .checked_sub(u64::from(len))
            .expect("map record bytes of a segment underflow");
    }
}

/// The tables a checkpoint writes, taken with its snapshot.
#[derive(Default)]
pub(crate) struct TableSnapshot {
    /// The root's payload; None when a changed group was too large to
    /// write (the checkpoint then names no root: open rebuilds).
    pub(crate) root: Option<Vec<u8>>,
    /// (table, stamp, payload) of every changed group with records.
    pub(crate) groups: Vec<(usize, u64, Vec<u8>)>,
}

/// The tables a checkpoint names, read at open.
#[derive(Debug, Clone)]
pub struct LoadedTables {
    pub root: TableRoot,
    pub groups: Vec<TableGroup>,
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
    /// The table of group `g` as it is now.
    fn group_table(&self, g: u64) -> TableGroup {
        let first = g * TABLE_SEGMENTS;
        let end = (first + TABLE_SEGMENTS).min(self.usage.count());
        let live = (first..end)
            .map(|s| self.usage.live_bytes(s) - self.books.meta_live[s as usize])
            .collect();
        let lo = self.geometry.data_offset_bytes + first * self.geometry.segment_size_bytes;
        let hi = self.geometry.data_offset_bytes + end * self.geometry.segment_size_bytes;
        let records = self
            .shared
            .records
            .range(lo..hi)
            .map(|(&offset, s)| TableRow {
                offset,
                refs: s.refs,
                owners: s.owners,
                crc: s.crc,
                unit: false,
            });
        let units = self
            .shared
            .units
            .range(lo..hi)
            .map(|(&offset, u)| TableRow {
                offset,
                refs: u.refs,
                owners: u32::from(u.owners),
                crc: 0,
                unit: true,
            });
        let mut rows: Vec<TableRow> = records.chain(units).collect();
        rows.sort_unstable_by_key(|r| r.offset);
        TableGroup {
            group: g,
            live,
            rows,
        }
    }

    /// The tables that changed, for a checkpoint, taken with its snapshot
    /// (under the state lock): empty groups lose their record at once.
    pub(crate) fn table_snapshot(&mut self) -> TableSnapshot {
        let mut snap = TableSnapshot::default();
        if self.map.tables() == 0 {
            return snap;
        }
        let mut complete = true;
        for g in 0..self.books.dirty.len() {
            let stamp = self.books.dirty[g];
            if stamp == 0 {
                continue;
            }
            let table = self.group_table(g as u64);
            if table.rows.is_empty() && table.live.iter().all(|&l| l == 0) {
                self.map.set_table_ref(1 + g, None);
                self.books.dirty[g] = 0;
                continue;
            }
            let raw = table.encode();
            if raw.len() > TABLE_PAYLOAD_MAX_BYTES {
                // Not written (its old record, stale, is named no more)
                // and no root either: open rebuilds until it fits again.
                self.map.set_table_ref(1 + g, None);
                complete = false;
                continue;
            }
            snap.groups.push((1 + g, stamp, raw));
        }
        // An empty map needs no tables (open rebuilds them for nothing):
        // a new volume's first records are not held live by a root.
        if complete && self.map.allocated_pages() > 0 {
            let root = TableRoot {
                segments: self.usage.count(),
                counters: counter_words(&self.counters),
            };
            snap.root = Some(root.encode());
        } else {
            self.map.set_table_ref(0, None);
        }
        snap
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
            self.books.stamp += 1;
            self.books.dirty[g] = self.books.stamp;
        }
    }

    /// The map and its tables as a checkpoint persisted them, with the
    /// records the map names counted live: what open takes when no map
    /// change was replayed since. Err (with the map back) if the tables do
    /// not fit the volume: open then rebuilds them.
    pub(crate) fn from_tables(
        sb: &Superblock,
        map: BlockMap,
        t: LoadedTables,
        needed: &HashMap<u64, u64>,
        open: Option<(u64, u64)>,
    ) -> Result<(LiveMap, SegmentTable), Box<(BlockMap, String)>> {
        let geometry = Geometry::of(sb);
        let segments = sb.segment_count();
        let mut segs = RebuiltSegments {
            table: SegmentTable::new(segments, sb.segment_size_bytes),
            usage: SegmentUsage::new(segments, sb.segment_size_bytes),
        };
        let mut rows = Rows::default();
        let mut books = TableBooks::new(segments, false);
        let loaded = (map.tables() as u64 == table_count(segments))
            .then_some(())
            .ok_or_else(|| "the map has no table slots".to_string())
            .and_then(|()| {
                for g in &t.groups {
                    load_group(sb, geometry, g, &mut segs, &mut rows)?;
                }
                count_map_records(&map, geometry, &mut segs, &mut books)
            });
        if let Err(e) = loaded {
            return Err(Box::new((map, e)));
        }
        let mut shared = SharedTable {
            records: rows.records.into_iter().collect(),
            units: rows.units.into_iter().collect(),
            extra_refs: 0,
        };
        shared.extra_refs = shared.records.values().map(Shared::extra).sum::<u64>()
            + shared
                .units
                .values()
                .map(|u| u64::from(u.refs))
                .sum::<u64>();
        mark_segments(&mut segs.table, needed, open);
        let live = LiveMap {
            map,
            counters: counters_of(&t.root.counters),
            shared,
            usage: segs.usage,
            geometry,
            changes: 0,
            books,
            loaded_tables: true,
        };
        Ok((live, segs.table))
    }
}

/// The shared table's rows as read, in offset order (groups are read in
/// order, rows within one sorted): a B-tree is built from them in bulk.
#[derive(Default)]
struct Rows {
    records: Vec<(u64, Shared)>,
    units: Vec<(u64, UnitLive)>,
}

/// Adds group `g`'s live bytes and rows, checked against the volume.
fn load_group(
    sb: &Superblock,
    geometry: Geometry,
    g: &TableGroup,
    segs: &mut RebuiltSegments,
    shared: &mut Rows,
) -> Result<(), String> {
    let first = g.group * TABLE_SEGMENTS;
    for (i, &live) in g.live.iter().enumerate() {
        let s = first + i as u64;
        if live > sb.segment_size_bytes {
            return Err(format!("table: segment {s} with {live} live bytes"));
        }
        if live > 0 {
            segs.usage.add_live(s, live);
            segs.table.mark(s, SegState::Sealed, 0);
        }
    }
    let end = first + g.live.len() as u64;
    for r in &g.rows {
        let s = r
            .offset
            .checked_sub(geometry.data_offset_bytes)
            .map(|rel| rel / geometry.segment_size_bytes);
        if !s.is_some_and(|s| (first..end).contains(&s))
            || segs.usage.live_bytes(s.unwrap_or(0)) == 0
        {
            return Err(format!(
                "table: a row at {} outside its group's live segments",
                r.offset
            ));
        }
        if r.unit {
            let owners = u16::try_from(r.owners).map_err(|_| "table: unit owners")?;
            if r.refs == 0 && owners == 0 {
                return Err("table: a unit without entries".into());
            }
            shared.units.push((
                r.offset,
                UnitLive {
                    refs: r.refs,
                    owners,
                },
            ));
        } else {
            if r.refs == 0 || r.owners > 1 {
                return Err("table: a shared record without refs".into());
            }
            let row = Shared {
                refs: r.refs,
                owners: r.owners,
                crc: r.crc,
                fp: 0,
            };
            shared.records.push((r.offset, row));
        }
    }
    Ok(())
}

/// Counts the records the map names, and those it retired, live (they
/// are the map's own: `books.meta_live`).
pub(super) fn count_map_records(
    map: &BlockMap,
    geometry: Geometry,
    segs: &mut RebuiltSegments,
    books: &mut TableBooks,
) -> Result<(), String> {
    let mut records: Vec<(u64, u32)> = map.retired().iter().map(|r| (r.offset, r.len)).collect();
    map.for_each_record(|offset, len| records.push((offset, len)));
    for (offset, len) in records {
        let s = geometry.segment_of(offset);
        if segs.usage.live_bytes(s) + u64::from(len) > geometry.segment_size_bytes {
            return Err(format!(
                "segment {s} would hold more live bytes than it has"
            ));
        }
        if segs.table.state(s) == SegState::Free {
            segs.table.mark(s, SegState::Sealed, 0);
        }
        segs.usage.add_live(s, u64::from(len));
        books.meta_born(s, len);
    }
    Ok(())
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
