//! The map's directory blocks as checkpoints write them: the changed
//! ones taken (`take_dirty_dirs`), their records named once written
//! (`dir_written`), and what the commit and the cleaner ask of them.
use super::{BlockMap, PageSource, DIR_SLOTS};
use crate::error::MetaError;
use cvol_format::checkpoint::PageRef;

impl BlockMap {
    /// The directory blocks changed since their record, as payload
    /// entries; they count as clean from here on. Blocks without pages
    /// are dropped (their record retired).
    pub fn take_dirty_dirs(&mut self) -> Vec<(usize, Vec<(u64, PageRef)>)> {
        let mut out = Vec::new();
        for b in 0..self.dirs.len() {
            let Some(d) = self.dirs[b].as_mut().filter(|d| d.dirty) else {
                continue;
            };
            assert!(
                d.packed.is_none(),
                "directory block {b} changed while packed"
            );
            d.dirty = false;
            if d.refs.is_empty() {
                let (record, list) = (d.record.take(), d.list.take());
                self.retired.extend(record);
                self.retired.extend(list);
                self.dirs[b] = None;
                continue;
            }
            let base = (b * DIR_SLOTS) as u64;
            let pages = (d.refs.iter())
                .map(|&(k, r)| (base + u64::from(k), r))
                .collect();
            out.push((b, pages));
        }
        out
    }

    /// Names record `r` as directory block `b`'s.
    pub fn dir_written(&mut self, b: usize, r: PageRef, list: Option<PageRef>) {
        match self.dirs[b].as_mut() {
            Some(d) => {
                d.holds = None;
                let old = (d.record.replace(r), std::mem::replace(&mut d.list, list));
                self.retired.extend(old.0);
                self.retired.extend(old.1);
            }
            None => {
                self.retired.push(r);
                self.retired.extend(list);
            }
        }
    }

    /// Marks directory block `b` changed (its record must be rewritten),
    /// its list decoded first if packed (read from `src` if apart).
    pub fn mark_dir_dirty(&mut self, b: usize, src: &dyn PageSource) -> Result<(), MetaError> {
        self.unpack(b, src)?;
        if let Some(d) = self.dirs[b].as_mut() {
            d.dirty = true;
        }
        Ok(())
    }

    /// Is `offset` the record of directory block `b`, or of its list
    /// kept apart? (An unread block's list is not known until the block
    /// is read: `unpack` it first.)
    pub fn dir_record_is(&self, b: usize, offset: u64) -> bool {
        let Some(d) = self.dirs.get(b).and_then(|d| d.as_ref()) else {
            return self.unread_record(b).is_some_and(|r| r.offset == offset);
        };
        [d.record, d.list]
            .iter()
            .flatten()
            .any(|r| r.offset == offset)
    }

    /// The MAP_DIR records of every directory block with its index, in
    /// block order; None if a block with pages has no record yet (changed
    /// since the last `take_dirty_dirs`).
    pub fn dir_records(&self) -> Option<Vec<(usize, PageRef)>> {
        let read: Option<Vec<(usize, PageRef)>> = (self.dirs.iter().enumerate())
            .filter_map(|(b, d)| Some((b, d.as_ref()?)))
            .map(|(b, d)| Some((b, d.record?)))
            .collect();
        let mut all = read?;
        if !self.unread.records.is_empty() {
            all.extend_from_slice(&self.unread.records);
            all.sort_unstable_by_key(|&(b, _)| b);
        }
        Some(all)
    }
}
