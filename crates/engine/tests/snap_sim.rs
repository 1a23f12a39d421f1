//! Seeded crash and fault simulation of snapshots, rollbacks and clones:
//! random writes, FUA writes, trims, write-zeroes and flushes in the hot
//! areas of a pool's volumes and clones, mixed with snapshot create and
//! delete (oldest, middle, newest), rollback to the newest snapshot,
//! clone, volume create, delete, grow and shrink, against an exact model.
//!
//! Crash simulation: the store fails every I/O after a random number of
//! them (the cut lands anywhere, inside a snapshot operation too: between
//! its mark, its moves of map entries, its flush and its table writes),
//! then loses its unsynced writes (kept, dropped or torn per sector).
//! Fault simulation: the fault is armed just before a pool operation, the
//! operation fails, its pool (in memory) shows the old or the new table,
//! and the store reopens as written or after a power cut.
//!
//! The oracle is exact for snapshots: a snapshot's creation flushes, so it
//! holds every write acknowledged before it. After every reopen:
//! - the table is the one before or after the operation in flight, with
//!   no snapshot left marked (deleting, rollback target) and no extent
//!   pending;
//! - every snapshot the table lists reads exactly its volume's content at
//!   its creation (after deletes of other snapshots too);
//! - every volume reads its flushed (or FUA) version of each block or a
//!   later write; a clone reads its snapshot's content where it did not
//!   write; a rolled-back volume reads exactly its snapshot (a rollback
//!   cut short reads all old or all rolled back, never a mix);
//! - no block outside the volumes' and snapshots' extents is mapped, the
//!   reference counts verify and `check` finds the store consistent.
//!
//! One seed: `CVOL_SNAP_SIM_SEED=N cargo test --release -p cvol-engine --test snap_sim -- --nocapture`
//! More:     `CVOL_SNAP_SIM_SEEDS=2000 cargo test --release -p cvol-engine --test snap_sim`
//! (and `CVOL_SNAP_FAULT_SEED`, `CVOL_SNAP_FAULT_SEEDS` for the fault simulation;
//! `CVOL_SEALED_SNAP_SEED`, `CVOL_SEALED_SNAP_SEEDS` for both on encrypted pools).
mod common;
#[path = "snap_sim/model.rs"]
mod model;
use common::pools;
use common::sealed::{self, Sealing};
use common::seeds;
use common::sim::{self, h};
use common::{BS, MIB};
use cvol_engine::pool::{Pool, PoolError, VolumeView};
use cvol_engine::{Codec, VolError};
use cvol_format::pool::EXTENT_BLOCKS;
use cvol_storage::{SimConfig, SimStorage};
use model::*;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::collections::BTreeMap;
use std::sync::Arc;
/// Blocks at each end of a volume (and around each extent boundary) that
/// the workload writes.
const HOT: u64 = 32;
const STORE_BYTES: u64 = 16 * MIB;
/// Seeds each simulation runs by default.
const SEEDS: u64 = 60;
const VOLS: [&str; 5] = ["default", "a", "b", "c", "d"];
const SNAPS: [&str; 6] = ["s0", "s1", "s2", "s3", "s4", "s5"];
/// Most snapshots the workload keeps of one volume.
const SNAPS_MAX: usize = 5;

/// Shared text (dedup shares it across volumes and snapshots), or stamped
/// with the volume's id, block and a counter.
fn content(rng: &mut StdRng, id: u64, block: u64, len: usize) -> Vec<u8> {
    match rng.gen_range(0..5) {
        0 => sim::content(rng, len, 5, |tag| format!("snap block {tag:08x} ")),
        // Incompressible: the log fills and the cleaner runs.
        1 => (0..len).map(|_| rng.gen()).collect(),
        _ => {
            let n: u32 = rng.gen();
            let stamp = format!("volume {id} block {block} version {n:08x} ");
            stamp.into_bytes().into_iter().cycle().take(len).collect()
        }
    }
}

/// The oldest, the newest or one between, of a volume's snapshots.
fn pick_snap(rng: &mut StdRng, v: &VolModel) -> Option<String> {
    let n = v.snaps.len();
    let i = match rng.gen_range(0..3) {
        0 => 0,
        1 if n > 2 => rng.gen_range(1..n - 1),
        _ => n.checked_sub(1)?,
    };
    v.snaps.get(i).map(|s| s.name.clone())
}

fn pick_pool_op(rng: &mut StdRng, m: &PoolModel) -> PoolOp {
    let other = VOLS[rng.gen_range(0..VOLS.len())].to_string();
    let names: Vec<&String> = m.vols.keys().collect();
    let Some(&name) = names.get(rng.gen_range(0..names.len().max(1))) else {
        return PoolOp::Create(other, pools::size_blocks(rng, HOT, 6) * BSU);
    };
    let (n, v) = (name.clone(), &m.vols[name]);
    let snap = pick_snap(rng, v);
    let newest = v.snaps.last().map(|s| s.name.clone());
    match (rng.gen_range(0..100), snap) {
        (r, _) if v.snaps.len() < SNAPS_MAX && (r < 30 || r < 50 && v.snaps.len() < 3) => {
            PoolOp::Snap(n, SNAPS[rng.gen_range(0..SNAPS.len())].into())
        }
        (0..50, Some(s)) => PoolOp::DelSnap(n, s),
        (50..62, Some(s)) => {
            PoolOp::Rollback(n, newest.filter(|_| rng.gen_ratio(3, 4)).unwrap_or(s))
        }
        (62..74, Some(s)) => PoolOp::Clone(n, s, other),
        (0..74, _) => PoolOp::Snap(n, SNAPS[rng.gen_range(0..SNAPS.len())].into()),
        (74..88, _) => {
            let cur = v.blocks;
            let blocks = match rng.gen_range(0..4) {
                0 => pools::size_blocks(rng, HOT, 6),
                1 => cur.saturating_sub(rng.gen_range(1..HOT)).max(1),
                _ => cur + rng.gen_range(0..2 * HOT),
            };
            PoolOp::Resize(n, blocks * BSU)
        }
        (88..94, _) => PoolOp::Create(other, pools::size_blocks(rng, HOT, 6) * BSU),
        _ => PoolOp::Delete(n),
    }
}

fn pool_op(
    pool: &Pool,
    m: &mut PoolModel,
    rng: &mut StdRng,
    cov: &mut Coverage,
    arm: &dyn Fn(Option<usize>),
) -> Result<(), Alt> {
    let op = pick_pool_op(rng, m);
    let after = apply(m, &op);
    arm(after.as_ref().ok().map(|a| a.1));
    match (call(pool, &op), after) {
        (Ok(()), Ok((mut next, kind, flushes))) => {
            cov.ops[kind] += 1;
            if flushes {
                next.all_durable();
            }
            *m = next;
        }
        (Ok(()), Err(want)) => panic!("{op:?} succeeded, the model expected {want:?}"),
        (Err(PoolError::Vol(e)), after) if pools::is_io(&e) => {
            let alt = after.ok().map(|(n, kind, _)| (n, kind));
            let k = key_of(pool);
            let took = alt.as_ref().is_some_and(|(n, _)| n.key() == k);
            assert!(took || m.key() == k, "after a failed {op:?}: {k:?}");
            if let Some((_, kind)) = &alt {
                cov.cut_in_op[*kind] += 1;
            }
            return Err(alt);
        }
        (Err(e), Err(want)) if want.matches(&e) => cov.refusals[want.index()] += 1,
        (Err(e), want) => panic!("{op:?}: {e} (the model expected {:?})", want.err()),
    }
    Ok(())
}

/// A read or an attempted change of a random snapshot: it reads exactly
/// its content, and refuses every change.
fn snapshot_op(pool: &Pool, m: &PoolModel, rng: &mut StdRng, cov: &mut Coverage) {
    let snaps: Vec<(&String, &Snap)> = (m.vols.iter())
        .flat_map(|(n, v)| v.snaps.iter().map(move |s| (n, s)))
        .collect();
    if snaps.is_empty() {
        return;
    }
    let (v, s) = snaps[rng.gen_range(0..snaps.len())];
    let full = format!("{v}@{}", s.name);
    let view = pool.volume(&full).expect("a view of every snapshot");
    let first = pools::hot_block(rng, s.blocks, HOT);
    let nb = rng.gen_range(1..=8).min(s.blocks - first);
    let (off, len) = (first * BSU, nb * BSU);
    let r = match rng.gen_range(0..8) {
        0 => view.write_at(off, &vec![1u8; len as usize], rng.gen()),
        1 => view.trim(off, len, false),
        2 => view.write_zeroes(off, len, rng.gen(), false),
        _ => {
            let mut got = vec![0u8; len as usize];
            view.read_at(off, &mut got).expect("read a snapshot");
            for (i, b) in got.chunks(BS).enumerate() {
                let want = s
                    .content
                    .get(&(first + i as u64))
                    .cloned()
                    .unwrap_or_else(zeros);
                assert!(
                    b == want,
                    "{full} block {} reads other than at its creation",
                    first + i as u64
                );
            }
            cov.snap_reads += 1;
            return;
        }
    };
    assert!(
        matches!(r, Err(VolError::ReadOnly)),
        "a change of {full}: {r:?}"
    );
    cov.read_only_refused += 1;
}

fn is_ok_or_space(r: Result<(), VolError>) -> bool {
    match r {
        Ok(()) | Err(VolError::NoSpace) => true,
        Err(e) if pools::is_io(&e) => false,
        Err(e) => panic!("cleaning: {e}"),
    }
}

/// One random I/O on a random volume; false when the store failed.
fn io_op(pool: &Pool, m: &mut PoolModel, rng: &mut StdRng, cov: &mut Coverage) -> bool {
    let names: Vec<String> = m.vols.keys().cloned().collect();
    if names.is_empty() || rng.gen_ratio(1, 8) {
        snapshot_op(pool, m, rng, cov);
        return true;
    }
    let name = &names[rng.gen_range(0..names.len())];
    let vm = m.vols.get_mut(name).expect("a volume of the model");
    let view = pool.volume(name).expect("a view of every volume");
    let first = pools::hot_block(rng, vm.blocks, HOT);
    let most = [8, 8, 32][rng.gen_range(0..3)];
    let nb = rng.gen_range(1..=most).min(vm.blocks - first);
    let (off, len) = (first * BSU, nb * BSU);
    let (r, effect) = match rng.gen_range(0..100) {
        0..=54 => (write_op(&view, vm, rng, cov, off, len), None),
        55..=62 => {
            // Unaligned: whole blocks inside change, the edges are kept.
            let cut = rng.gen_range(0..BSU);
            let (o, l) = (off + cut, len - cut - rng.gen_range(0..BSU - cut));
            let (a, b) = (o.div_ceil(BSU), (o + l) / BSU);
            let r = view.trim(o, l, false);
            if a < b {
                vm.write(a * BSU, &vec![0u8; ((b - a) * BSU) as usize]);
            }
            (r, None)
        }
        // A discard of the volume's last extent (all of a small volume, as
        // mkfs does): an extent may hold nothing at the next snapshot.
        // (Only where that is a few blocks: a delete fills the extents its
        // snapshot did not take with zeros in the older one, all of them.)
        63 if vm.parent == 0 && (vm.blocks - 1) % EXTENT_BLOCKS < 8 * HOT => {
            let start = (vm.blocks - 1) / EXTENT_BLOCKS * EXTENT_BLOCKS;
            let r = view.trim(start * BSU, (vm.blocks - start) * BSU, false);
            if !matches!(r, Err(VolError::NoSpace)) {
                vm.zero_from(start);
                cov.discards += 1;
            }
            (r, None)
        }
        63..=69 => {
            let zeros = Some(vec![0; len as usize]);
            (view.write_zeroes(off, len, rng.gen(), false), zeros)
        }
        // The cleaner moves the records snapshots refer to; an idle pass
        // that moved anything flushed.
        70 => return is_ok_or_space(pool.engine().clean(u64::MAX, false).map(|_| ())),
        71..=72 => {
            let r = pool.engine().idle_clean(false);
            if r.as_ref().is_ok_and(|r| r.segments > 0) {
                m.all_durable();
            }
            return r.is_ok();
        }
        73..=86 => {
            let r = view.flush();
            if r.is_ok() {
                m.all_durable();
            }
            return r.is_ok();
        }
        // A checkpoint (durable as a flush): two of them carry directory
        // blocks no write touched over, and a reopen leaves those unread.
        87..=89 => {
            let r = pool.engine().checkpoint();
            if r.is_ok() {
                m.all_durable();
            }
            return is_ok_or_space(r);
        }
        _ => {
            let mut b = vec![0u8; BS];
            view.read_at(off, &mut b).expect("a read");
            assert!(
                b == vm.read(first),
                "volume {name} block {first} reads other than written"
            );
            return true;
        }
    };
    match r {
        Err(VolError::NoSpace) => {
            cov.no_space += 1;
            return true;
        }
        Err(ref e) if !pools::is_io(e) => panic!("unexpected error: {e}"),
        _ => {}
    }
    if let Some(data) = effect {
        vm.write(off, &data);
    }
    r.is_ok()
}

/// A write of `len` bytes from `off` (one in eight starting or ending
/// inside a block), FUA one time in ten, and its effect on the model.
fn write_op(
    view: &VolumeView,
    vm: &mut VolModel,
    rng: &mut StdRng,
    cov: &mut Coverage,
    off: u64,
    len: u64,
) -> Result<(), VolError> {
    let (o, l) = match rng.gen_ratio(1, 8) {
        true => {
            let (cut, tail) = (rng.gen_range(0..len / 2), rng.gen_range(0..len / 2));
            (off + cut, len - cut - tail)
        }
        false => (off, len),
    };
    let data = content(rng, vm.id, off / BSU, l as usize);
    let fua = rng.gen_ratio(1, 10);
    cov.clone_writes += u64::from(vm.parent != 0);
    let r = view.write_at(o, &data, fua);
    if !matches!(r, Err(VolError::NoSpace)) {
        vm.write(o, &data);
    }
    if fua && r.is_ok() {
        vm.durable(o / BSU, (o + l).div_ceil(BSU));
    }
    r
}

enum Ended {
    Done,
    Cut(Alt),
}

fn run_ops(
    pool: &Pool,
    m: &mut PoolModel,
    rng: &mut StdRng,
    ops: usize,
    cov: &mut Coverage,
    arm: &dyn Fn(Option<usize>),
) -> Ended {
    let pool_rarity = [3, 6, 12][rng.gen_range(0..3)];
    for _ in 0..ops {
        if rng.gen_ratio(1, pool_rarity) {
            if let Err(alt) = pool_op(pool, m, rng, cov, arm) {
                return Ended::Cut(alt);
            }
        } else if !io_op(pool, m, rng, cov) {
            return Ended::Cut(None);
        }
    }
    Ended::Done
}

/// A new pool on a new store: `default` and `a`, of random sizes.
fn new_pool(rng: &mut StdRng) -> (SimStorage, Pool, PoolModel) {
    let store = SimStorage::new(STORE_BYTES);
    let (b0, b1) = (
        pools::size_blocks(rng, HOT, 6),
        pools::size_blocks(rng, HOT, 6),
    );
    let codec = [Codec::Lz4, Codec::None, Codec::Zstd(1)][rng.gen_range(0..3)];
    let opts = common::options(&store, b0 * BSU)
        .with_codec(codec)
        .with_dedup(rng.gen_ratio(3, 4));
    let opts = sealed::create_opts(sealed::current().as_ref(), opts);
    let pool = Pool::create(Arc::new(store.clone()), &opts).expect("create a pool");
    pool.create_volume("a", b1 * BSU).expect("create a");
    if opts.encryption.is_some() {
        sealed::assert_encrypted(&store);
    }
    let vols = BTreeMap::from([
        (
            "default".to_string(),
            VolModel::new(1, b0, 0, Content::default()),
        ),
        ("a".to_string(), VolModel::new(2, b1, 0, Content::default())),
    ]);
    (store, pool, PoolModel { vols, next_id: 3 })
}

fn power_cut(store: &SimStorage, rng: &mut StdRng) -> SimStorage {
    if rng.gen_ratio(3, 4) {
        store.crash(rng.gen())
    } else {
        let salt: u64 = rng.gen();
        store.crash_dropping(move |s| h(&(s ^ salt).to_le_bytes()).is_multiple_of(3))
    }
}

/// After the last cycle: a clean close makes everything durable, and the
/// pool reopens exactly as the model has it.
fn close_and_verify(pool: Pool, store: &SimStorage, mut m: PoolModel, cov: &mut Coverage) {
    pool.engine().close().expect("a clean close");
    drop(pool);
    m.all_durable();
    let pool = open_pool(store);
    check_reopened(&pool, store, &m, None, cov, true);
}

/// `cycles` runs of random operations, each ended by `crash` (given the
/// store and whether the run was cut) and a reopen.
fn cycles(seed: u64, cov: &mut Coverage, fault: bool) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut store, mut pool, mut m) = new_pool(&mut rng);
    for cycle in 0..3u64 {
        let ops = rng.gen_range(20..160);
        // The budget runs from the start of the cycle, or from just before
        // the first pool operation of a chosen kind (it fails inside one).
        let targeted = fault || rng.gen_bool(0.5);
        let budget = match targeted {
            true => rng.gen_range(0..10),
            false => rng.gen_range(0..ops as u64 * 3),
        };
        let target = (targeted && rng.gen_ratio(7, 8)).then(|| rng.gen_range(0..KINDS.len()));
        let armed = std::cell::Cell::new(!targeted);
        let s = store.clone();
        let set = || {
            s.set_config(SimConfig {
                io_budget: Some(budget),
                ..SimConfig::default()
            })
        };
        let arm = |kind: Option<usize>| {
            if !armed.get() && kind.is_some() && kind == target {
                armed.set(true);
                set();
            }
        };
        if !targeted {
            set();
        }
        let alt = match run_ops(&pool, &mut m, &mut rng, ops, cov, &arm) {
            Ended::Done => None,
            Ended::Cut(alt) => alt,
        };
        let next = if fault && rng.gen_bool(0.5) {
            cov.live_reopens += 1;
            store.snapshot_live()
        } else {
            power_cut(&store, &mut rng)
        };
        cov.cleaned += pool.engine().stats().cleaner.cleaner_segments_cleaned;
        cov.unread_read += pool.engine().map_dir_blocks_read();
        drop(pool);
        pool = open_pool(&next);
        cov.unread_at_open += pool.engine().map_dir_blocks_unread() as u64;
        if !fault && (seed + cycle).is_multiple_of(2) && pool.engine().map_dir_blocks_unread() > 0 {
            // A checkpoint and a clean close while blocks are unread (the
            // checks below read them all): its commits name them as they
            // are, or the reopen finds the pages they hold gone.
            pool.engine()
                .checkpoint()
                .expect("a checkpoint after reopening");
            pool.engine().close().expect("a close after reopening");
            cov.checkpoint_unread += 1;
            drop(pool);
            pool = open_pool(&next);
        }
        m = check_reopened(&pool, &next, &m, alt.as_ref(), cov, seed.is_multiple_of(4));
        store = next;
    }
    close_and_verify(pool, &store, m, cov);
}

#[test]
fn snapshot_crash_simulation_seeds() {
    let run = |seed, cov: &mut Coverage| cycles(seed, cov, false);
    let r = seeds::run_seeds(
        "CVOL_SNAP_SIM_SEED",
        "CVOL_SNAP_SIM_SEEDS",
        SEEDS,
        run,
        Coverage::add,
    );
    let Some((n, cov)) = r else { return };
    report("crash", n, &cov);
    assert_covered(&cov);
    assert!(
        cov.table_old > 0 && cov.table_new > 0,
        "a cut never left the old or the new table"
    );
    assert!(
        cov.rolled_back > 0 && cov.kept_unflushed > 0,
        "no unflushed data lost or kept"
    );
    assert!(
        cov.checkpoint_unread > 0,
        "no checkpoint was taken while blocks were unread"
    );
}

#[test]
fn snapshot_fault_simulation_seeds() {
    let run = |seed, cov: &mut Coverage| cycles(seed, cov, true);
    let r = seeds::run_seeds(
        "CVOL_SNAP_FAULT_SEED",
        "CVOL_SNAP_FAULT_SEEDS",
        SEEDS,
        run,
        Coverage::add,
    );
    let Some((n, cov)) = r else { return };
    report("fault", n, &cov);
    assert_covered(&cov);
    assert!(cov.live_reopens > 0);
}

/// Both simulations on encrypted pools (`Sealing::of_seed`): even seeds
/// cut the power, odd ones add live reopens under failing I/O. Few seeds
/// in a plain run (`CVOL_SEALED_SNAP_SEEDS` for more).
#[test]
fn sealed_snapshot_simulation_seeds() {
    let run = |seed, cov: &mut Coverage| {
        let fault = seed % 2 == 1;
        sealed::with_current(Some(Sealing::of_seed(seed)), || cycles(seed, cov, fault))
    };
    let r = seeds::run_seeds(
        "CVOL_SEALED_SNAP_SEED",
        "CVOL_SEALED_SNAP_SEEDS",
        24,
        run,
        Coverage::add,
    );
    let Some((n, cov)) = r else { return };
    report("sealed", n, &cov);
    assert!(cov.live_reopens > 0 && cov.rolled_back > 0);
}

/// A block of text naming `tag` and block `b`.
fn tagged(tag: &str, b: u64) -> Vec<u8> {
    format!("{tag} block {b} ")
        .into_bytes()
        .into_iter()
        .cycle()
        .take(BS)
        .collect()
}

/// What a view should read: blocks [first, end) of each `(tag, first, end)`
/// in order (later ones over earlier ones; tag "" for zeros).
fn image(runs: &[(&str, u64, u64)]) -> BTreeMap<u64, Vec<u8>> {
    let mut m = BTreeMap::new();
    for &(tag, a, b) in runs {
        for k in a..b {
            m.insert(
                k,
                if tag.is_empty() {
                    zeros()
                } else {
                    tagged(tag, k)
                },
            );
        }
    }
    m
}

fn write_run(pool: &Pool, name: &str, tag: &str, first: u64, end: u64) {
    let data: Vec<u8> = (first..end).flat_map(|b| tagged(tag, b)).collect();
    pool.volume(name)
        .unwrap()
        .write_at(first * BSU, &data, false)
        .unwrap();
}

/// Every block of `name` reads exactly `want` (zeros where it names none).
fn assert_reads(pool: &Pool, name: &str, want: &BTreeMap<u64, Vec<u8>>) {
    let view = pool
        .volume(name)
        .unwrap_or_else(|| panic!("no view {name}"));
    let blocks = view.size_bytes() / BSU;
    let mut got = vec![0u8; blocks as usize * BS];
    view.read_at(0, &mut got).unwrap();
    for (b, d) in got.chunks(BS).enumerate() {
        let w = want.get(&(b as u64)).cloned().unwrap_or_else(zeros);
        assert!(
            d == w,
            "{name} block {b}: {:?}",
            String::from_utf8_lossy(&d[..24])
        );
    }
}

/// A pool with volume `v` of `blocks` blocks (and `default`, unused).
fn directed_pool(blocks: u64) -> (SimStorage, Pool) {
    let store = SimStorage::new(STORE_BYTES);
    let pool = Pool::create(Arc::new(store.clone()), &common::options(&store, 8 * BSU)).unwrap();
    pool.create_volume("v", blocks * BSU).unwrap();
    (store, pool)
}

/// Closes `pool` cleanly, reopens it, checks refcounts and `check`.
fn reopen(pool: Pool, store: &SimStorage) -> Pool {
    pool.engine().close().unwrap();
    drop(pool);
    let pool = open_pool(store);
    pool.engine().verify_refcounts().unwrap();
    let rep = cvol_engine::check::check_volume(store, &mut |_, _| {});
    assert!(rep.consistent(), "check: {:?}", rep.errors);
    pool
}

#[test]
fn a_snapshot_keeps_what_the_volume_overwrites() {
    let (store, pool) = directed_pool(64);
    write_run(&pool, "v", "one", 0, 8);
    pool.create_snapshot("v@s").unwrap();
    write_run(&pool, "v", "two", 0, 4);
    let v = pool.volume("v").unwrap();
    v.trim(4 * BSU, 2 * BSU, false).unwrap();
    v.write_zeroes(6 * BSU, 2 * BSU, true, false).unwrap();
    write_run(&pool, "v", "new", 8, 10);
    let one = image(&[("one", 0, 8)]);
    let now = image(&[("two", 0, 4), ("new", 8, 10)]);
    assert_reads(&pool, "v@s", &one);
    assert_reads(&pool, "v", &now);
    let e = pool.volume("v@s").unwrap().write_at(0, &zeros(), false);
    assert!(matches!(e, Err(VolError::ReadOnly)), "{e:?}");
    // Nothing was flushed since the snapshot: a power cut leaves the
    // volume as the snapshot; after a flush, as written.
    let p = open_pool(&store.crash_dropping(|_| true));
    assert_reads(&p, "v@s", &one);
    assert_reads(&p, "v", &one);
    pool.engine().flush().unwrap();
    let p = open_pool(&store.crash_dropping(|_| true));
    assert_reads(&p, "v@s", &one);
    assert_reads(&p, "v", &now);
    let pool = reopen(pool, &store);
    assert_reads(&pool, "v@s", &one);
    assert_reads(&pool, "v", &now);
}

#[test]
fn deleting_a_middle_snapshot_keeps_the_older_and_newer_ones() {
    let (store, pool) = directed_pool(64);
    write_run(&pool, "v", "A", 0, 12);
    pool.create_snapshot("v@s1").unwrap();
    write_run(&pool, "v", "B", 4, 12);
    // s2 is larger than s1: what it keeps beyond s1's end has nowhere to go.
    pool.resize_volume("v", 80 * BSU, false).unwrap();
    write_run(&pool, "v", "E", 70, 72);
    pool.create_snapshot("v@s2").unwrap();
    write_run(&pool, "v", "C", 8, 16);
    write_run(&pool, "v", "F", 71, 73);
    pool.create_snapshot("v@s3").unwrap();
    write_run(&pool, "v", "D", 0, 2);
    write_run(&pool, "v", "D", 10, 14);
    let s1 = image(&[("A", 0, 12)]);
    let s3 = image(&[
        ("A", 0, 4),
        ("B", 4, 8),
        ("C", 8, 16),
        ("E", 70, 71),
        ("F", 71, 73),
    ]);
    let v = image(&[
        ("A", 0, 4),
        ("B", 4, 8),
        ("C", 8, 16),
        ("D", 0, 2),
        ("D", 10, 14),
    ]);
    let v = (v.into_iter())
        .chain(image(&[("E", 70, 71), ("F", 71, 73)]))
        .collect();
    pool.delete_snapshot("v@s2", false).unwrap();
    assert!(pool.volume("v@s2").is_none());
    let check = |p: &Pool| {
        assert_reads(p, "v@s1", &s1);
        assert_reads(p, "v@s3", &s3);
        assert_reads(p, "v", &v);
    };
    check(&pool);
    let pool = reopen(pool, &store);
    check(&pool);
    pool.delete_snapshot("v@s1", false).unwrap();
    assert_reads(&pool, "v@s3", &s3);
    pool.delete_snapshot("v@s3", false).unwrap();
    assert_reads(&reopen(pool, &store), "v", &v);
}

#[test]
fn a_rollback_reads_exactly_the_newest_snapshot() {
    let (store, pool) = directed_pool(64);
    write_run(&pool, "v", "A", 0, 8);
    pool.create_snapshot("v@s1").unwrap();
    write_run(&pool, "v", "B", 0, 4);
    pool.create_snapshot("v@s2").unwrap();
    write_run(&pool, "v", "C", 2, 6);
    let v = pool.volume("v").unwrap();
    v.trim(6 * BSU, 2 * BSU, false).unwrap();
    write_run(&pool, "v", "D", 20, 22);
    let e = pool.rollback("v@s1").unwrap_err();
    assert!(
        matches!(&e, PoolError::NotNewest { newer, .. } if newer == &["v@s2"]),
        "{e}"
    );
    let s1 = image(&[("A", 0, 8)]);
    let s2 = image(&[("B", 0, 4), ("A", 4, 8)]);
    pool.rollback("v@s2").unwrap();
    assert_reads(&pool, "v", &s2);
    assert_reads(&pool, "v@s2", &s2);
    assert_reads(&pool, "v@s1", &s1);
    // Again, after more writes; then refused while a client has it open,
    // and after a grow.
    write_run(&pool, "v", "E", 0, 2);
    pool.rollback("v@s2").unwrap();
    assert_reads(&pool, "v", &s2);
    let guard = pool.volume("v").unwrap().open_guard();
    assert!(matches!(
        pool.rollback("v@s2"),
        Err(PoolError::RollbackInUse { .. })
    ));
    drop(guard);
    let pool = reopen(pool, &store);
    assert_reads(&pool, "v", &s2);
    assert_reads(&pool, "v@s1", &s1);
    pool.resize_volume("v", 72 * BSU, false).unwrap();
    assert!(matches!(
        pool.rollback("v@s2"),
        Err(PoolError::SizeChanged { .. })
    ));
}

#[test]
fn a_clone_changes_neither_its_snapshot_nor_its_origin() {
    let (store, pool) = directed_pool(64);
    write_run(&pool, "v", "A", 0, 8);
    pool.create_snapshot("v@s").unwrap();
    pool.clone_volume("v@s", "c").unwrap();
    write_run(&pool, "c", "X", 0, 2);
    pool.volume("c").unwrap().trim(2 * BSU, BSU, false).unwrap();
    write_run(&pool, "v", "Y", 4, 6);
    let s = image(&[("A", 0, 8)]);
    let v = image(&[("A", 0, 8), ("Y", 4, 6)]);
    let c = image(&[("A", 0, 8), ("X", 0, 2), ("", 2, 3)]);
    assert_reads(&pool, "v@s", &s);
    assert_reads(&pool, "v", &v);
    assert_reads(&pool, "c", &c);
    pool.create_snapshot("c@t").unwrap();
    write_run(&pool, "c", "Z", 5, 6);
    let c2 = (c.clone().into_iter())
        .chain(image(&[("Z", 5, 6)]))
        .collect();
    assert_reads(&pool, "c@t", &c);
    assert_reads(&pool, "c", &c2);
    let e = pool.delete_snapshot("v@s", false).unwrap_err();
    assert!(
        matches!(&e, PoolError::HasClones { clones, .. } if clones == &["c"]),
        "{e}"
    );
    assert!(matches!(
        pool.delete_volume("v", false),
        Err(PoolError::HasSnapshots { .. })
    ));
    let pool = reopen(pool, &store);
    for (name, want) in [("v@s", &s), ("v", &v), ("c@t", &c), ("c", &c2)] {
        assert_reads(&pool, name, want);
    }
    pool.delete_snapshot("c@t", false).unwrap();
    pool.delete_volume("c", false).unwrap();
    pool.delete_snapshot("v@s", false).unwrap();
    assert_reads(&reopen(pool, &store), "v", &v);
}

/// The state a sweep starts from: `v` with A on blocks 0..16 (flushed),
/// snapshot `v@a`, then B on 8..24 (flushed if `flush`).
fn sweep_start(flush: bool) -> (SimStorage, Pool) {
    let (store, pool) = directed_pool(64);
    write_run(&pool, "v", "A", 0, 16);
    pool.create_snapshot("v@a").unwrap();
    write_run(&pool, "v", "B", 8, 24);
    if flush {
        pool.engine().flush().unwrap();
    }
    (store, pool)
}

/// Runs `op` from `sweep_start` with the store failing after n I/Os, for
/// every n up to the I/Os it takes whole, then reopens after power cuts
/// of every kind; `check` gets the reopened pool. Returns the cut points.
fn sweep(flush: bool, op: impl Fn(&Pool) -> Result<(), PoolError>, check: impl Fn(&Pool)) -> u64 {
    let (store, pool) = sweep_start(flush);
    store.set_config(SimConfig::default());
    op(&pool).unwrap();
    let total = store.io_count();
    for n in 0..=total {
        let (store, pool) = sweep_start(flush);
        store.set_config(SimConfig {
            io_budget: Some(n),
            ..SimConfig::default()
        });
        let r = op(&pool);
        assert!(r.is_ok() == (n == total), "{n} of {total} I/Os: {r:?}");
        let cuts = [
            store.crash(n),
            store.crash(n + 1000),
            store.crash_dropping(|_| true),
        ];
        for crashed in cuts.iter().chain([&store.snapshot_live()]) {
            let p = open_pool(crashed);
            check(&p);
            p.engine().verify_refcounts().unwrap();
            let rep = cvol_engine::check::check_volume(crashed, &mut |_, _| {});
            assert!(
                rep.consistent(),
                "{n} of {total} I/Os: check {:?}",
                rep.errors
            );
        }
    }
    total
}

/// Every block of `v` below 24 reads one of the versions `allowed` gives.
fn assert_volume_one_of(pool: &Pool, allowed: impl Fn(u64) -> Vec<Vec<u8>>) {
    let mut got = vec![0u8; 24 * BS];
    pool.volume("v").unwrap().read_at(0, &mut got).unwrap();
    for (b, d) in got.chunks(BS).enumerate() {
        assert!(allowed(b as u64).iter().any(|w| w == d), "v block {b}");
    }
}

#[test]
fn a_snapshot_cut_at_every_io_of_its_creation_is_whole_or_absent() {
    let a = image(&[("A", 0, 16)]);
    let b = image(&[("A", 0, 8), ("B", 8, 24)]);
    let (seen_new, seen_old) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    let total = sweep(
        false,
        |p| p.create_snapshot("v@b"),
        |p| {
            assert_reads(p, "v@a", &a);
            if p.volume("v@b").is_some() {
                // Its creation flushed first: B is in it, and in the volume.
                assert_reads(p, "v@b", &b);
                assert_reads(p, "v", &b);
                seen_new.set(seen_new.get() + 1);
            } else {
                let old = |k| a.get(&k).cloned().unwrap_or_else(zeros);
                let new = |k| b.get(&k).cloned().unwrap_or_else(zeros);
                assert_volume_one_of(p, |k| vec![old(k), new(k)]);
                seen_old.set(seen_old.get() + 1);
            }
        },
    );
    assert!(
        total > 2 && seen_new.get() > 0 && seen_old.get() > 0,
        "{total} I/Os"
    );
}

#[test]
fn a_rollback_or_delete_cut_at_every_io_is_all_or_nothing() {
    let a = image(&[("A", 0, 16)]);
    let b = image(&[("A", 0, 8), ("B", 8, 24)]);
    let rolled_back = std::cell::Cell::new(0);
    let total = sweep(
        true,
        |p| p.rollback("v@a"),
        |p| {
            assert_reads(p, "v@a", &a);
            let mut got = vec![0u8; 24 * BS];
            p.volume("v").unwrap().read_at(0, &mut got).unwrap();
            let was = |m: &BTreeMap<u64, Vec<u8>>| {
                (got.chunks(BS).enumerate())
                    .all(|(k, d)| m.get(&(k as u64)).map_or(d == zeros(), |w| w == d))
            };
            assert!(
                was(&a) || was(&b),
                "the volume is neither rolled back nor as it was"
            );
            rolled_back.set(rolled_back.get() + u64::from(was(&a)));
        },
    );
    assert!(rolled_back.get() > 0 && rolled_back.get() < 4 * (total + 1));
    sweep(
        true,
        |p| p.delete_snapshot("v@a", false),
        |p| {
            if p.volume("v@a").is_some() {
                assert_reads(p, "v@a", &a);
            }
            assert_reads(p, "v", &b);
        },
    );
}
