//! The upload pool: chunks the engine filled (last sector written) or
//! stopped writing are taken by the background and queued, and
//! `uploads` workers PUT each whole to a fresh object the next delta
//! references. The queue is bounded (`uploads` entries): with every
//! worker busy on a slow store, the background takes no more chunks, so
//! at most twice `uploads` chunks are taken at once and a chunk's bytes
//! are read (into memory) only when a worker starts it. Also the pause a
//! sync takes ([`Inner::quiesce`]) so no upload runs beside it.
//!
//! Depends on: `state`, `cache` (a chunk's bytes, fetched if need be),
//! `objects`.
use super::objects::put;
use super::state::{err, lock, Inner};
use crate::bits::Bits;
use crate::format::ObjId;
use crossbeam_channel::{Sender, TrySendError};
use cvol_storage::Storage;
use std::io;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// A chunk not written for this long is uploaded.
const IDLE_UPLOAD: Duration = Duration::from_secs(1);

/// A chunk's bytes read for an upload, and its state at that moment.
pub(super) struct Snapshot {
    pub(super) body: Vec<u8>,
    pub(super) gen: u64,
    /// The dirty sectors the snapshot cleared.
    pub(super) dirty: Bits,
    /// The pending change the upload replaces.
    pub(super) pending: Option<Option<ObjId>>,
}

/// Background uploads stay paused while this lives (a sync).
pub(super) struct QuiesceGuard<'a> {
    inner: &'a Inner,
}

impl Drop for QuiesceGuard<'_> {
    fn drop(&mut self) {
        lock(&self.inner.up).paused -= 1;
        self.inner.up_cv.notify_all();
    }
}

impl Inner {
    /// Reads the whole chunk for an upload, clearing its dirty sectors;
    /// None if it changed under us (discarded, or evicted meanwhile).
    pub(super) fn snapshot(&self, c: u32) -> io::Result<Option<Snapshot>> {
        let n = self.sectors(c);
        self.ensure_valid(c, 0, n)?;
        let mut ch = lock(&self.chunks[c as usize]);
        if !ch.valid.is_full() {
            return Ok(None);
        }
        let (start, len) = self.d.chunk_range(c);
        let mut buf = vec![0u8; len as usize];
        self.local.read_at(start, &mut buf)?;
        let dirty = std::mem::replace(&mut ch.dirty, Bits::None);
        ch.wrote_end = false;
        Ok(Some(Snapshot {
            body: buf,
            gen: ch.gen,
            dirty,
            pending: ch.pending,
        }))
    }

    /// A fresh object id (this epoch's next).
    pub(super) fn new_id(&self) -> ObjId {
        ObjId {
            epoch: self.epoch,
            n: self.next_obj.fetch_add(1, Ordering::Relaxed),
        }
    }

    fn put_chunk(&self, c: u32, id: ObjId, body: Vec<u8>) -> object_store::Result<()> {
        let len = body.len() as u64;
        self.block(put(
            &*self.store,
            &self.names.chunk(c, id),
            body,
            self.create_only,
        ))?;
        self.c.puts.fetch_add(1, Ordering::Relaxed);
        self.c.put_bytes.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    /// An upload worker: uploads the chunks queued until the background
    /// (the queue's one sender) has stopped and the queue is empty.
    pub(super) fn upload_worker(&self) {
        while let Ok(c) = self.queue.recv() {
            self.upload(c);
        }
    }

    /// A background upload of chunk `c` (queued by `queue_uploads`).
    fn upload(&self, c: u32) {
        let r = self.upload_one(c);
        lock(&self.chunks[c as usize]).uploading = false;
        if let Err(e) = r {
            tracing::warn!("{}: uploading chunk {c}: {e} (retried later)", self.label);
        }
        let mut up = lock(&self.up);
        up.in_flight -= 1;
        self.up_cv.notify_all();
    }

    fn upload_one(&self, c: u32) -> io::Result<()> {
        let Some(Snapshot {
            body, gen, dirty, ..
        }) = self.snapshot(c)?
        else {
            return Ok(());
        };
        let id = self.new_id();
        let r = self.put_chunk(c, id, body);
        let mut ch = lock(&self.chunks[c as usize]);
        let n = self.sectors(c);
        match r {
            Ok(()) if ch.gen == gen => {
                if let Some(Some(old)) = ch.pending.replace(Some(id)) {
                    lock(&self.garbage).push(self.names.chunk(c, old));
                }
                drop(ch);
                lock(&self.changed).insert(c);
                Ok(())
            }
            Ok(()) => {
                drop(ch);
                lock(&self.garbage).push(self.names.chunk(c, id));
                Ok(())
            }
            Err(e) => {
                if ch.gen == gen {
                    // Not uploaded: what was dirty is dirty again.
                    for (a, b) in dirty.runs(0, n, true) {
                        ch.dirty.assign(a, b, true, n);
                    }
                    drop(ch);
                    lock(&self.changed).insert(c);
                }
                Err(err(e))
            }
        }
    }

    /// Pauses new background uploads and waits for those in flight.
    pub(super) fn quiesce(&self) -> QuiesceGuard<'_> {
        let mut up = lock(&self.up);
        up.paused += 1;
        while up.in_flight > 0 {
            up = self.up_cv.wait(up).unwrap_or_else(|p| p.into_inner());
        }
        QuiesceGuard { inner: self }
    }

    /// Queues uploads of chunks the engine filled or stopped writing, as
    /// many as the queue takes (the rest wait for a later round).
    pub(super) fn queue_uploads(&self, tx: &Sender<u32>) {
        let now = self.now();
        let candidates: Vec<u32> = lock(&self.changed).iter().copied().collect();
        for c in candidates {
            if !self.upload_ready(c, now) {
                continue;
            }
            let mut up = lock(&self.up);
            if up.paused > 0 {
                return;
            }
            let mut ch = lock(&self.chunks[c as usize]);
            if ch.uploading {
                continue;
            }
            ch.uploading = true;
            drop(ch);
            up.in_flight += 1;
            drop(up);
            match tx.try_send(c) {
                Ok(()) => {}
                // Every worker busy and the queue full: the store is slow.
                Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                    self.untake(c);
                    return;
                }
            }
        }
    }

    /// Chunk `c` is dirty, not uploading, and written to its end or idle.
    fn upload_ready(&self, c: u32, now: u64) -> bool {
        let ch = lock(&self.chunks[c as usize]);
        !ch.uploading
            && !ch.dirty.is_empty()
            && (ch.wrote_end || now.saturating_sub(ch.last_write) >= IDLE_UPLOAD.as_millis() as u64)
    }

    /// Puts back a chunk taken for upload that the queue did not take.
    fn untake(&self, c: u32) {
        lock(&self.chunks[c as usize]).uploading = false;
        let mut up = lock(&self.up);
        up.in_flight -= 1;
        self.up_cv.notify_all();
    }
}
