//! Background recompression (bcachefs background_compression, zram
//! recompress; EDC §3 "higher compression rate in periods of lower system
//! utilization"): when clients have been quiet for a while, cold data that
//! was written with a fast codec (lz4 under load) or in small units is
//! read back and rewritten with the volume's strong codec, merged into
//! units of the configured size, largest expected savings first, within a
//! budget per pass. It stops the moment a client issues a request.
//!
//! Safety: a rewrite is an ordinary DATA record appended to the log, and it
//! is committed only if, under the state lock, every block it replaces still
//! has the map entry that was read (compare-and-set); otherwise the run is
//! left alone. Roll-forward replays it in seq order like a client write of
//! the same content. The old records die as on an overwrite, and their
//! segments are reused only after the map pointing away is durable
//! (the cleaner's rule). Raw records (the probe, or a compression that did
//! not pay) are never retried; windows holding dedup references are skipped.
use super::*;
use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// Windows (of unit size) scanned per hold of the state lock.
const SCAN_WINDOWS_PER_LOCK: u64 = 4096;
/// Windows scanned per pass (then the cursor moves on).
const SCAN_WINDOWS_PER_PASS: u64 = 1 << 18;
/// A rewrite must save at least 1/16 of the bytes it replaces.
const MIN_GAIN_DIVISOR: u64 = 16;

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
}

struct Candidate {
    first: u64,
    score: u64,
}

impl Volume {
    fn window_blocks(&self) -> u64 {
        u64::from(
            self.options
                .elastic
                .unit_blocks
                .clamp(1, policy::UNIT_BLOCKS_MAX),
        )
    }

    /// Milliseconds since the last client request.
    pub(super) fn idle_ms(&self) -> u64 {
        let now = self.opened.elapsed().as_millis() as u64;
        now.saturating_sub(self.last_client_io_ms.load(Ordering::Relaxed))
    }

    /// Is entry `e` a record worth rewriting with the strong codec? lz4
    /// records, and single-block records of a compressing codec (too small
    /// a unit); not raw ones (judged incompressible), not dedup-shared ones.
    fn weak(st: &State, e: MapEntry) -> Option<(u64, u32)> {
        match e.state_valid() {
            EntryState::Data {
                codec,
                offset,
                len,
                shared: false,
                unit,
            } if codec != CodecTag::None
                && (codec == CodecTag::Lz4 || !unit)
                && st.shared.get(offset).is_none_or(|s| s.refs == 0) =>
            {
                Some((offset, len))
            }
            _ => None,
        }
    }

    /// Scores the windows from `cursor`: stored bytes of weak records in
    /// each window with no dedup references in it.
    fn scan_candidates(&self, cursor: u64, windows: u64) -> (Vec<Candidate>, u64) {
        let w = self.window_blocks();
        let total = self.sb.logical_blocks().div_ceil(w);
        let end = (cursor + windows).min(total);
        let mut out = Vec::new();
        let mut at = cursor;
        while at < end {
            let stop = (at + SCAN_WINDOWS_PER_LOCK).min(end);
            let st = self.lock_state();
            while at < stop {
                let first = at * w;
                at += 1;
                // Skip unwritten pages quickly.
                match st.map.next_allocated_page_lba(first) {
                    Some(p) if p < first + w => {}
                    Some(p) => {
                        at = at.max(p / w);
                        continue;
                    }
                    None => {
                        at = stop.max(at);
                        break;
                    }
                }
                let last = (first + w).min(st.map.blocks());
                let mut score = 0u64;
                let mut seen = Vec::new();
                let mut shared = false;
                for l in first..last {
                    let e = st.map.get(l);
                    if let EntryState::Data { shared: true, .. } = e.state_valid() {
                        shared = true;
                        break;
                    }
                    if let Some((offset, len)) = Self::weak(&st, e) {
                        if !seen.contains(&offset) {
                            seen.push(offset);
                            score += u64::from(len);
                        }
                    }
                }
                if !shared && score > 0 {
                    out.push(Candidate { first, score });
                }
            }
        }
        (out, end)
    }

    /// One background pass: scans windows from the cursor, rewrites the
    /// best candidates until `budget_bytes` of logical data were rewritten.
    /// With `yield_to_clients` it stops at the first client request.
    pub fn recompress_pass(
        &self,
        budget_bytes: u64,
        yield_to_clients: bool,
    ) -> Result<RecompressReport, VolError> {
        self.check_writable()?;
        let CodecPolicy::Auto { strong } = self.policy else {
            return Ok(RecompressReport::default());
        };
        let _c = self.cleaner_lock.lock().expect("cleaner lock");
        let mut rep = RecompressReport::default();
        let w = self.window_blocks();
        let total = self.sb.logical_blocks().div_ceil(w);
        let cursor = self.recompress_cursor.load(Ordering::Relaxed).min(total);
        let (mut cands, end) = self.scan_candidates(cursor, SCAN_WINDOWS_PER_PASS);
        rep.windows_scanned = end - cursor;
        rep.candidates = cands.len() as u64;
        // Largest expected savings first.
        cands.sort_by(|a, b| b.score.cmp(&a.score).then(a.first.cmp(&b.first)));
        let mut budget = budget_bytes;
        let mut finished = true;
        for c in cands {
            if yield_to_clients && self.clients_busy() {
                rep.yielded = true;
            }
            if rep.yielded || budget == 0 || !self.room_for_recompression() {
                finished = false;
                break;
            }
            let done = self.recompress_window(c.first, strong, &mut rep)?;
            budget = budget.saturating_sub(done * BLOCK_SIZE_BYTES);
        }
        // The next pass resumes after this chunk only once all its
        // candidates were handled (rewritten ones are strong now).
        if finished {
            rep.wrapped = end >= total;
            let next = if rep.wrapped { 0 } else { end };
            self.recompress_cursor.store(next, Ordering::Relaxed);
        }
        let es = &self.elastic_stats;
        es.recompress_passes.fetch_add(1, Ordering::Relaxed);
        es.recompressed_blocks
            .fetch_add(rep.blocks_rewritten, Ordering::Relaxed);
        es.recompressed_bytes_before
            .fetch_add(rep.bytes_before, Ordering::Relaxed);
        es.recompressed_bytes_after
            .fetch_add(rep.bytes_after, Ordering::Relaxed);
        es.recompress_skipped_units
            .fetch_add(rep.skipped, Ordering::Relaxed);
        Ok(rep)
    }

    /// Recompression appends before the old records die: only with free
    /// segments above the cleaner's start threshold (plus 5%) to spare.
    fn room_for_recompression(&self) -> bool {
        let st = self.lock_state();
        let free = st.log.segments.free_count();
        let total = st.log.segments.count();
        free * 100 > (self.options.cleaner.low_free_percent + 5) * total
            && st.log.free_bytes() > self.reserve_bytes(&st) + 2 * self.sb.segment_size_bytes
    }

    /// Rewrites the runs of contiguous data blocks of one window with the
    /// strong codec. Returns the blocks rewritten.
    fn recompress_window(
        &self,
        first: u64,
        strong: Codec,
        rep: &mut RecompressReport,
    ) -> Result<u64, VolError> {
        let w = self.window_blocks();
        let last = (first + w).min(self.sb.logical_blocks());
        let before: Vec<MapEntry> = {
            let st = self.lock_state();
            (first..last).map(|l| st.map.get(l)).collect()
        };
        let mut data = vec![0u8; before.len() * BS];
        // An unreadable block is left for the client read to report.
        if self.read_blocks_once(first, &mut data, false).is_err() {
            rep.skipped += 1;
            return Ok(0);
        }
        let mut rewritten = 0;
        let mut i = 0;
        while i < before.len() {
            let owner_data = |e: &MapEntry| {
                matches!(
                    e.state_valid(),
                    EntryState::Data { shared: false, codec, .. } if codec != CodecTag::None
                )
            };
            if !owner_data(&before[i]) {
                i += 1;
                continue;
            }
            let mut j = i + 1;
            while j < before.len() && owner_data(&before[j]) {
                j += 1;
            }
            rewritten += self.recompress_run(
                first + i as u64,
                &before[i..j],
                &data[i * BS..j * BS],
                strong,
                rep,
            )?;
            i = j;
        }
        Ok(rewritten)
    }

    /// Compresses one run with the strong codec and commits it if it saves
    /// enough and nothing changed under it.
    fn recompress_run(
        &self,
        lba: u64,
        before: &[MapEntry],
        data: &[u8],
        strong: Codec,
        rep: &mut RecompressReport,
    ) -> Result<u64, VolError> {
        let n = before.len();
        // What the run's records cost now: each distinct record once, if
        // the run covers all its entries (else it stays live anyway).
        let old_bytes = {
            let st = self.lock_state();
            let mut per: HashMap<u64, (u32, u32)> = HashMap::new();
            for e in before {
                if let EntryState::Data { offset, len, .. } = e.state_valid() {
                    per.entry(offset).or_insert((len, 0)).1 += 1;
                }
            }
            per.iter()
                .filter(|(off, (_, count))| {
                    st.shared
                        .get(**off)
                        .is_none_or(|s| s.refs == 0 && s.owners == *count)
                })
                .map(|(_, (len, _))| u64::from(*len))
                .sum::<u64>()
        };
        let fps = vec![0 as Fingerprint; n];
        let items = self.compress_run_with(lba, data, &fps, strong);
        let new_bytes: u64 = items
            .iter()
            .map(|p| match p {
                Prepared::Data { payload, .. } => (RECORD_HEADER_BYTES + payload.len()) as u64,
                _ => unreachable!("a data run compresses to data"),
            })
            .sum();
        if new_bytes + old_bytes / MIN_GAIN_DIVISOR > old_bytes {
            rep.skipped += 1;
            return Ok(0);
        }
        let mut st = self.lock_state();
        self.check_writable()?;
        let changed = before
            .iter()
            .enumerate()
            .any(|(k, e)| st.map.get(lba + k as u64) != *e);
        if changed || st.log.free_bytes() < new_bytes + self.reserve_bytes(&st) {
            rep.skipped += 1;
            return Ok(0);
        }
        let mut done = HashMap::new();
        for item in items {
            let again = self.commit_one(&mut st, item, &mut done)?;
            debug_assert!(again.is_none(), "data items always commit");
        }
        rep.blocks_rewritten += n as u64;
        rep.bytes_before += old_bytes;
        rep.bytes_after += new_bytes;
        Ok(n as u64)
    }

    /// Starts the background recompressor (policy auto with recompression
    /// on); it stops when the handle drops.
    pub fn start_background_recompressor(self: &Arc<Self>) -> Option<BackgroundRecompressor> {
        if !self.policy.is_auto() || !self.options.elastic.recompress || self.options.read_only {
            return None;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (vol, flag) = (Arc::downgrade(self), stop.clone());
        let handle = std::thread::Builder::new()
            .name("cvol-recompress".into())
            .spawn(move || recompress_loop(vol, flag))
            .expect("spawn recompression thread");
        Some(BackgroundRecompressor {
            stop,
            handle: Some(handle),
        })
    }
}

fn recompress_loop(vol: std::sync::Weak<Volume>, stop: Arc<AtomicBool>) {
    // After a sweep of the whole volume found nothing, wait for new writes.
    let mut quiet_at: Option<u64> = None;
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(200));
        let Some(v) = vol.upgrade() else { return };
        if v.poisoned.load(Ordering::SeqCst) || v.idle_ms() < v.options.elastic.recompress_idle_ms {
            continue;
        }
        let written = v.client_bytes_written.load(Ordering::Relaxed);
        if quiet_at == Some(written) {
            continue;
        }
        // Rewrites append before old records die: make room first (idle
        // time is the cleaner's too), up to the cleaner's stop threshold.
        let (free, total) = {
            let st = v.lock_state();
            (st.log.segments.free_count(), st.log.segments.count())
        };
        let cfg = v.options.cleaner;
        if free * 100 < cfg.high_free_percent * total {
            let want = (cfg.high_free_percent * total).div_ceil(100) * v.sb.segment_size_bytes;
            if let Err(e) = v.clean(want, true) {
                tracing::warn!("cleaning before recompression: {e}");
            }
        }
        match v.recompress_pass(v.options.elastic.recompress_pass_bytes, true) {
            Ok(r) => {
                if r.blocks_rewritten > 0 {
                    tracing::debug!(?r, "background recompression pass");
                }
                if r.wrapped && r.blocks_rewritten == 0 && !r.yielded {
                    quiet_at = Some(written);
                }
            }
            Err(e) => tracing::warn!("background recompression: {e}"),
        }
    }
}

/// Handle of the background recompression thread.
pub struct BackgroundRecompressor {
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Drop for BackgroundRecompressor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
