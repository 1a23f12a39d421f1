//! In-memory block map: LBA -> MapEntry, allocated in pages of 512 entries
//! (12 bytes each), so memory follows written space, not logical size.
//! Pages are shared copy-on-write with snapshots (`BlockMap::snapshot`), so
//! a checkpoint encodes a consistent map outside the volume lock while
//! writers go on: a page changed after the snapshot is copied once.
use cvol_format::MapEntry;
use std::sync::Arc;

pub const PAGE_BLOCKS: usize = 512;

#[derive(Clone)]
struct Page {
    loc: [u64; PAGE_BLOCKS],
    crc: [u32; PAGE_BLOCKS],
    /// Entries that are not unmapped.
    used: u32,
}

pub struct BlockMap {
    pages: Vec<Option<Arc<Page>>>,
    /// One bit per page, set while it is allocated: finding the next
    /// allocated page reads 64 slots a word, so scans of a large sparse
    /// volume cost what is mapped, not the logical size.
    allocated: Vec<u64>,
    blocks: u64,
}

impl BlockMap {
    pub fn new(blocks: u64) -> BlockMap {
        let npages = (blocks as usize).div_ceil(PAGE_BLOCKS);
        BlockMap {
            pages: (0..npages).map(|_| None).collect(),
            allocated: vec![0; npages.div_ceil(64)],
            blocks,
        }
    }

    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    pub fn get(&self, lba: u64) -> MapEntry {
        assert!(lba < self.blocks, "lba {lba} beyond map");
        let (p, i) = split(lba);
        match &self.pages[p] {
            Some(page) => MapEntry {
                loc: page.loc[i],
                crc: page.crc[i],
            },
            None => MapEntry::UNMAPPED,
        }
    }

    /// Sets an entry, returning the previous one.
    pub fn set(&mut self, lba: u64, e: MapEntry) -> MapEntry {
        assert!(lba < self.blocks, "lba {lba} beyond map");
        let (p, i) = split(lba);
        if self.pages[p].is_none() {
            if e.is_unmapped() {
                return MapEntry::UNMAPPED;
            }
            self.pages[p] = Some(Arc::new(Page {
                loc: [0; PAGE_BLOCKS],
                crc: [0; PAGE_BLOCKS],
                used: 0,
            }));
            self.allocated[p / 64] |= 1 << (p % 64);
        }
        let page = Arc::make_mut(self.pages[p].as_mut().expect("page allocated above"));
        let old = MapEntry {
            loc: page.loc[i],
            crc: page.crc[i],
        };
        page.loc[i] = e.loc;
        page.crc[i] = e.crc;
        page.used = (page.used + u32::from(!e.is_unmapped()))
            .checked_sub(u32::from(!old.is_unmapped()))
            .expect("a page's count of used entries matches its entries");
        debug_assert!(page.used as usize <= PAGE_BLOCKS);
        if page.used == 0 {
            self.pages[p] = None;
            self.allocated[p / 64] &= !(1 << (p % 64));
        }
        old
    }

    /// Calls `f(lba, entry)` for every entry that is not unmapped, in LBA order.
    pub fn for_each_mapped(&self, mut f: impl FnMut(u64, MapEntry)) {
        for (p, page) in self.allocated_pages() {
            page.for_each_mapped(p, &mut f);
        }
    }

    /// The map as it is now, sharing its pages: O(allocated pages), and
    /// later changes to this map copy the pages they touch.
    pub fn snapshot(&self) -> MapSnapshot {
        let pages = self
            .allocated_pages()
            .map(|(p, page)| (p, Arc::clone(page)))
            .collect();
        MapSnapshot { pages }
    }

    /// The allocated pages and their indexes, in order.
    fn allocated_pages(&self) -> impl Iterator<Item = (usize, &Arc<Page>)> + '_ {
        let mut next = self.next_allocated_page(0);
        std::iter::from_fn(move || {
            let p = next?;
            next = self.next_allocated_page(p + 1);
            let page = self.pages[p]
                .as_ref()
                .expect("an allocated page's bit is set");
            Some((p, page))
        })
    }

    /// Next LBA >= `lba` whose page is allocated (a fast skip over holes).
    pub fn next_allocated_page_lba(&self, lba: u64) -> Option<u64> {
        let start = usize::try_from(lba).ok()? / PAGE_BLOCKS;
        self.next_allocated_page(start)
            .map(|p| ((p * PAGE_BLOCKS) as u64).max(lba))
            .filter(|&l| l < self.blocks)
    }

    /// The first allocated page at or after page `start`.
    fn next_allocated_page(&self, start: usize) -> Option<usize> {
        let mut word = start / 64;
        let mut bits = *self.allocated.get(word)? & (u64::MAX << (start % 64));
        while bits == 0 {
            word += 1;
            bits = *self.allocated.get(word)?;
        }
        let p = word * 64 + bits.trailing_zeros() as usize;
        debug_assert!(self.pages[p].is_some(), "page {p}'s bit without a page");
        Some(p)
    }

    /// The mapped (not unmapped) LBAs in [lba, end) of the first allocated
    /// page at or after `lba`, and where the next page starts; None when no
    /// allocated page starts before `end`. Callers may change entries of the
    /// batch before asking for the next one.
    pub fn next_mapped_batch(&self, lba: u64, end: u64) -> Option<(Vec<u64>, u64)> {
        let first = self.next_allocated_page_lba(lba).filter(|&p| p < end)?;
        let next = page_end(first);
        let lbas = (first..next.min(end))
            .filter(|&l| !self.get(l).is_unmapped())
            .collect();
        Some((lbas, next))
    }

    /// Is any entry in [first, end) mapped?
    pub fn any_mapped(&self, first: u64, end: u64) -> bool {
        let mut lba = first;
        while let Some((lbas, next)) = self.next_mapped_batch(lba, end) {
            if !lbas.is_empty() {
                return true;
            }
            lba = next;
        }
        false
    }

    /// Bytes of heap this map uses.
    pub fn memory_bytes(&self) -> u64 {
        let pages = self.pages.iter().filter(|p| p.is_some()).count();
        (self.pages.capacity() * std::mem::size_of::<Option<Arc<Page>>>()
            + self.allocated.capacity() * std::mem::size_of::<u64>()
            + pages * std::mem::size_of::<Page>()) as u64
    }
}

impl Page {
    /// Calls `f(lba, entry)` for every entry of page `p` that is not unmapped.
    fn for_each_mapped(&self, p: usize, f: &mut impl FnMut(u64, MapEntry)) {
        for i in 0..PAGE_BLOCKS {
            if self.loc[i] != 0 {
                f(
                    (p * PAGE_BLOCKS + i) as u64,
                    MapEntry {
                        loc: self.loc[i],
                        crc: self.crc[i],
                    },
                );
            }
        }
    }
}

/// A frozen copy of a map (`BlockMap::snapshot`).
pub struct MapSnapshot {
    pages: Vec<(usize, Arc<Page>)>,
}

impl MapSnapshot {
    /// Calls `f(lba, entry)` for every entry that is not unmapped, in LBA order.
    pub fn for_each_mapped(&self, mut f: impl FnMut(u64, MapEntry)) {
        for (p, page) in &self.pages {
            page.for_each_mapped(*p, &mut f);
        }
    }
}

/// The first LBA of the page after the one holding `lba`.
pub fn page_end(lba: u64) -> u64 {
    (lba / PAGE_BLOCKS as u64 + 1) * PAGE_BLOCKS as u64
}

fn split(lba: u64) -> (usize, usize) {
    ((lba as usize) / PAGE_BLOCKS, (lba as usize) % PAGE_BLOCKS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cvol_format::CodecTag;

    #[test]
    fn set_get_and_page_release() {
        let mut m = BlockMap::new(2000);
        assert_eq!(m.get(1999), MapEntry::UNMAPPED);
        let e = MapEntry::data(CodecTag::Lz4, 1 << 20, 100, 9);
        assert_eq!(m.set(700, e), MapEntry::UNMAPPED);
        assert_eq!(m.set(701, MapEntry::ZERO), MapEntry::UNMAPPED);
        assert_eq!(m.get(700), e);
        let mut seen = vec![];
        m.for_each_mapped(|l, e| seen.push((l, e)));
        assert_eq!(seen, vec![(700, e), (701, MapEntry::ZERO)]);
        assert_eq!(m.next_allocated_page_lba(0), Some(512));
        assert_eq!(m.next_mapped_batch(0, 2000), Some((vec![700, 701], 1024)));
        assert_eq!(m.next_mapped_batch(701, 2000), Some((vec![701], 1024)));
        assert_eq!(m.next_mapped_batch(1024, 2000), None);
        assert!(m.any_mapped(0, 701) && !m.any_mapped(0, 700) && !m.any_mapped(702, 2000));
        assert_eq!(m.set(700, MapEntry::UNMAPPED), e);
        assert_eq!(m.set(701, MapEntry::UNMAPPED), MapEntry::ZERO);
        assert_eq!(m.next_allocated_page_lba(0), None);
        assert!(m.memory_bytes() < 100);
    }

    #[test]
    fn next_allocated_page_crosses_words_and_the_end() {
        let blocks = 200 * PAGE_BLOCKS as u64 + 7;
        let mut m = BlockMap::new(blocks);
        let e = MapEntry::ZERO;
        for lba in [0, 63 * 512 + 3, 64 * 512, 130 * 512 + 9, blocks - 1] {
            m.set(lba, e);
        }
        let mut pages = vec![];
        let mut lba = 0;
        while let Some(p) = m.next_allocated_page_lba(lba) {
            pages.push(p / PAGE_BLOCKS as u64);
            lba = page_end(p);
        }
        assert_eq!(pages, vec![0, 63, 64, 130, 200]);
        assert_eq!(m.next_allocated_page_lba(64 * 512 + 1), Some(64 * 512 + 1));
        assert_eq!(m.next_allocated_page_lba(blocks), None);
        assert_eq!(m.next_allocated_page_lba(u64::MAX), None);
        m.set(64 * 512, MapEntry::UNMAPPED);
        assert_eq!(m.next_allocated_page_lba(64 * 512), Some(130 * 512));
        let mut n = 0;
        m.for_each_mapped(|_, _| n += 1);
        assert_eq!(n, 4);
    }

    #[test]
    fn a_snapshot_keeps_the_map_as_it_was() {
        let mut m = BlockMap::new(4096);
        let a = MapEntry::data(CodecTag::Lz4, 1 << 20, 100, 1);
        let b = MapEntry::data(CodecTag::Lz4, 2 << 20, 100, 2);
        m.set(1, a);
        m.set(600, a);
        let snap = m.snapshot();
        m.set(1, b);
        m.set(600, MapEntry::UNMAPPED);
        m.set(2000, b);
        let mut seen = vec![];
        snap.for_each_mapped(|l, e| seen.push((l, e)));
        assert_eq!(seen, vec![(1, a), (600, a)]);
        let mut now = vec![];
        m.for_each_mapped(|l, e| now.push((l, e)));
        assert_eq!(now, vec![(1, b), (2000, b)]);
    }
}
