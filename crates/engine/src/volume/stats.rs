//! The counters of what happened since open (everything `stat` shows that
//! is not derived from the map), and `Volume::stats`.
use super::jobs::cleaner::CleanerStats as CleanerCounters;
use super::jobs::recompress::RecompressReport;
use super::{space, State, Volume};
use crate::policy::Load;
use crate::segments::Region;
use crate::stats::{CleanerStats, CodecBlocks, DedupStats, ElasticStats, ScrubStats, SpaceStats};
use crate::stats::{MemoryBytes, MemoryStats, VolumeStats};
use cvol_format::{CodecTag, BLOCK_SIZE_BYTES};
use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of client I/O, dedup, caches and background work since open.
#[derive(Debug, Default)]
pub(in crate::volume) struct Counters {
    pub(in crate::volume) client_bytes_written: AtomicU64,
    pub(in crate::volume) corrupt_reads: AtomicU64,
    pub(in crate::volume) dedup_lookups: AtomicU64,
    pub(in crate::volume) dedup_hits: AtomicU64,
    pub(in crate::volume) warm_table_fingerprints: AtomicU64,
    pub(in crate::volume) warm_data_blocks: AtomicU64,
    pub(in crate::volume) window: super::window::WindowCounters,
    pub(in crate::volume) read_cache_hits: AtomicU64,
    pub(in crate::volume) read_cache_misses: AtomicU64,
    pub(in crate::volume) elastic: ElasticCounters,
    pub(in crate::volume) cleaner: CleanerCounters,
    pub(in crate::volume) checkpoints: AtomicU64,
    pub(in crate::volume) checkpoint_last_bytes: AtomicU64,
    /// Log bytes of every checkpoint since open (cleaning's cost).
    pub(in crate::volume) checkpoint_bytes_total: AtomicU64,
    pub(in crate::volume) checkpoint_last_micros: AtomicU64,
    /// Fingerprint tables written between checkpoints: spills, bytes.
    pub(in crate::volume) fp_spills: AtomicU64,
    pub(in crate::volume) fp_spill_bytes: AtomicU64,
    pub(in crate::volume) map_records_moved: AtomicU64,
    /// Turns writers spent waiting for the cleaner to make room, and
    /// writes refused for space (ENOSPC).
    pub(in crate::volume) space_waits: AtomicU64,
    pub(in crate::volume) space_refusals: AtomicU64,
}

/// Counters of elastic compression, for `stat`.
#[derive(Debug, Default)]
pub(in crate::volume) struct ElasticCounters {
    /// Blocks the probe sent to storage raw, uncompressed.
    pub(in crate::volume) probe_raw_blocks: AtomicU64,
    /// Units (records) the auto policy compressed with lz4 / zstd:1 / zstd:3.
    auto_lz4: AtomicU64,
    auto_zstd_fast: AtomicU64,
    auto_zstd_strong: AtomicU64,
    /// Of the busy-codec units, those the I/O load alone would have given
    /// zstd: the machine's CPU was busy (`busy_cpu_percent`).
    pub(in crate::volume) auto_cpu_busy: AtomicU64,
    /// Units stored raw because inline compression was over its CPU
    /// budget (deferred to background recompression), and their blocks.
    pub(in crate::volume) deferred_units: AtomicU64,
    pub(in crate::volume) deferred_blocks: AtomicU64,
    /// Multi-block units written by client writes, and their blocks.
    pub(in crate::volume) units_written: AtomicU64,
    pub(in crate::volume) unit_blocks_written: AtomicU64,
    /// Read path: client reads, bytes served, bytes decompressed to serve
    /// them, 4 KiB pages of the store read for them.
    pub(in crate::volume) client_reads: AtomicU64,
    pub(in crate::volume) store_pages_read: AtomicU64,
    pub(in crate::volume) bytes_read: AtomicU64,
    pub(in crate::volume) bytes_decoded: AtomicU64,
    pub(in crate::volume) unit_cache_hits: AtomicU64,
    pub(in crate::volume) unit_cache_misses: AtomicU64,
    /// Background recompression.
    recompress_passes: AtomicU64,
    recompressed_blocks: AtomicU64,
    recompressed_bytes_before: AtomicU64,
    recompressed_bytes_after: AtomicU64,
    recompress_skipped_units: AtomicU64,
    recompress_uncollectable: AtomicU64,
}

fn get(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

/// More logical data that fits at the current ratio: the usable bytes,
/// and the room deferred raw units and partly overwritten units hold that
/// cleaning gives back, at the ratio the data will reach once compacted.
fn estimated_free(usable: u64, compactable: u64, mapped: u64, live: u64) -> u64 {
    ((usable + compactable) as f64 * ratio(mapped, live.saturating_sub(compactable)).max(1.0))
        as u64
}

/// a / b, or 1.0 when there is nothing to reduce (a is 0).
fn ratio_or_one(a: u64, b: u64) -> f64 {
    if a == 0 {
        1.0
    } else {
        ratio(a, b)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

impl ElasticCounters {
    /// The auto policy chose a codec for a unit under `load`.
    pub(in crate::volume) fn count_auto_choice(&self, load: Load) {
        match load {
            Load::Busy => &self.auto_lz4,
            Load::Medium => &self.auto_zstd_fast,
            Load::Idle => &self.auto_zstd_strong,
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    pub(in crate::volume) fn count_recompress_pass(&self, rep: &RecompressReport) {
        let add = |a: &AtomicU64, n: u64| a.fetch_add(n, Ordering::Relaxed);
        add(&self.recompress_passes, 1);
        add(&self.recompressed_blocks, rep.blocks_rewritten);
        add(&self.recompressed_bytes_before, rep.bytes_before);
        add(&self.recompressed_bytes_after, rep.bytes_after);
        add(&self.recompress_skipped_units, rep.skipped);
        add(&self.recompress_uncollectable, rep.uncollectable);
    }
}

/// What the metadata device holds (all zeros without one).
struct MetadataUse {
    path: Option<String>,
    size: u64,
    used: u64,
    free: u64,
}

impl Volume {
    /// The logical size statistics report: a pool's volumes' total, else
    /// the superblock's.
    fn reported_logical_bytes(&self) -> u64 {
        let reported = *self
            .reported_logical
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        reported.unwrap_or(self.sb.logical_size_bytes)
    }

    fn metadata_use(&self, st: &State) -> MetadataUse {
        if !self.sb.has_metadata_device() {
            return MetadataUse {
                path: None,
                size: 0,
                used: 0,
                free: 0,
            };
        }
        let label = cvol_format::metadev::METADATA_DATA_OFFSET_BYTES;
        let segments = u64::from(self.sb.metadata_segments) * self.sb.segment_size_bytes;
        MetadataUse {
            path: (self.options.metadata_device_path.clone())
                .or_else(|| super::metadev::recorded_metadata_path(&*self.storage)),
            size: label + segments,
            used: self.metadata_used_bytes(st),
            free: st.log.meta_free_bytes(),
        }
    }

    /// Bytes of the metadata device in use (0 without one).
    fn metadata_used_bytes(&self, st: &State) -> u64 {
        match self.sb.has_metadata_device() {
            true => cvol_format::metadev::METADATA_DATA_OFFSET_BYTES + st.log.meta_used_bytes(),
            false => 0,
        }
    }

    /// `physical_used_bytes`: the superblock area, the data log's occupied
    /// segments and the metadata device's.
    fn physical_used_bytes(&self, st: &State) -> u64 {
        self.sb.data_offset_bytes + st.log.used_bytes() + self.metadata_used_bytes(st)
    }

    /// What the host holds for the volume as far as the engine can tell
    /// (`du` of a backing file but for the zeros ahead of the log head):
    /// `physical_used_bytes` and the free segments kept warm, whose space
    /// is returned only when clients have been idle a while.
    pub(in crate::volume) fn host_held_bytes(&self, st: &State) -> u64 {
        let warm = st.log.segments.warm_count() * self.sb.segment_size_bytes;
        self.physical_used_bytes(st) + warm
    }

    /// What `stat` shows. Reads through a poisoned lock (the numbers of a
    /// volume that stopped may be half-updated; `poisoned` says so).
    pub fn stats(&self) -> VolumeStats {
        let st = self.state.lock_for_report();
        let (c, bs) = (st.live.counters(), BLOCK_SIZE_BYTES);
        let (mapped, zero) = (c.data_blocks * bs, c.zero_blocks * bs);
        let unique = (c.data_blocks - st.live.shared().extra_refs) * bs;
        let (logical, meta) = (self.reported_logical_bytes(), self.metadata_use(&st));
        let used = self.physical_used_bytes(&st);
        let live = st.live.usage().total_live_bytes();
        let (usable, compactable) = (self.usable_bytes(&st), self.compactable_bytes(&st));
        let (client, segs) = (get(&self.counters.client_bytes_written), &st.log.segments);
        let (lost, cache) = (c.lost_blocks * bs, st.live.map().cache_counts());
        VolumeStats {
            logical_size_bytes: logical,
            physical_size_bytes: self.sb.physical_size_bytes,
            mapped_bytes: mapped,
            zero_bytes: zero,
            unmapped_bytes: logical.saturating_sub(mapped + zero + lost),
            stored_bytes: c.stored_payload_bytes,
            physical_used_bytes: used,
            physical_free_bytes: st.log.free_bytes(),
            warm_free_bytes: segs.warm_count() * self.sb.segment_size_bytes,
            metadata_device: meta.path,
            metadata_size_bytes: meta.size,
            metadata_used_bytes: meta.used,
            metadata_free_bytes: meta.free,
            reduction_ratio: ratio_or_one(mapped, used),
            compression_ratio: ratio_or_one(unique, c.stored_payload_bytes),
            blocks_by_codec: CodecBlocks::from_counts(&c.codec_blocks),
            codec_none_blocks: c.codec_blocks[CodecTag::None as usize],
            codec_lz4_blocks: c.codec_blocks[CodecTag::Lz4 as usize],
            codec_zstd_blocks: c.codec_blocks[CodecTag::Zstd as usize],
            codec: self.policy.to_string(),
            segment_size_bytes: self.sb.segment_size_bytes,
            segments_total: self.sb.segment_count(),
            segments_used: segs.count() - segs.free_count() - segs.free_in(Region::Meta),
            segments_free: segs.free_count() + segs.free_in(Region::Meta),
            live_bytes: live,
            dead_bytes: (st.log.used_bytes() + st.log.meta_used_bytes()).saturating_sub(live),
            reclaimable_bytes: self.idle_reclaimable_bytes(&st),
            host_allocated_bytes: self.storage.allocated_bytes(),
            estimated_free_logical_bytes: estimated_free(usable, compactable, mapped, live),
            worst_case_free_logical_bytes: space::worst_case_free_logical_bytes(usable),
            space: self.space_stats(&st, compactable),
            client_bytes_written: client,
            media_bytes_written: st.log.media_bytes_written,
            write_amplification: ratio(st.log.media_bytes_written, client),
            pages_written_per_block: ratio(st.log.media_bytes_written, client), // pages: once each
            padding_bytes: st.log.padding_bytes,
            zero_ahead_bytes: st.log.zero_ahead_bytes,
            packing: self.sb.packing().name().into(),
            encryption: self.encryption_name().into(),
            cleaner: self.cleaner_stats(),
            corrupt_reads: get(&self.counters.corrupt_reads),
            lost_bytes: lost,
            map_memory_bytes: st.live.map().memory_bytes(),
            map_bytes_per_mapped_block: ratio(st.live.map().memory_bytes(), c.data_blocks),
            map_cache_hits: cache.hits,
            map_cache_misses: cache.misses,
            map_cache_bytes: st.live.map().cache_bytes(),
            map_cache_evictions: cache.evictions,
            map_dirty_pages: st.live.map().dirty_pages() as u64,
            map_records_moved: get(&self.counters.map_records_moved),
            dedup: self.dedup_stats(&st),
            elastic: self.elastic_stats(&st),
            checkpoint_generation: st.checkpoint_generation,
            checkpoints_written: get(&self.counters.checkpoints),
            checkpoint_last_bytes: get(&self.counters.checkpoint_last_bytes),
            checkpoint_last_seconds: get(&self.counters.checkpoint_last_micros) as f64 / 1e6,
            fingerprint_spills: get(&self.counters.fp_spills),
            fingerprint_spill_bytes: get(&self.counters.fp_spill_bytes),
            last_seq: st.log.last_seq(),
            epoch: st.log.epoch,
            read_only: self.options.read_only,
            poisoned: self.poisoned.load(Ordering::SeqCst),
            scrub: self.scrub_stats(),
            cache: self.cache_stats(),
            object: crate::stats::ObjectStoreStats::from_storage(self.storage.object_stats()),
            memory: self.memory_stats(&st),
        }
    }

    /// `memory_bytes` and what the kernel and the allocator say.
    fn memory_stats(&self, st: &State) -> MemoryStats {
        MemoryStats {
            memory_bytes: self.memory_bytes(st),
            rss_bytes: crate::memory::process_rss_bytes(),
            allocator_free_bytes: crate::memory::allocator_bytes().free,
        }
    }

    /// `memory_bytes`: what each part holds by the engine's own counts,
    /// the rest of what the allocator handed out as `other`.
    fn memory_bytes(&self, st: &State) -> MemoryBytes {
        let index = self.dedup.as_ref().map(|d| d.index.lock_for_report());
        MemoryBytes {
            map: st.live.map().memory_bytes(),
            dedup_index: index.as_deref().map_or(0, |i| i.memory_bytes()),
            dedup_shared: st.live.shared().memory_bytes(),
            fingerprint_rows: st.live.fp_pending_bytes(),
            read_cache: self.caches.block_bytes(),
            unit_cache: self.caches.unit_bytes(),
            segment_buffers: st.log.buffer_bytes(),
            nbd_buffers: self.edge_memory.get().map_or(0, |hook| hook()),
            ..MemoryBytes::default()
        }
        .with_allocated(crate::memory::allocator_bytes().in_use)
    }

    /// The cipher records are sealed with, or "none".
    fn encryption_name(&self) -> &'static str {
        self.sb.key_slot.map_or("none", |k| k.cipher.name())
    }

    fn space_stats(&self, st: &State, compactable: u64) -> SpaceStats {
        SpaceStats {
            space_pressure: self.space_pressure(st).to_string(),
            deferred_pending_bytes: st.live.hints().raw_total(),
            deferral_room: self.activity.defer_room.load(Ordering::Relaxed),
            compactable_bytes: compactable,
        }
    }

    fn cleaner_stats(&self) -> CleanerStats {
        let cs = &self.counters.cleaner;
        CleanerStats {
            cleaner_policy: format!("{:?}", self.options.cleaner.policy),
            cleaner_segments_cleaned: get(&cs.segments_cleaned),
            cleaner_records_relocated: get(&cs.records_relocated),
            cleaner_bytes_relocated: get(&cs.bytes_relocated),
            segments_reclaimed: get(&cs.segments_reclaimed),
            idle_clean: self.options.cleaner.idle && !self.options.read_only,
            idle_clean_passes: get(&cs.idle_passes),
            idle_clean_bytes_relocated: get(&cs.idle_bytes_relocated),
            cleaner_holder_scans: get(&cs.holder_scans),
            cleaner_holder_pages_scanned: get(&cs.holder_pages_scanned),
            cleaner_units_compacted: get(&cs.units_compacted),
            cleaner_compaction_saved_bytes: get(&cs.compaction_bytes_saved),
            space_waits: get(&self.counters.space_waits),
            space_refusals: get(&self.counters.space_refusals),
        }
    }

    /// Dedup and reduction figures; takes the index lock (after `state`).
    fn dedup_stats(&self, st: &State) -> DedupStats {
        let (c, shared) = (st.live.counters(), st.live.shared());
        let bs = BLOCK_SIZE_BYTES;
        let guard = self.dedup.as_ref().map(|d| d.index.lock_for_report());
        let ix = guard.as_deref().map(|i| &i.hot);
        let (hits, misses) = (
            get(&self.counters.read_cache_hits),
            get(&self.counters.read_cache_misses),
        );
        let mut s = DedupStats {
            dedup: self.sb.dedup(),
            dedup_saved_bytes: shared.extra_refs * bs,
            dedup_ratio: ratio_or_one(c.data_blocks * bs, (c.data_blocks - shared.extra_refs) * bs),
            compression_saved_bytes: ((c.data_blocks - shared.extra_refs) * bs)
                .saturating_sub(c.stored_payload_bytes),
            zero_saved_bytes: c.zero_blocks * bs,
            dedup_shared_records: shared.shared_count(),
            dedup_lookups: get(&self.counters.dedup_lookups),
            dedup_hits: get(&self.counters.dedup_hits),
            dedup_index_entries: ix.map_or(0, |i| i.entries),
            dedup_index_capacity: ix.map_or(0, |i| i.capacity()),
            dedup_index_memory_bytes: guard.as_deref().map_or(0, |i| i.memory_bytes()),
            dedup_shared_table_bytes: shared.memory_bytes(),
            dedup_warm_table_fingerprints: get(&self.counters.warm_table_fingerprints),
            dedup_warm_data_blocks: get(&self.counters.warm_data_blocks),
            read_cache_hits: hits,
            read_cache_misses: misses,
            read_cache_hit_rate: ratio(hits, hits + misses),
            ..DedupStats::default()
        };
        let distinct = c.data_blocks - shared.extra_refs;
        self.window_stats(&mut s, guard.as_deref(), distinct);
        s
    }

    fn elastic_stats(&self, st: &State) -> ElasticStats {
        let c = st.live.counters();
        let es = &self.counters.elastic;
        let load = &self.activity.load;
        ElasticStats {
            codec_strong: self.policy.codec().to_string(),
            codec_none_bytes: c.stored_codec_bytes[CodecTag::None as usize],
            codec_lz4_bytes: c.stored_codec_bytes[CodecTag::Lz4 as usize],
            codec_zstd_bytes: c.stored_codec_bytes[CodecTag::Zstd as usize],
            unit_blocks: self.options.elastic.unit_blocks,
            units_written: get(&es.units_written),
            unit_blocks_written: get(&es.unit_blocks_written),
            probe_raw_blocks: get(&es.probe_raw_blocks),
            deferred_units: get(&es.deferred_units),
            deferred_blocks: get(&es.deferred_blocks),
            inline_cpu_percent: self.activity.inline_budget.percent(),
            auto_lz4_units: get(&es.auto_lz4),
            auto_zstd_fast_units: get(&es.auto_zstd_fast),
            auto_zstd_strong_units: get(&es.auto_zstd_strong),
            auto_cpu_busy_units: get(&es.auto_cpu_busy),
            load_iops: load.iops(),
            load_cpu_percent: load.cpu_percent(),
            busy_cpu_percent: self.options.elastic.busy_cpu_percent,
            load_inflight: load.inflight() as u64,
            load_level: format!("{:?}", load.load(&self.options.elastic)).to_lowercase(),
            bytes_read: get(&es.bytes_read),
            bytes_decoded: get(&es.bytes_decoded),
            read_amplification: ratio(get(&es.bytes_decoded), get(&es.bytes_read)),
            client_reads: get(&es.client_reads),
            store_pages_read: get(&es.store_pages_read),
            pages_read_per_read: ratio(get(&es.store_pages_read), get(&es.client_reads)),
            unit_cache_hits: get(&es.unit_cache_hits),
            unit_cache_misses: get(&es.unit_cache_misses),
            recompress: self.policy.is_auto() && self.options.elastic.recompress,
            recompress_passes: get(&es.recompress_passes),
            recompressed_blocks: get(&es.recompressed_blocks),
            recompressed_bytes_before: get(&es.recompressed_bytes_before),
            recompressed_bytes_after: get(&es.recompressed_bytes_after),
            recompress_skipped_units: get(&es.recompress_skipped_units),
            recompress_uncollectable_windows: get(&es.recompress_uncollectable),
        }
    }

    fn scrub_stats(&self) -> ScrubStats {
        let s = &self.jobs.scrub;
        let now = s.in_progress();
        ScrubStats {
            scrub_runs: get(&s.finished_runs),
            scrub_blocks_checked: get(&s.blocks_checked_total),
            scrub_corrupt_blocks: get(&s.corrupt_blocks_total),
            scrub_last_finished_unix: get(&s.last_finished_unix),
            scrub_in_progress: now.is_some(),
            scrub_progress_blocks: now.as_ref().map_or(0, |p| p.blocks_checked),
            scrub_total_blocks: now.as_ref().map_or(0, |p| p.blocks_total),
        }
    }
}

impl Volume {
    /// The cache keys: what the cache layer above this volume reports
    /// through its hook (a served cache's counters, an offline cache's
    /// label), zeros and no `cache` otherwise.
    fn cache_stats(&self) -> crate::stats::CacheStats {
        self.cache_stats
            .get()
            .map(|hook| hook())
            .unwrap_or_default()
    }

    /// Lets the server in front of this volume report the request payload
    /// it holds in `memory_bytes` (set once).
    pub fn set_edge_memory(&self, hook: super::EdgeMemoryHook) {
        let _ = self.edge_memory.set(hook);
    }

    /// Lets the cache layer above this volume answer `stat` (set once).
    pub fn set_cache_stats(&self, hook: super::CacheStatsHook) {
        let _ = self.cache_stats.set(hook);
    }
}
