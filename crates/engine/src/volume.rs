//! The volume: block-granular reads and writes over a log of compressed
//! records, with a block map in memory, checkpoints and recovery.
//!
//! Concurrency: compression and decompression run on the caller's thread,
//! outside any lock, so concurrent requests use every core. One `state` mutex
//! covers the map and the log head for the short commit step (assign seq,
//! copy into the segment buffer, update the map). `flush_lock` serialises
//! flushes and checkpoints; concurrent flushes batch into one sync.
//! Unaligned writes (read-modify-write) take `rmw` exclusively so that no
//! other write interleaves with their read and commit.
use crate::codec::{self, Codec};
use crate::error::VolError;
use crate::log::{Log, Shape};
use crate::map::BlockMap;
use crate::policy::{self, CodecPolicy, ElasticConfig, LoadMonitor};
use crate::recovery;
use crate::segments::SegmentTable;
use crate::stats::{CodecBlocks, MapCounters, VolumeStats};
use cvol_format::checkpoint::{push_run, ChunkRef, CommitPayload};
use cvol_format::record::{RecordHeader, RecordKind, RECORD_HEADER_BYTES, RECORD_MAX_BYTES};
use cvol_format::{
    align_up, CheckpointPointer, CodecTag, EntryState, MapEntry, Superblock, BLOCK_SIZE_BYTES,
};
use cvol_storage::Storage;
use std::borrow::Cow;

mod cleaner;
mod recompress;
mod refs;
mod scrub;
mod warmup;
use crate::dedup::{self, DedupIndex, Fingerprint, SharedTable};
pub(crate) use cleaner::parse_segment;
use cleaner::CleanerStats;
pub use cleaner::{BackgroundCleaner, CleanerConfig};
pub use recompress::{BackgroundRecompressor, RecompressReport};
pub(crate) use refs::rebuild as rebuild_liveness;
pub use scrub::{
    pace_delay, ScrubFinding, ScrubOptions, ScrubProgress, ScrubReport, ScrubRunning, ScrubStatus,
};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
pub use warmup::IndexWarmup;

const BS: usize = BLOCK_SIZE_BYTES as usize;
/// Raw bytes of map entries per checkpoint chunk record.
const CHUNK_RAW_MAX_BYTES: usize = 256 << 10;
/// Storage reads of adjacent records are merged up to this size.
const READ_MERGE_MAX_BYTES: u64 = 1 << 20;
const PAGE_BLOCKS: u64 = crate::map::PAGE_BLOCKS as u64;
/// Largest DATA record the volume writes (a full 64 KiB unit stored raw).
const UNIT_RECORD_MAX_BYTES: u64 = 16 * BLOCK_SIZE_BYTES + RECORD_HEADER_BYTES as u64;
/// Most clean-and-retry turns of a write short of space.
const SPACE_TURNS_MAX: u32 = 16;
/// Extra attempts at a read whose record failed verification.
const READ_RETRIES: u32 = 2;
pub const DEDUP_MEMORY_DEFAULT_BYTES: u64 = 128 << 20;
pub const READ_CACHE_DEFAULT_BYTES: u64 = 32 << 20;
/// Reads of at most this many adjacent records fill the read cache; longer
/// (sequential) runs pass it by, so a scan does not flush hot blocks.
const READ_CACHE_RUN_MAX: usize = 4;
/// Most extents one block-status call returns.
const EXTENTS_MAX: usize = 1024;
/// Decompressed units kept for reads of their other blocks (at most
/// 64 KiB each).
const UNIT_CACHE_UNITS: usize = 128;

#[derive(Debug, Clone)]
pub struct CreateOptions {
    pub logical_size_bytes: u64,
    pub physical_size_bytes: u64,
    /// A fixed codec, or `auto` (elastic, with a strong codec for idle time).
    pub codec: CodecPolicy,
    /// 0 picks a default from the physical size.
    pub segment_size_bytes: u64,
    /// Inline deduplication of 4 KiB blocks.
    pub dedup: bool,
}

#[derive(Debug, Clone)]
pub struct OpenOptions {
    pub read_only: bool,
    /// Every write is durable before it returns.
    pub sync_writes: bool,
    /// A flush also checkpoints once this many log bytes were written since the last one.
    pub checkpoint_interval_bytes: u64,
    pub cleaner: CleanerConfig,
    /// Memory for the dedup fingerprint index (volumes with dedup on).
    pub dedup_memory_bytes: u64,
    /// Memory for the cache of decompressed blocks (0: none).
    pub read_cache_bytes: u64,
    /// Merged compression units, load thresholds, background recompression.
    pub elastic: ElasticConfig,
    /// When no checkpoint is usable, rebuild the map from every record the
    /// log still holds (`cvol check --repair`) instead of refusing to open.
    pub rebuild_from_log: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            read_only: false,
            sync_writes: false,
            checkpoint_interval_bytes: 256 << 20,
            cleaner: CleanerConfig::default(),
            dedup_memory_bytes: DEDUP_MEMORY_DEFAULT_BYTES,
            read_cache_bytes: READ_CACHE_DEFAULT_BYTES,
            elastic: ElasticConfig::default(),
            rebuild_from_log: false,
        }
    }
}

/// One run of block status: `length` bytes that are all zero-reading holes or all data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u64,
    pub zero: bool,
}

struct State {
    map: BlockMap,
    log: Log,
    counters: MapCounters,
    synced_seq: u64,
    /// The synced seq the newest SYNCED record in the log certifies.
    synced_marked: u64,
    checkpoint_generation: u64,
    /// `log.appended_bytes` at the last checkpoint (for the checkpoint interval).
    appended_at_checkpoint: u64,
    /// Snapshot seq of the newest durable checkpoint: segments whose records
    /// are all at or below it, and hold no live data, may be reused.
    durable_snapshot_seq: u64,
    /// Map updates since the last checkpoint was appended (close skips an
    /// unneeded checkpoint, so restarts of a full volume cost no space).
    map_changes_since_checkpoint: u64,
    /// Records with dedup references.
    shared: SharedTable,
    /// Segments the cleaner is emptying: no new references into them.
    cleaning: HashSet<u64>,
}

pub struct Volume {
    storage: Arc<dyn Storage>,
    sb: Superblock,
    policy: CodecPolicy,
    /// I/O intensity for the auto policy.
    load: LoadMonitor,
    /// Decompressed multi-block units by (record offset, record length).
    unit_cache: UnitCache,
    elastic_stats: ElasticStats,
    /// Next window the background recompressor scans.
    recompress_cursor: AtomicU64,
    /// What recovery had to skip or rebuild at open (shown by repair).
    recovery_warnings: Vec<String>,
    /// What a salvage at open (repair) could not save.
    recovery_salvage: Option<recovery::Salvage>,
    options: OpenOptions,
    state: Mutex<State>,
    flush_lock: Mutex<()>,
    rmw: RwLock<()>,
    poisoned: AtomicBool,
    client_bytes_written: AtomicU64,
    corrupt_reads: AtomicU64,
    /// Serialises cleaning (background and foreground).
    cleaner_lock: Mutex<()>,
    cleaner_stats: CleanerStats,
    /// The running scrub, its last report and counters.
    scrub: scrub::ScrubState,
    /// Milliseconds since `opened` of the last client request (cleaner yields).
    last_client_io_ms: AtomicU64,
    opened: std::time::Instant,
    /// Writers waiting for the cleaner to make room (the cleaner stops yielding).
    space_waiters: std::sync::atomic::AtomicUsize,
    /// Fingerprint seed (volumes with dedup on).
    dedup_seed: Option<u64>,
    /// Fingerprint index: hints only, checked against the map at commit.
    /// Its own lock, so probes never wait for the log's I/O. Lock order:
    /// state, then index.
    index: Option<Mutex<DedupIndex>>,
    dedup_lookups: AtomicU64,
    dedup_hits: AtomicU64,
    /// Decompressed blocks by (record offset, record crc).
    read_cache: Option<ReadCache>,
    read_cache_hits: AtomicU64,
    read_cache_misses: AtomicU64,
}

/// A block or unit after compression, before it has a place in the log.
enum Prepared<'a> {
    Data {
        lba: u64,
        /// 1, or the blocks of a merged unit.
        nblocks: u32,
        codec: CodecTag,
        level: u8,
        payload: Cow<'a, [u8]>,
        payload_crc: u32,
        /// Fingerprint per block (0: none).
        fps: Vec<Fingerprint>,
    },
    Zero {
        lba: u64,
        nblocks: u32,
    },
    /// Content already stored, verified byte for byte: becomes a reference
    /// if the record is still live at commit.
    Dup {
        lba: u64,
        fp: Fingerprint,
        block: &'a [u8],
        target: DupTarget,
    },
}

#[derive(Clone, Copy)]
enum DupTarget {
    /// A stored record (its owner-form entry and header LBA, from the index).
    Record(MapEntry, u64),
    /// The same content as an earlier block of this write (by LBA).
    Earlier(u64),
}

/// Decompressed blocks by (record offset, record crc).
type ReadCache = quick_cache::sync::Cache<(u64, u32), Arc<[u8]>>;

/// A verified, decompressed record: its header and all its blocks.
pub(crate) struct DecodedUnit {
    header: RecordHeader,
    data: Vec<u8>,
}
type UnitCache = quick_cache::sync::Cache<(u64, u32), Arc<DecodedUnit>>;

/// Counters of elastic compression, for `stat`.
#[derive(Debug, Default)]
struct ElasticStats {
    /// Blocks the probe sent to storage raw, uncompressed.
    probe_raw_blocks: AtomicU64,
    /// Units (records) the auto policy compressed with lz4 / zstd:1 / zstd:3.
    auto_lz4: AtomicU64,
    auto_zstd_fast: AtomicU64,
    auto_zstd_strong: AtomicU64,
    /// Multi-block units written by client writes, and their blocks.
    units_written: AtomicU64,
    unit_blocks_written: AtomicU64,
    /// Read path: bytes served, bytes decompressed to serve them.
    bytes_read: AtomicU64,
    bytes_decoded: AtomicU64,
    unit_cache_hits: AtomicU64,
    unit_cache_misses: AtomicU64,
    /// Background recompression.
    recompress_passes: AtomicU64,
    recompressed_blocks: AtomicU64,
    recompressed_bytes_before: AtomicU64,
    recompressed_bytes_after: AtomicU64,
    recompress_skipped_units: AtomicU64,
}

/// Bytes of a REF record.
const REF_RECORD_BYTES: u64 = (RECORD_HEADER_BYTES + cvol_format::mapentry::MAP_ENTRY_BYTES) as u64;

/// The live mask of a fresh record of `nblocks` (every block; 0 for one).
pub(crate) fn full_mask(nblocks: u32) -> u16 {
    if nblocks > 1 {
        ((1u32 << nblocks) - 1) as u16
    } else {
        0
    }
}

/// The owner entry of block `k` of a record of `nblocks` blocks.
pub(crate) fn unit_entry(
    codec: CodecTag,
    offset: u64,
    len: u32,
    crc: u32,
    nblocks: u32,
    k: u32,
) -> MapEntry {
    if nblocks > 1 {
        MapEntry::unit(codec, offset, len, crc, k)
    } else {
        MapEntry::data(codec, offset, len, crc)
    }
}

pub fn default_segment_size(physical_size_bytes: u64) -> u64 {
    if physical_size_bytes >= 1 << 30 {
        4 << 20
    } else {
        1 << 20
    }
}

fn is_zero(b: &[u8]) -> bool {
    let words = b.chunks_exact(16);
    let rest = words.remainder();
    words
        .map(|c| u128::from_ne_bytes(c.try_into().expect("16 bytes")))
        .all(|w| w == 0)
        && rest.iter().all(|&x| x == 0)
}

impl Volume {
    /// Formats `storage` as a new volume and opens it for writing.
    pub fn create(storage: Arc<dyn Storage>, c: &CreateOptions) -> Result<Volume, VolError> {
        let segment_size_bytes = if c.segment_size_bytes == 0 {
            default_segment_size(c.physical_size_bytes)
        } else {
            c.segment_size_bytes
        };
        let sb = Superblock {
            uuid: rand::random(),
            logical_size_bytes: c.logical_size_bytes,
            physical_size_bytes: c.physical_size_bytes,
            segment_size_bytes,
            data_offset_bytes: cvol_format::DATA_OFFSET_BYTES,
            codec: c.codec.codec().tag(),
            codec_level: c.codec.codec().level(),
            created_unix_secs: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            flags: if c.dedup {
                cvol_format::superblock::FLAG_DEDUP
            } else {
                0
            } | if c.codec.is_auto() {
                cvol_format::superblock::FLAG_AUTO_CODEC
            } else {
                0
            },
        };
        sb.validate()
            .map_err(|e| VolError::Open(format!("cannot create volume: {e}")))?;
        if sb.physical_size_bytes > storage.len_bytes() {
            return Err(VolError::Open(format!(
                "physical size {} exceeds the backing store ({} bytes)",
                sb.physical_size_bytes,
                storage.len_bytes()
            )));
        }
        let enc = sb.encode();
        let io = |r: std::io::Result<()>| r.map_err(VolError::Io);
        io(storage.write_at(cvol_format::SUPERBLOCK_A_OFFSET, &enc))?;
        io(storage.write_at(cvol_format::SUPERBLOCK_B_OFFSET, &enc))?;
        let zero_slot = [0u8; cvol_format::pointer::POINTER_BYTES];
        io(storage.write_at(CheckpointPointer::slot_offset(0), &zero_slot))?;
        io(storage.write_at(CheckpointPointer::slot_offset(1), &zero_slot))?;
        io(storage.write_at(sb.segment_offset(0), &[0u8; RECORD_HEADER_BYTES]))?;
        io(storage.sync())?;
        let mut segs = SegmentTable::new(sb.segment_count(), sb.segment_size_bytes);
        let first = segs.open_next().expect("a new volume has free segments");
        let state = State {
            map: BlockMap::new(sb.logical_blocks()),
            log: Log::new(&sb, segs, first, 0, 0, 1),
            counters: MapCounters::default(),
            synced_seq: 0,
            synced_marked: 0,
            checkpoint_generation: 0,
            appended_at_checkpoint: 0,
            durable_snapshot_seq: 0,
            map_changes_since_checkpoint: 1,
            shared: SharedTable::default(),
            cleaning: HashSet::new(),
        };
        let vol = Volume::assemble(storage, sb, OpenOptions::default(), state);
        vol.begin_epoch()?;
        vol.checkpoint()?;
        Ok(vol)
    }

    /// Opens an existing volume: recovery, then (unless read-only) a new epoch.
    pub fn open(storage: Arc<dyn Storage>, options: OpenOptions) -> Result<Volume, VolError> {
        let (sb, warnings) = recovery::read_superblock(&*storage).map_err(VolError::Open)?;
        warnings.iter().for_each(|w| tracing::warn!("{w}"));
        let r = match recovery::recover(&*storage, &sb) {
            // Repair reads the whole log: flushed records the chain cannot
            // reach (a segment whose start was erased) are salvaged too.
            Ok(r) if options.rebuild_from_log && !options.read_only => {
                let c = recovery::certified_in_log(&*storage, &sb);
                if r.last_seq < c.seq {
                    let e = format!(
                        "the log's chain ends at seq {} but {} certifies seq {} as flushed",
                        r.last_seq, c.by, c.seq
                    );
                    tracing::warn!("{e}; salvaging the map from the log");
                    let mut r = recovery::salvage(&*storage, &sb).map_err(VolError::Open)?;
                    r.warnings.insert(0, e);
                    r
                } else {
                    r
                }
            }
            Ok(r) => r,
            Err(e) if options.rebuild_from_log && !options.read_only => {
                tracing::warn!("{e}; salvaging the map from the log");
                let mut r = recovery::salvage(&*storage, &sb).map_err(VolError::Open)?;
                r.warnings.insert(0, e);
                r
            }
            Err(e) => return Err(VolError::Open(e)),
        };
        let recovery_warnings = r.warnings.clone();
        let recovery_salvage = r.salvage.clone();
        r.warnings.iter().for_each(|w| tracing::warn!("{w}"));
        // A clean close leaves no data records after the last checkpoint
        // (only EPOCH records of opens): say "recovered" only when records
        // that change the map had to be replayed.
        if r.replayed_map_records > 0 {
            // With warnings, they (logged above) say why; without, the
            // last run simply ended before its final checkpoint.
            let why = if r.warnings.is_empty() {
                " (the last run ended without a final checkpoint)"
            } else {
                ""
            };
            tracing::info!(
                checkpoint = r.checkpoint_generation,
                last_seq = r.last_seq,
                "recovered: replayed {} records written after the last checkpoint{why}",
                r.replayed_map_records
            );
        } else {
            tracing::debug!(
                checkpoint = r.checkpoint_generation,
                replayed = r.replayed_records,
                last_seq = r.last_seq,
                "volume opened: no data to replay"
            );
        }
        let fill = (align_up(r.end as u64, cvol_format::SECTOR_SIZE_BYTES))
            .min(sb.segment_size_bytes) as usize;
        let live = refs::rebuild(
            &sb,
            &r.map,
            &r.needed_segments,
            Some((r.segment, r.last_seq)),
        );
        let mut log = Log::new(
            &sb,
            live.segments,
            r.segment,
            fill,
            r.last_epoch,
            r.last_seq + 1,
        );
        storage
            .read_at(sb.segment_offset(r.segment), &mut log.buf[..r.end])
            .map_err(VolError::Io)?;
        let mut counters = MapCounters::default();
        r.map.for_each_mapped(|_, e| counters.add(e));
        counters.stored_payload_bytes = live.stored_payload_bytes;
        counters.stored_codec_bytes = live.stored_codec_bytes;
        let state = State {
            map: r.map,
            log,
            counters,
            synced_seq: r.last_seq,
            synced_marked: 0,
            checkpoint_generation: r.checkpoint_generation,
            appended_at_checkpoint: 0,
            durable_snapshot_seq: r.snapshot_seq,
            map_changes_since_checkpoint: r.replayed_map_records,
            shared: live.shared,
            cleaning: HashSet::new(),
        };
        let mut vol = Volume::assemble(storage, sb, options, state);
        vol.recovery_warnings = recovery_warnings;
        vol.recovery_salvage = recovery_salvage;
        if !vol.options.read_only {
            match vol.begin_epoch() {
                Err(VolError::NoSpace) => {
                    return Err(VolError::Open(
                        "the log is full: no room for the epoch record that opening for writing \
                         needs; serve it --read-only to copy the data out"
                            .into(),
                    ))
                }
                r => r?,
            }
        }
        Ok(vol)
    }

    fn assemble(
        storage: Arc<dyn Storage>,
        sb: Superblock,
        options: OpenOptions,
        state: State,
    ) -> Volume {
        let dedup_seed = sb.dedup().then(|| dedup::volume_seed(&sb.uuid));
        // No use indexing more blocks than the log holds at a 4:1 ratio.
        let index = (sb.dedup() && !options.read_only).then(|| {
            Mutex::new(DedupIndex::new(
                options.dedup_memory_bytes,
                sb.physical_size_bytes / 1024,
            ))
        });
        let cache_blocks = options.read_cache_bytes / BLOCK_SIZE_BYTES;
        let read_cache =
            (cache_blocks > 0).then(|| quick_cache::sync::Cache::new(cache_blocks as usize));
        Volume {
            dedup_seed,
            index,
            dedup_lookups: AtomicU64::new(0),
            dedup_hits: AtomicU64::new(0),
            read_cache,
            read_cache_hits: AtomicU64::new(0),
            read_cache_misses: AtomicU64::new(0),
            policy: {
                let c = Codec::from_tag(sb.codec, sb.codec_level);
                if sb.auto_codec() {
                    CodecPolicy::Auto { strong: c }
                } else {
                    CodecPolicy::Fixed(c)
                }
            },
            load: LoadMonitor::default(),
            unit_cache: quick_cache::sync::Cache::new(UNIT_CACHE_UNITS),
            elastic_stats: ElasticStats::default(),
            recompress_cursor: AtomicU64::new(0),
            recovery_warnings: Vec::new(),
            recovery_salvage: None,
            storage,
            sb,
            options,
            state: Mutex::new(state),
            flush_lock: Mutex::new(()),
            rmw: RwLock::new(()),
            poisoned: AtomicBool::new(false),
            client_bytes_written: AtomicU64::new(0),
            corrupt_reads: AtomicU64::new(0),
            cleaner_lock: Mutex::new(()),
            cleaner_stats: CleanerStats::default(),
            scrub: scrub::ScrubState::default(),
            last_client_io_ms: AtomicU64::new(0),
            opened: std::time::Instant::now(),
            space_waiters: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// Starts a new epoch: an EPOCH record, made durable before any other
    /// record of this epoch, so stale records of a crashed epoch never rejoin the chain.
    fn begin_epoch(&self) -> Result<(), VolError> {
        let _f = self.flush_lock.lock().expect("flush lock");
        let mut st = self.lock_state();
        st.log.epoch += 1;
        let crc = crc32c::crc32c(&[]);
        self.guard(st.log.append(
            &*self.storage,
            RecordKind::Epoch,
            CodecTag::None,
            0,
            0,
            &[],
            crc,
        ))?;
        self.guard(st.log.pad_and_write(&*self.storage))?;
        drop(st);
        self.guard(self.storage.sync().map_err(VolError::Io))?;
        let mut st = self.lock_state();
        st.synced_seq = st.log.last_seq();
        Ok(())
    }

    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }

    pub fn size_bytes(&self) -> u64 {
        self.sb.logical_size_bytes
    }

    /// The fixed codec, or the strong (idle-time) codec of the auto policy.
    pub fn codec(&self) -> Codec {
        self.policy.codec()
    }

    /// Where the record serving `lba` lies (offset, length), if any: for
    /// tests that attribute an unreadable block to an injected fault.
    #[doc(hidden)]
    pub fn block_record(&self, lba: u64) -> Option<(u64, u32)> {
        let st = self.lock_state();
        match (lba < st.map.blocks()).then(|| st.map.get(lba).state_valid()) {
            Some(EntryState::Data { offset, len, .. }) => Some((offset, len)),
            _ => None,
        }
    }

    /// What recovery skipped or rebuilt when this volume was opened.
    pub fn recovery_warnings(&self) -> &[String] {
        &self.recovery_warnings
    }

    /// What the salvage this open ran (`rebuild_from_log`) could not save.
    pub fn recovery_salvage(&self) -> Option<&recovery::Salvage> {
        self.recovery_salvage.as_ref()
    }

    pub fn codec_policy(&self) -> CodecPolicy {
        self.policy
    }

    pub fn read_only(&self) -> bool {
        self.options.read_only
    }

    fn lock_state(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .expect("volume state lock poisoned by a panic")
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

    // ---- writes ----

    pub fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), VolError> {
        self.check_range(offset, data.len() as u64)?;
        self.check_writable()?;
        self.note_client_io();
        if data.is_empty() {
            return Ok(());
        }
        self.load.note(data.len() as u64);
        let _inflight = self.load.enter();
        if offset.is_multiple_of(BLOCK_SIZE_BYTES) && data.len().is_multiple_of(BS) {
            let _shared = self.rmw.read().expect("rmw lock");
            self.write_blocks(offset / BLOCK_SIZE_BYTES, data)?;
        } else {
            let _exclusive = self.rmw.write().expect("rmw lock");
            self.write_unaligned(offset, data)?;
        }
        self.client_bytes_written
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        self.after_write(fua)
    }

    fn after_write(&self, fua: bool) -> Result<(), VolError> {
        if fua || self.options.sync_writes {
            self.flush()
        } else {
            Ok(())
        }
    }

    fn write_unaligned(&self, offset: u64, data: &[u8]) -> Result<(), VolError> {
        let first = offset / BLOCK_SIZE_BYTES;
        let last = (offset + data.len() as u64 - 1) / BLOCK_SIZE_BYTES;
        let nblocks = (last - first + 1) as usize;
        let mut buf = vec![0u8; nblocks * BS];
        let head = (offset % BLOCK_SIZE_BYTES) as usize;
        if head != 0 {
            self.read_blocks(first, &mut buf[..BS])?;
        }
        let tail_end = head + data.len();
        if !tail_end.is_multiple_of(BS) && (last != first || head == 0) {
            self.read_blocks(last, &mut buf[(nblocks - 1) * BS..])?;
        }
        buf[head..tail_end].copy_from_slice(data);
        self.write_blocks(first, &buf)
    }

    /// Splits a write into records to commit: zero runs, blocks whose
    /// content is already stored (verified dedup candidates), and compressed
    /// blocks. Runs on the caller's thread, without the state lock.
    fn prepare<'a>(&self, lba: u64, data: &'a [u8]) -> Vec<Prepared<'a>> {
        let nblocks = data.len() / BS;
        let block = |i: usize| &data[i * BS..(i + 1) * BS];
        let mut fps = vec![0 as Fingerprint; nblocks];
        let mut targets: Vec<Option<DupTarget>> = vec![None; nblocks];
        if let (Some(seed), Some(index)) = (self.dedup_seed, &self.index) {
            let mut first: std::collections::HashMap<Fingerprint, usize> =
                std::collections::HashMap::new();
            let mut candidates = Vec::new();
            for (i, fp) in fps.iter_mut().enumerate() {
                if !is_zero(block(i)) {
                    *fp = dedup::fingerprint(seed, block(i));
                }
            }
            {
                let mut ix = index.lock().expect("index lock");
                for (i, &fp) in fps.iter().enumerate().filter(|(_, &fp)| fp != 0) {
                    if nblocks == 1 {
                        if let Some((e, owner)) = ix.lookup(fp) {
                            candidates.push((i, e, owner));
                        }
                        continue;
                    }
                    match first.get(&fp) {
                        Some(&i0) if block(i0) == block(i) => {
                            targets[i] = Some(DupTarget::Earlier(lba + i0 as u64));
                        }
                        Some(_) => {} // a collision inside one write: store it
                        None => {
                            first.insert(fp, i);
                            if let Some((e, owner)) = ix.lookup(fp) {
                                candidates.push((i, e, owner));
                            }
                        }
                    }
                }
            }
            self.dedup_lookups.fetch_add(
                fps.iter().filter(|&&fp| fp != 0).count() as u64,
                Ordering::Relaxed,
            );
            // Verify outside every lock: the stored block must equal this one.
            for (i, e, owner) in candidates {
                if self.stored_block(e).as_deref() == Some(block(i)) {
                    targets[i] = Some(DupTarget::Record(e, owner));
                }
            }
        }
        // Zero runs, dedup references, and runs of data merged into units:
        // contiguous blocks inside one aligned window of `unit` blocks.
        let unit = u64::from(
            self.options
                .elastic
                .unit_blocks
                .clamp(1, policy::UNIT_BLOCKS_MAX),
        );
        let mut out: Vec<Prepared<'a>> = Vec::with_capacity(nblocks);
        let mut run: Option<usize> = None;
        let flush_run = |out: &mut Vec<Prepared<'a>>, run: &mut Option<usize>, end: usize| {
            if let Some(start) = run.take() {
                out.extend(self.compress_run(
                    lba + start as u64,
                    &data[start * BS..end * BS],
                    &fps[start..end],
                ));
            }
        };
        for i in 0..nblocks {
            let (l, b) = (lba + i as u64, block(i));
            if is_zero(b) {
                flush_run(&mut out, &mut run, i);
                if let Some(Prepared::Zero { lba: zl, nblocks }) = out.last_mut() {
                    if *zl + u64::from(*nblocks) == l {
                        *nblocks += 1;
                        continue;
                    }
                }
                out.push(Prepared::Zero { lba: l, nblocks: 1 });
                continue;
            }
            if let Some(target) = targets[i] {
                flush_run(&mut out, &mut run, i);
                out.push(Prepared::Dup {
                    lba: l,
                    fp: fps[i],
                    block: b,
                    target,
                });
                continue;
            }
            if run.is_some() && l % unit == 0 {
                flush_run(&mut out, &mut run, i);
            }
            run.get_or_insert(i);
        }
        flush_run(&mut out, &mut run, nblocks);
        out
    }

    /// The codec for a run of blocks: raw if the probe finds it
    /// incompressible, else the fixed codec or the auto policy's choice
    /// for the current load.
    fn choose_codec(&self, data: &[u8]) -> Codec {
        let n = (data.len() / BS) as u64;
        let es = &self.elastic_stats;
        match self.policy {
            CodecPolicy::Fixed(Codec::None) => Codec::None,
            _ if !policy::probe_compressible(data) => {
                es.probe_raw_blocks.fetch_add(n, Ordering::Relaxed);
                Codec::None
            }
            CodecPolicy::Fixed(c) => c,
            CodecPolicy::Auto { .. } => {
                let load = self.load.load(&self.options.elastic);
                match load {
                    policy::Load::Busy => &es.auto_lz4,
                    policy::Load::Medium => &es.auto_zstd_fast,
                    policy::Load::Idle => &es.auto_zstd_strong,
                }
                .fetch_add(1, Ordering::Relaxed);
                policy::auto_codec(load)
            }
        }
    }

    /// Compresses a run of contiguous blocks (inside one unit window) into
    /// one unit record, or single-block records when it is one block or
    /// does not compress.
    fn compress_run<'a>(&self, lba: u64, data: &'a [u8], fps: &[Fingerprint]) -> Vec<Prepared<'a>> {
        let out = self.compress_run_with(lba, data, fps, self.choose_codec(data));
        if let [Prepared::Data { nblocks, .. }] = out[..] {
            if nblocks > 1 {
                let es = &self.elastic_stats;
                es.units_written.fetch_add(1, Ordering::Relaxed);
                es.unit_blocks_written
                    .fetch_add(u64::from(nblocks), Ordering::Relaxed);
            }
        }
        out
    }

    fn compress_run_with<'a>(
        &self,
        lba: u64,
        data: &'a [u8],
        fps: &[Fingerprint],
        codec: Codec,
    ) -> Vec<Prepared<'a>> {
        let n = data.len() / BS;
        debug_assert!(n >= 1 && n <= policy::UNIT_BLOCKS_MAX as usize && fps.len() == n);
        let compressed = codec.compress(data);
        match compressed {
            Some(c) => {
                vec![Prepared::Data {
                    lba,
                    nblocks: n as u32,
                    codec: codec.tag(),
                    level: codec.level(),
                    payload_crc: crc32c::crc32c(&c),
                    payload: Cow::Owned(c),
                    fps: fps.to_vec(),
                }]
            }
            // Stored raw, one record per block: a raw unit would only cost
            // read amplification.
            None => (0..n)
                .map(|i| {
                    let b = &data[i * BS..(i + 1) * BS];
                    Prepared::Data {
                        lba: lba + i as u64,
                        nblocks: 1,
                        codec: CodecTag::None,
                        level: 0,
                        payload_crc: crc32c::crc32c(b),
                        payload: Cow::Borrowed(b),
                        fps: vec![fps[i]],
                    }
                })
                .collect(),
        }
    }

    /// One block, compressed on its own (a dedup candidate that lost its
    /// target at commit).
    fn compress_block<'a>(&self, lba: u64, block: &'a [u8], fp: Fingerprint) -> Prepared<'a> {
        self.compress_run(lba, block, &[fp])
            .pop()
            .expect("one block makes one record")
    }

    /// The decompressed block of the record `e` names, for dedup
    /// verification: from the read cache, the open segment's buffer or the
    /// store. None if it cannot be read or is not that record any more.
    fn stored_block(&self, e: MapEntry) -> Option<Arc<[u8]>> {
        let EntryState::Data {
            offset, len, unit, ..
        } = e.state_valid()
        else {
            return None;
        };
        // As a ref entry: the record may name any LBA; its crc must match.
        let as_ref = e.as_ref_entry();
        let mut out = vec![0u8; BS];
        if unit {
            if let Some(u) = self.unit_cache.get(&(offset, len)) {
                u.copy_block(0, as_ref, &mut out).ok()?;
                return Some(Arc::from(out));
            }
        }
        if let Some(b) = self
            .read_cache
            .as_ref()
            .and_then(|c| c.get(&(offset, e.crc)))
        {
            self.read_cache_hits.fetch_add(1, Ordering::Relaxed);
            return Some(b);
        }
        let buffered = self
            .lock_state()
            .log
            .buffered(offset, len as usize)
            .map(<[u8]>::to_vec);
        let rec = match buffered {
            Some(r) => r,
            None => {
                let mut r = vec![0u8; len as usize];
                self.storage.read_at(offset, &mut r).ok()?;
                r
            }
        };
        if unit {
            let u = Arc::new(DecodedUnit::decode(&rec).ok()?);
            u.copy_block(0, as_ref, &mut out).ok()?;
            self.unit_cache.insert((offset, len), u);
        } else {
            decode_block_record(0, as_ref, &rec, &mut out).ok()?;
        }
        let b: Arc<[u8]> = Arc::from(out);
        if let Some(c) = &self.read_cache {
            self.read_cache_misses.fetch_add(1, Ordering::Relaxed);
            c.insert((offset, e.crc), b.clone());
        }
        Some(b)
    }

    /// Log bytes kept back from client writes so a checkpoint always fits.
    /// Log bytes kept back from client writes: room for a checkpoint of the
    /// map and one segment for the cleaner to move live data into.
    fn reserve_bytes(&self, st: &State) -> u64 {
        self.checkpoint_estimate_bytes(st) + self.sb.segment_size_bytes + 2 * UNIT_RECORD_MAX_BYTES
    }

    /// Raw map bytes per MAP_CHUNK record: small next to a segment, so the
    /// tail a chunk leaves unused at a segment switch stays small.
    fn chunk_raw_max_bytes(&self) -> usize {
        (self.sb.segment_size_bytes as usize / 16).min(CHUNK_RAW_MAX_BYTES)
    }

    /// Locks the state with `need` log bytes free beyond the reserve, running
    /// the cleaner first if the log is short of space. NoSpace only when
    /// cleaning cannot make room: the live data truly does not fit.
    fn lock_with_space(&self, need: u64) -> Result<MutexGuard<'_, State>, VolError> {
        let mut idle_turns = 0;
        for _ in 0..SPACE_TURNS_MAX {
            let st = self.lock_state();
            self.check_writable()?;
            let want = need + self.reserve_bytes(&st);
            if st.log.free_bytes() >= want {
                return Ok(st);
            }
            drop(st);
            // Whether this call or a concurrent one (the background cleaner)
            // made the room, the check above decides on the next turn. Give
            // up when cleaning stops gaining a useful amount (a full volume
            // only yields segment tails).
            if idle_turns == 2 {
                break;
            }
            self.space_waiters.fetch_add(1, Ordering::SeqCst);
            // Clean a little beyond the need, so one clean serves many writes.
            let count = self.sb.segment_count();
            let slack = (count / 20).max(2).min(count / 4) * self.sb.segment_size_bytes;
            let cleaned = self.clean(want + slack, false);
            self.space_waiters.fetch_sub(1, Ordering::SeqCst);
            let useful = self.sb.segment_size_bytes / 16;
            idle_turns = if cleaned? < useful { idle_turns + 1 } else { 0 };
        }
        Err(VolError::NoSpace)
    }

    fn write_blocks(&self, lba: u64, data: &[u8]) -> Result<(), VolError> {
        debug_assert!(data.len().is_multiple_of(BS));
        let mut items = self.prepare(lba, data);
        loop {
            let need: u64 = items
                .iter()
                .map(|p| match p {
                    Prepared::Data { payload, .. } => (RECORD_HEADER_BYTES + payload.len()) as u64,
                    Prepared::Zero { .. } => RECORD_HEADER_BYTES as u64,
                    Prepared::Dup { .. } => REF_RECORD_BYTES,
                })
                .sum::<u64>()
                + 2 * RECORD_MAX_BYTES as u64;
            let mut st = self.lock_with_space(need)?;
            // Entries this commit gave each LBA (for duplicates inside the write).
            let mut done: std::collections::HashMap<u64, MapEntry> =
                std::collections::HashMap::new();
            let mut retry = Vec::new();
            for item in items {
                if let Some(again) = self.commit_one(&mut st, item, &mut done)? {
                    retry.push(again);
                }
            }
            if retry.is_empty() {
                return Ok(());
            }
            // Candidates whose record died (or is being cleaned) since they
            // were verified: compress them after all, outside the lock.
            drop(st);
            items = retry
                .into_iter()
                .map(|(l, block, fp)| self.compress_block(l, block, fp))
                .collect();
        }
    }

    /// Commits one prepared item under the state lock. A dedup candidate
    /// whose record can no longer be referenced comes back, to be compressed.
    #[allow(clippy::type_complexity)]
    fn commit_one<'a>(
        &self,
        st: &mut State,
        item: Prepared<'a>,
        done: &mut std::collections::HashMap<u64, MapEntry>,
    ) -> Result<Option<(u64, &'a [u8], Fingerprint)>, VolError> {
        match item {
            Prepared::Data {
                lba,
                nblocks,
                codec,
                level,
                payload,
                payload_crc,
                fps,
            } => {
                let shape = Shape {
                    kind: RecordKind::Data,
                    codec,
                    level,
                    lba,
                    nblocks,
                    mask: full_mask(nblocks),
                };
                let p =
                    self.guard(
                        st.log
                            .append_shaped(&*self.storage, shape, &payload, payload_crc),
                    )?;
                for (k, &fp) in fps.iter().enumerate() {
                    let e = unit_entry(codec, p.offset, p.len, p.crc, nblocks, k as u32);
                    let l = lba + k as u64;
                    self.set_entry(st, l, e);
                    if let (Some(ix), true) = (&self.index, fp != 0) {
                        ix.lock().expect("index lock").insert(fp, e, l);
                        done.insert(l, e);
                    }
                }
            }
            Prepared::Zero { lba, nblocks } => {
                self.append_range(st, RecordKind::Zero, lba, nblocks)?;
                (lba..lba + u64::from(nblocks)).for_each(|l| self.set_entry(st, l, MapEntry::ZERO));
            }
            Prepared::Dup {
                lba,
                fp,
                block,
                target,
            } => {
                let target = match target {
                    DupTarget::Record(e, owner) => Some(e).filter(|&e| {
                        self.referable(st, e, owner) || {
                            if let Some(ix) = &self.index {
                                ix.lock().expect("index lock").forget(fp, &e);
                            }
                            false
                        }
                    }),
                    // Committed earlier in this very lock hold, so still live.
                    DupTarget::Earlier(l0) => done.get(&l0).copied(),
                };
                let Some(target) = target else {
                    return Ok(Some((lba, block, fp)));
                };
                self.commit_ref(st, lba, target, fp)?;
                done.insert(lba, target);
                self.dedup_hits.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(None)
    }

    /// May a new reference point at record `e` (indexed with header LBA
    /// `owner`) now: is it live, and not in a segment being cleaned?
    fn referable(&self, st: &State, e: MapEntry, owner: u64) -> bool {
        let EntryState::Data { offset, .. } = e.state_valid() else {
            return false;
        };
        let seg = (offset - self.sb.data_offset_bytes) / self.sb.segment_size_bytes;
        !st.cleaning.contains(&seg) && self.record_live(st, e, owner)
    }

    /// Points `lba` at the live record `target` (same content): a REF record
    /// in the log, a ref entry in the map, no new data.
    fn commit_ref(
        &self,
        st: &mut State,
        lba: u64,
        target: MapEntry,
        fp: Fingerprint,
    ) -> Result<(), VolError> {
        if st.map.get(lba).same_record(&target) {
            return Ok(()); // the block holds this very record already
        }
        let e = target.as_ref_entry();
        let mut payload = [0u8; cvol_format::mapentry::MAP_ENTRY_BYTES];
        e.encode(&mut payload);
        let crc = crc32c::crc32c(&payload);
        self.guard(st.log.append(
            &*self.storage,
            RecordKind::Ref,
            CodecTag::None,
            lba,
            1,
            &payload,
            crc,
        ))?;
        self.set_entry_fp(st, lba, e, fp);
        Ok(())
    }

    fn append_range(
        &self,
        st: &mut State,
        kind: RecordKind,
        lba: u64,
        nblocks: u32,
    ) -> Result<(), VolError> {
        let crc = crc32c::crc32c(&[]);
        self.guard(
            st.log
                .append(&*self.storage, kind, CodecTag::None, lba, nblocks, &[], crc),
        )
        .map(|_| ())
    }

    fn set_entry(&self, st: &mut State, lba: u64, e: MapEntry) {
        self.set_entry_fp(st, lba, e, 0);
    }

    /// TRIM: whole blocks inside the range become unmapped holes; partial
    /// blocks at the edges are left alone (TRIM is advisory).
    pub fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), VolError> {
        self.check_range(offset, len)?;
        self.check_writable()?;
        let first = offset.div_ceil(BLOCK_SIZE_BYTES);
        let end = (offset + len) / BLOCK_SIZE_BYTES;
        if first < end {
            let _shared = self.rmw.read().expect("rmw lock");
            self.unmap_blocks(first, end)?;
        }
        self.after_write(fua)
    }

    fn unmap_blocks(&self, first: u64, end: u64) -> Result<(), VolError> {
        let mut st = self.lock_state();
        self.check_writable()?;
        let mapped = |l: u64| l < end && !st.map.get(l).is_unmapped();
        let any = std::iter::successors(st.map.next_allocated_page_lba(first), |&p| {
            st.map
                .next_allocated_page_lba((p / PAGE_BLOCKS + 1) * PAGE_BLOCKS)
        })
        .take_while(|&p| p < end)
        .any(|p| (p..((p / PAGE_BLOCKS + 1) * PAGE_BLOCKS).min(end)).any(mapped));
        if !any {
            return Ok(()); // already holes: no record, no space
        }
        let records = (end - first).div_ceil(u64::from(u32::MAX));
        if st.log.free_bytes() < records * RECORD_HEADER_BYTES as u64 + 2 * RECORD_MAX_BYTES as u64
        {
            return Err(VolError::NoSpace);
        }
        let mut lba = first;
        while lba < end {
            let n = (end - lba).min(u64::from(u32::MAX));
            self.append_range(&mut st, RecordKind::Trim, lba, n as u32)?;
            lba += n;
        }
        let mut l = first;
        while let Some(next) = st.map.next_allocated_page_lba(l).filter(|&n| n < end) {
            let page_end = (next / PAGE_BLOCKS + 1) * PAGE_BLOCKS;
            for x in next..page_end.min(end) {
                if !st.map.get(x).is_unmapped() {
                    self.set_entry(&mut st, x, MapEntry::UNMAPPED);
                }
            }
            l = page_end;
        }
        Ok(())
    }

    /// WRITE_ZEROES: whole blocks become holes (or, with `no_hole`, zero
    /// blocks that stay allocated in the map); partial edges are written.
    pub fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        no_hole: bool,
        fua: bool,
    ) -> Result<(), VolError> {
        self.check_range(offset, len)?;
        self.check_writable()?;
        let first = offset.div_ceil(BLOCK_SIZE_BYTES);
        let end = (offset + len) / BLOCK_SIZE_BYTES;
        if first >= end {
            let zeros = vec![0u8; len as usize];
            return self.write_at(offset, &zeros, fua);
        }
        let head = first * BLOCK_SIZE_BYTES - offset;
        let tail = offset + len - end * BLOCK_SIZE_BYTES;
        // Refuse up front rather than half-way, after the edges were written.
        let edges = (u64::from(head > 0) + u64::from(tail > 0)) * (BLOCK_SIZE_BYTES + 64);
        let entries = if no_hole { (end - first) * 13 } else { 0 };
        drop(self.lock_with_space(edges + entries + 4 * RECORD_MAX_BYTES as u64)?);
        if head > 0 {
            self.write_at(offset, &vec![0u8; head as usize], false)?;
        }
        if tail > 0 {
            self.write_at(end * BLOCK_SIZE_BYTES, &vec![0u8; tail as usize], false)?;
        }
        if no_hole {
            let _shared = self.rmw.read().expect("rmw lock");
            self.zero_blocks(first, end)?;
        } else {
            let _shared = self.rmw.read().expect("rmw lock");
            self.unmap_blocks(first, end)?;
        }
        self.after_write(fua)
    }

    fn zero_blocks(&self, first: u64, end: u64) -> Result<(), VolError> {
        let records = (end - first).div_ceil(u64::from(u32::MAX));
        let mut st = self.lock_with_space(records * 64 + (end - first) * 13)?;
        let mut lba = first;
        while lba < end {
            let n = (end - lba).min(u64::from(u32::MAX));
            self.append_range(&mut st, RecordKind::Zero, lba, n as u32)?;
            lba += n;
        }
        (first..end).for_each(|l| self.set_entry(&mut st, l, MapEntry::ZERO));
        Ok(())
    }

    // ---- reads ----

    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), VolError> {
        self.check_range(offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        self.load.note(buf.len() as u64);
        let _inflight = self.load.enter();
        let first = offset / BLOCK_SIZE_BYTES;
        if offset.is_multiple_of(BLOCK_SIZE_BYTES) && buf.len().is_multiple_of(BS) {
            return self.read_blocks(first, buf);
        }
        let last = (offset + buf.len() as u64 - 1) / BLOCK_SIZE_BYTES;
        let mut tmp = vec![0u8; ((last - first + 1) as usize) * BS];
        self.read_blocks(first, &mut tmp)?;
        let head = (offset % BLOCK_SIZE_BYTES) as usize;
        buf.copy_from_slice(&tmp[head..head + buf.len()]);
        Ok(())
    }

    /// Reads whole blocks. A record that fails verification is looked up
    /// and read again: the cleaner may have moved it, and its old segment been
    /// reused, between the map lookup and the read. Only a repeated failure is
    /// reported (and counted) as corruption.
    fn read_blocks(&self, lba: u64, out: &mut [u8]) -> Result<(), VolError> {
        self.note_client_io();
        let mut attempt = 0;
        loop {
            match self.read_blocks_once(lba, out, true) {
                Err(VolError::Corrupt { .. }) if attempt < READ_RETRIES => attempt += 1,
                Err(VolError::Corrupt { lba, detail }) => {
                    self.corrupt_reads.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(lba, "corrupt block: {detail}");
                    return Err(VolError::Corrupt { lba, detail });
                }
                r => return r,
            }
        }
    }

    /// Reads whole blocks once; `client` reads count in the read statistics.
    fn read_blocks_once(&self, lba: u64, out: &mut [u8], client: bool) -> Result<(), VolError> {
        let n = out.len() / BS;
        let mut entries = Vec::with_capacity(n);
        let mut buffered: Vec<Option<Vec<u8>>> = Vec::with_capacity(n);
        {
            let st = self.lock_state();
            for i in 0..n as u64 {
                let e = st.map.get(lba + i);
                let b = match e.state_valid() {
                    EntryState::Data { offset, len, .. } => {
                        st.log.buffered(offset, len as usize).map(<[u8]>::to_vec)
                    }
                    _ => None,
                };
                entries.push(e);
                buffered.push(b);
            }
        }
        // Only client reads count in the read statistics.
        let count = |pick: fn(&ElasticStats) -> &AtomicU64, n: u64| {
            if client {
                pick(&self.elastic_stats).fetch_add(n, Ordering::Relaxed);
            }
        };
        count(|e| &e.bytes_read, out.len() as u64);
        let corrupt = |k: usize, detail: String| VolError::Corrupt {
            lba: lba + k as u64,
            detail,
        };
        let mut i = 0;
        while i < n {
            if entries[i].state_valid() == EntryState::Lost {
                return Err(corrupt(
                    i,
                    "lost: damage destroyed this block's newest version (repair could not \
                     salvage it); it reads as an error until written again"
                        .into(),
                ));
            }
            let EntryState::Data {
                offset, len, unit, ..
            } = entries[i].state_valid()
            else {
                out[i * BS..(i + 1) * BS].fill(0);
                i += 1;
                continue;
            };
            if let Some(rec) = &buffered[i] {
                self.decode_block(
                    lba + i as u64,
                    entries[i],
                    rec,
                    &mut out[i * BS..(i + 1) * BS],
                )?;
                i += 1;
                continue;
            }
            if !unit {
                if let Some(cache) = &self.read_cache {
                    if let Some(b) = cache.get(&(offset, entries[i].crc)) {
                        self.read_cache_hits.fetch_add(1, Ordering::Relaxed);
                        out[i * BS..(i + 1) * BS].copy_from_slice(&b);
                        i += 1;
                        continue;
                    }
                }
            } else if let Some(u) = self.unit_cache.get(&(offset, len)) {
                count(|e| &e.unit_cache_hits, 1);
                // This block and the following ones of the same unit.
                let mut j = i;
                while j < n && buffered[j].is_none() && entries[j].same_location(&entries[i]) {
                    u.copy_block(lba + j as u64, entries[j], &mut out[j * BS..(j + 1) * BS])
                        .map_err(|d| corrupt(j, d))?;
                    j += 1;
                }
                i = j;
                continue;
            }
            // Adjacent records (and further blocks of the same unit) in one read.
            let mut j = i + 1;
            let (mut end, mut last) = (offset + u64::from(len), offset);
            while j < n && buffered[j].is_none() && end - offset < READ_MERGE_MAX_BYTES {
                match entries[j].state_valid() {
                    EntryState::Data { offset: o, .. } if o == last => {}
                    EntryState::Data {
                        offset: o, len: l, ..
                    } if o == end => {
                        last = o;
                        end += u64::from(l);
                    }
                    _ => break,
                }
                j += 1;
            }
            let mut run = vec![0u8; (end - offset) as usize];
            self.storage
                .read_at(offset, &mut run)
                .map_err(VolError::Io)?;
            let cache = self
                .read_cache
                .as_ref()
                .filter(|_| j - i <= READ_CACHE_RUN_MAX);
            let mut current: Option<(u64, Arc<DecodedUnit>)> = None;
            for k in i..j {
                let EntryState::Data {
                    offset: o,
                    len: l,
                    unit,
                    ..
                } = entries[k].state_valid()
                else {
                    unreachable!("run holds data")
                };
                let at = (o - offset) as usize;
                let rec = &run[at..at + l as usize];
                let block = &mut out[k * BS..(k + 1) * BS];
                if !unit {
                    self.decode_block(lba + k as u64, entries[k], rec, block)?;
                    count(|e| &e.bytes_decoded, BS as u64);
                    if let Some(c) = cache {
                        c.insert((o, entries[k].crc), Arc::from(&*block));
                    }
                    continue;
                }
                if current.as_ref().is_none_or(|(co, _)| *co != o) {
                    let u = Arc::new(DecodedUnit::decode(rec).map_err(|d| corrupt(k, d))?);
                    count(|e| &e.unit_cache_misses, 1);
                    count(|e| &e.bytes_decoded, u.data.len() as u64);
                    self.unit_cache.insert((o, l), u.clone());
                    current = Some((o, u));
                }
                let (_, u) = current.as_ref().expect("decoded above");
                u.copy_block(lba + k as u64, entries[k], block)
                    .map_err(|d| corrupt(k, d))?;
            }
            if self.read_cache.is_some() {
                self.read_cache_misses
                    .fetch_add((j - i) as u64, Ordering::Relaxed);
            }
            i = j;
        }
        Ok(())
    }

    fn decode_block(
        &self,
        lba: u64,
        e: MapEntry,
        rec: &[u8],
        out: &mut [u8],
    ) -> Result<(), VolError> {
        decode_block_record(lba, e, rec, out).map_err(|detail| VolError::Corrupt { lba, detail })
    }

    /// Allocation status from `offset`: zero-reading holes versus data.
    pub fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, VolError> {
        self.check_range(offset, len)?;
        let end = offset + len;
        let st = self.lock_state();
        let mut out: Vec<Extent> = Vec::new();
        let mut pos = offset;
        while pos < end && out.len() < EXTENTS_MAX {
            let lba = pos / BLOCK_SIZE_BYTES;
            let (zero, next) = match st.map.next_allocated_page_lba(lba) {
                Some(p) if p > lba => (true, p * BLOCK_SIZE_BYTES),
                None => (true, end),
                Some(_) => {
                    let z = !matches!(
                        st.map.get(lba).state_valid(),
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

    // ---- durability ----

    /// Makes every write that completed before this call durable.
    pub fn flush(&self) -> Result<(), VolError> {
        let _f = self.flush_lock.lock().expect("flush lock");
        if self.poisoned.load(Ordering::SeqCst) {
            return Err(VolError::Poisoned);
        }
        // Segments emptied by records this sync makes durable, and older
        // than the durable checkpoint, are reusable once it returns.
        let (target, candidates) = {
            let mut st = self.lock_state();
            let candidates = st.log.segments.reclaimable(st.durable_snapshot_seq);
            if st.log.last_seq() == st.synced_seq {
                drop(st);
                self.reclaim(&candidates);
                return Ok(());
            }
            // Certify the previous sync in the log (lazily: with this
            // flush's data, no extra write), so that recovery can tell
            // damage at rest from a crash's unsynced tail.
            if st.synced_seq > st.synced_marked {
                let seq = st.synced_seq;
                let payload = seq.to_le_bytes();
                let crc = crc32c::crc32c(&payload);
                self.guard(st.log.append(
                    &*self.storage,
                    RecordKind::Synced,
                    CodecTag::None,
                    0,
                    0,
                    &payload,
                    crc,
                ))?;
                st.synced_marked = seq;
            }
            self.guard(st.log.pad_and_write(&*self.storage))?;
            (st.log.last_seq(), candidates)
        };
        self.guard(self.storage.sync().map_err(VolError::Io))?;
        self.reclaim(&candidates);
        let due = {
            let mut st = self.lock_state();
            st.synced_seq = st.synced_seq.max(target);
            let empty = st.log.segments.empty_sealed_count();
            // Also checkpoint when enough segments only wait for one to be reused
            // (after a large TRIM, say), so the host gets its space back.
            st.log.appended_bytes - st.appended_at_checkpoint
                >= self.options.checkpoint_interval_bytes
                || empty >= (st.log.segments.count() / 8).max(4)
        };
        if due {
            match self.checkpoint_locked() {
                Ok(()) | Err(VolError::NoSpace) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Writes a checkpoint of the map and makes it the recovery start.
    pub fn checkpoint(&self) -> Result<(), VolError> {
        let _f = self.flush_lock.lock().expect("flush lock");
        self.checkpoint_locked()
    }

    fn checkpoint_locked(&self) -> Result<(), VolError> {
        self.check_writable()?;
        let (ptr, snapshot_seq, candidates) = {
            let mut st = self.lock_state();
            let snapshot_seq = st.log.last_seq();
            let candidates = st.log.segments.reclaimable(snapshot_seq);
            let ptr = self.append_checkpoint(&mut st)?;
            self.guard(st.log.pad_and_write(&*self.storage))?;
            (ptr, snapshot_seq, candidates)
        };
        self.guard(self.storage.sync().map_err(VolError::Io))?;
        let slot = CheckpointPointer::slot_offset(ptr.slot());
        self.guard(
            self.storage
                .write_at(slot, &ptr.encode())
                .map_err(VolError::Io),
        )?;
        self.guard(self.storage.sync().map_err(VolError::Io))?;
        let mut st = self.lock_state();
        st.checkpoint_generation = ptr.generation;
        st.synced_seq = st.synced_seq.max(ptr.commit_seq);
        st.appended_at_checkpoint = st.log.appended_bytes;
        st.durable_snapshot_seq = snapshot_seq;
        drop(st);
        self.reclaim(&candidates);
        tracing::debug!(
            generation = ptr.generation,
            seq = ptr.commit_seq,
            "checkpoint written"
        );
        Ok(())
    }

    /// Appends MAP_CHUNK records and the CKPT_COMMIT record; returns the pointer to publish.
    fn append_checkpoint(&self, st: &mut State) -> Result<CheckpointPointer, VolError> {
        let snapshot_seq = st.log.last_seq();
        let chunks = encode_map_chunks(&st.map, self.chunk_raw_max_bytes());
        // Refuse before appending anything: a half-written checkpoint only wastes space.
        let total: u64 = chunks
            .iter()
            .map(|c| (RECORD_HEADER_BYTES + c.len()) as u64)
            .sum();
        let largest = chunks
            .iter()
            .map(|c| (RECORD_HEADER_BYTES + c.len()) as u64)
            .max()
            .unwrap_or(0);
        let commit_bytes = (RECORD_HEADER_BYTES + 20 + 16 * chunks.len()) as u64;
        let tails = (total / self.sb.segment_size_bytes + 2) * largest.max(commit_bytes);
        if st.log.free_bytes() < total + commit_bytes + tails {
            return Err(VolError::NoSpace);
        }
        st.map_changes_since_checkpoint = 0;
        let mut refs = Vec::with_capacity(chunks.len());
        for c in &chunks {
            let crc = crc32c::crc32c(c);
            let p = self.guard(st.log.append(
                &*self.storage,
                RecordKind::MapChunk,
                CodecTag::Lz4,
                0,
                0,
                c,
                crc,
            ))?;
            refs.push(ChunkRef {
                offset: p.offset,
                len: p.len,
                crc: p.crc,
            });
        }
        let commit = CommitPayload {
            snapshot_seq,
            logical_blocks: self.sb.logical_blocks(),
            chunks: refs,
        }
        .encode();
        let crc = crc32c::crc32c(&commit);
        let p = self.guard(st.log.append(
            &*self.storage,
            RecordKind::CkptCommit,
            CodecTag::None,
            0,
            0,
            &commit,
            crc,
        ))?;
        Ok(CheckpointPointer {
            generation: st.checkpoint_generation + 1,
            commit_offset: p.offset,
            commit_len: p.len,
            commit_epoch: st.log.epoch,
            commit_seq: p.seq,
        })
    }

    /// Frees the candidates that are still empty and returns their space to
    /// the host. Callers pass candidates chosen before a sync that made their
    /// emptiness (and a checkpoint covering their records) durable.
    fn reclaim(&self, candidates: &[u64]) {
        if candidates.is_empty() {
            return;
        }
        let freed = self.lock_state().log.segments.free_empty(candidates);
        self.cleaner_stats
            .segments_reclaimed
            .fetch_add(freed.len() as u64, Ordering::Relaxed);
        self.release_segments(&freed);
    }

    /// Returns freed segments' space to the host (hole punch / discard).
    fn release_segments(&self, freed: &[u64]) {
        for &s in freed {
            let off = self.sb.segment_offset(s);
            if let Err(e) = self.storage.discard(off, self.sb.segment_size_bytes) {
                tracing::debug!(
                    segment = s,
                    "discard failed (space stays allocated on the host): {e}"
                );
            }
        }
        if !freed.is_empty() {
            tracing::debug!(segments = freed.len(), "segments reclaimed");
        }
    }

    /// Flushes and checkpoints (a clean close). Safe to call more than once.
    pub fn close(&self) -> Result<(), VolError> {
        if self.options.read_only {
            return Ok(());
        }
        self.flush()?;
        if self.lock_state().map_changes_since_checkpoint == 0 {
            return Ok(()); // the newest checkpoint already holds this map
        }
        match self.checkpoint() {
            Ok(()) => Ok(()),
            Err(VolError::NoSpace) => {
                tracing::warn!(
                    "no space for a final checkpoint; the next open replays the log instead"
                );
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    pub fn stats(&self) -> VolumeStats {
        let st = self.lock_state();
        let c = &st.counters;
        let bs = BLOCK_SIZE_BYTES;
        let mapped = c.data_blocks * bs;
        let used = self.sb.data_offset_bytes + st.log.used_bytes();
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let live = st.log.segments.total_live_bytes();
        let usable = st.log.free_bytes().saturating_sub(self.reserve_bytes(&st));
        let client = self.client_bytes_written.load(Ordering::Relaxed);
        let cs = &self.cleaner_stats;
        let ix_guard = self.index.as_ref().map(|i| i.lock().expect("index lock"));
        let ix = ix_guard.as_deref();
        let cache_hits = self.read_cache_hits.load(Ordering::Relaxed);
        let cache_misses = self.read_cache_misses.load(Ordering::Relaxed);
        let es = &self.elastic_stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let scrub_now = self.scrub.in_progress();
        VolumeStats {
            logical_size_bytes: self.sb.logical_size_bytes,
            physical_size_bytes: self.sb.physical_size_bytes,
            mapped_bytes: mapped,
            zero_bytes: c.zero_blocks * bs,
            unmapped_bytes: self.sb.logical_size_bytes
                - mapped
                - c.zero_blocks * bs
                - c.lost_blocks * bs,
            stored_bytes: c.stored_payload_bytes,
            physical_used_bytes: used,
            physical_free_bytes: st.log.free_bytes(),
            reduction_ratio: ratio(mapped, used),
            compression_ratio: ratio(mapped, c.stored_payload_bytes),
            blocks_by_codec: CodecBlocks::from_counts(&c.codec_blocks),
            codec_none_blocks: c.codec_blocks[CodecTag::None as usize],
            codec_lz4_blocks: c.codec_blocks[CodecTag::Lz4 as usize],
            codec_zstd_blocks: c.codec_blocks[CodecTag::Zstd as usize],
            codec: self.policy.to_string(),
            segment_size_bytes: self.sb.segment_size_bytes,
            segments_total: self.sb.segment_count(),
            segments_used: st.log.segments.count() - st.log.segments.free_count(),
            segments_free: st.log.segments.free_count(),
            live_bytes: live,
            dead_bytes: st.log.used_bytes().saturating_sub(live),
            estimated_free_logical_bytes: (usable as f64 * ratio(mapped, live).max(1.0)) as u64,
            worst_case_free_logical_bytes: usable / (BLOCK_SIZE_BYTES + RECORD_HEADER_BYTES as u64)
                * BLOCK_SIZE_BYTES,
            client_bytes_written: client,
            media_bytes_written: st.log.media_bytes_written,
            write_amplification: ratio(st.log.media_bytes_written, client),
            cleaner_policy: format!("{:?}", self.options.cleaner.policy),
            cleaner_segments_cleaned: cs.segments_cleaned.load(Ordering::Relaxed),
            cleaner_records_relocated: cs.records_relocated.load(Ordering::Relaxed),
            cleaner_bytes_relocated: cs.bytes_relocated.load(Ordering::Relaxed),
            segments_reclaimed: cs.segments_reclaimed.load(Ordering::Relaxed),
            corrupt_reads: self.corrupt_reads.load(Ordering::Relaxed),
            lost_bytes: c.lost_blocks * bs,
            map_memory_bytes: st.map.memory_bytes(),
            dedup: self.sb.dedup(),
            dedup_saved_bytes: st.shared.extra_refs * bs,
            compression_saved_bytes: ((c.data_blocks - st.shared.extra_refs) * bs)
                .saturating_sub(c.stored_payload_bytes),
            zero_saved_bytes: c.zero_blocks * bs,
            dedup_shared_records: st.shared.shared_count(),
            dedup_lookups: self.dedup_lookups.load(Ordering::Relaxed),
            dedup_hits: self.dedup_hits.load(Ordering::Relaxed),
            dedup_index_entries: ix.map_or(0, |i| i.entries),
            dedup_index_capacity: ix.map_or(0, |i| i.capacity()),
            dedup_index_memory_bytes: ix.map_or(0, |i| i.memory_bytes()),
            dedup_shared_table_bytes: st.shared.memory_bytes(),
            read_cache_hits: cache_hits,
            read_cache_misses: cache_misses,
            read_cache_hit_rate: ratio(cache_hits, cache_hits + cache_misses),
            codec_strong: self.policy.codec().to_string(),
            codec_none_bytes: c.stored_codec_bytes[CodecTag::None as usize],
            codec_lz4_bytes: c.stored_codec_bytes[CodecTag::Lz4 as usize],
            codec_zstd_bytes: c.stored_codec_bytes[CodecTag::Zstd as usize],
            unit_blocks: self.options.elastic.unit_blocks,
            units_written: get(&es.units_written),
            unit_blocks_written: get(&es.unit_blocks_written),
            probe_raw_blocks: get(&es.probe_raw_blocks),
            auto_lz4_units: get(&es.auto_lz4),
            auto_zstd_fast_units: get(&es.auto_zstd_fast),
            auto_zstd_strong_units: get(&es.auto_zstd_strong),
            load_iops: self.load.iops(),
            load_inflight: self.load.inflight() as u64,
            load_level: format!("{:?}", self.load.load(&self.options.elastic)).to_lowercase(),
            bytes_read: get(&es.bytes_read),
            bytes_decoded: get(&es.bytes_decoded),
            read_amplification: ratio(get(&es.bytes_decoded), get(&es.bytes_read)),
            unit_cache_hits: get(&es.unit_cache_hits),
            unit_cache_misses: get(&es.unit_cache_misses),
            recompress: self.policy.is_auto() && self.options.elastic.recompress,
            recompress_passes: get(&es.recompress_passes),
            recompressed_blocks: get(&es.recompressed_blocks),
            recompressed_bytes_before: get(&es.recompressed_bytes_before),
            recompressed_bytes_after: get(&es.recompressed_bytes_after),
            recompress_skipped_units: get(&es.recompress_skipped_units),
            checkpoint_generation: st.checkpoint_generation,
            last_seq: st.log.last_seq(),
            epoch: st.log.epoch,
            read_only: self.options.read_only,
            poisoned: self.poisoned.load(Ordering::SeqCst),
            scrub_runs: get(&self.scrub.finished_runs),
            scrub_blocks_checked: get(&self.scrub.blocks_checked_total),
            scrub_corrupt_blocks: get(&self.scrub.corrupt_blocks_total),
            scrub_last_finished_unix: get(&self.scrub.last_finished_unix),
            scrub_in_progress: scrub_now.is_some(),
            scrub_progress_blocks: scrub_now.as_ref().map_or(0, |p| p.blocks_checked),
            scrub_total_blocks: scrub_now.as_ref().map_or(0, |p| p.blocks_total),
        }
    }
}

/// Checks that map entry `e` (for `lba`) may point at the verified record
/// `h`, and returns the index of the block it names in it. A record's crc
/// includes its seq, so a stale or misdirected record fails here.
pub fn block_index(lba: u64, e: MapEntry, h: &RecordHeader) -> Result<usize, String> {
    let EntryState::Data { shared, unit, .. } = e.state_valid() else {
        return Err("map entry names no record".into());
    };
    let k = e.block_in(h.crc);
    let fits = if unit {
        h.nblocks >= 2 && k < h.nblocks
    } else {
        h.nblocks == 1 && k == 0
    };
    if !fits || h.kind != RecordKind::Data {
        return Err(format!(
            "record crc {:#010x} ({:?}, lba {}+{}) is not the one the map expects \
             ({:#010x}): stale or misdirected",
            h.crc, h.kind, h.lba, h.nblocks, e.crc
        ));
    }
    if h.nblocks > recovery::DATA_UNIT_BLOCKS_MAX {
        return Err(format!("data record of {} blocks", h.nblocks));
    }
    // A ref entry (dedup) may point at a record that names another LBA.
    if !shared && h.lba + u64::from(k) != lba {
        return Err(format!(
            "record holds lba {}+{} of kind {:?}, not lba {lba}",
            h.lba, h.nblocks, h.kind
        ));
    }
    Ok(k as usize)
}

impl DecodedUnit {
    /// Verifies and decompresses a whole DATA record.
    pub(crate) fn decode(rec: &[u8]) -> Result<DecodedUnit, String> {
        let (h, payload) = RecordHeader::decode_verified(rec).map_err(|e| e.to_string())?;
        if h.kind != RecordKind::Data || h.nblocks > recovery::DATA_UNIT_BLOCKS_MAX {
            return Err(format!(
                "not a data record: {:?} of {} blocks",
                h.kind, h.nblocks
            ));
        }
        let mut data = vec![0u8; h.nblocks as usize * BS];
        codec::decompress(h.codec, payload, &mut data)?;
        Ok(DecodedUnit { header: h, data })
    }

    /// Copies the block entry `e` (for `lba`) names, after the identity check.
    pub(crate) fn copy_block(&self, lba: u64, e: MapEntry, out: &mut [u8]) -> Result<(), String> {
        let k = block_index(lba, e, &self.header)?;
        out.copy_from_slice(&self.data[k * BS..(k + 1) * BS]);
        Ok(())
    }
}

/// Verifies a DATA record against the map entry that points at it and
/// decompresses the block for `lba` into `out`.
pub fn decode_block_record(
    lba: u64,
    e: MapEntry,
    rec: &[u8],
    out: &mut [u8],
) -> Result<(), String> {
    let (h, payload) = RecordHeader::decode_verified(rec).map_err(|e| e.to_string())?;
    let k = block_index(lba, e, &h)?;
    if h.nblocks == 1 {
        return codec::decompress(h.codec, payload, out);
    }
    let mut unit = vec![0u8; h.nblocks as usize * BS];
    codec::decompress(h.codec, payload, &mut unit)?;
    out.copy_from_slice(&unit[k * BS..(k + 1) * BS]);
    Ok(())
}

/// Encodes the map's non-unmapped entries as lz4-compressed chunk payloads.
fn encode_map_chunks(map: &BlockMap, raw_max: usize) -> Vec<Vec<u8>> {
    let mut chunks = Vec::new();
    let mut raw = Vec::new();
    let mut run: Vec<MapEntry> = Vec::new();
    let mut run_start = 0u64;
    map.for_each_mapped(|lba, e| {
        if !run.is_empty() && lba != run_start + run.len() as u64 {
            push_run(&mut raw, run_start, &run);
            run.clear();
        }
        if run.is_empty() {
            run_start = lba;
        }
        run.push(e);
        if raw.len() + run.len() * 12 >= raw_max {
            push_run(&mut raw, run_start, &run);
            run.clear();
            chunks.push(lz4_flex::block::compress_prepend_size(&raw));
            raw.clear();
        }
    });
    if !run.is_empty() {
        push_run(&mut raw, run_start, &run);
    }
    if !raw.is_empty() {
        chunks.push(lz4_flex::block::compress_prepend_size(&raw));
    }
    chunks
}

#[cfg(test)]
mod dedup_tests {
    use super::*;
    use cvol_storage::SimStorage;

    fn block(tag: u8) -> Vec<u8> {
        format!("block {tag} ").bytes().cycle().take(BS).collect()
    }

    /// A fingerprint collision (here planted in the index) must cost a
    /// missed dedup, never another block's data.
    #[test]
    fn a_colliding_fingerprint_is_caught_by_verification() {
        let sim = SimStorage::new(8 << 20);
        let opts = CreateOptions {
            logical_size_bytes: 1 << 20,
            physical_size_bytes: 8 << 20,
            codec: Codec::Lz4.into(),
            segment_size_bytes: 1 << 20,
            dedup: true,
        };
        let vol = Volume::create(Arc::new(sim), &opts).unwrap();
        let (a, b) = (block(1), block(2));
        vol.write_at(BS as u64, &b, false).unwrap();
        let b_entry = vol.lock_state().map.get(1);
        let fp_a = dedup::fingerprint(vol.dedup_seed.unwrap(), &a);
        vol.index
            .as_ref()
            .unwrap()
            .lock()
            .unwrap()
            .insert(fp_a, b_entry, 1);
        vol.write_at(2 * BS as u64, &a, false).unwrap();
        let mut got = vec![0u8; BS];
        vol.read_at(2 * BS as u64, &mut got).unwrap();
        assert!(got == a, "the colliding block must hold its own data");
        assert!(!vol.lock_state().map.get(2).same_record(&b_entry));
        assert_eq!(vol.stats().dedup_hits, 0);
        // A real duplicate still dedups.
        vol.write_at(3 * BS as u64, &b, false).unwrap();
        assert!(vol.lock_state().map.get(3).same_record(&b_entry));
        assert_eq!(vol.stats().dedup_hits, 1);
        vol.verify_refcounts().unwrap();
    }

    #[test]
    fn index_is_empty_after_reopen_until_warmed_up() {
        let sim = SimStorage::new(8 << 20);
        let opts = CreateOptions {
            logical_size_bytes: 1 << 20,
            physical_size_bytes: 8 << 20,
            codec: Codec::Lz4.into(),
            segment_size_bytes: 1 << 20,
            dedup: true,
        };
        let vol = Volume::create(Arc::new(sim.clone()), &opts).unwrap();
        for t in 0..8u8 {
            vol.write_at(u64::from(t) * BS as u64, &block(t), false)
                .unwrap();
        }
        vol.close().unwrap();
        drop(vol);
        let vol = Volume::open(Arc::new(sim.clone()), OpenOptions::default()).unwrap();
        vol.write_at(100 * BS as u64, &block(3), false).unwrap();
        assert_eq!(vol.stats().dedup_hits, 0, "a fresh index knows nothing");
        // 8 blocks on the volume; block 3 is known already (the copy just written).
        assert_eq!(vol.warm_index(), 7);
        vol.write_at(101 * BS as u64, &block(5), false).unwrap();
        assert_eq!(vol.stats().dedup_hits, 1);
        let (copy, original) = {
            let st = vol.lock_state();
            (st.map.get(101), st.map.get(5))
        };
        assert!(copy.same_record(&original));
        vol.verify_refcounts().unwrap();
    }
}
