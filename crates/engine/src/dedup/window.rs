//! The three parts of the dedup index and how `--dedup-memory` is shared
//! between them (docs/design/dedup-window.md):
//! - the *hot* index (`DedupIndex`): exact, 24 bytes a block, the most
//!   recently written or found blocks, in any order;
//! - the *hook* index (`hooks::HookIndex`): a content-defined sample of every
//!   block's fingerprint (1 in 2^k), each pointing at the fingerprint table
//!   that holds its row, 8 bytes a hook: the whole volume's window, found
//!   by locality as in sparse indexing (Lillibridge et al., FAST '09) and
//!   dm-vdo's sparse UDS index;
//! - the *table cache* (`tables::TableCache`): fingerprint tables loaded on
//!   a hook hit, so a run of duplicates costs one table read.
//!
//! All three are hints: every candidate is compared byte for byte with the
//! stored block before a reference is made.
use super::hooks::{HookGeometry, HookIndex};
use super::tables::TableCache;
use super::DedupIndex;

/// Where the hook index stands after open: its hooks come from replaying
/// the persisted fingerprint tables in the background.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HookLoad {
    /// Tables are being replayed: lookups use what is loaded so far.
    Loading,
    /// Every persisted table was replayed (or there were none).
    Ready,
}

impl HookLoad {
    pub fn name(self) -> &'static str {
        match self {
            HookLoad::Loading => "loading",
            HookLoad::Ready => "ready",
        }
    }
}

pub struct Index {
    geo: HookGeometry,
    pub hot: DedupIndex,
    pub hooks: HookIndex,
    pub cache: TableCache,
    pub load: HookLoad,
}

impl Index {
    /// The three parts within `budget_bytes` in all: a quarter for the hot
    /// index, half for the hooks, the rest (what the others' rounding and
    /// size caps leave too) for the table cache. `max_useful` is the most
    /// distinct blocks the volume can hold: no part grows past what they need.
    pub fn new(budget_bytes: u64, max_useful: u64, geo: HookGeometry) -> Index {
        let hot = DedupIndex::new(budget_bytes / 4, max_useful);
        let hooks = HookIndex::new(budget_bytes / 2, max_useful, geo);
        let rest = budget_bytes.saturating_sub(hot.memory_bytes() + hooks.memory_bytes());
        Index {
            geo,
            hot,
            hooks,
            cache: TableCache::new(rest),
            load: HookLoad::Loading,
        }
    }

    /// Table `table` keeps a row for `key` (just appended): a hook if
    /// sampled, and a cached copy of the table is stale.
    pub fn learn_hook(&mut self, key: u64, table: u32) {
        self.hooks.note(key, table);
        self.cache.remove(table);
    }

    /// The next part of `table`'s segment, if `table` is not its last.
    pub fn successor(&self, table: u32) -> Option<u32> {
        let rel = u64::from(table).checked_sub(self.geo.first_table)?;
        (rel % self.geo.parts_per_segment + 1 < self.geo.parts_per_segment).then_some(table + 1)
    }

    /// The tables of `segment` (freed): hooks into them die, cached copies go.
    pub fn segment_freed(&mut self, segment: u64) {
        self.hooks.segment_freed(segment);
        let first = self.geo.first_table + segment * self.geo.parts_per_segment;
        let (Ok(a), Ok(b)) = (
            u32::try_from(first),
            u32::try_from(first + self.geo.parts_per_segment),
        ) else {
            return;
        };
        self.cache.remove_range(a..b);
    }

    /// The store has `segments` segments now (`HookIndex::grow_segments`).
    pub fn grow_segments(&mut self, segments: u64) {
        self.hooks.grow_segments(segments);
        self.geo.segments = self.geo.segments.max(segments);
    }

    /// RAM of all three parts.
    pub fn memory_bytes(&self) -> u64 {
        self.hot.memory_bytes() + self.hooks.memory_bytes() + self.cache.memory_bytes()
    }
}
