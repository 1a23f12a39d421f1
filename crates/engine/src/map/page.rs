//! A map page in memory: the `PAGE_BLOCKS` entries of its LBAs, held
//! densely (a slot per entry, 6 KiB) or, while at most `SPARSE_MAX` are
//! mapped, sparsely (a bit per entry and the mapped ones in index order).
//! A snapshot's page holds only the old entries of the blocks first
//! changed since it was taken: random writes put a few on each of its
//! pages, and a dense page for each would cost 6 KiB of memory (zeroed)
//! and of cache per entry. A page becomes dense when it outgrows the
//! sparse form and stays so while in memory.
//!
//! `Page` is a handle, shared copy-on-write (cloning it shares the page:
//! a checkpoint's snapshot of the dirty pages); `set` copies a shared one.
use super::{ref_summary, unit_identity, PAGE_BLOCKS, UNIT_WINDOW_BLOCKS};
use cvol_format::checkpoint::MAP_PAGE_BLOCKS;
use cvol_format::MapEntry;
use std::sync::Arc;

/// Most entries a sparse page holds; one more makes it dense.
pub const SPARSE_MAX: usize = 128;
const WORDS: usize = PAGE_BLOCKS / 64;
/// What the allocator adds to each allocation of a page (its `Arc`'s
/// counts, the allocator's header).
const ALLOC_OVERHEAD_BYTES: u64 = 16 + 16;

#[derive(Clone)]
struct Dense {
    loc: [u64; PAGE_BLOCKS],
    crc: [u32; PAGE_BLOCKS],
    /// Entries that are not unmapped.
    used: u32,
}

#[derive(Clone, Default)]
struct Sparse {
    /// Bit `i`: entry `i` is mapped.
    bits: [u64; WORDS],
    /// The mapped entries, in index order.
    entries: Vec<MapEntry>,
}

#[derive(Clone)]
enum Repr {
    Dense(Arc<Dense>),
    Sparse(Arc<Sparse>),
}

#[derive(Clone)]
pub struct Page(Repr);

/// Bytes a dense page in memory takes (the most a page takes).
pub const DENSE_PAGE_BYTES: u64 = std::mem::size_of::<Dense>() as u64 + ALLOC_OVERHEAD_BYTES;

impl Sparse {
    /// Where entry `i` is (or would be) in `entries`.
    fn rank(&self, i: usize) -> usize {
        let (w, b) = (i / 64, i % 64);
        let below: u32 = self.bits[..w].iter().map(|x| x.count_ones()).sum();
        (below + (self.bits[w] & ((1u64 << b) - 1)).count_ones()) as usize
    }

    fn has(&self, i: usize) -> bool {
        self.bits[i / 64] & (1 << (i % 64)) != 0
    }

    fn get(&self, i: usize) -> MapEntry {
        if self.has(i) {
            self.entries[self.rank(i)]
        } else {
            MapEntry::UNMAPPED
        }
    }

    /// Sets entry `i` (room permitting: the caller makes the page dense
    /// first), returning the old one.
    fn set(&mut self, i: usize, e: MapEntry) -> MapEntry {
        let (r, had) = (self.rank(i), self.has(i));
        match (had, e.is_unmapped()) {
            (true, false) => std::mem::replace(&mut self.entries[r], e),
            (true, true) => {
                self.bits[i / 64] &= !(1 << (i % 64));
                self.entries.remove(r)
            }
            (false, false) => {
                self.bits[i / 64] |= 1 << (i % 64);
                self.entries.insert(r, e);
                MapEntry::UNMAPPED
            }
            (false, true) => MapEntry::UNMAPPED,
        }
    }

    fn mapped(&self) -> impl Iterator<Item = (usize, MapEntry)> + '_ {
        let idx = (0..WORDS).flat_map(move |w| {
            let mut x = self.bits[w];
            std::iter::from_fn(move || {
                (x != 0).then(|| {
                    let b = x.trailing_zeros() as usize;
                    x &= x - 1;
                    w * 64 + b
                })
            })
        });
        idx.zip(self.entries.iter().copied())
    }

    fn to_dense(&self) -> Dense {
        let mut d = Dense {
            loc: [0; PAGE_BLOCKS],
            crc: [0; PAGE_BLOCKS],
            used: self.entries.len() as u32,
        };
        for (i, e) in self.mapped() {
            d.loc[i] = e.loc;
            d.crc[i] = e.crc;
        }
        d
    }
}

impl Page {
    /// A page without entries (sparse).
    pub(super) fn empty() -> Page {
        Page(Repr::Sparse(Arc::default()))
    }

    /// A page from the entries of its record (`PageSource::load`); None if
    /// an entry lies outside page `p`.
    pub fn from_entries(p: u64, entries: &[(u64, MapEntry)]) -> Option<Page> {
        if (entries.iter()).any(|&(lba, e)| lba / MAP_PAGE_BLOCKS != p || e.is_unmapped()) {
            return None;
        }
        let at = |lba: u64| (lba % MAP_PAGE_BLOCKS) as usize;
        if entries.len() <= SPARSE_MAX {
            let mut page = Page::empty();
            for &(lba, e) in entries {
                page.set(at(lba), e);
            }
            return Some(page);
        }
        let mut d = Dense {
            loc: [0; PAGE_BLOCKS],
            crc: [0; PAGE_BLOCKS],
            used: 0,
        };
        for &(lba, e) in entries {
            let i = at(lba);
            d.used += u32::from(d.loc[i] == 0);
            d.loc[i] = e.loc;
            d.crc[i] = e.crc;
        }
        Some(Page(Repr::Dense(Arc::new(d))))
    }

    /// Entries that are not unmapped.
    pub fn used(&self) -> u32 {
        match &self.0 {
            Repr::Dense(d) => d.used,
            Repr::Sparse(s) => s.entries.len() as u32,
        }
    }

    /// Whether the page is held sparsely.
    pub fn is_sparse(&self) -> bool {
        matches!(self.0, Repr::Sparse(_))
    }

    /// Bytes of memory the page takes.
    pub fn memory_bytes(&self) -> u64 {
        match &self.0 {
            Repr::Dense(_) => DENSE_PAGE_BYTES,
            Repr::Sparse(s) => {
                let entries = s.entries.capacity() * std::mem::size_of::<MapEntry>();
                let buffer = if entries > 0 { ALLOC_OVERHEAD_BYTES } else { 0 };
                (std::mem::size_of::<Sparse>() + entries) as u64 + ALLOC_OVERHEAD_BYTES + buffer
            }
        }
    }

    /// Whether `a` and `b` are the same page (one shared, not a copy).
    pub fn same(a: &Page, b: &Page) -> bool {
        match (&a.0, &b.0) {
            (Repr::Dense(x), Repr::Dense(y)) => Arc::ptr_eq(x, y),
            (Repr::Sparse(x), Repr::Sparse(y)) => Arc::ptr_eq(x, y),
            _ => false,
        }
    }

    pub(super) fn entry(&self, i: usize) -> MapEntry {
        match &self.0 {
            Repr::Dense(d) => MapEntry {
                loc: d.loc[i],
                crc: d.crc[i],
            },
            Repr::Sparse(s) => s.get(i),
        }
    }

    /// Sets entry `i`, returning the old one; a shared page is copied
    /// first, a sparse page that would outgrow its form becomes dense.
    pub(super) fn set(&mut self, i: usize, e: MapEntry) -> MapEntry {
        if let Repr::Sparse(s) = &self.0 {
            if s.entries.len() >= SPARSE_MAX && !s.has(i) && !e.is_unmapped() {
                self.0 = Repr::Dense(Arc::new(s.to_dense()));
            }
        }
        match &mut self.0 {
            Repr::Dense(d) => {
                let d = Arc::make_mut(d);
                let old = MapEntry {
                    loc: d.loc[i],
                    crc: d.crc[i],
                };
                d.loc[i] = e.loc;
                d.crc[i] = e.crc;
                d.used = (d.used + u32::from(!e.is_unmapped()))
                    .checked_sub(u32::from(!old.is_unmapped()))
                    .expect("a page's count of used entries matches its entries");
                old
            }
            Repr::Sparse(s) => Arc::make_mut(s).set(i, e),
        }
    }

    /// This page's reference summary (`ref_summary`).
    pub(super) fn ref_summary(&self) -> u64 {
        let mut sum = 0;
        self.for_each_mapped(0, &mut |_, e| sum |= ref_summary(std::iter::once(e)));
        sum
    }

    /// `BlockMap::window_owners` for entry `i` of this page, counting only
    /// the entries of the record whose identity (`unit_identity`) is
    /// `ident`, if given: two records at one offset (a segment reused
    /// between a checkpoint and a crash) are told apart.
    pub fn window_owners(&self, i: usize, offset: u64, ident: Option<u32>) -> u32 {
        let w = UNIT_WINDOW_BLOCKS;
        let first = i / w * w;
        (first..first + w)
            .map(|j| self.entry(j))
            .filter(|e| e.is_unit_owner_of(offset))
            .filter(|e| ident.is_none_or(|id| unit_identity(e.crc) == id))
            .count() as u32
    }

    /// Calls `f(i, before, after)` for every entry `i` that differs
    /// between `before` and `after` (None: a page without entries).
    pub fn for_each_change(
        before: Option<&Page>,
        after: Option<&Page>,
        f: &mut impl FnMut(usize, MapEntry, MapEntry),
    ) {
        let at = |page: Option<&Page>, i: usize| page.map_or(MapEntry::UNMAPPED, |p| p.entry(i));
        for i in 0..PAGE_BLOCKS {
            let (b, a) = (at(before, i), at(after, i));
            if b != a {
                f(i, b, a);
            }
        }
    }

    /// Calls `f(lba, entry)` for every entry of page `p` that is not
    /// unmapped, in LBA order.
    pub fn for_each_mapped(&self, p: usize, f: &mut impl FnMut(u64, MapEntry)) {
        let lba = |i: usize| (p * PAGE_BLOCKS + i) as u64;
        match &self.0 {
            Repr::Dense(d) => {
                for i in 0..PAGE_BLOCKS {
                    if d.loc[i] != 0 {
                        f(
                            lba(i),
                            MapEntry {
                                loc: d.loc[i],
                                crc: d.crc[i],
                            },
                        );
                    }
                }
            }
            Repr::Sparse(s) => s.mapped().for_each(|(i, e)| f(lba(i), e)),
        }
    }
}
