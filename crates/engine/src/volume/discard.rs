//! TRIM and WRITE_ZEROES: whole blocks become unmapped holes (TRIM records)
//! or zero blocks that stay allocated (ZERO records); partial blocks at the
//! edges are left alone (TRIM is advisory) or written as data.
use super::layered::Layers;
use super::space::{self, RANGE_RECORD_BLOCKS_MAX};
use super::{State, Volume, Writer};
use crate::error::VolError;
use crate::log::Shape;
use cvol_format::record::RecordKind;
use cvol_format::{MapEntry, BLOCK_SIZE_BYTES};

/// Blocks a TRIM keeping old entries handles per hold of the state lock.
const LAYERED_STEP_BLOCKS: u64 = 4096;

impl Volume {
    /// TRIM: whole blocks inside the range become unmapped holes; partial
    /// blocks at the edges are left alone (TRIM is advisory).
    pub fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), VolError> {
        self.trim_layered(offset, len, fua, &Layers::default())
    }

    /// [`Volume::trim`] on a layered view: old content kept first where
    /// `layers` asks; on a view with layers below (a clone) the blocks
    /// become zero blocks, which hide what lies below, not holes.
    pub fn trim_layered(
        &self,
        offset: u64,
        len: u64,
        fua: bool,
        layers: &Layers,
    ) -> Result<(), VolError> {
        self.check_range(offset, len)?;
        self.check_writable()?;
        let first = offset.div_ceil(BLOCK_SIZE_BYTES);
        let end = (offset + len) / BLOCK_SIZE_BYTES;
        let _shared = self.rmw_shared()?;
        // With old entries to keep (a REF record each), a long range goes
        // a part at a time, so that no hold of the lock needs the log room
        // of a whole 1 GiB discard.
        let step = if layers.keep.is_some() {
            LAYERED_STEP_BLOCKS
        } else {
            u64::MAX
        };
        let mut at = first;
        while at < end {
            let stop = end.min(at.saturating_add(step));
            let layers = layers.at(at - offset / BLOCK_SIZE_BYTES);
            if layers.below.is_empty() {
                self.unmap_blocks(at, stop, &layers)?;
            } else {
                self.hide_blocks(at, stop, &layers)?;
            }
            at = stop;
        }
        self.after_write(fua)
    }

    fn unmap_blocks(&self, first: u64, end: u64, layers: &Layers) -> Result<(), VolError> {
        let mut st = loop {
            let mut st = self.lock_state()?;
            self.check_writable()?;
            // The pages at the range's edges tell whether it holds anything;
            // a page wholly inside it holds something if it has entries.
            self.fault(&mut st, first, first + 1)?;
            self.fault(&mut st, end - 1, end)?;
            if !st.live.map().any_mapped(first, end) {
                return Ok(()); // already holes: no record, no space
            }
            let need = space::trim_bytes(end - first) + layers.keep_bytes(end - first);
            if st.log.free_bytes() < need {
                return Err(VolError::NoSpace);
            }
            if self.keep_old(&mut st, first, end - first, layers, true)? {
                break st;
            }
            drop(st);
            self.wait_for_cleaning();
        };
        self.append_ranges(&mut st, RecordKind::Trim, first, end)?;
        let mut lba = first;
        while let Some(page) = st
            .live
            .map()
            .next_allocated_page_lba(lba)
            .filter(|&l| l < end)
        {
            self.fault(&mut st, page, page + 1)?;
            // A page of a directory block not read before may hold nothing
            // after all.
            if !st
                .live
                .map()
                .is_allocated(page as usize / crate::map::PAGE_BLOCKS)
            {
                lba = crate::map::page_end(page);
                continue;
            }
            let (mapped, next) = (st.live.map().next_mapped_batch(page, end))
                .expect("an allocated page in the range");
            for l in mapped {
                st.set_entry(l, MapEntry::UNMAPPED, 0);
            }
            lba = next;
        }
        Ok(())
    }

    /// Appends ZERO or TRIM records over [first, end), as many as their
    /// u32 block counts need.
    fn append_ranges(
        &self,
        st: &mut State,
        kind: RecordKind,
        first: u64,
        end: u64,
    ) -> Result<(), VolError> {
        let mut lba = first;
        while lba < end {
            let n = (end - lba).min(RANGE_RECORD_BLOCKS_MAX);
            self.append(st, Shape::range(kind, lba, n as u32), &[])?;
            lba += n;
        }
        Ok(())
    }

    /// WRITE_ZEROES: whole blocks become holes (or, with `no_hole`, zero
    /// blocks that stay allocated in the map); partial edges are written.
    pub fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        no_hole: bool,
        fua: bool,
    ) -> Result<(), VolError> {
        self.write_zeroes_layered(offset, len, no_hole, fua, &Layers::default())
    }

    /// [`Volume::write_zeroes`] on a layered view (see `trim_layered`).
    pub fn write_zeroes_layered(
        &self,
        offset: u64,
        len: u64,
        no_hole: bool,
        fua: bool,
        layers: &Layers,
    ) -> Result<(), VolError> {
        self.check_range(offset, len)?;
        self.check_writable()?;
        let first = offset.div_ceil(BLOCK_SIZE_BYTES);
        let end = (offset + len) / BLOCK_SIZE_BYTES;
        if first >= end {
            let zeros = vec![0u8; len as usize];
            return self.write_layered(Writer::Client, offset, &zeros, fua, layers);
        }
        let head = first * BLOCK_SIZE_BYTES - offset;
        let tail = offset + len - end * BLOCK_SIZE_BYTES;
        // Refuse up front rather than half-way, after the edges were written.
        let edges = u64::from(head > 0) + u64::from(tail > 0);
        drop(self.lock_with_space(space::write_zeroes_bytes(edges, end - first, no_hole))?);
        if head > 0 {
            self.write_layered(
                Writer::Client,
                offset,
                &vec![0u8; head as usize],
                false,
                layers,
            )?;
        }
        if tail > 0 {
            let at = end * BLOCK_SIZE_BYTES;
            let tail_layers = layers.at(end - offset / BLOCK_SIZE_BYTES);
            self.write_layered(
                Writer::Client,
                at,
                &vec![0u8; tail as usize],
                false,
                &tail_layers,
            )?;
        }
        {
            let _shared = self.rmw_shared()?;
            let layers = layers.at(first - offset / BLOCK_SIZE_BYTES);
            if no_hole {
                self.zero_blocks(first, end, &layers)?;
            } else if layers.below.is_empty() {
                self.unmap_blocks(first, end, &layers)?;
            } else {
                self.hide_blocks(first, end, &layers)?;
            }
        }
        self.after_write(fua)
    }

    /// A layered view's (a clone's) TRIM: the blocks a layer below maps
    /// become zero blocks (a hole would show what lies below), the others
    /// holes, so trimming a clone's free space costs no map entries where
    /// its snapshot holds nothing.
    fn hide_blocks(&self, first: u64, end: u64, layers: &Layers) -> Result<(), VolError> {
        let mut at = first;
        while at < end {
            let l = layers.at(at - first);
            let (from, len) = (at * BLOCK_SIZE_BYTES, (end - at) * BLOCK_SIZE_BYTES);
            let runs = self.layered_runs(from, len, &l.below, false, |row| {
                row.iter().any(|e| !e.is_unmapped())
            })?;
            for (bytes, below) in runs {
                let n = bytes / BLOCK_SIZE_BYTES;
                let l = layers.at(at - first);
                if below {
                    self.zero_blocks(at, at + n, &l)?;
                } else {
                    self.unmap_blocks(at, at + n, &l)?;
                }
                at += n;
            }
        }
        Ok(())
    }

    fn zero_blocks(&self, first: u64, end: u64, layers: &Layers) -> Result<(), VolError> {
        self.prefault_layers(layers, end - first, first)?;
        let need = space::zero_blocks_bytes(end - first) + layers.keep_bytes(end - first);
        let mut st = loop {
            let mut st = self.lock_with_space(need)?;
            if self.keep_old(&mut st, first, end - first, layers, true)? {
                break st;
            }
            drop(st);
            self.wait_for_cleaning();
        };
        self.fault(&mut st, first, end)?;
        self.append_ranges(&mut st, RecordKind::Zero, first, end)?;
        for l in first..end {
            st.set_entry(l, MapEntry::ZERO, 0);
        }
        Ok(())
    }
}
