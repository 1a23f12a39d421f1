//! Adapters from a pool's volume (`VolumeView`) and a cache volume to the
//! NBD server's `Backend` trait.
use cvol_cache::CacheVolume;
use cvol_engine::pool::OpenGuard;
use cvol_engine::VolError;
use cvol_nbd::{Backend, BackendError, CommandKind, ContextExtent, Extent, WriteZeroesFlags};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// How many engine errors became `EIO` since the process started.
static EIO_ERRORS: AtomicU64 = AtomicU64::new(0);

/// Whether the `n`th (0-based) error that became `EIO` is logged: the first
/// 10, then every 1000th (a poisoned volume fails every request; the log
/// must not flood).
fn eio_logged(n: u64) -> bool {
    n < 10 || n.is_multiple_of(1000)
}

pub(crate) fn to_nbd(e: VolError) -> BackendError {
    match e {
        VolError::OutOfRange => BackendError::Invalid,
        VolError::ReadOnly => BackendError::ReadOnly,
        VolError::NoSpace => BackendError::NoSpace,
        e @ (VolError::Corrupt { .. }
        | VolError::Io(_)
        | VolError::Poisoned
        | VolError::Open(_)
        | VolError::Meta(_)) => {
            let n = EIO_ERRORS.fetch_add(1, Ordering::Relaxed);
            if eio_logged(n) {
                tracing::warn!("request failed with EIO ({} so far): {e}", n + 1);
            }
            BackendError::Io
        }
    }
}

/// Adapter from one volume of a pool to the NBD server: each connection
/// has its own, holding the volume open.
/// The metadata context namespace and prefix of changed-block tracking.
pub const DIRTY_BITMAP: &str = "qemu:dirty-bitmap:";

pub struct ViewBackend {
    pub guard: OpenGuard,
}

impl Backend for ViewBackend {
    fn size_bytes(&self) -> u64 {
        self.guard.view().size_bytes()
    }

    fn read_only(&self) -> bool {
        self.guard.view().read_only()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        self.guard.view().read_at(offset, buf).map_err(to_nbd)
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), BackendError> {
        self.guard
            .view()
            .write_at(offset, data, fua)
            .map_err(to_nbd)
    }

    fn flush(&self) -> Result<(), BackendError> {
        self.guard.view().flush().map_err(to_nbd)
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<(), BackendError> {
        self.guard.view().trim(offset, length, fua).map_err(to_nbd)
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        flags: WriteZeroesFlags,
    ) -> Result<(), BackendError> {
        self.guard
            .view()
            .write_zeroes(offset, length, flags.no_hole, flags.fua)
            .map_err(to_nbd)
    }

    /// `qemu:dirty-bitmap:SNAP` for each live snapshot of the volume:
    /// the blocks changed since SNAP (flag 1 = dirty), as qemu's
    /// persistent dirty bitmaps report them.
    fn meta_contexts(&self) -> Vec<String> {
        (self.guard.view().tracked_snapshots().into_iter())
            .map(|s| format!("{DIRTY_BITMAP}{s}"))
            .collect()
    }

    fn context_status(
        &self,
        name: &str,
        offset: u64,
        length: u64,
    ) -> Result<Vec<ContextExtent>, BackendError> {
        let snap = name
            .strip_prefix(DIRTY_BITMAP)
            .ok_or(BackendError::NotSupported)?;
        let runs = self
            .guard
            .view()
            .changed_since(snap, offset, length)
            .map_err(to_nbd)?
            .ok_or(BackendError::NotSupported)?;
        Ok(runs
            .into_iter()
            .map(|(length, dirty)| ContextExtent {
                length,
                flags: u32::from(dirty),
            })
            .collect())
    }

    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, BackendError> {
        let extents = self
            .guard
            .view()
            .block_status(offset, length)
            .map_err(to_nbd)?;
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

/// One call of a backend, as a [`Hook`] around it sees it.
#[derive(Debug, Clone, Copy)]
pub struct Call {
    pub kind: CommandKind,
    pub offset: u64,
    /// Bytes: a READ's or WRITE's payload, else the range (0 for FLUSH).
    pub length: u64,
    pub fua: bool,
    /// WRITE_ZEROES only.
    pub no_hole: bool,
    pub fast_zero: bool,
}

/// Code run around every call of a wrapped backend (metrics, traces).
pub trait Hook: Send + Sync + 'static {
    fn around<T>(
        &self,
        call: Call,
        f: impl FnOnce() -> Result<T, BackendError>,
    ) -> Result<T, BackendError>;
}

impl<H: Hook> Hook for Arc<H> {
    fn around<T>(
        &self,
        call: Call,
        f: impl FnOnce() -> Result<T, BackendError>,
    ) -> Result<T, BackendError> {
        (**self).around(call, f)
    }
}

/// `inner` with `hook` around each of its calls.
pub struct Hooked<H> {
    pub inner: Arc<dyn Backend>,
    pub hook: H,
}

fn call(kind: CommandKind, offset: u64, length: u64, fua: bool) -> Call {
    Call {
        kind,
        offset,
        length,
        fua,
        no_hole: false,
        fast_zero: false,
    }
}

impl<H: Hook> Backend for Hooked<H> {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn read_only(&self) -> bool {
        self.inner.read_only()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        let c = call(CommandKind::Read, offset, buf.len() as u64, false);
        self.hook.around(c, || self.inner.read(offset, buf))
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), BackendError> {
        let c = call(CommandKind::Write, offset, data.len() as u64, fua);
        self.hook.around(c, || self.inner.write(offset, data, fua))
    }
    fn flush(&self) -> Result<(), BackendError> {
        let c = call(CommandKind::Flush, 0, 0, false);
        self.hook.around(c, || self.inner.flush())
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<(), BackendError> {
        let c = call(CommandKind::Trim, offset, length, fua);
        self.hook.around(c, || self.inner.trim(offset, length, fua))
    }
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        flags: WriteZeroesFlags,
    ) -> Result<(), BackendError> {
        let c = Call {
            no_hole: flags.no_hole,
            fast_zero: flags.fast_zero,
            ..call(CommandKind::WriteZeroes, offset, length, flags.fua)
        };
        self.hook
            .around(c, || self.inner.write_zeroes(offset, length, flags))
    }
    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, BackendError> {
        let c = call(CommandKind::BlockStatus, offset, length, false);
        self.hook
            .around(c, || self.inner.block_status(offset, length))
    }
    fn cache(&self, offset: u64, length: u64) -> Result<(), BackendError> {
        let c = call(CommandKind::Cache, offset, length, false);
        self.hook.around(c, || self.inner.cache(offset, length))
    }
    fn meta_contexts(&self) -> Vec<String> {
        self.inner.meta_contexts()
    }
    fn context_status(
        &self,
        name: &str,
        offset: u64,
        length: u64,
    ) -> Result<Vec<ContextExtent>, BackendError> {
        let c = call(CommandKind::BlockStatus, offset, length, false);
        self.hook
            .around(c, || self.inner.context_status(name, offset, length))
    }
}

#[cfg(test)]
mod tests {
    use super::eio_logged;

    #[test]
    fn eio_log_is_rate_limited() {
        let logged: Vec<u64> = (0..3001).filter(|&n| eio_logged(n)).collect();
        let mut want: Vec<u64> = (0..10).collect();
        want.extend([1000, 2000, 3000]);
        assert_eq!(logged, want);
    }
}
