//! The cleaner's search for the holders of a victim's shared records: every
//! LBA whose map entry points at a record of the victim that dedup
//! references share (they all must be repointed when it moves).
//!
//! The whole map is scanned, a batch of pages per hold of the state lock:
//! pages in memory are scanned under it, the others are read and scanned
//! outside it. That is safe because no new dedup reference may point into a
//! segment being cleaned (`State::cleaning`, checked by the write path) and
//! only the cleaner (one at a time) moves records: holders can only go away
//! while the scan runs, and one that did is dropped when the record moves
//! (its entry no longer names it). A page read outside the lock whose
//! record was superseded and its space reused meanwhile fails to verify and
//! is read again under the lock.
use crate::error::VolError;
use crate::map::{page_end, PageSource, PAGE_BLOCKS};
use crate::recovery::LogPages;
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

impl Volume {
    /// The holders of the records in [base, end) that have dedup
    /// references (the caller marked the segment as being cleaned).
    pub(super) fn find_holders(&self, base: u64, end: u64) -> Result<Holders, VolError> {
        let mut holders = Holders::new();
        let mut note = |lba: u64, e: MapEntry| {
            if let EntryState::Data { offset, .. } = e.state_valid() {
                if (base..end).contains(&offset) {
                    holders.entry(offset).or_default().push(lba);
                }
            }
        };
        let mut lba = Some(0);
        while let Some(from) = lba {
            let (unread, next) = self.scan_resident(from, &mut note)?;
            for (p, r, copy) in unread {
                self.scan_unread(p, &r, copy, &mut note)?;
            }
            lba = next;
        }
        let st = self.lock_state()?;
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
        note: &mut impl FnMut(u64, MapEntry),
    ) -> Result<(Vec<Unread>, Option<u64>), VolError> {
        let st = self.lock_state()?;
        let map = st.live.map();
        let mut unread = Vec::new();
        let mut lba = from;
        for _ in 0..PAGES_PER_HOLD {
            let Some(l) = map.next_allocated_page_lba(lba) else {
                return Ok((unread, None));
            };
            let p = l as usize / PAGE_BLOCKS;
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
            lba = page_end(l);
        }
        Ok((unread, Some(lba)))
    }

    /// Scans page `p` from its record `r` outside the state lock, or, if
    /// that no longer verifies, as the map has it now under the lock.
    fn scan_unread(
        &self,
        p: usize,
        r: &PageRef,
        copy: Option<Vec<u8>>,
        note: &mut impl FnMut(u64, MapEntry),
    ) -> Result<(), VolError> {
        let buffered = |_: u64, _: usize| copy.clone();
        let src = LogPages {
            storage: &*self.storage,
            sb: &self.sb,
            buffered: Some(&buffered),
        };
        if let Ok(entries) = src.load(p as u64, r) {
            entries.into_iter().for_each(|(l, e)| note(l, e));
            return Ok(());
        }
        let mut st = self.lock_state()?;
        let first = (p * PAGE_BLOCKS) as u64;
        let end = page_end(first).min(st.live.blocks());
        self.fault(&mut st, first, end)?;
        for l in first..end {
            note(l, st.live.get(l));
        }
        Ok(())
    }
}
