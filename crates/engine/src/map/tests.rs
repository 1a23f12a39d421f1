use super::*;
use crate::error::MetaError;
use cvol_format::checkpoint::SegmentUse;
use cvol_format::CodecTag;
use std::cell::RefCell;
use std::collections::HashMap;

/// Page records kept in memory, keyed by offset.
#[derive(Default)]
struct Records {
    by_offset: RefCell<HashMap<u64, Vec<(u64, MapEntry)>>>,
    next: RefCell<u64>,
    reads: RefCell<u64>,
    /// Directory lists kept apart, keyed by offset, and their reads.
    lists: RefCell<HashMap<u64, Vec<u8>>>,
    list_reads: RefCell<u64>,
    /// Directory blocks' lists as their records hold them, keyed by
    /// offset, and the reads of blocks left unread.
    dirs: RefCell<HashMap<u64, Vec<(u64, PageRef)>>>,
    dir_reads: RefCell<u64>,
}

impl Records {
    /// "Writes" every dirty page of `m` and its directory, as a checkpoint does.
    fn checkpoint(&self, m: &mut BlockMap) -> Vec<PageRef> {
        for (p, snap) in m.take_dirty() {
            let mut entries = Vec::new();
            snap.for_each_mapped(p, &mut |l, e| entries.push((l, e)));
            let r = self.put(entries);
            m.page_written(p, &snap, r);
        }
        for (b, pages) in m.take_dirty_dirs() {
            let r = self.put(Vec::new());
            self.dirs.borrow_mut().insert(r.offset, pages);
            m.dir_written(b, r, None);
        }
        m.take_retired(m.retired().len())
    }

    fn put(&self, entries: Vec<(u64, MapEntry)>) -> PageRef {
        let mut n = self.next.borrow_mut();
        *n += 1;
        self.by_offset.borrow_mut().insert(*n, entries);
        PageRef {
            offset: *n,
            len: 100,
            crc: 0,
            seq: *n,
        }
    }
}

impl PageSource for Records {
    fn load(&self, _page: u64, r: &PageRef) -> Result<Vec<(u64, MapEntry)>, MetaError> {
        *self.reads.borrow_mut() += 1;
        self.by_offset
            .borrow()
            .get(&r.offset)
            .cloned()
            .ok_or_else(|| MetaError::Damaged("no such record".into()))
    }

    fn dir_list(&self, _block: u64, r: &PageRef) -> Result<Vec<u8>, MetaError> {
        *self.list_reads.borrow_mut() += 1;
        (self.lists.borrow().get(&r.offset).cloned())
            .ok_or_else(|| MetaError::Damaged("no such list".into()))
    }

    fn dir_block(&self, _block: u64, r: &PageRef) -> Result<DirLoaded, MetaError> {
        *self.dir_reads.borrow_mut() += 1;
        (self.dirs.borrow().get(&r.offset).cloned())
            .map(DirLoaded::Pages)
            .ok_or_else(|| MetaError::Damaged("no such directory block".into()))
    }
}

fn entry(n: u64) -> MapEntry {
    MapEntry::data(CodecTag::Lz4, n << 20, 100, n as u32)
}

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
    assert_eq!(m.dirty_pages(), 1);
    assert_eq!(m.set(700, MapEntry::UNMAPPED), e);
    assert_eq!(m.set(701, MapEntry::UNMAPPED), MapEntry::ZERO);
    assert_eq!(m.next_allocated_page_lba(0), None);
    assert_eq!((m.dirty_pages(), m.resident_pages()), (0, 0));
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
fn a_checkpoint_writes_only_what_changed_and_clean_pages_can_be_dropped() {
    let src = Records::default();
    let mut m = BlockMap::new(DIR_PAGES * 3 * MAP_PAGE_BLOCKS);
    for p in 0..10u64 {
        m.set(p * MAP_PAGE_BLOCKS + 3, entry(p + 1));
    }
    m.set(2 * DIR_PAGES * MAP_PAGE_BLOCKS, entry(99));
    assert!(src.checkpoint(&mut m).is_empty(), "nothing superseded yet");
    let dirs = m.dir_records().expect("every block written");
    assert_eq!(dirs.len(), 2, "two directory blocks hold pages");
    assert_eq!(m.dirty_pages(), 0);
    // Clean pages go; a change after that needs the page faulted in.
    assert_eq!(m.evict(0), 11);
    assert_eq!(m.resident_pages(), 0);
    m.fault_in(5 * MAP_PAGE_BLOCKS, 6 * MAP_PAGE_BLOCKS, &src)
        .unwrap();
    assert_eq!(m.get(5 * MAP_PAGE_BLOCKS + 3), entry(6));
    m.set(5 * MAP_PAGE_BLOCKS + 4, entry(7));
    let before = m.page_ref(5).unwrap();
    let retired = src.checkpoint(&mut m);
    // The page and its directory block were rewritten: the old ones retire.
    assert_eq!(retired.len(), 2);
    assert_eq!(retired[0], before);
    assert_eq!(m.dir_records().unwrap().len(), 2);
    assert_eq!(*src.reads.borrow(), 1);
    // A scan reads what is not in memory without keeping it.
    let mut n = 0;
    m.scan(Some(&src), |_, _| n += 1).unwrap();
    assert_eq!(n, 12);
    assert_eq!(m.resident_pages(), 1);
    let counts = m.cache_counts();
    assert_eq!((counts.misses, counts.evictions), (1, 11));
    // A client request's lookup counts a page in memory as a hit.
    let missing = |m: &mut BlockMap, a, b| m.missing_pages(a, b, &src).expect("nothing packed");
    assert!(missing(&mut m, 5 * MAP_PAGE_BLOCKS, 6 * MAP_PAGE_BLOCKS).is_empty());
    assert_eq!(missing(&mut m, 0, 2 * MAP_PAGE_BLOCKS).len(), 2);
    assert_eq!(m.cache_counts().hits, 1);
}

#[test]
fn a_page_changed_while_its_checkpoint_writes_it_stays_dirty() {
    let src = Records::default();
    let mut m = BlockMap::new(4 * MAP_PAGE_BLOCKS);
    m.set(1, entry(1));
    m.set(MAP_PAGE_BLOCKS, entry(2));
    let taken = m.take_dirty();
    m.set(2, entry(3)); // after the snapshot: copied on write
    for (p, snap) in &taken {
        let mut entries = Vec::new();
        snap.for_each_mapped(*p, &mut |l, e| entries.push((l, e)));
        let r = src.put(entries);
        m.page_written(*p, snap, r);
    }
    assert_eq!(m.dirty_pages(), 1, "page 0 changed after the snapshot");
    assert_eq!(m.evict(0), 1, "only the clean page goes");
    assert_eq!(m.get(2), entry(3));
    // A page emptied before its record is named keeps none.
    let taken = m.take_dirty();
    m.set(1, MapEntry::UNMAPPED);
    m.set(2, MapEntry::UNMAPPED);
    let (p, snap) = &taken[0];
    m.page_written(*p, snap, src.put(vec![(1, entry(1))]));
    assert_eq!(m.page_ref(0), None);
    assert_eq!(
        m.retired().len(),
        2,
        "the old record and the unneeded new one"
    );
}

#[test]
#[should_panic(expected = "not faulted in")]
fn touching_a_page_not_in_memory_is_a_bug() {
    let src = Records::default();
    let mut m = BlockMap::new(4 * MAP_PAGE_BLOCKS);
    m.set(1, entry(1));
    src.checkpoint(&mut m);
    m.evict(0);
    m.get(2);
}

#[test]
fn a_record_of_another_page_is_refused() {
    let src = Records::default();
    let mut m = BlockMap::new(4 * MAP_PAGE_BLOCKS);
    let r = src.put(vec![(MAP_PAGE_BLOCKS + 1, entry(1))]);
    m.install_unread(0, r);
    let err = m.fault_in(0, 1, &src).unwrap_err();
    assert!(
        matches!(&err, MetaError::Damaged(m) if m.contains("another page")),
        "{err}"
    );
}

#[test]
fn ref_region_bits_cover_every_region_a_range_touches() {
    use super::ref_region_bits;
    let mib = 1u64 << 20;
    assert_eq!(ref_region_bits(0, 1), 1);
    assert_eq!(ref_region_bits(mib - 1, mib + 1), 0b11);
    assert_eq!(ref_region_bits(3 * mib, 4 * mib), 1 << 3);
    // Regions wrap modulo 64; 64 or more regions set every bit.
    assert_eq!(ref_region_bits(65 * mib, 65 * mib + 1), 1 << 1);
    assert_eq!(ref_region_bits(0, 64 * mib), u64::MAX);
    assert_eq!(ref_region_bits(63 * mib, 65 * mib), 1 << 63 | 1);
}

#[test]
fn a_map_of_the_largest_logical_size_costs_what_it_holds() {
    let src = Records::default();
    let blocks = 1u64 << 32;
    let mut m = BlockMap::new(blocks);
    let fresh = m.memory_bytes();
    // A slot chunk holds 2048 pages, a bit chunk 4096: pages on both sides
    // of their edges, far apart, and the last.
    let last_page = blocks / MAP_PAGE_BLOCKS - 1;
    let pages = [0, 2047, 2048, 4095, 4096, 5_000_000, last_page];
    for (n, &p) in pages.iter().enumerate() {
        m.set(p * MAP_PAGE_BLOCKS + 3, entry(n as u64 + 1));
    }
    assert!(fresh < 1 << 20, "an empty map: {fresh} bytes");
    let used = m.memory_bytes();
    assert!(used < 1 << 20, "seven pages of 2^32 blocks: {used} bytes");
    assert_eq!(m.dirty_indexes(), pages.map(|p| p as usize).to_vec());
    let mut found = vec![];
    let mut lba = 0;
    while let Some(l) = m.next_allocated_page_lba(lba) {
        found.push(l / MAP_PAGE_BLOCKS);
        lba = page_end(l);
    }
    assert_eq!(found, pages.to_vec());
    src.checkpoint(&mut m);
    assert_eq!(
        m.dir_records().unwrap().len(),
        5,
        "blocks 0, 1, 2, 2441, 4095"
    );
    assert_eq!(m.evict(0), pages.len());
    m.fault_in(0, blocks, &src).unwrap();
    assert_eq!(m.get(last_page * MAP_PAGE_BLOCKS + 3), entry(7));
    // Emptied, the map gives back what its pages took.
    for &p in &pages {
        m.set(p * MAP_PAGE_BLOCKS + 3, MapEntry::UNMAPPED);
    }
    src.checkpoint(&mut m);
    m.evict(0);
    assert_eq!(m.next_allocated_page_lba(0), None);
    assert_eq!(m.memory_bytes(), fresh + 8 * m.clock.capacity() as u64);
}

/// A ref entry to a record at `offset`.
fn ref_at(offset: u64) -> MapEntry {
    MapEntry::data(CodecTag::Lz4, offset, 100, 7).as_ref_entry()
}

#[test]
fn pages_match_a_model_sparse_until_full_and_keep_their_byte_counts() {
    use super::page::SPARSE_MAX;
    use rand::{Rng, SeedableRng};
    let src = Records::default();
    let pb = MAP_PAGE_BLOCKS;
    let mut m = BlockMap::new(3 * pb);
    let mut model: HashMap<u64, MapEntry> = HashMap::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for step in 0..6000u64 {
        // Page 0 fills up (dense past SPARSE_MAX), page 1 stays sparse-ish,
        // page 2 gains and loses entries.
        let lba = match step % 3 {
            0 => rng.gen_range(0..pb),
            1 => pb + rng.gen_range(0..40),
            _ => 2 * pb + rng.gen_range(0..pb),
        };
        m.fault_in(lba, lba + 1, &src).unwrap();
        let e = match rng.gen_range(0..4) {
            0 if step % 3 != 0 => MapEntry::UNMAPPED,
            1 => ref_at((1 + rng.gen_range(0..64u64)) << 20),
            _ => entry(1 + step),
        };
        let old = model.get(&lba).copied().unwrap_or(MapEntry::UNMAPPED);
        assert_eq!(m.set(lba, e), old, "step {step}: lba {lba}");
        match e.is_unmapped() {
            true => drop(model.remove(&lba)),
            false => drop(model.insert(lba, e)),
        }
        if step % 500 == 499 {
            src.checkpoint(&mut m);
            m.evict(0);
            m.fault_in(0, 3 * pb, &src).unwrap();
        }
        assert_eq!(m.recount_bytes(), (m.cache_bytes(), m.dirty_bytes()));
    }
    for lba in 0..3 * pb {
        let want = model.get(&lba).copied().unwrap_or(MapEntry::UNMAPPED);
        assert_eq!(m.get(lba), want, "lba {lba}");
    }
    for p in 0..3 {
        let used = model.keys().filter(|&&l| l / pb == p).count();
        let Some(page) = m.resident(p as usize) else {
            assert_eq!(used, 0);
            continue;
        };
        assert_eq!(page.used() as usize, used);
        if used <= SPARSE_MAX / 2 {
            assert!(page.is_sparse(), "page {p} with {used} entries");
            assert!(page.memory_bytes() < PAGE_MEMORY_BYTES / 2);
        }
    }
    let full = m.resident(0).expect("page 0");
    assert!(!full.is_sparse(), "{} entries", full.used());
    assert_eq!(full.memory_bytes(), PAGE_MEMORY_BYTES);
}

#[test]
fn one_entry_per_page_costs_a_small_part_of_a_dense_page() {
    // A snapshot's pages after random writes: an old entry or a few each.
    let pages = 1000u64;
    let mut m = BlockMap::new(pages * MAP_PAGE_BLOCKS);
    for p in 0..pages {
        m.set(p * MAP_PAGE_BLOCKS + p % 512, ref_at(p << 20));
    }
    let per_page = m.cache_bytes() / pages;
    assert!(per_page <= 256, "{per_page} bytes a page");
    assert_eq!(m.dirty_bytes(), m.cache_bytes());
    // Summaries of pages in memory and out of it.
    let src = Records::default();
    let bits = |o: u64| super::ref_region_bits(o, o + 1);
    assert!(m.may_refer_to(3, bits(3 << 20)));
    assert!(!m.may_refer_to(3, bits(4 << 20)));
    src.checkpoint(&mut m);
    assert_eq!(m.evict(0), pages as usize);
    assert_eq!((m.cache_bytes(), m.dirty_bytes()), (0, 0));
    assert!(m.may_refer_to(3, bits(3 << 20)), "kept once out of memory");
    assert!(!m.may_refer_to(3, bits(4 << 20)));
    m.fault_in(3 * MAP_PAGE_BLOCKS, 4 * MAP_PAGE_BLOCKS, &src)
        .unwrap();
    m.set(3 * MAP_PAGE_BLOCKS, ref_at(5 << 20));
    assert!(m.may_refer_to(3, bits(3 << 20)) && m.may_refer_to(3, bits(5 << 20)));
    assert!(!m.may_refer_to(3, bits(4 << 20)));
}

/// Block 0's pages 3, 5 and 700 written (their records in `recs`), and
/// their (page, record) list as a directory block names them.
fn written_block() -> (Records, Vec<(u64, PageRef)>) {
    let recs = Records::default();
    let mut m = BlockMap::new(3000 * MAP_PAGE_BLOCKS);
    for p in [3u64, 5, 700] {
        m.set(p * MAP_PAGE_BLOCKS + 1, entry(p));
    }
    recs.checkpoint(&mut m);
    let pages = [3u64, 5, 700]
        .iter()
        .map(|&p| (p, m.page_ref(p as usize).expect("written")))
        .collect();
    (recs, pages)
}

/// Segments of 2 bytes: the test records (offsets 1, 2, ...) lie two to a
/// segment.
const TWO_BYTE_SEGMENTS: Segments = Segments {
    data_offset: 0,
    segment_size: 2,
    count: 1000,
};

/// A map with directory block 0 installed packed: summarized from
/// `summarized`, its list holding `listed`.
fn packed_map(summarized: &[(u64, PageRef)], listed: &[(u64, PageRef)]) -> BlockMap {
    use cvol_format::checkpoint::{DirPayload, DirSummary};
    let s = DirSummary::of(summarized, |o| TWO_BYTE_SEGMENTS.locate(o));
    let raw = DirPayload {
        pages: listed.to_vec(),
    }
    .encode();
    let list = lz4_flex::block::compress_prepend_size(&raw);
    let mut m = BlockMap::new(3000 * MAP_PAGE_BLOCKS);
    m.install_packed_block(0, s, Some(SharedBytes::owned(list)), TWO_BYTE_SEGMENTS);
    m
}

/// `packed_map` with the list kept apart, in `recs` at offset 999 (the
/// block's own record at 998).
fn packed_apart(
    recs: &Records,
    summarized: &[(u64, PageRef)],
    listed: &[(u64, PageRef)],
) -> BlockMap {
    use cvol_format::checkpoint::{DirPayload, DirSummary};
    let s = DirSummary::of(summarized, |o| TWO_BYTE_SEGMENTS.locate(o));
    let raw = DirPayload {
        pages: listed.to_vec(),
    }
    .encode();
    let list = lz4_flex::block::compress_prepend_size(&raw);
    recs.lists.borrow_mut().insert(999, list);
    let at = |offset| PageRef {
        offset,
        len: 100,
        crc: 0,
        seq: offset,
    };
    let mut m = BlockMap::new(3000 * MAP_PAGE_BLOCKS);
    m.install_packed_block(0, s, None, TWO_BYTE_SEGMENTS);
    m.install_dir_record(0, at(998), Some(at(999)));
    m
}

#[test]
fn a_list_kept_apart_is_read_when_its_block_is_first_needed() {
    let (recs, pages) = written_block();
    let mut m = packed_apart(&recs, &pages, &pages);
    assert!(m.is_allocated(3) && m.is_allocated(700) && !m.is_allocated(4));
    // Liveness names the block's record and its list's, and counts the
    // pages by the summary; nothing is read for that.
    let mut named = Vec::new();
    m.for_each_record_use(|o, _| named.push(o), |_| {});
    assert_eq!((named, *recs.list_reads.borrow()), (vec![998, 999], 0));
    assert!(m.dir_record_is(0, 998) && m.dir_record_is(0, 999) && !m.dir_record_is(0, 5));
    m.fault_in(5 * MAP_PAGE_BLOCKS, 5 * MAP_PAGE_BLOCKS + 1, &recs)
        .expect("fault");
    assert_eq!((m.packed_blocks(), *recs.list_reads.borrow()), (0, 1));
    assert_eq!(m.get(5 * MAP_PAGE_BLOCKS + 1), entry(5));
    for &(p, r) in &pages {
        assert_eq!(m.page_ref(p as usize), Some(r));
    }
    // Written again, the block retires its record and its list's.
    m.mark_dir_dirty(0, &recs).expect("decoded");
    let retired: Vec<u64> = recs.checkpoint(&mut m).iter().map(|r| r.offset).collect();
    assert!(
        retired.contains(&998) && retired.contains(&999),
        "{retired:?}"
    );
}

#[test]
fn a_list_kept_apart_that_is_missing_or_wrong_is_damage_not_a_panic() {
    let (recs, pages) = written_block();
    let lba = 5 * MAP_PAGE_BLOCKS;
    for listed in [&pages[..2], &pages[..]] {
        let mut m = packed_apart(&recs, &pages, listed);
        if listed.len() == pages.len() {
            recs.lists.borrow_mut().remove(&999);
        }
        let e = m.fault_in(lba, lba + 1, &recs).expect_err("damage");
        assert!(matches!(e, MetaError::Damaged(_)), "{e}");
        assert!(m.missing_pages(lba, lba + 1, &recs).is_err());
        assert!(m.mark_dir_dirty(0, &recs).is_err());
        assert_eq!(m.packed_blocks(), 1, "still packed, nothing half-installed");
    }
}

#[test]
fn a_packed_directory_block_is_decoded_when_first_needed() {
    let (recs, pages) = written_block();
    let mut m = packed_map(&pages, &pages);
    // Allocation is known from the summary alone.
    assert!(m.is_allocated(3) && m.is_allocated(5) && m.is_allocated(700));
    assert!(!m.is_allocated(4));
    assert_eq!((m.allocated_pages(), m.packed_blocks()), (3, 1));
    // Liveness counts the packed block by its summary, per segment.
    let (mut named, mut by_use) = (0, HashMap::new());
    m.for_each_record_use(
        |_, _| named += 1,
        |u| {
            by_use.insert(u.segment, u.bytes);
        },
    );
    let mut want = HashMap::new();
    for (_, r) in &pages {
        *want.entry(r.offset / 2).or_insert(0) += u64::from(r.len);
    }
    assert_eq!((named, by_use), (0, want));
    // A fault decodes the block, and the page reads its entries.
    m.fault_in(5 * MAP_PAGE_BLOCKS, 5 * MAP_PAGE_BLOCKS + 1, &recs)
        .expect("fault");
    assert_eq!(m.packed_blocks(), 0);
    assert_eq!(m.get(5 * MAP_PAGE_BLOCKS + 1), entry(5));
    for &(p, r) in &pages {
        assert_eq!(m.page_ref(p as usize), Some(r));
    }
    let mut named = 0;
    m.for_each_record_use(|_, _| named += 1, |_| panic!("nothing packed"));
    assert_eq!(named, 3);
}

#[test]
fn a_packed_list_that_disagrees_with_its_summary_is_damage_not_a_panic() {
    let (recs, pages) = written_block();
    let mut other = pages.clone();
    other[1].1.seq += 7;
    for listed in [&other[..], &pages[..2]] {
        let mut m = packed_map(&pages, listed);
        let lba = 5 * MAP_PAGE_BLOCKS;
        let e = m.fault_in(lba, lba + 1, &recs).expect_err("damage");
        assert!(matches!(e, MetaError::Damaged(_)), "{e}");
        assert!(m.missing_pages(lba, lba + 1, &recs).is_err());
        assert!(m.mark_dir_dirty(0, &recs).is_err());
        assert_eq!(m.packed_blocks(), 1, "still packed, nothing half-installed");
    }
}

#[test]
fn a_page_added_to_a_packed_block_is_written_with_its_list() {
    let (recs, pages) = written_block();
    let mut m = packed_map(&pages, &pages);
    // Page 9 has no entries: the fault of its LBAs decodes its block all
    // the same, so that the set below can name its record later.
    m.fault_in(9 * MAP_PAGE_BLOCKS, 10 * MAP_PAGE_BLOCKS, &recs)
        .expect("fault");
    assert_eq!(m.packed_blocks(), 0);
    m.set(9 * MAP_PAGE_BLOCKS, entry(9));
    recs.checkpoint(&mut m);
    let named: Vec<usize> = [3, 5, 9, 700]
        .into_iter()
        .filter(|&p| m.page_ref(p).is_some())
        .collect();
    assert_eq!(named, vec![3, 5, 9, 700]);
}

/// Segments of 4 bytes: the test records' offsets count up from 1.
const SEGMENTS: Segments = Segments {
    data_offset: 0,
    segment_size: 4,
    count: 1 << 20,
};

/// The map `m` reopened as a named directory's commit leaves it: block
/// `read`'s list taken, every other block named by its record alone, and
/// the commit's totals (`named_usage` of `m`) given.
fn reopen_named(m: &mut BlockMap, src: &Records, read: usize, seg: Segments) -> BlockMap {
    let (pages, uses) = m.named_usage(seg);
    let mut n = BlockMap::new(m.blocks());
    for (b, r) in m.dir_records().expect("every block written") {
        if b == read {
            n.install_unread_block(&src.dirs.borrow()[&r.offset]);
            n.install_dir_record(b, r, None);
        } else {
            assert!(n.install_unread_dir(b, r));
            assert!(!n.install_unread_dir(b, r), "a block named twice");
        }
    }
    n.name_unread(pages, &uses, seg).unwrap();
    n
}

/// Per segment, the bytes liveness counts as the map's own.
fn map_bytes(m: &BlockMap, seg: Segments) -> Vec<(u64, u64)> {
    let per = RefCell::new(std::collections::BTreeMap::new());
    let add = |s: u64, bytes: u64| *per.borrow_mut().entry(s).or_insert(0) += bytes;
    m.for_each_record_use(
        |o, l| add(seg.locate(o).unwrap(), u64::from(l)),
        |u| add(u.segment, u.bytes),
    );
    per.into_inner().into_iter().collect()
}

#[test]
fn blocks_left_unread_are_read_when_first_needed_and_hold_what_the_commit_named() {
    let src = Records::default();
    let seg = SEGMENTS;
    let mut m = BlockMap::new(DIR_PAGES * 3 * MAP_PAGE_BLOCKS);
    let pages = [0, 5, DIR_PAGES, DIR_PAGES + 7, 2 * DIR_PAGES + 1];
    for p in pages {
        m.set(p * MAP_PAGE_BLOCKS + 3, entry(p + 1));
    }
    src.checkpoint(&mut m);
    let named = m.named_usage(seg);
    assert_eq!(named.0, 5);
    let mut n = reopen_named(&mut m, &src, 0, seg);
    assert_eq!((n.allocated_pages(), n.unread_blocks()), (5, 2));
    assert_eq!(n.named_usage(seg), named, "the next commit says the same");
    assert_eq!(map_bytes(&n, seg), map_bytes(&m, seg));
    assert_eq!(*src.dir_reads.borrow(), 0, "nothing read at open");
    // Past block 0, a page of unread block 1 may be allocated.
    let first_of = |p: u64| p * MAP_PAGE_BLOCKS;
    assert_eq!(
        n.next_allocated_page_lba(first_of(6)),
        Some(first_of(DIR_PAGES))
    );
    n.fault_in(first_of(DIR_PAGES), first_of(DIR_PAGES + 8), &src)
        .unwrap();
    assert_eq!(*src.dir_reads.borrow(), 1, "block 1's record, once");
    assert_eq!(n.get(first_of(DIR_PAGES + 7) + 3), entry(DIR_PAGES + 8));
    assert_eq!((n.allocated_pages(), n.unread_blocks()), (5, 1));
    assert_eq!(n.named_usage(seg), named);
    assert_eq!(map_bytes(&n, seg), map_bytes(&m, seg));
    // Block 1 is known now: its next page is block 2's first, unread.
    let after = first_of(DIR_PAGES + 8);
    assert_eq!(
        n.next_allocated_page_lba(after),
        Some(first_of(2 * DIR_PAGES))
    );
    n.unpack_all(&src).unwrap();
    assert_eq!((n.unread_blocks(), *src.dir_reads.borrow()), (0, 2));
    assert_eq!(
        n.next_allocated_page_lba(after),
        Some(first_of(2 * DIR_PAGES + 1))
    );
    let records = |m: &BlockMap| {
        let mut v = Vec::new();
        m.for_each_record(|o, l| v.push((o, l)));
        v.sort_unstable();
        v
    };
    assert_eq!(records(&n), records(&m));
    // Written again, a block read at first use retires its record.
    n.set(first_of(DIR_PAGES) + 9, entry(1));
    let before = n.dir_record_of(1).unwrap();
    assert!(src.checkpoint(&mut n).contains(&before));
}

#[test]
#[should_panic(expected = "not faulted in")]
fn a_page_of_an_unread_block_is_refused_until_the_block_is_read() {
    let src = Records::default();
    let seg = SEGMENTS;
    let mut m = BlockMap::new(DIR_PAGES * 2 * MAP_PAGE_BLOCKS);
    m.set(DIR_PAGES * MAP_PAGE_BLOCKS + 3, entry(1));
    m.set(3, entry(2));
    src.checkpoint(&mut m);
    let n = reopen_named(&mut m, &src, 0, seg);
    // An unmapped-looking LBA of the unread block: not known yet.
    n.get(DIR_PAGES * MAP_PAGE_BLOCKS + 600);
}

#[test]
fn totals_that_disagree_with_the_blocks_are_damage() {
    let src = Records::default();
    let seg = SEGMENTS;
    let mut m = BlockMap::new(DIR_PAGES * 2 * MAP_PAGE_BLOCKS);
    for p in [1, 2, DIR_PAGES + 1] {
        m.set(p * MAP_PAGE_BLOCKS, entry(p));
    }
    src.checkpoint(&mut m);
    let (pages, uses) = m.named_usage(seg);
    let dirs = m.dir_records().unwrap();
    let open = |pages: u64, uses: &[SegmentUse]| {
        let mut n = BlockMap::new(m.blocks());
        n.install_unread_block(&src.dirs.borrow()[&dirs[0].1.offset]);
        n.install_dir_record(dirs[0].0, dirs[0].1, None);
        assert!(n.install_unread_dir(dirs[1].0, dirs[1].1));
        n.name_unread(pages, uses, seg).map(|()| n)
    };
    // Fewer pages or bytes than the block read holds: refused at open.
    assert!(open(1, &uses).is_err());
    assert!(open(pages, &[]).is_err());
    // Fewer than the unread block holds: refused when it is read, and the
    // block stays unread (its pages unknown).
    let mut n = open(pages - 1, &uses).unwrap();
    let lba = (DIR_PAGES + 1) * MAP_PAGE_BLOCKS;
    let e = n.fault_in(lba, lba + 1, &src).unwrap_err();
    assert!(e.to_string().contains("more pages"), "{e}");
    assert_eq!(n.unread_blocks(), 1);
    // A record that is not there: damage, the block still unread.
    let mut n = open(pages, &uses).unwrap();
    src.dirs.borrow_mut().clear();
    assert!(n.fault_in(lba, lba + 1, &src).is_err());
    assert_eq!(n.unread_blocks(), 1);
}
