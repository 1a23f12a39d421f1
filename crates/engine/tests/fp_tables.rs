//! Persisted fingerprints: each checkpoint writes the
//! fingerprints of the blocks appended since, per part of their segment;
//! after an open the dedup index is refilled from those tables, not by
//! reading and hashing the stored data, so the first rewrite of existing
//! data after a restart deduplicates.
mod common;
use common::{BS, MIB};
use cvol_engine::Volume;
use cvol_storage::SimStorage;

const BLOCKS: u64 = 600;

fn write_distinct(vol: &Volume, first_lba: u64, n: u64, seed: u64) {
    for i in 0..n {
        let data = common::text(seed * 1_000_000 + i, BS);
        vol.write_at((first_lba + i) * BS as u64, &data, false)
            .unwrap();
    }
}

/// Rewrites the contents `seed` wrote at other LBAs; returns the dedup
/// hits this made.
fn rewrite_hits(vol: &Volume, at_lba: u64, n: u64, seed: u64) -> u64 {
    let before = vol.stats().dedup.dedup_hits;
    write_distinct(vol, at_lba, n, seed);
    vol.stats().dedup.dedup_hits - before
}

/// The warm-up's fingerprints, and the blocks of data it read.
fn warm(vol: &Volume) -> (u64, u64) {
    let n = vol.warm_index();
    let s = vol.stats().dedup;
    assert!(s.dedup_warm_table_fingerprints + s.dedup_warm_data_blocks >= n);
    (n, s.dedup_warm_data_blocks)
}

#[test]
fn a_reopened_volume_dedups_the_first_rewrite_without_reading_its_data() {
    let sim = SimStorage::new(64 * MIB);
    let vol = common::create(&sim, &common::options(&sim, 32 * MIB));
    write_distinct(&vol, 0, BLOCKS, 1);
    vol.close().unwrap();
    drop(vol);
    let vol = common::open(&sim);
    let (indexed, read) = warm(&vol);
    assert_eq!(indexed, BLOCKS, "every block's fingerprint comes back");
    assert_eq!(read, 0, "no data read");
    assert_eq!(rewrite_hits(&vol, 4000, BLOCKS, 1), BLOCKS);
    common::close_and_check(vol, &sim);
}

#[test]
fn the_head_part_keeps_the_rows_of_earlier_runs() {
    // Three short runs append into the same part of the same segment: the
    // table it gets at each close must hold all three runs' blocks.
    let sim = SimStorage::new(64 * MIB);
    common::create_closed(&sim, &common::options(&sim, 32 * MIB));
    for run in 0..3 {
        let vol = common::open(&sim);
        write_distinct(&vol, run * 10, 10, 10 + run);
        vol.close().unwrap();
    }
    let vol = common::open(&sim);
    assert_eq!(warm(&vol), (30, 0));
    let hits: u64 = (0..3)
        .map(|run| rewrite_hits(&vol, 5000 + run * 10, 10, 10 + run))
        .sum();
    assert_eq!(hits, 30);
    common::close_and_check(vol, &sim);
}

#[test]
fn after_a_crash_the_checkpointed_fingerprints_come_back() {
    let sim = SimStorage::new(64 * MIB);
    let vol = common::create(&sim, &common::options(&sim, 32 * MIB));
    write_distinct(&vol, 0, BLOCKS, 2);
    vol.flush().unwrap();
    vol.checkpoint().unwrap();
    // Written after the checkpoint, flushed: replayed, but not in a table.
    write_distinct(&vol, BLOCKS, 20, 3);
    vol.flush().unwrap();
    let crashed = sim.crash(7);
    drop(vol);
    let vol = common::open(&crashed);
    let (indexed, read) = warm(&vol);
    assert!(indexed >= BLOCKS, "{indexed} fingerprints");
    assert_eq!(
        read, 0,
        "20 blocks after the checkpoint are not worth reading the data"
    );
    assert_eq!(rewrite_hits(&vol, 4000, BLOCKS, 2), BLOCKS);
    common::close_and_check(vol, &crashed);
}

/// Incompressible blocks (stored raw: about 250 records per 1 MiB
/// segment), distinct per (seed, i).
fn write_random(vol: &Volume, first_lba: u64, n: u64, seed: u64) {
    write_random_from(vol, first_lba, n, seed, 0);
}

#[test]
fn the_cleaner_moves_fingerprint_tables_with_their_rows() {
    // A fills segment 0, so its checkpoint puts A's fingerprint tables at
    // the start of segment 1; B follows them there and is overwritten:
    // segment 1, nearly dead, is cleaned, moving A's tables, whose rows
    // (A is live) must survive into their new records.
    let sim = SimStorage::new(64 * MIB);
    let vol = common::create(&sim, &common::options(&sim, 32 * MIB));
    write_random(&vol, 0, 253, 4);
    vol.checkpoint().unwrap();
    write_random(&vol, 1000, 200, 5);
    write_random(&vol, 1000, 200, 6);
    vol.checkpoint().unwrap();
    let s = vol.stats();
    // One victim: segment 1 frees the most (segment 0 is all live A).
    vol.clean(s.physical_free_bytes + 1, false).unwrap();
    vol.checkpoint().unwrap();
    assert!(
        vol.stats().map_records_moved > s.map_records_moved,
        "the cleaner moved no map record"
    );
    vol.close().unwrap();
    drop(vol);
    let vol = common::open(&sim);
    let (indexed, read) = warm(&vol);
    assert!(indexed >= 453, "{indexed} fingerprints");
    assert_eq!(read, 0, "no data read");
    let before = vol.stats().dedup.dedup_hits;
    write_random(&vol, 4000, 253, 4);
    write_random(&vol, 5000, 200, 6);
    assert_eq!(vol.stats().dedup.dedup_hits - before, 453);
    common::close_and_check(vol, &sim);
}

/// Options whose fingerprint rows spill every ~40 blocks appended.
fn spilling() -> cvol_engine::OpenOptions {
    cvol_engine::OpenOptions {
        fingerprint_spill_bytes: 1024,
        ..cvol_engine::OpenOptions::default()
    }
}

/// Writes `n` incompressible blocks from `first_lba`, a FLUSH every 25
/// (a flush spills the rows when they are due, with no checkpointer).
fn write_random_flushed(vol: &Volume, first_lba: u64, n: u64, seed: u64) {
    for k in (0..n).step_by(25) {
        let len = (n - k).min(25);
        write_random_from(vol, first_lba + k, len, seed, k);
        vol.flush().unwrap();
    }
}

/// `write_random`'s blocks `skip..skip + n` of stream `seed`, at `first_lba`.
fn write_random_from(vol: &Volume, first_lba: u64, n: u64, seed: u64, skip: u64) {
    use rand::{RngCore, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut data = vec![0u8; BS];
    for _ in 0..skip {
        rng.fill_bytes(&mut data);
    }
    for i in 0..n {
        rng.fill_bytes(&mut data);
        vol.write_at((first_lba + i) * BS as u64, &data, false)
            .unwrap();
    }
}

#[test]
fn spilled_tables_are_written_without_a_checkpoint_and_named_by_the_next() {
    // 600 raw blocks fill ~5 parts of 512 KiB: the rows of each part the
    // head has left are written as its table by a flush, no checkpoint.
    let sim = SimStorage::new(64 * MIB);
    common::create_closed(&sim, &common::options(&sim, 32 * MIB));
    let vol = common::open_with(&sim, spilling());
    write_random_flushed(&vol, 0, 600, 8);
    let s = vol.stats();
    assert!(s.fingerprint_spills >= 3, "{} spills", s.fingerprint_spills);
    assert!(s.fingerprint_spill_bytes > 0);
    assert_eq!(s.checkpoints_written, 0, "a spill is not a checkpoint");
    // The close's checkpoint names them (and writes the head's part).
    vol.close().unwrap();
    drop(vol);
    let vol = common::open(&sim);
    assert_eq!(warm(&vol), (600, 0), "every fingerprint, no data read");
    let before = vol.stats().dedup.dedup_hits;
    write_random(&vol, 4000, 600, 8);
    assert_eq!(vol.stats().dedup.dedup_hits - before, 600);
    common::close_and_check(vol, &sim);
}

#[test]
fn a_crash_after_a_spill_loses_no_data_and_no_named_table() {
    // The checkpoint names A's tables; B's rows are spilled after it and
    // the volume crashes before any other commit: B's table records are
    // named by nothing on disk (dead space), A's still are, and every
    // flushed block reads back.
    let sim = SimStorage::new(64 * MIB);
    common::create_closed(&sim, &common::options(&sim, 32 * MIB));
    let vol = common::open_with(&sim, spilling());
    write_random(&vol, 0, 300, 9);
    vol.checkpoint().unwrap();
    let spills = vol.stats().fingerprint_spills;
    write_random_flushed(&vol, 1000, 400, 10);
    assert!(
        vol.stats().fingerprint_spills > spills,
        "no spill after the checkpoint"
    );
    let crashed = sim.crash(11);
    drop(vol);
    let vol = common::open(&crashed);
    let (indexed, _) = warm(&vol);
    assert!(indexed >= 300, "{indexed} fingerprints");
    let before = vol.stats().dedup.dedup_hits;
    write_random(&vol, 4000, 300, 9);
    assert_eq!(vol.stats().dedup.dedup_hits - before, 300, "A's tables");
    let mut data = vec![0u8; BS];
    let mut want = vec![0u8; BS];
    use rand::{RngCore, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(10);
    for i in 0..400u64 {
        rng.fill_bytes(&mut want);
        vol.read_at((1000 + i) * BS as u64, &mut data).unwrap();
        assert!(data == want, "flushed block {} lost", 1000 + i);
    }
    common::close_and_check(vol, &crashed);
}
