//! The block map: LBA -> MapEntry, in pages of `PAGE_BLOCKS` entries (12
//! bytes each), paged: every page with entries has a MAP_CHUNK record in
//! the log once a checkpoint (or an eviction) wrote it, named by the map's
//! *directory* (`DirBlock`s of `DIR_PAGES` pages, each a MAP_DIR record);
//! a page not changed since its record may be dropped from memory
//! (`evict`) and read back on demand (`fault_in`, through a `PageSource`).
//!
//! Callers fault in the pages they touch before `get` or `set`, and within
//! one hold of the volume's state lock; eviction happens only when the lock
//! is taken (`Volume::lock_state`), so a page faulted in stays until the
//! lock is released. `get` or `set` on a page that is not in memory is a
//! bug, and panics.
//!
//! Pages in memory are shared copy-on-write with a checkpoint's snapshot
//! (`take_dirty`): a page changed while the checkpoint encodes it is
//! copied once, and stays dirty for the next one.
use crate::error::MetaError;
use cvol_format::checkpoint::{PageRef, DIR_PAGES, MAP_PAGE_BLOCKS};
use cvol_format::MapEntry;
pub use page::Page;
use sparse::{Bits, Slots};
use std::collections::VecDeque;

pub const PAGE_BLOCKS: usize = MAP_PAGE_BLOCKS as usize;
/// The aligned window every block of a unit lies in.
pub const UNIT_WINDOW_BLOCKS: usize = cvol_format::record::UNIT_BLOCKS_MAX as usize;
const _: () = assert!(PAGE_BLOCKS.is_multiple_of(UNIT_WINDOW_BLOCKS));

/// What identifies a unit's record in its entries' crc (the record's crc
/// xor the block index, below 16): all but the low 4 bits.
pub fn unit_identity(entry_crc: u32) -> u32 {
    entry_crc & !(UNIT_WINDOW_BLOCKS as u32 - 1)
}

const DIR_SLOTS: usize = DIR_PAGES as usize;

/// Bytes one page in memory takes at most (a dense one).
pub const PAGE_MEMORY_BYTES: u64 = page::DENSE_PAGE_BYTES;

/// Reads a page's record: what `fault_in` calls on a miss.
pub trait PageSource {
    /// The entries of page `page`, from the record `r` names (verified).
    fn load(&self, page: u64, r: &PageRef) -> Result<Vec<(u64, MapEntry)>, MetaError>;

    /// The list of directory block `block` from the record `r` names, a
    /// block's list kept apart from its summary (verified: a MAP_DIR of
    /// that block with `r`'s crc): its lz4 bytes, length prepended.
    fn dir_list(&self, block: u64, r: &PageRef) -> Result<Vec<u8>, MetaError>;

    /// The MAP_DIR record `r` of directory block `block`, left unread at
    /// open (`FLAG_DIR_NAMED`), read and verified (a MAP_DIR of that block
    /// with `r`'s crc and seq).
    fn dir_block(&self, block: u64, r: &PageRef) -> Result<DirLoaded, MetaError>;
}

/// Log bytes per region of a page's reference summary.
const REF_REGION_BYTES_LOG2: u32 = 20;

/// The summary bits of the log bytes [base, end): region `offset >> 20`
/// is bit `region % 64` (every bit beyond 64 regions).
pub fn ref_region_bits(base: u64, end: u64) -> u64 {
    assert!(base < end);
    let (first, last) = (
        base >> REF_REGION_BYTES_LOG2,
        (end - 1) >> REF_REGION_BYTES_LOG2,
    );
    if last - first >= 63 {
        return u64::MAX;
    }
    (first..=last).fold(0, |acc, r| acc | 1 << (r % 64))
}

/// The reference summary of a page's `entries`: the log regions
/// (`ref_region_bits`) its ref entries point into.
pub fn ref_summary(entries: impl Iterator<Item = MapEntry>) -> u64 {
    entries
        .filter_map(|e| e.ref_offset())
        .fold(0, |acc, offset| acc | ref_region_bits(offset, offset + 1))
}

/// One directory block: where the record of each of its pages is.
struct DirBlock {
    /// (slot in the block, record) of its pages that have one, by slot:
    /// memory for what is named, not for the `DIR_SLOTS` pages of a block.
    refs: Vec<(u16, PageRef)>,
    /// Its list still compressed, `refs` empty meanwhile (`packed`).
    packed: Option<Box<packed::Packed>>,
    /// Its MAP_DIR record, once written.
    record: Option<PageRef>,
    /// The record of its list, when the list lies apart from `record`
    /// (`FLAG_DIR_LIST_APART`): written, named and retired with it.
    list: Option<PageRef>,
    /// Changed since `record` was written.
    dirty: bool,
    /// What its pages' and list's records hold (`unread::Holds`), kept
    /// until they change: what each commit sums (`named_usage`).
    holds: Option<Box<unread::Holds>>,
}

impl DirBlock {
    fn get(&self, k: usize) -> Option<PageRef> {
        let at = self.refs.binary_search_by_key(&(k as u16), |&(s, _)| s);
        at.ok().map(|i| self.refs[i].1)
    }

    /// Names `r` as slot `k`'s record, returning the one named before.
    fn replace(&mut self, k: usize, r: Option<PageRef>) -> Option<PageRef> {
        self.holds = None;
        let key = k as u16;
        match (self.refs.binary_search_by_key(&key, |&(s, _)| s), r) {
            (Ok(i), Some(r)) => Some(std::mem::replace(&mut self.refs[i].1, r)),
            (Ok(i), None) => Some(self.refs.remove(i).1),
            (Err(i), Some(r)) => {
                self.refs.insert(i, (key, r));
                None
            }
            (Err(_), None) => None,
        }
    }
}

const _: () = assert!(DIR_SLOTS <= 1 << 16);

/// Counters of the page cache.
#[derive(Debug, Default, Clone, Copy)]
pub struct CacheCounts {
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// Page records the open that made this map read to verify them
    /// (pages it left on disk unverified are verified when first read).
    pub verified_at_open: u64,
    /// Directory lists kept apart read to decode their packed blocks.
    pub dir_lists_read: u64,
    /// Directory blocks open left unread, read when first needed.
    pub dir_blocks_read: u64,
}

/// A page in memory, and its reference summary (`BlockMap::ref_sums`),
/// next to it: a change to a ref entry updates it where the page's slot
/// was just read.
struct Resident {
    page: Page,
    sum: u64,
}

pub struct BlockMap {
    /// Pages in memory (`Slots` and `Bits` cost what they hold: a map
    /// of 2^32 blocks with a few pages used takes a few KiB, not the
    /// logical size's share).
    pages: Slots<Resident>,
    /// The pages with entries (in memory or not): finding the next
    /// allocated page skips holes a chunk or a word at a time, so scans of
    /// a large sparse volume cost what is mapped, not the logical size.
    allocated: Bits,
    /// The pages changed since their record was written (or that have
    /// none): they stay in memory until a checkpoint writes them.
    dirty: Bits,
    dirty_count: usize,
    /// Memory of the dirty pages (`Page::memory_bytes`).
    dirty_bytes: u64,
    dirs: Vec<Option<Box<DirBlock>>>,
    /// Directory blocks still packed (`packed`).
    packed_count: usize,
    /// What the blocks left unread at open hold (`unread`).
    unread: unread::Unread,
    /// Where the log's segments lie, once a block is packed.
    packed_segments: Option<packed::Segments>,
    /// Records no longer named (superseded pages and directory blocks):
    /// live until a checkpoint that no longer names them is durable.
    retired: Vec<PageRef>,
    /// Pages in memory, oldest first (second-chance order); may hold
    /// stale indexes of pages dropped since.
    clock: VecDeque<usize>,
    /// The pages used since the clock last passed them.
    touched: Bits,
    resident: usize,
    /// Memory of the pages in memory.
    resident_bytes: u64,
    /// Pages with entries.
    allocated_count: usize,
    counts: CacheCounts,
    blocks: u64,
    /// Directory slots after the pages' that name the persisted liveness
    /// tables (`liveness::tables`), none in maps of scans and tests.
    tables: usize,
    /// While recording (recovery's roll-forward): every page read from its
    /// record, as read (`record_originals`).
    originals: Option<Vec<(usize, Page)>>,
    /// Reference summaries (`ref_region_bits` of every ref entry's record
    /// offset) of the pages not in memory that had any, kept after they
    /// left it (a page in memory keeps its own, `Resident::sum`); a page
    /// with a summary bit in `summed` and none here has no ref entry. A
    /// page that has not been in memory since the map was made (open
    /// leaves pages on disk) has none yet. Bits are only added while a
    /// page changes (a superset, never a miss), and recomputed when it
    /// comes into memory. The cleaner scans only the pages whose summary
    /// may name its victim (`may_refer_to`).
    ref_sums: rustc_hash::FxHashMap<usize, u64>,
    summed: Bits,
}

impl BlockMap {
    pub fn new(blocks: u64) -> BlockMap {
        BlockMap::with_tables(blocks, 0)
    }

    /// The map of a volume: its `blocks` and `tables` directory slots for
    /// liveness tables after its pages'.
    pub fn with_tables(blocks: u64, tables: usize) -> BlockMap {
        let npages = (blocks as usize).div_ceil(PAGE_BLOCKS);
        BlockMap {
            ref_sums: rustc_hash::FxHashMap::default(),
            summed: Bits::new(npages),
            pages: Slots::new(npages),
            allocated: Bits::new(npages),
            dirty: Bits::new(npages),
            dirty_count: 0,
            dirty_bytes: 0,
            dirs: (0..(npages + tables).div_ceil(DIR_SLOTS))
                .map(|_| None)
                .collect(),
            packed_count: 0,
            unread: unread::Unread::new((npages + tables).div_ceil(DIR_SLOTS)),
            packed_segments: None,
            retired: Vec::new(),
            clock: VecDeque::new(),
            touched: Bits::new(npages),
            resident: 0,
            resident_bytes: 0,
            allocated_count: 0,
            counts: CacheCounts::default(),
            blocks,
            tables,
            originals: None,
        }
    }

    /// From here on, keeps every page read from its record as it was read
    /// (recovery: the pages roll-forward changes, before it changed them).
    pub fn record_originals(&mut self) {
        self.originals.get_or_insert_with(Vec::new);
    }

    /// The pages kept since `record_originals` (None if not recording), and
    /// stops recording.
    pub fn take_originals(&mut self) -> Option<Vec<(usize, Page)>> {
        self.originals.take()
    }

    /// Page `p` if it is in memory.
    pub fn resident(&self, p: usize) -> Option<&Page> {
        self.pages.get(p).map(|r| &r.page)
    }

    /// Whether page `p` has entries (in memory or not). Its directory
    /// block must have been read (`unpack_page`).
    pub fn is_allocated(&self, p: usize) -> bool {
        assert!(
            !self.unread_at(p),
            "page {p} asked of before its block was read"
        );
        self.allocated.get(p)
    }

    /// The pages changed since their records were written.
    pub fn dirty_indexes(&self) -> Vec<usize> {
        let mut out = Vec::with_capacity(self.dirty_count);
        out.extend(self.dirty.ones());
        out
    }

    /// Directory slots for liveness tables.
    pub fn tables(&self) -> usize {
        self.tables
    }

    /// The directory slot of table `t`.
    fn table_slot(&self, t: usize) -> usize {
        assert!(t < self.tables, "table {t} of {}", self.tables);
        self.pages.len() + t
    }

    /// Table `t`'s record, if it has one.
    pub fn table_ref(&self, t: usize) -> Option<PageRef> {
        self.page_ref(self.table_slot(t))
    }

    /// Names `r` as table `t`'s record (None: it has none), retiring the
    /// one named before.
    pub fn set_table_ref(&mut self, t: usize, r: Option<PageRef>) {
        self.set_ref(self.table_slot(t), r);
    }

    /// The tables in [first, end) that have a record, in table order: what
    /// is named, not every slot (a pool's table slots number millions).
    pub fn table_refs(&self, first: usize, end: usize) -> Vec<(usize, PageRef)> {
        let end = end.min(self.tables);
        if first >= end {
            return Vec::new();
        }
        let base = self.pages.len();
        let (lo, hi) = (base + first, base + end);
        let mut out = Vec::new();
        for b in lo / DIR_SLOTS..hi.div_ceil(DIR_SLOTS) {
            let Some(d) = self.dirs.get(b).and_then(|d| d.as_ref()) else {
                continue;
            };
            assert!(d.packed.is_none(), "directory block {b} read while packed");
            for &(k, r) in &d.refs {
                let slot = b * DIR_SLOTS + usize::from(k);
                if (lo..hi).contains(&slot) {
                    out.push((slot - base, r));
                }
            }
        }
        out
    }

    /// The table whose directory slot is `slot`, if it is one.
    pub fn table_of_slot(&self, slot: u64) -> Option<usize> {
        let t = usize::try_from(slot).ok()?.checked_sub(self.pages.len())?;
        (t < self.tables).then_some(t)
    }

    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    pub fn get(&self, lba: u64) -> MapEntry {
        assert!(lba < self.blocks, "lba {lba} beyond map");
        let (p, i) = split(lba);
        match self.pages.get(p) {
            Some(r) => r.page.entry(i),
            None => {
                assert!(
                    !self.allocated.get(p) && !self.unread_at(p),
                    "map page {p} not faulted in"
                );
                MapEntry::UNMAPPED
            }
        }
    }

    /// Owner entries of the unit at `offset` (unit entries that are not
    /// refs) in the unit window of `lba`: the aligned `UNIT_BLOCKS_MAX`
    /// blocks around it, where every owner of a unit lies (a unit's blocks
    /// lie inside one such window, `cvol_format::record`). Its page must be
    /// in memory (or have no entries).
    pub fn window_owners(&self, lba: u64, offset: u64) -> u32 {
        assert!(lba < self.blocks, "lba {lba} beyond map");
        let (p, i) = split(lba);
        let Some(r) = self.pages.get(p) else {
            assert!(
                !self.allocated.get(p) && !self.unread_at(p),
                "map page {p} not faulted in"
            );
            return 0;
        };
        r.page.window_owners(i, offset, None)
    }

    /// Sets an entry, returning the previous one. Its page must be in
    /// memory (or have no entries).
    pub fn set(&mut self, lba: u64, e: MapEntry) -> MapEntry {
        assert!(lba < self.blocks, "lba {lba} beyond map");
        let (p, i) = split(lba);
        if !self.pages.has(p) {
            assert!(
                !self.allocated.get(p) && !self.unread_at(p),
                "map page {p} not faulted in"
            );
            if e.is_unmapped() {
                return MapEntry::UNMAPPED;
            }
            self.insert(p, Page::empty());
            self.allocate(p);
        }
        self.mark_dirty(p);
        let r = self.pages.get_mut(p).expect("page in memory above");
        if let Some(offset) = e.ref_offset() {
            r.sum |= ref_region_bits(offset, offset + 1);
        }
        let before = r.page.memory_bytes();
        let old = r.page.set(i, e);
        let (after, used) = (r.page.memory_bytes(), r.page.used());
        debug_assert!(used as usize <= PAGE_BLOCKS);
        // The page is dirty (marked above): both sums follow its size.
        self.resident_bytes = self.resident_bytes + after - before;
        self.dirty_bytes = self.dirty_bytes + after - before;
        if used == 0 {
            self.drop_page(p);
        }
        old
    }

    /// A page that lost its last entry: no memory, no record.
    fn drop_page(&mut self, p: usize) {
        let page = self.pages.take(p).expect("a page in memory").page;
        self.resident -= 1;
        self.resident_bytes -= page.memory_bytes();
        self.ref_sums.remove(&p);
        self.summed.set(p, false);
        self.touched.set(p, false);
        self.allocated.set(p, false);
        self.allocated_count -= 1;
        if self.dirty.get(p) {
            self.dirty.set(p, false);
            self.dirty_count -= 1;
            self.dirty_bytes -= page.memory_bytes();
        }
        self.set_ref(p, None);
    }

    fn allocate(&mut self, p: usize) {
        assert!(!self.allocated.get(p), "page {p} allocated twice");
        self.allocated.set(p, true);
        self.allocated_count += 1;
    }

    /// Takes `sum` as page `p`'s reference summary (`ref_summary` of all
    /// its entries).
    pub fn learn_summary(&mut self, p: usize, sum: u64) {
        match (self.pages.get_mut(p), sum) {
            (Some(r), _) => r.sum = sum,
            (None, 0) => drop(self.ref_sums.remove(&p)),
            (None, sum) => drop(self.ref_sums.insert(p, sum)),
        };
        self.summed.set(p, true);
    }

    /// Whether page `p` may hold a ref entry to a record in the log bytes
    /// whose summary bits are `bits` (`ref_region_bits`): false only if
    /// its summary is known and has none of them.
    pub fn may_refer_to(&self, p: usize, bits: u64) -> bool {
        if let Some(r) = self.pages.get(p) {
            return r.sum & bits != 0;
        }
        !self.summed.get(p) || self.ref_sums.get(&p).is_some_and(|&s| s & bits != 0)
    }

    /// Pages with entries (in memory or not; those of unread blocks
    /// counted by the commit that named them).
    pub fn allocated_pages(&self) -> usize {
        self.allocated_count + self.unread.pages as usize
    }

    fn insert(&mut self, p: usize, page: Page) {
        debug_assert!(!self.pages.has(p));
        let sum = page.ref_summary();
        self.ref_sums.remove(&p);
        self.summed.set(p, true);
        self.resident_bytes += page.memory_bytes();
        self.pages.put(p, Resident { page, sum });
        self.resident += 1;
        self.clock.push_back(p);
        self.touched.set(p, true);
    }

    /// Marks page `p` (in memory) changed since its record.
    pub fn mark_dirty(&mut self, p: usize) {
        debug_assert!(self.pages.has(p));
        if !self.dirty.get(p) {
            self.dirty.set(p, true);
            self.dirty_count += 1;
            self.dirty_bytes += self.pages.get(p).map_or(0, |r| r.page.memory_bytes());
        }
    }

    /// Names `r` as page `p`'s record (None: it has none), retiring the
    /// record named before.
    fn set_ref(&mut self, p: usize, r: Option<PageRef>) {
        let (b, k) = (p / DIR_SLOTS, p % DIR_SLOTS);
        assert!(!self.unread_at(p), "directory block {b} changed unread");
        if self.dirs[b].is_none() {
            if r.is_none() {
                return;
            }
            self.dirs[b] = Some(Box::new(DirBlock {
                refs: Vec::new(),
                packed: None,
                record: None,
                list: None,
                dirty: true,
                holds: None,
            }));
        }
        let d = self.dirs[b].as_mut().expect("made above");
        assert!(
            d.packed.is_none(),
            "directory block {b} changed while packed"
        );
        let old = d.replace(k, r);
        d.dirty = true;
        self.retired.extend(old);
    }

    /// Page `p`'s record, if it has one.
    pub fn page_ref(&self, p: usize) -> Option<PageRef> {
        assert!(!self.unread_at(p), "page {p}'s directory block unread");
        let d = self.dirs[p / DIR_SLOTS].as_ref()?;
        assert!(
            d.packed.is_none(),
            "page {p}'s directory block read while packed"
        );
        d.get(p % DIR_SLOTS)
    }

    /// Makes sure every page holding an LBA of [first, end) is in memory,
    /// reading those that are not from `src`.
    pub fn fault_in(
        &mut self,
        first: u64,
        end: u64,
        src: &dyn PageSource,
    ) -> Result<(), MetaError> {
        let end = end.min(self.blocks);
        self.unpack_lbas(first, end, src)?;
        let mut lba = first;
        while let Some(l) = self.next_allocated_page_lba(lba).filter(|&l| l < end) {
            self.fault_page(l as usize / PAGE_BLOCKS, src)?;
            lba = page_end(l);
        }
        Ok(())
    }

    /// The pages of [first, end) with entries that are not in memory, and
    /// their records: what `fault_in` would read. The lookup of a client
    /// request: its pages in memory count as hits (a miss counts when the
    /// page is read). Directory blocks of the range still packed are
    /// decoded (a list kept apart read from `src`).
    pub fn missing_pages(
        &mut self,
        first: u64,
        end: u64,
        src: &dyn PageSource,
    ) -> Result<Vec<(usize, PageRef)>, MetaError> {
        let end = end.min(self.blocks);
        self.unpack_lbas(first, end, src)?;
        let mut out = Vec::new();
        let mut lba = first;
        while let Some(l) = self.next_allocated_page_lba(lba).filter(|&l| l < end) {
            let p = l as usize / PAGE_BLOCKS;
            if !self.pages.has(p) {
                let r = self.page_ref(p).expect("a page not in memory has a record");
                out.push((p, r));
            } else {
                self.counts.hits += 1;
            }
            lba = page_end(l);
        }
        Ok(out)
    }

    /// Puts page `p`, read from record `r` without the volume's lock, in
    /// memory, if it is still missing and `r` still its record (it may
    /// have been read, rewritten or emptied meanwhile). True if it was.
    pub fn install_read(&mut self, p: usize, page: Page, r: &PageRef) -> bool {
        let current = !self.pages.has(p) && self.page_ref(p).as_ref() == Some(r);
        if current {
            self.counts.misses += 1;
            self.insert(p, page);
        }
        current
    }

    /// `fault_in` for one page (allocated or not).
    pub fn fault_page(&mut self, p: usize, src: &dyn PageSource) -> Result<(), MetaError> {
        if self.pages.has(p) {
            self.touched.set(p, true);
            return Ok(());
        }
        self.unpack_page(p, src)?;
        if !self.allocated.get(p) {
            return Ok(());
        }
        self.counts.misses += 1;
        let page = self.read_page(p, src)?;
        if let Some(o) = self.originals.as_mut() {
            o.push((p, page.clone()));
        }
        self.insert(p, page);
        Ok(())
    }

    fn read_page(&self, p: usize, src: &dyn PageSource) -> Result<Page, MetaError> {
        let r = self
            .page_ref(p)
            .expect("an allocated page not in memory has a record");
        let entries = src.load(p as u64, &r)?;
        match Page::from_entries(p as u64, &entries) {
            Some(page) if page.used() > 0 => Ok(page),
            _ => Err(MetaError::Damaged(format!(
                "map page {p}'s record holds entries of another page"
            ))),
        }
    }

    /// Drops clean pages, least recently used first, until the pages in
    /// memory take at most `max_bytes` (dirty pages stay: a checkpoint must
    /// write them first). Returns how many it dropped.
    pub fn evict(&mut self, max_bytes: u64) -> usize {
        // Only clean pages go: with more dirty pages than the cache holds
        // there is nothing to look for until a checkpoint cleans them, and
        // the clock is passed at most a few times per page to drop, so a
        // cache full of dirty pages costs nothing per call.
        let clean = self.resident_bytes - self.dirty_bytes;
        let want = self.resident_bytes.saturating_sub(max_bytes).min(clean);
        // Pages to drop, at most (the smallest page takes 64 bytes or more).
        let pages = usize::try_from(want.div_ceil(64)).unwrap_or(usize::MAX);
        let mut passes = pages
            .saturating_mul(4)
            .saturating_add(64)
            .min(self.clock.len() * 2);
        let (mut dropped, mut freed) = (0, 0);
        while freed < want && passes > 0 {
            passes -= 1;
            let Some(p) = self.clock.pop_front() else {
                break;
            };
            if !self.pages.has(p) {
                continue; // a stale index: dropped since
            }
            if self.touched.get(p) || self.dirty.get(p) {
                self.touched.set(p, false);
                self.clock.push_back(p);
                continue;
            }
            let Resident { page, sum } = self.pages.take(p).expect("in memory above");
            if sum != 0 {
                self.ref_sums.insert(p, sum);
            }
            self.resident -= 1;
            self.resident_bytes -= page.memory_bytes();
            freed += page.memory_bytes();
            dropped += 1;
        }
        if self.clock.len() > 2 * self.resident + 64 {
            let pages = &self.pages;
            self.clock.retain(|&p| pages.has(p));
        }
        self.counts.evictions += dropped as u64;
        dropped
    }

    pub fn resident_pages(&self) -> usize {
        self.resident
    }

    pub fn dirty_pages(&self) -> usize {
        self.dirty_count
    }

    /// Memory of the dirty pages.
    pub fn dirty_bytes(&self) -> u64 {
        self.dirty_bytes
    }

    pub fn cache_counts(&self) -> CacheCounts {
        self.counts
    }

    /// The dirty pages, shared, for a checkpoint to write. They stay dirty
    /// (in memory) until `page_written` names their record.
    pub fn take_dirty(&self) -> Vec<(usize, Page)> {
        let page = |p: usize| self.resident(p).expect("a dirty page is in memory");
        (self.dirty_indexes().into_iter())
            .map(|p| (p, page(p).clone()))
            .collect()
    }

    /// Names record `r`, just written from `snap` (page `p` as
    /// `take_dirty` handed it out), as the page's record; the page is
    /// clean if it has not changed since. A page that has lost its entries
    /// since keeps none (the record is retired at once).
    pub fn page_written(&mut self, p: usize, snap: &Page, r: PageRef) {
        if !self.allocated.get(p) {
            self.retired.push(r);
            return;
        }
        self.set_ref(p, Some(r));
        // Its summary afresh (bits are only added while a page changes, so
        // one whose references moved again and again would name the whole
        // log): the page is in memory, written pages are dirty ones.
        if let Some(sum) = self.resident(p).map(|live| live.ref_summary()) {
            self.learn_summary(p, sum);
        }
        let live = self.resident(p).filter(|c| Page::same(c, snap));
        if let Some(bytes) = live.map(Page::memory_bytes).filter(|_| self.dirty.get(p)) {
            self.dirty.set(p, false);
            self.dirty_count -= 1;
            self.dirty_bytes -= bytes;
        }
    }

    /// The first `n` records retired (the oldest).
    pub fn take_retired(&mut self, n: usize) -> Vec<PageRef> {
        self.retired.drain(..n).collect()
    }

    /// Records retired and not yet taken.
    pub fn retired(&self) -> &[PageRef] {
        &self.retired
    }

    /// Calls `f(offset, len)` for every record the map names (pages and
    /// directory blocks): live data of their segments.
    /// No directory block may be packed (`unpack_all`; liveness counts
    /// packed blocks by their summaries, `for_each_record_use`).
    pub fn for_each_record(&self, mut f: impl FnMut(u64, u32)) {
        assert_eq!(self.packed_count, 0, "records of packed directory blocks");
        assert_eq!(
            self.unread.blocks(),
            0,
            "records of unread directory blocks"
        );
        for d in self.dirs.iter().flatten() {
            for r in [d.record, d.list].iter().flatten() {
                f(r.offset, r.len);
            }
            d.refs.iter().for_each(|(_, r)| f(r.offset, r.len));
        }
    }

    /// Calls `f(lba, entry)` for every entry that is not unmapped, in LBA
    /// order; pages not in memory are read from `src` (and not kept).
    pub fn scan(
        &self,
        src: Option<&dyn PageSource>,
        mut f: impl FnMut(u64, MapEntry),
    ) -> Result<(), MetaError> {
        assert_eq!(self.packed_count, 0, "a scan of packed directory blocks");
        assert_eq!(self.unread.blocks(), 0, "a scan of unread directory blocks");
        let mut next = self.next_allocated_page(0);
        while let Some(p) = next {
            match (self.resident(p), src) {
                (Some(page), _) => page.for_each_mapped(p, &mut f),
                (None, Some(src)) => self.read_page(p, src)?.for_each_mapped(p, &mut f),
                (None, None) => panic!("map page {p} not faulted in"),
            }
            next = self.next_allocated_page(p + 1);
        }
        Ok(())
    }

    /// Calls `f(lba, entry)` for every entry that is not unmapped, in LBA
    /// order. Every allocated page must be in memory (recovery's maps).
    pub fn for_each_mapped(&self, f: impl FnMut(u64, MapEntry)) {
        self.scan(None, f).expect("no page is read");
    }

    /// `for_each_mapped` of the LBAs of [first, end) whose pages are in
    /// memory (the others are skipped).
    pub fn for_each_mapped_in(&self, first: u64, end: u64, mut f: impl FnMut(u64, MapEntry)) {
        let in_range = |p: &usize| ((*p * PAGE_BLOCKS) as u64) < end;
        let mut next = self
            .next_allocated_page(first as usize / PAGE_BLOCKS)
            .filter(in_range);
        while let Some(p) = next {
            if let Some(page) = self.resident(p) {
                page.for_each_mapped(p, &mut |lba, e| {
                    if (first..end).contains(&lba) {
                        f(lba, e)
                    }
                });
            }
            next = self.next_allocated_page(p + 1).filter(in_range);
        }
    }

    /// Next LBA >= `lba` whose page is allocated (a fast skip over holes),
    /// or whose directory block is unread (which may hold one: callers
    /// read the blocks of their range first, `unpack_lbas`, and a page of
    /// an unread block is refused as not faulted in).
    pub fn next_allocated_page_lba(&self, lba: u64) -> Option<u64> {
        let start = usize::try_from(lba).ok()? / PAGE_BLOCKS;
        let next = match (
            self.next_allocated_page(start),
            self.next_unread_page(start),
        ) {
            (Some(a), Some(u)) => Some(a.min(u)),
            (a, u) => a.or(u),
        };
        next.map(|p| ((p * PAGE_BLOCKS) as u64).max(lba))
            .filter(|&l| l < self.blocks)
    }

    /// The first allocated page at or after page `start`.
    fn next_allocated_page(&self, start: usize) -> Option<usize> {
        self.allocated.next_set(start)
    }

    /// The mapped (not unmapped) LBAs in [lba, end) of the first allocated
    /// page at or after `lba` (which must be in memory), and where the next
    /// page starts; None when no allocated page starts before `end`.
    /// Callers may change entries of the batch before asking for the next.
    pub fn next_mapped_batch(&self, lba: u64, end: u64) -> Option<(Vec<u64>, u64)> {
        let first = self.next_allocated_page_lba(lba).filter(|&p| p < end)?;
        let next = page_end(first);
        let lbas = (first..next.min(end))
            .filter(|&l| !self.get(l).is_unmapped())
            .collect();
        Some((lbas, next))
    }

    /// Is any entry in [first, end) mapped? The pages holding `first` and
    /// `end - 1` must be in memory; a page wholly inside the range is
    /// mapped if it has entries.
    pub fn any_mapped(&self, first: u64, end: u64) -> bool {
        let Some(l) = self.next_allocated_page_lba(first).filter(|&l| l < end) else {
            return false;
        };
        let (p_start, p_end) = (l - l % MAP_PAGE_BLOCKS, page_end(l));
        if first <= p_start && p_end <= end {
            return true;
        }
        (l..p_end.min(end)).any(|x| !self.get(x).is_unmapped()) || self.any_mapped(p_end, end)
    }

    /// Bytes of heap this map uses.
    pub fn memory_bytes(&self) -> u64 {
        let dirs: usize = (self.dirs.iter().flatten())
            .map(|d| {
                let packed = d.packed.as_ref().map_or(0, |p| {
                    p.list.as_ref().map_or(0, |l| l.len())
                        + p.summary.uses.capacity() * 24
                        + DIR_SLOTS / 8
                        + 64
                });
                d.refs.capacity() * std::mem::size_of::<(u16, PageRef)>() + packed + 64
            })
            .sum();
        let bits = [&self.allocated, &self.dirty, &self.touched, &self.summed];
        (self.pages.memory_bytes()
            + bits.iter().map(|b| b.memory_bytes()).sum::<usize>()
            + self.dirs.capacity() * 8
            + dirs
            + self.unread.memory_bytes()
            + self.clock.capacity() * 8
            + self.ref_sums.capacity() * 24) as u64
            + self.resident_bytes
    }

    /// Bytes of the pages in memory.
    pub fn cache_bytes(&self) -> u64 {
        self.resident_bytes
    }

    /// The bytes of the pages in memory and of the dirty ones, summed
    /// afresh (what `cache_bytes` and `dirty_bytes` keep).
    #[cfg(test)]
    fn recount_bytes(&self) -> (u64, u64) {
        let mut sums = (0, 0);
        for p in 0..self.pages.len() {
            if let Some(r) = self.pages.get(p) {
                sums.0 += r.page.memory_bytes();
                if self.dirty.get(p) {
                    sums.1 += r.page.memory_bytes();
                }
            }
        }
        sums
    }
}

/// The first LBA of the page after the one holding `lba`.
pub fn page_end(lba: u64) -> u64 {
    (lba / PAGE_BLOCKS as u64 + 1) * PAGE_BLOCKS as u64
}

fn split(lba: u64) -> (usize, usize) {
    ((lba as usize) / PAGE_BLOCKS, (lba as usize) % PAGE_BLOCKS)
}

mod dirs;
mod install;
mod packed;
pub use packed::{decode_summarized, Segments, SharedBytes};
mod unread;
pub use unread::DirLoaded;
mod page;
mod sparse;
#[cfg(test)]
mod tests;
