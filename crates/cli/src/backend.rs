//! Adapter from the engine's `Volume` to the NBD server's `Backend` trait.
use cvol_engine::cache::CacheVolume;
use cvol_engine::{VolError, Volume};
use cvol_nbd::{Backend, BackendError, Extent, WriteZeroesFlags};
use std::sync::Arc;

pub struct VolumeBackend {
    pub volume: Arc<Volume>,
}

pub(crate) fn to_nbd(e: VolError) -> BackendError {
    match e {
        VolError::OutOfRange => BackendError::Invalid,
        VolError::ReadOnly => BackendError::ReadOnly,
        VolError::NoSpace => BackendError::NoSpace,
        VolError::Corrupt { .. } => BackendError::Io,
        e @ (VolError::Io(_) | VolError::Poisoned | VolError::Open(_)) => {
            tracing::warn!("request failed: {e}");
            BackendError::Io
        }
    }
}

impl Backend for VolumeBackend {
    fn size_bytes(&self) -> u64 {
        self.volume.size_bytes()
    }

    fn read_only(&self) -> bool {
        self.volume.read_only()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        self.volume.read_at(offset, buf).map_err(to_nbd)
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), BackendError> {
        self.volume.write_at(offset, data, fua).map_err(to_nbd)
    }

    fn flush(&self) -> Result<(), BackendError> {
        self.volume.flush().map_err(to_nbd)
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<(), BackendError> {
        self.volume.trim(offset, length, fua).map_err(to_nbd)
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        flags: WriteZeroesFlags,
    ) -> Result<(), BackendError> {
        self.volume
            .write_zeroes(offset, length, flags.no_hole, flags.fua)
            .map_err(to_nbd)
    }

    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, BackendError> {
        let extents = self.volume.block_status(offset, length).map_err(to_nbd)?;
        Ok(extents
            .into_iter()
            .map(|e| Extent {
                length: e.length,
                hole: e.zero,
                zero: e.zero,
            })
            .collect())
    }
}

/// Adapter from a cache volume (`cvol create --origin`) to the NBD server.
pub struct CacheBackend {
    pub cache: Arc<CacheVolume>,
}

impl Backend for CacheBackend {
    fn size_bytes(&self) -> u64 {
        self.cache.size_bytes()
    }

    fn read_only(&self) -> bool {
        self.cache.read_only()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        self.cache.read_at(offset, buf).map_err(to_nbd)
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), BackendError> {
        self.cache.write_at(offset, data, fua).map_err(to_nbd)
    }

    fn flush(&self) -> Result<(), BackendError> {
        self.cache.flush().map_err(to_nbd)
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<(), BackendError> {
        self.cache.trim(offset, length, fua).map_err(to_nbd)
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        flags: WriteZeroesFlags,
    ) -> Result<(), BackendError> {
        self.cache
            .write_zeroes(offset, length, flags.fua)
            .map_err(to_nbd)
    }

    /// Everything reads as data: the cache does not know the origin's holes.
    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, BackendError> {
        match offset.checked_add(length) {
            Some(end) if end <= self.cache.size_bytes() => Ok(vec![Extent {
                length,
                hole: false,
                zero: false,
            }]),
            _ => Err(BackendError::Invalid),
        }
    }
}
