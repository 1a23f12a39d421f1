//! `cvol resize POOL --physical-size SIZE`: grow the store a pool may use
//! (a file is extended, sparse; a device must have grown), or shrink it
//! when nothing lies beyond the new end (a file is then cut). A pool's
//! table slots are numbered for the most segments its segment size allows
//! (docs/FORMAT.md), so only the superblock's physical size changes: both
//! copies, A then B, each synced; a crash between leaves A (the new size)
//! or, if A was torn, B (the old one), both whole volumes.
use crate::error::Error;
use crate::volfile::{self, Globals, Opened, Purpose};
use crate::words::human_bytes;
use crate::{control, size};
use cvol_engine::{OpenOptions, Volume};
use cvol_format::{Superblock, SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET};
use cvol_storage::{FileStorage, Storage};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

#[derive(clap::Args, Debug)]
pub struct ResizeFlags {
    /// The pool (a file or block device made by `cvol create`); it must not
    /// be served.
    pool: PathBuf,
    /// The store's new size (e.g. 64G), rounded down to whole segments:
    /// larger (a file is extended; a block device must already be that
    /// large) or smaller (refused while data or metadata lies beyond it).
    #[arg(long)]
    physical_size: String,
}

/// Free segments a shrink must leave, at least.
const SHRINK_FREE_MIN: u64 = 4;

fn refuse(path: &Path, why: impl std::fmt::Display) -> Error {
    Error::Refused(format!("{}: {why}", path.display()))
}

pub fn cmd_resize(f: ResizeFlags, _globals: &Globals) -> Result<ExitCode, Error> {
    let path = f.pool.as_path();
    if crate::objvol::url_of(path).is_some() {
        return Err(refuse(
            path,
            "a volume in an object store has no physical size to change",
        ));
    }
    let want = size::parse_size(&f.physical_size)?;
    if control::query(path, "stat").is_some() {
        return Err(refuse(
            path,
            "the pool is served: stop the server first (the store's size changes offline)",
        ));
    }
    let storage = Arc::new(volfile::open_volume_store(path, Purpose::Change)?);
    let (mut sb, _) = cvol_engine::read_superblock(&*storage).map_err(|e| refuse(path, e))?;
    if !sb.is_pool() {
        return Err(refuse(
            path,
            "this volume file was made before pools: its metadata is laid out for its size, \
             which cannot change; copy its data into a pool made by `cvol create` (nbdcopy)",
        ));
    }
    if sb.has_metadata_device() || sb.is_cache() {
        return Err(refuse(
            path,
            "a pool with a metadata device (or a cache) keeps its size: its metadata segments \
             are numbered after the data store's",
        ));
    }
    let seg = sb.segment_size_bytes;
    let new = want.saturating_sub(sb.data_offset_bytes) / seg * seg + sb.data_offset_bytes;
    let old = sb.physical_size_bytes;
    let mut next = sb.clone();
    next.physical_size_bytes = new;
    next.validate()
        .map_err(|e| refuse(path, format!("--physical-size {}: {e}", f.physical_size)))?;
    if new == old {
        println!(
            "{}: the store is already {}",
            path.display(),
            human_bytes(old)
        );
        return Ok(ExitCode::SUCCESS);
    }
    if new > old {
        grow_backing(path, &storage, new)?;
    } else {
        check_shrink(path, &storage, &sb, new)?;
    }
    sb.physical_size_bytes = new;
    write_superblocks(path, &*storage, &sb)?;
    if new < old && !storage.is_block_device() {
        set_file_len(path, new)?;
    }
    // Opened and closed at its new size: the segment tables, laid out for
    // the old one, are rebuilt from the map once, here, and saved. (The
    // store is opened again: its length changed.)
    drop(storage);
    let dynstore: Arc<dyn Storage> = Arc::new(volfile::open_volume_store(path, Purpose::Change)?);
    match volfile::open_with_progress(path, dynstore, crate::keyfile::open_options(), None) {
        Opened::Volume(v) => v
            .close()
            .map_err(|e| refuse(path, format!("closing: {e}")))?,
        Opened::Failed(e) => return Err(e),
        Opened::Stopped => unreachable!("no stop flag"),
    }
    println!(
        "{}: the store {} from {} to {}",
        path.display(),
        if new > old { "grew" } else { "shrank" },
        human_bytes(old),
        human_bytes(new)
    );
    Ok(ExitCode::SUCCESS)
}

fn set_file_len(path: &Path, len: u64) -> Result<(), Error> {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|f| f.set_len(len))
        .map_err(|e| Error::io(path.display(), e))
}

/// Extends a file to `new` bytes (sparse); a device must have them.
fn grow_backing(path: &Path, storage: &FileStorage, new: u64) -> Result<(), Error> {
    let have = if storage.is_block_device() {
        storage.len_bytes()
    } else {
        std::fs::metadata(path)
            .map_err(|e| Error::io(path.display(), e))?
            .len()
    };
    if have >= new {
        return Ok(());
    }
    if storage.is_block_device() {
        return Err(refuse(
            path,
            format!(
                "the device has {}; grow it first (e.g. lvextend), then resize the pool",
                human_bytes(have)
            ),
        ));
    }
    set_file_len(path, new)
}

/// A shrink to `new` bytes must leave every segment beyond it free, the
/// newest checkpoint before it, and some free room.
fn check_shrink(
    path: &Path,
    storage: &Arc<FileStorage>,
    sb: &Superblock,
    new: u64,
) -> Result<(), Error> {
    let keep = (new - sb.data_offset_bytes) / sb.segment_size_bytes;
    let dynstore: Arc<dyn Storage> = storage.clone();
    // Opened for writing and closed: the log is checkpointed where it is.
    let vol =
        match volfile::open_with_progress(path, dynstore, crate::keyfile::open_options(), None) {
            Opened::Volume(v) => *v,
            Opened::Failed(e) => return Err(e),
            Opened::Stopped => unreachable!("no stop flag"),
        };
    let checked = (|| -> Result<(), Error> {
        let (busy, commit_beyond) = vol.shrink_blockers(keep).map_err(|e| refuse(path, e))?;
        let stats = vol.stats();
        let dropped = sb.data_segment_count() - keep;
        let free_after = stats.segments_free.saturating_sub(dropped);
        if busy > 0 || commit_beyond {
            return Err(refuse(
                path,
                format!(
                    "{busy} segment(s) beyond {} hold data or metadata{}: the store cannot \
                     shrink below them yet (trim or delete data, let the cleaner empty the end, \
                     or choose a larger size)",
                    human_bytes(new),
                    if commit_beyond {
                        " (the newest checkpoint among them)"
                    } else {
                        ""
                    }
                ),
            ));
        }
        if free_after < SHRINK_FREE_MIN {
            return Err(refuse(
                path,
                format!(
                    "at {} the pool would have {free_after} free segment(s) left; it needs \
                     {SHRINK_FREE_MIN} at least",
                    human_bytes(new)
                ),
            ));
        }
        Ok(())
    })();
    let closed = vol
        .close()
        .map_err(|e| refuse(path, format!("closing: {e}")));
    drop(vol);
    checked?;
    closed?;
    // The close's checkpoint must not have moved the log beyond the end.
    let again: Arc<dyn Storage> = storage.clone();
    let opts = OpenOptions {
        read_only: true,
        ..crate::keyfile::open_options()
    };
    let vol = Volume::open(again, opts).map_err(|e| refuse(path, e))?;
    let (busy, commit_beyond) = vol.shrink_blockers(keep).map_err(|e| refuse(path, e))?;
    if busy > 0 || commit_beyond {
        return Err(refuse(
            path,
            "the pool's log moved beyond the new end while it closed; try again",
        ));
    }
    Ok(())
}

/// Writes both superblock copies (A, synced, then B, synced).
fn write_superblocks(path: &Path, storage: &dyn Storage, sb: &Superblock) -> Result<(), Error> {
    let enc = sb.encode();
    for off in [SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET] {
        storage
            .write_at(off, &enc)
            .and_then(|()| storage.sync())
            .map_err(|e| Error::io(format!("{}: writing the superblock", path.display()), e))?;
    }
    Ok(())
}
