//! Unit tests of the store's rooms: lease bodies, cache file names, and
//! the upload queue's bound under a slow store.
use super::cache::cache_name;
use super::lease::{lease_body, lease_of, RELEASED};
use super::state::lock;
use super::*;
use async_trait::async_trait;
use futures::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::path::Path as ObjPath;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::time::{Duration, Instant};

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

/// A store whose chunk PUTs wait until `open` (a store slower than the
/// writers), counting those waiting, or fail while `fail`.
#[derive(Debug, Default)]
struct Gate {
    open: AtomicBool,
    waiting: AtomicUsize,
    fail: AtomicBool,
}

#[derive(Debug)]
struct SlowStore {
    inner: InMemory,
    gate: Arc<Gate>,
}

impl std::fmt::Display for SlowStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SlowStore")
    }
}

#[async_trait]
impl ObjectStore for SlowStore {
    async fn put_opts(
        &self,
        location: &ObjPath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        if location.as_ref().contains("/chunk/") && self.gate.fail.load(Ordering::SeqCst) {
            return Err(object_store::Error::Generic {
                store: "SlowStore",
                source: "injected chunk PUT failure".into(),
            });
        }
        if location.as_ref().contains("/chunk/") {
            self.gate.waiting.fetch_add(1, Ordering::SeqCst);
            while !self.gate.open.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            self.gate.waiting.fetch_sub(1, Ordering::SeqCst);
        }
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &ObjPath,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &ObjPath,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &ObjPath,
        ranges: &[std::ops::Range<u64>],
    ) -> object_store::Result<Vec<bytes::Bytes>> {
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<ObjPath>>,
    ) -> BoxStream<'static, object_store::Result<ObjPath>> {
        self.inner.delete_stream(locations)
    }

    fn list(
        &self,
        prefix: Option<&ObjPath>,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&ObjPath>,
    ) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &ObjPath,
        to: &ObjPath,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

/// Waits (up to a minute) for `what` to hold.
fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < Duration::from_secs(60), "never: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

const MIB: u64 = 1 << 20;

/// A store in front of `gate`, a volume of 24 chunks of 1 MiB on it, and
/// its config (`uploads` workers).
fn gated_volume(gate: &Arc<Gate>, dir: &std::path::Path, uploads: usize) -> (Config, Descriptor) {
    let store = Arc::new(SlowStore {
        inner: InMemory::new(),
        gate: gate.clone(),
    });
    let mut cfg = Config::new(store, "vols/slow", dir.to_path_buf());
    cfg.uploads = uploads;
    let d = Descriptor {
        size_bytes: 24 * MIB,
        head_bytes: MIB,
        chunk_bytes: MIB,
    };
    create(&cfg, &d, false).expect("create");
    (cfg, d)
}

/// With every chunk PUT held by a slow store, the background takes no
/// more chunks for upload than the workers run plus the queue holds: the
/// rest wait (dirty, in the cache file) instead of piling up in the queue.
/// Once the store answers, a FLUSH commits everything.
#[test]
fn a_slow_store_holds_uploads_to_the_queue_bound() {
    let gate = Arc::new(Gate::default());
    let dir = tempfile::tempdir().expect("temporary directory");
    let (cfg, d) = gated_volume(&gate, dir.path(), 2);
    let st = ObjectStorage::open(&cfg).expect("open");
    let inner = &st.inner;
    let filled: Vec<u32> = (1..17).collect();
    for &c in &filled {
        let (start, len) = d.chunk_range(c);
        // Written to its end: ready for upload at once.
        st.write_at(start, &vec![c as u8; len as usize])
            .expect("write");
    }
    let (parallel, bound) = (cfg.uploads, inner.queue.capacity().expect("bounded"));
    assert_eq!(bound, parallel, "the queue holds as many as run at once");
    wait_for("every worker holds a PUT and the queue is full", || {
        gate.waiting.load(Ordering::SeqCst) == parallel && inner.queue.len() == bound
    });
    for _ in 0..100 {
        let taken = filled
            .iter()
            .filter(|&&c| lock(&inner.chunks[c as usize]).uploading)
            .count();
        assert!(inner.queue.len() <= bound);
        assert!(gate.waiting.load(Ordering::SeqCst) <= parallel);
        assert!(lock(&inner.up).in_flight <= parallel + bound);
        assert!(taken <= parallel + bound, "{taken} chunks taken for upload");
        std::thread::sleep(Duration::from_millis(2));
    }
    let waiting = filled
        .iter()
        .filter(|&&c| !lock(&inner.chunks[c as usize]).dirty.is_empty())
        .count();
    assert!(waiting >= filled.len() - parallel, "{waiting} chunks dirty");
    gate.open.store(true, Ordering::SeqCst);
    st.sync().expect("flush");
    for &c in &filled {
        let ch = lock(&inner.chunks[c as usize]);
        assert!(ch.dirty.is_empty() && ch.object.is_some(), "chunk {c}");
    }
    st.close().expect("close");
    // The cache file is locked until its storage is gone.
    drop(st);
    let st = ObjectStorage::open(&cfg).expect("reopen");
    for &c in &filled {
        let (start, len) = d.chunk_range(c);
        let mut buf = vec![0u8; len as usize];
        st.read_at(start, &mut buf).expect("read");
        assert!(buf.iter().all(|&b| b == c as u8), "chunk {c} reads back");
    }
    st.close().expect("close");
}

/// A FLUSH whose whole-chunk upload fails keeps every change it had not
/// taken yet for the next one (a small write in another chunk was once
/// dropped from the set of changed chunks, so the next FLUSH succeeded
/// without it and it was lost at the next open).
#[test]
fn a_failed_flush_leaves_every_change_to_the_next() {
    let gate = Arc::new(Gate {
        open: AtomicBool::new(true),
        ..Gate::default()
    });
    let dir = tempfile::tempdir().expect("temporary directory");
    let (cfg, d) = gated_volume(&gate, dir.path(), 2);
    let st = ObjectStorage::open(&cfg).expect("open");
    gate.fail.store(true, Ordering::SeqCst);
    let (whole, _) = d.chunk_range(3);
    st.write_at(whole, &vec![3u8; MIB as usize]).expect("write");
    let (small, _) = d.chunk_range(5);
    st.write_at(small + 4096, &[5u8; 4096]).expect("write");
    st.sync().expect_err("the whole chunk's PUT fails");
    gate.fail.store(false, Ordering::SeqCst);
    st.sync().expect("flush");
    st.close().expect("close");
    drop(st);
    let st = ObjectStorage::open(&cfg).expect("reopen");
    let mut buf = vec![0u8; 4096];
    st.read_at(small + 4096, &mut buf).expect("read");
    assert!(buf.iter().all(|&b| b == 5), "the small write survives");
    st.read_at(whole, &mut buf).expect("read");
    assert!(buf.iter().all(|&b| b == 3), "the whole chunk survives");
    st.close().expect("close");
}

/// `release` (an open the engine refused, e.g. for a wrong key) marks the
/// lease released, so the next server claims at once, and commits nothing:
/// no manifest and no delta beyond the claim's fencing one.
#[test]
fn release_gives_the_lease_up_and_commits_nothing() {
    let mem = Arc::new(InMemory::new());
    let dir = tempfile::tempdir().expect("temporary directory");
    let cfg = Config::new(mem.clone(), "vols/released", dir.path().to_path_buf());
    let d = Descriptor {
        size_bytes: 8 * MIB,
        head_bytes: MIB,
        chunk_bytes: MIB,
    };
    create(&cfg, &d, false).expect("create");
    let names = Names::new("vols/released");
    let rt = objects::runtime().expect("runtime");
    let listed = |kind: &str| {
        let mut v: Vec<String> = rt
            .block_on(objects::list(&*mem, &names.dir(kind)))
            .expect("list")
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        v.sort();
        v
    };
    let st = ObjectStorage::open(&cfg).expect("open");
    let (manifests, deltas) = (listed("manifest"), listed("log"));
    st.write_at(2 * MIB, &[7u8; 4096])
        .expect("an unsynced write");
    st.release();
    let lease = rt
        .block_on(objects::get(&*mem, &names.lease(st.epoch())))
        .expect("the lease object");
    assert_eq!(&lease[..], RELEASED);
    assert_eq!(listed("manifest"), manifests, "release wrote a manifest");
    assert_eq!(listed("log"), deltas, "release wrote a delta");
    drop(st);
    let st = ObjectStorage::open(&cfg).expect("the next open");
    let mut buf = [1u8; 4096];
    st.read_at(2 * MIB, &mut buf).expect("read");
    assert_eq!(
        buf, [0u8; 4096],
        "the unsynced write is gone, as after a crash"
    );
    st.close().expect("close");
}
