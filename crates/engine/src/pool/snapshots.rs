//! Snapshots, rollbacks and clones of a pool's volumes
//! (`cvol_format::pool` version 2; the layering in `layers.rs`).
//!
//! Each operation takes effect when its table is synced, like the
//! volume operations. A snapshot costs no copy: it is a table entry with
//! empty extents of its own, and the volume's writes keep the old entries
//! of the blocks they change there. A delete is marked in the table
//! first (*deleting*), then the snapshot's entries move to the next older
//! snapshot where that holds nothing (it read through them), the rest are
//! unmapped, and a table without it is written; a rollback is marked
//! (*rollback target*), the snapshot's entries move back to the volume,
//! and the mark is cleared. Both moves are idempotent: an open for
//! writing finishes one a crash cut short.
use super::{now_secs, view_of, Pool, PoolError, VolumeUsage};
use crate::volume::RangeUsage;
use cvol_format::pool::{
    extents_for, name_problem, snapshot_name_problem, PoolSnapshot, PoolTable, PoolVolume,
    SnapState, EXTENT_BLOCKS, EXTENT_BYTES, NO_EXTENT,
};
use cvol_format::BLOCK_SIZE_BYTES;

/// A snapshot as `Pool::snapshots` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// `VOLUME@SNAP`.
    pub name: String,
    pub volume: String,
    pub id: u64,
    pub size_bytes: u64,
    pub created_unix_secs: u64,
    /// Clients reading it now.
    pub clients: usize,
    /// Volumes cloned from it.
    pub clones: Vec<String>,
}

/// Splits `VOLUME@SNAP`, checking both names.
pub fn split_snapshot_name(full: &str) -> Result<(&str, &str), PoolError> {
    let bad = |why| PoolError::BadSnapshotName {
        name: full.into(),
        why,
    };
    let (v, s) = full
        .split_once('@')
        .ok_or(bad("a snapshot is named VOLUME@SNAPSHOT"))?;
    if let Some(why) = name_problem(v) {
        return Err(bad(why));
    }
    if let Some(why) = snapshot_name_problem(s) {
        return Err(bad(why));
    }
    Ok((v, s))
}

/// The pool ranges of `n` blocks of a layer from its block 0, a range per
/// extent: (layer block, pool block, blocks).
/// Extents not taken (`NO_EXTENT`) are skipped.
fn extent_ranges(extents: &[u32], blocks: u64) -> Vec<(u64, u64, u64)> {
    (0..extents_for(blocks * BLOCK_SIZE_BYTES))
        .filter_map(|x| {
            let at = x * EXTENT_BLOCKS;
            let base = u64::from(taken(extents, at)?) * EXTENT_BLOCKS;
            Some((at, base, (blocks - at).min(EXTENT_BLOCKS)))
        })
        .collect()
}

/// The extent holding a layer's block `at`, if it has one.
fn taken(extents: &[u32], at: u64) -> Option<u32> {
    extents
        .get((at / EXTENT_BLOCKS) as usize)
        .copied()
        .filter(|&e| e != NO_EXTENT)
}

impl Pool {
    /// The live snapshots, by volume, oldest first.
    pub fn snapshots(&self) -> Vec<SnapshotInfo> {
        let t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        let views = self.views();
        let mut out: Vec<SnapshotInfo> = (t.snapshots.iter())
            .filter(|s| s.state != SnapState::Deleting)
            .filter_map(|s| {
                let v = t.volume_by_id(s.volume)?;
                let name = format!("{}@{}", v.name, s.name);
                Some(SnapshotInfo {
                    clients: views.get(&name).map_or(0, |w| w.clients()),
                    clones: clones_of(&t, s.id),
                    name,
                    volume: v.name.clone(),
                    id: s.id,
                    size_bytes: s.size_bytes,
                    created_unix_secs: s.created_unix_secs,
                })
            })
            .collect();
        out.sort_by(|a, b| a.volume.cmp(&b.volume).then(a.id.cmp(&b.id)));
        out
    }

    /// No live snapshot `name` in `t` (the table, locked by the caller).
    fn snapshot_not_found(&self, t: &PoolTable, name: &str) -> PoolError {
        // As `snapshots` lists them: by volume, oldest first.
        let mut known: Vec<(&str, u64, String)> = (t.snapshots.iter())
            .filter(|s| s.state != SnapState::Deleting)
            .filter_map(|s| {
                let v = t.volume_by_id(s.volume)?;
                Some((v.name.as_str(), s.id, format!("{}@{}", v.name, s.name)))
            })
            .collect();
        known.sort();
        let known = known.into_iter().map(|(_, _, n)| n).collect();
        PoolError::SnapshotNotFound {
            name: name.into(),
            known,
        }
    }

    /// The live snapshot `full` of `t`.
    fn find_snapshot(&self, t: &PoolTable, full: &str) -> Result<PoolSnapshot, PoolError> {
        let (v, s) = split_snapshot_name(full)?;
        if t.volume(v).is_none() {
            return Err(self.not_found(v));
        }
        match t.snapshot(v, s) {
            Some(s) if s.state != SnapState::Deleting => Ok(s.clone()),
            _ => Err(self.snapshot_not_found(t, full)),
        }
    }

    /// A new snapshot's extents: a fresh one for each extent of `v` that
    /// holds anything (every one, for a clone, which reads through its
    /// snapshot), `NO_EXTENT` for the others (the snapshot reads zeros
    /// there). The volume's requests must be drained.
    fn snapshot_extents(&self, t: &PoolTable, v: &PoolVolume) -> Result<Vec<u32>, PoolError> {
        let blocks = v.size_bytes / BLOCK_SIZE_BYTES;
        let mut held = Vec::with_capacity(v.extents.len());
        for (x, &e) in v.extents.iter().enumerate() {
            let first = u64::from(e) * EXTENT_BLOCKS;
            let n = (blocks - x as u64 * EXTENT_BLOCKS).min(EXTENT_BLOCKS);
            held.push(v.parent != 0 || self.vol.first_mapped(first, first + n)?.is_some());
        }
        let need = held.iter().filter(|&&h| h).count() as u64;
        let mut fresh = self.fresh_extents(t, need * EXTENT_BYTES)?.into_iter();
        Ok(held
            .into_iter()
            .map(|h| match h {
                true => fresh.next().expect("one fresh extent each"),
                false => NO_EXTENT,
            })
            .collect())
    }

    /// Takes snapshot `VOLUME@SNAP` of a volume: what its clients were
    /// told was written, made durable first. The volume's requests pause
    /// for a flush and a table write.
    pub fn create_snapshot(&self, full: &str) -> Result<(), PoolError> {
        self.check_changeable()?;
        let (vname, sname) = split_snapshot_name(full)?;
        let mut t = self.lock_table()?;
        let v = t
            .volume(vname)
            .ok_or_else(|| self.not_found(vname))?
            .clone();
        if t.snapshot(vname, sname).is_some() {
            return Err(PoolError::SnapshotExists(full.into()));
        }
        let view = self.volume(vname).expect("every volume has a view");
        // Most of what clients wrote is made durable while they go on;
        // the flush under the drained volume then syncs only the rest, so
        // the pause is short.
        self.vol.flush()?;
        // Requests in flight finish first; new ones wait.
        let mut layout = view.layout.write().map_err(|_| crate::VolError::Poisoned)?;
        let extents = self.snapshot_extents(&t, &v)?;
        self.vol.flush()?;
        let mut next = t.clone();
        next.snapshots.push(PoolSnapshot {
            name: sname.into(),
            id: next.next_id,
            volume: v.id,
            size_bytes: v.size_bytes,
            created_unix_secs: now_secs(),
            state: SnapState::Live,
            extents,
        });
        next.next_id += 1;
        self.commit(&mut t, next)?;
        self.relayout(&t, Some((vname, &mut layout)))?;
        drop(layout);
        tracing::info!("snapshot '{full}' created");
        Ok(())
    }

    /// Deletes snapshot `full`: refused while clones read through it, or
    /// (unless `force`) while clients read it.
    pub fn delete_snapshot(&self, full: &str, force: bool) -> Result<(), PoolError> {
        self.check_changeable()?;
        let mut t = self.lock_table()?;
        let s = self.find_snapshot(&t, full)?;
        let clones = clones_of(&t, s.id);
        if !clones.is_empty() {
            return Err(PoolError::HasClones {
                name: full.into(),
                clones,
            });
        }
        if let Some(view) = self.existing_view(full) {
            if view.clients() > 0 && !force {
                return Err(PoolError::InUse {
                    name: full.into(),
                    clients: view.clients(),
                });
            }
        }
        self.set_state(&mut t, s.id, SnapState::Deleting)?;
        self.relayout(&t, None)?;
        self.finish_delete(&mut t, s.id)?;
        tracing::info!("snapshot '{full}' deleted");
        Ok(())
    }

    fn set_state(&self, t: &mut PoolTable, id: u64, state: SnapState) -> Result<(), PoolError> {
        let mut next = t.clone();
        for s in next.snapshots.iter_mut().filter(|s| s.id == id) {
            s.state = state;
        }
        self.commit(t, next)
    }

    /// The rest of a delete marked in the table: the snapshot's entries
    /// move to the next older snapshot of its volume where that holds
    /// nothing, the others are unmapped; then the table drops it.
    fn finish_delete(&self, t: &mut PoolTable, id: u64) -> Result<(), PoolError> {
        let s = t
            .snapshot_by_id(id)
            .expect("a snapshot being deleted")
            .clone();
        let older = (t.snapshots_of(s.volume))
            .filter(|o| o.id < id && o.state != SnapState::Deleting)
            .last()
            .cloned();
        let blocks = s.size_bytes / BLOCK_SIZE_BYTES;
        let older_blocks = older
            .as_ref()
            .map_or(0, |o| o.size_bytes / BLOCK_SIZE_BYTES);
        for x in 0..extents_for(s.size_bytes) {
            let at = x * EXTENT_BLOCKS;
            let n = (blocks - at).min(EXTENT_BLOCKS);
            // What the older snapshot reads through this one here: its
            // blocks up to its own size, if it has an extent here.
            let to = older.as_ref().and_then(|o| taken(&o.extents, at));
            let to = to
                .filter(|_| at < older_blocks)
                .map(|e| u64::from(e) * EXTENT_BLOCKS);
            let moved = if to.is_some() {
                n.min(older_blocks - at)
            } else {
                0
            };
            match (taken(&s.extents, at), to) {
                (Some(e), _) => {
                    let from = u64::from(e) * EXTENT_BLOCKS;
                    if moved > 0 {
                        self.vol.move_entries(from, to, moved, true)?;
                    }
                    if moved < n {
                        self.vol
                            .move_entries(from + moved, None, n - moved, false)?;
                    }
                }
                // It read zeros here: so must the older one, after it.
                (None, Some(to)) => self.vol.fill_zeros(to, moved)?,
                (None, None) => {}
            }
        }
        self.vol.flush()?;
        let mut next = t.clone();
        next.snapshots.retain(|x| x.id != id);
        next.pending
            .extend(s.extents.iter().filter(|&&e| e != NO_EXTENT));
        self.commit(t, next)?;
        self.relayout(t, None)?;
        self.settle_pending(t)
    }

    /// Rolls volume `VOLUME` back to its newest snapshot `full`: refused
    /// while clients have the volume open, if newer snapshots exist, or if
    /// the volume was resized since.
    pub fn rollback(&self, full: &str) -> Result<(), PoolError> {
        self.check_changeable()?;
        let mut t = self.lock_table()?;
        let s = self.find_snapshot(&t, full)?;
        let v = t
            .volume_by_id(s.volume)
            .expect("a snapshot's volume")
            .clone();
        let newer: Vec<String> = (t.snapshots_of(v.id))
            .filter(|o| o.id > s.id)
            .map(|o| format!("{}@{}", v.name, o.name))
            .collect();
        if !newer.is_empty() {
            return Err(PoolError::NotNewest {
                name: full.into(),
                newer,
            });
        }
        if v.size_bytes != s.size_bytes {
            return Err(PoolError::SizeChanged {
                name: v.name,
                size_bytes: v.size_bytes,
                snapshot_bytes: s.size_bytes,
            });
        }
        let view = self.volume(&v.name).expect("every volume has a view");
        if view.clients() > 0 {
            return Err(PoolError::RollbackInUse {
                name: v.name,
                clients: view.clients(),
            });
        }
        let mut layout = view.layout.write().map_err(|_| crate::VolError::Poisoned)?;
        self.set_state(&mut t, s.id, SnapState::RollbackTarget)?;
        self.finish_rollback(&mut t, s.id)?;
        self.relayout(&t, Some((&v.name, &mut layout)))?;
        tracing::info!("volume '{}' rolled back to '{full}'", v.name);
        Ok(())
    }

    /// The rest of a rollback marked in the table: the snapshot's entries
    /// (the old content of every block changed since) move back to the
    /// volume; then the mark is cleared.
    fn finish_rollback(&self, t: &mut PoolTable, id: u64) -> Result<(), PoolError> {
        let s = t.snapshot_by_id(id).expect("a rollback target").clone();
        let v = t
            .volume_by_id(s.volume)
            .expect("a snapshot's volume")
            .clone();
        let blocks = s.size_bytes / BLOCK_SIZE_BYTES;
        for x in 0..extents_for(s.size_bytes) {
            let at = x * EXTENT_BLOCKS;
            let n = (blocks - at).min(EXTENT_BLOCKS);
            let to = u64::from(v.extents[x as usize]) * EXTENT_BLOCKS;
            match taken(&s.extents, at) {
                Some(e) => {
                    let from = u64::from(e) * EXTENT_BLOCKS;
                    self.vol.move_entries(from, Some(to), n, false)?;
                }
                // The snapshot reads zeros here (the volume held nothing).
                None => self.vol.move_entries(to, None, n, false)?,
            }
        }
        self.vol.flush()?;
        self.set_state(t, id, SnapState::Live)
    }

    /// Makes volume `name`, a writable clone of snapshot `full`: it reads
    /// as the snapshot until written, and costs nothing until then.
    pub fn clone_volume(&self, full: &str, name: &str) -> Result<(), PoolError> {
        self.check_changeable()?;
        if let Some(why) = name_problem(name) {
            return Err(PoolError::BadName {
                name: name.into(),
                why,
            });
        }
        let mut t = self.lock_table()?;
        let s = self.find_snapshot(&t, full)?;
        if t.volume(name).is_some() {
            return Err(PoolError::Exists(name.into()));
        }
        if t.volumes.len() >= super::POOL_VOLUMES_MAX {
            return Err(PoolError::TooManyVolumes);
        }
        let extents = self.fresh_extents(&t, s.size_bytes)?;
        let mut next = t.clone();
        let v = PoolVolume {
            name: name.into(),
            id: next.next_id,
            size_bytes: s.size_bytes,
            created_unix_secs: now_secs(),
            extents,
            parent: s.id,
        };
        next.next_id += 1;
        next.volumes.push(v.clone());
        self.commit(&mut t, next)?;
        self.views().insert(
            name.into(),
            view_of(&self.vol, &super::layers::LayerSet::of(&t), &v),
        );
        tracing::info!("volume '{name}' cloned from '{full}'");
        Ok(())
    }

    /// Finishes the deletes and rollbacks a crash cut short.
    pub(super) fn finish_snapshot_work(&self, t: &mut PoolTable) -> Result<(), PoolError> {
        let marked: Vec<(u64, SnapState)> = (t.snapshots.iter())
            .filter(|s| s.state != SnapState::Live)
            .map(|s| (s.id, s.state))
            .collect();
        for (id, state) in marked {
            match state {
                SnapState::RollbackTarget => self.finish_rollback(t, id)?,
                _ => self.finish_delete(t, id)?,
            }
        }
        self.relayout(t, None)
    }

    /// What snapshot `full` holds: `mapped_bytes` the blocks whose old
    /// content it keeps (changed since it was taken), `unique_bytes` the
    /// stored bytes only it references.
    pub fn snapshot_usage(&self, full: &str) -> Result<VolumeUsage, PoolError> {
        let s = {
            let t = self.lock_table()?;
            self.find_snapshot(&t, full)?
        };
        let mut acc = RangeUsage::default();
        for (_, a, n) in extent_ranges(&s.extents, s.size_bytes / BLOCK_SIZE_BYTES) {
            self.vol.range_usage(a, a + n, &mut acc)?;
        }
        let bytes = self.vol.usage_bytes(&acc)?;
        Ok(VolumeUsage {
            size_bytes: s.size_bytes,
            mapped_bytes: acc.data_blocks * BLOCK_SIZE_BYTES,
            zero_bytes: acc.zero_blocks * BLOCK_SIZE_BYTES,
            unique_bytes: bytes.unique_bytes,
            shared_bytes: bytes.shared_bytes,
        })
    }
}

/// The volumes cloned from snapshot `id`.
fn clones_of(t: &PoolTable, id: u64) -> Vec<String> {
    (t.volumes.iter())
        .filter(|v| v.parent == id)
        .map(|v| v.name.clone())
        .collect()
}
