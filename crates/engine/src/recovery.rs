//! Opening a volume: newest valid checkpoint, then roll-forward along the
//! chain of records (seq + 1, same epoch or a newer EPOCH record) through the
//! segments written after it. See docs/FORMAT.md "Recovery".
use crate::map::BlockMap;
pub use crate::records::{walk_segment, SegmentWalk};
use cvol_format::checkpoint::{decode_runs, CommitPayload};
use cvol_format::pointer::POINTER_BYTES;
use cvol_format::record::{RecordHeader, RecordKind, RECORD_HEADER_BYTES};
use cvol_format::{
    align_up, CheckpointPointer, CodecTag, EntryState, MapEntry, Superblock, SECTOR_SIZE_BYTES,
};
use cvol_storage::Storage;
use std::collections::HashMap;

/// Most blocks one DATA record may hold (a 64 KiB compression unit).
pub const DATA_UNIT_BLOCKS_MAX: u32 = cvol_format::record::UNIT_BLOCKS_MAX;

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
    /// Seqs of damaged checkpoint records the roll-forward stepped over.
    pub skipped: Vec<u64>,
    /// Segments the roll-forward read records from.
    pub rolled_segments: Vec<u64>,
    /// What a salvage (`cvol check --repair`) could not save.
    pub salvage: Option<Salvage>,
}

/// What `salvage` could not save.
#[derive(Debug, Clone, Default)]
pub struct Salvage {
    /// Blocks whose newest flushed version is gone: their entries are now
    /// LOST (they read as EIO until written again).
    pub lost_lbas: Vec<u64>,
    /// Records below the certified seq that are gone and whose blocks
    /// cannot be told (their headers are destroyed): some block may read
    /// an older version. Listed by seq.
    pub unknown_records: Vec<u64>,
    /// The seq the volume had certified as flushed, and by what.
    pub certified: Certified,
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
    let index = first_record_index(storage, sb)?;
    let start = log_start(&index).ok_or("no log start (record seq 1) found")?;
    let mut map = BlockMap::new(sb.logical_blocks());
    let r = roll_forward(storage, sb, &mut map, start, &index, &HashMap::new())?;
    Ok(Recovered { map, ..r })
}

/// Roll-forward from the very first record (seq 1), if the log still has it.
fn log_start(index: &HashMap<u64, Vec<u64>>) -> Option<Start> {
    let &segment = index.get(&1)?.first()?;
    Some(Start {
        segment,
        offset: 0,
        expected_seq: 1,
        epoch: 0,
        snapshot_seq: 0,
        checkpoint_segments: HashMap::new(),
    })
}

/// The highest seq the volume has certified as durable, and what proves it.
/// Records up to `seq` were on the media: a recovery that ends below it
/// would drop flushed data, so it is refused instead.
#[derive(Debug, Clone, Default)]
pub struct Certified {
    pub seq: u64,
    pub by: String,
}

impl Certified {
    fn raise(&mut self, seq: u64, by: impl FnOnce() -> String) {
        if seq > self.seq {
            self.seq = seq;
            self.by = by();
        }
    }

    /// What the pointer slots certify: each slot that decodes was written
    /// only after the checkpoint it names was synced, so the log up to its
    /// commit seq was durable, even if that checkpoint is damaged now.
    fn from_pointers(ptrs: &[CheckpointPointer]) -> Certified {
        let mut c = Certified::default();
        for p in ptrs {
            c.raise(p.commit_seq, || {
                format!(
                    "checkpoint pointer generation {} (commit seq {})",
                    p.generation, p.commit_seq
                )
            });
        }
        c
    }

    /// What the log itself certifies: every SYNCED record (written only
    /// after the sync it names completed) and, when a pointer slot is
    /// damaged (it named some checkpoint, which one is unknown), the newest
    /// complete checkpoint in the log.
    fn raise_from_scan(&mut self, storage: &dyn Storage, sb: &Superblock, scan: &LogScan) {
        for r in &scan.records {
            if let Some(n) = r.synced {
                self.raise(n, || {
                    format!(
                        "a SYNCED record (seq {}) in segment {}",
                        r.header.seq, r.segment
                    )
                });
            }
        }
        if damaged_pointer_slots(storage) == 0 {
            return;
        }
        let chunks: std::collections::HashSet<(u64, u32)> = scan
            .records
            .iter()
            .filter(|r| r.header.kind == RecordKind::MapChunk)
            .map(|r| (sb.segment_offset(r.segment) + r.at as u64, r.header.crc))
            .collect();
        for c in scan
            .records
            .iter()
            .filter(|r| r.header.kind == RecordKind::CkptCommit)
        {
            let off = sb.segment_offset(c.segment) + c.at as u64;
            let complete = read_record(storage, sb, off, c.header.total_len() as u32)
                .ok()
                .and_then(|(_, rec)| CommitPayload::decode(&rec[RECORD_HEADER_BYTES..]).ok())
                .is_some_and(|cp| {
                    cp.chunks
                        .iter()
                        .all(|k| chunks.contains(&(k.offset, k.crc)))
                });
            if complete {
                self.raise(c.header.seq, || {
                    format!(
                        "the complete checkpoint with commit seq {} (a pointer slot that may \
                         have named it is damaged)",
                        c.header.seq
                    )
                });
            }
        }
    }
}

/// The highest certified seq found by reading the whole log (pointer
/// slots, every SYNCED record, the newest complete checkpoint when a slot
/// is damaged). Open looks only where the chain can lead; `check` and
/// repair, which read everything anyway, also catch damage that hides a
/// whole segment from the chain (its first records erased).
pub fn certified_in_log(storage: &dyn Storage, sb: &Superblock) -> Certified {
    let ptrs: Vec<CheckpointPointer> = read_pointers(storage).into_iter().flatten().collect();
    let mut c = Certified::from_pointers(&ptrs);
    c.raise_from_scan(storage, sb, &scan_log(storage, sb));
    c
}

/// Records a pointer names that recovery may step over when damaged,
/// because they change no block: the MAP_CHUNK and CKPT_COMMIT records of
/// the checkpoints the slots name (chunks have the seqs just below their
/// commit's). Keyed by seq: (physical offset, length, epoch).
fn known_checkpoint_records(
    storage: &dyn Storage,
    sb: &Superblock,
    ptrs: &[CheckpointPointer],
) -> HashMap<u64, (u64, u32, u32)> {
    let mut known = HashMap::new();
    for p in ptrs {
        known.insert(
            p.commit_seq,
            (p.commit_offset, p.commit_len, p.commit_epoch),
        );
        let Ok((h, rec)) = read_record(storage, sb, p.commit_offset, p.commit_len) else {
            continue;
        };
        if h.kind != RecordKind::CkptCommit || h.seq != p.commit_seq {
            continue;
        }
        let Ok(cp) = CommitPayload::decode(&rec[RECORD_HEADER_BYTES..]) else {
            continue;
        };
        let n = cp.chunks.len() as u64;
        for (i, c) in cp.chunks.iter().enumerate() {
            if let Some(seq) = (p.commit_seq + i as u64).checked_sub(n) {
                known.insert(seq, (c.offset, c.len, p.commit_epoch));
            }
        }
    }
    known
}

pub fn recover(storage: &dyn Storage, sb: &Superblock) -> Result<Recovered, String> {
    let mut warnings = Vec::new();
    let mut ptrs: Vec<CheckpointPointer> = read_pointers(storage).into_iter().flatten().collect();
    ptrs.sort_by_key(|p| std::cmp::Reverse(p.generation));
    // A slot that holds bytes but does not decode was damaged (create
    // zeroes both): the log may no longer reach seq 1, so it must not be
    // replayed from there as if no checkpoint had ever been written.
    let damaged_slots = damaged_pointer_slots(storage);
    if damaged_slots > 0 {
        warnings.push(format!(
            "{damaged_slots} checkpoint pointer slot(s) damaged"
        ));
    }
    let had_checkpoint = !ptrs.is_empty() || damaged_slots > 0;
    let index = first_record_index(storage, sb)?;
    let mut certified = Certified::from_pointers(&ptrs);
    let known = known_checkpoint_records(storage, sb, &ptrs);
    // Candidates, best first: the newest pointer; then (fallbacks) the older
    // pointer and the newest intact commit records found by scanning the
    // log. A fallback may name records in segments reused since, so its
    // result is accepted only if every record its map names verifies, and
    // only if its roll-forward reaches every seq the volume certified.
    let mut tried: Vec<u64> = Vec::new();
    let mut scan: Option<LogScan> = None;
    let mut short: Option<String> = None;
    let mut candidates: Vec<(CheckpointPointer, &'static str)> =
        ptrs.iter().map(|p| (*p, "pointer")).collect();
    let mut i = 0;
    while had_checkpoint && i <= candidates.len() {
        if i == candidates.len() {
            if scan.is_some() {
                break;
            }
            let sc = scan.insert(scan_log(storage, sb));
            certified.raise_from_scan(storage, sb, sc);
            let mut commits: Vec<&Scanned> = sc
                .records
                .iter()
                .filter(|r| r.header.kind == RecordKind::CkptCommit)
                .collect();
            commits.sort_by_key(|r| std::cmp::Reverse(r.header.seq));
            candidates.extend(commits.into_iter().map(|c| {
                let p = CheckpointPointer {
                    generation: 0,
                    commit_offset: sb.segment_offset(c.segment) + c.at as u64,
                    commit_len: c.header.total_len() as u32,
                    commit_epoch: c.header.epoch,
                    commit_seq: c.header.seq,
                };
                (p, "scan")
            }));
            continue;
        }
        let (p, source) = candidates[i];
        i += 1;
        if tried.contains(&p.commit_offset) {
            continue;
        }
        tried.push(p.commit_offset);
        let what = match source {
            "pointer" => format!("checkpoint generation {}", p.generation),
            _ => format!("checkpoint found in the log (commit seq {})", p.commit_seq),
        };
        let (mut map, start) = match load_checkpoint(storage, sb, &p) {
            Ok(x) => x,
            Err(e) => {
                warnings.push(format!("{what} unusable: {e}"));
                continue;
            }
        };
        let r = match roll_forward(storage, sb, &mut map, start, &index, &known) {
            Ok(r) => r,
            Err(e) => {
                warnings.push(format!("{what}: roll-forward failed: {e}"));
                continue;
            }
        };
        if let Some(c) = certified_beyond(storage, sb, &r, &index) {
            return Err(damaged_chain(r.last_seq, c, &warnings));
        }
        let newest = source == "pointer" && i == 1;
        if !newest {
            // A fallback: everything the log certifies counts (one full
            // scan, only on this rare path).
            if scan.is_none() {
                certified.raise_from_scan(storage, sb, scan.insert(scan_log(storage, sb)));
            }
            if r.last_seq < certified.seq {
                let m = format!(
                    "{what}: its roll-forward ends at seq {} (segment {}, byte {}), below seq {} \
                     certified as flushed by {}",
                    r.last_seq, r.segment, r.end, certified.seq, certified.by
                );
                warnings.push(m.clone());
                short.get_or_insert(m);
                continue;
            }
            if let Err(e) = verify_map_records(storage, sb, &map) {
                warnings.push(format!("{what} is stale: {e}"));
                continue;
            }
            warnings.push(format!("recovered from the {what}"));
        }
        if !r.skipped.is_empty() {
            warnings.push(format!(
                "damaged checkpoint records stepped over (seqs {:?}): they change no block",
                r.skipped
            ));
        }
        return Ok(Recovered {
            map,
            checkpoint_generation: p.generation,
            warnings,
            ..r
        });
    }
    // Segments are reused only after a durable checkpoint, so with no
    // pointer at all the whole log is still there to replay; with pointers
    // that all fail it may not be, and replaying it could silently return
    // old data: only `salvage`, asked for explicitly (`cvol check
    // --repair`), does that.
    if let Some(m) = short {
        return Err(format!(
            "flushed data is damaged: {m}; opening would silently lose what was flushed after \
             that point, so cvol refuses and writes nothing: `cvol check --repair` salvages every \
             intact record and lists the blocks that are lost ({})",
            warnings.join("; ")
        ));
    }
    if had_checkpoint {
        return Err(format!(
            "no usable checkpoint ({}); refusing to guess the map: \
             `cvol check --repair` rebuilds it from the log",
            warnings.join("; ")
        ));
    }
    let start = log_start(&index)
        .ok_or("no checkpoint and no log start found: the volume was never initialised")?;
    let mut map = BlockMap::new(sb.logical_blocks());
    let r = roll_forward(storage, sb, &mut map, start, &index, &known)?;
    if let Some(certified) = certified_beyond(storage, sb, &r, &index) {
        return Err(damaged_chain(r.last_seq, certified, &warnings));
    }
    Ok(Recovered {
        map,
        checkpoint_generation: 0,
        warnings,
        ..r
    })
}

fn damaged_chain(last_seq: u64, certified: u64, warnings: &[String]) -> String {
    let mut m = format!(
        "the log is damaged: its chain of records ends at seq {last_seq}, but a later record \
         certifies that records up to seq {certified} were flushed; opening would lose them \
         silently, so cvol refuses: `cvol check --repair` rebuilds the map from every intact record"
    );
    if !warnings.is_empty() {
        m += &format!(" ({})", warnings.join("; "));
    }
    m
}

/// The highest seq a SYNCED record found beyond the recovered chain's end
/// certifies as flushed, if the chain did not reach it: records the chain
/// should have passed are damaged (a crash's unsynced tail never is
/// certified: a SYNCED record is written only after its sync completed).
fn certified_beyond(
    storage: &dyn Storage,
    sb: &Superblock,
    r: &Recovered,
    index: &HashMap<u64, Vec<u64>>,
) -> Option<u64> {
    // The end's segment, those the roll-forward passed through (a record
    // copied elsewhere by a misdirected write can lead the chain away from
    // the segment that holds the rest), and those that start after it.
    let mut segs = vec![r.segment];
    segs.extend(&r.rolled_segments);
    for (&first, s) in index {
        if first > r.last_seq {
            segs.extend(s);
        }
    }
    segs.sort_unstable();
    segs.dedup();
    let mut best: Option<u64> = None;
    for s in segs {
        let Ok(buf) = read_segment(storage, sb, s) else {
            continue;
        };
        for (at, h) in walk_segment(&buf, sb.volume_tag()).records {
            if h.kind != RecordKind::Synced || h.seq <= r.last_seq {
                continue;
            }
            let Some(certified) =
                synced_payload(&buf[at + RECORD_HEADER_BYTES..at + h.total_len()])
            else {
                continue;
            };
            if certified > r.last_seq {
                best = Some(best.map_or(certified, |b| b.max(certified)));
            }
        }
    }
    best
}

/// The seq a SYNCED record's payload certifies.
fn synced_payload(payload: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(payload.get(..8)?.try_into().ok()?))
}

/// Every DATA entry of `map` names an intact record holding its block (a
/// fallback checkpoint may predate the reuse of segments it points into).
fn verify_map_records(
    storage: &dyn Storage,
    sb: &Superblock,
    map: &BlockMap,
) -> Result<(), String> {
    let mut seen: HashMap<u64, Option<RecordHeader>> = HashMap::new();
    let mut bad = None;
    map.for_each_mapped(|lba, e| {
        if bad.is_some() {
            return;
        }
        if let Ok(EntryState::Data { offset, len, .. }) = e.state() {
            let h = seen
                .entry(offset)
                .or_insert_with(|| read_record(storage, sb, offset, len).ok().map(|(h, _)| h));
            let ok = h.as_ref().is_some_and(|h| {
                h.kind == RecordKind::Data && e.block_in(h.crc) < h.nblocks.max(1)
            });
            if !ok {
                bad = Some(format!("lba {lba} names no intact record at byte {offset}"));
            }
        }
    });
    bad.map_or(Ok(()), Err)
}

/// Pointer slots that hold bytes but no valid pointer.
fn damaged_pointer_slots(storage: &dyn Storage) -> usize {
    (0..2)
        .filter(|&slot| {
            let mut b = vec![0u8; POINTER_BYTES];
            match storage.read_at(CheckpointPointer::slot_offset(slot), &mut b) {
                Err(_) => true,
                Ok(()) => {
                    b.iter().any(|&x| x != 0)
                        && CheckpointPointer::decode(&b)
                            .ok()
                            .filter(|p| p.slot() == slot)
                            .is_none()
                }
            }
        })
        .count()
}

/// A verified record found by scanning a segment.
pub struct Scanned {
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
pub struct LogScan {
    pub records: Vec<Scanned>,
    pub damaged: Vec<(u64, usize, String)>,
    /// Headers of damaged records of the segments' current lives (segment,
    /// byte, header), for repair to name the blocks they held.
    pub damaged_headers: Vec<(u64, usize, RecordHeader)>,
}

/// Walks every segment's chain of records (each at the end of the previous
/// one or at the next sector boundary, seq increasing); records of earlier
/// lives of a reused segment have lower seqs and end the walk.
pub fn scan_log(storage: &dyn Storage, sb: &Superblock) -> LogScan {
    let tag = sb.volume_tag();
    let mut out = LogScan {
        records: Vec::new(),
        damaged: Vec::new(),
        damaged_headers: Vec::new(),
    };
    for s in 0..sb.segment_count() {
        let Ok(buf) = read_segment(storage, sb, s) else {
            out.damaged.push((s, 0, "unreadable".into()));
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
            let ref_entry = (h.kind == RecordKind::Ref)
                .then(|| MapEntry::decode(&buf[at + RECORD_HEADER_BYTES..]).ok())
                .flatten();
            let synced = (h.kind == RecordKind::Synced)
                .then(|| synced_payload(&buf[at + RECORD_HEADER_BYTES..at + h.total_len()]))
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

/// Rebuilds the map from every record the log still holds, without any
/// checkpoint (`cvol check --repair` when no checkpoint is usable). Records
/// apply in (epoch, seq) order, so a later epoch's writes win over records a
/// crashed epoch left behind. What it cannot know: a block whose newest
/// history (a TRIM, an overwrite) sat only in segments already reused may
/// come back with an older version; the warnings say how many records and
/// which damaged places were involved.
pub fn rebuild_from_log(storage: &dyn Storage, sb: &Superblock) -> Result<Recovered, String> {
    let scan = scan_log(storage, sb);
    let mut recs: Vec<&Scanned> = scan.records.iter().collect();
    if recs.is_empty() {
        return Err("no intact record in the log: nothing to rebuild from".into());
    }
    recs.sort_by_key(|r| (r.header.epoch, r.header.seq));
    let data_at: HashMap<u64, &RecordHeader> = scan
        .records
        .iter()
        .filter(|r| r.header.kind == RecordKind::Data)
        .map(|r| (sb.segment_offset(r.segment) + r.at as u64, &r.header))
        .collect();
    let mut map = BlockMap::new(sb.logical_blocks());
    let mut needed: HashMap<u64, u64> = HashMap::new();
    let (mut applied, mut dropped_refs) = (0u64, Vec::new());
    for r in &recs {
        let h = &r.header;
        let m = needed.entry(r.segment).or_insert(0);
        *m = (*m).max(h.seq);
        if h.kind == RecordKind::Ref {
            // The target must be an intact DATA record holding that block.
            let ok = r.ref_entry.is_some_and(|e| match e.state() {
                Ok(EntryState::Data { offset, .. }) => data_at
                    .get(&offset)
                    .is_some_and(|t| e.block_in(t.crc) < t.nblocks.max(1)),
                _ => false,
            });
            if !ok {
                dropped_refs.push(h.lba);
                continue;
            }
        }
        applied += u64::from(apply_scanned(&mut map, sb, r));
    }
    let last = recs.last().expect("not empty");
    let mut warnings = vec![format!(
        "map rebuilt from {} records of the log without a checkpoint ({} map changes); \
         blocks whose newest history was only in reused segments may hold an older version",
        recs.len(),
        applied
    )];
    for (s, at, e) in &scan.damaged {
        warnings.push(format!(
            "segment {s} at byte {at}: damaged record ({e}); the rest of that segment was skipped"
        ));
    }
    if !dropped_refs.is_empty() {
        dropped_refs.truncate(100);
        warnings.push(format!(
            "dedup references whose target record is lost were dropped (LBAs {:?}): those blocks read as holes",
            dropped_refs
        ));
    }
    // The log continues after every record of the head's segment: records
    // of a crashed epoch may lie beyond the newest one, and the map may
    // name them now.
    let end = recs
        .iter()
        .filter(|r| r.segment == last.segment)
        .map(|r| r.at + r.header.total_len())
        .max()
        .unwrap_or(0);
    Ok(Recovered {
        map,
        segment: last.segment,
        end,
        last_seq: recs.iter().map(|r| r.header.seq).max().unwrap_or(0),
        last_epoch: recs.iter().map(|r| r.header.epoch).max().unwrap_or(0),
        checkpoint_generation: 0,
        replayed_records: recs.len() as u64,
        replayed_map_records: applied.max(1),
        snapshot_seq: 0,
        needed_segments: needed,
        warnings,
        skipped: Vec::new(),
        salvage: None,
        rolled_segments: Vec::new(),
    })
}

/// A starting point for `salvage`: a checkpoint whose commit record
/// verifies, with every intact chunk loaded; the LBA spans of damaged
/// chunks are unknown.
struct SalvageBase {
    map: BlockMap,
    start: Start,
    lost_spans: Vec<(u64, u64)>,
    what: String,
}

fn load_checkpoint_partial(
    storage: &dyn Storage,
    sb: &Superblock,
    p: &CheckpointPointer,
    what: String,
) -> Result<SalvageBase, String> {
    let (h, rec) = read_record(storage, sb, p.commit_offset, p.commit_len)?;
    if h.kind != RecordKind::CkptCommit || h.seq != p.commit_seq || h.epoch != p.commit_epoch {
        return Err("pointer does not name its commit record".into());
    }
    let commit = CommitPayload::decode(&rec[RECORD_HEADER_BYTES..]).map_err(|e| e.to_string())?;
    if commit.logical_blocks != sb.logical_blocks() {
        return Err("checkpoint is for another logical size".into());
    }
    let mut map = BlockMap::new(sb.logical_blocks());
    // Chunks hold runs in LBA order: a damaged chunk's span lies between
    // the intact chunks around it.
    // Per chunk: Some(span, if it holds entries) when intact, None when damaged.
    let mut spans: Vec<Option<Option<(u64, u64)>>> = Vec::new();
    let mut checkpoint_segments = HashMap::new();
    for c in &commit.chunks {
        if let Some((seg, _)) = sb.locate(c.offset) {
            checkpoint_segments.insert(seg, p.commit_seq);
        }
        let entries = read_chunk(storage, sb, c.offset, c.len, c.crc);
        match entries {
            Ok(v) => {
                spans.push(Some(v.first().map(|f| (f.0, v[v.len() - 1].0 + 1))));
                v.into_iter().for_each(|(lba, e)| {
                    map.set(lba, e);
                });
            }
            Err(_) => spans.push(None),
        }
    }
    let mut lost_spans = Vec::new();
    for (i, sp) in spans.iter().enumerate() {
        if sp.is_some() {
            continue;
        }
        let from = spans[..i]
            .iter()
            .rev()
            .flatten()
            .flatten()
            .next()
            .map_or(0, |s| s.1);
        let to = spans[i + 1..]
            .iter()
            .flatten()
            .flatten()
            .next()
            .map_or(sb.logical_blocks(), |s| s.0);
        if lost_spans.last().is_none_or(|&(_, e)| e < from) {
            lost_spans.push((from, to));
        }
    }
    if let Some((seg, _)) = sb.locate(p.commit_offset) {
        checkpoint_segments.insert(seg, p.commit_seq);
    }
    let (segment, at) = sb
        .locate(p.commit_offset)
        .ok_or("commit outside the data area")?;
    Ok(SalvageBase {
        map,
        start: Start {
            segment,
            offset: at + p.commit_len as usize,
            expected_seq: p.commit_seq + 1,
            epoch: p.commit_epoch,
            snapshot_seq: commit.snapshot_seq,
            checkpoint_segments,
        },
        lost_spans,
        what,
    })
}

/// The entries of one MAP_CHUNK record, verified.
fn read_chunk(
    storage: &dyn Storage,
    sb: &Superblock,
    offset: u64,
    len: u32,
    crc: u32,
) -> Result<Vec<(u64, MapEntry)>, String> {
    let (ch, rec) = read_record(storage, sb, offset, len)?;
    if ch.kind != RecordKind::MapChunk || ch.crc != crc {
        return Err(format!(
            "map chunk at {offset} is not the one the checkpoint names"
        ));
    }
    let raw = match ch.codec {
        CodecTag::Lz4 => lz4_flex::block::decompress_size_prepended(&rec[RECORD_HEADER_BYTES..])
            .map_err(|e| format!("map chunk: {e}"))?,
        CodecTag::None => rec[RECORD_HEADER_BYTES..].to_vec(),
        CodecTag::Zstd => return Err("map chunk with zstd codec".into()),
    };
    let mut out = Vec::new();
    let mut bad = None;
    decode_runs(&raw, sb.logical_blocks(), |lba, e| {
        if let Err(why) = check_entry_location(sb, e) {
            bad.get_or_insert(format!("lba {lba}: {why}"));
        }
        out.push((lba, e));
    })
    .map_err(|e| e.to_string())?;
    bad.map_or(Ok(out), Err)
}

/// One salvage walk from `base` over every record the scan found.
struct SalvageWalk {
    recovered: Recovered,
    unknown: Vec<u64>,
}

/// Rolls forward from `base` like recovery, but below the certified seq a
/// missing record does not end the walk: the blocks of a damaged record
/// (its header tells which) become LOST, a record whose header is gone too
/// is counted as unknown, and the walk goes on with the records after it
/// (in the same segment and later ones), so nothing intact is dropped.
/// Above the certified seq the first gap ends it, as in recovery (an
/// unsynced crash tail, never acknowledged as flushed).
fn salvage_walk(
    sb: &Superblock,
    scan: &LogScan,
    base: SalvageBase,
    certified: &Certified,
    known: &HashMap<u64, (u64, u32, u32)>,
) -> SalvageWalk {
    let mut by_seq: HashMap<u64, Vec<&Scanned>> = HashMap::new();
    for r in &scan.records {
        by_seq.entry(r.header.seq).or_default().push(r);
    }
    let mut damaged_by_seq: HashMap<u64, Vec<&(u64, usize, RecordHeader)>> = HashMap::new();
    for d in &scan.damaged_headers {
        damaged_by_seq.entry(d.2.seq).or_default().push(d);
    }
    let max_seq = scan
        .records
        .iter()
        .map(|r| r.header.seq)
        .chain(scan.damaged_headers.iter().map(|d| d.2.seq))
        .max()
        .unwrap_or(0)
        .max(certified.seq);
    let SalvageBase {
        mut map,
        start,
        lost_spans,
        what,
    } = base;
    for &(a, b) in &lost_spans {
        (a..b).for_each(|l| {
            map.set(l, MapEntry::LOST);
        });
    }
    let mut needed = start.checkpoint_segments.clone();
    let (mut expected, mut epoch) = (start.expected_seq, start.epoch);
    let (mut gap, mut replayed, mut applied) = (false, 0u64, 0u64);
    let mut last: Option<(u64, usize)> = Some((start.segment, start.offset));
    let mut unknown = Vec::new();
    let mut warnings = vec![format!("salvage from the {what}")];
    if !lost_spans.is_empty() {
        warnings.push(format!(
            "damaged map chunks of that checkpoint: LBA spans {lost_spans:?} are lost unless written after it"
        ));
    }
    while expected <= max_seq {
        let pick = by_seq.get(&expected).and_then(|v| {
            v.iter()
                .filter(|r| {
                    let h = &r.header;
                    h.epoch == epoch
                        || (h.kind == RecordKind::Epoch && h.epoch > epoch)
                        || (gap && h.epoch >= epoch)
                })
                .max_by_key(|r| r.header.epoch)
        });
        if let Some(r) = pick {
            let h = &r.header;
            applied += u64::from(apply_scanned(&mut map, sb, r));
            replayed += 1;
            let m = needed.entry(r.segment).or_insert(0);
            *m = (*m).max(h.seq);
            last = Some((r.segment, r.at + h.total_len()));
            epoch = h.epoch;
            expected += 1;
            gap = false;
            continue;
        }
        if expected > certified.seq {
            break; // an unsynced tail: recovery drops it too
        }
        gap = true;
        let damaged = damaged_by_seq.get(&expected).and_then(|v| {
            v.iter()
                .filter(|d| d.2.epoch >= epoch)
                .max_by_key(|d| d.2.epoch)
        });
        match damaged {
            Some(&&(seg, _, h)) => {
                let m = needed.entry(seg).or_insert(0);
                *m = (*m).max(h.seq);
                let end = (h.lba + u64::from(h.nblocks.min(DATA_UNIT_BLOCKS_MAX)))
                    .min(sb.logical_blocks());
                match h.kind {
                    RecordKind::Data => (h.lba..end).filter(|&l| h.maps(l)).for_each(|l| {
                        map.set(l, MapEntry::LOST);
                    }),
                    RecordKind::Zero | RecordKind::Trim | RecordKind::Ref => {
                        (h.lba..end).for_each(|l| {
                            map.set(l, MapEntry::LOST);
                        })
                    }
                    RecordKind::Epoch => epoch = epoch.max(h.epoch),
                    RecordKind::MapChunk | RecordKind::CkptCommit | RecordKind::Synced => {}
                }
            }
            None if known.contains_key(&expected) => {} // a checkpoint record: no blocks
            None => unknown.push(expected),
        }
        expected += 1;
    }
    let mut lost_lbas = Vec::new();
    map.for_each_mapped(|l, e| {
        if e == MapEntry::LOST {
            lost_lbas.push(l);
        }
    });
    if !lost_lbas.is_empty() {
        warnings.push(format!(
            "{} block(s) lost (their newest flushed version was destroyed; they read as EIO until \
             written again): LBAs {}",
            lost_lbas.len(),
            lba_list(&lost_lbas)
        ));
    }
    if !unknown.is_empty() {
        warnings.push(format!(
            "{} record(s) below the certified seq {} are destroyed with their headers (seqs {}): \
             the blocks they held cannot be told and may read an older version",
            unknown.len(),
            certified.seq,
            lba_list(&unknown)
        ));
    }
    // The log continues after every record of the head's segment, intact or
    // damaged: nothing the map may name is overwritten.
    let (segment, _) = last.unwrap_or((start.segment, start.offset));
    let end = scan
        .records
        .iter()
        .filter(|r| r.segment == segment)
        .map(|r| r.at + r.header.total_len())
        .chain(
            scan.damaged_headers
                .iter()
                .filter(|d| d.0 == segment)
                .map(|d| (d.1 + d.2.total_len()).min(sb.segment_size_bytes as usize)),
        )
        .chain(last.map(|l| l.1))
        .max()
        .unwrap_or(0);
    let all_seqs = scan.records.iter().map(|r| (r.header.seq, r.header.epoch));
    let recovered = Recovered {
        map,
        segment,
        end,
        last_seq: all_seqs
            .clone()
            .map(|x| x.0)
            .max()
            .unwrap_or(0)
            .max(expected - 1),
        last_epoch: all_seqs.map(|x| x.1).max().unwrap_or(0).max(epoch),
        checkpoint_generation: 0,
        replayed_records: replayed,
        replayed_map_records: applied.max(1),
        snapshot_seq: start.snapshot_seq,
        needed_segments: needed,
        warnings,
        skipped: Vec::new(),
        rolled_segments: Vec::new(),
        salvage: Some(Salvage {
            lost_lbas,
            unknown_records: unknown.clone(),
            certified: certified.clone(),
        }),
    };
    SalvageWalk { recovered, unknown }
}

/// A short list of numbers for messages (the first 100, then a count).
pub fn lba_list(v: &[u64]) -> String {
    let mut s = format!("{:?}", &v[..v.len().min(100)]);
    if v.len() > 100 {
        s += &format!(" and {} more", v.len() - 100);
    }
    s
}

/// Salvages a volume whose recovery refused (`cvol check --repair`): from
/// the best checkpoint whose commit record is intact, every intact record
/// of the log applies in chain order, records after a damaged one
/// included; the blocks a damaged record held (named by its header) become
/// LOST — they read as EIO until written again — rather than silently
/// keeping an older version or zeros. A checkpoint whose chunks are all
/// intact and whose walk finds every record's blocks is preferred (exact);
/// otherwise the newest one, with the spans of its damaged chunks lost.
/// Without any usable checkpoint: the walk from the log's first record, or
/// else `rebuild_from_log`.
pub fn salvage(storage: &dyn Storage, sb: &Superblock) -> Result<Recovered, String> {
    let scan = scan_log(storage, sb);
    let mut r = salvage_from(storage, sb, &scan)?;
    if r.salvage.as_ref().is_some_and(|s| s.unknown_records != [0]) {
        // (rebuild_from_log lists the damaged records itself.)
        for (s, at, e) in scan.damaged.iter().take(100) {
            r.warnings
                .push(format!("segment {s} at byte {at}: damaged record ({e})"));
        }
    }
    Ok(r)
}

fn salvage_from(
    storage: &dyn Storage,
    sb: &Superblock,
    scan: &LogScan,
) -> Result<Recovered, String> {
    let mut ptrs: Vec<CheckpointPointer> = read_pointers(storage).into_iter().flatten().collect();
    ptrs.sort_by_key(|p| std::cmp::Reverse(p.generation));
    let mut certified = Certified::from_pointers(&ptrs);
    certified.raise_from_scan(storage, sb, scan);
    let known = known_checkpoint_records(storage, sb, &ptrs);
    let mut commits: Vec<(CheckpointPointer, String)> = ptrs
        .iter()
        .map(|p| (*p, format!("checkpoint generation {}", p.generation)))
        .collect();
    let mut scanned: Vec<&Scanned> = scan
        .records
        .iter()
        .filter(|r| r.header.kind == RecordKind::CkptCommit)
        .collect();
    scanned.sort_by_key(|r| std::cmp::Reverse(r.header.seq));
    commits.extend(scanned.into_iter().map(|c| {
        (
            CheckpointPointer {
                generation: 0,
                commit_offset: sb.segment_offset(c.segment) + c.at as u64,
                commit_len: c.header.total_len() as u32,
                commit_epoch: c.header.epoch,
                commit_seq: c.header.seq,
            },
            format!("checkpoint found in the log (commit seq {})", c.header.seq),
        )
    }));
    let mut fallback: Option<SalvageWalk> = None;
    let mut tried = Vec::new();
    for (p, what) in commits {
        if tried.contains(&p.commit_offset) {
            continue;
        }
        tried.push(p.commit_offset);
        let Ok(base) = load_checkpoint_partial(storage, sb, &p, what) else {
            continue;
        };
        let complete = base.lost_spans.is_empty();
        let walk = salvage_walk(sb, scan, base, &certified, &known);
        // Every seq from the base on was found (intact, or damaged with
        // its blocks named): nothing between was reused, so the map names
        // no place reused since, and it is exact but for the LOST blocks.
        if complete && walk.unknown.is_empty() {
            return Ok(walk.recovered);
        }
        fallback.get_or_insert(walk);
    }
    if let Some(w) = fallback {
        return Ok(w.recovered);
    }
    // No checkpoint at all: from the log's first record, if it is still there.
    let index = first_record_index(storage, sb)?;
    if let Some(start) = log_start(&index) {
        let base = SalvageBase {
            map: BlockMap::new(sb.logical_blocks()),
            start,
            lost_spans: Vec::new(),
            what: "start of the log (seq 1)".into(),
        };
        return Ok(salvage_walk(sb, scan, base, &certified, &known).recovered);
    }
    let mut r = rebuild_from_log(storage, sb)?;
    r.salvage = Some(Salvage {
        lost_lbas: Vec::new(),
        unknown_records: vec![0],
        certified,
    });
    Ok(r)
}

/// Rewrites a damaged superblock copy from the intact one. Returns what it did.
pub fn repair_superblocks(storage: &dyn Storage) -> Result<Vec<String>, String> {
    let offs = [
        cvol_format::SUPERBLOCK_A_OFFSET,
        cvol_format::SUPERBLOCK_B_OFFSET,
    ];
    let read = |off: u64| -> Option<Superblock> {
        let mut b = vec![0u8; cvol_format::superblock::SUPERBLOCK_BYTES];
        storage.read_at(off, &mut b).ok()?;
        Superblock::decode(&b).ok()
    };
    let copies = [read(offs[0]), read(offs[1])];
    let Some(good) = copies.iter().flatten().next().cloned() else {
        return Err("both superblock copies are damaged: cannot repair".into());
    };
    let mut notes = Vec::new();
    for (i, c) in copies.iter().enumerate() {
        if c.as_ref() != Some(&good) {
            storage
                .write_at(offs[i], &good.encode())
                .map_err(|e| e.to_string())?;
            notes.push(format!(
                "superblock copy {} rewritten from copy {}",
                ["A", "B"][i],
                ["B", "A"][i]
            ));
        }
    }
    if !notes.is_empty() {
        storage.sync().map_err(|e| e.to_string())?;
    }
    Ok(notes)
}

/// Key of `first_record_index` under which segments whose start holds
/// bytes but no record header of this volume are listed (damage, or a
/// misdirected write: their records may still matter).
const DAMAGED_START: u64 = u64::MAX;

/// Seq of the first record of every segment whose first header decodes;
/// under `DAMAGED_START`, segments whose start is neither that nor zeros.
/// A segment that cannot be read fails the open: it may hold the log's
/// continuation, and guessing would end the chain early.
fn first_record_index(
    storage: &dyn Storage,
    sb: &Superblock,
) -> Result<HashMap<u64, Vec<u64>>, String> {
    let mut index: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut b = [0u8; RECORD_HEADER_BYTES];
    for s in 0..sb.segment_count() {
        storage
            .read_at(sb.segment_offset(s), &mut b)
            .map_err(|e| format!("reading the start of segment {s}: {e}"))?;
        match RecordHeader::decode(&b) {
            Ok(h) if h.volume_tag == sb.volume_tag() => index.entry(h.seq).or_default().push(s),
            Ok(_) => {}
            Err(_) if b.iter().any(|&x| x != 0) => index.entry(DAMAGED_START).or_default().push(s),
            Err(_) => {}
        }
    }
    Ok(index)
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
    known: &HashMap<u64, (u64, u32, u32)>,
) -> Result<Recovered, String> {
    let tag = sb.volume_tag();
    let (mut segment, mut pos, mut expected, mut epoch) =
        (start.segment, start.offset, start.expected_seq, start.epoch);
    let mut needed = start.checkpoint_segments.clone();
    let mut buf = read_segment(storage, sb, segment)?;
    let mut replayed = 0u64;
    let mut map_records = 0u64;
    let mut skipped = Vec::new();
    let mut rolled_segments = vec![segment];
    loop {
        let aligned = align_up(pos as u64, SECTOR_SIZE_BYTES) as usize;
        let found = chain_record_at(&buf, pos, tag, expected, epoch)
            .map(|h| (pos, h))
            .or_else(|| chain_record_at(&buf, aligned, tag, expected, epoch).map(|h| (aligned, h)));
        let (at, h) = match found {
            Some(x) => x,
            // A damaged MAP_CHUNK or CKPT_COMMIT that a pointer names, just
            // where the chain expects it: it changes no block, so the chain
            // steps over it (a damaged newest checkpoint must not cut the
            // roll-forward from the older one short).
            None if known.get(&expected).is_some_and(|&(off, _, ep)| {
                sb.locate(off).is_some_and(|(s, at)| {
                    ep == epoch
                        && ((s == segment && (at == pos || at == aligned))
                            || (s != segment && at == 0))
                })
            }) =>
            {
                let (off, len, _) = known[&expected];
                let (s, at) = sb.locate(off).expect("checked above");
                if s != segment {
                    buf = read_segment(storage, sb, s)?;
                    segment = s;
                    rolled_segments.push(s);
                }
                skipped.push(expected);
                let m = needed.entry(segment).or_insert(0);
                *m = (*m).max(expected);
                pos = at + len as usize;
                expected += 1;
                continue;
            }
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
                rolled_segments.push(next);
                segment = next;
                buf = nbuf;
                pos = 0;
                continue;
            }
        };
        // chain_record_at verified a whole record of the expected seq.
        assert!(at + h.total_len() <= buf.len() && h.seq == expected);
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
        skipped,
        salvage: None,
        rolled_segments,
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
                    crate::records::unit_entry(h.codec, offset, len, h.crc, h.nblocks, k),
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
        RecordKind::Epoch | RecordKind::MapChunk | RecordKind::CkptCommit | RecordKind::Synced => {
            Ok(())
        }
    }
}

/// Applies a record found by `scan_log` (its REF payload kept as the
/// decoded entry). True if it changed the map (DATA, ZERO, TRIM, REF).
fn apply_scanned(map: &mut BlockMap, sb: &Superblock, r: &Scanned) -> bool {
    let mut b = [0u8; cvol_format::mapentry::MAP_ENTRY_BYTES];
    if let Some(e) = r.ref_entry {
        e.encode(&mut b);
    }
    let payload = if r.ref_entry.is_some() {
        &b[..]
    } else {
        &[][..]
    };
    let offset = sb.segment_offset(r.segment) + r.at as u64;
    apply(map, sb, &r.header, offset, payload).is_ok()
        && matches!(
            r.header.kind,
            RecordKind::Data | RecordKind::Zero | RecordKind::Trim | RecordKind::Ref
        )
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

#[cfg(test)]
mod walk_tests {
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
        };
        encode_record(&mut h, payload)
    }

    /// Found by the fault simulation (seed 247): a misdirected write put a
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
        assert!(walk.damaged[0].1.contains("lba 5+1"), "{:?}", walk.damaged);
    }
}
