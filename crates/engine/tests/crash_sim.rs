//! Seeded crash simulation. Each seed runs random client operations against a
//! volume on the simulated store, cuts the power at a random I/O (every
//! unsynced write is kept, dropped or torn per sector), reopens, and checks:
//! - every block made durable by a completed FLUSH or FUA write reads back
//!   exactly, unless a later write to it was issued (then any written version);
//! - no block ever holds content that was never written (no garbage);
//! - `cvol check` finds the recovered volume consistent.
//!
//! Three crash cycles per seed, so recovery after recovery is covered.
//! A third of the seeds put the volume's metadata on a separate device
//! (two simulated stores, each losing its own unsynced writes).
//! Another third (`window_of`) run the dedup index in a few KiB, so that
//! its hook index fills and samples ever fewer blocks, its table cache
//! evicts, and the hook snapshot is persisted every few fingerprint tables:
//! crashes land before, during and after those snapshots, and the
//! workload copies earlier blocks elsewhere, which only the fingerprint
//! tables still know.
//!
//! Reproduce one seed: `CVOL_SIM_SEED=123 cargo test -p cvol-engine --test crash_sim -- --nocapture`
//! More seeds: `CVOL_SIM_SEEDS=5000 cargo test --release -p cvol-engine --test crash_sim`
//! The same on encrypted volumes: `CVOL_SEALED_SIM_SEED` / `CVOL_SEALED_SIM_SEEDS`.
mod common;
use common::sealed::{self, Sealing};
use common::seeds;
use common::sim::{self, h, Model};
use common::stores::Stores;
use cvol_engine::{check, Codec, OpenOptions, VolError, Volume};
use cvol_format::record::RecordKind;
use cvol_format::superblock::Packing;
use cvol_storage::{SimConfig, SimStorage};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::Arc;

use common::{BS, MIB};
const LOGICAL_BLOCKS: usize = 384;

thread_local! {
    /// Where the model's blocks lie in the volume (bytes): a seed's blocks
    /// may straddle two map pages, or two map directory blocks.
    static BASE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The volume offset of model offset `off`.
fn at(off: usize) -> u64 {
    BASE.with(|b| b.get()) + off as u64
}

/// The seed's base: at 0 (one map page), straddling pages 0 and 1, or
/// straddling the first two directory blocks (2048 pages each).
fn base_of(seed: u64) -> u64 {
    let blocks = match (seed / 2) % 3 {
        0 => 0,
        1 => 512 - 192,
        _ => 2048 * 512 - 192,
    };
    blocks * BS as u64
}

/// Block contents: zeros, random, or text (half the time from a small
/// pool, so dedup finds repeats).
fn content(rng: &mut StdRng, len: usize) -> Vec<u8> {
    sim::content(rng, len, 5, |tag| format!("block {tag:08x} text "))
}

fn is_io(e: &VolError) -> bool {
    matches!(e, VolError::Io(_) | VolError::Poisoned)
}

/// Runs random operations until they are done or the store fails. Returns
/// the number of operations run.
/// Swarm testing: each seed picks how often it syncs (1 = often, higher =
/// long unsynced bursts that cross segments and race the cleaner).
fn run_ops(
    vol: &Volume,
    model: &mut Model,
    rng: &mut StdRng,
    ops: usize,
    time: &mut sim::SimClock,
    window: bool,
) -> usize {
    let sync_rarity = [1, 1, 4, 20][rng.gen_range(0..4)];
    for i in 0..ops {
        time.tick();
        let (r, effect, fua) = one_op(vol, model, rng, sync_rarity, window);
        match &r {
            // A request refused for space has no effect.
            Err(VolError::NoSpace) => continue,
            Err(e) if !is_io(e) => panic!("unexpected error: {e}"),
            _ => {}
        }
        // Failed by the store: the write may or may not have reached it.
        if let Some((off, data)) = &effect {
            model.written(*off, data);
            if fua && r.is_ok() {
                model.durable(off / BS..(off + data.len()).div_ceil(BS));
            }
        }
        match r {
            Ok(Durable::All) => model.flushed(),
            Ok(Durable::None) => {}
            Err(_) => return i,
        }
    }
    ops
}

enum Durable {
    None,
    All,
}

type OpResult = (Result<Durable, VolError>, Option<(usize, Vec<u8>)>, bool);

/// One random operation: its result, the bytes it writes (if any), and whether it was FUA.
fn one_op(
    vol: &Volume,
    model: &Model,
    rng: &mut StdRng,
    sync_rarity: u32,
    window: bool,
) -> OpResult {
    let size = LOGICAL_BLOCKS * BS;
    let none = |r: Result<(), VolError>| r.map(|_| Durable::None);
    let mut roll = rng.gen_range(0..100);
    if (76..=93).contains(&roll) && !rng.gen_ratio(1, sync_rarity) {
        roll = rng.gen_range(0..45); // a write instead of a flush
    }
    match roll {
        0..=44 => {
            let nb = rng.gen_range(1..=16);
            let off = rng.gen_range(0..=LOGICAL_BLOCKS - nb) * BS;
            // Window seeds copy earlier blocks elsewhere a third of the
            // time (the others keep their draws).
            let data = match window && rng.gen_ratio(1, 3) {
                true => sim::copy_of(rng, &model.cur, nb * BS),
                false => content(rng, nb * BS),
            };
            let fua = rng.gen_ratio(1, 10 * sync_rarity);
            (
                none(vol.write_at(at(off), &data, fua)),
                Some((off, data)),
                fua,
            )
        }
        45..=59 => {
            let len = rng.gen_range(1..3 * BS);
            let off = rng.gen_range(0..size - len);
            let data = content(rng, len);
            (
                none(vol.write_at(at(off), &data, false)),
                Some((off, data)),
                false,
            )
        }
        60..=67 => {
            let len = rng.gen_range(1..64 * BS);
            let off = rng.gen_range(0..size - len);
            // TRIM only affects whole blocks inside the range.
            let (first, end) = (off.div_ceil(BS), (off + len) / BS);
            let effect = (first < end).then(|| (first * BS, vec![0u8; (end - first) * BS]));
            (none(vol.trim(at(off), len as u64, false)), effect, false)
        }
        68..=75 => {
            let len = rng.gen_range(1..32 * BS);
            let off = rng.gen_range(0..size - len);
            (
                none(vol.write_zeroes(at(off), len as u64, rng.gen(), false)),
                Some((off, vec![0u8; len])),
                false,
            )
        }
        76..=93 => (vol.flush().map(|_| Durable::All), None, false),
        94 => (vol.checkpoint().map(|_| Durable::All), None, false),
        // A checkpoint written outside the volume lock with a client write
        // landing between its records (as a concurrent one would): made
        // durable by it, and replayed from the snapshot's log position.
        95 => {
            let nb = rng.gen_range(1..=16);
            let off = rng.gen_range(0..=LOGICAL_BLOCKS - nb) * BS;
            let data = content(rng, nb * BS);
            let mut written = None;
            // Only a write that fits without the cleaner (it would wait
            // for the checkpoint's flush lock).
            // The checkpoint appends its records before the write runs:
            // room for the write must remain after them, or it would clean,
            // which waits for this very checkpoint.
            let st = vol.stats();
            let margin = 2 * st.checkpoint_last_bytes.max(st.segment_size_bytes);
            let fits = st.worst_case_free_logical_bytes >= 2 * (nb * BS) as u64 + margin;
            // (`at` before the closure: it runs on another thread.)
            let target = at(off);
            let r = vol.checkpoint_interleaved(|| {
                if fits {
                    written = Some(vol.write_at(target, &data, false));
                }
            });
            match written {
                // Refused for space: it changed nothing.
                Some(Err(VolError::NoSpace)) | None => (r.map(|_| Durable::All), None, false),
                Some(w) => (w.and(r).map(|_| Durable::All), Some((off, data)), false),
            }
        }
        // The cleaner checkpoints when it relocates, but that makes nothing
        // durable that the model can count on unless it actually ran.
        96 if rng.gen() => (
            vol.clean(u64::MAX, false).map(|_| Durable::None),
            None,
            false,
        ),
        // Idle cleaning: a pass that moved anything flushed, so everything
        // acknowledged before it is durable.
        96 => (
            vol.idle_clean(false).map(|r| {
                if r.segments > 0 {
                    Durable::All
                } else {
                    Durable::None
                }
            }),
            None,
            false,
        ),
        // Background recompression (policy auto; a no-op otherwise).
        // (Also returns the warm segments' space, as idle time does.)
        97 => (
            vol.recompress_pass(u64::MAX, false)
                .and_then(|_| vol.punch_warm(false))
                .map(|_| Durable::None),
            None,
            false,
        ),
        _ => {
            let mut b = vec![0u8; BS];
            let lba = rng.gen_range(0..LOGICAL_BLOCKS);
            let r = vol.read_at(at(lba * BS), &mut b);
            if r.is_ok() {
                assert!(
                    b == model.cur[lba * BS..(lba + 1) * BS],
                    "read of lba {lba} differs from the model"
                );
            }
            (none(r), None, false)
        }
    }
}

fn verify(vol: &Volume, model: &Model, seed: u64, cycle: usize) -> Vec<u8> {
    let mut image = vec![0u8; LOGICAL_BLOCKS * BS];
    vol.read_at(at(0), &mut image)
        .unwrap_or_else(|e| panic!("seed {seed} cycle {cycle}: read after recovery: {e}"));
    for (b, block) in image.chunks(BS).enumerate() {
        assert!(
            model.allowed[b].contains(&h(block)),
            "seed {seed} cycle {cycle}: lba {b} holds content that is neither its durable version nor a later write \
             (reproduce: CVOL_SIM_SEED={seed} cargo test -p cvol-engine --test crash_sim)"
        );
    }
    image
}

/// What a seed exercised, so the suite can assert it tested something.
#[derive(Default)]
struct Coverage {
    cleaner_records_moved: u64,
    cut_mid_run: u64,
    blocks_rolled_back: u64,
    blocks_kept_unflushed: u64,
    dedup_hits: u64,
    units_written: u64,
    recompressed_blocks: u64,
    idle_clean_passes: u64,
    /// Opens that took the tables a checkpoint persisted.
    tables_loaded: u64,
    /// Fingerprints the warm-up after a reopen took from the persisted
    /// fingerprint tables (the next cycle's writes dedup against them).
    warm_table_fingerprints: u64,
    /// Seeds whose metadata was on a separate device.
    metadata_device_seeds: u64,
    paged_seeds: u64,
    /// Fingerprint tables written between checkpoints.
    fingerprint_spills: u64,
    /// Freed segments written over without a punch in between.
    warm_reuses: u64,
    /// Zeros written past the log head by flushes.
    zero_ahead_bytes: u64,
    /// Seeds on a store small enough to run near full, units the cleaner
    /// compacted as it moved them, writes refused for space.
    near_full_seeds: u64,
    units_compacted: u64,
    space_refusals: u64,
    /// Seeds with the dedup index in a few KiB (`window_of`), their
    /// duplicates found through a fingerprint table, hook snapshots
    /// written, raises of the hooks' sampling, and hooks a reopen took
    /// from a snapshot.
    window_seeds: u64,
    hits_table: u64,
    hook_snapshots: u64,
    hook_sweeps: u64,
    hook_snapshot_entries: u64,
}

impl Coverage {
    fn add(&mut self, o: Coverage) {
        let Coverage {
            cleaner_records_moved,
            cut_mid_run,
            blocks_rolled_back,
            blocks_kept_unflushed,
            dedup_hits,
            units_written,
            recompressed_blocks,
            idle_clean_passes,
            tables_loaded,
            warm_table_fingerprints,
            metadata_device_seeds,
            paged_seeds,
            fingerprint_spills,
            warm_reuses,
            zero_ahead_bytes,
            near_full_seeds,
            units_compacted,
            space_refusals,
            window_seeds,
            hits_table,
            hook_snapshots,
            hook_sweeps,
            hook_snapshot_entries,
        } = o;
        self.window_seeds += window_seeds;
        self.hits_table += hits_table;
        self.hook_snapshots += hook_snapshots;
        self.hook_sweeps += hook_sweeps;
        self.hook_snapshot_entries += hook_snapshot_entries;
        self.zero_ahead_bytes += zero_ahead_bytes;
        self.fingerprint_spills += fingerprint_spills;
        self.warm_reuses += warm_reuses;
        self.cleaner_records_moved += cleaner_records_moved;
        self.cut_mid_run += cut_mid_run;
        self.blocks_rolled_back += blocks_rolled_back;
        self.blocks_kept_unflushed += blocks_kept_unflushed;
        self.dedup_hits += dedup_hits;
        self.units_written += units_written;
        self.recompressed_blocks += recompressed_blocks;
        self.idle_clean_passes += idle_clean_passes;
        self.tables_loaded += tables_loaded;
        self.warm_table_fingerprints += warm_table_fingerprints;
        self.metadata_device_seeds += metadata_device_seeds;
        self.paged_seeds += paged_seeds;
        self.near_full_seeds += near_full_seeds;
        self.units_compacted += units_compacted;
        self.space_refusals += space_refusals;
    }
}

/// Seeds 1, 4, 7, ... keep their metadata on a separate device (a small
/// one, so that it is cleaned too).
fn metadata_device_of(seed: u64) -> u64 {
    if seed % 3 == 1 {
        4 * MIB
    } else {
        0
    }
}

/// Seeds cycle through the packings (`--packing`) in threes, so that each
/// meets the metadata device and each codec.
fn packing_of(seed: u64) -> Packing {
    Packing::ALL[(seed / 3 % 3) as usize]
}

/// Seeds 3, 7, 11, ... run near full: a data store of three segments
/// beside the superblocks, where the live data (up to 1.5 MiB, half of it
/// incompressible) and the reserve leave the cleaner little room, and the
/// writes that deferral leaves raw (busy seeds) must be compacted by the
/// cleaner for the rest to fit.
fn data_store_of(seed: u64) -> u64 {
    if seed % 4 == 3 {
        4 * MIB
    } else {
        6 * MIB
    }
}

/// Seeds 0-8, 27-35, 54-62, ... (every spill setting, metadata device,
/// packing and base) run the dedup index in 8 KiB: 2 KiB of hot index,
/// 4 KiB of hooks (full at a few hundred blocks), the rest for cached
/// tables; the hook snapshot is due every 4 KiB of fingerprint tables.
fn window_of(seed: u64) -> bool {
    (seed / 9).is_multiple_of(3)
}

fn run_seed(seed: u64, sealing: Option<&Sealing>, cov: &mut Coverage) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut store = Stores::new(data_store_of(seed), metadata_device_of(seed));
    cov.near_full_seeds += u64::from(data_store_of(seed) < 6 * MIB);
    let codec = sim::codec_policies()[rng.gen_range(0..4)];
    BASE.with(|b| b.set(base_of(seed)));
    let opts = common::options(&store.data, base_of(seed) + (LOGICAL_BLOCKS * BS) as u64)
        .with_codec(codec)
        .with_dedup(rng.gen_ratio(3, 4))
        .with_packing(packing_of(seed));
    let opts = sealed::create_opts(sealing, opts);
    store.create(&opts).close().expect("close after create");
    if sealing.is_some() {
        sealed::assert_encrypted(&*store.joined());
    }
    cov.metadata_device_seeds += u64::from(store.has_meta());
    cov.paged_seeds += u64::from(packing_of(seed).paged());
    // Odd seeds keep no clean map page in memory: nearly every operation
    // reads back the pages it touches (`base_of` spreads the blocks over
    // pages and directory blocks).
    let mut time = sim::SimClock::new(seed);
    let clock = time.shared();
    let plain = || OpenOptions {
        elastic: sim::elastic(&mut StdRng::seed_from_u64(seed)),
        clock: clock.clone(),
        map_cache_bytes: (seed % 2 == 1).then_some(0),
        // A third of the seeds spill fingerprint rows every ~20 blocks.
        fingerprint_spill_bytes: match seed % 3 {
            0 => 512,
            _ => OpenOptions::default().fingerprint_spill_bytes,
        },
        // Half the seeds keep freed segments' space for the log head to
        // write over: stale records of their earlier lives lie behind the
        // new ones, and the space is returned later.
        warm_segments: (seed % 4 < 2).then_some(3),
        // Three seeds in five have flushes write zeros past the log head,
        // which later records then overwrite: recovery must stop at them.
        zero_ahead_bytes: (seed % 5 < 3).then_some(8 << 10),
        dedup_memory_bytes: window_of(seed).then_some(8 << 10),
        hook_snapshot_bytes: match window_of(seed) {
            true => 4 << 10,
            false => OpenOptions::default().hook_snapshot_bytes,
        },
        ..OpenOptions::default()
    };
    let options = || sealed::open_opts(sealing, plain());
    let window = window_of(seed);
    cov.window_seeds += u64::from(window);
    let mut vol = store.open(options()).expect("open");
    let mut model = Model::new(LOGICAL_BLOCKS);
    for cycle in 0..3 {
        let ops = rng.gen_range(20..300);
        // Let a random number of I/Os through, then fail every one after.
        let budget = rng.gen_range(0..ops as u64 / 2 + 4);
        store.set_config(SimConfig {
            io_budget: Some(budget),
            ..Default::default()
        });
        if run_ops(&vol, &mut model, &mut rng, ops, &mut time, window) < ops {
            cov.cut_mid_run += 1;
        }
        let st = vol.stats();
        cov.cleaner_records_moved += st.cleaner.cleaner_records_relocated;
        cov.dedup_hits += st.dedup.dedup_hits;
        cov.fingerprint_spills += st.fingerprint_spills;
        cov.warm_reuses += vol.warm_reuses();
        cov.zero_ahead_bytes += st.zero_ahead_bytes;
        cov.units_written += st.elastic.units_written;
        cov.recompressed_blocks += st.elastic.recompressed_blocks;
        cov.idle_clean_passes += st.cleaner.idle_clean_passes;
        cov.units_compacted += st.cleaner.cleaner_units_compacted;
        cov.space_refusals += st.cleaner.space_refusals;
        cov.hits_table += st.dedup.dedup_hits_table;
        cov.hook_snapshots += st.dedup.dedup_hook_snapshots;
        cov.hook_sweeps += st.dedup.dedup_hook_sweeps;
        vol.verify_refcounts()
            .unwrap_or_else(|e| panic!("seed {seed} cycle {cycle}: before the crash: {e}"));
        let crashed = store.crash(rng.gen());
        drop(vol);
        let reopened = (crashed.open(options()))
            .unwrap_or_else(|e| panic!("seed {seed} cycle {cycle}: reopen failed: {e}"));
        reopened
            .verify_refcounts()
            .unwrap_or_else(|e| panic!("seed {seed} cycle {cycle}: after recovery: {e}"));
        let image = verify(&reopened, &model, seed, cycle);
        for (b, (got, cur)) in image.chunks(BS).zip(model.cur.chunks(BS)).enumerate() {
            if got != cur {
                cov.blocks_rolled_back += 1;
            } else if model.allowed[b].len() > 1 {
                cov.blocks_kept_unflushed += 1;
            }
        }
        let rep = sealed::check(sealing, &*crashed.joined());
        assert!(
            rep.consistent(),
            "seed {seed} cycle {cycle}: check found {:?}",
            rep.errors
        );
        cov.tables_loaded += u64::from(reopened.opened_from_tables());
        // Tables a checkpoint named are always usable after a crash: open
        // brings them up to date with the log, never rebuilds them.
        if let Some(why) = reopened.tables_rejected() {
            panic!("seed {seed} cycle {cycle}: the tables were rejected: {why}");
        }
        // Half the reopens refill the dedup index from the fingerprint
        // tables, as a served volume does: hints the writes after must
        // never turn into wrong data.
        if rng.gen_bool(0.5) {
            reopened.warm_index();
            let d = reopened.stats().dedup;
            cov.warm_table_fingerprints += d.dedup_warm_table_fingerprints;
            cov.hook_snapshot_entries += d.dedup_hook_snapshot_entries;
        }
        model.reset_to(image);
        vol = reopened;
        store = crashed;
    }
    // A clean close and reopen: open takes the liveness tables the close's
    // checkpoint persisted, which must equal what the map gives.
    vol.close()
        .unwrap_or_else(|e| panic!("seed {seed}: close failed: {e}"));
    drop(vol);
    let reopened =
        (store.open(options())).unwrap_or_else(|e| panic!("seed {seed}: clean reopen failed: {e}"));
    cov.tables_loaded += u64::from(reopened.opened_from_tables());
    if let Some(why) = reopened.tables_rejected() {
        panic!("seed {seed}: after a clean reopen, the tables were rejected: {why}");
    }
    // The close persisted the hook index too: a window seed's warm-up
    // takes it back, and the volume still reads exactly.
    if window {
        reopened.warm_index();
        cov.hook_snapshot_entries += reopened.stats().dedup.dedup_hook_snapshot_entries;
    }
    reopened
        .verify_refcounts()
        .unwrap_or_else(|e| panic!("seed {seed}: after a clean reopen: {e}"));
    verify(&reopened, &model, seed, 3);
}

/// The window seeds exercised the dedup window and its persistence.
fn assert_window_covered(cov: &Coverage, n: u64) {
    assert!(cov.window_seeds >= n / 4, "too few window seeds");
    assert!(
        cov.hits_table > 0,
        "no duplicate was found through a fingerprint table"
    );
    assert!(cov.hook_snapshots > 0, "no hook snapshot was written");
    assert!(cov.hook_sweeps > 0, "the hooks never filled");
    assert!(
        cov.hook_snapshot_entries > 0,
        "no reopen loaded hooks from a snapshot"
    );
}

#[test]
fn crash_simulation_seeds() {
    let Some((n, cov)) = seeds::run_seeds(
        "CVOL_SIM_SEED",
        "CVOL_SIM_SEEDS",
        300,
        |seed, cov| run_seed(seed, None, cov),
        Coverage::add,
    ) else {
        return;
    };
    eprintln!(
        "{n} seeds: {} runs cut by a failing store, {} blocks rolled back to an older version, \
         {} unflushed blocks kept, {} records moved by the cleaner, {} dedup hits, \
         {} units written, {} blocks recompressed, {} idle cleaning passes, \
         {} opens from persisted tables, {} fingerprints warmed from tables, \
         {} seeds with a metadata device, {} fingerprint spills, {} page-packed seeds, \
         {} freed segments written over unpunched, {} bytes of zeros ahead of the head, \
         {} near-full seeds, {} units compacted by the cleaner, {} writes refused for space; \
         {} seeds with a dedup window of 8 KiB: {} duplicates found through fingerprint tables, \
         {} hook snapshots written, {} raises of the hook sampling, {} hooks loaded from snapshots",
        cov.cut_mid_run,
        cov.blocks_rolled_back,
        cov.blocks_kept_unflushed,
        cov.cleaner_records_moved,
        cov.dedup_hits,
        cov.units_written,
        cov.recompressed_blocks,
        cov.idle_clean_passes,
        cov.tables_loaded,
        cov.warm_table_fingerprints,
        cov.metadata_device_seeds,
        cov.fingerprint_spills,
        cov.paged_seeds,
        cov.warm_reuses,
        cov.zero_ahead_bytes,
        cov.near_full_seeds,
        cov.units_compacted,
        cov.space_refusals,
        cov.window_seeds,
        cov.hits_table,
        cov.hook_snapshots,
        cov.hook_sweeps,
        cov.hook_snapshot_entries
    );
    assert_window_covered(&cov, n);
    assert!(
        cov.units_compacted > 0,
        "the cleaner never compacted a unit"
    );
    assert!(
        cov.zero_ahead_bytes > 0,
        "no flush wrote zeros ahead of the log head"
    );
    assert!(
        cov.warm_reuses > 0,
        "no freed segment was written over unpunched"
    );
    assert!(
        cov.fingerprint_spills > 0,
        "no fingerprint rows were ever spilled"
    );
    // The simulation must actually lose unflushed data sometimes, or it tests nothing.
    assert!(cov.cut_mid_run > n / 2 && cov.blocks_rolled_back > 0 && cov.blocks_kept_unflushed > 0);
    assert!(cov.cleaner_records_moved > 0, "the cleaner never ran");
    assert!(cov.dedup_hits > 0, "dedup never found a repeat");
    assert!(cov.units_written > 0, "no merged unit was ever written");
    assert!(
        cov.recompressed_blocks > 0,
        "background recompression never ran"
    );
    assert!(
        cov.idle_clean_passes > 0,
        "idle cleaning never moved anything"
    );
    assert!(
        cov.warm_table_fingerprints > 0,
        "no reopen warmed the index from fingerprint tables"
    );
    assert!(cov.paged_seeds >= n / 2, "too few page-packed seeds");
    assert!(
        cov.metadata_device_seeds >= n / 4,
        "too few seeds with a metadata device"
    );
    assert!(
        cov.tables_loaded > n / 2,
        "opens rarely took persisted tables: {}",
        cov.tables_loaded
    );
}

/// The same simulation on encrypted volumes (`Sealing::of_seed`): every
/// record sealed, every reopen and check given the key. Few seeds in a
/// plain run (`CVOL_SEALED_SIM_SEEDS` for more, `CVOL_SEALED_SIM_SEED` for
/// one); seeds 0-35 meet every configuration the seed picks.
#[test]
fn sealed_crash_simulation_seeds() {
    let Some((n, cov)) = seeds::run_seeds(
        "CVOL_SEALED_SIM_SEED",
        "CVOL_SEALED_SIM_SEEDS",
        36,
        |seed, cov| run_seed(seed, Some(&Sealing::of_seed(seed)), cov),
        Coverage::add,
    ) else {
        return;
    };
    eprintln!(
        "{n} sealed seeds: {} runs cut, {} blocks rolled back, {} unflushed kept, \
         {} records moved by the cleaner, {} dedup hits ({} through tables), {} units compacted",
        cov.cut_mid_run,
        cov.blocks_rolled_back,
        cov.blocks_kept_unflushed,
        cov.cleaner_records_moved,
        cov.dedup_hits,
        cov.hits_table,
        cov.units_compacted,
    );
    assert!(cov.cut_mid_run > n / 2 && cov.blocks_rolled_back > 0 && cov.blocks_kept_unflushed > 0);
    assert!(cov.cleaner_records_moved > 0, "the cleaner never ran");
    assert!(
        cov.dedup_hits > 0 && cov.hits_table > 0,
        "dedup never found a repeat"
    );
    assert!(cov.metadata_device_seeds >= n / 4 && cov.window_seeds >= n / 4);
}

/// A crash loses the first unflushed record (B1) but keeps later ones,
/// including C1, the first record of the next segment. The new epoch then
/// writes exactly as many records as were lost before C1 and flushes, so
/// C1's seq is exactly the one the chain expects next. Following seq alone
/// would resurrect C1 over a flushed zeroing of its block; the epoch rule refuses it.
#[test]
fn regression_stale_records_of_crashed_epoch_never_rejoin_the_chain() {
    let sim = SimStorage::new(6 * MIB);
    let opts = common::options(&sim, (LOGICAL_BLOCKS * BS) as u64)
        .with_codec(Codec::None)
        .with_dedup(false);
    let block = |seed: u64| -> Vec<u8> {
        let mut r = StdRng::seed_from_u64(seed);
        (0..BS).map(|_| r.gen()).collect()
    };
    // WRITE_ZEROES with NO_HOLE always logs a 44-byte ZERO record.
    let zero = |v: &Volume, lba: u64| {
        v.write_zeroes(lba * BS as u64, BS as u64, true, false)
            .unwrap()
    };
    let vol = common::create(&sim, &opts);
    vol.write_at(0, &block(1), false).unwrap(); // A
    vol.flush().unwrap();
    zero(&vol, 300); // B1
    for lba in 1..300u64 {
        vol.write_at(lba * BS as u64, &block(lba + 10), false)
            .unwrap(); // into segment 1
    }
    // The flush reaches storage but its sync fails: nothing after A is durable.
    sim.set_config(SimConfig {
        io_budget: Some(1),
        ..Default::default()
    });
    assert!(vol.flush().is_err());
    let b1 = common::records_of(&sim, RecordKind::Zero, 300)[0];
    let c1 = common::record_header(&sim, cvol_format::DATA_OFFSET_BYTES + MIB);
    let b1_seq = common::record_header(&sim, b1).seq;
    let crashed = sim.crash_dropping(|sector| sector == b1 / 512 * 512);
    drop(vol);

    let vol = Volume::open(Arc::new(crashed.clone()), OpenOptions::default()).unwrap();
    let mut b = vec![0u8; BS];
    vol.read_at(0, &mut b).unwrap();
    assert!(b == block(1), "A survives");
    vol.read_at(c1.lba * BS as u64, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0), "C1 is not part of the chain");
    // The epoch record took B1's seq; these take the rest up to C1's.
    for _ in b1_seq + 1..c1.seq - 1 {
        zero(&vol, 300);
    }
    zero(&vol, c1.lba);
    vol.flush().unwrap();
    drop(vol);

    let vol = Volume::open(Arc::new(crashed.crash(1)), OpenOptions::default()).unwrap();
    vol.read_at(c1.lba * BS as u64, &mut b).unwrap();
    assert!(
        b.iter().all(|&x| x == 0),
        "a stale record of the crashed epoch undid a flushed zeroing"
    );
}

#[test]
fn space_exhaustion_under_crashes_keeps_volume_consistent() {
    // A small store that fills up: ENOSPC must never corrupt anything.
    for seed in 1000..1010 {
        let mut rng = StdRng::seed_from_u64(seed);
        let sim = SimStorage::new(4 * MIB);
        let opts = common::options(&sim, (LOGICAL_BLOCKS * BS) as u64).with_codec(Codec::None);
        let vol = common::create(&sim, &opts);
        let mut model = Model::new(LOGICAL_BLOCKS);
        let mut full = false;
        for _ in 0..400 {
            let nb = rng.gen_range(1..=16);
            let off = rng.gen_range(0..=LOGICAL_BLOCKS - nb) * BS;
            let data: Vec<u8> = (0..nb * BS).map(|_| rng.gen()).collect();
            match vol.write_at(off as u64, &data, false) {
                Ok(()) => model.written(off, &data),
                Err(VolError::NoSpace) => full = true,
                Err(e) => panic!("{e}"),
            }
            if rng.gen_ratio(1, 8) {
                vol.flush().unwrap();
                model.flushed();
            }
        }
        assert!(full, "seed {seed}: the store never filled up");
        vol.flush().unwrap();
        model.flushed();
        let crashed = sim.crash(seed);
        drop(vol);
        let v = Volume::open(Arc::new(crashed.clone()), OpenOptions::default()).unwrap();
        verify(&v, &model, seed, 0);
        assert!(check::check_volume(&crashed, &mut |_, _| {}).consistent());
    }
}
