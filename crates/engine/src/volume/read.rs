//! The read path: the map is looked up under the state lock, one hold per
//! request when its map pages are in memory (records still only in the
//! open segment's buffer are copied), then adjacent records are
//! read from the store in one `pread`, verified (record crc, the map's
//! identity check) and decompressed outside the lock, each unit once per
//! request. Decompressed blocks and units go to small caches. Also block
//! status (holes versus data).
use super::stats::{Counters, ElasticCounters};
use super::{Volume, BS};
use crate::error::VolError;
use crate::records::{decode_block_payload, decode_block_record, open_in_place, DecodedUnit};
use cvol_format::{EntryState, MapEntry, RecordHeader, BLOCK_SIZE_BYTES};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const PAGE: usize = crate::map::PAGE_BLOCKS;

/// Storage reads of adjacent records are merged up to this size.
pub(in crate::volume) const READ_MERGE_MAX_BYTES: u64 = 1 << 20;
/// Padding a merged read reads along rather than split in two reads.
const READ_MERGE_GAP_BYTES: u64 = 4096;
/// Extra attempts at a read whose record failed verification.
const READ_RETRIES: u32 = 2;
/// Reads of at most this many adjacent records fill the read cache; longer
/// (sequential) runs pass it by, so a scan does not flush hot blocks.
const READ_CACHE_RUN_MAX: usize = 4;
/// Most extents one block-status call returns.
const EXTENTS_MAX: usize = 1024;
/// Decompressed units kept for reads of their other blocks: about this
/// many (at most 64 KiB each)...
const UNIT_CACHE_UNITS: usize = 128;
/// ...and at most this many bytes of them.
const UNIT_CACHE_BYTES: u64 = 8 << 20;
/// What a cache entry costs beyond its bytes (key, `Arc` counts, the
/// cache's own slot), for `memory_bytes`.
const CACHE_ENTRY_OVERHEAD_BYTES: u64 = 64;

/// One run of block status: `length` bytes that are all zero-reading holes or all data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u64,
    pub zero: bool,
}

/// Decompressed blocks by (record offset, record crc).
type ReadCache = quick_cache::sync::Cache<(u64, u32), Arc<[u8]>>;
/// Decompressed multi-block units by (record offset, record length),
/// weighed by their bytes.
type UnitCache = quick_cache::sync::Cache<(u64, u32), Arc<DecodedUnit>, UnitBytes>;

/// A unit's weight in the unit cache: its decompressed bytes.
#[derive(Clone)]
pub(in crate::volume) struct UnitBytes;

impl quick_cache::Weighter<(u64, u32), Arc<DecodedUnit>> for UnitBytes {
    fn weight(&self, _: &(u64, u32), u: &Arc<DecodedUnit>) -> u64 {
        u.data.len() as u64 + CACHE_ENTRY_OVERHEAD_BYTES
    }
}

/// The caches of decompressed data.
pub(in crate::volume) struct Caches {
    /// Single blocks (`--read-cache`; none when 0).
    block: Option<ReadCache>,
    pub(in crate::volume) unit: UnitCache,
}

impl Caches {
    pub(in crate::volume) fn new(read_cache_bytes: u64) -> Caches {
        let blocks = read_cache_bytes / BLOCK_SIZE_BYTES;
        Caches {
            block: (blocks > 0).then(|| quick_cache::sync::Cache::new(blocks as usize)),
            unit: quick_cache::sync::Cache::with_weighter(
                UNIT_CACHE_UNITS,
                UNIT_CACHE_BYTES,
                UnitBytes,
            ),
        }
    }

    /// Bytes of the decompressed blocks cached (`--read-cache`).
    pub(in crate::volume) fn block_bytes(&self) -> u64 {
        self.block.as_ref().map_or(0, |c| {
            c.len() as u64 * (BLOCK_SIZE_BYTES + CACHE_ENTRY_OVERHEAD_BYTES)
        })
    }

    /// Bytes of the decompressed units cached.
    pub(in crate::volume) fn unit_bytes(&self) -> u64 {
        self.unit.weight()
    }

    /// A cached block of the record at `offset` with crc `crc` (a hit is counted).
    pub(in crate::volume) fn cached_block(
        &self,
        offset: u64,
        crc: u32,
        counters: &Counters,
    ) -> Option<Arc<[u8]>> {
        let b = self.block.as_ref()?.get(&(offset, crc))?;
        counters.read_cache_hits.fetch_add(1, Ordering::Relaxed);
        Some(b)
    }

    /// Caches a block read from the store (a miss is counted).
    pub(in crate::volume) fn insert_block(
        &self,
        offset: u64,
        crc: u32,
        b: &Arc<[u8]>,
        counters: &Counters,
    ) {
        if let Some(c) = &self.block {
            counters.read_cache_misses.fetch_add(1, Ordering::Relaxed);
            c.insert((offset, crc), b.clone());
        }
    }
}

/// What a read found under the state lock: each block's map entry, and a
/// copy of its record when that is still only in the open segment's buffer.
struct Snapshot {
    entries: Vec<MapEntry>,
    buffered: Vec<Option<Vec<u8>>>,
}

/// A read in progress: where it starts, what it found, whether a client
/// issued it (only client reads count in the read statistics).
struct Reading<'a> {
    lba: u64,
    snap: Snapshot,
    out: &'a mut [u8],
    client: bool,
}

impl Reading<'_> {
    fn block(&mut self, k: usize) -> &mut [u8] {
        &mut self.out[k * BS..(k + 1) * BS]
    }

    fn corrupt(&self, k: usize, detail: impl std::fmt::Display) -> VolError {
        VolError::Corrupt {
            lba: self.lba + k as u64,
            detail: detail.to_string(),
        }
    }

    fn data(&self, k: usize) -> Option<(u64, u32, bool)> {
        match self.snap.entries[k].state_valid() {
            EntryState::Data {
                offset, len, unit, ..
            } => Some((offset, len, unit)),
            _ => None,
        }
    }
}

impl Volume {
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), VolError> {
        self.read_layered(offset, buf, &[])
    }

    /// `read_at` of a layered view (a pool's snapshot or clone): a block
    /// whose own entry is unmapped reads as the same block of the first
    /// layer in `below` that maps it (each the LBA of the block at
    /// `offset`), resolved under one hold of the state lock.
    pub fn read_layered(&self, offset: u64, buf: &mut [u8], below: &[u64]) -> Result<(), VolError> {
        self.check_range(offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        self.activity.load.note(buf.len() as u64);
        let _inflight = self.activity.load.enter();
        self.counters
            .elastic
            .client_reads
            .fetch_add(1, Ordering::Relaxed);
        let first = offset / BLOCK_SIZE_BYTES;
        if offset.is_multiple_of(BLOCK_SIZE_BYTES) && buf.len().is_multiple_of(BS) {
            return self.read_blocks(first, buf, below);
        }
        let last = (offset + buf.len() as u64 - 1) / BLOCK_SIZE_BYTES;
        let mut tmp = vec![0u8; ((last - first + 1) as usize) * BS];
        self.read_blocks(first, &mut tmp, below)?;
        let head = (offset % BLOCK_SIZE_BYTES) as usize;
        buf.copy_from_slice(&tmp[head..head + buf.len()]);
        Ok(())
    }

    /// Reads whole blocks. A record that fails verification is looked up
    /// and read again: the cleaner may have moved it, and its old segment been
    /// reused, between the map lookup and the read. Only a repeated failure is
    /// reported (and counted) as corruption.
    pub(in crate::volume) fn read_blocks(
        &self,
        lba: u64,
        out: &mut [u8],
        below: &[u64],
    ) -> Result<(), VolError> {
        self.activity.note_client_io();
        let mut attempt = 0;
        loop {
            match self.read_blocks_layered(lba, out, true, below) {
                Err(VolError::Corrupt { .. }) if attempt < READ_RETRIES => attempt += 1,
                Err(VolError::Corrupt { lba, detail }) => {
                    self.counters.corrupt_reads.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(lba, "corrupt block: {detail}");
                    return Err(VolError::Corrupt { lba, detail });
                }
                r => return r,
            }
        }
    }

    /// Reads whole blocks once; `client` reads count in the read statistics.
    pub(in crate::volume) fn read_blocks_once(
        &self,
        lba: u64,
        out: &mut [u8],
        client: bool,
    ) -> Result<(), VolError> {
        self.read_blocks_layered(lba, out, client, &[])
    }

    fn read_blocks_layered(
        &self,
        lba: u64,
        out: &mut [u8],
        client: bool,
        below: &[u64],
    ) -> Result<(), VolError> {
        assert!(out.len().is_multiple_of(BS));
        let n = out.len() / BS;
        let snap = self.read_snapshot(lba, n, below)?;
        self.count_read(client, |c| &c.bytes_read, out.len() as u64);
        let mut r = Reading {
            lba,
            snap,
            out,
            client,
        };
        let mut i = 0;
        while i < n {
            let next = self.read_from(&mut r, i)?;
            assert!(
                next > i && next <= n,
                "a read step serves at least one block"
            );
            i = next;
        }
        Ok(())
    }

    /// The map entries of `n` blocks from `lba` (through the layers
    /// `below`, in ref form when found there), and copies of the records
    /// still only in the open segment's buffer: one short hold of the
    /// lock when the map pages are in memory (`lock_state_prefaulted`).
    fn read_snapshot(&self, lba: u64, n: usize, below: &[u64]) -> Result<Snapshot, VolError> {
        let n64 = n as u64;
        let mut st = if below.is_empty() {
            self.lock_state_prefaulted(&[(lba, lba + n64)])?
        } else {
            let ranges: Vec<_> = (std::iter::once(lba).chain(below.iter().copied()))
                .map(|b| (b, b + n64))
                .collect();
            self.lock_state_prefaulted(&ranges)?
        };
        self.fault(&mut st, lba, lba + n as u64)?;
        for &b in below {
            self.fault(&mut st, b, b + n as u64)?;
        }
        let mut snap = Snapshot {
            entries: Vec::with_capacity(n),
            buffered: Vec::with_capacity(n),
        };
        for i in 0..n as u64 {
            // An entry found in a layer below is read as a reference: its
            // record names another LBA (the crc still identifies it).
            let e = match super::layered::resolve(&st, lba + i, below, i) {
                (e, at) if at != lba + i && matches!(e.state_valid(), EntryState::Data { .. }) => {
                    e.as_ref_entry()
                }
                (e, _) => e,
            };
            let b = match e.state_valid() {
                EntryState::Data { offset, len, .. } => {
                    st.log.buffered(offset, len as usize).map(<[u8]>::to_vec)
                }
                _ => None,
            };
            snap.entries.push(e);
            snap.buffered.push(b);
        }
        Ok(snap)
    }

    fn count_read(&self, client: bool, pick: fn(&ElasticCounters) -> &AtomicU64, n: u64) {
        if client {
            pick(&self.counters.elastic).fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Serves block `i` of the read, and the following blocks that come
    /// from the same place (a cached unit, one merged store read). Returns
    /// the next block to serve.
    fn read_from(&self, r: &mut Reading<'_>, i: usize) -> Result<usize, VolError> {
        if r.snap.entries[i].state_valid() == EntryState::Lost {
            return Err(r.corrupt(
                i,
                "lost: damage destroyed this block's newest version (repair could not \
                 salvage it); it reads as an error until written again",
            ));
        }
        let Some((offset, len, unit)) = r.data(i) else {
            r.block(i).fill(0);
            return Ok(i + 1);
        };
        if let Some(rec) = r.snap.buffered[i].take() {
            let (l, e) = (r.lba + i as u64, r.snap.entries[i]);
            self.decode_block(l, e, &rec, r.block(i))?;
            return Ok(i + 1);
        }
        if !unit {
            if let Some(b) = self
                .caches
                .cached_block(offset, r.snap.entries[i].crc, &self.counters)
            {
                r.block(i).copy_from_slice(&b);
                return Ok(i + 1);
            }
        } else if let Some(u) = self.unit_cached(offset, len, r.lba + i as u64, r.snap.entries[i]) {
            self.count_read(r.client, |c| &c.unit_cache_hits, 1);
            // This block and the following ones of the same unit.
            let mut j = i;
            while j < r.snap.entries.len()
                && r.snap.buffered[j].is_none()
                && r.snap.entries[j].same_location(&r.snap.entries[i])
            {
                let (l, e) = (r.lba + j as u64, r.snap.entries[j]);
                u.copy_block(l, e, r.block(j))
                    .map_err(|d| r.corrupt(j, d))?;
                j += 1;
            }
            return Ok(j);
        }
        self.read_run(r, i)
    }

    /// The cached unit at (`offset`, `len`) if it is the record `e` (block
    /// `lba`) points at. The cache is keyed by place: once a segment is
    /// reused, another record of the same length may sit at the same
    /// place (the cleaner moving one unit round a nearly full volume puts
    /// it back where it was, with a new seq); such a stale entry is
    /// dropped, and the caller reads the store. Found by the cache
    /// simulation (`tests/cache_sim.rs`): reads failed as corrupt.
    pub(in crate::volume) fn unit_cached(
        &self,
        offset: u64,
        len: u32,
        lba: u64,
        e: MapEntry,
    ) -> Option<Arc<DecodedUnit>> {
        let u = self.caches.unit.get(&(offset, len))?;
        if u.serves(lba, e) {
            return Some(u);
        }
        self.caches.unit.remove(&(offset, len));
        None
    }

    /// Do these two volume offsets lie in one segment?
    fn same_segment(&self, a: u64, b: u64) -> bool {
        matches!((self.sb.locate(a), self.sb.locate(b)), (Some((x, _)), Some((y, _))) if x == y)
    }

    /// Reads the records of blocks `i..` that lie next to each other on the
    /// store (and further blocks of the same unit) in one read, and decodes
    /// them. Returns the next block to serve.
    fn read_run(&self, r: &mut Reading<'_>, i: usize) -> Result<usize, VolError> {
        let (offset, len, _) = r.data(i).expect("a run starts at data");
        let mut j = i + 1;
        let (mut end, mut last) = (offset + u64::from(len), offset);
        while j < r.snap.entries.len()
            && r.snap.buffered[j].is_none()
            && end - offset < READ_MERGE_MAX_BYTES
        {
            match r.data(j) {
                Some((o, _, _)) if o == last => {}
                // Next to the run, or after padding (a flush's, or page
                // packing's before a record that did not fit its page) in
                // the same segment: one read, the padding read along.
                Some((o, l, _))
                    if o >= end
                        && o - end < READ_MERGE_GAP_BYTES
                        && self.same_segment(end - 1, o) =>
                {
                    last = o;
                    end = o + u64::from(l);
                }
                _ => break,
            }
            j += 1;
        }
        let mut run = vec![0u8; (end - offset) as usize];
        self.storage
            .read_at(offset, &mut run)
            .map_err(VolError::Io)?;
        if r.client {
            let pages = (end - 1) / BLOCK_SIZE_BYTES - offset / BLOCK_SIZE_BYTES + 1;
            self.counters
                .elastic
                .store_pages_read
                .fetch_add(pages, Ordering::Relaxed);
        }
        let fill_cache = j - i <= READ_CACHE_RUN_MAX;
        let mut current: Option<(u64, Arc<DecodedUnit>)> = None;
        // Each record of the run is verified and opened once, in the run's
        // own buffer (an encrypted volume's records decrypted where they
        // lie); blocks after the first of a record reuse it.
        let mut opened: Option<(u64, RecordHeader, std::ops::Range<usize>)> = None;
        for k in i..j {
            let (o, l, unit) = r.data(k).expect("run holds data");
            if opened.as_ref().is_none_or(|(oo, _, _)| *oo != o) {
                let at = (o - offset) as usize;
                let (h, p) = open_in_place(self.sb.sealer(), &mut run[at..at + l as usize])
                    .map_err(|d| r.corrupt(k, d))?;
                opened = Some((o, h, at + p.start..at + p.end));
            }
            let (_, h, p) = opened.as_ref().expect("opened above");
            let payload = &run[p.clone()];
            if unit {
                self.decode_unit_block(r, k, h, payload, &mut current)?;
            } else {
                self.decode_single(r, k, h, payload, fill_cache)?;
            }
        }
        if self.caches.block.is_some() {
            self.counters
                .read_cache_misses
                .fetch_add((j - i) as u64, Ordering::Relaxed);
        }
        Ok(j)
    }

    /// Decodes block `k`, from the opened record `h` (its content
    /// `payload`), into the read.
    fn decode_single(
        &self,
        r: &mut Reading<'_>,
        k: usize,
        h: &RecordHeader,
        payload: &[u8],
        fill_cache: bool,
    ) -> Result<(), VolError> {
        let (l, e) = (r.lba + k as u64, r.snap.entries[k]);
        decode_block_payload(h, l, e, payload, r.block(k)).map_err(|d| r.corrupt(k, d))?;
        self.count_read(r.client, |c| &c.bytes_decoded, BS as u64);
        if let (Some(c), true) = (&self.caches.block, fill_cache) {
            let (EntryState::Data { offset, .. }, crc) = (e.state_valid(), e.crc) else {
                unreachable!("decoded data")
            };
            c.insert((offset, crc), Arc::from(&*r.block(k)));
        }
        Ok(())
    }

    /// Copies block `k` out of the unit `h` (opened; its content
    /// `payload`), decoding it once per run (`current`) and caching it.
    fn decode_unit_block(
        &self,
        r: &mut Reading<'_>,
        k: usize,
        h: &RecordHeader,
        payload: &[u8],
        current: &mut Option<(u64, Arc<DecodedUnit>)>,
    ) -> Result<(), VolError> {
        let (o, l, _) = r.data(k).expect("unit data");
        if current.as_ref().is_none_or(|(co, _)| *co != o) {
            let u = Arc::new(DecodedUnit::from_payload(*h, payload).map_err(|d| r.corrupt(k, d))?);
            self.count_read(r.client, |c| &c.unit_cache_misses, 1);
            self.count_read(r.client, |c| &c.bytes_decoded, u.data.len() as u64);
            self.caches.unit.insert((o, l), u.clone());
            *current = Some((o, u));
        }
        let (_, u) = current.as_ref().expect("decoded above");
        let (lba, e) = (r.lba + k as u64, r.snap.entries[k]);
        u.copy_block(lba, e, r.block(k))
            .map_err(|d| r.corrupt(k, d))
    }

    fn decode_block(
        &self,
        lba: u64,
        e: MapEntry,
        rec: &[u8],
        out: &mut [u8],
    ) -> Result<(), VolError> {
        decode_block_record(self.sb.sealer(), lba, e, rec, out).map_err(|e| VolError::Corrupt {
            lba,
            detail: e.to_string(),
        })
    }

    /// Which of the `n` blocks from `lba` hold something written (data, zeros
    /// or a lost block) rather than nothing (never written, or trimmed): the
    /// cache layer's presence test (`crate::cache`), where an unmapped
    /// block is a miss, not zeros.
    pub fn mapped_blocks(&self, lba: u64, n: usize) -> Result<Vec<bool>, VolError> {
        let len = (n as u64)
            .checked_mul(BLOCK_SIZE_BYTES)
            .ok_or(VolError::OutOfRange)?;
        self.check_range(
            lba.checked_mul(BLOCK_SIZE_BYTES)
                .ok_or(VolError::OutOfRange)?,
            len,
        )?;
        let mut st = self.lock_state()?;
        let end = lba + n as u64;
        let mut out = vec![false; n];
        let mut pos = lba;
        while pos < end {
            let page_end = ((pos / PAGE as u64) + 1) * PAGE as u64;
            let stop = page_end.min(end);
            match st.live.map().next_allocated_page_lba(pos) {
                Some(p) if p > pos => pos = p.min(end),
                None => break,
                Some(_) => {
                    self.fault(&mut st, pos, stop)?;
                    for b in pos..stop {
                        out[(b - lba) as usize] =
                            st.live.get(b).state_valid() != EntryState::Unmapped;
                    }
                    pos = stop;
                }
            }
        }
        Ok(out)
    }

    /// Allocation status from `offset`: zero-reading holes versus data.
    pub fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, VolError> {
        self.check_range(offset, len)?;
        let end = offset + len;
        let mut st = self.lock_state()?;
        let mut out: Vec<Extent> = Vec::new();
        let mut pos = offset;
        while pos < end && out.len() < EXTENTS_MAX {
            let lba = pos / BLOCK_SIZE_BYTES;
            let (zero, next) = match st.live.map().next_allocated_page_lba(lba) {
                Some(p) if p > lba => (true, p * BLOCK_SIZE_BYTES),
                None => (true, end),
                Some(_) => {
                    if lba.is_multiple_of(crate::map::PAGE_BLOCKS as u64) || pos == offset {
                        self.fault(&mut st, lba, lba + 1)?;
                    }
                    let z = !matches!(
                        st.live.get(lba).state_valid(),
                        EntryState::Data { .. } | EntryState::Lost
                    );
                    (z, (lba + 1) * BLOCK_SIZE_BYTES)
                }
            };
            let next = next.min(end);
            match out.last_mut() {
                Some(x) if x.zero == zero => x.length += next - pos,
                _ => out.push(Extent {
                    length: next - pos,
                    zero,
                }),
            }
            pos = next;
        }
        Ok(out)
    }
}
