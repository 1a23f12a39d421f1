//! Single-writer fencing rests on create-only PUTs (S3's `If-None-Match:
//! *`). A store that does not honour them is found by a probe at create
//! and at a writable open, and refused unless `unsafe_no_fencing`; with
//! it, such a store still works for one writer.
use async_trait::async_trait;
use cvol_engine::{CreateOptions, OpenOptions, Volume};
use cvol_objstore::format::Names;
use cvol_objstore::store::{probe_create_only, CreateOnly};
use cvol_objstore::{Config, Descriptor, Error, ObjectStorage};
use futures::stream::BoxStream;
use futures::TryStreamExt;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMode, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use std::sync::Arc;

const MIB: u64 = 1 << 20;

/// What a store without conditional PUTs does with a create-only one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flaw {
    /// Ignores the condition: the PUT overwrites (as a store that drops
    /// `If-None-Match` does).
    Ignores,
    /// Rejects it: "not implemented".
    Rejects,
}

#[derive(Debug)]
struct FlawedStore {
    inner: Arc<InMemory>,
    flaw: Flaw,
}

impl std::fmt::Display for FlawedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FlawedStore({:?})", self.flaw)
    }
}

#[async_trait]
impl ObjectStore for FlawedStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        mut opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        if matches!(opts.mode, PutMode::Create) {
            match self.flaw {
                Flaw::Ignores => opts.mode = PutMode::Overwrite,
                Flaw::Rejects => {
                    return Err(object_store::Error::NotImplemented {
                        operation: "put_opts with PutMode::Create".into(),
                        implementer: self.to_string(),
                    })
                }
            }
        }
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[std::ops::Range<u64>],
    ) -> object_store::Result<Vec<bytes::Bytes>> {
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

fn flawed(mem: &Arc<InMemory>, flaw: Flaw) -> Arc<dyn ObjectStore> {
    Arc::new(FlawedStore {
        inner: mem.clone(),
        flaw,
    })
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn objects(store: &dyn ObjectStore) -> Vec<String> {
    rt().block_on(async {
        store
            .list(None)
            .map_ok(|m| m.location.to_string())
            .try_collect()
            .await
            .expect("list")
    })
}

fn probe(store: &dyn ObjectStore) -> CreateOnly {
    rt().block_on(probe_create_only(store, &Names::new("vols/p")))
        .expect("the probe reaches the store")
}

const DESCRIPTOR: Descriptor = Descriptor {
    size_bytes: 8 * MIB,
    head_bytes: MIB,
    chunk_bytes: MIB,
};

fn config(store: Arc<dyn ObjectStore>, dir: &std::path::Path) -> Config {
    let mut c = Config::new(store, "vols/p", dir.to_path_buf());
    c.lease = std::time::Duration::from_millis(100);
    c
}

/// A whole volume's life on `store`: create, format, write, close, open
/// again and read back.
fn create_write_reopen(cfg: &Config) -> Result<(), String> {
    cvol_objstore::create(cfg, &DESCRIPTOR, false)?;
    let st = Arc::new(ObjectStorage::open(cfg)?);
    let opts = CreateOptions::new(4 * MIB, DESCRIPTOR.size_bytes).with_segment_size(MIB);
    let vol = Volume::create(st.clone(), &opts).map_err(|e| e.to_string())?;
    vol.write_at(4096, &[7u8; 4096], false)
        .map_err(|e| e.to_string())?;
    vol.close().map_err(|e| e.to_string())?;
    drop(vol);
    st.close()?;
    // The cache file is locked until its storage is gone.
    drop(st);
    let st = Arc::new(ObjectStorage::open(cfg)?);
    let vol = Volume::open(st.clone(), OpenOptions::default()).map_err(|e| e.to_string())?;
    let mut got = vec![0u8; 4096];
    vol.read_at(4096, &mut got).map_err(|e| e.to_string())?;
    assert_eq!(got, vec![7u8; 4096]);
    vol.close().map_err(|e| e.to_string())?;
    drop(vol);
    Ok(st.close()?)
}

#[test]
fn the_in_memory_store_honours_create_only_puts_and_the_probe_leaves_nothing() {
    let mem = Arc::new(InMemory::new());
    assert_eq!(probe(&*mem), CreateOnly::Honoured);
    assert_eq!(objects(&*mem), Vec::<String>::new(), "the probe is deleted");
    let dir = tempfile::tempdir().expect("tempdir");
    create_write_reopen(&config(mem.clone(), dir.path())).expect("a fenced volume works");
}

#[test]
fn the_probe_tells_a_store_that_ignores_or_rejects_create_only_puts() {
    let mem = Arc::new(InMemory::new());
    match probe(&*flawed(&mem, Flaw::Ignores)) {
        CreateOnly::NotHonoured(why) => assert!(why.contains("second create-only PUT"), "{why}"),
        h => panic!("ignoring store probed as {h:?}"),
    }
    match probe(&*flawed(&mem, Flaw::Rejects)) {
        CreateOnly::NotHonoured(why) => assert!(why.contains("AWS_CONDITIONAL_PUT"), "{why}"),
        h => panic!("rejecting store probed as {h:?}"),
    }
    assert_eq!(
        objects(&*mem),
        Vec::<String>::new(),
        "the probes are deleted"
    );
}

#[test]
fn create_and_a_writable_open_refuse_a_store_without_create_only_puts() {
    for flaw in [Flaw::Ignores, Flaw::Rejects] {
        let mem = Arc::new(InMemory::new());
        let dir = tempfile::tempdir().expect("tempdir");
        let bad = config(flawed(&mem, flaw), dir.path());
        let e = cvol_objstore::create(&bad, &DESCRIPTOR, false).expect_err("create refused");
        assert!(matches!(e, Error::NoFencing { .. }), "{flaw:?}: {e}");
        let e = e.to_string();
        assert!(
            e.contains("does not honour create-only PUTs") && e.contains("--unsafe-no-fencing"),
            "{flaw:?}: {e}"
        );
        assert_eq!(
            objects(&*mem),
            Vec::<String>::new(),
            "{flaw:?}: nothing written"
        );
        // A volume made through an honest view, then served through the flawed one.
        create_write_reopen(&config(mem.clone(), dir.path())).expect("honest store");
        let before = objects(&*mem);
        let e = ObjectStorage::open(&bad)
            .err()
            .expect("a writable open refused");
        assert!(matches!(e, Error::NoFencing { .. }), "{flaw:?}: {e}");
        let e = e.to_string();
        assert!(
            e.contains("does not honour create-only PUTs"),
            "{flaw:?}: {e}"
        );
        assert_eq!(
            objects(&*mem),
            before,
            "{flaw:?}: the refused open wrote nothing"
        );
        // Reading writes nothing: no fencing needed.
        let mut ro = config(flawed(&mem, flaw), dir.path());
        ro.read_only = true;
        let st = ObjectStorage::open(&ro).expect("a read-only open needs no fencing");
        st.close().expect("close");
    }
}

#[test]
fn unsafe_no_fencing_serves_one_writer_on_such_a_store() {
    for flaw in [Flaw::Ignores, Flaw::Rejects] {
        let mem = Arc::new(InMemory::new());
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = config(flawed(&mem, flaw), dir.path());
        cfg.unsafe_no_fencing = true;
        create_write_reopen(&cfg).unwrap_or_else(|e| panic!("{flaw:?}: {e}"));
    }
}
