//! Block map entry: 12 bytes per logical block, in memory and in checkpoints.
//!
//! ```text
//! loc: u64
//!   bits  0..43  physical byte offset of the record header (8 TiB)
//!   bits 43..60  record length, header + payload (< 128 KiB)
//!   bits 60..64  state: 0 unmapped, 1 zero, 2 data/none, 3 data/lz4, 4 data/zstd,
//!                5 ref/none, 6 ref/lz4, 7 ref/zstd,
//!                8 unit/none, 9 unit/lz4, 10 unit/zstd,
//!                11 unit ref/none, 12 unit ref/lz4, 13 unit ref/zstd,
//!                14 lost (offset, length and crc 0)
//! crc: u32       the record's CRC (catches stale or misdirected records);
//!                for a block k of a unit, the record's CRC xor k
//! ```
//! A *ref* entry points at a DATA record that may name another LBA in its
//! header (deduplication): the block's content is that record's, and the
//! owner-LBA check on read is skipped (the crc still identifies the record).
//! A *unit* entry points at block k of a multi-block DATA record (a merged
//! compression unit): k = entry crc xor record crc, which must be below the
//! record's block count (and, for the owner form, equal lba - record lba).
//! Checkpoint encoding: `loc` (8 bytes LE) then `crc` (4 bytes LE).
use crate::*;

const OFFSET_BITS: u32 = 43;
const LEN_BITS: u32 = 17;
const OFFSET_MASK: u64 = (1 << OFFSET_BITS) - 1;
const LEN_MASK: u64 = (1 << LEN_BITS) - 1;
const STATE_SHIFT: u32 = OFFSET_BITS + LEN_BITS;
pub const MAP_ENTRY_BYTES: usize = 12;
/// State value of a lost block (see [`EntryState::Lost`]).
const STATE_LOST: u64 = 14;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryState {
    /// Never written, or trimmed: reads as zeros, reported as a hole.
    Unmapped,
    /// Written as zeros: reads as zeros, costs no data space.
    Zero,
    /// Its newest flushed version was destroyed by damage at rest and could
    /// not be salvaged (`cvol check --repair`): reads fail (EIO) until the
    /// block is written or trimmed again. Written only by repair.
    Lost,
    /// Points at a DATA record.
    Data {
        codec: CodecTag,
        offset: u64,
        len: u32,
        /// A dedup reference: the record may belong to another LBA.
        shared: bool,
        /// The record is a multi-block unit; crc is the record's xor the
        /// block's index in it.
        unit: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MapEntry {
    pub loc: u64,
    pub crc: u32,
}

impl MapEntry {
    pub const UNMAPPED: MapEntry = MapEntry { loc: 0, crc: 0 };
    pub const ZERO: MapEntry = MapEntry {
        loc: 1 << STATE_SHIFT,
        crc: 0,
    };
    pub const LOST: MapEntry = MapEntry {
        loc: STATE_LOST << STATE_SHIFT,
        crc: 0,
    };

    pub fn data(codec: CodecTag, offset: u64, len: u32, crc: u32) -> MapEntry {
        assert!(offset <= OFFSET_MASK, "offset beyond 8 TiB");
        assert!(u64::from(len) <= LEN_MASK && len as usize >= record::RECORD_HEADER_BYTES);
        let state = 2 + codec as u64;
        MapEntry {
            loc: (state << STATE_SHIFT) | (u64::from(len) << OFFSET_BITS) | offset,
            crc,
        }
    }

    /// The same record, referenced from an LBA its header may not name.
    pub fn data_ref(codec: CodecTag, offset: u64, len: u32, crc: u32) -> MapEntry {
        let e = MapEntry::data(codec, offset, len, crc);
        MapEntry {
            loc: e.loc + (3 << STATE_SHIFT),
            crc,
        }
    }

    /// Block `k` of the multi-block record (crc `record_crc`) at `offset`.
    pub fn unit(codec: CodecTag, offset: u64, len: u32, record_crc: u32, k: u32) -> MapEntry {
        assert!(k < record::UNIT_BLOCKS_MAX, "block {k} of a unit");
        let e = MapEntry::data(codec, offset, len, record_crc ^ k);
        MapEntry {
            loc: e.loc + (6 << STATE_SHIFT),
            crc: e.crc,
        }
    }

    /// This entry (data) as a ref entry to the same block of the same record.
    pub fn as_ref_entry(&self) -> MapEntry {
        match self.state_valid() {
            EntryState::Data { shared: true, .. } => *self,
            EntryState::Data { .. } => MapEntry {
                loc: self.loc + (3 << STATE_SHIFT),
                crc: self.crc,
            },
            _ => panic!("as_ref_entry of a non-data entry"),
        }
    }

    /// This entry (data) in owner form (the inverse of `as_ref_entry`).
    pub fn as_owner_entry(&self) -> MapEntry {
        match self.state_valid() {
            EntryState::Data { shared: true, .. } => MapEntry {
                loc: self.loc - (3 << STATE_SHIFT),
                crc: self.crc,
            },
            EntryState::Data { .. } => *self,
            _ => panic!("as_owner_entry of a non-data entry"),
        }
    }

    /// The block index this entry names in the record whose crc is `record_crc`.
    pub fn block_in(&self, record_crc: u32) -> u32 {
        self.crc ^ record_crc
    }

    /// Both entries name the same block of the same record (owner or ref
    /// form alike).
    pub fn same_record(&self, other: &MapEntry) -> bool {
        self.crc == other.crc && self.same_location(other)
    }

    /// Both entries point at the record at the same place (any block of it).
    pub fn same_location(&self, other: &MapEntry) -> bool {
        self.loc & (OFFSET_MASK | (LEN_MASK << OFFSET_BITS))
            == other.loc & (OFFSET_MASK | (LEN_MASK << OFFSET_BITS))
            && matches!(self.state(), Ok(EntryState::Data { .. }))
            && matches!(other.state(), Ok(EntryState::Data { .. }))
    }

    pub fn state(&self) -> Result<EntryState, FormatError> {
        let offset = self.loc & OFFSET_MASK;
        let len = ((self.loc >> OFFSET_BITS) & LEN_MASK) as u32;
        match self.loc >> STATE_SHIFT {
            0 | 1 | STATE_LOST if offset != 0 || len != 0 || self.crc != 0 => {
                Err(FormatError::Invalid("map entry"))
            }
            0 => Ok(EntryState::Unmapped),
            1 => Ok(EntryState::Zero),
            STATE_LOST => Ok(EntryState::Lost),
            s @ 2..=13 => {
                if (len as usize) < record::RECORD_HEADER_BYTES {
                    return Err(FormatError::Invalid("map entry length"));
                }
                let form = (s - 2) / 3;
                let codec = CodecTag::from_u8(((s - 2) % 3) as u8)?;
                Ok(EntryState::Data {
                    codec,
                    offset,
                    len,
                    shared: form % 2 == 1,
                    unit: form >= 2,
                })
            }
            _ => Err(FormatError::Invalid("map entry state")),
        }
    }

    /// An owner entry of (a block of) the unit whose record is at
    /// `offset` (a fast test on the raw bits: unit windows are scanned on
    /// every change of a unit block).
    pub fn is_unit_owner_of(&self, offset: u64) -> bool {
        self.loc & OFFSET_MASK == offset && matches!(self.loc >> STATE_SHIFT, 8..=10)
    }

    /// A ref entry to (a block of) the unit whose record is at `offset`.
    pub fn is_unit_ref_of(&self, offset: u64) -> bool {
        self.loc & OFFSET_MASK == offset && matches!(self.loc >> STATE_SHIFT, 11..=13)
    }

    /// The record offset of a ref entry (a dedup reference, of a single
    /// block or into a unit), None for any other entry.
    pub fn ref_offset(&self) -> Option<u64> {
        matches!(self.loc >> STATE_SHIFT, 5..=7 | 11..=13).then_some(self.loc & OFFSET_MASK)
    }

    /// State of an entry known valid (in-memory map). Panics on a corrupt entry.
    pub fn state_valid(&self) -> EntryState {
        self.state().expect("in-memory map entry is valid")
    }

    pub fn is_unmapped(&self) -> bool {
        self.loc == 0
    }

    pub fn encode(&self, out: &mut [u8]) {
        put_u64(out, 0, self.loc);
        put_u32(out, 8, self.crc);
    }

    pub fn decode(b: &[u8]) -> Result<MapEntry, FormatError> {
        need(b, MAP_ENTRY_BYTES)?;
        let e = MapEntry {
            loc: get_u64(b, 0),
            crc: get_u32(b, 8),
        };
        e.state()?;
        Ok(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_owner_and_ref_tests_match_the_state() {
        let owner = MapEntry::unit(CodecTag::Lz4, 1 << 20, 300, 7, 2);
        let refe = owner.as_ref_entry();
        let single = MapEntry::data(CodecTag::Lz4, 1 << 20, 300, 7);
        assert!(owner.is_unit_owner_of(1 << 20) && !owner.is_unit_ref_of(1 << 20));
        assert!(refe.is_unit_ref_of(1 << 20) && !refe.is_unit_owner_of(1 << 20));
        assert!(!owner.is_unit_owner_of((1 << 20) + 1));
        for e in [
            single,
            single.as_ref_entry(),
            MapEntry::ZERO,
            MapEntry::UNMAPPED,
        ] {
            assert!(!e.is_unit_owner_of(1 << 20) && !e.is_unit_ref_of(1 << 20));
            assert!(!e.is_unit_owner_of(0) && !e.is_unit_ref_of(0));
        }
    }

    #[test]
    fn states_roundtrip() {
        assert_eq!(MapEntry::UNMAPPED.state().unwrap(), EntryState::Unmapped);
        assert_eq!(MapEntry::ZERO.state().unwrap(), EntryState::Zero);
        assert_eq!(MapEntry::LOST.state().unwrap(), EntryState::Lost);
        let mut lb = [0u8; MAP_ENTRY_BYTES];
        MapEntry::LOST.encode(&mut lb);
        assert_eq!(MapEntry::decode(&lb).unwrap(), MapEntry::LOST);
        for codec in CodecTag::ALL {
            let e = MapEntry::data(codec, (1 << 43) - 1, 4140, 0x1234_5678);
            assert_eq!(
                e.state().unwrap(),
                EntryState::Data {
                    codec,
                    offset: (1 << 43) - 1,
                    len: 4140,
                    shared: false,
                    unit: false,
                }
            );
            let mut b = [0u8; MAP_ENTRY_BYTES];
            e.encode(&mut b);
            assert_eq!(MapEntry::decode(&b).unwrap(), e);
            let r = e.as_ref_entry();
            assert_eq!(
                r.state().unwrap(),
                EntryState::Data {
                    codec,
                    offset: (1 << 43) - 1,
                    len: 4140,
                    shared: true,
                    unit: false,
                }
            );
            assert!(r.same_record(&e) && e.same_record(&r) && r != e);
            r.encode(&mut b);
            assert_eq!(MapEntry::decode(&b).unwrap(), r);
            for k in [0, 1, 15] {
                let u = MapEntry::unit(codec, 4096, 30_000, 0xabcd_0000, k);
                let want = |shared| EntryState::Data {
                    codec,
                    offset: 4096,
                    len: 30_000,
                    shared,
                    unit: true,
                };
                assert_eq!(u.state().unwrap(), want(false));
                assert_eq!(u.block_in(0xabcd_0000), k);
                let ur = u.as_ref_entry();
                assert_eq!(ur.state().unwrap(), want(true));
                assert_eq!(ur.as_ref_entry(), ur);
                assert_eq!(ur.as_owner_entry(), u);
                assert_eq!(u.as_owner_entry(), u);
                assert!(ur.same_record(&u) && ur.block_in(0xabcd_0000) == k);
                ur.encode(&mut b);
                assert_eq!(MapEntry::decode(&b).unwrap(), ur);
                let other = MapEntry::unit(codec, 4096, 30_000, 0xabcd_0000, (k + 1) % 16);
                assert!(!other.same_record(&u) && other.same_location(&u));
            }
        }
    }

    #[test]
    fn invalid_states_rejected() {
        assert!(MapEntry {
            loc: 15 << STATE_SHIFT,
            crc: 0
        }
        .state()
        .is_err());
        assert!(MapEntry {
            loc: (STATE_LOST << STATE_SHIFT) | 4096,
            crc: 0
        }
        .state()
        .is_err());
        assert!(MapEntry { loc: 7, crc: 0 }.state().is_err());
        assert!(MapEntry {
            loc: (2 << STATE_SHIFT) | 100,
            crc: 0
        }
        .state()
        .is_err());
    }
}
