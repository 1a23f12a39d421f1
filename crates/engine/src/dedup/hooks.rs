//! The hook index: a sampled, whole-volume map from a fingerprint key to the
//! fingerprint table that holds its row, in bounded RAM.
//!
//! The idea is dm-vdo's UDS sparse index and sparse indexing (Lillibridge et
//! al., FAST '09): only the keys whose top `k` bits are zero ("hooks", 1 in
//! 2^k blocks, content-defined, so a copy and its original pick the same
//! blocks) are kept, each naming the table (the "chapter" or "manifest") that
//! lists it and the blocks written next to it. A hook hit loads that table,
//! and the table hands over its neighbours.
//!
//! Layout: buckets of 8 one-word entries (64 bytes, one cache line), chosen by
//! fastrange on the key's low 32 bits, so the bucket is independent of the
//! top bits that decide sampling. Exact LRU inside a bucket by position (index
//! 0 is the most recently used; occupied entries are always a prefix). An
//! entry is one `u64`, 0 meaning empty:
//!
//! ```text
//!  63           40 39     32 31                 0
//! +---------------+---------+--------------------+
//! | tag = key>>40 |   gen   | table-first_table+1 |
//! +---------------+---------+--------------------+
//! ```
//!
//! The table field is stored relative to the geometry's first table plus one,
//! so it is never 0 and an occupied entry never encodes to 0 (tables outside
//! the geometry are never stored). The 24-bit tag is the key's top bits, so
//! it carries the sample bits: whether an entry is still sampled after `k`
//! grows is decided from the entry alone. `gen` is the generation of the
//! table's segment when the hook was made; freeing a segment bumps its
//! generation, which kills every hook into it at once with no scan (a wrap
//! after 256 reuses can only revive a hint).
//!
//! Nothing here is trusted. A tag match is a hint: a lookup of a key that is
//! not in the index matches another key of its bucket with the same tag with
//! probability about (entries in the bucket) × 2^-(24 - k), at most
//! 8 × 2^-(24 - k) = 2^-(21 - k): 2^-16 per hook lookup at k = 5, 2^-13 at
//! k = 8 (only sampled keys are looked up, so 2^-21 per block at k = 5). A
//! false match costs one wasted table read: the table is searched by the full
//! key and every candidate block is compared byte for byte before use. The
//! same collision on `note` repoints the other key's hook (newest wins), which
//! loses that hint: a missed dedup at the same rate, never a wrong block.
//!
//! Adaptive sampling: `k` starts at 0 (every key is a hook, so a small
//! volume gets a complete 8-byte-per-block index). When the occupied entries
//! exceed 75% of the slots, `k` grows by one and a sweep clears the entries
//! no longer sampled (about half). The sweep is amortised over `note` calls,
//! [`SWEEP_BUCKETS_PER_NOTE`] buckets each, so no call is long. At `k = 8`
//! and 75% load the index is full: inserts keep evicting the least recently
//! used entry of their bucket, and nothing ever waits or fails. Below k = 8,
//! a full bucket first gives up an entry the next k would drop: the sweep
//! would clear it anyway, while an evicted hook that stays sampled is lost
//! until its block is written again (without this, a volume at k = 2 kept
//! about 90% of its hooks instead of all).
//!
//! Dead entries (a freed segment's) stay counted in `entries` until a lookup
//! meets them, an insert reuses their slot, or a sweep clears them. So that
//! they do not raise `k` by themselves, a load past 75% after segments were
//! freed first runs a cleanup sweep at the same `k` (it clears dead entries
//! only); `k` grows when the load is still past 75% after it.

/// Where fingerprint tables are numbered (cvol_format::fprints): table t is part
/// (t - first_table) % parts_per_segment of segment (t - first_table) / parts_per_segment.
#[derive(Debug, Clone, Copy)]
pub struct HookGeometry {
    pub first_table: u64,
    pub parts_per_segment: u64,
    pub segments: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HookStats {
    /// Occupied slots: live, or dead but not yet known dead.
    pub entries: u64,
    /// Slots.
    pub capacity: u64,
    /// k: a key is a hook iff its top k bits are zero.
    pub sample_bits: u8,
    /// Slots at 8 B plus the segment generations (1 B each).
    pub memory_bytes: u64,
    /// Live entries evicted (least recently used) from a full bucket.
    pub evictions: u64,
    /// Times k was raised.
    pub sweeps: u64,
    /// k == MAX_SAMPLE_BITS and the load is at least 75%.
    pub full: bool,
}

/// The sparsest sampling: 1 key in 256 is a hook.
pub const MAX_SAMPLE_BITS: u8 = 8;
/// Entries per bucket (one 64-byte cache line).
pub const BUCKET_SLOTS: usize = 8;
/// Bytes one bucket costs.
pub const BUCKET_BYTES: u64 = (BUCKET_SLOTS * 8) as u64;
/// Buckets a `note` sweeps while a sweep is under way (512 slots, about a
/// microsecond).
pub const SWEEP_BUCKETS_PER_NOTE: u64 = 64;

const TAG_SHIFT: u32 = 40;
const TAG_BITS: u32 = 64 - TAG_SHIFT;
const GEN_SHIFT: u32 = 32;

fn tag_of(key: u64) -> u64 {
    key >> TAG_SHIFT
}

fn entry_tag(e: u64) -> u64 {
    e >> TAG_SHIFT
}

fn entry_gen(e: u64) -> u8 {
    (e >> GEN_SHIFT) as u8
}

/// The table field: relative to the first table, plus one (never 0).
fn entry_rel(e: u64) -> u64 {
    u64::from(e as u32) - 1
}

/// Whether an entry's tag is sampled at `k` (its top `k` bits are zero).
fn tag_sampled(tag: u64, k: u8) -> bool {
    tag.checked_shr(TAG_BITS - u32::from(k)).unwrap_or(0) == 0
}

/// The buckets an index of at most `budget_bytes` gets (8 B a slot plus one
/// generation byte per segment), capped at what `max_useful` distinct blocks
/// need at k = 0 with 25% headroom (`max_useful * 4 / 3` slots, rounded up to
/// whole buckets). Always at least one bucket, so a budget smaller than the
/// generations plus one bucket is exceeded by that bucket; at most 2^32
/// buckets (the fastrange width).
pub fn hook_buckets(budget_bytes: u64, max_useful: u64, segments: u64) -> u64 {
    let by_budget = budget_bytes.saturating_sub(segments) / BUCKET_BYTES;
    let need_slots = (u128::from(max_useful) * 4).div_ceil(3);
    let by_need = need_slots.div_ceil(BUCKET_SLOTS as u128);
    let by_need = u64::try_from(by_need).unwrap_or(u64::MAX);
    by_budget.min(by_need).clamp(1, 1 << 32)
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Bucket([u64; BUCKET_SLOTS]);

impl Bucket {
    /// Moves the entry at `pos` (or the slot it replaces) to the front as
    /// `e`: the most recently used.
    fn put_front(&mut self, pos: usize, e: u64) {
        self.0[..=pos].rotate_right(1);
        self.0[0] = e;
    }

    /// Clears the entry at `pos`, keeping the occupied entries a prefix.
    fn remove_at(&mut self, pos: usize) {
        self.0[pos..].rotate_left(1);
        self.0[BUCKET_SLOTS - 1] = 0;
    }

    /// Keeps the entries `keep` accepts, in order; returns how many occupied
    /// entries were cleared.
    fn retain(&mut self, keep: impl Fn(u64) -> bool) -> u64 {
        let mut w = 0;
        let mut cleared = 0;
        for i in 0..BUCKET_SLOTS {
            let e = self.0[i];
            if e == 0 {
                continue;
            }
            if keep(e) {
                self.0[w] = e;
                w += 1;
            } else {
                cleared += 1;
            }
        }
        self.0[w..].fill(0);
        cleared
    }
}

/// The per-segment generations and the table geometry.
struct Generations {
    gens: Vec<u8>,
    geo: HookGeometry,
}

impl Generations {
    /// `table` relative to the first table, if it lies in the geometry and
    /// its stored form (plus one) fits the entry's 32 bits.
    fn rel(&self, table: u32) -> Option<u64> {
        let rel = u64::from(table).checked_sub(self.geo.first_table)?;
        let in_geo = rel / self.geo.parts_per_segment < self.geo.segments;
        (in_geo && rel < u64::from(u32::MAX)).then_some(rel)
    }

    fn gen_of_rel(&self, rel: u64) -> u8 {
        self.gens[(rel / self.geo.parts_per_segment) as usize]
    }

    fn encode(&self, key: u64, table: u32) -> Option<u64> {
        let rel = self.rel(table)?;
        let gen = u64::from(self.gen_of_rel(rel));
        Some(tag_of(key) << TAG_SHIFT | gen << GEN_SHIFT | (rel + 1))
    }

    fn table(&self, e: u64) -> u32 {
        (entry_rel(e) + self.geo.first_table) as u32
    }

    /// An occupied entry whose segment still has the entry's generation.
    fn live(&self, e: u64) -> bool {
        e != 0 && self.gen_of_rel(entry_rel(e)) == entry_gen(e)
    }
}

pub struct HookIndex {
    buckets: Vec<Bucket>,
    gens: Generations,
    /// k: a key is sampled iff its top k bits are zero.
    k: u8,
    entries: u64,
    evictions: u64,
    sweeps: u64,
    /// The next bucket the sweep under way clears; `buckets.len()` when none is.
    cursor: u64,
    /// A segment was freed since the last sweep started (dead entries may
    /// be counted).
    freed_since_sweep: bool,
    /// The last sweep kept `k` (it only cleared dead entries).
    last_sweep_cleanup: bool,
}

impl HookIndex {
    /// At most `budget_bytes` (slots at 8 B plus the generation bytes), and no
    /// more slots than `max_useful` distinct blocks need at k = 0 with 25% headroom
    /// (max_useful * 4 / 3, rounded up to whole 8-slot buckets; at least one bucket).
    pub fn new(budget_bytes: u64, max_useful: u64, geo: HookGeometry) -> HookIndex {
        assert!(geo.parts_per_segment > 0, "a segment has at least one part");
        let n = hook_buckets(budget_bytes, max_useful, geo.segments);
        let mut buckets = vec![Bucket([0; BUCKET_SLOTS]); n as usize];
        // Touch every page now: the index is a fixed, configured cost, and
        // first-touch page faults would otherwise land on client writes.
        for b in buckets.iter_mut().step_by(4096 / BUCKET_BYTES as usize) {
            // SAFETY: `b` is a valid, aligned, exclusive reference.
            unsafe { std::ptr::write_volatile(b, Bucket([0; BUCKET_SLOTS])) };
        }
        HookIndex {
            buckets,
            gens: Generations {
                gens: vec![0; geo.segments as usize],
                geo,
            },
            k: 0,
            entries: 0,
            evictions: 0,
            sweeps: 0,
            cursor: n,
            freed_since_sweep: false,
            last_sweep_cleanup: false,
        }
    }

    /// Whether `key` (upper 64 bits of a block fingerprint, never 0) is a hook at the current k: key >> (64 - k) == 0 (k = 0: every key).
    pub fn sampled(&self, key: u64) -> bool {
        key.checked_shr(64 - u32::from(self.k)).unwrap_or(0) == 0
    }

    /// The current k.
    pub fn sample_bits(&self) -> u8 {
        self.k
    }

    /// Slots.
    pub fn capacity(&self) -> u64 {
        self.buckets.len() as u64 * BUCKET_SLOTS as u64
    }

    fn bucket_of(&self, key: u64) -> usize {
        ((u64::from(key as u32) * self.buckets.len() as u64) >> 32) as usize
    }

    /// Starts loading `key`'s bucket into the CPU cache (the index is far
    /// larger than the cache; prefetching a request's buckets before the
    /// first lookup overlaps the misses).
    pub fn prefetch(&self, key: u64) {
        let bucket = &self.buckets[self.bucket_of(key)];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch is a hint that never faults; the address is
        // the bucket's, one aligned cache line.
        unsafe {
            std::arch::x86_64::_mm_prefetch(
                (bucket as *const Bucket).cast::<i8>(),
                std::arch::x86_64::_MM_HINT_T0,
            )
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = bucket;
    }

    /// Table `table` holds a row for `key` (just appended, or replayed from a table at open).
    /// No-op unless sampled (or `table` lies outside the geometry). Same tag already in the
    /// bucket -> repointed to `table` (newest wins) with the current generation of its segment;
    /// else a dead (generation mismatch) or no longer sampled slot; else a free slot; else
    /// evict (and count) the least recently used of the bucket's entries that k + 1 would
    /// drop, or when none would (or k is 8), the least recently used. The entry becomes the most
    /// recently used. Every call, sampled or not, also runs one amortised sweep step and
    /// starts a sweep (raising k when k < 8) when the occupied entries exceed 75% of capacity.
    pub fn note(&mut self, key: u64, table: u32) {
        if self.sampled(key) {
            self.insert(key, table);
        }
        self.sweep_step();
        self.maybe_start_sweep();
    }

    fn insert(&mut self, key: u64, table: u32) {
        let Some(e) = self.gens.encode(key, table) else {
            return;
        };
        let (tag, k) = (tag_of(key), self.k);
        let i = self.bucket_of(key);
        let gens = &self.gens;
        let b = &mut self.buckets[i];
        let stale = |e: u64| e != 0 && !(gens.live(e) && tag_sampled(entry_tag(e), k));
        let pos = (b.0.iter().position(|&x| x != 0 && entry_tag(x) == tag))
            .or_else(|| b.0.iter().rposition(|&x| stale(x)))
            .or_else(|| b.0.iter().position(|&x| x == 0));
        match pos {
            Some(p) => {
                if b.0[p] == 0 {
                    self.entries += 1;
                }
                b.put_front(p, e);
            }
            None => {
                // The least recently used of the entries the next k drops,
                // if any: they are swept when k grows anyway, while a hook
                // that stays sampled is lost for good.
                let doomed = (k < MAX_SAMPLE_BITS)
                    .then(|| b.0.iter().rposition(|&x| !tag_sampled(entry_tag(x), k + 1)))
                    .flatten();
                self.evictions += 1;
                b.put_front(doomed.unwrap_or(BUCKET_SLOTS - 1), e);
            }
        }
    }

    /// Clears, in the next [`SWEEP_BUCKETS_PER_NOTE`] buckets of a sweep
    /// under way, the entries that are dead or no longer sampled.
    fn sweep_step(&mut self) {
        let n = self.buckets.len() as u64;
        if self.cursor >= n {
            return;
        }
        let end = (self.cursor + SWEEP_BUCKETS_PER_NOTE).min(n);
        let (gens, k) = (&self.gens, self.k);
        let mut cleared = 0;
        for b in &mut self.buckets[self.cursor as usize..end as usize] {
            cleared += b.retain(|e| gens.live(e) && tag_sampled(entry_tag(e), k));
        }
        self.entries -= cleared;
        self.cursor = end;
    }

    fn maybe_start_sweep(&mut self) {
        let idle = self.cursor >= self.buckets.len() as u64;
        if !idle || self.entries * 4 <= self.capacity() * 3 {
            return;
        }
        let cleanup =
            self.freed_since_sweep && (!self.last_sweep_cleanup || self.k == MAX_SAMPLE_BITS);
        if !cleanup {
            if self.k == MAX_SAMPLE_BITS {
                return; // full: inserts evict inside their bucket
            }
            self.k += 1;
            self.sweeps += 1;
        }
        self.last_sweep_cleanup = cleanup;
        self.freed_since_sweep = false;
        self.cursor = 0;
    }

    /// The table a live hook for `key` names (tag match AND the entry's generation equals its
    /// segment's current generation), made most recently used in its bucket. None otherwise
    /// (also for unsampled keys; a dead entry found on the way is cleared).
    pub fn lookup(&mut self, key: u64) -> Option<u32> {
        if !self.sampled(key) {
            return None;
        }
        let (tag, i) = (tag_of(key), self.bucket_of(key));
        let b = &mut self.buckets[i];
        let pos = b.0.iter().position(|&e| e != 0 && entry_tag(e) == tag)?;
        let e = b.0[pos];
        if self.gens.live(e) {
            b.put_front(pos, e);
            Some(self.gens.table(e))
        } else {
            b.remove_at(pos);
            self.entries -= 1;
            None
        }
    }

    /// The hook for `key` pointing at `table` was stale (the table lacked the key): clear it.
    pub fn forget(&mut self, key: u64, table: u32) {
        let Some(rel) = self.gens.rel(table) else {
            return;
        };
        let (tag, i) = (tag_of(key), self.bucket_of(key));
        let b = &mut self.buckets[i];
        let found =
            b.0.iter()
                .position(|&e| e != 0 && entry_tag(e) == tag && entry_rel(e) == rel);
        if let Some(pos) = found {
            b.remove_at(pos);
            self.entries -= 1;
        }
    }

    /// Segment `segment` was freed: every hook into its tables dies at once (generation += 1, wrapping).
    pub fn segment_freed(&mut self, segment: u64) {
        let slot = usize::try_from(segment).ok();
        if let Some(g) = slot.and_then(|s| self.gens.gens.get_mut(s)) {
            *g = g.wrapping_add(1);
            self.freed_since_sweep = true;
        }
    }

    /// The store has `segments` segments now (a pool's physical resize):
    /// hooks may name the tables of the segments added. A shrink keeps
    /// the generations (the segments it dropped were freed: every hook
    /// into them is dead) and the geometry.
    pub fn grow_segments(&mut self, segments: u64) {
        if segments > self.gens.geo.segments {
            self.gens.gens.resize(segments as usize, 0);
            self.gens.geo.segments = segments;
        }
    }

    pub fn stats(&self) -> HookStats {
        HookStats {
            entries: self.entries,
            capacity: self.capacity(),
            sample_bits: self.k,
            memory_bytes: self.memory_bytes(),
            evictions: self.evictions,
            sweeps: self.sweeps,
            full: self.k == MAX_SAMPLE_BITS && self.entries * 4 >= self.capacity() * 3,
        }
    }

    pub fn memory_bytes(&self) -> u64 {
        self.buckets.len() as u64 * BUCKET_BYTES + self.gens.gens.len() as u64
    }

    /// Buckets in the index (a snapshot is only loaded into an index of
    /// the same size: a bucket is a function of the key and the count).
    pub fn bucket_count(&self) -> u64 {
        self.buckets.len() as u64
    }

    /// Buckets `first..first + n` in their persisted form: `BUCKET_SLOTS`
    /// words a bucket, each live entry as `tag << 40 | table` (the absolute
    /// table index, the generation field zero: generations are memory
    /// only), 0 for a free or dead slot.
    pub fn export(&self, first: u64, n: u64) -> Vec<u64> {
        let end = (first + n).min(self.bucket_count());
        let mut out = Vec::with_capacity(((end - first.min(end)) as usize) * BUCKET_SLOTS);
        for b in &self.buckets[first.min(end) as usize..end as usize] {
            for &e in &b.0 {
                let live = self.gens.live(e) && tag_sampled(entry_tag(e), self.k);
                out.push(match live {
                    true => entry_tag(e) << TAG_SHIFT | u64::from(self.gens.table(e)),
                    false => 0,
                });
            }
        }
        out
    }

    /// Loads buckets from `first` in the form `export` gives, persisted
    /// with sample bits `k` (the index's `k` is raised to it): an entry
    /// whose table `accept` takes fills a free slot of its bucket (an
    /// entry already there, learnt since open, wins), with its segment's
    /// current generation. Returns the entries taken.
    pub fn import(
        &mut self,
        first: u64,
        words: &[u64],
        k: u8,
        mut accept: impl FnMut(u32) -> bool,
    ) -> u64 {
        if k > self.k && k <= MAX_SAMPLE_BITS {
            self.k = k;
            self.cursor = 0; // clear what the old k sampled and the new does not
        }
        let mut taken = 0;
        for (j, bucket) in words.chunks(BUCKET_SLOTS).enumerate() {
            let Some(b) = self.buckets.get_mut(first as usize + j) else {
                break;
            };
            for &w in bucket.iter().filter(|&&w| w != 0) {
                let (tag, table) = (entry_tag(w), w as u32);
                let Some(rel) = self.gens.rel(table) else {
                    continue;
                };
                if !tag_sampled(tag, self.k) || b.0.iter().any(|&e| e != 0 && entry_tag(e) == tag) {
                    continue;
                }
                let Some(free) = b.0.iter().position(|&e| e == 0) else {
                    break;
                };
                if !accept(table) {
                    continue;
                }
                let gen = u64::from(self.gens.gen_of_rel(rel));
                b.0[free] = tag << TAG_SHIFT | gen << GEN_SHIFT | (rel + 1);
                taken += 1;
            }
        }
        self.entries += taken;
        taken
    }
}

#[cfg(test)]
mod tests;
