//! Where recovery chooses a checkpoint (`recover_with`): the newest
//! pointer, else (fallbacks, each verified against the records its map
//! names) the older pointer and the newest intact commit records a scan of
//! the log finds (`CheckpointSearch`); a replay from seq 1 when no
//! checkpoint was ever written. No result may end below a seq the volume
//! certified as flushed (`certified_beyond`, `Certified`). Uses
//! `checkpoint` (loading a candidate), `chain` (its roll-forward),
//! `certified`, `scan`, `superblock` (the pointer slots) and `outcome`.
use super::certified::{read_flush_mark, Certified};
use super::chain::{log_start, roll_forward, ReadSegments};
use super::checkpoint::{load_checkpoint, scanned_commits, Known, Load, LoadedCheckpoint, Source};
use super::outcome::Recovered;
use super::scan::{
    first_record_index, read_segment, read_segment_around, scan_log, synced_payload, LogScan,
};
use super::superblock::{damaged_pointer_slots, pointers_newest_first};
use crate::error::{CheckpointError, RecoveryError, ShortRollForward};
use crate::logread::{read_record, volume_map, LogPages};
use crate::map::BlockMap;
use crate::records::walk_segment;
use cvol_format::record::{RecordHeader, RecordKind};
use cvol_format::seal;
use cvol_format::{CheckpointPointer, EntryState, Superblock};
use cvol_storage::Storage;
use std::collections::HashMap;

/// How recovery reads a checkpoint's map pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pages {
    /// Every page read into memory (`recover`).
    Read,
    /// Left on disk; the newest pointer's verified when first read (when
    /// the older pointer decodes too: `Load::lazy_for`), a fallback's all
    /// verified now (`recover_lazy`).
    Lazy,
    /// Left on disk, every one verified now (`recover_lazy_verified`).
    LazyVerified,
}

/// `recover`, `recover_lazy` and `recover_lazy_verified`.
pub(super) fn recover_with(
    storage: &dyn Storage,
    sb: &Superblock,
    lazy: Pages,
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
    let mut certified = Certified::from_pointers(&ptrs);
    let mark = read_flush_mark(storage, sb);
    certified.raise_from_flush_mark(mark);
    let flush_mark = mark.map_or(0, |m| m.seq);
    let known = Known::new(storage, sb, &ptrs);
    if !had_checkpoint {
        return replay_without_checkpoint(storage, sb, &index, &known, flush_mark, warnings);
    }
    let search = CheckpointSearch {
        storage,
        sb,
        index: &index,
        known: &known,
        lazy,
        older_commit_seq: (ptrs.get(1).map(|p| p.commit_seq)).filter(|&s| s < ptrs[0].commit_seq),
        certified,
        flush_mark,
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
    known: &Known,
    flush_mark: u64,
    warnings: Vec<String>,
) -> Result<Recovered, RecoveryError> {
    let start = log_start(index).ok_or(RecoveryError::NeverInitialised)?;
    let mut map = volume_map(sb);
    let (r, read) = roll_forward(storage, sb, &mut map, start, index, known)?;
    let beyond = certified_beyond(storage, sb, &r, index, &read);
    if let Some(certified) = beyond.or((flush_mark > r.last_seq).then_some(flush_mark)) {
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
        head_segment: head_segment(read, r.segment),
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
    known: &'a Known<'a>,
    /// How map pages are read.
    lazy: Pages,
    /// The commit seq of the older pointer, if two decode: the newest
    /// pointer's candidate then verifies its pages when first read
    /// (`Load::lazy_for`).
    older_commit_seq: Option<u64>,
    /// The highest certified seq known so far (the pointers'; the whole
    /// log's once it has been scanned).
    certified: Certified,
    /// The seq the flush mark certifies (0 without one): every candidate,
    /// the newest pointer's too, must roll forward to it.
    flush_mark: u64,
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
        let load = match self.lazy {
            Pages::Lazy => Load::lazy_for(newest, self.older_commit_seq, p.commit_seq),
            Pages::LazyVerified => Load::lazy_for(false, None, p.commit_seq),
            Pages::Read => Load::Whole,
        };
        let (mut map, start, tables) = match load_checkpoint(storage, sb, p, load) {
            Ok(LoadedCheckpoint {
                map, start, tables, ..
            }) => (map, start, tables),
            Err(e) => {
                self.warnings.push(format!("{what} unusable: {e}"));
                return Ok(None);
            }
        };
        let rolled = roll_forward(storage, sb, &mut map, start, self.index, self.known);
        let (r, read) = match rolled {
            Ok(x) => x,
            Err(e) => {
                self.warnings
                    .push(format!("{what}: roll-forward failed: {e}"));
                return Ok(None);
            }
        };
        if let Some(certified) = certified_beyond(storage, sb, &r, self.index, &read) {
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
        if r.last_seq < self.flush_mark {
            // Damage took the log's tail with every SYNCED record that
            // certified it; the mark outside the log still does.
            self.warnings.push(format!(
                "{what}: its chain of records ends at seq {}, below seq {} that the flush mark \
                 certifies",
                r.last_seq, self.flush_mark
            ));
            self.chain_gap.get_or_insert((r.last_seq, self.flush_mark));
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
            head_segment: head_segment(read, r.segment),
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

/// The end's segment `segment` among those roll-forward read whole.
fn head_segment(read: ReadSegments, segment: u64) -> Option<Vec<u8>> {
    (read.into_iter()).find_map(|(s, buf)| (s == segment).then_some(buf))
}

/// The highest seq a SYNCED record found beyond the recovered chain's end
/// certifies as flushed, if the chain did not reach it: records the chain
/// should have passed are damaged (a crash's unsynced tail never is
/// certified: a SYNCED record is written only after its sync completed).
/// `read`: segments the roll-forward read whole, not read again.
fn certified_beyond(
    storage: &dyn Storage,
    sb: &Superblock,
    r: &Recovered,
    index: &HashMap<u64, Vec<u64>>,
    read: &ReadSegments,
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
        let kept = read
            .iter()
            .find(|(k, _)| *k == s)
            .map(|(_, b)| b.as_slice());
        let fresh;
        let buf = match kept {
            Some(b) => b,
            None => {
                fresh = read_segment(storage, sb, s)
                    .unwrap_or_else(|_| read_segment_around(storage, sb, s));
                &fresh[..]
            }
        };
        for (at, h) in walk_segment(buf, sb.volume_tag()).records {
            if h.kind != RecordKind::Synced || h.seq <= r.last_seq {
                continue;
            }
            let rec = &buf[at..at + h.total_len()];
            let Some(certified) = seal::payload(sb.sealer(), &h, rec)
                .ok()
                .and_then(|p| synced_payload(&p))
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

/// Every DATA entry of `map` names an intact record holding its block (a
/// fallback checkpoint may predate the reuse of segments it points into).
fn verify_map_records(
    storage: &dyn Storage,
    sb: &Superblock,
    map: &BlockMap,
) -> Result<(), CheckpointError> {
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
                bad = Some(CheckpointError::NamesNoRecord { lba, offset });
            }
        }
    })
    .map_err(CheckpointError::MapPages)?;
    bad.map_or(Ok(()), Err)
}
