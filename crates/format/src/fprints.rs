//! Persisted fingerprints (volumes with `FLAG_FP_TABLES`): the dedup index
//! is memory only, and after open it is refilled from these instead of by
//! reading and hashing every stored block.
//!
//! Each segment is cut into *parts* of `FP_PART_BYTES` of the segment (a
//! 4 MiB segment has 8); part `k` of segment `s` has at most one
//! fingerprint table, a MAP_TABLE record (lz4, as every table) named in
//! the map directory at table index
//! `table_count(segments) + s * fp_parts(segment size) + k`, after the
//! liveness tables (`tables`). Its payload:
//! ```text
//! 8  segment s
//! 4  part k
//! 4  row count r (at most FP_TABLE_MAX_ROWS)
//! r rows of FP_ROW_BYTES, in the order their records were appended:
//!    8  the upper 64 bits of the block's xxh3-128 fingerprint (never 0;
//!       the dedup index keys on them: every match is verified byte for
//!       byte, so 64 bits only bound the wasted verifications)
//!    8  the block's map entry `loc` when it was written (a DATA, unit or
//!       owner-form entry of a record whose header starts in part k)
//!    4  the entry's crc
//!    4  the LBA the record's header names for the block (the owner)
//! ```
//! Rows are *hints*, like the index slots they refill: a row may name a
//! record that died since (it is not removed), and one part may have
//! more blocks than rows (the first `FP_TABLE_MAX_ROWS` are kept). A row
//! is used only after the index's own check that its record is live.
use crate::*;

/// Bytes of a segment one fingerprint table covers.
pub const FP_PART_BYTES: u64 = 512 << 10;
/// Header of a fingerprint table payload.
pub const FP_HEADER_BYTES: usize = 16;
/// Bytes of one row.
pub const FP_ROW_BYTES: usize = 24;
/// Most rows one table holds: its lz4 record stays below `RECORD_MAX_BYTES`
/// (124 KiB raw).
pub const FP_TABLE_MAX_ROWS: usize = 5290;
const _: () = assert!(
    FP_HEADER_BYTES + FP_TABLE_MAX_ROWS * FP_ROW_BYTES + 1024
        < record::RECORD_MAX_BYTES - record::RECORD_HEADER_BYTES
);

/// Fingerprint tables per segment of `segment_size` bytes.
pub const fn fp_parts(segment_size: u64) -> u64 {
    let n = segment_size / FP_PART_BYTES;
    if n == 0 {
        1
    } else {
        n
    }
}

/// Table index of part `part` of segment `segment`'s fingerprint table.
pub const fn fp_table_index(segments: u64, segment_size: u64, segment: u64, part: u64) -> u64 {
    tables::table_count(segments) + segment * fp_parts(segment_size) + part
}

/// Every table index of a volume: liveness tables, then fingerprint tables.
pub const fn directory_tables(segments: u64, segment_size: u64) -> u64 {
    tables::table_count(segments) + segments * fp_parts(segment_size)
}

/// One row: a block's fingerprint (its upper 64 bits) and where it was
/// written (24 bytes in memory too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FpRow {
    pub fp: u64,
    pub loc: u64,
    pub crc: u32,
    pub owner: u32,
}

impl FpRow {
    /// The map entry the block got.
    pub fn entry(&self) -> MapEntry {
        MapEntry {
            loc: self.loc,
            crc: self.crc,
        }
    }
}

/// A fingerprint table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FpTable {
    pub segment: u64,
    pub part: u32,
    pub rows: Vec<FpRow>,
}

impl FpTable {
    /// The payload of part `part` of `segment` with `rows` (the first
    /// `FP_TABLE_MAX_ROWS` of them).
    pub fn encode_rows(segment: u64, part: u32, rows: &[FpRow]) -> Vec<u8> {
        let rows = &rows[..rows.len().min(FP_TABLE_MAX_ROWS)];
        let mut v = vec![0u8; FP_HEADER_BYTES + rows.len() * FP_ROW_BYTES];
        put_u64(&mut v, 0, segment);
        put_u32(&mut v, 8, part);
        put_u32(&mut v, 12, rows.len() as u32);
        for (i, r) in rows.iter().enumerate() {
            let at = FP_HEADER_BYTES + i * FP_ROW_BYTES;
            put_u64(&mut v, at, r.fp);
            put_u64(&mut v, at + 8, r.loc);
            put_u32(&mut v, at + 16, r.crc);
            put_u32(&mut v, at + 20, r.owner);
        }
        v
    }

    pub fn encode(&self) -> Vec<u8> {
        FpTable::encode_rows(self.segment, self.part, &self.rows)
    }

    /// Decodes the table of part `part` of `segment`; every row must be a
    /// non-zero fingerprint of a data entry (which the caller checks
    /// against the volume's geometry).
    pub fn decode(b: &[u8], segment: u64, part: u32) -> Result<FpTable, FormatError> {
        if b.len() < FP_HEADER_BYTES {
            return Err(FormatError::Invalid("fingerprint table length"));
        }
        if get_u64(b, 0) != segment || get_u32(b, 8) != part {
            return Err(FormatError::Invalid("fingerprint table of another part"));
        }
        let n = get_u32(b, 12) as usize;
        if n > FP_TABLE_MAX_ROWS || b.len() != FP_HEADER_BYTES + n * FP_ROW_BYTES {
            return Err(FormatError::Invalid("fingerprint table row count"));
        }
        let mut rows = Vec::with_capacity(n);
        for i in 0..n {
            let at = FP_HEADER_BYTES + i * FP_ROW_BYTES;
            let row = FpRow {
                fp: get_u64(b, at),
                loc: get_u64(b, at + 8),
                crc: get_u32(b, at + 16),
                owner: get_u32(b, at + 20),
            };
            if row.fp == 0 || !matches!(row.entry().state(), Ok(EntryState::Data { .. })) {
                return Err(FormatError::Invalid("fingerprint table row"));
            }
            rows.push(row);
        }
        Ok(FpTable {
            segment,
            part,
            rows,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(i: u64) -> FpRow {
        let e = MapEntry::data(CodecTag::Lz4, (1 << 20) + i * 100, 90, i as u32);
        FpRow {
            fp: (i + 1) << 7 | 5,
            loc: e.loc,
            crc: e.crc,
            owner: i as u32 * 3,
        }
    }

    #[test]
    fn a_table_round_trips_and_keeps_its_first_rows() {
        let rows: Vec<FpRow> = (0..10).map(row).collect();
        let t = FpTable {
            segment: 7,
            part: 3,
            rows: rows.clone(),
        };
        assert_eq!(FpTable::decode(&t.encode(), 7, 3).unwrap(), t);
        assert!(FpTable::decode(&t.encode(), 7, 2).is_err());
        assert!(FpTable::decode(&t.encode(), 6, 3).is_err());
        let many: Vec<FpRow> = (0..FP_TABLE_MAX_ROWS as u64 + 5).map(row).collect();
        let back = FpTable::decode(&FpTable::encode_rows(1, 0, &many), 1, 0).unwrap();
        assert_eq!(back.rows, many[..FP_TABLE_MAX_ROWS]);
    }

    #[test]
    fn a_row_of_no_data_or_a_zero_fingerprint_is_refused() {
        let mut bad = row(1);
        bad.fp = 0;
        assert!(FpTable::decode(&FpTable::encode_rows(0, 0, &[bad]), 0, 0).is_err());
        let mut bad = row(1);
        bad.loc = MapEntry::ZERO.loc;
        assert!(FpTable::decode(&FpTable::encode_rows(0, 0, &[bad]), 0, 0).is_err());
        let mut b = FpTable::encode_rows(0, 0, &[row(1)]);
        b.pop();
        assert!(FpTable::decode(&b, 0, 0).is_err());
    }

    #[test]
    fn table_indexes_follow_the_liveness_tables() {
        let seg = 4 << 20;
        assert_eq!(fp_parts(seg), 8);
        assert_eq!(fp_parts(1 << 20), 2);
        assert_eq!(fp_table_index(10, seg, 0, 0), tables::table_count(10));
        assert_eq!(fp_table_index(10, seg, 9, 7) + 1, directory_tables(10, seg));
    }
}
