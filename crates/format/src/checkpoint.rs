//! Checkpoint payloads. A checkpoint is a series of MAP_CHUNK records followed
//! by one CKPT_COMMIT record, all ordinary log records.
//!
//! MAP_CHUNK payload (before the record's codec is applied): a sequence of runs
//! ```text
//! 8  first lba
//! 4  count (n >= 1)
//! 12*n map entries (see mapentry)
//! ```
//! Unmapped blocks are not stored. CKPT_COMMIT payload:
//! ```text
//! 8  snapshot_seq   (the map equals the state after applying every record <= this seq)
//! 8  logical_blocks (sanity check against the superblock)
//! 4  chunk count (c)
//! c * (8 offset, 4 total record length, 4 record crc) locating each MAP_CHUNK record
//! optional, 16 bytes (volumes with FLAG_RESUME_AT_SNAPSHOT):
//! 8  resume segment (the log head's segment when the snapshot was taken)
//! 8  resume offset  (its fill then: record snapshot_seq + 1 is there, at the
//!                    next sector boundary, or first in another segment)
//! optional, 16 more bytes (volumes with FLAG_METADATA_DEVICE):
//! 8  metadata resume segment (the metadata head's segment at the snapshot)
//! 8  metadata resume offset  (its fill then)
//! ```
//! With a metadata device the log has two heads drawing seqs from one
//! counter: map records and commits go to the metadata head, every other
//! record to the data head; roll-forward follows the chain of seqs through
//! both, from both resume positions.
//! Without the resume position, no record lies between the snapshot and the
//! commit and roll-forward starts after the commit; with it, records of
//! clients may lie between the snapshot and the MAP_CHUNKs and between the
//! chunks (the checkpoint was written outside the volume lock), and
//! roll-forward starts at the resume position, passing over the
//! checkpoint's own records.
//!
//! Paged map (volumes with FLAG_PAGED_MAP): the commit's chunk references
//! may name MAP_DIR records instead, one per *directory block* holding at
//! least one map page, in block order. The map is split into pages of
//! `MAP_PAGE_BLOCKS` LBAs; each page with entries is one MAP_CHUNK record
//! (the runs above, all inside the page; header lba = the page's first
//! LBA), written when the page changed and named by every later checkpoint
//! until it changes again. A MAP_DIR record (header lba = the first LBA of
//! its block) lists, for the `DIR_PAGES` pages of its block that have
//! entries, in page order, 32 bytes each:
//! ```text
//! 8  page index (lba / MAP_PAGE_BLOCKS)
//! 8  offset of the page's MAP_CHUNK record
//! 4  its total length
//! 4  its crc
//! 8  its seq
//! ```
//! A commit names MAP_DIR records only or MAP_CHUNK records only; recovery
//! tells which from the kind of the records.
use crate::*;

/// LBAs per page of the paged map.
pub const MAP_PAGE_BLOCKS: u64 = 512;
/// Map pages per directory block (one MAP_DIR record).
pub const DIR_PAGES: u64 = 2048;
const DIR_OFF_PAGE: usize = 0;
const DIR_OFF_OFFSET: usize = DIR_OFF_PAGE + 8;
const DIR_OFF_LEN: usize = DIR_OFF_OFFSET + 8;
const DIR_OFF_CRC: usize = DIR_OFF_LEN + 4;
const DIR_OFF_SEQ: usize = DIR_OFF_CRC + 4;
pub const DIR_ENTRY_BYTES: usize = DIR_OFF_SEQ + 8;

// Run header of a MAP_CHUNK payload.
const RUN_OFF_LBA: usize = 0;
const RUN_OFF_COUNT: usize = RUN_OFF_LBA + 8;
pub const RUN_HEADER_BYTES: usize = RUN_OFF_COUNT + 4;

// CKPT_COMMIT payload: a fixed header, then one chunk reference per MAP_CHUNK.
const COMMIT_OFF_SNAPSHOT_SEQ: usize = 0;
const COMMIT_OFF_LOGICAL_BLOCKS: usize = COMMIT_OFF_SNAPSHOT_SEQ + 8;
const COMMIT_OFF_CHUNK_COUNT: usize = COMMIT_OFF_LOGICAL_BLOCKS + 8;
pub const COMMIT_HEADER_BYTES: usize = COMMIT_OFF_CHUNK_COUNT + 4;
const RESUME_OFF_SEGMENT: usize = 0;
const RESUME_OFF_OFFSET: usize = RESUME_OFF_SEGMENT + 8;
pub const RESUME_BYTES: usize = RESUME_OFF_OFFSET + 8;
const CHUNK_OFF_OFFSET: usize = 0;
const CHUNK_OFF_LEN: usize = CHUNK_OFF_OFFSET + 8;
const CHUNK_OFF_CRC: usize = CHUNK_OFF_LEN + 4;
pub const CHUNK_REF_BYTES: usize = CHUNK_OFF_CRC + 4;

/// Bytes of a CKPT_COMMIT payload naming `chunks` MAP_CHUNK records.
pub const fn commit_payload_bytes(chunks: usize) -> usize {
    COMMIT_HEADER_BYTES + chunks * CHUNK_REF_BYTES
}

/// Bytes of one run of `entries` map entries in a MAP_CHUNK payload.
pub const fn run_bytes(entries: usize) -> usize {
    RUN_HEADER_BYTES + entries * mapentry::MAP_ENTRY_BYTES
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkRef {
    pub offset: u64,
    pub len: u32,
    pub crc: u32,
}

/// Where roll-forward resumes: the log head when the snapshot was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resume {
    pub segment: u64,
    /// Bytes into the segment (at most the segment size).
    pub offset: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitPayload {
    pub snapshot_seq: u64,
    pub logical_blocks: u64,
    pub chunks: Vec<ChunkRef>,
    /// None: roll-forward starts right after the commit record.
    pub resume: Option<Resume>,
    /// The metadata head at the snapshot (a volume with a metadata device;
    /// only with `resume`).
    pub meta_resume: Option<Resume>,
}

impl CommitPayload {
    pub fn encode(&self) -> Vec<u8> {
        let refs = commit_payload_bytes(self.chunks.len());
        assert!(self.resume.is_some() || self.meta_resume.is_none());
        let resume = RESUME_BYTES
            * (usize::from(self.resume.is_some()) + usize::from(self.meta_resume.is_some()));
        let mut v = vec![0u8; refs + resume];
        put_u64(&mut v, COMMIT_OFF_SNAPSHOT_SEQ, self.snapshot_seq);
        put_u64(&mut v, COMMIT_OFF_LOGICAL_BLOCKS, self.logical_blocks);
        put_u32(&mut v, COMMIT_OFF_CHUNK_COUNT, self.chunks.len() as u32);
        for (i, c) in self.chunks.iter().enumerate() {
            let at = commit_payload_bytes(i);
            put_u64(&mut v, at + CHUNK_OFF_OFFSET, c.offset);
            put_u32(&mut v, at + CHUNK_OFF_LEN, c.len);
            put_u32(&mut v, at + CHUNK_OFF_CRC, c.crc);
        }
        if let Some(r) = self.resume {
            put_u64(&mut v, refs + RESUME_OFF_SEGMENT, r.segment);
            put_u64(&mut v, refs + RESUME_OFF_OFFSET, r.offset);
        }
        if let Some(r) = self.meta_resume {
            let at = refs + RESUME_BYTES;
            put_u64(&mut v, at + RESUME_OFF_SEGMENT, r.segment);
            put_u64(&mut v, at + RESUME_OFF_OFFSET, r.offset);
        }
        v
    }

    pub fn decode(b: &[u8]) -> Result<CommitPayload, FormatError> {
        need(b, COMMIT_HEADER_BYTES)?;
        let count = get_u32(b, COMMIT_OFF_CHUNK_COUNT) as usize;
        let refs = commit_payload_bytes(count);
        let resume_at = |at: usize| Resume {
            segment: get_u64(b, at + RESUME_OFF_SEGMENT),
            offset: get_u64(b, at + RESUME_OFF_OFFSET),
        };
        let (resume, meta_resume) = match b.len().checked_sub(refs) {
            Some(0) => (None, None),
            Some(RESUME_BYTES) => (Some(resume_at(refs)), None),
            Some(n) if n == 2 * RESUME_BYTES => {
                (Some(resume_at(refs)), Some(resume_at(refs + RESUME_BYTES)))
            }
            _ => return Err(FormatError::Invalid("commit payload length")),
        };
        let chunks = (0..count)
            .map(|i| {
                let at = commit_payload_bytes(i);
                ChunkRef {
                    offset: get_u64(b, at + CHUNK_OFF_OFFSET),
                    len: get_u32(b, at + CHUNK_OFF_LEN),
                    crc: get_u32(b, at + CHUNK_OFF_CRC),
                }
            })
            .collect();
        Ok(CommitPayload {
            snapshot_seq: get_u64(b, COMMIT_OFF_SNAPSHOT_SEQ),
            logical_blocks: get_u64(b, COMMIT_OFF_LOGICAL_BLOCKS),
            chunks,
            resume,
            meta_resume,
        })
    }
}

/// Where a map page's MAP_CHUNK record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRef {
    pub offset: u64,
    pub len: u32,
    pub crc: u32,
    pub seq: u64,
}

/// A MAP_DIR payload: the pages of one directory block that have entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirPayload {
    pub pages: Vec<(u64, PageRef)>,
}

impl DirPayload {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.pages.len() * DIR_ENTRY_BYTES];
        for (i, (page, r)) in self.pages.iter().enumerate() {
            let at = i * DIR_ENTRY_BYTES;
            put_u64(&mut v, at + DIR_OFF_PAGE, *page);
            put_u64(&mut v, at + DIR_OFF_OFFSET, r.offset);
            put_u32(&mut v, at + DIR_OFF_LEN, r.len);
            put_u32(&mut v, at + DIR_OFF_CRC, r.crc);
            put_u64(&mut v, at + DIR_OFF_SEQ, r.seq);
        }
        v
    }

    /// Decodes the directory block `block`: every page must lie in it, in
    /// strictly increasing order.
    pub fn decode(b: &[u8], block: u64) -> Result<DirPayload, FormatError> {
        if !b.len().is_multiple_of(DIR_ENTRY_BYTES) {
            return Err(FormatError::Invalid("map directory length"));
        }
        let range = block * DIR_PAGES..(block + 1) * DIR_PAGES;
        let mut pages: Vec<(u64, PageRef)> = Vec::with_capacity(b.len() / DIR_ENTRY_BYTES);
        for e in b.chunks_exact(DIR_ENTRY_BYTES) {
            let page = get_u64(e, DIR_OFF_PAGE);
            if !range.contains(&page) || pages.last().is_some_and(|l| l.0 >= page) {
                return Err(FormatError::Invalid("map directory page out of order"));
            }
            let r = PageRef {
                offset: get_u64(e, DIR_OFF_OFFSET),
                len: get_u32(e, DIR_OFF_LEN),
                crc: get_u32(e, DIR_OFF_CRC),
                seq: get_u64(e, DIR_OFF_SEQ),
            };
            pages.push((page, r));
        }
        Ok(DirPayload { pages })
    }
}

/// Bytes of a summarized MAP_DIR payload's page bitmap: a bit per page of
/// the block.
pub const DIR_BITMAP_BYTES: usize = (DIR_PAGES / 8) as usize;
const DIRSUM_OFF_PAGES: usize = 0;
const DIRSUM_OFF_USES: usize = DIRSUM_OFF_PAGES + 4;
const DIRSUM_OFF_BITMAP: usize = DIRSUM_OFF_USES + 4;
/// Bytes before a summarized MAP_DIR payload's segment uses.
pub const DIRSUM_HEADER_BYTES: usize = DIRSUM_OFF_BITMAP + DIR_BITMAP_BYTES;
/// Bytes of one segment use.
pub const DIR_USE_BYTES: usize = 24;
/// Set in a summarized MAP_DIR's segment-use count when the block's list
/// lies in a record of its own (`DirList::Apart`), named by the
/// `DIR_LIST_REF_BYTES` after the uses.
pub const DIRSUM_LIST_APART: u32 = 1 << 31;
/// Bytes of the reference to a list record: offset u64, total length u32,
/// crc u32, seq u64.
pub const DIR_LIST_REF_BYTES: usize = 24;

/// Where a summarized block's list is: in its MAP_DIR record after the
/// summary (lz4, length prepended), or in a MAP_DIR record of its own (an
/// lz4 list, the unsummarized layout) that the summary names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirList<'a> {
    Inline(&'a [u8]),
    Apart(PageRef),
}

/// The page records of a directory block that lie in one segment: how
/// many bytes they hold and the highest seq among them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentUse {
    pub segment: u64,
    pub bytes: u64,
    pub max_seq: u64,
}

/// What a summarized MAP_DIR payload says before its entries: which pages
/// of the block have a record (`bitmap`, bit `i % 64` of word `i / 64` for
/// the block's page `i`), and per segment the bytes and highest seq of
/// those records (`uses`, ascending segments).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirSummary {
    pub pages: u32,
    pub bitmap: [u64; (DIR_PAGES / 64) as usize],
    pub uses: Vec<SegmentUse>,
}

impl DirSummary {
    /// The summary of `pages` (a block's list, as `DirPayload`), their
    /// records located in segments by `segment_of` (None: in none).
    pub fn of(pages: &[(u64, PageRef)], segment_of: impl Fn(u64) -> Option<u64>) -> DirSummary {
        let mut bitmap = [0u64; (DIR_PAGES / 64) as usize];
        let mut uses: Vec<SegmentUse> = Vec::new();
        for &(p, r) in pages {
            let i = (p % DIR_PAGES) as usize;
            bitmap[i / 64] |= 1 << (i % 64);
            let Some(segment) = segment_of(r.offset) else {
                continue;
            };
            match uses.binary_search_by_key(&segment, |u| u.segment) {
                Ok(at) => {
                    let u = &mut uses[at];
                    u.bytes += u64::from(r.len);
                    u.max_seq = u.max_seq.max(r.seq);
                }
                Err(at) => uses.insert(
                    at,
                    SegmentUse {
                        segment,
                        bytes: u64::from(r.len),
                        max_seq: r.seq,
                    },
                ),
            }
        }
        DirSummary {
            pages: pages.len() as u32,
            bitmap,
            uses,
        }
    }

    /// The summarized payload: this summary, then `packed` (the block's
    /// `DirPayload` entries, compressed by the caller).
    pub fn encode(&self, packed: &[u8]) -> Vec<u8> {
        self.encode_with(0, packed)
    }

    /// The summarized payload of a block whose list lies in the record
    /// `list` (`DirList::Apart`).
    pub fn encode_apart(&self, list: &PageRef) -> Vec<u8> {
        let mut r = [0u8; DIR_LIST_REF_BYTES];
        put_u64(&mut r, 0, list.offset);
        put_u32(&mut r, 8, list.len);
        put_u32(&mut r, 12, list.crc);
        put_u64(&mut r, 16, list.seq);
        self.encode_with(DIRSUM_LIST_APART, &r)
    }

    fn encode_with(&self, flags: u32, packed: &[u8]) -> Vec<u8> {
        let uses_at = DIRSUM_HEADER_BYTES;
        let packed_at = uses_at + self.uses.len() * DIR_USE_BYTES;
        let mut v = vec![0u8; packed_at + packed.len()];
        assert!((self.uses.len() as u32) < DIRSUM_LIST_APART);
        put_u32(&mut v, DIRSUM_OFF_PAGES, self.pages);
        put_u32(&mut v, DIRSUM_OFF_USES, self.uses.len() as u32 | flags);
        for (i, w) in self.bitmap.iter().enumerate() {
            put_u64(&mut v, DIRSUM_OFF_BITMAP + i * 8, *w);
        }
        for (i, u) in self.uses.iter().enumerate() {
            let at = uses_at + i * DIR_USE_BYTES;
            put_u64(&mut v, at, u.segment);
            put_u64(&mut v, at + 8, u.bytes);
            put_u64(&mut v, at + 16, u.max_seq);
        }
        v[packed_at..].copy_from_slice(packed);
        v
    }

    /// Decodes a summarized payload: the summary, and where its list is
    /// (the compressed entries after it, or the record it names). The
    /// page count must match the bitmap, the segments ascend and every use
    /// holds bytes; a named list is all that follows the uses.
    pub fn decode(b: &[u8]) -> Result<(DirSummary, DirList<'_>), FormatError> {
        need(b, DIRSUM_HEADER_BYTES)?;
        let pages = get_u32(b, DIRSUM_OFF_PAGES);
        let word = get_u32(b, DIRSUM_OFF_USES);
        let apart = word & DIRSUM_LIST_APART != 0;
        let nuses = (word & !DIRSUM_LIST_APART) as usize;
        let packed_at = nuses
            .checked_mul(DIR_USE_BYTES)
            .and_then(|n| n.checked_add(DIRSUM_HEADER_BYTES))
            .filter(|&n| n <= b.len())
            .ok_or(FormatError::Invalid("map directory summary length"))?;
        let mut bitmap = [0u64; (DIR_PAGES / 64) as usize];
        for (i, w) in bitmap.iter_mut().enumerate() {
            *w = get_u64(b, DIRSUM_OFF_BITMAP + i * 8);
        }
        if bitmap.iter().map(|w| w.count_ones()).sum::<u32>() != pages || pages == 0 {
            return Err(FormatError::Invalid("map directory summary page count"));
        }
        let mut uses: Vec<SegmentUse> = Vec::with_capacity(nuses);
        for i in 0..nuses {
            let at = DIRSUM_HEADER_BYTES + i * DIR_USE_BYTES;
            let u = SegmentUse {
                segment: get_u64(b, at),
                bytes: get_u64(b, at + 8),
                max_seq: get_u64(b, at + 16),
            };
            if u.bytes == 0 || uses.last().is_some_and(|l| l.segment >= u.segment) {
                return Err(FormatError::Invalid("map directory summary segments"));
            }
            uses.push(u);
        }
        let s = DirSummary {
            pages,
            bitmap,
            uses,
        };
        let rest = &b[packed_at..];
        if !apart {
            return Ok((s, DirList::Inline(rest)));
        }
        if rest.len() != DIR_LIST_REF_BYTES {
            return Err(FormatError::Invalid("map directory list reference length"));
        }
        let r = PageRef {
            offset: get_u64(rest, 0),
            len: get_u32(rest, 8),
            crc: get_u32(rest, 12),
            seq: get_u64(rest, 16),
        };
        Ok((s, DirList::Apart(r)))
    }
}

/// Appends one run to a chunk payload being built.
pub fn push_run(out: &mut Vec<u8>, first_lba: u64, entries: &[MapEntry]) {
    assert!(!entries.is_empty());
    let at = out.len();
    out.resize(at + run_bytes(entries.len()), 0);
    put_u64(out, at + RUN_OFF_LBA, first_lba);
    put_u32(out, at + RUN_OFF_COUNT, entries.len() as u32);
    for (i, e) in entries.iter().enumerate() {
        e.encode(&mut out[at + RUN_HEADER_BYTES + i * mapentry::MAP_ENTRY_BYTES..]);
    }
}

/// Decodes a chunk payload, calling `f(lba, entry)` for every stored entry.
/// Entries are validated; LBAs are checked against `logical_blocks`.
pub fn decode_runs(
    mut b: &[u8],
    logical_blocks: u64,
    mut f: impl FnMut(u64, MapEntry),
) -> Result<(), FormatError> {
    while !b.is_empty() {
        need(b, RUN_HEADER_BYTES)?;
        let first = get_u64(b, RUN_OFF_LBA);
        let count = get_u32(b, RUN_OFF_COUNT) as usize;
        let bytes = count * mapentry::MAP_ENTRY_BYTES;
        need(b, RUN_HEADER_BYTES + bytes)?;
        if count == 0
            || first
                .checked_add(count as u64)
                .is_none_or(|end| end > logical_blocks)
        {
            return Err(FormatError::Invalid("map run out of range"));
        }
        for i in 0..count {
            let at = RUN_HEADER_BYTES + i * mapentry::MAP_ENTRY_BYTES;
            f(first + i as u64, MapEntry::decode(&b[at..])?);
        }
        b = &b[RUN_HEADER_BYTES + bytes..];
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_roundtrip() {
        let c = CommitPayload {
            snapshot_seq: 9,
            logical_blocks: 1 << 20,
            chunks: vec![
                ChunkRef {
                    offset: 1 << 20,
                    len: 500,
                    crc: 1,
                },
                ChunkRef {
                    offset: 2 << 20,
                    len: 7,
                    crc: 2,
                },
            ],
            resume: None,
            meta_resume: None,
        };
        assert_eq!(CommitPayload::decode(&c.encode()).unwrap(), c);
        assert!(CommitPayload::decode(&c.encode()[..30]).is_err());
        let r = CommitPayload {
            resume: Some(Resume {
                segment: 7,
                offset: 4096,
            }),
            ..c.clone()
        };
        assert_eq!(r.encode().len(), c.encode().len() + RESUME_BYTES);
        assert_eq!(CommitPayload::decode(&r.encode()).unwrap(), r);
        let long = [r.encode(), vec![0]].concat();
        assert!(CommitPayload::decode(&long).is_err());
        assert!(CommitPayload::decode(&r.encode()[..r.encode().len() - 1]).is_err());
        let m = CommitPayload {
            meta_resume: Some(Resume {
                segment: 90,
                offset: 512,
            }),
            ..r.clone()
        };
        assert_eq!(m.encode().len(), r.encode().len() + RESUME_BYTES);
        assert_eq!(CommitPayload::decode(&m.encode()).unwrap(), m);
        assert!(CommitPayload::decode(&[m.encode(), vec![0; 16]].concat()).is_err());
    }

    #[test]
    fn dir_roundtrip_and_bounds() {
        let r = |o: u64| PageRef {
            offset: o,
            len: 300,
            crc: 7,
            seq: o + 1,
        };
        let d = DirPayload {
            pages: vec![(DIR_PAGES, r(1 << 20)), (DIR_PAGES + 5, r(2 << 20))],
        };
        let b = d.encode();
        assert_eq!(b.len(), 2 * DIR_ENTRY_BYTES);
        assert_eq!(DirPayload::decode(&b, 1).unwrap(), d);
        assert!(DirPayload::decode(&b, 0).is_err(), "pages of another block");
        assert!(DirPayload::decode(&b[1..], 1).is_err());
        let swapped = DirPayload {
            pages: vec![d.pages[1], d.pages[0]],
        };
        assert!(DirPayload::decode(&swapped.encode(), 1).is_err());
        assert_eq!(DirPayload::decode(&[], 3).unwrap().pages, vec![]);
    }

    #[test]
    fn runs_roundtrip_and_bounds() {
        let mut v = Vec::new();
        let e = MapEntry::data(CodecTag::Lz4, 4096, 100, 5);
        push_run(&mut v, 10, &[e, MapEntry::ZERO]);
        push_run(&mut v, 100, &[e]);
        let mut got = Vec::new();
        decode_runs(&v, 101, |l, e| got.push((l, e))).unwrap();
        assert_eq!(got, vec![(10, e), (11, MapEntry::ZERO), (100, e)]);
        assert!(decode_runs(&v, 100, |_, _| {}).is_err());
        assert!(decode_runs(&v[..v.len() - 1], 101, |_, _| {}).is_err());
    }

    #[test]
    fn dir_summary_roundtrip_and_bounds() {
        let r = |offset: u64, seq: u64| PageRef {
            offset,
            len: 100,
            crc: 1,
            seq,
        };
        let pages = vec![
            (DIR_PAGES, r(10, 5)),
            (DIR_PAGES + 70, r(30, 9)),
            (DIR_PAGES + 71, r(12, 7)),
        ];
        // Segments of 10 bytes: records at 10 and 12 share segment 1.
        let s = DirSummary::of(&pages, |o| Some(o / 10));
        assert_eq!(s.pages, 3);
        assert_eq!(s.bitmap[0], 1);
        assert_eq!(s.bitmap[1], 0b1100_0000);
        let uses: Vec<_> = s
            .uses
            .iter()
            .map(|u| (u.segment, u.bytes, u.max_seq))
            .collect();
        assert_eq!(uses, vec![(1, 200, 7), (3, 100, 9)]);
        let b = s.encode(b"list");
        let (back, list) = DirSummary::decode(&b).unwrap();
        assert_eq!((back, list), (s.clone(), DirList::Inline(&b"list"[..])));
        // A list apart: the summary names its record, and nothing follows.
        let at = r(4096, 11);
        let apart = s.encode_apart(&at);
        let (back, list) = DirSummary::decode(&apart).unwrap();
        assert_eq!((back, list), (s.clone(), DirList::Apart(at)));
        assert!(DirSummary::decode(&apart[..apart.len() - 1]).is_err());
        let mut longer = apart.clone();
        longer.push(0);
        assert!(DirSummary::decode(&longer).is_err());
        // A page count that is not the bitmap's, segments out of order, a
        // use without bytes and a short payload are refused.
        let mut wrong = b.clone();
        wrong[0] = 4;
        assert!(DirSummary::decode(&wrong).is_err());
        let mut swapped = s.clone();
        swapped.uses.swap(0, 1);
        assert!(DirSummary::decode(&swapped.encode(b"")).is_err());
        let mut empty_use = s.clone();
        empty_use.uses[0].bytes = 0;
        assert!(DirSummary::decode(&empty_use.encode(b"")).is_err());
        assert!(DirSummary::decode(&b[..DIRSUM_HEADER_BYTES + 30]).is_err());
    }
}
