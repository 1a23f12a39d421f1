//! The roll-forward: from a start (a checkpoint's, or seq 1), along the
//! chain of records (seq + 1, same epoch or a newer EPOCH record) through
//! the segments written after it, applying each record to the map
//! (`roll_forward`, `Chain`, `apply`). Damaged checkpoint records a pointer
//! names are stepped over; any other gap ends the chain. Uses `scan` (whole
//! segments read) and `outcome` (`Recovered`).
use super::outcome::Recovered;
use super::scan::{read_segment, Scanned};
use crate::error::{ApplyError, RecoveryError};
use crate::logread::{check_entry_location, LogPages};
use crate::map::BlockMap;
use cvol_format::record::{RecordHeader, RecordKind, RECORD_HEADER_BYTES};
use cvol_format::seal::{self, Sealer};
use cvol_format::{
    align_up, superblock::PACKING_PAGE_BYTES, EntryState, MapEntry, Superblock, SECTOR_SIZE_BYTES,
};
use cvol_storage::Storage;
use std::collections::HashMap;

/// Most blocks one DATA record may hold (a 64 KiB compression unit).
pub(super) const DATA_UNIT_BLOCKS_MAX: u32 = cvol_format::record::UNIT_BLOCKS_MAX;

/// Position from which roll-forward starts.
pub(super) struct Start {
    pub(super) segment: u64,
    pub(super) offset: usize,
    /// The metadata head's position at the snapshot, on a volume with a
    /// metadata device (its records continue the chain there too).
    pub(super) meta: Option<(u64, usize)>,
    pub(super) expected_seq: u64,
    pub(super) epoch: u32,
    pub(super) snapshot_seq: u64,
    /// Segments holding the checkpoint's records, with their highest seq.
    pub(super) checkpoint_segments: HashMap<u64, u64>,
}

/// Roll-forward from the very first record (seq 1), if the log still has it.
pub(super) fn log_start(index: &HashMap<u64, Vec<u64>>) -> Option<Start> {
    let &segment = index.get(&1)?.first()?;
    Some(Start {
        segment,
        offset: 0,
        meta: None,
        expected_seq: 1,
        epoch: 0,
        snapshot_seq: 0,
        checkpoint_segments: HashMap::new(),
    })
}

/// The records checkpoint pointers name that roll-forward may step over
/// when damaged (`checkpoint::known_checkpoint_records`), by seq: where
/// (physical offset, length) and their epoch.
pub(super) trait KnownRecords {
    fn record(&self, seq: u64) -> Option<(u64, u32, u32)>;
}

impl KnownRecords for HashMap<u64, (u64, u32, u32)> {
    fn record(&self, seq: u64) -> Option<(u64, u32, u32)> {
        self.get(&seq).copied()
    }
}

/// Segments the cursors left that a roll-forward keeps, the newest.
const KEPT_LEFT: usize = 2;

/// Segments read whole, by segment: those a roll-forward ended in, which
/// the search for certified records beyond its end reads next
/// (`certified_beyond`).
pub(super) type ReadSegments = Vec<(u64, Vec<u8>)>;

/// Rolls forward from `start` along the chain of records (docs/FORMAT.md
/// "Recovery", step 3), applying each to `map`, until no record continues
/// the chain. The result's map is empty: the caller keeps `map`. With it,
/// the segments the chain ended in, as read.
pub(super) fn roll_forward(
    storage: &dyn Storage,
    sb: &Superblock,
    map: &mut BlockMap,
    start: Start,
    index: &HashMap<u64, Vec<u64>>,
    known: &dyn KnownRecords,
) -> Result<(Recovered, ReadSegments), RecoveryError> {
    let mut chain = Chain::new(storage, sb, &start)?;
    loop {
        // An intact record continuing the chain is taken here or at the
        // start of another segment (a checkpoint record that did not fit
        // the open segment's tail starts the next one) before a record a
        // pointer names is taken for damaged and stepped over.
        if let Some((i, at, h)) = chain.record_here() {
            chain.apply(map, i, at, &h)?;
        } else if chain.switch_segment(index)? {
            continue;
        } else if chain.at_known_checkpoint_record(known) {
            chain.step_over_known(known)?;
        } else {
            break;
        }
    }
    let mut read = std::mem::take(&mut chain.left);
    read.extend(
        (chain.cursors.iter_mut())
            .filter(|c| c.buf.len() as u64 == sb.segment_size_bytes)
            .map(|c| (c.segment, std::mem::take(&mut c.buf))),
    );
    Ok((chain.into_recovered(start.snapshot_seq), read))
}

/// Where the roll-forward reads one stream of the log: a segment (loaded
/// in `buf`) and the byte after the last record of the chain there.
struct Cursor {
    segment: u64,
    buf: Vec<u8>,
    pos: usize,
}

impl Cursor {
    /// The next sector boundary at or after the position (where a record
    /// follows flush padding).
    fn aligned(&self) -> usize {
        align_up(self.pos as u64, SECTOR_SIZE_BYTES) as usize
    }

    /// The next page boundary at or after the position (where a DATA
    /// record of a page-packed volume follows page padding).
    fn page_aligned(&self) -> usize {
        align_up(self.pos as u64, PACKING_PAGE_BYTES) as usize
    }
}

/// Where the roll-forward is: a cursor per stream of the log (the data
/// head's, and the metadata head's on a volume with a metadata device:
/// both take their seqs from one counter, so the chain goes from one to
/// the other), the seq and epoch the next record must continue, and what
/// it has done so far. `cursors[0]` is the data stream's.
struct Chain<'a> {
    storage: &'a dyn Storage,
    sb: &'a Superblock,
    cursors: Vec<Cursor>,
    expected: u64,
    epoch: u32,
    /// Segments holding the checkpoint or the chain, with their highest seq.
    needed: HashMap<u64, u64>,
    replayed: u64,
    map_records: u64,
    /// Offsets of the DATA records applied.
    new_records: Vec<u64>,
    /// Damaged checkpoint records stepped over, by seq.
    skipped: Vec<u64>,
    rolled_segments: Vec<u64>,
    /// Segments the cursors left, as read (`ReadSegments`).
    left: ReadSegments,
}

impl<'a> Chain<'a> {
    /// The chain at a checkpoint's start (or seq 1), its segments read.
    fn new(
        storage: &'a dyn Storage,
        sb: &'a Superblock,
        start: &Start,
    ) -> Result<Self, RecoveryError> {
        let mut cursors = vec![Cursor {
            segment: start.segment,
            buf: read_segment(storage, sb, start.segment)?,
            pos: start.offset,
        }];
        let mut rolled_segments = vec![start.segment];
        if let Some((segment, pos)) = start.meta {
            let buf = read_segment(storage, sb, segment)?;
            cursors.push(Cursor { segment, buf, pos });
            rolled_segments.push(segment);
        }
        Ok(Chain {
            storage,
            sb,
            cursors,
            expected: start.expected_seq,
            epoch: start.epoch,
            needed: start.checkpoint_segments.clone(),
            replayed: 0,
            map_records: 0,
            new_records: Vec::new(),
            skipped: Vec::new(),
            rolled_segments,
            left: Vec::new(),
        })
    }

    /// The cursor of `segment`'s stream, made if the chain had none yet.
    fn stream_of(&mut self, segment: u64) -> usize {
        let meta = self.sb.is_metadata_segment(segment);
        if let Some(i) = (0..self.cursors.len())
            .find(|&i| self.sb.is_metadata_segment(self.cursors[i].segment) == meta)
        {
            return i;
        }
        self.cursors.push(Cursor {
            segment,
            buf: Vec::new(),
            pos: 0,
        });
        self.cursors.len() - 1
    }

    /// Moves the cursor of `segment`'s stream to it (the segment it
    /// leaves is kept as read: `left`).
    fn enter(&mut self, segment: u64, buf: Vec<u8>, pos: usize) -> usize {
        let i = self.stream_of(segment);
        let old = std::mem::replace(&mut self.cursors[i], Cursor { segment, buf, pos });
        if old.buf.len() as u64 == self.sb.segment_size_bytes {
            // A few, not every one a long roll-forward passes: memory.
            if self.left.len() == KEPT_LEFT {
                self.left.remove(0);
            }
            self.left.push((old.segment, old.buf));
        }
        self.rolled_segments.push(segment);
        i
    }

    /// The record continuing the chain at one of the cursors, at its
    /// position or else at its next sector boundary, or (page packing:
    /// only a DATA record) its next page boundary: (cursor, where, header).
    fn record_here(&self) -> Option<(usize, usize, RecordHeader)> {
        let tag = self.sb.volume_tag();
        let (expected, epoch) = (self.expected, self.epoch);
        let paged = self.sb.packing().paged();
        self.cursors.iter().enumerate().find_map(|(i, c)| {
            let found = |at| {
                chain_record_at(self.sb.sealer(), &c.buf, at, tag, expected, epoch)
                    .map(|h| (i, at, h))
            };
            found(c.pos).or_else(|| found(c.aligned())).or_else(|| {
                paged
                    .then(|| found(c.page_aligned()))
                    .flatten()
                    .filter(|(_, _, h)| h.kind == RecordKind::Data)
            })
        })
    }

    /// Applies the verified record `h` at `at` of cursor `i`'s segment to
    /// the map and moves past it.
    fn apply(
        &mut self,
        map: &mut BlockMap,
        i: usize,
        at: usize,
        h: &RecordHeader,
    ) -> Result<(), RecoveryError> {
        let c = &self.cursors[i];
        // chain_record_at verified a whole record of the expected seq.
        assert!(at + h.total_len() <= c.buf.len() && h.seq == self.expected);
        let offset = self.sb.segment_offset(c.segment) + at as u64;
        let bad = |detail| RecoveryError::BadRecord {
            seq: h.seq,
            offset,
            detail,
        };
        // Only a REF record's content is needed (the others' meaning is in
        // their header, authenticated by `chain_record_at`).
        let payload = match h.kind {
            RecordKind::Ref => seal::payload(self.sb.sealer(), h, &c.buf[at..at + h.total_len()])
                .map_err(|e| bad(e.to_string()))?,
            _ => std::borrow::Cow::Borrowed(&[][..]),
        };
        if changes_map(h.kind) {
            // A lazily loaded map: the pages it changes come into memory.
            let src = LogPages {
                storage: self.storage,
                sb: self.sb,
                buffered: None,
            };
            let end = h.lba.saturating_add(u64::from(h.nblocks));
            map.fault_in(h.lba, end, &src)
                .map_err(|e| bad(e.to_string()))?;
        }
        apply(map, self.sb, h, offset, &payload).map_err(|e| bad(e.to_string()))?;
        if h.kind == RecordKind::Data {
            self.new_records.push(offset);
        }
        self.replayed += 1;
        self.map_records += u64::from(changes_map(h.kind));
        let m = self.needed.entry(c.segment).or_insert(0);
        *m = (*m).max(h.seq);
        self.cursors[i].pos = at + h.total_len();
        self.expected += 1;
        self.epoch = h.epoch;
        Ok(())
    }

    /// Whether the expected seq is a MAP_CHUNK or CKPT_COMMIT a pointer
    /// names, of the current epoch, exactly where the chain expects it (at
    /// a cursor's position or next sector boundary, or at the start of
    /// another segment): damaged, since no intact record continued the
    /// chain there.
    fn at_known_checkpoint_record(&self, known: &dyn KnownRecords) -> bool {
        known.record(self.expected).is_some_and(|(off, _, ep)| {
            self.sb.locate(off).is_some_and(|(s, at)| {
                let mut here = self.cursors.iter().filter(|c| c.segment == s).peekable();
                ep == self.epoch
                    && match here.peek() {
                        Some(_) => here.any(|c| at == c.pos || at == c.aligned()),
                        None => at == 0,
                    }
            })
        })
    }

    /// Steps over the damaged checkpoint record `at_known_checkpoint_record`
    /// found: it changes no block, so a damaged newest checkpoint must not
    /// cut the roll-forward from the older one short.
    fn step_over_known(&mut self, known: &dyn KnownRecords) -> Result<(), RecoveryError> {
        let (off, len, _) = known.record(self.expected).expect("checked above");
        let (s, at) = self.sb.locate(off).expect("checked above");
        let i = match self.cursors.iter().position(|c| c.segment == s) {
            Some(i) => i,
            None => {
                let buf = read_segment(self.storage, self.sb, s)?;
                self.enter(s, buf, 0)
            }
        };
        self.skipped.push(self.expected);
        let m = self.needed.entry(s).or_insert(0);
        *m = (*m).max(self.expected);
        self.cursors[i].pos = at + len as usize;
        self.expected += 1;
        Ok(())
    }

    /// Moves the cursor of a stream to another segment whose first record
    /// continues the chain. False if there is none: the chain ends here.
    fn switch_segment(&mut self, index: &HashMap<u64, Vec<u64>>) -> Result<bool, RecoveryError> {
        let tag = self.sb.volume_tag();
        // Every candidate is tried: a stale segment of a crashed epoch
        // may share the expected first seq with the real next one.
        let candidates: Vec<u64> = index
            .get(&self.expected)
            .into_iter()
            .flatten()
            .copied()
            .collect();
        for s in candidates {
            if self.cursors.iter().any(|c| c.segment == s) {
                continue;
            }
            let b = read_segment(self.storage, self.sb, s)?;
            if chain_record_at(self.sb.sealer(), &b, 0, tag, self.expected, self.epoch).is_some() {
                self.enter(s, b, 0);
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Where the chain ended (the data stream's cursor: where the log goes
    /// on) and what the roll-forward did.
    fn into_recovered(self, snapshot_seq: u64) -> Recovered {
        let data = &self.cursors[0];
        Recovered {
            map: BlockMap::new(0),
            segment: data.segment,
            end: data.pos,
            last_seq: self.expected - 1,
            last_epoch: self.epoch,
            checkpoint_generation: 0,
            replayed_records: self.replayed,
            replayed_map_records: self.map_records,
            snapshot_seq,
            needed_segments: self.needed,
            warnings: Vec::new(),
            skipped: self.skipped,
            salvage: None,
            rolled_segments: self.rolled_segments,
            tables: None,
            new_records: self.new_records,
            head_segment: None,
        }
    }
}

/// A verified record at `at` in `seg` that continues the chain, if any.
/// On an encrypted volume (`seal`) every record is authenticated too: a
/// record changed or forged after the fact (its crc is no secret) ends
/// the chain as a damaged one does.
fn chain_record_at(
    seal: Option<&Sealer>,
    seg: &[u8],
    at: usize,
    tag: u32,
    expected: u64,
    epoch: u32,
) -> Option<RecordHeader> {
    let b = seg.get(at..)?;
    let h = RecordHeader::decode(b).ok()?;
    let continues =
        h.seq == expected && (h.epoch == epoch || (h.kind == RecordKind::Epoch && h.epoch > epoch));
    if h.volume_tag != tag || !continues || h.total_len() > b.len() {
        return None;
    }
    h.verify(b, &b[RECORD_HEADER_BYTES..h.total_len()]).ok()?;
    seal::authenticate(seal, &h, b).ok()?;
    Some(h)
}

/// Does replaying a record of this kind change the map?
fn changes_map(kind: RecordKind) -> bool {
    matches!(
        kind,
        RecordKind::Data | RecordKind::Zero | RecordKind::Trim | RecordKind::Ref
    )
}

/// Applies one verified record's effect on the map.
fn apply(
    map: &mut BlockMap,
    sb: &Superblock,
    h: &RecordHeader,
    offset: u64,
    payload: &[u8],
) -> Result<(), ApplyError> {
    let end = h.lba + u64::from(h.nblocks);
    let in_range = end <= map.blocks();
    match h.kind {
        RecordKind::Data | RecordKind::Zero | RecordKind::Trim | RecordKind::Ref if !in_range => {
            Err(ApplyError::BeyondVolume { lba: h.lba, end })
        }
        RecordKind::Data if h.nblocks > DATA_UNIT_BLOCKS_MAX => Err(ApplyError::UnitTooLarge {
            nblocks: h.nblocks,
            max: DATA_UNIT_BLOCKS_MAX,
        }),
        RecordKind::Data => {
            // A unit's blocks each get their own entry (crc xor index); a
            // unit moved by the cleaner maps only the blocks of its live mask.
            for l in (h.lba..end).filter(|&l| h.maps(l)) {
                let k = (l - h.lba) as u32;
                let len = h.total_len() as u32;
                map.set(
                    l,
                    crate::records::unit_entry(h.codec, offset, len, h.crc, h.nblocks, k),
                );
            }
            Ok(())
        }
        RecordKind::Zero => {
            (h.lba..end).for_each(|l| {
                map.set(l, MapEntry::ZERO);
            });
            Ok(())
        }
        RecordKind::Trim => {
            set_unmapped(map, h.lba, end);
            Ok(())
        }
        RecordKind::Ref => {
            let e = MapEntry::decode(payload).map_err(ApplyError::RefUndecodable)?;
            match e.state_valid() {
                EntryState::Data { shared: true, .. } => {}
                _ => return Err(ApplyError::RefNotShared),
            }
            check_entry_location(sb, e).map_err(ApplyError::RefLocation)?;
            map.set(h.lba, e);
            Ok(())
        }
        RecordKind::Epoch
        | RecordKind::MapChunk
        | RecordKind::MapDir
        | RecordKind::MapTable
        | RecordKind::CkptCommit
        | RecordKind::Synced => Ok(()),
    }
}

/// Applies a record found by `scan_log` (its REF payload kept as the
/// decoded entry). True if it changed the map (DATA, ZERO, TRIM, REF).
pub(super) fn apply_scanned(map: &mut BlockMap, sb: &Superblock, r: &Scanned) -> bool {
    let mut b = [0u8; cvol_format::mapentry::MAP_ENTRY_BYTES];
    if let Some(e) = r.ref_entry {
        e.encode(&mut b);
    }
    let payload = if r.ref_entry.is_some() {
        &b[..]
    } else {
        &[][..]
    };
    let offset = sb.segment_offset(r.segment) + r.at as u64;
    apply(map, sb, &r.header, offset, payload).is_ok()
        && matches!(
            r.header.kind,
            RecordKind::Data | RecordKind::Zero | RecordKind::Trim | RecordKind::Ref
        )
}

/// Unmaps [start, end), skipping pages that hold nothing.
fn set_unmapped(map: &mut BlockMap, start: u64, end: u64) {
    let mut lba = start;
    while lba < end {
        match map.next_allocated_page_lba(lba) {
            Some(next) if next < end => {
                let page_end =
                    (next / crate::map::PAGE_BLOCKS as u64 + 1) * crate::map::PAGE_BLOCKS as u64;
                for l in next..page_end.min(end) {
                    map.set(l, MapEntry::UNMAPPED);
                }
                lba = page_end;
            }
            _ => break,
        }
    }
}
