//! Opening a volume: newest valid checkpoint, then roll-forward along the
//! chain of records (seq + 1, same epoch or a newer EPOCH record) through the
//! segments written after it. See docs/FORMAT.md "Recovery".
//!
//! The entry points are here; each stage is a room of its own, each using
//! only rooms listed before it:
//!
//! - `superblock`: the superblock copies and the checkpoint pointer slots
//! - `scan`: the log read segment by segment (every verified record)
//! - `certified`: the highest seq the volume certified as flushed
//! - `outcome`: `Recovered`, `Salvage` (what every stage returns)
//! - `chain`: the roll-forward along the chain of records
//! - `dir_records`: a checkpoint's MAP_DIR records, and the lists kept
//!   apart their summaries name
//! - `checkpoint`: reading one checkpoint (commit, start, map, tables)
//! - `search`: choosing the checkpoint to recover from (`recover`)
//! - `salvage_walk`, `salvage`: `cvol check --repair`'s salvage and the
//!   rebuild from the log
mod certified;
mod chain;
mod checkpoint;
mod dir_records;
mod outcome;
mod salvage;
mod salvage_walk;
mod scan;
mod search;
mod superblock;

pub use certified::certified_in_log;
pub use outcome::{Recovered, Salvage};
pub use salvage_walk::lba_list;
pub use superblock::{read_pointers, read_superblock, repair_superblocks, require_metadata_device};

use crate::error::RecoveryError;
use crate::logread::volume_map;
use chain::{log_start, roll_forward};
use cvol_format::Superblock;
use cvol_storage::Storage;
use salvage::salvage_from;
use scan::{first_record_index, scan_log};
use search::{recover_with, Pages};
use std::collections::HashMap;

/// Recovers the map when opening a volume (docs/FORMAT.md "Recovery"): the
/// newest usable checkpoint and the roll-forward from it, or a replay from
/// seq 1 when no checkpoint was ever written. Refuses, writing nothing, when
/// checkpoints existed but none is usable, or when the result would end
/// below a certified seq (`cvol check --repair` salvages then).
pub fn recover(storage: &dyn Storage, sb: &Superblock) -> Result<Recovered, RecoveryError> {
    recover_with(storage, sb, Pages::Read)
}

/// `recover`, leaving the checkpoint's map pages on disk: the volume
/// faults them in (and verifies them) as it needs them. When both pointers
/// decode, the newest pointer's checkpoint is taken without reading its
/// pages or its directory blocks (but those holding tables): every record
/// its commit names was synced before the pointer was written, so no crash
/// can have damaged it (`Load::lazy_for`); each is verified when first
/// read (damage at rest: an error where the page is used, which `cvol
/// check` and scrub report). A fallback checkpoint's pages, and those of
/// the only pointer that decodes, are each read once now to verify them.
/// Roll-forward faults in the pages it changes.
pub fn recover_lazy(storage: &dyn Storage, sb: &Superblock) -> Result<Recovered, RecoveryError> {
    recover_with(storage, sb, Pages::Lazy)
}

/// `recover_lazy`, verifying every map page of the checkpoint it takes
/// (each read once, then dropped): repair (`cvol check --repair`) falls
/// back or salvages when one is damaged, where an open would take the
/// checkpoint and the page would read as an error when used.
pub fn recover_lazy_verified(
    storage: &dyn Storage,
    sb: &Superblock,
) -> Result<Recovered, RecoveryError> {
    recover_with(storage, sb, Pages::LazyVerified)
}

/// Rebuilds the map from the whole log, ignoring every checkpoint. Used by
/// `cvol check` to cross-check the checkpointed map.
pub fn replay_full(storage: &dyn Storage, sb: &Superblock) -> Result<Recovered, RecoveryError> {
    let index = first_record_index(storage, sb)?;
    let start = log_start(&index).ok_or(RecoveryError::NoLogStart)?;
    let mut map = volume_map(sb);
    let (r, _) = roll_forward(storage, sb, &mut map, start, &index, &HashMap::new())?;
    Ok(Recovered { map, ..r })
}

/// Salvages a volume whose recovery refused (`cvol check --repair`): from
/// the best checkpoint whose commit record is intact, every intact record
/// of the log applies in chain order, records after a damaged one
/// included; the blocks a damaged record held (named by its header) become
/// LOST — they read as EIO until written again — rather than silently
/// keeping an older version or zeros. A checkpoint whose chunks are all
/// intact and whose walk finds every record's blocks is preferred (exact);
/// otherwise the newest one, with the spans of its damaged chunks lost.
/// Without any usable checkpoint: the walk from the log's first record, or
/// else `rebuild_from_log`.
pub fn salvage(storage: &dyn Storage, sb: &Superblock) -> Result<Recovered, RecoveryError> {
    let scan = scan_log(storage, sb);
    let mut r = salvage_from(storage, sb, &scan)?;
    if r.salvage.as_ref().is_some_and(|s| s.unknown_records != [0]) {
        // (rebuild_from_log lists the damaged records itself.)
        for (s, at, e) in scan.damaged.iter().take(100) {
            r.warnings
                .push(format!("segment {s} at byte {at}: damaged record ({e})"));
        }
    }
    Ok(r)
}

#[cfg(test)]
mod tests;
