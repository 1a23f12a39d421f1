//! Persisted liveness tables: a checkpoint saves the counters,
//! the live bytes per segment and the shared table; an open with nothing
//! to replay takes them instead of reading every map page, and they must
//! equal what a rebuild from the whole map gives (`verify_refcounts`).
mod common;
use common::{BS, MIB};
use cvol_engine::{OpenOptions, Volume, VolumeStats};
use cvol_storage::SimStorage;
use rand::{Rng, SeedableRng};

/// Writes units (multi-block writes), dedup references (blocks written
/// twice), single blocks, overwrites part of the units and trims some.
fn mixed_workload(vol: &Volume, seed: u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    // Units of 4 blocks: 64 of them.
    for u in 0..64u64 {
        let data = common::text(seed * 100_000 + u, 4 * BS);
        vol.write_at(u * 4 * BS as u64, &data, false).unwrap();
    }
    // Dedup: blocks 1000.. repeat blocks 2000.. (each content twice or
    // three times), single-block writes.
    for i in 0..200u64 {
        let data = common::text(seed * 100_000 + 50_000 + i % 70, BS);
        vol.write_at((1000 + i) * BS as u64, &data, false).unwrap();
    }
    // Overwrite blocks inside units, trim others.
    for _ in 0..40 {
        let lba = rng.gen_range(0..256u64);
        let data = common::text(rng.gen(), BS);
        vol.write_at(lba * BS as u64, &data, false).unwrap();
    }
    vol.trim(300 * BS as u64, 40 * BS as u64, false).unwrap();
    vol.trim(1050 * BS as u64, 20 * BS as u64, false).unwrap();
    vol.flush().unwrap();
}

/// What `stat` reports about space and sharing, which the tables feed
/// (not `physical_used_bytes`: an open appends its EPOCH record).
fn space(s: &VolumeStats) -> (u64, u64, u64, u64, u64) {
    (
        s.mapped_bytes,
        s.stored_bytes,
        s.live_bytes,
        s.dedup.dedup_shared_records,
        s.dedup.dedup_saved_bytes,
    )
}

fn image(vol: &Volume, blocks: u64) -> Vec<u8> {
    let mut b = vec![0u8; blocks as usize * BS];
    vol.read_at(0, &mut b).unwrap();
    b
}

#[test]
fn a_clean_reopen_takes_the_persisted_tables_and_they_match_the_map() {
    let sim = SimStorage::new(48 * MIB);
    let vol = common::create(&sim, &common::options(&sim, 16 * MIB));
    mixed_workload(&vol, 1);
    let img = image(&vol, 1400);
    vol.close().unwrap();
    let before = space(&vol.stats());
    drop(vol);
    let vol = common::open(&sim);
    assert!(vol.opened_from_tables(), "nothing to replay: tables used");
    vol.verify_refcounts().unwrap();
    assert_eq!(space(&vol.stats()), before);
    assert!(image(&vol, 1400) == img);
    // And they go on being kept exact: more work, a second reopen.
    mixed_workload(&vol, 2);
    vol.close().unwrap();
    let before = space(&vol.stats());
    common::close_and_check(vol, &sim);
    let vol = common::open(&sim);
    assert!(vol.opened_from_tables());
    vol.verify_refcounts().unwrap();
    assert_eq!(space(&vol.stats()), before);
}

#[test]
fn a_reopen_that_replays_the_log_brings_the_tables_up_to_date() {
    let sim = SimStorage::new(48 * MIB);
    let vol = common::create(&sim, &common::options(&sim, 16 * MIB));
    mixed_workload(&vol, 3);
    vol.checkpoint().unwrap();
    // Flushed after the checkpoint: roll-forward changes the map (units
    // overwritten, references added and dropped, trims).
    vol.write_at(7 * BS as u64, &common::text(77, BS), false)
        .unwrap();
    mixed_workload(&vol, 4);
    let img = image(&vol, 1400);
    drop(vol);
    let vol = common::open(&sim);
    assert!(vol.opened_from_tables(), "tables and the pages replayed");
    vol.verify_refcounts().unwrap();
    assert!(image(&vol, 1400) == img);
    // The tables are written at close; the next open takes them.
    vol.close().unwrap();
    drop(vol);
    let vol = common::open(&sim);
    assert!(vol.opened_from_tables());
    vol.verify_refcounts().unwrap();
}

#[test]
fn tables_follow_the_cleaner_and_a_tiny_map_cache() {
    let sim = SimStorage::new(24 * MIB);
    let vol = common::create(&sim, &common::options(&sim, 16 * MIB));
    let tiny = || OpenOptions {
        map_cache_bytes: Some(0),
        ..OpenOptions::default()
    };
    vol.close().unwrap();
    drop(vol);
    let vol = common::open_with(&sim, tiny());
    for round in 0..6 {
        mixed_workload(&vol, 10 + round);
        vol.checkpoint().unwrap();
    }
    // Cleaning moves data records (their segments' tables change) and
    // the map's own records, tables included.
    vol.clean(u64::MAX, false).unwrap();
    vol.checkpoint().unwrap();
    vol.verify_refcounts().unwrap();
    let img = image(&vol, 1400);
    vol.close().unwrap();
    let before = space(&vol.stats());
    common::close_and_check(vol, &sim);
    let vol = common::open_with(&sim, tiny());
    assert!(vol.opened_from_tables());
    vol.verify_refcounts().unwrap();
    assert_eq!(space(&vol.stats()), before);
    assert!(image(&vol, 1400) == img);
}

/// A segment's table larger than a table record may be (thousands of tiny
/// shared records) is not written, and neither is the root: open rebuilds,
/// until the segment's table fits again.
#[test]
fn a_group_too_large_for_its_record_leaves_no_root() {
    const N: u64 = 12_000;
    let sim = SimStorage::new(48 * MIB);
    let vol = common::create(&sim, &common::options(&sim, 256 * MIB));
    // Tiny records (a block of one repeated byte compresses to a few dozen
    // bytes): over 10000 in one 1 MiB segment. Each written again later
    // (REF records elsewhere): over 10000 shared records in that segment,
    // a table of more than 64 KiB.
    let tiny = |i: u64| {
        let mut b = vec![(i % 251) as u8; BS];
        b[..8].copy_from_slice(&i.to_le_bytes());
        b
    };
    for i in 0..N {
        vol.write_at(i * BS as u64, &tiny(i), false).unwrap();
    }
    for i in 0..N {
        vol.write_at((30_000 + i) * BS as u64, &tiny(i), false)
            .unwrap();
    }
    vol.flush().unwrap();
    let shared = vol.stats().dedup.dedup_shared_records;
    assert!(shared >= N * 9 / 10, "{shared}");
    common::close_and_check(vol, &sim);
    let vol = common::open(&sim);
    assert!(!vol.opened_from_tables(), "no root: tables rebuilt");
    vol.verify_refcounts().unwrap();
    // Unshare them: the segment's table fits again.
    vol.trim(30_000 * BS as u64, N * BS as u64, false).unwrap();
    common::close_and_check(vol, &sim);
    let vol = common::open(&sim);
    assert!(vol.opened_from_tables(), "the table fits: root written");
    vol.verify_refcounts().unwrap();
}

/// Roll-forward adds a reference to a record the checkpoint had unshared
/// whose owner lies in a page roll-forward does not change: the tables
/// must count the owner they do not see.
#[test]
fn a_replayed_reference_to_an_old_record_keeps_its_unseen_owner() {
    let sim = SimStorage::new(48 * MIB);
    let vol = common::create(&sim, &common::options(&sim, 64 * MIB));
    let data = common::text(5, BS);
    vol.write_at(3 * BS as u64, &data, false).unwrap();
    vol.flush().unwrap();
    vol.checkpoint().unwrap();
    // Far away (another map page): the same content, a REF record.
    vol.write_at(9000 * BS as u64, &data, false).unwrap();
    vol.flush().unwrap();
    assert_eq!(vol.stats().dedup.dedup_shared_records, 1);
    drop(vol);
    let vol = common::open(&sim);
    assert!(vol.opened_from_tables());
    vol.verify_refcounts().unwrap();
    // Dropping the old owner leaves the record live through the reference.
    vol.trim(3 * BS as u64, BS as u64, false).unwrap();
    let mut b = vec![0u8; BS];
    vol.read_at(9000 * BS as u64, &mut b).unwrap();
    assert!(b == data);
    common::close_and_check(vol, &sim);
}

/// Crash simulation seed 12 (found when the simulation began warming the
/// dedup index after reopens): a flush freed segments whose data died
/// after the durable checkpoint (their records all older than its
/// snapshot); after a crash the persisted tables had them live, replay
/// emptied them, and open kept them sealed, so a 5-segment volume 17%
/// full had no free segment and refused to open for writing ("the log is
/// full"). Emptied segments are free after open, as a rebuild has them.
#[test]
fn regression_segments_emptied_by_replay_are_free_after_open() {
    let sim = SimStorage::new(8 * MIB);
    let vol = common::create(&sim, &common::options(&sim, 4 * MIB));
    // Segment 0 holds these blocks (incompressible: 253 fill it, so the
    // checkpoint's records go to segment 1).
    let block = |i: u64, v: u64| {
        let mut r = rand::rngs::StdRng::seed_from_u64(i * 1000 + v);
        (0..BS).map(|_| r.gen()).collect::<Vec<u8>>()
    };
    for i in 0..253 {
        vol.write_at(i * BS as u64, &block(i, 1), false).unwrap();
    }
    vol.checkpoint().unwrap();
    let before = vol.stats().segments_free;
    for i in 0..253 {
        vol.write_at(i * BS as u64, &block(i, 2), false).unwrap();
    }
    vol.flush().unwrap();
    let free = vol.stats().segments_free;
    assert!(
        free + 1 >= before,
        "the flush freed segment 0: {before} free, then {free}"
    );
    let crashed = sim.crash(3);
    drop(vol);
    let vol = Volume::open(std::sync::Arc::new(crashed.clone()), OpenOptions::default()).unwrap();
    // The open's EPOCH takes no new segment here (the head has room).
    assert_eq!(
        vol.stats().segments_free,
        free,
        "free segments before the crash and after"
    );
    vol.verify_refcounts().unwrap();
    common::close_and_check(vol, &crashed);
}

/// A block of its own content that compresses to a few bytes.
fn tiny_block(i: u64) -> Vec<u8> {
    let mut b = vec![0u8; BS];
    b[..8].copy_from_slice(&i.to_le_bytes());
    b[8..16].copy_from_slice(&(!i).to_le_bytes());
    b
}

/// A checkpoint that falls due (here: the dirty pages of a tiny map cache)
/// before `checkpoint_interval_bytes` of log since the last one that wrote
/// the liveness tables writes them when they are cheap beside its pages
/// (units have no rows), and an open after a crash takes them; it leaves
/// them out, and names no root, when they are not (many records with
/// dedup references in the segments that changed): with a small cache
/// such checkpoints come every few thousand random writes, and rewriting
/// large tables each time cost 0.72x the random-write IOPS
/// (docs/BENCHMARKING.md). An open right after one rebuilds the tables; an
/// explicit checkpoint (close) writes them again.
#[test]
fn a_checkpoint_that_falls_due_early_leaves_only_costly_tables_out() {
    const PAGE: u64 = 512 * BS as u64;
    const SHARED: u64 = 12_000;
    let sim = SimStorage::new(64 * MIB);
    common::create_closed(&sim, &common::options(&sim, 400 * PAGE));
    let tiny = || OpenOptions {
        map_cache_bytes: Some(0),
        ..OpenOptions::default()
    };
    // One block in each of 300 pages, and 160 zero blocks after it (ZERO
    // entries: no data, no rows) so that each page is dense in memory:
    // more dirty page bytes than the 256 full pages that make a checkpoint
    // due, far less log than the interval.
    let zeros = vec![0u8; 160 * BS];
    let touch_pages = |vol: &Volume, content: &dyn Fn(u64) -> Vec<u8>| {
        for p in 30..330u64 {
            vol.write_at(p * PAGE, &content(p), false).unwrap();
            vol.write_at(p * PAGE + BS as u64, &zeros, false).unwrap();
        }
        let before = vol.stats().checkpoints_written;
        vol.flush().unwrap();
        assert!(
            vol.stats().checkpoints_written > before,
            "no checkpoint fell due"
        );
    };
    let vol = common::open_with(&sim, tiny());
    touch_pages(&vol, &|p| common::text(p, BS));
    let crashed = sim.crash(1);
    let reopened = common::open_with(&crashed, tiny());
    assert!(
        reopened.opened_from_tables(),
        "cheap tables: the due checkpoint wrote them"
    );
    reopened.verify_refcounts().unwrap();
    drop(reopened);
    // Records with dedup references: a row each in their segments' tables.
    for i in 0..SHARED {
        vol.write_at(i * BS as u64, &tiny_block(i), false).unwrap();
    }
    for i in 0..SHARED {
        let lba = 190_000 + i;
        vol.write_at(lba * BS as u64, &tiny_block(i), false)
            .unwrap();
    }
    // (The index forgets a few when its sets are full.)
    assert!(vol.stats().dedup.dedup_shared_records > SHARED * 9 / 10);
    vol.close().unwrap();
    drop(vol);
    // A reference more to shared records from each of 300 pages: their
    // segments' tables (12 000 rows) change, far beyond a quarter of the
    // pages' bytes.
    let vol = common::open_with(&sim, tiny());
    vol.warm_index();
    let hits = vol.stats().dedup.dedup_hits;
    touch_pages(&vol, &|p| tiny_block(p * 37));
    assert!(vol.stats().dedup.dedup_hits > hits + 250);
    let crashed = sim.crash(2);
    let reopened = common::open_with(&crashed, tiny());
    assert!(
        !reopened.opened_from_tables(),
        "a due checkpoint wrote costly tables"
    );
    reopened.verify_refcounts().unwrap();
    for p in 30..330u64 {
        let mut b = vec![0u8; BS];
        reopened.read_at(p * PAGE, &mut b).unwrap();
        assert!(b == tiny_block(p * 37), "page {p}");
    }
    drop(reopened);
    drop(vol);
    // A clean close writes them.
    let vol = common::open_with(&sim, tiny());
    vol.close().unwrap();
    drop(vol);
    assert!(common::open_with(&sim, tiny()).opened_from_tables());
}
