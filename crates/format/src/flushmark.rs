//! Flush mark: the highest seq a completed sync made durable, kept outside
//! the log. A flush that appends records writes it (the seq of the sync
//! before, as its SYNCED record certifies), alternating between two slots;
//! an open for writing writes both after its EPOCH record is synced. A
//! SYNCED record lies beside what it certifies, so damage to the log's tail
//! (a misdirected write over its last sectors) can take the records and
//! every SYNCED record certifying them at once; the mark survives it, and
//! recovery whose chain ends below it refuses instead of serving older data.
//!
//! ```text
//! offset size field
//! 0      8    magic "CVOLFLSH"
//! 8      4    volume tag (the superblock's `volume_tag`)
//! 12     4    epoch the mark was written in
//! 16     8    seq: every record up to it was synced
//! 24     4    crc32c of bytes [0, 24)
//! 28          end; fits in one 512-byte sector
//! ```
//!
//! The slot that decodes with the highest (epoch, seq) counts; a slot
//! that does not decode (zeros on a volume that never wrote one, or
//! damage) certifies nothing.
use crate::*;

pub const FLUSH_MARK_MAGIC: [u8; 8] = *b"CVOLFLSH";
pub const FLUSH_MARK_BYTES: usize = 512;
/// The two slots, in the space between the cache labels and the pool
/// table slots.
pub const FLUSH_MARK_OFFSETS: [u64; 2] = [32 << 10, (32 << 10) + METADATA_SLOT_BYTES];
const _: () = assert!(cache::CACHE_LABEL_B_OFFSET + METADATA_SLOT_BYTES <= FLUSH_MARK_OFFSETS[0]);
const _: () = assert!(FLUSH_MARK_OFFSETS[1] + METADATA_SLOT_BYTES <= pool::POOL_SLOT_OFFSETS[0]);
const OFF_TAG: usize = 8;
const OFF_EPOCH: usize = OFF_TAG + 4;
const OFF_SEQ: usize = OFF_EPOCH + 4;
const OFF_CRC: usize = OFF_SEQ + 8;
const END: usize = OFF_CRC + 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlushMark {
    pub volume_tag: u32,
    pub epoch: u32,
    pub seq: u64,
}

impl FlushMark {
    pub fn encode(&self) -> [u8; FLUSH_MARK_BYTES] {
        let mut b = [0u8; FLUSH_MARK_BYTES];
        b[0..8].copy_from_slice(&FLUSH_MARK_MAGIC);
        put_u32(&mut b, OFF_TAG, self.volume_tag);
        put_u32(&mut b, OFF_EPOCH, self.epoch);
        put_u64(&mut b, OFF_SEQ, self.seq);
        let crc = crc32c::crc32c(&b[..OFF_CRC]);
        put_u32(&mut b, OFF_CRC, crc);
        b
    }

    /// Decodes a slot of the volume with tag `volume_tag` (another
    /// volume's mark, left by an earlier format of the store, is refused).
    pub fn decode(b: &[u8], volume_tag: u32) -> Result<FlushMark, FormatError> {
        need(b, END)?;
        if b[0..8] != FLUSH_MARK_MAGIC {
            return Err(FormatError::BadMagic);
        }
        let stored = get_u32(b, OFF_CRC);
        let computed = crc32c::crc32c(&b[..OFF_CRC]);
        if stored != computed {
            return Err(FormatError::BadChecksum { stored, computed });
        }
        let m = FlushMark {
            volume_tag: get_u32(b, OFF_TAG),
            epoch: get_u32(b, OFF_EPOCH),
            seq: get_u64(b, OFF_SEQ),
        };
        if m.volume_tag != volume_tag {
            return Err(FormatError::Invalid("flush mark of another volume"));
        }
        Ok(m)
    }

    /// The mark that counts of two decoded slots: the highest (epoch, seq).
    pub fn newest(a: Option<FlushMark>, b: Option<FlushMark>) -> Option<FlushMark> {
        match (a, b) {
            (Some(x), Some(y)) => Some(if (x.epoch, x.seq) >= (y.epoch, y.seq) {
                x
            } else {
                y
            }),
            (x, None) => x,
            (None, y) => y,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_newest_and_foreign_tag() {
        let m = FlushMark {
            volume_tag: 0xfeed,
            epoch: 3,
            seq: 574,
        };
        assert_eq!(FlushMark::decode(&m.encode(), 0xfeed).unwrap(), m);
        assert!(FlushMark::decode(&m.encode(), 0xbeef).is_err());
        assert!(FlushMark::decode(&[0u8; FLUSH_MARK_BYTES], 0xfeed).is_err());
        // A later epoch wins over a higher seq of an earlier one (an open
        // after repair writes a lower seq in a new epoch).
        let later = FlushMark {
            epoch: 4,
            seq: 541,
            ..m
        };
        assert_eq!(FlushMark::newest(Some(m), Some(later)), Some(later));
        assert_eq!(FlushMark::newest(Some(m), None), Some(m));
        assert_eq!(FlushMark::newest(None, None), None);
    }

    #[test]
    fn corruption_detected() {
        let b = FlushMark {
            volume_tag: 7,
            epoch: 1,
            seq: 99,
        }
        .encode();
        for bit in 0..(END * 8) {
            let mut c = b;
            c[bit / 8] ^= 1 << (bit % 8);
            assert!(FlushMark::decode(&c, 7).is_err(), "bit {bit}");
        }
    }
}
