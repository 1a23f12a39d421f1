//! Record decoding shared by every reader of the log: the volume's read path
//! and scrub, the cleaner, recovery and `check`. It depends on nothing but
//! `cvol-format` and the codecs, so none of its users depend on each other
//! through it (recovery no longer imports the volume, nor the cleaner
//! recovery).
//!
//! - map entries of a record: `unit_entry`, `full_mask`;
//! - the identity check a map entry makes against the record it names:
//!   `block_index`;
//! - whole DATA records verified and decompressed: `DecodedUnit`,
//!   `decode_block_record`;
//! - the records of a segment buffer: `walk_segment` (every verified record,
//!   damage skipped), `data_records` (the DATA ones).
use crate::codec;
use cvol_format::record::UNIT_BLOCKS_MAX;
use cvol_format::record::{RecordHeader, RecordKind, RECORD_HEADER_BYTES, RECORD_MAGIC};
use cvol_format::seal::{self, Sealer};
use cvol_format::FormatError;
use cvol_format::{align_up, CodecTag, EntryState, MapEntry, BLOCK_SIZE_BYTES, SECTOR_SIZE_BYTES};

const BS: usize = BLOCK_SIZE_BYTES as usize;

/// The live mask of a fresh record of `nblocks` (every block; 0 for one).
pub(crate) fn full_mask(nblocks: u32) -> u16 {
    assert!(
        (1..=UNIT_BLOCKS_MAX).contains(&nblocks),
        "a DATA record of {nblocks} blocks"
    );
    if nblocks > 1 {
        // nblocks <= 16: the mask fits the u16 flags.
        ((1u32 << nblocks) - 1) as u16
    } else {
        0
    }
}

/// The owner entry of block `k` of a record of `nblocks` blocks.
pub(crate) fn unit_entry(
    codec: CodecTag,
    offset: u64,
    len: u32,
    crc: u32,
    nblocks: u32,
    k: u32,
) -> MapEntry {
    assert!(k < nblocks, "block {k} of a record of {nblocks}");
    if nblocks > 1 {
        MapEntry::unit(codec, offset, len, crc, k)
    } else {
        MapEntry::data(codec, offset, len, crc)
    }
}

/// Why a block cannot be read from the record its map entry names.
#[derive(Debug)]
pub enum BlockError {
    /// The map entry names no record.
    NoRecord,
    /// The record verifies, but is not the one the entry expects (another
    /// crc, kind or shape): stale or misdirected.
    NotExpected {
        crc: u32,
        kind: RecordKind,
        lba: u64,
        nblocks: u32,
        expected_crc: u32,
    },
    /// A data record claiming more blocks than a unit holds.
    TooManyBlocks(u32),
    /// An owner entry pointing at a record of other LBAs.
    OtherLba {
        lba: u64,
        record_lba: u64,
        nblocks: u32,
        kind: RecordKind,
    },
    /// A whole-record decode found another kind or shape.
    NotData { kind: RecordKind, nblocks: u32 },
    /// The header or checksum does not verify.
    Invalid(cvol_format::FormatError),
    /// The payload does not decompress to the blocks it claims.
    Decompress(codec::DecompressError),
}

impl std::fmt::Display for BlockError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BlockError::NoRecord => write!(f, "map entry names no record"),
            BlockError::NotExpected {
                crc,
                kind,
                lba,
                nblocks,
                expected_crc,
            } => write!(
                f,
                "record crc {crc:#010x} ({kind:?}, lba {lba}+{nblocks}) is not the one the map \
                 expects ({expected_crc:#010x}): stale or misdirected"
            ),
            BlockError::TooManyBlocks(n) => write!(f, "data record of {n} blocks"),
            BlockError::OtherLba {
                lba,
                record_lba,
                nblocks,
                kind,
            } => write!(
                f,
                "record holds lba {record_lba}+{nblocks} of kind {kind:?}, not lba {lba}"
            ),
            BlockError::NotData { kind, nblocks } => {
                write!(f, "not a data record: {kind:?} of {nblocks} blocks")
            }
            BlockError::Invalid(e) => write!(f, "{e}"),
            BlockError::Decompress(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for BlockError {}

impl From<codec::DecompressError> for BlockError {
    fn from(e: codec::DecompressError) -> BlockError {
        BlockError::Decompress(e)
    }
}

/// Checks that map entry `e` (for `lba`) may point at the verified record
/// `h`, and returns the index of the block it names in it. A record's crc
/// includes its seq, so a stale or misdirected record fails here.
pub fn block_index(lba: u64, e: MapEntry, h: &RecordHeader) -> Result<usize, BlockError> {
    let EntryState::Data { shared, unit, .. } = e.state_valid() else {
        return Err(BlockError::NoRecord);
    };
    let k = e.block_in(h.crc);
    let fits = if unit {
        h.nblocks >= 2 && k < h.nblocks
    } else {
        h.nblocks == 1 && k == 0
    };
    if !fits || h.kind != RecordKind::Data {
        return Err(BlockError::NotExpected {
            crc: h.crc,
            kind: h.kind,
            lba: h.lba,
            nblocks: h.nblocks,
            expected_crc: e.crc,
        });
    }
    if h.nblocks > UNIT_BLOCKS_MAX {
        return Err(BlockError::TooManyBlocks(h.nblocks));
    }
    // A ref entry (dedup) may point at a record that names another LBA.
    if !shared && h.lba + u64::from(k) != lba {
        return Err(BlockError::OtherLba {
            lba,
            record_lba: h.lba,
            nblocks: h.nblocks,
            kind: h.kind,
        });
    }
    Ok(k as usize)
}

/// A verified, decompressed DATA record: its header and all its blocks.
pub(crate) struct DecodedUnit {
    pub(crate) header: RecordHeader,
    pub(crate) data: Vec<u8>,
}

impl DecodedUnit {
    /// Verifies, opens (an encrypted volume's `seal`) and decompresses a
    /// whole DATA record.
    pub(crate) fn decode(seal: Option<&Sealer>, rec: &[u8]) -> Result<DecodedUnit, BlockError> {
        let (h, _) = RecordHeader::decode_verified(rec).map_err(BlockError::Invalid)?;
        Self::check_kind(&h)?;
        let payload = seal::payload(seal, &h, rec).map_err(BlockError::Invalid)?;
        Self::from_payload(h, &payload)
    }

    fn check_kind(h: &RecordHeader) -> Result<(), BlockError> {
        if h.kind != RecordKind::Data || h.nblocks > UNIT_BLOCKS_MAX {
            return Err(BlockError::NotData {
                kind: h.kind,
                nblocks: h.nblocks,
            });
        }
        Ok(())
    }

    /// Decompresses the DATA record `h` from its opened `payload`
    /// ([`open_in_place`]).
    pub(crate) fn from_payload(h: RecordHeader, payload: &[u8]) -> Result<DecodedUnit, BlockError> {
        Self::check_kind(&h)?;
        let mut data = vec![0u8; h.nblocks as usize * BS];
        codec::decompress(h.codec, payload, &mut data)?;
        debug_assert_eq!(data.len(), h.nblocks as usize * BS);
        Ok(DecodedUnit { header: h, data })
    }

    /// Copies the block entry `e` (for `lba`) names, after the identity check.
    /// Is this the record `e` (block `lba`) points at? The unit cache is
    /// keyed by place, and a reused segment may hold another record of the
    /// same length at the same place.
    pub(crate) fn serves(&self, lba: u64, e: MapEntry) -> bool {
        block_index(lba, e, &self.header).is_ok()
    }

    pub(crate) fn copy_block(
        &self,
        lba: u64,
        e: MapEntry,
        out: &mut [u8],
    ) -> Result<(), BlockError> {
        let k = block_index(lba, e, &self.header)?;
        out.copy_from_slice(&self.data[k * BS..(k + 1) * BS]);
        Ok(())
    }
}

/// Verifies a DATA record against the map entry that points at it, opens
/// it (an encrypted volume's `seal`) and decompresses the block for `lba`
/// into `out`.
pub fn decode_block_record(
    seal: Option<&Sealer>,
    lba: u64,
    e: MapEntry,
    rec: &[u8],
    out: &mut [u8],
) -> Result<(), BlockError> {
    let (h, _) = RecordHeader::decode_verified(rec).map_err(BlockError::Invalid)?;
    block_index(lba, e, &h)?;
    let payload = seal::payload(seal, &h, rec).map_err(BlockError::Invalid)?;
    decode_block_payload(&h, lba, e, &payload, out)
}

/// [`decode_block_record`] of a record already verified and opened
/// ([`open_in_place`]): `h` its header, `payload` its content.
pub(crate) fn decode_block_payload(
    h: &RecordHeader,
    lba: u64,
    e: MapEntry,
    payload: &[u8],
    out: &mut [u8],
) -> Result<(), BlockError> {
    let k = block_index(lba, e, h)?;
    if h.nblocks == 1 {
        return Ok(codec::decompress(h.codec, payload, out)?);
    }
    let mut unit = vec![0u8; h.nblocks as usize * BS];
    codec::decompress(h.codec, payload, &mut unit)?;
    out.copy_from_slice(&unit[k * BS..(k + 1) * BS]);
    Ok(())
}

/// Verifies the record at the start of `rec` and opens its payload where
/// it lies (an encrypted volume's `seal`; no copy): its header, and the
/// place of its content in `rec`. A record that fails leaves `rec`'s
/// payload bytes unspecified.
pub(crate) fn open_in_place(
    seal: Option<&Sealer>,
    rec: &mut [u8],
) -> Result<(RecordHeader, std::ops::Range<usize>), BlockError> {
    let (h, _) = RecordHeader::decode_verified(rec).map_err(BlockError::Invalid)?;
    let at = seal::payload_in_place(seal, &h, rec).map_err(BlockError::Invalid)?;
    Ok((h, at))
}

/// The verified records of one segment, and where damaged ones were.
pub struct SegmentWalk {
    pub records: Vec<(usize, RecordHeader)>,
    pub damaged: Vec<(usize, RecordDamage)>,
    /// The damaged records' headers: as written when one damaged header
    /// byte explains the damage (`header_byte_fix`), else as read.
    pub damaged_headers: Vec<(usize, RecordHeader)>,
}

/// Walks a segment's records: each at the end of the previous one or at the
/// next sector boundary; where that breaks (the end of what was written, a
/// damaged record, a header too damaged to decode, a valid record written
/// to the wrong place) it resumes at the next intact record further on,
/// found byte by byte, so nothing damaged or misplaced hides the records
/// after it. Every verified record is returned, whatever its seq: records
/// of a reused segment's earlier lives too (callers that care compare seqs;
/// the cleaner moves only records the map names). `damaged` lists records
/// whose header decodes but whose checksum fails.
pub fn walk_segment(buf: &[u8], tag: u32) -> SegmentWalk {
    let mut out = SegmentWalk {
        records: Vec::new(),
        damaged: Vec::new(),
        damaged_headers: Vec::new(),
    };
    if buf.iter().all(|&b| b == 0) {
        return out; // a free segment (a hole on the host): nothing to search
    }
    let mut pos = 0usize;
    loop {
        let aligned = align_up(pos as u64, SECTOR_SIZE_BYTES) as usize;
        let found = match record_at(buf, pos, tag) {
            Some(r) => Some((pos, r)),
            None => record_at(buf, aligned, tag).map(|r| (aligned, r)),
        };
        let resume = match found {
            Some((at, Ok(h))) => {
                pos = at + h.total_len();
                assert!(pos <= buf.len(), "a verified record ends inside its buffer");
                out.records.push((at, h));
                continue;
            }
            Some((at, Err(e))) => {
                let h = cvol_format::record::header_byte_fix(&buf[at..])
                    .or_else(|| RecordHeader::decode(&buf[at..]).ok());
                if let Some(h) = h {
                    out.damaged_headers.push((at, h));
                }
                out.damaged.push((at, e));
                at + 1
            }
            None => pos + 1,
        };
        match next_intact_record(buf, resume, tag) {
            Some(p) => pos = p,
            None => break,
        }
    }
    out
}

/// Why a record header of ours found in a segment does not verify.
#[derive(Debug)]
pub enum RecordDamage {
    /// The segment holding it could not be read.
    Unreadable,
    /// Its length runs past the end of the segment.
    PastSegment,
    /// Its checksum fails; the header as read (it may lie).
    Checksum {
        why: cvol_format::FormatError,
        kind: RecordKind,
        seq: u64,
        lba: u64,
        nblocks: u32,
    },
}

impl std::fmt::Display for RecordDamage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecordDamage::Unreadable => write!(f, "unreadable"),
            RecordDamage::PastSegment => write!(f, "record runs past the segment"),
            RecordDamage::Checksum {
                why,
                kind,
                seq,
                lba,
                nblocks,
            } => write!(
                f,
                "{why}; it claims to be {kind:?} seq {seq} for lba {lba}+{nblocks} (header as \
                 read; repair marks its blocks lost unless written after it)"
            ),
        }
    }
}

/// The record of this volume at `at`: None if no header of ours decodes
/// there, else the verified header or why it failed verification.
fn record_at(buf: &[u8], at: usize, tag: u32) -> Option<Result<RecordHeader, RecordDamage>> {
    let b = buf.get(at..)?;
    let h = RecordHeader::decode(b).ok()?;
    if h.volume_tag != tag {
        return None;
    }
    if h.total_len() > b.len() {
        return Some(Err(RecordDamage::PastSegment));
    }
    Some(
        h.verify(b, &b[RECORD_HEADER_BYTES..h.total_len()])
            .map(|_| h)
            .map_err(|why| RecordDamage::Checksum {
                why,
                kind: h.kind,
                seq: h.seq,
                lba: h.lba,
                nblocks: h.nblocks,
            }),
    )
}

/// The first place at or after `from` holding an intact record of ours
/// (each place holding the header's magic tried in turn).
fn next_intact_record(buf: &[u8], from: usize, tag: u32) -> Option<usize> {
    let end = buf.len().saturating_sub(RECORD_HEADER_BYTES);
    let magic = RECORD_MAGIC.to_le_bytes();
    // Magic starting before `end` (a header fits after it).
    let hay = buf.get(from..(end + magic.len()).min(buf.len()))?;
    memchr::memmem::find_iter(hay, &magic)
        .map(|p| from + p)
        .find(|&p| p < end && matches!(record_at(buf, p, tag), Some(Ok(_))))
}

/// A verified DATA record found in a segment buffer.
pub(crate) struct Found {
    /// Its byte offset in the segment.
    pub(crate) at: usize,
    pub(crate) header: RecordHeader,
}

impl Found {
    /// Its bytes (header and payload) in the segment buffer it was found in.
    pub(crate) fn bytes<'a>(&self, seg: &'a [u8]) -> &'a [u8] {
        &seg[self.at..self.at + self.header.total_len()]
    }

    /// Its payload in the clear (opened with an encrypted volume's
    /// `seal`), from the segment buffer it was found in.
    pub(crate) fn payload<'a>(
        &self,
        seal: Option<&Sealer>,
        seg: &'a [u8],
    ) -> Result<std::borrow::Cow<'a, [u8]>, FormatError> {
        seal::payload(seal, &self.header, self.bytes(seg))
    }
}

/// The verified DATA records of a segment (see `walk_segment`: a damaged
/// record does not hide the ones after it).
pub(crate) fn data_records(seg: &[u8], tag: u32) -> Vec<Found> {
    walk_segment(seg, tag)
        .records
        .into_iter()
        .filter(|(_, h)| h.kind == RecordKind::Data)
        .map(|(at, header)| Found { at, header })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use cvol_format::record::encode_record;

    fn record(seq: u64, lba: u64, payload: &[u8]) -> Vec<u8> {
        let mut h = RecordHeader {
            kind: RecordKind::Data,
            codec: CodecTag::None,
            level: 0,
            mask: 0,
            volume_tag: 7,
            epoch: 1,
            seq,
            lba,
            nblocks: 1,
            payload_len: payload.len() as u32,
            crc: 0,
            sealed: false,
        };
        encode_record(&mut h, payload)
    }

    /// Found by the fault simulation (its seed 247): a misdirected write put a
    /// valid record with a higher seq in the middle of a segment; the walk
    /// required rising seqs and lost the live records after it (the
    /// cleaner would never have moved them; check reported bad usage).
    #[test]
    fn regression_a_misplaced_valid_record_does_not_hide_the_records_after_it() {
        let mut seg = Vec::new();
        for (seq, lba) in [(5, 1), (90, 2), (6, 3), (7, 4)] {
            seg.extend(record(seq, lba, &[lba as u8; 100]));
        }
        // A damaged record, then one more.
        let mut bad = record(8, 5, &[5; 100]);
        bad[60] ^= 1;
        seg.extend(bad);
        seg.extend(record(9, 6, &[6; 100]));
        seg.resize(4096, 0);
        let walk = walk_segment(&seg, 7);
        let lbas: Vec<u64> = walk.records.iter().map(|(_, h)| h.lba).collect();
        assert_eq!(lbas, vec![1, 2, 3, 4, 6]);
        assert_eq!(walk.damaged.len(), 1);
        assert!(matches!(
            walk.damaged[0].1,
            RecordDamage::Checksum {
                lba: 5,
                nblocks: 1,
                ..
            }
        ));
        assert!(
            walk.damaged[0].1.to_string().contains("lba 5+1"),
            "{:?}",
            walk.damaged
        );
    }
    /// The search for the next intact record finds what a byte-by-byte
    /// search finds, wherever records, garbage, stray magic and the
    /// segment's end lie (the magic found with `memmem`).
    #[test]
    fn the_next_intact_record_is_the_first_a_byte_by_byte_search_finds() {
        use rand::{Rng, SeedableRng};
        let naive = |buf: &[u8], from: usize| {
            (from..buf.len().saturating_sub(RECORD_HEADER_BYTES)).find(|&p| {
                buf[p..p + 4] == RECORD_MAGIC.to_le_bytes()
                    && matches!(record_at(buf, p, 7), Some(Ok(_)))
            })
        };
        // A record of one byte that ends the segment: its magic lies in
        // the last bytes the search may start from.
        for tail in 1..4 {
            let mut seg = vec![0u8; 5];
            seg.extend(record(1, 1, &vec![9; tail]));
            assert_eq!(next_intact_record(&seg, 0, 7), Some(5), "payload of {tail}");
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for round in 0..300 {
            let mut seg = Vec::new();
            for k in 0..rng.gen_range(0..6u64) {
                match rng.gen_range(0..4) {
                    0 => seg.extend(std::iter::repeat_n(0u8, rng.gen_range(0..300))),
                    1 => seg.extend(RECORD_MAGIC.to_le_bytes()),
                    2 => {
                        let mut r = record(k + 1, k, &vec![k as u8; rng.gen_range(1..200)]);
                        let flip = rng.gen_range(0..r.len() * 3);
                        if flip < r.len() {
                            r[flip] ^= 1;
                        }
                        seg.extend(r);
                    }
                    _ => seg.extend((0..rng.gen_range(0..50)).map(|_| rng.gen::<u8>())),
                }
            }
            // Cut anywhere: a record may run past the end.
            seg.truncate(rng.gen_range(0..=seg.len()));
            for from in 0..=seg.len() + 1 {
                assert_eq!(
                    next_intact_record(&seg, from, 7),
                    naive(&seg, from),
                    "round {round} from {from}"
                );
            }
        }
    }
}
