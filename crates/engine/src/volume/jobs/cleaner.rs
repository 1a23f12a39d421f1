//! The cleaner: makes room in the log by moving the live records of
//! mostly-dead segments to the log head, then checkpointing so the emptied
//! segments can be reused (ZBD §2.1.4, LFS §3.5).
//!
//! Safety: a record is moved only if, under the state lock, the map still
//! points at it; the move is an ordinary DATA record appended to the log, so
//! roll-forward replays it in order with client writes. A segment is reused
//! only after a durable checkpoint whose snapshot covers every record in it
//! (`SegmentTable::reclaimable`), i.e. after the map that points away from it
//! is durable. Until then a crash recovers the old map, which still finds the
//! old records where they were.
use super::relocate::{compacted, Compacted};
use super::{Next, Worker};
use crate::dedup::Fingerprint;
use crate::error::VolError;
use crate::records::{walk_segment, DecodedUnit, Found};
use crate::segments::{pack_order, VictimPolicy};
use crate::volume::space::{self, CLEAN_GAIN_USEFUL_DIVISOR};
use crate::volume::{State, Volume};
use cvol_format::checkpoint::{DIR_PAGES, MAP_PAGE_BLOCKS};
use cvol_format::record::{RecordHeader, RecordKind};
use cvol_format::seal;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// When and how the cleaner runs.
#[derive(Debug, Clone, Copy)]
pub struct CleanerConfig {
    pub policy: VictimPolicy,
    /// The background cleaner starts below this share of free segments...
    pub low_free_percent: u64,
    /// ...and stops above this one.
    pub high_free_percent: u64,
    /// Collect dead space when clients are idle (`idle_clean`), whatever
    /// the free space.
    pub idle: bool,
}

impl Default for CleanerConfig {
    fn default() -> Self {
        CleanerConfig {
            policy: VictimPolicy::CostBenefit,
            low_free_percent: 10,
            high_free_percent: 25,
            idle: true,
        }
    }
}

/// What the cleaner did since open, for `stat`.
#[derive(Debug, Default)]
pub(in crate::volume) struct CleanerStats {
    pub(in crate::volume) segments_cleaned: AtomicU64,
    pub(in crate::volume) records_relocated: AtomicU64,
    pub(in crate::volume) bytes_relocated: AtomicU64,
    pub(in crate::volume) segments_reclaimed: AtomicU64,
    /// Idle cleaning passes that moved something, and what they moved.
    pub(in crate::volume) idle_passes: AtomicU64,
    pub(in crate::volume) idle_bytes_relocated: AtomicU64,
    /// Searches for the holders of a victim's shared records, and the map
    /// pages they scanned (the others were skipped by their summaries).
    pub(in crate::volume) holder_scans: AtomicU64,
    pub(in crate::volume) holder_pages_scanned: AtomicU64,
    /// Units rewritten smaller as they moved (live blocks only, or raw
    /// units compressed), and the log bytes that saved.
    pub(in crate::volume) units_compacted: AtomicU64,
    /// Log bytes of the checkpoints cleaning wrote to reclaim its victims.
    pub(in crate::volume) checkpoint_bytes: AtomicU64,
    pub(in crate::volume) compaction_bytes_saved: AtomicU64,
}

/// Idle cleaning leaves at most this share (percent) of the live bytes as
/// dead space in sealed segments...
pub const IDLE_DEAD_PERCENT: u64 = 5;
/// Idle passes in a row (each moving something) before the idle cleaner
/// waits for new client work.
const IDLE_PASSES_MAX: u32 = 4;

/// Where the idle cleaner stopped: the log's last seq when its passes
/// settled, and the passes in a row that moved something since.
#[derive(Default)]
struct IdleQuiet {
    at: Option<u64>,
    passes: u32,
}
/// ...and never moves a segment more than this full (percent live): moving
/// 9 bytes to free 1 is not worth the wear.
pub const IDLE_VICTIM_LIVE_MAX_PERCENT: u64 = 90;

/// What one idle cleaning pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct IdleCleanReport {
    /// Victim segments emptied.
    pub segments: u64,
    /// Log bytes of live records moved to empty them.
    pub bytes_relocated: u64,
    /// Segments returned to the host (hole-punched) by the pass.
    pub segments_reclaimed: u64,
    /// The pass stopped early for a client request.
    pub yielded: bool,
}

/// Cleaning's counters at one moment (`Volume::cleaning_progress`).
#[derive(Debug, Clone, Copy)]
pub(in crate::volume) struct CleaningProgress {
    reclaimed: u64,
    relocated: u64,
}

impl CleaningProgress {
    /// Log bytes gained since `before`: the segments reclaimed, less what
    /// was moved to empty them and the checkpoints cleaning wrote (the
    /// map records a checkpoint replaces die, and come back as reclaimed
    /// segments later: a volume full of live data, whose cleaning only
    /// collects the last checkpoint's old records to write the next,
    /// gains nothing).
    pub(in crate::volume) fn gain_since(
        &self,
        before: &CleaningProgress,
        segment_size: u64,
    ) -> u64 {
        let freed = (self.reclaimed - before.reclaimed) * segment_size;
        freed.saturating_sub(self.relocated - before.relocated)
    }
}

/// Most clean-then-checkpoint rounds one `clean` call runs.
const ROUNDS_MAX: usize = 64;
/// Records moved per hold of the state lock.
const MOVE_BATCH: usize = 64;
/// How often the background cleaner looks at the free segments.
const BACKGROUND_PERIOD: Duration = Duration::from_millis(100);
/// Clients idle this long: the free segments kept warm for the log head
/// give their host space back (`Volume::punch_warm`).
const WARM_PUNCH_IDLE_MS: u64 = 1000;

/// A victim segment read into memory, its DATA records, the map entries
/// holding its shared records (by record offset), and the fingerprints of
/// each record's blocks (empty without dedup or for a record that does not
/// decode), so the dedup index follows every move.
pub(super) struct Victim {
    pub(super) base: u64,
    pub(super) buf: Vec<u8>,
    pub(super) found: Vec<Found>,
    /// Its page and directory records (position, header).
    pub(super) map_records: Vec<(usize, RecordHeader)>,
    pub(super) holders: HashMap<u64, Vec<u64>>,
    pub(super) fps: Vec<Vec<Fingerprint>>,
    /// Records that do not verify (left where they are).
    pub(super) damaged: usize,
    /// Per found record, its compacted form, if it has one (`Compacted`).
    pub(super) compact: Vec<Option<Compacted>>,
}

impl Victim {
    /// Fingerprint of block `k` of found record `i`, 0 when unknown.
    pub(super) fn fp(&self, i: usize, k: u32) -> Fingerprint {
        self.fps
            .get(i)
            .and_then(|f| f.get(k as usize))
            .copied()
            .unwrap_or(0)
    }
}

impl Volume {
    /// Cleans until the log has `want_free_bytes` free or nothing more can
    /// be gained. With `yield_to_clients` it pauses while clients are busy.
    /// Returns the log bytes gained.
    pub fn clean(&self, want_free_bytes: u64, yield_to_clients: bool) -> Result<u64, VolError> {
        self.clean_rounds(want_free_bytes, yield_to_clients)
            .map(|(_, gained)| gained)
    }

    /// `clean`; also says whether it ran a round at all (false: the room
    /// was there when it got the cleaner, made by whoever held it before).
    pub(in crate::volume) fn clean_rounds(
        &self,
        want_free_bytes: u64,
        yield_to_clients: bool,
    ) -> Result<(bool, u64), VolError> {
        let _c = self.lock_cleaner()?;
        self.check_writable()?;
        let (mut gained, mut ran, mut checkpointed) = (0, false, false);
        for _ in 0..ROUNDS_MAX {
            if self.lock_state()?.log.free_bytes() >= want_free_bytes {
                break;
            }
            ran = true;
            let before = self.cleaning_progress();
            let emptied = self.relocate_round(want_free_bytes, yield_to_clients)?;
            if emptied == 0 {
                // No victim fits beside the reserve. Fingerprint rows
                // waiting for their tables count in it (the client writes
                // and the moves add them): a checkpoint writes them, and
                // gives that part of the reserve back to the cleaner, once.
                if checkpointed || !self.fp_rows_hold_room()? {
                    break; // nothing to gain: no checkpoint either
                }
                checkpointed = true;
                self.cleaner_checkpoint()?;
                continue;
            }
            // Victims older than the durable checkpoint are free once the
            // moves are durable; newer ones need a checkpoint first.
            self.flush()?;
            let free = self.lock_state()?.log.free_bytes();
            if free < want_free_bytes && self.checkpoint_frees_segments()? {
                if !self.cleaner_checkpoint()? {
                    break;
                }
                // Victims that held map records are empty once the
                // checkpoint that rewrote them is durable: reuse them now.
                self.flush()?;
            }
            let round = self
                .cleaning_progress()
                .gain_since(&before, self.sb.segment_size_bytes);
            gained += round;
            if round < self.sb.segment_size_bytes / CLEAN_GAIN_USEFUL_DIVISOR {
                break; // only segment tails left to gain: the live data is dense
            }
            if yield_to_clients && self.activity.space_wanted() {
                // Background cleaning hands the lock to the writers short
                // of room: each takes what the round freed, or cleans for
                // its own need, rather than wait out this pass's target.
                break;
            }
        }
        Ok((ran, gained))
    }

    /// What cleaning has done so far (segments reclaimed, bytes it moved):
    /// its gain between two readings is measured from these, not from the
    /// free bytes, which concurrent client writes consume meanwhile (under
    /// 32 random writers a round that freed 20 segments showed as no gain,
    /// and the writer waiting for room gave up with ENOSPC while the
    /// cleaner was keeping up).
    pub(in crate::volume) fn cleaning_progress(&self) -> CleaningProgress {
        let c = &self.counters.cleaner;
        // Its checkpoints cost the data log only when it holds the
        // metadata too. (Those the clients' writes call for, and their
        // fingerprint spills, are the writes' cost, not cleaning's.)
        let metadata = match self.sb.has_metadata_device() {
            true => 0,
            false => c.checkpoint_bytes.load(Ordering::SeqCst),
        };
        CleaningProgress {
            reclaimed: c.segments_reclaimed.load(Ordering::SeqCst),
            relocated: c.bytes_relocated.load(Ordering::SeqCst) + metadata,
        }
    }

    /// A checkpoint for cleaning, its bytes counted as cleaning's cost.
    /// Returns false when there was no room for it.
    fn cleaner_checkpoint(&self) -> Result<bool, VolError> {
        let total = &self.counters.checkpoint_bytes_total;
        let before = total.load(Ordering::SeqCst);
        let r = self.checkpoint();
        let bytes = total.load(Ordering::SeqCst) - before;
        self.counters
            .cleaner
            .checkpoint_bytes
            .fetch_add(bytes, Ordering::SeqCst);
        match r {
            Ok(()) => Ok(true),
            Err(VolError::NoSpace) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Do fingerprint rows waiting for their tables hold a useful part of
    /// the reserve?
    fn fp_rows_hold_room(&self) -> Result<bool, VolError> {
        let st = self.lock_state()?;
        Ok(!self.sb.has_metadata_device()
            && st.live.fp_bytes_bound() > self.sb.segment_size_bytes / CLEAN_GAIN_USEFUL_DIVISOR)
    }

    /// Are emptied segments waiting for a checkpoint to be reused, or
    /// victims for one to rewrite the map records they hold?
    fn checkpoint_frees_segments(&self) -> Result<bool, VolError> {
        let st = self.lock_state()?;
        Ok(st.log.segments.empty_sealed_count(st.live.usage()) > 0 || st.map_records_moved)
    }

    /// Makes an idle pass's moves durable and its emptied segments free:
    /// a flush, then a checkpoint when emptied segments still wait for one
    /// (and a flush, which reuses what the checkpoint emptied).
    fn make_cleaning_durable(&self) -> Result<(), VolError> {
        self.flush()?;
        if self.checkpoint_frees_segments()? {
            self.checkpoint()?;
            self.flush()?;
        }
        Ok(())
    }

    /// Empties victims until the log would have `want_free_bytes` free once
    /// they are reclaimed. Returns how many segments were emptied.
    fn relocate_round(
        &self,
        want_free_bytes: u64,
        yield_to_clients: bool,
    ) -> Result<u64, VolError> {
        let mut done: HashSet<u64> = HashSet::new();
        loop {
            if yield_to_clients {
                while self.activity.clients_busy() && !self.activity.space_wanted() {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            if yield_to_clients && !done.is_empty() && self.activity.space_wanted() {
                break; // writers wait for the lock: end the round (see `clean`)
            }
            let Some((victim, live)) = self.pick_victim(&done, want_free_bytes)? else {
                break;
            };
            done.insert(victim);
            if live > 0 {
                // Writers may take the free space down to the reserve while
                // the victim moves: a move that finds no room for itself
                // and a checkpoint ends the round (every move so far is
                // whole), and the flush and checkpoint after it reclaim
                // what it emptied.
                let damaged = match self.relocate_segment(victim) {
                    Ok(d) => d,
                    Err(VolError::NoSpace) => break,
                    Err(e) => return Err(e),
                };
                self.counters
                    .cleaner
                    .segments_cleaned
                    .fetch_add(1, Ordering::Relaxed);
                // Map records a checkpoint retired stay live until its
                // commit: only damaged records are worth a warning.
                if damaged > 0 {
                    let left = self.lock_state()?.live.usage().live_bytes(victim);
                    tracing::warn!(
                        segment = victim,
                        live_bytes = left,
                        damaged_records = damaged,
                        "cleaner could not move damaged records (`cvol scrub` names them)"
                    );
                }
            }
        }
        Ok(done.len() as u64)
    }

    /// The best victim not yet tried whose live data fits in the space the
    /// cleaner may use, or None once enough space will be free.
    fn pick_victim(
        &self,
        done: &HashSet<u64>,
        want_free_bytes: u64,
    ) -> Result<Option<(u64, u64)>, VolError> {
        let st = self.lock_state()?;
        let usage = st.live.usage();
        let ckpt = self.checkpoint_estimate_bytes(&st);
        let projected = st.log.free_bytes() + done.len() as u64 * self.sb.segment_size_bytes;
        if projected >= want_free_bytes.saturating_add(ckpt) {
            return Ok(None);
        }
        let budget = space::cleaner_budget(st.log.free_bytes(), ckpt);
        let candidates: Vec<_> = self
            .cleaning_candidates(&st)
            .into_iter()
            .filter(|c| !done.contains(&c.0))
            .collect();
        let left: HashMap<u64, u64> = candidates.iter().map(|&(s, l, _)| (s, l)).collect();
        let order = self.options.cleaner.policy.order(
            candidates,
            self.sb.segment_size_bytes,
            st.log.last_seq(),
        );
        Ok(order
            .into_iter()
            .find(|s| left[s] <= budget)
            .map(|s| (s, usage.live_bytes(s))))
    }

    /// The sealed data segments cleaning would gain from, as (segment,
    /// bytes left after cleaning it, max seq): live bytes less what
    /// compacting its units is expected to save (`CompactionHints`).
    fn cleaning_candidates(&self, st: &State) -> Vec<(u64, u64, u64)> {
        let compacts = self.compaction_codec().is_some();
        let hints = st.live.hints();
        st.log
            .segments
            .candidates_after(st.live.usage(), |s, live| match compacts {
                true => hints.saving(s, live),
                false => 0,
            })
    }

    /// Moves every live record of `victim` to the log head. Returns how
    /// many damaged records (that do not verify) it found.
    pub(super) fn relocate_segment(&self, victim: u64) -> Result<usize, VolError> {
        // No new dedup reference may point into the victim from here on, so
        // the holders of its shared records found below stay complete.
        self.lock_state()?.cleaning.insert(victim);
        let r = self.relocate_segment_marked(victim);
        let mut st = self.lock_state()?;
        st.cleaning.remove(&victim);
        st.live.hints_reset(&[victim]);
        r
    }

    fn relocate_segment_marked(&self, victim: u64) -> Result<usize, VolError> {
        let (v, space) = self.read_victim(victim)?;
        self.rewrite_map_records(&v)?;
        let sizes: Vec<(u64, u64)> = v
            .found
            .iter()
            .map(|f| (f.header.total_len() as u64, f.header.lba))
            .collect();
        let order = pack_order(&sizes, space, self.sb.segment_size_bytes);
        for batch in order.chunks(MOVE_BATCH) {
            let mut st = self.lock_state()?;
            self.check_writable()?;
            for &i in batch {
                let f = &v.found[i];
                let holders = v.holders.get(&(v.base + f.at as u64));
                self.fault_record(&mut st, f, holders.map_or(&[][..], Vec::as_slice))?;
                match holders {
                    _ if f.header.nblocks > 1 => {
                        let h = holders.map_or(&[][..], Vec::as_slice);
                        self.move_unit_record(&mut st, &v, i, h)?
                    }
                    Some(h) => self.move_shared_record(&mut st, &v, i, h)?,
                    None => self.move_record(&mut st, &v, i)?,
                }
            }
        }
        Ok(v.damaged)
    }

    /// Brings into memory the map pages a move of `f` reads and changes:
    /// those of its blocks and of its dedup holders.
    fn fault_record(&self, st: &mut State, f: &Found, holders: &[u64]) -> Result<(), VolError> {
        let h = &f.header;
        let end = (h.lba + u64::from(h.nblocks)).min(st.live.blocks());
        if h.lba < end {
            self.fault(st, h.lba, end)?;
        }
        for &l in holders {
            self.fault(st, l, l + 1)?;
        }
        Ok(())
    }

    /// The map records (page and directory records) of the victim that the
    /// map still names are marked to be written again by the next
    /// checkpoint, which leaves the victim empty. Returns their bytes.
    fn rewrite_map_records(&self, v: &Victim) -> Result<u64, VolError> {
        let mut st = self.lock_state()?;
        let mut bytes = 0;
        for &(at, ref h) in &v.map_records {
            let offset = v.base + at as u64;
            let live = match h.kind {
                RecordKind::MapChunk => {
                    let p = (h.lba / MAP_PAGE_BLOCKS) as usize;
                    if h.lba < st.live.blocks() {
                        self.unpack_page(&mut st, p)?;
                    }
                    let named = h.lba < st.live.blocks()
                        && st
                            .live
                            .map()
                            .page_ref(p)
                            .is_some_and(|r| r.offset == offset);
                    if named {
                        self.fault(&mut st, h.lba, h.lba + 1)?;
                        st.live.map_mut().mark_dirty(p);
                    }
                    named
                }
                RecordKind::MapTable => {
                    let map = st.live.map();
                    let t = map.table_of_slot(h.lba / MAP_PAGE_BLOCKS);
                    let named = t.filter(|&t| map.table_ref(t).is_some_and(|r| r.offset == offset));
                    match named {
                        // A dedup hook snapshot record: unnamed (its hints
                        // lost), and the snapshot written again from memory.
                        Some(t) if t >= st.live.hook_root_table() => {
                            st.live.hook_unnamed(t);
                            let moved = &self.counters.window.snapshot_moved;
                            moved.store(true, Ordering::Relaxed);
                        }
                        Some(t) if st.live.is_fp_table(t) => {
                            let rec = &v.buf[at..at + h.total_len()];
                            match seal::payload(self.sb.sealer(), h, rec) {
                                Ok(payload) => self.fp_table_moved(&mut st, t, &payload),
                                Err(e) => {
                                    tracing::warn!("fingerprint table {t}: {e}: dropped");
                                    st.live.map_mut().set_table_ref(t, None);
                                }
                            }
                        }
                        Some(t) => st.live.table_moved(t),
                        None => {}
                    }
                    named.is_some()
                }
                _ => {
                    let b = (h.lba / (DIR_PAGES * MAP_PAGE_BLOCKS)) as usize;
                    // A block open left unread names its list once read.
                    self.unpack_page(&mut st, b * DIR_PAGES as usize)?;
                    let named = st.live.map().dir_record_is(b, offset);
                    if named {
                        let dirty = self.with_log_pages(&mut st, |live, src| {
                            live.map_mut().mark_dir_dirty(b, src)
                        });
                        dirty?;
                    }
                    named
                }
            };
            if live {
                bytes += h.total_len() as u64;
                st.map_records_moved = true;
                self.counters
                    .map_records_moved
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(bytes)
    }

    /// Fingerprint table `t`'s record (`payload`) is in the victim: its rows
    /// are written again by the next checkpoint; a record that does not
    /// decode (it did when written) is dropped with its hints.
    fn fp_table_moved(&self, st: &mut State, t: usize, payload: &[u8]) {
        match st.live.fp_decode(t, payload) {
            Ok(rows) => st.live.fp_reload(t, rows),
            Err(e) => {
                tracing::warn!("fingerprint table {t} does not decode ({e}): dropped");
                st.live.map_mut().set_table_ref(t, None);
            }
        }
    }

    /// Reads the victim and finds the holders of its shared records (one map
    /// scan, `find_holders`); also returns the room left in the open segment.
    fn read_victim(&self, victim: u64) -> Result<(Victim, u64), VolError> {
        let base = self.sb.segment_offset(victim);
        let end = base + self.sb.segment_size_bytes;
        let mut buf = vec![0u8; self.sb.segment_size_bytes as usize];
        self.storage.read_at(base, &mut buf).map_err(VolError::Io)?;
        let walk = walk_segment(&buf, self.sb.volume_tag());
        let map_records = (walk.records.iter())
            .filter(|(_, h)| {
                matches!(
                    h.kind,
                    RecordKind::MapChunk | RecordKind::MapDir | RecordKind::MapTable
                )
            })
            .copied()
            .collect();
        let damaged = walk.damaged.len();
        // The same walk's DATA records (`data_records` would walk again).
        let found: Vec<Found> = (walk.records.iter())
            .filter(|(_, h)| h.kind == RecordKind::Data)
            .map(|&(at, header)| Found { at, header })
            .collect();
        let masks = self.unit_live_masks(base, &found)?;
        // Outside every lock: decompressing and compressing are the slow
        // part.
        let codec = self.compaction_codec();
        let mut fps = Vec::new();
        let mut compact = Vec::with_capacity(found.len());
        for (f, &mask) in found.iter().zip(&masks) {
            let wanted = mask.is_some() && codec.is_some();
            if self.dedup.is_none() && !wanted {
                compact.push(None);
                continue;
            }
            let unit = DecodedUnit::decode(self.sb.sealer(), f.bytes(&buf)).ok();
            if self.dedup.is_some() {
                fps.push(
                    unit.as_ref()
                        .map(|u| self.fingerprints(&u.data))
                        .unwrap_or_default(),
                );
            }
            compact.push(match (unit, mask, codec) {
                (Some(u), Some(mask), Some(c)) => compacted(f, u.data, mask, c),
                _ => None,
            });
        }
        // The pages of the owners of the records with dedup references (a
        // record's owner entries lie at its header's LBA, a unit's in its
        // window, inside one page).
        let owner_pages: Vec<usize> = {
            let st = self.lock_state()?;
            let shared = st.live.shared();
            (found.iter())
                .filter(|f| shared.get(base + f.at as u64).is_some_and(|s| s.refs > 0))
                .map(|f| f.header.lba as usize / crate::map::PAGE_BLOCKS)
                .collect()
        };
        // Every LBA pointing at a record of the victim with dedup
        // references.
        let holders = match owner_pages.is_empty() {
            false => self.find_holders(base, end, owner_pages)?,
            true => HashMap::new(),
        };
        let space = {
            let st = self.lock_state()?;
            st.log.segment_size - st.log.head.fill as u64
        };
        let v = Victim {
            base,
            buf,
            found,
            map_records,
            holders,
            fps,
            damaged,
            compact,
        };
        Ok((v, space))
    }

    /// Starts the background cleaner thread: between the configured
    /// thresholds of free segments it cleans, yielding to clients; when
    /// clients are idle (and background recompression has nothing left to
    /// do) it also collects dead space worth collecting (`idle_clean`).
    pub fn start_background_cleaner(self: &Arc<Self>) -> Worker {
        let mut quiet = IdleQuiet::default();
        Worker::spawn("cvol-cleaner", self, BACKGROUND_PERIOD, move |v| {
            v.background_clean(&mut quiet);
            Next::After(BACKGROUND_PERIOD)
        })
    }

    /// `quiet`: the log's last seq when idle passes last settled (no scan
    /// until something changes: an idle volume costs no CPU).
    fn background_clean(&self, quiet: &mut IdleQuiet) {
        if self.read_only() || self.poisoned.load(Ordering::SeqCst) {
            return;
        }
        let cfg = self.options.cleaner;
        match self.free_segments_below(cfg.low_free_percent) {
            // Below half the start threshold the cleaner no longer waits for
            // clients to pause: under a steady stream of writes they would
            // never pause, and every writer would end up cleaning in the
            // foreground instead.
            Ok(Some(want)) => match self.clean(want, !self.free_segments_urgent()) {
                Ok(n) => tracing::debug!(freed = n, "background cleaning pass"),
                Err(e) => tracing::warn!("background cleaner: {e}"),
            },
            Ok(None) => {}
            Err(e) => tracing::warn!("background cleaner: {e}"),
        }
        if self.activity.idle_ms() >= WARM_PUNCH_IDLE_MS {
            if let Err(e) = self.punch_warm(true) {
                tracing::warn!("returning warm segments' space: {e}");
            }
            if let Err(e) = self.punch_head_tail() {
                tracing::warn!("returning the open segment's tail: {e}");
            }
        }
        if !cfg.idle
            || self.activity.idle_ms() < self.options.elastic.recompress_idle_ms
            || self.jobs.recompress_pending.load(Ordering::SeqCst)
        {
            return;
        }
        // Every change appends a record: an unchanged seq is nothing new.
        let Ok(work) = self.lock_state().map(|st| st.log.last_seq()) else {
            return;
        };
        if quiet.at == Some(work) {
            return;
        }
        match self.idle_clean(true) {
            Ok(r) => {
                if r.segments > 0 {
                    tracing::debug!(?r, "idle cleaning pass");
                }
                // A pass that moved something looks again: its own
                // checkpoint left dead map and table records behind, and
                // the victims it chose were counted before its moves. A
                // pass with nothing to do waits for new work, and so does
                // the last of `IDLE_PASSES_MAX` passes in a row (on a tiny
                // volume a pass's own leavings could stay above the
                // target).
                quiet.passes = if r.segments > 0 { quiet.passes + 1 } else { 0 };
                if !r.yielded && (r.segments == 0 || quiet.passes >= IDLE_PASSES_MAX) {
                    quiet.at = self.lock_state().map(|st| st.log.last_seq()).ok();
                    quiet.passes = 0;
                }
            }
            Err(VolError::NoSpace) => quiet.at = Some(work),
            Err(e) => tracing::warn!("idle cleaning: {e}"),
        }
    }

    /// Idle cleaning (LFS §3.6: cleaning when idle is the cheap time):
    /// empties the sealed segments the victim policy ranks first, each at
    /// most `IDLE_VICTIM_LIVE_MAX_PERCENT` live, until the dead space left in
    /// sealed segments is at most `IDLE_DEAD_PERCENT` of the live bytes, then
    /// makes the moves durable so the emptied segments are returned to the
    /// host. With `stop_at_client` it stops at the first client request.
    pub fn idle_clean(&self, stop_at_client: bool) -> Result<IdleCleanReport, VolError> {
        self.idle_clean_below(stop_at_client, IDLE_VICTIM_LIVE_MAX_PERCENT)
    }

    /// `idle_clean` of victims at most `max_live_percent` live.
    pub(in crate::volume) fn idle_clean_below(
        &self,
        stop_at_client: bool,
        max_live_percent: u64,
    ) -> Result<IdleCleanReport, VolError> {
        self.idle_clean_of(stop_at_client, |v| v.idle_victims(max_live_percent))
    }

    /// `idle_clean` of those of `segments` that are sealed and at most
    /// `IDLE_VICTIM_LIVE_MAX_PERCENT` live, however little dead space is
    /// left elsewhere: the segments background recompression emptied of
    /// its candidates, collected as it goes.
    pub(in crate::volume) fn collect_segments(
        &self,
        stop_at_client: bool,
        segments: &[u64],
    ) -> Result<IdleCleanReport, VolError> {
        self.idle_clean_of(stop_at_client, |v| {
            let st = v.lock_state()?;
            let size = v.sb.segment_size_bytes;
            Ok((st.log.segments.candidates(st.live.usage()).into_iter())
                .filter(|&(s, live, _)| {
                    segments.contains(&s) && live * 100 <= size * IDLE_VICTIM_LIVE_MAX_PERCENT
                })
                .map(|(s, _, _)| s)
                .collect())
        })
    }

    /// Idle cleaning of the `victims` chosen under the cleaner lock.
    fn idle_clean_of(
        &self,
        stop_at_client: bool,
        victims: impl FnOnce(&Self) -> Result<Vec<u64>, VolError>,
    ) -> Result<IdleCleanReport, VolError> {
        let _c = self.lock_cleaner()?;
        self.check_writable()?;
        let mut rep = IdleCleanReport::default();
        let reclaimed_before = self
            .counters
            .cleaner
            .segments_reclaimed
            .load(Ordering::Relaxed);
        let relocated_before = self
            .counters
            .cleaner
            .bytes_relocated
            .load(Ordering::Relaxed);
        for victim in victims(self)? {
            if stop_at_client && self.activity.clients_busy() {
                rep.yielded = true;
                break;
            }
            let fits = {
                let st = self.lock_state()?;
                let budget =
                    space::cleaner_budget(st.log.free_bytes(), self.checkpoint_estimate_bytes(&st));
                st.live.usage().live_bytes(victim) <= budget
            };
            if !fits {
                break; // no room to move it: the low-space cleaner's job
            }
            self.relocate_segment(victim)?;
            rep.segments += 1;
        }
        if rep.segments > 0 {
            self.make_cleaning_durable()?;
        }
        let c = &self.counters.cleaner;
        rep.bytes_relocated = c.bytes_relocated.load(Ordering::Relaxed) - relocated_before;
        rep.segments_reclaimed = c.segments_reclaimed.load(Ordering::Relaxed) - reclaimed_before;
        if rep.segments > 0 {
            c.segments_cleaned
                .fetch_add(rep.segments, Ordering::Relaxed);
            c.idle_passes.fetch_add(1, Ordering::Relaxed);
            c.idle_bytes_relocated
                .fetch_add(rep.bytes_relocated, Ordering::Relaxed);
        }
        Ok(rep)
    }

    /// The victims of an idle pass, best first: enough of them to bring the
    /// dead space in sealed segments down to the idle target.
    fn idle_victims(&self, max_live_percent: u64) -> Result<Vec<u64>, VolError> {
        let st = self.lock_state()?;
        let usage = st.live.usage();
        let size = self.sb.segment_size_bytes;
        let target = usage.total_live_bytes() * IDLE_DEAD_PERCENT / 100;
        let all = self.cleaning_candidates(&st);
        let mut dead: u64 = all.iter().map(|&(_, left, _)| size - left).sum();
        let candidates: Vec<_> = all
            .into_iter()
            .filter(|&(_, left, _)| left * 100 <= size * max_live_percent)
            .collect();
        let left: HashMap<u64, u64> = candidates.iter().map(|&(s, l, _)| (s, l)).collect();
        let order = self
            .options
            .cleaner
            .policy
            .order(candidates, size, st.log.last_seq());
        let mut out = Vec::new();
        for s in order {
            if dead <= target {
                break;
            }
            dead -= size - left[&s];
            out.push(s);
        }
        Ok(out)
    }

    /// Dead bytes idle cleaning would collect now: the dead space of sealed
    /// segments it may move (for `stat`).
    pub(in crate::volume) fn idle_reclaimable_bytes(&self, st: &State) -> u64 {
        self.reclaimable_below(st, IDLE_VICTIM_LIVE_MAX_PERCENT)
    }

    /// The dead bytes of sealed segments at most `max_live_percent` live.
    pub(in crate::volume) fn reclaimable_below(&self, st: &State, max_live_percent: u64) -> u64 {
        let size = self.sb.segment_size_bytes;
        (st.log.segments.candidates(st.live.usage()).into_iter())
            .filter(|&(_, live, _)| live * 100 <= size * max_live_percent)
            .map(|(_, live, _)| size - live)
            .sum()
    }

    /// Log bytes cleaning is expected to save besides the dead bytes
    /// (`CompactionHints`), for `stat`.
    pub(in crate::volume) fn compactable_bytes(&self, st: &State) -> u64 {
        if self.compaction_codec().is_none() {
            return 0;
        }
        let (segs, usage) = (&st.log.segments, st.live.usage());
        (0..segs.count())
            .filter(|&s| segs.state(s) == crate::segments::SegState::Sealed)
            .map(|s| st.live.hints().saving(s, usage.live_bytes(s)))
            .sum()
    }

    /// How short of room the log is, in `stat`'s words.
    pub(in crate::volume) fn space_pressure(&self, st: &State) -> &'static str {
        let (free, total) = (st.log.segments.free_count(), st.log.segments.count());
        if self.activity.space_wanted() {
            "writers-waiting"
        } else if free * 100 < self.options.cleaner.low_free_percent * total {
            "cleaning"
        } else {
            "none"
        }
    }

    /// Fewer than half the cleaner's start threshold of segments free: the
    /// background cleaner works without yielding to clients.
    fn free_segments_urgent(&self) -> bool {
        let Ok(st) = self.lock_state() else {
            return false;
        };
        let (free, total) = (st.log.segments.free_count(), st.log.segments.count());
        free * 200 < self.options.cleaner.low_free_percent * total
    }

    /// When fewer than `percent` of the segments are free: the free log bytes
    /// the cleaner's stop threshold asks for, or (a volume so full of live
    /// data that the threshold is out of reach) the free bytes plus half
    /// the dead bytes of the sealed segments. Without that cap a pass at
    /// 80% live data took every segment as a victim, chasing a free share
    /// no cleaning can reach: all the live data moved per pass, for the
    /// few percent the writes since had used.
    pub(in crate::volume) fn free_segments_below(
        &self,
        percent: u64,
    ) -> Result<Option<u64>, VolError> {
        let st = self.lock_state()?;
        let (free, total) = (st.log.segments.free_count(), st.log.segments.count());
        if free * 100 >= percent * total {
            return Ok(None);
        }
        // Only now (the scan is over every segment): what cleaning can reach.
        let size = self.sb.segment_size_bytes;
        let dead: u64 = (self.cleaning_candidates(&st).iter())
            .map(|&(_, left, _)| size - left)
            .sum();
        let threshold = (self.options.cleaner.high_free_percent * total).div_ceil(100) * size;
        Ok(Some(threshold.min(st.log.free_bytes() + dead / 2)))
    }
}
