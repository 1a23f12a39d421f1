//! `ObjectStorage`: the engine's `Storage` over an object store.
//!
//! The byte space is cut into chunks (the engine's metadata area, then one
//! chunk per log segment). The truth is, in the store: the newest manifest
//! (every chunk's object), then the deltas after it in order (chunk object
//! changes and byte ranges). Locally, a sparse cache file holds the bytes
//! of the chunks in use: a sector is *valid* when its local bytes are
//! current, *dirty* when written since the last sync.
//!
//! - A write goes to the cache file (dirty). A chunk the engine has filled
//!   (its last sector written, or no write for a second) is uploaded whole
//!   in the background, several PUTs at once, and referenced by the next
//!   delta.
//! - `sync` (a FLUSH) PUTs one delta, create-only at the next sequence
//!   number: the uploads finished since the last sync, then the dirty
//!   ranges. It returns once that PUT has: flushed data is in the store.
//! - Every so often (log bytes, count, time) a sync uploads every chunk
//!   with bytes still only in deltas, then writes a manifest; objects it
//!   supersedes are deleted after the next delta (so a server fenced
//!   meanwhile never deletes what its successor reads).
//! - Reads of sectors not valid locally are ranged GETs of the chunk's
//!   object (64 KiB at least), kept; clean chunks are evicted (least
//!   recently used) when the cache file outgrows `--cache-size`.
//! - Single writer: a server claims epoch E+1 create-only, after epoch E's
//!   lease stopped changing for the lease time (or was released), then
//!   *fences* the log: a create-only empty delta at the next number. A
//!   stale server's next delta then collides and it stops (its later
//!   uploads are never referenced).
//! - Fencing rests on the store honouring create-only PUTs
//!   (`If-None-Match: *`). `create` and a writable `open` probe that first
//!   ([`probe_create_only`]) and refuse a store that does not, unless
//!   [`Config::unsafe_no_fencing`] (then every PUT overwrites, and only one
//!   server may ever write the volume at a time).
//!
//! The rooms, each depending only on those listed before it: `error`,
//! `objects` (requests), `config`, `fencing` (the create-only probe),
//! `create` (a new volume's objects), `state` (what every room works on),
//! `lease`, `cache` (the local chunk cache), `gc`, `manifest`, `upload`
//! (the bounded upload pool), `sync` (deltas), `recovery` (open's replay),
//! `background` (the threads); this file opens and closes a volume and
//! implements [`Storage`] over them.
mod background;
mod cache;
mod config;
mod create;
mod error;
mod fencing;
mod gc;
mod lease;
mod manifest;
mod objects;
mod recovery;
mod state;
mod sync;
#[cfg(test)]
mod tests;
mod upload;

pub use config::Config;
pub use create::{create, destroy};
pub use error::{describe, Error, RecoveryError};
pub use fencing::{probe_create_only, CreateOnly};

use crate::format::{Descriptor, Names};
use cvol_storage::{ObjectStats, Storage};
use lease::claim;
use state::{lock, Inner};
use std::io;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// A volume in an object store, served through a local cache.
pub struct ObjectStorage {
    inner: Arc<Inner>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    lease_thread: Mutex<Option<JoinHandle<()>>>,
}

impl ObjectStorage {
    /// Opens the volume: claims the next epoch and fences the log (unless
    /// read-only), then recovers the newest manifest and the deltas after
    /// it. The local cache starts empty.
    pub fn open(cfg: &Config) -> Result<ObjectStorage, Error> {
        let rt = objects::runtime()?;
        let names = Names::new(&cfg.prefix);
        let store = &*cfg.store;
        let label = &cfg.label;
        let d = rt.block_on(recovery::read_descriptor(store, &names, label))?;
        // Nothing is written read-only; a writer needs fencing to hold.
        let create_only =
            cfg.read_only || rt.block_on(fencing::settle_fencing(store, &names, cfg))?;
        let (file, local) = cache::open_cache_file(cfg, &d)?;
        let epoch = if cfg.read_only {
            0
        } else {
            match rt.block_on(claim(store, &names, label, cfg.lease, create_only)) {
                Ok(e) => e,
                Err(e) => {
                    // Refused: the cache file (ours, locked, empty) goes.
                    let _ = std::fs::remove_file(&file);
                    return Err(e);
                }
            }
        };
        let (inner, uploads) = Inner::new(cfg, rt, d, local, create_only, epoch);
        let s = ObjectStorage {
            inner: Arc::new(inner),
            threads: Mutex::new(Vec::new()),
            lease_thread: Mutex::new(None),
        };
        if let Err(e) = s.start(uploads) {
            s.abandon(&file);
            return Err(e);
        }
        Ok(s)
    }

    /// Renews the lease from the claim on (a long recovery must not look
    /// like a dead server), recovers, then starts the background threads
    /// (`uploads`: the upload queue's sending end).
    fn start(&self, uploads: crossbeam_channel::Sender<u32>) -> Result<(), Error> {
        let label = || self.inner.label.clone();
        self.start_lease()?;
        self.inner.recover().map_err(|source| Error::Recovery {
            label: label(),
            source,
        })?;
        background::spawn(&self.inner, uploads, &mut lock(&self.threads)).map_err(|source| {
            Error::Io {
                label: label(),
                source,
            }
        })
    }

    /// Starts renewing the lease (writable).
    fn start_lease(&self) -> Result<(), Error> {
        if self.inner.read_only {
            return Ok(());
        }
        let inner = self.inner.clone();
        let renewer = std::thread::Builder::new()
            .name("cvol-s3-lease".into())
            .spawn(move || inner.renew_lease())
            .map_err(|source| Error::Io {
                label: self.inner.label.clone(),
                source,
            })?;
        *lock(&self.lease_thread) = Some(renewer);
        Ok(())
    }

    /// An open that failed after the claim: stops the threads, releases
    /// the lease so the next server starts at once, removes the cache file.
    fn abandon(&self, file: &Path) {
        self.stop_threads();
        if !self.inner.read_only {
            self.inner.release_lease();
        }
        let _ = std::fs::remove_file(file);
    }

    /// Stops the background work; then (writable, not failed) writes a
    /// manifest, deletes what it superseded and releases the lease, so
    /// the next server starts at once.
    pub fn close(&self) -> Result<(), Error> {
        let inner = &self.inner;
        inner.stop.store(true, Ordering::SeqCst);
        inner.up_cv.notify_all();
        for h in lock(&self.threads).drain(..) {
            let _ = h.join();
        }
        let finished = if inner.read_only {
            Ok(())
        } else {
            self.finish()
        };
        self.stop_threads();
        if inner.read_only {
            return Ok(());
        }
        finished?;
        inner.put_released().map_err(|source| Error::ReleaseLease {
            label: inner.label.clone(),
            source,
        })
    }

    /// Gives the volume up without a last commit, after an open the engine
    /// refused (a wrong key, a damaged superblock, a signal): stops the
    /// threads and releases the lease, so the next server need not wait a
    /// lease time. Nothing more is written; what was not synced is dropped,
    /// as after a crash (its uploads, if any, are garbage the next
    /// server's collection removes).
    pub fn release(&self) {
        self.stop_threads();
        if !self.inner.read_only {
            self.inner.release_lease();
        }
    }

    /// Close's last commit: a manifest, and an empty delta after it so its
    /// garbage goes.
    fn finish(&self) -> Result<(), Error> {
        let inner = &self.inner;
        let label = || inner.label.clone();
        if let Some(why) = lock(&inner.failed).clone() {
            return Err(Error::NotClosedCleanly {
                label: label(),
                why,
            });
        }
        inner
            .sync_inner(true)
            .map_err(|source| Error::FinalManifest {
                label: label(),
                source,
            })?;
        inner.sync_marker().map_err(|source| Error::Io {
            label: label(),
            source,
        })?;
        inner.delete_ready();
        Ok(())
    }

    /// The volume's shape.
    pub fn descriptor(&self) -> Descriptor {
        self.inner.d
    }

    pub fn epoch(&self) -> u64 {
        self.inner.epoch
    }

    /// Why the store refuses writes (fenced, a failed PUT), if it does.
    pub fn failure(&self) -> Option<String> {
        lock(&self.inner.failed).clone()
    }

    /// Stops and joins every thread, the lease renewal last.
    fn stop_threads(&self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        self.inner.up_cv.notify_all();
        for h in lock(&self.threads).drain(..) {
            let _ = h.join();
        }
        self.inner.stop_lease.store(true, Ordering::SeqCst);
        if let Some(h) = lock(&self.lease_thread).take() {
            let _ = h.join();
        }
    }
}

impl Drop for ObjectStorage {
    fn drop(&mut self) {
        self.stop_threads();
    }
}

impl Storage for ObjectStorage {
    fn len_bytes(&self) -> u64 {
        self.inner.d.size_bytes
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.inner.read(offset, buf)
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.inner.write(offset, data)
    }

    fn sync(&self) -> io::Result<()> {
        self.inner.sync_inner(false)
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.discard(offset, len)
    }

    /// Bytes in the object store (the volume's `du`).
    fn allocated_bytes(&self) -> Option<u64> {
        Some(self.inner.stats().bytes)
    }

    fn next_data(&self, offset: u64) -> io::Result<Option<u64>> {
        self.inner.next_data(offset)
    }

    fn object_stats(&self) -> Option<ObjectStats> {
        Some(self.inner.stats())
    }
}
