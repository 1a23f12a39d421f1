//! A simulated volume on one store, or on a data store and a metadata
//! device (`--metadata-device`): two `SimStorage`s, each losing its own
//! unsynced writes at a crash and failing its own I/O budget.
use cvol_engine::volume::metadev;
use cvol_engine::{CreateOptions, OpenOptions, VolError, Volume};
use cvol_storage::{SimConfig, SimStorage, Storage};
use std::sync::Arc;

#[derive(Clone)]
pub struct Stores {
    pub data: SimStorage,
    pub meta: Option<SimStorage>,
}

impl Stores {
    /// A data store of `data_bytes`, and a metadata device of `meta_bytes`
    /// when that is not 0.
    pub fn new(data_bytes: u64, meta_bytes: u64) -> Stores {
        Stores {
            data: SimStorage::new(data_bytes),
            meta: (meta_bytes > 0).then(|| SimStorage::new(meta_bytes)),
        }
    }

    /// The volume's store as the engine sees it (the two joined, once
    /// created).
    pub fn joined(&self) -> Arc<dyn Storage> {
        let data: Arc<dyn Storage> = Arc::new(self.data.clone());
        match &self.meta {
            None => data,
            Some(m) => {
                let m: Arc<dyn Storage> = Arc::new(m.clone());
                metadev::open_stores(data, |_| Ok(m)).expect("join the stores")
            }
        }
    }

    pub fn create(&self, opts: &CreateOptions) -> Volume {
        let data: Arc<dyn Storage> = Arc::new(self.data.clone());
        match &self.meta {
            None => Volume::create(data, opts),
            Some(m) => Volume::create_with_metadata(data, Arc::new(m.clone()), "/sim/meta", opts),
        }
        .expect("create")
    }

    pub fn open(&self, options: OpenOptions) -> Result<Volume, VolError> {
        Volume::open(self.joined(), options)
    }

    /// Both stores fail after `config`'s budget of I/Os each.
    pub fn set_config(&self, config: SimConfig) {
        if let Some(m) = &self.meta {
            m.set_config(config.clone());
        }
        self.data.set_config(config);
    }

    /// A power cut: each store keeps, drops or tears its own unsynced
    /// writes.
    pub fn crash(&self, seed: u64) -> Stores {
        Stores {
            data: self.data.crash(seed),
            meta: self
                .meta
                .as_ref()
                .map(|m| m.crash(seed ^ 0x9e37_79b9_7f4a_7c15)),
        }
    }

    /// The store and its own offset of volume offset `at`.
    pub fn route(&self, at: u64) -> (&SimStorage, u64) {
        let base = self.data.len_bytes();
        match &self.meta {
            Some(m) if at >= self.metadata_base() => (
                m,
                at - self.metadata_base() + cvol_format::metadev::METADATA_DATA_OFFSET_BYTES,
            ),
            _ => {
                assert!(at < base, "offset {at} beyond the data store");
                (&self.data, at)
            }
        }
    }

    /// The volume offset of the metadata device's first segment.
    fn metadata_base(&self) -> u64 {
        let (sb, _) = cvol_engine::read_superblock(&self.data).expect("a superblock");
        sb.metadata_base()
    }

    pub fn has_meta(&self) -> bool {
        self.meta.is_some()
    }
}
