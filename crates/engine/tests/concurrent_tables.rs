//! Liveness tables written by the background checkpointer while clients
//! write and the cleaner moves data (as `cvol serve` runs them), then a
//! crash: the running tables must equal a rebuild from the map at every
//! step, and the reopened volume's too. The deterministic simulations run
//! one thread; this runs the threads a server runs (the e2e kill -9 test's
//! workload: 64 KiB writes of compressible data at 4 KiB-aligned offsets,
//! a flush every 4-16 writes).
mod common;
use common::{BS, MIB};
use cvol_engine::{check, OpenOptions, Volume};
use cvol_storage::SimStorage;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// 16 blocks of write `seed`: a header each, then 1 KiB repeated.
fn write_data(seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let unit: Vec<u8> = (0..1024).map(|_| rng.gen()).collect();
    let mut out = Vec::with_capacity(16 * BS);
    for k in 0..16u64 {
        out.extend_from_slice(&seed.to_le_bytes());
        out.extend_from_slice(&k.to_le_bytes());
        out.extend_from_slice(&unit[16..]);
        for _ in 0..3 {
            out.extend_from_slice(&unit);
        }
    }
    out
}

fn writer(vol: &Volume, seed: u64, stop: &AtomicBool) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let slots = (vol.stats().logical_size_bytes - 16 * BS as u64) / BS as u64 + 1;
    let mut next_flush = rng.gen_range(4..=16);
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let off = rng.gen_range(0..slots) * BS as u64;
        let fua = rng.gen_bool(0.1);
        vol.write_at(off, &write_data(seed * 1_000_000 + n), fua)
            .unwrap();
        next_flush -= 1;
        if next_flush == 0 {
            vol.flush().unwrap();
            next_flush = rng.gen_range(4..=16);
        }
    }
}

fn round(sim: &SimStorage, seed: u64, options: OpenOptions) -> SimStorage {
    let vol = Arc::new(common::open_with(sim, options));
    let ckpt = vol.start_background_checkpointer();
    let cleaner = vol.start_background_cleaner();
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    // At least 1.5 s, and on until the checkpointer (a background thread
    // at low priority) has written more than 3 checkpoints, or 60 s pass.
    let running = || {
        let t = start.elapsed();
        t < Duration::from_millis(1500)
            || (t < Duration::from_secs(60) && vol.stats().checkpoints_written <= 3)
    };
    std::thread::scope(|s| {
        for t in 0..2 {
            let (vol, stop) = (&vol, &stop);
            s.spawn(move || writer(vol, seed * 10 + t, stop));
        }
        while running() {
            std::thread::sleep(Duration::from_millis(100));
            vol.verify_refcounts()
                .unwrap_or_else(|e| panic!("seed {seed}: while running: {e}"));
        }
        stop.store(true, Ordering::Relaxed);
    });
    vol.flush().unwrap();
    vol.verify_refcounts()
        .unwrap_or_else(|e| panic!("seed {seed}: after the writers: {e}"));
    let written = vol.stats().checkpoints_written;
    assert!(written > 3, "seed {seed}: {written} checkpoints in 60 s");
    let crashed = sim.crash(seed);
    drop(ckpt);
    drop(cleaner);
    drop(vol);
    crashed
}

/// Rounds per test: `CVOL_CONCURRENT_ROUNDS`, default 4.
fn rounds() -> u64 {
    std::env::var("CVOL_CONCURRENT_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4)
}

#[test]
fn background_checkpoints_keep_the_tables_exact_across_crashes() {
    let seeds = rounds();
    let sim = SimStorage::new(160 * MIB);
    common::create_closed(&sim, &common::options(&sim, 64 * MIB));
    let mut sim = sim;
    for seed in 1..=seeds {
        let options = OpenOptions {
            map_cache_bytes: (seed % 2 == 0).then_some(0),
            // Checkpoints every few MiB of log, while the writers run.
            checkpoint_interval_bytes: (1 + seed % 4) * 2 * MIB,
            ..OpenOptions::default()
        };
        sim = round(&sim, seed, options.clone());
        let vol = common::open_with(&sim, options);
        assert_eq!(vol.tables_rejected(), None, "seed {seed}");
        consistent_after_recovery(vol, &sim, seed);
    }
}

/// The e2e kill -9 test's shape, where a flaw was found: a clean stop
/// (tables written), then one long run of writes with flushes and no
/// checkpoint, then a crash: roll-forward replays the whole run. Flushes
/// free segments whose records all predate the durable checkpoint once
/// they are empty, and new records reuse them, so one offset can name a
/// unit live at the snapshot and another one appended since, of the same
/// length: open must count them apart. The flaw this shape is about (the
/// tables took the second for the first: persisted live bytes one record
/// short, found by `cvol check` after e2e kill9's third round, about one
/// run in eight) was not reproduced here; scripts/e2e/kill9.sh is its
/// reproducer.
#[test]
fn a_replay_over_reused_segments_keeps_the_tables_exact() {
    let rounds = rounds();
    let sim = SimStorage::new(512 * MIB);
    let opts = common::options(&sim, 64 * MIB).with_segment_size(4 * MIB);
    common::create_closed(&sim, &opts);
    let mut sim = sim;
    let mut reused = 0;
    for seed in 1..=rounds {
        let vol = common::open(&sim);
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| writer(&vol, seed, &stop));
            std::thread::sleep(Duration::from_millis(1500));
            stop.store(true, Ordering::Relaxed);
        });
        vol.flush().unwrap();
        reused += vol.stats().cleaner.segments_reclaimed;
        let crashed = sim.crash(seed);
        drop(vol);
        let vol = common::open(&crashed);
        assert_eq!(vol.tables_rejected(), None, "seed {seed}");
        // (The first round's checkpoint, of an empty map, has no tables.)
        assert!(seed == 1 || vol.opened_from_tables(), "seed {seed}");
        consistent_after_recovery(vol, &crashed, seed);
        sim = crashed;
    }
    assert!(reused > 0, "no flush freed a segment");
}

/// A recovered volume's reference counts match its map, and `check`
/// finds it consistent after a clean close.
fn consistent_after_recovery(vol: Volume, sim: &SimStorage, seed: u64) {
    vol.verify_refcounts()
        .unwrap_or_else(|e| panic!("seed {seed}: after recovery: {e}"));
    vol.close().unwrap();
    drop(vol);
    let rep = check::check_volume(sim, &mut |_, _| {});
    assert!(rep.consistent(), "seed {seed}: {:?}", rep.errors);
}
