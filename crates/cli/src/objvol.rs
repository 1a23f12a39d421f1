//! Volumes kept in an object store (`s3://BUCKET/PREFIX`): create, open
//! for serve, and the local cache's flags. The protocol is in
//! cvol-objstore; docs/FORMAT.md "Object store".
use cvol_engine::{CreateOptions, Volume};
use cvol_format::DATA_OFFSET_BYTES;
use cvol_objstore::url::{is_object_url, S3Url};
use cvol_objstore::{Config, Descriptor, ObjectStorage};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The address when `path` names an object-store volume.
pub fn url_of(path: &Path) -> Option<&str> {
    path.to_str().filter(|s| is_object_url(s))
}

/// A directory of its own for a command that needs a cache only briefly
/// (create, an offline stat): removed on drop.
pub struct TempCache(pub PathBuf);

impl TempCache {
    pub fn new(what: &str) -> TempCache {
        TempCache(std::env::temp_dir().join(format!("cvol-{what}-{}", std::process::id())))
    }
}

impl Drop for TempCache {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The store's configuration for `url`.
pub fn config(url: &str, cache_dir: PathBuf) -> Result<Config, String> {
    let u = S3Url::parse(url)?;
    let mut c = Config::new(u.store()?, &u.prefix, cache_dir);
    c.label = u.to_string();
    Ok(c)
}

/// Writes a new volume at `url`: descriptor and empty manifest, then the
/// engine's format through the store. A failure deletes what it wrote
/// (nothing is touched when the prefix holds objects and --force is not given).
pub fn create(
    url: &str,
    opts: &CreateOptions,
    force: bool,
    unsafe_no_fencing: bool,
) -> Result<(), String> {
    let tmp = TempCache::new("create");
    let mut cfg = config(url, tmp.0.clone())?;
    cfg.unsafe_no_fencing = unsafe_no_fencing;
    let d = Descriptor {
        size_bytes: opts.physical_size_bytes,
        head_bytes: DATA_OFFSET_BYTES,
        chunk_bytes: opts.segment_size_bytes,
    };
    cvol_objstore::create(&cfg, &d, force)?;
    let r = (|| {
        let st = Arc::new(ObjectStorage::open(&cfg)?);
        let vol = Volume::create(st.clone(), opts).map_err(|e| format!("{url}: {e}"))?;
        vol.close().map_err(|e| format!("{url}: {e}"))?;
        drop(vol);
        st.close()
    })();
    if r.is_err() {
        let _ = cvol_objstore::destroy(&cfg);
    }
    r
}

/// `cvol serve`'s flags for an object-store volume.
pub struct ServeFlags<'a> {
    pub cache_dir: Option<&'a Path>,
    pub cache_size: Option<&'a str>,
    pub lease: f64,
    pub read_only: bool,
    /// `--unsafe-no-fencing`.
    pub unsafe_no_fencing: bool,
}

/// Default `--cache-size`.
pub const DEFAULT_CACHE_BYTES: u64 = 1 << 30;

/// Opens `url` for serving (claiming it, unless read-only).
pub fn open(url: &str, f: &ServeFlags) -> Result<Arc<ObjectStorage>, String> {
    let dir = f.cache_dir.ok_or_else(|| {
        format!("{url}: an object-store volume needs --cache-dir DIR (its local cache)")
    })?;
    let mut cfg = config(url, dir.to_path_buf())?;
    cfg.cache_bytes = match f.cache_size {
        Some(s) => crate::size::parse_size(s).map_err(|e| format!("--cache-size: {e}"))?,
        None => DEFAULT_CACHE_BYTES,
    };
    if !(0.1..=3600.0).contains(&f.lease) {
        return Err(format!(
            "--lease {}: give seconds from 0.1 to 3600",
            f.lease
        ));
    }
    cfg.lease = Duration::from_secs_f64(f.lease);
    cfg.read_only = f.read_only;
    cfg.unsafe_no_fencing = f.unsafe_no_fencing;
    Ok(Arc::new(ObjectStorage::open(&cfg)?))
}

/// Flags that only mean something for an object-store volume, refused
/// for a volume on local media.
pub fn refuse_for_local(path: &Path, f: &ServeFlags) -> Result<(), String> {
    if url_of(path).is_none()
        && (f.cache_dir.is_some() || f.cache_size.is_some() || f.unsafe_no_fencing)
    {
        return Err(format!(
            "--cache-dir, --cache-size and --unsafe-no-fencing are for a volume in an object \
             store (s3://BUCKET/PREFIX), not {}",
            path.display()
        ));
    }
    Ok(())
}

/// Opens `url` read-only for a command that only reads (stat, an offline
/// scrub), with a cache directory of its own that goes with the command.
pub fn open_read_only(url: &str, read_cache_bytes: Option<u64>) -> Result<Volume, String> {
    let tmp = TempCache::new("read");
    let mut cfg = config(url, tmp.0.clone())?;
    cfg.read_only = true;
    let st = Arc::new(ObjectStorage::open(&cfg)?);
    // The cache file stays open (and readable) once its directory is gone.
    drop(tmp);
    let options = cvol_engine::OpenOptions {
        read_only: true,
        read_cache_bytes,
        ..cvol_engine::OpenOptions::default()
    };
    Volume::open(st, options).map_err(|e| format!("{url}: {e}"))
}
