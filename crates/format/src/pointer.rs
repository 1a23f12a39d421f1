//! Checkpoint pointer: names the newest durable checkpoint. Two slots
//! alternate (generation parity), so a torn slot write leaves the other valid.
//!
//! ```text
//! offset size field
//! 0      8    magic "CVOLCKPT"
//! 8      8    generation (newest valid slot wins)
//! 16     8    commit_offset   (physical byte offset of the CKPT_COMMIT record)
//! 24     4    commit_len      (total record length, header + payload)
//! 28     4    commit_epoch
//! 32     8    commit_seq
//! 40     4    crc32c of bytes [0, 40)
//! 44          end; fits in one 512-byte sector
//! ```
use crate::*;

pub const POINTER_MAGIC: [u8; 8] = *b"CVOLCKPT";
pub const POINTER_BYTES: usize = 512;
const OFF_GEN: usize = 8;
const OFF_COMMIT_OFFSET: usize = OFF_GEN + 8;
const OFF_COMMIT_LEN: usize = OFF_COMMIT_OFFSET + 8;
const OFF_EPOCH: usize = OFF_COMMIT_LEN + 4;
const OFF_SEQ: usize = OFF_EPOCH + 4;
const OFF_CRC: usize = OFF_SEQ + 8;
const END: usize = OFF_CRC + 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointPointer {
    pub generation: u64,
    pub commit_offset: u64,
    pub commit_len: u32,
    pub commit_epoch: u32,
    pub commit_seq: u64,
}

impl CheckpointPointer {
    /// Slot index (0 or 1) this generation is written to.
    pub fn slot(&self) -> usize {
        (self.generation % 2) as usize
    }

    pub fn slot_offset(slot: usize) -> u64 {
        assert!(slot < 2);
        if slot == 0 {
            POINTER_SLOT_0_OFFSET
        } else {
            POINTER_SLOT_1_OFFSET
        }
    }

    pub fn encode(&self) -> [u8; POINTER_BYTES] {
        let mut b = [0u8; POINTER_BYTES];
        b[0..8].copy_from_slice(&POINTER_MAGIC);
        put_u64(&mut b, OFF_GEN, self.generation);
        put_u64(&mut b, OFF_COMMIT_OFFSET, self.commit_offset);
        put_u32(&mut b, OFF_COMMIT_LEN, self.commit_len);
        put_u32(&mut b, OFF_EPOCH, self.commit_epoch);
        put_u64(&mut b, OFF_SEQ, self.commit_seq);
        let crc = crc32c::crc32c(&b[..OFF_CRC]);
        put_u32(&mut b, OFF_CRC, crc);
        b
    }

    pub fn decode(b: &[u8]) -> Result<CheckpointPointer, FormatError> {
        need(b, END)?;
        if b[0..8] != POINTER_MAGIC {
            return Err(FormatError::BadMagic);
        }
        let stored = get_u32(b, OFF_CRC);
        let computed = crc32c::crc32c(&b[..OFF_CRC]);
        if stored != computed {
            return Err(FormatError::BadChecksum { stored, computed });
        }
        Ok(CheckpointPointer {
            generation: get_u64(b, OFF_GEN),
            commit_offset: get_u64(b, OFF_COMMIT_OFFSET),
            commit_len: get_u32(b, OFF_COMMIT_LEN),
            commit_epoch: get_u32(b, OFF_EPOCH),
            commit_seq: get_u64(b, OFF_SEQ),
        })
    }

    /// The newest of two decoded slots, if any is valid.
    pub fn newest(
        a: Option<CheckpointPointer>,
        b: Option<CheckpointPointer>,
    ) -> Option<CheckpointPointer> {
        match (a, b) {
            (Some(x), Some(y)) => Some(if x.generation >= y.generation { x } else { y }),
            (x, None) => x,
            (None, y) => y,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_newest() {
        let p = CheckpointPointer {
            generation: 5,
            commit_offset: 1 << 20,
            commit_len: 99,
            commit_epoch: 2,
            commit_seq: 77,
        };
        let d = CheckpointPointer::decode(&p.encode()).unwrap();
        assert_eq!(d, p);
        assert_eq!(p.slot(), 1);
        let q = CheckpointPointer { generation: 6, ..p };
        assert_eq!(
            CheckpointPointer::newest(Some(p), Some(q))
                .unwrap()
                .generation,
            6
        );
        assert_eq!(
            CheckpointPointer::newest(None, Some(p)).unwrap().generation,
            5
        );
        assert!(CheckpointPointer::newest(None, None).is_none());
    }

    #[test]
    fn corruption_detected() {
        let p = CheckpointPointer {
            generation: 1,
            commit_offset: 4096,
            commit_len: 10,
            commit_epoch: 1,
            commit_seq: 3,
        };
        let b = p.encode();
        for bit in 0..(END * 8) {
            let mut c = b;
            c[bit / 8] ^= 1 << (bit % 8);
            assert!(CheckpointPointer::decode(&c).is_err(), "bit {bit}");
        }
        assert!(CheckpointPointer::decode(&[0u8; POINTER_BYTES]).is_err());
    }
}
