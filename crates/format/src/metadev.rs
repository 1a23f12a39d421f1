//! The metadata device label (volumes with `FLAG_METADATA_DEVICE`).
//!
//! A volume may keep its map records, checkpoint commits and fingerprint
//! tables on a second store, the *metadata device* (metadata on a faster
//! device, as VDO's block map and journal in Ajdari et al., *An
//! Enterprise-Grade Open-Source Data Reduction Architecture for All-Flash
//! Storage Systems*). Its segments follow the data store's in the
//! volume's offset space (`Superblock::metadata_base`), so record offsets,
//! map entries and page references keep one format. The label says which
//! volume a metadata device belongs to; it is written at create, in two
//! copies at the start of the metadata device (the device's own) and two
//! in the data store after the pointer slots (naming the device's path, so
//! that `serve VOLUME` finds it).
//!
//! ```text
//! offset size field
//! 0      8    magic "CVOLMDEV"
//! 8      16   volume uuid (the data store's superblock's)
//! 24     4    metadata_segments (as in the superblock)
//! 28     8    segment_size_bytes (as in the superblock)
//! 36     2    path length (n <= METADEV_PATH_MAX_BYTES)
//! 38     n    the metadata device's path as given at create (UTF-8)
//! 4092   4    crc32c of bytes [0, 4092)
//! ```
//! Metadata device layout: label copies at 0 and 4 KiB, segments from
//! `METADATA_DATA_OFFSET_BYTES` (1 MiB) on. Data store: label copies at
//! `METADEV_LABEL_A_OFFSET` and `_B_`, inside the first MiB.
use crate::*;

pub const METADEV_MAGIC: [u8; 8] = *b"CVOLMDEV";
pub const METADEV_LABEL_BYTES: usize = 4096;
/// Where the metadata device's first segment starts on that device.
pub const METADATA_DATA_OFFSET_BYTES: u64 = DATA_OFFSET_BYTES;
/// The label copies in the data store (after the pointer slots).
pub const METADEV_LABEL_A_OFFSET: u64 = POINTER_SLOT_1_OFFSET + METADATA_SLOT_BYTES;
pub const METADEV_LABEL_B_OFFSET: u64 = METADEV_LABEL_A_OFFSET + METADATA_SLOT_BYTES;
const _: () = assert!(METADEV_LABEL_B_OFFSET + METADATA_SLOT_BYTES <= DATA_OFFSET_BYTES);
const OFF_UUID: usize = 8;
const OFF_SEGMENTS: usize = OFF_UUID + UUID_BYTES;
const OFF_SEGMENT_SIZE: usize = OFF_SEGMENTS + 4;
const OFF_PATH_LEN: usize = OFF_SEGMENT_SIZE + 8;
const OFF_PATH: usize = OFF_PATH_LEN + 2;
const OFF_CRC: usize = METADEV_LABEL_BYTES - 4;
pub const METADEV_PATH_MAX_BYTES: usize = 3072;
const _: () = assert!(OFF_PATH + METADEV_PATH_MAX_BYTES <= OFF_CRC);

use crate::superblock::UUID_BYTES;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadevLabel {
    pub uuid: [u8; UUID_BYTES],
    pub metadata_segments: u32,
    pub segment_size_bytes: u64,
    pub path: String,
}

impl MetadevLabel {
    /// The label of `sb`'s metadata device at `path`; None if the path is
    /// too long to record.
    pub fn new(sb: &Superblock, path: &str) -> Option<MetadevLabel> {
        (path.len() <= METADEV_PATH_MAX_BYTES).then(|| MetadevLabel {
            uuid: sb.uuid,
            metadata_segments: sb.metadata_segments,
            segment_size_bytes: sb.segment_size_bytes,
            path: path.to_string(),
        })
    }

    /// Does this label belong to `sb`'s volume and say what it says?
    pub fn matches(&self, sb: &Superblock) -> bool {
        self.uuid == sb.uuid
            && self.metadata_segments == sb.metadata_segments
            && self.segment_size_bytes == sb.segment_size_bytes
    }

    pub fn encode(&self) -> [u8; METADEV_LABEL_BYTES] {
        assert!(self.path.len() <= METADEV_PATH_MAX_BYTES);
        let mut b = [0u8; METADEV_LABEL_BYTES];
        b[0..8].copy_from_slice(&METADEV_MAGIC);
        b[OFF_UUID..OFF_UUID + UUID_BYTES].copy_from_slice(&self.uuid);
        put_u32(&mut b, OFF_SEGMENTS, self.metadata_segments);
        put_u64(&mut b, OFF_SEGMENT_SIZE, self.segment_size_bytes);
        put_u16(&mut b, OFF_PATH_LEN, self.path.len() as u16);
        b[OFF_PATH..OFF_PATH + self.path.len()].copy_from_slice(self.path.as_bytes());
        let crc = crc32c::crc32c(&b[..OFF_CRC]);
        put_u32(&mut b, OFF_CRC, crc);
        b
    }

    pub fn decode(b: &[u8]) -> Result<MetadevLabel, FormatError> {
        need(b, METADEV_LABEL_BYTES)?;
        if b[0..8] != METADEV_MAGIC {
            return Err(FormatError::BadMagic);
        }
        let stored = get_u32(b, OFF_CRC);
        let computed = crc32c::crc32c(&b[..OFF_CRC]);
        if stored != computed {
            return Err(FormatError::BadChecksum { stored, computed });
        }
        let n = get_u16(b, OFF_PATH_LEN) as usize;
        if n > METADEV_PATH_MAX_BYTES {
            return Err(FormatError::Invalid("metadata device path length"));
        }
        let path = std::str::from_utf8(&b[OFF_PATH..OFF_PATH + n])
            .map_err(|_| FormatError::Invalid("metadata device path is not UTF-8"))?;
        let mut uuid = [0u8; UUID_BYTES];
        uuid.copy_from_slice(&b[OFF_UUID..OFF_UUID + UUID_BYTES]);
        Ok(MetadevLabel {
            uuid,
            metadata_segments: get_u32(b, OFF_SEGMENTS),
            segment_size_bytes: get_u64(b, OFF_SEGMENT_SIZE),
            path: path.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn label() -> MetadevLabel {
        MetadevLabel {
            uuid: [9; 16],
            metadata_segments: 12,
            segment_size_bytes: 4 << 20,
            path: "/dev/nvme0n1p3".into(),
        }
    }

    #[test]
    fn roundtrip_and_every_damage_refused() {
        let l = label();
        let b = l.encode();
        assert_eq!(MetadevLabel::decode(&b).unwrap(), l);
        for at in [0, OFF_UUID, OFF_SEGMENTS, OFF_PATH_LEN, OFF_PATH, OFF_CRC] {
            let mut d = b;
            d[at] ^= 1;
            assert!(MetadevLabel::decode(&d).is_err(), "flip at {at}");
        }
        assert!(MetadevLabel::decode(&b[..100]).is_err());
    }

    #[test]
    fn matches_only_its_volume() {
        let mut sb = Superblock::decode(&crate::superblock::tests_sample().encode()).unwrap();
        sb.metadata_segments = 12;
        sb.flags |= crate::superblock::FLAG_METADATA_DEVICE;
        sb.uuid = [9; 16];
        assert!(label().matches(&sb));
        sb.uuid[0] = 1;
        assert!(!label().matches(&sb));
        assert!(MetadevLabel::new(&sb, &"x".repeat(METADEV_PATH_MAX_BYTES + 1)).is_none());
    }
}
