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
/// writers), counting those waiting.
#[derive(Debug, Default)]
struct Gate {
    open: AtomicBool,
    waiting: AtomicUsize,
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

/// With every chunk PUT held by a slow store, the background takes no
/// more chunks for upload than the workers run plus the queue holds: the
/// rest wait (dirty, in the cache file) instead of piling up in the queue.
/// Once the store answers, a FLUSH commits everything.
#[test]
fn a_slow_store_holds_uploads_to_the_queue_bound() {
    const MIB: u64 = 1 << 20;
    let gate = Arc::new(Gate::default());
    let store = Arc::new(SlowStore {
        inner: InMemory::new(),
        gate: gate.clone(),
    });
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut cfg = Config::new(store, "vols/slow", dir.path().to_path_buf());
    cfg.uploads = 2;
    let d = Descriptor {
        size_bytes: 24 * MIB,
        head_bytes: MIB,
        chunk_bytes: MIB,
    };
    create(&cfg, &d, false).expect("create");
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
