//! The pool's operations: create, delete and resize a volume, and what
//! one volume holds.
use super::{
    check_size, free_bytes, now_secs, view_of, Pool, PoolError, VolumeUsage, POOL_VOLUMES_MAX,
};
use crate::volume::RangeUsage;
use cvol_format::pool::{extents_for, name_problem, PoolVolume, EXTENT_BLOCKS};
use cvol_format::BLOCK_SIZE_BYTES;

/// The pool blocks of a volume's blocks [first, end), a range per extent:
/// (volume block, pool block, pool end).
fn pool_ranges(extents: &[u32], first: u64, end: u64) -> Vec<(u64, u64, u64)> {
    let mut out = Vec::new();
    let mut at = first;
    while at < end {
        let (x, within) = (at / EXTENT_BLOCKS, at % EXTENT_BLOCKS);
        let n = (EXTENT_BLOCKS - within).min(end - at);
        let base = u64::from(extents[x as usize]) * EXTENT_BLOCKS;
        out.push((at, base + within, base + within + n));
        at += n;
    }
    out
}

impl Pool {
    /// Creates volume `name` of `size_bytes`, empty.
    pub fn create_volume(&self, name: &str, size_bytes: u64) -> Result<(), PoolError> {
        self.check_changeable()?;
        if let Some(why) = name_problem(name) {
            return Err(PoolError::BadName {
                name: name.into(),
                why,
            });
        }
        check_size(size_bytes)?;
        let mut t = self.lock_table()?;
        if t.volume(name).is_some() {
            return Err(PoolError::Exists(name.into()));
        }
        if t.volumes.len() >= POOL_VOLUMES_MAX {
            return Err(PoolError::TooManyVolumes);
        }
        let need = extents_for(size_bytes) as usize;
        let free = t.free_extents();
        if free.len() < need {
            return Err(PoolError::NoRoom {
                needed_bytes: need as u64 * cvol_format::pool::EXTENT_BYTES,
                free_bytes: free_bytes(&t),
            });
        }
        let extents = free[..need].to_vec();
        // Free extents hold nothing, unless a crash cut a delete short
        // before it wrote its table: unmapped (durably) before use.
        self.unmap_extents(&extents)?;
        self.vol.flush()?;
        let mut next = t.clone();
        let v = PoolVolume {
            name: name.into(),
            id: next.next_id,
            size_bytes,
            created_unix_secs: now_secs(),
            extents,
            parent: 0,
        };
        next.next_id += 1;
        next.volumes.push(v.clone());
        self.commit(&mut t, next)?;
        self.views().insert(
            name.into(),
            view_of(&self.vol, &super::layers::LayerSet::of(&t), &v),
        );
        tracing::info!("volume '{name}' created, {size_bytes} bytes");
        Ok(())
    }

    /// Deletes volume `name`; refused while clients have it open unless
    /// `force` (their requests then fail). Its blocks are unmapped after.
    pub fn delete_volume(&self, name: &str, force: bool) -> Result<(), PoolError> {
        self.check_changeable()?;
        let mut t = self.lock_table()?;
        let Some(i) = t.volumes.iter().position(|v| v.name == name) else {
            return Err(self.not_found(name));
        };
        let snaps: Vec<String> = t
            .snapshots_of(t.volumes[i].id)
            .map(|s| s.name.clone())
            .collect();
        if !snaps.is_empty() {
            return Err(PoolError::HasSnapshots {
                name: name.into(),
                snapshots: snaps,
            });
        }
        let view = self.volume(name).expect("every volume has a view");
        if view.clients() > 0 && !force {
            return Err(PoolError::InUse {
                name: name.into(),
                clients: view.clients(),
            });
        }
        let mut layout = view.layout.write().map_err(|_| crate::VolError::Poisoned)?;
        let mut next = t.clone();
        let v = next.volumes.remove(i);
        next.pending.extend(&v.extents);
        self.commit(&mut t, next)?;
        layout.deleted = true;
        drop(layout);
        self.views().remove(name);
        tracing::info!("volume '{name}' deleted");
        self.settle_pending(&mut t)
    }

    /// Sets volume `name`'s size. A shrink is refused while data lies
    /// beyond the new end, unless `discard`. Returns the old size.
    pub fn resize_volume(
        &self,
        name: &str,
        size_bytes: u64,
        discard: bool,
    ) -> Result<u64, PoolError> {
        self.check_changeable()?;
        check_size(size_bytes)?;
        let mut t = self.lock_table()?;
        let Some(i) = t.volumes.iter().position(|v| v.name == name) else {
            return Err(self.not_found(name));
        };
        let view = self.volume(name).expect("every volume has a view");
        let old = t.volumes[i].clone();
        // Requests in flight finish first; new ones wait.
        let mut layout = view.layout.write().map_err(|_| crate::VolError::Poisoned)?;
        let mut next = t.clone();
        let v = &mut next.volumes[i];
        let (old_blocks, new_blocks) = (old.blocks(), size_bytes / BLOCK_SIZE_BYTES);
        let layered = old.parent != 0 || t.snapshots_of(old.id).next().is_some();
        if new_blocks < old_blocks && layered {
            return Err(PoolError::ShrinkLayered { name: name.into() });
        }
        let freed = if new_blocks >= old_blocks {
            let need = extents_for(size_bytes) as usize - old.extents.len();
            let free = t.free_extents();
            if free.len() < need {
                return Err(PoolError::NoRoom {
                    needed_bytes: need as u64 * cvol_format::pool::EXTENT_BYTES,
                    free_bytes: free_bytes(&t),
                });
            }
            v.extents.extend(&free[..need]);
            // What a grow exposes reads as zeros, whatever an earlier
            // shrink or a crash left there.
            for (_, a, b) in pool_ranges(&v.extents, old_blocks, new_blocks) {
                self.unmap(a, b)?;
            }
            self.vol.flush()?;
            Vec::new()
        } else {
            for (at, a, b) in pool_ranges(&old.extents, new_blocks, old_blocks) {
                if let Some(l) = self.vol.first_mapped(a, b)?.filter(|_| !discard) {
                    return Err(PoolError::MappedBeyond {
                        name: name.into(),
                        size_bytes,
                        first_mapped: (at + l - a) * BLOCK_SIZE_BYTES,
                    });
                }
            }
            v.extents.split_off(extents_for(size_bytes) as usize)
        };
        v.size_bytes = size_bytes;
        let extents = v.extents.clone();
        next.pending.extend(&freed);
        self.commit(&mut t, next)?;
        self.relayout(&t, Some((name, &mut layout)))?;
        drop(layout);
        if new_blocks < old_blocks {
            let tail_end = (extents.len() as u64 * EXTENT_BLOCKS).min(old_blocks);
            for (_, a, b) in pool_ranges(&extents, new_blocks, tail_end) {
                self.unmap(a, b)?;
            }
            self.settle_pending(&mut t)?;
        }
        tracing::info!(
            "volume '{name}' resized from {} to {size_bytes} bytes",
            old.size_bytes
        );
        Ok(old.size_bytes)
    }

    /// What volume `name` holds now.
    pub fn usage(&self, name: &str) -> Result<VolumeUsage, PoolError> {
        let (size_bytes, extents) = {
            let t = self.lock_table()?;
            let v = t.volume(name).ok_or_else(|| self.not_found(name))?;
            (v.size_bytes, v.extents.clone())
        };
        let mut acc = RangeUsage::default();
        for (_, a, b) in pool_ranges(&extents, 0, size_bytes / BLOCK_SIZE_BYTES) {
            self.vol.range_usage(a, b, &mut acc)?;
        }
        let bytes = self.vol.usage_bytes(&acc)?;
        Ok(VolumeUsage {
            size_bytes,
            mapped_bytes: acc.data_blocks * BLOCK_SIZE_BYTES,
            zero_bytes: acc.zero_blocks * BLOCK_SIZE_BYTES,
            unique_bytes: bytes.unique_bytes,
            shared_bytes: bytes.shared_bytes,
        })
    }
}
