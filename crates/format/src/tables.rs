//! Persisted liveness tables (volumes with `FLAG_SEG_TABLES`): what open
//! would otherwise rebuild by reading the whole map, saved with each
//! checkpoint so that open costs the log since it, not the map.
//!
//! Each table record is a MAP_TABLE record, named in the map directory
//! like a map page (written with codec none: the root as it is, a group
//! *head-first*, its head as below through the row counts, then its rows
//! as `u32 length` + their lz4 block, `GroupHead::decode_head_first`; with
//! codec lz4, as older volumes have them, the whole payload below lz4
//! with its length prepended): table `t` is
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
//! 4  segment count n in the group (the last group may be short), with
//!    bit 31 set when the counts below follow (`GROUP_COUNTS_FLAG`; groups
//!    written before it have no counts)
//! 4  row count r
//! 8 * n  live bytes of the *data* records of each segment (map records
//!        are counted from the directory)
//! 8 * 3  (with the flag) the counts of the rows below: records, units,
//!        and the blocks they serve without a record of their own (for a
//!        record refs + owners - 1, for a unit its refs): what open takes
//!        for the shared table's totals instead of reading every row
//! r rows: the records of the group's segments that the shared table
//!        holds (records with dedup references, and live units), in
//!        increasing offset order, each:
//!   varint  offset: the first row's itself, later ones the (non-zero)
//!           difference from the row before
//!   varint  owners (owner entries) * 2 + 1 for a unit
//!   varint  refs (ref entries)
//!   4       crc (not for a unit)
//! ```
//! A varint is LEB128: 7 bits a byte, least significant first, the high
//! bit set on every byte but the last, at most 10 bytes, no superfluous
//! zero bytes. A unit without references takes about 5 bytes.
//! A group without live data records has no record, and no group payload
//! is larger than `TABLE_PAYLOAD_MAX_BYTES`: a group that would be (tiny
//! shared records by the thousand) is not written, and neither is the
//! root, until it fits again. All describe the map at the checkpoint's
//! snapshot seq, as its pages do; a directory without a root names no
//! usable tables (open rebuilds them from the map).
use crate::*;

/// Physical segments per group table.
pub const TABLE_SEGMENTS: u64 = 1;
/// Largest group payload written (head and rows, before lz4): 2729 rows.
pub const TABLE_PAYLOAD_MAX_BYTES: usize = 64 << 10;
/// Words of map counters in the root.
pub const COUNTER_WORDS: usize = 10;
const ROOT_VERSION: u64 = 1;
const ROOT_OFF_VERSION: usize = 0;
const ROOT_OFF_GROUP_SEGMENTS: usize = ROOT_OFF_VERSION + 8;
const ROOT_OFF_SEGMENTS: usize = ROOT_OFF_GROUP_SEGMENTS + 8;
const ROOT_OFF_COUNTERS: usize = ROOT_OFF_SEGMENTS + 8;
pub const ROOT_BYTES: usize = ROOT_OFF_COUNTERS + 8 * COUNTER_WORDS;

/// Set in a group's segment count when the row counts follow its live
/// bytes.
pub const GROUP_COUNTS_FLAG: u32 = 1 << 31;
/// Bytes of the row counts.
pub const GROUP_COUNTS_BYTES: usize = 8 * 3;
/// The fewest bytes a row takes (a unit: offset, owners, refs).
const ROW_MIN_BYTES: usize = 3;
const GROUP_OFF_INDEX: usize = 0;
const GROUP_OFF_SEGMENTS: usize = GROUP_OFF_INDEX + 8;
const GROUP_OFF_ROWS: usize = GROUP_OFF_SEGMENTS + 4;
pub const GROUP_HEADER_BYTES: usize = GROUP_OFF_ROWS + 4;
/// The most bytes a row takes in a volume (segments of at most 1 GiB):
/// an offset difference below 2^35 (5 bytes; the first row's offset, below
/// 2^43, 2 more per table), owners (1 byte), refs (5), a crc (4).
pub const ROW_MAX_BYTES: usize = 15;
const VARINT_MAX_BYTES: usize = 10;

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
    /// The counts of its rows (records, units, blocks served), if its
    /// payload carries them (`GROUP_COUNTS_FLAG`).
    pub counts: Option<[u64; 3]>,
    /// Rows in increasing offset order.
    pub rows: Vec<TableRow>,
}

impl TableGroup {
    pub fn encode(&self) -> Vec<u8> {
        let rows = self.rows.iter().copied();
        TableGroup::encode_rows(self.group, &self.live, self.counts, rows)
    }

    /// The payload of group `group` with these live bytes, row counts and
    /// rows (in increasing offset order), without collecting the rows
    /// first. The counts are the caller's: this layer does not know which
    /// rows are records and what blocks they serve.
    pub fn encode_rows(
        group: u64,
        live: &[u64],
        counts: Option<[u64; 3]>,
        rows: impl Iterator<Item = TableRow>,
    ) -> Vec<u8> {
        let (mut head, rows) = TableGroup::encode_parts(group, live, counts, rows);
        head.extend_from_slice(&rows);
        head
    }

    /// `encode_rows` in its two parts: the head (through the row counts)
    /// and the rows. The whole layout is the two one after the other; the
    /// head-first layout (`GroupHead::decode_head_first`) stores the head
    /// and then the rows lz4-compressed with their length prepended.
    pub fn encode_parts(
        group: u64,
        live: &[u64],
        counts: Option<[u64; 3]>,
        rows: impl Iterator<Item = TableRow>,
    ) -> (Vec<u8>, Vec<u8>) {
        let extra = if counts.is_some() {
            GROUP_COUNTS_BYTES
        } else {
            0
        };
        let at = GROUP_HEADER_BYTES + 8 * live.len();
        let mut v = vec![0u8; at + extra];
        put_u64(&mut v, GROUP_OFF_INDEX, group);
        let flag = if counts.is_some() {
            GROUP_COUNTS_FLAG
        } else {
            0
        };
        put_u32(&mut v, GROUP_OFF_SEGMENTS, live.len() as u32 | flag);
        for (i, l) in live.iter().enumerate() {
            put_u64(&mut v, GROUP_HEADER_BYTES + 8 * i, *l);
        }
        for (i, c) in counts.iter().flatten().enumerate() {
            put_u64(&mut v, at + 8 * i, *c);
        }
        let mut b = Vec::new();
        let (mut count, mut prev) = (0u32, 0u64);
        for r in rows {
            assert!(
                count == 0 || r.offset > prev,
                "rows in increasing offset order"
            );
            put_varint(&mut b, r.offset - prev);
            put_varint(&mut b, u64::from(r.owners) << 1 | u64::from(r.unit));
            put_varint(&mut b, u64::from(r.refs));
            if !r.unit {
                b.extend_from_slice(&r.crc.to_le_bytes());
            }
            (count, prev) = (count + 1, r.offset);
        }
        put_u32(&mut v, GROUP_OFF_ROWS, count);
        (v, b)
    }

    /// Decodes group `group` of a volume of `segments` segments: its
    /// segment count must be the group's, its rows in increasing offset
    /// order, every byte used (their segments are checked by the caller,
    /// who knows where segments lie).
    pub fn decode(b: &[u8], group: u64, segments: u64) -> Result<TableGroup, FormatError> {
        let head = GroupHead::decode(b, group, segments)?;
        let mut rows = head.rows(b);
        let mut out = Vec::with_capacity(head.count.min(b.len()));
        for r in rows.by_ref() {
            out.push(r?);
        }
        rows.finish()?;
        Ok(TableGroup {
            group,
            live: head.live,
            counts: head.counts,
            rows: out,
        })
    }
}

/// A group table's header, its rows left encoded (`rows` reads them one
/// at a time: open counts a group's rows without collecting them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupHead {
    pub group: u64,
    /// Live bytes of data records, per segment of the group.
    pub live: Vec<u64>,
    /// The counts of its rows, if it carries them: records, units, blocks
    /// served (`GROUP_COUNTS_FLAG`; unchecked against the rows).
    pub counts: Option<[u64; 3]>,
    /// Where the rows begin in the bytes they are read from (the payload
    /// of the whole layout; 0 in the head-first layout, whose rows are
    /// read decompressed), and how many there are (no more than their
    /// bytes could hold).
    pub rows_at: usize,
    pub count: usize,
}

/// Where a head-first group record keeps its rows (`decode_head_first`):
/// the lz4 block (its length prepended) from byte `at` to the end, and the
/// length they decompress to (bounded: with the head, no more than
/// `TABLE_PAYLOAD_MAX_BYTES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedRows {
    pub at: usize,
    pub len: usize,
}

/// Bytes of the length an lz4 block is prepended with.
pub const PACKED_LEN_BYTES: usize = 4;

impl GroupHead {
    /// The header of group `group`'s payload `b` (see `TableGroup::decode`).
    pub fn decode(b: &[u8], group: u64, segments: u64) -> Result<GroupHead, FormatError> {
        let head = GroupHead::decode_within(b, group, segments)?;
        if b.len() > TABLE_PAYLOAD_MAX_BYTES {
            return Err(FormatError::Invalid("group table larger than any written"));
        }
        if head.count > (b.len() - head.rows_at) / ROW_MIN_BYTES {
            return Err(FormatError::Invalid("group table rows beyond its length"));
        }
        Ok(head)
    }

    /// The header of a *head-first* group record's payload `b` (group
    /// `group` of a volume of `segments` segments): the head as in the
    /// whole layout, then the rows lz4-compressed, their length prepended
    /// (u32). Checks what `decode` does, the rows' declared length taken
    /// for their bytes; the rows are neither decompressed nor read (their
    /// `rows_at` is 0: `rows` reads them decompressed).
    pub fn decode_head_first(
        b: &[u8],
        group: u64,
        segments: u64,
    ) -> Result<(GroupHead, PackedRows), FormatError> {
        let mut head = GroupHead::decode_within(b, group, segments)?;
        let at = head.rows_at;
        let Some(len) = b.get(at..at + PACKED_LEN_BYTES) else {
            return Err(FormatError::Invalid("group table length"));
        };
        let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
        if len > TABLE_PAYLOAD_MAX_BYTES.saturating_sub(at) {
            return Err(FormatError::Invalid("group table larger than any written"));
        }
        if head.count > len / ROW_MIN_BYTES {
            return Err(FormatError::Invalid("group table rows beyond its length"));
        }
        head.rows_at = 0;
        Ok((head, PackedRows { at, len }))
    }

    /// The header at the start of `b`, checked but for the bytes of its
    /// rows (`decode`, `decode_head_first`); `rows_at` where it ends.
    fn decode_within(b: &[u8], group: u64, segments: u64) -> Result<GroupHead, FormatError> {
        let bad = |what| Err(FormatError::Invalid(what));
        if b.len() < GROUP_HEADER_BYTES || get_u64(b, GROUP_OFF_INDEX) != group {
            return bad("group table of another group");
        }
        let first = group.saturating_mul(TABLE_SEGMENTS);
        let expect = segments.saturating_sub(first).min(TABLE_SEGMENTS) as usize;
        let word = get_u32(b, GROUP_OFF_SEGMENTS);
        let with_counts = word & GROUP_COUNTS_FLAG != 0;
        let n = (word & !GROUP_COUNTS_FLAG) as usize;
        let count = get_u32(b, GROUP_OFF_ROWS) as usize;
        let counts_at = GROUP_HEADER_BYTES + 8 * n;
        let rows_at = counts_at + if with_counts { GROUP_COUNTS_BYTES } else { 0 };
        if n != expect || expect == 0 || b.len() < rows_at {
            return bad("group table length");
        }
        let live = (0..n)
            .map(|i| get_u64(b, GROUP_HEADER_BYTES + 8 * i))
            .collect();
        let counts = with_counts.then(|| std::array::from_fn(|i| get_u64(b, counts_at + 8 * i)));
        Ok(GroupHead {
            group,
            live,
            counts,
            rows_at,
            count,
        })
    }

    /// The rows of `b` (the payload this header was decoded from), in
    /// order; `Rows::finish` then checks that every byte was used.
    pub fn rows<'a>(&self, b: &'a [u8]) -> Rows<'a> {
        Rows {
            b,
            at: self.rows_at,
            left: self.count,
            prev: None,
        }
    }
}

/// The rows of a group payload, decoded one at a time (`GroupHead::rows`).
pub struct Rows<'a> {
    b: &'a [u8],
    at: usize,
    left: usize,
    prev: Option<u64>,
}

impl Rows<'_> {
    fn row(&mut self) -> Result<TableRow, FormatError> {
        let bad = FormatError::Invalid("group table row");
        let b = self.b;
        let delta = get_varint(b, &mut self.at)?;
        let kind = get_varint(b, &mut self.at)?;
        let refs = u32::try_from(get_varint(b, &mut self.at)?);
        let owners = u32::try_from(kind >> 1);
        let offset = match self.prev {
            None => Some(delta),
            Some(prev) => prev.checked_add(delta).filter(|_| delta > 0),
        };
        let (Some(offset), Ok(refs), Ok(owners)) = (offset, refs, owners) else {
            return Err(bad);
        };
        let unit = kind & 1 == 1;
        let crc = if unit {
            0
        } else {
            let crc = b.get(self.at..self.at + 4).ok_or(bad)?;
            self.at += 4;
            u32::from_le_bytes(crc.try_into().expect("4 bytes"))
        };
        self.prev = Some(offset);
        Ok(TableRow {
            offset,
            refs,
            owners,
            crc,
            unit,
        })
    }

    /// After the last row: every byte of the payload must have been used.
    pub fn finish(self) -> Result<(), FormatError> {
        if self.left != 0 || self.at != self.b.len() {
            return Err(FormatError::Invalid("group table length"));
        }
        Ok(())
    }
}

impl Iterator for Rows<'_> {
    type Item = Result<TableRow, FormatError>;

    /// The next row; after an error, none.
    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        let r = self.row();
        self.left = if r.is_ok() { self.left - 1 } else { 0 };
        if r.is_err() {
            self.at = usize::MAX;
        }
        Some(r)
    }
}

/// Appends `v` as a LEB128 varint.
pub(crate) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// The LEB128 varint at `*at`, moving past it: at most 10 bytes, the last
/// not zero unless it is the only one, no bits beyond 64.
#[inline]
pub(crate) fn get_varint(b: &[u8], at: &mut usize) -> Result<u64, FormatError> {
    // One byte (most owners and refs): no loop.
    if let Some(&byte) = b.get(*at) {
        if byte < 0x80 {
            *at += 1;
            return Ok(u64::from(byte));
        }
    }
    let mut v = 0u64;
    for i in 0..VARINT_MAX_BYTES {
        let byte = *b.get(*at + i).ok_or(FormatError::Invalid("varint"))?;
        let bits = u64::from(byte & 0x7f);
        if (i == 9 && byte > 1) || (i > 0 && byte == 0) {
            return Err(FormatError::Invalid("varint"));
        }
        v |= bits << (7 * i);
        if byte & 0x80 == 0 {
            *at += i + 1;
            return Ok(v);
        }
    }
    Err(FormatError::Invalid("varint"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_and_refuse_overlong_forms() {
        for v in [0, 1, 127, 128, 300, u64::from(u32::MAX), u64::MAX] {
            let mut b = Vec::new();
            put_varint(&mut b, v);
            let mut at = 0;
            assert_eq!(get_varint(&b, &mut at).unwrap(), v);
            assert_eq!(at, b.len());
        }
        let mut at = 0;
        assert!(
            get_varint(&[0x80, 0x00], &mut at).is_err(),
            "superfluous zero"
        );
        assert!(get_varint(&[0xff; 10], &mut at).is_err(), "beyond 64 bits");
        assert!(get_varint(&[0x80], &mut at).is_err(), "cut short");
    }

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
            crc: if unit { 0 } else { 7 },
            unit,
        };
        let g = TableGroup {
            group: 1,
            live: vec![5; 1],
            counts: None,
            rows: vec![row(10, false), row(20, true)],
        };
        let b = g.encode();
        assert_eq!(TableGroup::decode(&b, 1, 300).unwrap(), g);
        assert!(TableGroup::decode(&b, 0, 300).is_err(), "another group");
        assert!(TableGroup::decode(&b, 1, 1).is_err(), "beyond the volume");
        assert!(TableGroup::decode(&b[..b.len() - 1], 1, 300).is_err());
        let mut longer = b.clone();
        longer.push(0);
        assert!(
            TableGroup::decode(&longer, 1, 300).is_err(),
            "a byte too many"
        );
        // A unit without references: offset, owners and refs in 5 bytes.
        let unit = TableRow {
            offset: 1 << 20,
            refs: 0,
            owners: 4,
            crc: 0,
            unit: true,
        };
        let one = TableGroup {
            rows: vec![
                unit,
                TableRow {
                    offset: (1 << 20) + 9000,
                    ..unit
                },
            ],
            ..g.clone()
        };
        let e = one.encode();
        assert_eq!(e.len(), GROUP_HEADER_BYTES + 8 + 5 + 4);
        assert_eq!(TableGroup::decode(&e, 1, 300).unwrap(), one);
        // Two rows at one offset (a zero difference) are refused.
        let second = GROUP_HEADER_BYTES + 8 + 5;
        let mut dup = e[..second].to_vec();
        dup.extend_from_slice(&[0, 9, 0]);
        assert!(TableGroup::decode(&dup, 1, 300).is_err());
    }
    /// A record row at `offset` (two refs, one owner).
    fn row(offset: u64) -> TableRow {
        TableRow {
            offset,
            refs: 2,
            owners: 1,
            crc: 9,
            unit: false,
        }
    }

    #[test]
    fn a_group_with_counts_round_trips_and_one_without_still_decodes() {
        let g = TableGroup {
            group: 3,
            live: vec![4096],
            counts: Some([2, 0, 4]),
            rows: vec![row(100), row(200)],
        };
        let b = g.encode();
        let old = TableGroup {
            counts: None,
            ..g.clone()
        }
        .encode();
        assert_eq!(b.len(), old.len() + GROUP_COUNTS_BYTES);
        assert_eq!(TableGroup::decode(&b, 3, 10).unwrap(), g);
        let head = GroupHead::decode(&b, 3, 10).unwrap();
        assert_eq!(head.counts, Some([2, 0, 4]));
        assert_eq!(head.rows_at, GROUP_HEADER_BYTES + 8 + GROUP_COUNTS_BYTES);
        let head = GroupHead::decode(&old, 3, 10).unwrap();
        assert_eq!((head.counts, head.rows_at), (None, GROUP_HEADER_BYTES + 8));
        // Cut inside the counts: refused.
        let short = &b[..GROUP_HEADER_BYTES + 8 + 10];
        assert!(GroupHead::decode(short, 3, 10).is_err());
        // Larger than any group written: refused.
        let mut large = b.clone();
        large.resize(TABLE_PAYLOAD_MAX_BYTES + 1, 0);
        assert!(GroupHead::decode(&large, 3, 10).is_err());
        // More rows than its bytes could hold: refused before any is read.
        let mut many = b.clone();
        put_u32(&mut many, GROUP_OFF_ROWS, 1000);
        assert!(GroupHead::decode(&many, 3, 10).is_err());
    }

    /// A head-first payload: the head, then the rows' length and (here
    /// uncompressed, standing for the lz4 block) bytes.
    fn head_first(g: &TableGroup) -> (Vec<u8>, Vec<u8>) {
        let rows = g.rows.iter().copied();
        let (mut head, rows) = TableGroup::encode_parts(g.group, &g.live, g.counts, rows);
        head.extend_from_slice(&(rows.len() as u32).to_le_bytes());
        head.extend_from_slice(&rows);
        (head, rows)
    }

    #[test]
    fn a_head_first_group_decodes_its_head_alone_with_or_without_counts() {
        for counts in [Some([2, 0, 4]), None] {
            let g = TableGroup {
                group: 3,
                live: vec![4096],
                counts,
                rows: vec![row(100), row(200)],
            };
            let whole = g.encode();
            let (b, rows) = head_first(&g);
            let (head, packed) = GroupHead::decode_head_first(&b, 3, 10).unwrap();
            let old = GroupHead::decode(&whole, 3, 10).unwrap();
            assert_eq!((head.rows_at, head.count), (0, 2));
            assert_eq!((&head.live, head.counts), (&old.live, old.counts));
            assert_eq!(packed.at, old.rows_at);
            assert_eq!(packed.len, rows.len());
            assert_eq!(&whole[old.rows_at..], &rows[..], "the same rows");
            let mut it = head.rows(&b[packed.at + PACKED_LEN_BYTES..]);
            assert_eq!(it.by_ref().collect::<Result<Vec<_>, _>>().unwrap(), g.rows);
            it.finish().unwrap();
            // Cut short: inside the head, or before the rows' length.
            for cut in [GROUP_HEADER_BYTES + 4, packed.at, packed.at + 3] {
                assert!(GroupHead::decode_head_first(&b[..cut], 3, 10).is_err());
            }
            // The rows' bytes themselves are not read at open.
            assert!(GroupHead::decode_head_first(&b[..packed.at + 4], 3, 10).is_ok());
            assert!(
                GroupHead::decode_head_first(&b, 2, 10).is_err(),
                "another group"
            );
            // Rows declared longer than any group written: refused.
            let mut large = b.clone();
            let max = (TABLE_PAYLOAD_MAX_BYTES - packed.at) as u32;
            put_u32(&mut large, packed.at, max + 1);
            assert!(GroupHead::decode_head_first(&large, 3, 10).is_err());
            put_u32(&mut large, packed.at, max);
            assert!(GroupHead::decode_head_first(&large, 3, 10).is_ok());
            put_u32(&mut large, packed.at, u32::MAX);
            assert!(GroupHead::decode_head_first(&large, 3, 10).is_err());
            // More rows than their declared length could hold: refused.
            let mut many = b.clone();
            put_u32(&mut many, GROUP_OFF_ROWS, rows.len() as u32 / 3 + 1);
            assert!(GroupHead::decode_head_first(&many, 3, 10).is_err());
        }
    }
}
