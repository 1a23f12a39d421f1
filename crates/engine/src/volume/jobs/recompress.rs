//! Background recompression (bcachefs background_compression, zram
//! recompress; EDC §3 "higher compression rate in periods of lower system
//! utilization"): when clients have been quiet for a while, cold data that
//! was written with a fast codec (lz4 under load) or in small units is
//! read back and rewritten with the volume's strong codec, merged into
//! units of the cold unit size (`ElasticConfig::recompress_unit_blocks`,
//! 64 KiB by default: larger than clients' units, as cold data is read
//! less), largest expected savings first, within a
//! budget per pass. It stops the moment a client issues a request. A pass's
//! windows are read and compressed on up to one thread per core, in
//! batches, and committed in order (`batch`).
//!
//! Safety: a rewrite is an ordinary DATA record appended to the log, and it
//! is committed only if, under the state lock, every block it replaces still
//! has the map entry that was read (compare-and-set); otherwise the run is
//! left alone. Roll-forward replays it in seq order like a client write of
//! the same content. The old records die as on an overwrite, and their
//! segments are reused only after the map pointing away is durable
//! (the cleaner's rule). Raw records (the probe, or a compression that did
//! not pay) are never retried; dedup references and the records they point
//! at are left as they are (a window's runs end at them; the cleaner
//! compresses a shared raw or lz4 unit as it moves it, `relocate`).
mod batch;

use super::{Next, Worker};
use crate::error::VolError;
use crate::policy::CodecPolicy;
use crate::volume::jobs::cleaner::IDLE_VICTIM_LIVE_MAX_PERCENT;
use crate::volume::{State, Volume};
use cvol_format::{CodecTag, EntryState, MapEntry, BLOCK_SIZE_BYTES};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Windows (of unit size) scanned per hold of the state lock.
const SCAN_WINDOWS_PER_LOCK: u64 = 4096;
/// Windows holding mapped pages scored per pass (then the cursor moves on;
/// windows of unmapped pages are skipped without counting).
const SCAN_WINDOWS_PER_PASS: u64 = 1 << 18;
/// A pass compresses at most this many times its budget of logical bytes:
/// candidates whose rewrite would not pay are compressed too before they
/// are skipped, and without a bound a pass over a volume of data the
/// strong codec cannot improve compressed all of it, holding the cleaner
/// lock throughout (1.2 GB at zstd:9 on a loaded machine: a minute and
/// more, which a closing server waits out too).
const EXAMINED_PER_BUDGET: u64 = 2;
/// Candidates a pass within a sweep scores at most: the whole chunk of
/// windows it scans, so that a segment's candidates are all known whatever
/// order the copy wrote them in (a copy over several connections, as
/// nbdcopy's, puts units of distant LBAs in one segment: with a budget's
/// worth of candidates no segment emptied on such a copy), up
/// to 1 GiB of logical data in windows (16,384 of 64 KiB, 65,536 of 16
/// KiB: about 5 MiB of candidates in memory either way, a window's
/// records growing with it; a pass outside a sweep scores twice its
/// budget).
const SWEEP_CANDIDATE_BYTES: u64 = 1 << 30;
/// Segments at most this live count as emptied by recompression.
const EMPTIED_LIVE_MAX_PERCENT: u64 = 5;
/// How often the background recompressor looks for idle time.
const BACKGROUND_PERIOD: Duration = Duration::from_millis(200);
/// The pause after a pass that rewrote data and was not interrupted: the
/// next follows at once (waiting `BACKGROUND_PERIOD` between passes was a
/// third of an idle sweep), after a moment in which whoever waits for the
/// cleaner lock takes it.
const AGAIN_PAUSE: Duration = Duration::from_millis(10);
/// Recompression appends before old records die: it runs only with this
/// many percent of free segments above the cleaner's start threshold...
const ROOM_FREE_PERCENT_ABOVE_CLEANER: u64 = 5;
/// ...and this many free segments beyond the reserve.
const ROOM_SEGMENTS: u64 = 2;

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RecompressReport {
    pub windows_scanned: u64,
    pub candidates: u64,
    pub blocks_rewritten: u64,
    pub bytes_before: u64,
    pub bytes_after: u64,
    pub skipped: u64,
    /// The pass stopped early for a client request.
    pub yielded: bool,
    /// The scan reached the end of the volume (next pass starts over).
    pub wrapped: bool,
    /// Candidate windows left alone because the space their rewrite would
    /// free sits in segments idle cleaning would not collect (they would
    /// stay more than 90% live): rewriting them would grow what the host
    /// holds.
    pub uncollectable: u64,
    /// The pass stopped where its next rewrite could have taken what the
    /// host holds above its sweep's ceiling (`recompress_pass_within`).
    pub held_back: bool,
}

/// Does a rewrite of `old` stored bytes into `new` save at least
/// `min_gain_percent` of `old`?
fn pays(old: u64, new: u64, min_gain_percent: u32) -> bool {
    new * 100 <= old * u64::from(100 - min_gain_percent.min(100))
}

/// Records background recompression may rewrite: compressed ones, and raw
/// units (only deferred compression writes those).
fn rewritable(codec: CodecTag, unit: bool) -> bool {
    codec != CodecTag::None || unit
}

fn is_raw_unit(e: MapEntry) -> bool {
    matches!(
        e.state_valid(),
        EntryState::Data {
            codec: CodecTag::None,
            unit: true,
            ..
        }
    )
}

/// What bounds a pass within a sweep.
struct Limit {
    /// Bytes the pass may add to what the host holds (beyond its first
    /// segment's rewrites).
    room: u64,
    /// What the host held when the pass began.
    held: u64,
    /// Each candidate's segment, in the pass's order.
    segs: Vec<u64>,
}

struct Candidate {
    first: u64,
    score: u64,
    /// The weak records the rewrite would replace: (offset, stored bytes).
    records: Vec<(u64, u32)>,
}

impl Volume {
    /// Blocks of a window: the unit cold data is rewritten in.
    fn window_blocks(&self) -> u64 {
        self.recompress_unit_blocks()
    }

    /// Is entry `e` a record worth rewriting with the strong codec? lz4
    /// records, single-block records of a compressing codec (too small a
    /// unit) and raw units (deferred compression); not raw single blocks
    /// (judged incompressible), not dedup-shared ones.
    fn weak(st: &State, e: MapEntry) -> Option<(u64, u32)> {
        let (codec, unit, offset, len) = Self::unreferenced_owner(st, e)?;
        matches!(
            (codec, unit),
            (CodecTag::Lz4, _) | (CodecTag::Zstd, false) | (CodecTag::None, true)
        )
        .then_some((offset, len))
    }

    /// An owner entry whose record no dedup reference points at (one that
    /// references point at stays live for them: rewriting its owners would
    /// store their data twice): its record's codec, whether it is a unit,
    /// its offset and length.
    fn unreferenced_owner(st: &State, e: MapEntry) -> Option<(CodecTag, bool, u64, u32)> {
        match e.state_valid() {
            EntryState::Data {
                codec,
                offset,
                len,
                shared: false,
                unit,
            } if st.live.shared().get(offset).is_none_or(|s| s.refs == 0) => {
                Some((codec, unit, offset, len))
            }
            _ => None,
        }
    }

    /// Scores up to `windows` windows that hold mapped pages, from
    /// `cursor`, stopping at `max_candidates` candidates; returns them and
    /// the window to resume at. Windows of
    /// unallocated pages are skipped without counting (the map finds the
    /// next allocated page a word of 64 pages at a time), so a pass over
    /// a large, mostly empty volume costs what is mapped, not the logical
    /// size.
    fn scan_candidates(
        &self,
        cursor: u64,
        windows: u64,
        max_candidates: usize,
    ) -> Result<(Vec<Candidate>, u64), VolError> {
        let w = self.window_blocks();
        let total = self.sb.logical_blocks().div_ceil(w);
        let mut out = Vec::new();
        let mut at = cursor.min(total);
        let mut scored = 0u64;
        let more = |at: u64, scored: u64, found: usize| {
            at < total && scored < windows && found < max_candidates
        };
        while more(at, scored, out.len()) {
            let mut st = self.lock_state()?;
            let mut this_lock = 0u64;
            while more(at, scored, out.len()) && this_lock < SCAN_WINDOWS_PER_LOCK {
                let first = at * w;
                match st.live.map().next_allocated_page_lba(first) {
                    Some(p) if p < first + w => {}
                    Some(p) => {
                        at = p / w;
                        continue;
                    }
                    None => {
                        at = total;
                        break;
                    }
                }
                at += 1;
                scored += 1;
                this_lock += 1;
                self.fault(&mut st, first, first + w)?;
                if let Some((score, records)) = Self::window_score(&st, first, w) {
                    out.push(Candidate {
                        first,
                        score,
                        records,
                    });
                }
            }
        }
        Ok((out, at))
    }

    /// Stored bytes of the weak records in the window of `w` blocks from
    /// `first`, each record once, and the records; None if there are none.
    fn window_score(st: &State, first: u64, w: u64) -> Option<(u64, Vec<(u64, u32)>)> {
        let last = (first + w).min(st.live.blocks());
        let mut seen: Vec<(u64, u32)> = Vec::new();
        for l in first..last {
            // Dedup references (and the records they point at, not `weak`)
            // stay as they are: the window's runs end at them.
            let e = st.live.get(l);
            if let Some((offset, len)) = Self::weak(st, e) {
                if !seen.iter().any(|&(o, _)| o == offset) {
                    seen.push((offset, len));
                }
            }
        }
        let score = seen.iter().map(|&(_, len)| u64::from(len)).sum::<u64>();
        (score > 0).then_some((score, seen))
    }

    /// Keeps the candidates whose gain idle cleaning can collect: after all
    /// the candidates' rewrites, every segment holding one of its records is
    /// at most `IDLE_VICTIM_LIVE_MAX_PERCENT` live. (A rewrite appends its
    /// new records first; the old ones' space returns to the host only when
    /// their segment is cleaned.) Returns how many were dropped.
    fn keep_collectable(&self, cands: &mut Vec<Candidate>) -> Result<u64, VolError> {
        let st = self.lock_state()?;
        let size = self.sb.segment_size_bytes;
        let mut freed: HashMap<u64, u64> = HashMap::new();
        for c in cands.iter() {
            for &(offset, len) in &c.records {
                *freed.entry(st.segment_of(offset)).or_default() += u64::from(len);
            }
        }
        let usage = st.live.usage();
        let collectable = |seg: u64| {
            let left = usage.live_bytes(seg).saturating_sub(freed[&seg]);
            left * 100 <= size * IDLE_VICTIM_LIVE_MAX_PERCENT
        };
        let before = cands.len();
        cands.retain(|c| {
            c.records
                .iter()
                .all(|&(offset, _)| collectable(st.segment_of(offset)))
        });
        Ok((before - cands.len()) as u64)
    }

    /// Orders the candidates segment by segment (the segment holding a
    /// candidate's first record), the segments their rewrites would leave
    /// least live first: each is emptied of them as early as it can be, for
    /// collection to give its space back. Returns each candidate's segment.
    fn order_by_segment(&self, cands: &mut [Candidate]) -> Result<Vec<u64>, VolError> {
        let st = self.lock_state()?;
        let seg = |c: &Candidate| {
            (c.records.iter())
                .map(|&(offset, _)| st.segment_of(offset))
                .min()
                .unwrap_or(u64::MAX)
        };
        let mut freed: HashMap<u64, u64> = HashMap::new();
        for c in cands.iter() {
            for &(offset, len) in &c.records {
                *freed.entry(st.segment_of(offset)).or_default() += u64::from(len);
            }
        }
        let usage = st.live.usage();
        let left = |s: u64| {
            let freed = freed.get(&s).copied().unwrap_or(0);
            usage.live_bytes(s).saturating_sub(freed)
        };
        cands.sort_by_cached_key(|c| {
            let s = seg(c);
            (left(s), s, c.first)
        });
        Ok(cands.iter().map(seg).collect())
    }

    /// The most a candidate's rewrite can append: its records again (a
    /// deferred raw unit is rewritten even without a gain), a record header
    /// per block and a sector of padding.
    fn append_bound(&self, c: &Candidate) -> u64 {
        let overhead = self.window_blocks() * self.sb.record_overhead() as u64;
        c.score + overhead + 512
    }

    /// What the host holds now (`host_held_bytes`).
    fn host_held_now(&self) -> Result<u64, VolError> {
        let st = self.lock_state()?;
        Ok(self.host_held_bytes(&st))
    }

    /// One background pass: scans windows from the cursor, rewrites the
    /// best candidates until `budget_bytes` of logical data were rewritten.
    /// With `yield_to_clients` it stops at the first client request.
    pub fn recompress_pass(
        &self,
        budget_bytes: u64,
        yield_to_clients: bool,
    ) -> Result<RecompressReport, VolError> {
        Ok(self
            .recompress_pass_within(budget_bytes, yield_to_clients, None)?
            .0)
    }

    /// `recompress_pass`; within a `sweep`, one that takes its candidates
    /// segment by segment (`order_by_segment`: the candidates of the whole
    /// chunk scanned, up to `SWEEP_CANDIDATE_BYTES`, not a budget's worth)
    /// and adds at most the sweep's room under its ceiling to what the
    /// host holds, besides the rewrites of its first segment, which it may
    /// always do (so that a sweep starting with no room progresses).
    /// Returns the report and the segments whose candidates were all
    /// handled, some rewritten.
    pub(in crate::volume) fn recompress_pass_within(
        &self,
        budget_bytes: u64,
        yield_to_clients: bool,
        mut sweep: Option<&mut Sweep>,
    ) -> Result<(RecompressReport, Vec<u64>), VolError> {
        self.check_writable()?;
        let CodecPolicy::Auto { strong } = self.policy else {
            return Ok((RecompressReport::default(), Vec::new()));
        };
        let _c = self.lock_cleaner()?;
        let mut rep = RecompressReport::default();
        let total = self.sb.logical_blocks().div_ceil(self.window_blocks());
        let cursor = self
            .jobs
            .recompress_cursor
            .load(Ordering::Relaxed)
            .min(total);
        let window_bytes = self.window_blocks() * BLOCK_SIZE_BYTES;
        let examined = budget_bytes.saturating_mul(EXAMINED_PER_BUDGET) / window_bytes;
        if let Some(s) = sweep.as_deref_mut() {
            s.skipped.at_chunk(cursor);
        }
        let (cands, end, limit) =
            self.pass_candidates(cursor, examined, sweep.as_deref(), &mut rep)?;
        let mut finished = true;
        let mut p = batch::Progress::new(budget_bytes);
        let mut i = 0;
        while i < cands.len() {
            rep.yielded = yield_to_clients && self.clients_or_writers_waiting();
            let n = match rep.yielded {
                true => 0,
                false => {
                    self.next_batch(&cands[i..], i, examined, p.budget, limit.as_ref(), &mut rep)?
                }
            };
            if n == 0 {
                finished = false;
                break;
            }
            let firsts: Vec<u64> = cands[i..i + n].iter().map(|c| c.first).collect();
            let prepared = self.prepare_windows(&firsts, strong, yield_to_clients)?;
            let (lim, sw) = (limit.as_ref(), &mut sweep);
            if !self.commit_batch(i, prepared, &firsts, lim, sw, &mut p, &mut rep)? {
                finished = false;
                break;
            }
            i += n;
        }
        let handled = p.handled;
        // The next pass resumes after this chunk only once all its
        // candidates were handled (rewritten ones are strong now).
        if finished {
            rep.wrapped = end >= total;
            let next = if rep.wrapped { 0 } else { end };
            self.jobs.recompress_cursor.store(next, Ordering::Relaxed);
        }
        self.counters.elastic.count_recompress_pass(&rep);
        Ok((rep, handled))
    }

    /// The candidates of a pass from `cursor` and the window after them:
    /// within a sweep, every candidate of the chunk scanned but those the
    /// sweep skipped, segment by segment, with the pass's `Limit`; else at
    /// most `examined`, largest expected savings first.
    fn pass_candidates(
        &self,
        cursor: u64,
        examined: u64,
        sweep: Option<&Sweep>,
        rep: &mut RecompressReport,
    ) -> Result<(Vec<Candidate>, u64, Option<Limit>), VolError> {
        let max_candidates = match sweep {
            Some(_) => {
                (SWEEP_CANDIDATE_BYTES / (self.window_blocks() * BLOCK_SIZE_BYTES)).max(examined)
            }
            None => examined.max(1),
        };
        let max_candidates = usize::try_from(max_candidates).unwrap_or(usize::MAX);
        let (mut cands, end) =
            self.scan_candidates(cursor, SCAN_WINDOWS_PER_PASS, max_candidates)?;
        if let Some(s) = sweep {
            let w = self.window_blocks();
            cands.retain(|c| !s.skipped.contains(c.first / w));
        }
        rep.windows_scanned = end - cursor;
        rep.candidates = cands.len() as u64;
        rep.uncollectable = self.keep_collectable(&mut cands)?;
        let limit = match sweep {
            Some(s) => {
                let held = self.host_held_now()?;
                let segs = self.order_by_segment(&mut cands)?;
                Some(Limit {
                    room: s.ceiling.saturating_sub(held),
                    held,
                    segs,
                })
            }
            None => {
                // Largest expected savings first.
                cands.sort_by(|a, b| b.score.cmp(&a.score).then(a.first.cmp(&b.first)));
                None
            }
        };
        Ok((cands, end, limit))
    }

    /// A client request arrived or is in flight, or a writer waits for the
    /// cleaner lock this pass holds.
    fn clients_or_writers_waiting(&self) -> bool {
        self.activity.clients_busy() || self.activity.space_wanted()
    }

    /// Recompression appends before the old records die: only with free
    /// segments above the cleaner's start threshold (plus 5%) to spare.
    fn room_for_recompression(&self) -> Result<bool, VolError> {
        let st = self.lock_state()?;
        let free = st.log.segments.free_count();
        let total = st.log.segments.count();
        let percent = self.options.cleaner.low_free_percent + ROOM_FREE_PERCENT_ABOVE_CLEANER;
        Ok(free * 100 > percent * total
            && self.usable_bytes(&st) > ROOM_SEGMENTS * self.sb.segment_size_bytes)
    }

    /// What the run's records cost now: each distinct record once, if the
    /// run covers all its entries (else it stays live anyway).
    fn run_stored_bytes(&self, before: &[MapEntry]) -> Result<u64, VolError> {
        let st = self.lock_state()?;
        let mut per: HashMap<u64, (u32, u32)> = HashMap::new();
        for e in before {
            if let EntryState::Data { offset, len, .. } = e.state_valid() {
                per.entry(offset).or_insert((len, 0)).1 += 1;
            }
        }
        let shared = st.live.shared();
        Ok(per
            .iter()
            .filter(|(off, (_, count))| {
                shared
                    .get(**off)
                    .is_none_or(|s| s.refs == 0 && s.owners == *count)
            })
            .map(|(_, (len, _))| u64::from(*len))
            .sum::<u64>())
    }

    /// Starts the background recompressor (policy auto with recompression
    /// on); it stops when the handle drops.
    pub fn start_background_recompressor(self: &Arc<Self>) -> Option<Worker> {
        if !self.policy.is_auto() || !self.options.elastic.recompress || self.options.read_only {
            return None;
        }
        // After a sweep of the whole volume found nothing, wait for new writes.
        let mut quiet_at: Option<u64> = None;
        let mut sweep: Option<Sweep> = None;
        self.jobs.recompress_pending.store(true, Ordering::SeqCst);
        Some(Worker::spawn(
            "cvol-recompress",
            self,
            BACKGROUND_PERIOD,
            move |v| match v.background_recompress(&mut quiet_at, &mut sweep) {
                true => Next::After(AGAIN_PAUSE),
                false => Next::After(BACKGROUND_PERIOD),
            },
        ))
    }

    /// One step of the background recompressor with a sweep of its own
    /// (tests): true if the next would follow at once.
    #[doc(hidden)]
    pub fn background_recompress_step(&self) -> bool {
        self.background_recompress(&mut None, &mut None)
    }

    /// One step of the background recompressor; true if it rewrote data
    /// and was not interrupted (the next pass follows at once).
    fn background_recompress(&self, quiet_at: &mut Option<u64>, sweep: &mut Option<Sweep>) -> bool {
        if self.poisoned.load(Ordering::SeqCst)
            || self.activity.idle_ms() < self.options.elastic.recompress_idle_ms
        {
            return false;
        }
        let written = self.counters.client_bytes_written.load(Ordering::Relaxed);
        if *quiet_at == Some(written) {
            return false;
        }
        self.jobs.recompress_pending.store(true, Ordering::SeqCst);
        // Rewrites append before old records die: make room first (idle
        // time is the cleaner's too), up to the cleaner's stop threshold.
        match self.free_segments_below(self.options.cleaner.high_free_percent) {
            Ok(Some(want)) => {
                if let Err(e) = self.clean(want, true) {
                    tracing::warn!("cleaning before recompression: {e}");
                }
            }
            Ok(None) => {}
            Err(e) => tracing::warn!("cleaning before recompression: {e}"),
        }
        let within = match self.sweep(sweep, written) {
            Ok(within) => within,
            Err(e) => {
                tracing::warn!("background recompression: {e}");
                return false;
            }
        };
        let budget = self.options.elastic.recompress_pass_bytes;
        match self.recompress_pass_within(budget, true, within) {
            Ok((r, handled)) => {
                if r.blocks_rewritten > 0 {
                    tracing::debug!(?r, "background recompression pass");
                    self.collect_what_recompression_left(&handled);
                    // What the pass read and compressed is free again.
                    crate::memory::trim_allocator();
                }
                if r.wrapped && r.blocks_rewritten == 0 && !r.yielded {
                    *quiet_at = Some(written);
                    self.jobs.recompress_pending.store(false, Ordering::SeqCst);
                }
                r.blocks_rewritten > 0 && !r.yielded
            }
            Err(e) => {
                tracing::warn!("background recompression: {e}");
                false
            }
        }
    }
}

/// An idle sweep of background recompression on a file or device
/// (`ElasticConfig::recompress_within_host_bytes`).
#[derive(Debug, Default)]
pub(in crate::volume) struct Sweep {
    /// Client bytes written when it began (a client write begins another).
    written: u64,
    /// What the host held then (`host_held_bytes`): its passes add at most
    /// what the host gave back since.
    ceiling: u64,
    /// Windows whose rewrite did not pay (or could not be made): not
    /// tried again in this sweep (its passes rescan the same windows until
    /// all their candidates are handled).
    skipped: Skipped,
}

/// The windows of the chunk a sweep's passes scan (from the cursor they
/// start at) whose rewrite did not pay: the cursor moves on only once
/// every candidate of its chunk was handled, so only that chunk's windows
/// are ever looked up, and they are forgotten when it moves (at most a
/// chunk's candidates, `SWEEP_CANDIDATE_BYTES` of windows: a set of every window a
/// sweep skipped held tens of MiB on a large volume).
#[derive(Debug, Default)]
struct Skipped {
    chunk: u64,
    windows: HashSet<u64>,
}

impl Skipped {
    /// Forgets the windows skipped unless the chunk from `cursor` is the one
    /// they were skipped in.
    fn at_chunk(&mut self, cursor: u64) {
        if cursor != self.chunk {
            self.chunk = cursor;
            self.windows = HashSet::new();
        }
    }

    fn insert(&mut self, window: u64) {
        self.windows.insert(window);
    }

    fn contains(&self, window: u64) -> bool {
        self.windows.contains(&window)
    }
}

impl Volume {
    /// The sweep the next pass belongs to (None: `recompress_within_host_bytes`
    /// off). A sweep begins, with what the host holds now as its ceiling,
    /// when clients wrote since the last one began.
    fn sweep<'a>(
        &self,
        sweep: &'a mut Option<Sweep>,
        written: u64,
    ) -> Result<Option<&'a mut Sweep>, VolError> {
        if !self.options.elastic.recompress_within_host_bytes {
            return Ok(None);
        }
        if sweep.as_ref().is_none_or(|s| s.written != written) {
            *sweep = Some(Sweep {
                written,
                ceiling: self.host_held_now()?,
                skipped: Skipped::default(),
            });
        }
        Ok(sweep.as_mut())
    }

    /// After a pass that rewrote data: within a sweep, collects the
    /// segments whose candidates it handled (their rewrites left them at
    /// most 90% live: `keep_collectable`) and returns their space to the
    /// host at once, not kept warm for reuse (the next pass's room is what
    /// the host gave back). Otherwise (an object store), collects the
    /// segments passes emptied (at most `EMPTIED_LIVE_MAX_PERCENT` live)
    /// once they hold half a pass's worth of dead bytes: what the host
    /// holds grows by about a pass. Fuller segments wait for idle cleaning
    /// there: moving their data now would compact what the next passes
    /// would recompress with the strong codec.
    fn collect_what_recompression_left(&self, handled: &[u64]) {
        let r = if self.options.elastic.recompress_within_host_bytes {
            let r = self.collect_segments(true, handled);
            if let Err(e) = self.punch_warm(true) {
                tracing::warn!("returning emptied segments' space: {e}");
            }
            r
        } else {
            let reclaimable = match self.lock_state() {
                Ok(st) => self.reclaimable_below(&st, EMPTIED_LIVE_MAX_PERCENT),
                Err(_) => return,
            };
            if reclaimable < self.options.elastic.recompress_pass_bytes / 2 {
                return;
            }
            self.idle_clean_below(true, EMPTIED_LIVE_MAX_PERCENT)
        };
        match r {
            Ok(r) if r.segments > 0 => tracing::debug!(?r, "cleaning between recompression passes"),
            Ok(_) | Err(VolError::NoSpace) => {}
            Err(e) => tracing::warn!("cleaning between recompression passes: {e}"),
        }
    }
}
#[cfg(test)]
mod tests {
    use super::Skipped;

    #[test]
    fn skipped_windows_are_kept_for_their_chunk_only() {
        let mut s = Skipped::default();
        s.at_chunk(100);
        s.insert(150);
        s.at_chunk(100);
        assert!(s.contains(150), "the same chunk keeps them");
        s.at_chunk(400);
        assert!(!s.contains(150));
        assert_eq!(
            s.windows.capacity(),
            0,
            "a new chunk starts with no memory held"
        );
    }
}
