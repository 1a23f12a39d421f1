//! The cleaner: makes room in the log by moving the live records of
//! mostly-dead segments to the log head, then checkpointing so the emptied
//! segments can be reused (ZBD §2.1.4, LFS §3.5).
//!
//! Safety: a record is moved only if, under the state lock, the map still
//! points at it; the move is an ordinary DATA record appended to the log, so
//! roll-forward replays it in order with client writes. A segment is reused
//! only after a durable checkpoint whose snapshot covers every record in it
//! (`SegmentTable::reclaim`), i.e. after the map that points away from it is
//! durable. Until then a crash recovers the old map, which still finds the
//! old records where they were.
use super::*;
use crate::segments::{pack_order, VictimPolicy};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// When and how the cleaner runs.
#[derive(Debug, Clone, Copy)]
pub struct CleanerConfig {
    pub policy: VictimPolicy,
    /// The background cleaner starts below this share of free segments...
    pub low_free_percent: u64,
    /// ...and stops above this one.
    pub high_free_percent: u64,
}

impl Default for CleanerConfig {
    fn default() -> Self {
        CleanerConfig {
            policy: VictimPolicy::CostBenefit,
            low_free_percent: 10,
            high_free_percent: 25,
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct CleanerStats {
    pub segments_cleaned: AtomicU64,
    pub records_relocated: AtomicU64,
    pub bytes_relocated: AtomicU64,
    pub segments_reclaimed: AtomicU64,
}

/// Most clean-then-checkpoint rounds one `clean` call runs.
const ROUNDS_MAX: usize = 64;
/// Records moved per hold of the state lock.
const MOVE_BATCH: usize = 64;
/// A client request this recent makes the background cleaner pause.
const CLIENT_BUSY_MS: u64 = 20;

pub(crate) struct Found {
    pub(crate) at: usize,
    pub(crate) header: RecordHeader,
}

impl Volume {
    pub(super) fn note_client_io(&self) {
        let ms = self.opened.elapsed().as_millis() as u64;
        self.last_client_io_ms.store(ms, Ordering::Relaxed);
    }

    pub(super) fn clients_busy(&self) -> bool {
        let now = self.opened.elapsed().as_millis() as u64;
        now.saturating_sub(self.last_client_io_ms.load(Ordering::Relaxed)) < CLIENT_BUSY_MS
    }

    /// Bytes a checkpoint of the current map may take.
    pub(super) fn checkpoint_estimate_bytes(&self, st: &State) -> u64 {
        // 12 bytes per entry plus a 12-byte run header at worst; lz4 is not counted on;
        // up to two chunk records lost to segment tails; the commit record.
        let entries = st.counters.data_blocks + st.counters.zero_blocks + st.counters.lost_blocks;
        let chunk = (self.chunk_raw_max_bytes() + 2 * RECORD_HEADER_BYTES) as u64;
        let raw = entries * 25;
        raw + (raw / self.sb.segment_size_bytes + 2) * chunk + (64 << 10)
    }

    /// Cleans until the log has `want_free_bytes` free or nothing more can
    /// be gained. With `yield_to_clients` it pauses while clients are busy.
    /// Returns the log bytes gained.
    pub fn clean(&self, want_free_bytes: u64, yield_to_clients: bool) -> Result<u64, VolError> {
        let _c = self.cleaner_lock.lock().expect("cleaner lock");
        self.check_writable()?;
        let mut gained = 0;
        for _ in 0..ROUNDS_MAX {
            let before = self.lock_state().log.free_bytes();
            if before >= want_free_bytes {
                break;
            }
            let emptied = self.relocate_round(want_free_bytes, yield_to_clients)?;
            if emptied == 0 {
                break; // nothing to gain: no checkpoint either
            }
            // Victims older than the durable checkpoint are free once the
            // moves are durable; newer ones need a checkpoint first.
            self.flush()?;
            let (free, waiting) = {
                let st = self.lock_state();
                (st.log.free_bytes(), st.log.segments.empty_sealed_count())
            };
            if free < want_free_bytes && waiting > 0 {
                match self.checkpoint() {
                    Ok(()) => {}
                    Err(VolError::NoSpace) => break,
                    Err(e) => return Err(e),
                }
            }
            let after = self.lock_state().log.free_bytes();
            gained += after.saturating_sub(before);
            if after < before + self.sb.segment_size_bytes / 16 {
                break; // only segment tails left to gain: the live data is dense
            }
        }
        Ok(gained)
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
                while self.clients_busy() && self.space_waiters.load(Ordering::SeqCst) == 0 {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            let Some((victim, live)) = self.pick_victim(&done, want_free_bytes) else {
                break;
            };
            done.insert(victim);
            if live > 0 {
                self.relocate_segment(victim)?;
                self.cleaner_stats
                    .segments_cleaned
                    .fetch_add(1, Ordering::Relaxed);
            }
            let left = self.lock_state().log.segments.live_bytes(victim);
            if left > 0 {
                tracing::warn!(
                    segment = victim,
                    live_bytes = left,
                    "cleaner could not empty a segment (unreadable records?)"
                );
            }
        }
        Ok(done.len() as u64)
    }

    /// The best victim not yet tried whose live data fits in the space the
    /// cleaner may use, or None once enough space will be free.
    fn pick_victim(&self, done: &HashSet<u64>, want_free_bytes: u64) -> Option<(u64, u64)> {
        let st = self.lock_state();
        let segs = &st.log.segments;
        let ckpt = self.checkpoint_estimate_bytes(&st);
        let projected = st.log.free_bytes() + done.len() as u64 * self.sb.segment_size_bytes;
        if projected >= want_free_bytes.saturating_add(ckpt) {
            return None;
        }
        let budget = st
            .log
            .free_bytes()
            .saturating_sub(ckpt + 2 * UNIT_RECORD_MAX_BYTES);
        let candidates: Vec<_> = segs
            .candidates()
            .into_iter()
            .filter(|c| !done.contains(&c.0))
            .collect();
        let order = self.options.cleaner.policy.order(
            candidates,
            self.sb.segment_size_bytes,
            st.log.last_seq(),
        );
        order
            .into_iter()
            .map(|s| (s, segs.live_bytes(s)))
            .find(|&(_, live)| live <= budget)
    }

    /// Moves every live record of `victim` to the log head.
    fn relocate_segment(&self, victim: u64) -> Result<(), VolError> {
        // No new dedup reference may point into the victim from here on, so
        // the holders of its shared records found below stay complete.
        self.lock_state().cleaning.insert(victim);
        let r = self.relocate_segment_marked(victim);
        self.lock_state().cleaning.remove(&victim);
        r
    }

    fn relocate_segment_marked(&self, victim: u64) -> Result<(), VolError> {
        let base = self.sb.segment_offset(victim);
        let end = base + self.sb.segment_size_bytes;
        let mut buf = vec![0u8; self.sb.segment_size_bytes as usize];
        self.storage.read_at(base, &mut buf).map_err(VolError::Io)?;
        let found = parse_segment(&buf, self.sb.volume_tag());

        let (space, holders) = {
            let st = self.lock_state();
            let has_refs = |off: u64| st.shared.get(off).is_some_and(|s| s.refs > 0);
            let any_shared = found.iter().any(|f| has_refs(base + f.at as u64));
            // Every LBA pointing at a record of the victim with dedup
            // references: one map scan. (A unit's owners are in its range.)
            let mut holders: HashMap<u64, Vec<u64>> = HashMap::new();
            if any_shared {
                st.map.for_each_mapped(|lba, e| {
                    if let EntryState::Data { offset, .. } = e.state_valid() {
                        if offset >= base && offset < end && has_refs(offset) {
                            holders.entry(offset).or_default().push(lba);
                        }
                    }
                });
            }
            (st.log.segment_size - st.log.fill as u64, holders)
        };
        let sizes: Vec<(u64, u64)> = found
            .iter()
            .map(|f| (f.header.total_len() as u64, f.header.lba))
            .collect();
        let order = pack_order(&sizes, space, self.sb.segment_size_bytes);
        for batch in order.chunks(MOVE_BATCH) {
            let mut st = self.lock_state();
            self.check_writable()?;
            for &i in batch {
                let f = &found[i];
                let holders = holders.get(&(base + f.at as u64));
                match holders {
                    _ if f.header.nblocks > 1 => {
                        let h = holders.map_or(&[][..], Vec::as_slice);
                        self.move_unit_record(&mut st, base, &buf, f, h)?
                    }
                    Some(h) => self.move_shared_record(&mut st, base, &buf, f, h)?,
                    None => self.move_record(&mut st, base, &buf, f)?,
                }
            }
        }
        Ok(())
    }

    /// Moves a multi-block unit: its owners (blocks of its range that still
    /// point at it) are repointed and named in the copy's live mask, so
    /// roll-forward maps exactly them; dedup holders get REF records.
    fn move_unit_record(
        &self,
        st: &mut State,
        base: u64,
        seg: &[u8],
        f: &Found,
        holders: &[u64],
    ) -> Result<(), VolError> {
        let h = &f.header;
        let (off, len) = (base + f.at as u64, h.total_len() as u32);
        let owners: Vec<u32> = (0..h.nblocks)
            .filter(|&k| {
                let l = h.lba + u64::from(k);
                l < st.map.blocks() && st.map.get(l) == MapEntry::unit(h.codec, off, len, h.crc, k)
            })
            .collect();
        let refs: Vec<(u64, u32)> = holders
            .iter()
            .filter_map(|&l| {
                let e = st.map.get(l);
                match e.state_valid() {
                    EntryState::Data {
                        offset,
                        shared: true,
                        unit: true,
                        ..
                    } if offset == off && e.block_in(h.crc) < h.nblocks => {
                        Some((l, e.block_in(h.crc)))
                    }
                    _ => None,
                }
            })
            .collect();
        if owners.is_empty() && refs.is_empty() {
            return Ok(());
        }
        let refs_bytes = REF_RECORD_BYTES * refs.len() as u64;
        if st.log.free_bytes()
            < refs_bytes + self.checkpoint_estimate_bytes(st) + UNIT_RECORD_MAX_BYTES
        {
            return Err(VolError::NoSpace);
        }
        let mask = owners.iter().fold(0u16, |m, &k| m | (1 << k));
        let new = self.copy_record(st, seg, f, h.lba, mask)?;
        let EntryState::Data { offset, len, .. } = new.state_valid() else {
            unreachable!("copy is data")
        };
        let crc = new.block_in(0);
        for k in owners {
            let e = MapEntry::unit(h.codec, offset, len, crc, k);
            self.set_entry(st, h.lba + u64::from(k), e);
        }
        for (l, k) in refs {
            let e = MapEntry::unit(h.codec, offset, len, crc, k);
            self.commit_ref(st, l, e, 0)?;
        }
        debug_assert!(st.shared.get(off).is_none(), "every holder moved");
        Ok(())
    }

    /// Appends a copy of one record if the map still points at the original.
    fn move_record(
        &self,
        st: &mut State,
        base: u64,
        seg: &[u8],
        f: &Found,
    ) -> Result<(), VolError> {
        let h = &f.header;
        let old = MapEntry::data(h.codec, base + f.at as u64, h.total_len() as u32, h.crc);
        let lbas = h.lba..h.lba + u64::from(h.nblocks);
        if !lbas
            .clone()
            .any(|l| l < st.map.blocks() && st.map.get(l) == old)
        {
            return Ok(());
        }
        let new = self.copy_record(st, seg, f, h.lba, 0)?;
        for l in lbas {
            if st.map.get(l) == old {
                self.set_entry(st, l, new);
            }
        }
        Ok(())
    }

    /// Moves a record that dedup references share: the copy's owner is the
    /// old owner if it still points at the record, else one of the holders;
    /// every other holder gets a REF record to the copy, so roll-forward
    /// repoints them all.
    fn move_shared_record(
        &self,
        st: &mut State,
        base: u64,
        seg: &[u8],
        f: &Found,
        holders: &[u64],
    ) -> Result<(), VolError> {
        let h = &f.header;
        let offset = base + f.at as u64;
        let old = MapEntry::data(h.codec, offset, h.total_len() as u32, h.crc);
        let lbas: Vec<u64> = holders
            .iter()
            .copied()
            .filter(|&l| st.map.get(l).same_record(&old))
            .collect();
        let Some(&first) = lbas.first() else {
            return Ok(()); // every holder moved on since the scan
        };
        let refs_bytes = REF_RECORD_BYTES * lbas.len() as u64;
        if st.log.free_bytes()
            < refs_bytes + self.checkpoint_estimate_bytes(st) + UNIT_RECORD_MAX_BYTES
        {
            return Err(VolError::NoSpace);
        }
        let fp = st.shared.fingerprint_of(offset);
        let owner = if h.lba < st.map.blocks() && st.map.get(h.lba) == old {
            h.lba
        } else {
            first
        };
        let new = self.copy_record(st, seg, f, owner, 0)?;
        self.set_entry_fp(st, owner, new, fp);
        for &l in lbas.iter().filter(|&&l| l != owner) {
            self.commit_ref(st, l, new, fp)?;
        }
        debug_assert!(st.shared.get(offset).is_none(), "all holders moved");
        if let (Some(ix), true) = (&self.index, fp != 0) {
            ix.lock().expect("index lock").moved(fp, &old, new, owner);
        }
        Ok(())
    }

    /// Appends the record's bytes again (new seq, header naming `owner`,
    /// live mask `mask` for a unit), without recompressing. Returns the
    /// copy's owner map entry (of block 0 for a unit).
    fn copy_record(
        &self,
        st: &mut State,
        seg: &[u8],
        f: &Found,
        owner: u64,
        mask: u16,
    ) -> Result<MapEntry, VolError> {
        let h = &f.header;
        let payload = &seg[f.at + RECORD_HEADER_BYTES..f.at + h.total_len()];
        let crc = crc32c::crc32c(payload);
        let shape = crate::log::Shape {
            kind: RecordKind::Data,
            codec: h.codec,
            level: h.level,
            lba: owner,
            nblocks: h.nblocks,
            mask,
        };
        let p = self.guard(st.log.append_shaped(&*self.storage, shape, payload, crc))?;
        self.cleaner_stats
            .records_relocated
            .fetch_add(1, Ordering::Relaxed);
        self.cleaner_stats
            .bytes_relocated
            .fetch_add(u64::from(p.len), Ordering::Relaxed);
        Ok(MapEntry::data(h.codec, p.offset, p.len, p.crc))
    }

    /// Starts the background cleaner thread; it stops when the handle drops.
    pub fn start_background_cleaner(self: &Arc<Self>) -> BackgroundCleaner {
        let stop = Arc::new(AtomicBool::new(false));
        let (vol, flag) = (Arc::downgrade(self), stop.clone());
        let handle = std::thread::Builder::new()
            .name("cvol-cleaner".into())
            .spawn(move || background_loop(vol, flag))
            .expect("spawn cleaner thread");
        BackgroundCleaner {
            stop,
            handle: Some(handle),
        }
    }
}

fn background_loop(vol: std::sync::Weak<Volume>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(100));
        let Some(v) = vol.upgrade() else { return };
        if v.read_only() || v.poisoned.load(Ordering::SeqCst) {
            continue;
        }
        let (free, total) = {
            let st = v.lock_state();
            (st.log.segments.free_count(), st.log.segments.count())
        };
        let cfg = v.options.cleaner;
        if free * 100 < cfg.low_free_percent * total {
            let want = (cfg.high_free_percent * total).div_ceil(100) * v.sb.segment_size_bytes;
            match v.clean(want, true) {
                Ok(n) => tracing::debug!(freed = n, "background cleaning pass"),
                Err(e) => tracing::warn!("background cleaner: {e}"),
            }
        }
    }
}

/// Handle of the background cleaner thread.
pub struct BackgroundCleaner {
    stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Drop for BackgroundCleaner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The verified DATA records of a segment (see `recovery::walk_segment`:
/// a damaged record does not hide the ones after it).
pub(crate) fn parse_segment(seg: &[u8], tag: u32) -> Vec<Found> {
    crate::recovery::walk_segment(seg, tag)
        .records
        .into_iter()
        .filter(|(_, h)| h.kind == RecordKind::Data)
        .map(|(at, header)| Found { at, header })
        .collect()
}
