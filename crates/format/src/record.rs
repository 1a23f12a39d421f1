//! Log records: every record in a segment is self-describing.
//!
//! ```text
//! offset size field
//! 0      4    magic 0x524c5643 ("CVLR" little-endian)
//! 4      1    kind   (1 DATA, 2 ZERO, 3 TRIM, 4 EPOCH, 5 MAP_CHUNK, 6 CKPT_COMMIT,
//!                     7 REF, 8 SYNCED, 9 MAP_DIR)
//! 5      1    codec: bits 0..3 tag of the payload (0 none, 1 lz4, 2 zstd),
//!             bits 3..8 the codec level it was made with (zstd 1..=19; 0 otherwise
//!             or unknown)
//! 6      2    flags: for a DATA record of more than one block (a merged
//!             compression unit), the *live mask*: bit k set = replay maps
//!             block k (lba + k) to this record (a fresh unit has every bit
//!             of its blocks set; a unit the cleaner moved keeps only its live
//!             blocks, possibly none when only dedup references hold it).
//!             0 otherwise
//! 8      4    volume tag (crc32c of the volume uuid)
//! 12     4    epoch (incremented each time the volume is opened for writing)
//! 16     8    seq   (global, +1 per record, never reused)
//! 24     8    lba   (first logical block covered)
//! 32     4    nblocks (logical blocks covered)
//! 36     4    payload_len (bytes following the header)
//! 40     4    crc32c: crc32c_append(crc32c(payload), header bytes [0, 40))
//! 44          payload
//! ```
//! DATA payloads decompress to exactly `nblocks * 4096` bytes (a unit holds at
//! most `UNIT_BLOCKS_MAX` = 16 blocks, so the live mask fits the flags, and
//! lies inside one aligned window of 16 blocks: `lba / 16` is the same for
//! all its blocks, so every owner entry of a unit lies in that window of
//! the map; a record that crosses it is invalid). ZERO
//! and TRIM carry no payload. Records never span segments.
use crate::seal::{KIND_SEALED_BIT, SEAL_TAG_BYTES};
use crate::*;

pub const RECORD_MAGIC: u32 = 0x524c_5643;
pub const RECORD_HEADER_BYTES: usize = 44;
const OFF_KIND: usize = 4;
const OFF_CODEC: usize = OFF_KIND + 1;
const OFF_FLAGS: usize = OFF_CODEC + 1;
const OFF_VOLTAG: usize = OFF_FLAGS + 2;
const OFF_EPOCH: usize = OFF_VOLTAG + 4;
const OFF_SEQ: usize = OFF_EPOCH + 4;
const OFF_LBA: usize = OFF_SEQ + 8;
const OFF_NBLOCKS: usize = OFF_LBA + 8;
const OFF_PAYLOAD_LEN: usize = OFF_NBLOCKS + 4;
const OFF_CRC: usize = OFF_PAYLOAD_LEN + 4;
const _: () = assert!(OFF_CRC + 4 == RECORD_HEADER_BYTES);

/// Largest record (header + payload) a map entry can point at.
pub const RECORD_MAX_BYTES: usize = (1 << 17) - 1;

/// Most blocks one DATA record holds (a merged compression unit): the live
/// mask in the flags field has one bit per block.
pub const UNIT_BLOCKS_MAX: u32 = u16::BITS;
/// A DATA record of a whole unit stored uncompressed (and sealed): the
/// largest DATA record a writer makes.
pub const UNIT_RECORD_MAX_BYTES: usize =
    RECORD_HEADER_BYTES + UNIT_BLOCKS_MAX as usize * BLOCK_SIZE_BYTES as usize + SEAL_TAG_BYTES;
const _: () = assert!(UNIT_RECORD_MAX_BYTES <= RECORD_MAX_BYTES);
/// A REF record's payload: one map entry (ref form).
pub const REF_PAYLOAD_BYTES: usize = crate::mapentry::MAP_ENTRY_BYTES;
/// A whole REF record.
pub const REF_RECORD_BYTES: usize = RECORD_HEADER_BYTES + REF_PAYLOAD_BYTES;
/// A SYNCED record's payload: the certified seq (u64).
pub const SYNCED_PAYLOAD_BYTES: usize = 8;
/// A record without payload (ZERO, TRIM, EPOCH).
pub const EMPTY_RECORD_BYTES: usize = RECORD_HEADER_BYTES;
/// What a record costs beyond its payload in the clear, at most: the
/// header, and on an encrypted volume the AEAD tag (`seal`). Space bounds
/// use these, so that they hold on every volume.
pub const RECORD_OVERHEAD_MAX_BYTES: usize = RECORD_HEADER_BYTES + SEAL_TAG_BYTES;
/// A REF record's bytes, at most (sealed).
pub const REF_RECORD_MAX_BYTES: usize = REF_RECORD_BYTES + SEAL_TAG_BYTES;
/// A record without content's bytes, at most (sealed).
pub const EMPTY_RECORD_MAX_BYTES: usize = EMPTY_RECORD_BYTES + SEAL_TAG_BYTES;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum RecordKind {
    Data = 1,
    Zero = 2,
    Trim = 3,
    Epoch = 4,
    MapChunk = 5,
    CkptCommit = 6,
    /// Dedup reference: the LBA now holds the content of an existing DATA
    /// record; the payload is that record's map entry (12 bytes, ref form).
    Ref = 7,
    /// Written with a flush: every record up to the seq in its payload (u64)
    /// was made durable by an earlier, completed sync. Lets recovery tell a
    /// log damaged after the fact from a crash's unsynced tail.
    Synced = 8,
    /// A block of the paged map's directory: where the MAP_CHUNK record of
    /// each map page in its range is (`checkpoint::DirPayload`).
    MapDir = 9,
    /// A persisted liveness table (`tables`): the root or a group of
    /// segments, named in the map directory after the map's pages.
    MapTable = 10,
}

impl RecordKind {
    pub fn from_u8(v: u8) -> Result<RecordKind, FormatError> {
        Ok(match v {
            1 => RecordKind::Data,
            2 => RecordKind::Zero,
            3 => RecordKind::Trim,
            4 => RecordKind::Epoch,
            5 => RecordKind::MapChunk,
            6 => RecordKind::CkptCommit,
            7 => RecordKind::Ref,
            8 => RecordKind::Synced,
            9 => RecordKind::MapDir,
            10 => RecordKind::MapTable,
            _ => return Err(FormatError::UnknownKind(v)),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    pub kind: RecordKind,
    pub codec: CodecTag,
    /// Codec level the payload was made with (zstd), 0 if none or unknown.
    pub level: u8,
    /// Live mask of a multi-block DATA record; 0 otherwise.
    pub mask: u16,
    pub volume_tag: u32,
    pub epoch: u32,
    pub seq: u64,
    pub lba: u64,
    pub nblocks: u32,
    pub payload_len: u32,
    /// Filled in by `encode_with_crc`; checked by `verify`.
    pub crc: u32,
    /// The payload is sealed (encrypted volumes, `seal`): bit 7 of the
    /// kind byte; `payload_len` then counts the AEAD tag.
    pub sealed: bool,
}

impl RecordHeader {
    pub fn total_len(&self) -> usize {
        RECORD_HEADER_BYTES + self.payload_len as usize
    }

    /// The payload's length in the clear (without a sealed record's tag).
    pub fn plain_len(&self) -> usize {
        let tag = if self.sealed { SEAL_TAG_BYTES } else { 0 };
        (self.payload_len as usize).saturating_sub(tag)
    }

    /// Does replaying this record map block `lba`?
    pub fn maps(&self, lba: u64) -> bool {
        let end = self.lba + u64::from(self.nblocks);
        (self.lba..end).contains(&lba)
            && (self.nblocks == 1
                || self.mask & (1 << (lba - self.lba).min(u64::from(UNIT_BLOCKS_MAX) - 1)) != 0)
    }

    fn encode_without_crc(&self) -> [u8; RECORD_HEADER_BYTES] {
        let mut b = [0u8; RECORD_HEADER_BYTES];
        put_u32(&mut b, 0, RECORD_MAGIC);
        b[OFF_KIND] = self.kind as u8 | if self.sealed { KIND_SEALED_BIT } else { 0 };
        assert!(self.level < 32, "codec level {} does not fit", self.level);
        b[OFF_CODEC] = self.codec as u8 | (self.level << 3);
        put_u16(&mut b, OFF_FLAGS, self.mask);
        put_u32(&mut b, OFF_VOLTAG, self.volume_tag);
        put_u32(&mut b, OFF_EPOCH, self.epoch);
        put_u64(&mut b, OFF_SEQ, self.seq);
        put_u64(&mut b, OFF_LBA, self.lba);
        put_u32(&mut b, OFF_NBLOCKS, self.nblocks);
        put_u32(&mut b, OFF_PAYLOAD_LEN, self.payload_len);
        b
    }

    /// Encodes the header, computing the record CRC from the CRC of the
    /// payload (`crc32c(payload)`, computed by the caller, possibly earlier and
    /// outside any lock). Returns the bytes and sets `self.crc`.
    pub fn encode_with_crc(&mut self, payload_crc: u32) -> [u8; RECORD_HEADER_BYTES] {
        let mut b = self.encode_without_crc();
        self.crc = crc32c::crc32c_append(payload_crc, &b[..OFF_CRC]);
        put_u32(&mut b, OFF_CRC, self.crc);
        b
    }

    /// Decodes and sanity-checks a header. The CRC is not verified here
    /// (it needs the payload): call `verify` once the payload is read.
    pub fn decode(b: &[u8]) -> Result<RecordHeader, FormatError> {
        need(b, RECORD_HEADER_BYTES)?;
        if get_u32(b, 0) != RECORD_MAGIC {
            return Err(FormatError::BadMagic);
        }
        let h = RecordHeader {
            kind: RecordKind::from_u8(b[OFF_KIND] & !KIND_SEALED_BIT)?,
            codec: CodecTag::from_u8(b[OFF_CODEC] & 7)?,
            level: b[OFF_CODEC] >> 3,
            mask: get_u16(b, OFF_FLAGS),
            volume_tag: get_u32(b, OFF_VOLTAG),
            epoch: get_u32(b, OFF_EPOCH),
            seq: get_u64(b, OFF_SEQ),
            lba: get_u64(b, OFF_LBA),
            nblocks: get_u32(b, OFF_NBLOCKS),
            payload_len: get_u32(b, OFF_PAYLOAD_LEN),
            crc: get_u32(b, OFF_CRC),
            sealed: b[OFF_KIND] & KIND_SEALED_BIT != 0,
        };
        if h.sealed && (h.payload_len as usize) < SEAL_TAG_BYTES {
            return Err(FormatError::Invalid("sealed payload shorter than its tag"));
        }
        let plain = h.plain_len();
        if h.mask != 0 && (h.kind != RecordKind::Data || h.nblocks < 2) {
            return Err(FormatError::Invalid("record flags"));
        }
        if h.nblocks <= UNIT_BLOCKS_MAX && u32::from(h.mask) >> h.nblocks != 0 {
            return Err(FormatError::Invalid("live mask beyond the record"));
        }
        match h.kind {
            RecordKind::Data if h.nblocks == 0 || plain == 0 => {
                return Err(FormatError::Invalid("empty data record"))
            }
            RecordKind::Data if h.total_len() > RECORD_MAX_BYTES => {
                return Err(FormatError::Invalid("data record too long"))
            }
            RecordKind::Zero | RecordKind::Trim if plain != 0 || h.nblocks == 0 => {
                return Err(FormatError::Invalid("zero/trim record shape"))
            }
            RecordKind::Ref if plain != REF_PAYLOAD_BYTES || h.nblocks != 1 => {
                return Err(FormatError::Invalid("ref record shape"))
            }
            RecordKind::Synced if plain != SYNCED_PAYLOAD_BYTES || h.nblocks != 0 => {
                return Err(FormatError::Invalid("synced record shape"))
            }
            _ => {}
        }
        if h.lba.checked_add(u64::from(h.nblocks)).is_none() {
            return Err(FormatError::Invalid("lba range overflows"));
        }
        let window = u64::from(UNIT_BLOCKS_MAX);
        if h.kind == RecordKind::Data
            && h.nblocks >= 2
            && h.lba / window != (h.lba + u64::from(h.nblocks) - 1) / window
        {
            return Err(FormatError::Invalid("a unit crosses its window"));
        }
        Ok(h)
    }

    /// Verifies the record CRC over `header_bytes` (44) and `payload`.
    pub fn verify(&self, header_bytes: &[u8], payload: &[u8]) -> Result<(), FormatError> {
        need(header_bytes, RECORD_HEADER_BYTES)?;
        if payload.len() != self.payload_len as usize {
            return Err(FormatError::TooShort {
                needed: self.payload_len as usize,
                got: payload.len(),
            });
        }
        let computed = crc32c::crc32c_append(crc32c::crc32c(payload), &header_bytes[..OFF_CRC]);
        if computed != self.crc {
            return Err(FormatError::BadChecksum {
                stored: self.crc,
                computed,
            });
        }
        Ok(())
    }

    /// Decodes a whole record from `b` (header followed by payload) and verifies it.
    pub fn decode_verified(b: &[u8]) -> Result<(RecordHeader, &[u8]), FormatError> {
        let h = RecordHeader::decode(b)?;
        need(b, h.total_len())?;
        let payload = &b[RECORD_HEADER_BYTES..h.total_len()];
        h.verify(b, payload)?;
        Ok((h, payload))
    }
}

/// For a record that fails its checksum: is the damage one byte of the
/// header's first 40 bytes? If some single-byte change there makes the
/// record verify, returns the header as it was written (the payload is then
/// intact); otherwise `None`: the damage is in the payload or the stored
/// crc (the header fields are as written), or wider than one byte. Repair
/// uses it to know which blocks a damaged record held. `b` starts at the
/// record and runs to the end of its segment.
pub fn header_byte_fix(b: &[u8]) -> Option<RecordHeader> {
    if b.len() < RECORD_HEADER_BYTES {
        return None;
    }
    let stored = get_u32(b, OFF_CRC);
    let mut h = [0u8; OFF_CRC];
    h.copy_from_slice(&b[..OFF_CRC]);
    let payload_crc = |len: usize| {
        b.get(RECORD_HEADER_BYTES..RECORD_HEADER_BYTES + len)
            .map(crc32c::crc32c)
    };
    let own = payload_crc(get_u32(b, OFF_PAYLOAD_LEN) as usize);
    let mut found = None;
    for i in 0..OFF_CRC {
        let orig = h[i];
        for x in 1..=255u8 {
            h[i] = orig ^ x;
            let p = if (OFF_PAYLOAD_LEN..OFF_CRC).contains(&i) {
                payload_crc(get_u32(&h, OFF_PAYLOAD_LEN) as usize)
            } else {
                own
            };
            if p.is_some_and(|p| crc32c::crc32c_append(p, &h) == stored) {
                let mut full = [0u8; RECORD_HEADER_BYTES];
                full[..OFF_CRC].copy_from_slice(&h);
                put_u32(&mut full, OFF_CRC, stored);
                if let Ok(fixed) = RecordHeader::decode(&full) {
                    if found.is_some() {
                        return None; // ambiguous: trust neither
                    }
                    found = Some(fixed);
                }
            }
        }
        h[i] = orig;
    }
    found
}

/// Builds a complete record (header + payload) in one buffer.
pub fn encode_record(header: &mut RecordHeader, payload: &[u8]) -> Vec<u8> {
    assert_eq!(header.payload_len as usize, payload.len());
    let hb = header.encode_with_crc(crc32c::crc32c(payload));
    let mut v = Vec::with_capacity(RECORD_HEADER_BYTES + payload.len());
    v.extend_from_slice(&hb);
    v.extend_from_slice(payload);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_byte_fix_finds_a_damaged_header_byte_and_only_that() {
        let payload: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut h = RecordHeader {
            kind: RecordKind::Data,
            codec: CodecTag::Lz4,
            level: 0,
            mask: 0,
            volume_tag: 0xfeed,
            epoch: 3,
            seq: 99,
            lba: 1234,
            nblocks: 1,
            payload_len: payload.len() as u32,
            crc: 0,
            sealed: false,
        };
        let rec = encode_record(&mut h, &payload);
        for at in [OFF_SEQ, OFF_LBA, OFF_LBA + 3, OFF_NBLOCKS, OFF_EPOCH + 1] {
            let mut bad = rec.clone();
            bad[at] ^= 0x5a;
            assert!(RecordHeader::decode_verified(&bad).is_err());
            assert_eq!(header_byte_fix(&bad), Some(h), "byte {at}");
        }
        // Damage in the payload or the stored crc: the header is as written.
        for at in [RECORD_HEADER_BYTES + 17, OFF_CRC + 1] {
            let mut bad = rec.clone();
            bad[at] ^= 0x81;
            assert_eq!(header_byte_fix(&bad), None, "byte {at}");
        }
    }

    fn hdr(payload_len: u32) -> RecordHeader {
        RecordHeader {
            kind: RecordKind::Data,
            codec: CodecTag::Lz4,
            level: 0,
            mask: 0,
            volume_tag: 0xdead_beef,
            epoch: 3,
            seq: 42,
            lba: 1000,
            nblocks: 1,
            payload_len,
            crc: 0,
            sealed: false,
        }
    }

    #[test]
    fn roundtrip_verified() {
        let payload = b"hello compressed world".to_vec();
        let mut h = hdr(payload.len() as u32);
        let rec = encode_record(&mut h, &payload);
        let (d, p) = RecordHeader::decode_verified(&rec).unwrap();
        assert_eq!(d, h);
        assert_eq!(p, &payload[..]);
    }

    #[test]
    fn every_bit_flip_detected() {
        let payload = vec![0xabu8; 64];
        let mut h = hdr(64);
        let rec = encode_record(&mut h, &payload);
        for bit in 0..rec.len() * 8 {
            let mut c = rec.clone();
            c[bit / 8] ^= 1 << (bit % 8);
            assert!(RecordHeader::decode_verified(&c).is_err(), "bit {bit}");
        }
    }

    #[test]
    fn shape_checks() {
        let mut h = hdr(0);
        h.kind = RecordKind::Zero;
        h.nblocks = 8;
        let rec = encode_record(&mut h, &[]);
        assert!(RecordHeader::decode_verified(&rec).is_ok());
        h.payload_len = 1;
        let b = h.encode_with_crc(0);
        assert!(RecordHeader::decode(&b).is_err());
        assert!(RecordHeader::decode(&[0u8; 10]).is_err());
        let mut bad = hdr(4).encode_with_crc(0);
        bad[OFF_KIND] = 99;
        assert_eq!(
            RecordHeader::decode(&bad),
            Err(FormatError::UnknownKind(99))
        );
    }

    #[test]
    fn level_and_live_mask_roundtrip() {
        let payload = vec![7u8; 100];
        let mut h = hdr(100);
        h.codec = CodecTag::Zstd;
        h.level = 19;
        h.nblocks = 16;
        h.lba = 992; // a unit lies in one aligned window of 16 blocks
        h.mask = 0b1010_0000_0000_0001;
        let rec = encode_record(&mut h, &payload);
        let (d, _) = RecordHeader::decode_verified(&rec).unwrap();
        assert_eq!(d, h);
        assert!(d.maps(992) && !d.maps(993) && d.maps(1005) && d.maps(1007));
        assert!(!d.maps(991) && !d.maps(1008));
        h.mask = 0; // a moved unit only dedup references hold
        assert!((982..1020).all(|l| !h.maps(l)));
        h.mask = 0xffff;
        assert!((992..1008).all(|l| h.maps(l)));
        // A unit that crosses its window is rejected.
        h.lba = 1000;
        assert_eq!(
            RecordHeader::decode(&h.encode_with_crc(0)),
            Err(FormatError::Invalid("a unit crosses its window"))
        );
        h.lba = 992;
        // A mask on a single-block record, or beyond the unit, is rejected.
        h.nblocks = 1;
        h.mask = 1;
        assert!(RecordHeader::decode(&h.encode_with_crc(0)).is_err());
        h.nblocks = 4;
        h.mask = 0b1_0000;
        assert!(RecordHeader::decode(&h.encode_with_crc(0)).is_err());
    }
}
