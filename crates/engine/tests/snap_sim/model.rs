//! The model and the checks of the snapshot simulation (`snap_sim.rs`):
//! what every volume, clone and snapshot of a pool may read, the pool
//! operations on the model (with the refusals it expects), and the
//! checks after a reopen.
use crate::common::sealed;
use crate::common::sim::h;
use crate::common::BS;
use cvol_engine::pool::{Pool, PoolError, VolumeView};
use cvol_engine::{OpenOptions, Volume};
use cvol_format::pool::POOL_HEADER_BYTES;
use cvol_format::pool::{PoolTable, SnapState, EXTENT_BLOCKS, NO_EXTENT, POOL_EXTENTS};
use cvol_format::pool::{POOL_SLOT_BYTES, POOL_SLOT_OFFSETS};
use cvol_storage::{SimStorage, Storage};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;

pub const BSU: u64 = BS as u64;
/// A snapshot's or a clone's base content: its non-zero blocks.
pub type Content = Arc<BTreeMap<u64, Vec<u8>>>;

/// What one block of a volume may hold (as pool_sim's).
#[derive(Clone)]
pub struct Blk {
    pub cur: Vec<u8>,
    /// Its version at the last flush or FUA write of it, and every later one.
    pub allowed: HashSet<u64>,
    pub history: HashSet<u64>,
}

impl Blk {
    pub fn durable(cur: Vec<u8>) -> Blk {
        let v = h(&cur);
        Blk {
            cur,
            allowed: HashSet::from([v]),
            history: HashSet::from([v]),
        }
    }
}

#[derive(Clone)]
pub struct Snap {
    pub name: String,
    pub id: u64,
    pub blocks: u64,
    /// Exactly what it reads: these blocks, zeros elsewhere.
    pub content: Content,
}

#[derive(Clone)]
pub struct VolModel {
    pub id: u64,
    pub blocks: u64,
    pub written: BTreeMap<u64, Blk>,
    /// A clone: the id of its snapshot, whose content it reads where it
    /// did not write (`base`).
    pub parent: u64,
    pub base: Content,
    /// Oldest first.
    pub snaps: Vec<Snap>,
}

pub fn zeros() -> Vec<u8> {
    vec![0u8; BS]
}

impl VolModel {
    pub fn new(id: u64, blocks: u64, parent: u64, base: Content) -> VolModel {
        VolModel {
            id,
            blocks,
            written: BTreeMap::new(),
            parent,
            base,
            snaps: Vec::new(),
        }
    }

    pub fn blk(&mut self, b: u64) -> &mut Blk {
        let base = self.base.get(&b).cloned().unwrap_or_else(zeros);
        self.written.entry(b).or_insert_with(|| Blk::durable(base))
    }

    /// What block `b` reads now.
    pub fn read(&self, b: u64) -> Vec<u8> {
        match self.written.get(&b) {
            Some(blk) => blk.cur.clone(),
            None => self.base.get(&b).cloned().unwrap_or_else(zeros),
        }
    }

    /// A write that may or may not persist.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
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

    /// A write of zeros over every block from `first` (that may or may
    /// not persist).
    pub fn zero_from(&mut self, first: u64) {
        for b in self.keys().into_iter().filter(|&b| b >= first) {
            self.write(b * BSU, &zeros());
        }
    }

    pub fn durable(&mut self, first: u64, end: u64) {
        for (_, blk) in self.written.range_mut(first..end) {
            blk.allowed = HashSet::from([h(&blk.cur)]);
        }
    }

    /// Blocks that may read other than zeros.
    pub fn keys(&self) -> BTreeSet<u64> {
        let k = self.written.keys().chain(self.base.keys());
        k.copied().filter(|&b| b < self.blocks).collect()
    }

    /// What a snapshot taken now holds.
    pub fn content(&self) -> Content {
        let m = (self.keys().into_iter())
            .map(|b| (b, self.read(b)))
            .filter(|(_, d)| d.iter().any(|&x| x != 0));
        Arc::new(m.collect())
    }

    pub fn snap(&self, name: &str) -> Option<usize> {
        self.snaps.iter().position(|s| s.name == name)
    }
}

#[derive(Clone)]
pub struct PoolModel {
    pub vols: BTreeMap<String, VolModel>,
    pub next_id: u64,
}

/// A table as the checks compare it: (name, id, size in bytes) of every
/// volume and snapshot (`VOLUME@SNAP`), sorted.
pub type Key = Vec<(String, u64, u64)>;

impl PoolModel {
    pub fn key(&self) -> Key {
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

    pub fn clones_of(&self, id: u64) -> Vec<String> {
        (self.vols.iter())
            .filter(|(_, v)| v.parent == id)
            .map(|(n, _)| n.clone())
            .collect()
    }

    pub fn all_durable(&mut self) {
        for v in self.vols.values_mut() {
            v.durable(0, u64::MAX);
        }
    }
}

pub fn key_of(pool: &Pool) -> Key {
    let vols = pool.volumes().into_iter();
    let mut k: Key = vols.map(|v| (v.name, v.id, v.size_bytes)).collect();
    k.extend(
        pool.snapshots()
            .into_iter()
            .map(|s| (s.name, s.id, s.size_bytes)),
    );
    k.sort();
    k
}

/// The newest valid table on the store, read the way `Pool::attach` does.
pub fn raw_table(store: &dyn Storage, uuid: &[u8; 16]) -> PoolTable {
    let seal = sealed::current_sealer(store);
    let mut best: Option<PoolTable> = None;
    for off in POOL_SLOT_OFFSETS {
        let mut b = vec![0u8; POOL_SLOT_BYTES as usize];
        store.read_at(off, &mut b).expect("read a table slot");
        let Ok(n) = PoolTable::payload_len(&b, uuid) else {
            continue;
        };
        if let Ok(t) = PoolTable::decode_with(&b[..POOL_HEADER_BYTES + n], uuid, seal.as_deref()) {
            if best.as_ref().is_none_or(|b| b.generation < t.generation) {
                best = Some(t);
            }
        }
    }
    best.expect("a valid table")
}

/// A refusal the model expects, with what its error must name.
#[derive(Debug, Clone)]
pub enum Refuse {
    Exists,
    SnapExists,
    HasClones(Vec<String>),
    NotNewest(Vec<String>),
    SizeChanged,
    ShrinkLayered,
    HasSnapshots,
}

pub const REFUSALS: usize = 7;

impl Refuse {
    pub fn index(&self) -> usize {
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

    pub fn matches(&self, e: &PoolError) -> bool {
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
pub struct Coverage {
    pub ops: [u64; 10],
    /// Runs cut inside a pool operation, per kind.
    pub cut_in_op: [u64; 10],
    pub refusals: [u64; REFUSALS],
    pub table_old: u64,
    pub table_new: u64,
    pub rolled_back: u64,
    pub kept_unflushed: u64,
    /// Snapshot blocks read back exactly after a reopen / while running.
    pub snap_blocks_checked: u64,
    pub snap_reads: u64,
    pub read_only_refused: u64,
    pub clone_writes: u64,
    pub live_reopens: u64,
    pub stale_tails: u64,
    pub cleaned: u64,
    pub no_space: u64,
    /// Snapshot extents `NO_EXTENT` in the tables after reopens.
    pub extents_not_taken: u64,
    pub discards: u64,
    /// Directory blocks reopens left unread (named by the commit alone),
    /// and those read later, when first needed.
    pub unread_at_open: u64,
    pub unread_read: u64,
    /// Checkpoints and closes right after a reopen that left blocks
    /// unread, before anything read them.
    pub checkpoint_unread: u64,
}

impl Coverage {
    pub fn add(&mut self, o: Coverage) {
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
        self.unread_at_open += o.unread_at_open;
        self.unread_read += o.unread_read;
        self.checkpoint_unread += o.checkpoint_unread;
        self.snap_reads += o.snap_reads;
        self.read_only_refused += o.read_only_refused;
        self.clone_writes += o.clone_writes;
        self.live_reopens += o.live_reopens;
        self.stale_tails += o.stale_tails;
        self.cleaned += o.cleaned;
        self.no_space += o.no_space;
        self.extents_not_taken += o.extents_not_taken;
        self.discards += o.discards;
    }
}

#[derive(Debug)]
pub enum PoolOp {
    Snap(String, String),
    DelSnap(String, String),
    Rollback(String, String),
    Clone(String, String, String),
    Resize(String, u64),
    Create(String, u64),
    Delete(String),
}

/// The model after `op` if it succeeds: its kind, and whether it flushes
/// the pool on success; or the refusal expected.
pub fn apply(m: &PoolModel, op: &PoolOp) -> Result<(PoolModel, usize, bool), Refuse> {
    let mut next = m.clone();
    let id = next.next_id;
    match op {
        PoolOp::Snap(v, s) => {
            let vm = next.vols.get_mut(v).expect("a volume of the model");
            if vm.snap(s).is_some() {
                return Err(Refuse::SnapExists);
            }
            let (content, blocks, name) = (vm.content(), vm.blocks, s.clone());
            vm.snaps.push(Snap {
                name,
                id,
                blocks,
                content,
            });
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
            let kind = if i == last {
                3
            } else if i == 0 {
                1
            } else {
                2
            };
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
            next.vols.insert(
                v.clone(),
                VolModel::new(id, size / BSU, 0, Content::default()),
            );
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

pub fn rollback(mut next: PoolModel, v: &str, s: &str) -> Result<(PoolModel, usize, bool), Refuse> {
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
    let keys: BTreeSet<u64> = vm
        .keys()
        .into_iter()
        .chain(snap.content.keys().copied())
        .collect();
    vm.written = (keys.into_iter())
        .map(|b| {
            (
                b,
                Blk::durable(snap.content.get(&b).cloned().unwrap_or_else(zeros)),
            )
        })
        .collect();
    Ok((next, 4, true))
}

pub fn call(pool: &Pool, op: &PoolOp) -> Result<(), PoolError> {
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
pub type Alt = Option<(PoolModel, usize)>;

pub fn open_pool(store: &SimStorage) -> Pool {
    let options = sealed::open_opts(sealed::current().as_ref(), OpenOptions::default());
    let vol =
        Volume::open(Arc::new(store.clone()), options).unwrap_or_else(|e| panic!("reopen: {e}"));
    Pool::attach(Arc::new(vol)).unwrap_or_else(|e| panic!("attach: {e}"))
}

/// Blocks `set` below `blocks` of `view`, read a run at a time.
pub fn read_set(view: &VolumeView, set: &BTreeSet<u64>, blocks: u64) -> Vec<(u64, Vec<u8>)> {
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
pub fn check_data(
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
                    return Err(format!(
                        "snapshot {name}@{} block {b} reads {what:?}",
                        s.name
                    ));
                }
                cov.snap_blocks_checked += 1;
            }
        }
    }
    Ok(m)
}

/// Every layer's block that is mapped (at its place in the layer), and
/// every block a model names: the blocks that may read other than zeros.
pub fn blocks_to_check(pool: &Pool, t: &PoolTable, models: &[&PoolModel]) -> BTreeSet<u64> {
    let mut set = BTreeSet::new();
    let layers =
        (t.volumes.iter().map(|v| &v.extents)).chain(t.snapshots.iter().map(|s| &s.extents));
    for extents in layers {
        for (k, &e) in extents.iter().enumerate().filter(|(_, &e)| e != NO_EXTENT) {
            let base = u64::from(e) * EXTENT_BLOCKS;
            let mut at = base;
            while let Some(l) = pool
                .engine()
                .first_mapped(at, base + EXTENT_BLOCKS)
                .expect("scan")
            {
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
pub fn check_no_strays(pool: &Pool, t: &PoolTable, cov: &mut Coverage) {
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
pub fn check_table(pool: &Pool, store: &SimStorage, k: &Key) -> PoolTable {
    let t = raw_table(store, &pool.engine().superblock().uuid);
    assert!(
        t.pending.is_empty(),
        "extents still pending: {:?}",
        t.pending
    );
    assert!(
        t.snapshots.iter().all(|s| s.state == SnapState::Live),
        "a snapshot still marked after reopening"
    );
    let mut raw: Key = (t.volumes.iter())
        .map(|v| (v.name.clone(), v.id, v.size_bytes))
        .collect();
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
pub fn check_reopened(
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
    assert!(
        !cands.is_empty(),
        "the table after reopening is neither the old nor the new one: {k:?}"
    );
    let t = check_table(pool, store, &k);
    let not_taken = t.snapshots.iter().flat_map(|s| &s.extents);
    cov.extents_not_taken += not_taken.filter(|&&e| e == NO_EXTENT).count() as u64;
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
        let rep = sealed::check(sealed::current().as_ref(), store);
        assert!(rep.consistent(), "check found {:?}", rep.errors);
    }
    next.next_id = t.next_id;
    next
}

/// Pool operations by kind, as the coverage counts them.
pub const KINDS: [&str; 10] = [
    "snapshot",
    "delete oldest",
    "delete middle",
    "delete newest",
    "rollback",
    "clone",
    "grow",
    "shrink",
    "create",
    "delete volume",
];

pub fn report(what: &str, n: u64, c: &Coverage) {
    let ops: Vec<String> = (0..10)
        .map(|i| format!("{} {}/{}", KINDS[i], c.ops[i], c.cut_in_op[i]))
        .collect();
    eprintln!(
        "{what}: {n} seeds; operations done/cut inside: {}; refusals (exists, snapshot exists, \
         has clones, not newest, size changed, shrink layered, has snapshots) {:?}; table old {} \
         new {} after a cut; {} blocks rolled back, {} unflushed kept; {} snapshot blocks \
         checked after reopens, {} snapshot reads, {} changes of a snapshot refused, {} clone \
         writes, {} stale tail blocks, {} reopens of the written image, {} segments \
         cleaned, {} writes refused for space, {} snapshot extents not taken, {} whole discards, \
         {} directory blocks left unread by reopens, {} of them read later, {} checkpoints \
         with blocks unread",
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
        c.live_reopens,
        c.cleaned,
        c.no_space,
        c.extents_not_taken,
        c.discards,
        c.unread_at_open,
        c.unread_read,
        c.checkpoint_unread
    );
}

/// Every kind of operation ran and every refusal happened.
pub fn assert_covered(c: &Coverage) {
    assert!(
        c.ops.iter().all(|&x| x > 0),
        "an operation never ran: {:?}",
        c.ops
    );
    assert!(
        c.refusals.iter().all(|&x| x > 0),
        "a refusal never happened: {:?}",
        c.refusals
    );
    assert!(c.snap_blocks_checked > 0 && c.snap_reads > 0 && c.clone_writes > 0);
    assert!(
        c.unread_at_open > 0 && c.unread_read > 0,
        "no reopen left a directory block unread, or none was read later"
    );
}
