//! How a volume is created and opened, and the defaults.
use super::jobs::cleaner::CleanerConfig;
use crate::clock::{Clock, SystemClock};
use crate::codec::Codec;
use crate::cpu::CpuGauge;
use crate::keys::{Encryption, KeyFile};
use crate::policy::{CodecPolicy, ElasticConfig};
use cvol_format::seal::Cipher;
use cvol_format::superblock::Packing;
use std::sync::Arc;

/// The largest default dedup index; `dedup_memory_default_bytes` scales it
/// down for smaller volumes.
pub const DEDUP_MEMORY_DEFAULT_BYTES: u64 = 128 << 20;
/// The largest default read cache; `read_cache_default_bytes` scales it down.
pub const READ_CACHE_DEFAULT_BYTES: u64 = 32 << 20;
/// The smallest default of either budget.
const MEMORY_DEFAULT_MIN_BYTES: u64 = 1 << 20;

/// Fingerprint table bytes between two snapshots of the dedup hook index
/// (at least): at about 18 bytes a block, one per 3.5 M blocks written.
pub const HOOK_SNAPSHOT_DEFAULT_BYTES: u64 = 64 << 20;

/// The dedup index a volume gets unless told (`--dedup-memory`): physical
/// / 64, from 1 MiB up to 128 MiB, so a small volume does not take (and
/// pre-fault) the index of a large one. It is shared by the exact hot
/// index (a quarter: 24 bytes per recent block), the hook index (half: 8
/// bytes per sampled block, covering the whole volume) and the table
/// cache (`dedup::Index`).
pub fn dedup_memory_default_bytes(physical_size_bytes: u64) -> u64 {
    (physical_size_bytes / 64).clamp(MEMORY_DEFAULT_MIN_BYTES, DEDUP_MEMORY_DEFAULT_BYTES)
}

/// The read cache a volume gets unless told (`--read-cache`): 1/128 of
/// the physical size, from 1 MiB up to 32 MiB.
pub fn read_cache_default_bytes(physical_size_bytes: u64) -> u64 {
    (physical_size_bytes / 128).clamp(MEMORY_DEFAULT_MIN_BYTES, READ_CACHE_DEFAULT_BYTES)
}
/// A flush also checkpoints once this many log bytes were written since the last one.
pub const CHECKPOINT_INTERVAL_DEFAULT_BYTES: u64 = 256 << 20;
/// Fingerprint rows waiting in memory (24 bytes a block appended) that
/// make the checkpointer write the tables of the parts the log head has
/// left, without a checkpoint (`OpenOptions::fingerprint_spill_bytes`): a
/// fill of 10:1 data appends 650 thousand blocks (15 MiB of rows) in a
/// checkpoint interval of log, and highly compressible data could append
/// far more. Until the seventh issue-16 session the rows made a whole
/// checkpoint due, which rewrote every dirty map page with them: at
/// 128 GiB mapped under random writes, three 300 MiB checkpoints in 40 s
/// where the log called for one.
pub const FINGERPRINT_SPILL_DEFAULT_BYTES: u64 = 32 << 20;

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
    /// How DATA records are laid out in segments ([SSD-packing]).
    pub packing: Packing,
    /// A pool (`crate::pool`): the logical size above is its first
    /// volume's, `default`; the map covers the pool's whole space.
    pub pool: bool,
    /// Encryption at rest (`crate::keys`): None for a volume in the clear.
    pub encryption: Option<Encryption>,
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
            packing: Packing::Compact,
            pool: false,
            encryption: None,
        }
    }

    /// As a pool whose first volume, `default`, has the logical size.
    pub fn as_pool(self) -> CreateOptions {
        CreateOptions { pool: true, ..self }
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

    /// Encrypted with this cipher under this key file.
    pub fn with_encryption(self, cipher: Cipher, key: KeyFile) -> CreateOptions {
        CreateOptions {
            encryption: Some(Encryption { cipher, key }),
            ..self
        }
    }

    /// With this packing of DATA records.
    pub fn with_packing(self, packing: Packing) -> CreateOptions {
        CreateOptions { packing, ..self }
    }
}

/// Default memory for block map pages: the whole map of a volume with up
/// to ~170 GiB mapped (3 MiB of map per GiB); beyond that, the pages used
/// least recently are read back from the log on demand.
pub const MAP_CACHE_DEFAULT_BYTES: u64 = 512 << 20;
/// Bytes of map pages the cache holds (`OpenOptions::map_cache_bytes`,
/// or the default): a page takes what its entries need
/// (`map::Page::memory_bytes`, at most `map::PAGE_MEMORY_BYTES`). 0 may
/// be: every clean page is dropped whenever the state lock is taken (the
/// simulations run so).
pub fn map_cache_limit_bytes(map_cache_bytes: Option<u64>) -> u64 {
    map_cache_bytes.unwrap_or(MAP_CACHE_DEFAULT_BYTES)
}

#[derive(Debug, Clone)]
pub struct OpenOptions {
    pub read_only: bool,
    /// Every write is durable before it returns.
    pub sync_writes: bool,
    /// A flush also checkpoints once this many log bytes were written since the last one.
    pub checkpoint_interval_bytes: u64,
    /// Fingerprint rows in memory beyond this many bytes are written as
    /// their tables between checkpoints (`FINGERPRINT_SPILL_DEFAULT_BYTES`;
    /// the simulations make it small).
    pub fingerprint_spill_bytes: u64,
    /// The dedup hook index is persisted (a snapshot) once this many bytes
    /// of fingerprint tables were written since the last one, and at least
    /// twice the last snapshot's bytes (`HOOK_SNAPSHOT_DEFAULT_BYTES`; the
    /// tests make it small).
    pub hook_snapshot_bytes: u64,
    pub cleaner: CleanerConfig,
    /// Memory for the dedup fingerprint index (volumes with dedup on);
    /// None: `dedup_memory_default_bytes` of the volume's physical size.
    pub dedup_memory_bytes: Option<u64>,
    /// Memory for the cache of decompressed blocks (0: none); None:
    /// `read_cache_default_bytes` of the volume's physical size.
    pub read_cache_bytes: Option<u64>,
    /// Memory for block map pages (clean pages beyond it are dropped and
    /// read back on demand); None: `MAP_CACHE_DEFAULT_BYTES`.
    pub map_cache_bytes: Option<u64>,
    /// Merged compression units, load thresholds, background recompression.
    pub elastic: ElasticConfig,
    /// When no checkpoint is usable, rebuild the map from every record the
    /// log still holds (`cvol check --repair`) instead of refusing to open.
    pub rebuild_from_log: bool,
    /// The path the metadata device was opened at, for `stat` (None: the
    /// one recorded at create, or no metadata device).
    pub metadata_device_path: Option<String>,
    /// Freed data segments that keep their host space for the log head to
    /// write over (`SegmentTable::split_warm`); None: 512 MiB or 1/16 of
    /// the data store, whichever is less (0 on a small volume; the
    /// simulations set it).
    pub warm_segments: Option<usize>,
    /// Zeros a flush writes past the data head so that the next flushes
    /// write over space the host holds (`Log::prepare_ahead`); None:
    /// `ZERO_AHEAD_DEFAULT_BYTES` where an overwrite is cheaper (a file),
    /// else 0. The simulations set it.
    pub zero_ahead_bytes: Option<usize>,
    /// The time the codec policy's load and CPU budget and the background
    /// jobs' idle test read (`crate::clock`): the system clock by default,
    /// a `ManualClock` in a simulation that wants its seed to fix them.
    pub clock: Arc<dyn Clock>,
    /// The machine's CPU load, which the codec policy counts as load
    /// (`ElasticConfig::busy_cpu_percent`; `crate::cpu`): None by default,
    /// so that no test's decisions depend on what else the machine runs;
    /// the server passes `MachineCpu`.
    pub cpu: Option<Arc<dyn CpuGauge>>,
    /// The key file of an encrypted volume (refused for one without).
    pub key: Option<KeyFile>,
}

/// The zeros a flush writes past the data head, by default, on a store
/// where writing over held space is cheaper than filling a hole.
pub const ZERO_AHEAD_DEFAULT_BYTES: usize = 256 << 10;

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            read_only: false,
            sync_writes: false,
            checkpoint_interval_bytes: CHECKPOINT_INTERVAL_DEFAULT_BYTES,
            fingerprint_spill_bytes: FINGERPRINT_SPILL_DEFAULT_BYTES,
            hook_snapshot_bytes: HOOK_SNAPSHOT_DEFAULT_BYTES,
            cleaner: CleanerConfig::default(),
            dedup_memory_bytes: None,
            read_cache_bytes: None,
            map_cache_bytes: None,
            elastic: ElasticConfig::default(),
            rebuild_from_log: false,
            metadata_device_path: None,
            warm_segments: None,
            zero_ahead_bytes: None,
            clock: SystemClock::shared(),
            cpu: None,
            key: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_defaults_scale_with_the_physical_size() {
        const MIB: u64 = 1 << 20;
        assert_eq!(dedup_memory_default_bytes(3 * MIB), MIB);
        assert_eq!(dedup_memory_default_bytes(4 << 30), 64 * MIB);
        assert_eq!(dedup_memory_default_bytes(1 << 40), 128 * MIB);
        assert_eq!(read_cache_default_bytes(3 * MIB), MIB);
        assert_eq!(read_cache_default_bytes(1 << 30), 8 * MIB);
        assert_eq!(read_cache_default_bytes(1 << 40), 32 * MIB);
    }
}
