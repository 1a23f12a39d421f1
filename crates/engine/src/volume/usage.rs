//! What a range of the map holds, for a pool's per-volume statistics
//! (`crate::pool`): mapped and zero blocks, and the stored bytes only the
//! range references (what deleting it frees) against those it shares
//! with the rest of the map (dedup), like ZFS's `used` and `referenced`.
use super::Volume;
use crate::dedup::OffsetMap;
use crate::error::VolError;
use cvol_format::checkpoint::MAP_PAGE_BLOCKS;
use cvol_format::EntryState;

/// Totals of `Volume::range_usage` over one or more ranges.
#[derive(Debug, Default)]
pub struct RangeUsage {
    pub data_blocks: u64,
    pub zero_blocks: u64,
    /// Stored bytes (record header and payload) of records nothing
    /// outside the map's own window references: single-block records
    /// without dedup references, units no reference points into.
    pub owned_bytes: u64,
    /// Records with dedup references: (entries seen in the ranges, record
    /// bytes), by offset.
    shared: OffsetMap<(u32, u32)>,
}

/// Stored bytes only the ranges reference, and bytes they share.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UsageBytes {
    pub unique_bytes: u64,
    pub shared_bytes: u64,
}

impl Volume {
    /// Adds what the map's blocks [first, end) hold to `acc`, a page per
    /// hold of the state lock (writes in between may move the totals by
    /// what they change).
    pub fn range_usage(&self, first: u64, end: u64, acc: &mut RangeUsage) -> Result<(), VolError> {
        self.walk_pages(first, end, |st, at, page_end| {
            let mut last_unit = None;
            for l in at..page_end {
                match st.live.get(l).state_valid() {
                    EntryState::Zero => acc.zero_blocks += 1,
                    EntryState::Data {
                        offset, len, unit, ..
                    } => {
                        acc.data_blocks += 1;
                        if st.live.shared().get(offset).is_some() {
                            acc.shared.entry(offset).or_insert((0, len)).0 += 1;
                        } else if !unit || last_unit != Some(offset) {
                            acc.owned_bytes += u64::from(len);
                        }
                        last_unit = unit.then_some(offset);
                    }
                    EntryState::Unmapped | EntryState::Lost => {}
                }
            }
            None::<()>
        })?;
        Ok(())
    }

    /// Calls `f(state, at, page end)` for the part of each allocated map
    /// page inside [first, end), its page faulted in, a page per hold of
    /// the state lock, until `f` returns something.
    fn walk_pages<R>(
        &self,
        first: u64,
        end: u64,
        mut f: impl FnMut(&super::State, u64, u64) -> Option<R>,
    ) -> Result<Option<R>, VolError> {
        let mut lba = first;
        while lba < end {
            let mut st = self.lock_state()?;
            let next = st.live.map().next_allocated_page_lba(lba);
            let Some(at) = next.filter(|&l| l < end) else {
                return Ok(None);
            };
            let page_end = (at - at % MAP_PAGE_BLOCKS + MAP_PAGE_BLOCKS).min(end);
            self.fault(&mut st, at, page_end)?;
            if let Some(r) = f(&st, at, page_end) {
                return Ok(Some(r));
            }
            lba = page_end;
        }
        Ok(None)
    }

    /// Splits `acc`'s records with dedup references into those only its
    /// ranges reference (all their entries were seen) and the others.
    pub fn usage_bytes(&self, acc: &RangeUsage) -> Result<UsageBytes, VolError> {
        let st = self.lock_state()?;
        let mut out = UsageBytes {
            unique_bytes: acc.owned_bytes,
            shared_bytes: 0,
        };
        for (&offset, &(seen, len)) in &acc.shared {
            match st.live.shared().get(offset) {
                Some(s) if s.entries() > seen => out.shared_bytes += u64::from(len),
                _ => out.unique_bytes += u64::from(len),
            }
        }
        Ok(out)
    }

    /// The first block in [first, end) that is mapped (data or zero).
    pub fn first_mapped(&self, first: u64, end: u64) -> Result<Option<u64>, VolError> {
        self.walk_pages(first, end, |st, at, page_end| {
            (at..page_end).find(|&l| !st.live.get(l).is_unmapped())
        })
    }

    /// Makes statistics report `bytes` as the logical size (a pool's:
    /// the sum of its volumes' sizes).
    pub fn set_reported_logical_bytes(&self, bytes: u64) {
        *self
            .reported_logical
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(bytes);
    }

    /// What keeps the data store from shrinking to `data_segments`
    /// segments: the segments at or beyond it that are not free, and
    /// whether the newest checkpoint's commit lies there (its pointer
    /// would name a place the store no longer has).
    pub fn shrink_blockers(&self, data_segments: u64) -> Result<(u64, bool), VolError> {
        let st = self.lock_state()?;
        let segs = &st.log.segments;
        let busy = (data_segments..self.sb.data_segment_count())
            .filter(|&s| segs.state(s) != crate::segments::SegState::Free)
            .count() as u64;
        let end = self.sb.segment_offset(data_segments);
        let commit_beyond = crate::recovery::read_pointers(&*self.storage)
            .iter()
            .flatten()
            .max_by_key(|p| p.generation)
            .is_some_and(|p| p.commit_offset >= end);
        Ok((busy, commit_beyond))
    }
}
