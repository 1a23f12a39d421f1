//! The log: a sync (a FLUSH, or the background's) PUTs one delta,
//! create-only at the next sequence number, with the uploads finished
//! since the last one and the dirty ranges (chunks mostly dirty or
//! written to their end are uploaded whole first; before a manifest,
//! every chunk with bytes only in the log). A delta that collides with
//! another server's means this one was fenced. Also the empty delta that
//! lets a manifest's garbage go.
//!
//! Depends on: `state`, `upload` (snapshots, the pause), `manifest`,
//! `gc`, `objects`.
use super::objects::{get, put};
use super::state::{err, lock, Inner, SyncState};
use super::upload::Snapshot;
use crate::bits::Bits;
use crate::format::{ChunkRef, Delta, ObjId, Range, SECTOR};
use cvol_storage::Storage;
use futures::StreamExt;
use std::collections::BTreeSet;
use std::io;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// What a sync took from one chunk (to commit or put back).
pub(super) struct Taken {
    chunk: u32,
    gen: u64,
    pending: Option<Option<ObjId>>,
    runs: Vec<(u64, u64)>,
    /// Uploaded for a manifest: the pending change it replaced, and its object.
    fresh: Option<(Option<Option<ObjId>>, ObjId)>,
}

impl Inner {
    /// Makes every completed write durable in the store: one delta. With
    /// `manifest`, every chunk with bytes only in the log is uploaded
    /// first and a manifest follows.
    pub(super) fn sync_inner(&self, manifest: bool) -> io::Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.check_failed()?;
        let mut st = lock(&self.sync);
        let _q = self.quiesce();
        let changed: BTreeSet<u32> = std::mem::take(&mut *lock(&self.changed));
        let mut todo = changed.clone();
        if manifest {
            todo.extend(lock(&self.logged).iter().copied());
        }
        let mut taken: Vec<Taken> = Vec::new();
        let delta = match self.build_delta(st.next_seq, &todo, manifest, &mut taken) {
            Ok(Some(d)) => d,
            Ok(None) => return Ok(()),
            Err(e) => {
                self.put_back(&taken, &changed);
                return Err(e);
            }
        };
        let body = delta.encode();
        let len = body.len() as u64;
        if let Err(e) = self.put_delta(delta.seq, body) {
            self.put_back(&taken, &changed);
            return Err(e);
        }
        st.next_seq += 1;
        st.log_bytes += len;
        st.deltas += 1;
        st.last_delta = Instant::now();
        // The delta landed: this server still owns the volume, and what
        // the last manifest superseded may go.
        let landed = std::mem::take(&mut st.after_next_delta);
        lock(&self.garbage).extend(landed);
        self.commit(&mut st, &taken, delta.seq);
        if manifest && lock(&self.logged).is_empty() {
            self.write_manifest(&mut st, delta.seq)?;
        }
        drop(st);
        self.delete_ready();
        Ok(())
    }

    /// Takes what chunks `todo` have to commit into delta `seq` (uploading
    /// some whole first); None when there is nothing to commit.
    fn build_delta(
        &self,
        seq: u64,
        todo: &BTreeSet<u32>,
        manifest: bool,
        taken: &mut Vec<Taken>,
    ) -> io::Result<Option<Delta>> {
        let mut delta = Delta {
            seq,
            epoch: self.epoch,
            ..Delta::default()
        };
        self.upload_whole(todo, manifest, taken)?;
        for &c in todo {
            if taken.iter().any(|t| t.chunk == c) {
                continue;
            }
            let (t, ranges) = self.take_dirty(c)?;
            taken.push(t);
            delta.ranges.extend(ranges);
        }
        for t in taken.iter() {
            if let Some(p) = t.pending {
                delta.refs.push(ChunkRef {
                    chunk: t.chunk,
                    object: p,
                });
            }
        }
        if delta.refs.is_empty() && delta.ranges.is_empty() && !manifest {
            return Ok(None);
        }
        Ok(Some(delta))
    }

    /// Takes chunk `c`'s pending change and dirty sectors (their bytes as
    /// delta ranges).
    fn take_dirty(&self, c: u32) -> io::Result<(Taken, Vec<Range>)> {
        let n = self.sectors(c);
        let (start, _) = self.d.chunk_range(c);
        let mut ch = lock(&self.chunks[c as usize]);
        let runs = ch.dirty.runs(0, n, true);
        let mut ranges = Vec::new();
        for &(a, b) in &runs {
            let mut data = vec![0u8; ((b - a) * SECTOR) as usize];
            self.local.read_at(start + a * SECTOR, &mut data)?;
            ranges.push(Range {
                offset: start + a * SECTOR,
                data,
            });
        }
        let pending = ch.pending.take();
        ch.dirty = Bits::None;
        let t = Taken {
            chunk: c,
            gen: ch.gen,
            pending,
            runs,
            fresh: None,
        };
        Ok((t, ranges))
    }

    /// Uploads (in parallel) chunks of `todo` whole, each to a fresh
    /// object the sync's delta then references: for a manifest, every
    /// chunk with bytes only in the log or dirty; otherwise the chunks
    /// mostly dirty or written to their end (filled segments the
    /// background has not uploaded yet: whole objects, not delta ranges
    /// uploaded again later).
    fn upload_whole(
        &self,
        todo: &BTreeSet<u32>,
        manifest: bool,
        taken: &mut Vec<Taken>,
    ) -> io::Result<()> {
        let jobs = self.take_whole(todo, manifest, taken)?;
        let store = self.store.clone();
        let names = self.names.clone();
        let create_only = self.create_only;
        let results: Vec<object_store::Result<()>> = self.block(
            futures::stream::iter(jobs.into_iter().map(|(c, id, body)| {
                let (store, name) = (store.clone(), names.chunk(c, id));
                async move { put(&*store, &name, body, create_only).await }
            }))
            .buffer_unordered(self.parallel)
            .collect(),
        );
        let bytes: u64 = taken
            .iter()
            .filter(|t| t.fresh.is_some())
            .map(|t| self.d.chunk_range(t.chunk).1)
            .sum();
        self.c
            .puts
            .fetch_add(results.len() as u64, Ordering::Relaxed);
        self.c.put_bytes.fetch_add(bytes, Ordering::Relaxed);
        match results.into_iter().find_map(Result::err) {
            Some(e) => Err(err(e)),
            None => Ok(()),
        }
    }

    /// Snapshots the chunks [`Inner::upload_whole`] uploads: (chunk, its
    /// fresh object, bytes).
    fn take_whole(
        &self,
        todo: &BTreeSet<u32>,
        manifest: bool,
        taken: &mut Vec<Taken>,
    ) -> io::Result<Vec<(u32, ObjId, Vec<u8>)>> {
        let mut jobs = Vec::new();
        for &c in todo {
            let n = self.sectors(c);
            let needs = {
                let ch = lock(&self.chunks[c as usize]);
                let dirty = ch.dirty.count(n);
                if manifest {
                    ch.in_log || dirty > 0
                } else {
                    dirty > 0 && (ch.wrote_end || dirty * 2 >= n)
                }
            };
            if !needs {
                continue;
            }
            let Some(Snapshot {
                body,
                gen,
                dirty,
                pending,
            }) = self.snapshot(c)?
            else {
                continue;
            };
            {
                let mut ch = lock(&self.chunks[c as usize]);
                if ch.gen != gen {
                    // Discarded since the snapshot: the plain path
                    // commits the discard instead.
                    continue;
                }
                ch.pending = None;
            }
            let id = self.new_id();
            taken.push(Taken {
                chunk: c,
                gen,
                pending: Some(Some(id)),
                runs: dirty.runs(0, n, true),
                fresh: Some((pending, id)),
            });
            jobs.push((c, id, body));
        }
        Ok(jobs)
    }

    /// Puts back what a failed sync took: the chunks' pending changes and
    /// dirty sectors, and `changed` (the chunks it took from the set of
    /// chunks waiting for a delta).
    fn put_back(&self, taken: &[Taken], changed: &BTreeSet<u32>) {
        for t in taken {
            let n = self.sectors(t.chunk);
            let mut ch = lock(&self.chunks[t.chunk as usize]);
            if ch.gen != t.gen {
                continue;
            }
            let pending = match t.fresh {
                Some((before, _)) => before,
                None => t.pending,
            };
            if ch.pending.is_none() {
                ch.pending = pending;
            }
            for &(a, b) in &t.runs {
                ch.dirty.assign(a, b, true, n);
            }
            drop(ch);
            lock(&self.changed).insert(t.chunk);
        }
        lock(&self.changed).extend(changed.iter().copied());
    }

    /// PUTs delta `seq` create-only. A failure that leaves it unclear
    /// whether the delta landed is settled by reading it back; a delta
    /// there that is not ours means another server took the volume over.
    fn put_delta(&self, seq: u64, body: Vec<u8>) -> io::Result<()> {
        let name = self.names.delta(seq);
        let len = body.len() as u64;
        let r = self.block(put(&*self.store, &name, body.clone(), self.create_only));
        self.c.puts.fetch_add(1, Ordering::Relaxed);
        self.c.put_bytes.fetch_add(len, Ordering::Relaxed);
        let e = match r {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        match self.block(get(&*self.store, &name)) {
            Ok(b) if b.as_ref() == body.as_slice() => Ok(()),
            Ok(_) => Err(self.fail(format!(
                "fenced: another server took the volume over (delta {seq} is theirs); \
                 this server's writes since its last flush are not in the volume"
            ))),
            // Not there: not retried at this number later, as a newer
            // server may have deleted a delta of ours there after its
            // manifest; the engine refuses writes after a failed sync too.
            Err(object_store::Error::NotFound { .. }) => {
                Err(self.fail(format!("delta {seq} was not written: {e}")))
            }
            Err(e2) => Err(self.fail(format!(
                "delta {seq}: {e}; reading it back failed too ({e2}): its fate is unknown"
            ))),
        }
    }

    /// A delta landed: chunks take their new objects; those with ranges in
    /// it have bytes in the log.
    fn commit(&self, st: &mut SyncState, taken: &[Taken], seq: u64) {
        for t in taken {
            let mut ch = lock(&self.chunks[t.chunk as usize]);
            if let Some(p) = t.pending {
                if let Some(old) = ch.object {
                    if Some(old) != p {
                        st.superseded.push((self.names.chunk(t.chunk, old), seq));
                    }
                }
                if let Some((Some(Some(unused)), _)) = t.fresh {
                    lock(&self.garbage).push(self.names.chunk(t.chunk, unused));
                }
                ch.object = p;
                ch.in_log = false;
            }
            let in_log = t.fresh.is_none() && !t.runs.is_empty();
            if in_log {
                ch.in_log = true;
            }
            let now_in_log = ch.in_log;
            drop(ch);
            let mut logged = lock(&self.logged);
            if now_in_log {
                logged.insert(t.chunk);
            } else {
                logged.remove(&t.chunk);
            }
        }
    }

    /// An empty delta (after a manifest, so its garbage may go).
    pub(super) fn sync_marker(&self) -> io::Result<()> {
        let mut st = lock(&self.sync);
        let seq = st.next_seq;
        let body = Delta {
            seq,
            epoch: self.epoch,
            ..Delta::default()
        }
        .encode();
        self.put_delta(seq, body)?;
        // Not counted among the deltas a manifest is due for: an idle
        // volume writes nothing more (the next manifest deletes it).
        st.next_seq += 1;
        let landed = std::mem::take(&mut st.after_next_delta);
        lock(&self.garbage).extend(landed);
        Ok(())
    }
}
