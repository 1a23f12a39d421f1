//! Persisted liveness tables (volumes with `FLAG_SEG_TABLES`): what open
//! would otherwise rebuild by reading the whole map, saved with each
//! checkpoint so that open costs the log since it, not the map.
//!
//! Each table record is a MAP_TABLE record (before lz4, which every one
//! uses), named in the map directory like a map page: table `t` is
//! directory slot `map pages + t` (see `checkpoint`), and it is rewritten
//! only when it changed since its last record. Table 0 is the *root*:
//! ```text
//! 8  version (1)
//! 8  segments per group (TABLE_SEGMENTS)
//! 8  segment count of the volume
//! 8 * COUNTER_WORDS  the map's counters at the snapshot: data, zero and
//!    lost blocks, blocks by codec (none, lz4, zstd), stored payload bytes,
//!    stored payload bytes by codec (none, lz4, zstd)
//! ```
//! Table `1 + g` is *group* g, segments [g * TABLE_SEGMENTS, ...):
//! ```text
//! 8  group index g
//! 4  segment count n in the group (the last group may be short)
//! 4  row count r
//! 8 * n  live bytes of the *data* records of each segment (map records
//!        are counted from the directory)
//! r * 24 rows: the records of the group's segments that the shared table
//!        holds (records with dedup references, and live units), by offset:
//!   8  record offset
//!   4  refs (ref entries)
//!   4  owners (owner entries)
//!   4  crc (0 for a unit)
//!   4  flags (bit 0: a unit)
//! ```
//! A group without live data records has no record, and no group payload
//! is larger than `TABLE_PAYLOAD_MAX_BYTES`: a group that would be (tiny
//! shared records by the thousand) is not written, and neither is the
//! root, until it fits again. All describe the map at the checkpoint's
//! snapshot seq, as its pages do; a directory without a root names no
//! usable tables (open rebuilds them from the map).
use crate::*;

/// Physical segments per group table.
pub const TABLE_SEGMENTS: u64 = 1;
/// Largest group payload written (before lz4): 2729 rows.
pub const TABLE_PAYLOAD_MAX_BYTES: usize = 64 << 10;
/// Words of map counters in the root.
pub const COUNTER_WORDS: usize = 10;
const ROOT_VERSION: u64 = 1;
const ROOT_OFF_VERSION: usize = 0;
const ROOT_OFF_GROUP_SEGMENTS: usize = ROOT_OFF_VERSION + 8;
const ROOT_OFF_SEGMENTS: usize = ROOT_OFF_GROUP_SEGMENTS + 8;
const ROOT_OFF_COUNTERS: usize = ROOT_OFF_SEGMENTS + 8;
pub const ROOT_BYTES: usize = ROOT_OFF_COUNTERS + 8 * COUNTER_WORDS;

const GROUP_OFF_INDEX: usize = 0;
const GROUP_OFF_SEGMENTS: usize = GROUP_OFF_INDEX + 8;
const GROUP_OFF_ROWS: usize = GROUP_OFF_SEGMENTS + 4;
pub const GROUP_HEADER_BYTES: usize = GROUP_OFF_ROWS + 4;
const ROW_OFF_OFFSET: usize = 0;
const ROW_OFF_REFS: usize = ROW_OFF_OFFSET + 8;
const ROW_OFF_OWNERS: usize = ROW_OFF_REFS + 4;
const ROW_OFF_CRC: usize = ROW_OFF_OWNERS + 4;
const ROW_OFF_FLAGS: usize = ROW_OFF_CRC + 4;
pub const ROW_BYTES: usize = ROW_OFF_FLAGS + 4;
const ROW_FLAG_UNIT: u32 = 1;

/// Tables of a volume of `segments` segments: the root and one per group.
pub const fn table_count(segments: u64) -> u64 {
    1 + segments.div_ceil(TABLE_SEGMENTS)
}

/// The root table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableRoot {
    pub segments: u64,
    pub counters: [u64; COUNTER_WORDS],
}

impl TableRoot {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![0u8; ROOT_BYTES];
        put_u64(&mut v, ROOT_OFF_VERSION, ROOT_VERSION);
        put_u64(&mut v, ROOT_OFF_GROUP_SEGMENTS, TABLE_SEGMENTS);
        put_u64(&mut v, ROOT_OFF_SEGMENTS, self.segments);
        for (i, c) in self.counters.iter().enumerate() {
            put_u64(&mut v, ROOT_OFF_COUNTERS + 8 * i, *c);
        }
        v
    }

    /// Decodes the root of a volume of `segments` segments.
    pub fn decode(b: &[u8], segments: u64) -> Result<TableRoot, FormatError> {
        if b.len() != ROOT_BYTES {
            return Err(FormatError::Invalid("table root length"));
        }
        if get_u64(b, ROOT_OFF_VERSION) != ROOT_VERSION
            || get_u64(b, ROOT_OFF_GROUP_SEGMENTS) != TABLE_SEGMENTS
            || get_u64(b, ROOT_OFF_SEGMENTS) != segments
        {
            return Err(FormatError::Invalid("table root of another layout"));
        }
        let mut counters = [0u64; COUNTER_WORDS];
        for (i, c) in counters.iter_mut().enumerate() {
            *c = get_u64(b, ROOT_OFF_COUNTERS + 8 * i);
        }
        Ok(TableRoot { segments, counters })
    }
}

/// One shared-table row of a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableRow {
    pub offset: u64,
    pub refs: u32,
    pub owners: u32,
    pub crc: u32,
    pub unit: bool,
}

/// A group table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableGroup {
    pub group: u64,
    /// Live bytes of data records, per segment of the group.
    pub live: Vec<u64>,
    /// Rows in increasing offset order.
    pub rows: Vec<TableRow>,
}

impl TableGroup {
    /// Payload bytes of a group of `segments` segments and `rows` rows.
    pub const fn bytes(segments: usize, rows: usize) -> usize {
        GROUP_HEADER_BYTES + 8 * segments + ROW_BYTES * rows
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![0u8; TableGroup::bytes(self.live.len(), self.rows.len())];
        put_u64(&mut v, GROUP_OFF_INDEX, self.group);
        put_u32(&mut v, GROUP_OFF_SEGMENTS, self.live.len() as u32);
        put_u32(&mut v, GROUP_OFF_ROWS, self.rows.len() as u32);
        for (i, l) in self.live.iter().enumerate() {
            put_u64(&mut v, GROUP_HEADER_BYTES + 8 * i, *l);
        }
        let rows_at = GROUP_HEADER_BYTES + 8 * self.live.len();
        for (i, r) in self.rows.iter().enumerate() {
            let at = rows_at + i * ROW_BYTES;
            put_u64(&mut v, at + ROW_OFF_OFFSET, r.offset);
            put_u32(&mut v, at + ROW_OFF_REFS, r.refs);
            put_u32(&mut v, at + ROW_OFF_OWNERS, r.owners);
            put_u32(&mut v, at + ROW_OFF_CRC, r.crc);
            put_u32(
                &mut v,
                at + ROW_OFF_FLAGS,
                u32::from(r.unit) * ROW_FLAG_UNIT,
            );
        }
        v
    }

    /// Decodes group `group` of a volume of `segments` segments: its
    /// segment count must be the group's, its rows in increasing offset
    /// order (their segments are checked by the caller, who knows where
    /// segments lie).
    pub fn decode(b: &[u8], group: u64, segments: u64) -> Result<TableGroup, FormatError> {
        if b.len() < GROUP_HEADER_BYTES || get_u64(b, GROUP_OFF_INDEX) != group {
            return Err(FormatError::Invalid("group table of another group"));
        }
        let first = group.saturating_mul(TABLE_SEGMENTS);
        let expect = segments.saturating_sub(first).min(TABLE_SEGMENTS) as usize;
        let n = get_u32(b, GROUP_OFF_SEGMENTS) as usize;
        let r = get_u32(b, GROUP_OFF_ROWS) as usize;
        if n != expect || expect == 0 || b.len() != TableGroup::bytes(n, r) {
            return Err(FormatError::Invalid("group table length"));
        }
        let live = (0..n)
            .map(|i| get_u64(b, GROUP_HEADER_BYTES + 8 * i))
            .collect();
        let rows_at = GROUP_HEADER_BYTES + 8 * n;
        let mut rows: Vec<TableRow> = Vec::with_capacity(r);
        for e in b[rows_at..].chunks_exact(ROW_BYTES) {
            let flags = get_u32(e, ROW_OFF_FLAGS);
            let row = TableRow {
                offset: get_u64(e, ROW_OFF_OFFSET),
                refs: get_u32(e, ROW_OFF_REFS),
                owners: get_u32(e, ROW_OFF_OWNERS),
                crc: get_u32(e, ROW_OFF_CRC),
                unit: flags & ROW_FLAG_UNIT != 0,
            };
            if flags & !ROW_FLAG_UNIT != 0 || rows.last().is_some_and(|l| l.offset >= row.offset) {
                return Err(FormatError::Invalid("group table row"));
            }
            rows.push(row);
        }
        Ok(TableGroup { group, live, rows })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_round_trips_and_refuses_another_layout() {
        let r = TableRoot {
            segments: 1000,
            counters: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        };
        let b = r.encode();
        assert_eq!(TableRoot::decode(&b, 1000).unwrap(), r);
        assert!(TableRoot::decode(&b, 999).is_err());
        assert!(TableRoot::decode(&b[1..], 1000).is_err());
        let mut v = b.clone();
        v[0] = 2;
        assert!(TableRoot::decode(&v, 1000).is_err());
    }

    #[test]
    fn group_round_trips_and_refuses_bad_shapes() {
        let row = |offset, unit| TableRow {
            offset,
            refs: 3,
            owners: 1,
            crc: 7,
            unit,
        };
        let g = TableGroup {
            group: 1,
            live: vec![5; 1],
            rows: vec![row(10, false), row(20, true)],
        };
        let b = g.encode();
        assert_eq!(TableGroup::decode(&b, 1, 300).unwrap(), g);
        assert!(TableGroup::decode(&b, 0, 300).is_err(), "another group");
        assert!(TableGroup::decode(&b, 1, 1).is_err(), "beyond the volume");
        assert!(TableGroup::decode(&b[..b.len() - 1], 1, 300).is_err());
        let swapped = TableGroup {
            rows: vec![row(20, false), row(10, true)],
            ..g.clone()
        };
        assert!(TableGroup::decode(&swapped.encode(), 1, 300).is_err());
        let mut flags = b.clone();
        flags[GROUP_HEADER_BYTES + 8 + ROW_OFF_FLAGS] = 2;
        assert!(TableGroup::decode(&flags, 1, 300).is_err());
    }
}
