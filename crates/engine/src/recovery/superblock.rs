//! The fixed places at the start of the store: the two superblock copies
//! (`read_superblock`, `repair_superblocks`), the metadata device a volume
//! may keep its map on (`require_metadata_device`), and the two checkpoint
//! pointer slots (`read_pointers`, `pointers_newest_first`,
//! `damaged_pointer_slots`). Uses no sibling room.
use crate::error::{RecoveryError, SuperblockCopyError};
use cvol_format::pointer::POINTER_BYTES;
use cvol_format::{CheckpointPointer, Superblock};
use cvol_storage::Storage;

/// The superblock: copy A, else copy B (with a warning naming what is
/// wrong with A). A copy that decodes is used even if it claims more bytes
/// than the backing store has: that fails the open.
pub fn read_superblock(storage: &dyn Storage) -> Result<(Superblock, Vec<String>), RecoveryError> {
    let mut warnings = Vec::new();
    let mut errors = Vec::new();
    for (name, off) in [
        ("A", cvol_format::SUPERBLOCK_A_OFFSET),
        ("B", cvol_format::SUPERBLOCK_B_OFFSET),
    ] {
        let mut b = vec![0u8; cvol_format::superblock::SUPERBLOCK_BYTES];
        let res = storage
            .read_at(off, &mut b)
            .map_err(SuperblockCopyError::Read)
            .and_then(|_| Superblock::decode(&b).map_err(SuperblockCopyError::Invalid));
        match res {
            Ok(sb) => {
                if sb.physical_size_bytes > storage.len_bytes() {
                    return Err(RecoveryError::SuperblockBeyondBacking {
                        physical_size_bytes: sb.physical_size_bytes,
                        backing_bytes: storage.len_bytes(),
                    });
                }
                return Ok((sb, warnings));
            }
            Err(e) => {
                warnings.push(format!("superblock copy {name} unusable: {e}"));
                errors.push(e);
            }
        }
    }
    let [copy_a, copy_b]: [SuperblockCopyError; 2] =
        errors.try_into().expect("both copies were tried");
    Err(RecoveryError::NoSuperblock { copy_a, copy_b })
}

/// Refuses a store that lacks the volume's metadata device (the data store
/// alone, of a volume that has one): its map would be out of reach.
pub fn require_metadata_device(
    storage: &dyn Storage,
    sb: &Superblock,
) -> Result<(), RecoveryError> {
    let end = sb.metadata_base() + u64::from(sb.metadata_segments) * sb.segment_size_bytes;
    if sb.has_metadata_device() && storage.len_bytes() < end {
        return Err(RecoveryError::MetadataDeviceMissing {
            segments: sb.metadata_segments,
        });
    }
    Ok(())
}

/// The pointer slots that decode (and name their own slot), by slot.
pub fn read_pointers(storage: &dyn Storage) -> [Option<CheckpointPointer>; 2] {
    let mut out = [None, None];
    for (slot, o) in out.iter_mut().enumerate() {
        let mut b = vec![0u8; POINTER_BYTES];
        if storage
            .read_at(CheckpointPointer::slot_offset(slot), &mut b)
            .is_ok()
        {
            *o = CheckpointPointer::decode(&b)
                .ok()
                .filter(|p| p.slot() == slot);
        }
    }
    out
}

/// The valid pointer slots, newest generation first.
pub(super) fn pointers_newest_first(storage: &dyn Storage) -> Vec<CheckpointPointer> {
    let mut ptrs: Vec<CheckpointPointer> = read_pointers(storage).into_iter().flatten().collect();
    ptrs.sort_by_key(|p| std::cmp::Reverse(p.generation));
    ptrs
}

/// Pointer slots that hold bytes but no valid pointer.
pub(super) fn damaged_pointer_slots(storage: &dyn Storage) -> usize {
    (0..2)
        .filter(|&slot| {
            let mut b = vec![0u8; POINTER_BYTES];
            match storage.read_at(CheckpointPointer::slot_offset(slot), &mut b) {
                Err(_) => true,
                Ok(()) => {
                    b.iter().any(|&x| x != 0)
                        && CheckpointPointer::decode(&b)
                            .ok()
                            .filter(|p| p.slot() == slot)
                            .is_none()
                }
            }
        })
        .count()
}

/// Rewrites a damaged superblock copy from the intact one. Returns what it did.
pub fn repair_superblocks(storage: &dyn Storage) -> Result<Vec<String>, RecoveryError> {
    let offs = [
        cvol_format::SUPERBLOCK_A_OFFSET,
        cvol_format::SUPERBLOCK_B_OFFSET,
    ];
    let read = |off: u64| -> Option<Superblock> {
        let mut b = vec![0u8; cvol_format::superblock::SUPERBLOCK_BYTES];
        storage.read_at(off, &mut b).ok()?;
        Superblock::decode(&b).ok()
    };
    let copies = [read(offs[0]), read(offs[1])];
    let Some(good) = copies.iter().flatten().next().cloned() else {
        return Err(RecoveryError::BothSuperblocksDamaged);
    };
    let mut notes = Vec::new();
    for (i, c) in copies.iter().enumerate() {
        if c.as_ref() != Some(&good) {
            storage
                .write_at(offs[i], &good.encode())
                .map_err(RecoveryError::RepairIo)?;
            notes.push(format!(
                "superblock copy {} rewritten from copy {}",
                ["A", "B"][i],
                ["B", "A"][i]
            ));
        }
    }
    if !notes.is_empty() {
        storage.sync().map_err(RecoveryError::RepairIo)?;
    }
    Ok(notes)
}
