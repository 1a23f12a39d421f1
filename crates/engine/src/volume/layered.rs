//! Layered views of the map, for a pool's snapshots and clones
//! (`crate::pool`). The engine knows nothing of either: a view names, for
//! the block a request starts at, the LBAs of the same block in the
//! *layers below* it (a block whose own entry is unmapped reads as the
//! first layer that maps it) and a *keep* target (before a block is first
//! changed, its current entry is copied there, unless the target, or a
//! guard, maps it already). Copies are map entries (REF records naming
//! the same record, or ZERO records for content that read as zeros), never
//! data, and are appended before the records of the change in the same
//! hold of the state lock: a log that keeps the change keeps the copy.
//! `move_entries` merges one layer into another (a snapshot deleted, a
//! volume rolled back); `layered_runs` answers block status and changed
//! blocks over several layers.
use super::read::Extent;
use super::{State, Volume};
use crate::error::VolError;
use crate::log::Shape;
use crate::map::PAGE_BLOCKS;
use cvol_format::record::{RecordKind, EMPTY_RECORD_MAX_BYTES, REF_RECORD_MAX_BYTES};
use cvol_format::{EntryState, MapEntry, BLOCK_SIZE_BYTES};

const PAGE: u64 = PAGE_BLOCKS as u64;
/// Most runs one `layered_runs` call returns.
const RUNS_MAX: usize = 1024;

/// The layers of one request's first block (all LBAs are the pool map's).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Layers {
    /// Where a block whose own entry is unmapped reads from, first mapped
    /// wins (a snapshot: the newer snapshots of its volume, then the
    /// volume; a clone: its snapshot's layers).
    pub below: Vec<u64>,
    /// Copy-on-write of entries, for a volume that has snapshots.
    pub keep: Option<Keep>,
}

/// Where a block's old entry is kept before its first change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keep {
    /// The same block in the newest snapshot.
    pub target: u64,
    /// How many blocks from the first have a target (the snapshot may be
    /// smaller than the volume).
    pub blocks: u64,
    /// The same block in newer snapshots being deleted: one that maps it
    /// saw the block changed after the target was taken; nothing to keep.
    pub guards: Vec<u64>,
}

impl Layers {
    /// The layers of the block `k` blocks further on.
    pub fn at(&self, k: u64) -> Layers {
        Layers {
            below: self.below_at(k),
            keep: self.keep.as_ref().map(|x| Keep {
                target: x.target + k,
                blocks: x.blocks.saturating_sub(k),
                guards: x.guards.iter().map(|g| g + k).collect(),
            }),
        }
    }

    pub fn below_at(&self, k: u64) -> Vec<u64> {
        self.below.iter().map(|b| b + k).collect()
    }

    /// The map ranges of `n` blocks from `lba` in every layer (the blocks'
    /// own, those below, the keep target's and its guards'): what a write
    /// faults in. Without layers below or guards (the common case: a
    /// volume with snapshots, none being deleted), two ranges in place.
    pub(super) fn ranges(&self, n: u64, lba: u64) -> Ranges {
        let keep = self.keep.as_ref().map(|k| (k, n.min(k.blocks)));
        if self.below.is_empty() && keep.is_none_or(|(k, _)| k.guards.is_empty()) {
            let (t, m) = keep.map_or((lba, 0), |(k, m)| (k.target, m));
            return Ranges::Two([(lba, lba + n), (t, t + m)]);
        }
        let mut ranges: Vec<(u64, u64)> = (std::iter::once(lba).chain(self.below.iter().copied()))
            .map(|b| (b, b + n))
            .collect();
        if let Some((k, m)) = keep {
            ranges.extend(
                std::iter::once(&k.target)
                    .chain(&k.guards)
                    .map(|&t| (t, t + m)),
            );
        }
        Ranges::Many(ranges)
    }

    /// Log bytes keeping the old entries of `n` blocks may take.
    pub(super) fn keep_bytes(&self, n: u64) -> u64 {
        self.keep
            .as_ref()
            .map_or(0, |k| n.min(k.blocks) * REF_RECORD_MAX_BYTES as u64)
    }
}

/// Map ranges of a request in its layers (`Layers::ranges`).
pub(super) enum Ranges {
    Two([(u64, u64); 2]),
    Many(Vec<(u64, u64)>),
}

impl std::ops::Deref for Ranges {
    type Target = [(u64, u64)];

    fn deref(&self) -> &[(u64, u64)] {
        match self {
            Ranges::Two(r) => r,
            Ranges::Many(r) => r,
        }
    }
}

/// The entry block `lba` reads (its own, else that of the first layer of
/// `below`, each shifted by `i`, that maps it), and the LBA it was found at.
pub(super) fn resolve(st: &State, lba: u64, below: &[u64], i: u64) -> (MapEntry, u64) {
    let own = st.live.get(lba);
    if own.state_valid() != EntryState::Unmapped {
        return (own, lba);
    }
    for &b in below {
        let e = st.live.get(b + i);
        if e.state_valid() != EntryState::Unmapped {
            return (e, b + i);
        }
    }
    (own, lba)
}

fn unmapped(st: &State, lba: u64) -> bool {
    st.live.get(lba).state_valid() == EntryState::Unmapped
}

impl Volume {
    /// Reads the map pages of `n` blocks from `lba` and of every layer of
    /// them outside the lock.
    pub(super) fn prefault_layers(&self, l: &Layers, n: u64, lba: u64) -> Result<(), VolError> {
        self.prefault_ranges(&l.ranges(n, lba))
    }

    /// A writer found an old entry to keep in a segment being cleaned (no
    /// new reference may point there): it waits for the move and retries.
    pub(super) fn wait_for_cleaning(&self) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }

    /// Keeps the current entries of the `n` blocks from `lba` at the keep
    /// target (where it and its guards map nothing) before they change;
    /// `zeroing`: the change makes them read as zeros, so content that
    /// reads as zeros already needs no copy. False (nothing done) if an
    /// entry to keep points into a segment being cleaned.
    pub(super) fn keep_old(
        &self,
        st: &mut State,
        lba: u64,
        n: u64,
        l: &Layers,
        zeroing: bool,
    ) -> Result<bool, VolError> {
        let Some(k) = &l.keep else { return Ok(true) };
        let n = n.min(k.blocks);
        if n == 0 {
            return Ok(true);
        }
        for &b in [lba, k.target].iter().chain(&k.guards).chain(&l.below) {
            self.fault(st, b, b + n)?;
        }
        let mut todo = Vec::new();
        for i in 0..n {
            if !unmapped(st, k.target + i) || k.guards.iter().any(|&g| !unmapped(st, g + i)) {
                continue;
            }
            let (e, from) = resolve(st, lba + i, &l.below, i);
            match e.state_valid() {
                EntryState::Data { offset, .. } if st.cleaning.contains(&st.segment_of(offset)) => {
                    return Ok(false);
                }
                EntryState::Data { .. } => {}
                _ if zeroing => continue,
                _ => {}
            }
            todo.push((k.target + i, e, from));
        }
        self.copy_entries(st, &todo)?;
        Ok(true)
    }

    /// Sets each `(to, e, from)`: `to` gets a ref to `e`'s record (found at
    /// `from`), or a zero block where `e` holds no data (zeros, nothing, or
    /// a block lost to damage: a copy reads zeros). Consecutive zero blocks
    /// share one ZERO record.
    fn copy_entries(&self, st: &mut State, todo: &[(u64, MapEntry, u64)]) -> Result<(), VolError> {
        let mut run: Option<(u64, u32)> = None;
        for &(to, e, from) in todo {
            if let EntryState::Data { shared, unit, .. } = e.state_valid() {
                self.zero_run(st, run.take())?;
                let home = (unit && !shared).then_some(from);
                self.commit_ref(st, to, e, 0, home)?;
                continue;
            }
            run = match run {
                Some((s, m)) if s + u64::from(m) == to && m < u32::MAX => Some((s, m + 1)),
                r => {
                    self.zero_run(st, r)?;
                    Some((to, 1))
                }
            };
        }
        self.zero_run(st, run)
    }

    fn zero_run(&self, st: &mut State, run: Option<(u64, u32)>) -> Result<(), VolError> {
        let Some((s, m)) = run else { return Ok(()) };
        self.append(st, Shape::range(RecordKind::Zero, s, m), &[])?;
        for l in s..s + u64::from(m) {
            st.set_entry(l, MapEntry::ZERO, 0);
        }
        Ok(())
    }

    /// Moves what `n` blocks from `from` map to `to` (each block; with
    /// `only_empty`, only where `to` maps nothing), then unmaps them at
    /// `from`; with `to` None only unmaps. A page per hold of the state
    /// lock; repeating it after a crash part-way does the same.
    pub fn move_entries(
        &self,
        from: u64,
        to: Option<u64>,
        n: u64,
        only_empty: bool,
    ) -> Result<(), VolError> {
        self.check_range(from * BLOCK_SIZE_BYTES, n * BLOCK_SIZE_BYTES)?;
        self.check_writable()?;
        let _shared = self.rmw_shared()?;
        let mut i = 0;
        while i < n {
            // Pages that hold nothing are skipped, a lock hold for all.
            let next = self
                .lock_state()?
                .live
                .map()
                .next_allocated_page_lba(from + i);
            match next.filter(|&l| l < from + n) {
                Some(l) => i = l - from,
                None => break,
            }
            let m = (PAGE - (from + i) % PAGE).min(n - i);
            if self.move_page(from + i, to.map(|t| t + i), m, only_empty)? {
                i += m;
            } else {
                self.wait_for_cleaning();
            }
        }
        Ok(())
    }

    /// One page's part of `move_entries`; false if it must wait for the
    /// cleaner.
    fn move_page(
        &self,
        from: u64,
        to: Option<u64>,
        m: u64,
        only_empty: bool,
    ) -> Result<bool, VolError> {
        self.prefault(from, from + m)?;
        if let Some(t) = to {
            self.prefault(t, t + m)?;
        }
        let need = m * REF_RECORD_MAX_BYTES as u64 + EMPTY_RECORD_MAX_BYTES as u64;
        let mut st = self.lock_with_space(super::space::commit_bytes(need))?;
        self.fault(&mut st, from, from + m)?;
        if !st.live.map().any_mapped(from, from + m) {
            return Ok(true);
        }
        let mut todo = Vec::new();
        for i in 0..m {
            let e = st.live.get(from + i);
            if e.state_valid() == EntryState::Unmapped {
                continue;
            }
            if let EntryState::Data { offset, .. } = e.state_valid() {
                if st.cleaning.contains(&st.segment_of(offset)) {
                    return Ok(false);
                }
            }
            if let Some(t) = to {
                self.fault(&mut st, t + i, t + i + 1)?;
                if !only_empty || unmapped(&st, t + i) {
                    todo.push((t + i, e, from + i));
                }
            }
        }
        self.copy_entries(&mut st, &todo)?;
        self.append(&mut st, Shape::range(RecordKind::Trim, from, m as u32), &[])?;
        for l in from..from + m {
            if !unmapped(&st, l) {
                st.set_entry(l, MapEntry::UNMAPPED, 0);
            }
        }
        Ok(true)
    }

    /// Makes every unmapped block of the `n` from `first` a zero block
    /// (ZERO records), a page per hold of the state lock: a layer that
    /// read zeros through another that goes away keeps reading zeros.
    pub fn fill_zeros(&self, first: u64, n: u64) -> Result<(), VolError> {
        self.check_range(first * BLOCK_SIZE_BYTES, n * BLOCK_SIZE_BYTES)?;
        self.check_writable()?;
        let _shared = self.rmw_shared()?;
        let mut i = 0;
        while i < n {
            let (at, m) = (first + i, (PAGE - (first + i) % PAGE).min(n - i));
            self.prefault(at, at + m)?;
            let mut st = self.lock_with_space(super::space::zero_blocks_bytes(m))?;
            self.fault(&mut st, at, at + m)?;
            let mut run: Option<(u64, u32)> = None;
            for l in at..at + m {
                if !unmapped(&st, l) {
                    self.zero_run(&mut st, run.take())?;
                    continue;
                }
                run = match run {
                    Some((s, c)) => Some((s, c + 1)),
                    None => Some((l, 1)),
                };
            }
            self.zero_run(&mut st, run)?;
            i += m;
        }
        Ok(())
    }

    /// Runs of blocks from the one holding `offset` up to `offset + len`
    /// (at least the first block; at most `RUNS_MAX` runs), each `(bytes,
    /// class)`: `class` gets the entries of one block in each of `bases`
    /// (that block's LBA in each layer, in order); `empty` is the class of
    /// a block no layer maps. Lengths are cut to the range.
    pub fn layered_runs(
        &self,
        offset: u64,
        len: u64,
        bases: &[u64],
        empty: bool,
        class: impl Fn(&[MapEntry]) -> bool,
    ) -> Result<Vec<(u64, bool)>, VolError> {
        let (first, end) = (
            offset / BLOCK_SIZE_BYTES,
            (offset + len).div_ceil(BLOCK_SIZE_BYTES),
        );
        let mut out: Vec<(u64, bool)> = Vec::new();
        let mut push = |from: u64, to: u64, c: bool| {
            let a = (from * BLOCK_SIZE_BYTES).max(offset);
            let b = (to * BLOCK_SIZE_BYTES).min(offset + len);
            match out.last_mut() {
                Some(x) if x.1 == c => x.0 += b - a,
                _ => out.push((b - a, c)),
            }
        };
        let mut pos = first;
        let mut count = 0;
        while pos < end && count < RUNS_MAX {
            let at = |b: u64| b + (pos - first);
            let stop = (pos + PAGE - at(bases[0]) % PAGE).min(end);
            let mut st = self.lock_state()?;
            let next = (bases.iter())
                .filter_map(|&b| {
                    st.live
                        .map()
                        .next_allocated_page_lba(at(b))
                        .map(|p| p.max(at(b)) - b)
                })
                .min()
                .map_or(end, |p| p + first);
            if next > pos {
                let to = next.min(end);
                push(pos, to, empty);
                pos = to;
                count += 1;
                continue;
            }
            for &b in bases {
                self.fault(&mut st, at(b), at(b) + (stop - pos))?;
            }
            let mut row = Vec::with_capacity(bases.len());
            for k in pos..stop {
                row.clear();
                row.extend(bases.iter().map(|&b| st.live.get(b + (k - first))));
                push(k, k + 1, class(&row));
            }
            count += 1;
            pos = stop;
        }
        Ok(out)
    }

    /// Block status of a layered view: a block is data if its own entry
    /// or, where that is unmapped, the first layer below that maps it,
    /// holds data (or a lost block).
    pub fn block_status_layered(
        &self,
        offset: u64,
        len: u64,
        below: &[u64],
    ) -> Result<Vec<Extent>, VolError> {
        if below.is_empty() {
            return self.block_status(offset, len);
        }
        self.check_range(offset, len)?;
        let own = offset / BLOCK_SIZE_BYTES;
        let bases: Vec<u64> = std::iter::once(own).chain(below.iter().copied()).collect();
        let runs = self.layered_runs(offset, len, &bases, false, |row| {
            let e = row.iter().find(|e| e.state_valid() != EntryState::Unmapped);
            matches!(
                e.map(|e| e.state_valid()),
                Some(EntryState::Data { .. } | EntryState::Lost)
            )
        })?;
        Ok(runs
            .into_iter()
            .map(|(length, data)| Extent {
                length,
                zero: !data,
            })
            .collect())
    }
}
