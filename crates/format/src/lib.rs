//! cvol on-disk format: byte layouts, encoding, decoding and checksums.
//!
//! This crate does no I/O. Every layout is documented beside its offset
//! constants, each offset derived from the previous one, and mirrored in
//! `docs/FORMAT.md`. All integers are little-endian.
//!
//! Backing store layout:
//! ```text
//! 0        superblock copy A          (4 KiB, static after create)
//! 4 KiB    superblock copy B          (4 KiB, identical to A)
//! 8 KiB    checkpoint pointer slot 0  (one 512-byte sector used)
//! 12 KiB   checkpoint pointer slot 1
//! 16 KiB   metadata device label copies A and B (only with a metadata
//!          device, `metadev`)
//! 24 KiB   cache label copies A and B (only for a cache, `cache`)
//! 32 KiB   flush mark slots 0 and 1 (one 512-byte sector used each, `flushmark`)
//! 64 KiB   pool table slots 0 and 1 (480 KiB each; pools, `pool`)
//! 1 MiB    segment 0, segment 1, ...  (fixed size; records packed byte-granular)
//! ```

pub mod cache;
pub mod checkpoint;
pub mod flushmark;
pub mod fprints;
pub mod hooks;
pub mod keyslot;
pub mod mapentry;
pub mod metadev;
pub mod pointer;
pub mod pool;
pub mod record;
pub mod seal;
pub mod superblock;
pub mod tables;
pub mod trace;

pub use mapentry::{EntryState, MapEntry};
pub use pointer::CheckpointPointer;
pub use record::{RecordHeader, RecordKind};
pub use superblock::Superblock;

/// Logical block size clients see and the unit of the block map.
pub const BLOCK_SIZE_BYTES: u64 = 4096;
/// Sector size whose writes the format assumes atomic (old or new, never mixed
/// within the sector). Flushes pad the log to this boundary so that no durable
/// sector is ever written again.
pub const SECTOR_SIZE_BYTES: u64 = 512;

/// Each superblock copy and pointer slot has a 4 KiB place of its own.
pub const METADATA_SLOT_BYTES: u64 = 4096;
pub const SUPERBLOCK_A_OFFSET: u64 = 0;
pub const SUPERBLOCK_B_OFFSET: u64 = SUPERBLOCK_A_OFFSET + METADATA_SLOT_BYTES;
pub const POINTER_SLOT_0_OFFSET: u64 = SUPERBLOCK_B_OFFSET + METADATA_SLOT_BYTES;
pub const POINTER_SLOT_1_OFFSET: u64 = POINTER_SLOT_0_OFFSET + METADATA_SLOT_BYTES;
const _: () = assert!(superblock::SUPERBLOCK_BYTES as u64 == METADATA_SLOT_BYTES);
const _: () = assert!(pointer::POINTER_BYTES as u64 <= METADATA_SLOT_BYTES);
const _: () = assert!(POINTER_SLOT_1_OFFSET + METADATA_SLOT_BYTES <= DATA_OFFSET_BYTES);
/// First byte of segment 0.
pub const DATA_OFFSET_BYTES: u64 = 1 << 20;

/// Largest physical offset a map entry can address (43 bits: 8 TiB).
pub const PHYSICAL_SIZE_MAX_BYTES: u64 = 1 << 43;
/// Largest logical size supported: 2^32 blocks (16 TiB).
pub const LOGICAL_SIZE_MAX_BYTES: u64 = (1 << 32) * BLOCK_SIZE_BYTES;

/// Codec tag stored in every record header and in every map entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum CodecTag {
    None = 0,
    Lz4 = 1,
    Zstd = 2,
}

impl CodecTag {
    pub const ALL: [CodecTag; 3] = [CodecTag::None, CodecTag::Lz4, CodecTag::Zstd];

    pub fn from_u8(v: u8) -> Result<CodecTag, FormatError> {
        match v {
            0 => Ok(CodecTag::None),
            1 => Ok(CodecTag::Lz4),
            2 => Ok(CodecTag::Zstd),
            _ => Err(FormatError::UnknownCodec(v)),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CodecTag::None => "none",
            CodecTag::Lz4 => "lz4",
            CodecTag::Zstd => "zstd",
        }
    }
}

/// Why a byte string is not a valid structure. Decoders never panic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FormatError {
    TooShort {
        needed: usize,
        got: usize,
    },
    BadMagic,
    BadChecksum {
        stored: u32,
        computed: u32,
    },
    UnsupportedVersion(u32),
    UnknownCodec(u8),
    UnknownKind(u8),
    Invalid(&'static str),
    /// A sealed (encrypted) record read without the volume's key.
    Sealed,
    /// A record in the clear where the volume seals every record.
    NotSealed,
    /// A sealed record or blob whose tag does not verify: changed,
    /// swapped, or sealed under another key.
    Unauthentic,
}

impl std::fmt::Display for FormatError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FormatError::TooShort { needed, got } => {
                write!(f, "too short: need {needed} bytes, got {got}")
            }
            FormatError::BadMagic => write!(f, "bad magic"),
            FormatError::BadChecksum { stored, computed } => {
                write!(
                    f,
                    "checksum mismatch: stored {stored:#010x}, computed {computed:#010x}"
                )
            }
            FormatError::UnsupportedVersion(v) => write!(f, "unsupported format version {v}"),
            FormatError::UnknownCodec(c) => write!(f, "unknown codec tag {c}"),
            FormatError::UnknownKind(k) => write!(f, "unknown record kind {k}"),
            FormatError::Invalid(what) => write!(f, "invalid field: {what}"),
            FormatError::Sealed => write!(f, "an encrypted record, and no key to open it"),
            FormatError::NotSealed => {
                write!(
                    f,
                    "a record in the clear on an encrypted volume (not written by cvol)"
                )
            }
            FormatError::Unauthentic => {
                write!(
                    f,
                    "authentication failed (changed, moved, or sealed under another key)"
                )
            }
        }
    }
}

impl std::error::Error for FormatError {}

pub(crate) fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
pub(crate) fn get_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}
pub(crate) fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}
pub(crate) fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn need(b: &[u8], n: usize) -> Result<(), FormatError> {
    if b.len() < n {
        Err(FormatError::TooShort {
            needed: n,
            got: b.len(),
        })
    } else {
        Ok(())
    }
}

/// Round `v` up to a multiple of `align` (a power of two).
pub fn align_up(v: u64, align: u64) -> u64 {
    debug_assert!(align.is_power_of_two());
    (v + align - 1) & !(align - 1)
}
