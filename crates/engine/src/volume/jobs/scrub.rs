//! Scrub: verifies every mapped block of a live volume in the background.
//!
//! The map is walked in LBA order in batches: the entries of a batch (and
//! copies of records still only in the open segment's buffer) are taken
//! under the state lock, then every record they name is read from the store
//! (never from the read or unit caches: the point is to check the media),
//! verified (record crc, the map's identity check, decompression)
//! outside every lock. A block that fails is looked up again and verified
//! once more, because the cleaner may have moved its record (and its old
//! segment been reused) in between; only a failure on an entry that did not
//! change counts. The pace is limited to `bytes_per_sec` of logical data,
//! and the scrub pauses while clients are busy (at most a second per batch,
//! so it always progresses). It also checks both superblock copies and the
//! newest checkpoint (pointer, commit and map chunk records).
//!
//! Scrub findings are counted in their own `stat` keys (`scrub_*`), not in
//! `corrupt_reads`, which stays the count of client reads refused.
use crate::error::VolError;
use crate::records::{block_index, DecodedUnit};
use crate::volume::read::READ_MERGE_MAX_BYTES;
use crate::volume::Volume;
use cvol_format::checkpoint::{CommitPayload, DirList, DirPayload, DirSummary};
use cvol_format::checkpoint::{DIR_PAGES, MAP_PAGE_BLOCKS};
use cvol_format::record::{RecordHeader, RecordKind};
use cvol_format::seal::{self, Sealer};
use cvol_format::superblock::FLAG_DIR_SUMMARY;
use cvol_format::{CheckpointPointer, EntryState, MapEntry, Superblock, BLOCK_SIZE_BYTES};
use serde::Serialize;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Blocks of the map taken per batch (1 MiB of logical space).
const SCRUB_BATCH_BLOCKS: u64 = 256;
/// Verification attempts of a block whose entry keeps changing under it.
const SCRUB_ATTEMPTS: u32 = 3;
/// Longest pause for busy clients per batch.
const SCRUB_YIELD_MAX: Duration = Duration::from_secs(1);
/// Longest single sleep (cancellation is noticed within it).
const SCRUB_SLEEP_SLICE: Duration = Duration::from_millis(50);

/// How a scrub runs.
#[derive(Debug, Clone)]
pub struct ScrubOptions {
    /// Logical bytes of data verified per second at most (0: no limit).
    pub bytes_per_sec: u64,
    /// Pause while clients issued a request in the last 20 ms.
    pub yield_to_clients: bool,
    /// Findings listed in the report (the counts are always complete).
    pub max_listed: usize,
}

impl Default for ScrubOptions {
    fn default() -> Self {
        ScrubOptions {
            bytes_per_sec: 64 << 20,
            yield_to_clients: true,
            max_listed: 1000,
        }
    }
}

/// Where a running scrub is.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ScrubProgress {
    /// Number of this run since the volume was opened (1, 2, ...).
    pub run: u64,
    /// Data blocks verified so far, and the data blocks mapped at the start.
    pub blocks_checked: u64,
    pub blocks_total: u64,
    pub bytes_checked: u64,
    pub corrupt_blocks: u64,
    pub unreadable_blocks: u64,
    pub elapsed_secs: f64,
}

/// One block that failed.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ScrubFinding {
    pub lba: u64,
    pub detail: String,
}

/// What a scrub found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ScrubReport {
    pub run: u64,
    /// Data blocks verified (zero and unmapped blocks hold nothing to verify).
    pub blocks_checked: u64,
    /// Their logical bytes.
    pub bytes_checked: u64,
    /// Distinct records read and verified (a unit or shared record once per batch).
    pub records_checked: u64,
    /// Record bytes read from the store.
    pub stored_bytes_read: u64,
    /// Blocks whose record failed verification (crc, identity, decompression).
    pub corrupt_blocks: u64,
    /// The first `max_listed` of them, in LBA order.
    pub corrupt: Vec<ScrubFinding>,
    /// Blocks whose record could not be read (I/O error).
    pub unreadable_blocks: u64,
    pub unreadable: Vec<ScrubFinding>,
    /// Blocks not verified because their entry kept changing (busy writers).
    pub skipped_blocks: u64,
    /// Superblock and checkpoint problems.
    pub metadata_errors: Vec<String>,
    /// Stopped before the end (server shutdown, `cancel_scrub`).
    pub cancelled: bool,
    pub elapsed_secs: f64,
    pub finished_unix: u64,
}

impl ScrubReport {
    /// Nothing wrong was found (a cancelled scrub may still be clean so far).
    pub fn clean(&self) -> bool {
        self.corrupt_blocks == 0 && self.unreadable_blocks == 0 && self.metadata_errors.is_empty()
    }
}

/// What `scrub-status` answers: the running scrub, and the last report.
#[derive(Debug, Clone, Serialize)]
pub struct ScrubStatus {
    pub running: bool,
    /// The running run's number, else the last one's (0: none yet).
    pub run: u64,
    pub progress: Option<ScrubProgress>,
    pub last_report: Option<ScrubReport>,
}

/// A scrub was asked for while one runs (its progress).
#[derive(Debug, Clone)]
pub struct ScrubRunning(pub ScrubProgress);

impl std::fmt::Display for ScrubRunning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "a scrub is already running (run {}, {} of {} blocks)",
            self.0.run, self.0.blocks_checked, self.0.blocks_total
        )
    }
}

impl std::error::Error for ScrubRunning {}

/// Per-volume scrub state and counters (for `stat` and `scrub-status`).
#[derive(Debug, Default)]
pub(in crate::volume) struct ScrubState {
    running: AtomicBool,
    cancel: AtomicBool,
    started_runs: AtomicU64,
    pub(in crate::volume) finished_runs: AtomicU64,
    pub(in crate::volume) blocks_checked_total: AtomicU64,
    pub(in crate::volume) corrupt_blocks_total: AtomicU64,
    pub(in crate::volume) last_finished_unix: AtomicU64,
    /// Leaf locks (nothing is taken while they are held), holding copies
    /// for status reports: a panic elsewhere cannot leave them half-updated.
    progress: Mutex<Option<ScrubProgress>>,
    last: Mutex<Option<ScrubReport>>,
}

/// A leaf lock of snapshot data, read through a poison.
fn leaf<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ScrubState {
    pub(in crate::volume) fn in_progress(&self) -> Option<ScrubProgress> {
        leaf(&self.progress).clone()
    }

    fn set_progress(&self, p: Option<ScrubProgress>) {
        *leaf(&self.progress) = p;
    }
}

/// Clears the running flag however the scrub ends.
struct RunningGuard<'a>(&'a ScrubState);

impl Drop for RunningGuard<'_> {
    fn drop(&mut self) {
        // Under the progress lock: whoever sees no progress (`scrub_status`
        // says not running) also finds the flag clear, so a scrub started
        // right then is not refused; a new scrub's progress waits for the
        // lock, so this clears only its own.
        let mut progress = leaf(&self.0.progress);
        *progress = None;
        self.0.cancel.store(false, Ordering::SeqCst);
        self.0.running.store(false, Ordering::SeqCst);
    }
}

/// How long to wait before going on, so that `done` bytes after `elapsed`
/// stay within `rate` bytes per second (0: no limit).
pub fn pace_delay(done: u64, rate: u64, elapsed: Duration) -> Duration {
    if rate == 0 {
        return Duration::ZERO;
    }
    let due = Duration::from_secs_f64(done as f64 / rate as f64);
    due.saturating_sub(elapsed)
}

/// A block of the batch and the record it needs.
struct Item {
    lba: u64,
    entry: MapEntry,
    /// The record, when it is still only in the open segment's buffer.
    buffered: Option<Arc<Vec<u8>>>,
}

#[derive(Clone)]
enum Failure {
    Corrupt(String),
    Unreadable(String),
}

/// Verified header (or failure) per record, by (offset, len).
type Verdicts = HashMap<(u64, u32), Result<RecordHeader, Failure>>;

/// Verifies and decompresses the record at byte `at`.
fn verify_record(seal: Option<&Sealer>, at: u64, rec: &[u8]) -> Result<RecordHeader, Failure> {
    DecodedUnit::decode(seal, rec)
        .map(|u| u.header)
        .map_err(|d| Failure::Corrupt(format!("record at byte {at} ({} bytes): {d}", rec.len())))
}

/// How a block that failed verification ended up after a second look.
enum Outcome {
    /// Verified now (its record moved and the first look raced the move).
    Checked,
    /// No data there any more.
    Gone,
    /// Its entry kept changing: not verified.
    Skipped,
    /// It failed twice on an entry that did not change.
    Failed(Failure),
}

impl Volume {
    /// Verifies every mapped data block, and the superblock copies and the
    /// newest checkpoint, while the volume serves. `progress` is called
    /// after every batch. Findings are logged, counted in `stat`, and
    /// reported; only a second concurrent scrub is refused.
    pub fn scrub(
        &self,
        opts: &ScrubOptions,
        progress: &dyn Fn(&ScrubProgress),
    ) -> Result<ScrubReport, ScrubRunning> {
        let run = self.claim_scrub()?;
        Ok(self.scrub_claimed(run, opts, progress))
    }

    /// Starts a scrub on a thread of its own; returns its run number, or
    /// the progress of the one already running.
    pub fn start_scrub(self: &Arc<Self>, opts: ScrubOptions) -> Result<u64, ScrubRunning> {
        let run = self.claim_scrub()?;
        let vol = self.clone();
        let spawned = std::thread::Builder::new()
            .name("cvol-scrub".into())
            .spawn(move || {
                super::background_priority();
                vol.scrub_claimed(run, &opts, &|_| {});
            });
        if let Err(e) = spawned {
            tracing::error!("cannot start the scrub thread: {e}");
            self.jobs.scrub.running.store(false, Ordering::SeqCst);
            self.jobs.scrub.set_progress(None);
        }
        Ok(run)
    }

    /// Asks a running scrub to stop after its current batch.
    pub fn cancel_scrub(&self) {
        let s = &self.jobs.scrub;
        if s.running.load(Ordering::SeqCst) {
            s.cancel.store(true, Ordering::SeqCst);
        }
    }

    /// The running scrub's progress and the last finished report.
    pub fn scrub_status(&self) -> ScrubStatus {
        let progress = self.jobs.scrub.in_progress();
        let last_report = leaf(&self.jobs.scrub.last).clone();
        ScrubStatus {
            running: progress.is_some(),
            run: progress
                .as_ref()
                .map(|p| p.run)
                .or(last_report.as_ref().map(|r| r.run))
                .unwrap_or(0),
            progress,
            last_report,
        }
    }

    fn claim_scrub(&self) -> Result<u64, ScrubRunning> {
        let s = &self.jobs.scrub;
        if s.running.swap(true, Ordering::SeqCst) {
            // Another scrub holds the flag; its progress may not be set yet.
            return Err(ScrubRunning(s.in_progress().unwrap_or_default()));
        }
        let run = s.started_runs.fetch_add(1, Ordering::SeqCst) + 1;
        let total = self.state.lock_for_report().live.counters().data_blocks;
        s.set_progress(Some(ScrubProgress {
            run,
            blocks_total: total,
            ..ScrubProgress::default()
        }));
        s.cancel.store(false, Ordering::SeqCst);
        Ok(run)
    }

    fn scrub_claimed(
        &self,
        run: u64,
        opts: &ScrubOptions,
        progress: &dyn Fn(&ScrubProgress),
    ) -> ScrubReport {
        let _running = RunningGuard(&self.jobs.scrub);
        let start = Instant::now();
        let blocks_total = self.jobs.scrub.in_progress().map_or(0, |p| p.blocks_total);
        tracing::info!(run, rate = opts.bytes_per_sec, "scrub started");
        let mut rep = ScrubReport {
            run,
            metadata_errors: self.scrub_metadata(),
            ..ScrubReport::default()
        };
        for e in &rep.metadata_errors {
            tracing::error!("scrub: {e}");
        }
        let mut lba = 0;
        loop {
            if self.jobs.scrub.cancel.load(Ordering::SeqCst) {
                rep.cancelled = true;
                break;
            }
            if opts.yield_to_clients {
                self.scrub_yield();
            }
            match self.scrub_next_batch(lba, opts, &mut rep) {
                Ok(Some(next)) => lba = next,
                Ok(None) => break,
                Err(e) => {
                    rep.metadata_errors.push(format!("scrub stopped: {e}"));
                    rep.cancelled = true;
                    break;
                }
            }
            let p = ScrubProgress {
                run,
                blocks_checked: rep.blocks_checked,
                blocks_total: blocks_total.max(rep.blocks_checked),
                bytes_checked: rep.bytes_checked,
                corrupt_blocks: rep.corrupt_blocks,
                unreadable_blocks: rep.unreadable_blocks,
                elapsed_secs: start.elapsed().as_secs_f64(),
            };
            self.jobs.scrub.set_progress(Some(p.clone()));
            progress(&p);
            self.scrub_pace(rep.bytes_checked, opts.bytes_per_sec, start);
        }
        self.finish_scrub(rep, start)
    }

    /// Pauses while clients are busy, at most `SCRUB_YIELD_MAX`.
    fn scrub_yield(&self) {
        let since = Instant::now();
        while self.activity.clients_busy() && since.elapsed() < SCRUB_YIELD_MAX {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Rate limit, in slices so a cancel is noticed.
    fn scrub_pace(&self, done: u64, rate: u64, start: Instant) {
        loop {
            let d = pace_delay(done, rate, start.elapsed());
            if d.is_zero() || self.jobs.scrub.cancel.load(Ordering::SeqCst) {
                break;
            }
            std::thread::sleep(d.min(SCRUB_SLEEP_SLICE));
        }
    }

    /// Verifies the next batch of mapped blocks at or after `lba`; returns
    /// where the next batch starts, None at the end of the map.
    fn scrub_next_batch(
        &self,
        lba: u64,
        opts: &ScrubOptions,
        rep: &mut ScrubReport,
    ) -> Result<Option<u64>, VolError> {
        let blocks = self.sb.logical_blocks();
        let next = self.lock_state()?.live.map().next_allocated_page_lba(lba);
        let Some(first) = next.filter(|&f| f < blocks) else {
            return Ok(None);
        };
        let n = SCRUB_BATCH_BLOCKS.min(blocks - first);
        let before = rep.blocks_checked;
        self.scrub_batch(first, n, opts, rep)?;
        self.jobs
            .scrub
            .blocks_checked_total
            .fetch_add(rep.blocks_checked - before, Ordering::Relaxed);
        Ok(Some(first + n))
    }

    fn finish_scrub(&self, mut rep: ScrubReport, start: Instant) -> ScrubReport {
        rep.elapsed_secs = start.elapsed().as_secs_f64();
        rep.finished_unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let s = &self.jobs.scrub;
        s.finished_runs.fetch_add(1, Ordering::Relaxed);
        s.last_finished_unix
            .store(rep.finished_unix, Ordering::Relaxed);
        tracing::info!(
            run = rep.run,
            blocks = rep.blocks_checked,
            corrupt = rep.corrupt_blocks,
            unreadable = rep.unreadable_blocks,
            metadata_errors = rep.metadata_errors.len(),
            cancelled = rep.cancelled,
            secs = rep.elapsed_secs,
            "scrub finished"
        );
        *leaf(&s.last) = Some(rep.clone());
        rep
    }

    /// The data entries of `n` blocks from `first`, with copies of records
    /// still in the open segment's buffer (one short hold of the lock).
    fn scrub_snapshot(&self, first: u64, n: u64) -> Result<Vec<Item>, VolError> {
        let mut st = self.lock_state()?;
        self.fault(&mut st, first, first + n)?;
        let mut copies: HashMap<u64, Arc<Vec<u8>>> = HashMap::new();
        let mut items = Vec::new();
        for lba in first..first + n {
            let entry = st.live.get(lba);
            let EntryState::Data { offset, len, .. } = entry.state_valid() else {
                continue;
            };
            let buffered = match copies.get(&offset) {
                Some(c) if c.len() == len as usize => Some(c.clone()),
                _ => st.log.buffered(offset, len as usize).map(|b| {
                    let c = Arc::new(b.to_vec());
                    copies.insert(offset, c.clone());
                    c
                }),
            };
            items.push(Item {
                lba,
                entry,
                buffered,
            });
        }
        Ok(items)
    }

    fn scrub_batch(
        &self,
        first: u64,
        n: u64,
        opts: &ScrubOptions,
        rep: &mut ScrubReport,
    ) -> Result<(), VolError> {
        let items = self.scrub_snapshot(first, n)?;
        let results = self.scrub_verify(&items, rep);
        for (item, res) in items.iter().zip(results) {
            let outcome = match res {
                Ok(()) => Outcome::Checked,
                Err(failure) => self.scrub_again(item, failure, rep)?,
            };
            self.record_outcome(item.lba, outcome, opts, rep);
        }
        rep.bytes_checked = rep.blocks_checked * BLOCK_SIZE_BYTES;
        Ok(())
    }

    /// The record of a block that failed may have moved (cleaner,
    /// overwrite) since the snapshot: verifies what the map names now, and
    /// reports only a failure on an entry that stayed the same.
    fn scrub_again(
        &self,
        item: &Item,
        failure: Failure,
        rep: &mut ScrubReport,
    ) -> Result<Outcome, VolError> {
        let mut last = (item.entry, failure);
        for _ in 1..SCRUB_ATTEMPTS {
            let again = self.scrub_snapshot(item.lba, 1)?;
            let Some(now) = again.first() else {
                return Ok(Outcome::Gone);
            };
            let verdict = self.scrub_verify(&again[..1], rep).pop();
            match verdict.expect("one result per item") {
                Ok(()) => return Ok(Outcome::Checked),
                Err(f) if now.entry == last.0 => return Ok(Outcome::Failed(f)),
                Err(f) => last = (now.entry, f),
            }
        }
        Ok(Outcome::Skipped)
    }

    fn record_outcome(
        &self,
        lba: u64,
        outcome: Outcome,
        opts: &ScrubOptions,
        rep: &mut ScrubReport,
    ) {
        let listed = |list: &mut Vec<ScrubFinding>, detail: String| {
            if list.len() < opts.max_listed {
                list.push(ScrubFinding { lba, detail });
            }
        };
        match outcome {
            Outcome::Checked => rep.blocks_checked += 1,
            Outcome::Gone => {}
            Outcome::Skipped => rep.skipped_blocks += 1,
            Outcome::Failed(Failure::Corrupt(detail)) => {
                tracing::error!(lba, "scrub: corrupt block: {detail}");
                rep.corrupt_blocks += 1;
                self.jobs
                    .scrub
                    .corrupt_blocks_total
                    .fetch_add(1, Ordering::Relaxed);
                listed(&mut rep.corrupt, detail);
            }
            Outcome::Failed(Failure::Unreadable(detail)) => {
                tracing::error!(lba, "scrub: unreadable block: {detail}");
                rep.unreadable_blocks += 1;
                listed(&mut rep.unreadable, detail);
            }
        }
    }

    /// Reads and verifies the records `items` name (each once), without any
    /// lock, and checks every item's entry against its record.
    fn scrub_verify(&self, items: &[Item], rep: &mut ScrubReport) -> Vec<Result<(), Failure>> {
        // Distinct records on the store by offset (buffered ones apart).
        let mut on_store: BTreeSet<(u64, u32)> = BTreeSet::new();
        for it in items.iter().filter(|it| it.buffered.is_none()) {
            if let EntryState::Data { offset, len, .. } = it.entry.state_valid() {
                on_store.insert((offset, len));
            }
        }
        let recs: Vec<(u64, u32)> = on_store.into_iter().collect();
        let verdicts = self.read_verdicts(&recs, rep);
        rep.records_checked += verdicts.len() as u64;
        items
            .iter()
            .map(|it| {
                let EntryState::Data { offset, len, .. } = it.entry.state_valid() else {
                    return Ok(());
                };
                let header = match &it.buffered {
                    Some(rec) => verify_record(self.sb.sealer(), offset, rec)?,
                    None => match verdicts.get(&(offset, len)) {
                        Some(Ok(h)) => *h,
                        Some(Err(f)) => return Err(f.clone()),
                        None => unreachable!("every stored record has a verdict"),
                    },
                };
                block_index(it.lba, it.entry, &header)
                    .map(|_| ())
                    .map_err(|e| Failure::Corrupt(e.to_string()))
            })
            .collect()
    }

    /// Reads the records `recs` (sorted by offset) from the store, adjacent
    /// ones in one read up to READ_MERGE_MAX_BYTES, and verifies each: its
    /// header, or why it failed, by (offset, len).
    fn read_verdicts(&self, recs: &[(u64, u32)], rep: &mut ScrubReport) -> Verdicts {
        let mut verdicts = Verdicts::new();
        let mut i = 0;
        while i < recs.len() {
            let (start, _) = recs[i];
            let mut end = start + u64::from(recs[i].1);
            let mut j = i + 1;
            while j < recs.len() && recs[j].0 == end && end - start < READ_MERGE_MAX_BYTES {
                end += u64::from(recs[j].1);
                j += 1;
            }
            let mut run = vec![0u8; (end - start) as usize];
            match self.storage.read_at(start, &mut run) {
                Ok(()) => {
                    rep.stored_bytes_read += end - start;
                    for &(o, l) in &recs[i..j] {
                        let at = (o - start) as usize;
                        verdicts.insert(
                            (o, l),
                            verify_record(self.sb.sealer(), o, &run[at..at + l as usize]),
                        );
                    }
                }
                // Read the records one by one, to tell which are unreadable.
                Err(_) => {
                    for &(o, l) in &recs[i..j] {
                        verdicts.insert((o, l), self.read_one_verdict(o, l, rep));
                    }
                }
            }
            i = j;
        }
        verdicts
    }

    fn read_one_verdict(
        &self,
        o: u64,
        l: u32,
        rep: &mut ScrubReport,
    ) -> Result<RecordHeader, Failure> {
        let mut rec = vec![0u8; l as usize];
        match self.storage.read_at(o, &mut rec) {
            Ok(()) => {
                rep.stored_bytes_read += u64::from(l);
                verify_record(self.sb.sealer(), o, &rec)
            }
            Err(e) => Err(Failure::Unreadable(format!(
                "reading the record at byte {o} ({l} bytes): {e}"
            ))),
        }
    }

    /// Both superblock copies, and the newest checkpoint: its pointer, commit
    /// record and map chunk records. A checkpoint written meanwhile (its
    /// predecessor's space may be reused) makes it look again.
    fn scrub_metadata(&self) -> Vec<String> {
        let mut errors = Vec::new();
        let want = self.sb.encode();
        for (name, off) in [
            ("A", cvol_format::SUPERBLOCK_A_OFFSET),
            ("B", cvol_format::SUPERBLOCK_B_OFFSET),
        ] {
            let mut b = vec![0u8; want.len()];
            match self.storage.read_at(off, &mut b) {
                Err(e) => errors.push(format!("superblock copy {name}: unreadable: {e}")),
                Ok(()) if b[..] != want[..] => errors.push(format!(
                    "superblock copy {name} differs from the superblock in use ({})",
                    Superblock::decode(&b).map_or_else(|e| e.to_string(), |_| "valid".into())
                )),
                Ok(()) => {}
            }
        }
        let mut last = Vec::new();
        for _ in 0..SCRUB_ATTEMPTS {
            let Some(ptr) = self.newest_pointer() else {
                last = vec!["no valid checkpoint pointer".to_string()];
                continue;
            };
            let problems = self.scrub_checkpoint(&ptr);
            if problems.is_empty() || self.newest_pointer() == Some(ptr) {
                last = problems;
                break;
            }
            last = problems;
        }
        errors.extend(last);
        errors
    }

    fn newest_pointer(&self) -> Option<CheckpointPointer> {
        let slot = |i: usize| {
            let mut b = vec![0u8; cvol_format::pointer::POINTER_BYTES];
            self.storage
                .read_at(CheckpointPointer::slot_offset(i), &mut b)
                .ok()?;
            CheckpointPointer::decode(&b).ok()
        };
        CheckpointPointer::newest(slot(0), slot(1))
    }

    fn scrub_checkpoint(&self, ptr: &CheckpointPointer) -> Vec<String> {
        let read = |off: u64, len: u32| -> Result<Vec<u8>, CkptFault> {
            let mut b = vec![0u8; len as usize];
            self.storage
                .read_at(off, &mut b)
                .map_err(CkptFault::Unreadable)?;
            Ok(b)
        };
        let gen = ptr.generation;
        let commit = match read(ptr.commit_offset, ptr.commit_len).and_then(|b| {
            let (h, _) = RecordHeader::decode_verified(&b).map_err(CkptFault::Invalid)?;
            let payload = seal::payload(self.sb.sealer(), &h, &b).map_err(CkptFault::Invalid)?;
            if h.kind != RecordKind::CkptCommit || h.seq != ptr.commit_seq {
                return Err(CkptFault::Commit {
                    kind: h.kind,
                    seq: h.seq,
                });
            }
            CommitPayload::decode(&payload).map_err(CkptFault::Invalid)
        }) {
            Ok(c) => c,
            Err(e) => return vec![format!("checkpoint {gen}: commit record: {e}")],
        };
        let mut errors = Vec::new();
        for (i, c) in commit.chunks.iter().enumerate() {
            let r = read(c.offset, c.len).and_then(|b| {
                let (h, _) = RecordHeader::decode_verified(&b).map_err(CkptFault::Invalid)?;
                let payload =
                    seal::payload(self.sb.sealer(), &h, &b).map_err(CkptFault::Invalid)?;
                if !matches!(h.kind, RecordKind::MapChunk | RecordKind::MapDir) || h.crc != c.crc {
                    return Err(CkptFault::Record {
                        kind: h.kind,
                        crc: h.crc,
                    });
                }
                if h.kind == RecordKind::MapDir {
                    let dir = dir_payload(&self.sb, &h, &payload, &read)?;
                    let npages = self.sb.logical_blocks().div_ceil(MAP_PAGE_BLOCKS);
                    for (p, r) in dir.pages {
                        // Slots after the pages' name liveness tables.
                        let kind = if p < npages {
                            RecordKind::MapChunk
                        } else {
                            RecordKind::MapTable
                        };
                        let page = read(r.offset, r.len).and_then(|b| {
                            let (h, _) =
                                RecordHeader::decode_verified(&b).map_err(CkptFault::Invalid)?;
                            seal::authenticate(self.sb.sealer(), &h, &b)
                                .map_err(CkptFault::Invalid)?;
                            if h.kind != kind || h.crc != r.crc {
                                return Err(CkptFault::Record {
                                    kind: h.kind,
                                    crc: h.crc,
                                });
                            }
                            Ok(())
                        });
                        if let Err(e) = page {
                            errors.push(format!(
                                "checkpoint {gen}: map page {p} at byte {}: {e}",
                                r.offset
                            ));
                        }
                    }
                }
                Ok(())
            });
            if let Err(e) = r {
                errors.push(format!(
                    "checkpoint {gen}: map record {i} at byte {}: {e}",
                    c.offset
                ));
            }
        }
        errors
    }
}

/// The pages a MAP_DIR record (header `h`, `payload`) lists, summarized or
/// not; a list kept apart is read (`read`) and checked.
fn dir_payload(
    sb: &cvol_format::Superblock,
    h: &RecordHeader,
    payload: &[u8],
    read: &dyn Fn(u64, u32) -> Result<Vec<u8>, CkptFault>,
) -> Result<DirPayload, CkptFault> {
    let block = h.lba / (DIR_PAGES * MAP_PAGE_BLOCKS);
    match h.codec {
        cvol_format::CodecTag::None if sb.flags & FLAG_DIR_SUMMARY != 0 => {
            let (s, list) = DirSummary::decode(payload).map_err(CkptFault::Invalid)?;
            let segments = crate::map::Segments::of(sb);
            let apart;
            let list = match list {
                DirList::Inline(list) => list,
                DirList::Apart(r) => {
                    let b = read(r.offset, r.len)?;
                    let (lh, _) = RecordHeader::decode_verified(&b).map_err(CkptFault::Invalid)?;
                    apart = seal::payload(sb.sealer(), &lh, &b)
                        .map_err(CkptFault::Invalid)?
                        .to_vec();
                    crate::logread::check_dir_list(&lh, block, &r)
                        .map_err(|e| CkptFault::Summary(e.to_string()))?;
                    &apart[..]
                }
            };
            crate::map::decode_summarized(block, &s, list, segments).map_err(CkptFault::Summary)
        }
        _ => {
            let raw = lz4_flex::block::decompress_size_prepended(payload)
                .map_err(CkptFault::Directory)?;
            DirPayload::decode(&raw, block).map_err(CkptFault::Invalid)
        }
    }
}

/// What a scrub finds wrong with a checkpoint's records.
#[derive(Debug)]
enum CkptFault {
    Unreadable(std::io::Error),
    /// A header, checksum or payload that does not verify or decode.
    Invalid(cvol_format::FormatError),
    /// The pointer's commit slot holds another record.
    Commit {
        kind: RecordKind,
        seq: u64,
    },
    /// A chunk or page slot holds another record.
    Record {
        kind: RecordKind,
        crc: u32,
    },
    /// A directory payload that does not decompress.
    Directory(lz4_flex::block::DecompressError),
    /// A summarized directory whose list disagrees with its summary.
    Summary(String),
}

impl std::fmt::Display for CkptFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CkptFault::Unreadable(e) => write!(f, "unreadable: {e}"),
            CkptFault::Invalid(e) => write!(f, "{e}"),
            CkptFault::Commit { kind, seq } => write!(f, "{kind:?} record of seq {seq}"),
            CkptFault::Record { kind, crc } => write!(f, "{kind:?} record with crc {crc:#010x}"),
            CkptFault::Directory(e) => write!(f, "directory: {e}"),
            CkptFault::Summary(e) => write!(f, "directory: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pace_delay_keeps_the_rate() {
        let s = Duration::from_secs;
        assert_eq!(pace_delay(100 << 20, 0, s(0)), Duration::ZERO);
        // 64 MiB at 64 MiB/s is due after one second.
        assert_eq!(pace_delay(64 << 20, 64 << 20, s(0)), s(1));
        assert_eq!(
            pace_delay(64 << 20, 64 << 20, Duration::from_millis(400)),
            Duration::from_millis(600)
        );
        assert_eq!(pace_delay(64 << 20, 64 << 20, s(2)), Duration::ZERO);
        assert_eq!(pace_delay(3 << 20, 1 << 20, s(1)), s(2));
    }
}
