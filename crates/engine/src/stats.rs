//! What `stat` reports (`VolumeStats`, its JSON keys a contract), and the
//! counters derived from the map (`MapCounters`), kept exact by `LiveMap`.
use cvol_format::{CodecTag, EntryState, MapEntry};
use serde::{Deserialize, Serialize};

/// Counters derived from the map; `add`/`remove` run on every map change.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MapCounters {
    pub data_blocks: u64,
    pub zero_blocks: u64,
    /// Blocks whose newest version repair could not salvage (read as EIO).
    pub lost_blocks: u64,
    pub codec_blocks: [u64; 3],
    /// Payload bytes of live records (what compression produced), each
    /// record once however many blocks share it; kept by `LiveMap` as
    /// records are born and die, not by `add`/`remove`.
    pub stored_payload_bytes: u64,
    /// `stored_payload_bytes` by the codec of the record.
    pub stored_codec_bytes: [u64; 3],
}

impl MapCounters {
    pub fn add(&mut self, e: MapEntry) {
        match e.state_valid() {
            EntryState::Unmapped => {}
            EntryState::Zero => self.zero_blocks += 1,
            EntryState::Lost => self.lost_blocks += 1,
            EntryState::Data { codec, .. } => {
                self.data_blocks += 1;
                self.codec_blocks[codec as usize] += 1;
            }
        }
    }

    /// Counts `e` out. Panics (never wraps) if it was not counted in: the
    /// books and the map disagree.
    pub fn remove(&mut self, e: MapEntry) {
        match e.state_valid() {
            EntryState::Unmapped => {}
            EntryState::Zero => decrement(&mut self.zero_blocks, 1, "zero blocks"),
            EntryState::Lost => decrement(&mut self.lost_blocks, 1, "lost blocks"),
            EntryState::Data { codec, .. } => {
                decrement(&mut self.data_blocks, 1, "data blocks");
                decrement(
                    &mut self.codec_blocks[codec as usize],
                    1,
                    "blocks of a codec",
                );
            }
        }
    }

    /// A record of `payload` bytes became live.
    pub fn record_born(&mut self, codec: CodecTag, payload: u64) {
        self.stored_payload_bytes += payload;
        self.stored_codec_bytes[codec as usize] += payload;
    }

    /// A record of `payload` bytes died. Panics (never wraps) on underflow.
    pub fn record_died(&mut self, codec: CodecTag, payload: u64) {
        decrement(&mut self.stored_payload_bytes, payload, "stored bytes");
        decrement(
            &mut self.stored_codec_bytes[codec as usize],
            payload,
            "stored bytes of a codec",
        );
    }
}

fn decrement(counter: &mut u64, by: u64, what: &str) {
    *counter = counter
        .checked_sub(by)
        .unwrap_or_else(|| panic!("{what} would go negative: {counter} - {by}"));
}

/// Per-codec block counts as they appear in `cvol stat --json`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CodecBlocks {
    pub none: u64,
    pub lz4: u64,
    pub zstd: u64,
}

/// What `cvol stat` reports. Field names are the JSON keys: a contract. The
/// sections are flattened, so the JSON is one flat object, in field order.
/// A server sends it as JSON over its control socket; `cvol stat` reads it
/// back into this struct (every key required).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct VolumeStats {
    pub logical_size_bytes: u64,
    pub physical_size_bytes: u64,
    /// Logical bytes holding non-zero data.
    pub mapped_bytes: u64,
    /// Logical bytes written as zeros (WRITE_ZEROES or all-zero blocks).
    pub zero_bytes: u64,
    /// Logical bytes never written or trimmed.
    pub unmapped_bytes: u64,
    /// Live payload bytes on media.
    pub stored_bytes: u64,
    /// Backing bytes occupied: metadata area plus every segment in use
    /// (free segments are returned to the host), i.e. what `du` of the
    /// backing file shows, give or take the open segment's unwritten tail
    /// and warm_free_bytes.
    /// (With a metadata device: both stores', the metadata device's label
    /// area and its segments in use included.)
    pub physical_used_bytes: u64,
    /// Free log bytes of the data store (room for client data).
    pub physical_free_bytes: u64,
    /// Free segments that still hold their host space: kept for the log
    /// head to write over (cheaper for the host than filling holes), at
    /// most 512 MiB or 1/16 of the data store, returned once clients are
    /// idle for a second and at close. `du` of the backing may exceed
    /// physical_used_bytes by this much meanwhile.
    pub warm_free_bytes: u64,
    /// The metadata device's path: where it was opened
    /// (`OpenOptions::metadata_device_path`), else as recorded at create;
    /// null without one.
    pub metadata_device: Option<String>,
    /// Bytes of the metadata device the volume uses (label area and
    /// segments; 0 without one).
    pub metadata_size_bytes: u64,
    /// Metadata device bytes occupied (label area and segments in use).
    pub metadata_used_bytes: u64,
    /// Metadata device bytes free for map records and checkpoints.
    pub metadata_free_bytes: u64,
    /// mapped_bytes / physical_used_bytes: logical data per byte the host
    /// holds (1.0 for a volume holding no data).
    pub reduction_ratio: f64,
    /// Unique data bytes (mapped_bytes less dedup_saved_bytes) /
    /// stored_bytes: what the codec alone achieves, dedup savings excluded
    /// (1.0 with nothing stored).
    pub compression_ratio: f64,
    pub blocks_by_codec: CodecBlocks,
    pub codec_none_blocks: u64,
    pub codec_lz4_blocks: u64,
    pub codec_zstd_blocks: u64,
    pub codec: String,
    pub segment_size_bytes: u64,
    pub segments_total: u64,
    pub segments_used: u64,
    pub segments_free: u64,
    /// Bytes of live records (headers included) in the log.
    pub live_bytes: u64,
    /// Log bytes occupied by dead records, old checkpoints, padding and segment tails.
    pub dead_bytes: u64,
    /// The part of dead_bytes idle cleaning would return to the host now:
    /// the dead space of sealed segments at most 90% live.
    pub reclaimable_bytes: u64,
    /// Bytes the host has allocated for the backing file (its `du`, from
    /// st_blocks); null for a block device.
    pub host_allocated_bytes: Option<u64>,
    /// More logical data that fits at the current compression ratio...
    pub estimated_free_logical_bytes: u64,
    /// ...and if nothing more compresses (the conservative figure).
    pub worst_case_free_logical_bytes: u64,
    #[serde(flatten)]
    pub space: SpaceStats,
    pub client_bytes_written: u64,
    pub media_bytes_written: u64,
    /// media_bytes_written / client_bytes_written since the server started.
    pub write_amplification: f64,
    /// 4 KiB pages of the store written per 4 KiB block clients wrote
    /// (the flash figure of [SSD-packing]; the log writes each page once, but for
    /// the zeros ahead of its head, so it is the write amplification in
    /// pages).
    pub pages_written_per_block: f64,
    /// Log bytes holding no record since open: flush padding to a sector,
    /// page padding (packing page, page-sorted), tails of segments sealed
    /// early.
    pub padding_bytes: u64,
    /// Zeros written past the log head since open, so that the flushes
    /// after them write over space the host holds (a backing file only;
    /// counted in media_bytes_written too).
    pub zero_ahead_bytes: u64,
    /// How records are laid out: compact, page or page-sorted (`--packing`).
    pub packing: String,
    /// The AEAD every record is sealed with (`--encryption`), or "none".
    pub encryption: String,
    #[serde(flatten)]
    pub cleaner: CleanerStats,
    pub corrupt_reads: u64,
    /// Logical bytes whose newest version `cvol check --repair` could not
    /// salvage: they read as EIO until written again.
    pub lost_bytes: u64,
    pub map_memory_bytes: u64,
    /// Block map memory per mapped block (bytes).
    pub map_bytes_per_mapped_block: f64,
    /// Map page lookups served from memory and read from the log, the
    /// bytes of the pages in memory, pages dropped from memory, and pages
    /// changed since the last checkpoint (`--map-cache`).
    pub map_cache_hits: u64,
    pub map_cache_misses: u64,
    pub map_cache_bytes: u64,
    pub map_cache_evictions: u64,
    pub map_dirty_pages: u64,
    /// Map records (pages, directory blocks) the cleaner found live in its
    /// victims and had the next checkpoint write again.
    pub map_records_moved: u64,
    #[serde(flatten)]
    pub dedup: DedupStats,
    #[serde(flatten)]
    pub elastic: ElasticStats,
    pub checkpoint_generation: u64,
    /// Checkpoints written since open, and the last one's log bytes (map
    /// chunks and commit) and duration from snapshot to published pointer.
    pub checkpoints_written: u64,
    pub checkpoint_last_bytes: u64,
    pub checkpoint_last_seconds: f64,
    /// Times the fingerprint rows in memory were written as their tables
    /// between checkpoints (without rewriting the dirty map pages), and
    /// the log bytes those tables took.
    pub fingerprint_spills: u64,
    pub fingerprint_spill_bytes: u64,
    pub last_seq: u64,
    pub epoch: u32,
    pub read_only: bool,
    pub poisoned: bool,
    #[serde(flatten)]
    pub scrub: ScrubStats,
    #[serde(flatten)]
    pub cache: CacheStats,
    #[serde(flatten)]
    pub object: ObjectStoreStats,
    #[serde(flatten)]
    pub memory: MemoryStats,
}

/// The memory of the process holding the volume.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MemoryStats {
    /// Memory the process holds, by use (from the engine's and the
    /// allocator's own counts): the parts add up to `total`.
    pub memory_bytes: MemoryBytes,
    /// The process's resident set size, for comparison with
    /// `memory_bytes.total` (pages the allocator keeps free, code and
    /// stacks make the difference).
    pub rss_bytes: u64,
    /// Bytes the allocator keeps free for reuse (not in `memory_bytes`).
    pub allocator_free_bytes: u64,
}

/// `memory_bytes`: heap memory by use. Every part is what the engine
/// counts for it, except `other`: what the allocator has handed out
/// beyond the counted parts (requests being worked on, stacks of
/// tables being built, small structures). `total` is their sum.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryBytes {
    pub total: u64,
    /// Map pages in memory (bounded by `--map-cache`), the directory and
    /// the bitmaps (`map_memory_bytes`).
    pub map: u64,
    /// The dedup index (`--dedup-memory`).
    pub dedup_index: u64,
    /// The shared-record table (`dedup_shared_table_bytes`).
    pub dedup_shared: u64,
    /// Fingerprint rows waiting for their table (spilled beyond 32 MiB).
    pub fingerprint_rows: u64,
    /// Decompressed blocks (`--read-cache`).
    pub read_cache: u64,
    /// Decompressed units (at most 8 MiB).
    pub unit_cache: u64,
    /// The open segment's buffer(s).
    pub segment_buffers: u64,
    /// NBD request payload held by the server (`--max-buffered`).
    pub nbd_buffers: u64,
    /// The rest of what the allocator handed out.
    pub other: u64,
}

impl MemoryBytes {
    /// The counted parts, `other` set to what the allocator reports in
    /// use beyond them, `total` to the sum.
    pub fn with_allocated(mut self, allocated: u64) -> MemoryBytes {
        self.total = 0;
        self.other = 0;
        let counted = self.sum();
        self.other = allocated.saturating_sub(counted);
        self.total = self.sum();
        self
    }

    /// The sum of the parts.
    pub fn sum(&self) -> u64 {
        let MemoryBytes {
            total: _,
            map,
            dedup_index,
            dedup_shared,
            fingerprint_rows,
            read_cache,
            unit_cache,
            segment_buffers,
            nbd_buffers,
            other,
        } = self;
        map + dedup_index
            + dedup_shared
            + fingerprint_rows
            + read_cache
            + unit_cache
            + segment_buffers
            + nbd_buffers
            + other
    }
}

/// A volume kept in an object store (`cvol create s3://...`): zeros and a
/// null `object_store` for a volume on local media. Counts since the
/// server started.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ObjectStoreStats {
    /// The volume's address, `s3://BUCKET/PREFIX` (null: local media).
    pub object_store: Option<String>,
    /// Objects the volume keeps in the store (chunks, deltas, manifest).
    pub object_count: u64,
    /// Bytes of those objects.
    pub object_bytes: u64,
    pub object_gets: u64,
    pub object_get_bytes: u64,
    pub object_puts: u64,
    pub object_put_bytes: u64,
    pub object_deletes: u64,
    /// Reads served by the local cache alone, and reads that needed a GET.
    pub object_cache_hits: u64,
    pub object_cache_misses: u64,
    /// hits / (hits + misses); 0 before the first read.
    pub object_cache_hit_ratio: f64,
    /// Bytes the local cache file holds, and may hold (`--cache-size`).
    pub object_cache_bytes: u64,
    pub object_cache_limit_bytes: u64,
    pub object_cache_evictions: u64,
    /// This server's epoch (fencing), and the number of its last delta.
    pub object_epoch: u64,
    pub object_seq: u64,
}

impl ObjectStoreStats {
    pub fn from_storage(s: Option<cvol_storage::ObjectStats>) -> ObjectStoreStats {
        let Some(s) = s else {
            return ObjectStoreStats::default();
        };
        let lookups = s.cache_hits + s.cache_misses;
        ObjectStoreStats {
            object_store: Some(s.url),
            object_count: s.objects,
            object_bytes: s.bytes,
            object_gets: s.gets,
            object_get_bytes: s.get_bytes,
            object_puts: s.puts,
            object_put_bytes: s.put_bytes,
            object_deletes: s.deletes,
            object_cache_hits: s.cache_hits,
            object_cache_misses: s.cache_misses,
            object_cache_hit_ratio: if lookups == 0 {
                0.0
            } else {
                s.cache_hits as f64 / lookups as f64
            },
            object_cache_bytes: s.cache_bytes,
            object_cache_limit_bytes: s.cache_limit_bytes,
            object_cache_evictions: s.cache_evictions,
            object_epoch: s.epoch,
            object_seq: s.seq,
        }
    }
}

/// A cache volume in front of an origin (`crate::cache`): zeros and a null
/// `cache` for an ordinary volume. Counts are of 4 KiB blocks since the
/// server started.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CacheStats {
    /// Blocks read served from the cache.
    pub cache_hits: u64,
    /// Blocks read the cache did not hold (read from the origin).
    pub cache_misses: u64,
    /// hits / (hits + misses); 0 before the first read.
    pub cache_hit_ratio: f64,
    /// Bytes written into the cache by fills after misses.
    pub cache_fill_bytes: u64,
    /// Lines evicted (to keep the cache within its physical size).
    pub cache_evictions: u64,
    pub origin_bytes_read: u64,
    pub origin_bytes_written: u64,
    /// Bytes of lines written to the cache but not yet to the origin
    /// (write-back; whole lines).
    pub cache_dirty_bytes: u64,
    /// The origin and mode (null for an ordinary volume).
    pub cache: Option<CacheInfo>,
}

/// What a cache volume's label says.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CacheInfo {
    /// The origin as given at create: a path or an NBD URI.
    pub origin: String,
    /// `write-through` or `write-back`.
    pub mode: String,
    pub line_size_bytes: u64,
    pub origin_size_bytes: u64,
    /// How the served cache started: `warm`, `cold` (empty: a new cache, a
    /// changed origin or a crash in write-through), `recovered` (write-back
    /// after a crash: every cached line counted dirty), or `offline`.
    pub start: String,
}

/// Space pressure: what the volume does about room.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SpaceStats {
    /// How short of room the log is: `none`; `cleaning` (free segments
    /// below the cleaner's start threshold: it collects dead space and
    /// compacts units while clients write, without waiting for them to
    /// pause once below half the threshold); `writers-waiting` (writes are
    /// waiting for the cleaner to make room now).
    pub space_pressure: String,
    /// Live bytes of raw units that deferred compression wrote since the
    /// server started and nothing has compressed yet: what deferral
    /// borrowed (compressed in the background when idle, or by the cleaner
    /// when space runs short)...
    pub deferred_pending_bytes: u64,
    /// ...and whether deferral may write more now (a quarter of the
    /// segments free and what it borrowed at most half the usable room).
    pub deferral_room: bool,
    /// Log bytes cleaning is expected to save besides the dead bytes, by
    /// compacting units (partly overwritten units rewritten as their live
    /// blocks, deferred raw units compressed); counted as free in
    /// estimated_free_logical_bytes.
    pub compactable_bytes: u64,
}

/// The cleaner: its policy and what it did since open.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CleanerStats {
    pub cleaner_policy: String,
    pub cleaner_segments_cleaned: u64,
    pub cleaner_records_relocated: u64,
    pub cleaner_bytes_relocated: u64,
    pub segments_reclaimed: u64,
    /// Idle cleaning is on for this server (`serve --idle-clean`).
    pub idle_clean: bool,
    /// Idle cleaning passes that moved data since open (also counted in
    /// cleaner_segments_cleaned and cleaner_bytes_relocated)...
    pub idle_clean_passes: u64,
    /// ...and the live bytes they moved: their write amplification.
    pub idle_clean_bytes_relocated: u64,
    /// Searches for the LBAs holding a victim's records that dedup
    /// references share, and the map pages they scanned: only the pages
    /// whose reference summary may name the victim, and its owners'.
    pub cleaner_holder_scans: u64,
    pub cleaner_holder_pages_scanned: u64,
    /// Units the cleaner rewrote smaller as it moved them (live blocks
    /// only, or deferred raw units compressed), and the log bytes saved.
    pub cleaner_units_compacted: u64,
    pub cleaner_compaction_saved_bytes: u64,
    /// Times a write waited for cleaning to make room (each a turn of
    /// foreground cleaning), and writes refused for space (ENOSPC: the
    /// live data, compacted, does not fit).
    pub space_waits: u64,
    pub space_refusals: u64,
}

/// Deduplication, what each kind of reduction saved, and the read cache
/// (which also serves dedup verification).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct DedupStats {
    /// Inline deduplication is on for this volume.
    pub dedup: bool,
    /// Logical bytes served by records shared with other blocks
    /// (sum over shared records of (references - 1) * 4096).
    pub dedup_saved_bytes: u64,
    /// mapped_bytes / unique data bytes (mapped_bytes - dedup_saved_bytes):
    /// what dedup alone achieves (1.0 with no data).
    pub dedup_ratio: f64,
    /// Logical bytes saved by compression: unique data blocks * 4096 - stored_bytes.
    pub compression_saved_bytes: u64,
    /// Logical bytes that cost nothing because they are zeros (= zero_bytes).
    pub zero_saved_bytes: u64,
    /// Records referenced by more than one block.
    pub dedup_shared_records: u64,
    /// Non-zero blocks looked up in the fingerprint index since open.
    pub dedup_lookups: u64,
    /// ...of which became references to stored data.
    pub dedup_hits: u64,
    pub dedup_index_entries: u64,
    pub dedup_index_capacity: u64,
    /// RAM of the fingerprint index (within the configured budget).
    pub dedup_index_memory_bytes: u64,
    /// RAM of the table of shared records (grows with shared data).
    pub dedup_shared_table_bytes: u64,
    /// Fingerprints the index warm-up took from the persisted fingerprint
    /// tables since open (no data read).
    pub dedup_warm_table_fingerprints: u64,
    /// Blocks the index warm-up read and hashed since open (volumes, or
    /// segments, without fingerprint tables).
    pub dedup_warm_data_blocks: u64,
    /// Distinct data the index can find again, by locality (a copy of
    /// old data in about the order it was written): the hot index's
    /// blocks, or each hook standing for 2^k blocks of its table, at most
    /// the distinct blocks stored. Single blocks rewritten in random order
    /// are found only in the hot part (`dedup_window_hot_bytes`).
    pub dedup_window_bytes: u64,
    /// Distinct data the exact hot index finds in any order.
    pub dedup_window_hot_bytes: u64,
    /// The hook index: sampled fingerprints (1 in 2^k) pointing at the
    /// fingerprint table that holds their row.
    pub dedup_hook_entries: u64,
    pub dedup_hook_capacity: u64,
    /// k: a block is a hook when the top k bits of its fingerprint are 0.
    pub dedup_hook_sample_log2: u64,
    pub dedup_hook_memory_bytes: u64,
    /// Blocks that missed the hot index and the cached tables and were
    /// sampled, so the hooks were asked; of which found a table / did not.
    pub dedup_hook_lookups: u64,
    pub dedup_hook_hits: u64,
    pub dedup_hook_misses: u64,
    /// Hooks whose table no longer held the block (forgotten).
    pub dedup_hook_stale: u64,
    /// Hooks pushed out of a full bucket, and raises of k.
    pub dedup_hook_evictions: u64,
    pub dedup_hook_sweeps: u64,
    /// The hook index is at its sparsest and 75% full: new hooks replace
    /// the least used ones (the window slides); writes never wait.
    pub dedup_hooks_full: bool,
    /// "loading" while the persisted fingerprint tables are replayed into
    /// the hook index after open, then "ready".
    pub dedup_hook_load: String,
    pub dedup_hook_replayed_tables: u64,
    /// Hooks taken from the persisted hook snapshot at open (entries whose
    /// table has not changed since it was written).
    pub dedup_hook_snapshot_entries: u64,
    /// Snapshots of the hook index written since open, their bytes, and
    /// those skipped (no room in the log beside the checkpoint reserve, or
    /// an index too large to persist).
    pub dedup_hook_snapshots: u64,
    pub dedup_hook_snapshot_bytes: u64,
    pub dedup_hook_snapshot_skipped: u64,
    /// Blocks whose candidate came from a cached table / blocks that
    /// missed the hot index and every cached table.
    pub dedup_table_cache_hits: u64,
    pub dedup_table_cache_misses: u64,
    /// Fingerprint tables loaded for lookups (hook hits and successors),
    /// of which successors of a table a run of duplicates went through;
    /// tables that could not be read or decoded.
    pub dedup_table_reads: u64,
    pub dedup_table_prefetches: u64,
    pub dedup_table_read_errors: u64,
    /// dedup_table_reads / dedup_lookups.
    pub dedup_table_reads_per_lookup: f64,
    pub dedup_table_cache_tables: u64,
    pub dedup_table_cache_bytes: u64,
    /// dedup_hits of stored records by where the candidate came from.
    pub dedup_hits_hot: u64,
    pub dedup_hits_table: u64,
    /// Candidates whose stored bytes differed, or whose record was no
    /// longer live at commit: stored as new data.
    pub dedup_verify_rejects: u64,
    pub read_cache_hits: u64,
    pub read_cache_misses: u64,
    /// hits / (hits + misses), 0 when nothing was read.
    pub read_cache_hit_rate: f64,
}

/// Elastic compression: codecs chosen, units, load, read amplification,
/// background recompression.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ElasticStats {
    /// The strong (idle, background) codec of `auto`, or the fixed codec.
    pub codec_strong: String,
    /// Stored payload bytes of live records by codec.
    pub codec_none_bytes: u64,
    pub codec_lz4_bytes: u64,
    pub codec_zstd_bytes: u64,
    /// Blocks per merged compression unit (serve --unit-size / 4096).
    pub unit_blocks: u32,
    /// Multi-block units written by client writes since open, and their blocks.
    pub units_written: u64,
    pub unit_blocks_written: u64,
    /// Blocks written raw because the compressibility probe judged them
    /// incompressible (since open).
    pub probe_raw_blocks: u64,
    /// Units (and their blocks) stored raw since open because inline
    /// compression had used its CPU budget while busy: compressed later
    /// by background recompression.
    pub deferred_units: u64,
    pub deferred_blocks: u64,
    /// The CPU budget of inline compression while busy, percent of all
    /// cores (serve --inline-cpu); null: always compress inline.
    pub inline_cpu_percent: Option<u32>,
    /// Units the auto policy gave lz4 (busy), zstd:1 (medium), the strong
    /// zstd level (idle), since open.
    pub auto_lz4_units: u64,
    pub auto_zstd_fast_units: u64,
    pub auto_zstd_strong_units: u64,
    /// Of `auto_lz4_units`, those given the busy codec because the
    /// machine's CPU was at least `busy_cpu_percent` busy while the I/O
    /// load was not busy.
    pub auto_cpu_busy_units: u64,
    /// Load as the auto policy sees it now: 4 KiB-normalised requests in
    /// the last second, requests in the engine, and the resulting level.
    pub load_iops: u64,
    pub load_inflight: u64,
    pub load_level: String,
    /// The machine's CPU, percent of all cores busy over about the last
    /// second (every process), as the auto policy sees it; null where the
    /// server reads no CPU gauge.
    pub load_cpu_percent: Option<u32>,
    /// The CPU busy percent from which compressible writes get the busy
    /// codec (serve --busy-cpu); null: off.
    pub busy_cpu_percent: Option<u32>,
    /// Client reads since open, the 4 KiB pages of the store they read
    /// (cached blocks read none; a record straddling a page boundary reads
    /// both), and pages per read ([SSD-packing]'s read amplification in pages).
    pub client_reads: u64,
    pub store_pages_read: u64,
    pub pages_read_per_read: f64,
    /// Read amplification: bytes decompressed to serve reads / bytes read.
    pub bytes_read: u64,
    pub bytes_decoded: u64,
    pub read_amplification: f64,
    pub unit_cache_hits: u64,
    pub unit_cache_misses: u64,
    /// Background recompression since open: passes, blocks rewritten,
    /// their stored bytes before and after, units left alone (no gain or
    /// changed under it).
    pub recompress: bool,
    pub recompress_passes: u64,
    pub recompressed_blocks: u64,
    pub recompressed_bytes_before: u64,
    pub recompressed_bytes_after: u64,
    pub recompress_skipped_units: u64,
    /// Candidate windows left alone (counted per pass) because idle
    /// cleaning could not collect what their rewrite frees.
    pub recompress_uncollectable_windows: u64,
}

/// Scrubs since open.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ScrubStats {
    /// Scrubs finished since open (`cvol scrub`), data blocks they verified,
    /// and blocks they found corrupt (counted apart from `corrupt_reads`,
    /// which counts client reads refused).
    pub scrub_runs: u64,
    pub scrub_blocks_checked: u64,
    pub scrub_corrupt_blocks: u64,
    /// Unix seconds when the last scrub finished (0: none since open).
    pub scrub_last_finished_unix: u64,
    /// A scrub is running: blocks verified so far of the data blocks
    /// mapped when it started (both 0 when none runs).
    pub scrub_in_progress: bool,
    pub scrub_progress_blocks: u64,
    pub scrub_total_blocks: u64,
}

impl CodecBlocks {
    pub fn from_counts(c: &[u64; 3]) -> CodecBlocks {
        CodecBlocks {
            none: c[CodecTag::None as usize],
            lz4: c[CodecTag::Lz4 as usize],
            zstd: c[CodecTag::Zstd as usize],
        }
    }
}
