//! Directory blocks open left unread (`FLAG_DIR_NAMED`): a named
//! directory's commit says which block each MAP_DIR holds, how many pages
//! the map has and what its records hold per segment, so open names a
//! block by its record alone and reads nothing of it. The block is read
//! when something first needs it (`unpack`, as for a packed block): its
//! record then says which pages it has, and what it held moves from the
//! unread blocks' totals (`Unread`) to the block. Opening a pool whose
//! snapshots name thousands of directory blocks then costs what the
//! commit holds, not a record per block.
use super::packed::Packed;
use super::sparse::Bits;
use super::{BlockMap, DirBlock, PageSource, Segments, SharedBytes, DIR_SLOTS};
use crate::error::MetaError;
use cvol_format::checkpoint::{DirSummary, PageRef, SegmentUse};

/// A directory block's MAP_DIR record as read when the block is first
/// needed (`PageSource::dir_block`): its list, or its summary and its
/// list compressed, or its summary and the record of its list.
pub enum DirLoaded {
    Pages(Vec<(u64, PageRef)>),
    Summarized(Box<DirSummary>, Vec<u8>),
    Apart(Box<DirSummary>, PageRef),
}

/// What the blocks left unread hold together: the commit's totals less
/// the blocks open read, less each block read since. An unread block has
/// no `DirBlock` (nothing is allocated per block at open): its record is
/// here, and its slot in the directory stays empty until it is read.
pub(super) struct Unread {
    /// Which blocks are still unread, by block (what `records` holds, for
    /// the per-page checks).
    pub(super) set: Bits,
    /// Their MAP_DIR records, by block (ascending).
    pub(super) records: Vec<(usize, PageRef)>,
    /// Their pages with entries.
    pub(super) pages: u64,
    /// Per segment (ascending), the bytes and highest seq of the records
    /// their lists name and of their lists kept apart.
    pub(super) uses: Vec<SegmentUse>,
}

fn damaged(why: String) -> MetaError {
    MetaError::Damaged(why)
}

/// Adds `bytes` (seq `seq`) in segment `segment` to `uses` (ascending).
fn add_use(uses: &mut Vec<SegmentUse>, segment: u64, bytes: u64, seq: u64) {
    match uses.binary_search_by_key(&segment, |u| u.segment) {
        Ok(i) => {
            uses[i].bytes += bytes;
            uses[i].max_seq = uses[i].max_seq.max(seq);
        }
        Err(i) => uses.insert(
            i,
            SegmentUse {
                segment,
                bytes,
                max_seq: seq,
            },
        ),
    }
}

/// Adds record `r` to `uses` in its segment (a record in none: left out,
/// as `DirSummary::of` leaves it).
fn add_ref(uses: &mut Vec<SegmentUse>, segments: Segments, r: &PageRef) {
    if let Some(s) = segments.locate(r.offset) {
        add_use(uses, s, u64::from(r.len), r.seq);
    }
}

/// Takes `less` (per segment) from `from`: every segment of `less` must
/// be in `from` with as many bytes or more. A segment left without bytes
/// goes. On a shortfall `from` is unchanged.
fn take_uses(from: &mut Vec<SegmentUse>, less: &[SegmentUse]) -> Result<(), String> {
    let mut at = Vec::with_capacity(less.len());
    for u in less {
        match from.binary_search_by_key(&u.segment, |f| f.segment) {
            Ok(i) if from[i].bytes >= u.bytes => at.push(i),
            _ => {
                return Err(format!(
                    "the commit's directory names fewer bytes in segment {} than its blocks",
                    u.segment
                ))
            }
        }
    }
    for (&i, u) in at.iter().zip(less) {
        from[i].bytes -= u.bytes;
    }
    from.retain(|u| u.bytes > 0);
    Ok(())
}

/// What a directory block's records other than its MAP_DIR hold: its
/// pages with records (page slots only, not tables) and per segment the
/// bytes and highest seq of its pages', tables' and list's records.
pub(super) struct Holds {
    pages: u64,
    uses: Vec<SegmentUse>,
}

/// The parts of a block `Holds::of` reads.
struct BlockView<'a> {
    refs: &'a [(u16, PageRef)],
    packed: Option<&'a DirSummary>,
    list: Option<PageRef>,
}

fn d_view(d: &DirBlock) -> BlockView<'_> {
    BlockView {
        refs: &d.refs,
        packed: d.packed.as_ref().map(|p| &p.summary),
        list: d.list,
    }
}

impl Holds {
    /// Block `b`'s (of a map of `npages` pages): a packed one's by its
    /// summary, a decoded one's by its records.
    fn of(d: BlockView<'_>, b: usize, npages: usize, segments: Segments) -> Holds {
        let mut uses = Vec::new();
        let note = |uses: &mut Vec<SegmentUse>, r: &PageRef| add_ref(uses, segments, r);
        let pages = match d.packed {
            Some(s) => {
                uses = s.uses.clone();
                u64::from(s.pages)
            }
            None => {
                d.refs.iter().for_each(|(_, r)| note(&mut uses, r));
                let base = b * DIR_SLOTS;
                (d.refs.iter())
                    .filter(|(k, _)| base + (*k as usize) < npages)
                    .count() as u64
            }
        };
        d.list.iter().for_each(|r| note(&mut uses, r));
        Holds { pages, uses }
    }
}

impl Unread {
    /// None unread, of a directory of `blocks` blocks.
    pub(super) fn new(blocks: usize) -> Unread {
        Unread {
            set: Bits::new(blocks),
            records: Vec::new(),
            pages: 0,
            uses: Vec::new(),
        }
    }

    /// Bytes of heap it uses.
    pub(super) fn memory_bytes(&self) -> usize {
        self.set.memory_bytes()
            + self.records.capacity() * std::mem::size_of::<(usize, PageRef)>()
            + self.uses.capacity() * std::mem::size_of::<SegmentUse>()
    }

    /// Blocks still unread.
    pub(super) fn blocks(&self) -> usize {
        self.records.len()
    }

    /// Where block `b`'s record is in `records`.
    fn find(&self, b: usize) -> Result<usize, usize> {
        self.records.binary_search_by_key(&b, |&(k, _)| k)
    }
}

impl DirLoaded {
    /// Its pages with entries, and what its records hold per segment (its
    /// list apart included).
    fn holds(&self, segments: Segments) -> (u64, Vec<SegmentUse>) {
        let note = |uses: &mut Vec<SegmentUse>, r: &PageRef| add_ref(uses, segments, r);
        match self {
            DirLoaded::Pages(pages) => {
                let mut uses = Vec::new();
                pages.iter().for_each(|(_, r)| note(&mut uses, r));
                (pages.len() as u64, uses)
            }
            DirLoaded::Summarized(s, _) => (u64::from(s.pages), s.uses.clone()),
            DirLoaded::Apart(s, list) => {
                let mut uses = s.uses.clone();
                note(&mut uses, list);
                (u64::from(s.pages), uses)
            }
        }
    }

    /// The last page it names.
    fn last_page(&self, b: usize) -> Option<usize> {
        let bitmap_last = |s: &DirSummary| {
            let (i, w) = s.bitmap.iter().enumerate().rev().find(|(_, w)| **w != 0)?;
            Some(b * DIR_SLOTS + i * 64 + 63 - w.leading_zeros() as usize)
        };
        match self {
            DirLoaded::Pages(pages) => pages.last().map(|&(p, _)| p as usize),
            DirLoaded::Summarized(s, _) | DirLoaded::Apart(s, _) => bitmap_last(s),
        }
    }
}

impl BlockMap {
    /// Names directory block `b` at open by its MAP_DIR record `r` alone,
    /// leaving the record unread (clean: the next checkpoint names it
    /// again). False if the block is named already (a commit naming a
    /// block twice: damage).
    pub fn install_unread_dir(&mut self, b: usize, r: PageRef) -> bool {
        let fits = b < self.pages.len() / DIR_SLOTS;
        if !fits || self.dirs.get(b).is_none_or(|d| d.is_some()) {
            return false;
        }
        // A commit names its blocks in ascending order: a push.
        match self.unread.records.last() {
            Some(&(last, _)) if last >= b => match self.unread.find(b) {
                Ok(_) => return false,
                Err(i) => self.unread.records.insert(i, (b, r)),
            },
            _ => self.unread.records.push((b, r)),
        }
        self.unread.set.set(b, true);
        true
    }

    /// Takes the commit's totals for the whole directory, once every block
    /// is named (`install_unread_dir`, or read): its `allocated_pages` and
    /// segment `uses`, less what the blocks read hold, are what the unread
    /// ones hold. Totals smaller than what was read are damage.
    pub fn name_unread(
        &mut self,
        allocated_pages: u64,
        uses: &[SegmentUse],
        segments: Segments,
    ) -> Result<(), MetaError> {
        self.packed_segments = Some(segments);
        let (known, read) = self.read_uses(segments);
        let pages = allocated_pages.checked_sub(known).ok_or_else(|| {
            damaged(format!(
                "the commit's directory names {allocated_pages} pages, its blocks read {known}"
            ))
        })?;
        let mut rest = uses.to_vec();
        take_uses(&mut rest, &read).map_err(damaged)?;
        if self.unread.blocks() == 0 && (pages > 0 || !rest.is_empty()) {
            return Err(damaged(
                "the commit's directory names more than its blocks hold".into(),
            ));
        }
        self.unread.pages = pages;
        self.unread.uses = rest;
        Ok(())
    }

    /// The map pages the blocks not left unread name records of, and per
    /// segment what they name other than their MAP_DIR records: their
    /// pages' and tables' records (a packed block's by its summary) and
    /// their lists kept apart. (A page changed since the last checkpoint
    /// may have entries and no record yet: not counted.) Each block's
    /// share is kept until its records change (`Holds`), so a commit sums
    /// a few uses per block, not a record per page.
    fn read_uses(&mut self, segments: Segments) -> (u64, Vec<SegmentUse>) {
        let npages = self.pages.len();
        let mut all: Vec<SegmentUse> = Vec::new();
        let mut pages = 0u64;
        for (b, d) in (self.dirs.iter_mut().enumerate()).filter_map(|(b, d)| Some((b, d.as_mut()?)))
        {
            if d.holds.is_none() {
                d.holds = Some(Box::new(Holds::of(d_view(d), b, npages, segments)));
            }
            let holds = d.holds.as_ref().expect("made above");
            pages += holds.pages;
            all.extend_from_slice(&holds.uses);
        }
        all.sort_unstable_by_key(|u| u.segment);
        let mut out: Vec<SegmentUse> = Vec::new();
        for u in all {
            match out.last_mut() {
                Some(o) if o.segment == u.segment => {
                    o.bytes += u.bytes;
                    o.max_seq = o.max_seq.max(u.max_seq);
                }
                _ => out.push(u),
            }
        }
        (pages, out)
    }

    /// What a named directory's commit says of the whole map now: the
    /// pages it names records of, and per segment what its records other
    /// than the MAP_DIRs hold (the unread blocks' totals with the
    /// others').
    pub fn named_usage(&mut self, segments: Segments) -> (u64, Vec<SegmentUse>) {
        let (pages, mut uses) = self.read_uses(segments);
        for u in &self.unread.uses {
            add_use(&mut uses, u.segment, u.bytes, u.max_seq);
        }
        (pages + self.unread.pages, uses)
    }

    /// The MAP_DIR record of directory block `b`, if it has one.
    pub fn dir_record_of(&self, b: usize) -> Option<PageRef> {
        match self.dirs.get(b)? {
            Some(d) => d.record,
            None => self.unread_record(b),
        }
    }

    /// The MAP_DIR record of directory block `b` if it is unread.
    pub(super) fn unread_record(&self, b: usize) -> Option<PageRef> {
        if self.unread.blocks() == 0 {
            return None;
        }
        let i = self.unread.find(b).ok()?;
        Some(self.unread.records[i].1)
    }

    /// Directory blocks still unread.
    pub fn unread_blocks(&self) -> usize {
        self.unread.blocks()
    }

    /// Whether page `p`'s directory block is unread (what it holds not
    /// known yet).
    pub(super) fn unread_at(&self, p: usize) -> bool {
        self.unread.blocks() > 0 && self.unread.set.get(p / DIR_SLOTS)
    }

    /// The first page at or after `start` whose directory block is
    /// unread (`start` itself if its block is).
    pub(super) fn next_unread_page(&self, start: usize) -> Option<usize> {
        if self.unread.blocks() == 0 {
            return None;
        }
        let b = self.unread.set.next_set(start / DIR_SLOTS)?;
        Some((b * DIR_SLOTS).max(start))
    }

    /// Reads unread directory block `b`'s record from `src`: its pages
    /// become allocated and the block packed (its list decoded by the
    /// caller, `unpack`), or decoded if its record lists them. What it
    /// holds leaves the unread totals. A record that does not read, names
    /// pages beyond the map's or more than the totals hold is damage, and
    /// the block stays unread.
    pub(super) fn load_unread(&mut self, b: usize, src: &dyn PageSource) -> Result<(), MetaError> {
        let r = self
            .unread_record(b)
            .expect("an unread block has its record");
        self.counts.dir_blocks_read += 1;
        let loaded = src.dir_block(b as u64, &r)?;
        let segments = self.packed_segments.expect("named at open");
        if loaded.last_page(b).is_none_or(|p| p >= self.pages.len()) {
            return Err(damaged(format!(
                "map directory block {b}: its record names no page, or pages beyond the map's"
            )));
        }
        let (pages, uses) = loaded.holds(segments);
        let why = |what: &str| {
            damaged(format!(
                "map directory block {b}: it holds more {what} than the commit's directory names"
            ))
        };
        let left = self
            .unread
            .pages
            .checked_sub(pages)
            .ok_or_else(|| why("pages"))?;
        take_uses(&mut self.unread.uses, &uses).map_err(|_| why("bytes"))?;
        self.unread.pages = left;
        self.unread.set.set(b, false);
        let i = self.unread.find(b).expect("unread above");
        self.unread.records.remove(i);
        assert!(
            self.dirs[b].is_none(),
            "unread block {b} has a directory block"
        );
        self.dirs[b] = Some(Box::new(DirBlock {
            refs: Vec::new(),
            packed: None,
            record: Some(r),
            list: None,
            dirty: false,
            holds: None,
        }));
        match loaded {
            DirLoaded::Pages(list) => {
                list.iter().for_each(|&(p, _)| self.allocate(p as usize));
                let base = (b * DIR_SLOTS) as u64;
                let d = self.dirs[b].as_mut().expect("unread above");
                d.refs = (list.iter())
                    .map(|&(p, r)| ((p - base) as u16, r))
                    .collect();
            }
            DirLoaded::Summarized(summary, list) => {
                let list = Some(SharedBytes::owned(list));
                self.pack_loaded(
                    b,
                    Packed {
                        summary: *summary,
                        list,
                    },
                );
            }
            DirLoaded::Apart(summary, list) => {
                self.dirs[b].as_mut().expect("unread above").list = Some(list);
                self.pack_loaded(
                    b,
                    Packed {
                        summary: *summary,
                        list: None,
                    },
                );
            }
        }
        Ok(())
    }

    /// Makes loaded block `b` packed with `packed`, its pages allocated.
    fn pack_loaded(&mut self, b: usize, packed: Packed) {
        let twice = (self.allocated).or_words(b * DIR_SLOTS, &packed.summary.bitmap);
        assert_eq!(twice, 0, "pages of block {b} allocated twice");
        self.allocated_count += packed.summary.pages as usize;
        self.packed_count += 1;
        let d = self.dirs[b].as_mut().expect("loaded above");
        d.packed = Some(Box::new(packed));
    }
}
