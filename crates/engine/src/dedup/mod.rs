//! Inline deduplication: block fingerprints, the bounded fingerprint index,
//! and the table of shared records (reference counts).
//!
//! Fingerprint: xxh3-128 seeded per volume. A match is only a candidate:
//! the stored block is read back (read cache, log buffer or store),
//! decompressed and compared byte for byte before the new block refers to
//! it, so a collision, accidental or crafted, costs a missed dedup, never
//! wrong data. docs/FORMAT.md has the argument and the measurement that chose
//! this over keyed BLAKE3-128 trusted without a read.
//!
//! Index: a set-associative table of `WAYS`-slot sets, exact LRU inside each
//! set, sized from a memory budget at open. When a set is full the least
//! recently used slot of that set is forgotten. Slots are hints: a hit is
//! validated against the map (the record must still be live) before use, so
//! stale slots cost a lookup, never correctness.
//!
//! Shared records: a DATA record referenced by exactly one map entry (its
//! owner, the LBA in its header) is not in the table. The first dedup
//! reference puts it in with a count of 2; it stays while any entry points
//! at it and leaves at 0, when its bytes become dead. So a record is live
//! iff it is in the table, or its owner's map entry points at it.
use cvol_format::MapEntry;
use std::sync::Arc;

pub mod hooks;
mod packed_share;
use packed_share::ShareSlot;
pub use packed_share::{counts_of, GroupRows, PackedShare, ShareRow};
pub mod tables;
mod window;
pub use window::{HookLoad, Index};

pub type Fingerprint = u128;

/// Per-volume fingerprint seed (from the volume uuid).
pub fn volume_seed(uuid: &[u8; 16]) -> u64 {
    u64::from_le_bytes(uuid[..8].try_into().expect("8 bytes")) ^ 0x6376_6f6c_6465_6475
}

/// How a volume's blocks are fingerprinted: xxh3-128 with a seed of the
/// uuid, or, on an encrypted volume, xxh3-128 of the block put through
/// BLAKE3 keyed with a subkey of the data key (a pseudo-random function of
/// the digest: without the key a fingerprint says nothing about the data
/// and cannot be computed for a guessed block, nor compared across
/// volumes).
#[derive(Clone)]
pub enum FpKey {
    Seed(u64),
    Keyed(Box<[u8; 32]>),
}

impl FpKey {
    /// The fingerprint key of the volume `sb` describes (unlocked).
    pub fn of(sb: &cvol_format::Superblock) -> FpKey {
        match sb.sealer() {
            Some(s) => FpKey::Keyed(Box::new(*s.fingerprint_key())),
            None => FpKey::Seed(volume_seed(&sb.uuid)),
        }
    }
}

impl std::fmt::Debug for FpKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FpKey::Seed(s) => write!(f, "Seed({s:#x})"),
            FpKey::Keyed(_) => write!(f, "Keyed(..)"),
        }
    }
}

pub fn fingerprint(fp_key: &FpKey, block: &[u8]) -> Fingerprint {
    // The index keys on the upper 64 bits, and 0 there marks an empty slot:
    // never 0 (a block hashing to it shares its key with one other value).
    let f = match fp_key {
        FpKey::Seed(seed) => xxhash_rust::xxh3::xxh3_128_with_seed(block, *seed),
        FpKey::Keyed(k) => {
            // BLAKE3 of the whole block costs 1.9 us on the machines we
            // measure (8x xxh3, a fifth of a write's CPU): it keys xxh3's
            // digest instead. Matches are verified byte for byte as always,
            // so xxh3's collisions cost a read, never data.
            let digest = xxhash_rust::xxh3::xxh3_128(block).to_le_bytes();
            let h = blake3::keyed_hash(k, &digest);
            u128::from_le_bytes(h.as_bytes()[..16].try_into().expect("16 bytes"))
        }
    };
    if key(f) == 0 {
        f | 1 << 64
    } else {
        f
    }
}

/// What the index and the fingerprint tables keep of a fingerprint: its
/// upper 64 bits (every match is verified byte for byte, so 64 bits only
/// bound the wasted verifications: about 2^-61 per lookup in a set of 8).
pub fn key(fp: Fingerprint) -> u64 {
    (fp >> 64) as u64
}

const WAYS: usize = 8;

/// 24 bytes: the fingerprint's key, the record's map entry, and its owner
/// LBA (logical sizes up to 16 TiB keep LBAs below 2^32).
#[derive(Clone, Copy, Default)]
struct Slot {
    fp: u64,
    loc: u64,
    crc: u32,
    /// The LBA named in the record's header when it was indexed.
    owner: u32,
}

impl Slot {
    fn new(fp: Fingerprint, entry: MapEntry, owner: u64) -> Slot {
        Slot {
            fp: key(fp),
            loc: entry.loc,
            crc: entry.crc,
            owner: u32::try_from(owner).expect("LBA below 2^32"),
        }
    }

    fn is(&self, fp: Fingerprint) -> bool {
        self.fp == key(fp)
    }

    fn empty(&self) -> bool {
        self.fp == 0
    }

    fn entry(&self) -> MapEntry {
        MapEntry {
            loc: self.loc,
            crc: self.crc,
        }
    }
}

/// Bytes one slot costs (the budget is divided by this).
pub const SLOT_BYTES: u64 = std::mem::size_of::<Slot>() as u64;

pub struct DedupIndex {
    slots: Vec<Slot>,
    set_mask: u64,
    pub entries: u64,
}

impl DedupIndex {
    /// An index of at most `budget_bytes`, and no larger than `max_useful`
    /// entries (a small volume cannot hold more distinct blocks).
    pub fn new(budget_bytes: u64, max_useful: u64) -> DedupIndex {
        let by_budget = (budget_bytes / SLOT_BYTES / WAYS as u64).max(1);
        let by_need = (max_useful.div_ceil(WAYS as u64) * 2).max(1);
        let mut sets = by_budget.min(by_need).next_power_of_two();
        if sets * WAYS as u64 * SLOT_BYTES > budget_bytes.max(SLOT_BYTES * WAYS as u64) {
            sets /= 2; // next_power_of_two rounded up past the budget
        }
        let sets = sets.max(1);
        let mut slots = vec![Slot::default(); (sets as usize) * WAYS];
        // Touch every page now: the index is a fixed, configured cost, and
        // first-touch page faults would otherwise land on client writes.
        for s in slots.iter_mut().step_by(4096 / SLOT_BYTES as usize) {
            // SAFETY: `s` is a valid, aligned, exclusive reference.
            unsafe { std::ptr::write_volatile(s, Slot::default()) };
        }
        DedupIndex {
            slots,
            set_mask: sets - 1,
            entries: 0,
        }
    }

    pub fn capacity(&self) -> u64 {
        self.slots.len() as u64
    }

    pub fn memory_bytes(&self) -> u64 {
        self.slots.len() as u64 * SLOT_BYTES
    }

    /// The first slot of `fp`'s set: the high bits pick the set (the
    /// fingerprint is uniform).
    fn set_start(&self, fp: Fingerprint) -> usize {
        ((fp >> 64) as u64 & self.set_mask) as usize * WAYS
    }

    fn set(&mut self, fp: Fingerprint) -> &mut [Slot] {
        let i = self.set_start(fp);
        &mut self.slots[i..i + WAYS]
    }

    /// Starts loading `fp`'s set into the CPU cache. The index is far larger
    /// than the cache, so each lookup or insert of a random fingerprint is a
    /// cache miss (with dedup on, 10-15% of a real-data sequential write's
    /// CPU went to waiting for them); prefetching a request's sets before
    /// the first lookup overlaps the misses instead.
    pub fn prefetch(&self, fp: Fingerprint) {
        let i = self.set_start(fp);
        let set = &self.slots[i..i + WAYS];
        #[cfg(target_arch = "x86_64")]
        {
            let start = set.as_ptr().cast::<i8>();
            let bytes = std::mem::size_of_val(set);
            for off in (0..bytes).step_by(64).chain(std::iter::once(bytes - 1)) {
                // SAFETY: a prefetch is a hint that never faults; the
                // address lies inside the set anyway.
                unsafe {
                    std::arch::x86_64::_mm_prefetch(start.add(off), std::arch::x86_64::_MM_HINT_T0)
                };
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = set;
    }

    /// The slot for `fp`, made most recently used.
    pub fn lookup(&mut self, fp: Fingerprint) -> Option<(MapEntry, u64)> {
        let set = self.set(fp);
        let pos = set.iter().position(|s| s.is(fp))?;
        set[..=pos].rotate_right(1);
        Some((set[0].entry(), u64::from(set[0].owner)))
    }

    /// Inserts or refreshes `fp` as most recently used; the set's least
    /// recently used slot is forgotten when it is full.
    pub fn insert(&mut self, fp: Fingerprint, entry: MapEntry, owner: u64) {
        let set = self.set(fp);
        let pos = set
            .iter()
            .position(|s| s.is(fp))
            .or_else(|| set.iter().position(Slot::empty))
            .unwrap_or(WAYS - 1);
        let new = set[pos].empty();
        set[..=pos].rotate_right(1);
        set[0] = Slot::new(fp, entry, owner);
        if new {
            self.entries += 1;
        }
        debug_assert!(self.entries <= self.capacity());
    }

    /// Inserts `fp` only into a free slot of its set (never evicting what
    /// live writes taught the index). Returns false when the set is full.
    pub fn insert_if_room(&mut self, fp: Fingerprint, entry: MapEntry, owner: u64) -> bool {
        let set = self.set(fp);
        if set.iter().any(|s| s.is(fp)) {
            return true;
        }
        let Some(pos) = set.iter().position(Slot::empty) else {
            return false;
        };
        set[pos] = Slot::new(fp, entry, owner);
        self.entries += 1;
        true
    }

    /// Learns `fp` from a persisted hint (the warm-up, oldest hint first):
    /// a slot already holding `fp` takes the newer hint in place (a record
    /// moved or rewritten since the older one), else a free slot of its set
    /// takes it. Returns false when the set is full.
    pub fn learn(&mut self, fp: Fingerprint, entry: MapEntry, owner: u64) -> bool {
        let set = self.set(fp);
        if let Some(s) = set.iter_mut().find(|s| s.is(fp)) {
            *s = Slot::new(fp, entry, owner);
            return true;
        }
        self.insert_if_room(fp, entry, owner)
    }

    /// Forgets `fp` if it still names `entry`'s record (which is gone).
    pub fn forget(&mut self, fp: Fingerprint, entry: &MapEntry) {
        let set = self.set(fp);
        if let Some(pos) = set
            .iter()
            .position(|s| s.is(fp) && s.entry().same_record(entry))
        {
            set[pos..].rotate_left(1);
            set[WAYS - 1] = Slot::default();
            self.entries = self.entries.checked_sub(1).expect("a slot was counted");
        }
    }

    /// Repoints `fp` from `from` to a moved copy of the same record; learns
    /// it (into a free slot only) when the index does not hold `fp`. A slot
    /// naming another record of the same content is kept.
    pub fn moved(&mut self, fp: Fingerprint, from: &MapEntry, to: MapEntry, owner: u64) {
        let set = self.set(fp);
        match set.iter_mut().find(|s| s.is(fp)) {
            Some(s) if s.entry().same_record(from) => *s = Slot::new(fp, to, owner),
            Some(_) => {}
            None => {
                self.insert_if_room(fp, to, owner);
            }
        }
    }
}

/// A single-block record with dedup references (`SharedTable::get` also
/// reports live units in this shape, with crc and fp 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shared {
    /// Ref entries pointing at the record.
    pub refs: u32,
    /// Owner entries pointing at it: 0 or 1 (the LBA in its header); up to
    /// its block count for a unit.
    pub owners: u32,
    /// The record's crc (identifies this life of the offset); 0 for a unit,
    /// whose entries carry crc xor block index.
    pub crc: u32,
    /// Its fingerprint, 0 if unknown (tables rebuilt at open; units).
    pub fp: Fingerprint,
}

impl Shared {
    /// Map entries pointing at the record.
    pub fn entries(&self) -> u32 {
        self.refs + self.owners
    }

    /// Blocks served without storing them again: a single-block record
    /// stores one block for all its entries. (For a unit, each ref counts:
    /// see `SharedTable::acquire`.)
    pub fn extra(&self) -> u64 {
        u64::from(self.entries().saturating_sub(1))
    }
}

/// Entries pointing at a unit that ref entries point into: 8 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnitLive {
    pub refs: u32,
    pub owners: u16,
}

/// A map keyed by record offset, with a fast hasher (the keys are
/// positions in the store, not attacker-chosen).
pub type OffsetMap<V> = rustc_hash::FxHashMap<u64, V>;
/// A map keyed by record offset, in offset order: the records of a range
/// of segments are one range of it (what a checkpoint's group tables
/// read, `liveness::tables`).
pub type OrderedMap<V> = std::collections::BTreeMap<u64, V>;

/// The shared records and live units of one segment.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SegShared {
    pub records: OrderedMap<Shared>,
    pub units: OrderedMap<UnitLive>,
}

/// Records with ref entries: single-block records, and units (records of
/// several blocks) that ref entries point into, with their owner entries
/// counted (a unit no ref entry points at has no row: its owner entries
/// all lie in its window of the map, `liveness`), by physical offset of
/// their header,
/// grouped by segment: a checkpoint takes a segment's share copy-on-write
/// (`segment`), as it takes map pages.
#[derive(Debug, Clone)]
pub struct SharedTable {
    base: u64,
    segment_size: u64,
    segs: Vec<Option<ShareSlot>>,
    records_len: usize,
    units_len: usize,
    /// Sum over the records of `Shared::extra`: blocks served without a
    /// record of their own.
    pub extra_refs: u64,
    /// The first damage found in packed rows decoded to change
    /// (`damaged_rows`).
    damage: Option<String>,
}

impl Default for SharedTable {
    fn default() -> Self {
        SharedTable::new(0, 1 << 20)
    }
}

impl SharedTable {
    /// An empty table of records in segments of `segment_size` bytes from
    /// byte `base` on.
    pub fn new(base: u64, segment_size: u64) -> SharedTable {
        SharedTable {
            base,
            segment_size,
            segs: Vec::new(),
            records_len: 0,
            units_len: 0,
            extra_refs: 0,
            damage: None,
        }
    }

    fn index(&self, offset: u64) -> usize {
        let rel = offset
            .checked_sub(self.base)
            .expect("a record in the data area");
        usize::try_from(rel / self.segment_size).expect("a segment index")
    }

    fn seg(&self, offset: u64) -> Option<&SegShared> {
        Some(&**self.segs.get(self.index(offset))?.as_ref()?.share())
    }

    fn seg_mut(&mut self, offset: u64) -> &mut SegShared {
        let i = self.index(offset);
        if i >= self.segs.len() {
            self.segs.resize(i + 1, None);
        }
        if let Some(ShareSlot::Packed(p)) = &self.segs[i] {
            // Decoded to change: the totals took the counts its table
            // claimed, and now take what the rows hold (the same, unless
            // the rows were damaged: `PackedShare::damage`).
            let (claimed, share) = (p.claimed(), p.share().clone());
            if self.damage.is_none() {
                self.damage = p.damage().map(|why| format!("segment {i}: {why}"));
            }
            // Added before the claimed counts are taken off: a caller may
            // have taken off a row's share of `extra_refs` already (a unit
            // row replaced), which the claimed counts hold.
            let [records, units, extra] = counts_of(&share);
            self.records_len =
                self.records_len.saturating_add(records as usize) - claimed[0] as usize;
            self.units_len = self.units_len.saturating_add(units as usize) - claimed[1] as usize;
            self.extra_refs = self.extra_refs.saturating_add(extra) - claimed[2];
            self.segs[i] = Some(ShareSlot::Share(share));
        }
        (self.segs[i].get_or_insert_with(|| ShareSlot::Share(Arc::default()))).share_mut()
    }

    /// Segments whose rows are still packed, taken at their tables' counts
    /// (`PackedShare::at_its_word`).
    pub fn packed_at_their_word(&self) -> usize {
        (self.segs.iter().flatten())
            .filter(|s| matches!(s, ShareSlot::Packed(p) if p.at_its_word()))
            .count()
    }

    /// Why the rows of a segment still packed, decoded, are not what open
    /// counted (`PackedShare::damage`): the first such segment. Decodes
    /// every packed segment (`cvol check`, the simulations).
    pub fn damaged_rows(&self) -> Option<String> {
        if let Some(why) = &self.damage {
            return Some(why.clone());
        }
        self.segs
            .iter()
            .enumerate()
            .find_map(|(s, slot)| match slot {
                Some(ShareSlot::Packed(p)) => p.damage().map(|why| format!("segment {s}: {why}")),
                _ => None,
            })
    }

    /// Drops the segment of `offset` from the table once it holds nothing.
    fn tidy(&mut self, offset: u64) {
        let i = self.index(offset);
        if (self.segs.get(i).and_then(Option::as_ref))
            .is_some_and(|s| s.share().records.is_empty() && s.share().units.is_empty())
        {
            self.segs[i] = None;
        }
    }

    /// Segment `s`'s share, shared (a checkpoint's snapshot: changed
    /// afterwards, the table copies it first).
    pub fn segment(&self, s: u64) -> Option<Arc<SegShared>> {
        Some(
            self.segs
                .get(usize::try_from(s).ok()?)?
                .as_ref()?
                .share()
                .clone(),
        )
    }

    /// Sets segment `s`'s share (empty before: loading tables at open).
    pub fn insert_segment(&mut self, s: u64, share: SegShared) {
        let i = usize::try_from(s).expect("a segment index");
        if i >= self.segs.len() {
            self.segs.resize(i + 1, None);
        }
        assert!(self.segs[i].is_none(), "segment {s}'s share set twice");
        let [records, units, extra] = counts_of(&share);
        self.records_len += records as usize;
        self.units_len += units as usize;
        self.extra_refs += extra;
        self.segs[i] = Some(ShareSlot::Share(Arc::new(share)));
    }

    /// Sets segment `s`'s share (empty before) to rows left packed
    /// (`PackedShare`), which its table says hold `records` records,
    /// `units` units and serve `extra` blocks (`extra_refs`,
    /// `PackedShare::claimed`): loading tables at open.
    pub fn insert_packed_segment(&mut self, s: u64, rows: PackedShare) {
        let counts = rows.claimed();
        let i = usize::try_from(s).expect("a segment index");
        if i >= self.segs.len() {
            self.segs.resize(i + 1, None);
        }
        assert!(self.segs[i].is_none(), "segment {s}'s share set twice");
        // Counts from a table (bounded by its rows, `check_claimed_counts`):
        // a crafted sum saturates rather than wrapping.
        let [records, units, extra] = counts;
        self.records_len = self.records_len.saturating_add(records as usize);
        self.units_len = self.units_len.saturating_add(units as usize);
        self.extra_refs = self.extra_refs.saturating_add(extra);
        self.segs[i] = Some(ShareSlot::Packed(Arc::new(rows)));
    }

    pub fn record(&self, offset: u64) -> Option<&Shared> {
        self.seg(offset)?.records.get(&offset)
    }

    pub fn unit(&self, offset: u64) -> Option<&UnitLive> {
        self.seg(offset)?.units.get(&offset)
    }

    pub fn insert_record(&mut self, offset: u64, s: Shared) {
        let new = self.seg_mut(offset).records.insert(offset, s).is_none();
        self.records_len += usize::from(new);
    }

    pub fn remove_record(&mut self, offset: u64) {
        if self.record(offset).is_some() {
            self.seg_mut(offset).records.remove(&offset);
            self.records_len -= 1;
            self.tidy(offset);
        }
    }

    pub fn insert_unit(&mut self, offset: u64, u: UnitLive) {
        let new = self.seg_mut(offset).units.insert(offset, u).is_none();
        self.units_len += usize::from(new);
    }

    pub fn remove_unit(&mut self, offset: u64) {
        if self.unit(offset).is_some() {
            self.seg_mut(offset).units.remove(&offset);
            self.units_len -= 1;
            self.tidy(offset);
        }
    }

    /// Every shared record, in offset order.
    pub fn records(&self) -> impl Iterator<Item = (u64, &Shared)> {
        (self.segs.iter().flatten()).flat_map(|s| s.share().records.iter().map(|(&o, r)| (o, r)))
    }

    /// Every live unit, in offset order.
    pub fn units(&self) -> impl Iterator<Item = (u64, &UnitLive)> {
        (self.segs.iter().flatten()).flat_map(|s| s.share().units.iter().map(|(&o, u)| (o, u)))
    }

    pub fn record_count(&self) -> usize {
        self.records_len
    }

    pub fn unit_count(&self) -> usize {
        self.units_len
    }

    /// `extra_refs` recomputed from the rows.
    pub fn recount_extra(&mut self) {
        self.extra_refs = (self.segs.iter().flatten())
            .map(|s| counts_of(s.share())[2])
            .sum();
    }

    pub fn get(&self, offset: u64) -> Option<Shared> {
        self.record(offset).copied().or_else(|| {
            self.unit(offset).map(|u| Shared {
                refs: u.refs,
                owners: u32::from(u.owners),
                crc: 0,
                fp: 0,
            })
        })
    }

    /// Records with dedup references.
    pub fn shared_count(&self) -> u64 {
        (self.records_len + self.units_len) as u64
    }

    /// One more ref entry points at the live single-block record at
    /// `offset` (live through its owner entry until it is shared). Units
    /// are not counted here: `LiveMap::set` keeps their rows (`put_unit`).
    pub fn acquire(&mut self, offset: u64, crc: u32, fp: Fingerprint) {
        let mut new = false;
        let s = self
            .seg_mut(offset)
            .records
            .entry(offset)
            .or_insert_with(|| {
                new = true;
                Shared {
                    refs: 0,
                    owners: 1,
                    crc,
                    fp: 0,
                }
            });
        assert_eq!(s.crc, crc, "shared record at {offset} changed identity");
        let before = s.extra();
        s.refs += 1;
        if s.fp == 0 {
            s.fp = fp;
        }
        let gained = s.extra() - before;
        self.extra_refs += gained;
        self.records_len += usize::from(new);
    }

    /// An entry (a ref entry if `was_ref`, else its owner) stopped pointing
    /// at the single-block record at `offset`. None if the record is not
    /// in the table (its owner was its only entry); else whether the
    /// record is now dead.
    pub fn release(&mut self, offset: u64, was_ref: bool) -> Option<bool> {
        self.record(offset)?;
        let s = self
            .seg_mut(offset)
            .records
            .get_mut(&offset)
            .expect("found above");
        let before = s.extra();
        if was_ref {
            assert!(s.refs > 0, "ref count of the record at {offset} underflows");
            s.refs -= 1;
        } else {
            assert!(
                s.owners > 0,
                "owner of the record at {offset} released twice"
            );
            s.owners -= 1;
        }
        let lost = before - s.extra();
        let (refs, owners) = (s.refs, s.owners);
        self.extra_refs -= lost;
        if refs == 0 {
            // Only the owner left (unshared again), or nothing (dead).
            self.remove_record(offset);
            return Some(owners == 0);
        }
        Some(false)
    }

    /// Sets the row of the unit at `offset`: `Some` while ref entries
    /// point at it (`refs > 0`), `None` once none does. Keeps `extra_refs`
    /// (each ref to a unit block counts one).
    pub fn put_unit(&mut self, offset: u64, row: Option<UnitLive>) {
        let old = self.unit(offset).copied();
        self.extra_refs -= old.map_or(0, |u| u64::from(u.refs));
        self.extra_refs += row.map_or(0, |u| u64::from(u.refs));
        match row {
            Some(u) => {
                assert!(u.refs > 0, "a unit row without refs at {offset}");
                self.insert_unit(offset, u);
            }
            None => self.remove_unit(offset),
        }
    }

    /// The fingerprint of a shared record, 0 if not known.
    pub fn fingerprint_of(&self, offset: u64) -> Fingerprint {
        self.record(offset).map_or(0, |s| s.fp)
    }

    pub fn memory_bytes(&self) -> u64 {
        // A B-tree node holds up to 11 keys and values (about 2/3 full on
        // average) and a few words more; a slot per segment. Rows still
        // packed count as the bytes their table holds (compressed, in a
        // head-first table), at the counts they were taken at; decoded,
        // as built too (their table's bytes are kept).
        let (mut records, mut units, mut held) = (self.records_len, self.units_len, 0u64);
        for slot in self.segs.iter().flatten() {
            if let ShareSlot::Packed(p) = slot {
                held += p.held_bytes() as u64;
                if !p.is_decoded() {
                    let [r, u, _] = p.claimed();
                    records = records.saturating_sub(r as usize);
                    units = units.saturating_sub(u as usize);
                }
            }
        }
        let cost = |n: usize, value: usize| (n as u64) * (8 + value as u64) * 3 / 2;
        cost(records, std::mem::size_of::<Shared>())
            + cost(units, std::mem::size_of::<UnitLive>())
            + (self.segs.capacity() * 8) as u64
            + held
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cvol_format::CodecTag;

    fn e(off: u64) -> MapEntry {
        MapEntry::data(CodecTag::Lz4, off, 100, off as u32)
    }

    /// A fingerprint whose key (upper 64 bits) is `i`.
    fn f(i: u128) -> Fingerprint {
        i << 64
    }

    #[test]
    fn keys_are_the_upper_half_and_never_zero() {
        assert_eq!(key(f(7) | 3), 7);
        let seed = FpKey::Seed(volume_seed(&[3; 16]));
        for b in 0..2000u32 {
            let block = b.to_le_bytes().repeat(1024);
            assert_ne!(key(fingerprint(&seed, &block)), 0);
        }
    }

    #[test]
    fn fingerprints_depend_on_seed_and_content() {
        let k1 = FpKey::Seed(volume_seed(&[1; 16]));
        let k2 = FpKey::Seed(volume_seed(&[2; 16]));
        let a = vec![7u8; 4096];
        let mut b = a.clone();
        b[4095] = 8;
        assert_eq!(fingerprint(&k1, &a), fingerprint(&k1, &a));
        assert_ne!(fingerprint(&k1, &a), fingerprint(&k1, &b));
        assert_ne!(fingerprint(&k1, &a), fingerprint(&k2, &a));
        // Keyed (encrypted volumes): by key and content, and not xxh3's.
        let (x1, x2) = (
            FpKey::Keyed(Box::new([1; 32])),
            FpKey::Keyed(Box::new([2; 32])),
        );
        assert_eq!(fingerprint(&x1, &a), fingerprint(&x1, &a));
        assert_ne!(fingerprint(&x1, &a), fingerprint(&x1, &b));
        assert_ne!(fingerprint(&x1, &a), fingerprint(&x2, &a));
        assert_ne!(fingerprint(&x1, &a), fingerprint(&k1, &a));
    }

    #[test]
    fn index_is_lru_per_set_and_bounded() {
        let mut ix = DedupIndex::new(SLOT_BYTES * WAYS as u64, 1 << 20); // one set
        assert_eq!(ix.capacity(), WAYS as u64);
        for i in 1..=WAYS as u128 {
            ix.insert(f(i), e(i as u64), 0);
        }
        assert_eq!(ix.entries, WAYS as u64);
        // Touch 1: now 2 is the least recently used and goes first.
        assert!(ix.lookup(f(1)).is_some());
        ix.insert(f(100), e(100), 0);
        assert!(ix.lookup(f(2)).is_none());
        assert!(ix.lookup(f(1)).is_some());
        assert!(ix.lookup(f(100)).is_some());
        assert_eq!(ix.entries, WAYS as u64);
        ix.forget(f(100), &e(99)); // another record: kept
        assert!(ix.lookup(f(100)).is_some());
        ix.forget(f(100), &e(100));
        assert!(ix.lookup(f(100)).is_none());
        assert_eq!(ix.entries, WAYS as u64 - 1);
        let moved = e(5000);
        ix.moved(f(1), &e(1), moved, 9);
        assert_eq!(ix.lookup(f(1)), Some((moved, 9)));
    }

    #[test]
    fn slots_are_24_bytes() {
        assert_eq!(SLOT_BYTES, 24);
    }

    #[test]
    fn index_respects_budget() {
        for budget in [1u64 << 10, 1 << 20, 3 << 20, 100 << 20] {
            let ix = DedupIndex::new(budget, u64::MAX / 4);
            assert!(ix.memory_bytes() <= budget.max(SLOT_BYTES * WAYS as u64));
            assert!(ix.memory_bytes() * 2 > budget.min(ix.memory_bytes() * 2));
        }
        // Small volumes get small indexes.
        assert!(DedupIndex::new(1 << 30, 1000).memory_bytes() < 1 << 20);
    }

    #[test]
    fn shared_table_counts_exactly() {
        let mut t = SharedTable::default();
        assert_eq!(t.release(10, false), None); // not shared: the caller owns the answer
        t.acquire(10, 10, 0); // owner + one ref
        t.acquire(10, 10, 0);
        assert_eq!(t.get(10).unwrap().entries(), 3);
        assert_eq!(t.extra_refs, 2);
        // The last ref goes while the owner lives: unshared again, alive.
        assert_eq!(t.release(10, true), Some(false));
        assert_eq!(t.release(10, true), Some(false));
        assert_eq!(t.extra_refs, 0);
        assert!(t.get(10).is_none());
        // Owner goes first, then the refs: dead with the last ref.
        t.acquire(20, 20, 0);
        t.acquire(20, 20, 0);
        assert_eq!(t.release(20, false), Some(false));
        assert_eq!(t.extra_refs, 1);
        assert_eq!(t.release(20, true), Some(false));
        assert_eq!(t.extra_refs, 0);
        assert_eq!(t.release(20, true), Some(true));
        assert!(t.get(20).is_none());
    }

    #[test]
    fn unit_liveness_is_8_bytes() {
        assert_eq!(std::mem::size_of::<UnitLive>(), 8);
    }

    #[test]
    fn unit_rows_exist_only_with_refs_and_keep_extra_refs() {
        let mut t = SharedTable::default();
        t.put_unit(30, Some(UnitLive { refs: 1, owners: 2 }));
        assert_eq!(t.get(30).unwrap().entries(), 3);
        assert_eq!((t.extra_refs, t.shared_count(), t.unit_count()), (1, 1, 1));
        t.put_unit(30, Some(UnitLive { refs: 3, owners: 0 }));
        assert_eq!((t.extra_refs, t.unit_count()), (3, 1));
        t.put_unit(30, None);
        assert!(t.get(30).is_none());
        assert_eq!((t.extra_refs, t.unit_count()), (0, 0));
    }
}
