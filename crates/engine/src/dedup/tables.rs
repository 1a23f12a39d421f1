//! The table cache: decoded fingerprint tables kept in RAM after a hook hit,
//! so that a run of duplicates written in the order of an old table costs one
//! table read, not one per block (the "champion" manifests of sparse
//! indexing, Lillibridge et al., FAST '09, and the cached chapters of
//! dm-vdo's UDS index).
//!
//! Layout: every cached table's rows (`Arc<[FpRow]>`, shared with whoever
//! loaded them) plus one key map `key -> (table, row)` over all of them, so a
//! lookup is one hash probe whichever table holds the key. The newest
//! inserted table wins a key that several cached tables hold. When a table
//! leaves, its keys leave the map only where the map still points at it. A
//! key that an older cached table also holds is then lost from the map until
//! that table is inserted again: a hint lost, never a wrong answer (every
//! candidate is verified byte for byte by the caller anyway).
//!
//! Eviction is least recently used by table: an insert or a hit makes a table
//! the most recent. A hit only stamps the table (O(1)); the LRU order lives in
//! a `BTreeMap<tick, table>` whose stale positions are corrected lazily when
//! they reach the front, so an eviction costs O(log tables) amortised.
//!
//! Memory is counted honestly, by capacity: rows at `size_of::<FpRow>()`
//! plus the `Arc` header, both hash maps by their bucket count (entry size
//! plus one control byte per bucket, plus one group of trailing control
//! bytes, as hashbrown lays them out) and the LRU tree by an upper bound of
//! its nodes. The hash maps are resized only here, to a bucket count chosen
//! against the budget (never by hashbrown on its own), so `memory_bytes()`
//! stays within the budget after every call.
use cvol_format::fprints::FpRow;
use cvol_format::MapEntry;
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;
use std::mem::size_of;
use std::ops::Range;
use std::sync::Arc;

/// A cached row matching a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheHit {
    /// The map entry the block got when the row was written.
    pub entry: MapEntry,
    /// The LBA its record's header names.
    pub owner: u64,
    /// The fingerprint table holding the row.
    pub table: u32,
    /// The row's index in that table.
    pub row: u32,
    /// The table's row count (for the successor rule: a hit in its second
    /// half makes the next part worth loading).
    pub rows: u32,
}

/// Tables the successor prefetch queue holds at most.
pub const WANTED_MAX: usize = 4;

/// Bytes of one cached row.
const ROW_BYTES: u64 = size_of::<FpRow>() as u64;
/// Bytes of an `Arc`'s counters, before its rows.
const ARC_HEADER_BYTES: u64 = 2 * size_of::<usize>() as u64;
/// Trailing control bytes of a hashbrown table (one SSE2 group).
const GROUP_BYTES: u64 = 16;

/// One cached table.
struct Cached {
    rows: Arc<[FpRow]>,
    /// When it was last used (insert or hit).
    tick: u64,
    /// Its position in the LRU tree (`tick` as of its last placement there).
    lru_key: u64,
    /// Lookups it answered.
    hits: u64,
}

/// Most items hashbrown stores in `buckets` buckets before it grows.
fn full_capacity(buckets: u64) -> u64 {
    if buckets < 8 {
        buckets.saturating_sub(1)
    } else {
        buckets / 8 * 7
    }
}

/// The bucket count hashbrown allocates for a capacity of `items`.
fn buckets_for(items: u64) -> u64 {
    match items {
        0 => 0,
        1..=3 => 4,
        4..=7 => 8,
        _ => (items * 8).div_ceil(7).next_power_of_two(),
    }
}

/// The bucket count behind `capacity()` of a map without tombstones.
fn buckets_of_capacity(capacity: u64) -> u64 {
    match capacity {
        0 => 0,
        1..=7 => (capacity + 1).next_power_of_two(),
        _ => (capacity / 7 * 8).next_power_of_two(),
    }
}

/// Bytes of a hashbrown table of `buckets` buckets of `entry` bytes.
fn map_bytes(buckets: u64, entry: usize) -> u64 {
    if buckets == 0 {
        0
    } else {
        buckets * (entry as u64 + 1) + GROUP_BYTES
    }
}

/// An upper bound on the bytes of a `BTreeMap<u64, u32>` of `len` entries:
/// std's nodes hold 11 entries, and every node but the root at least 5.
fn lru_bytes(len: u64) -> u64 {
    const LEAF: u64 = 11 * (8 + 4) + 8 + 2 + 2;
    const INTERNAL: u64 = LEAF + 12 * 8;
    if len == 0 {
        return 0;
    }
    let leaves = len / 5 + 1;
    let mut level = leaves;
    let mut internal = 0;
    while level > 1 {
        level = level.div_ceil(6);
        internal += level;
    }
    leaves * LEAF + internal * INTERNAL
}

/// A hash map whose bucket count is decided by its owner: it is rebuilt to
/// a chosen size before items are added, so hashbrown never grows it.
struct Sized<K, V> {
    map: FxHashMap<K, V>,
    buckets: u64,
}

impl<K: std::hash::Hash + Eq, V> Sized<K, V> {
    fn new() -> Self {
        Sized {
            map: FxHashMap::default(),
            buckets: 0,
        }
    }

    fn len(&self) -> u64 {
        self.map.len() as u64
    }

    fn bytes(&self) -> u64 {
        map_bytes(self.buckets, size_of::<(K, V)>())
    }

    /// Buckets needed to add `n` items: the present ones if they hold them.
    fn target(&self, n: u64) -> u64 {
        if self.len() + n <= full_capacity(self.buckets) {
            self.buckets
        } else {
            buckets_for(self.len() + n)
        }
    }

    /// Moves every item into a fresh table of `buckets` buckets (which also
    /// clears hashbrown's tombstones).
    fn rebuild(&mut self, buckets: u64) {
        let old = std::mem::take(&mut self.map);
        let capacity = full_capacity(buckets) as usize;
        self.map = FxHashMap::with_capacity_and_hasher(capacity, Default::default());
        self.map.extend(old);
        self.buckets = buckets_of_capacity(self.map.capacity() as u64);
        debug_assert_eq!(self.buckets, buckets);
    }

    /// Makes room for `n` new items in `buckets` buckets without hashbrown
    /// resizing: a rebuild if the size changes, or if tombstones ate the room.
    fn make_room(&mut self, n: u64, buckets: u64) {
        let room = self.map.capacity() as u64 - self.len();
        if buckets != self.buckets || room < n {
            self.rebuild(buckets);
        }
    }
}

/// The cache. Not synchronised: the caller holds it under its own lock.
pub struct TableCache {
    budget: u64,
    /// Key -> (table, row) over every cached table.
    keys: Sized<u64, (u32, u32)>,
    cached: Sized<u32, Cached>,
    /// LRU order: tick of last placement -> table. Entries may be stale (the
    /// table was used since); they are re-placed when they reach the front.
    lru: BTreeMap<u64, u32>,
    tick: u64,
    /// Bytes of every cached table's rows and `Arc` header.
    row_bytes: u64,
    /// Successor prefetch queue, oldest first.
    wanted: [u32; WANTED_MAX],
    wanted_len: usize,
    /// Key map rebuilds forced by hashbrown tombstones (not by a resize).
    pub rebuilds: u64,
}

impl TableCache {
    /// A cache of at most `budget_bytes` (rows and the key map together,
    /// counted honestly).
    pub fn new(budget_bytes: u64) -> TableCache {
        TableCache {
            budget: budget_bytes,
            keys: Sized::new(),
            cached: Sized::new(),
            lru: BTreeMap::new(),
            tick: 0,
            row_bytes: 0,
            wanted: [0; WANTED_MAX],
            wanted_len: 0,
            rebuilds: 0,
        }
    }

    pub fn contains(&self, table: u32) -> bool {
        self.cached.map.contains_key(&table)
    }

    /// Bytes every part of the cache would take with `row_bytes` of rows,
    /// key and table maps of the given bucket counts, and `tables` tables.
    fn cost(row_bytes: u64, key_buckets: u64, table_buckets: u64, tables: u64) -> u64 {
        row_bytes
            + map_bytes(key_buckets, size_of::<(u64, (u32, u32))>())
            + map_bytes(table_buckets, size_of::<(u32, Cached)>())
            + lru_bytes(tables)
    }

    /// Caches `rows` as table `table`'s (replacing an older copy of it),
    /// most recently used; least recently used tables are evicted until the
    /// cache fits its budget; a table that alone exceeds the budget is not
    /// cached. Rows with key 0 are ignored.
    pub fn insert(&mut self, table: u32, rows: Arc<[FpRow]>) {
        self.remove(table);
        let n = rows.iter().filter(|r| r.fp != 0).count() as u64;
        let add = rows.len() as u64 * ROW_BYTES + ARC_HEADER_BYTES;
        if Self::cost(add, buckets_for(n), buckets_for(1), 1) > self.budget {
            return;
        }
        self.make_room(n, add);
        let tick = self.next_tick();
        for (i, r) in rows.iter().enumerate() {
            if r.fp != 0 {
                // A key repeated inside the table: its last row wins.
                self.keys.map.insert(r.fp, (table, i as u32));
            }
        }
        self.lru.insert(tick, table);
        self.row_bytes += add;
        let entry = Cached {
            rows,
            tick,
            lru_key: tick,
            hits: 0,
        };
        self.cached.map.insert(table, entry);
        debug_assert!(self.cached.map.capacity() as u64 <= full_capacity(self.cached.buckets));
        debug_assert!(self.keys.map.capacity() as u64 <= full_capacity(self.keys.buckets));
        debug_assert!(self.memory_bytes() <= self.budget);
    }

    /// Evicts, shrinks or grows so that a table of `n` keys and `add` row
    /// bytes fits in the budget, then sizes both maps for it.
    fn make_room(&mut self, n: u64, add: u64) {
        loop {
            let (kt, tt) = (self.keys.target(n), self.cached.target(1));
            let tables = self.cached.len() + 1;
            let rows = self.row_bytes + add;
            if Self::cost(rows, kt, tt, tables) <= self.budget {
                break;
            }
            // Maps grown for tables since evicted: smaller ones may do.
            let km = buckets_for(self.keys.len() + n);
            let tm = buckets_for(tables);
            if (km < kt || tm < tt) && Self::cost(rows, km, tm, tables) <= self.budget {
                self.keys.rebuild(km);
                self.cached.rebuild(tm);
                break;
            }
            if !self.evict_lru() {
                // Empty: the caller checked that the table alone fits.
                self.keys.rebuild(km);
                self.cached.rebuild(tm);
                break;
            }
        }
        let (kt, tt) = (self.keys.target(n), self.cached.target(1));
        if kt == self.keys.buckets && (self.keys.map.capacity() as u64) < self.keys.len() + n {
            self.rebuilds += 1;
        }
        self.keys.make_room(n, kt);
        self.cached.make_room(1, tt);
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// Evicts the least recently used table; false if none is cached.
    fn evict_lru(&mut self) -> bool {
        while let Some((at, table)) = self.lru.pop_first() {
            let c = self
                .cached
                .map
                .get_mut(&table)
                .expect("LRU names a cached table");
            if c.tick == at {
                self.remove(table);
                return true;
            }
            // Used since it was placed: place it where its last use puts it.
            c.lru_key = c.tick;
            self.lru.insert(c.tick, table);
        }
        false
    }

    /// The row for `key` in any cached table (the most recently inserted
    /// table holding it wins), its table made most recently used; counts a
    /// hit on that table.
    pub fn lookup(&mut self, key: u64) -> Option<CacheHit> {
        if key == 0 {
            return None;
        }
        let &(table, row) = self.keys.map.get(&key)?;
        self.tick += 1;
        let c = self
            .cached
            .map
            .get_mut(&table)
            .expect("key map names a cached table");
        c.tick = self.tick;
        c.hits += 1;
        let r = &c.rows[row as usize];
        Some(CacheHit {
            entry: r.entry(),
            owner: u64::from(r.owner),
            table,
            row,
            rows: c.rows.len() as u32,
        })
    }

    /// Lookups table `table` answered since it was cached (None: not cached).
    pub fn hits(&self, table: u32) -> Option<u64> {
        self.cached.map.get(&table).map(|c| c.hits)
    }

    /// Drops table `table` (its rows changed, or its record is gone).
    pub fn remove(&mut self, table: u32) {
        let Some(c) = self.cached.map.remove(&table) else {
            return;
        };
        self.lru.remove(&c.lru_key);
        for r in c.rows.iter().filter(|r| r.fp != 0) {
            if matches!(self.keys.map.get(&r.fp), Some(&(t, _)) if t == table) {
                self.keys.map.remove(&r.fp);
            }
        }
        self.row_bytes -= c.rows.len() as u64 * ROW_BYTES + ARC_HEADER_BYTES;
    }

    /// Drops every cached table in `tables` (a freed segment's parts).
    pub fn remove_range(&mut self, tables: Range<u32>) {
        if u64::from(tables.end.saturating_sub(tables.start)) <= self.cached.len() {
            tables.for_each(|t| self.remove(t));
        } else {
            let doomed: Vec<u32> = self
                .cached
                .map
                .keys()
                .copied()
                .filter(|t| tables.contains(t))
                .collect();
            doomed.into_iter().for_each(|t| self.remove(t));
        }
    }

    /// Successor prefetch queue: records a table to load on a later request
    /// (ignored if cached or already queued; at most `WANTED_MAX` queued,
    /// oldest dropped).
    pub fn want(&mut self, table: u32) {
        if self.contains(table) || self.wanted[..self.wanted_len].contains(&table) {
            return;
        }
        if self.wanted_len == WANTED_MAX {
            self.wanted.copy_within(1.., 0);
            self.wanted_len -= 1;
        }
        self.wanted[self.wanted_len] = table;
        self.wanted_len += 1;
    }

    /// Pops the oldest queued table (skipping any cached since it was
    /// queued).
    pub fn take_wanted(&mut self) -> Option<u32> {
        while self.wanted_len > 0 {
            let t = self.wanted[0];
            self.wanted.copy_within(1.., 0);
            self.wanted_len -= 1;
            if !self.contains(t) {
                return Some(t);
            }
        }
        None
    }

    /// Tables cached.
    pub fn tables(&self) -> u64 {
        self.cached.len()
    }

    /// Keys the key map holds.
    pub fn keys(&self) -> u64 {
        self.keys.len()
    }

    /// Bytes the cache holds (never above its budget).
    pub fn memory_bytes(&self) -> u64 {
        self.row_bytes + self.keys.bytes() + self.cached.bytes() + lru_bytes(self.lru.len() as u64)
    }
}

#[cfg(test)]
#[path = "tables_tests.rs"]
mod tests;
