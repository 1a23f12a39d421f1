//! Snapshots in the pool table (version 2). A snapshot is a frozen view of
//! one volume, `VOLUME@NAME`, with extents of its own (as many as the
//! volume had when it was taken) that hold only what the volume changed
//! since: before a block of the volume is first changed after its newest
//! snapshot, the block's old entry is copied to the snapshot's extent
//! (copy-on-write of map entries, not of data). A block a snapshot does
//! not hold reads through to the next newer snapshot of the same volume,
//! and after the newest, to the volume. A clone is a volume whose
//! `parent` is a snapshot: a block it does not hold reads through the
//! snapshot.
//!
//! Encoding, after the volumes: `count u32`, then per snapshot:
//! ```text
//! 1  name length (1..=64), then the name (the part after '@';
//!    `snapshot_name_problem`)
//! 8  id (from the table's `next_id`, shared with volumes)
//! 8  the id of its volume
//! 8  size in bytes (the volume's when it was taken)
//! 8  creation time, Unix seconds
//! 1  state: 0 live, 1 deleting (its entries being merged into the next
//!    older snapshot of its volume, or freed), 2 rollback target (its
//!    volume is being rolled back to it)
//! 4  extent count (exactly ceil(size / 1 GiB)), then the extents, u32 each
//! ```
//! Snapshots are listed in id order, which is creation order. A snapshot
//! extent `NO_EXTENT` (0xffff_ffff) is *not taken*: the volume held
//! nothing there when the snapshot was taken (and is not a clone), so the
//! snapshot reads zeros there, keeps nothing there and reads through
//! nothing: a snapshot of a big, sparsely written volume takes only the
//! extents its volume had data in.
use super::{
    extents_for, first_repeat, name_problem, put_u32, put_u64, PoolTable, Reader, POOL_EXTENTS,
};
use crate::{FormatError, BLOCK_SIZE_BYTES, LOGICAL_SIZE_MAX_BYTES};

/// A snapshot extent that is not taken: the snapshot reads zeros there.
pub const NO_EXTENT: u32 = u32::MAX;

/// What a snapshot is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapState {
    Live,
    /// Being deleted: its entries are merged into the next older snapshot
    /// (or freed); it is no longer listed, served or cloned.
    Deleting,
    /// Its volume is being rolled back to it (no client may write the
    /// volume until that is done).
    RollbackTarget,
}

impl SnapState {
    fn byte(self) -> u8 {
        match self {
            SnapState::Live => 0,
            SnapState::Deleting => 1,
            SnapState::RollbackTarget => 2,
        }
    }

    fn from_byte(b: u8) -> Option<SnapState> {
        Some(match b {
            0 => SnapState::Live,
            1 => SnapState::Deleting,
            2 => SnapState::RollbackTarget,
            _ => return None,
        })
    }
}

/// One snapshot of a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSnapshot {
    /// The part after '@'.
    pub name: String,
    pub id: u64,
    /// The id of the volume it is a snapshot of.
    pub volume: u64,
    pub size_bytes: u64,
    pub created_unix_secs: u64,
    pub state: SnapState,
    pub extents: Vec<u32>,
}

/// Why `name` cannot name a snapshot (the part after '@'), if it cannot:
/// the rules of a volume name.
pub fn snapshot_name_problem(name: &str) -> Option<&'static str> {
    name_problem(name).map(|p| match p {
        "a volume name cannot be empty" => "a snapshot name cannot be empty",
        "a volume name has at most 64 characters" => "a snapshot name has at most 64 characters",
        "a volume name cannot contain '/'" => "a snapshot name cannot contain '/'",
        "a volume name cannot start with '.' or '-'" => {
            "a snapshot name cannot start with '.' or '-'"
        }
        "a volume name cannot contain '@' (it separates a volume from a snapshot)" => {
            "a snapshot name cannot contain '@'"
        }
        _ => "a snapshot name may use only letters, digits and . _ - + :",
    })
}

pub(super) fn encode_snapshots(p: &mut Vec<u8>, snaps: &[PoolSnapshot]) {
    put_u32(p, snaps.len() as u32);
    for s in snaps {
        p.push(s.name.len() as u8);
        p.extend_from_slice(s.name.as_bytes());
        put_u64(p, s.id);
        put_u64(p, s.volume);
        put_u64(p, s.size_bytes);
        put_u64(p, s.created_unix_secs);
        p.push(s.state.byte());
        put_u32(p, s.extents.len() as u32);
        for &e in &s.extents {
            put_u32(p, e);
        }
    }
}

impl Reader<'_> {
    pub(super) fn snapshots(&mut self) -> Result<Vec<PoolSnapshot>, FormatError> {
        let count = self.u32()?;
        // Room for as many as the payload can hold (38 bytes at least each).
        let mut out = Vec::with_capacity((count as usize).min((self.b.len() - self.at) / 38));
        for _ in 0..count {
            let len = self.take(1)?[0] as usize;
            let name = std::str::from_utf8(self.take(len)?)
                .map_err(|_| FormatError::Invalid("pool table snapshot name not UTF-8"))?
                .to_string();
            let (id, volume, size_bytes) = (self.u64()?, self.u64()?, self.u64()?);
            let created_unix_secs = self.u64()?;
            let state = SnapState::from_byte(self.take(1)?[0])
                .ok_or(FormatError::Invalid("pool table snapshot state unknown"))?;
            let n = self.u32()?;
            if n > POOL_EXTENTS {
                return Err(FormatError::Invalid(
                    "pool table snapshot has too many extents",
                ));
            }
            let extents = self.extents(n)?;
            out.push(PoolSnapshot {
                name,
                id,
                volume,
                size_bytes,
                created_unix_secs,
                state,
                extents,
            });
        }
        Ok(out)
    }
}

impl PoolTable {
    /// The snapshots of the volume `volume_id`, oldest first.
    pub fn snapshots_of(&self, volume_id: u64) -> impl Iterator<Item = &PoolSnapshot> {
        self.snapshots.iter().filter(move |s| s.volume == volume_id)
    }

    /// The snapshot `snap` of the volume named `volume`.
    pub fn snapshot(&self, volume: &str, snap: &str) -> Option<&PoolSnapshot> {
        let v = self.volume(volume)?;
        self.snapshots_of(v.id).find(|s| s.name == snap)
    }

    pub fn snapshot_by_id(&self, id: u64) -> Option<&PoolSnapshot> {
        self.snapshots.iter().find(|s| s.id == id)
    }

    pub fn volume_by_id(&self, id: u64) -> Option<&super::PoolVolume> {
        self.volumes.iter().find(|v| v.id == id)
    }

    /// Snapshot rules: names valid and distinct per volume, ids distinct
    /// from each other and from volumes' and below `next_id`, in
    /// increasing order, each of an existing volume, sizes valid, extent
    /// counts exact, at most one rollback target per volume; a clone's
    /// parent is an existing snapshot.
    pub(super) fn validate_snapshots(&self) -> Result<(), FormatError> {
        let bad = FormatError::Invalid;
        // Found by sorting, not by comparing each snapshot with every
        // earlier one: the first snapshot whose name an earlier one of its
        // volume has, and the first rollback target of a volume that an
        // earlier one has.
        let mut vol_ids: Vec<u64> = self.volumes.iter().map(|v| v.id).collect();
        vol_ids.sort_unstable();
        let is_volume = |id: u64| vol_ids.binary_search(&id).is_ok();
        let snaps = &self.snapshots;
        let name_twice = first_repeat(snaps.iter().map(|s| (s.volume, s.name.as_str())));
        let rollbacks: Vec<usize> = (0..snaps.len())
            .filter(|&i| snaps[i].state == SnapState::RollbackTarget)
            .collect();
        let rollback_twice =
            first_repeat(rollbacks.iter().map(|&i| snaps[i].volume)).map(|j| rollbacks[j]);
        for (i, s) in snaps.iter().enumerate() {
            if snapshot_name_problem(&s.name).is_some() {
                return Err(bad("pool table snapshot name invalid"));
            }
            if s.id == 0 || s.id >= self.next_id || is_volume(s.id) {
                return Err(bad("pool table snapshot id out of range or taken"));
            }
            if i > 0 && snaps[i - 1].id >= s.id {
                return Err(bad("pool table snapshots out of order"));
            }
            if !is_volume(s.volume) {
                return Err(bad("pool table snapshot of no volume"));
            }
            if name_twice == Some(i) {
                return Err(bad("pool table snapshot name used twice"));
            }
            if rollback_twice == Some(i) {
                return Err(bad("pool table has two rollbacks of one volume"));
            }
            if s.size_bytes == 0
                || !s.size_bytes.is_multiple_of(BLOCK_SIZE_BYTES)
                || s.size_bytes > LOGICAL_SIZE_MAX_BYTES
                || s.extents.len() as u64 != extents_for(s.size_bytes)
            {
                return Err(bad("pool table snapshot size invalid"));
            }
        }
        // The snapshots are in increasing id order now.
        for v in &self.volumes {
            if v.parent != 0 && snaps.binary_search_by_key(&v.parent, |s| s.id).is_err() {
                return Err(bad("pool table clone of no snapshot"));
            }
        }
        Ok(())
    }
}
