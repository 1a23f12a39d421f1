//! The cleaner's search for the holders of a victim's shared records: every
//! LBA whose map entry points at a record of the victim that dedup
//! references share (they all must be repointed when it moves).
//!
//! The pages that may hold one are scanned, a batch per hold of the state
//! lock: the pages of the records' owners (a record's owner entries lie at
//! its header's LBA, a unit's in its window) and every page whose
//! reference summary may name the victim (`BlockMap::may_refer_to`: all
//! of them until a page has been in memory since open, none that never
//! held a ref entry into that part of the log); pages in memory are
//! scanned under the lock, the others are read and scanned outside it,
//! and their summaries learnt from what was read. That is safe because no new dedup reference may point into a
//! segment being cleaned (`State::cleaning`, checked by the write path) and
//! only the cleaner (one at a time) moves records: holders can only go away
//! while the scan runs, and one that did is dropped when the record moves
//! (its entry no longer names it). A page read outside the lock whose
//! record was superseded and its space reused meanwhile fails to verify and
//! is read again under the lock.
use crate::error::VolError;
use crate::logread::LogPages;
use crate::map::{page_end, ref_summary, PageSource, PAGE_BLOCKS};
use crate::volume::Volume;
use cvol_format::checkpoint::PageRef;
use cvol_format::{EntryState, MapEntry};
use std::collections::HashMap;

/// Map pages scanned per hold of the state lock.
const PAGES_PER_HOLD: usize = 256;

/// LBAs pointing at each record in [base, end), by record offset.
pub(super) type Holders = HashMap<u64, Vec<u64>>;

/// A page not in memory: its index, its record, and the record's bytes if
/// they were still only in the open segment's buffer.
type Unread = (usize, PageRef, Option<Vec<u8>>);

/// A page read outside the lock: its index, the reference summary of
/// what was read, and the record read (`learn`).
type Learnt = (usize, u64, PageRef);

/// What a holder scan looks at: the summary bits of the victim's bytes,
/// and the pages of its shared records' owners (sorted).
struct ScanScope {
    bits: u64,
    owner_pages: Vec<usize>,
}

impl ScanScope {
    fn wants(&self, map: &crate::map::BlockMap, p: usize) -> bool {
        self.owner_pages.binary_search(&p).is_ok() || map.may_refer_to(p, self.bits)
    }
}

impl Volume {
    /// The holders of the records in [base, end) that have dedup
    /// references (the caller marked the segment as being cleaned), whose
    /// owners' entries lie in `owner_pages`.
    pub(super) fn find_holders(
        &self,
        base: u64,
        end: u64,
        mut owner_pages: Vec<usize>,
    ) -> Result<Holders, VolError> {
        owner_pages.sort_unstable();
        owner_pages.dedup();
        let scope = ScanScope {
            bits: crate::map::ref_region_bits(base, end),
            owner_pages,
        };
        let mut holders = Holders::new();
        let mut note = |lba: u64, e: MapEntry| {
            if let EntryState::Data { offset, .. } = e.state_valid() {
                if (base..end).contains(&offset) {
                    holders.entry(offset).or_default().push(lba);
                }
            }
        };
        let mut lba = Some(0);
        let mut learnt = Vec::new();
        while let Some(from) = lba {
            let (unread, next) = self.scan_resident(from, &scope, &mut learnt, &mut note)?;
            for (p, r, copy) in unread {
                if let Some(sum) = self.scan_unread(p, &r, copy, &mut note)? {
                    learnt.push((p, sum, r));
                }
            }
            lba = next;
        }
        self.counters
            .cleaner
            .holder_scans
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut st = self.lock_state()?;
        learn(&mut st, &mut learnt);
        let shared = st.live.shared();
        holders.retain(|&offset, _| shared.get(offset).is_some_and(|s| s.refs > 0));
        // In LBA order, as one scan under the lock found them.
        holders.values_mut().for_each(|v| v.sort_unstable());
        Ok(holders)
    }

    /// Scans up to `PAGES_PER_HOLD` pages with entries from LBA `from`
    /// under the state lock: those in memory at once, the others returned
    /// to be read; and the LBA to go on from (None: the map's end).
    fn scan_resident(
        &self,
        from: u64,
        scope: &ScanScope,
        learnt: &mut Vec<Learnt>,
        note: &mut impl FnMut(u64, MapEntry),
    ) -> Result<(Vec<Unread>, Option<u64>), VolError> {
        let mut st = self.lock_state()?;
        learn(&mut st, learnt);
        let mut unread = Vec::new();
        let mut lba = from;
        for _ in 0..PAGES_PER_HOLD {
            let Some(l) = st.live.map().next_allocated_page_lba(lba) else {
                return Ok((unread, None));
            };
            let p = l as usize / PAGE_BLOCKS;
            lba = page_end(l);
            if !scope.wants(st.live.map(), p) {
                continue;
            }
            // A page wanted from a directory block open left packed or
            // unread: its list decoded now (its record is needed below). A
            // page of an unread block may turn out to have no entries.
            self.unpack_page(&mut st, p)?;
            let map = st.live.map();
            if !map.is_allocated(p) {
                continue;
            }
            self.counters
                .cleaner
                .holder_pages_scanned
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            match map.resident(p) {
                Some(page) => page.for_each_mapped(p, note),
                None => {
                    let r = map.page_ref(p).expect("a page not in memory has a record");
                    let copy = st
                        .log
                        .buffered(r.offset, r.len as usize)
                        .map(<[u8]>::to_vec);
                    unread.push((p, r, copy));
                }
            }
        }
        Ok((unread, Some(lba)))
    }

    /// Scans page `p` from its record `r` outside the state lock (and
    /// returns the reference summary of what it read), or, if that no
    /// longer verifies, as the map has it now under the lock.
    fn scan_unread(
        &self,
        p: usize,
        r: &PageRef,
        copy: Option<Vec<u8>>,
        note: &mut impl FnMut(u64, MapEntry),
    ) -> Result<Option<u64>, VolError> {
        let buffered = |_: u64, _: usize| copy.clone();
        let src = LogPages {
            storage: &*self.storage,
            sb: &self.sb,
            buffered: Some(&buffered),
        };
        if let Ok(entries) = src.load(p as u64, r) {
            entries.iter().for_each(|&(l, e)| note(l, e));
            return Ok(Some(ref_summary(entries.iter().map(|&(_, e)| e))));
        }
        let mut st = self.lock_state()?;
        let first = (p * PAGE_BLOCKS) as u64;
        let end = page_end(first).min(st.live.blocks());
        self.fault(&mut st, first, end)?;
        for l in first..end {
            note(l, st.live.get(l));
        }
        Ok(None)
    }
}

/// Takes the summaries of the pages read outside the lock whose record is
/// still the one read (a page changed since is in memory, and learnt its
/// summary when it came in).
fn learn(st: &mut crate::volume::State, learnt: &mut Vec<Learnt>) {
    let map = st.live.map_mut();
    for (p, sum, r) in learnt.drain(..) {
        if map.resident(p).is_none() && map.page_ref(p) == Some(r) {
            map.learn_summary(p, sum);
        }
    }
}
