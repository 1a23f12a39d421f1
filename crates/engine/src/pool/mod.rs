//! Pools: many volumes in one store (`cvol_format::pool` has the layout).
//! The engine's `Volume` is the pool's store: one log, one map over the
//! pool's 16 TiB logical space, one cleaner and dedup index; a
//! `VolumeView` is one volume of it, a list of 1 GiB extents of that
//! space. A block two volumes hold is stored once.
//!
//! Operations (create, delete, resize) run one at a time, and each takes
//! effect when its new volume table is written and synced (two alternating
//! slots): a crash before leaves the old table, after the new one. Blocks
//! of extents a delete or shrink frees are unmapped after the table is
//! written (they are *pending* in it until then); extents a create or grow
//! takes are unmapped, durably, before it is written; so no volume ever
//! sees another's blocks, whatever the crash.
use crate::error::VolError;
use crate::volume::{CreateOptions, Volume};
use cvol_format::pool::{
    extents_for, PoolSnapshot, PoolTable, PoolVolume, SnapState, DEFAULT_VOLUME, EXTENT_BLOCKS,
    EXTENT_BYTES, POOL_HEADER_BYTES, POOL_SLOT_BYTES, POOL_SLOT_OFFSETS,
};
use cvol_format::{BLOCK_SIZE_BYTES, LOGICAL_SIZE_MAX_BYTES};
use cvol_storage::Storage;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

mod error;
mod layers;
mod snapshots;
mod view;

pub use error::PoolError;
pub use snapshots::{split_snapshot_name, SnapshotInfo};
pub use view::{OpenGuard, VolumeView};

/// Most volumes a pool holds (the table then still fits its slot).
pub const POOL_VOLUMES_MAX: usize = 4096;

/// Where a volume lies in the pool's space, and whether it is gone.
pub struct Layout {
    size_bytes: u64,
    /// Shared with the view's layer (`layers::LayerSet`).
    extents: Arc<[u32]>,
    deleted: bool,
    /// What it reads through and where it keeps old entries.
    plan: layers::Plan,
}

/// A volume as `Pool::volumes` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeInfo {
    pub name: String,
    pub id: u64,
    pub size_bytes: u64,
    pub created_unix_secs: u64,
    /// Clients that have it open now.
    pub clients: usize,
}

/// What one volume holds (`Pool::usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VolumeUsage {
    pub size_bytes: u64,
    /// Blocks holding data, in bytes.
    pub mapped_bytes: u64,
    /// Blocks written as zeros, in bytes.
    pub zero_bytes: u64,
    /// Stored bytes only this volume references: what deleting it frees.
    pub unique_bytes: u64,
    /// Stored bytes it references that other blocks (of it or of other
    /// volumes) reference too.
    pub shared_bytes: u64,
}

pub struct Pool {
    vol: Arc<Volume>,
    legacy: bool,
    /// The current table; held for a whole operation.
    table: Mutex<PoolTable>,
    views: Mutex<BTreeMap<String, Arc<VolumeView>>>,
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Reads the newest valid table of the volume `uuid`: the slots' headers
/// first, then the payload of the newest whose header is valid, and the
/// other's only if that one does not decode. (The older slot's payload is
/// the fallback of a torn write, not read at every open: `cvol check`
/// reads both.)
fn read_table(storage: &dyn Storage, sb: &cvol_format::Superblock) -> Result<PoolTable, PoolError> {
    let uuid = &sb.uuid;
    let mut why = Vec::new();
    // (slot, generation, payload length) of the valid headers.
    let mut heads = Vec::new();
    for (i, &off) in POOL_SLOT_OFFSETS.iter().enumerate() {
        // A slot that fails to read is invalid, as a torn or damaged one
        // is: the other is the table.
        let mut head = [0u8; POOL_HEADER_BYTES];
        match storage.read_at(off, &mut head) {
            Err(e) => why.push(format!("slot {i}: {e}")),
            Ok(()) => match PoolTable::payload_len(&head, uuid) {
                Ok(n) => heads.push((i, PoolTable::header_generation(&head), n)),
                Err(e) => why.push(format!("slot {i}: {e}")),
            },
        }
    }
    heads.sort_unstable_by_key(|&(_, g, _)| std::cmp::Reverse(g));
    for (i, _, n) in heads {
        let mut b = vec![0u8; POOL_HEADER_BYTES + n];
        let t = storage
            .read_at(POOL_SLOT_OFFSETS[i], &mut b)
            .map_err(|_| cvol_format::FormatError::Invalid("pool table slot unreadable"))
            .and_then(|()| PoolTable::decode_with(&b, uuid, sb.sealer()));
        match t {
            Ok(t) if t.slot() != i => why.push(format!("slot {i}: generation in the wrong slot")),
            Ok(t) => {
                // A fresh pool has one slot written; otherwise the other
                // slot was torn by a crash, or damaged since: worth a line.
                if t.generation > 1 && !why.is_empty() {
                    tracing::warn!(
                        "pool table: using generation {} ({})",
                        t.generation,
                        why.join("; ")
                    );
                }
                return Ok(t);
            }
            Err(e) => why.push(format!("slot {i}: {e}")),
        }
    }
    Err(PoolError::Table(why.join("; ")))
}

/// Writes `t` to its slot and syncs.
fn write_table(
    storage: &dyn Storage,
    sb: &cvol_format::Superblock,
    t: &PoolTable,
) -> Result<(), PoolError> {
    let b = t.encode_with(sb.sealer());
    assert!(b.len() as u64 <= POOL_SLOT_BYTES, "table checked to fit");
    storage.write_at(POOL_SLOT_OFFSETS[t.slot()], &b)?;
    storage.sync()?;
    Ok(())
}

/// Volume `v`'s layout under the table of `ls`.
fn volume_layout(ls: &layers::LayerSet, v: &PoolVolume) -> Layout {
    Layout {
        size_bytes: v.size_bytes,
        extents: ls.volume_extents(v),
        deleted: false,
        plan: layers::plan_volume(ls, v.id),
    }
}

/// Snapshot `s`'s layout under the table of `ls`.
fn snapshot_layout(ls: &layers::LayerSet, s: &PoolSnapshot) -> Layout {
    Layout {
        size_bytes: s.size_bytes,
        extents: ls.snapshot_extents(s),
        deleted: false,
        plan: layers::plan_snapshot(ls, s.id),
    }
}

/// The live snapshot `full` (`VOLUME@SNAP`) of table `t`, if any.
fn live_snapshot<'t>(t: &'t PoolTable, full: &str) -> Option<&'t PoolSnapshot> {
    let (v, s) = full.split_once('@')?;
    t.snapshot(v, s).filter(|s| s.state != SnapState::Deleting)
}

/// The layout of view `name` (a volume, or a live snapshot) under the
/// table of `ls`; None if the table names no such view.
fn layout_of(ls: &layers::LayerSet, name: &str) -> Option<Layout> {
    if name.contains('@') {
        live_snapshot(ls.table(), name).map(|s| snapshot_layout(ls, s))
    } else {
        (ls.table().volume(name)).map(|v| volume_layout(ls, v))
    }
}

fn new_view(vol: &Arc<Volume>, name: String, snapshot: bool, layout: Layout) -> Arc<VolumeView> {
    Arc::new(VolumeView {
        vol: vol.clone(),
        name,
        snapshot,
        layout: std::sync::RwLock::new(layout),
        opens: Default::default(),
    })
}

fn view_of(vol: &Arc<Volume>, ls: &layers::LayerSet, v: &PoolVolume) -> Arc<VolumeView> {
    new_view(vol, v.name.clone(), false, volume_layout(ls, v))
}

/// The views a table starts with: its volumes'. A snapshot's read-only
/// view (`VOLUME@SNAP`) is made when it is first asked for
/// (`Pool::volume`): with 100 snapshots, building their views made a
/// sixth of what the snapshots added to an open, and every table change
/// (`relayout`) built them all again.
fn views_of(vol: &Arc<Volume>, t: &PoolTable) -> BTreeMap<String, Arc<VolumeView>> {
    let ls = layers::LayerSet::of(t);
    (t.volumes.iter().map(|v| view_of(vol, &ls, v)))
        .map(|w| (w.name.clone(), w))
        .collect()
}

impl Pool {
    /// Formats `storage` as a new pool whose one volume, `default`, has
    /// `c.logical_size_bytes`, and opens it.
    pub fn create(storage: Arc<dyn Storage>, c: &CreateOptions) -> Result<Pool, PoolError> {
        check_size(c.logical_size_bytes)?;
        let vol = Volume::create(storage, &c.clone().as_pool())?;
        Pool::attach(Arc::new(vol))
    }

    /// The pool of an open volume: its table (a volume made before pools
    /// is a pool of one volume, `default`, that cannot change). Opened
    /// for writing, finishes the unmapping a delete or shrink left.
    pub fn attach(vol: Arc<Volume>) -> Result<Pool, PoolError> {
        let sb = vol.superblock().clone();
        let (legacy, table) = if sb.is_pool() {
            (false, read_table(&**vol.storage(), &sb)?)
        } else {
            let size = sb.logical_size_bytes;
            let mut t = PoolTable::new(sb.uuid, size, sb.created_unix_secs);
            t.volumes[0].extents = (0..extents_for(size) as u32).collect();
            (true, t)
        };
        let views = views_of(&vol, &table);
        if !legacy {
            vol.set_reported_logical_bytes(sum_sizes(&table));
        }
        let pool = Pool {
            vol,
            legacy,
            table: Mutex::new(table),
            views: Mutex::new(views),
        };
        if !pool.vol.read_only() && !legacy {
            let mut t = pool.lock_table()?;
            pool.finish_snapshot_work(&mut t)?;
            pool.settle_pending(&mut t)?;
        }
        Ok(pool)
    }

    /// The store underneath.
    pub fn engine(&self) -> &Arc<Volume> {
        &self.vol
    }

    /// Whether the file predates pools (one volume, no changes).
    pub fn is_legacy(&self) -> bool {
        self.legacy
    }

    fn lock_table(&self) -> Result<MutexGuard<'_, PoolTable>, PoolError> {
        self.table
            .lock()
            .map_err(|_| PoolError::Vol(VolError::Poisoned))
    }

    fn views(&self) -> MutexGuard<'_, BTreeMap<String, Arc<VolumeView>>> {
        self.views.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets every view's plan from table `t` (a table change may change
    /// what any view reads through); `held`: the layout of one view the
    /// caller holds for writing, by name. Views `t` no longer names are
    /// marked deleted and dropped; views of new volumes are added (those of
    /// snapshots are made when first asked for). The caller holds the
    /// table.
    fn relayout(&self, t: &PoolTable, held: Option<(&str, &mut Layout)>) -> Result<(), PoolError> {
        let ls = layers::LayerSet::of(t);
        let mut views = self.views();
        let (held_name, mut held_layout) = match held {
            Some((n, l)) => (Some(n.to_string()), Some(l)),
            None => (None, None),
        };
        let mut gone = Vec::new();
        for (name, view) in views.iter() {
            let fresh = layout_of(&ls, name);
            let apply = |l: &mut Layout| match &fresh {
                Some(f) => {
                    l.size_bytes = f.size_bytes;
                    l.extents = f.extents.clone();
                    l.plan = f.plan.clone();
                }
                None => l.deleted = true,
            };
            if held_name.as_deref() == Some(name.as_str()) {
                apply(held_layout.as_deref_mut().expect("held with its name"));
            } else {
                apply(&mut *view.layout.write().map_err(|_| VolError::Poisoned)?);
            }
            if fresh.is_none() {
                gone.push(name.clone());
            }
        }
        for name in gone {
            views.remove(&name);
        }
        for v in &t.volumes {
            if !views.contains_key(&v.name) {
                views.insert(v.name.clone(), view_of(&self.vol, &ls, v));
            }
        }
        Ok(())
    }

    /// Every volume, by name.
    pub fn volumes(&self) -> Vec<VolumeInfo> {
        let t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        let views = self.views();
        let mut out: Vec<_> = t
            .volumes
            .iter()
            .map(|v| VolumeInfo {
                name: v.name.clone(),
                id: v.id,
                size_bytes: v.size_bytes,
                created_unix_secs: v.created_unix_secs,
                clients: views.get(&v.name).map_or(0, |w| w.clients()),
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// The sum of the volumes' sizes.
    pub fn logical_bytes(&self) -> u64 {
        self.volumes().iter().map(|v| v.size_bytes).sum()
    }

    /// The volume named `name` ("" names `default`).
    /// A live snapshot's view, `VOLUME@SNAP`, is made at its first
    /// request (takes the table: not for callers that hold it, who use
    /// `existing_view`).
    pub fn volume(&self, name: &str) -> Option<Arc<VolumeView>> {
        let name = if name.is_empty() {
            DEFAULT_VOLUME
        } else {
            name
        };
        if let Some(v) = self.existing_view(name) {
            return Some(v);
        }
        if !name.contains('@') {
            return None;
        }
        // The table, then the views (the order of every holder of both):
        // no table change can come between the lookup and the insert.
        let t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        let s = live_snapshot(&t, name)?;
        let layout = snapshot_layout(&layers::LayerSet::of(&t), s);
        let mut views = self.views();
        let v = (views.entry(name.to_string()))
            .or_insert_with(|| new_view(&self.vol, name.to_string(), true, layout));
        Some(v.clone())
    }

    /// The view `name` already has, if any (a snapshot's before its first
    /// request has none).
    fn existing_view(&self, name: &str) -> Option<Arc<VolumeView>> {
        self.views().get(name).cloned()
    }

    /// A volume named `name` is not in the table: the error lists the
    /// volumes (not the snapshots, whose views are named `VOLUME@SNAP`).
    fn not_found(&self, name: &str) -> PoolError {
        let views = self.views();
        PoolError::NotFound {
            name: name.into(),
            known: (views.iter())
                .filter(|(_, v)| !v.is_snapshot())
                .map(|(n, _)| n.clone())
                .collect(),
        }
    }

    fn check_changeable(&self) -> Result<(), PoolError> {
        if self.legacy {
            Err(PoolError::Legacy)
        } else if self.vol.read_only() {
            Err(PoolError::ReadOnly)
        } else {
            Ok(())
        }
    }

    /// Writes `next` (one generation up) and makes it the table.
    fn commit(&self, t: &mut PoolTable, mut next: PoolTable) -> Result<(), PoolError> {
        next.generation = t.generation + 1;
        next.validate()
            .map_err(|e| PoolError::Table(e.to_string()))?;
        if !next.fits() {
            return Err(PoolError::TooManyVolumes);
        }
        write_table(&**self.vol.storage(), self.vol.superblock(), &next)?;
        *t = next;
        self.vol.set_reported_logical_bytes(sum_sizes(t));
        Ok(())
    }

    /// Unmaps blocks [first, end) of the pool's map, an extent at a time.
    fn unmap(&self, first: u64, end: u64) -> Result<(), PoolError> {
        let mut at = first;
        while at < end {
            let n = (end - at).min(EXTENT_BLOCKS - at % EXTENT_BLOCKS);
            self.vol
                .trim(at * BLOCK_SIZE_BYTES, n * BLOCK_SIZE_BYTES, false)?;
            at += n;
        }
        Ok(())
    }

    fn unmap_extents(&self, extents: &[u32]) -> Result<(), PoolError> {
        for &e in extents {
            let first = u64::from(e) * EXTENT_BLOCKS;
            self.unmap(first, first + EXTENT_BLOCKS)?;
        }
        Ok(())
    }

    /// Free extents for `size_bytes`, lowest first, holding nothing: free
    /// extents hold nothing unless a crash cut a delete short before it
    /// wrote its table; what is mapped there is unmapped, durably, before
    /// a table names them.
    fn fresh_extents(&self, t: &PoolTable, size_bytes: u64) -> Result<Vec<u32>, PoolError> {
        let need = extents_for(size_bytes) as usize;
        let free = t.free_extents();
        if free.len() < need {
            return Err(PoolError::NoRoom {
                needed_bytes: need as u64 * EXTENT_BYTES,
                free_bytes: free_bytes(t),
            });
        }
        let extents = free[..need].to_vec();
        let mut dirty = false;
        for &e in &extents {
            let first = u64::from(e) * EXTENT_BLOCKS;
            if self
                .vol
                .first_mapped(first, first + EXTENT_BLOCKS)?
                .is_some()
            {
                self.unmap(first, first + EXTENT_BLOCKS)?;
                dirty = true;
            }
        }
        if dirty {
            self.vol.flush()?;
        }
        Ok(extents)
    }

    /// Unmaps the pending extents, durably, then drops them from the table.
    fn settle_pending(&self, t: &mut PoolTable) -> Result<(), PoolError> {
        if t.pending.is_empty() {
            return Ok(());
        }
        self.unmap_extents(&t.pending.clone())?;
        self.vol.flush()?;
        let mut next = t.clone();
        next.pending.clear();
        self.commit(t, next)
    }
}

fn check_size(size_bytes: u64) -> Result<(), PoolError> {
    if size_bytes == 0
        || !size_bytes.is_multiple_of(BLOCK_SIZE_BYTES)
        || size_bytes > LOGICAL_SIZE_MAX_BYTES
    {
        return Err(PoolError::BadSize { size_bytes });
    }
    Ok(())
}

mod ops;
#[cfg(test)]
mod tests;

fn sum_sizes(t: &PoolTable) -> u64 {
    t.volumes.iter().map(|v| v.size_bytes).sum()
}

/// Bytes of the pool's space still free for volumes.
fn free_bytes(t: &PoolTable) -> u64 {
    t.free_extents().len() as u64 * EXTENT_BYTES
}
