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
//! (and `CVOL_SNAP_FAULT_SEED`, `CVOL_SNAP_FAULT_SEEDS` for the fault simulation).
mod common;
use common::seeds;
use common::sim::{self, h};
use common::{BS, MIB};
use cvol_engine::pool::{Pool, PoolError, VolumeView};
use cvol_engine::{check, Codec, OpenOptions, VolError, Volume};
use cvol_format::pool::{PoolTable, SnapState, EXTENT_BLOCKS, POOL_EXTENTS, POOL_HEADER_BYTES};
use cvol_format::pool::{POOL_SLOT_BYTES, POOL_SLOT_OFFSETS};
use cvol_storage::{SimConfig, SimStorage, Storage};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;

const BSU: u64 = BS as u64;
/// Blocks at each end of a volume (and around each extent boundary) that
/// the workload writes.
const HOT: u64 = 32;
const STORE_BYTES: u64 = 16 * MIB;
/// Seeds each simulation runs by default.
const SEEDS: u64 = 60;
const VOLS: [&str; 5] = ["default", "a", "b", "c", "d"];
const SNAPS: [&str; 5] = ["s0", "s1", "s2", "s3", "s4"];
/// Most snapshots the workload keeps of one volume.
const SNAPS_MAX: usize = 4;
/// Pool operations by kind, as the coverage counts them.
const KINDS: [&str; 10] = [
    "snapshot", "delete oldest", "delete middle", "delete newest", "rollback", "clone", "grow",
    "shrink", "create", "delete volume",
];

/// A snapshot's or a clone's base content: its non-zero blocks.
type Content = Arc<BTreeMap<u64, Vec<u8>>>;

/// What one block of a volume may hold (as pool_sim's).
#[derive(Clone)]
struct Blk {
    cur: Vec<u8>,
    /// Its version at the last flush or FUA write of it, and every later one.
    allowed: HashSet<u64>,
    history: HashSet<u64>,
}

impl Blk {
    fn durable(cur: Vec<u8>) -> Blk {
        let v = h(&cur);
        Blk {
            cur,
            allowed: HashSet::from([v]),
            history: HashSet::from([v]),
        }
    }
}

#[derive(Clone)]
struct Snap {
    name: String,
    id: u64,
    blocks: u64,
    /// Exactly what it reads: these blocks, zeros elsewhere.
    content: Content,
}

#[derive(Clone)]
struct VolModel {
    id: u64,
    blocks: u64,
    written: BTreeMap<u64, Blk>,
    /// A clone: the id of its snapshot, whose content it reads where it
    /// did not write (`base`).
    parent: u64,
    base: Content,
    /// Oldest first.
    snaps: Vec<Snap>,
}

fn zeros() -> Vec<u8> {
    vec![0u8; BS]
}

impl VolModel {
    fn new(id: u64, blocks: u64, parent: u64, base: Content) -> VolModel {
        VolModel {
            id,
            blocks,
            written: BTreeMap::new(),
            parent,
            base,
            snaps: Vec::new(),
        }
    }

    fn blk(&mut self, b: u64) -> &mut Blk {
        let base = self.base.get(&b).cloned().unwrap_or_else(zeros);
        self.written.entry(b).or_insert_with(|| Blk::durable(base))
    }

    /// What block `b` reads now.
    fn read(&self, b: u64) -> Vec<u8> {
        match self.written.get(&b) {
            Some(blk) => blk.cur.clone(),
            None => self.base.get(&b).cloned().unwrap_or_else(zeros),
        }
    }

    /// A write that may or may not persist.
    fn write(&mut self, offset: u64, data: &[u8]) {
        let end = offset + data.len() as u64;
        for b in offset / BSU..end.div_ceil(BSU) {
            let blk = self.blk(b);
            let (lo, hi) = ((b * BSU).max(offset), ((b + 1) * BSU).min(end));
            blk.cur[(lo - b * BSU) as usize..(hi - b * BSU) as usize]
                .copy_from_slice(&data[(lo - offset) as usize..(hi - offset) as usize]);
            let v = h(&blk.cur);
            blk.allowed.insert(v);
            blk.history.insert(v);
        }
    }

    fn durable(&mut self, first: u64, end: u64) {
        for (_, blk) in self.written.range_mut(first..end) {
            blk.allowed = HashSet::from([h(&blk.cur)]);
        }
    }

    /// Blocks that may read other than zeros.
    fn keys(&self) -> BTreeSet<u64> {
        let k = self.written.keys().chain(self.base.keys());
        k.copied().filter(|&b| b < self.blocks).collect()
    }

    /// What a snapshot taken now holds.
    fn content(&self) -> Content {
        let m = (self.keys().into_iter())
            .map(|b| (b, self.read(b)))
            .filter(|(_, d)| d.iter().any(|&x| x != 0));
        Arc::new(m.collect())
    }

    fn snap(&self, name: &str) -> Option<usize> {
        self.snaps.iter().position(|s| s.name == name)
    }
}

#[derive(Clone)]
struct PoolModel {
    vols: BTreeMap<String, VolModel>,
    next_id: u64,
}

/// A table as the checks compare it: (name, id, size in bytes) of every
/// volume and snapshot (`VOLUME@SNAP`), sorted.
type Key = Vec<(String, u64, u64)>;

impl PoolModel {
    fn key(&self) -> Key {
        let mut k: Key = Vec::new();
        for (n, v) in &self.vols {
            k.push((n.clone(), v.id, v.blocks * BSU));
            for s in &v.snaps {
                k.push((format!("{n}@{}", s.name), s.id, s.blocks * BSU));
            }
        }
        k.sort();
        k
    }

    fn clones_of(&self, id: u64) -> Vec<String> {
        (self.vols.iter())
            .filter(|(_, v)| v.parent == id)
            .map(|(n, _)| n.clone())
            .collect()
    }

    fn all_durable(&mut self) {
        for v in self.vols.values_mut() {
            v.durable(0, u64::MAX);
        }
    }
}

fn key_of(pool: &Pool) -> Key {
    let vols = pool.volumes().into_iter();
    let mut k: Key = vols.map(|v| (v.name, v.id, v.size_bytes)).collect();
    k.extend(pool.snapshots().into_iter().map(|s| (s.name, s.id, s.size_bytes)));
    k.sort();
    k
}

/// The newest valid table on the store, read the way `Pool::attach` does.
fn raw_table(store: &dyn Storage, uuid: &[u8; 16]) -> PoolTable {
    let mut best: Option<PoolTable> = None;
    for off in POOL_SLOT_OFFSETS {
        let mut b = vec![0u8; POOL_SLOT_BYTES as usize];
        store.read_at(off, &mut b).expect("read a table slot");
        let Ok(n) = PoolTable::payload_len(&b, uuid) else {
            continue;
        };
        if let Ok(t) = PoolTable::decode(&b[..POOL_HEADER_BYTES + n], uuid) {
            if best.as_ref().is_none_or(|b| b.generation < t.generation) {
                best = Some(t);
            }
        }
    }
    best.expect("a valid table")
}

/// Shared text (dedup shares it across volumes and snapshots), or stamped
/// with the volume's id, block and a counter.
fn content(rng: &mut StdRng, id: u64, block: u64, len: usize) -> Vec<u8> {
    match rng.gen_range(0..4) {
        0 => sim::content(rng, len, 5, |tag| format!("snap block {tag:08x} ")),
        _ => {
            let n: u32 = rng.gen();
            let stamp = format!("volume {id} block {block} version {n:08x} ");
            stamp.into_bytes().into_iter().cycle().take(len).collect()
        }
    }
}

/// Near the start, near the end, or around an extent boundary.
fn hot_block(rng: &mut StdRng, blocks: u64) -> u64 {
    let near = |at: u64, rng: &mut StdRng| at.saturating_sub(HOT) + rng.gen_range(0..2 * HOT);
    let b = match rng.gen_range(0..3) {
        0 => rng.gen_range(0..HOT),
        1 => near(blocks, rng),
        _ => near(EXTENT_BLOCKS * rng.gen_range(1..=blocks.div_ceil(EXTENT_BLOCKS)), rng),
    };
    b.min(blocks - 1)
}

/// Small, or just below or above an extent boundary.
fn size_blocks(rng: &mut StdRng) -> u64 {
    match rng.gen_range(0..6) {
        0 => EXTENT_BLOCKS - rng.gen_range(0..HOT),
        1 => EXTENT_BLOCKS + rng.gen_range(1..2 * HOT),
        _ => rng.gen_range(8..4 * HOT),
    }
}

fn is_io(e: &VolError) -> bool {
    matches!(e, VolError::Io(_) | VolError::Poisoned)
}

/// A refusal the model expects, with what its error must name.
#[derive(Debug, Clone)]
enum Refuse {
    Exists,
    SnapExists,
    HasClones(Vec<String>),
    NotNewest(Vec<String>),
    SizeChanged,
    ShrinkLayered,
    HasSnapshots,
}

const REFUSALS: usize = 7;

impl Refuse {
    fn index(&self) -> usize {
        match self {
            Refuse::Exists => 0,
            Refuse::SnapExists => 1,
            Refuse::HasClones(_) => 2,
            Refuse::NotNewest(_) => 3,
            Refuse::SizeChanged => 4,
            Refuse::ShrinkLayered => 5,
            Refuse::HasSnapshots => 6,
        }
    }

    fn matches(&self, e: &PoolError) -> bool {
        match (self, e) {
            (Refuse::HasClones(w), PoolError::HasClones { clones, .. }) => {
                let mut c = clones.clone();
                c.sort();
                w == &c
            }
            (Refuse::NotNewest(w), PoolError::NotNewest { newer, .. }) => w == newer,
            (Refuse::Exists, PoolError::Exists(_))
            | (Refuse::SnapExists, PoolError::SnapshotExists(_))
            | (Refuse::SizeChanged, PoolError::SizeChanged { .. })
            | (Refuse::ShrinkLayered, PoolError::ShrinkLayered { .. })
            | (Refuse::HasSnapshots, PoolError::HasSnapshots { .. }) => true,
            _ => false,
        }
    }
}

#[derive(Default)]
struct Coverage {
    ops: [u64; 10],
    /// Runs cut inside a pool operation, per kind.
    cut_in_op: [u64; 10],
    refusals: [u64; REFUSALS],
    table_old: u64,
    table_new: u64,
    rolled_back: u64,
    kept_unflushed: u64,
    /// Snapshot blocks read back exactly after a reopen / while running.
    snap_blocks_checked: u64,
    snap_reads: u64,
    read_only_refused: u64,
    clone_writes: u64,
    live_reopens: u64,
    stale_tails: u64,
}

impl Coverage {
    fn add(&mut self, o: Coverage) {
        for i in 0..10 {
            self.ops[i] += o.ops[i];
            self.cut_in_op[i] += o.cut_in_op[i];
        }
        for i in 0..REFUSALS {
            self.refusals[i] += o.refusals[i];
        }
        self.table_old += o.table_old;
        self.table_new += o.table_new;
        self.rolled_back += o.rolled_back;
        self.kept_unflushed += o.kept_unflushed;
        self.snap_blocks_checked += o.snap_blocks_checked;
        self.snap_reads += o.snap_reads;
        self.read_only_refused += o.read_only_refused;
        self.clone_writes += o.clone_writes;
        self.live_reopens += o.live_reopens;
        self.stale_tails += o.stale_tails;
    }
}

#[derive(Debug)]
enum PoolOp {
    Snap(String, String),
    DelSnap(String, String),
    Rollback(String, String),
    Clone(String, String, String),
    Resize(String, u64),
    Create(String, u64),
    Delete(String),
}

fn pick_snap(rng: &mut StdRng, v: &VolModel) -> Option<String> {
    (!v.snaps.is_empty()).then(|| v.snaps[rng.gen_range(0..v.snaps.len())].name.clone())
}

fn pick_pool_op(rng: &mut StdRng, m: &PoolModel) -> PoolOp {
    let other = VOLS[rng.gen_range(0..VOLS.len())].to_string();
    let names: Vec<&String> = m.vols.keys().collect();
    let Some(&name) = names.get(rng.gen_range(0..names.len().max(1))) else {
        return PoolOp::Create(other, size_blocks(rng) * BSU);
    };
    let (n, v) = (name.clone(), &m.vols[name]);
    let snap = pick_snap(rng, v);
    let newest = v.snaps.last().map(|s| s.name.clone());
    match (rng.gen_range(0..100), snap) {
        (0..30, _) if v.snaps.len() < SNAPS_MAX => {
            PoolOp::Snap(n, SNAPS[rng.gen_range(0..SNAPS.len())].into())
        }
        (0..50, Some(s)) => PoolOp::DelSnap(n, s),
        (50..62, Some(s)) => PoolOp::Rollback(n, newest.filter(|_| rng.gen_ratio(3, 4)).unwrap_or(s)),
        (62..74, Some(s)) => PoolOp::Clone(n, s, other),
        (0..74, _) => PoolOp::Snap(n, SNAPS[rng.gen_range(0..SNAPS.len())].into()),
        (74..88, _) => {
            let cur = v.blocks;
            let blocks = match rng.gen_range(0..4) {
                0 => size_blocks(rng),
                1 => cur.saturating_sub(rng.gen_range(1..HOT)).max(1),
                _ => cur + rng.gen_range(0..2 * HOT),
            };
            PoolOp::Resize(n, blocks * BSU)
        }
        (88..94, _) => PoolOp::Create(other, size_blocks(rng) * BSU),
        _ => PoolOp::Delete(n),
    }
}

/// The model after `op` if it succeeds: its kind, and whether it flushes
/// the pool on success; or the refusal expected.
fn apply(m: &PoolModel, op: &PoolOp) -> Result<(PoolModel, usize, bool), Refuse> {
    let mut next = m.clone();
    let id = next.next_id;
    match op {
        PoolOp::Snap(v, s) => {
            let vm = next.vols.get_mut(v).expect("a volume of the model");
            if vm.snap(s).is_some() {
                return Err(Refuse::SnapExists);
            }
            let (content, blocks, name) = (vm.content(), vm.blocks, s.clone());
            vm.snaps.push(Snap { name, id, blocks, content });
            next.next_id += 1;
            Ok((next, 0, true))
        }
        PoolOp::DelSnap(v, s) => {
            let i = m.vols[v].snap(s).expect("a snapshot of the model");
            let clones = m.clones_of(m.vols[v].snaps[i].id);
            if !clones.is_empty() {
                return Err(Refuse::HasClones(clones));
            }
            let vm = next.vols.get_mut(v).expect("a volume of the model");
            let last = vm.snaps.len() - 1;
            vm.snaps.remove(i);
            let kind = if i == last { 3 } else if i == 0 { 1 } else { 2 };
            Ok((next, kind, true))
        }
        PoolOp::Rollback(v, s) => rollback(next, v, s),
        PoolOp::Clone(v, s, c) => {
            if m.vols.contains_key(c) {
                return Err(Refuse::Exists);
            }
            let s = &m.vols[v].snaps[m.vols[v].snap(s).expect("a snapshot")];
            let clone = VolModel::new(id, s.blocks, s.id, s.content.clone());
            next.vols.insert(c.clone(), clone);
            next.next_id += 1;
            Ok((next, 5, false))
        }
        PoolOp::Resize(v, size) => {
            let vm = next.vols.get_mut(v).expect("a volume of the model");
            let shrink = size / BSU < vm.blocks;
            if shrink && (vm.parent != 0 || !vm.snaps.is_empty()) {
                return Err(Refuse::ShrinkLayered);
            }
            vm.written.split_off(&(size / BSU));
            vm.blocks = size / BSU;
            Ok((next, if shrink { 7 } else { 6 }, !shrink))
        }
        PoolOp::Create(v, size) => {
            if m.vols.contains_key(v) {
                return Err(Refuse::Exists);
            }
            next.vols.insert(v.clone(), VolModel::new(id, size / BSU, 0, Content::default()));
            next.next_id += 1;
            Ok((next, 8, true))
        }
        PoolOp::Delete(v) => {
            if !m.vols[v].snaps.is_empty() {
                return Err(Refuse::HasSnapshots);
            }
            next.vols.remove(v);
            Ok((next, 9, true))
        }
    }
}

fn rollback(mut next: PoolModel, v: &str, s: &str) -> Result<(PoolModel, usize, bool), Refuse> {
    let vm = next.vols.get_mut(v).expect("a volume of the model");
    let i = vm.snap(s).expect("a snapshot of the model");
    if i + 1 < vm.snaps.len() {
        let newer = vm.snaps[i + 1..].iter().map(|x| format!("{v}@{}", x.name));
        return Err(Refuse::NotNewest(newer.collect()));
    }
    let snap = vm.snaps[i].clone();
    if snap.blocks != vm.blocks {
        return Err(Refuse::SizeChanged);
    }
    let keys: BTreeSet<u64> = vm.keys().into_iter().chain(snap.content.keys().copied()).collect();
    vm.written = (keys.into_iter())
        .map(|b| (b, Blk::durable(snap.content.get(&b).cloned().unwrap_or_else(zeros))))
        .collect();
    Ok((next, 4, true))
}

fn call(pool: &Pool, op: &PoolOp) -> Result<(), PoolError> {
    match op {
        PoolOp::Snap(v, s) => pool.create_snapshot(&format!("{v}@{s}")),
        PoolOp::DelSnap(v, s) => pool.delete_snapshot(&format!("{v}@{s}"), false),
        PoolOp::Rollback(v, s) => pool.rollback(&format!("{v}@{s}")),
        PoolOp::Clone(v, s, c) => pool.clone_volume(&format!("{v}@{s}"), c),
        PoolOp::Resize(v, size) => pool.resize_volume(v, *size, true).map(|_| ()),
        PoolOp::Create(v, size) => pool.create_volume(v, *size),
        PoolOp::Delete(v) => pool.delete_volume(v, false),
    }
}

/// The state the table may have taken instead when the store failed
/// under a pool operation, and the operation's kind.
type Alt = Option<(PoolModel, usize)>;

fn pool_op(
    pool: &Pool,
    m: &mut PoolModel,
    rng: &mut StdRng,
    cov: &mut Coverage,
    arm: &dyn Fn(),
) -> Result<(), Alt> {
    let op = pick_pool_op(rng, m);
    let after = apply(m, &op);
    arm();
    match (call(pool, &op), after) {
        (Ok(()), Ok((mut next, kind, flushes))) => {
            cov.ops[kind] += 1;
            if flushes {
                next.all_durable();
            }
            *m = next;
        }
        (Ok(()), Err(want)) => panic!("{op:?} succeeded, the model expected {want:?}"),
        (Err(PoolError::Vol(e)), after) if is_io(&e) => {
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
    let snaps: Vec<(&String, &Snap)> =
        (m.vols.iter()).flat_map(|(n, v)| v.snaps.iter().map(move |s| (n, s))).collect();
    if snaps.is_empty() {
        return;
    }
    let (v, s) = snaps[rng.gen_range(0..snaps.len())];
    let full = format!("{v}@{}", s.name);
    let view = pool.volume(&full).expect("a view of every snapshot");
    let first = hot_block(rng, s.blocks);
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
                let want = s.content.get(&(first + i as u64)).cloned().unwrap_or_else(zeros);
                assert!(b == want, "{full} block {} reads other than at its creation", first + i as u64);
            }
            cov.snap_reads += 1;
            return;
        }
    };
    assert!(matches!(r, Err(VolError::ReadOnly)), "a change of {full}: {r:?}");
    cov.read_only_refused += 1;
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
    let first = hot_block(rng, vm.blocks);
    let nb = rng.gen_range(1..=8).min(vm.blocks - first);
    let (off, len) = (first * BSU, nb * BSU);
    let (r, effect, fua) = match rng.gen_range(0..100) {
        0..=54 => {
            let data = content(rng, vm.id, first, len as usize);
            let fua = rng.gen_ratio(1, 10);
            cov.clone_writes += u64::from(vm.parent != 0);
            (view.write_at(off, &data, fua), Some(data), fua)
        }
        55..=62 => {
            // Unaligned: whole blocks inside change, the edges are kept.
            let cut = rng.gen_range(0..BSU);
            let (o, l) = (off + cut, len - cut - rng.gen_range(0..BSU - cut));
            let (a, b) = (o.div_ceil(BSU), (o + l) / BSU);
            let r = view.trim(o, l, false);
            if a < b {
                vm.write(a * BSU, &vec![0u8; ((b - a) * BSU) as usize]);
            }
            (r, None, false)
        }
        63..=69 => {
            let zeros = Some(vec![0; len as usize]);
            (view.write_zeroes(off, len, rng.gen(), false), zeros, false)
        }
        70..=89 => {
            let r = view.flush();
            if r.is_ok() {
                m.all_durable();
            }
            return r.is_ok();
        }
        _ => {
            let mut b = vec![0u8; BS];
            view.read_at(off, &mut b).expect("a read");
            assert!(b == vm.read(first), "volume {name} block {first} reads other than written");
            return true;
        }
    };
    match r {
        Err(VolError::NoSpace) => return true,
        Err(ref e) if !is_io(e) => panic!("unexpected error: {e}"),
        _ => {}
    }
    if let Some(data) = effect {
        vm.write(off, &data);
        if fua && r.is_ok() {
            vm.durable(first, first + nb);
        }
    }
    r.is_ok()
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
    arm: &dyn Fn(),
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

fn open_pool(store: &SimStorage) -> Pool {
    let vol = Volume::open(Arc::new(store.clone()), OpenOptions::default())
        .unwrap_or_else(|e| panic!("reopen: {e}"));
    Pool::attach(Arc::new(vol)).unwrap_or_else(|e| panic!("attach: {e}"))
}

/// Blocks `set` below `blocks` of `view`, read a run at a time.
fn read_set(view: &VolumeView, set: &BTreeSet<u64>, blocks: u64) -> Vec<(u64, Vec<u8>)> {
    let mut out = Vec::new();
    let mut run: Vec<u64> = Vec::new();
    let flush_run = |run: &mut Vec<u64>, out: &mut Vec<(u64, Vec<u8>)>| {
        let Some(&first) = run.first() else { return };
        let mut buf = vec![0u8; run.len() * BS];
        view.read_at(first * BSU, &mut buf)
            .unwrap_or_else(|e| panic!("read {} block {first}: {e}", view.name()));
        out.extend(run.drain(..).zip(buf.chunks(BS).map(<[u8]>::to_vec)));
    };
    for &b in set.range(..blocks) {
        if run.last().is_some_and(|&l| l + 1 != b) {
            flush_run(&mut run, &mut out);
        }
        run.push(b);
    }
    flush_run(&mut run, &mut out);
    out
}

/// Checks every volume and snapshot of `m` against what the pool reads
/// at `set`, and makes what the volumes hold the model's durable state.
fn check_data(
    pool: &Pool,
    mut m: PoolModel,
    set: &BTreeSet<u64>,
    cov: &mut Coverage,
) -> Result<PoolModel, String> {
    for (name, vm) in m.vols.iter_mut() {
        let view = pool.volume(name).expect("a view");
        for (b, got) in read_set(&view, set, vm.blocks) {
            let hv = h(&got);
            let blk = vm.blk(b);
            if !blk.allowed.contains(&hv) {
                let why = if blk.history.contains(&hv) {
                    "an older version than its flushed one"
                } else if got.iter().any(|&x| x != 0) {
                    "data it never held there"
                } else {
                    "zeros instead of its flushed data"
                };
                return Err(format!("volume {name} block {b} holds {why}"));
            }
            cov.rolled_back += u64::from(hv != h(&blk.cur));
            cov.kept_unflushed += u64::from(hv == h(&blk.cur) && blk.allowed.len() > 1);
            blk.cur = got;
            blk.allowed = HashSet::from([hv]);
            blk.history.insert(hv);
        }
        for s in &vm.snaps {
            let view = pool.volume(&format!("{name}@{}", s.name)).expect("a view");
            for (b, got) in read_set(&view, set, s.blocks) {
                if got != s.content.get(&b).cloned().unwrap_or_else(zeros) {
                    let what = String::from_utf8_lossy(&got[..40]).to_string();
                    return Err(format!("snapshot {name}@{} block {b} reads {what:?}", s.name));
                }
                cov.snap_blocks_checked += 1;
            }
        }
    }
    Ok(m)
}

/// Every layer's block that is mapped (at its place in the layer), and
/// every block a model names: the blocks that may read other than zeros.
fn blocks_to_check(pool: &Pool, t: &PoolTable, models: &[&PoolModel]) -> BTreeSet<u64> {
    let mut set = BTreeSet::new();
    let layers = (t.volumes.iter().map(|v| &v.extents)).chain(t.snapshots.iter().map(|s| &s.extents));
    for extents in layers {
        for (k, &e) in extents.iter().enumerate() {
            let base = u64::from(e) * EXTENT_BLOCKS;
            let mut at = base;
            while let Some(l) = pool.engine().first_mapped(at, base + EXTENT_BLOCKS).expect("scan") {
                set.insert(k as u64 * EXTENT_BLOCKS + l - base);
                at = l + 1;
            }
        }
    }
    for vm in models.iter().flat_map(|m| m.vols.values()) {
        set.extend(vm.keys());
        set.extend(vm.snaps.iter().flat_map(|s| s.content.keys()));
    }
    set
}

/// No block outside the volumes' and snapshots' extents is mapped.
fn check_no_strays(pool: &Pool, t: &PoolTable, cov: &mut Coverage) {
    let mut owner = BTreeMap::new();
    for v in &t.volumes {
        for (k, &e) in v.extents.iter().enumerate() {
            owner.insert(e, (k as u64, v.blocks()));
        }
    }
    for s in &t.snapshots {
        for (k, &e) in s.extents.iter().enumerate() {
            owner.insert(e, (k as u64, s.size_bytes / BSU));
        }
    }
    let end = u64::from(POOL_EXTENTS) * EXTENT_BLOCKS;
    let mut at = 0;
    while let Some(l) = pool.engine().first_mapped(at, end).expect("scan the map") {
        let e = (l / EXTENT_BLOCKS) as u32;
        let Some((k, blocks)) = owner.get(&e) else {
            panic!("pool block {l} (extent {e}, no volume's or snapshot's) is mapped");
        };
        cov.stale_tails += u64::from(k * EXTENT_BLOCKS + l % EXTENT_BLOCKS >= *blocks);
        at = l + 1;
    }
}

/// The table of the store: settled, and naming what the pool lists.
fn check_table(pool: &Pool, store: &SimStorage, k: &Key) -> PoolTable {
    let t = raw_table(store, &pool.engine().superblock().uuid);
    assert!(t.pending.is_empty(), "extents still pending: {:?}", t.pending);
    assert!(
        t.snapshots.iter().all(|s| s.state == SnapState::Live),
        "a snapshot still marked after reopening"
    );
    let mut raw: Key = (t.volumes.iter()).map(|v| (v.name.clone(), v.id, v.size_bytes)).collect();
    for s in &t.snapshots {
        let v = t.volume_by_id(s.volume).expect("a snapshot's volume");
        raw.push((format!("{}@{}", v.name, s.name), s.id, s.size_bytes));
    }
    raw.sort();
    assert_eq!(&raw, k, "the table on the store and the pool's");
    t
}

/// After a reopen: the table is `m`'s or `alt`'s (for a rollback both
/// name the same: then the data decides, all one or all the other), and
/// everything reads as that model says. Returns the model to go on with.
fn check_reopened(
    pool: &Pool,
    store: &SimStorage,
    m: &PoolModel,
    alt: Option<&(PoolModel, usize)>,
    cov: &mut Coverage,
    full_check: bool,
) -> PoolModel {
    let k = key_of(pool);
    let mut cands: Vec<(&PoolModel, bool)> = Vec::new();
    if let Some((a, _)) = alt.filter(|(a, _)| a.key() == k) {
        cands.push((a, true));
    }
    if m.key() == k {
        cands.push((m, false));
    }
    assert!(!cands.is_empty(), "the table after reopening is neither the old nor the new one: {k:?}");
    let t = check_table(pool, store, &k);
    for (n, vm) in cands[0].0.vols.iter() {
        let v = t.volume(n).expect("in the table");
        assert_eq!(v.parent, vm.parent, "volume {n}'s parent in the table");
    }
    let set = blocks_to_check(pool, &t, &cands.iter().map(|c| c.0).collect::<Vec<_>>());
    let mut why = Vec::new();
    let mut next = None;
    for (c, new) in cands {
        let mut local = Coverage::default();
        match check_data(pool, c.clone(), &set, &mut local) {
            Ok(n) => {
                cov.add(local);
                cov.table_new += u64::from(new);
                cov.table_old += u64::from(!new && alt.is_some());
                next = Some(n);
                break;
            }
            Err(e) => why.push(e),
        }
    }
    let mut next = next.unwrap_or_else(|| panic!("after reopening: {}", why.join("; or ")));
    check_no_strays(pool, &t, cov);
    pool.engine()
        .verify_refcounts()
        .unwrap_or_else(|e| panic!("reference counts after reopening: {e}"));
    if full_check {
        let rep = check::check_volume(store, &mut |_, _| {});
        assert!(rep.consistent(), "check found {:?}", rep.errors);
    }
    next.next_id = t.next_id;
    next
}

/// A new pool on a new store: `default` and `a`, of random sizes.
fn new_pool(rng: &mut StdRng) -> (SimStorage, Pool, PoolModel) {
    let store = SimStorage::new(STORE_BYTES);
    let (b0, b1) = (size_blocks(rng), size_blocks(rng));
    let codec = [Codec::Lz4, Codec::None, Codec::Zstd(1)][rng.gen_range(0..3)];
    let opts = common::options(&store, b0 * BSU)
        .with_codec(codec)
        .with_dedup(rng.gen_ratio(3, 4));
    let pool = Pool::create(Arc::new(store.clone()), &opts).expect("create a pool");
    pool.create_volume("a", b1 * BSU).expect("create a");
    let vols = BTreeMap::from([
        ("default".to_string(), VolModel::new(1, b0, 0, Content::default())),
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
    for _cycle in 0..3 {
        let ops = rng.gen_range(20..160);
        // The budget runs from the start of the cycle, or from just before
        // one of its first pool operations (so that it fails inside one).
        let targeted = fault || rng.gen_bool(0.5);
        let budget = match targeted {
            true => rng.gen_range(0..24),
            false => rng.gen_range(0..ops as u64 * 3),
        };
        let at = (!targeted || rng.gen_ratio(3, 4)).then(|| rng.gen_range(0..3));
        let calls = std::cell::Cell::new(0);
        let s = store.clone();
        let set = || s.set_config(SimConfig { io_budget: Some(budget), ..SimConfig::default() });
        let arm = || {
            if targeted && at == Some(calls.get()) {
                set();
            }
            calls.set(calls.get() + 1);
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
        drop(pool);
        pool = open_pool(&next);
        m = check_reopened(&pool, &next, &m, alt.as_ref(), cov, seed.is_multiple_of(4));
        store = next;
    }
    close_and_verify(pool, &store, m, cov);
}

fn report(what: &str, n: u64, c: &Coverage) {
    let ops: Vec<String> = (0..10).map(|i| format!("{} {}/{}", KINDS[i], c.ops[i], c.cut_in_op[i])).collect();
    eprintln!(
        "{what}: {n} seeds; operations done/cut inside: {}; refusals (exists, snapshot exists, \
         has clones, not newest, size changed, shrink layered, has snapshots) {:?}; table old {} \
         new {} after a cut; {} blocks rolled back, {} unflushed kept; {} snapshot blocks \
         checked after reopens, {} snapshot reads, {} changes of a snapshot refused, {} clone \
         writes, {} stale tail blocks, {} reopens of the written image",
        ops.join(", "),
        c.refusals,
        c.table_old,
        c.table_new,
        c.rolled_back,
        c.kept_unflushed,
        c.snap_blocks_checked,
        c.snap_reads,
        c.read_only_refused,
        c.clone_writes,
        c.stale_tails,
        c.live_reopens
    );
}

/// Every kind of operation ran and every refusal happened.
fn assert_covered(c: &Coverage) {
    assert!(c.ops.iter().all(|&x| x > 0), "an operation never ran: {:?}", c.ops);
    assert!(c.refusals.iter().all(|&x| x > 0), "a refusal never happened: {:?}", c.refusals);
    assert!(c.snap_blocks_checked > 0 && c.snap_reads > 0 && c.clone_writes > 0);
}

#[test]
fn snapshot_crash_simulation_seeds() {
    let run = |seed, cov: &mut Coverage| cycles(seed, cov, false);
    let r = seeds::run_seeds("CVOL_SNAP_SIM_SEED", "CVOL_SNAP_SIM_SEEDS", SEEDS, run, Coverage::add);
    let Some((n, cov)) = r else { return };
    report("crash", n, &cov);
    assert_covered(&cov);
    assert!(cov.table_old > 0 && cov.table_new > 0, "a cut never left the old or the new table");
    assert!(cov.rolled_back > 0 && cov.kept_unflushed > 0, "no unflushed data lost or kept");
}

#[test]
fn snapshot_fault_simulation_seeds() {
    let run = |seed, cov: &mut Coverage| cycles(seed, cov, true);
    let r = seeds::run_seeds("CVOL_SNAP_FAULT_SEED", "CVOL_SNAP_FAULT_SEEDS", SEEDS, run, Coverage::add);
    let Some((n, cov)) = r else { return };
    report("fault", n, &cov);
    assert_covered(&cov);
    assert!(cov.live_reopens > 0);
}
