//! The cache label (volumes with `FLAG_CACHE`: a compressed cache in front
//! of an origin, as FlaZ in Klonatos et al., *Transparent Online Storage
//! Compression at the Block-Level*).
//!
//! A cache volume is an ordinary volume whose logical size is its origin's
//! and whose *unmapped* blocks mean "not cached: read the origin" instead
//! of zeros. The label names the origin and says how the cache was left:
//! `state` is `OPEN` from the first write of a serve to its clean close,
//! so an open that finds `OPEN` knows the last server did not stop cleanly.
//! The origin's size and stamp at the clean close let the next open tell
//! that the origin changed while the cache was offline (it then starts
//! cold instead of serving stale lines).
//!
//! Two copies in the data store after the metadata device labels, written
//! in turn (A, then B) with a rising `sequence`: a torn write of one leaves
//! the other, and the copy that decodes with the higher sequence wins.
//!
//! ```text
//! offset size field
//! 0      8    magic "CVOLCACH"
//! 8      16   volume uuid (the superblock's)
//! 24     8    sequence (the newer copy has the higher)
//! 32     1    mode: 0 write-through, 1 write-back
//! 33     1    state: 0 open (served, not closed yet), 1 clean
//! 34     2    reserved (0)
//! 36     4    line_size_bytes (power of two, 4 KiB to 1 MiB)
//! 40     8    origin_size_bytes at the last clean close (or at create)
//! 48     8    origin stamp: mtime in ns of a regular file origin (0: none)
//! 56     8    origin stamp: inode number (0: none)
//! 64     8    origin stamp: device number (0: none)
//! 72     2    origin length n (n <= CACHE_ORIGIN_MAX_BYTES)
//! 74     n    the origin as given at create: a path or an NBD URI (UTF-8)
//! 4092   4    crc32c of bytes [0, 4092)
//! ```
use crate::superblock::UUID_BYTES;
use crate::*;

pub const CACHE_MAGIC: [u8; 8] = *b"CVOLCACH";
pub const CACHE_LABEL_BYTES: usize = 4096;
pub const CACHE_LABEL_A_OFFSET: u64 = metadev::METADEV_LABEL_B_OFFSET + METADATA_SLOT_BYTES;
pub const CACHE_LABEL_B_OFFSET: u64 = CACHE_LABEL_A_OFFSET + METADATA_SLOT_BYTES;
const _: () = assert!(CACHE_LABEL_B_OFFSET + METADATA_SLOT_BYTES <= DATA_OFFSET_BYTES);
pub const CACHE_ORIGIN_MAX_BYTES: usize = 3072;
pub const CACHE_LINE_MIN_BYTES: u32 = 4096;
pub const CACHE_LINE_MAX_BYTES: u32 = 1 << 20;
pub const CACHE_LINE_DEFAULT_BYTES: u32 = 64 << 10;
const OFF_UUID: usize = 8;
const OFF_SEQ: usize = OFF_UUID + UUID_BYTES;
const OFF_MODE: usize = OFF_SEQ + 8;
const OFF_STATE: usize = OFF_MODE + 1;
const OFF_LINE: usize = OFF_STATE + 3;
const OFF_ORIGIN_SIZE: usize = OFF_LINE + 4;
const OFF_MTIME: usize = OFF_ORIGIN_SIZE + 8;
const OFF_INO: usize = OFF_MTIME + 8;
const OFF_DEV: usize = OFF_INO + 8;
const OFF_ORIGIN_LEN: usize = OFF_DEV + 8;
const OFF_ORIGIN: usize = OFF_ORIGIN_LEN + 2;
const OFF_CRC: usize = CACHE_LABEL_BYTES - 4;
const _: () = assert!(OFF_ORIGIN + CACHE_ORIGIN_MAX_BYTES <= OFF_CRC);

/// How writes reach the origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheMode {
    /// The origin first, then the cache; the origin always holds every
    /// completed write (FlaZ's mode).
    WriteThrough,
    /// The cache only; dirty lines go to the origin in the background, at
    /// eviction and at a clean close.
    WriteBack,
}

impl CacheMode {
    pub fn name(self) -> &'static str {
        match self {
            CacheMode::WriteThrough => "write-through",
            CacheMode::WriteBack => "write-back",
        }
    }

    pub fn parse(s: &str) -> Option<CacheMode> {
        match s {
            "write-through" => Some(CacheMode::WriteThrough),
            "write-back" => Some(CacheMode::WriteBack),
            _ => None,
        }
    }
}

/// What identifies the origin's content between two serves: its size, and
/// for a regular file its mtime, inode and device (zeros when unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OriginStamp {
    pub size_bytes: u64,
    pub mtime_ns: u64,
    pub ino: u64,
    pub dev: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheLabel {
    pub uuid: [u8; UUID_BYTES],
    pub sequence: u64,
    pub mode: CacheMode,
    /// Closed cleanly (the cache's content matches `stamp`'s origin).
    pub clean: bool,
    pub line_size_bytes: u32,
    pub stamp: OriginStamp,
    pub origin: String,
}

impl CacheLabel {
    /// Where copy `sequence` goes: A for even, B for odd.
    pub fn offset(&self) -> u64 {
        if self.sequence.is_multiple_of(2) {
            CACHE_LABEL_A_OFFSET
        } else {
            CACHE_LABEL_B_OFFSET
        }
    }

    pub fn encode(&self) -> [u8; CACHE_LABEL_BYTES] {
        assert!(self.origin.len() <= CACHE_ORIGIN_MAX_BYTES);
        let mut b = [0u8; CACHE_LABEL_BYTES];
        b[0..8].copy_from_slice(&CACHE_MAGIC);
        b[OFF_UUID..OFF_UUID + UUID_BYTES].copy_from_slice(&self.uuid);
        put_u64(&mut b, OFF_SEQ, self.sequence);
        b[OFF_MODE] = match self.mode {
            CacheMode::WriteThrough => 0,
            CacheMode::WriteBack => 1,
        };
        b[OFF_STATE] = u8::from(self.clean);
        put_u32(&mut b, OFF_LINE, self.line_size_bytes);
        put_u64(&mut b, OFF_ORIGIN_SIZE, self.stamp.size_bytes);
        put_u64(&mut b, OFF_MTIME, self.stamp.mtime_ns);
        put_u64(&mut b, OFF_INO, self.stamp.ino);
        put_u64(&mut b, OFF_DEV, self.stamp.dev);
        put_u16(&mut b, OFF_ORIGIN_LEN, self.origin.len() as u16);
        b[OFF_ORIGIN..OFF_ORIGIN + self.origin.len()].copy_from_slice(self.origin.as_bytes());
        let crc = crc32c::crc32c(&b[..OFF_CRC]);
        put_u32(&mut b, OFF_CRC, crc);
        b
    }

    pub fn decode(b: &[u8]) -> Result<CacheLabel, FormatError> {
        need(b, CACHE_LABEL_BYTES)?;
        if b[0..8] != CACHE_MAGIC {
            return Err(FormatError::BadMagic);
        }
        let stored = get_u32(b, OFF_CRC);
        let computed = crc32c::crc32c(&b[..OFF_CRC]);
        if stored != computed {
            return Err(FormatError::BadChecksum { stored, computed });
        }
        let mode = match b[OFF_MODE] {
            0 => CacheMode::WriteThrough,
            1 => CacheMode::WriteBack,
            _ => return Err(FormatError::Invalid("cache mode")),
        };
        let clean = match b[OFF_STATE] {
            0 => false,
            1 => true,
            _ => return Err(FormatError::Invalid("cache state")),
        };
        let line_size_bytes = get_u32(b, OFF_LINE);
        if !line_size_bytes.is_power_of_two()
            || !(CACHE_LINE_MIN_BYTES..=CACHE_LINE_MAX_BYTES).contains(&line_size_bytes)
        {
            return Err(FormatError::Invalid("cache line size"));
        }
        let n = get_u16(b, OFF_ORIGIN_LEN) as usize;
        if n > CACHE_ORIGIN_MAX_BYTES {
            return Err(FormatError::Invalid("cache origin length"));
        }
        let origin = std::str::from_utf8(&b[OFF_ORIGIN..OFF_ORIGIN + n])
            .map_err(|_| FormatError::Invalid("cache origin is not UTF-8"))?;
        let mut uuid = [0u8; UUID_BYTES];
        uuid.copy_from_slice(&b[OFF_UUID..OFF_UUID + UUID_BYTES]);
        Ok(CacheLabel {
            uuid,
            sequence: get_u64(b, OFF_SEQ),
            mode,
            clean,
            line_size_bytes,
            stamp: OriginStamp {
                size_bytes: get_u64(b, OFF_ORIGIN_SIZE),
                mtime_ns: get_u64(b, OFF_MTIME),
                ino: get_u64(b, OFF_INO),
                dev: get_u64(b, OFF_DEV),
            },
            origin: origin.to_string(),
        })
    }

    /// The newer of two copies that decode and belong to `uuid`.
    pub fn newest(copies: [&[u8]; 2], uuid: &[u8; UUID_BYTES]) -> Option<CacheLabel> {
        copies
            .iter()
            .filter_map(|b| CacheLabel::decode(b).ok())
            .filter(|l| &l.uuid == uuid)
            .max_by_key(|l| l.sequence)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn label() -> CacheLabel {
        CacheLabel {
            uuid: [7; 16],
            sequence: 3,
            mode: CacheMode::WriteBack,
            clean: true,
            line_size_bytes: 64 << 10,
            stamp: OriginStamp {
                size_bytes: 2 << 30,
                mtime_ns: 17,
                ino: 99,
                dev: 2049,
            },
            origin: "nbd+unix:///disk?socket=/run/o.sock".into(),
        }
    }

    #[test]
    fn roundtrip_and_every_damage_refused() {
        let l = label();
        let b = l.encode();
        assert_eq!(CacheLabel::decode(&b).unwrap(), l);
        for at in [
            0,
            OFF_UUID,
            OFF_SEQ,
            OFF_MODE,
            OFF_LINE,
            OFF_ORIGIN_LEN,
            OFF_ORIGIN,
            OFF_CRC,
        ] {
            let mut d = b;
            d[at] ^= 1;
            assert!(CacheLabel::decode(&d).is_err(), "flip at {at}");
        }
        assert!(CacheLabel::decode(&b[..100]).is_err());
    }

    #[test]
    fn the_newer_copy_of_this_volume_wins() {
        let a = label();
        let mut b = label();
        b.sequence = 4;
        b.clean = false;
        let (ea, eb) = (a.encode(), b.encode());
        assert_eq!(CacheLabel::newest([&ea, &eb], &a.uuid), Some(b.clone()));
        assert_eq!(CacheLabel::newest([&eb, &ea], &a.uuid), Some(b.clone()));
        let mut torn = eb;
        torn[600] ^= 0xff;
        assert_eq!(CacheLabel::newest([&ea, &torn], &a.uuid), Some(a.clone()));
        assert_eq!(CacheLabel::newest([&ea, &eb], &[1; 16]), None);
        assert_ne!(a.offset(), b.offset());
    }
}
