//! cvol engine: a volume of 4 KiB logical blocks stored as compressed,
//! self-describing records packed byte-granular into fixed-size segments.
//!
//! - `volume`: the public API (create/open, read/write/trim/zero, flush, checkpoint, stats)
//! - `log`: the open segment buffer and record placement
//! - `map`: the in-memory block map (12 bytes per written block)
//! - `recovery`: checkpoint load and roll-forward
//! - `check`: offline verification of every record and all metadata
//! - `codec`: lz4 / zstd / none
// `log` and `map` are internals; public only for the criterion benchmarks.
#[doc(hidden)]
pub mod log;
#[doc(hidden)]
pub mod map;
pub mod policy;
pub mod segments;

pub mod check;
pub mod codec;
pub mod dedup;
pub mod error;
pub mod recovery;
pub mod stats;
pub mod volume;
pub use volume::CleanerConfig;

pub use codec::Codec;
pub use error::VolError;
pub use policy::{CodecPolicy, ElasticConfig};
pub use stats::VolumeStats;
pub use volume::{CreateOptions, Extent, IndexWarmup, OpenOptions, Volume};
