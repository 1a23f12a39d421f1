//! Segment table (allocation), segment usage (live bytes), victim policies
//! and relocation packing for the cleaner.
//!
//! A segment is Free (allocatable), Open (the log head) or Sealed (written,
//! possibly holding live records). A Sealed segment becomes Free again only
//! when no map entry points into it AND every record in it is older than the
//! snapshot of the newest durable checkpoint: then recovery needs nothing in it.

use crate::error::BadWord;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegState {
    Free,
    Open,
    Sealed,
}

/// Allocation state of every segment: the log's side of the segment table.
/// What lives in each segment is `SegmentUsage`, derived from the map and
/// kept by `LiveMap`; decisions that need both take the usage as an argument.
#[derive(Debug, Clone)]
pub struct SegmentTable {
    pub segment_size: u64,
    state: Vec<SegState>,
    /// Highest record seq written into each segment (0: none known since open).
    max_seq: Vec<u64>,
    /// Free segments of the data region, of the metadata region.
    free: [u64; 2],
    /// The first segment of the metadata region (`count` when there is
    /// none: a volume without a metadata device).
    split: u64,
    /// Allocation cursor per region: handed out round-robin from here.
    cursor: [u64; 2],
    /// Free data segments whose host space was kept (no hole punched when
    /// they were freed), oldest first, and how many may be kept. The log
    /// head reuses these first, newest first: writing over allocated (and
    /// likely cached) blocks costs the host a third of filling a hole
    /// (no block allocation, no page allocation). `punch_warm` returns the
    /// space once clients are idle, and at close.
    warm: std::collections::VecDeque<u64>,
    warm_max: usize,
    /// Warm segments the log head opened since open (for the simulations).
    pub warm_reused: u64,
}

/// Freed data segments keep their host space, for the log head to reuse,
/// up to this many bytes...
pub const WARM_BYTES_MAX: u64 = 512 << 20;
/// ...and this share of the data region (1/16): `du` of the backing may
/// exceed what the volume holds by that much while clients write.
pub const WARM_SHARE_DIVISOR: u64 = 16;

/// Where a segment is: the data store, or the metadata device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Region {
    Data = 0,
    Meta = 1,
}

impl SegmentTable {
    pub fn new(count: u64, segment_size: u64) -> SegmentTable {
        let n = count as usize;
        SegmentTable {
            segment_size,
            state: vec![SegState::Free; n],
            max_seq: vec![0; n],
            free: [count, 0],
            split: count,
            cursor: [0, count],
            warm: std::collections::VecDeque::new(),
            warm_max: 0,
            warm_reused: 0,
        }
    }

    /// How many freed data segments may keep their host space.
    pub fn set_warm_max(&mut self, segments: usize) {
        self.warm_max = segments;
    }

    /// Of `empty` (about to be freed), the ones to keep warm: as many as
    /// the pool has room for, data segments only. The others are punched.
    pub fn split_warm(&self, empty: &[u64]) -> (Vec<u64>, Vec<u64>) {
        let room = self.warm_max.saturating_sub(self.warm.len());
        let (mut keep, mut punch) = (Vec::new(), Vec::new());
        for &s in empty {
            match keep.len() < room && self.region(s) == Region::Data {
                true => keep.push(s),
                false => punch.push(s),
            }
        }
        (keep, punch)
    }

    /// Notes freed segments whose host space was kept.
    pub fn add_warm(&mut self, freed: &[u64]) {
        for &s in freed {
            debug_assert_eq!(self.state(s), SegState::Free);
            self.warm.push_back(s);
        }
    }

    /// The oldest warm segment, no longer warm: the caller returns its
    /// space while it holds the state lock (the log head cannot open it).
    pub fn take_warm(&mut self) -> Option<u64> {
        while let Some(s) = self.warm.pop_front() {
            if self.state(s) == SegState::Free {
                return Some(s);
            }
        }
        None
    }

    /// Free segments that still hold host space.
    pub fn warm_count(&self) -> u64 {
        self.warm.len() as u64
    }

    /// The table of `sb`'s volume: data segments, then the metadata device's.
    pub fn for_volume(sb: &cvol_format::Superblock) -> SegmentTable {
        let mut t = SegmentTable::new(sb.segment_count(), sb.segment_size_bytes);
        t.warm_max = SegmentTable::warm_max_for(sb);
        t.split_at(sb.data_segment_count())
    }

    /// How many freed segments of `sb`'s volume may keep their host space.
    pub fn warm_max_for(sb: &cvol_format::Superblock) -> usize {
        let data_bytes = sb.data_segment_count() * sb.segment_size_bytes;
        let warm_bytes = (data_bytes / WARM_SHARE_DIVISOR).min(WARM_BYTES_MAX);
        usize::try_from(warm_bytes / sb.segment_size_bytes).unwrap_or(usize::MAX)
    }

    /// The data store now has `count` segments (a pool's physical resize;
    /// a volume without a metadata device): segments added are free, and
    /// segments dropped must be free (the caller checked). None if one
    /// of them is not.
    pub fn resize_data(&mut self, count: u64) -> Option<()> {
        assert!(
            !self.has_meta(),
            "a volume with a metadata device keeps its size"
        );
        let old = self.count();
        if (count..old).any(|s| self.state(s) != SegState::Free) {
            return None;
        }
        let n = count as usize;
        self.state.resize(n, SegState::Free);
        self.max_seq.resize(n, 0);
        self.free[0] = self.free[0] + count.saturating_sub(old) - old.saturating_sub(count);
        self.split = count;
        self.cursor = [self.cursor[0] % count.max(1), count];
        self.warm.retain(|&s| s < count);
        debug_assert_eq!(
            self.free[0],
            self.state.iter().filter(|&&x| x == SegState::Free).count() as u64
        );
        Some(())
    }

    /// Makes segments from `first_meta` on the metadata region (all free).
    pub fn split_at(mut self, first_meta: u64) -> SegmentTable {
        assert!(first_meta <= self.count() && self.free == [self.count(), 0]);
        self.split = first_meta;
        self.free = [first_meta, self.count() - first_meta];
        self.cursor = [0, first_meta];
        self
    }

    pub fn region(&self, s: u64) -> Region {
        if s < self.split {
            Region::Data
        } else {
            Region::Meta
        }
    }

    /// Whether the volume has a metadata region.
    pub fn has_meta(&self) -> bool {
        self.split < self.count()
    }

    /// The segments of a region.
    pub fn range(&self, r: Region) -> std::ops::Range<u64> {
        match r {
            Region::Data => 0..self.split,
            Region::Meta => self.split..self.count(),
        }
    }

    pub fn count(&self) -> u64 {
        self.state.len() as u64
    }

    /// Free segments of the data region (the whole table without a
    /// metadata device): what client writes and the cleaner work with.
    pub fn free_count(&self) -> u64 {
        self.free[0]
    }

    /// Free segments of `r`.
    pub fn free_in(&self, r: Region) -> u64 {
        self.free[r as usize]
    }

    pub fn state(&self, s: u64) -> SegState {
        self.state[s as usize]
    }

    pub fn max_seq(&self, s: u64) -> u64 {
        self.max_seq[s as usize]
    }

    fn set_state(&mut self, s: u64, st: SegState) {
        let old = self.state[s as usize];
        let r = self.region(s) as usize;
        if old == SegState::Free && st != SegState::Free {
            self.free[r] -= 1;
        }
        if old != SegState::Free && st == SegState::Free {
            self.free[r] += 1;
        }
        self.state[s as usize] = st;
        debug_assert_eq!(
            self.free[0] + self.free[1],
            self.state.iter().filter(|&&x| x == SegState::Free).count() as u64
        );
    }

    /// Marks a segment in use as found by recovery.
    pub fn mark(&mut self, s: u64, st: SegState, max_seq: u64) {
        self.set_state(s, st);
        self.max_seq[s as usize] = self.max_seq[s as usize].max(max_seq);
    }

    /// Takes the next free data segment (round-robin) and opens it.
    pub fn open_next(&mut self) -> Option<u64> {
        self.open_next_in(Region::Data)
    }

    /// Takes the next free segment of region `r` (round-robin) and opens it.
    pub fn open_next_in(&mut self, r: Region) -> Option<u64> {
        let found = match self.pop_warm(r) {
            Some(s) => s,
            None => {
                let range = self.range(r);
                let n = range.end - range.start;
                let at = self.cursor[r as usize] - range.start;
                let s = (0..n)
                    .map(|i| range.start + (at + i) % n)
                    .find(|&s| self.state[s as usize] == SegState::Free)?;
                self.cursor[r as usize] = range.start + (s - range.start + 1) % n;
                s
            }
        };
        let free_before = self.free[r as usize];
        self.set_state(found, SegState::Open);
        assert_eq!(self.free[r as usize] + 1, free_before);
        self.max_seq[found as usize] = 0;
        Some(found)
    }

    /// The most recently freed warm segment of `r` still free, if any.
    fn pop_warm(&mut self, r: Region) -> Option<u64> {
        if r != Region::Data {
            return None;
        }
        while let Some(s) = self.warm.pop_back() {
            if self.state(s) == SegState::Free {
                self.warm_reused += 1;
                return Some(s);
            }
        }
        None
    }

    pub fn seal(&mut self, s: u64) {
        assert_eq!(
            self.state(s),
            SegState::Open,
            "only the open segment is sealed"
        );
        self.set_state(s, SegState::Sealed);
    }

    pub fn note_seq(&mut self, s: u64, seq: u64) {
        assert_eq!(
            self.state(s),
            SegState::Open,
            "records go to an open segment"
        );
        let m = &mut self.max_seq[s as usize];
        *m = (*m).max(seq);
    }

    /// Sealed segments that hold no live data and no record newer than
    /// `snapshot_seq`: once the map state that emptied them is durable (the
    /// caller syncs first) and a checkpoint with that snapshot is durable,
    /// recovery needs nothing in them.
    pub fn reclaimable(&self, usage: &SegmentUsage, snapshot_seq: u64) -> Vec<u64> {
        (0..self.count())
            .filter(|&s| {
                self.state(s) == SegState::Sealed
                    && usage.live_bytes(s) == 0
                    && self.max_seq(s) <= snapshot_seq
            })
            .collect()
    }

    /// Frees those of `candidates` that are still empty (a sealed segment
    /// never gains live data, so this is a re-check, not a race).
    pub fn free_empty(&mut self, usage: &SegmentUsage, candidates: &[u64]) -> Vec<u64> {
        let mut out = Vec::new();
        for &s in candidates {
            if self.is_sealed_empty(usage, s) {
                self.set_state(s, SegState::Free);
                out.push(s);
            }
        }
        out
    }

    /// Is `s` sealed and without live data (free to reuse once reclaimed)?
    pub fn is_sealed_empty(&self, usage: &SegmentUsage, s: u64) -> bool {
        self.state(s) == SegState::Sealed && usage.live_bytes(s) == 0
    }

    /// Sealed segments holding no live data: a checkpoint would free them.
    pub fn empty_sealed_count(&self, usage: &SegmentUsage) -> u64 {
        (0..self.count())
            .filter(|&s| self.is_sealed_empty(usage, s))
            .count() as u64
    }

    /// Sealed data segments with some dead space, as (segment, live bytes,
    /// max seq): the cleaner's candidates.
    pub fn candidates(&self, usage: &SegmentUsage) -> Vec<(u64, u64, u64)> {
        self.candidates_in(Region::Data, usage)
    }

    /// Sealed data segments whose live bytes less what compacting them
    /// saves (`saving`) are below a segment, as (segment, those bytes, max
    /// seq): the cleaner's candidates when it compacts units.
    pub fn candidates_after(
        &self,
        usage: &SegmentUsage,
        saving: impl Fn(u64, u64) -> u64,
    ) -> Vec<(u64, u64, u64)> {
        self.range(Region::Data)
            .filter(|&s| self.state(s) == SegState::Sealed)
            .map(|s| {
                let live = usage.live_bytes(s);
                (s, live - saving(s, live).min(live), self.max_seq(s))
            })
            .filter(|&(_, left, _)| left < self.segment_size)
            .collect()
    }

    /// Sealed segments of `r` with some dead space.
    pub fn candidates_in(&self, r: Region, usage: &SegmentUsage) -> Vec<(u64, u64, u64)> {
        self.range(r)
            .filter(|&s| {
                self.state(s) == SegState::Sealed && usage.live_bytes(s) < self.segment_size
            })
            .map(|s| (s, usage.live_bytes(s), self.max_seq(s)))
            .collect()
    }
}

/// Bytes of live records (header + payload) per segment: derived from the
/// map, changed only by `LiveMap` (a record is born or dies).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentUsage {
    segment_size: u64,
    live: Vec<u64>,
}

impl SegmentUsage {
    pub fn new(count: u64, segment_size: u64) -> SegmentUsage {
        SegmentUsage {
            segment_size,
            live: vec![0; count as usize],
        }
    }

    pub fn count(&self) -> u64 {
        self.live.len() as u64
    }

    pub fn live_bytes(&self, s: u64) -> u64 {
        self.live[s as usize]
    }

    pub fn total_live_bytes(&self) -> u64 {
        self.live.iter().sum()
    }

    /// `count` segments: added ones hold nothing; dropped ones must not.
    pub(crate) fn resize(&mut self, count: u64) {
        let n = count as usize;
        assert!(
            self.live.iter().skip(n).all(|&l| l == 0),
            "a segment dropped holds live bytes"
        );
        self.live.resize(n, 0);
    }

    pub(crate) fn add_live(&mut self, s: u64, bytes: u64) {
        let l = &mut self.live[s as usize];
        *l += bytes;
        assert!(
            *l <= self.segment_size,
            "segment {s} holds {l} live bytes, more than it has"
        );
    }

    pub(crate) fn sub_live(&mut self, s: u64, bytes: u64) {
        let l = &mut self.live[s as usize];
        *l = l
            .checked_sub(bytes)
            .unwrap_or_else(|| panic!("segment {s} live bytes would go negative"));
    }
}

/// How the cleaner picks victims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VictimPolicy {
    /// Fewest live bytes first.
    Greedy,
    /// LFS cost-benefit: highest (1 - u) * age / (1 + u) first.
    CostBenefit,
}

impl VictimPolicy {
    pub fn parse(s: &str) -> Result<VictimPolicy, BadWord> {
        match s {
            "greedy" => Ok(VictimPolicy::Greedy),
            "cost-benefit" => Ok(VictimPolicy::CostBenefit),
            _ => Err(BadWord(format!(
                "unknown cleaner policy '{s}': expected greedy or cost-benefit"
            ))),
        }
    }

    /// Orders candidates (segment, live bytes, max seq) best victim first.
    pub fn order(self, mut c: Vec<(u64, u64, u64)>, segment_size: u64, now_seq: u64) -> Vec<u64> {
        match self {
            VictimPolicy::Greedy => c.sort_by_key(|&(s, live, _)| (live, s)),
            VictimPolicy::CostBenefit => {
                let score = |live: u64, max_seq: u64| {
                    let u = live as f64 / segment_size as f64;
                    let age = now_seq.saturating_sub(max_seq) as f64 + 1.0;
                    (1.0 - u) * age / (1.0 + u)
                };
                c.sort_by(|a, b| {
                    score(b.1, b.2)
                        .total_cmp(&score(a.1, a.2))
                        .then(a.0.cmp(&b.0))
                });
            }
        }
        c.into_iter().map(|(s, _, _)| s).collect()
    }
}

/// What cleaning a segment would save beyond its dead bytes, estimated
/// per segment, in memory only (rebuilt by nothing: a reopened volume
/// starts without hints, and background recompression finds the raw units
/// itself): merged units some of whose blocks were overwritten (the unit
/// stays wholly live until its last block dies, and the cleaner rewrites
/// it as a record of its live blocks), and raw units that deferred
/// compression wrote (the cleaner compresses them as it moves them). The
/// cleaner ranks victims by live bytes less this saving, so a segment
/// full of such units is a victim like one full of dead records. A hint
/// overstates, on purpose: each block a live unit loses adds its share of
/// the unit's remaining owners, and nothing is taken back when the unit
/// dies, so segments where units were overwritten rank as victims early
/// (an estimate that took shares back at a unit's death ranked them too
/// late: under random 4 KiB overwrites of 16 KiB units at 80% live the
/// hidden dead shares grew faster than the cleaner collected them, and
/// writes failed). It is capped at the segment's live bytes, dropped when
/// the segment is cleaned or freed, and not counted as reclaimable space.
#[derive(Debug, Clone, Default)]
pub struct CompactionHints {
    /// Bytes of overwritten blocks' shares of units still live.
    partial: Vec<u64>,
    /// Bytes of live raw units (deferred compression).
    raw: Vec<u64>,
    raw_total: u64,
}

impl CompactionHints {
    pub fn new(count: u64) -> CompactionHints {
        CompactionHints {
            partial: vec![0; count as usize],
            raw: vec![0; count as usize],
            raw_total: 0,
        }
    }

    /// A block of a unit in segment `s` died while the unit stays live;
    /// `share` is its part of the unit's bytes.
    pub fn unit_block_died(&mut self, s: u64, share: u64) {
        self.partial[s as usize] += share;
    }

    /// A raw unit of `len` bytes in segment `s` became live / died.
    pub fn raw_born(&mut self, s: u64, len: u64) {
        self.raw[s as usize] += len;
        self.raw_total += len;
    }

    pub fn raw_died(&mut self, s: u64, len: u64) {
        let r = &mut self.raw[s as usize];
        let d = len.min(*r);
        *r -= d;
        self.raw_total -= d;
    }

    /// Segment `s` was cleaned or freed: nothing of it is left to compact.
    pub fn reset(&mut self, s: u64) {
        self.partial[s as usize] = 0;
        self.raw_total -= self.raw[s as usize];
        self.raw[s as usize] = 0;
    }

    /// `count` segments: added ones have nothing to compact, dropped ones
    /// are forgotten.
    pub fn resize(&mut self, count: u64) {
        let n = count as usize;
        self.raw_total -= self.raw.iter().skip(n).sum::<u64>();
        self.partial.resize(n, 0);
        self.raw.resize(n, 0);
    }

    /// Bytes cleaning `s` (with `live` live bytes) is expected to save
    /// beyond its dead bytes: the overwritten shares, and half the raw
    /// units (the probe judged their data compressible, and lz4 stores
    /// such data in about half: a guess the cleaner checks when it reads
    /// the segment, copying a unit that does not shrink as it is).
    pub fn saving(&self, s: u64, live: u64) -> u64 {
        (self.partial[s as usize] + self.raw[s as usize] / 2).min(live)
    }

    /// Bytes of live raw units in the whole log (what deferral borrowed,
    /// at most).
    pub fn raw_total(&self) -> u64 {
        self.raw_total
    }
}

/// Order in which relocated records are appended. Records are taken in LBA
/// order (neighbours stay together); when the next one does not fit in the
/// space left in the current segment, the largest remaining record that fits
/// is placed instead (first-fit decreasing), so segment tails are not wasted.
/// `items` are (size, lba); `space` is what is left in the open segment.
pub fn pack_order(items: &[(u64, u64)], mut space: u64, segment_size: u64) -> Vec<usize> {
    let mut by_lba: Vec<usize> = (0..items.len()).collect();
    by_lba.sort_by_key(|&i| items[i].1);
    let mut by_size = by_lba.clone();
    by_size.sort_by_key(|&i| std::cmp::Reverse(items[i].0));
    let mut used = vec![false; items.len()];
    let mut out = Vec::with_capacity(items.len());
    let mut next = 0;
    while out.len() < items.len() {
        while used[by_lba[next]] {
            next += 1;
        }
        let i = by_lba[next];
        let pick = if items[i].0 <= space {
            i
        } else {
            match by_size
                .iter()
                .copied()
                .find(|&j| !used[j] && items[j].0 <= space)
            {
                Some(j) => j,
                None => {
                    space = segment_size; // a new segment opens
                    i
                }
            }
        };
        used[pick] = true;
        space -= items[pick].0.min(space);
        out.push(pick);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Freed segments kept warm are opened before any other, newest first;
    /// the pool keeps no more than its room; one taken for its punch is
    /// never opened.
    #[test]
    fn warm_segments_are_reused_first_and_bounded() {
        let mut t = SegmentTable::new(8, 100);
        let u = SegmentUsage::new(8, 100);
        t.set_warm_max(2);
        for want in 0..4 {
            assert_eq!(t.open_next(), Some(want));
            t.seal(want);
        }
        let empty = t.reclaimable(&u, u64::MAX);
        assert_eq!(empty, [0, 1, 2, 3]);
        let (warm, punch) = t.split_warm(&empty);
        assert_eq!(
            (warm.as_slice(), punch.as_slice()),
            (&[0, 1][..], &[2, 3][..])
        );
        assert_eq!(t.free_empty(&u, &empty), empty);
        t.add_warm(&warm);
        assert_eq!(t.split_warm(&[5]).0, Vec::<u64>::new(), "the pool is full");
        // The newest warm one first, then the cursor's round-robin (4...).
        assert_eq!(t.open_next(), Some(1));
        assert_eq!(t.warm_count(), 1);
        assert_eq!(t.take_warm(), Some(0), "taken for its punch");
        assert_eq!(t.open_next(), Some(4));
        assert_eq!(t.warm_reused, 1);
    }

    #[test]
    fn allocation_sealing_and_reclaim() {
        let mut t = SegmentTable::new(4, 100);
        let mut u = SegmentUsage::new(4, 100);
        assert_eq!(t.open_next(), Some(0));
        u.add_live(0, 60);
        t.note_seq(0, 10);
        t.seal(0);
        assert_eq!(t.open_next(), Some(1));
        assert_eq!(t.free_count(), 2);
        assert!(
            t.reclaimable(&u, 100).is_empty(),
            "live data keeps a segment"
        );
        u.sub_live(0, 60);
        assert!(
            t.reclaimable(&u, 9).is_empty(),
            "records newer than the checkpoint keep it"
        );
        assert_eq!(t.reclaimable(&u, 10), vec![0]);
        assert_eq!(t.free_empty(&u, &[0]), vec![0]);
        assert_eq!(t.free_count(), 3);
        assert_eq!(t.open_next(), Some(2), "round robin");
    }

    #[test]
    fn regions_allocate_and_count_apart() {
        let mut t = SegmentTable::new(6, 100).split_at(4);
        assert_eq!((t.free_in(Region::Data), t.free_in(Region::Meta)), (4, 2));
        assert_eq!(t.open_next_in(Region::Meta), Some(4));
        assert_eq!(t.open_next(), Some(0));
        assert_eq!(t.open_next_in(Region::Meta), Some(5));
        assert_eq!(
            t.open_next_in(Region::Meta),
            None,
            "the data region is not used"
        );
        assert_eq!(t.free_count(), 3, "data segments only");
        t.note_seq(5, 3);
        t.seal(5);
        let u = SegmentUsage::new(6, 100);
        assert_eq!(t.candidates(&u), Vec::<(u64, u64, u64)>::new());
        assert_eq!(t.candidates_in(Region::Meta, &u), vec![(5, 0, 3)]);
        assert_eq!(t.free_empty(&u, &[5]), vec![5]);
        assert_eq!(
            t.open_next_in(Region::Meta),
            Some(5),
            "round robin in its region"
        );
        assert_eq!((t.region(3), t.region(4)), (Region::Data, Region::Meta));
    }

    #[test]
    fn greedy_picks_emptiest_cost_benefit_prefers_old_cold() {
        let c = vec![(0, 50, 100), (1, 10, 990), (2, 30, 10)];
        assert_eq!(
            VictimPolicy::Greedy.order(c.clone(), 100, 1000),
            vec![1, 2, 0]
        );
        // segment 2 is older and fairly empty: it wins under cost-benefit
        assert_eq!(VictimPolicy::CostBenefit.order(c, 100, 1000)[0], 2);
    }

    #[test]
    fn packing_keeps_lba_order_and_fills_tails() {
        let items = vec![(40, 3), (30, 1), (90, 2), (10, 4)];
        // 100 left: lba1 (30) fits, lba2 (90) does not -> largest that fits (40, lba3),
        // then 10 (lba4) -> 20 left, 90 opens a new segment.
        let order = pack_order(&items, 100, 100);
        assert_eq!(order, vec![1, 0, 3, 2]);
        assert_eq!(pack_order(&[], 5, 100), Vec::<usize>::new());
        // everything fits: pure LBA order
        assert_eq!(pack_order(&items, 1000, 1000), vec![1, 2, 0, 3]);
    }
}
