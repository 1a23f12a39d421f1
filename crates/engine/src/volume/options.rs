//! How a volume is created and opened, and the defaults.
use super::jobs::cleaner::CleanerConfig;
use crate::codec::Codec;
use crate::policy::{CodecPolicy, ElasticConfig};

pub const DEDUP_MEMORY_DEFAULT_BYTES: u64 = 128 << 20;
pub const READ_CACHE_DEFAULT_BYTES: u64 = 32 << 20;
/// A flush also checkpoints once this many log bytes were written since the last one.
pub const CHECKPOINT_INTERVAL_DEFAULT_BYTES: u64 = 256 << 20;

#[derive(Debug, Clone)]
pub struct CreateOptions {
    pub logical_size_bytes: u64,
    pub physical_size_bytes: u64,
    /// A fixed codec, or `auto` (elastic, with a strong codec for idle time).
    pub codec: CodecPolicy,
    /// 0 picks a default from the physical size.
    pub segment_size_bytes: u64,
    /// Inline deduplication of 4 KiB blocks.
    pub dedup: bool,
}

impl CreateOptions {
    /// A volume of `logical_size_bytes` on `physical_size_bytes` of store:
    /// lz4, the default segment size for that store, dedup on.
    pub fn new(logical_size_bytes: u64, physical_size_bytes: u64) -> CreateOptions {
        CreateOptions {
            logical_size_bytes,
            physical_size_bytes,
            codec: CodecPolicy::Fixed(Codec::Lz4),
            segment_size_bytes: 0,
            dedup: true,
        }
    }

    /// With this codec policy (`Codec::Lz4.into()`, `CodecPolicy::Auto {..}`).
    pub fn with_codec(self, codec: impl Into<CodecPolicy>) -> CreateOptions {
        CreateOptions {
            codec: codec.into(),
            ..self
        }
    }

    /// With segments of this size (0: the default for the physical size).
    pub fn with_segment_size(self, segment_size_bytes: u64) -> CreateOptions {
        CreateOptions {
            segment_size_bytes,
            ..self
        }
    }

    /// With inline deduplication on or off.
    pub fn with_dedup(self, dedup: bool) -> CreateOptions {
        CreateOptions { dedup, ..self }
    }
}

#[derive(Debug, Clone)]
pub struct OpenOptions {
    pub read_only: bool,
    /// Every write is durable before it returns.
    pub sync_writes: bool,
    /// A flush also checkpoints once this many log bytes were written since the last one.
    pub checkpoint_interval_bytes: u64,
    pub cleaner: CleanerConfig,
    /// Memory for the dedup fingerprint index (volumes with dedup on).
    pub dedup_memory_bytes: u64,
    /// Memory for the cache of decompressed blocks (0: none).
    pub read_cache_bytes: u64,
    /// Merged compression units, load thresholds, background recompression.
    pub elastic: ElasticConfig,
    /// When no checkpoint is usable, rebuild the map from every record the
    /// log still holds (`cvol check --repair`) instead of refusing to open.
    pub rebuild_from_log: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            read_only: false,
            sync_writes: false,
            checkpoint_interval_bytes: CHECKPOINT_INTERVAL_DEFAULT_BYTES,
            cleaner: CleanerConfig::default(),
            dedup_memory_bytes: DEDUP_MEMORY_DEFAULT_BYTES,
            read_cache_bytes: READ_CACHE_DEFAULT_BYTES,
            elastic: ElasticConfig::default(),
            rebuild_from_log: false,
        }
    }
}
