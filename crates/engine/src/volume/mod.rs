//! The volume: block-granular reads and writes over a log of compressed
//! records, with a block map in memory, checkpoints and recovery.
//!
//! One file per stage (a request goes through them top to bottom):
//!
//! | room | holds |
//! |---|---|
//! | `options` | `CreateOptions`, `OpenOptions`, the defaults |
//! | `lifecycle` | create, open (recovery, then a new epoch), close, accessors |
//! | `prepare` | a write split into zero runs, dedup candidates (looked up and verified) and units compressed by the codec policy, outside every lock |
//! | `commit` | `write_at`: records appended and the map updated under the state lock, through `LiveMap::set` only |
//! | `read` | `read_at`, block status, the read and unit caches |
//! | `discard` | TRIM and WRITE_ZEROES |
//! | `durability` | flush, checkpoint, the EPOCH record, segment reclaim |
//! | `space` | every reserve and cost (named, from `cvol-format` constants) and the wait for room |
//! | `window` | a write's dedup candidates: the hot index, then the fingerprint tables the hook index points at |
//! | `hooksnap` | the hook index persisted: snapshots written, read back at open |
//! | `stats` | the counters not derived from the map, and `stat` |
//! | `jobs/` | background work sharing one `Worker` handle: cleaner, recompress, warmup, scrub |
//!
//! Concurrency: compression and decompression run on the caller's thread,
//! outside any lock, so concurrent requests use every core. The `state`
//! mutex covers the map and the log head for the short commit step (assign
//! seq, copy into the segment buffer, update the map). The lock order
//! (rmw -> cleaner -> flush -> state -> index) is in crate::locks, checked in
//! debug builds.
use crate::codec::Codec;
use crate::dedup;
use crate::error::VolError;
use crate::liveness::LiveMap;
use crate::locks::{Held, OrderedMutex, OrderedRwLock};
use crate::log::{Log, Placed, Shape};
use crate::policy::CodecPolicy;
use cvol_format::{MapEntry, BLOCK_SIZE_BYTES};
use cvol_storage::Storage;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, MutexGuard, RwLockReadGuard, RwLockWriteGuard};

mod commit;
mod dirwrite;
mod discard;
mod durability;
mod hooksnap;
mod jobs;
mod layered;
mod lifecycle;
pub mod metadev;
mod options;
mod physical;
mod prepare;
mod read;
mod sbcell;
mod space;
mod stats;
#[cfg(test)]
mod tests;
mod usage;
mod window;

use crate::dedup::Fingerprint;
pub use commit::Writer;
pub use jobs::checkpointer::Checkpointer;
pub use jobs::cleaner::CleanerConfig;
pub use jobs::recompress::RecompressReport;
pub use jobs::scrub::{
    pace_delay, ScrubFinding, ScrubOptions, ScrubProgress, ScrubReport, ScrubRunning, ScrubStatus,
};
pub use jobs::Worker;
pub use layered::{Keep, Layers};
pub use lifecycle::default_segment_size;
pub use options::{
    dedup_memory_default_bytes, map_cache_limit_bytes, read_cache_default_bytes, CreateOptions,
    OpenOptions, DEDUP_MEMORY_DEFAULT_BYTES, MAP_CACHE_DEFAULT_BYTES, READ_CACHE_DEFAULT_BYTES,
};
pub use physical::{resize_unsupported, ResizeError, SHRINK_FREE_MIN_SEGMENTS};
pub use read::Extent;
pub use usage::{RangeUsage, UsageBytes};

/// What `stat` asks the cache layer above a volume for (`cvol_cache`).
pub type CacheStatsHook = Box<dyn Fn() -> crate::stats::CacheStats + Send + Sync>;
/// The bytes of request payload the server in front of a volume holds.
pub type EdgeMemoryHook = Box<dyn Fn() -> u64 + Send + Sync>;

/// Handle of the background cleaner thread (stops when dropped).
pub type BackgroundCleaner = Worker;
/// Handle of the background recompression thread (stops when dropped).
pub type BackgroundRecompressor = Worker;
/// Handle of the dedup index warm-up thread (stops when dropped).
pub type IndexWarmup = Worker;

const BS: usize = BLOCK_SIZE_BYTES as usize;

/// What the state lock covers: the map and its books, the log head, and
/// the sync and checkpoint bookkeeping.
struct State {
    /// The block map and every table derived from it.
    live: LiveMap,
    log: Log,
    synced_seq: u64,
    /// The synced seq the newest SYNCED record in the log certifies.
    synced_marked: u64,
    /// Flush marks written by flushes (the parity picks the slot).
    flush_marks: u64,
    checkpoint_generation: u64,
    /// `log.appended_bytes` at the last checkpoint (for the checkpoint interval).
    appended_at_checkpoint: u64,
    /// `log.appended_bytes` at the snapshot of the last checkpoint that
    /// wrote the liveness tables (one that does not, `Checkpoint::Light`,
    /// leaves the open without them: a crash then rebuilds them).
    appended_at_tables: u64,
    /// Snapshot seq of the newest durable checkpoint: segments whose records
    /// are all at or below it, and hold no live data, may be reused.
    durable_snapshot_seq: u64,
    /// `live.changes()` when the last checkpoint was appended (close skips
    /// an unneeded checkpoint, so restarts of a full volume cost no space).
    changes_at_checkpoint: u64,
    /// Segments the cleaner is emptying: no new references into them.
    cleaning: HashSet<u64>,
    /// The cleaner marked map records of a victim to be written again: a
    /// checkpoint empties the victim (cleared when one takes its snapshot).
    map_records_moved: bool,
}

impl State {
    /// Sets one map entry through the only mutator of the map's books.
    fn set_entry(&mut self, lba: u64, e: MapEntry, fp: Fingerprint) {
        self.live.set(&self.log.segments, lba, e, fp);
    }

    /// Segment holding the byte at physical `offset`.
    fn segment_of(&self, offset: u64) -> u64 {
        (offset - self.log.data_offset) / self.log.segment_size
    }
}

/// The dedup fingerprint seed and index (volumes with dedup on, opened for
/// writing).
struct Dedup {
    seed: dedup::FpKey,
    /// Hints only, checked against the map at commit. Its own lock (level
    /// `Index`, after `state`), so probes never wait for the log's I/O.
    index: OrderedMutex<dedup::Index>,
}

pub struct Volume {
    storage: Arc<dyn Storage>,
    /// Replaced, under the state lock, only by a physical resize.
    sb: sbcell::SbCell,
    options: OpenOptions,
    /// Bytes of map pages kept in memory (`OpenOptions::map_cache_bytes`).
    map_cache_bytes: u64,
    policy: CodecPolicy,
    /// What recovery had to skip or rebuild at open (shown by repair).
    recovery_warnings: Vec<String>,
    /// What a salvage at open (repair) could not save.
    recovery_salvage: Option<crate::recovery::Salvage>,
    // The locks, in lock order (crate::locks). `dedup` holds the last one.
    /// Unaligned writes (read-modify-write) take it exclusively so that no
    /// other write interleaves with their read and commit.
    rmw: OrderedRwLock<()>,
    /// Serialises cleaning (background and foreground) and recompression.
    cleaner_lock: OrderedMutex<()>,
    /// Serialises checkpoints (held for a checkpoint's whole length).
    checkpoint_lock: OrderedMutex<()>,
    /// Serialises flushes and checkpoint commits; concurrent flushes batch.
    flush_lock: OrderedMutex<()>,
    state: OrderedMutex<State>,
    dedup: Option<Dedup>,
    /// Set by an I/O error on the store or a poisoned lock: writes and
    /// flushes fail until the volume is reopened.
    poisoned: AtomicBool,
    /// Client activity: load for the codec policy, when clients last
    /// issued a request, writers waiting for space.
    activity: jobs::Activity,
    caches: read::Caches,
    counters: stats::Counters,
    jobs: jobs::JobsState,
    /// The cache layer's counters (`cvol_cache`), when one is above.
    cache_stats: std::sync::OnceLock<CacheStatsHook>,
    /// What the server in front holds for its clients' requests (bytes),
    /// for `memory_bytes` (set once).
    edge_memory: std::sync::OnceLock<EdgeMemoryHook>,
    /// The logical size statistics report, when a pool above holds
    /// volumes (the sum of their sizes); None: the superblock's.
    reported_logical: std::sync::Mutex<Option<u64>>,
}

type StateGuard<'a> = Held<MutexGuard<'a, State>>;

impl Volume {
    /// The state lock. A lock poisoned by a panic poisons the volume.
    /// Taking it is when map pages beyond the cache are dropped: no caller
    /// relies on a page it faulted in under an earlier hold.
    fn lock_state(&self) -> Result<StateGuard<'_>, VolError> {
        let mut st = self.note_poison(self.state.lock())?;
        if st.live.map().cache_bytes() > self.map_cache_bytes {
            // Down to 15/16 of the cache, so that eviction runs in batches.
            st.live
                .evict(self.map_cache_bytes - self.map_cache_bytes / 16);
        }
        Ok(st)
    }

    /// Reads the map pages of LBAs [first, end) that are not in memory
    /// without holding the state lock, so that a miss (a read and a
    /// decode) does not stop other requests; the `fault` under the lock
    /// that follows then finds them (or reads what it still misses, e.g. a
    /// record still only in the open segment's buffer).
    fn prefault(&self, first: u64, end: u64) -> Result<(), VolError> {
        self.prefault_ranges(&[(first, end)])
    }

    /// `prefault` of several ranges, with one hold of the lock to find
    /// what is missing.
    fn prefault_ranges(&self, ranges: &[(u64, u64)]) -> Result<(), VolError> {
        self.lock_state_prefaulted(ranges).map(drop)
    }

    /// The state lock, held after the map pages of `ranges` that were not
    /// in memory were read without it (`prefault`). When every page is in
    /// memory, the common case of a read, that is one hold of the lock: the
    /// caller's lookups run in the hold that found nothing missing. The
    /// caller still `fault`s its ranges (a page dropped, or rewritten, while
    /// the lock was released is read under it).
    fn lock_state_prefaulted(&self, ranges: &[(u64, u64)]) -> Result<StateGuard<'_>, VolError> {
        self.lock_prefaulted_by(ranges, || self.lock_state())
    }

    /// `lock_state_prefaulted`, the lock taken by `lock` (a writer's takes
    /// it with room for its records, `lock_with_space`): when the pages are
    /// in memory, the hold that found none missing is the writer's.
    fn lock_prefaulted_by<'a>(
        &'a self,
        ranges: &[(u64, u64)],
        lock: impl Fn() -> Result<StateGuard<'a>, VolError>,
    ) -> Result<StateGuard<'a>, VolError> {
        let mut st = lock()?;
        let mut missing = Vec::new();
        for &(a, b) in ranges {
            let pages =
                self.with_log_pages(&mut st, |live, src| live.map_mut().missing_pages(a, b, src));
            missing.extend(pages.map_err(|e| VolError::Corrupt {
                lba: a,
                detail: e.to_string(),
            })?);
        }
        if missing.is_empty() {
            return Ok(st);
        }
        drop(st);
        let src = crate::logread::LogPages {
            storage: &*self.storage,
            sb: &self.sb,
            buffered: None,
        };
        let read: Vec<_> = missing
            .into_iter()
            .filter_map(|(p, r)| {
                let entries = crate::map::PageSource::load(&src, p as u64, &r).ok()?;
                let page = crate::map::Page::from_entries(p as u64, &entries)?;
                (page.used() > 0).then_some((p, page, r))
            })
            .collect();
        let mut st = lock()?;
        for (p, page, r) in read {
            st.live.map_mut().install_read(p, page, &r);
        }
        Ok(st)
    }

    /// Brings the map pages of LBAs [first, end) into memory, for this
    /// hold of the state lock (a miss reads the page's record).
    fn fault(&self, st: &mut State, first: u64, end: u64) -> Result<(), VolError> {
        self.with_log_pages(st, |live, src| live.fault_in(first, end, src))
            .map_err(|e| VolError::Corrupt {
                lba: first,
                detail: e.to_string(),
            })
    }

    /// `f` with the map and the log's records as its page source: the
    /// open segment's buffer while records are still there, else the
    /// store.
    fn with_log_pages<T>(
        &self,
        st: &mut State,
        f: impl FnOnce(&mut LiveMap, &dyn crate::map::PageSource) -> T,
    ) -> T {
        let State { live, log, .. } = st;
        let buffered = |offset: u64, len: usize| log.buffered(offset, len).map(<[u8]>::to_vec);
        let src = crate::logread::LogPages {
            storage: &*self.storage,
            sb: &self.sb,
            buffered: Some(&buffered),
        };
        f(live, &src)
    }

    /// Decodes the directory block of map page `p` if open left it packed
    /// (a list kept apart is read then).
    fn unpack_page(&self, st: &mut State, p: usize) -> Result<(), VolError> {
        self.with_log_pages(st, |live, src| live.map_mut().unpack_page(p, src))
            .map_err(|e| VolError::Corrupt {
                lba: (p * crate::map::PAGE_BLOCKS) as u64,
                detail: e.to_string(),
            })
    }

    fn lock_checkpoint(&self) -> Result<Held<MutexGuard<'_, ()>>, VolError> {
        self.note_poison(self.checkpoint_lock.lock())
    }

    fn lock_flush(&self) -> Result<Held<MutexGuard<'_, ()>>, VolError> {
        self.note_poison(self.flush_lock.lock())
    }

    fn lock_cleaner(&self) -> Result<Held<MutexGuard<'_, ()>>, VolError> {
        self.note_poison(self.cleaner_lock.lock())
    }

    fn rmw_shared(&self) -> Result<Held<RwLockReadGuard<'_, ()>>, VolError> {
        self.note_poison(self.rmw.read())
    }

    fn rmw_exclusive(&self) -> Result<Held<RwLockWriteGuard<'_, ()>>, VolError> {
        self.note_poison(self.rmw.write())
    }

    /// The dedup index, if this volume has one.
    fn lock_index(&self) -> Result<Option<Held<MutexGuard<'_, dedup::Index>>>, VolError> {
        match &self.dedup {
            Some(d) => self.note_poison(d.index.lock()).map(Some),
            None => Ok(None),
        }
    }

    /// Poisons the volume when `r` is a poisoned lock.
    fn note_poison<T>(&self, r: Result<T, VolError>) -> Result<T, VolError> {
        if let Err(VolError::Poisoned) = &r {
            if !self.poisoned.swap(true, Ordering::SeqCst) {
                tracing::error!(
                    "a panic inside the engine poisoned a lock; refusing further requests \
                     until reopened"
                );
            }
        }
        r
    }

    /// Appends a record (its payload crc computed here); an I/O error
    /// poisons the volume.
    fn append(&self, st: &mut State, shape: Shape, payload: &[u8]) -> Result<Placed, VolError> {
        self.append_with_crc(st, shape, payload, self.payload_crc(payload))
    }

    /// Appends a record whose payload crc was computed earlier (outside
    /// the lock).
    fn append_with_crc(
        &self,
        st: &mut State,
        shape: Shape,
        payload: &[u8],
        payload_crc: u32,
    ) -> Result<Placed, VolError> {
        let before = st.log.head_segments();
        let p = self.guard(st.log.append(&*self.storage, shape, payload, payload_crc))?;
        // A segment the head opened holds no live record (it was free).
        if cfg!(debug_assertions) && st.log.head_segments() != before {
            for s in st.log.head_segments().into_iter().flatten() {
                if before.contains(&Some(s)) {
                    continue;
                }
                let live = st.live.usage().live_bytes(s);
                assert_eq!(
                    live, 0,
                    "the log head opened segment {s}, which holds {live} live bytes"
                );
            }
        }
        Ok(p)
    }

    /// Poisons the volume on an I/O error.
    fn guard<T>(&self, r: Result<T, VolError>) -> Result<T, VolError> {
        if let Err(VolError::Io(e)) = &r {
            if !self.poisoned.swap(true, Ordering::SeqCst) {
                tracing::error!(
                    "backing store I/O error, refusing further writes until reopened: {e}"
                );
            }
        }
        r
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), VolError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.sb.logical_size_bytes => Ok(()),
            _ => Err(VolError::OutOfRange),
        }
    }

    fn check_writable(&self) -> Result<(), VolError> {
        if self.options.read_only {
            Err(VolError::ReadOnly)
        } else if self.poisoned.load(Ordering::SeqCst) {
            Err(VolError::Poisoned)
        } else {
            Ok(())
        }
    }

    /// Recomputes reference counts, live bytes per segment, stored bytes
    /// and block counters from the map and compares them with the running
    /// tables.
    pub fn verify_refcounts(&self) -> Result<(), VolError> {
        let mut st = self.lock_state()?;
        // The rebuild reads every page: packed directory blocks first.
        self.with_log_pages(&mut st, |live, src| live.map_mut().unpack_all(src))?;
        let buffered = |offset: u64, len: usize| st.log.buffered(offset, len).map(<[u8]>::to_vec);
        let src = crate::logread::LogPages {
            storage: &*self.storage,
            sb: &self.sb,
            buffered: Some(&buffered),
        };
        Ok(st.live.verify(&self.sb, &src)?)
    }

    /// The fixed codec, or the strong (idle-time) codec of the auto policy.
    pub fn codec(&self) -> Codec {
        self.policy.codec()
    }
}
