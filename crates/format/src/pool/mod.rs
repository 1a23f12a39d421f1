//! The pool's volume table (superblock flag bit 12, `FLAG_POOL`): which
//! volumes a pool holds and where each lies in the pool's block map.
//!
//! A pool's block map covers a fixed logical space of 16 TiB
//! (`LOGICAL_SIZE_MAX_BYTES`, the superblock's logical size), cut into
//! *extents* of 1 GiB (`EXTENT_BLOCKS` blocks). A volume is a list of
//! extents: its block `b` is the pool's block
//! `extents[b / EXTENT_BLOCKS] * EXTENT_BLOCKS + b % EXTENT_BLOCKS`. An
//! extent belongs to at most one volume; the others are free. Everything
//! below the map (the log, the cleaner, the dedup index, free space) is
//! the pool's, shared by its volumes, so a block two volumes hold is
//! stored once.
//!
//! The table lives in two alternating slots in the header area before the
//! first segment (`POOL_SLOT_OFFSETS`, `POOL_SLOT_BYTES` each), written
//! whole and synced: generation `g` goes to slot `g % 2`, and the valid
//! slot with the highest generation is the table. A torn write leaves the
//! other slot, the previous table, intact. Layout of a slot:
//! ```text
//! 0   8  magic "CVOLPOOL"
//! 8   4  version (1)
//! 12  4  payload length n
//! 16  8  generation (>= 1)
//! 24 16  the superblock's volume uuid (a table of an earlier volume on
//!        the same device is never taken)
//! 40  4  crc32c of the payload
//! 44  4  crc32c of bytes 0..44
//! 48  n  payload:
//!        8  next volume id (ids are never reused)
//!        4  volume count v, then v volumes:
//!             1  name length (1..=64), then the name (`valid_name`)
//!             8  id
//!             8  size in bytes (a non-zero multiple of 4096)
//!             8  creation time, Unix seconds
//!             4  extent count e (exactly ceil(size / 1 GiB)), then e
//!                extent indexes, u32 each (below `POOL_EXTENTS`, each
//!                used once in the whole table)
//!        4  pending count p, then p extents (u32) freed by a delete or
//!           shrink whose blocks may still be mapped: they are trimmed
//!           (unmapped) before they count as free again
//! ```
//! Every byte of the payload is used; anything else is refused.
//!
//! Version 2 (written only while a snapshot or a clone exists, so that a
//! pool without them stays readable by binaries that know version 1) adds
//! `parent u64` after each volume's extents (the id of the snapshot a
//! clone was made from; 0 for none), and between the volumes and the
//! pending extents the snapshots (`snap.rs`).
use crate::seal::{Sealer, BLOB_OVERHEAD_BYTES};
use crate::*;

/// Blocks of one extent: 2^18 (1 GiB).
pub const EXTENT_BLOCKS_LOG2: u32 = 18;
pub const EXTENT_BLOCKS: u64 = 1 << EXTENT_BLOCKS_LOG2;
pub const EXTENT_BYTES: u64 = EXTENT_BLOCKS * BLOCK_SIZE_BYTES;
/// Extents of a pool's logical space.
pub const POOL_EXTENTS: u32 = (LOGICAL_SIZE_MAX_BYTES / EXTENT_BYTES) as u32;
/// Where the two table slots are, between the label copies and segment 0.
pub const POOL_SLOT_OFFSETS: [u64; 2] = [64 << 10, 544 << 10];
pub const POOL_SLOT_BYTES: u64 = 480 << 10;
const _: () = assert!(POOL_SLOT_OFFSETS[1] + POOL_SLOT_BYTES <= DATA_OFFSET_BYTES);
const _: () = assert!(POOL_SLOT_OFFSETS[0] + POOL_SLOT_BYTES <= POOL_SLOT_OFFSETS[1]);
pub const POOL_MAGIC: [u8; 8] = *b"CVOLPOOL";
pub const POOL_VERSION: u32 = 1;
/// The version a table with snapshots or clones is written with.
pub const POOL_VERSION_SNAPSHOTS: u32 = 2;
pub const POOL_HEADER_BYTES: usize = 48;
/// Longest volume name.
pub const NAME_MAX_BYTES: usize = 64;
/// The name of the volume an older, single-volume file holds, and of the
/// first volume `cvol create` makes.
pub const DEFAULT_VOLUME: &str = "default";

/// One volume of a pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolVolume {
    pub name: String,
    pub id: u64,
    pub size_bytes: u64,
    pub created_unix_secs: u64,
    pub extents: Vec<u32>,
    /// A clone's origin: the id of the snapshot it was made from (0: none).
    pub parent: u64,
}

impl PoolVolume {
    pub fn blocks(&self) -> u64 {
        self.size_bytes / BLOCK_SIZE_BYTES
    }
}

/// The table of a pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolTable {
    pub generation: u64,
    pub uuid: [u8; 16],
    pub next_id: u64,
    pub volumes: Vec<PoolVolume>,
    /// Frozen copies of volumes, in creation (id) order.
    pub snapshots: Vec<PoolSnapshot>,
    /// Extents freed but maybe still mapped: trimmed before reuse.
    pub pending: Vec<u32>,
}

/// Extents a volume of `size_bytes` takes.
pub fn extents_for(size_bytes: u64) -> u64 {
    size_bytes.div_ceil(EXTENT_BYTES)
}

/// Why `name` cannot name a volume, if it cannot: 1 to 64 bytes of ASCII
/// letters, digits, `.`, `_`, `-`, `+`, `:`, not starting with `.` or `-`
/// (no `/`, which NBD URIs and paths use, and no `@`, which names a
/// snapshot).
pub fn name_problem(name: &str) -> Option<&'static str> {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '+' | ':');
    if name.is_empty() {
        Some("a volume name cannot be empty")
    } else if name.len() > NAME_MAX_BYTES {
        Some("a volume name has at most 64 characters")
    } else if name.contains('/') {
        Some("a volume name cannot contain '/'")
    } else if name.contains('@') {
        Some("a volume name cannot contain '@' (it separates a volume from a snapshot)")
    } else if !name.chars().all(ok) {
        Some("a volume name may use only letters, digits and . _ - + :")
    } else if name.starts_with(['.', '-']) {
        Some("a volume name cannot start with '.' or '-'")
    } else {
        None
    }
}

pub(super) fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub(super) fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

impl PoolTable {
    /// A new pool's table: one volume, `default`, of `size_bytes`.
    pub fn new(uuid: [u8; 16], size_bytes: u64, now: u64) -> PoolTable {
        PoolTable {
            generation: 1,
            uuid,
            next_id: 2,
            volumes: vec![PoolVolume {
                name: DEFAULT_VOLUME.into(),
                id: 1,
                size_bytes,
                created_unix_secs: now,
                extents: (0..extents_for(size_bytes) as u32).collect(),
                parent: 0,
            }],
            snapshots: Vec::new(),
            pending: Vec::new(),
        }
    }

    /// Which slot this generation goes to.
    pub fn slot(&self) -> usize {
        (self.generation % 2) as usize
    }

    pub fn volume(&self, name: &str) -> Option<&PoolVolume> {
        self.volumes.iter().find(|v| v.name == name)
    }

    /// Extents neither a volume nor a pending trim holds, lowest first.
    pub fn free_extents(&self) -> Vec<u32> {
        let mut used = vec![false; POOL_EXTENTS as usize];
        for e in self.volumes.iter().flat_map(|v| &v.extents) {
            used[*e as usize] = true;
        }
        for e in self.snapshots.iter().flat_map(|s| &s.extents) {
            if *e != NO_EXTENT {
                used[*e as usize] = true;
            }
        }
        for e in &self.pending {
            used[*e as usize] = true;
        }
        (0..POOL_EXTENTS).filter(|&e| !used[e as usize]).collect()
    }

    /// The whole slot image: header and payload.
    pub fn encode(&self) -> Vec<u8> {
        self.encode_with(None)
    }

    /// What an encrypted volume's table payload is sealed for: the volume
    /// and the generation, so that a payload moved to another slot,
    /// generation or volume does not open.
    fn seal_domain(uuid: &[u8; 16], generation: u64) -> Vec<u8> {
        let mut d = b"cvol pool table".to_vec();
        d.extend_from_slice(uuid);
        d.extend_from_slice(&generation.to_le_bytes());
        d
    }

    /// The slot image, its payload sealed when `seal` is given (an
    /// encrypted volume: volume and snapshot names and sizes are not left
    /// in the clear). The header stays in the clear.
    pub fn encode_with(&self, seal: Option<&Sealer>) -> Vec<u8> {
        let v2 = self.version() == POOL_VERSION_SNAPSHOTS;
        let mut p = Vec::new();
        put_u64(&mut p, self.next_id);
        put_u32(&mut p, self.volumes.len() as u32);
        for v in &self.volumes {
            p.push(v.name.len() as u8);
            p.extend_from_slice(v.name.as_bytes());
            put_u64(&mut p, v.id);
            put_u64(&mut p, v.size_bytes);
            put_u64(&mut p, v.created_unix_secs);
            put_u32(&mut p, v.extents.len() as u32);
            for &e in &v.extents {
                put_u32(&mut p, e);
            }
            if v2 {
                put_u64(&mut p, v.parent);
            }
        }
        if v2 {
            snap::encode_snapshots(&mut p, &self.snapshots);
        }
        put_u32(&mut p, self.pending.len() as u32);
        for &e in &self.pending {
            put_u32(&mut p, e);
        }
        if let Some(s) = seal {
            p = s.seal_blob(&PoolTable::seal_domain(&self.uuid, self.generation), &p);
        }
        let mut out = Vec::with_capacity(POOL_HEADER_BYTES + p.len());
        out.extend_from_slice(&POOL_MAGIC);
        put_u32(&mut out, self.version());
        put_u32(&mut out, p.len() as u32);
        put_u64(&mut out, self.generation);
        out.extend_from_slice(&self.uuid);
        put_u32(&mut out, crc32c::crc32c(&p));
        let hcrc = crc32c::crc32c(&out);
        put_u32(&mut out, hcrc);
        out.extend_from_slice(&p);
        out
    }

    /// Whether the encoded table fits its slot.
    pub fn fits(&self) -> bool {
        (self.encode().len() + BLOB_OVERHEAD_BYTES) as u64 <= POOL_SLOT_BYTES
    }

    /// The header's payload length, if `b` starts with a valid header of
    /// the volume `uuid` (read the rest of the slot up to it).
    pub fn payload_len(b: &[u8], uuid: &[u8; 16]) -> Result<usize, FormatError> {
        let h = b
            .get(..POOL_HEADER_BYTES)
            .ok_or(FormatError::Invalid("pool table header cut short"))?;
        if h[..8] != POOL_MAGIC {
            return Err(FormatError::Invalid("no pool table (bad magic)"));
        }
        if crc32c::crc32c(&h[..44]) != u32::from_le_bytes(h[44..48].try_into().unwrap()) {
            return Err(FormatError::Invalid("pool table header checksum mismatch"));
        }
        let version = u32::from_le_bytes(h[8..12].try_into().unwrap());
        if version != POOL_VERSION && version != POOL_VERSION_SNAPSHOTS {
            return Err(FormatError::Invalid("pool table of an unknown version"));
        }
        if &h[24..40] != uuid {
            return Err(FormatError::Invalid("pool table of another volume"));
        }
        let n = u32::from_le_bytes(h[12..16].try_into().unwrap()) as usize;
        if (POOL_HEADER_BYTES + n) as u64 > POOL_SLOT_BYTES {
            return Err(FormatError::Invalid("pool table longer than its slot"));
        }
        Ok(n)
    }

    /// The generation a slot's header names (check it with `payload_len`
    /// first).
    pub fn header_generation(h: &[u8; POOL_HEADER_BYTES]) -> u64 {
        u64::from_le_bytes(h[16..24].try_into().unwrap())
    }

    /// Decodes a slot image (header and payload) of the volume `uuid`.
    pub fn decode(b: &[u8], uuid: &[u8; 16]) -> Result<PoolTable, FormatError> {
        PoolTable::decode_with(b, uuid, None)
    }

    /// Decodes a slot image of the volume `uuid`, opening its payload
    /// with `seal` (an encrypted volume's tables are all sealed).
    pub fn decode_with(
        b: &[u8],
        uuid: &[u8; 16],
        seal: Option<&Sealer>,
    ) -> Result<PoolTable, FormatError> {
        let n = PoolTable::payload_len(b, uuid)?;
        let p = b
            .get(POOL_HEADER_BYTES..POOL_HEADER_BYTES + n)
            .ok_or(FormatError::Invalid("pool table cut short"))?;
        if crc32c::crc32c(p) != u32::from_le_bytes(b[40..44].try_into().unwrap()) {
            return Err(FormatError::Invalid("pool table checksum mismatch"));
        }
        let generation = u64::from_le_bytes(b[16..24].try_into().unwrap());
        let opened;
        let p = match seal {
            Some(s) => {
                opened = s.open_blob(&PoolTable::seal_domain(uuid, generation), p)?;
                &opened[..]
            }
            None => p,
        };
        let v2 = u32::from_le_bytes(b[8..12].try_into().unwrap()) == POOL_VERSION_SNAPSHOTS;
        let mut r = Reader { b: p, at: 0 };
        let mut t = PoolTable {
            generation,
            uuid: *uuid,
            next_id: r.u64()?,
            volumes: Vec::new(),
            snapshots: Vec::new(),
            pending: Vec::new(),
        };
        let count = r.u32()?;
        for _ in 0..count {
            let mut v = r.volume()?;
            if v2 {
                v.parent = r.u64()?;
            }
            t.volumes.push(v);
        }
        if v2 {
            t.snapshots = r.snapshots()?;
        }
        let pending = r.u32()?;
        for _ in 0..pending {
            t.pending.push(r.u32()?);
        }
        if r.at != p.len() {
            return Err(FormatError::Invalid("pool table has trailing bytes"));
        }
        t.validate()?;
        Ok(t)
    }

    /// The table's invariants: generation >= 1, names valid and distinct,
    /// ids distinct and below `next_id`, sizes valid, extent counts
    /// exact, every extent below `POOL_EXTENTS` and used once.
    pub fn validate(&self) -> Result<(), FormatError> {
        let bad = FormatError::Invalid;
        if self.generation == 0 {
            return Err(bad("pool table generation 0"));
        }
        let mut used = vec![false; POOL_EXTENTS as usize];
        let mut take = |e: u32| -> Result<(), FormatError> {
            let slot = used
                .get_mut(e as usize)
                .ok_or(bad("pool table extent out of range"))?;
            if std::mem::replace(slot, true) {
                return Err(bad("pool table extent used twice"));
            }
            Ok(())
        };
        // The first volume whose name or id an earlier one has.
        let twice = (first_repeat(self.volumes.iter().map(|v| v.name.as_str())))
            .into_iter()
            .chain(first_repeat(self.volumes.iter().map(|v| v.id)))
            .min();
        for (i, v) in self.volumes.iter().enumerate() {
            if name_problem(&v.name).is_some() {
                return Err(bad("pool table volume name invalid"));
            }
            if twice == Some(i) {
                return Err(bad("pool table volume name or id used twice"));
            }
            if v.id == 0 || v.id >= self.next_id {
                return Err(bad("pool table volume id out of range"));
            }
            if v.size_bytes == 0
                || !v.size_bytes.is_multiple_of(BLOCK_SIZE_BYTES)
                || v.size_bytes > LOGICAL_SIZE_MAX_BYTES
                || v.extents.len() as u64 != extents_for(v.size_bytes)
            {
                return Err(bad("pool table volume size invalid"));
            }
            for &e in &v.extents {
                take(e)?;
            }
        }
        for s in &self.snapshots {
            for &e in s.extents.iter().filter(|&&e| e != NO_EXTENT) {
                take(e)?;
            }
        }
        for &e in &self.pending {
            take(e)?;
        }
        self.validate_snapshots()
    }

    /// 2 while a snapshot or a clone exists, else 1.
    pub fn version(&self) -> u32 {
        if self.snapshots.is_empty() && self.volumes.iter().all(|v| v.parent == 0) {
            POOL_VERSION
        } else {
            POOL_VERSION_SNAPSHOTS
        }
    }
}

/// The first index whose key an earlier index has: what comparing each
/// key with every earlier one finds, in O(n log n).
pub(super) fn first_repeat<K: Ord>(keys: impl Iterator<Item = K>) -> Option<usize> {
    let mut k: Vec<(K, usize)> = keys.enumerate().map(|(i, k)| (k, i)).collect();
    k.sort_unstable();
    // Sorted by key, then index: an index after an equal key repeats it.
    (k.windows(2))
        .filter(|w| w[0].0 == w[1].0)
        .map(|w| w[1].1)
        .min()
}

pub(super) struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    pub(super) fn take(&mut self, n: usize) -> Result<&[u8], FormatError> {
        let s = self
            .b
            .get(self.at..self.at + n)
            .ok_or(FormatError::Invalid("pool table cut short"))?;
        self.at += n;
        Ok(s)
    }

    pub(super) fn u32(&mut self) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }

    pub(super) fn u64(&mut self) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }

    /// `n` extent indexes (u32 each), read at once.
    pub(super) fn extents(&mut self, n: u32) -> Result<Vec<u32>, FormatError> {
        let b = self.take(4 * n as usize)?;
        Ok((b.chunks_exact(4))
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect())
    }

    fn volume(&mut self) -> Result<PoolVolume, FormatError> {
        let len = self.take(1)?[0] as usize;
        let name = std::str::from_utf8(self.take(len)?)
            .map_err(|_| FormatError::Invalid("pool table volume name not UTF-8"))?
            .to_string();
        let (id, size_bytes, created_unix_secs) = (self.u64()?, self.u64()?, self.u64()?);
        let n = self.u32()?;
        if u64::from(n) > u64::from(POOL_EXTENTS) {
            return Err(FormatError::Invalid(
                "pool table volume has too many extents",
            ));
        }
        let extents = self.extents(n)?;
        Ok(PoolVolume {
            name,
            id,
            size_bytes,
            created_unix_secs,
            extents,
            parent: 0,
        })
    }
}

mod snap;
pub use snap::{snapshot_name_problem, PoolSnapshot, SnapState, NO_EXTENT};

#[cfg(test)]
mod tests;
#[cfg(test)]
mod validate_tests;
