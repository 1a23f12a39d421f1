//! cvol engine: a volume of 4 KiB logical blocks stored as compressed,
//! self-describing records packed byte-granular into fixed-size segments.
//!
//! Rooms, from the bottom up (each depends only on rooms above it in this
//! list and on `cvol-format`, `cvol-storage`):
//!
//! - `error`: `VolError`, `OpenError`, `RecoveryError`
//! - `memory`: the allocator's settings for a server, its counts, the
//!   process's RSS (`stat`'s `memory_bytes`)
//! - `keys`: encryption keys: key files, unwrapping the data key, rotation
//! - `clock`: the time the policy and background jobs read; `cpu`: the
//!   machine's CPU load the policy reads (both passed in by the opener)
//! - `codec`: lz4 / zstd / none; `policy`: which codec a write gets (elastic)
//! - `records`: record decoding shared by every reader of the log
//! - `map`: the in-memory block map (12 bytes per written block)
//! - `logread`: records read back from the store (`read_record`), the
//!   empty map of a volume, the map pages of the log (`LogPages`)
//! - `segments`: segment allocation, segment usage, victim policies
//! - `dedup`: fingerprints, the fingerprint index, the shared-record table
//! - `stats`: `VolumeStats` (what `stat` shows) and the map's counters
//! - `liveness`: `LiveMap`, the map and every table derived from it, kept
//!   exact by its one mutator
//! - `log`: the open segment buffer and record placement
//! - `locks`: the lock order (checked in debug builds) and poisoning
//! - `recovery`: superblock, checkpoint search and load, roll-forward,
//!   salvage (one file per stage in `recovery/`); `check`: offline
//!   verification and repair
//! - `volume`: the public API, one file per stage, background jobs in
//!   `volume/jobs`
//! - `pool`: many volumes in one store (a volume table over the map's
//!   logical space), served as `VolumeView`s
// `log` and `map` are internals; public only for the criterion benchmarks.
#[doc(hidden)]
pub mod log;
#[doc(hidden)]
pub mod map;
pub mod memory;
pub mod policy;
pub mod segments;

pub mod check;
pub mod clock;
pub mod codec;
pub mod cpu;
pub mod dedup;
pub mod error;
pub mod keys;
mod liveness;
mod locks;
mod logread;
pub mod pool;
mod records;
mod recovery;
pub mod stats;
#[cfg(test)]
mod test_util;
pub mod volume;
pub use volume::CleanerConfig;

pub use codec::Codec;
// The record decoder every read goes through; the fuzz targets drive it.
pub use error::{KeyProblem, OpenError, RecoveryError, VolError};
pub use keys::{Encryption, KeyFile};
pub use policy::{CodecPolicy, ElasticConfig};
pub use records::decode_block_record;
// The superblock, for tools that look at a store before opening it.
pub use recovery::read_superblock;
pub use stats::VolumeStats;
pub use volume::{resize_unsupported, ResizeError, SHRINK_FREE_MIN_SEGMENTS};
pub use volume::{CreateOptions, Extent, IndexWarmup, OpenOptions, Volume};
