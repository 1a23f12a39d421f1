use super::*;

fn row(key: u64) -> FpRow {
    FpRow {
        fp: key,
        loc: key * 10,
        crc: key as u32 ^ 0xabcd,
        owner: key as u32 + 1,
    }
}

fn rows(keys: &[u64]) -> Arc<[FpRow]> {
    keys.iter().map(|&k| row(k)).collect()
}

/// `n` rows with keys `base..base + n`.
fn run(base: u64, n: u64) -> Arc<[FpRow]> {
    (base..base + n).map(row).collect()
}

/// The invariants every call keeps: within budget, and hashbrown never
/// grew a map behind the cache's back.
fn check(c: &TableCache) {
    assert!(
        c.memory_bytes() <= c.budget,
        "{} > {}",
        c.memory_bytes(),
        c.budget
    );
    assert!(c.keys.map.capacity() as u64 <= full_capacity(c.keys.buckets));
    assert!(c.cached.map.capacity() as u64 <= full_capacity(c.cached.buckets));
    assert_eq!(c.lru.len() as u64, c.tables());
}

#[test]
fn lookup_finds_table_and_row() {
    let mut c = TableCache::new(1 << 20);
    c.insert(7, rows(&[10, 11, 12]));
    let hit = c.lookup(11).expect("cached");
    assert_eq!(
        hit,
        CacheHit {
            entry: MapEntry {
                loc: 110,
                crc: 11 ^ 0xabcd
            },
            owner: 12,
            table: 7,
            row: 1,
            rows: 3,
        }
    );
    assert_eq!(c.lookup(99), None);
    assert_eq!(c.lookup(0), None);
    assert_eq!(c.hits(7), Some(1));
    assert_eq!(c.hits(8), None);
    assert!(c.contains(7) && !c.contains(8));
    assert_eq!((c.tables(), c.keys()), (1, 3));
    check(&c);
}

#[test]
fn newest_table_wins_a_shared_key() {
    let mut c = TableCache::new(1 << 20);
    c.insert(1, rows(&[5, 6]));
    c.insert(2, rows(&[6, 7]));
    assert_eq!(c.lookup(6).map(|h| (h.table, h.row)), Some((2, 0)));
    // The older table leaving keeps the newer table's key.
    c.remove(1);
    assert_eq!(c.lookup(6).map(|h| (h.table, h.row)), Some((2, 0)));
    assert_eq!(c.lookup(5), None);
    assert_eq!(c.keys(), 2);
}

#[test]
fn removing_the_newest_loses_the_shared_key() {
    let mut c = TableCache::new(1 << 20);
    c.insert(1, rows(&[5, 6]));
    c.insert(2, rows(&[6, 7]));
    c.remove(2);
    // Documented: table 1's row for key 6 is lost from the map (a hint lost,
    // never a wrong answer) until table 1 is inserted again.
    assert_eq!(c.lookup(6), None);
    assert_eq!(c.lookup(5).map(|h| (h.table, h.row)), Some((1, 0)));
    assert_eq!(c.lookup(7), None);
    c.insert(1, rows(&[5, 6]));
    assert_eq!(c.lookup(6).map(|h| (h.table, h.row)), Some((1, 1)));
}

#[test]
fn insert_replaces_an_older_copy() {
    let mut c = TableCache::new(1 << 20);
    c.insert(3, rows(&[1, 2]));
    let before = c.memory_bytes();
    c.insert(3, rows(&[2, 4]));
    assert_eq!(c.lookup(1), None);
    assert_eq!(c.lookup(2).map(|h| h.row), Some(0));
    assert_eq!(c.lookup(4).map(|h| h.row), Some(1));
    assert_eq!((c.tables(), c.keys(), c.memory_bytes()), (1, 2, before));
}

#[test]
fn key_zero_rows_are_ignored() {
    let mut c = TableCache::new(1 << 20);
    c.insert(4, rows(&[0, 5, 0, 5]));
    assert_eq!(c.keys(), 1);
    assert_eq!(c.lookup(0), None);
    // A key repeated inside a table: its last row wins.
    assert_eq!(c.lookup(5).map(|h| (h.row, h.rows)), Some((3, 4)));
    // A table of only key-0 rows is cached (no reload), and finds nothing.
    c.insert(9, rows(&[0, 0]));
    assert!(c.contains(9));
    assert_eq!(c.keys(), 1);
}

#[test]
fn eviction_is_lru_by_table() {
    // The budget of exactly three 100-row tables plus a fourth, less one byte.
    let mut probe = TableCache::new(u64::MAX);
    for t in 1..=4 {
        probe.insert(t, run(u64::from(t) * 1000, 100));
    }
    let mut c = TableCache::new(probe.memory_bytes() - 1);
    for t in 1..=3 {
        c.insert(t, run(u64::from(t) * 1000, 100));
    }
    assert_eq!(c.lookup(1050).map(|h| h.table), Some(1));
    c.insert(4, run(4000, 100));
    check(&c);
    let cached: Vec<u32> = (1..=4).filter(|&t| c.contains(t)).collect();
    assert_eq!(cached, [1, 3, 4]);
    assert_eq!(c.lookup(2050), None);
    assert_eq!(c.keys(), 300);
    // Now 3 is the least recently used.
    c.insert(5, run(5000, 100));
    let cached: Vec<u32> = (1..=5).filter(|&t| c.contains(t)).collect();
    assert_eq!(cached, [1, 4, 5]);
    check(&c);
}

#[test]
fn remove_range_drops_exactly_those_tables() {
    let mut c = TableCache::new(1 << 20);
    for t in [5, 10, 11, 12, 13, 14, 15, 25] {
        c.insert(t, run(u64::from(t) * 100, 10));
    }
    c.remove_range(11..14);
    let left: Vec<u32> = (0..30).filter(|&t| c.contains(t)).collect();
    assert_eq!(left, [5, 10, 14, 15, 25]);
    assert_eq!(c.keys(), 50);
    assert_eq!(c.lookup(1205), None);
    assert_eq!(c.lookup(1405).map(|h| h.table), Some(14));
    // A range wider than the cache: the other branch.
    c.remove_range(14..1_000_000);
    let left: Vec<u32> = (0..30).filter(|&t| c.contains(t)).collect();
    assert_eq!(left, [5, 10]);
    assert_eq!(c.keys(), 20);
    check(&c);
}

#[test]
fn a_table_larger_than_the_budget_is_not_cached() {
    let mut c = TableCache::new(10_000);
    c.insert(1, run(1, 10));
    c.insert(2, run(100, 1000));
    assert!(c.contains(1) && !c.contains(2));
    assert_eq!(c.lookup(500), None);
    // An oversized new copy still drops the old one (its rows changed).
    c.insert(1, run(1, 1000));
    assert_eq!((c.tables(), c.keys()), (0, 0));
    check(&c);
    let mut zero = TableCache::new(0);
    zero.insert(1, run(1, 1));
    assert_eq!((zero.tables(), zero.memory_bytes()), (0, 0));
}

/// 10,000 tables of 512 rows through a cache of `budget` bytes, each
/// followed by a lookup of the table inserted 10 before (among the 20 most
/// recently used, so always cached); the invariants checked after each call.
fn ten_thousand_tables(budget: u64) -> TableCache {
    let mut c = TableCache::new(budget);
    for t in 0..10_000u32 {
        c.insert(t, run(u64::from(t) * 512 + 1, 512));
        check(&c);
        if t >= 10 {
            let probe = u64::from(t - 10) * 512 + 7;
            assert_eq!(c.lookup(probe).map(|h| (h.table, h.row)), Some((t - 10, 6)));
        }
        check(&c);
    }
    assert_eq!(c.keys(), c.tables() * 512);
    c
}

#[test]
fn budget_holds_over_ten_thousand_tables() {
    // 512 rows take 12,304 bytes (24 each and 16 of Arc header); the key map
    // settles at 32,768 buckets of 17 bytes (557,072 bytes, room for 28,672
    // keys = 56 tables). What is left holds 39 tables (479,856 bytes).
    let c = ten_thousand_tables(1 << 20);
    assert_eq!((c.keys.buckets, c.tables()), (32_768, 39));
    assert!(c.memory_bytes() > (1 << 20) - 13_000);
}

#[test]
fn budget_holds_with_a_full_key_map() {
    // At 700,000 bytes 32,768 buckets leave room for 11 tables only, so the
    // key map stays at 16,384 buckets, full at 28 tables (14,336 keys), and
    // tombstones force a rebuild now and then instead of a growth.
    let c = ten_thousand_tables(700_000);
    assert_eq!((c.keys.buckets, c.tables()), (16_384, 28));
    assert!(c.rebuilds > 0);
}

#[test]
fn budget_holds_for_mixed_sizes_lookups_and_removals() {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut c = TableCache::new(300_000);
    for step in 0..20_000u64 {
        let r = next();
        let table = (r % 3000) as u32;
        match r >> 60 {
            0..=9 => {
                let n = [0, 1, 3, 40, 500, 3000][(r >> 20) as usize % 6];
                // Overlapping key ranges, so tables share keys.
                c.insert(table, run(u64::from(table) * 50 + 1, n));
            }
            10..=13 => {
                let _ = c.lookup((r >> 16) % 150_000);
            }
            14 => c.remove(table),
            _ => c.remove_range(table..table + (r >> 40) as u32 % 20),
        }
        check(&c);
        if step % 1000 == 0 {
            // Every mapped key points at a cached row holding it.
            for (&k, &(t, i)) in &c.keys.map {
                assert_eq!(c.cached.map[&t].rows[i as usize].fp, k);
            }
        }
    }
}

#[test]
fn want_queues_four_distinct_uncached_tables() {
    let mut c = TableCache::new(1 << 20);
    c.insert(9, run(1, 4));
    c.want(1);
    c.want(2);
    c.want(2);
    c.want(9);
    c.want(3);
    c.want(4);
    c.want(5);
    assert_eq!(c.take_wanted(), Some(2));
    c.insert(3, run(100, 4));
    assert_eq!(c.take_wanted(), Some(4));
    assert_eq!(c.take_wanted(), Some(5));
    assert_eq!(c.take_wanted(), None);
    c.want(6);
    assert_eq!(c.take_wanted(), Some(6));
    assert_eq!(c.take_wanted(), None);
}

#[test]
fn hashbrown_model_matches_std() {
    for n in (0..70_000usize)
        .step_by(7)
        .chain([1, 2, 3, 4, 7, 8, 14, 15, 28, 29])
    {
        let m: FxHashMap<u64, (u32, u32)> =
            FxHashMap::with_capacity_and_hasher(n, Default::default());
        let cap = m.capacity() as u64;
        assert_eq!(buckets_of_capacity(cap), buckets_for(n as u64), "n {n}");
        assert_eq!(full_capacity(buckets_for(n as u64)), cap, "n {n}");
    }
    assert_eq!(map_bytes(0, 16), 0);
    assert_eq!(map_bytes(32, 16), 32 * 17 + 16);
    assert_eq!(size_of::<(u64, (u32, u32))>(), 16);
}
