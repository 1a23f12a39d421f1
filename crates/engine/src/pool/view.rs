//! One volume of a pool as a block device: its byte offsets translated to
//! the pool's (`cvol_format::pool`), requests split at extent boundaries.
//! A request holds the volume's layout (read lock) while it runs, so a
//! resize or delete (write lock) waits for requests in flight and no
//! request sees half of one.
use super::Layout;
use crate::error::VolError;
use crate::volume::{Extent, Layers, Volume, Writer};
use cvol_format::pool::{SnapState, EXTENT_BLOCKS as EXTENT_BLOCKS_U, EXTENT_BYTES, NO_EXTENT};
use cvol_format::{EntryState, BLOCK_SIZE_BYTES};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};

pub struct VolumeView {
    pub(super) vol: Arc<Volume>,
    pub(super) name: String,
    /// A snapshot (`VOLUME@SNAP`, read-only).
    pub(super) snapshot: bool,
    pub(super) layout: RwLock<Layout>,
    /// Clients holding it open (`OpenGuard`).
    pub(super) opens: AtomicUsize,
}

/// A piece of a request inside one extent: (pool offset, None in a
/// snapshot's extent not taken, which reads zeros; bytes; offset in the
/// request; the layers of its first block).
type Piece = (Option<u64>, u64, usize, Layers);

fn gone() -> VolError {
    VolError::Io(std::io::Error::new(
        std::io::ErrorKind::NotFound,
        "the volume was deleted",
    ))
}

impl VolumeView {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn size_bytes(&self) -> u64 {
        self.layout.read().map_or(0, |l| l.size_bytes)
    }

    pub fn read_only(&self) -> bool {
        self.snapshot || self.vol.read_only()
    }

    /// A snapshot's view (`VOLUME@SNAP`).
    pub fn is_snapshot(&self) -> bool {
        self.snapshot
    }

    /// Clients that have it open now.
    pub fn clients(&self) -> usize {
        self.opens.load(Ordering::SeqCst)
    }

    /// Counts a client until the guard drops.
    pub fn open_guard(self: &Arc<Self>) -> OpenGuard {
        self.opens.fetch_add(1, Ordering::SeqCst);
        OpenGuard(self.clone())
    }

    fn layout(&self) -> Result<RwLockReadGuard<'_, Layout>, VolError> {
        let l = self.layout.read().map_err(|_| VolError::Poisoned)?;
        if l.deleted {
            return Err(gone());
        }
        Ok(l)
    }

    /// The pieces of [offset, offset + len) in the pool, in order.
    fn pieces(l: &Layout, offset: u64, len: u64) -> Result<Vec<Piece>, VolError> {
        match offset.checked_add(len) {
            Some(end) if end <= l.size_bytes => {}
            _ => return Err(VolError::OutOfRange),
        }
        let mut out = Vec::with_capacity(1);
        let mut at = offset;
        while at < offset + len {
            let (x, within) = (at / EXTENT_BYTES, at % EXTENT_BYTES);
            let b = at / BLOCK_SIZE_BYTES;
            let cut = l.piece_end(b).saturating_mul(BLOCK_SIZE_BYTES);
            let n = (EXTENT_BYTES - within).min(offset + len - at).min(cut - at);
            let e = l.extents[x as usize];
            let p = (e != NO_EXTENT).then(|| u64::from(e) * EXTENT_BYTES + within);
            out.push((p, n, (at - offset) as usize, l.layers_at(b)));
            at += n;
        }
        Ok(out)
    }

    fn writable(&self) -> Result<(), VolError> {
        if self.snapshot {
            return Err(VolError::ReadOnly);
        }
        Ok(())
    }

    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), VolError> {
        let l = self.layout()?;
        for (p, n, at, y) in Self::pieces(&l, offset, buf.len() as u64)? {
            let out = &mut buf[at..at + n as usize];
            match p {
                Some(p) => self.vol.read_layered(p, out, &y.below)?,
                None => out.fill(0),
            }
        }
        Ok(())
    }

    pub fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), VolError> {
        self.writable()?;
        let l = self.layout()?;
        for (p, n, at, y) in Self::pieces(&l, offset, data.len() as u64)? {
            let d = &data[at..at + n as usize];
            let p = p.ok_or(VolError::ReadOnly)?;
            self.vol.write_layered(Writer::Client, p, d, fua, &y)?;
        }
        Ok(())
    }

    pub fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), VolError> {
        self.writable()?;
        let l = self.layout()?;
        for (p, n, _, y) in Self::pieces(&l, offset, len)? {
            self.vol
                .trim_layered(p.ok_or(VolError::ReadOnly)?, n, fua, &y)?;
        }
        Ok(())
    }

    pub fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        no_hole: bool,
        fua: bool,
    ) -> Result<(), VolError> {
        self.writable()?;
        let l = self.layout()?;
        for (p, n, _, y) in Self::pieces(&l, offset, len)? {
            let p = p.ok_or(VolError::ReadOnly)?;
            self.vol.write_zeroes_layered(p, n, no_hole, fua, &y)?;
        }
        Ok(())
    }

    pub fn flush(&self) -> Result<(), VolError> {
        let _l = self.layout()?;
        self.vol.flush()
    }

    /// Allocation status from `offset`, up to the end of its extent at most.
    pub fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, VolError> {
        let l = self.layout()?;
        let pieces = Self::pieces(&l, offset, len)?;
        let (p, n, _, y) = pieces.first().ok_or(VolError::OutOfRange)?;
        match p {
            Some(p) => self.vol.block_status_layered(*p, *n, &y.below),
            None => Ok(vec![Extent {
                length: *n,
                zero: true,
            }]),
        }
    }

    /// The names of the snapshots whose changed blocks this view can
    /// report (a volume's live snapshots, oldest first).
    pub fn tracked_snapshots(&self) -> Vec<String> {
        let Ok(l) = self.layout() else {
            return Vec::new();
        };
        (l.plan.snaps.iter())
            .filter(|(_, st, _)| *st != SnapState::Deleting)
            .map(|(n, ..)| n.clone())
            .collect()
    }

    /// Runs `(bytes, changed)` from `offset` (up to the end of its extent
    /// at most): a block changed since snapshot `snap` if it or a newer
    /// snapshot of the volume holds the block's old entry (kept at its
    /// first change), or if it lies beyond the snapshot's size. None if
    /// the volume has no such snapshot.
    pub fn changed_since(
        &self,
        snap: &str,
        offset: u64,
        len: u64,
    ) -> Result<Option<Vec<(u64, bool)>>, VolError> {
        let l = self.layout()?;
        let snaps = &l.plan.snaps;
        let Some(k) = (snaps.iter()).position(|(n, st, _)| n == snap && *st != SnapState::Deleting)
        else {
            return Ok(None);
        };
        let pieces = Self::pieces(&l, offset, len)?;
        let (_, n, _, _) = pieces.first().ok_or(VolError::OutOfRange)?;
        let b = offset / BLOCK_SIZE_BYTES;
        let since = &snaps[k].2;
        if b >= since.blocks {
            return Ok(Some(vec![(*n, true)]));
        }
        let end = (offset + n).min(since.blocks * BLOCK_SIZE_BYTES);
        let lbas: Vec<Option<u64>> = snaps[k..].iter().map(|(_, _, s)| s.lba(b)).collect();
        let mut bases: Vec<u64> = lbas.iter().flatten().copied().collect();
        if lbas.iter().any(Option::is_none) {
            // The volume held nothing there when one of these snapshots
            // was taken (it has no extent there): every block it maps now
            // was written since.
            let own = u64::from(l.extents[(b / EXTENT_BLOCKS_U) as usize]) * EXTENT_BLOCKS_U
                + b % EXTENT_BLOCKS_U;
            bases.push(own);
        }
        let within = offset % BLOCK_SIZE_BYTES;
        let mut runs = self.vol.layered_runs(
            bases[0] * BLOCK_SIZE_BYTES + within,
            end - offset,
            &bases,
            false,
            |row| row.iter().any(|e| e.state_valid() != EntryState::Unmapped),
        )?;
        if end < offset + n {
            runs.push((offset + n - end, true)); // beyond the snapshot's size
        }
        Ok(Some(runs))
    }

    /// The engine underneath (the pool's).
    pub fn engine(&self) -> &Arc<Volume> {
        &self.vol
    }
}

/// A client's hold on a volume: `VolumeView::clients` counts it.
pub struct OpenGuard(Arc<VolumeView>);

impl OpenGuard {
    pub fn view(&self) -> &Arc<VolumeView> {
        &self.0
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.opens.fetch_sub(1, Ordering::SeqCst);
    }
}
