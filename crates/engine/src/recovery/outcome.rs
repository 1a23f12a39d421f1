//! What recovery returns (`Recovered`) and what a salvage could not save
//! (`Salvage`). Every other room of recovery builds one; this one uses
//! only `certified` (the seq a salvage reports as certified).
use super::certified::Certified;
use crate::liveness::LoadedTables;
use crate::map::BlockMap;
use std::collections::HashMap;

/// Result of recovery: the map and where the log continues.
pub struct Recovered {
    pub map: BlockMap,
    /// Segment holding the end of the chain and the byte after its last record.
    pub segment: u64,
    pub end: usize,
    pub last_seq: u64,
    pub last_epoch: u32,
    pub checkpoint_generation: u64,
    pub replayed_records: u64,
    /// Replayed records that changed the map (DATA, ZERO, TRIM).
    pub replayed_map_records: u64,
    /// Snapshot seq of the checkpoint recovery started from (0: none).
    pub snapshot_seq: u64,
    /// Segments recovery needs besides those holding live data: the ones the
    /// roll-forward passed through and those holding the checkpoint, with the
    /// highest seq each holds.
    pub needed_segments: HashMap<u64, u64>,
    /// Human-readable notes on what was skipped (corrupt slots, fallbacks).
    pub warnings: Vec<String>,
    /// Seqs of damaged checkpoint records the roll-forward stepped over.
    pub skipped: Vec<u64>,
    /// Segments the roll-forward read records from.
    pub rolled_segments: Vec<u64>,
    /// What a salvage (`cvol check --repair`) could not save.
    pub salvage: Option<Salvage>,
    /// The liveness tables the checkpoint persisted, if it named them all.
    pub(crate) tables: Option<LoadedTables>,
    /// Offsets of the DATA records roll-forward replayed.
    pub(crate) new_records: Vec<u64>,
    /// The end's segment as roll-forward read it whole (when it did): the
    /// log's open segment, which open then need not read again.
    pub(crate) head_segment: Option<Vec<u8>>,
}

/// What `salvage` could not save.
#[derive(Debug, Clone, Default)]
pub struct Salvage {
    /// Blocks whose newest flushed version is gone: their entries are now
    /// LOST (they read as EIO until written again).
    pub lost_lbas: Vec<u64>,
    /// Records below the certified seq that are gone and whose blocks
    /// cannot be told (their headers are destroyed): some block may read
    /// an older version. Listed by seq.
    pub unknown_records: Vec<u64>,
    /// The seq the volume had certified as flushed, and by what.
    pub certified: Certified,
}
