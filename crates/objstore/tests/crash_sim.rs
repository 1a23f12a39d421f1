//! The object-store backend under failures, with the engine on top:
//! PUTs and GETs that fail, PUTs that land but report failure (the reply
//! was lost), and crashes (the store stops answering the old server at
//! once; its in-flight PUTs are lost). The promise checked exactly: after
//! a crash and a recovery from the objects alone (a fresh cache
//! directory), every block reads back as the version it had at the last
//! completed flush, or as a version written after it; never older, never
//! zeros. And single-writer fencing: a server paused past its lease is
//! taken over; once it resumes, its flushes fail and its writes never
//! reach the volume.
//!
//! Seeds: `CVOL_OBJ_SEEDS` (default 12), or one `CVOL_OBJ_SEED`.
use async_trait::async_trait;
use cvol_engine::{CreateOptions, OpenOptions, Volume};
use cvol_objstore::{Config, Descriptor, Error, ObjectStorage};
use futures::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const BS: u64 = 4096;
const MIB: u64 = 1 << 20;
const BLOCKS: u64 = 2048;

/// Faults one server's view of the store sees.
#[derive(Debug, Default)]
struct Faults {
    /// Per mille: PUT fails and is not stored; PUT is stored but fails;
    /// GET fails.
    put_fail: AtomicU64,
    put_lost_reply: AtomicU64,
    get_fail: AtomicU64,
    /// Crashed: nothing reaches the store any more.
    dead: AtomicBool,
    /// Paused: every request waits (a server stopped by SIGSTOP).
    paused: AtomicBool,
    /// Milliseconds each chunk PUT takes (a slow store).
    chunk_put_ms: AtomicU64,
    rng: Mutex<Option<rand::rngs::StdRng>>,
}

impl Faults {
    fn roll(&self, per_mille: &AtomicU64) -> bool {
        let p = per_mille.load(Ordering::Relaxed);
        p > 0
            && lock(&self.rng)
                .as_mut()
                .is_some_and(|r| r.gen_range(0..1000) < p)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug)]
struct FaultStore {
    inner: Arc<InMemory>,
    f: Arc<Faults>,
}

impl std::fmt::Display for FaultStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FaultStore")
    }
}

fn injected(what: &str) -> object_store::Error {
    object_store::Error::Generic {
        store: "FaultStore",
        source: format!("injected {what}").into(),
    }
}

impl FaultStore {
    async fn gate(&self) -> object_store::Result<()> {
        while self.f.paused.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if self.f.dead.load(Ordering::SeqCst) {
            return Err(injected("crash"));
        }
        Ok(())
    }
}

#[async_trait]
impl ObjectStore for FaultStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.gate().await?;
        let delay = self.f.chunk_put_ms.load(Ordering::Relaxed);
        if delay > 0 && location.as_ref().contains("/chunk/") {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if self.f.roll(&self.f.put_fail) {
            return Err(injected("PUT failure"));
        }
        let r = self.inner.put_opts(location, payload, opts).await;
        if r.is_ok() && self.f.roll(&self.f.put_lost_reply) {
            return Err(injected("lost PUT reply"));
        }
        r
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.gate().await?;
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.gate().await?;
        if self.f.roll(&self.f.get_fail) {
            return Err(injected("GET failure"));
        }
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[std::ops::Range<u64>],
    ) -> object_store::Result<Vec<bytes::Bytes>> {
        self.gate().await?;
        if self.f.roll(&self.f.get_fail) {
            return Err(injected("GET failure"));
        }
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        if self.f.dead.load(Ordering::SeqCst) {
            return Box::pin(futures::stream::once(async { Err(injected("crash")) }));
        }
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        if self.f.dead.load(Ordering::SeqCst) {
            return Box::pin(futures::stream::once(async { Err(injected("crash")) }));
        }
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.gate().await?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.gate().await?;
        self.inner.copy_opts(from, to, options).await
    }
}

/// A server's view of `mem`, with its own faults.
fn view(mem: &Arc<InMemory>) -> (Arc<dyn ObjectStore>, Arc<Faults>) {
    let f = Arc::new(Faults::default());
    (
        Arc::new(FaultStore {
            inner: mem.clone(),
            f: f.clone(),
        }),
        f,
    )
}

fn config(store: Arc<dyn ObjectStore>, dir: &std::path::Path) -> Config {
    let mut c = Config::new(store, "vols/sim", dir.to_path_buf());
    c.lease = Duration::from_millis(200);
    c.uploads = 3;
    // Small enough that reads evict and refetch.
    c.cache_bytes = 6 * MIB;
    c
}

fn new_volume(mem: &Arc<InMemory>, dir: &std::path::Path) {
    let (store, _) = view(mem);
    let cfg = config(store, dir);
    let d = Descriptor {
        size_bytes: 24 * MIB,
        head_bytes: MIB,
        chunk_bytes: MIB,
    };
    cvol_objstore::create(&cfg, &d, false).expect("create the objects");
    let st = Arc::new(ObjectStorage::open(&cfg).expect("open for create"));
    let opts = CreateOptions::new(BLOCKS * BS, d.size_bytes).with_segment_size(MIB);
    let vol = Volume::create(st.clone(), &opts).expect("engine create");
    vol.close().expect("engine close");
    drop(vol);
    st.close().expect("storage close");
}

fn block(lba: u64, v: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(BS as usize);
    b.extend_from_slice(&lba.to_le_bytes());
    b.extend_from_slice(&v.to_le_bytes());
    while b.len() < BS as usize {
        b.push(((b.len() as u64 * (v + 3)) % 251) as u8);
    }
    b
}

/// Versions each block may read back as.
#[derive(Default)]
struct Oracle {
    flushed: HashMap<u64, u64>,
    since: HashMap<u64, Vec<u64>>,
}

impl Oracle {
    fn check(&self, vol: &Volume, seed: u64, round: u64) {
        for lba in 0..BLOCKS {
            let mut got = vec![0u8; BS as usize];
            vol.read_at(lba * BS, &mut got)
                .expect("read after recovery");
            let v = u64::from_le_bytes(got[8..16].try_into().expect("8"));
            let is_zero = got.iter().all(|&b| b == 0);
            let ok_versions: Vec<u64> = self
                .flushed
                .get(&lba)
                .into_iter()
                .chain(self.since.get(&lba).into_iter().flatten())
                .copied()
                .collect();
            let ok = if is_zero {
                !self.flushed.contains_key(&lba)
            } else {
                u64::from_le_bytes(got[..8].try_into().expect("8")) == lba
                    && ok_versions.contains(&v)
                    && got == block(lba, v)
            };
            assert!(
                ok,
                "seed {seed} round {round}: block {lba} reads as {} (flushed {:?}, written since {:?})",
                if is_zero { "zeros".to_string() } else { format!("version {v}") },
                self.flushed.get(&lba),
                self.since.get(&lba)
            );
        }
    }

    /// After a verified recovery, what each block holds now is flushed.
    fn settle(&mut self, vol: &Volume) {
        self.since.clear();
        self.flushed.clear();
        for lba in 0..BLOCKS {
            let mut got = vec![0u8; BS as usize];
            vol.read_at(lba * BS, &mut got).expect("read");
            if got.iter().any(|&b| b != 0) {
                self.flushed
                    .insert(lba, u64::from_le_bytes(got[8..16].try_into().expect("8")));
            }
        }
    }
}

fn open_volume(st: &Arc<ObjectStorage>) -> Volume {
    let opts = OpenOptions {
        map_cache_bytes: Some(64 << 10),
        ..OpenOptions::default()
    };
    Volume::open(st.clone(), opts).expect("engine open")
}

fn run_seed(seed: u64) {
    let mem = Arc::new(InMemory::new());
    let tmp = tempfile::tempdir().expect("tempdir");
    new_volume(&mem, &tmp.path().join("c0"));
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut oracle = Oracle::default();
    let mut v = 0u64;
    for round in 0..4 {
        let (store, faults) = view(&mem);
        let cfg = config(store, &tmp.path().join(format!("c{seed}-{round}")));
        let st = Arc::new(ObjectStorage::open(&cfg).expect("open"));
        let vol = open_volume(&st);
        *lock(&faults.rng) = Some(rand::rngs::StdRng::seed_from_u64(seed * 31 + round));
        faults
            .put_fail
            .store(rng.gen_range(0..20), Ordering::SeqCst);
        faults
            .put_lost_reply
            .store(rng.gen_range(0..20), Ordering::SeqCst);
        faults
            .get_fail
            .store(rng.gen_range(0..10), Ordering::SeqCst);
        // Some rounds on a slow store: syncs overlap uploads.
        faults
            .chunk_put_ms
            .store([0, 0, 2, 10][rng.gen_range(0..4)], Ordering::SeqCst);
        let ops = rng.gen_range(200..1500);
        for _ in 0..ops {
            let at = rng.gen_range(0..BLOCKS / 8) * 8;
            let n = rng.gen_range(1..=8u64);
            v += 1;
            let data: Vec<u8> = (at..at + n).flat_map(|l| block(l, v)).collect();
            if vol.write_at(at * BS, &data, false).is_err() {
                break;
            }
            for l in at..at + n {
                oracle.since.entry(l).or_default().push(v);
            }
            if rng.gen_range(0..20) == 0 {
                if vol.flush().is_err() {
                    break;
                }
                for (l, vs) in oracle.since.drain() {
                    oracle.flushed.insert(l, *vs.last().expect("a version"));
                }
            }
            if rng.gen_range(0..300) == 0 {
                // Let background uploads and manifests run.
                std::thread::sleep(Duration::from_millis(rng.gen_range(1..400)));
            }
        }
        // Crash: the store hears nothing more from this server.
        faults.dead.store(true, Ordering::SeqCst);
        drop(vol);
        drop(st);
        // Recover from the objects alone, with a fresh cache directory.
        let (store, _) = view(&mem);
        let cfg = config(store, &tmp.path().join(format!("r{seed}-{round}")));
        let st = Arc::new(
            ObjectStorage::open(&cfg).unwrap_or_else(|e| panic!("seed {seed} round {round}: {e}")),
        );
        let vol = open_volume(&st);
        oracle.check(&vol, seed, round);
        oracle.settle(&vol);
        vol.close().expect("close");
        drop(vol);
        st.close().expect("close storage");
    }
}

fn seeds() -> Vec<u64> {
    if let Ok(s) = std::env::var("CVOL_OBJ_SEED") {
        return vec![s.parse().expect("CVOL_OBJ_SEED is a number")];
    }
    let n = std::env::var("CVOL_OBJ_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    (1..=n).collect()
}

#[test]
fn flushed_data_survives_store_faults_and_crashes() {
    for seed in seeds() {
        run_seed(seed);
    }
}

/// Server A on a view of its own (to pause it), having written and
/// flushed version 1 of blocks 0-63.
fn a_flushes_version_1(
    mem: &Arc<InMemory>,
    dir: &std::path::Path,
) -> (Volume, Arc<ObjectStorage>, Arc<Faults>) {
    let (store_a, faults_a) = view(mem);
    let st_a = Arc::new(ObjectStorage::open(&config(store_a, &dir.join("a"))).expect("open A"));
    let vol_a = open_volume(&st_a);
    for lba in 0..64 {
        vol_a
            .write_at(lba * BS, &block(lba, 1), false)
            .expect("A writes");
    }
    vol_a.flush().expect("A flushes");
    (vol_a, st_a, faults_a)
}

/// A third server C recovers the volume after B took it over: B's
/// version 2 in blocks 0-31, A's version 1 in 32-63.
fn c_reads_b_over_a(mem: &Arc<InMemory>, dir: &std::path::Path) {
    let (store_c, _) = view(mem);
    let st_c = Arc::new(ObjectStorage::open(&config(store_c, &dir.join("c"))).expect("open C"));
    let vol_c = open_volume(&st_c);
    for lba in 0..64 {
        let mut got = vec![0u8; BS as usize];
        vol_c.read_at(lba * BS, &mut got).expect("read");
        let want = if lba < 32 { 2 } else { 1 };
        assert_eq!(got, block(lba, want), "block {lba}");
    }
    vol_c.close().expect("close");
    drop(vol_c);
    st_c.close().expect("close");
}

#[test]
fn a_paused_server_is_taken_over_and_fenced() {
    let mem = Arc::new(InMemory::new());
    let tmp = tempfile::tempdir().expect("tempdir");
    new_volume(&mem, &tmp.path().join("c0"));
    let (vol_a, st_a, faults_a) = a_flushes_version_1(&mem, tmp.path());
    // While A serves, B is refused.
    let (store_b, _) = view(&mem);
    let err = ObjectStorage::open(&config(store_b.clone(), &tmp.path().join("b")))
        .err()
        .expect("B refused while A renews its lease");
    assert!(matches!(err, Error::Served { .. }), "{err}");
    let err = err.to_string();
    assert!(err.contains("being served by another server"), "{err}");
    // A stops (SIGSTOP): its lease lapses and B takes over.
    faults_a.paused.store(true, Ordering::SeqCst);
    let st_b = Arc::new(
        ObjectStorage::open(&config(store_b, &tmp.path().join("b2"))).expect("B takes over"),
    );
    assert!(st_b.epoch() > st_a.epoch());
    let vol_b = open_volume(&st_b);
    for lba in 0..32 {
        vol_b
            .write_at(lba * BS, &block(lba, 2), false)
            .expect("B writes");
    }
    vol_b.flush().expect("B flushes");
    // A resumes: its writes and flush must not reach the volume.
    faults_a.paused.store(false, Ordering::SeqCst);
    for lba in 0..64 {
        let _ = vol_a.write_at(lba * BS, &block(lba, 3), false);
    }
    assert!(vol_a.flush().is_err(), "a fenced server's flush fails");
    assert!(
        st_a.failure().is_some_and(|f| f.contains("fenced")),
        "{:?}",
        st_a.failure()
    );
    drop(vol_a);
    drop(st_a);
    vol_b.close().expect("B closes");
    drop(vol_b);
    st_b.close().expect("B's storage closes");
    c_reads_b_over_a(&mem, tmp.path());
}

/// Regression: an upload that replaced a pending (uploaded, not yet
/// committed) object queued the old one for deletion under the sync
/// lock, while a sync held that lock waiting for uploads in flight: a
/// deadlock. Whole chunks written over and over (each write ends the
/// chunk, so each is uploaded at once) while another thread syncs.
#[test]
fn regression_uploads_replacing_pending_objects_do_not_deadlock_a_sync() {
    let mem = Arc::new(InMemory::new());
    let tmp = tempfile::tempdir().expect("tempdir");
    let (store, faults) = view(&mem);
    // Uploads slow enough that syncs begin while they are in flight.
    faults.chunk_put_ms.store(30, Ordering::SeqCst);
    let cfg = config(store, &tmp.path().join("c"));
    let d = Descriptor {
        size_bytes: 8 * MIB,
        head_bytes: MIB,
        chunk_bytes: MIB,
    };
    cvol_objstore::create(&cfg, &d, false).expect("create");
    let st = Arc::new(ObjectStorage::open(&cfg).expect("open"));
    let stop = Arc::new(AtomicBool::new(false));
    let syncer = {
        let (st, stop) = (st.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                cvol_storage::Storage::sync(&*st).expect("sync");
                n += 1;
                // Slower than uploads: a chunk is uploaded twice between syncs.
                std::thread::sleep(Duration::from_millis(40 + n % 5 * 20));
            }
            n
        })
    };
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let writer = {
        let st = st.clone();
        std::thread::spawn(move || {
            let start = std::time::Instant::now();
            let mut v = 0u8;
            while start.elapsed() < Duration::from_secs(2) {
                v = v.wrapping_add(1);
                for c in 1..4u64 {
                    cvol_storage::Storage::write_at(&*st, c * MIB, &vec![v; MIB as usize])
                        .expect("write");
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            let _ = done_tx.send(());
        })
    };
    done_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the writer finishes: no deadlock");
    writer.join().expect("writer");
    stop.store(true, Ordering::SeqCst);
    let syncs = syncer.join().expect("syncer");
    assert!(syncs > 0);
    st.close().expect("close");
    // What the last sync made durable reads back.
    let (store, _) = view(&mem);
    let st2 = ObjectStorage::open(&config(store, &tmp.path().join("d"))).expect("reopen");
    let mut a = vec![0u8; MIB as usize];
    let mut b = vec![0u8; MIB as usize];
    cvol_storage::Storage::read_at(&st2, MIB, &mut a).expect("read");
    cvol_storage::Storage::read_at(&st2, 3 * MIB, &mut b).expect("read");
    assert!(a.iter().all(|&x| x == a[0]) && a[0] != 0);
    assert_eq!(a, b, "the close synced every chunk's last version");
    st2.close().expect("close");
}

/// Regression (found in review while scripts/e2e/s3.sh's `stale` step was
/// written): the fence delta was deleted with the other deltas a manifest
/// superseded, which freed the one name a stale server writes next: once
/// resumed, its flush "succeeded" into a deleted slot behind the newest
/// manifest (ignored by recovery: acknowledged and lost), and its later
/// deletions could remove objects the new server uses. Fence deltas are
/// kept forever now.
#[test]
fn regression_a_stale_server_stays_fenced_after_a_manifest() {
    let mem = Arc::new(InMemory::new());
    let tmp = tempfile::tempdir().expect("tempdir");
    new_volume(&mem, &tmp.path().join("c0"));
    let (vol_a, st_a, faults_a) = a_flushes_version_1(&mem, tmp.path());
    faults_a.paused.store(true, Ordering::SeqCst);
    let (store_b, _) = view(&mem);
    let st_b = Arc::new(
        ObjectStorage::open(&config(store_b, &tmp.path().join("b"))).expect("B takes over"),
    );
    let vol_b = open_volume(&st_b);
    // Enough flushes for a manifest (every 512 deltas; a new version each
    // time, as the same bytes would dedup into no delta at all), then time
    // for the empty delta after it that lets the superseded deltas go.
    for i in 0..600u64 {
        let lba = i % 32;
        vol_b
            .write_at(lba * BS, &block(lba, 100 + i), false)
            .expect("B writes");
        vol_b.flush().expect("B flushes");
    }
    for lba in 0..32 {
        vol_b
            .write_at(lba * BS, &block(lba, 2), false)
            .expect("B writes");
    }
    vol_b.flush().expect("B flushes");
    std::thread::sleep(Duration::from_millis(2500));
    faults_a.paused.store(false, Ordering::SeqCst);
    for lba in 0..64 {
        let _ = vol_a.write_at(lba * BS, &block(lba, 3), false);
    }
    assert!(
        vol_a.flush().is_err(),
        "a stale server's flush fails even once its fence is behind a manifest"
    );
    drop(vol_a);
    drop(st_a);
    vol_b.close().expect("B closes");
    drop(vol_b);
    st_b.close().expect("B's storage closes");
    c_reads_b_over_a(&mem, tmp.path());
}

/// Regression (found by scripts/bench/s3: every reopen of a volume with
/// an empty cache warned "damaged checkpoint records stepped over"):
/// `next_data` answered "nothing but zeros from here" as soon as the
/// local cache file had no data left, though later chunks had objects,
/// and jumped over chunks with objects to the cache file's next data;
/// the engine's log scan then skipped those segments.
#[test]
fn regression_next_data_finds_chunks_only_in_the_store() {
    use cvol_storage::Storage;
    let mem = Arc::new(InMemory::new());
    let tmp = tempfile::tempdir().expect("tempdir");
    let (store, _) = view(&mem);
    let d = Descriptor {
        size_bytes: 9 * MIB,
        head_bytes: MIB,
        chunk_bytes: MIB,
    };
    let cfg = config(store.clone(), &tmp.path().join("a"));
    cvol_objstore::create(&cfg, &d, false).expect("create");
    let st = ObjectStorage::open(&cfg).expect("open");
    // Chunks 2 and 6 (bytes 2-3 MiB and 6-7 MiB) hold data; the rest is zeros.
    st.write_at(2 * MIB + 4096, &[7u8; 4096]).expect("write");
    st.write_at(6 * MIB, &[9u8; 512]).expect("write");
    st.sync().expect("sync");
    st.close().expect("close");
    // Reopened with an empty cache: the data is only in the store.
    let st = ObjectStorage::open(&config(store.clone(), &tmp.path().join("b"))).expect("reopen");
    assert_eq!(st.next_data(MIB).expect("next_data"), Some(2 * MIB));
    assert_eq!(st.next_data(3 * MIB).expect("next_data"), Some(6 * MIB));
    assert_eq!(st.next_data(7 * MIB).expect("next_data"), None);
    // Then written locally in chunk 4 (not uploaded yet): found too.
    st.write_at(4 * MIB + 512, &[1u8; 512]).expect("write");
    assert_eq!(st.next_data(3 * MIB).expect("next_data"), Some(4 * MIB));
    st.close().expect("close");
}
