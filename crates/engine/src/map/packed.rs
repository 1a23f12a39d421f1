//! Directory blocks left packed at open (`FLAG_DIR_SUMMARY`): a
//! summarized MAP_DIR record says which pages of its block have records,
//! and their bytes and highest seq per segment, before the compressed
//! list of those records. Open takes the summary (the pages' allocation
//! and what liveness needs) and keeps the list compressed; the list is
//! decoded when something first needs a page record of the block
//! (`unpack_*`): a fault, a change, a checkpoint, the cleaner. Opening a
//! map with many pages then costs what the summaries hold, not a decode
//! per page (a pool's snapshots name hundreds of thousands of pages).
//! A list kept apart from its summary (`FLAG_DIR_LIST_APART`) is not even
//! read at open: it is read, from the record the summary names, when the
//! block is decoded.
use super::{BlockMap, DirBlock, PageSource, DIR_SLOTS, PAGE_BLOCKS};
use crate::error::MetaError;
use cvol_format::checkpoint::{DirPayload, DirSummary, PageRef, SegmentUse, DIR_ENTRY_BYTES};
use std::ops::Range;
use std::sync::Arc;

/// A packed block: its summary and its compressed list, or None when the
/// list lies apart (in the record `DirBlock::list` names).
pub(super) struct Packed {
    pub(super) summary: DirSummary,
    pub(super) list: Option<SharedBytes>,
}

/// A range of a buffer several records were read into together, which
/// each range keeps alive: open keeps packed blocks' lists where the
/// read put them, rather than copying each (a pool's snapshots hold
/// thousands of directory blocks, megabytes of lists).
#[derive(Clone)]
pub struct SharedBytes {
    buf: Arc<Vec<u8>>,
    range: Range<usize>,
}

impl SharedBytes {
    /// `buf[range]`.
    pub fn new(buf: Arc<Vec<u8>>, range: Range<usize>) -> SharedBytes {
        assert!(range.end <= buf.len(), "a range of its buffer");
        SharedBytes { buf, range }
    }

    /// All of `v`.
    pub fn owned(v: Vec<u8>) -> SharedBytes {
        let range = 0..v.len();
        SharedBytes {
            buf: Arc::new(v),
            range,
        }
    }

    /// The bytes from `at` on.
    pub fn tail(&self, at: usize) -> SharedBytes {
        assert!(at <= self.range.len(), "a tail within the bytes");
        SharedBytes::new(self.buf.clone(), self.range.start + at..self.range.end)
    }

    /// Bytes of the buffer these are a range of (what keeping them holds).
    pub fn buffer_bytes(&self) -> usize {
        self.buf.len()
    }

    /// The bytes as a vector of their own (no copy when they are the
    /// whole of a buffer nothing else holds).
    pub fn into_vec(self) -> Vec<u8> {
        if self.range == (0..self.buf.len()) {
            match Arc::try_unwrap(self.buf) {
                Ok(v) => return v,
                Err(buf) => return buf[self.range].to_vec(),
            }
        }
        self.buf[self.range].to_vec()
    }
}

impl std::ops::Deref for SharedBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[self.range.clone()]
    }
}

/// Where the log's segments lie: how a summary's segments are checked
/// against the records its list names.
#[derive(Clone, Copy, Debug)]
pub struct Segments {
    pub data_offset: u64,
    pub segment_size: u64,
    pub count: u64,
}

impl Segments {
    pub fn of(sb: &cvol_format::Superblock) -> Segments {
        Segments {
            data_offset: sb.data_offset_bytes,
            segment_size: sb.segment_size_bytes,
            count: sb.segment_count(),
        }
    }

    /// The segment holding the log offset `offset`, if any.
    pub fn locate(&self, offset: u64) -> Option<u64> {
        let s = offset.checked_sub(self.data_offset)? / self.segment_size;
        (s < self.count).then_some(s)
    }
}

impl BlockMap {
    /// Installs directory block `b` at open from its summarized record:
    /// its pages allocated (left on disk), its list kept compressed where
    /// it was read, or (None) left unread in its own record, which
    /// `install_dir_record` names.
    pub fn install_packed_block(
        &mut self,
        b: usize,
        summary: DirSummary,
        list: Option<SharedBytes>,
        segments: Segments,
    ) {
        assert!(
            self.dirs[b].is_none(),
            "directory block {b} installed twice"
        );
        self.packed_segments = Some(segments);
        // No page of the block is allocated yet (it had no directory
        // block), so none is in memory: its pages' bits are set a word at
        // a time.
        assert!(
            (b + 1) * DIR_SLOTS <= self.pages.len(),
            "block {b} holds table slots"
        );
        let twice = self.allocated.or_words(b * DIR_SLOTS, &summary.bitmap);
        assert_eq!(twice, 0, "pages of block {b} allocated twice");
        self.allocated_count += summary.pages as usize;
        self.packed_count += 1;
        self.dirs[b] = Some(Box::new(DirBlock {
            refs: Vec::new(),
            packed: Some(Box::new(Packed { summary, list })),
            record: None,
            list: None,
            dirty: true,
            holds: None,
        }));
    }

    /// Directory blocks still packed.
    pub fn packed_blocks(&self) -> usize {
        self.packed_count
    }

    /// Decodes directory block `b`'s list if it is packed (a list kept
    /// apart read from `src` first). A list that does not read or decode,
    /// or disagrees with its summary, is damage.
    pub fn unpack(&mut self, b: usize, src: &dyn PageSource) -> Result<(), MetaError> {
        if self.unread_record(b).is_some() {
            self.load_unread(b, src)?;
        }
        let Some(d) = self.dirs.get_mut(b).and_then(|d| d.as_mut()) else {
            return Ok(());
        };
        let Some(packed) = d.packed.take() else {
            return Ok(());
        };
        let segments = self
            .packed_segments
            .expect("set with the first packed block");
        let read = match (&packed.list, d.list) {
            (Some(_), _) => Ok(None),
            (None, Some(r)) => {
                self.counts.dir_lists_read += 1;
                src.dir_list(b as u64, &r).map(Some)
            }
            (None, None) => panic!("packed directory block {b} without its list"),
        };
        let decoded = read.and_then(|apart| {
            let list = packed
                .list
                .as_deref()
                .or(apart.as_deref())
                .unwrap_or_default();
            decode_list(b, &packed.summary, list, segments)
        });
        match decoded {
            Ok(refs) => {
                d.refs = refs;
                self.packed_count -= 1;
                Ok(())
            }
            Err(e) => {
                d.packed = Some(packed);
                Err(e)
            }
        }
    }

    /// `unpack` of every directory block holding a page of the LBAs
    /// [first, end).
    pub fn unpack_lbas(
        &mut self,
        first: u64,
        end: u64,
        src: &dyn PageSource,
    ) -> Result<(), MetaError> {
        let end = end.min(self.blocks);
        if first >= end || self.packed_count + self.unread.blocks() == 0 {
            return Ok(());
        }
        let block_lbas = (DIR_SLOTS * PAGE_BLOCKS) as u64;
        for b in first / block_lbas..end.div_ceil(block_lbas) {
            self.unpack(b as usize, src)?;
        }
        Ok(())
    }

    /// `unpack` of the directory block of page `p`.
    pub fn unpack_page(&mut self, p: usize, src: &dyn PageSource) -> Result<(), MetaError> {
        self.unpack(p / DIR_SLOTS, src)
    }

    /// Marks every directory block with a record whose list is not kept
    /// apart changed (decoding it if packed): the next checkpoint writes
    /// each summarized with its list apart (an older volume's blocks,
    /// unsummarized or with their lists inline), so that later opens read
    /// their summaries alone.
    pub fn mark_inline_lists_dirty(&mut self, src: &dyn PageSource) -> Result<(), MetaError> {
        for b in 0..self.dirs.len() {
            let inline =
                (self.dirs[b].as_ref()).is_some_and(|d| d.record.is_some() && d.list.is_none());
            if inline {
                self.mark_dir_dirty(b, src)?;
            }
        }
        Ok(())
    }

    /// `unpack` of every directory block: what whole-map walks (`scan`,
    /// `for_each_record`, `cvol check`) need first.
    pub fn unpack_all(&mut self, src: &dyn PageSource) -> Result<(), MetaError> {
        for b in 0..self.dirs.len() {
            if self.packed_count + self.unread.blocks() == 0 {
                break;
            }
            self.unpack(b, src)?;
        }
        Ok(())
    }

    /// Calls `rec(offset, len)` for every record the map names that its
    /// directory holds decoded (pages, tables and directory blocks), and
    /// `uses(use)` for the page records of the packed blocks, by segment,
    /// and for what the unread blocks name other than their records
    /// (`name_unread`): what liveness counts as the map's own live bytes.
    pub fn for_each_record_use(
        &self,
        mut rec: impl FnMut(u64, u32),
        mut uses: impl FnMut(&SegmentUse),
    ) {
        for d in self.dirs.iter().flatten() {
            for r in [d.record, d.list].iter().flatten() {
                rec(r.offset, r.len);
            }
            match &d.packed {
                Some(p) => p.summary.uses.iter().for_each(&mut uses),
                None => d.refs.iter().for_each(|(_, r)| rec(r.offset, r.len)),
            }
        }
        for (_, r) in &self.unread.records {
            rec(r.offset, r.len);
        }
        self.unread.uses.iter().for_each(&mut uses);
    }
}

/// The list of packed block `b` (`list`: its compressed bytes), decoded
/// and checked against its summary.
fn decode_list(
    b: usize,
    summary: &DirSummary,
    list: &[u8],
    segments: Segments,
) -> Result<Vec<(u16, PageRef)>, MetaError> {
    let d = decode_summarized(b as u64, summary, list, segments)
        .map_err(|why| MetaError::Damaged(format!("map directory block {b}: {why}")))?;
    let base = (b * DIR_SLOTS) as u64;
    Ok((d.pages.into_iter())
        .map(|(p, r)| ((p - base) as u16, r))
        .collect())
}

/// The page list of summarized directory block `block` (`list`: as its
/// record holds it, lz4 with its size first), decoded and checked against
/// `summary`: the same pages, and per segment of `segments` the same
/// bytes and highest seq.
pub fn decode_summarized(
    block: u64,
    summary: &DirSummary,
    list: &[u8],
    segments: Segments,
) -> Result<DirPayload, String> {
    let max = DIR_SLOTS * DIR_ENTRY_BYTES;
    let declared = (list.get(..4)).map(|n| u32::from_le_bytes(n.try_into().expect("4 bytes")));
    if declared.is_none_or(|n| n as usize > max) {
        return Err("its page list is longer than a block".into());
    }
    let raw = lz4_flex::block::decompress_size_prepended(list)
        .map_err(|e| format!("its page list does not decompress: {e}"))?;
    let d = DirPayload::decode(&raw, block).map_err(|e| e.to_string())?;
    if DirSummary::of(&d.pages, |o| segments.locate(o)) != *summary {
        return Err("its page list disagrees with its summary".into());
    }
    Ok(d)
}
