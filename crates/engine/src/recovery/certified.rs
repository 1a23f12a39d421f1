//! What the volume certified as flushed (`Certified`): the commit seqs of
//! the pointer slots, the flush mark, the seqs SYNCED records certify, and, when a pointer
//! slot is damaged, the newest complete checkpoint in the log. A recovery
//! never ends below it. Uses `superblock` (the pointer slots) and `scan`
//! (the whole-log scan).
use super::scan::{scan_log, LogScan};
use super::superblock::{damaged_pointer_slots, read_pointers};
use crate::logread::read_record;
use cvol_format::checkpoint::CommitPayload;
use cvol_format::flushmark::{FlushMark, FLUSH_MARK_BYTES, FLUSH_MARK_OFFSETS};
use cvol_format::record::{RecordKind, RECORD_HEADER_BYTES};
use cvol_format::{CheckpointPointer, Superblock};
use cvol_storage::Storage;

/// The highest seq the volume has certified as durable, and what proves it.
/// Records up to `seq` were on the media: a recovery that ends below it
/// would drop flushed data, so it is refused instead.
#[derive(Debug, Clone, Default)]
pub struct Certified {
    pub seq: u64,
    pub by: String,
}

impl Certified {
    /// Raises the certified seq to `seq` (`by` says what certifies it).
    pub(super) fn raise(&mut self, seq: u64, by: impl FnOnce() -> String) {
        if seq > self.seq {
            self.seq = seq;
            self.by = by();
        }
    }

    /// What the pointer slots certify: each slot that decodes was written
    /// only after the checkpoint it names was synced, so the log up to its
    /// commit seq was durable, even if that checkpoint is damaged now.
    pub(super) fn from_pointers(ptrs: &[CheckpointPointer]) -> Certified {
        let mut c = Certified::default();
        for p in ptrs {
            c.raise(p.commit_seq, || {
                format!(
                    "checkpoint pointer generation {} (commit seq {})",
                    p.generation, p.commit_seq
                )
            });
        }
        c
    }

    /// What the flush mark certifies (written only after the sync it
    /// names returned, outside the log: it survives damage to the log's
    /// tail that takes the SYNCED records along).
    pub(super) fn raise_from_flush_mark(&mut self, mark: Option<FlushMark>) {
        if let Some(m) = mark {
            self.raise(m.seq, || {
                format!("the flush mark (epoch {}, seq {})", m.epoch, m.seq)
            });
        }
    }

    /// What the log itself certifies: every SYNCED record (written only
    /// after the sync it names completed) and, when a pointer slot is
    /// damaged (it named some checkpoint, which one is unknown), the newest
    /// complete checkpoint in the log.
    pub(super) fn raise_from_scan(
        &mut self,
        storage: &dyn Storage,
        sb: &Superblock,
        scan: &LogScan,
    ) {
        for r in &scan.records {
            if let Some(n) = r.synced {
                self.raise(n, || {
                    format!(
                        "a SYNCED record (seq {}) in segment {}",
                        r.header.seq, r.segment
                    )
                });
            }
        }
        if damaged_pointer_slots(storage) == 0 {
            return;
        }
        let chunks: std::collections::HashSet<(u64, u32)> = scan
            .records
            .iter()
            .filter(|r| matches!(r.header.kind, RecordKind::MapChunk | RecordKind::MapDir))
            .map(|r| (sb.segment_offset(r.segment) + r.at as u64, r.header.crc))
            .collect();
        for c in scan
            .records
            .iter()
            .filter(|r| r.header.kind == RecordKind::CkptCommit)
        {
            let off = sb.segment_offset(c.segment) + c.at as u64;
            let complete = read_record(storage, sb, off, c.header.total_len() as u32)
                .ok()
                .and_then(|(_, rec)| CommitPayload::decode(&rec[RECORD_HEADER_BYTES..]).ok())
                .is_some_and(|cp| {
                    cp.chunks
                        .iter()
                        .all(|k| chunks.contains(&(k.offset, k.crc)))
                });
            if complete {
                self.raise(c.header.seq, || {
                    format!(
                        "the complete checkpoint with commit seq {} (a pointer slot that may \
                         have named it is damaged)",
                        c.header.seq
                    )
                });
            }
        }
    }
}

/// The highest certified seq found by reading the whole log (pointer
/// slots, every SYNCED record, the newest complete checkpoint when a slot
/// is damaged). Open looks only where the chain can lead; `check` and
/// repair, which read everything anyway, also catch damage that hides a
/// whole segment from the chain (its first records erased).
pub fn certified_in_log(storage: &dyn Storage, sb: &Superblock) -> Certified {
    let ptrs: Vec<CheckpointPointer> = read_pointers(storage).into_iter().flatten().collect();
    let mut c = Certified::from_pointers(&ptrs);
    c.raise_from_flush_mark(read_flush_mark(storage, sb));
    c.raise_from_scan(storage, sb, &scan_log(storage, sb));
    c
}

/// The flush mark that counts: of the slots that decode for this volume,
/// the highest (epoch, seq). None on a volume that never wrote one (older
/// versions left the slots zero) or when both are damaged.
pub(super) fn read_flush_mark(storage: &dyn Storage, sb: &Superblock) -> Option<FlushMark> {
    let tag = sb.volume_tag();
    let slot = |at: u64| {
        let mut b = vec![0u8; FLUSH_MARK_BYTES];
        storage.read_at(at, &mut b).ok()?;
        FlushMark::decode(&b, tag).ok()
    };
    FlushMark::newest(slot(FLUSH_MARK_OFFSETS[0]), slot(FLUSH_MARK_OFFSETS[1]))
}
