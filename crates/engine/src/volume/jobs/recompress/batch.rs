//! A pass's windows in batches: each batch is read and compressed by up to
//! `ElasticConfig::recompress_threads` threads at once (the strong codec is
//! what an idle sweep spends its time on, and the clients that would use
//! the other cores are gone), then committed one by one in the pass's
//! order, each under the state lock with the compare-and-set of a serial
//! pass: a window a client (or the cleaner) changed after it was read is
//! left alone, whatever thread compressed it.
use super::{is_raw_unit, pays, rewritable, Candidate, Limit, RecompressReport, Sweep};
use crate::codec::Codec;
use crate::error::VolError;
use crate::volume::jobs::background_priority;
use crate::volume::prepare::Prepared;
use crate::volume::{Volume, BS};
use cvol_format::{MapEntry, BLOCK_SIZE_BYTES};
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Logical bytes of one batch: what it holds in memory at once is about
/// twice this (the data read and its compressed form).
const BATCH_BYTES: u64 = 1 << 20;

/// What a pass carries from batch to batch.
pub(super) struct Progress {
    /// Logical bytes the pass may still rewrite.
    pub(super) budget: u64,
    /// The segments whose candidates were all handled, some rewritten.
    pub(super) handled: Vec<u64>,
    /// A candidate of the current segment was rewritten.
    group_rewrote: bool,
}

impl Progress {
    pub(super) fn new(budget: u64) -> Progress {
        Progress {
            budget,
            handled: Vec::new(),
            group_rewrote: false,
        }
    }
}

/// A window read and compressed, not yet committed.
pub(super) struct PreparedWindow {
    /// None: a block could not be read (left for the client read to report).
    runs: Option<Vec<PreparedRun>>,
}

/// A run of contiguous owner data blocks of one window, compressed.
struct PreparedRun {
    lba: u64,
    /// The map entries the data was read under (compare-and-set at commit).
    before: Vec<MapEntry>,
    old_bytes: u64,
    new_bytes: u64,
    /// None: the rewrite would not pay.
    items: Option<Vec<Prepared<'static>>>,
}

fn into_owned(p: Prepared<'_>) -> Prepared<'static> {
    match p {
        Prepared::Data {
            lba,
            nblocks,
            codec,
            level,
            payload,
            payload_crc,
            fps,
        } => Prepared::Data {
            lba,
            nblocks,
            codec,
            level,
            payload: Cow::Owned(payload.into_owned()),
            payload_crc,
            fps,
        },
        _ => unreachable!("a data run compresses to data"),
    }
}

impl Volume {
    /// Threads that compress a batch.
    fn recompress_threads(&self) -> usize {
        match self.options.elastic.recompress_threads {
            0 => crate::memory::cores(),
            n => n,
        }
    }

    /// How many of `cands` (the pass's candidates from its `at`-th) the next
    /// batch takes; 0: the pass ends here. The batch's first candidate is
    /// checked as a serial pass checks each (its room under the sweep's
    /// ceiling, the budget, the candidates examined, free segments); the
    /// others join it while the batch's appends (`append_bound` each, more
    /// than a rewrite appends) stay within the room, so that a batch never
    /// takes more than a serial pass would.
    pub(super) fn next_batch(
        &self,
        cands: &[Candidate],
        at: usize,
        examined: u64,
        budget: u64,
        limit: Option<&Limit>,
        rep: &mut RecompressReport,
    ) -> Result<usize, VolError> {
        let examined_all = |i: usize| limit.is_some() && i as u64 >= examined.max(1);
        let mut appended = 0;
        if let Some(l) = limit {
            appended = self.host_held_now()?.saturating_sub(l.held);
            if l.segs[at] != l.segs[0] {
                rep.held_back = appended + self.append_bound(&cands[0]) > l.room;
            }
        }
        if rep.held_back || budget == 0 || examined_all(at) || !self.room_for_recompression()? {
            return Ok(0);
        }
        let window_bytes = self.window_blocks() * BLOCK_SIZE_BYTES;
        let max = (BATCH_BYTES / window_bytes).clamp(1, budget.div_ceil(window_bytes));
        let max = cands.len().min(usize::try_from(max).unwrap_or(usize::MAX));
        let mut extra = self.append_bound(&cands[0]);
        let mut n = 1;
        while n < max && !examined_all(at + n) {
            let bound = self.append_bound(&cands[n]);
            if limit
                .is_some_and(|l| l.segs[at + n] != l.segs[0] && appended + extra + bound > l.room)
            {
                break;
            }
            extra += bound;
            n += 1;
        }
        Ok(n)
    }

    /// Reads and compresses the windows from `firsts`, on up to
    /// `recompress_threads` threads. With `yield_to_clients`, no window is
    /// begun once a client request arrives: the windows from the first
    /// one not prepared are None.
    pub(super) fn prepare_windows(
        &self,
        firsts: &[u64],
        strong: Codec,
        yield_to_clients: bool,
    ) -> Result<Vec<Option<PreparedWindow>>, VolError> {
        let next = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        let work = || -> Result<Vec<(usize, PreparedWindow)>, VolError> {
            let mut out = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                if yield_to_clients && self.clients_or_writers_waiting() {
                    stop.store(true, Ordering::SeqCst);
                    break;
                }
                let k = next.fetch_add(1, Ordering::SeqCst);
                let Some(&first) = firsts.get(k) else { break };
                match self.prepare_window(first, strong) {
                    Ok(w) => out.push((k, w)),
                    Err(e) => {
                        stop.store(true, Ordering::SeqCst);
                        return Err(e);
                    }
                }
            }
            Ok(out)
        };
        let threads = self.recompress_threads().clamp(1, firsts.len().max(1));
        let results = if threads == 1 {
            vec![work()]
        } else {
            std::thread::scope(|s| {
                let helpers: Vec<_> = (1..threads)
                    .map(|_| {
                        s.spawn(|| {
                            background_priority();
                            work()
                        })
                    })
                    .collect();
                let mut all = vec![work()];
                for h in helpers {
                    all.push(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
                }
                all
            })
        };
        let mut slots: Vec<Option<PreparedWindow>> = firsts.iter().map(|_| None).collect();
        for r in results {
            for (k, w) in r? {
                slots[k] = Some(w);
            }
        }
        Ok(slots)
    }

    /// Commits a batch's windows in order, the pass's candidates from its
    /// `at`-th; false if one was not prepared (a client arrived: the pass
    /// stops there).
    #[allow(
        clippy::too_many_arguments,
        reason = "a pass's state, lent to its batches"
    )]
    pub(super) fn commit_batch(
        &self,
        at: usize,
        prepared: Vec<Option<PreparedWindow>>,
        firsts: &[u64],
        limit: Option<&Limit>,
        sweep: &mut Option<&mut Sweep>,
        p: &mut Progress,
        rep: &mut RecompressReport,
    ) -> Result<bool, VolError> {
        for (k, w) in prepared.into_iter().enumerate() {
            let Some(w) = w else {
                rep.yielded = true;
                return Ok(false);
            };
            let skipped = rep.skipped;
            let done = self.commit_window(w, rep)?;
            p.budget = p.budget.saturating_sub(done * BLOCK_SIZE_BYTES);
            if let (Some(s), true) = (sweep.as_deref_mut(), rep.skipped > skipped) {
                s.skipped.insert(firsts[k] / self.window_blocks());
            }
            p.group_rewrote |= done > 0;
            let i = at + k;
            if let Some(l) = limit.filter(|l| l.segs.get(i + 1) != Some(&l.segs[i])) {
                if std::mem::take(&mut p.group_rewrote) {
                    p.handled.push(l.segs[i]);
                }
            }
        }
        Ok(true)
    }

    /// Reads one window and compresses its runs of contiguous owner data
    /// blocks with the strong codec.
    fn prepare_window(&self, first: u64, strong: Codec) -> Result<PreparedWindow, VolError> {
        let w = self.window_blocks();
        let last = (first + w).min(self.sb.logical_blocks());
        // Each block's entry, and whether the run may take it: an owner
        // entry of a rewritable record no dedup reference points at.
        let (before, owner_data): (Vec<MapEntry>, Vec<bool>) = {
            let mut st = self.lock_state()?;
            self.fault(&mut st, first, last)?;
            (first..last)
                .map(|l| {
                    let e = st.live.get(l);
                    let owner = Self::unreferenced_owner(&st, e);
                    (
                        e,
                        owner.is_some_and(|(codec, unit, ..)| rewritable(codec, unit)),
                    )
                })
                .unzip()
        };
        let mut data = vec![0u8; before.len() * BS];
        // An unreadable block is left for the client read to report.
        if self.read_blocks_once(first, &mut data, false).is_err() {
            return Ok(PreparedWindow { runs: None });
        }
        let mut runs = Vec::new();
        let mut i = 0;
        while i < before.len() {
            if !owner_data[i] {
                i += 1;
                continue;
            }
            let mut j = i + 1;
            while j < before.len() && owner_data[j] {
                j += 1;
            }
            let (lba, data) = (first + i as u64, &data[i * BS..j * BS]);
            runs.push(self.prepare_run(lba, &before[i..j], data, strong)?);
            i = j;
        }
        Ok(PreparedWindow { runs: Some(runs) })
    }

    /// Compresses one run with the strong codec; keeps the records only if
    /// the rewrite saves enough.
    fn prepare_run(
        &self,
        lba: u64,
        before: &[MapEntry],
        data: &[u8],
        strong: Codec,
    ) -> Result<PreparedRun, VolError> {
        let old_bytes = self.run_stored_bytes(before)?;
        // The rewrite is indexed like a client write, so identical data
        // written later still deduplicates against it (the old records die).
        let fps = self.fingerprints(data);
        let items = self.compress_run_with(lba, data, &fps, strong, self.window_blocks());
        let new_bytes: u64 = items
            .iter()
            .map(|p| match p {
                Prepared::Data { payload, .. } => {
                    (self.sb.record_overhead() + payload.len()) as u64
                }
                _ => unreachable!("a data run compresses to data"),
            })
            .sum();
        // A deferred raw unit is rewritten even without a gain: as raw
        // single blocks it is judged, and no pass visits it again.
        let deferred = before.iter().any(|e| is_raw_unit(*e));
        let min_gain = self.options.elastic.recompress_min_gain_percent;
        let keep = deferred || pays(old_bytes, new_bytes, min_gain);
        Ok(PreparedRun {
            lba,
            before: before.to_vec(),
            old_bytes,
            new_bytes,
            items: keep.then(|| items.into_iter().map(into_owned).collect()),
        })
    }

    /// Commits a prepared window's runs that pay and that nothing changed
    /// under. Returns the blocks rewritten.
    pub(super) fn commit_window(
        &self,
        w: PreparedWindow,
        rep: &mut RecompressReport,
    ) -> Result<u64, VolError> {
        let Some(runs) = w.runs else {
            rep.skipped += 1;
            return Ok(0);
        };
        let mut rewritten = 0;
        for run in runs {
            rewritten += self.commit_run(run, rep)?;
        }
        Ok(rewritten)
    }

    /// Commits one run if every block still has the map entry it was read
    /// under (compare-and-set) and the log has room.
    fn commit_run(&self, run: PreparedRun, rep: &mut RecompressReport) -> Result<u64, VolError> {
        let Some(items) = run.items else {
            rep.skipped += 1;
            return Ok(0);
        };
        let n = run.before.len() as u64;
        let mut st = self.lock_state()?;
        self.check_writable()?;
        self.fault(&mut st, run.lba, run.lba + n)?;
        let changed =
            (run.before.iter().enumerate()).any(|(k, e)| st.live.get(run.lba + k as u64) != *e);
        let need = crate::volume::commit::log_bytes(&items, st.log.packing);
        if changed || st.log.free_bytes() < need + self.reserve_bytes(&st) {
            rep.skipped += 1;
            return Ok(0);
        }
        let items = crate::volume::commit::packed(st.log.packing, st.log.head.fill, items);
        let mut done = HashMap::new();
        for item in items {
            let again = self.commit_one(&mut st, item, &mut done)?;
            assert!(again.is_none(), "data items always commit");
        }
        rep.blocks_rewritten += n;
        rep.bytes_before += run.old_bytes;
        rep.bytes_after += run.new_bytes;
        Ok(n)
    }
}
