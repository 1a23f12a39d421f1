//! Volumes kept in an object store (`s3://BUCKET/PREFIX`): create, open
//! for serve, and the local cache's flags. The protocol is in
//! cvol-objstore; docs/FORMAT.md "Object store".
use crate::error::Error;
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
/// (create, an offline stat): made fresh in the temporary directory under
/// an unpredictable name, mode 0700 (mkdtemp), so no other user can have
/// planted anything in it; removed on drop.
pub struct TempCache(tempfile::TempDir);

impl TempCache {
    pub fn new(what: &str) -> Result<TempCache, Error> {
        use std::os::unix::fs::PermissionsExt;
        tempfile::Builder::new()
            .prefix(&format!("cvol-{what}-"))
            // mkdir with mode 0700 (tempfile's default leaves it to the umask).
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir()
            .map(TempCache)
            .map_err(|e| {
                Error::Refused({
                    format!(
                        "cannot make a temporary cache directory in {}: {e}",
                        std::env::temp_dir().display()
                    )
                })
            })
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

/// Makes `--cache-dir` if it is missing, private to this user (0700).
fn make_cache_dir(dir: &Path) -> Result<(), Error> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| Error::Usage(format!("--cache-dir {}: {e}", dir.display())))
}

/// The store's configuration for `url`.
pub fn config(url: &str, cache_dir: PathBuf) -> Result<Config, Error> {
    let u = S3Url::parse(url).map_err(|e| Error::Usage(e.to_string()))?;
    let mut c = Config::new(u.store().map_err(store_error)?, &u.prefix, cache_dir);
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
) -> Result<(), Error> {
    let tmp = TempCache::new("create")?;
    let mut cfg = config(url, tmp.path().to_path_buf())?;
    cfg.unsafe_no_fencing = unsafe_no_fencing;
    let d = Descriptor {
        size_bytes: opts.physical_size_bytes,
        head_bytes: DATA_OFFSET_BYTES,
        chunk_bytes: opts.segment_size_bytes,
    };
    cvol_objstore::create(&cfg, &d, force).map_err(store_error)?;
    let r = (|| {
        let st = Arc::new(ObjectStorage::open(&cfg).map_err(store_error)?);
        let vol =
            Volume::create(st.clone(), opts).map_err(|e| Error::Refused(format!("{url}: {e}")))?;
        vol.close()
            .map_err(|e| Error::Refused(format!("{url}: {e}")))?;
        drop(vol);
        st.close().map_err(store_error)
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

/// Least `--cache-size`: a few chunks.
const CACHE_MIN_BYTES: u64 = 16 << 20;

/// Default `--cache-size`.
pub const DEFAULT_CACHE_BYTES: u64 = 1 << 30;

/// Opens `url` for serving (claiming it, unless read-only).
pub fn open(url: &str, f: &ServeFlags) -> Result<Arc<ObjectStorage>, Error> {
    let dir = f.cache_dir.ok_or_else(|| {
        Error::Refused({
            format!("{url}: an object-store volume needs --cache-dir DIR (its local cache)")
        })
    })?;
    let mut cfg = config(url, dir.to_path_buf())?;
    cfg.cache_bytes = match f.cache_size {
        Some(s) => {
            let b = crate::size::parse_size(s)
                .map_err(|e| Error::Usage(format!("--cache-size: {e}")))?;
            if !(CACHE_MIN_BYTES..=cvol_format::PHYSICAL_SIZE_MAX_BYTES).contains(&b) {
                return Err(Error::Usage(format!(
                    "--cache-size {s}: give from 16M to {} TiB",
                    cvol_format::PHYSICAL_SIZE_MAX_BYTES >> 40
                )));
            }
            b
        }
        None => DEFAULT_CACHE_BYTES,
    };
    if !(0.1..=3600.0).contains(&f.lease) {
        return Err(Error::Usage(format!(
            "--lease {}: give seconds from 0.1 to 3600",
            f.lease
        )));
    }
    cfg.lease = Duration::from_secs_f64(f.lease);
    cfg.read_only = f.read_only;
    cfg.unsafe_no_fencing = f.unsafe_no_fencing;
    make_cache_dir(dir)?;
    Ok(Arc::new(ObjectStorage::open(&cfg).map_err(store_error)?))
}

/// Flags that only mean something for an object-store volume, refused
/// for a volume on local media.
pub fn refuse_for_local(path: &Path, f: &ServeFlags) -> Result<(), Error> {
    if url_of(path).is_none()
        && (f.cache_dir.is_some() || f.cache_size.is_some() || f.unsafe_no_fencing)
    {
        return Err(Error::Usage(format!(
            "--cache-dir, --cache-size and --unsafe-no-fencing are for a volume in an object \
             store (s3://BUCKET/PREFIX), not {}",
            path.display()
        )));
    }
    Ok(())
}

/// Opens `url` read-only for a command that only reads (stat, an offline
/// scrub), with a cache directory of its own that goes with the command.
pub fn open_read_only(url: &str, read_cache_bytes: Option<u64>) -> Result<Volume, Error> {
    let tmp = TempCache::new("read")?;
    let mut cfg = config(url, tmp.path().to_path_buf())?;
    cfg.read_only = true;
    let st = Arc::new(ObjectStorage::open(&cfg).map_err(store_error)?);
    // The cache file stays open (and readable) once its directory is gone.
    drop(tmp);
    let options = cvol_engine::OpenOptions {
        read_only: true,
        read_cache_bytes,
        ..crate::keyfile::open_options()
    };
    Volume::open(st, options).map_err(|e| Error::Refused(format!("{url}: {e}")))
}

/// Opens `url` writable for a short offline change (`cvol key rotate`):
/// claims the volume (refused while a server renews its lease) with a
/// cache directory of its own, kept until the change is closed.
pub fn open_for_change(url: &str) -> Result<(TempCache, Arc<ObjectStorage>), Error> {
    let tmp = TempCache::new("change")?;
    let cfg = config(url, tmp.path().to_path_buf())?;
    let st = Arc::new(ObjectStorage::open(&cfg).map_err(store_error)?);
    Ok((tmp, st))
}

/// An object store's refusal or failure, in its words.
fn store_error(e: impl std::fmt::Display) -> Error {
    Error::Refused(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    /// The temporary cache directory is made fresh (never one that is
    /// already there, as another user could have planted it), private,
    /// under a name nobody can guess, and removed when done.
    #[test]
    fn temp_cache_dirs_are_fresh_private_and_unpredictable() {
        // What another user would plant at the name cvol once used.
        let old = std::env::temp_dir().join(format!("cvol-read-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&old);
        std::fs::create_dir(&old).unwrap();
        let a = TempCache::new("read").unwrap();
        let b = TempCache::new("read").unwrap();
        assert_ne!(a.path(), old.as_path());
        assert_ne!(a.path(), b.path());
        let name = a.path().file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with("cvol-read-") && name.len() >= "cvol-read-".len() + 6);
        let md = std::fs::symlink_metadata(a.path()).unwrap();
        assert!(md.is_dir());
        assert_eq!(md.permissions().mode() & 0o777, 0o700);
        assert_eq!(md.uid(), rustix::process::geteuid().as_raw());
        let kept = a.path().to_path_buf();
        drop(a);
        assert!(!kept.exists(), "removed on drop");
        std::fs::remove_dir(&old).unwrap();
    }

    /// `--cache-size` has a range.
    #[test]
    fn cache_size_is_bounded() {
        let f = |s| ServeFlags {
            cache_dir: Some(Path::new("/nonexistent-cvol-cache")),
            cache_size: Some(s),
            lease: 10.0,
            read_only: true,
            unsafe_no_fencing: false,
        };
        for bad in ["0", "1M", "99999T"] {
            let e = open("s3://bkt/vol", &f(bad)).err().unwrap().to_string();
            assert!(e.contains("--cache-size") && e.contains("16M"), "{e}");
        }
    }
}
