//! Opening a volume's log: the descriptor, then (writable) the fence (a
//! create-only empty delta at the next number, so a stale server's next
//! delta collides), then the newest manifest and the deltas after it
//! replayed into the chunk states and the cache file; at a writable open,
//! the garbage older servers left is swept.
//!
//! Depends on: `state`, `objects`, `gc`, `error`.
use super::error::{Error, RecoveryError};
use super::objects::{get, list, numbers, put};
use super::state::{lock, Chunk, Inner};
use crate::format::{Delta, Descriptor, Manifest, Names, SECTOR};
use cvol_storage::Storage;
use object_store::ObjectStore;

/// Attempts at fencing the log (each lost to a racing writer's delta).
const FENCE_TRIES: u64 = 1000;

/// Reads the volume's descriptor (its shape).
pub(super) async fn read_descriptor(
    store: &dyn ObjectStore,
    names: &Names,
    label: &str,
) -> Result<Descriptor, Error> {
    match get(store, &names.descriptor()).await {
        Ok(b) => Descriptor::decode(&b).map_err(|source| Error::BadDescriptor {
            label: label.to_string(),
            source,
        }),
        Err(object_store::Error::NotFound { .. }) => Err(Error::NoVolume {
            label: label.to_string(),
        }),
        Err(source) => Err(Error::Store {
            label: label.to_string(),
            source,
        }),
    }
}

impl Inner {
    /// Fences the log (writable), then loads the newest manifest and
    /// applies the deltas after it.
    pub(super) fn recover(&self) -> Result<(), RecoveryError> {
        let fence = if self.read_only {
            None
        } else {
            Some(self.fence_log()?)
        };
        // Listed after the fence: a stale server's manifest written before
        // it is seen, and no stale server deletes anything after it.
        let manifests = self.list_numbers("manifest")?;
        let logs = self.list_numbers("log")?;
        if let Some(f) = fence {
            // The fence must be the newest delta: one that landed in a gap
            // (deltas deleted behind a newer manifest, while this server
            // was slow to start) fences nothing.
            let above = logs.last().is_some_and(|&top| top > f)
                || manifests.last().is_some_and(|&top| top >= f);
            if above {
                return Err(RecoveryError::Overtaken { fence: f });
            }
        }
        let m = *manifests.last().ok_or(RecoveryError::NoManifest)?;
        let man = self.load_manifest(m)?;
        let mut fences = man.fences.clone();
        fences.extend(fence);
        let end = match fence {
            Some(f) => f,
            // Read-only: up to the first gap.
            None => {
                let mut s = m;
                while logs.binary_search(&(s + 1)).is_ok() {
                    s += 1;
                }
                s
            }
        };
        let log_bytes = self.replay(m, end, fence, &mut fences)?;
        {
            let mut st = lock(&self.sync);
            st.next_seq = end + 1;
            st.manifest_seq = m;
            st.log_bytes = log_bytes;
            st.deltas = end - m;
            fences.sort_unstable();
            fences.dedup();
            st.fences = fences;
        }
        if fence.is_some() {
            self.collect_garbage(m, &man);
        }
        tracing::info!(
            "{}: opened at epoch {}: manifest {m}, {} deltas after it",
            self.label,
            self.epoch,
            end - m
        );
        Ok(())
    }

    /// The sequence numbers under `dir` ("log", "manifest").
    fn list_numbers(&self, dir: &str) -> Result<Vec<u64>, RecoveryError> {
        let listed = self
            .block(list(&*self.store, &self.names.dir(dir)))
            .map_err(RecoveryError::List)?;
        Ok(numbers(&listed))
    }

    /// PUTs an empty fence delta create-only just above the newest delta
    /// (higher on each collision); its number.
    fn fence_log(&self) -> Result<u64, RecoveryError> {
        let top0 = self.list_numbers("log")?.last().copied().unwrap_or(0);
        for k in 1..=FENCE_TRIES {
            let seq = top0 + k;
            let body = Delta {
                seq,
                epoch: self.epoch,
                fence: true,
                ..Delta::default()
            }
            .encode();
            let name = self.names.delta(seq);
            match self.block(put(&*self.store, &name, body, self.create_only)) {
                Ok(()) => return Ok(seq),
                Err(object_store::Error::AlreadyExists { .. }) => continue,
                Err(e) => return Err(RecoveryError::Fence(e)),
            }
        }
        Err(RecoveryError::FenceContended)
    }

    /// Reads manifest `m` and takes its chunk objects.
    fn load_manifest(&self, m: u64) -> Result<Manifest, RecoveryError> {
        let man = self
            .block(get(&*self.store, &self.names.manifest(m)))
            .map_err(|source| RecoveryError::Manifest { seq: m, source })?;
        let man = Manifest::decode(&man)
            .map_err(|source| RecoveryError::ManifestMalformed { seq: m, source })?;
        if man.chunks.len() as u64 != self.d.chunk_count() || man.seq != m {
            return Err(RecoveryError::ManifestMismatch { seq: m });
        }
        for (c, o) in man.chunks.iter().enumerate() {
            *lock(&self.chunks[c]) = Chunk::new(*o);
        }
        Ok(man)
    }

    /// Applies the deltas after manifest `m` up to `end` (but the fence),
    /// noting fence deltas in `fences`; the bytes read.
    fn replay(
        &self,
        m: u64,
        end: u64,
        fence: Option<u64>,
        fences: &mut Vec<u64>,
    ) -> Result<u64, RecoveryError> {
        let mut log_bytes = 0;
        for seq in m + 1..=end {
            if fence == Some(seq) {
                continue;
            }
            let b = self
                .block(get(&*self.store, &self.names.delta(seq)))
                .map_err(|source| RecoveryError::Delta {
                    seq,
                    manifest: m,
                    source,
                })?;
            log_bytes += b.len() as u64;
            let delta = Delta::decode(&b)
                .map_err(|source| RecoveryError::DeltaMalformed { seq, source })?;
            if delta.seq != seq {
                return Err(RecoveryError::DeltaMisnumbered {
                    seq,
                    says: delta.seq,
                });
            }
            if delta.fence {
                fences.push(seq);
            }
            self.apply(&delta)?;
        }
        Ok(log_bytes)
    }

    /// Applies one delta: chunk object changes, then byte ranges (written
    /// to the cache file: valid, in the log).
    fn apply(&self, delta: &Delta) -> Result<(), RecoveryError> {
        let seq = delta.seq;
        let local = |source| RecoveryError::Local { seq, source };
        for r in &delta.refs {
            let Some(cell) = self.chunks.get(r.chunk as usize) else {
                return Err(RecoveryError::ChunkBeyond {
                    seq,
                    chunk: r.chunk,
                });
            };
            let (start, len) = self.d.chunk_range(r.chunk);
            self.local.discard(start, len).map_err(local)?;
            let mut ch = lock(cell);
            *ch = Chunk::new(r.object);
            lock(&self.logged).remove(&r.chunk);
        }
        for r in &delta.ranges {
            let end = r.offset + r.data.len() as u64;
            if !r.offset.is_multiple_of(SECTOR)
                || !end.is_multiple_of(SECTOR)
                || end > self.d.size_bytes
            {
                return Err(RecoveryError::Unaligned {
                    seq,
                    offset: r.offset,
                    len: r.data.len(),
                });
            }
            self.local.write_at(r.offset, &r.data).map_err(local)?;
            self.mark_in_log(r.offset, end);
        }
        Ok(())
    }

    /// Bytes `[offset, end)` came from the log: valid locally, in the log.
    fn mark_in_log(&self, offset: u64, end: u64) {
        let mut at = offset;
        while at < end {
            let c = self.d.chunk_of(at);
            let (start, len) = self.d.chunk_range(c);
            let to = end.min(start + len);
            let mut ch = lock(&self.chunks[c as usize]);
            ch.valid.assign(
                (at - start) / SECTOR,
                (to - start) / SECTOR,
                true,
                len / SECTOR,
            );
            ch.in_log = true;
            lock(&self.logged).insert(c);
            at = to;
        }
    }
}
