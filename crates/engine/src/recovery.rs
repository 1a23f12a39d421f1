//! Opening a volume: newest valid checkpoint, then roll-forward along the
//! chain of records (seq + 1, same epoch or a newer EPOCH record) through the
//! segments written after it. See docs/FORMAT.md "Recovery".
pub use crate::error::MetaError;
use crate::error::{RecoveryError, ShortRollForward, SuperblockCopyError};
use crate::liveness::LoadedTables;
use crate::map::{BlockMap, Page, PageSource};
pub use crate::records::{walk_segment, SegmentWalk};
use cvol_format::checkpoint::{decode_runs, ChunkRef, CommitPayload, DirPayload, PageRef};
use cvol_format::checkpoint::{DIR_PAGES, MAP_PAGE_BLOCKS};
use cvol_format::fprints::directory_tables;
use cvol_format::pointer::POINTER_BYTES;
use cvol_format::record::{RecordHeader, RecordKind, RECORD_HEADER_BYTES};
use cvol_format::tables::{table_count, TableGroup, TableRoot};
use cvol_format::{
    align_up, superblock::PACKING_PAGE_BYTES, CheckpointPointer, CodecTag, EntryState, MapEntry,
    Superblock, SECTOR_SIZE_BYTES,
};
use cvol_storage::Storage;
use std::collections::HashMap;

/// An empty map of the volume, with directory slots for its tables.
pub fn volume_map(sb: &Superblock) -> BlockMap {
    let tables = directory_tables(sb.segment_count(), sb.segment_size_bytes);
    BlockMap::with_tables(sb.logical_blocks(), tables as usize)
}

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
    /// The liveness tables the checkpoint persisted, if it named them all.
    pub(crate) tables: Option<LoadedTables>,
    /// Offsets of the DATA records roll-forward replayed.
    pub(crate) new_records: Vec<u64>,
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
    /// The metadata head's position at the snapshot, on a volume with a
    /// metadata device (its records continue the chain there too).
    meta: Option<(u64, usize)>,
    expected_seq: u64,
    epoch: u32,
    snapshot_seq: u64,
    /// Segments holding the checkpoint's records, with their highest seq.
    checkpoint_segments: HashMap<u64, u64>,
}

/// The superblock: copy A, else copy B (with a warning naming what is
/// wrong with A). A copy that decodes is used even if it claims more bytes
/// than the backing store has: that fails the open.
pub fn read_superblock(storage: &dyn Storage) -> Result<(Superblock, Vec<String>), RecoveryError> {
    let mut warnings = Vec::new();
    let mut errors = Vec::new();
    for (name, off) in [
        ("A", cvol_format::SUPERBLOCK_A_OFFSET),
        ("B", cvol_format::SUPERBLOCK_B_OFFSET),
    ] {
        let mut b = vec![0u8; cvol_format::superblock::SUPERBLOCK_BYTES];
        let res = storage
            .read_at(off, &mut b)
            .map_err(SuperblockCopyError::Read)
            .and_then(|_| Superblock::decode(&b).map_err(SuperblockCopyError::Invalid));
        match res {
            Ok(sb) => {
                if sb.physical_size_bytes > storage.len_bytes() {
                    return Err(RecoveryError::SuperblockBeyondBacking {
                        physical_size_bytes: sb.physical_size_bytes,
                        backing_bytes: storage.len_bytes(),
                    });
                }
                return Ok((sb, warnings));
            }
            Err(e) => {
                warnings.push(format!("superblock copy {name} unusable: {e}"));
                errors.push(e);
            }
        }
    }
    let [copy_a, copy_b]: [SuperblockCopyError; 2] =
        errors.try_into().expect("both copies were tried");
    Err(RecoveryError::NoSuperblock { copy_a, copy_b })
}

/// Refuses a store that lacks the volume's metadata device (the data store
/// alone, of a volume that has one): its map would be out of reach.
pub fn require_metadata_device(
    storage: &dyn Storage,
    sb: &Superblock,
) -> Result<(), RecoveryError> {
    let end = sb.metadata_base() + u64::from(sb.metadata_segments) * sb.segment_size_bytes;
    if sb.has_metadata_device() && storage.len_bytes() < end {
        return Err(RecoveryError::MetadataDeviceMissing {
            segments: sb.metadata_segments,
        });
    }
    Ok(())
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
pub fn replay_full(storage: &dyn Storage, sb: &Superblock) -> Result<Recovered, RecoveryError> {
    let index = first_record_index(storage, sb)?;
    let start = log_start(&index).ok_or(RecoveryError::NoLogStart)?;
    let mut map = volume_map(sb);
    let r = roll_forward(storage, sb, &mut map, start, &index, &HashMap::new())?;
    Ok(Recovered { map, ..r })
}

/// Roll-forward from the very first record (seq 1), if the log still has it.
fn log_start(index: &HashMap<u64, Vec<u64>>) -> Option<Start> {
    let &segment = index.get(&1)?.first()?;
    Some(Start {
        segment,
        offset: 0,
        meta: None,
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
            .filter(|r| matches!(r.header.kind, RecordKind::MapChunk | RecordKind::MapDir))
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
        let dirs: Vec<Result<DirRead, String>> =
            cp.chunks.iter().map(|c| read_dir(storage, sb, c)).collect();
        if !dirs.iter().any(Result::is_ok) {
            // MAP_CHUNKs of the whole map, appended just before the commit.
            let n = cp.chunks.len() as u64;
            for (i, c) in cp.chunks.iter().enumerate() {
                if let Some(seq) = (p.commit_seq + i as u64).checked_sub(n) {
                    known.insert(seq, (c.offset, c.len, p.commit_epoch));
                }
            }
            continue;
        }
        // A paged map: the directory blocks and pages this checkpoint wrote
        // (after its snapshot) lie among the records roll-forward passes
        // over; their seqs are in the directory.
        for (_, d, pages) in dirs.into_iter().flatten() {
            for r in std::iter::once(d).chain(pages.into_iter().map(|(_, r)| r)) {
                if r.seq > cp.snapshot_seq && r.seq < p.commit_seq {
                    known.insert(r.seq, (r.offset, r.len, p.commit_epoch));
                }
            }
        }
    }
    known
}

/// The valid pointer slots, newest generation first.
fn pointers_newest_first(storage: &dyn Storage) -> Vec<CheckpointPointer> {
    let mut ptrs: Vec<CheckpointPointer> = read_pointers(storage).into_iter().flatten().collect();
    ptrs.sort_by_key(|p| std::cmp::Reverse(p.generation));
    ptrs
}

/// The intact CKPT_COMMIT records a scan found, newest (highest seq) first,
/// as pointers (generation 0): the fallbacks once the pointer slots fail.
fn scanned_commits(sb: &Superblock, scan: &LogScan) -> Vec<CheckpointPointer> {
    let mut commits: Vec<&Scanned> = scan
        .records
        .iter()
        .filter(|r| r.header.kind == RecordKind::CkptCommit)
        .collect();
    commits.sort_by_key(|r| std::cmp::Reverse(r.header.seq));
    commits
        .into_iter()
        .map(|c| CheckpointPointer {
            generation: 0,
            commit_offset: sb.segment_offset(c.segment) + c.at as u64,
            commit_len: c.header.total_len() as u32,
            commit_epoch: c.header.epoch,
            commit_seq: c.header.seq,
        })
        .collect()
}

/// Where a candidate checkpoint comes from: a pointer slot, or a commit
/// record found by scanning the log.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Source {
    Pointer,
    Scan,
}

impl Source {
    /// How messages name the checkpoint `p` from this source.
    fn name(self, p: &CheckpointPointer) -> String {
        match self {
            Source::Pointer => format!("checkpoint generation {}", p.generation),
            Source::Scan => format!("checkpoint found in the log (commit seq {})", p.commit_seq),
        }
    }
}

/// Recovers the map when opening a volume (docs/FORMAT.md "Recovery"): the
/// newest usable checkpoint and the roll-forward from it, or a replay from
/// seq 1 when no checkpoint was ever written. Refuses, writing nothing, when
/// checkpoints existed but none is usable, or when the result would end
/// below a certified seq (`cvol check --repair` salvages then).
pub fn recover(storage: &dyn Storage, sb: &Superblock) -> Result<Recovered, RecoveryError> {
    recover_with(storage, sb, false)
}

/// `recover`, leaving the checkpoint's map pages on disk (each read once
/// to verify it, then dropped): the volume faults them in as it needs
/// them. Roll-forward faults in the pages it changes.
pub fn recover_lazy(storage: &dyn Storage, sb: &Superblock) -> Result<Recovered, RecoveryError> {
    recover_with(storage, sb, true)
}

fn recover_with(
    storage: &dyn Storage,
    sb: &Superblock,
    lazy: bool,
) -> Result<Recovered, RecoveryError> {
    let mut warnings = Vec::new();
    let ptrs = pointers_newest_first(storage);
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
    let certified = Certified::from_pointers(&ptrs);
    let known = known_checkpoint_records(storage, sb, &ptrs);
    if !had_checkpoint {
        return replay_without_checkpoint(storage, sb, &index, &known, warnings);
    }
    let search = CheckpointSearch {
        storage,
        sb,
        index: &index,
        known: &known,
        lazy,
        certified,
        warnings,
        scan: None,
        shortfall: None,
        chain_gap: None,
    };
    search.run(&ptrs)
}

/// Recovery of a volume that never published a checkpoint (both pointer
/// slots zeros): segments are reused only after a durable checkpoint, so
/// the whole log is still there and is replayed from seq 1.
fn replay_without_checkpoint(
    storage: &dyn Storage,
    sb: &Superblock,
    index: &HashMap<u64, Vec<u64>>,
    known: &HashMap<u64, (u64, u32, u32)>,
    warnings: Vec<String>,
) -> Result<Recovered, RecoveryError> {
    let start = log_start(index).ok_or(RecoveryError::NeverInitialised)?;
    let mut map = volume_map(sb);
    let r = roll_forward(storage, sb, &mut map, start, index, known)?;
    if let Some(certified) = certified_beyond(storage, sb, &r, index) {
        return Err(RecoveryError::ChainEndsBeforeCertified {
            last_seq: r.last_seq,
            certified,
            notes: warnings,
        });
    }
    Ok(Recovered {
        map,
        checkpoint_generation: 0,
        warnings,
        ..r
    })
}

/// `recover`'s search for a checkpoint to start from, when checkpoints
/// were written. Candidates, best first: the newest pointer; then
/// (fallbacks) the older pointer and the newest intact commit records found
/// by scanning the log. A fallback may name records in segments reused
/// since, so its result is accepted only if every record its map names
/// verifies, and only if its roll-forward reaches every seq the volume
/// certified.
struct CheckpointSearch<'a> {
    storage: &'a dyn Storage,
    sb: &'a Superblock,
    index: &'a HashMap<u64, Vec<u64>>,
    known: &'a HashMap<u64, (u64, u32, u32)>,
    /// Leave map pages on disk (`recover_lazy`).
    lazy: bool,
    /// The highest certified seq known so far (the pointers'; the whole
    /// log's once it has been scanned).
    certified: Certified,
    /// Notes on every candidate tried.
    warnings: Vec<String>,
    /// The whole-log scan, once a fallback needed it.
    scan: Option<LogScan>,
    /// The first fallback whose roll-forward fell short of the certified seq.
    shortfall: Option<ShortRollForward>,
    /// The first candidate whose chain ended before a SYNCED record further
    /// on: (where the chain ended, the seq that record certifies).
    chain_gap: Option<(u64, u64)>,
}

impl CheckpointSearch<'_> {
    /// Tries the pointers, then (once) the commits a scan of the log finds,
    /// each checkpoint once: the first accepted is the recovery; when none
    /// is, the refusal.
    fn run(mut self, ptrs: &[CheckpointPointer]) -> Result<Recovered, RecoveryError> {
        let mut candidates: Vec<(CheckpointPointer, Source)> =
            ptrs.iter().map(|p| (*p, Source::Pointer)).collect();
        let mut tried: Vec<u64> = Vec::new();
        let mut commits_added = false;
        let mut i = 0;
        while i <= candidates.len() {
            if i == candidates.len() {
                // The commits the whole log holds are the last fallbacks,
                // also when an earlier candidate's check already scanned it.
                if commits_added {
                    break;
                }
                commits_added = true;
                let commits = self.scan_for_commits();
                candidates.extend(commits.into_iter().map(|p| (p, Source::Scan)));
                continue;
            }
            let (p, source) = candidates[i];
            i += 1;
            if tried.contains(&p.commit_offset) {
                continue;
            }
            tried.push(p.commit_offset);
            let newest = source == Source::Pointer && i == 1;
            if let Some(r) = self.try_candidate(&p, source, newest)? {
                return Ok(r);
            }
        }
        Err(self.refusal())
    }

    /// Scans the whole log (once: `accept_fallback` may have already): the
    /// certified seq rises to what the log certifies, and its intact commit
    /// records become the last fallbacks.
    fn scan_for_commits(&mut self) -> Vec<CheckpointPointer> {
        if self.scan.is_none() {
            let scan = self.scan.insert(scan_log(self.storage, self.sb));
            self.certified.raise_from_scan(self.storage, self.sb, scan);
        }
        let scan = self.scan.as_ref().expect("scanned above");
        scanned_commits(self.sb, scan)
    }

    /// Loads one candidate checkpoint and rolls forward from it. `Ok(None)`:
    /// rejected (the warnings say why). A SYNCED record beyond the chain's
    /// end that certifies more than it reached rejects the candidate and
    /// raises the certified seq: only a later checkpoint whose chain starts
    /// past the damage can still be accepted (as a fallback, reaching it).
    fn try_candidate(
        &mut self,
        p: &CheckpointPointer,
        source: Source,
        newest: bool,
    ) -> Result<Option<Recovered>, RecoveryError> {
        let (storage, sb) = (self.storage, self.sb);
        let what = source.name(p);
        let (mut map, start, tables) = match load_checkpoint(storage, sb, p, self.lazy) {
            Ok(x) => x,
            Err(e) => {
                self.warnings.push(format!("{what} unusable: {e}"));
                return Ok(None);
            }
        };
        let r = match roll_forward(storage, sb, &mut map, start, self.index, self.known) {
            Ok(r) => r,
            Err(e) => {
                self.warnings
                    .push(format!("{what}: roll-forward failed: {e}"));
                return Ok(None);
            }
        };
        if let Some(certified) = certified_beyond(storage, sb, &r, self.index) {
            self.warnings.push(format!(
                "{what}: its chain of records ends at seq {}, below seq {certified} that a \
                 later SYNCED record certifies",
                r.last_seq
            ));
            self.certified.raise(certified, || {
                format!("a SYNCED record beyond the damage (certifies seq {certified})")
            });
            self.chain_gap.get_or_insert((r.last_seq, certified));
            return Ok(None);
        }
        if !newest && !self.accept_fallback(what, &map, &r) {
            return Ok(None);
        }
        if !r.skipped.is_empty() {
            self.warnings.push(format!(
                "damaged checkpoint records stepped over (seqs {:?}): they change no block",
                r.skipped
            ));
        }
        Ok(Some(Recovered {
            map,
            checkpoint_generation: p.generation,
            warnings: std::mem::take(&mut self.warnings),
            tables,
            ..r
        }))
    }

    /// Whether a fallback's result can be trusted: its roll-forward reaches
    /// every seq the whole log certifies (scanned once, only on this rare
    /// path), and every record its map names is intact (not in a segment
    /// reused since).
    fn accept_fallback(&mut self, what: String, map: &BlockMap, r: &Recovered) -> bool {
        let (storage, sb) = (self.storage, self.sb);
        if self.scan.is_none() {
            let scan = self.scan.insert(scan_log(storage, sb));
            self.certified.raise_from_scan(storage, sb, scan);
        }
        if r.last_seq < self.certified.seq {
            let shortfall = ShortRollForward {
                what,
                last_seq: r.last_seq,
                segment: r.segment,
                end: r.end,
                certified_seq: self.certified.seq,
                certified_by: self.certified.by.clone(),
            };
            self.warnings.push(shortfall.to_string());
            self.shortfall.get_or_insert(shortfall);
            return false;
        }
        if let Err(e) = verify_map_records(storage, sb, map) {
            self.warnings.push(format!("{what} is stale: {e}"));
            return false;
        }
        self.warnings.push(format!("recovered from the {what}"));
        true
    }

    /// Why no candidate was accepted. With pointers that all fail, the log
    /// may no longer reach seq 1 and replaying what is left could silently
    /// return old data: only `salvage`, asked for explicitly (`cvol check
    /// --repair`), does that.
    fn refusal(self) -> RecoveryError {
        if let Some((last_seq, certified)) = self.chain_gap {
            return RecoveryError::ChainEndsBeforeCertified {
                last_seq,
                certified,
                notes: self.warnings,
            };
        }
        match self.shortfall {
            Some(shortfall) => RecoveryError::RollForwardBelowCertified {
                shortfall,
                notes: self.warnings,
            },
            None => RecoveryError::NoUsableCheckpoint {
                notes: self.warnings,
            },
        }
    }
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
        // A segment with unreadable parts is read around them: a SYNCED
        // record in the rest still certifies (skipping the segment hid
        // flushed records lost to damage before the unreadable part).
        let buf =
            read_segment(storage, sb, s).unwrap_or_else(|_| read_segment_around(storage, sb, s));
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
    let src = LogPages {
        storage,
        sb,
        buffered: None,
    };
    map.scan(Some(&src), |lba, e| {
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
    })
    .map_err(|e| e.to_string())?;
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
    for s in segments_with_data(storage, sb) {
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
pub fn rebuild_from_log(
    storage: &dyn Storage,
    sb: &Superblock,
) -> Result<Recovered, RecoveryError> {
    let scan = scan_log(storage, sb);
    let mut recs: Vec<&Scanned> = scan.records.iter().collect();
    if recs.is_empty() {
        return Err(RecoveryError::NoIntactRecord);
    }
    recs.sort_by_key(|r| (r.header.epoch, r.header.seq));
    let data_at: HashMap<u64, &RecordHeader> = scan
        .records
        .iter()
        .filter(|r| r.header.kind == RecordKind::Data)
        .map(|r| (sb.segment_offset(r.segment) + r.at as u64, &r.header))
        .collect();
    let mut map = volume_map(sb);
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
    // The log goes on in the data store (a volume with a metadata device
    // keeps map records and commits on the other head).
    let last = (recs.iter().rev())
        .find(|r| !sb.is_metadata_segment(r.segment))
        .ok_or(RecoveryError::NoIntactRecord)?;
    let warnings = rebuild_warnings(recs.len(), applied, &scan, dropped_refs);
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
        tables: None,
        new_records: Vec::new(),
    })
}

/// What `rebuild_from_log` says: how many records it applied, which damaged
/// places it skipped, and which dedup references it dropped (their target
/// record is lost).
fn rebuild_warnings(
    records: usize,
    applied: u64,
    scan: &LogScan,
    mut dropped_refs: Vec<u64>,
) -> Vec<String> {
    let mut warnings = vec![format!(
        "map rebuilt from {} records of the log without a checkpoint ({} map changes); \
         blocks whose newest history was only in reused segments may hold an older version",
        records, applied
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
    warnings
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
    let loaded = load_commit_map(storage, sb, p, &commit, Load::Partial)?;
    let mut checkpoint_segments = HashMap::new();
    for &(off, seq) in &loaded.records {
        if let Some((seg, _)) = sb.locate(off) {
            let m = checkpoint_segments.entry(seg).or_insert(0);
            *m = seq.max(*m);
        }
    }
    let (map, lost_spans) = (loaded.map, loaded.lost_spans);
    if let Some((seg, _)) = sb.locate(p.commit_offset) {
        let m = checkpoint_segments.entry(seg).or_insert(0);
        *m = p.commit_seq.max(*m);
    }
    Ok(SalvageBase {
        map,
        start: checkpoint_start(sb, p, &commit, checkpoint_segments)?,
        lost_spans,
        what,
    })
}

/// Where roll-forward from the checkpoint of `p` starts: at the log head
/// of its snapshot when the commit names it (the checkpoint was written
/// outside the volume lock: client records may lie between the snapshot
/// and the commit, and the checkpoint's own records are passed over),
/// else right after the commit record.
fn checkpoint_start(
    sb: &Superblock,
    p: &CheckpointPointer,
    commit: &CommitPayload,
    checkpoint_segments: HashMap<u64, u64>,
) -> Result<Start, String> {
    let (segment, offset, expected_seq) = match commit.resume {
        Some(r) => {
            if r.segment >= sb.segment_count() || r.offset > sb.segment_size_bytes {
                return Err(format!(
                    "resume position {}+{} outside the log",
                    r.segment, r.offset
                ));
            }
            if commit.snapshot_seq >= p.commit_seq {
                return Err("snapshot seq not before its commit".into());
            }
            (r.segment, r.offset as usize, commit.snapshot_seq + 1)
        }
        None => {
            let (segment, at) = sb
                .locate(p.commit_offset)
                .ok_or("commit outside the data area")?;
            (segment, at + p.commit_len as usize, p.commit_seq + 1)
        }
    };
    let meta = match (commit.resume, commit.meta_resume) {
        (Some(_), Some(m)) => {
            if !(sb.is_metadata_segment(m.segment) && m.segment < sb.segment_count())
                || m.offset > sb.segment_size_bytes
            {
                return Err(format!(
                    "metadata resume position {}+{} outside the metadata device",
                    m.segment, m.offset
                ));
            }
            Some((m.segment, m.offset as usize))
        }
        _ => None,
    };
    if sb.is_metadata_segment(segment) {
        return Err(format!(
            "resume segment {segment} is on the metadata device"
        ));
    }
    Ok(Start {
        segment,
        offset,
        meta,
        expected_seq,
        epoch: p.commit_epoch,
        snapshot_seq: commit.snapshot_seq,
        checkpoint_segments,
    })
}

/// How to read a checkpoint's map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Load {
    /// Every record must read; `lazy`: pages are verified, not kept.
    Whole { lazy: bool },
    /// A damaged record loses the LBAs it held (`lost_spans`) instead of
    /// failing the load.
    Partial,
}

/// A checkpoint's map, read from the records its commit names.
struct LoadedMap {
    map: BlockMap,
    /// Its liveness tables, if it names a root and every table reads.
    tables: Option<LoadedTables>,
    /// LBA spans whose entries were in damaged records (partial loads).
    lost_spans: Vec<(u64, u64)>,
    /// (offset, seq) of the records read: segments recovery needs.
    records: Vec<(u64, u64)>,
}

/// Reads the map a commit names: MAP_CHUNKs of runs (the whole map), or
/// MAP_DIRs and the page records they name (a paged map), told apart by
/// the kind of the first record that reads.
fn load_commit_map(
    storage: &dyn Storage,
    sb: &Superblock,
    p: &CheckpointPointer,
    commit: &CommitPayload,
    load: Load,
) -> Result<LoadedMap, String> {
    let partial = load == Load::Partial;
    let kind = commit
        .chunks
        .iter()
        .find_map(|c| read_record(storage, sb, c.offset, c.len).ok())
        .map(|(h, _)| h.kind);
    let mut loaded = LoadedMap {
        map: volume_map(sb),
        tables: None,
        lost_spans: Vec::new(),
        records: Vec::new(),
    };
    match kind {
        None if commit.chunks.is_empty() => {}
        None if partial => loaded.lost_spans.push((0, sb.logical_blocks())),
        None => return Err("no map record of the checkpoint reads".into()),
        Some(RecordKind::MapDir) => load_paged(storage, sb, commit, load, &mut loaded)?,
        Some(_) => load_flat(storage, sb, p.commit_seq, commit, partial, &mut loaded)?,
    }
    Ok(loaded)
}

/// The spans of the damaged items of a sequence in LBA order, each from the
/// end of the intact item before it to the start of the one after it;
/// `spans[i]`: Some(span of item i, if it holds entries) when intact.
fn damaged_spans(spans: &[Option<Option<(u64, u64)>>], logical_blocks: u64) -> Vec<(u64, u64)> {
    let mut lost: Vec<(u64, u64)> = Vec::new();
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
            .map_or(logical_blocks, |s| s.0);
        if lost.last().is_none_or(|&(_, e)| e < from) {
            lost.push((from, to));
        }
    }
    lost
}

/// `load_commit_map` for MAP_CHUNKs holding the whole map in runs. Their
/// segments are needed up to the commit's seq: the map names none of
/// these records (its pages have none until the first paged checkpoint),
/// so nothing else keeps a segment holding only chunks from being reused
/// while this checkpoint is the durable one.
fn load_flat(
    storage: &dyn Storage,
    sb: &Superblock,
    commit_seq: u64,
    commit: &CommitPayload,
    partial: bool,
    loaded: &mut LoadedMap,
) -> Result<(), String> {
    // Chunks hold runs in LBA order: a damaged chunk's span lies between
    // the intact chunks around it.
    let mut spans: Vec<Option<Option<(u64, u64)>>> = Vec::new();
    for c in &commit.chunks {
        loaded.records.push((c.offset, commit_seq));
        match read_chunk(storage, sb, c.offset, c.len, c.crc) {
            Ok(v) => {
                spans.push(Some(v.first().map(|f| (f.0, v[v.len() - 1].0 + 1))));
                v.into_iter().for_each(|(lba, e)| {
                    loaded.map.set(lba, e);
                });
            }
            Err(e) if !partial => return Err(e),
            Err(_) => spans.push(None),
        }
    }
    loaded.lost_spans = damaged_spans(&spans, sb.logical_blocks());
    Ok(())
}

/// `load_commit_map` for MAP_DIRs and the pages they name: every page is
/// read (the map is whole in memory after open; the volume drops clean
/// pages down to its cache size afterwards).
fn load_paged(
    storage: &dyn Storage,
    sb: &Superblock,
    commit: &CommitPayload,
    load: Load,
    loaded: &mut LoadedMap,
) -> Result<(), String> {
    let partial = load == Load::Partial;
    let block_blocks = DIR_PAGES * MAP_PAGE_BLOCKS;
    let npages = sb.logical_blocks().div_ceil(MAP_PAGE_BLOCKS);
    let mut spans: Vec<Option<Option<(u64, u64)>>> = Vec::new();
    let mut dirs = Vec::new();
    let mut tables: Vec<(usize, PageRef)> = Vec::new();
    for c in &commit.chunks {
        let (b, r, pages) = match read_dir(storage, sb, c) {
            Ok(d) if dirs.last().is_none_or(|&(last, _)| last < d.0) => d,
            Ok(_) => return Err("map directory blocks out of order".into()),
            Err(e) if !partial => return Err(e),
            Err(_) => {
                spans.push(None);
                continue;
            }
        };
        loaded.records.push((r.offset, r.seq));
        dirs.push((b, r));
        let first = (b as u64 * block_blocks).min(sb.logical_blocks());
        let end = (first + block_blocks).min(sb.logical_blocks());
        spans.push(Some(Some((first, end))));
        for (p, r) in pages {
            loaded.records.push((r.offset, r.seq));
            if p >= npages {
                tables.push(((p - npages) as usize, r));
                continue;
            }
            if let Err(e) = load_page(storage, sb, p, r, load, &mut loaded.map) {
                if !partial {
                    return Err(format!("map page {p}: {e}"));
                }
                let first = p * MAP_PAGE_BLOCKS;
                let end = (first + MAP_PAGE_BLOCKS).min(sb.logical_blocks());
                loaded.lost_spans.push((first, end));
            }
        }
    }
    for &(t, r) in &tables {
        loaded.map.set_table_ref(t, Some(r));
    }
    for (b, r) in dirs {
        loaded.map.install_dir_record(b, r);
    }
    if load == (Load::Whole { lazy: true }) {
        loaded.map.record_originals();
    }
    if !partial {
        loaded.tables = read_tables(storage, sb, &tables)
            .map_err(|e| tracing::warn!("liveness tables unusable ({e}): rebuilt from the map"))
            .ok()
            .flatten();
    }
    loaded
        .lost_spans
        .extend(damaged_spans(&spans, sb.logical_blocks()));
    loaded.lost_spans.sort_unstable();
    Ok(())
}

/// Reads page `p`'s record `r` into `map`: whole, or (lazy) verified and
/// left on disk.
fn load_page(
    storage: &dyn Storage,
    sb: &Superblock,
    p: u64,
    r: PageRef,
    load: Load,
    map: &mut BlockMap,
) -> Result<(), String> {
    if load == (Load::Whole { lazy: true }) {
        let (h, _) = read_record(storage, sb, r.offset, r.len)?;
        if h.kind != RecordKind::MapChunk || h.crc != r.crc || h.lba != p * MAP_PAGE_BLOCKS {
            return Err("not the record the directory names".into());
        }
        map.install_unread(p as usize, r);
        return Ok(());
    }
    let src = LogPages {
        storage,
        sb,
        buffered: None,
    };
    let page = src
        .load(p, &r)
        .and_then(|v| {
            Page::from_entries(p, &v)
                .ok_or_else(|| MetaError::Damaged("a page record of another page".into()))
        })
        .map_err(|e| e.to_string())?;
    map.install_loaded(p as usize, page, r);
    Ok(())
}

/// The liveness tables a directory names (by table index), if it names a
/// root: None without one (a checkpoint whose tables were incomplete, or
/// of an older cvol).
fn read_tables(
    storage: &dyn Storage,
    sb: &Superblock,
    tables: &[(usize, PageRef)],
) -> Result<Option<LoadedTables>, String> {
    let npages = sb.logical_blocks().div_ceil(MAP_PAGE_BLOCKS);
    let mut root = None;
    let mut groups = Vec::new();
    // Fingerprint tables are read by the index warm-up, not at open.
    let liveness = table_count(sb.segment_count()) as usize;
    for &(t, r) in tables.iter().filter(|(t, _)| *t < liveness) {
        let (h, rec) = read_record(storage, sb, r.offset, r.len)?;
        let slot = npages + t as u64;
        if h.kind != RecordKind::MapTable || h.crc != r.crc || h.lba != slot * MAP_PAGE_BLOCKS {
            return Err(format!("table {t}: not the record the directory names"));
        }
        if h.codec != CodecTag::Lz4 {
            return Err(format!("table {t}: codec {:?}", h.codec));
        }
        let raw = lz4_flex::block::decompress_size_prepended(&rec[RECORD_HEADER_BYTES..])
            .map_err(|e| format!("table {t}: {e}"))?;
        let segments = sb.segment_count();
        if t == 0 {
            root = Some(TableRoot::decode(&raw, segments).map_err(|e| e.to_string())?);
        } else {
            let g = TableGroup::decode(&raw, t as u64 - 1, segments);
            groups.push(g.map_err(|e| format!("table {t}: {e}"))?);
        }
    }
    Ok(root.map(|root| LoadedTables { root, groups }))
}

/// A directory block read: its index, its record, the pages it lists.
type DirRead = (usize, PageRef, Vec<(u64, PageRef)>);

/// One MAP_DIR record a commit names, verified: its directory block, its
/// reference, and the pages it lists.
fn read_dir(storage: &dyn Storage, sb: &Superblock, c: &ChunkRef) -> Result<DirRead, String> {
    let (h, rec) = read_record(storage, sb, c.offset, c.len)?;
    let block_blocks = DIR_PAGES * MAP_PAGE_BLOCKS;
    if h.kind != RecordKind::MapDir || h.crc != c.crc || h.lba % block_blocks != 0 {
        return Err(format!(
            "map directory at {} is not the one the checkpoint names",
            c.offset
        ));
    }
    // Directory slots: the map's pages, then its tables.
    let slots = sb.logical_blocks().div_ceil(MAP_PAGE_BLOCKS)
        + directory_tables(sb.segment_count(), sb.segment_size_bytes);
    if h.lba / MAP_PAGE_BLOCKS >= slots {
        return Err(format!("map directory at {} beyond the volume", c.offset));
    }
    let raw = match h.codec {
        CodecTag::Lz4 => lz4_flex::block::decompress_size_prepended(&rec[RECORD_HEADER_BYTES..])
            .map_err(|e| format!("map directory: {e}"))?,
        CodecTag::None => rec[RECORD_HEADER_BYTES..].to_vec(),
        CodecTag::Zstd => return Err("map directory with zstd codec".into()),
    };
    let block = h.lba / block_blocks;
    let d = DirPayload::decode(&raw, block).map_err(|e| e.to_string())?;
    if d.pages.last().is_some_and(|&(p, _)| p >= slots) {
        return Err("map directory names a page beyond the volume".into());
    }
    let r = PageRef {
        offset: c.offset,
        len: c.len,
        crc: c.crc,
        seq: h.seq,
    };
    Ok((block as usize, r, d.pages))
}

/// The page records of a volume's log, read on a map cache miss: from the
/// open segment's buffer while they are still there (`buffered`), else
/// from the store.
pub struct LogPages<'a> {
    pub storage: &'a dyn Storage,
    pub sb: &'a Superblock,
    pub buffered: Option<&'a dyn Fn(u64, usize) -> Option<Vec<u8>>>,
}

impl PageSource for LogPages<'_> {
    fn load(&self, _page: u64, r: &PageRef) -> Result<Vec<(u64, MapEntry)>, MetaError> {
        let copy = self.buffered.and_then(|f| f(r.offset, r.len as usize));
        let Some(rec) = copy else {
            return read_chunk(self.storage, self.sb, r.offset, r.len, r.crc)
                .map_err(MetaError::Damaged);
        };
        let (h, _) =
            RecordHeader::decode_verified(&rec).map_err(|e| MetaError::Damaged(e.to_string()))?;
        if h.volume_tag != self.sb.volume_tag() || h.total_len() != r.len as usize {
            return Err(MetaError::Damaged(
                "record belongs to another volume or has another length".into(),
            ));
        }
        chunk_entries(self.sb, &h, &rec, r.offset, r.crc).map_err(MetaError::Damaged)
    }
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
    chunk_entries(sb, &ch, &rec, offset, crc)
}

/// The entries of a MAP_CHUNK record read whole (`rec`, its header `ch`).
fn chunk_entries(
    sb: &Superblock,
    ch: &RecordHeader,
    rec: &[u8],
    offset: u64,
    crc: u32,
) -> Result<Vec<(u64, MapEntry)>, String> {
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
    /// The base's damaged map chunks: LBA spans set LOST before the walk.
    lost_spans: Vec<(u64, u64)>,
    /// Which records the walk applied to the tracked spans, if asked.
    touches: Option<Touches>,
}

/// The last seq that changed each block of some LBA spans, as a salvage
/// walk applies records: a block whose last change is newer than every
/// record the walk could not tell is known exactly.
struct Touches {
    spans: Vec<(u64, u64)>,
    /// DATA records, block by block (a unit changes the blocks of its mask).
    blocks: HashMap<u64, u64>,
    /// ZERO, TRIM and REF records: (first, end, seq).
    ranges: Vec<(u64, u64, u64)>,
}

impl Touches {
    fn new(spans: Vec<(u64, u64)>) -> Touches {
        Touches {
            spans,
            blocks: HashMap::new(),
            ranges: Vec::new(),
        }
    }

    /// Notes a record the walk applied (or marked lost).
    fn note(&mut self, h: &RecordHeader, logical_blocks: u64) {
        let end = (h.lba + u64::from(h.nblocks)).min(logical_blocks);
        match h.kind {
            RecordKind::Data => {
                for &(a, b) in &self.spans {
                    for l in h.lba.max(a)..end.min(b) {
                        if h.maps(l) {
                            self.blocks.insert(l, h.seq);
                        }
                    }
                }
            }
            RecordKind::Zero | RecordKind::Trim | RecordKind::Ref
                if self.spans.iter().any(|&(a, b)| h.lba < b && a < end) =>
            {
                self.ranges.push((h.lba, end, h.seq));
            }
            _ => {}
        }
    }

    /// The last seq that changed block `l`, if the walk changed it.
    fn last(&self, l: u64) -> Option<u64> {
        let ranges = self.ranges.iter().filter(|r| r.0 <= l && l < r.1);
        self.blocks
            .get(&l)
            .copied()
            .into_iter()
            .chain(ranges.map(|r| r.2))
            .max()
    }
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
    track: Option<Vec<(u64, u64)>>,
) -> SalvageWalk {
    let records = SalvageIndex::new(scan, certified);
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
    let mut warnings = vec![format!("salvage from the {what}")];
    if !lost_spans.is_empty() {
        warnings.push(format!(
            "damaged map chunks of that checkpoint: LBA spans {lost_spans:?} are lost unless written after it"
        ));
    }
    let mut walk = SalvageCursor::new(&start);
    walk.touches = track.map(Touches::new);
    walk.run(&mut map, sb, &records, certified, known);
    let mut lost_lbas = Vec::new();
    map.for_each_mapped(|l, e| {
        if e == MapEntry::LOST {
            lost_lbas.push(l);
        }
    });
    warnings.extend(loss_warnings(&lost_lbas, &walk.unknown, certified));
    let salvage = Salvage {
        lost_lbas,
        unknown_records: walk.unknown.clone(),
        certified: certified.clone(),
    };
    let mut w = walk.finish(map, sb, scan, start.snapshot_seq, warnings, salvage);
    w.lost_spans = lost_spans;
    w
}

/// The records a scan found, by seq, for the salvage walk: the intact
/// ones, and the damaged ones whose header says what they held.
struct SalvageIndex<'a> {
    by_seq: HashMap<u64, Vec<&'a Scanned>>,
    damaged_by_seq: HashMap<u64, Vec<&'a (u64, usize, RecordHeader)>>,
    /// The highest seq the log holds or certifies: where the walk stops.
    max_seq: u64,
}

impl<'a> SalvageIndex<'a> {
    /// Indexes the scan's intact and damaged records by seq.
    fn new(scan: &'a LogScan, certified: &Certified) -> Self {
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
        SalvageIndex {
            by_seq,
            damaged_by_seq,
            max_seq,
        }
    }

    /// The intact record of seq `expected` that continues the walk (the
    /// epoch rule; after a gap any epoch not older), the newest epoch's.
    fn intact(&self, expected: u64, epoch: u32, gap: bool) -> Option<&'a Scanned> {
        let v = self.by_seq.get(&expected)?;
        v.iter()
            .filter(|r| {
                let h = &r.header;
                h.epoch == epoch
                    || (h.kind == RecordKind::Epoch && h.epoch > epoch)
                    || (gap && h.epoch >= epoch)
            })
            .max_by_key(|r| r.header.epoch)
            .copied()
    }

    /// The damaged record of seq `expected` (segment, byte, header) of an
    /// epoch not older than the walk's, the newest epoch's.
    fn damaged(&self, expected: u64, epoch: u32) -> Option<&'a (u64, usize, RecordHeader)> {
        let v = self.damaged_by_seq.get(&expected)?;
        v.iter()
            .filter(|d| d.2.epoch >= epoch)
            .max_by_key(|d| d.2.epoch)
            .copied()
    }
}

/// Where the salvage walk is and what it has done.
struct SalvageCursor {
    expected: u64,
    epoch: u32,
    /// The previous seq was missing (damaged or destroyed).
    gap: bool,
    replayed: u64,
    applied: u64,
    /// The last record applied: its segment and the byte after it.
    last: (u64, usize),
    needed: HashMap<u64, u64>,
    /// Seqs below the certified seq destroyed with their headers.
    unknown: Vec<u64>,
    touches: Option<Touches>,
}

impl SalvageCursor {
    /// The walk at the base's start: the seq and epoch after its commit.
    fn new(start: &Start) -> Self {
        SalvageCursor {
            expected: start.expected_seq,
            epoch: start.epoch,
            gap: false,
            replayed: 0,
            applied: 0,
            last: (start.segment, start.offset),
            needed: start.checkpoint_segments.clone(),
            unknown: Vec::new(),
            touches: None,
        }
    }

    /// Walks seq by seq up to the highest seq the log holds: an intact
    /// record applies; below the certified seq a missing one is marked
    /// (its blocks LOST, or nothing for a checkpoint record, or unknown)
    /// and skipped; above it the first gap ends the walk.
    fn run(
        &mut self,
        map: &mut BlockMap,
        sb: &Superblock,
        records: &SalvageIndex,
        certified: &Certified,
        known: &HashMap<u64, (u64, u32, u32)>,
    ) {
        while self.expected <= records.max_seq {
            if let Some(r) = records.intact(self.expected, self.epoch, self.gap) {
                self.apply_intact(map, sb, r);
                continue;
            }
            if self.expected > certified.seq {
                break; // an unsynced tail: recovery drops it too
            }
            self.gap = true;
            match records.damaged(self.expected, self.epoch) {
                Some(&(seg, _, h)) => self.mark_damaged(map, sb, seg, &h),
                None if known.contains_key(&self.expected) => {} // a checkpoint record: no blocks
                None => self.unknown.push(self.expected),
            }
            self.expected += 1;
        }
    }

    /// Applies an intact record of the walk and moves past it.
    fn apply_intact(&mut self, map: &mut BlockMap, sb: &Superblock, r: &Scanned) {
        let h = &r.header;
        let changed = apply_scanned(map, sb, r);
        if let Some(t) = self.touches.as_mut().filter(|_| changed) {
            t.note(h, sb.logical_blocks());
        }
        self.applied += u64::from(changed);
        self.replayed += 1;
        let m = self.needed.entry(r.segment).or_insert(0);
        *m = (*m).max(h.seq);
        if !sb.is_metadata_segment(r.segment) {
            // The log goes on after the data stream's last record.
            self.last = (r.segment, r.at + h.total_len());
        }
        self.epoch = h.epoch;
        self.expected += 1;
        self.gap = false;
    }

    /// A damaged record of segment `seg`, by its header: the blocks it held
    /// become LOST (a DATA unit's live blocks; every block of a ZERO, TRIM
    /// or REF); an EPOCH record still moves the epoch on.
    fn mark_damaged(&mut self, map: &mut BlockMap, sb: &Superblock, seg: u64, h: &RecordHeader) {
        let m = self.needed.entry(seg).or_insert(0);
        *m = (*m).max(h.seq);
        let end = (h.lba + u64::from(h.nblocks.min(DATA_UNIT_BLOCKS_MAX))).min(sb.logical_blocks());
        match h.kind {
            RecordKind::Data => (h.lba..end).filter(|&l| h.maps(l)).for_each(|l| {
                map.set(l, MapEntry::LOST);
            }),
            RecordKind::Zero | RecordKind::Trim | RecordKind::Ref => (h.lba..end).for_each(|l| {
                map.set(l, MapEntry::LOST);
            }),
            RecordKind::Epoch => self.epoch = self.epoch.max(h.epoch),
            RecordKind::MapChunk
            | RecordKind::MapDir
            | RecordKind::MapTable
            | RecordKind::CkptCommit
            | RecordKind::Synced => {}
        }
    }

    /// The salvaged recovery: the log continues after every record of the
    /// head's segment, intact or damaged (nothing the map may name is
    /// overwritten), and after the highest seq and epoch the log holds.
    fn finish(
        self,
        map: BlockMap,
        sb: &Superblock,
        scan: &LogScan,
        snapshot_seq: u64,
        warnings: Vec<String>,
        salvage: Salvage,
    ) -> SalvageWalk {
        let (segment, last_end) = self.last;
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
            .chain(std::iter::once(last_end))
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
                .max(self.expected - 1),
            last_epoch: all_seqs.map(|x| x.1).max().unwrap_or(0).max(self.epoch),
            checkpoint_generation: 0,
            replayed_records: self.replayed,
            replayed_map_records: self.applied.max(1),
            snapshot_seq,
            needed_segments: self.needed,
            warnings,
            skipped: Vec::new(),
            rolled_segments: Vec::new(),
            salvage: Some(salvage),
            tables: None,
            new_records: Vec::new(),
        };
        SalvageWalk {
            recovered,
            unknown: self.unknown,
            lost_spans: Vec::new(),
            touches: self.touches,
        }
    }
}

/// What a salvage could not save, for its warnings: the LOST blocks and
/// the destroyed records whose blocks cannot be told.
/// How the note listing lost blocks reads, after their count.
const LOST_NOTE: &str = "block(s) lost (their newest flushed version was destroyed";

fn loss_warnings(lost_lbas: &[u64], unknown: &[u64], certified: &Certified) -> Vec<String> {
    let mut warnings = Vec::new();
    if !lost_lbas.is_empty() {
        warnings.push(format!(
            "{} {LOST_NOTE}; they read as EIO until written again): LBAs {}",
            lost_lbas.len(),
            lba_list(lost_lbas)
        ));
    }
    if !unknown.is_empty() {
        warnings.push(format!(
            "{} record(s) below the certified seq {} are destroyed with their headers (seqs {}): \
             the blocks they held cannot be told and may read an older version",
            unknown.len(),
            certified.seq,
            lba_list(unknown)
        ));
    }
    warnings
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
pub fn salvage(storage: &dyn Storage, sb: &Superblock) -> Result<Recovered, RecoveryError> {
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

/// The salvage walk from the best base: the first checkpoint (pointers
/// newest first, then commits found in the log) whose walk is exact, else
/// the first whose commit record loads, else the log's first record, else
/// `rebuild_from_log`.
fn salvage_from(
    storage: &dyn Storage,
    sb: &Superblock,
    scan: &LogScan,
) -> Result<Recovered, RecoveryError> {
    let ptrs = pointers_newest_first(storage);
    let mut certified = Certified::from_pointers(&ptrs);
    certified.raise_from_scan(storage, sb, scan);
    let known = known_checkpoint_records(storage, sb, &ptrs);
    let mut commits: Vec<(CheckpointPointer, Source)> =
        ptrs.iter().map(|p| (*p, Source::Pointer)).collect();
    commits.extend(
        scanned_commits(sb, scan)
            .into_iter()
            .map(|p| (p, Source::Scan)),
    );
    let mut fallback: Option<SalvageWalk> = None;
    let mut tried = Vec::new();
    for (p, source) in &commits {
        if tried.contains(&p.commit_offset) {
            continue;
        }
        tried.push(p.commit_offset);
        let Ok(base) = load_checkpoint_partial(storage, sb, p, source.name(p)) else {
            continue;
        };
        let complete = base.lost_spans.is_empty();
        let walk = salvage_walk(sb, scan, base, &certified, &known, None);
        // Every seq from the base on was found (intact, or damaged with
        // its blocks named): nothing between was reused, so the map names
        // no place reused since, and it is exact but for the LOST blocks.
        if complete && walk.unknown.is_empty() {
            return Ok(walk.recovered);
        }
        fallback.get_or_insert(walk);
    }
    let log_base = || -> Result<Option<SalvageBase>, RecoveryError> {
        let index = first_record_index(storage, sb)?;
        Ok(log_start(&index).map(|start| SalvageBase {
            map: volume_map(sb),
            start,
            lost_spans: Vec::new(),
            what: "start of the log (seq 1)".into(),
        }))
    };
    if let Some(mut w) = fallback {
        if !w.lost_spans.is_empty() {
            let mut alternates: Vec<SalvageBase> = commits
                .iter()
                .filter_map(|(p, s)| load_checkpoint_partial(storage, sb, p, s.name(p)).ok())
                .filter(|b| b.lost_spans.is_empty())
                .collect();
            alternates.extend(log_base()?);
            for base in alternates {
                let spans = Some(w.lost_spans.clone());
                fill_lost_spans(
                    &mut w,
                    &salvage_walk(sb, scan, base, &certified, &known, spans),
                );
            }
        }
        return Ok(w.recovered);
    }
    // No checkpoint at all: from the log's first record, if it is still there.
    if let Some(base) = log_base()? {
        return Ok(salvage_walk(sb, scan, base, &certified, &known, None).recovered);
    }
    let mut r = rebuild_from_log(storage, sb)?;
    r.salvage = Some(Salvage {
        lost_lbas: Vec::new(),
        unknown_records: vec![0],
        certified,
    });
    Ok(r)
}

/// Gives blocks of `w`'s damaged-chunk spans that are still LOST the value
/// `alt` (a walk from an older, intact base over the same log) ends with,
/// where that value is certain: the last record that changed the block is
/// newer than every record `alt` could not tell (a destroyed header may
/// have held any block), or `alt` could tell every record. The blocks so
/// recovered leave the lost list; the rest stay LOST.
fn fill_lost_spans(w: &mut SalvageWalk, alt: &SalvageWalk) {
    let Some(touches) = &alt.touches else { return };
    let unknown_max = alt.unknown.iter().max().copied();
    let mut filled = 0u64;
    let map = &mut w.recovered.map;
    for &(a, b) in &w.lost_spans {
        for l in a..b {
            let (mine, theirs) = (map.get(l), alt.recovered.map.get(l));
            if mine != MapEntry::LOST || theirs == MapEntry::LOST {
                continue;
            }
            let certain = match touches.last(l) {
                Some(seq) => unknown_max.is_none_or(|u| seq > u),
                None => unknown_max.is_none(),
            };
            if certain {
                map.set(l, theirs);
                filled += 1;
            }
        }
    }
    if filled == 0 {
        return;
    }
    let Some(s) = w.recovered.salvage.as_mut() else {
        return;
    };
    s.lost_lbas.retain(|&l| map.get(l) == MapEntry::LOST);
    // The loss note the walk wrote counted the blocks recovered here.
    w.recovered.warnings.retain(|m| !m.contains(LOST_NOTE));
    w.recovered.warnings.push(format!(
        "{filled} block(s) of the damaged map chunks recovered exactly from the log's older records"
    ));
    w.recovered
        .warnings
        .extend(loss_warnings(&s.lost_lbas, &[], &s.certified));
}

/// Rewrites a damaged superblock copy from the intact one. Returns what it did.
pub fn repair_superblocks(storage: &dyn Storage) -> Result<Vec<String>, RecoveryError> {
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
        return Err(RecoveryError::BothSuperblocksDamaged);
    };
    let mut notes = Vec::new();
    for (i, c) in copies.iter().enumerate() {
        if c.as_ref() != Some(&good) {
            storage
                .write_at(offs[i], &good.encode())
                .map_err(RecoveryError::RepairIo)?;
            notes.push(format!(
                "superblock copy {} rewritten from copy {}",
                ["A", "B"][i],
                ["B", "A"][i]
            ));
        }
    }
    if !notes.is_empty() {
        storage.sync().map_err(RecoveryError::RepairIo)?;
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

/// Segment `s` read sector by sector, unreadable sectors left zero.
fn read_segment_around(storage: &dyn Storage, sb: &Superblock, s: u64) -> Vec<u8> {
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

fn read_segment(storage: &dyn Storage, sb: &Superblock, s: u64) -> Result<Vec<u8>, RecoveryError> {
    let mut buf = vec![0u8; sb.segment_size_bytes as usize];
    storage
        .read_at(sb.segment_offset(s), &mut buf)
        .map_err(|source| RecoveryError::SegmentUnreadable { segment: s, source })?;
    Ok(buf)
}

/// Rolls forward from `start` along the chain of records (docs/FORMAT.md
/// "Recovery", step 3), applying each to `map`, until no record continues
/// the chain. The result's map is empty: the caller keeps `map`.
fn roll_forward(
    storage: &dyn Storage,
    sb: &Superblock,
    map: &mut BlockMap,
    start: Start,
    index: &HashMap<u64, Vec<u64>>,
    known: &HashMap<u64, (u64, u32, u32)>,
) -> Result<Recovered, RecoveryError> {
    let mut chain = Chain::new(storage, sb, &start)?;
    loop {
        // An intact record continuing the chain is taken here or at the
        // start of another segment (a checkpoint record that did not fit
        // the open segment's tail starts the next one) before a record a
        // pointer names is taken for damaged and stepped over.
        if let Some((i, at, h)) = chain.record_here() {
            chain.apply(map, i, at, &h)?;
        } else if chain.switch_segment(index)? {
            continue;
        } else if chain.at_known_checkpoint_record(known) {
            chain.step_over_known(known)?;
        } else {
            break;
        }
    }
    Ok(chain.into_recovered(start.snapshot_seq))
}

/// Where the roll-forward reads one stream of the log: a segment (loaded
/// in `buf`) and the byte after the last record of the chain there.
struct Cursor {
    segment: u64,
    buf: Vec<u8>,
    pos: usize,
}

impl Cursor {
    /// The next sector boundary at or after the position (where a record
    /// follows flush padding).
    fn aligned(&self) -> usize {
        align_up(self.pos as u64, SECTOR_SIZE_BYTES) as usize
    }

    /// The next page boundary at or after the position (where a DATA
    /// record of a page-packed volume follows page padding).
    fn page_aligned(&self) -> usize {
        align_up(self.pos as u64, PACKING_PAGE_BYTES) as usize
    }
}

/// Where the roll-forward is: a cursor per stream of the log (the data
/// head's, and the metadata head's on a volume with a metadata device:
/// both take their seqs from one counter, so the chain goes from one to
/// the other), the seq and epoch the next record must continue, and what
/// it has done so far. `cursors[0]` is the data stream's.
struct Chain<'a> {
    storage: &'a dyn Storage,
    sb: &'a Superblock,
    cursors: Vec<Cursor>,
    expected: u64,
    epoch: u32,
    /// Segments holding the checkpoint or the chain, with their highest seq.
    needed: HashMap<u64, u64>,
    replayed: u64,
    map_records: u64,
    /// Offsets of the DATA records applied.
    new_records: Vec<u64>,
    /// Damaged checkpoint records stepped over, by seq.
    skipped: Vec<u64>,
    rolled_segments: Vec<u64>,
}

impl<'a> Chain<'a> {
    /// The chain at a checkpoint's start (or seq 1), its segments read.
    fn new(
        storage: &'a dyn Storage,
        sb: &'a Superblock,
        start: &Start,
    ) -> Result<Self, RecoveryError> {
        let mut cursors = vec![Cursor {
            segment: start.segment,
            buf: read_segment(storage, sb, start.segment)?,
            pos: start.offset,
        }];
        let mut rolled_segments = vec![start.segment];
        if let Some((segment, pos)) = start.meta {
            let buf = read_segment(storage, sb, segment)?;
            cursors.push(Cursor { segment, buf, pos });
            rolled_segments.push(segment);
        }
        Ok(Chain {
            storage,
            sb,
            cursors,
            expected: start.expected_seq,
            epoch: start.epoch,
            needed: start.checkpoint_segments.clone(),
            replayed: 0,
            map_records: 0,
            new_records: Vec::new(),
            skipped: Vec::new(),
            rolled_segments,
        })
    }

    /// The cursor of `segment`'s stream, made if the chain had none yet.
    fn stream_of(&mut self, segment: u64) -> usize {
        let meta = self.sb.is_metadata_segment(segment);
        if let Some(i) = (0..self.cursors.len())
            .find(|&i| self.sb.is_metadata_segment(self.cursors[i].segment) == meta)
        {
            return i;
        }
        self.cursors.push(Cursor {
            segment,
            buf: Vec::new(),
            pos: 0,
        });
        self.cursors.len() - 1
    }

    /// Moves the cursor of `segment`'s stream to it.
    fn enter(&mut self, segment: u64, buf: Vec<u8>, pos: usize) -> usize {
        let i = self.stream_of(segment);
        self.cursors[i] = Cursor { segment, buf, pos };
        self.rolled_segments.push(segment);
        i
    }

    /// The record continuing the chain at one of the cursors, at its
    /// position or else at its next sector boundary, or (page packing:
    /// only a DATA record) its next page boundary: (cursor, where, header).
    fn record_here(&self) -> Option<(usize, usize, RecordHeader)> {
        let tag = self.sb.volume_tag();
        let (expected, epoch) = (self.expected, self.epoch);
        let paged = self.sb.packing().paged();
        self.cursors.iter().enumerate().find_map(|(i, c)| {
            let found = |at| chain_record_at(&c.buf, at, tag, expected, epoch).map(|h| (i, at, h));
            found(c.pos).or_else(|| found(c.aligned())).or_else(|| {
                paged
                    .then(|| found(c.page_aligned()))
                    .flatten()
                    .filter(|(_, _, h)| h.kind == RecordKind::Data)
            })
        })
    }

    /// Applies the verified record `h` at `at` of cursor `i`'s segment to
    /// the map and moves past it.
    fn apply(
        &mut self,
        map: &mut BlockMap,
        i: usize,
        at: usize,
        h: &RecordHeader,
    ) -> Result<(), RecoveryError> {
        let c = &self.cursors[i];
        // chain_record_at verified a whole record of the expected seq.
        assert!(at + h.total_len() <= c.buf.len() && h.seq == self.expected);
        let offset = self.sb.segment_offset(c.segment) + at as u64;
        let payload = &c.buf[at + RECORD_HEADER_BYTES..at + h.total_len()];
        let bad = |detail| RecoveryError::BadRecord {
            seq: h.seq,
            offset,
            detail,
        };
        if changes_map(h.kind) {
            // A lazily loaded map: the pages it changes come into memory.
            let src = LogPages {
                storage: self.storage,
                sb: self.sb,
                buffered: None,
            };
            let end = h.lba.saturating_add(u64::from(h.nblocks));
            map.fault_in(h.lba, end, &src)
                .map_err(|e| bad(e.to_string()))?;
        }
        apply(map, self.sb, h, offset, payload).map_err(bad)?;
        if h.kind == RecordKind::Data {
            self.new_records.push(offset);
        }
        self.replayed += 1;
        self.map_records += u64::from(changes_map(h.kind));
        let m = self.needed.entry(c.segment).or_insert(0);
        *m = (*m).max(h.seq);
        self.cursors[i].pos = at + h.total_len();
        self.expected += 1;
        self.epoch = h.epoch;
        Ok(())
    }

    /// Whether the expected seq is a MAP_CHUNK or CKPT_COMMIT a pointer
    /// names, of the current epoch, exactly where the chain expects it (at
    /// a cursor's position or next sector boundary, or at the start of
    /// another segment): damaged, since no intact record continued the
    /// chain there.
    fn at_known_checkpoint_record(&self, known: &HashMap<u64, (u64, u32, u32)>) -> bool {
        known.get(&self.expected).is_some_and(|&(off, _, ep)| {
            self.sb.locate(off).is_some_and(|(s, at)| {
                let mut here = self.cursors.iter().filter(|c| c.segment == s).peekable();
                ep == self.epoch
                    && match here.peek() {
                        Some(_) => here.any(|c| at == c.pos || at == c.aligned()),
                        None => at == 0,
                    }
            })
        })
    }

    /// Steps over the damaged checkpoint record `at_known_checkpoint_record`
    /// found: it changes no block, so a damaged newest checkpoint must not
    /// cut the roll-forward from the older one short.
    fn step_over_known(
        &mut self,
        known: &HashMap<u64, (u64, u32, u32)>,
    ) -> Result<(), RecoveryError> {
        let (off, len, _) = known[&self.expected];
        let (s, at) = self.sb.locate(off).expect("checked above");
        let i = match self.cursors.iter().position(|c| c.segment == s) {
            Some(i) => i,
            None => {
                let buf = read_segment(self.storage, self.sb, s)?;
                self.enter(s, buf, 0)
            }
        };
        self.skipped.push(self.expected);
        let m = self.needed.entry(s).or_insert(0);
        *m = (*m).max(self.expected);
        self.cursors[i].pos = at + len as usize;
        self.expected += 1;
        Ok(())
    }

    /// Moves the cursor of a stream to another segment whose first record
    /// continues the chain. False if there is none: the chain ends here.
    fn switch_segment(&mut self, index: &HashMap<u64, Vec<u64>>) -> Result<bool, RecoveryError> {
        let tag = self.sb.volume_tag();
        // Every candidate is tried: a stale segment of a crashed epoch
        // may share the expected first seq with the real next one.
        let candidates: Vec<u64> = index
            .get(&self.expected)
            .into_iter()
            .flatten()
            .copied()
            .collect();
        for s in candidates {
            if self.cursors.iter().any(|c| c.segment == s) {
                continue;
            }
            let b = read_segment(self.storage, self.sb, s)?;
            if chain_record_at(&b, 0, tag, self.expected, self.epoch).is_some() {
                self.enter(s, b, 0);
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Where the chain ended (the data stream's cursor: where the log goes
    /// on) and what the roll-forward did.
    fn into_recovered(self, snapshot_seq: u64) -> Recovered {
        let data = &self.cursors[0];
        Recovered {
            map: BlockMap::new(0),
            segment: data.segment,
            end: data.pos,
            last_seq: self.expected - 1,
            last_epoch: self.epoch,
            checkpoint_generation: 0,
            replayed_records: self.replayed,
            replayed_map_records: self.map_records,
            snapshot_seq,
            needed_segments: self.needed,
            warnings: Vec::new(),
            skipped: self.skipped,
            salvage: None,
            rolled_segments: self.rolled_segments,
            tables: None,
            new_records: self.new_records,
        }
    }
}

/// Does replaying a record of this kind change the map?
fn changes_map(kind: RecordKind) -> bool {
    matches!(
        kind,
        RecordKind::Data | RecordKind::Zero | RecordKind::Trim | RecordKind::Ref
    )
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
        RecordKind::Epoch
        | RecordKind::MapChunk
        | RecordKind::MapDir
        | RecordKind::MapTable
        | RecordKind::CkptCommit
        | RecordKind::Synced => Ok(()),
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
        .is_none_or(|end| end > sb.segment_offset_end())
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
    lazy: bool,
) -> Result<(BlockMap, Start, Option<LoadedTables>), String> {
    let (h, rec) = read_record(storage, sb, p.commit_offset, p.commit_len)?;
    if h.kind != RecordKind::CkptCommit || h.seq != p.commit_seq || h.epoch != p.commit_epoch {
        return Err("pointer does not name its commit record".into());
    }
    let commit = CommitPayload::decode(&rec[RECORD_HEADER_BYTES..]).map_err(|e| e.to_string())?;
    if commit.logical_blocks != sb.logical_blocks() {
        return Err("checkpoint is for another logical size".into());
    }
    let loaded = load_commit_map(storage, sb, p, &commit, Load::Whole { lazy })?;
    let mut checkpoint_segments = HashMap::new();
    let records = loaded.records.iter().copied();
    for (off, seq) in records.chain([(p.commit_offset, p.commit_seq)]) {
        if let Some((seg, _)) = sb.locate(off) {
            let m = checkpoint_segments.entry(seg).or_insert(0);
            *m = seq.max(*m);
        }
    }
    let start = checkpoint_start(sb, p, &commit, checkpoint_segments)?;
    Ok((loaded.map, start, loaded.tables))
}

/// A data entry must point inside one segment of the data area.
pub fn check_entry_location(sb: &Superblock, e: MapEntry) -> Result<(), String> {
    if let EntryState::Data { offset, len, .. } = e.state().map_err(|e| e.to_string())? {
        let rel = offset
            .checked_sub(sb.data_offset_bytes)
            .ok_or("points into the metadata area")?;
        let segment = rel / sb.segment_size_bytes;
        if segment >= sb.segment_count()
            || rel % sb.segment_size_bytes + u64::from(len) > sb.segment_size_bytes
        {
            return Err(format!("points outside the data area ({offset}+{len})"));
        }
        if sb.is_metadata_segment(segment) {
            return Err(format!("points into the metadata device ({offset}+{len})"));
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
