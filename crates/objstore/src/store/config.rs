//! [`Config`]: how to reach a volume and use the local cache.
//!
//! Depends on: nothing in the crate.
use object_store::ObjectStore;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

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
    /// Background PUTs at once (and the length of the queue of chunks
    /// waiting for one of them).
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
