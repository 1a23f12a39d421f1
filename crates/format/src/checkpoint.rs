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
//!
//! Named directory (volumes with `FLAG_DIR_NAMED`; bit 31 of the chunk
//! count, `COMMIT_DIR_NAMED`, set): the commit also says which block each
//! MAP_DIR holds and what the directory names as a whole, so that open
//! need not read a block's record until something needs the block. Each
//! chunk reference is then 32 bytes, and a usage part follows them,
//! before the resume positions:
//! ```text
//! c * (8 offset, 4 total record length, 4 record crc, 8 record seq,
//!      8 directory block)                       blocks strictly ascending
//! 8  allocated pages (map pages with entries, the whole map)
//! 4  use count (u)
//! u * (8 segment, 8 bytes, 8 highest seq)       segments strictly ascending
//! ```
//! The uses sum, per segment, the records the directory names other than
//! the MAP_DIRs themselves (those the chunk references name): the pages'
//! and tables' MAP_CHUNK/MAP_TABLE records and the lists kept apart.
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
const CHUNK_OFF_SEQ: usize = CHUNK_REF_BYTES;
const CHUNK_OFF_BLOCK: usize = CHUNK_OFF_SEQ + 8;
/// Bytes of a chunk reference in a named directory's commit.
pub const NAMED_CHUNK_REF_BYTES: usize = CHUNK_OFF_BLOCK + 8;
/// Set in a commit's chunk count when it names its directory's blocks and
/// usage (`NamedDir`).
pub const COMMIT_DIR_NAMED: u32 = 1 << 31;
const NAMED_OFF_ALLOCATED: usize = 0;
const NAMED_OFF_USES: usize = NAMED_OFF_ALLOCATED + 8;
/// Bytes of a named directory's usage part before its segment uses.
pub const NAMED_HEADER_BYTES: usize = NAMED_OFF_USES + 4;

/// Bytes of a CKPT_COMMIT payload naming `chunks` MAP_CHUNK records.
pub const fn commit_payload_bytes(chunks: usize) -> usize {
    COMMIT_HEADER_BYTES + chunks * CHUNK_REF_BYTES
}

/// Bytes of a named directory's CKPT_COMMIT payload (without resume
/// positions) naming `chunks` MAP_DIR records, with `uses` segment uses.
pub const fn named_commit_payload_bytes(chunks: usize, uses: usize) -> usize {
    COMMIT_HEADER_BYTES + chunks * NAMED_CHUNK_REF_BYTES + NAMED_HEADER_BYTES + uses * DIR_USE_BYTES
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
    /// What a named directory's commit says beyond where its MAP_DIRs are
    /// (`FLAG_DIR_NAMED`).
    pub named: Option<NamedDir>,
}

/// A named directory (`FLAG_DIR_NAMED`): which block each MAP_DIR of the
/// commit holds, and what the whole directory names, so that open can
/// leave a block's record unread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedDir {
    /// Per chunk reference, in order: its directory block and the seq of
    /// its record. Blocks strictly ascend.
    pub blocks: Vec<DirName>,
    /// Map pages with entries, in the whole map.
    pub allocated_pages: u64,
    /// Per segment (ascending), the bytes and highest seq of the records
    /// the directory names other than its MAP_DIRs: pages, tables and
    /// lists kept apart.
    pub uses: Vec<SegmentUse>,
}

/// The directory block a MAP_DIR holds, and its record's seq.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirName {
    pub block: u64,
    pub seq: u64,
}

impl CommitPayload {
    pub fn encode(&self) -> Vec<u8> {
        let refs = self.refs_bytes();
        assert!(self.resume.is_some() || self.meta_resume.is_none());
        let resume = RESUME_BYTES
            * (usize::from(self.resume.is_some()) + usize::from(self.meta_resume.is_some()));
        let mut v = vec![0u8; refs + resume];
        put_u64(&mut v, COMMIT_OFF_SNAPSHOT_SEQ, self.snapshot_seq);
        put_u64(&mut v, COMMIT_OFF_LOGICAL_BLOCKS, self.logical_blocks);
        let count = self.chunks.len() as u32;
        assert!(count < COMMIT_DIR_NAMED, "a count below the flag bit");
        let named = self.named.as_ref();
        let flag = if named.is_some() { COMMIT_DIR_NAMED } else { 0 };
        put_u32(&mut v, COMMIT_OFF_CHUNK_COUNT, count | flag);
        let stride = match named {
            Some(_) => NAMED_CHUNK_REF_BYTES,
            None => CHUNK_REF_BYTES,
        };
        for (i, c) in self.chunks.iter().enumerate() {
            let at = COMMIT_HEADER_BYTES + i * stride;
            put_u64(&mut v, at + CHUNK_OFF_OFFSET, c.offset);
            put_u32(&mut v, at + CHUNK_OFF_LEN, c.len);
            put_u32(&mut v, at + CHUNK_OFF_CRC, c.crc);
            if let Some(n) = named {
                let name = n.blocks[i];
                put_u64(&mut v, at + CHUNK_OFF_SEQ, name.seq);
                put_u64(&mut v, at + CHUNK_OFF_BLOCK, name.block);
            }
        }
        if let Some(n) = named {
            assert_eq!(n.blocks.len(), self.chunks.len(), "a name per chunk");
            let at = COMMIT_HEADER_BYTES + self.chunks.len() * stride;
            put_u64(&mut v, at + NAMED_OFF_ALLOCATED, n.allocated_pages);
            put_u32(&mut v, at + NAMED_OFF_USES, n.uses.len() as u32);
            for (i, u) in n.uses.iter().enumerate() {
                let at = at + NAMED_HEADER_BYTES + i * DIR_USE_BYTES;
                put_u64(&mut v, at, u.segment);
                put_u64(&mut v, at + 8, u.bytes);
                put_u64(&mut v, at + 16, u.max_seq);
            }
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

    /// Bytes before the resume positions.
    fn refs_bytes(&self) -> usize {
        match &self.named {
            Some(n) => named_commit_payload_bytes(self.chunks.len(), n.uses.len()),
            None => commit_payload_bytes(self.chunks.len()),
        }
    }

    pub fn decode(b: &[u8]) -> Result<CommitPayload, FormatError> {
        need(b, COMMIT_HEADER_BYTES)?;
        let word = get_u32(b, COMMIT_OFF_CHUNK_COUNT);
        let count = (word & !COMMIT_DIR_NAMED) as usize;
        let named = word & COMMIT_DIR_NAMED != 0;
        let stride = if named {
            NAMED_CHUNK_REF_BYTES
        } else {
            CHUNK_REF_BYTES
        };
        let chunks_end = count
            .checked_mul(stride)
            .and_then(|n| n.checked_add(COMMIT_HEADER_BYTES))
            .filter(|&n| n <= b.len())
            .ok_or(FormatError::Invalid("commit payload length"))?;
        let chunk_at = |i: usize| COMMIT_HEADER_BYTES + i * stride;
        let chunks = (0..count)
            .map(|i| ChunkRef {
                offset: get_u64(b, chunk_at(i) + CHUNK_OFF_OFFSET),
                len: get_u32(b, chunk_at(i) + CHUNK_OFF_LEN),
                crc: get_u32(b, chunk_at(i) + CHUNK_OFF_CRC),
            })
            .collect();
        let (named, refs) = match named {
            true => {
                let (n, end) = decode_named(b, count, chunks_end)?;
                (Some(n), end)
            }
            false => (None, chunks_end),
        };
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
        Ok(CommitPayload {
            snapshot_seq: get_u64(b, COMMIT_OFF_SNAPSHOT_SEQ),
            logical_blocks: get_u64(b, COMMIT_OFF_LOGICAL_BLOCKS),
            chunks,
            resume,
            meta_resume,
            named,
        })
    }
}

/// The named directory of a commit payload `b` with `count` chunk
/// references ending at `at`, and where it ends. Blocks must ascend
/// strictly, and segments too, each use holding bytes.
fn decode_named(b: &[u8], count: usize, at: usize) -> Result<(NamedDir, usize), FormatError> {
    let names = (0..count).map(|i| {
        let c = COMMIT_HEADER_BYTES + i * NAMED_CHUNK_REF_BYTES;
        DirName {
            block: get_u64(b, c + CHUNK_OFF_BLOCK),
            seq: get_u64(b, c + CHUNK_OFF_SEQ),
        }
    });
    let blocks: Vec<DirName> = names.collect();
    if blocks.windows(2).any(|w| w[0].block >= w[1].block) {
        return Err(FormatError::Invalid("commit directory blocks out of order"));
    }
    need(b, at + NAMED_HEADER_BYTES)?;
    let nuses = get_u32(b, at + NAMED_OFF_USES) as usize;
    let end = nuses
        .checked_mul(DIR_USE_BYTES)
        .and_then(|n| n.checked_add(at + NAMED_HEADER_BYTES))
        .filter(|&n| n <= b.len())
        .ok_or(FormatError::Invalid("commit payload length"))?;
    let mut uses: Vec<SegmentUse> = Vec::with_capacity(nuses);
    for i in 0..nuses {
        let u_at = at + NAMED_HEADER_BYTES + i * DIR_USE_BYTES;
        let u = SegmentUse {
            segment: get_u64(b, u_at),
            bytes: get_u64(b, u_at + 8),
            max_seq: get_u64(b, u_at + 16),
        };
        if u.bytes == 0 || uses.last().is_some_and(|l| l.segment >= u.segment) {
            return Err(FormatError::Invalid("commit directory segments"));
        }
        uses.push(u);
    }
    let n = NamedDir {
        blocks,
        allocated_pages: get_u64(b, at + NAMED_OFF_ALLOCATED),
        uses,
    };
    Ok((n, end))
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
            named: None,
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
    fn named_commit_roundtrip_and_bounds() {
        let chunk = |offset| ChunkRef {
            offset,
            len: 300,
            crc: 5,
        };
        let name = |block, seq| DirName { block, seq };
        let used = |segment, bytes| SegmentUse {
            segment,
            bytes,
            max_seq: segment + 40,
        };
        let c = CommitPayload {
            snapshot_seq: 9,
            logical_blocks: 1 << 30,
            chunks: vec![chunk(1 << 20), chunk(3 << 20)],
            resume: Some(Resume {
                segment: 7,
                offset: 4096,
            }),
            meta_resume: None,
            named: Some(NamedDir {
                blocks: vec![name(0, 77), name(5, 78)],
                allocated_pages: 4000,
                uses: vec![used(1, 9000), used(4, 12)],
            }),
        };
        let b = c.encode();
        assert_eq!(b.len(), named_commit_payload_bytes(2, 2) + RESUME_BYTES);
        assert_eq!(CommitPayload::decode(&b).unwrap(), c);
        let word = get_u32(&b, COMMIT_OFF_CHUNK_COUNT);
        assert_eq!(word, 2 | COMMIT_DIR_NAMED, "the flag bit marks the layout");
        for cut in [b.len() - 1, b.len() - RESUME_BYTES - 1, 40, 90] {
            assert!(CommitPayload::decode(&b[..cut]).is_err(), "cut at {cut}");
        }
        assert!(CommitPayload::decode(&[b.clone(), vec![0]].concat()).is_err());
        let bad = |f: &dyn Fn(&mut NamedDir)| {
            let mut c = c.clone();
            f(c.named.as_mut().unwrap());
            CommitPayload::decode(&c.encode()).is_err()
        };
        assert!(bad(&|n| n.blocks.swap(0, 1)), "blocks out of order");
        assert!(bad(&|n| n.blocks[1].block = 0), "a block twice");
        assert!(bad(&|n| n.uses.swap(0, 1)), "segments out of order");
        assert!(bad(&|n| n.uses[0].bytes = 0), "a use without bytes");
        assert!(!bad(&|n| n.uses.clear()), "no uses at all is well formed");
        // Without the flag bit the same bytes are an older commit's refs.
        let plain = CommitPayload {
            named: None,
            ..c.clone()
        };
        assert_eq!(CommitPayload::decode(&plain.encode()).unwrap(), plain);
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
