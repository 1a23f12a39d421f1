//! Storage: the seam between the cvol engine and its media.
//!
//! `FileStorage` serves a regular file or a block device with positional I/O.
//! `SimStorage` keeps the image in memory, remembers which writes are not yet
//! synced, and at a simulated crash keeps, drops or tears (per 512-byte
//! sector) each of them; it also injects I/O errors. `SplitStorage` joins a
//! data store and a metadata device into one offset space.

mod file;
mod sim;
mod split;

pub use file::FileStorage;
pub use sim::{SimConfig, SimStorage};
pub use split::SplitStorage;

use std::io;

/// Media access. Implementations are shared between threads.
///
/// Semantics the engine relies on (documented in docs/FORMAT.md):
/// - `write_at` data may be lost at a crash until `sync` returns.
/// - after `sync` returns, every earlier completed write is durable.
/// - a write of one aligned 512-byte sector is atomic (old or new content).
pub trait Storage: Send + Sync {
    /// Usable size in bytes.
    fn len_bytes(&self) -> u64;
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()>;
    fn sync(&self) -> io::Result<()>;
    /// Tells the media a range holds no data any more (hole punch / discard).
    /// Advisory: the range may still read back old bytes.
    fn discard(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
    /// Makes a range read as zeros (a cache writing through to its origin,
    /// NBD WRITE_ZEROES). The default writes zero buffers of at most 1 MiB;
    /// a store that can zero without sending the bytes overrides it.
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(offset, 0, self.len_bytes())?;
        let zeros = vec![0u8; len.min(1 << 20) as usize];
        let mut at = offset;
        let end = offset.checked_add(len).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidInput, "write_zeroes range overflows")
        })?;
        while at < end {
            let n = (end - at).min(zeros.len() as u64) as usize;
            self.write_at(at, &zeros[..n])?;
            at += n as u64;
        }
        Ok(())
    }
    /// Whether writing over space the store already holds costs the host
    /// less than filling a hole (a file on a file system: no block or page
    /// allocation), so that freed segments are worth keeping for reuse a
    /// while before their space is returned. False: return it at once.
    fn overwrite_is_cheaper(&self) -> bool {
        false
    }
    /// Bytes the host has allocated for the store (`du` of a backing file),
    /// when the store can tell; None for a block device or a simulation.
    fn allocated_bytes(&self) -> Option<u64> {
        None
    }
    /// Where the next bytes that may be non-zero start, at or after
    /// `offset` (a backing file's `SEEK_DATA`): every byte of
    /// `[offset, returned)` reads as zeros, and None means nothing but zeros
    /// from `offset` to the end. Lets scans skip the holes of a sparse
    /// store (an empty 8 TiB volume) in one call. A store that cannot tell
    /// answers `offset` itself (the default): data may be anywhere.
    fn next_data(&self, offset: u64) -> io::Result<Option<u64>> {
        check_range(offset, 0, self.len_bytes())?;
        Ok((offset < self.len_bytes()).then_some(offset))
    }
    /// Makes the store `len` bytes long, for a volume whose store grew or
    /// shrank while open (`cvol resize --physical-size`): a file is
    /// extended (sparse: the new bytes read as zeros; one already longer
    /// keeps its length) or cut; a block
    /// device must already hold `len` bytes (its size is read again: it
    /// may have grown since it was opened) and keeps its size. A store
    /// that cannot change size refuses (the default).
    fn set_len(&self, _len: u64) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this store cannot change size while open",
        ))
    }
    /// Counters of a store kept in an object store (None for local media).
    fn object_stats(&self) -> Option<ObjectStats> {
        None
    }
}

/// What a volume kept in an object store did since it was opened, and
/// holds (the `object_*` keys of `cvol stat --json`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ObjectStats {
    /// The volume's address (`s3://BUCKET/PREFIX`).
    pub url: String,
    /// Objects the volume keeps in the store (chunks, deltas, manifest).
    pub objects: u64,
    /// Bytes of those objects.
    pub bytes: u64,
    pub gets: u64,
    pub get_bytes: u64,
    pub puts: u64,
    pub put_bytes: u64,
    pub deletes: u64,
    /// Reads served from the local cache alone, and reads that had to GET.
    pub cache_hits: u64,
    pub cache_misses: u64,
    /// Bytes the local cache file holds, and may hold.
    pub cache_bytes: u64,
    pub cache_limit_bytes: u64,
    pub cache_evictions: u64,
    /// This server's epoch, and the last delta's number.
    pub epoch: u64,
    pub seq: u64,
}

/// An `InvalidInput` error unless `[offset, offset + len)` lies within `size` bytes.
pub fn check_range(offset: u64, len: usize, size: u64) -> io::Result<()> {
    match offset.checked_add(len as u64) {
        Some(end) if end <= size => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("I/O at {offset}+{len} beyond the end of the store ({size} bytes)"),
        )),
    }
}
