//! Whole-volume dedup in bounded RAM: a copy of data written long before,
//! far past what the exact (hot) fingerprint index holds, is still
//! deduplicated, because sampled fingerprints (hooks) lead to the
//! fingerprint table written with the data and that table hands over the
//! neighbours (sparse indexing, Lillibridge et al., FAST '09; dm-vdo's UDS
//! sparse index). Also after a restart, after the cleaner moved the data
//! and reused its segments, after recompression; a full index stays within
//! its budget and every read is exact; scattered single blocks are found
//! only at the sampling rate, which is measured and printed.
//!
//! Every volume uses a small `dedup_memory_bytes`, so the hot index covers a
//! fraction of the data: each test asserts (`assert_past_hot_window`) that
//! the blocks it copies were followed by at least twice the hot index's
//! capacity of newer distinct blocks.
//!
//! The assertions on the window's own stat keys are in `NEW-KEY` blocks.
mod common;
use common::{close_and_check, BS, MIB};
use cvol_engine::stats::DedupStats;
use cvol_engine::{Codec, CodecPolicy, ElasticConfig, OpenOptions, Volume};
use cvol_storage::SimStorage;
use rand::{rngs::StdRng, seq::SliceRandom, SeedableRng};

/// The dedup memory of most tests: 8 K hot-index slots if the hot index
/// has all of it, a quarter of that when the hooks and tables share it.
const BUDGET: u64 = 256 << 10;
/// Distinct blocks most tests write first (128 MiB): four times what the
/// hot index holds at `BUDGET` even when it has all of it.
const BLOCKS: u64 = 32 * 1024;
/// Blocks per client request of a sequential write or copy (1 MiB).
const REQ: u64 = 256;
/// Where copies go (1 GiB): past every original.
const COPY_LBA: u64 = 1 << 18;
/// Logical size of every volume (copies included).
const LOGICAL: u64 = 4 << 30;
/// The share of a copy of old data that must be deduplicated.
const FOUND_MIN: f64 = 0.90;

/// Block `i` of stream `seed`: compressible text (about 3:1), distinct per
/// (seed, i).
fn block(seed: u64, i: u64) -> Vec<u8> {
    common::text((seed << 32) | i, BS)
}

/// Blocks `first..first + n` of stream `seed`, concatenated.
fn run(seed: u64, first: u64, n: u64) -> Vec<u8> {
    (first..first + n).flat_map(|i| block(seed, i)).collect()
}

/// Writes blocks `first..first + n` of stream `seed` at `lba..`, `req`
/// blocks per request.
fn write_run(vol: &Volume, lba: u64, seed: u64, first: u64, n: u64, req: u64) {
    for k in (0..n).step_by(req as usize) {
        let len = req.min(n - k);
        let data = run(seed, first + k, len);
        vol.write_at((lba + k) * BS as u64, &data, false).unwrap();
    }
}

/// `write_run` in 1 MiB requests; returns the dedup hits since `since`.
fn copy_hits(vol: &Volume, since: &DedupStats, lba: u64, seed: u64, first: u64, n: u64) -> u64 {
    write_run(vol, lba, seed, first, n, REQ);
    vol.stats().dedup.dedup_hits - since.dedup_hits
}

/// The blocks at `lba..lba + n` are blocks `first..first + n` of `seed`.
#[track_caller]
fn assert_run(vol: &Volume, lba: u64, seed: u64, first: u64, n: u64) {
    let mut buf = vec![0u8; REQ as usize * BS];
    for k in (0..n).step_by(REQ as usize) {
        let len = REQ.min(n - k);
        let buf = &mut buf[..len as usize * BS];
        vol.read_at((lba + k) * BS as u64, buf).unwrap();
        assert!(
            *buf == run(seed, first + k, len),
            "blocks {}..{} at lba {}",
            first + k,
            first + k + len,
            lba + k
        );
    }
}

fn small(budget: u64) -> OpenOptions {
    OpenOptions {
        dedup_memory_bytes: Some(budget),
        ..OpenOptions::default()
    }
}

/// A new volume on `sim` (lz4, 1 MiB segments, dedup on), open with
/// `options`.
fn volume(sim: &SimStorage, options: OpenOptions) -> Volume {
    common::create_closed(sim, &common::options(sim, LOGICAL));
    common::open_with(sim, options)
}

/// `newer` distinct blocks were written after the ones a test copies: at
/// least twice what the hot index holds, so an exact index of this size
/// alone cannot find them.
#[track_caller]
fn assert_past_hot_window(vol: &Volume, newer: u64) {
    let s = vol.stats().dedup;
    assert!(
        newer >= 2 * s.dedup_index_capacity,
        "only {newer} newer blocks, hot index holds {}",
        s.dedup_index_capacity
    );
    assert!(s.dedup_index_memory_bytes <= BUDGET, "{s:?}");
}

/// Found fraction of a copy of `n` blocks; printed for the benchmark docs.
fn found(what: &str, hits: u64, n: u64) -> f64 {
    let f = hits as f64 / n as f64;
    eprintln!("dedup_window: {what}: {hits} of {n} blocks found ({f:.4})");
    f
}

#[test]
fn a_copy_of_data_far_older_than_the_hot_index_is_deduplicated() {
    let sim = SimStorage::new(128 * MIB);
    let vol = volume(&sim, small(BUDGET));
    write_run(&vol, 0, 1, 0, BLOCKS, REQ);
    vol.flush().unwrap();
    let quarter = BLOCKS / 4;
    assert_past_hot_window(&vol, BLOCKS - quarter);
    let stored = vol.stats().stored_bytes;
    let s0 = vol.stats().dedup;
    let hits = copy_hits(&vol, &s0, COPY_LBA, 1, 0, quarter);
    let f = found("old copy, first quarter", hits, quarter);
    assert!(f >= FOUND_MIN, "{hits} of {quarter} found");
    let s = vol.stats();
    // The original quarter stored about stored / 4; the copy's misses and
    // its REF records cost a fraction of that.
    let grown = s.stored_bytes.saturating_sub(stored);
    assert!(
        grown < stored / 4 / 5,
        "the copy stored {grown} bytes, the original {stored}"
    );
    let d = &s.dedup;
    let table = d.dedup_hits_table - s0.dedup_hits_table;
    assert!(
        table as f64 >= FOUND_MIN * quarter as f64,
        "{table} from tables"
    );
    let reads = d.dedup_table_reads - s0.dedup_table_reads;
    assert!(reads as f64 <= 0.01 * quarter as f64, "{reads} table reads");
    assert!(d.dedup_hook_hits > s0.dedup_hook_hits);
    assert!(d.dedup_window_bytes >= BLOCKS * BS as u64 * 9 / 10, "{d:?}");
    assert!(d.dedup_index_memory_bytes <= BUDGET, "{d:?}");
    assert_run(&vol, COPY_LBA, 1, 0, quarter);
    assert_run(&vol, 0, 1, 0, quarter);
    close_and_check(vol, &sim);
}

#[test]
fn after_a_restart_a_copy_of_the_newest_data_is_deduplicated() {
    // A warm-up that only refills the hot index, oldest table first, leaves
    // the newest quarter out; it must be found all the same (the hooks).
    let sim = SimStorage::new(128 * MIB);
    let vol = volume(&sim, small(BUDGET));
    write_run(&vol, 0, 2, 0, BLOCKS, REQ);
    vol.close().unwrap();
    drop(vol);
    let vol = common::open_with(&sim, small(BUDGET));
    vol.warm_index();
    let s0 = vol.stats().dedup;
    assert_eq!(s0.dedup_warm_data_blocks, 0, "the warm-up read data");
    assert_eq!(s0.dedup_hook_load, "ready", "{s0:?}");
    let quarter = BLOCKS / 4;
    assert!(
        BLOCKS - quarter >= 2 * s0.dedup_index_capacity,
        "the hot index could hold the rest"
    );
    let hits = copy_hits(&vol, &s0, COPY_LBA, 2, BLOCKS - quarter, quarter);
    let f = found("after restart, last quarter", hits, quarter);
    assert!(f >= FOUND_MIN, "{hits} of {quarter} found");
    let d = vol.stats().dedup;
    let table = d.dedup_hits_table - s0.dedup_hits_table;
    assert!(
        table as f64 >= FOUND_MIN * quarter as f64,
        "{table} from tables"
    );
    let reads = d.dedup_table_reads - s0.dedup_table_reads;
    assert!(reads as f64 <= 0.01 * quarter as f64, "{reads} table reads");
    assert_run(&vol, COPY_LBA, 2, BLOCKS - quarter, quarter);
    close_and_check(vol, &sim);
}

/// Incompressible garbage, distinct per (seed, i): 4 KiB stored a block.
fn garbage(seed: u64, i: u64, n: u64) -> Vec<u8> {
    use rand::RngCore;
    let mut data = vec![0u8; (n as usize) * BS];
    StdRng::seed_from_u64((seed << 32) | i).fill_bytes(&mut data);
    data
}

/// A's `n` blocks at `0..n`, and twice as many blocks of garbage at
/// `g_lba..` in the same segments: 64 KiB of A, 128 KiB of garbage in turn.
fn write_interleaved(vol: &Volume, a_seed: u64, g_lba: u64, n: u64) {
    for k in (0..n).step_by(16) {
        write_run(vol, k, a_seed, k, 16, 16);
        let g = garbage(a_seed, k, 32);
        vol.write_at((g_lba + 2 * k) * BS as u64, &g, false)
            .unwrap();
    }
}

#[test]
fn a_copy_of_data_the_cleaner_moved_into_reused_segments_is_deduplicated() {
    // A (4 K blocks) interleaved with garbage (32 MiB) in the same
    // segments; the garbage is trimmed, the cleaner moves A out of those
    // segments and frees them, and 16 K blocks of new data land in them
    // (more than the store had free before cleaning). Then A is copied.
    let n = 4 * 1024;
    let sim = SimStorage::new(56 * MIB);
    let vol = volume(&sim, small(BUDGET));
    write_interleaved(&vol, 3, 2 * COPY_LBA, n);
    vol.flush().unwrap();
    let free_before = vol.stats().physical_free_bytes;
    vol.trim(2 * COPY_LBA * BS as u64, 2 * n * BS as u64, false)
        .unwrap();
    vol.flush().unwrap();
    let before = vol.stats();
    vol.clean(u64::MAX, false).unwrap();
    vol.checkpoint().unwrap();
    let cleaned = vol.stats();
    let moved =
        cleaned.cleaner.cleaner_records_relocated - before.cleaner.cleaner_records_relocated;
    assert!(moved > 0, "the cleaner moved nothing");
    assert!(cleaned.cleaner.segments_reclaimed > before.cleaner.segments_reclaimed);
    let newer = 4 * n;
    write_run(&vol, 3 * COPY_LBA, 5, 0, newer, REQ);
    vol.flush().unwrap();
    let s = vol.stats();
    let grown = s.stored_bytes - cleaned.stored_bytes;
    assert!(
        grown > free_before,
        "the new data ({grown} bytes) fit in what was never used ({free_before})"
    );
    assert_past_hot_window(&vol, newer);
    let s0 = s.dedup;
    let hits = copy_hits(&vol, &s0, COPY_LBA, 3, 0, n);
    let f = found("after cleaning and segment reuse", hits, n);
    assert!(f >= FOUND_MIN, "{hits} of {n} found");
    let d = vol.stats().dedup;
    let table = d.dedup_hits_table - s0.dedup_hits_table;
    assert!(table as f64 >= FOUND_MIN * n as f64, "{table} from tables");
    assert!(d.dedup_hook_hits > s0.dedup_hook_hits);
    assert_run(&vol, COPY_LBA, 3, 0, n);
    assert_run(&vol, 0, 3, 0, n);
    assert_run(&vol, 3 * COPY_LBA, 5, 0, newer);
    close_and_check(vol, &sim);
}

/// Busy with inline compression deferred for every unit: 1 MiB writes are
/// stored raw, background recompression compresses them later.
fn deferring() -> OpenOptions {
    OpenOptions {
        elastic: ElasticConfig {
            unit_blocks: 4,
            busy_iops: 0,
            idle_iops: 0,
            busy_inflight: usize::MAX,
            recompress: true,
            inline_cpu_percent: Some(0),
            ..ElasticConfig::default()
        },
        ..small(BUDGET)
    }
}

#[test]
fn a_copy_of_recompressed_data_is_deduplicated() {
    let n = 24 * 1024;
    let sim = SimStorage::new(160 * MIB);
    let opts = common::options(&sim, LOGICAL).with_codec(CodecPolicy::Auto {
        strong: Codec::Zstd(1),
    });
    common::create_closed(&sim, &opts);
    let vol = common::open_with(&sim, deferring());
    write_run(&vol, 0, 6, 0, n, REQ);
    let raw = vol.stats().elastic.deferred_blocks;
    assert!(raw >= n / 4, "only {raw} blocks stored raw");
    let rewritten = common::recompress_to_end(&vol, 16 * MIB);
    assert_eq!(rewritten, n, "recompression left blocks raw");
    vol.flush().unwrap();
    let quarter = n / 4;
    assert_past_hot_window(&vol, n - quarter);
    let s0 = vol.stats().dedup;
    let hits = copy_hits(&vol, &s0, COPY_LBA, 6, 0, quarter);
    let f = found("after recompression, first quarter", hits, quarter);
    assert!(f >= FOUND_MIN, "{hits} of {quarter} found");
    let d = vol.stats().dedup;
    let table = d.dedup_hits_table - s0.dedup_hits_table;
    assert!(
        table as f64 >= FOUND_MIN * quarter as f64,
        "{table} from tables"
    );
    assert_run(&vol, COPY_LBA, 6, 0, quarter);
    assert_run(&vol, 0, 6, 0, quarter);
    close_and_check(vol, &sim);
}

#[test]
fn a_full_index_stays_within_its_budget_and_every_read_is_exact() {
    // 1 KiB of dedup memory: the hooks' share (about 64 slots, 48 at 75%
    // load) is full long before 24 K distinct blocks (16 K, then 8 K that
    // overwrite half of them), about 96 hooks even at 1 in 256.
    let budget = 1 << 10;
    let n = 16 * 1024;
    let sim = SimStorage::new(64 * MIB);
    let vol = volume(&sim, small(budget));
    write_run(&vol, 0, 7, 0, n, REQ);
    // Overwrite every other 64 KiB with new data, and copy some old data.
    for k in (0..n).step_by(32) {
        write_run(&vol, k, 8, k, 16, 16);
    }
    write_run(&vol, COPY_LBA, 7, 0, 4 * REQ, REQ);
    let d = vol.stats().dedup;
    assert!(d.dedup_index_memory_bytes <= budget, "{d:?}");
    assert!(d.dedup_hooks_full, "{d:?}");
    assert!(d.dedup_hook_evictions > 0, "{d:?}");
    assert_eq!(d.dedup_hook_sample_log2, 8, "{d:?}");
    assert!(d.dedup_index_memory_bytes <= budget, "{d:?}");
    for k in (0..n).step_by(32) {
        assert_run(&vol, k, 8, k, 16);
        assert_run(&vol, k + 16, 7, k + 16, 16);
    }
    assert_run(&vol, COPY_LBA, 7, 0, 4 * REQ);
    vol.close().unwrap();
    drop(vol);
    let vol = common::open_with(&sim, small(budget));
    vol.warm_index();
    assert!(vol.stats().dedup.dedup_index_memory_bytes <= budget);
    assert_run(&vol, COPY_LBA, 7, 0, 4 * REQ);
    close_and_check(vol, &sim);
}

#[test]
fn scattered_single_blocks_of_old_data_are_found_at_the_sampling_rate() {
    // The honest limit: a block rewritten alone, in random order, has no
    // neighbour to lead to its table; it is found only if it is a hook
    // itself (1 in 2^k), or by luck in a table already loaded.
    let sim = SimStorage::new(128 * MIB);
    let vol = volume(&sim, small(BUDGET));
    write_run(&vol, 0, 9, 0, BLOCKS, REQ);
    vol.flush().unwrap();
    let old = BLOCKS / 4;
    assert_past_hot_window(&vol, BLOCKS - old);
    let mut picks: Vec<u64> = (0..old).collect();
    picks.shuffle(&mut StdRng::seed_from_u64(10));
    picks.truncate(2000);
    let before = vol.stats().dedup.dedup_hits;
    for (j, &i) in picks.iter().enumerate() {
        let at = (COPY_LBA + j as u64) * BS as u64;
        vol.write_at(at, &block(9, i), false).unwrap();
    }
    let hits = vol.stats().dedup.dedup_hits - before;
    let f = found("random single blocks of old data", hits, picks.len() as u64);
    // k is at most 8: never less than half of 1 in 256.
    assert!(f >= 0.5 / 256.0, "{hits} of {} found", picks.len());
    let d = vol.stats().dedup;
    let k = d.dedup_hook_sample_log2;
    eprintln!("dedup_window: random singles at k = {k}");
    assert!(f >= 0.5 / (1u64 << k) as f64, "{hits} found at k = {k}");
    assert!(d.dedup_index_memory_bytes <= BUDGET, "{d:?}");
    for (j, &i) in picks.iter().enumerate() {
        assert_run(&vol, COPY_LBA + j as u64, 9, i, 1);
    }
    close_and_check(vol, &sim);
}

/// Options of the snapshot tests: a checkpoint every 4 MiB written, and
/// the hook index persisted every 64 KiB of fingerprint tables (about
/// 3,500 blocks).
fn snapshotting(budget: u64) -> OpenOptions {
    OpenOptions {
        checkpoint_interval_bytes: 4 * MIB,
        hook_snapshot_bytes: 64 << 10,
        ..small(budget)
    }
}

/// Writes `BLOCKS` of `seed` in 1 MiB requests with a flush every 4 MiB,
/// so that snapshots fall due along the way.
fn write_flushing(vol: &Volume, seed: u64) {
    for part in (0..BLOCKS).step_by(1024) {
        write_run(vol, part, seed, part, 1024, REQ);
        vol.flush().unwrap();
    }
}

#[test]
fn an_open_loads_the_hook_snapshot_and_replays_only_the_newer_tables() {
    let sim = SimStorage::new(128 * MIB);
    let vol = volume(&sim, snapshotting(BUDGET));
    write_flushing(&vol, 3);
    let written = vol.stats().dedup;
    assert!(written.dedup_hook_snapshots >= 2, "{written:?}");
    vol.close().unwrap();
    drop(vol);
    let vol = common::open_with(&sim, snapshotting(BUDGET));
    vol.warm_index();
    let s0 = vol.stats().dedup;
    assert_eq!(s0.dedup_hook_load, "ready");
    assert!(s0.dedup_hook_snapshot_entries > 0, "{s0:?}");
    // O(changes): the tables written since the last snapshot, not all.
    let all = vol.fingerprint_tables_named();
    assert!(
        s0.dedup_hook_replayed_tables * 2 < all,
        "replayed {} of {all} tables",
        s0.dedup_hook_replayed_tables
    );
    eprintln!(
        "dedup_window: reopen from a snapshot: {} hooks from it, {} of {all} tables replayed",
        s0.dedup_hook_snapshot_entries, s0.dedup_hook_replayed_tables
    );
    // The oldest quarter comes through the snapshot, the newest through
    // the tables written after it.
    let quarter = BLOCKS / 4;
    let hits = copy_hits(&vol, &s0, COPY_LBA, 3, 0, quarter);
    let f = found(
        "after restart from a snapshot, first quarter",
        hits,
        quarter,
    );
    assert!(f >= FOUND_MIN, "{hits} of {quarter} found");
    let s1 = vol.stats().dedup;
    let last = BLOCKS - quarter;
    let hits = copy_hits(&vol, &s1, COPY_LBA + quarter, 3, last, quarter);
    let f = found("after restart from a snapshot, last quarter", hits, quarter);
    assert!(f >= FOUND_MIN, "{hits} of {quarter} found");
    assert_run(&vol, COPY_LBA, 3, 0, quarter);
    assert_run(&vol, COPY_LBA + quarter, 3, last, quarter);
    close_and_check(vol, &sim);
}

#[test]
fn a_snapshot_of_another_size_is_ignored_and_every_table_replayed() {
    let sim = SimStorage::new(128 * MIB);
    let vol = volume(&sim, snapshotting(BUDGET));
    write_flushing(&vol, 4);
    vol.close().unwrap();
    drop(vol);
    // Another --dedup-memory: another bucket count, so the snapshot cannot
    // be placed; the tables rebuild the index, nothing is lost.
    let vol = common::open_with(&sim, snapshotting(2 * BUDGET));
    vol.warm_index();
    let s0 = vol.stats().dedup;
    assert_eq!(s0.dedup_hook_snapshot_entries, 0, "{s0:?}");
    assert_eq!(
        s0.dedup_hook_replayed_tables,
        vol.fingerprint_tables_named()
    );
    let quarter = BLOCKS / 4;
    let hits = copy_hits(&vol, &s0, COPY_LBA, 4, 0, quarter);
    assert!(found("snapshot of another size", hits, quarter) >= FOUND_MIN);
    close_and_check(vol, &sim);
}

/// Block `i` of stream `seed`: 160 bytes that do not compress, then zeros:
/// about 200 bytes stored, so one 512 KiB part's table holds about 2,500
/// rows (below the 7,000 a table keeps), more than the table cache of a
/// 256 KiB budget holds.
fn sparse_block(seed: u64, i: u64) -> Vec<u8> {
    use rand::RngCore;
    let mut b = vec![0u8; BS];
    StdRng::seed_from_u64((seed << 32) | i).fill_bytes(&mut b[..160]);
    b
}

#[test]
fn regression_a_table_larger_than_the_table_cache_is_still_searched() {
    // Found by the crash simulation with an 8 KiB budget: a hook led to a
    // table the cache could not hold, the table was read and dropped, and
    // the hook forgotten as stale; nothing was found.
    let sim = SimStorage::new(128 * MIB);
    let vol = volume(&sim, small(BUDGET));
    let write = |lba: u64, first: u64, n: u64| {
        for k in (0..n).step_by(REQ as usize) {
            let len = REQ.min(n - k);
            let data: Vec<u8> = (first + k..first + k + len)
                .flat_map(|i| sparse_block(11, i))
                .collect();
            vol.write_at((lba + k) * BS as u64, &data, false).unwrap();
        }
    };
    write(0, 0, BLOCKS);
    vol.flush().unwrap();
    let quarter = BLOCKS / 4;
    assert_past_hot_window(&vol, BLOCKS - quarter);
    let s0 = vol.stats().dedup;
    write(COPY_LBA, 0, quarter);
    let s = vol.stats().dedup;
    let hits = s.dedup_hits - s0.dedup_hits;
    let f = found("tables larger than the cache", hits, quarter);
    assert!(f >= FOUND_MIN, "{hits} of {quarter} found: {s:?}");
    let mut buf = vec![0u8; BS];
    for i in (0..quarter).step_by(97) {
        vol.read_at((COPY_LBA + i) * BS as u64, &mut buf).unwrap();
        assert_eq!(buf, sparse_block(11, i), "block {i}");
    }
    close_and_check(vol, &sim);
}
