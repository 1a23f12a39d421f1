//! The state every room works on: [`Inner`] (the volume's shape, the
//! store, the local cache file, each chunk's [`Chunk`] state, the log's
//! [`SyncState`], the upload queue and counters), with the helpers all
//! rooms share (locking, failing, blocking on a request, statistics).
//!
//! Depends on: `config`, `bits`, `format`.
use super::config::Config;
use crate::bits::Bits;
use crate::format::{Descriptor, Names, ObjId, SECTOR};
use cvol_storage::{FileStorage, ObjectStats, Storage};
use object_store::ObjectStore;
use std::collections::BTreeSet;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One chunk's state.
#[derive(Debug)]
pub(super) struct Chunk {
    /// The object committed by the log (None: the chunk reads as zeros
    /// apart from ranges in deltas).
    pub(super) object: Option<ObjId>,
    /// An object change the next delta commits (Some(None): discarded).
    pub(super) pending: Option<Option<ObjId>>,
    pub(super) valid: Bits,
    pub(super) dirty: Bits,
    /// Committed bytes live only in deltas (not in `object`).
    pub(super) in_log: bool,
    pub(super) uploading: bool,
    /// Raised by a whole-chunk discard: an upload begun before it is void.
    pub(super) gen: u64,
    pub(super) last_use: u64,
    pub(super) last_write: u64,
    pub(super) wrote_end: bool,
}

impl Chunk {
    pub(super) fn new(object: Option<ObjId>) -> Chunk {
        Chunk {
            object,
            pending: None,
            valid: if object.is_some() {
                Bits::None
            } else {
                Bits::All
            },
            dirty: Bits::None,
            in_log: false,
            uploading: false,
            gen: 0,
            last_use: 0,
            last_write: 0,
            wrote_end: false,
        }
    }

    pub(super) fn evictable(&self) -> bool {
        self.object.is_some()
            && !self.valid.is_empty()
            && self.dirty.is_empty()
            && self.pending.is_none()
            && !self.in_log
            && !self.uploading
    }
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) gets: AtomicU64,
    pub(super) get_bytes: AtomicU64,
    pub(super) puts: AtomicU64,
    pub(super) put_bytes: AtomicU64,
    pub(super) deletes: AtomicU64,
    pub(super) hits: AtomicU64,
    pub(super) misses: AtomicU64,
    pub(super) evictions: AtomicU64,
}

pub(super) struct SyncState {
    pub(super) next_seq: u64,
    pub(super) manifest_seq: u64,
    pub(super) log_bytes: u64,
    pub(super) deltas: u64,
    pub(super) last_manifest: Instant,
    /// Chunk objects replaced, with the delta that replaced them.
    pub(super) superseded: Vec<(String, u64)>,
    /// Superseded by the last manifest: deletable once a delta lands after
    /// it (a server fenced meanwhile cannot land one, so never deletes
    /// what its successor recovered from).
    pub(super) after_next_delta: Vec<String>,
    /// Fence deltas (kept forever: each is the one name a stale server
    /// would write next).
    pub(super) fences: Vec<u64>,
    /// When the last delta landed.
    pub(super) last_delta: Instant,
}

impl SyncState {
    fn new() -> SyncState {
        SyncState {
            next_seq: 0,
            manifest_seq: 0,
            log_bytes: 0,
            deltas: 0,
            last_manifest: Instant::now(),
            superseded: Vec::new(),
            after_next_delta: Vec::new(),
            fences: Vec::new(),
            last_delta: Instant::now(),
        }
    }
}

/// Background uploads taken (queued or running) and syncs waiting for
/// them to finish.
#[derive(Default)]
pub(super) struct Uploads {
    pub(super) in_flight: usize,
    pub(super) paused: usize,
}

pub(super) struct Inner {
    pub(super) rt: tokio::runtime::Runtime,
    pub(super) store: std::sync::Arc<dyn ObjectStore>,
    pub(super) names: Names,
    pub(super) label: String,
    pub(super) d: Descriptor,
    pub(super) local: FileStorage,
    pub(super) cache_bytes: u64,
    pub(super) read_only: bool,
    /// PUTs meant create-only are (false: `--unsafe-no-fencing` on a store
    /// that does not honour them; every PUT overwrites).
    pub(super) create_only: bool,
    pub(super) epoch: u64,
    pub(super) lease: Duration,
    pub(super) chunks: Vec<Mutex<Chunk>>,
    /// Chunks with dirty sectors or a pending change.
    pub(super) changed: Mutex<BTreeSet<u32>>,
    /// Chunks with bytes only in deltas.
    pub(super) logged: Mutex<BTreeSet<u32>>,
    pub(super) sync: Mutex<SyncState>,
    /// Objects no delta or manifest in use references: deleted soon.
    /// (Its own lock: uploads add to it while a sync waits for them.)
    pub(super) garbage: Mutex<Vec<String>>,
    pub(super) up: Mutex<Uploads>,
    pub(super) up_cv: Condvar,
    /// The upload queue's receiving end (the upload workers'): chunks the
    /// background took for upload. Bounded (`parallel` entries), so at most
    /// `parallel` uploads wait while `parallel` run; the background's
    /// sender is its only sender, so the workers stop once it has.
    pub(super) queue: crossbeam_channel::Receiver<u32>,
    pub(super) failed: Mutex<Option<String>>,
    pub(super) next_obj: AtomicU64,
    pub(super) c: Counters,
    pub(super) start: Instant,
    pub(super) stop: AtomicBool,
    /// Stops the lease renewal (last: a clean close renews until done).
    pub(super) stop_lease: AtomicBool,
    /// Background PUTs at once.
    pub(super) parallel: usize,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(super) fn err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

impl Inner {
    /// A volume's state before recovery (every chunk zeros, the log empty),
    /// and the upload queue's sending end.
    pub(super) fn new(
        cfg: &Config,
        rt: tokio::runtime::Runtime,
        d: Descriptor,
        local: FileStorage,
        create_only: bool,
        epoch: u64,
    ) -> (Inner, crossbeam_channel::Sender<u32>) {
        let parallel = cfg.uploads.max(1);
        let (tx, queue) = crossbeam_channel::bounded(parallel);
        let chunks = (0..d.chunk_count())
            .map(|_| Mutex::new(Chunk::new(None)))
            .collect();
        let inner = Inner {
            rt,
            store: cfg.store.clone(),
            names: Names::new(&cfg.prefix),
            label: cfg.label.clone(),
            d,
            local,
            cache_bytes: cfg.cache_bytes,
            read_only: cfg.read_only,
            create_only,
            epoch,
            lease: cfg.lease,
            chunks,
            changed: Mutex::new(BTreeSet::new()),
            logged: Mutex::new(BTreeSet::new()),
            sync: Mutex::new(SyncState::new()),
            garbage: Mutex::new(Vec::new()),
            up: Mutex::new(Uploads::default()),
            up_cv: Condvar::new(),
            queue,
            failed: Mutex::new(None),
            next_obj: AtomicU64::new(1),
            c: Counters::default(),
            start: Instant::now(),
            stop: AtomicBool::new(false),
            stop_lease: AtomicBool::new(false),
            parallel,
        };
        (inner, tx)
    }

    /// Milliseconds since open.
    pub(super) fn now(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// Sectors of chunk `c`.
    pub(super) fn sectors(&self, c: u32) -> u64 {
        self.d.chunk_range(c).1 / SECTOR
    }

    pub(super) fn check_failed(&self) -> io::Result<()> {
        match &*lock(&self.failed) {
            Some(f) => Err(err(format!("{}: {f}", self.label))),
            None => Ok(()),
        }
    }

    /// Refuses writes from now on, for `why`; the error to return.
    pub(super) fn fail(&self, why: String) -> io::Error {
        tracing::error!("{}: {why}; no further writes until reopened", self.label);
        let mut f = lock(&self.failed);
        if f.is_none() {
            *f = Some(why.clone());
        }
        err(format!("{}: {why}", self.label))
    }

    pub(super) fn block<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    pub(super) fn stats(&self) -> ObjectStats {
        let (mut objects, mut bytes) = (0u64, 0u64);
        for (c, cell) in self.chunks.iter().enumerate() {
            if lock(cell).object.is_some() {
                objects += 1;
                bytes += self.d.chunk_range(c as u32).1;
            }
        }
        let st = lock(&self.sync);
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ObjectStats {
            url: self.label.clone(),
            objects: objects + st.deltas + 1,
            bytes: bytes + st.log_bytes,
            gets: get(&self.c.gets),
            get_bytes: get(&self.c.get_bytes),
            puts: get(&self.c.puts),
            put_bytes: get(&self.c.put_bytes),
            deletes: get(&self.c.deletes),
            cache_hits: get(&self.c.hits),
            cache_misses: get(&self.c.misses),
            cache_bytes: self.local.allocated_bytes().unwrap_or(0),
            cache_limit_bytes: self.cache_bytes,
            cache_evictions: get(&self.c.evictions),
            epoch: self.epoch,
            seq: st.next_seq.saturating_sub(1),
        }
    }
}
