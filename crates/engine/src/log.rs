//! The log head: the open segment's buffer, record placement, write-behind
//! and the flush padding rule (no durable sector is ever written twice).
use crate::error::VolError;
use crate::segments::{SegState, SegmentTable};
use cvol_format::record::{RecordHeader, RecordKind, RECORD_HEADER_BYTES, RECORD_MAX_BYTES};
use cvol_format::record::{REF_PAYLOAD_BYTES, SYNCED_PAYLOAD_BYTES, UNIT_BLOCKS_MAX};
use cvol_format::{align_up, CodecTag, Superblock, SECTOR_SIZE_BYTES};
use cvol_storage::Storage;

/// Unwritten full sectors beyond this are written behind, before any flush.
const WRITE_BEHIND_BYTES: usize = 1 << 20;

/// The header fields of a record to append (the log fills in the rest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub kind: RecordKind,
    pub codec: CodecTag,
    pub level: u8,
    pub lba: u64,
    pub nblocks: u32,
    pub mask: u16,
}

impl Shape {
    /// A DATA record of `nblocks` from `lba` (a unit when more than one),
    /// mapping the blocks of `mask`.
    pub fn data(codec: CodecTag, level: u8, lba: u64, nblocks: u32, mask: u16) -> Shape {
        Shape {
            kind: RecordKind::Data,
            codec,
            level,
            lba,
            nblocks,
            mask,
        }
    }

    /// A ZERO or TRIM record over `nblocks` from `lba` (no payload).
    pub fn range(kind: RecordKind, lba: u64, nblocks: u32) -> Shape {
        assert!(matches!(kind, RecordKind::Zero | RecordKind::Trim));
        Shape::meta(kind, CodecTag::None).at(lba, nblocks)
    }

    /// A REF record for `lba` (its payload: the ref entry).
    pub fn reference(lba: u64) -> Shape {
        Shape::meta(RecordKind::Ref, CodecTag::None).at(lba, 1)
    }

    /// A record that covers no blocks: EPOCH, SYNCED, MAP_CHUNK, CKPT_COMMIT.
    pub fn meta(kind: RecordKind, codec: CodecTag) -> Shape {
        Shape {
            kind,
            codec,
            level: 0,
            lba: 0,
            nblocks: 0,
            mask: 0,
        }
    }

    /// A MAP_CHUNK of the paged map's page starting at `lba`, a MAP_DIR of
    /// the directory block starting at `lba`, or a MAP_TABLE of the
    /// directory slot `lba / MAP_PAGE_BLOCKS` (lz4 payloads; they map no
    /// block: the lba only names the page, block or table, for scans).
    pub fn map_meta(kind: RecordKind, lba: u64) -> Shape {
        assert!(matches!(
            kind,
            RecordKind::MapChunk | RecordKind::MapDir | RecordKind::MapTable
        ));
        Shape::meta(kind, CodecTag::Lz4).at(lba, 0)
    }

    fn at(self, lba: u64, nblocks: u32) -> Shape {
        Shape {
            lba,
            nblocks,
            ..self
        }
    }

    /// Checks the shape the way recovery will (`RecordHeader::decode`), so
    /// that nothing is appended that roll-forward would refuse.
    fn assert_valid(&self, payload_len: usize) {
        let total = RECORD_HEADER_BYTES + payload_len;
        match self.kind {
            RecordKind::Data => {
                assert!((1..=UNIT_BLOCKS_MAX).contains(&self.nblocks) && payload_len > 0);
                assert!(total <= RECORD_MAX_BYTES, "DATA record of {total} bytes");
                assert!(self.nblocks > 1 || self.mask == 0, "mask of a single block");
                assert!(
                    u32::from(self.mask) >> self.nblocks == 0,
                    "mask beyond the unit"
                );
            }
            RecordKind::Zero | RecordKind::Trim => {
                assert!(payload_len == 0 && self.nblocks > 0 && self.mask == 0);
            }
            RecordKind::Ref => assert!(payload_len == REF_PAYLOAD_BYTES && self.nblocks == 1),
            RecordKind::Synced => assert!(payload_len == SYNCED_PAYLOAD_BYTES),
            RecordKind::Epoch => assert!(payload_len == 0),
            RecordKind::MapChunk | RecordKind::CkptCommit => assert!(payload_len > 0),
            RecordKind::MapDir | RecordKind::MapTable => {}
        }
        if self.kind != RecordKind::Data {
            assert!(
                self.mask == 0 && self.level == 0,
                "{:?} with a level or mask",
                self.kind
            );
        }
        if matches!(
            self.kind,
            RecordKind::Epoch | RecordKind::Synced | RecordKind::CkptCommit
        ) {
            assert!(self.lba == 0, "{:?} names no block", self.kind);
        }
        if matches!(
            self.kind,
            RecordKind::Epoch
                | RecordKind::Synced
                | RecordKind::MapChunk
                | RecordKind::MapDir
                | RecordKind::MapTable
                | RecordKind::CkptCommit
        ) {
            assert!(self.nblocks == 0, "{:?} covers no blocks", self.kind);
        }
    }
}

/// Where a record landed.
#[derive(Debug, Clone, Copy)]
pub struct Placed {
    pub offset: u64,
    pub len: u32,
    pub crc: u32,
    pub seq: u64,
}

pub struct Log {
    pub segment_size: u64,
    pub data_offset: u64,
    pub volume_tag: u32,
    /// Usage and state of every segment.
    pub segments: SegmentTable,
    /// Current (open) segment.
    pub segment: u64,
    /// Bytes of the open segment in use (records and padding).
    pub fill: usize,
    /// Bytes of the open segment already handed to storage.
    pub written: usize,
    /// The open segment's bytes; reads of records in it are served from here.
    pub buf: Vec<u8>,
    pub epoch: u32,
    pub next_seq: u64,
    /// Bytes handed to storage by the log since open (write amplification).
    pub media_bytes_written: u64,
    /// Bytes appended (records and padding) since open; only grows.
    pub appended_bytes: u64,
}

impl Log {
    /// A log head at `fill` bytes into `segment`, which `segments` has Open.
    pub fn new(
        sb: &Superblock,
        segments: SegmentTable,
        segment: u64,
        fill: usize,
        epoch: u32,
        next_seq: u64,
    ) -> Log {
        assert!(segment < sb.segment_count());
        assert_eq!(segments.state(segment), SegState::Open);
        assert!(
            fill as u64 <= sb.segment_size_bytes && (fill as u64).is_multiple_of(SECTOR_SIZE_BYTES)
        );
        Log {
            segment_size: sb.segment_size_bytes,
            data_offset: sb.data_offset_bytes,
            volume_tag: sb.volume_tag(),
            segments,
            segment,
            fill,
            written: fill,
            buf: vec![0u8; sb.segment_size_bytes as usize],
            epoch,
            next_seq,
            media_bytes_written: 0,
            appended_bytes: 0,
        }
    }

    pub fn segment_base(&self) -> u64 {
        self.data_offset + self.segment * self.segment_size
    }

    pub fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }

    /// Log bytes still available for records: free segments and the open one's rest.
    pub fn free_bytes(&self) -> u64 {
        self.segments.free_count() * self.segment_size + (self.segment_size - self.fill as u64)
    }

    /// Log bytes occupied (live and dead records, padding, abandoned tails).
    pub fn used_bytes(&self) -> u64 {
        let others = self.segments.count() - self.segments.free_count() - 1;
        others * self.segment_size + self.fill as u64
    }

    /// Appends one record (`payload_crc` = crc32c of `payload`, computed by
    /// the caller, possibly earlier and outside every lock) and returns where
    /// it landed. Opens the next free segment when the record does not fit
    /// in the open one; NoSpace when there is none.
    pub fn append(
        &mut self,
        storage: &dyn Storage,
        shape: Shape,
        payload: &[u8],
        payload_crc: u32,
    ) -> Result<Placed, VolError> {
        shape.assert_valid(payload.len());
        debug_assert_eq!(payload_crc, crc32c::crc32c(payload));
        let total = RECORD_HEADER_BYTES + payload.len();
        assert!(
            total as u64 <= self.segment_size,
            "record larger than a segment"
        );
        if self.fill + total > self.segment_size as usize {
            self.advance_segment(storage)?;
        }
        let mut h = RecordHeader {
            kind: shape.kind,
            codec: shape.codec,
            level: shape.level,
            mask: shape.mask,
            volume_tag: self.volume_tag,
            epoch: self.epoch,
            seq: self.next_seq,
            lba: shape.lba,
            nblocks: shape.nblocks,
            payload_len: payload.len() as u32,
            crc: 0,
        };
        let hb = h.encode_with_crc(payload_crc);
        // What the log writes, recovery reads back as the same header.
        debug_assert_eq!(RecordHeader::decode(&hb), Ok(h));
        let at = self.fill;
        self.buf[at..at + RECORD_HEADER_BYTES].copy_from_slice(&hb);
        self.buf[at + RECORD_HEADER_BYTES..at + total].copy_from_slice(payload);
        self.fill += total;
        self.appended_bytes += total as u64;
        self.segments.note_seq(self.segment, h.seq);
        self.next_seq += 1;
        let placed = Placed {
            offset: self.segment_base() + at as u64,
            len: total as u32,
            crc: h.crc,
            seq: h.seq,
        };
        self.write_behind(storage)?;
        self.assert_head();
        Ok(placed)
    }

    /// The log head's invariants: the open segment is Open, its fill within
    /// it, and only whole filled bytes handed to storage.
    fn assert_head(&self) {
        assert_eq!(self.segments.state(self.segment), SegState::Open);
        assert!(self.written <= self.fill && self.fill as u64 <= self.segment_size);
        assert!(self.fill <= self.buf.len());
    }

    fn write_range(&mut self, storage: &dyn Storage, end: usize) -> Result<(), VolError> {
        if end > self.written {
            let base = self.segment_base();
            storage
                .write_at(base + self.written as u64, &self.buf[self.written..end])
                .map_err(VolError::Io)?;
            self.media_bytes_written += (end - self.written) as u64;
            self.written = end;
        }
        Ok(())
    }

    fn write_behind(&mut self, storage: &dyn Storage) -> Result<(), VolError> {
        let full = self.fill - self.fill % SECTOR_SIZE_BYTES as usize;
        if full - self.written >= WRITE_BEHIND_BYTES {
            self.write_range(storage, full)?;
        }
        Ok(())
    }

    /// Pads the open segment to a sector boundary and hands every byte to
    /// storage. After the caller's `sync`, everything appended is durable and
    /// the next record starts in a fresh sector.
    pub fn pad_and_write(&mut self, storage: &dyn Storage) -> Result<(), VolError> {
        let padded = (align_up(self.fill as u64, SECTOR_SIZE_BYTES) as usize)
            .min(self.segment_size as usize);
        self.appended_bytes += (padded - self.fill) as u64;
        self.buf[self.fill..padded].fill(0); // may hold an earlier segment's bytes
        self.fill = padded;
        self.write_range(storage, padded)?;
        assert!(self.written == self.fill && (self.fill as u64).is_multiple_of(SECTOR_SIZE_BYTES));
        self.assert_head();
        Ok(())
    }

    fn advance_segment(&mut self, storage: &dyn Storage) -> Result<(), VolError> {
        if self.segments.free_count() == 0 {
            return Err(VolError::NoSpace);
        }
        self.write_range(storage, self.fill)?;
        self.appended_bytes += self.segment_size - self.fill as u64;
        self.segments.seal(self.segment);
        self.segment = self
            .segments
            .open_next()
            .expect("a free segment was counted");
        assert_eq!(self.segments.state(self.segment), SegState::Open);
        // No zeroing of `buf`: only appended records and the zeroed padding
        // of `pad_and_write` are ever written out or read back.
        self.fill = 0;
        self.written = 0;
        Ok(())
    }

    /// The bytes of a record in the open segment, if it lies there.
    pub fn buffered(&self, offset: u64, len: usize) -> Option<&[u8]> {
        let base = self.segment_base();
        if offset >= base && offset + len as u64 <= base + self.fill as u64 {
            let at = (offset - base) as usize;
            Some(&self.buf[at..at + len])
        } else {
            None
        }
    }
}
