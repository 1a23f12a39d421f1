//! The origin behind a cache volume (`cvol create --origin`): a file, a
//! block device, or an NBD export (`nbd://HOST[:PORT]/EXPORT`,
//! `nbd+unix:///EXPORT?socket=PATH`) read and written through
//! `cvol_nbd::client`.
use crate::error::Error;
use cvol_cache::{OriginStamp, StampFn};
use cvol_nbd::client::Client;
use cvol_storage::{FileStorage, Storage};
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// An NBD export as a store.
struct NbdOrigin {
    client: Client,
}

impl Storage for NbdOrigin {
    fn len_bytes(&self) -> u64 {
        self.client.size_bytes()
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.client.read_at(offset, buf)
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.client.write_at(offset, data, false)
    }

    fn sync(&self) -> io::Result<()> {
        self.client.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.client.trim(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.client.write_zeroes(offset, len)
    }
}

/// Is `origin` an NBD URI rather than a path?
pub fn is_uri(origin: &str) -> bool {
    origin.starts_with("nbd://") || origin.starts_with("nbd+unix://")
}

/// The origin's stamp now: its size, and for a regular file its mtime,
/// inode and device (an NBD export or a block device: the size only).
fn stamp_of(path: Option<&Path>, size_bytes: u64) -> io::Result<OriginStamp> {
    let mut s = OriginStamp {
        size_bytes,
        ..OriginStamp::default()
    };
    if let Some(p) = path {
        let md = std::fs::metadata(p)?;
        if md.is_file() {
            s.mtime_ns = (md.mtime() as u64)
                .wrapping_mul(1_000_000_000)
                .wrapping_add(md.mtime_nsec() as u64);
            s.ino = md.ino();
            s.dev = md.dev();
        }
    }
    Ok(s)
}

/// An opened origin: the store, and how to stamp it.
pub struct Origin {
    pub store: Arc<dyn Storage>,
    pub stamp: StampFn,
}

/// Opens the origin a cache names, writable unless `read_only`. A path
/// origin is locked like a volume (exclusive when writable), so two
/// servers never write one origin.
pub fn open(origin: &str, read_only: bool) -> Result<Origin, Error> {
    if is_uri(origin) {
        let client = Client::connect(origin).map_err(|e| {
            Error::Refused(match e.to_string() {
                m if m.contains(origin) => format!("origin: {m}"),
                m => format!("origin {origin}: {m}"),
            })
        })?;
        if client.read_only() && !read_only {
            return Err(Error::Refused(format!(
                "origin {origin} is read-only; serve the cache with --read-only"
            )));
        }
        let store: Arc<dyn Storage> = Arc::new(NbdOrigin { client });
        let weak = Arc::downgrade(&store);
        let stamp: StampFn = Box::new(move || {
            let size = weak.upgrade().map_or(0, |s| s.len_bytes());
            stamp_of(None, size)
        });
        return Ok(Origin { store, stamp });
    }
    let path = PathBuf::from(origin);
    let md =
        std::fs::metadata(&path).map_err(|e| Error::Refused(format!("origin {origin}: {e}")))?;
    if !md.is_file() && !md.file_type().is_block_device() {
        return Err(Error::Refused(format!(
            "origin {origin} is neither a file, a block device nor an NBD URI \
             (nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH)"
        )));
    }
    let file = FileStorage::open(&path, !read_only, !read_only)
        .map_err(|e| Error::Refused(format!("origin {origin}: {e}")))?;
    let store: Arc<dyn Storage> = Arc::new(file);
    let size = store.len_bytes();
    let stamp: StampFn = Box::new(move || stamp_of(Some(&path), size));
    Ok(Origin { store, stamp })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_origin_is_stamped_and_a_missing_one_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("o.img");
        std::fs::write(&p, vec![1u8; 8192]).unwrap();
        let o = open(p.to_str().unwrap(), false).unwrap();
        let a = (o.stamp)().unwrap();
        assert_eq!(a.size_bytes, 8192);
        assert!(a.ino != 0 && a.mtime_ns != 0);
        o.store.write_at(0, &[2u8; 4096]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        drop(o);
        std::fs::write(&p, vec![3u8; 8192]).unwrap();
        let b = (open(p.to_str().unwrap(), true).unwrap().stamp)().unwrap();
        assert_ne!(a, b, "a rewrite changes the stamp");
        let e = open("/nonexistent/o.img", false).err().unwrap().to_string();
        assert!(e.contains("/nonexistent/o.img"), "{e}");
        let e = open(dir.path().to_str().unwrap(), false)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("neither a file"), "{e}");
        let e = open("nbd+unix:///x?socket=/nonexistent.sock", false)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("nbd+unix"), "{e}");
    }
}
