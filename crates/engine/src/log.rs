//! The log head: the open segment's buffer, record placement, write-behind
//! and the flush padding rule (no durable sector is ever written twice).
//!
//! A volume with a metadata device has two heads drawing seqs from one
//! counter: map records and checkpoint commits (`Shape::is_meta`) go to
//! the metadata head, in the metadata region's segments; everything else
//! to the data head. Without one, every record goes to the data head.
use crate::error::VolError;
use crate::segments::{Region, SegState, SegmentTable};
use cvol_format::record::{RecordHeader, RecordKind, RECORD_HEADER_BYTES, RECORD_MAX_BYTES};
use cvol_format::record::{REF_PAYLOAD_BYTES, SYNCED_PAYLOAD_BYTES, UNIT_BLOCKS_MAX};
use cvol_format::seal::{Sealer, SEAL_AAD_BYTES, SEAL_TAG_BYTES};
use cvol_format::superblock::Packing;
use cvol_format::{align_up, CodecTag, Superblock, SECTOR_SIZE_BYTES};
use cvol_storage::Storage;
use std::sync::Arc;

pub mod pack;
mod segbuf;
use segbuf::SegBuf;

/// A client write that leaves this many unwritten full sectors in the
/// data head (or an eighth of a segment, if less) claims them and writes
/// them behind after it drops the state lock ([`Log::claim_write_behind`]),
/// so the copy to storage does not hold every other request up.
const WRITE_BEHIND_BYTES: usize = 512 << 10;
/// Appends that leave this many (a large commit, background work that
/// claims nothing) write them behind at once, under the lock.
const WRITE_BEHIND_LOCKED_BYTES: usize = 4 << 20;

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

    /// Does this record go to the metadata head (when there is one)?
    pub fn is_meta(&self) -> bool {
        matches!(
            self.kind,
            RecordKind::MapChunk
                | RecordKind::MapDir
                | RecordKind::MapTable
                | RecordKind::CkptCommit
        )
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

/// One head of the log: its open segment and that segment's buffer.
pub struct Head {
    /// Current (open) segment.
    pub segment: u64,
    /// Bytes of the open segment in use (records and padding).
    pub fill: usize,
    /// Bytes of the open segment already handed to storage, or claimed by
    /// a write-behind that runs outside the state lock.
    pub written: usize,
    /// The open segment's bytes; reads of records in it are served from
    /// here. Shared with the write-behinds of its claimed ranges.
    pub buf: Arc<SegBuf>,
    /// Bytes of the open segment known to be written on the store (the
    /// records and the zeros `Log::zero_ahead` wrote past them): writes
    /// below it land on space the host already holds.
    pub prepared: usize,
}

impl Head {
    fn new(segment: u64, fill: usize, segment_size: u64) -> Head {
        Head {
            segment,
            fill,
            written: fill,
            buf: Arc::new(SegBuf::new(segment_size as usize)),
            prepared: fill,
        }
    }

    /// Takes `bytes` (the open segment read whole) as the buffer, its
    /// first `end` bytes kept, at open (no write-behind can run yet).
    pub fn adopt(&mut self, bytes: Vec<u8>, end: usize) {
        assert!(end <= self.fill && bytes.len() == self.buf.len());
        self.buf = Arc::new(SegBuf::from_bytes(bytes, end));
    }

    /// The whole buffer, to load the open segment's bytes at open (no
    /// write-behind can run yet).
    pub fn buf_mut(&mut self) -> &mut [u8] {
        Arc::get_mut(&mut self.buf)
            .expect("no write-behind before the volume is open")
            .as_mut_slice()
    }

    /// Waits for the write-behinds of this head's segment: after it, every
    /// claimed byte is on storage (or the volume has an I/O error).
    fn wait_written(&self) -> Result<(), VolError> {
        match self.buf.wait_idle() {
            true => Ok(()),
            false => Err(VolError::Io(std::io::Error::other(
                "a write-behind of the open segment failed",
            ))),
        }
    }
}

/// A range of the open segment claimed under the state lock, to be copied
/// to storage after the lock is dropped ([`WriteBehind::run`]).
#[must_use = "a claimed range must be written, or seal and flush wait forever"]
pub struct WriteBehind {
    buf: Arc<SegBuf>,
    offset: u64,
    at: usize,
    len: usize,
}

impl WriteBehind {
    /// Writes the claimed range; an error marks the segment failed (the
    /// next seal or flush of it reports it) and is returned.
    pub fn run(self, storage: &dyn Storage) -> Result<(), VolError> {
        let r = storage.write_at(self.offset, self.buf.bytes(self.at, self.len));
        self.buf.end(r.is_ok());
        r.map_err(VolError::Io)
    }
}

pub struct Log {
    pub segment_size: u64,
    pub data_offset: u64,
    pub volume_tag: u32,
    /// Usage and state of every segment.
    pub segments: SegmentTable,
    /// The data head (every record without a metadata device).
    pub head: Head,
    /// The metadata head, on a volume with a metadata device.
    pub meta: Option<Head>,
    pub epoch: u32,
    pub next_seq: u64,
    /// Bytes handed to storage by the log since open (write amplification).
    pub media_bytes_written: u64,
    /// Bytes appended (records and padding) since open; only grows.
    pub appended_bytes: u64,
    /// Of those, bytes no record holds: flush padding to a sector, page
    /// padding (`Packing::Page*`) and the tails of segments sealed before
    /// they were full.
    pub padding_bytes: u64,
    /// How DATA records are placed (the superblock's).
    pub packing: Packing,
    /// Bytes of zeros a flush writes past the data head when what it has
    /// prepared there runs short (0: none): see `prepare_ahead`.
    pub zero_ahead: usize,
    /// Zero bytes written that way since open (also in `media_bytes_written`).
    pub zero_ahead_bytes: u64,
    /// Where the data head was padded last (segment, fill).
    padded_at: (u64, usize),
    /// The data key of an encrypted volume: every record is sealed.
    seal: Option<Arc<Sealer>>,
}

impl Log {
    /// Bytes of the open segments' buffers (data, metadata).
    pub fn buffer_bytes(&self) -> u64 {
        let meta = self.meta.as_ref().map_or(0, |h| h.buf.len());
        (self.head.buf.len() + meta) as u64
    }

    /// The segments the heads write into now (data, metadata).
    pub fn head_segments(&self) -> [Option<u64>; 2] {
        [
            Some(self.head.segment),
            self.meta.as_ref().map(|h| h.segment),
        ]
    }

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
        assert_eq!(segments.region(segment), Region::Data);
        Log {
            segment_size: sb.segment_size_bytes,
            data_offset: sb.data_offset_bytes,
            volume_tag: sb.volume_tag(),
            segments,
            head: Head::new(segment, fill, sb.segment_size_bytes),
            // Opened by the first metadata record (`head_for`).
            meta: None,
            epoch,
            next_seq,
            media_bytes_written: 0,
            appended_bytes: 0,
            padding_bytes: 0,
            packing: sb.packing(),
            zero_ahead: 0,
            zero_ahead_bytes: 0,
            padded_at: (segment, fill),
            seal: sb.seal.clone(),
        }
    }

    /// Bytes a record takes beyond its payload in the clear: the header,
    /// and the AEAD tag on an encrypted volume.
    pub fn record_overhead(&self) -> usize {
        RECORD_HEADER_BYTES + self.seal.as_ref().map_or(0, |_| SEAL_TAG_BYTES)
    }

    /// The volume offset of the data head's segment.
    pub fn segment_base(&self) -> u64 {
        self.base_of(self.head.segment)
    }

    fn base_of(&self, segment: u64) -> u64 {
        self.data_offset + segment * self.segment_size
    }

    pub fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }

    /// The data head's position: where the next data record goes.
    pub fn data_position(&self) -> (u64, usize) {
        (self.head.segment, self.head.fill)
    }

    /// The metadata head's position, if it has one open.
    pub fn meta_position(&self) -> Option<(u64, usize)> {
        self.meta.as_ref().map(|m| (m.segment, m.fill))
    }

    /// Log bytes still available for data records: free data segments and
    /// the data head's rest (every record's, without a metadata device).
    pub fn free_bytes(&self) -> u64 {
        self.segments.free_count() * self.segment_size + (self.segment_size - self.head.fill as u64)
    }

    /// Log bytes still available for map records and commits: the data
    /// log's without a metadata device.
    pub fn meta_free_bytes(&self) -> u64 {
        if !self.segments.has_meta() {
            return self.free_bytes();
        }
        let rest = self
            .meta
            .as_ref()
            .map_or(0, |m| self.segment_size - m.fill as u64);
        self.segments.free_in(Region::Meta) * self.segment_size + rest
    }

    /// Data log bytes occupied (live and dead records, padding, abandoned tails).
    pub fn used_bytes(&self) -> u64 {
        let n = self.segments.range(Region::Data).end;
        let others = n - self.segments.free_count() - 1;
        others * self.segment_size + self.head.fill as u64
    }

    /// Metadata device bytes occupied (0 without one).
    pub fn meta_used_bytes(&self) -> u64 {
        let r = self.segments.range(Region::Meta);
        let open = u64::from(self.meta.is_some());
        let sealed = (r.end - r.start) - self.segments.free_in(Region::Meta) - open;
        sealed * self.segment_size + self.meta.as_ref().map_or(0, |m| m.fill as u64)
    }

    /// The head `shape` goes to, with room for `total` bytes: the data head,
    /// or the metadata head (opened or advanced here). NoSpace when its
    /// region has no free segment left.
    fn head_for(
        &mut self,
        storage: &dyn Storage,
        shape: &Shape,
        total: usize,
    ) -> Result<Region, VolError> {
        let r = match shape.is_meta() && self.segments.has_meta() {
            true => Region::Meta,
            false => Region::Data,
        };
        if r == Region::Meta && self.meta.is_none() {
            let s = self
                .segments
                .open_next_in(Region::Meta)
                .ok_or(VolError::NoSpace)?;
            self.meta = Some(Head::new(s, 0, self.segment_size));
        }
        if self.head_mut(r).fill + total > self.segment_size as usize {
            self.advance_segment(storage, r)?;
        }
        Ok(r)
    }

    fn head_mut(&mut self, r: Region) -> &mut Head {
        match r {
            Region::Data => &mut self.head,
            Region::Meta => self.meta.as_mut().expect("the metadata head is open"),
        }
    }

    /// Appends one record (`payload_crc` = crc32c of `payload`, computed by
    /// the caller, possibly earlier and outside every lock; unused on an
    /// encrypted volume, which seals the payload here) and returns where
    /// it landed. Opens the next free segment when the record does not fit
    /// in its head's open one; NoSpace when there is none.
    pub fn append(
        &mut self,
        storage: &dyn Storage,
        shape: Shape,
        payload: &[u8],
        payload_crc: u32,
    ) -> Result<Placed, VolError> {
        shape.assert_valid(payload.len());
        // (A sealed payload's crc is taken here, of the sealed bytes.)
        debug_assert!(self.seal.is_some() || payload_crc == crc32c::crc32c(payload));
        let sealed_len = payload.len() + self.seal.as_ref().map_or(0, |_| SEAL_TAG_BYTES);
        let total = RECORD_HEADER_BYTES + sealed_len;
        assert!(
            total as u64 <= self.segment_size,
            "record larger than a segment"
        );
        let r = self.head_for(storage, &shape, total)?;
        if shape.kind == RecordKind::Data {
            self.place_in_page(storage, r, total)?;
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
            payload_len: sealed_len as u32,
            crc: 0,
            sealed: self.seal.is_some(),
        };
        let seal = self.seal.clone();
        let head = self.head_mut(r);
        let at = head.fill;
        let payload_crc = match seal {
            // On an encrypted volume the payload is sealed in place, once
            // its seq (the nonce) and header (the associated data) are known.
            Some(s) => {
                let aad = h.encode_with_crc(0);
                let (epoch, seq) = (h.epoch, h.seq);
                head.buf
                    .fill_with(at + RECORD_HEADER_BYTES, sealed_len, |out| {
                        s.seal_record(&aad[..SEAL_AAD_BYTES], epoch, seq, payload, out);
                        crc32c::crc32c(out)
                    })
            }
            None => {
                head.buf.put(at + RECORD_HEADER_BYTES, payload);
                payload_crc
            }
        };
        let hb = h.encode_with_crc(payload_crc);
        // What the log writes, recovery reads back as the same header.
        debug_assert_eq!(RecordHeader::decode(&hb), Ok(h));
        head.buf.put(at, &hb);
        head.fill += total;
        let segment = head.segment;
        self.appended_bytes += total as u64;
        self.segments.note_seq(segment, h.seq);
        self.next_seq += 1;
        let placed = Placed {
            offset: self.base_of(segment) + at as u64,
            len: total as u32,
            crc: h.crc,
            seq: h.seq,
        };
        self.write_behind(storage, r)?;
        self.assert_head();
        Ok(placed)
    }

    /// Page packing: moves head `r` to where a DATA record of `total`
    /// bytes goes (`Packing::place`; the next segment if that is past the
    /// open one's end), zeroing the gap. Compact packing: nothing to do.
    fn place_in_page(
        &mut self,
        storage: &dyn Storage,
        r: Region,
        total: usize,
    ) -> Result<(), VolError> {
        let packing = self.packing;
        let fill = self.head_mut(r).fill;
        let at = packing.place(fill as u64, total as u64) as usize;
        if at == fill {
            return Ok(());
        }
        if at + total > self.segment_size as usize {
            // A fresh segment starts at a page boundary.
            return self.advance_segment(storage, r);
        }
        let head = self.head_mut(r);
        assert!(
            head.written <= fill,
            "padding only bytes not yet handed out"
        );
        head.buf.zero(fill, at); // may hold an earlier segment's bytes
        head.fill = at;
        let pad = (at - fill) as u64;
        self.appended_bytes += pad;
        self.padding_bytes += pad;
        Ok(())
    }

    /// The log heads' invariants: each open segment Open and in its
    /// region, its fill within it, and only whole filled bytes handed to
    /// storage.
    fn assert_head(&self) {
        let heads = std::iter::once((&self.head, Region::Data))
            .chain(self.meta.as_ref().map(|m| (m, Region::Meta)));
        for (h, r) in heads {
            assert_eq!(self.segments.state(h.segment), SegState::Open);
            assert_eq!(self.segments.region(h.segment), r);
            assert!(h.written <= h.fill && h.fill as u64 <= self.segment_size);
            assert!(h.fill <= h.buf.len());
        }
    }

    fn write_range(
        &mut self,
        storage: &dyn Storage,
        r: Region,
        end: usize,
    ) -> Result<(), VolError> {
        let (size, data_offset) = (self.segment_size, self.data_offset);
        let head = self.head_mut(r);
        if end > head.written {
            let base = data_offset + head.segment * size;
            let bytes = head.buf.bytes(head.written, end - head.written);
            storage
                .write_at(base + head.written as u64, bytes)
                .map_err(VolError::Io)?;
            let n = (end - head.written) as u64;
            head.written = end;
            self.media_bytes_written += n;
        }
        Ok(())
    }

    fn write_behind(&mut self, storage: &dyn Storage, r: Region) -> Result<(), VolError> {
        let head = self.head_mut(r);
        let full = head.fill - head.fill % SECTOR_SIZE_BYTES as usize;
        if full - head.written >= WRITE_BEHIND_LOCKED_BYTES {
            self.write_range(storage, r, full)?;
        }
        Ok(())
    }

    /// Claims the data head's unwritten full sectors if there are at least
    /// `WRITE_BEHIND_BYTES` of them: the caller writes them with
    /// [`WriteBehind::run`] once it has dropped the state lock. A seal or a
    /// flush of the segment waits for the claimed writes to finish.
    pub fn claim_write_behind(&mut self) -> Option<WriteBehind> {
        let base = self.base_of(self.head.segment);
        let head = &mut self.head;
        let full = head.fill - head.fill % SECTOR_SIZE_BYTES as usize;
        if full - head.written < WRITE_BEHIND_BYTES.min(self.segment_size as usize / 8) {
            return None;
        }
        head.buf.begin();
        let claim = WriteBehind {
            buf: Arc::clone(&head.buf),
            offset: base + head.written as u64,
            at: head.written,
            len: full - head.written,
        };
        self.media_bytes_written += claim.len as u64;
        head.written = full;
        Some(claim)
    }

    /// Pads each head's open segment to a sector boundary and hands every
    /// byte to storage. After the caller's `sync`, everything appended is
    /// durable and the next record starts in a fresh sector. A head with
    /// nothing unwritten is left as it is.
    pub fn pad_and_write(&mut self, storage: &dyn Storage) -> Result<(), VolError> {
        self.pad_head(storage, Region::Data)?;
        if self.meta.as_ref().is_some_and(|m| m.fill > m.written) {
            self.pad_head(storage, Region::Meta)?;
        }
        self.assert_head();
        Ok(())
    }

    fn pad_head(&mut self, storage: &dyn Storage, r: Region) -> Result<(), VolError> {
        let size = self.segment_size as usize;
        let head = self.head_mut(r);
        let padded = (align_up(head.fill as u64, SECTOR_SIZE_BYTES) as usize).min(size);
        let pad = (padded - head.fill) as u64;
        head.buf.zero(head.fill, padded); // may hold an earlier segment's bytes
        head.fill = padded;
        self.appended_bytes += pad;
        self.padding_bytes += pad;
        self.write_range(storage, r, padded)?;
        let head = self.head_mut(r);
        head.wait_written()?;
        assert!(head.written == head.fill && (head.fill as u64).is_multiple_of(SECTOR_SIZE_BYTES));
        head.prepared = head.prepared.max(head.written);
        if r == Region::Data {
            self.prepare_ahead(storage);
        }
        Ok(())
    }

    /// Writes zeros past the data head, up to the next multiple of
    /// `zero_ahead` at least `zero_ahead` on, when less than half of that
    /// is prepared and the head moved less than a quarter of it since the
    /// last pad (flushes come often: a rare one, after megabytes of
    /// writes, would only add zeros). The flushes that follow then write
    /// their records over space the host holds: a sync of a file whose
    /// blocks were allocated since the last one also writes its allocation
    /// metadata (twice the latency and CPU of a sync of overwritten blocks
    /// on ext4), and a log that pads every flush to a sector would
    /// allocate a block every few flushes.
    /// The zeros lie past every record, in a segment opened free, so they
    /// only replace bytes no record needs: recovery stops at them as it
    /// stops at a hole (docs/FORMAT.md "Zeros ahead of the head").
    fn prepare_ahead(&mut self, storage: &dyn Storage) {
        static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
        let (chunk, size) = (self.zero_ahead, self.segment_size as usize);
        let (fill, prepared) = (self.head.fill, self.head.prepared);
        let last = std::mem::replace(&mut self.padded_at, (self.head.segment, fill));
        // (The head may have come back to the segment since, lower in it.)
        let often =
            last.0 == self.head.segment && fill.checked_sub(last.1).is_some_and(|d| d < chunk / 4);
        if chunk == 0 || fill >= size || prepared >= fill + chunk / 2 || !often {
            return;
        }
        let base = self.base_of(self.head.segment);
        let end = ((fill + chunk).div_ceil(chunk) * chunk).min(size);
        let mut at = prepared.max(fill);
        while at < end {
            let n = (end - at).min(ZEROS.len());
            if let Err(e) = storage.write_at(base + at as u64, &ZEROS[..n]) {
                // Only an optimization failed (a full host file system,
                // say): the bytes past the head matter to no one, whatever
                // part landed. No more zeros until the volume is reopened;
                // the flush goes on, and its own writes report real errors.
                tracing::warn!(error = %e, "zeros ahead of the log head not written; not trying again until reopened");
                self.zero_ahead = 0;
                break;
            }
            self.media_bytes_written += n as u64;
            self.zero_ahead_bytes += n as u64;
            at += n;
            self.head.prepared = at;
        }
    }

    fn advance_segment(&mut self, storage: &dyn Storage, r: Region) -> Result<(), VolError> {
        if self.segments.free_in(r) == 0 {
            return Err(VolError::NoSpace);
        }
        let fill = self.head_mut(r).fill;
        self.write_range(storage, r, fill)?;
        // Sealed, the segment is read from storage: its claimed ranges
        // must be there, and the buffer is reused for the next one.
        self.head_mut(r).wait_written()?;
        self.appended_bytes += self.segment_size - fill as u64;
        self.padding_bytes += self.segment_size - fill as u64;
        let old = self.head_mut(r).segment;
        self.segments.seal(old);
        let next = self
            .segments
            .open_next_in(r)
            .expect("a free segment was counted");
        assert_eq!(self.segments.state(next), SegState::Open);
        // No zeroing of `buf`: only appended records and the zeroed padding
        // of `pad_and_write` are ever written out or read back.
        let head = self.head_mut(r);
        head.segment = next;
        head.fill = 0;
        head.written = 0;
        head.prepared = 0;
        Ok(())
    }

    /// The bytes of a record in an open segment, if it lies there.
    pub fn buffered(&self, offset: u64, len: usize) -> Option<&[u8]> {
        let heads = std::iter::once(&self.head).chain(self.meta.as_ref());
        heads.into_iter().find_map(|h| {
            let base = self.base_of(h.segment);
            (offset >= base && offset + len as u64 <= base + h.fill as u64)
                .then(|| h.buf.bytes((offset - base) as usize, len))
        })
    }
}
