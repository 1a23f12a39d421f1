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
use crate::bits::Bits;
use crate::format::{ChunkRef, Delta, Descriptor, Manifest, Names, ObjId, Range, SECTOR};
use bytes::Bytes;
use cvol_storage::{FileStorage, ObjectStats, Storage};
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use std::collections::BTreeSet;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Least bytes a miss fetches (aligned), in sectors: 64 KiB.
const FETCH_SECTORS: u64 = 128;
/// A chunk not written for this long is uploaded.
const IDLE_UPLOAD: Duration = Duration::from_secs(1);
/// A manifest is written once the deltas since the last one hold this
/// many bytes, number this many, or are this old.
const MANIFEST_LOG_BYTES: u64 = 64 << 20;
const MANIFEST_DELTAS: u64 = 512;
const MANIFEST_AGE: Duration = Duration::from_secs(30);
/// ...or sooner when objects wait to be deleted (TRIM frees store space).
const MANIFEST_GARBAGE_AGE: Duration = Duration::from_secs(5);
/// Changes (uploads, discards, dirty bytes) no FLUSH committed for this
/// long are committed by the background.
const BACKGROUND_SYNC_AFTER: Duration = Duration::from_secs(3);
/// Attempts at fencing the log (each lost to a racing writer's delta).
const FENCE_TRIES: u64 = 1000;

/// How to reach a volume and use the local cache.
#[derive(Clone)]
pub struct Config {
    pub store: Arc<dyn ObjectStore>,
    /// The volume's prefix in the bucket.
    pub prefix: String,
    /// What to call the volume in messages (its URL).
    pub label: String,
    /// Directory of the local cache file.
    pub cache_dir: PathBuf,
    /// Bytes the cache file may hold (clean data beyond it is evicted).
    pub cache_bytes: u64,
    pub read_only: bool,
    /// A server whose lease has not changed for this long is gone.
    pub lease: Duration,
    /// Background PUTs at once.
    pub uploads: usize,
    /// Create and serve even when the store does not honour create-only
    /// PUTs (`--unsafe-no-fencing`): nothing then stops a second server
    /// from writing the volume at the same time.
    pub unsafe_no_fencing: bool,
}

impl Config {
    pub fn new(store: Arc<dyn ObjectStore>, prefix: &str, cache_dir: PathBuf) -> Config {
        Config {
            store,
            prefix: prefix.to_string(),
            label: prefix.to_string(),
            cache_dir,
            cache_bytes: 1 << 30,
            read_only: false,
            lease: Duration::from_secs(10),
            uploads: 8,
            unsafe_no_fencing: false,
        }
    }
}

/// An object-store error in words a user can act on: a missing bucket,
/// missing or refused credentials, an unreachable endpoint.
pub fn describe(label: &str, e: &object_store::Error) -> String {
    let text = e.to_string();
    let code = text
        .split("<Code>")
        .nth(1)
        .and_then(|r| r.split("</Code>").next())
        .unwrap_or("");
    let endpoint =
        std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "AWS (no AWS_ENDPOINT_URL)".into());
    if code == "NoSuchBucket" {
        return format!(
            "{label}: the bucket does not exist at {endpoint}; create it first (any S3 tool; \
             `scripts/ceph-local mkbucket NAME` for the local Ceph)"
        );
    }
    if matches!(
        code,
        "InvalidAccessKeyId" | "SignatureDoesNotMatch" | "AccessDenied"
    ) {
        return format!(
            "{label}: {endpoint} refused the credentials ({code}): check AWS_ACCESS_KEY_ID and \
             AWS_SECRET_ACCESS_KEY"
        );
    }
    if std::env::var_os("AWS_ACCESS_KEY_ID").is_none()
        && (text.contains("169.254.169.254") || text.to_lowercase().contains("credential"))
    {
        return format!(
            "{label}: no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and \
             AWS_ENDPOINT_URL for a store other than AWS); the instance metadata service did not \
             provide any"
        );
    }
    if text.contains("error sending request") {
        return format!("{label}: cannot reach the object store at {endpoint}: {text}");
    }
    let short: String = text.chars().take(400).collect();
    format!("{label}: {short}")
}

fn err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// One chunk's state.
#[derive(Debug)]
struct Chunk {
    /// The object committed by the log (None: the chunk reads as zeros
    /// apart from ranges in deltas).
    object: Option<ObjId>,
    /// An object change the next delta commits (Some(None): discarded).
    pending: Option<Option<ObjId>>,
    valid: Bits,
    dirty: Bits,
    /// Committed bytes live only in deltas (not in `object`).
    in_log: bool,
    uploading: bool,
    /// Raised by a whole-chunk discard: an upload begun before it is void.
    gen: u64,
    last_use: u64,
    last_write: u64,
    wrote_end: bool,
}

impl Chunk {
    fn new(object: Option<ObjId>) -> Chunk {
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

    fn evictable(&self) -> bool {
        self.object.is_some()
            && !self.valid.is_empty()
            && self.dirty.is_empty()
            && self.pending.is_none()
            && !self.in_log
            && !self.uploading
    }
}

#[derive(Default)]
struct Counters {
    gets: AtomicU64,
    get_bytes: AtomicU64,
    puts: AtomicU64,
    put_bytes: AtomicU64,
    deletes: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
}

struct SyncState {
    next_seq: u64,
    manifest_seq: u64,
    log_bytes: u64,
    deltas: u64,
    last_manifest: Instant,
    /// Chunk objects replaced, with the delta that replaced them.
    superseded: Vec<(String, u64)>,
    /// Superseded by the last manifest: deletable once a delta lands after
    /// it (a server fenced meanwhile cannot land one, so never deletes
    /// what its successor recovered from).
    after_next_delta: Vec<String>,
    /// Fence deltas (kept forever: each is the one name a stale server
    /// would write next).
    fences: Vec<u64>,
    /// When the last delta landed.
    last_delta: Instant,
}

#[derive(Default)]
struct Uploads {
    in_flight: usize,
    paused: usize,
}

struct Inner {
    rt: tokio::runtime::Runtime,
    store: Arc<dyn ObjectStore>,
    names: Names,
    label: String,
    d: Descriptor,
    local: FileStorage,
    cache_bytes: u64,
    read_only: bool,
    /// PUTs meant create-only are (false: `--unsafe-no-fencing` on a store
    /// that does not honour them; every PUT overwrites).
    create_only: bool,
    epoch: u64,
    lease: Duration,
    chunks: Vec<Mutex<Chunk>>,
    /// Chunks with dirty sectors or a pending change.
    changed: Mutex<BTreeSet<u32>>,
    /// Chunks with bytes only in deltas.
    logged: Mutex<BTreeSet<u32>>,
    sync: Mutex<SyncState>,
    /// Objects no delta or manifest in use references: deleted soon.
    /// (Its own lock: uploads add to it while a sync waits for them.)
    garbage: Mutex<Vec<String>>,
    up: Mutex<Uploads>,
    up_cv: Condvar,
    failed: Mutex<Option<String>>,
    next_obj: AtomicU64,
    c: Counters,
    start: Instant,
    stop: AtomicBool,
    /// Stops the lease renewal (last: a clean close renews until done).
    stop_lease: AtomicBool,
    parallel: usize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A volume in an object store, served through a local cache.
pub struct ObjectStorage {
    inner: Arc<Inner>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    lease_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// Writes a new volume's descriptor and empty manifest. An existing
/// volume at the prefix is refused unless `force` (then every object
/// under the prefix is deleted first).
pub fn create(cfg: &Config, d: &Descriptor, force: bool) -> Result<(), String> {
    d.validate().map_err(|e| e.to_string())?;
    let rt = runtime()?;
    let names = Names::new(&cfg.prefix);
    let store = cfg.store.clone();
    rt.block_on(async {
        let listed = list(&*store, &names.dir(""))
            .await
            .map_err(|e| describe(&cfg.label, &e))?;
        if !listed.is_empty() {
            if !force {
                let what = if listed.iter().any(|(n, _)| *n == names.descriptor()) {
                    "a cvol volume is there"
                } else {
                    "objects are there"
                };
                return Err(format!(
                    "{}: {what} ({} objects); --force deletes them",
                    cfg.label,
                    listed.len()
                ));
            }
            for (n, _) in &listed {
                store
                    .delete(&ObjPath::from(n.as_str()))
                    .await
                    .map_err(|e| format!("{}: deleting {n}: {e}", cfg.label))?;
            }
        }
        let create_only = settle_fencing(&*store, &names, cfg).await?;
        put(&*store, &names.descriptor(), d.encode(), create_only)
            .await
            .map_err(|e| format!("{}: {e}", cfg.label))?;
        let m = Manifest {
            seq: 0,
            epoch: 0,
            chunks: vec![None; d.chunk_count() as usize],
            fences: Vec::new(),
        };
        put(&*store, &names.manifest(0), m.encode(), create_only)
            .await
            .map_err(|e| format!("{}: {e}", cfg.label))
    })
}

/// Deletes every object of a volume (a failed create's undo).
pub fn destroy(cfg: &Config) -> Result<(), String> {
    let rt = runtime()?;
    let names = Names::new(&cfg.prefix);
    rt.block_on(async {
        for (n, _) in list(&*cfg.store, &names.dir(""))
            .await
            .map_err(|e| e.to_string())?
        {
            cfg.store
                .delete(&ObjPath::from(n.as_str()))
                .await
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    })
}

/// What a store does with create-only PUTs (`PutMode::Create`, S3's
/// `If-None-Match: *`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreateOnly {
    /// A second create-only PUT of an object fails: fencing holds.
    Honoured,
    /// It does not (the reason, in words): a stale server's delta would
    /// silently replace its successor's.
    NotHonoured(String),
}

/// Probes whether `store` honours create-only PUTs: PUTs a new probe
/// object under the volume's prefix create-only, then again, and expects
/// "already exists"; the probe is deleted. Errors are the store's (no
/// access, no bucket), not an answer.
pub async fn probe_create_only(
    store: &dyn ObjectStore,
    names: &Names,
) -> object_store::Result<CreateOnly> {
    static PROBES: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let name = names.dir(&format!(
        "probe/{}-{nanos:x}-{}",
        std::process::id(),
        PROBES.fetch_add(1, Ordering::Relaxed)
    ));
    let body = || b"cvol create-only probe\n".to_vec();
    let answer = match put(store, &name, body(), true).await {
        Ok(()) => match put(store, &name, body(), true).await {
            Err(object_store::Error::AlreadyExists { .. }) => Ok(CreateOnly::Honoured),
            Ok(()) => Ok(CreateOnly::NotHonoured(
                "a second create-only PUT of the same object succeeded".into(),
            )),
            Err(e) => Ok(CreateOnly::NotHonoured(format!(
                "a second create-only PUT of the same object failed with another error than \
                 \"already exists\": {e}"
            ))),
        },
        Err(e @ object_store::Error::NotImplemented { .. }) => {
            return Ok(CreateOnly::NotHonoured(format!(
                "{e} (is AWS_CONDITIONAL_PUT set to disabled?)"
            )))
        }
        Err(e) => return Err(e),
    };
    if let Err(e) = store.delete(&ObjPath::from(name.as_str())).await {
        tracing::warn!("deleting the probe object {name}: {e}");
    }
    answer
}

/// Probes the store ([`probe_create_only`]) before anything is written;
/// true: PUTs meant create-only are (fencing holds). A store that does
/// not honour them is refused, unless `cfg.unsafe_no_fencing` (then
/// false: every PUT overwrites, which such a store may be doing anyway).
async fn settle_fencing(
    store: &dyn ObjectStore,
    names: &Names,
    cfg: &Config,
) -> Result<bool, String> {
    let label = &cfg.label;
    let why = match probe_create_only(store, names)
        .await
        .map_err(|e| describe(label, &e))?
    {
        CreateOnly::Honoured => {
            if cfg.unsafe_no_fencing {
                tracing::info!(
                    "{label}: the store honours create-only PUTs, so fencing stays on \
                     (--unsafe-no-fencing is not needed)"
                );
            }
            return Ok(true);
        }
        CreateOnly::NotHonoured(why) => why,
    };
    if cfg.unsafe_no_fencing {
        tracing::warn!(
            "WARNING: {label}: fencing is OFF (--unsafe-no-fencing): the store does not honour \
             create-only PUTs ({why}). Nothing stops a second server from writing this volume \
             at the same time, which corrupts it: run one writer only, and make sure an old \
             server is gone before a new one starts."
        );
        return Ok(false);
    }
    Err(format!(
        "{label}: the object store does not honour create-only PUTs (If-None-Match: *): {why}. \
         cvol's single-writer fencing rests on them: without it, a server taken over after a \
         pause could go on writing and corrupt the volume. Use a store that honours them \
         (AWS S3 and Ceph RGW do), or, if only one server will ever write this volume at a \
         time (an old one always gone before a new one starts), pass --unsafe-no-fencing."
    ))
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("cvol-s3-io")
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the I/O runtime: {e}"))
}

/// Every object under `dir` (a prefix ending at a `/` boundary), name and size.
async fn list(store: &dyn ObjectStore, dir: &str) -> object_store::Result<Vec<(String, u64)>> {
    let prefix = (!dir.is_empty()).then(|| ObjPath::from(dir));
    store
        .list(prefix.as_ref())
        .map_ok(|m| (m.location.to_string(), m.size))
        .try_collect()
        .await
}

async fn put(
    store: &dyn ObjectStore,
    name: &str,
    body: Vec<u8>,
    create: bool,
) -> object_store::Result<()> {
    let opts = PutOptions {
        mode: if create {
            PutMode::Create
        } else {
            PutMode::Overwrite
        },
        ..PutOptions::default()
    };
    store
        .put_opts(&ObjPath::from(name), PutPayload::from(body), opts)
        .await
        .map(|_| ())
}

async fn get(store: &dyn ObjectStore, name: &str) -> object_store::Result<Bytes> {
    store.get(&ObjPath::from(name)).await?.bytes().await
}

fn numbers(listed: &[(String, u64)]) -> Vec<u64> {
    let mut v: Vec<u64> = listed
        .iter()
        .filter_map(|(n, _)| Names::number(n))
        .collect();
    v.sort_unstable();
    v
}

fn lease_body(epoch: u64, n: u64, lease: Duration) -> Vec<u8> {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!(
        "serving epoch={epoch} host={} pid={} lease_ms={} renewal={n}\n",
        host.trim(),
        std::process::id(),
        lease.as_millis()
    )
    .into_bytes()
}

/// The lease time a lease body names (its server renews every quarter of it).
fn lease_of(body: &[u8]) -> Option<Duration> {
    let text = std::str::from_utf8(body).ok()?;
    let ms = text
        .split_whitespace()
        .find_map(|w| w.strip_prefix("lease_ms="))?;
    Some(Duration::from_millis(ms.parse().ok()?))
}

const RELEASED: &[u8] = b"released\n";

impl ObjectStorage {
    /// Opens the volume: claims the next epoch and fences the log (unless
    /// read-only), then recovers the newest manifest and the deltas after
    /// it. The local cache starts empty.
    pub fn open(cfg: &Config) -> Result<ObjectStorage, String> {
        let rt = runtime()?;
        let names = Names::new(&cfg.prefix);
        let store = cfg.store.clone();
        let label = &cfg.label;
        let d = rt.block_on(async {
            match get(&*store, &names.descriptor()).await {
                Ok(b) => Descriptor::decode(&b).map_err(|e| format!("{label}: {e}")),
                Err(object_store::Error::NotFound { .. }) => Err(format!(
                    "{label}: no cvol volume there (no `volume` object); create it with \
                     `cvol create {label} --size SIZE`"
                )),
                Err(e) => Err(describe(label, &e)),
            }
        })?;
        // Nothing is written read-only; a writer needs fencing to hold.
        let create_only = cfg.read_only || rt.block_on(settle_fencing(&*store, &names, cfg))?;
        std::fs::create_dir_all(&cfg.cache_dir)
            .map_err(|e| format!("--cache-dir {}: {e}", cfg.cache_dir.display()))?;
        let file = cfg.cache_dir.join(format!("{}.cache", cache_name(label)));
        let local =
            FileStorage::create_private(&file, d.size_bytes).map_err(|e| match e.kind() {
                io::ErrorKind::WouldBlock => format!(
                    "{}: the cache file is in use by another cvol process",
                    file.display()
                ),
                _ => format!("{}: {e}", file.display()),
            })?;
        let epoch = if cfg.read_only {
            0
        } else {
            match rt.block_on(claim(&*store, &names, label, cfg.lease, create_only)) {
                Ok(e) => e,
                Err(e) => {
                    // Refused: the cache file (ours, locked, empty) goes.
                    let _ = std::fs::remove_file(&file);
                    return Err(e);
                }
            }
        };
        let chunks = (0..d.chunk_count())
            .map(|_| Mutex::new(Chunk::new(None)))
            .collect();
        let inner = Inner {
            rt,
            store,
            names,
            label: label.clone(),
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
            sync: Mutex::new(SyncState {
                next_seq: 0,
                manifest_seq: 0,
                log_bytes: 0,
                deltas: 0,
                last_manifest: Instant::now(),
                superseded: Vec::new(),
                after_next_delta: Vec::new(),
                fences: Vec::new(),
                last_delta: Instant::now(),
            }),
            garbage: Mutex::new(Vec::new()),
            up: Mutex::new(Uploads::default()),
            up_cv: Condvar::new(),
            failed: Mutex::new(None),
            next_obj: AtomicU64::new(1),
            c: Counters::default(),
            start: Instant::now(),
            stop: AtomicBool::new(false),
            stop_lease: AtomicBool::new(false),
            parallel: cfg.uploads.max(1),
        };
        let s = ObjectStorage {
            inner: Arc::new(inner),
            threads: Mutex::new(Vec::new()),
            lease_thread: Mutex::new(None),
        };
        // The lease is renewed from the claim on: a long recovery must not
        // look like a dead server.
        if !cfg.read_only {
            let inner = s.inner.clone();
            let renewer = std::thread::Builder::new()
                .name("cvol-s3-lease".into())
                .spawn(move || inner.renew_lease())
                .map_err(|e| format!("{label}: {e}"));
            match renewer {
                Ok(h) => *lock(&s.lease_thread) = Some(h),
                Err(e) => {
                    s.inner.release_lease();
                    return Err(e);
                }
            }
        }
        let started = s
            .inner
            .recover()
            .map_err(|e| format!("{label}: {e}"))
            .and_then(|()| s.start_threads().map_err(|e| format!("{label}: {e}")));
        if let Err(e) = started {
            // Stop renewing and let the next server start at once.
            s.stop_threads();
            if !cfg.read_only {
                s.inner.release_lease();
            }
            let _ = std::fs::remove_file(&file);
            return Err(e);
        }
        Ok(s)
    }

    fn start_threads(&self) -> io::Result<()> {
        let mut t = lock(&self.threads);
        let (tx, rx) = crossbeam_channel::unbounded::<u32>();
        let inner = self.inner.clone();
        t.push(
            std::thread::Builder::new()
                .name("cvol-s3".into())
                .spawn(move || inner.background(&tx))?,
        );
        if !self.inner.read_only {
            for i in 0..self.inner.parallel {
                let (inner, rx) = (self.inner.clone(), rx.clone());
                t.push(
                    std::thread::Builder::new()
                        .name(format!("cvol-s3-up{i}"))
                        .spawn(move || {
                            while let Ok(c) = rx.recv() {
                                inner.upload(c);
                            }
                        })?,
                );
            }
        }
        Ok(())
    }

    /// Stops the background work; then (writable, not failed) writes a
    /// manifest, deletes what it superseded and releases the lease, so
    /// the next server starts at once.
    pub fn close(&self) -> Result<(), String> {
        let inner = &self.inner;
        inner.stop.store(true, Ordering::SeqCst);
        inner.up_cv.notify_all();
        for h in lock(&self.threads).drain(..) {
            let _ = h.join();
        }
        let finish = || {
            if let Some(f) = lock(&inner.failed).clone() {
                return Err(format!("{}: not closed cleanly: {f}", inner.label));
            }
            let label = &inner.label;
            inner
                .sync_inner(true)
                .map_err(|e| format!("{label}: final manifest: {e}"))?;
            // An empty delta after the manifest lets its garbage go.
            inner.sync_marker().map_err(|e| format!("{label}: {e}"))?;
            inner.delete_ready();
            Ok(())
        };
        let finished = if inner.read_only { Ok(()) } else { finish() };
        self.stop_threads();
        if inner.read_only {
            return Ok(());
        }
        finished?;
        let label = &inner.label;
        inner
            .rt
            .block_on(put(
                &*inner.store,
                &inner.names.lease(inner.epoch),
                RELEASED.to_vec(),
                false,
            ))
            .map_err(|e| format!("{label}: releasing the lease: {e}"))
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
}

impl ObjectStorage {
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

/// A file name for a volume's cache: its label with anything but
/// letters, digits, `.`, `-` and `_` replaced.
fn cache_name(label: &str) -> String {
    label
        .trim_start_matches("s3://")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || ".-_".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Claims the next epoch: the current one's lease must be released or
/// unchanged for `lease` (its server is gone).
async fn claim(
    store: &dyn ObjectStore,
    names: &Names,
    label: &str,
    lease: Duration,
    create_only: bool,
) -> Result<u64, String> {
    let here = |e: object_store::Error| describe(label, &e);
    let epochs = numbers(&list(store, &names.dir("epoch")).await.map_err(here)?);
    let last = epochs.last().copied().unwrap_or(0);
    if last > 0 {
        let read = || async {
            match get(store, &names.lease(last)).await {
                Ok(b) => Ok(Some(b)),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(here(e)),
            }
        };
        let first = read().await?;
        if first.as_deref() != Some(RELEASED) {
            // Its server renews every quarter of *its* lease time: wait the
            // longer of the two (capped at an hour).
            let wait = first
                .as_deref()
                .and_then(lease_of)
                .map_or(lease, |theirs| theirs.max(lease))
                .min(Duration::from_secs(3600));
            tracing::info!(
                "{label}: epoch {last} did not release its lease; waiting {} s to see \
                 whether its server still renews it",
                wait.as_secs_f64()
            );
            tokio::time::sleep(wait).await;
            let second = read().await?;
            if second != first {
                let who = second
                    .map(|b| String::from_utf8_lossy(&b).trim().to_string())
                    .unwrap_or_default();
                return Err(format!(
                    "{label}: being served by another server ({who}; its lease changed within \
                     the last {} s); stop it first",
                    wait.as_secs_f64()
                ));
            }
            tracing::info!("{label}: epoch {last}'s lease lapsed: taking the volume over");
        }
    }
    let epoch = last + 1;
    match put(
        store,
        &names.epoch(epoch),
        lease_body(epoch, 0, lease),
        create_only,
    )
    .await
    {
        Ok(()) => {}
        Err(object_store::Error::AlreadyExists { .. }) => {
            return Err(format!(
                "{label}: another server claimed the volume at the same time (epoch {epoch})"
            ))
        }
        Err(e) => return Err(here(e)),
    }
    put(
        store,
        &names.lease(epoch),
        lease_body(epoch, 0, lease),
        false,
    )
    .await
    .map_err(here)?;
    Ok(epoch)
}

impl Inner {
    fn now(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn sectors(&self, c: u32) -> u64 {
        self.d.chunk_range(c).1 / SECTOR
    }

    fn check_failed(&self) -> io::Result<()> {
        match &*lock(&self.failed) {
            Some(f) => Err(err(format!("{}: {f}", self.label))),
            None => Ok(()),
        }
    }

    fn fail(&self, why: String) -> io::Error {
        tracing::error!("{}: {why}; no further writes until reopened", self.label);
        let mut f = lock(&self.failed);
        if f.is_none() {
            *f = Some(why.clone());
        }
        err(format!("{}: {why}", self.label))
    }

    fn block<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    // ---- recovery ---------------------------------------------------

    /// Fences the log (writable), then loads the newest manifest and
    /// applies the deltas after it.
    fn recover(&self) -> Result<(), String> {
        let store = &*self.store;
        let names = &self.names;
        let logs = numbers(
            &self
                .block(list(store, &names.dir("log")))
                .map_err(|e| e.to_string())?,
        );
        let top0 = logs.last().copied().unwrap_or(0);
        let fence = if self.read_only {
            None
        } else {
            let mut k = 0;
            loop {
                k += 1;
                if k > FENCE_TRIES {
                    return Err("cannot fence the log: another writer keeps appending".into());
                }
                let seq = top0 + k;
                let body = Delta {
                    seq,
                    epoch: self.epoch,
                    fence: true,
                    ..Delta::default()
                }
                .encode();
                match self.block(put(store, &names.delta(seq), body, self.create_only)) {
                    Ok(()) => break Some(seq),
                    Err(object_store::Error::AlreadyExists { .. }) => continue,
                    Err(e) => return Err(format!("fencing the log: {e}")),
                }
            }
        };
        // Listed after the fence: a stale server's manifest written before
        // it is seen, and no stale server deletes anything after it.
        let manifests = numbers(
            &self
                .block(list(store, &names.dir("manifest")))
                .map_err(|e| e.to_string())?,
        );
        let logs = numbers(
            &self
                .block(list(store, &names.dir("log")))
                .map_err(|e| e.to_string())?,
        );
        if let Some(f) = fence {
            // The fence must be the newest delta: one that landed in a gap
            // (deltas deleted behind a newer manifest, while this server
            // was slow to start) fences nothing.
            let above = logs.last().is_some_and(|&top| top > f)
                || manifests.last().is_some_and(|&top| top >= f);
            if above {
                return Err(format!(
                    "another server wrote to the volume while this one was starting \
                     (fence {f} is not the newest delta): start again"
                ));
            }
        }
        let m = *manifests
            .last()
            .ok_or("no manifest: the volume was not created completely")?;
        let man = self
            .block(get(store, &names.manifest(m)))
            .map_err(|e| format!("manifest {m}: {e}"))?;
        let man = Manifest::decode(&man).map_err(|e| format!("manifest {m}: {e}"))?;
        if man.chunks.len() as u64 != self.d.chunk_count() || man.seq != m {
            return Err(format!("manifest {m} does not match the volume"));
        }
        for (c, o) in man.chunks.iter().enumerate() {
            *lock(&self.chunks[c]) = Chunk::new(*o);
        }
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
        let mut log_bytes = 0;
        for seq in m + 1..=end {
            if fence == Some(seq) {
                continue;
            }
            let b = self
                .block(get(store, &names.delta(seq)))
                .map_err(|e| format!("delta {seq} (after manifest {m}): {e}"))?;
            log_bytes += b.len() as u64;
            let delta = Delta::decode(&b).map_err(|e| format!("delta {seq}: {e}"))?;
            if delta.seq != seq {
                return Err(format!("delta {seq} says it is number {}", delta.seq));
            }
            if delta.fence {
                fences.push(seq);
            }
            self.apply(&delta)
                .map_err(|e| format!("delta {seq}: {e}"))?;
        }
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

    fn apply(&self, delta: &Delta) -> Result<(), String> {
        for r in &delta.refs {
            let Some(cell) = self.chunks.get(r.chunk as usize) else {
                return Err(format!("chunk {} beyond the volume", r.chunk));
            };
            let (start, len) = self.d.chunk_range(r.chunk);
            self.local.discard(start, len).map_err(|e| e.to_string())?;
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
                return Err(format!(
                    "range {}+{} is not whole sectors of the volume",
                    r.offset,
                    r.data.len()
                ));
            }
            self.local
                .write_at(r.offset, &r.data)
                .map_err(|e| e.to_string())?;
            let mut at = r.offset;
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
        Ok(())
    }

    /// Deletes what no server can need any more: chunk objects of older
    /// epochs the manifest and log do not reference, and deltas and
    /// manifests older than the manifest in use. Best effort.
    fn collect_garbage(&self, m: u64, man: &Manifest) {
        let r = self.block(async {
            let store = &*self.store;
            let mut doomed = Vec::new();
            for (n, _) in list(store, &self.names.dir("chunk")).await? {
                if let Some((c, o)) = Names::parse_chunk(&n) {
                    let used = lock(&self.chunks[c.min(self.chunks.len() as u32 - 1) as usize])
                        .object
                        == Some(o)
                        || man.chunks.get(c as usize) == Some(&Some(o));
                    if !used && o.epoch < self.epoch {
                        doomed.push(n);
                    }
                }
            }
            for (dir, keep_from) in [("log", m + 1), ("manifest", m)] {
                for (n, _) in list(store, &self.names.dir(dir)).await? {
                    let old = Names::number(&n).filter(|&s| s < keep_from);
                    let fence = dir == "log" && old.is_some_and(|s| man.fences.contains(&s));
                    if old.is_some() && !fence {
                        doomed.push(n);
                    }
                }
            }
            Ok::<_, object_store::Error>(doomed)
        });
        match r {
            Ok(doomed) => {
                if !doomed.is_empty() {
                    tracing::info!(
                        "{}: deleting {} objects no one needs",
                        self.label,
                        doomed.len()
                    );
                }
                lock(&self.garbage).extend(doomed);
                self.delete_ready();
            }
            Err(e) => tracing::warn!("{}: listing for garbage failed: {e}", self.label),
        }
    }

    // ---- reads and writes -------------------------------------------

    /// Makes sectors `[from, to)` of chunk `c` valid locally, fetching what
    /// is not; true when nothing had to be fetched.
    fn ensure_valid(&self, c: u32, from: u64, to: u64) -> io::Result<bool> {
        let n = self.sectors(c);
        let mut hit = true;
        for _ in 0..100 {
            let (runs, obj) = {
                let mut ch = lock(&self.chunks[c as usize]);
                ch.last_use = self.now();
                if ch.valid.runs(from, to, false).is_empty() {
                    return Ok(hit);
                }
                let wf = from / FETCH_SECTORS * FETCH_SECTORS;
                let wt = to
                    .div_ceil(FETCH_SECTORS)
                    .saturating_mul(FETCH_SECTORS)
                    .min(n);
                (ch.valid.runs(wf, wt, false), ch.object)
            };
            hit = false;
            let Some(obj) = obj else {
                // Invalid sectors exist only in chunks with an object.
                debug_assert!(false, "chunk {c} has invalid sectors and no object");
                lock(&self.chunks[c as usize]).valid = Bits::All;
                continue;
            };
            let ranges: Vec<std::ops::Range<u64>> =
                runs.iter().map(|&(a, b)| a * SECTOR..b * SECTOR).collect();
            let name = ObjPath::from(self.names.chunk(c, obj));
            let got = self
                .block(self.store.get_ranges(&name, &ranges))
                .map_err(err)?;
            self.c
                .gets
                .fetch_add(ranges.len() as u64, Ordering::Relaxed);
            let (start, _) = self.d.chunk_range(c);
            let mut ch = lock(&self.chunks[c as usize]);
            if ch.object != Some(obj) {
                continue;
            }
            for (&(a, b), data) in runs.iter().zip(&got) {
                if data.len() as u64 != (b - a) * SECTOR {
                    return Err(err(format!(
                        "chunk {c}: object {} returned {} bytes for {} asked",
                        self.names.chunk(c, obj),
                        data.len(),
                        (b - a) * SECTOR
                    )));
                }
                self.c
                    .get_bytes
                    .fetch_add(data.len() as u64, Ordering::Relaxed);
                // Only sectors still invalid: a write may have come meanwhile.
                for (x, y) in ch.valid.runs(a, b, false) {
                    let part = &data[((x - a) * SECTOR) as usize..((y - a) * SECTOR) as usize];
                    self.local.write_at(start + x * SECTOR, part)?;
                    ch.valid.assign(x, y, true, n);
                }
            }
        }
        Err(err(format!(
            "chunk {c}: could not fill it (it kept changing)"
        )))
    }

    fn pieces(&self, offset: u64, len: u64) -> Vec<(u32, u64, u64)> {
        let mut v = Vec::new();
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let c = self.d.chunk_of(at);
            let (start, clen) = self.d.chunk_range(c);
            let to = end.min(start + clen);
            v.push((c, at, to));
            at = to;
        }
        v
    }

    fn check_range(&self, offset: u64, len: usize) -> io::Result<()> {
        cvol_storage::check_range(offset, len, self.d.size_bytes)
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check_range(offset, buf.len())?;
        let pieces = self.pieces(offset, buf.len() as u64);
        let mut hit = true;
        for _ in 0..100 {
            for &(c, a, b) in &pieces {
                let (start, _) = self.d.chunk_range(c);
                hit &= self.ensure_valid(c, (a - start) / SECTOR, (b - start).div_ceil(SECTOR))?;
            }
            // The local bytes are read under the chunks' locks (ascending:
            // no other path holds two), so no eviction punches them meanwhile.
            let guards: Vec<_> = pieces
                .iter()
                .map(|&(c, _, _)| lock(&self.chunks[c as usize]))
                .collect();
            let valid = pieces.iter().zip(&guards).all(|(&(c, a, b), ch)| {
                let (start, _) = self.d.chunk_range(c);
                ch.valid
                    .runs((a - start) / SECTOR, (b - start).div_ceil(SECTOR), false)
                    .is_empty()
            });
            if !valid {
                // Evicted between the fill and the lock: fill again.
                continue;
            }
            self.local.read_at(offset, buf)?;
            drop(guards);
            let counter = if hit { &self.c.hits } else { &self.c.misses };
            counter.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        Err(err(format!(
            "read at {offset}: the cache kept evicting what it fetched (--cache-size too small?)"
        )))
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.check_range(offset, data.len())?;
        if self.read_only {
            return Err(io::Error::new(io::ErrorKind::PermissionDenied, "read-only"));
        }
        self.check_failed()?;
        let mut done = 0usize;
        for (c, a, b) in self.pieces(offset, data.len() as u64) {
            let (start, clen) = self.d.chunk_range(c);
            let n = clen / SECTOR;
            let (from, to) = ((a - start) / SECTOR, (b - start).div_ceil(SECTOR));
            let part = &data[done..done + (b - a) as usize];
            done += part.len();
            loop {
                // Partial sectors at the edges need their old bytes.
                if !a.is_multiple_of(SECTOR) {
                    self.ensure_valid(c, from, from + 1)?;
                }
                if !b.is_multiple_of(SECTOR) {
                    self.ensure_valid(c, to - 1, to)?;
                }
                let mut ch = lock(&self.chunks[c as usize]);
                let edges_ok = (a.is_multiple_of(SECTOR) || ch.valid.get(from))
                    && (b.is_multiple_of(SECTOR) || ch.valid.get(to - 1));
                if !edges_ok {
                    continue;
                }
                self.local.write_at(a, part)?;
                ch.valid.assign(from, to, true, n);
                ch.dirty.assign(from, to, true, n);
                ch.last_write = self.now();
                ch.last_use = ch.last_write;
                ch.wrote_end |= to == n;
                break;
            }
            lock(&self.changed).insert(c);
        }
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        if self.read_only || len == 0 {
            return Ok(());
        }
        self.check_range(offset, len as usize)?;
        for (c, a, b) in self.pieces(offset, len) {
            let (start, clen) = self.d.chunk_range(c);
            if a != start || b != start + clen {
                continue; // advisory: only whole chunks are dropped
            }
            let mut ch = lock(&self.chunks[c as usize]);
            self.local.discard(start, clen)?;
            ch.gen += 1;
            ch.valid = Bits::All;
            ch.dirty = Bits::None;
            ch.wrote_end = false;
            ch.pending = Some(None);
            drop(ch);
            lock(&self.changed).insert(c);
        }
        Ok(())
    }

    fn next_data(&self, offset: u64) -> io::Result<Option<u64>> {
        if offset >= self.d.size_bytes {
            return Ok(None);
        }
        // A chunk with an object may hold data anywhere; one without holds
        // only what the cache file holds (written or applied from deltas).
        let local = self.local.next_data(offset)?;
        for c in self.d.chunk_of(offset)..self.d.chunk_count() as u32 {
            let (start, len) = self.d.chunk_range(c);
            if lock(&self.chunks[c as usize]).object.is_some() {
                return Ok(Some(offset.max(start)));
            }
            if let Some(x) = local.filter(|&x| x < start + len) {
                return Ok(Some(x));
            }
        }
        Ok(None)
    }

    // ---- uploads ----------------------------------------------------

    /// Reads the whole chunk for an upload, clearing its dirty sectors;
    /// None if it changed under us (discarded, or evicted meanwhile).
    fn snapshot(&self, c: u32) -> io::Result<Option<Snapshot>> {
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

    fn new_id(&self) -> ObjId {
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

    /// A background upload of chunk `c` (queued by `background`).
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

    // ---- sync ---------------------------------------------------------

    /// Pauses new background uploads and waits for those in flight.
    fn quiesce(&self) -> QuiesceGuard<'_> {
        let mut up = lock(&self.up);
        up.paused += 1;
        while up.in_flight > 0 {
            up = self.up_cv.wait(up).unwrap_or_else(|p| p.into_inner());
        }
        QuiesceGuard { inner: self }
    }

    /// Makes every completed write durable in the store: one delta. With
    /// `manifest`, every chunk with bytes only in the log is uploaded
    /// first and a manifest follows.
    fn sync_inner(&self, manifest: bool) -> io::Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.check_failed()?;
        let mut st = lock(&self.sync);
        let _q = self.quiesce();
        let mut delta = Delta {
            seq: st.next_seq,
            epoch: self.epoch,
            ..Delta::default()
        };
        let mut taken: Vec<Taken> = Vec::new();
        let mut todo: BTreeSet<u32> = std::mem::take(&mut *lock(&self.changed));
        if manifest {
            todo.extend(lock(&self.logged).iter().copied());
        }
        self.upload_whole(&todo, manifest, &mut taken)?;
        for &c in &todo {
            if taken.iter().any(|t| t.chunk == c) {
                continue;
            }
            let n = self.sectors(c);
            let (start, _) = self.d.chunk_range(c);
            let mut ch = lock(&self.chunks[c as usize]);
            let pending = ch.pending.take();
            let runs = ch.dirty.runs(0, n, true);
            ch.dirty = Bits::None;
            let mut ranges = Vec::new();
            for &(a, b) in &runs {
                let mut data = vec![0u8; ((b - a) * SECTOR) as usize];
                self.local.read_at(start + a * SECTOR, &mut data)?;
                ranges.push(Range {
                    offset: start + a * SECTOR,
                    data,
                });
            }
            taken.push(Taken {
                chunk: c,
                gen: ch.gen,
                pending,
                runs,
                fresh: None,
            });
            delta.ranges.extend(ranges);
        }
        for t in &taken {
            if let Some(p) = t.pending {
                delta.refs.push(ChunkRef {
                    chunk: t.chunk,
                    object: p,
                });
            }
        }
        if delta.refs.is_empty() && delta.ranges.is_empty() && !manifest {
            return Ok(());
        }
        let body = delta.encode();
        let len = body.len() as u64;
        if let Err(e) = self.put_delta(delta.seq, body) {
            self.restore(&taken);
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
                    // Discarded since the snapshot: the plain path below
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
                runs: dirty.runs(0, self.sectors(c), true),
                fresh: Some((pending, id)),
            });
            jobs.push((c, id, body));
        }
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
        if let Some(e) = results.into_iter().find_map(Result::err) {
            self.restore(taken);
            return Err(err(e));
        }
        Ok(())
    }

    /// Puts back what a failed sync took.
    fn restore(&self, taken: &[Taken]) {
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

    fn write_manifest(&self, st: &mut SyncState, seq: u64) -> io::Result<()> {
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
        // Superseded by this manifest: older deltas and manifest, and the
        // chunk objects replaced up to it. Deleted after the next delta.
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
        Ok(())
    }

    /// An empty delta (after a manifest, so its garbage may go).
    fn sync_marker(&self) -> io::Result<()> {
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

    /// Deletes the objects nothing references any more.
    fn delete_ready(&self) {
        let doomed: Vec<String> = std::mem::take(&mut *lock(&self.garbage));
        if doomed.is_empty() {
            return;
        }
        let n = doomed.len() as u64;
        let store = self.store.clone();
        let r: Vec<object_store::Result<()>> = self.block(
            futures::stream::iter(doomed.into_iter().map(|name| {
                let store = store.clone();
                async move {
                    match store.delete(&ObjPath::from(name.as_str())).await {
                        Err(object_store::Error::NotFound { .. }) => Ok(()),
                        r => r,
                    }
                }
            }))
            .buffer_unordered(16)
            .collect(),
        );
        self.c.deletes.fetch_add(n, Ordering::Relaxed);
        if let Some(e) = r.into_iter().find_map(Result::err) {
            tracing::warn!("{}: deleting a superseded object: {e}", self.label);
        }
    }

    // ---- background ---------------------------------------------------

    /// Marks the lease released (best effort: an open that failed).
    fn release_lease(&self) {
        let r = self.block(put(
            &*self.store,
            &self.names.lease(self.epoch),
            RELEASED.to_vec(),
            false,
        ));
        if let Err(e) = r {
            tracing::warn!("{}: releasing the lease: {e}", self.label);
        }
    }

    /// Renews the lease every quarter of the lease time until stopped or
    /// failed (a fenced server stops renewing).
    fn renew_lease(&self) {
        let mut renewal = 0u64;
        let mut last = Instant::now();
        while !self.stop_lease.load(Ordering::SeqCst) && lock(&self.failed).is_none() {
            std::thread::sleep(Duration::from_millis(20));
            if last.elapsed() < self.lease / 4 {
                continue;
            }
            renewal += 1;
            let r = self.block(put(
                &*self.store,
                &self.names.lease(self.epoch),
                lease_body(self.epoch, renewal, self.lease),
                false,
            ));
            if let Err(e) = r {
                tracing::warn!("{}: renewing the lease: {e}", self.label);
            }
            last = Instant::now();
        }
    }

    fn background(&self, tx: &crossbeam_channel::Sender<u32>) {
        let mut last_evict = Instant::now();
        while !self.stop.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(50));
            if self.read_only {
                self.evict_if_needed(&mut last_evict);
                continue;
            }
            if lock(&self.failed).is_some() {
                continue;
            }
            self.queue_uploads(tx);
            if self.sync_due() {
                // Clients idle without a FLUSH: commit what waits (uploads,
                // discarded segments, so the store can delete them; dirty
                // bytes). A sync clients did not ask for is always allowed.
                if let Err(e) = self.sync_inner(false) {
                    tracing::warn!("{}: background sync: {e}", self.label);
                }
            }
            if self.manifest_due() {
                if let Err(e) = self.sync_inner(true) {
                    tracing::warn!("{}: writing a manifest: {e}", self.label);
                }
            }
            if self.garbage_waits() {
                // Nothing else lands a delta while clients are idle: an
                // empty one lets what the manifest superseded go.
                match self.sync_marker() {
                    Ok(()) => self.delete_ready(),
                    Err(e) => tracing::warn!("{}: {e}", self.label),
                }
            }
            self.evict_if_needed(&mut last_evict);
        }
    }

    /// Changes wait for a delta and none landed for a while.
    fn sync_due(&self) -> bool {
        let idle = lock(&self.sync).last_delta.elapsed() >= BACKGROUND_SYNC_AFTER;
        idle && !lock(&self.changed).is_empty()
    }

    /// Objects wait for a delta after the last manifest (a second on).
    fn garbage_waits(&self) -> bool {
        let st = lock(&self.sync);
        !st.after_next_delta.is_empty() && st.last_manifest.elapsed() >= Duration::from_secs(1)
    }

    fn manifest_due(&self) -> bool {
        let st = lock(&self.sync);
        let age = st.last_manifest.elapsed();
        st.log_bytes >= MANIFEST_LOG_BYTES
            || st.deltas >= MANIFEST_DELTAS
            || (!st.superseded.is_empty() && age >= MANIFEST_GARBAGE_AGE)
            || (st.deltas > 0 && age >= MANIFEST_AGE)
    }

    /// Queues uploads of chunks the engine filled or stopped writing.
    fn queue_uploads(&self, tx: &crossbeam_channel::Sender<u32>) {
        let now = self.now();
        let candidates: Vec<u32> = lock(&self.changed).iter().copied().collect();
        for c in candidates {
            let ready = {
                let ch = lock(&self.chunks[c as usize]);
                !ch.uploading
                    && !ch.dirty.is_empty()
                    && (ch.wrote_end
                        || now.saturating_sub(ch.last_write) >= IDLE_UPLOAD.as_millis() as u64)
            };
            if !ready {
                continue;
            }
            let mut up = lock(&self.up);
            if up.paused > 0 || up.in_flight >= self.parallel * 2 {
                continue;
            }
            let mut ch = lock(&self.chunks[c as usize]);
            if ch.uploading {
                continue;
            }
            ch.uploading = true;
            drop(ch);
            up.in_flight += 1;
            drop(up);
            if tx.send(c).is_err() {
                return;
            }
        }
    }

    /// Evicts clean chunks, least recently used first, while the cache
    /// file holds more than its budget.
    fn evict_if_needed(&self, last: &mut Instant) {
        if last.elapsed() < Duration::from_millis(500) {
            return;
        }
        *last = Instant::now();
        let Some(used) = self.local.allocated_bytes() else {
            return;
        };
        if used <= self.cache_bytes {
            return;
        }
        let target = self.cache_bytes / 10 * 9;
        let mut cands: Vec<(u64, u32)> = (0..self.chunks.len())
            .filter_map(|c| {
                let ch = lock(&self.chunks[c]);
                ch.evictable().then_some((ch.last_use, c as u32))
            })
            .collect();
        cands.sort_unstable();
        let mut used = used;
        for (_, c) in cands {
            if used <= target {
                break;
            }
            let (start, len) = self.d.chunk_range(c);
            let mut ch = lock(&self.chunks[c as usize]);
            if !ch.evictable() {
                continue;
            }
            let held = ch.valid.count(len / SECTOR) * SECTOR;
            if self.local.discard(start, len).is_err() {
                continue;
            }
            ch.valid = Bits::None;
            used = used.saturating_sub(held);
            self.c.evictions.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn stats(&self) -> ObjectStats {
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

/// A chunk's bytes read for an upload, and its state at that moment.
struct Snapshot {
    body: Vec<u8>,
    gen: u64,
    /// The dirty sectors the snapshot cleared.
    dirty: Bits,
    /// The pending change the upload replaces.
    pending: Option<Option<ObjId>>,
}

/// What a sync took from one chunk (to commit or put back).
struct Taken {
    chunk: u32,
    gen: u64,
    pending: Option<Option<ObjId>>,
    runs: Vec<(u64, u64)>,
    /// Uploaded for a manifest: the pending change it replaced, and its object.
    fresh: Option<(Option<Option<ObjId>>, ObjId)>,
}

struct QuiesceGuard<'a> {
    inner: &'a Inner,
}

impl Drop for QuiesceGuard<'_> {
    fn drop(&mut self) {
        lock(&self.inner.up).paused -= 1;
        self.inner.up_cv.notify_all();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_body_names_its_lease_time() {
        let b = lease_body(3, 7, Duration::from_millis(2500));
        assert_eq!(lease_of(&b), Some(Duration::from_millis(2500)));
        assert_eq!(lease_of(RELEASED), None);
        assert_eq!(lease_of(b"serving epoch=1 lease_ms=x"), None);
    }

    #[test]
    fn cache_file_names_keep_only_safe_characters() {
        assert_eq!(cache_name("s3://bkt/a/b c"), "bkt_a_b_c");
    }
}
