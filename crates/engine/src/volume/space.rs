//! Space: every reserve and cost the volume checks before it appends, named
//! and built from `cvol-format` constants, and the wait for room (cleaning
//! in the foreground) that a client write makes when the log is short.
//!
//! The promise (docs/FORMAT.md "Space"): a client write proceeds only if,
//! after it, the log still has the *reserve* free: room for a checkpoint of
//! the current map, room for the cleaner to move live data into (a
//! segment, or 1/64 of the data segments), and
//! two whole units. So a checkpoint, a reopen (its EPOCH record) and the
//! cleaner always find room, whatever the clients wrote.
use super::{State, StateGuard, Volume};
use crate::error::VolError;
use cvol_format::checkpoint::{commit_payload_bytes, run_bytes, DIR_ENTRY_BYTES, DIR_PAGES};
use cvol_format::checkpoint::{DIRSUM_HEADER_BYTES, DIR_LIST_REF_BYTES, DIR_USE_BYTES};
use cvol_format::mapentry::MAP_ENTRY_BYTES;
use cvol_format::record::{
    EMPTY_RECORD_MAX_BYTES, RECORD_MAX_BYTES, RECORD_OVERHEAD_MAX_BYTES, REF_RECORD_MAX_BYTES,
    UNIT_RECORD_MAX_BYTES,
};
use cvol_format::BLOCK_SIZE_BYTES;
use std::sync::atomic::Ordering;

/// Checkpoint bytes one map entry may cost: the entry and a run header of
/// its own (no two entries adjacent), plus a byte for lz4, which is not
/// counted on to shrink anything (its expansion of incompressible input is
/// far below a byte per entry).
const CHECKPOINT_ENTRY_MAX_BYTES: u64 = run_bytes(1) as u64 + 1;
/// The commit record of a checkpoint, and what its padding costs.
const CHECKPOINT_COMMIT_ALLOWANCE_BYTES: u64 = 64 << 10;
/// Chunk records a checkpoint may lose to segment tails besides one per
/// segment it spans.
const CHECKPOINT_TAILS_EXTRA: u64 = 2;
/// A segment switch can leave up to a record's bytes unused at the tail of
/// the old segment; a commit allows for two.
const SEGMENT_TAIL_MARGIN_BYTES: u64 = 2 * RECORD_MAX_BYTES as u64;
/// What a record without payload costs, rounded up (ZERO, TRIM records and
/// the header of a partial edge block).
const RECORD_HEADER_ALLOWANCE_BYTES: u64 = 64;
const _: () = assert!(RECORD_HEADER_ALLOWANCE_BYTES >= RECORD_OVERHEAD_MAX_BYTES as u64);
/// Checkpoint growth per block turned into a ZERO entry: one map entry,
/// plus lz4's byte.
const ZERO_ENTRY_CHECKPOINT_BYTES: u64 = MAP_ENTRY_BYTES as u64 + 1;
/// The cleaner's part of the reserve is this share of the data segments
/// (at least one segment).
const CLEANER_ROOM_DIVISOR: u64 = 64;
/// Most clean-and-retry turns of a write short of space (each turn that
/// gains nothing counts towards `SPACE_IDLE_TURNS_MAX` as well; this only
/// bounds a writer that other writers keep beating to the room cleaning
/// makes).
const SPACE_TURNS_MAX: u32 = 1024;
/// A write gives up (NoSpace) when cleaning gained too little over this
/// many turns together.
const SPACE_WINDOW_TURNS: usize = 3;
/// A cleaning turn that gains less than 1/16 of a segment gained nothing
/// useful: only segment tails are left to collect.
pub(super) const CLEAN_GAIN_USEFUL_DIVISOR: u64 = 16;
/// Blocks of a ZERO or TRIM record, at most (its block count is a u32).
pub(super) const RANGE_RECORD_BLOCKS_MAX: u64 = u32::MAX as u64;

/// Log bytes one map page's record may take besides its entries: header,
/// lz4's length prefix and its worst expansion of a page.
const PAGE_RECORD_OVERHEAD_BYTES: u64 = RECORD_OVERHEAD_MAX_BYTES as u64 + 4 + 48;
/// The largest map page record (every entry a run of its own) or directory
/// block record, rounded up: what a segment switch can leave unused.
const MAP_RECORD_MAX_BYTES: u64 = 80 << 10;
/// Directory bytes per page with entries, lz4's expansion included, and
/// a segment use of the block's summary (one per page at most).
const DIR_BYTES_PER_PAGE: u64 = (DIR_ENTRY_BYTES + DIR_USE_BYTES) as u64 + 1;
/// Directory bytes per block besides its pages': two records (the
/// summary and the list kept apart) and the summary's bitmap and list
/// reference.
const DIR_BLOCK_BYTES: u64 =
    2 * PAGE_RECORD_OVERHEAD_BYTES + (DIRSUM_HEADER_BYTES + DIR_LIST_REF_BYTES) as u64;

/// Upper bound on the log bytes a checkpoint of a map of `entries` mapped
/// or zero entries in `pages` pages takes, every page dirty, with liveness
/// tables of `table_bytes` (`LiveMap::table_bytes_bound`): the page and
/// table records, the directory, up to two map records lost to segment
/// tails per segment it spans, the commit record.
pub(super) fn checkpoint_estimate_bytes(
    entries: u64,
    pages: u64,
    table_bytes: u64,
    segment_size_bytes: u64,
) -> u64 {
    let raw = entries * CHECKPOINT_ENTRY_MAX_BYTES
        + pages * (PAGE_RECORD_OVERHEAD_BYTES + DIR_BYTES_PER_PAGE)
        + dir_blocks_max(pages) * DIR_BLOCK_BYTES
        + table_bytes;
    raw + (raw / segment_size_bytes + CHECKPOINT_TAILS_EXTRA) * MAP_RECORD_MAX_BYTES
        + CHECKPOINT_COMMIT_ALLOWANCE_BYTES
}

/// Directory blocks `pages` pages can need.
fn dir_blocks_max(pages: u64) -> u64 {
    pages.min(pages / DIR_PAGES + 1)
}

/// Log bytes appending a checkpoint of page payloads of these lengths (or
/// bounds on them) needs, with a map of `pages` pages with records: the
/// page records, the directory (all of it, at most), segment tails, the
/// commit. What is checked before the first page record.
pub(super) fn checkpoint_append_bytes(
    page_lens: &[usize],
    pages: u64,
    segment_size_bytes: u64,
) -> u64 {
    let record = |len: usize| (RECORD_OVERHEAD_MAX_BYTES + len) as u64;
    let total_pages = pages + page_lens.len() as u64;
    let blocks = dir_blocks_max(total_pages);
    let total: u64 = page_lens.iter().map(|&l| record(l)).sum::<u64>()
        + total_pages * DIR_BYTES_PER_PAGE
        + blocks * DIR_BLOCK_BYTES;
    let commit = record(commit_payload_bytes(blocks as usize));
    let tails =
        (total / segment_size_bytes + CHECKPOINT_TAILS_EXTRA) * MAP_RECORD_MAX_BYTES.max(commit);
    total + commit + tails
}

/// Log bytes a TRIM of `nblocks` appends (it is not held to the reserve:
/// it frees space).
pub(super) fn trim_bytes(nblocks: u64) -> u64 {
    let records = nblocks.div_ceil(RANGE_RECORD_BLOCKS_MAX);
    records * EMPTY_RECORD_MAX_BYTES as u64 + SEGMENT_TAIL_MARGIN_BYTES
}

/// Log bytes beyond the reserve WRITE_ZEROES needs: its partial edge
/// blocks (`edges`, 0-2) written as data, and with `no_hole` a ZERO entry
/// per whole block, refused up front rather than half-way.
pub(super) fn write_zeroes_bytes(edges: u64, nblocks: u64, no_hole: bool) -> u64 {
    let edge_bytes = edges * (BLOCK_SIZE_BYTES + RECORD_HEADER_ALLOWANCE_BYTES);
    let entries = if no_hole {
        nblocks * ZERO_ENTRY_CHECKPOINT_BYTES
    } else {
        0
    };
    edge_bytes + entries + 2 * SEGMENT_TAIL_MARGIN_BYTES
}

/// Log bytes beyond the reserve ZERO records over `nblocks` need.
pub(super) fn zero_blocks_bytes(nblocks: u64) -> u64 {
    let records = nblocks.div_ceil(RANGE_RECORD_BLOCKS_MAX);
    records * RECORD_HEADER_ALLOWANCE_BYTES + nblocks * ZERO_ENTRY_CHECKPOINT_BYTES
}

/// Log bytes beyond the reserve a commit of records of these sizes needs.
pub(super) fn commit_bytes(record_bytes: u64) -> u64 {
    record_bytes + SEGMENT_TAIL_MARGIN_BYTES
}

/// Room a cleaner move needs: the copy (at most a whole unit), a REF
/// record per holder, and a checkpoint of the map (`checkpoint` bytes).
pub(super) fn relocation_bytes(holders: usize, checkpoint: u64) -> u64 {
    holders as u64 * REF_RECORD_MAX_BYTES as u64 + checkpoint + UNIT_RECORD_MAX_BYTES as u64
}

/// Log bytes the cleaner may fill with moved records, with `free` bytes
/// free and a checkpoint of `checkpoint` bytes to keep room for.
pub(super) fn cleaner_budget(free: u64, checkpoint: u64) -> u64 {
    free.saturating_sub(checkpoint + 2 * UNIT_RECORD_MAX_BYTES as u64)
}

/// Logical bytes that surely fit in `usable` log bytes: every block stored
/// raw, in a record of its own.
pub(super) fn worst_case_free_logical_bytes(usable: u64) -> u64 {
    usable / (BLOCK_SIZE_BYTES + RECORD_OVERHEAD_MAX_BYTES as u64) * BLOCK_SIZE_BYTES
}

impl Volume {
    /// Bytes a checkpoint of the current map may take.
    pub(super) fn checkpoint_estimate_bytes(&self, st: &State) -> u64 {
        let c = st.live.counters();
        let entries = c.data_blocks + c.zero_blocks + c.lost_blocks;
        let pages = st.live.map().allocated_pages() as u64;
        let tables = st.live.table_bytes_bound();
        checkpoint_estimate_bytes(entries, pages, tables, self.sb.segment_size_bytes)
    }

    /// Log bytes kept back from client writes: room for a checkpoint of the
    /// map, room for the cleaner to move live data into, and two whole
    /// units.
    /// (A checkpoint on a metadata device takes no room here.)
    pub(super) fn reserve_bytes(&self, st: &State) -> u64 {
        let checkpoint = match self.sb.has_metadata_device() {
            true => 0,
            false => self.checkpoint_estimate_bytes(st),
        };
        checkpoint + self.cleaner_room_bytes() + 2 * UNIT_RECORD_MAX_BYTES as u64
    }

    /// The cleaner's part of the reserve: a segment, or 1/64 of the data
    /// segments if more, so that a writer short of room leaves the cleaner
    /// enough to move several victims per round (at 80% live and with a
    /// single segment, the cleaner could move one victim, often none, and
    /// writes failed with 8% of the log dead).
    fn cleaner_room_bytes(&self) -> u64 {
        let segments = (self.sb.data_segment_count() / CLEANER_ROOM_DIVISOR).max(1);
        segments * self.sb.segment_size_bytes
    }

    /// Log bytes free beyond the reserve.
    pub(super) fn usable_bytes(&self, st: &State) -> u64 {
        st.log.free_bytes().saturating_sub(self.reserve_bytes(st))
    }

    /// Live bytes and the log bytes they may fill (every data segment less
    /// the reserve): a cache evicts by their ratio (`crate::cache`).
    pub fn live_and_room_bytes(&self) -> Result<(u64, u64), VolError> {
        let st = self.lock_state()?;
        let total = self.sb.data_segment_count() * self.sb.segment_size_bytes;
        let live = st.live.usage().total_live_bytes();
        Ok((live, total.saturating_sub(self.reserve_bytes(&st))))
    }

    /// Locks the state with `need` log bytes free beyond the reserve, running
    /// the cleaner first if the log is short of space. NoSpace only when
    /// cleaning cannot make room: the live data truly does not fit.
    pub(super) fn lock_with_space(&self, need: u64) -> Result<StateGuard<'_>, VolError> {
        // Cleaning's progress before each of the last turns that cleaned.
        let mut turns = std::collections::VecDeque::with_capacity(SPACE_WINDOW_TURNS + 1);
        for _ in 0..SPACE_TURNS_MAX {
            let st = self.lock_state()?;
            self.check_writable()?;
            let want = need + self.reserve_bytes(&st);
            if st.log.free_bytes() >= want {
                return Ok(st);
            }
            drop(st);
            // Whether this call or a concurrent one (the background cleaner,
            // another writer) made the room, the check above decides. Give
            // up when cleaning gained too little over the last turns that
            // cleaned (a full volume only yields segment tails, and the old
            // map records each of its checkpoints leaves for the next). The
            // gain is what cleaning reclaimed less what it moved and the
            // checkpoints it wrote, by whoever cleaned meanwhile: not the
            // change in free bytes, which the other writers consume as fast
            // as the cleaner frees them. It is summed over a window of
            // turns because a turn's moves are often reclaimed in the next;
            // a turn that found the room already made (and then taken by
            // other writers) is no sign of a full volume, and does not count.
            if turns.len() == SPACE_WINDOW_TURNS {
                let oldest = turns.pop_front().expect("a full window");
                let gained = self
                    .cleaning_progress()
                    .gain_since(&oldest, self.sb.segment_size_bytes);
                if gained < self.sb.segment_size_bytes / CLEAN_GAIN_USEFUL_DIVISOR {
                    self.log_refusal(need, gained);
                    break;
                }
            }
            let before = self.cleaning_progress();
            if self.clean_for_space(want)? {
                turns.push_back(before);
            }
            self.counters.space_waits.fetch_add(1, Ordering::Relaxed);
        }
        self.counters.space_refusals.fetch_add(1, Ordering::Relaxed);
        Err(VolError::NoSpace)
    }

    /// Says why a write is refused for space (debug level: the client
    /// sees ENOSPC; `stat` counts the refusals).
    fn log_refusal(&self, need: u64, gained: u64) {
        if let Ok(st) = self.lock_state() {
            tracing::warn!(
                need,
                gained,
                free = st.log.free_bytes(),
                reserve = self.reserve_bytes(&st),
                checkpoint = self.checkpoint_estimate_bytes(&st),
                fp_rows = st.live.fp_bytes_bound(),
                tables = st.live.table_bytes_bound(),
                live = st.live.usage().total_live_bytes(),
                "write refused for space: cleaning gained too little"
            );
        }
    }

    /// Foreground cleaning for a writer that needs `want` bytes free: a
    /// little beyond the need, so one clean serves many writes. Whether it
    /// cleaned at all (`clean_rounds`).
    fn clean_for_space(&self, want: u64) -> Result<bool, VolError> {
        let waiters = &self.activity.space_waiters;
        waiters.fetch_add(1, Ordering::SeqCst);
        let count = self.sb.segment_count();
        let slack = (count / 20).max(2).min(count / 4) * self.sb.segment_size_bytes;
        let cleaned = self.clean_rounds(want + slack, false);
        waiters.fetch_sub(1, Ordering::SeqCst);
        cleaned.map(|(ran, _)| ran)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_named_costs_are_the_numbers_the_volume_always_used() {
        assert_eq!(CHECKPOINT_ENTRY_MAX_BYTES, 25);
        assert_eq!(ZERO_ENTRY_CHECKPOINT_BYTES, 13);
        // Every record is counted with the 16-byte tag an encrypted volume
        // seals it with (44 header bytes + 16), on every volume.
        assert_eq!(UNIT_RECORD_MAX_BYTES, 16 * 4096 + 44 + 16);
        // An empty map: two map records' worth and the commit allowance.
        assert_eq!(
            checkpoint_estimate_bytes(0, 0, 0, MIB),
            2 * (80 << 10) + (64 << 10)
        );
        // A page record holds its entries with room for lz4 (the page's
        // directory entry and block count too).
        let one = checkpoint_estimate_bytes(1, 1, 0, MIB) - checkpoint_estimate_bytes(0, 0, 0, MIB);
        // (Its block: two records, the summary's bitmap, counts and list
        // reference.)
        assert_eq!(
            one,
            25 + (60 + 4 + 48) + 57 + (2 * (60 + 4 + 48) + 264 + 24)
        );
        const { assert!(512 * 25 + 2 * PAGE_RECORD_OVERHEAD_BYTES < MAP_RECORD_MAX_BYTES) };
        // A block's list and its summary (its list apart) are records of
        // their own, each smaller than the largest map record.
        const LIST_BYTES: u64 = DIR_ENTRY_BYTES as u64 + 1;
        const { assert!(DIR_PAGES * LIST_BYTES + 96 < MAP_RECORD_MAX_BYTES) };
        const SUMMARY_BYTES: u64 = DIR_BLOCK_BYTES + DIR_PAGES * DIR_USE_BYTES as u64;
        const { assert!(SUMMARY_BYTES < MAP_RECORD_MAX_BYTES) };
        assert_eq!(trim_bytes(1), 60 + 2 * ((1 << 17) - 1));
        assert_eq!(
            trim_bytes(u64::from(u32::MAX) + 1),
            2 * 60 + 2 * ((1 << 17) - 1)
        );
        assert_eq!(zero_blocks_bytes(10), 64 + 130);
        assert_eq!(
            write_zeroes_bytes(2, 10, true),
            2 * (4096 + 64) + 130 + 4 * ((1 << 17) - 1)
        );
        assert_eq!(worst_case_free_logical_bytes(4156 * 3 + 100), 3 * 4096);
        assert_eq!(worst_case_free_logical_bytes(4156 * 3 - 1), 2 * 4096);
    }

    #[test]
    fn a_checkpoint_append_counts_its_tails() {
        // Three pages of 1000 bytes in 1 MiB segments, no other page: the
        // records, their directory block, the commit record, and two of
        // the largest map record.
        let need = checkpoint_append_bytes(&[1000, 1000, 1000], 0, MIB);
        // (Each record with the 16-byte tag of an encrypted volume.)
        let commit = (60 + 20 + 16) as u64;
        assert_eq!(need, 3 * 1060 + 3 * 57 + 512 + commit + 2 * (80 << 10));
        assert_eq!(checkpoint_append_bytes(&[], 0, MIB), 80 + 2 * (80 << 10));
    }
}
