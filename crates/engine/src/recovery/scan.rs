//! Reading the log segment by segment, without following the chain: every
//! verified record of every segment's current life (`scan_log`, for the
//! fallbacks, `check` and salvage), the seq of each segment's first record
//! (`first_record_index`, where the roll-forward looks for the next
//! segment), the segments that may hold data (`segments_with_data`: holes
//! are skipped), and whole segments read (`read_segment`,
//! `read_segment_around`). Uses no sibling room.
use crate::error::RecoveryError;
use crate::records::{walk_segment, RecordDamage};
use cvol_format::record::{RecordHeader, RecordKind, RECORD_HEADER_BYTES};
use cvol_format::seal;
use cvol_format::{MapEntry, Superblock, SECTOR_SIZE_BYTES};
use cvol_storage::Storage;
use std::collections::HashMap;

/// A verified record found by scanning a segment.
pub(super) struct Scanned {
    pub segment: u64,
    pub at: usize,
    pub header: RecordHeader,
    /// The payload of a REF record (a map entry).
    pub ref_entry: Option<MapEntry>,
    /// The seq a SYNCED record certifies.
    pub synced: Option<u64>,
}

/// Every verified record of every segment, and the segments where a
/// record header was found but did not verify (damage).
pub(super) struct LogScan {
    pub records: Vec<Scanned>,
    pub damaged: Vec<(u64, usize, crate::records::RecordDamage)>,
    /// Headers of damaged records of the segments' current lives (segment,
    /// byte, header), for repair to name the blocks they held.
    pub damaged_headers: Vec<(u64, usize, RecordHeader)>,
}

/// Walks every segment's chain of records (each at the end of the previous
/// one or at the next sector boundary, seq increasing); records of earlier
/// lives of a reused segment have lower seqs and end the walk.
pub(super) fn scan_log(storage: &dyn Storage, sb: &Superblock) -> LogScan {
    let tag = sb.volume_tag();
    let mut out = LogScan {
        records: Vec::new(),
        damaged: Vec::new(),
        damaged_headers: Vec::new(),
    };
    for s in segments_with_data(storage, sb) {
        let Ok(buf) = read_segment(storage, sb, s) else {
            out.damaged
                .push((s, 0, crate::records::RecordDamage::Unreadable));
            continue;
        };
        let walk = walk_segment(&buf, tag);
        // Records older than the segment's first are from its earlier
        // lives (reused since): dead, and not to be replayed.
        let life_start = match walk.records.first() {
            Some((0, h)) => h.seq,
            _ => 0,
        };
        out.damaged
            .extend(walk.damaged.into_iter().map(|(at, e)| (s, at, e)));
        out.damaged_headers.extend(
            walk.damaged_headers
                .into_iter()
                .filter(|(_, h)| h.seq >= life_start)
                .map(|(at, h)| (s, at, h)),
        );
        for (at, h) in walk
            .records
            .into_iter()
            .filter(|(_, h)| h.seq >= life_start)
        {
            // An encrypted volume's records are authenticated: one that
            // fails was changed after the fact, and is not replayed.
            let Ok(payload) = seal::payload(sb.sealer(), &h, &buf[at..at + h.total_len()]) else {
                let why = RecordDamage::Checksum {
                    why: cvol_format::FormatError::Unauthentic,
                    kind: h.kind,
                    seq: h.seq,
                    lba: h.lba,
                    nblocks: h.nblocks,
                };
                out.damaged.push((s, at, why));
                out.damaged_headers.push((s, at, h));
                continue;
            };
            let ref_entry = (h.kind == RecordKind::Ref)
                .then(|| MapEntry::decode(&payload).ok())
                .flatten();
            let synced = (h.kind == RecordKind::Synced)
                .then(|| synced_payload(&payload))
                .flatten();
            out.records.push(Scanned {
                segment: s,
                at,
                header: h,
                ref_entry,
                synced,
            });
        }
    }
    out
}

/// Key of `first_record_index` under which segments whose start holds
/// bytes but no record header of this volume are listed (damage, or a
/// misdirected write: their records may still matter).
const DAMAGED_START: u64 = u64::MAX;

/// Seq of the first record of every segment whose first header decodes;
/// under `DAMAGED_START`, segments whose start is neither that nor zeros.
/// A segment that cannot be read fails the open: it may hold the log's
/// continuation, and guessing would end the chain early.
pub(super) fn first_record_index(
    storage: &dyn Storage,
    sb: &Superblock,
) -> Result<HashMap<u64, Vec<u64>>, RecoveryError> {
    let mut index: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut b = [0u8; RECORD_HEADER_BYTES];
    for s in segments_with_data(storage, sb) {
        storage
            .read_at(sb.segment_offset(s), &mut b)
            .map_err(|source| RecoveryError::SegmentStartUnreadable { segment: s, source })?;
        match RecordHeader::decode(&b) {
            Ok(h) if h.volume_tag == sb.volume_tag() => index.entry(h.seq).or_default().push(s),
            Ok(_) => {}
            Err(_) if b.iter().any(|&x| x != 0) => index.entry(DAMAGED_START).or_default().push(s),
            Err(_) => {}
        }
    }
    Ok(index)
}

/// The segments whose bytes may not all be zeros, in order: a segment
/// that reads as zeros holds no record, so scans skip it without reading
/// (`Storage::next_data`: one call over the holes of a sparse file, so an
/// empty 8 TiB volume opens without 2 Mi reads). Where the store cannot
/// tell, or answers with an error, every segment is listed and read.
fn segments_with_data<'a>(
    storage: &'a dyn Storage,
    sb: &'a Superblock,
) -> impl Iterator<Item = u64> + 'a {
    let mut next = 0u64;
    std::iter::from_fn(move || {
        let s = next_segment_with_data(storage, sb, next)?;
        next = s + 1;
        Some(s)
    })
}

/// The first segment from `from` on that may hold data.
fn next_segment_with_data(storage: &dyn Storage, sb: &Superblock, from: u64) -> Option<u64> {
    if from >= sb.segment_count() {
        return None;
    }
    let start = sb.segment_offset(from);
    let s = match storage.next_data(start) {
        Ok(Some(at)) => from + at.saturating_sub(start) / sb.segment_size_bytes,
        Ok(None) => return None,
        Err(_) => from,
    };
    (s < sb.segment_count()).then_some(s)
}

/// Segment `s` read whole.
pub(super) fn read_segment(
    storage: &dyn Storage,
    sb: &Superblock,
    s: u64,
) -> Result<Vec<u8>, RecoveryError> {
    let mut buf = vec![0u8; sb.segment_size_bytes as usize];
    storage
        .read_at(sb.segment_offset(s), &mut buf)
        .map_err(|source| RecoveryError::SegmentUnreadable { segment: s, source })?;
    Ok(buf)
}

/// Segment `s` read sector by sector, unreadable sectors left zero.
pub(super) fn read_segment_around(storage: &dyn Storage, sb: &Superblock, s: u64) -> Vec<u8> {
    let mut buf = vec![0u8; sb.segment_size_bytes as usize];
    let base = sb.segment_offset(s);
    for (k, sector) in buf.chunks_mut(SECTOR_SIZE_BYTES as usize).enumerate() {
        if storage
            .read_at(base + k as u64 * SECTOR_SIZE_BYTES, sector)
            .is_err()
        {
            sector.fill(0);
        }
    }
    buf
}

/// The seq a SYNCED record's payload certifies.
pub(super) fn synced_payload(payload: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(payload.get(..8)?.try_into().ok()?))
}
