//! Manifests: when one is due (log bytes, count, age, garbage waiting),
//! writing one (every chunk's object, the fences), and what it
//! supersedes (older deltas and manifest, replaced chunk objects),
//! deleted once the next delta lands.
//!
//! Depends on: `state`, `objects`.
use super::objects::put;
use super::state::{lock, Inner, SyncState};
use crate::format::Manifest;
use std::io;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A manifest is written once the deltas since the last one hold this
/// many bytes, number this many, or are this old.
const MANIFEST_LOG_BYTES: u64 = 64 << 20;
const MANIFEST_DELTAS: u64 = 512;
const MANIFEST_AGE: Duration = Duration::from_secs(30);
/// ...or sooner when objects wait to be deleted (TRIM frees store space).
const MANIFEST_GARBAGE_AGE: Duration = Duration::from_secs(5);

impl Inner {
    /// Writes manifest `seq` (the delta just landed): every chunk's object
    /// and the fences; what it supersedes waits for the next delta.
    pub(super) fn write_manifest(&self, st: &mut SyncState, seq: u64) -> io::Result<()> {
        let chunks = self.chunks.iter().map(|c| lock(c).object).collect();
        let m = Manifest {
            seq,
            epoch: self.epoch,
            chunks,
            fences: st.fences.clone(),
        };
        let body = m.encode();
        let len = body.len() as u64;
        self.block(put(
            &*self.store,
            &self.names.manifest(seq),
            body,
            self.create_only,
        ))
        .map_err(|e| self.fail(format!("manifest {seq}: {e}")))?;
        self.c.puts.fetch_add(1, Ordering::Relaxed);
        self.c.put_bytes.fetch_add(len, Ordering::Relaxed);
        self.supersede_up_to(st, seq);
        Ok(())
    }

    /// Superseded by manifest `seq`: older deltas and manifest, and the
    /// chunk objects replaced up to it. Deleted after the next delta.
    fn supersede_up_to(&self, st: &mut SyncState, seq: u64) {
        let before = st.manifest_seq;
        for s in before + 1..=seq {
            // A fence stays: it is the name a stale server would write next.
            if st.fences.binary_search(&s).is_err() {
                st.after_next_delta.push(self.names.delta(s));
            }
        }
        if before != seq {
            st.after_next_delta.push(self.names.manifest(before));
        }
        let (old, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut st.superseded)
            .into_iter()
            .partition(|(_, s)| *s <= seq);
        st.superseded = keep;
        st.after_next_delta.extend(old.into_iter().map(|(n, _)| n));
        st.manifest_seq = seq;
        st.log_bytes = 0;
        st.deltas = 0;
        st.last_manifest = Instant::now();
    }

    pub(super) fn manifest_due(&self) -> bool {
        let st = lock(&self.sync);
        let age = st.last_manifest.elapsed();
        st.log_bytes >= MANIFEST_LOG_BYTES
            || st.deltas >= MANIFEST_DELTAS
            || (!st.superseded.is_empty() && age >= MANIFEST_GARBAGE_AGE)
            || (st.deltas > 0 && age >= MANIFEST_AGE)
    }

    /// Objects wait for a delta after the last manifest (a second on).
    pub(super) fn garbage_waits(&self) -> bool {
        let st = lock(&self.sync);
        !st.after_next_delta.is_empty() && st.last_manifest.elapsed() >= Duration::from_secs(1)
    }
}
