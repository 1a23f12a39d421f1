//! A pool's store grows or shrinks while the pool is open (`cvol resize
//! POOL --physical-size`, offline or through its server).
//!
//! A pool's directory numbers its table slots for the most segments its
//! segment size allows (docs/FORMAT.md, "Table slots of a pool"), so on
//! the store only the superblock's physical size changes: copy A, synced,
//! then copy B, synced. In memory every per-segment book follows (the
//! segment table, live bytes, liveness and fingerprint table books,
//! compaction hints, the dedup hook generations), and the superblock the
//! volume reads its geometry from is replaced, all under the state lock:
//! writers, the space checks and statistics see the old size or the new.
//!
//! Order, so that a crash anywhere opens the pool at the old size or the
//! new one with every flushed write:
//! - grow: the file is extended (a device must have the room), the
//!   superblocks are written, and only then may the log head open a new
//!   segment;
//! - shrink: the segments beyond the new end must be free (no record
//!   recovery needs, not the log head) and leave `SHRINK_FREE_MIN_SEGMENTS`
//!   free; they are dropped from the books first (nothing may open them),
//!   then the superblocks are written, then a file is cut.
//!
//! The cleaner lock (no cleaning pass moves records meanwhile) and the
//! checkpoint lock (no checkpoint holds a snapshot of the old books, and
//! no commit moves the checkpoint pointer) are held throughout; client
//! writes go on except for the short step under the state lock. A
//! checkpoint whose tables were taken at the old size is not a problem:
//! its root names the old segment count, and an open that finds it so
//! rebuilds the tables from the map.
use super::Volume;
use crate::error::VolError;
use cvol_format::{FormatError, Superblock, SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET};
use std::fmt;

/// Free segments a shrink must leave, at least (room for the log head,
/// a checkpoint and the cleaner to go on).
pub const SHRINK_FREE_MIN_SEGMENTS: u64 = 4;

/// Why a physical resize was refused or failed.
#[derive(Debug)]
pub enum ResizeError {
    /// This volume's store cannot change size (the reason).
    Unsupported(&'static str),
    /// The size gives no valid store.
    Size(FormatError),
    /// The store could not take the new size (a device smaller than it).
    Backing(std::io::Error),
    /// Segments at or beyond `end` (bytes) hold records, or the newest
    /// checkpoint's commit lies there.
    Busy {
        segments: u64,
        commit: bool,
        end: u64,
    },
    /// The shrink would leave `free_after` free segments, too few.
    TooFull {
        free_after: u64,
        end: u64,
    },
    Vol(VolError),
}

impl From<VolError> for ResizeError {
    fn from(e: VolError) -> ResizeError {
        ResizeError::Vol(e)
    }
}

impl ResizeError {
    /// A refusal (nothing changed; the user can act on it), as opposed to
    /// an I/O failure or a stopped volume.
    pub fn is_refusal(&self) -> bool {
        !matches!(self, ResizeError::Vol(VolError::Io(_) | VolError::Poisoned))
    }
}

impl fmt::Display for ResizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: &u64| b >> 20;
        match self {
            ResizeError::Unsupported(why) => f.write_str(why),
            ResizeError::Size(e) => write!(f, "no valid store at that size: {e}"),
            ResizeError::Backing(e) => write!(
                f,
                "the store cannot take that size ({e}); a block device must be grown first \
                 (e.g. lvextend), then the pool resized"
            ),
            ResizeError::Busy {
                segments,
                commit,
                end,
            } => write!(
                f,
                "{segments} segment(s) beyond {} MiB hold data or metadata{}: the store \
                 cannot shrink below them yet (trim or delete data, let the cleaner empty \
                 the end, or choose a larger size)",
                mib(end),
                if *commit {
                    " (the newest checkpoint among them)"
                } else {
                    ""
                }
            ),
            ResizeError::TooFull { free_after, end } => write!(
                f,
                "at {} MiB the pool would have {free_after} free segment(s) left; it needs \
                 {SHRINK_FREE_MIN_SEGMENTS} at least",
                mib(end)
            ),
            ResizeError::Vol(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ResizeError {}

/// Why the store of `sb`'s volume cannot change size, if it cannot.
pub fn resize_unsupported(sb: &Superblock) -> Option<ResizeError> {
    if !sb.is_pool() {
        return Some(ResizeError::Unsupported(
            "this volume was made before pools: its metadata is laid out for its size, \
             which cannot change; copy its data into a pool made by `cvol create` (nbdcopy)",
        ));
    }
    if sb.has_metadata_device() || sb.is_cache() {
        return Some(ResizeError::Unsupported(
            "a pool with a metadata device (or a cache) keeps its size: its metadata \
             segments are numbered after the data store's",
        ));
    }
    None
}

impl Volume {
    /// Makes the pool's store `want` bytes (rounded down to whole
    /// segments) while it is open: see the module. Returns the old size
    /// and the new one (equal: nothing to do).
    pub fn resize_physical(&self, want: u64) -> Result<(u64, u64), ResizeError> {
        if let Some(e) = resize_unsupported(&self.sb) {
            return Err(e);
        }
        self.check_writable()?;
        let _cleaner = self.lock_cleaner()?;
        let _checkpoint = self.lock_checkpoint()?;
        let mut next: Superblock = (*self.sb).clone();
        let (seg, base) = (next.segment_size_bytes, next.data_offset_bytes);
        next.physical_size_bytes = want.saturating_sub(base) / seg * seg + base;
        next.validate().map_err(ResizeError::Size)?;
        let (old, new) = (self.sb.physical_size_bytes, next.physical_size_bytes);
        match new.cmp(&old) {
            std::cmp::Ordering::Equal => {}
            std::cmp::Ordering::Greater => self.grow_store(next)?,
            std::cmp::Ordering::Less => self.shrink_store(next)?,
        }
        Ok((old, new))
    }

    fn grow_store(&self, next: Superblock) -> Result<(), ResizeError> {
        let new = next.physical_size_bytes;
        if self.storage.len_bytes() < new {
            self.storage.set_len(new).map_err(ResizeError::Backing)?;
        }
        self.write_superblocks(&next)?;
        let mut st = self.lock_state()?;
        self.adopt(&mut st, next);
        Ok(())
    }

    fn shrink_store(&self, next: Superblock) -> Result<(), ResizeError> {
        let keep = next.data_segment_count();
        let end = next.physical_size_bytes;
        // The checkpoint lock is held: the pointers stay as they are.
        let commit = crate::recovery::read_pointers(&*self.storage)
            .iter()
            .flatten()
            .max_by_key(|p| p.generation)
            .is_some_and(|p| p.commit_offset >= end);
        {
            let mut st = self.lock_state()?;
            let segs = &st.log.segments;
            let busy = (keep..segs.count())
                .filter(|&s| segs.state(s) != crate::segments::SegState::Free)
                .count() as u64;
            if busy > 0 || commit {
                return Err(ResizeError::Busy {
                    segments: busy,
                    commit,
                    end,
                });
            }
            let free_after = segs.free_count() - (segs.count() - keep);
            if free_after < SHRINK_FREE_MIN_SEGMENTS {
                return Err(ResizeError::TooFull { free_after, end });
            }
            // Nothing opens a segment beyond the end from here on: if the
            // superblocks cannot be written, the pool stays smaller in
            // memory than on the store, which is safe either way.
            self.adopt(&mut st, next.clone());
        }
        self.write_superblocks(&next)?;
        self.storage
            .set_len(end)
            .map_err(|e| ResizeError::Vol(VolError::Io(e)))
    }

    /// An open for writing finishes a resize a crash cut between the two
    /// superblock copies: copy B is rewritten from copy A (the one the
    /// volume opened with) when they differ in the physical size alone.
    /// Left so, a torn copy A at the next resize would bring back B's old
    /// size with records beyond it. (Copies that differ otherwise are
    /// damage, for `cvol check --repair`.)
    pub(super) fn finish_resize(&self) -> Result<(), VolError> {
        let mut b = vec![0u8; cvol_format::superblock::SUPERBLOCK_BYTES];
        let Ok(copy_b) = (self.storage.read_at(SUPERBLOCK_B_OFFSET, &mut b))
            .map_err(drop)
            .and_then(|()| Superblock::decode(&b).map_err(drop))
        else {
            return Ok(());
        };
        let size = self.sb.physical_size_bytes;
        let mut same = copy_b.clone();
        same.physical_size_bytes = size;
        if copy_b.physical_size_bytes == size || same.encode() != self.sb.encode() {
            return Ok(());
        }
        let r = (self
            .storage
            .write_at(SUPERBLOCK_B_OFFSET, &self.sb.encode()))
        .and_then(|()| self.storage.sync());
        self.guard(r.map_err(VolError::Io))?;
        tracing::info!(
            from = copy_b.physical_size_bytes,
            to = size,
            "superblock copy B given copy A's physical size (a resize was cut short)"
        );
        Ok(())
    }

    /// Writes both superblock copies (A, synced, then B, synced): a crash
    /// between leaves A (the new size) or, if A was torn, B (the old one).
    /// An I/O error stops the volume, as any on its store does.
    fn write_superblocks(&self, sb: &Superblock) -> Result<(), VolError> {
        let enc = sb.encode();
        for at in [SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET] {
            let r = (self.storage.write_at(at, &enc)).and_then(|()| self.storage.sync());
            self.guard(r.map_err(VolError::Io))?;
        }
        Ok(())
    }

    /// Makes `next` the volume's superblock and every per-segment book
    /// its segment count's (under the state lock, `st`). The caller
    /// checked that every segment dropped is free.
    fn adopt(&self, st: &mut super::State, next: Superblock) {
        let count = next.data_segment_count();
        st.log
            .segments
            .resize_data(count)
            .expect("the segments dropped are free");
        st.live.set_segment_count(count);
        if self.options.warm_segments.is_none() && self.storage.overwrite_is_cheaper() {
            let warm = crate::segments::SegmentTable::warm_max_for(&next);
            st.log.segments.set_warm_max(warm);
        }
        if let Some(d) = &self.dedup {
            if let Ok(mut index) = self.note_poison(d.index.lock()) {
                index.grow_segments(count);
            }
        }
        self.sb.replace(next);
        tracing::info!(
            physical_size_bytes = self.sb.physical_size_bytes,
            segments = count,
            "the store changed size"
        );
    }
}
