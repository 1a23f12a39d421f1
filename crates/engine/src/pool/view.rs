//! One volume of a pool as a block device: its byte offsets translated to
//! the pool's (`cvol_format::pool`), requests split at extent boundaries.
//! A request holds the volume's layout (read lock) while it runs, so a
//! resize or delete (write lock) waits for requests in flight and no
//! request sees half of one.
use super::Layout;
use crate::error::VolError;
use crate::volume::{Extent, Volume};
use cvol_format::pool::EXTENT_BYTES;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};

pub struct VolumeView {
    pub(super) vol: Arc<Volume>,
    pub(super) name: String,
    pub(super) layout: RwLock<Layout>,
    /// Clients holding it open (`OpenGuard`).
    pub(super) opens: AtomicUsize,
}

/// A piece of a request inside one extent: (pool offset, bytes, offset in
/// the request).
type Piece = (u64, u64, usize);

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
        self.vol.read_only()
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
            let n = (EXTENT_BYTES - within).min(offset + len - at);
            let base = u64::from(l.extents[x as usize]) * EXTENT_BYTES;
            out.push((base + within, n, (at - offset) as usize));
            at += n;
        }
        Ok(out)
    }

    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), VolError> {
        let l = self.layout()?;
        for (p, n, at) in Self::pieces(&l, offset, buf.len() as u64)? {
            self.vol.read_at(p, &mut buf[at..at + n as usize])?;
        }
        Ok(())
    }

    pub fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), VolError> {
        let l = self.layout()?;
        for (p, n, at) in Self::pieces(&l, offset, data.len() as u64)? {
            self.vol.write_at(p, &data[at..at + n as usize], fua)?;
        }
        Ok(())
    }

    pub fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), VolError> {
        let l = self.layout()?;
        for (p, n, _) in Self::pieces(&l, offset, len)? {
            self.vol.trim(p, n, fua)?;
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
        let l = self.layout()?;
        for (p, n, _) in Self::pieces(&l, offset, len)? {
            self.vol.write_zeroes(p, n, no_hole, fua)?;
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
        let &(p, n, _) = pieces.first().ok_or(VolError::OutOfRange)?;
        self.vol.block_status(p, n)
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
