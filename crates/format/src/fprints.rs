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
//! r rows, in the order their records were appended, each:
//!    8      the upper 64 bits of the block's xxh3-128 fingerprint (never
//!           0; the dedup index keys on them: every match is verified byte
//!           for byte, so 64 bits only bound the wasted verifications)
//!   varint  zigzag(offset - the row before's offset; the first row's: 0)
//!           where offset is the record's (bits 0..43 of the block's map
//!           entry `loc` when it was written: a DATA, unit or owner-form
//!           entry of a record whose header starts in part k)
//!   varint  the rest of that `loc` (bits 43..64: length and state)
//!    4      the entry's crc
//!   varint  zigzag(owner - the row before's owner; the first: 0), owner
//!           being the LBA the record's header names for the block
//! Varints are LEB128 as in `tables`; zigzag maps 0, -1, 1, -2 ... to
//! 0, 1, 2, 3 ...; every byte of the payload is used. A row of records
//! written one after the other takes about 18 bytes.
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
/// Bytes of one row in memory (`FpRow`).
pub const FP_ROW_BYTES: usize = 24;
/// At least the most bytes one row takes in a table: fingerprint 8, offset
/// difference 7 (44 bits zigzagged), length and state 3, crc 4, owner
/// difference 5 (27); the encoder starts a row only with this much room.
pub const FP_ROW_MAX_BYTES: usize = 32;
/// Most rows a part keeps.
pub const FP_TABLE_MAX_ROWS: usize = 7000;
/// Largest payload (before lz4): rows that would go beyond it are left out
/// (the first ones are kept), so the record stays below `RECORD_MAX_BYTES`.
pub const FP_PAYLOAD_MAX_BYTES: usize = 124 << 10;
const _: () = assert!(
    FP_PAYLOAD_MAX_BYTES + FP_PAYLOAD_MAX_BYTES / 255 + 64
        < record::RECORD_MAX_BYTES - record::RECORD_HEADER_BYTES
);
const LOC_OFFSET_BITS: u32 = 43;

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    (v >> 1) as i64 ^ -((v & 1) as i64)
}

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

/// Every table index of a volume: liveness tables, fingerprint tables,
/// then the hook snapshot's root and chunks (`hooks`).
pub const fn directory_tables(segments: u64, segment_size: u64) -> u64 {
    hooks::hook_root_table(segments, segment_size) + 1 + hooks::HOOK_CHUNKS_MAX
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
        let mut v = vec![0u8; FP_HEADER_BYTES];
        put_u64(&mut v, 0, segment);
        put_u32(&mut v, 8, part);
        let (mut n, mut prev_offset, mut prev_owner) = (0u32, 0u64, 0u32);
        for r in rows.iter().take(FP_TABLE_MAX_ROWS) {
            if v.len() + FP_ROW_MAX_BYTES > FP_PAYLOAD_MAX_BYTES {
                break; // the first rows are kept: hints
            }
            let offset = r.loc & ((1 << LOC_OFFSET_BITS) - 1);
            v.extend_from_slice(&r.fp.to_le_bytes());
            tables::put_varint(&mut v, zigzag(offset.wrapping_sub(prev_offset) as i64));
            tables::put_varint(&mut v, r.loc >> LOC_OFFSET_BITS);
            v.extend_from_slice(&r.crc.to_le_bytes());
            let d = i64::from(r.owner) - i64::from(prev_owner);
            tables::put_varint(&mut v, zigzag(d));
            (prev_offset, prev_owner) = (offset, r.owner);
            n += 1;
        }
        put_u32(&mut v, 12, n);
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
        if n > FP_TABLE_MAX_ROWS || b.len() > FP_PAYLOAD_MAX_BYTES {
            return Err(FormatError::Invalid("fingerprint table row count"));
        }
        let bad = FormatError::Invalid("fingerprint table row");
        let mut rows = Vec::with_capacity(n);
        let (mut at, mut prev_offset, mut prev_owner) = (FP_HEADER_BYTES, 0u64, 0u32);
        for _ in 0..n {
            if at + FP_ROW_MAX_BYTES > FP_PAYLOAD_MAX_BYTES {
                return Err(bad); // the encoder would have stopped before it
            }
            let fp = get_u64(b.get(..at + 8).ok_or(bad.clone())?, at);
            at += 8;
            let offset =
                i128::from(prev_offset) + i128::from(unzigzag(tables::get_varint(b, &mut at)?));
            let high = tables::get_varint(b, &mut at)?;
            let crc = get_u32(b.get(..at + 4).ok_or(bad.clone())?, at);
            at += 4;
            let owner = i64::from(prev_owner) + unzigzag(tables::get_varint(b, &mut at)?);
            let (Ok(offset), Ok(owner)) = (u64::try_from(offset), u32::try_from(owner)) else {
                return Err(bad);
            };
            if offset >> LOC_OFFSET_BITS != 0 || high >> (64 - LOC_OFFSET_BITS) != 0 {
                return Err(bad);
            }
            let row = FpRow {
                fp,
                loc: high << LOC_OFFSET_BITS | offset,
                crc,
                owner,
            };
            if row.fp == 0 || !matches!(row.entry().state(), Ok(EntryState::Data { .. })) {
                return Err(bad);
            }
            rows.push(row);
            (prev_offset, prev_owner) = (offset, owner);
        }
        if at != b.len() {
            return Err(FormatError::Invalid("fingerprint table length"));
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
    fn rows_are_varints_of_differences_and_stop_at_the_payload_cap() {
        // Offsets and owners that go down as well as up round-trip.
        let rows: Vec<FpRow> = [
            (900u64, 50u32),
            (100, 7),
            (100, 8),
            ((1 << 43) - 1, u32::MAX),
        ]
        .iter()
        .map(|&(off, owner)| {
            let e = MapEntry::data(CodecTag::Zstd, off, (1 << 17) - 1, 3);
            FpRow {
                fp: u64::MAX,
                loc: e.loc,
                crc: 3,
                owner,
            }
        })
        .collect();
        let b = FpTable::encode_rows(2, 1, &rows);
        assert_eq!(FpTable::decode(&b, 2, 1).unwrap().rows, rows);
        // Records 100 bytes apart, owners 3 apart: 18 bytes a row.
        let seq: Vec<FpRow> = (0..1000).map(row).collect();
        let b = FpTable::encode_rows(0, 0, &seq);
        assert_eq!(b.len(), FP_HEADER_BYTES + 1000 * 18 + 2); // the first offset whole
                                                              // Rows that would pass the cap are left out, and a payload holding
                                                              // them is refused (the encoder never writes one).
        let wide: Vec<FpRow> = (0..FP_TABLE_MAX_ROWS as u64)
            .map(|i| FpRow {
                owner: (i as u32).wrapping_mul(2_654_435_761),
                ..row(i * 5000)
            })
            .collect();
        let b = FpTable::encode_rows(0, 0, &wide);
        let kept = FpTable::decode(&b, 0, 0).unwrap().rows.len();
        assert!(kept < wide.len() && b.len() <= FP_PAYLOAD_MAX_BYTES);
        assert_eq!(FpTable::decode(&b, 0, 0).unwrap().rows, wide[..kept]);
    }

    #[test]
    fn table_indexes_follow_the_liveness_tables() {
        let seg = 4 << 20;
        assert_eq!(fp_parts(seg), 8);
        assert_eq!(fp_parts(1 << 20), 2);
        assert_eq!(fp_table_index(10, seg, 0, 0), tables::table_count(10));
        assert_eq!(
            fp_table_index(10, seg, 9, 7) + 1,
            hooks::hook_root_table(10, seg)
        );
        assert_eq!(
            directory_tables(10, seg),
            hooks::hook_root_table(10, seg) + 1 + hooks::HOOK_CHUNKS_MAX
        );
    }
}
