//! Opening a volume: newest valid checkpoint, then roll-forward along the
//! chain of records (seq + 1, same epoch or a newer EPOCH record) through the
//! segments written after it. See docs/FORMAT.md "Recovery".
use crate::map::BlockMap;
use cvol_format::checkpoint::{decode_runs, CommitPayload};
use cvol_format::pointer::POINTER_BYTES;
use cvol_format::record::{RecordHeader, RecordKind, RECORD_HEADER_BYTES};
use cvol_format::{
    align_up, CheckpointPointer, CodecTag, EntryState, MapEntry, Superblock, SECTOR_SIZE_BYTES,
};
use cvol_storage::Storage;
use std::collections::HashMap;

/// Most blocks one DATA record may hold (a 64 KiB compression unit).
pub const DATA_UNIT_BLOCKS_MAX: u32 = 16;

/// Result of recovery: the map and where the log continues.
pub struct Recovered {
    pub map: BlockMap,
    /// Segment holding the end of the chain and the byte after its last record.
    pub segment: u64,
    pub end: usize,
    pub last_seq: u64,
    pub last_epoch: u32,
    pub checkpoint_generation: u64,
    pub replayed_records: u64,
    /// Replayed records that changed the map (DATA, ZERO, TRIM).
    pub replayed_map_records: u64,
    /// Snapshot seq of the checkpoint recovery started from (0: none).
    pub snapshot_seq: u64,
    /// Segments recovery needs besides those holding live data: the ones the
    /// roll-forward passed through and those holding the checkpoint, with the
    /// highest seq each holds.
    pub needed_segments: HashMap<u64, u64>,
    /// Human-readable notes on what was skipped (corrupt slots, fallbacks).
    pub warnings: Vec<String>,
}

/// Position from which roll-forward starts.
struct Start {
    segment: u64,
    offset: usize,
    expected_seq: u64,
    epoch: u32,
    snapshot_seq: u64,
    /// Segments holding the checkpoint's records, with their highest seq.
    checkpoint_segments: HashMap<u64, u64>,
}

pub fn read_superblock(storage: &dyn Storage) -> Result<(Superblock, Vec<String>), String> {
    let mut warnings = Vec::new();
    let mut first_err = None;
    for (name, off) in [
        ("A", cvol_format::SUPERBLOCK_A_OFFSET),
        ("B", cvol_format::SUPERBLOCK_B_OFFSET),
    ] {
        let mut b = vec![0u8; cvol_format::superblock::SUPERBLOCK_BYTES];
        let res = storage
            .read_at(off, &mut b)
            .map_err(|e| e.to_string())
            .and_then(|_| Superblock::decode(&b).map_err(|e| e.to_string()));
        match res {
            Ok(sb) => {
                if sb.physical_size_bytes > storage.len_bytes() {
                    return Err(format!(
                        "superblock says {} physical bytes but the backing store has {}",
                        sb.physical_size_bytes,
                        storage.len_bytes()
                    ));
                }
                return Ok((sb, warnings));
            }
            Err(e) => {
                warnings.push(format!("superblock copy {name} unusable: {e}"));
                first_err.get_or_insert(e);
            }
        }
    }
    Err(format!(
        "not a cvol volume (no valid superblock: {})",
        first_err.unwrap_or_default()
    ))
}

pub fn read_pointers(storage: &dyn Storage) -> [Option<CheckpointPointer>; 2] {
    let mut out = [None, None];
    for (slot, o) in out.iter_mut().enumerate() {
        let mut b = vec![0u8; POINTER_BYTES];
        if storage
            .read_at(CheckpointPointer::slot_offset(slot), &mut b)
            .is_ok()
        {
            *o = CheckpointPointer::decode(&b)
                .ok()
                .filter(|p| p.slot() == slot);
        }
    }
    out
}

/// Rebuilds the map from the whole log, ignoring every checkpoint. Used by
/// `cvol check` to cross-check the checkpointed map.
pub fn replay_full(storage: &dyn Storage, sb: &Superblock) -> Result<Recovered, String> {
    let index = first_record_index(storage, sb);
    let Some(&segment) = index.get(&1).and_then(|v| v.first()) else {
        return Err("no log start (record seq 1) found".into());
    };
    let mut map = BlockMap::new(sb.logical_blocks());
    let start = Start {
        segment,
        offset: 0,
        expected_seq: 1,
        epoch: 0,
        snapshot_seq: 0,
        checkpoint_segments: HashMap::new(),
    };
    let r = roll_forward(storage, sb, &mut map, start, &index)?;
    Ok(Recovered { map, ..r })
}

pub fn recover(storage: &dyn Storage, sb: &Superblock) -> Result<Recovered, String> {
    let mut warnings = Vec::new();
    let mut ptrs: Vec<CheckpointPointer> = read_pointers(storage).into_iter().flatten().collect();
    ptrs.sort_by_key(|p| std::cmp::Reverse(p.generation));
    let mut loaded = None;
    for p in &ptrs {
        match load_checkpoint(storage, sb, p) {
            Ok(x) => {
                loaded = Some((x, p.generation));
                break;
            }
            Err(e) => warnings.push(format!(
                "checkpoint generation {} unusable: {e}",
                p.generation
            )),
        }
    }
    let index = first_record_index(storage, sb);
    let ((mut map, start), generation) = match loaded {
        Some(x) => x,
        None => {
            // Segments are reused only after a durable checkpoint, so with no
            // pointer at all the whole log is still there to replay; with
            // pointers that all fail it may not be, and replaying it could
            // silently return old data.
            if !ptrs.is_empty() {
                return Err(format!(
                    "no usable checkpoint ({}); refusing to guess the map",
                    warnings.join("; ")
                ));
            }
            let Some(&segment) = index.get(&1).and_then(|v| v.first()) else {
                return Err(
                    "no checkpoint and no log start found: the volume was never initialised".into(),
                );
            };
            let start = Start {
                segment,
                offset: 0,
                expected_seq: 1,
                epoch: 0,
                snapshot_seq: 0,
                checkpoint_segments: HashMap::new(),
            };
            ((BlockMap::new(sb.logical_blocks()), start), 0)
        }
    };
    let r = roll_forward(storage, sb, &mut map, start, &index)?;
    Ok(Recovered {
        map,
        checkpoint_generation: generation,
        warnings,
        ..r
    })
}

/// Seq of the first record of every segment whose first header decodes.
fn first_record_index(storage: &dyn Storage, sb: &Superblock) -> HashMap<u64, Vec<u64>> {
    let mut index: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut b = [0u8; RECORD_HEADER_BYTES];
    for s in 0..sb.segment_count() {
        if storage.read_at(sb.segment_offset(s), &mut b).is_err() {
            continue;
        }
        if let Ok(h) = RecordHeader::decode(&b) {
            if h.volume_tag == sb.volume_tag() {
                index.entry(h.seq).or_default().push(s);
            }
        }
    }
    index
}

/// A verified record at `at` in `seg` that continues the chain, if any.
fn chain_record_at(
    seg: &[u8],
    at: usize,
    tag: u32,
    expected: u64,
    epoch: u32,
) -> Option<RecordHeader> {
    let b = seg.get(at..)?;
    let h = RecordHeader::decode(b).ok()?;
    let continues =
        h.seq == expected && (h.epoch == epoch || (h.kind == RecordKind::Epoch && h.epoch > epoch));
    if h.volume_tag != tag || !continues || h.total_len() > b.len() {
        return None;
    }
    h.verify(b, &b[RECORD_HEADER_BYTES..h.total_len()]).ok()?;
    Some(h)
}

fn read_segment(storage: &dyn Storage, sb: &Superblock, s: u64) -> Result<Vec<u8>, String> {
    let mut buf = vec![0u8; sb.segment_size_bytes as usize];
    storage
        .read_at(sb.segment_offset(s), &mut buf)
        .map_err(|e| format!("reading segment {s}: {e}"))?;
    Ok(buf)
}

fn roll_forward(
    storage: &dyn Storage,
    sb: &Superblock,
    map: &mut BlockMap,
    start: Start,
    index: &HashMap<u64, Vec<u64>>,
) -> Result<Recovered, String> {
    let tag = sb.volume_tag();
    let (mut segment, mut pos, mut expected, mut epoch) =
        (start.segment, start.offset, start.expected_seq, start.epoch);
    let mut needed = start.checkpoint_segments.clone();
    let mut buf = read_segment(storage, sb, segment)?;
    let mut replayed = 0u64;
    let mut map_records = 0u64;
    loop {
        let aligned = align_up(pos as u64, SECTOR_SIZE_BYTES) as usize;
        let found = chain_record_at(&buf, pos, tag, expected, epoch)
            .map(|h| (pos, h))
            .or_else(|| chain_record_at(&buf, aligned, tag, expected, epoch).map(|h| (aligned, h)));
        let (at, h) = match found {
            Some(x) => x,
            None => {
                // Every candidate is tried: a stale segment of a crashed epoch
                // may share the expected first seq with the real next one.
                let mut next = None;
                for &s in index
                    .get(&expected)
                    .into_iter()
                    .flatten()
                    .filter(|&&s| s != segment)
                {
                    let b = read_segment(storage, sb, s)?;
                    if chain_record_at(&b, 0, tag, expected, epoch).is_some() {
                        next = Some((s, b));
                        break;
                    }
                }
                let Some((next, nbuf)) = next else { break };
                segment = next;
                buf = nbuf;
                pos = 0;
                continue;
            }
        };
        let offset = sb.segment_offset(segment) + at as u64;
        let payload = &buf[at + RECORD_HEADER_BYTES..at + h.total_len()];
        apply(map, sb, &h, offset, payload)
            .map_err(|e| format!("record seq {} at byte {offset}: {e}", h.seq))?;
        replayed += 1;
        map_records += u64::from(matches!(
            h.kind,
            RecordKind::Data | RecordKind::Zero | RecordKind::Trim | RecordKind::Ref
        ));
        let m = needed.entry(segment).or_insert(0);
        *m = (*m).max(h.seq);
        pos = at + h.total_len();
        expected += 1;
        epoch = h.epoch;
    }
    Ok(Recovered {
        map: BlockMap::new(0),
        segment,
        end: pos,
        last_seq: expected - 1,
        last_epoch: epoch,
        checkpoint_generation: 0,
        replayed_records: replayed,
        replayed_map_records: map_records,
        snapshot_seq: start.snapshot_seq,
        needed_segments: needed,
        warnings: Vec::new(),
    })
}

/// Applies one verified record's effect on the map.
pub fn apply(
    map: &mut BlockMap,
    sb: &Superblock,
    h: &RecordHeader,
    offset: u64,
    payload: &[u8],
) -> Result<(), String> {
    let end = h.lba + u64::from(h.nblocks);
    let in_range = end <= map.blocks();
    match h.kind {
        RecordKind::Data | RecordKind::Zero | RecordKind::Trim | RecordKind::Ref if !in_range => {
            Err(format!("lba range {}..{end} beyond the volume", h.lba))
        }
        RecordKind::Data if h.nblocks > DATA_UNIT_BLOCKS_MAX => Err(format!(
            "data record of {} blocks (at most {DATA_UNIT_BLOCKS_MAX})",
            h.nblocks
        )),
        RecordKind::Data => {
            // A unit's blocks each get their own entry (crc xor index); a
            // unit moved by the cleaner maps only the blocks of its live mask.
            for l in (h.lba..end).filter(|&l| h.maps(l)) {
                let k = (l - h.lba) as u32;
                let len = h.total_len() as u32;
                map.set(
                    l,
                    crate::volume::unit_entry(h.codec, offset, len, h.crc, h.nblocks, k),
                );
            }
            Ok(())
        }
        RecordKind::Zero => {
            (h.lba..end).for_each(|l| {
                map.set(l, MapEntry::ZERO);
            });
            Ok(())
        }
        RecordKind::Trim => {
            set_unmapped(map, h.lba, end);
            Ok(())
        }
        RecordKind::Ref => {
            let e = MapEntry::decode(payload).map_err(|e| format!("ref record: {e}"))?;
            match e.state_valid() {
                EntryState::Data { shared: true, .. } => {}
                _ => return Err("ref record does not name a shared data entry".into()),
            }
            check_entry_location(sb, e).map_err(|w| format!("ref record {w}"))?;
            map.set(h.lba, e);
            Ok(())
        }
        RecordKind::Epoch | RecordKind::MapChunk | RecordKind::CkptCommit => Ok(()),
    }
}

/// Unmaps [start, end), skipping pages that hold nothing.
pub fn set_unmapped(map: &mut BlockMap, start: u64, end: u64) {
    let mut lba = start;
    while lba < end {
        match map.next_allocated_page_lba(lba) {
            Some(next) if next < end => {
                let page_end =
                    (next / crate::map::PAGE_BLOCKS as u64 + 1) * crate::map::PAGE_BLOCKS as u64;
                for l in next..page_end.min(end) {
                    map.set(l, MapEntry::UNMAPPED);
                }
                lba = page_end;
            }
            _ => break,
        }
    }
}

/// Reads and verifies one whole record at a physical offset.
pub fn read_record(
    storage: &dyn Storage,
    sb: &Superblock,
    offset: u64,
    len: u32,
) -> Result<(RecordHeader, Vec<u8>), String> {
    let seg_rel = offset
        .checked_sub(sb.data_offset_bytes)
        .ok_or("record offset inside the metadata area")?;
    if (len as usize) < RECORD_HEADER_BYTES
        || seg_rel / sb.segment_size_bytes >= sb.segment_count()
        || seg_rel % sb.segment_size_bytes + u64::from(len) > sb.segment_size_bytes
    {
        return Err(format!(
            "record at {offset} (+{len}) crosses a segment boundary"
        ));
    }
    if offset
        .checked_add(u64::from(len))
        .is_none_or(|end| end > sb.physical_size_bytes)
    {
        return Err(format!(
            "record at {offset} (+{len}) beyond the physical size"
        ));
    }
    let mut b = vec![0u8; len as usize];
    storage.read_at(offset, &mut b).map_err(|e| e.to_string())?;
    let (h, _) = RecordHeader::decode_verified(&b).map_err(|e| e.to_string())?;
    if h.volume_tag != sb.volume_tag() || h.total_len() != len as usize {
        return Err("record belongs to another volume or has another length".into());
    }
    Ok((h, b))
}

fn load_checkpoint(
    storage: &dyn Storage,
    sb: &Superblock,
    p: &CheckpointPointer,
) -> Result<(BlockMap, Start), String> {
    let (h, rec) = read_record(storage, sb, p.commit_offset, p.commit_len)?;
    if h.kind != RecordKind::CkptCommit || h.seq != p.commit_seq || h.epoch != p.commit_epoch {
        return Err("pointer does not name its commit record".into());
    }
    let commit = CommitPayload::decode(&rec[RECORD_HEADER_BYTES..]).map_err(|e| e.to_string())?;
    if commit.logical_blocks != sb.logical_blocks() {
        return Err("checkpoint is for another logical size".into());
    }
    let mut map = BlockMap::new(sb.logical_blocks());
    for c in &commit.chunks {
        let (ch, rec) = read_record(storage, sb, c.offset, c.len)?;
        if ch.kind != RecordKind::MapChunk || ch.crc != c.crc {
            return Err(format!(
                "map chunk at {} is not the one the checkpoint names",
                c.offset
            ));
        }
        let raw = match ch.codec {
            CodecTag::Lz4 => {
                lz4_flex::block::decompress_size_prepended(&rec[RECORD_HEADER_BYTES..])
                    .map_err(|e| format!("map chunk: {e}"))?
            }
            CodecTag::None => rec[RECORD_HEADER_BYTES..].to_vec(),
            CodecTag::Zstd => return Err("map chunk with zstd codec".into()),
        };
        let mut bad = None;
        decode_runs(&raw, sb.logical_blocks(), |lba, e| {
            if let Err(why) = check_entry_location(sb, e) {
                bad.get_or_insert(format!("lba {lba}: {why}"));
            }
            map.set(lba, e);
        })
        .map_err(|e| e.to_string())?;
        if let Some(b) = bad {
            return Err(b);
        }
    }
    let seg_of = |off: u64| (off - sb.data_offset_bytes) / sb.segment_size_bytes;
    let mut checkpoint_segments = HashMap::new();
    for c in &commit.chunks {
        checkpoint_segments.insert(seg_of(c.offset), p.commit_seq);
    }
    checkpoint_segments.insert(seg_of(p.commit_offset), p.commit_seq);
    let seg_rel = p.commit_offset - sb.data_offset_bytes;
    let start = Start {
        segment: seg_rel / sb.segment_size_bytes,
        offset: (seg_rel % sb.segment_size_bytes) as usize + p.commit_len as usize,
        expected_seq: p.commit_seq + 1,
        epoch: p.commit_epoch,
        snapshot_seq: commit.snapshot_seq,
        checkpoint_segments,
    };
    Ok((map, start))
}

/// A data entry must point inside one segment of the data area.
pub fn check_entry_location(sb: &Superblock, e: MapEntry) -> Result<(), String> {
    if let EntryState::Data { offset, len, .. } = e.state().map_err(|e| e.to_string())? {
        let rel = offset
            .checked_sub(sb.data_offset_bytes)
            .ok_or("points into the metadata area")?;
        if rel / sb.segment_size_bytes >= sb.segment_count()
            || rel % sb.segment_size_bytes + u64::from(len) > sb.segment_size_bytes
        {
            return Err(format!("points outside the data area ({offset}+{len})"));
        }
    }
    Ok(())
}
