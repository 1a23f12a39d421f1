//! What a path names, before the engine sees it: every command finds out
//! here whether it was given a volume at all (exit 2 if not), whether the
//! backing store is as long as the volume says, and opens it with progress
//! on the terminal's stderr when that takes a while.
use crate::error::Error;
use crate::words::human_bytes;
use cvol_engine::{OpenError, OpenOptions, Volume};
use cvol_format::superblock::{SUPERBLOCK_BYTES, SUPERBLOCK_MAGIC};
use cvol_format::{Superblock, SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET};
use cvol_storage::{FileStorage, Storage};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a volume may live on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    BlockDevice,
}

/// `path` must exist and be a regular file or a block device (symlinks
/// followed). Anything else is an error naming what it is.
pub fn existing_kind(path: &Path) -> Result<Kind, Error> {
    let md = std::fs::metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::Refused(format!("{}: no such file", path.display())),
        _ => Error::io(path.display(), e),
    })?;
    kind_of(path, &md)
}

pub fn kind_of(path: &Path, md: &std::fs::Metadata) -> Result<Kind, Error> {
    let ft = md.file_type();
    if ft.is_file() {
        Ok(Kind::File)
    } else if ft.is_block_device() {
        Ok(Kind::BlockDevice)
    } else if ft.is_dir() {
        Err(Error::Refused(format!(
            "{} is a directory, not a volume",
            path.display()
        )))
    } else {
        Err(Error::Refused(format!(
            "{} is not a regular file or a block device (a volume lives in one)",
            path.display()
        )))
    }
}

/// What the first bytes of a backing store say.
pub enum Header {
    /// A superblock copy decodes; the store is long enough for it.
    Volume,
    /// The store ends before the volume does (truncated or an incomplete
    /// copy). The message says so plainly.
    Short(String),
    /// A superblock magic is there but neither copy decodes: a damaged
    /// volume (the engine and `check` say what is wrong with it).
    Damaged,
}

/// Reads the superblock copies the way the engine does (A first, then B).
/// Something without the cvol magic in either place is not a volume: an
/// error (exit 2) naming the problem, before anything else is tried.
pub fn read_header(path: &Path, storage: &FileStorage, kind: Kind) -> Result<Header, Error> {
    let len = storage.len_bytes();
    let mut magic_seen = false;
    for off in [SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET] {
        let mut b = vec![0u8; SUPERBLOCK_BYTES];
        if off + SUPERBLOCK_BYTES as u64 > len || storage.read_at(off, &mut b).is_err() {
            continue;
        }
        magic_seen |= b[..8] == SUPERBLOCK_MAGIC;
        if let Ok(sb) = Superblock::decode(&b) {
            if sb.physical_size_bytes > len {
                return Ok(Header::Short(short_message(
                    kind,
                    sb.physical_size_bytes,
                    len,
                )));
            }
            return Ok(Header::Volume);
        }
    }
    if magic_seen {
        return Ok(Header::Damaged);
    }
    Err(Error::Refused(if len == 0 {
        format!("{} is empty, not a cvol volume", path.display())
    } else {
        format!(
            "{} is not a cvol volume (no cvol superblock at byte {SUPERBLOCK_A_OFFSET} or {SUPERBLOCK_B_OFFSET})",
            path.display()
        )
    }))
}

fn short_message(kind: Kind, volume_bytes: u64, have: u64) -> String {
    match kind {
        Kind::File => format!(
            "the file is {} bytes shorter than the volume ({have} of {volume_bytes} bytes); \
             was it truncated or copied incompletely?",
            volume_bytes - have
        ),
        Kind::BlockDevice => format!(
            "the device is {} bytes smaller than the volume ({have} of {volume_bytes} bytes); \
             is it the right device?",
            volume_bytes - have
        ),
    }
}

/// Why a command wants the store: the words of the "served" refusal.
#[derive(Clone, Copy)]
pub enum Purpose {
    /// stat, offline scrub: shared lock, read-only.
    Read,
    /// check: shared lock, read-only.
    Check,
    /// check --repair: exclusive lock, writable.
    Repair,
    /// serve: exclusive lock.
    Serve { writable: bool },
    /// `cvol volume` on a pool nobody serves: exclusive lock, writable.
    Change,
}

/// Opens the backing store of an existing volume (taking its lock) after
/// the path checks; the header is read by the caller.
pub fn open_store(path: &Path, purpose: Purpose) -> Result<(FileStorage, Kind), Error> {
    let kind = existing_kind(path)?;
    let (writable, exclusive) = match purpose {
        Purpose::Read | Purpose::Check => (false, false),
        Purpose::Repair | Purpose::Change => (true, true),
        Purpose::Serve { writable } => (writable, true),
    };
    let st = FileStorage::open(path, writable, exclusive).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock => Error::Refused(match purpose {
            Purpose::Read => format!(
                "{}: in use by a cvol process whose control socket could not be reached ({e})",
                path.display()
            ),
            Purpose::Check => format!(
                "{}: the volume is being served; stop the server to check it",
                path.display()
            ),
            Purpose::Repair => format!(
                "{}: the volume is being served; stop the server to repair it",
                path.display()
            ),
            Purpose::Serve { .. } => format!("{}: {e}", path.display()),
            Purpose::Change => format!(
                "{}: in use by a cvol process whose control socket could not be reached ({e})",
                path.display()
            ),
        }),
        _ => Error::io(path.display(), e),
    })?;
    if let Purpose::Serve { .. } = purpose {
        warn_if_shared(path, &st, kind);
    }
    Ok((st, kind))
}

/// Logs a warning when other users may read or write a volume file a
/// server opened: they can read the stored data, and a process that can
/// open the file can hold a lock that keeps the next server from starting
/// (`cvol create` makes files 0600). A block device is judged by what
/// users outside its group may do (group `disk` is the norm).
fn warn_if_shared(path: &Path, st: &FileStorage, kind: Kind) {
    let Ok(mode) = st.mode() else { return };
    let shared = match kind {
        Kind::File => mode & 0o066,
        Kind::BlockDevice => mode & 0o006,
    };
    if shared != 0 {
        tracing::warn!(
            "{} is mode {mode:04o}: other users may {} it (its data, and a lock that keeps a \
             server from starting); make it private: chmod {} {}",
            path.display(),
            if shared & 0o022 != 0 {
                "read and write"
            } else {
                "read"
            },
            match kind {
                Kind::File => "600",
                Kind::BlockDevice => "o-rw",
            },
            path.display()
        );
    }
}

/// Opens the store and refuses (exit 2) what is not a volume, is shorter
/// than the volume or has no intact superblock: for the commands that open
/// it (stat, scrub, serve).
pub fn open_volume_store(path: &Path, purpose: Purpose) -> Result<FileStorage, Error> {
    let (st, kind) = open_store(path, purpose)?;
    match read_header(path, &st, kind)? {
        Header::Short(m) => Err(Error::Refused(format!("{}: {m}", path.display()))),
        Header::Damaged => Err(Error::Refused(format!(
            "{}: a cvol volume whose superblock copies are both damaged; \
             `cvol check` lists what else is wrong",
            path.display()
        ))),
        Header::Volume => Ok(st),
    }
}

/// The global flags, which every command is given with its own
/// (`cvol --metadata-device PATH COMMAND ...`).
#[derive(Clone, Debug, Default)]
pub struct Globals {
    /// `--metadata-device`, when given: with `create`, where the metadata
    /// goes; else the metadata device to open instead of the path the
    /// volume recorded at create (a device renamed since).
    pub metadata_device: Option<PathBuf>,
}

/// Do two paths name the same file (device and inode)?
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// The volume's store as the engine opens it: the data store joined with
/// the volume's metadata device when it has one (`--metadata-device`, else
/// the path recorded at create), opened and locked like the volume. Sets
/// `options.metadata_device_path` to where it was found.
pub fn with_metadata(
    path: &Path,
    data: FileStorage,
    purpose: Purpose,
    globals: &Globals,
    options: &mut OpenOptions,
) -> Result<Arc<dyn Storage>, Error> {
    let given = globals.metadata_device.as_deref();
    let mut asked = false;
    let mut opened = None;
    let joined = cvol_engine::volume::metadev::open_stores(Arc::new(data), |recorded| {
        asked = true;
        let refuse = |m: String| cvol_engine::VolError::from(OpenError::MetadataDevice(m));
        let m = match (given, recorded) {
            (Some(g), _) => g.to_path_buf(),
            (None, Some(r)) => PathBuf::from(r),
            (None, None) => {
                return Err(refuse(
                    "its path could not be read from the volume: pass --metadata-device PATH"
                        .into(),
                ))
            }
        };
        if same_file(path, &m) {
            return Err(refuse(format!("{} is the volume itself", m.display())));
        }
        opened = std::path::absolute(&m).ok();
        let (st, _) = open_store(&m, purpose).map_err(|e| match given {
            None => refuse(format!(
                "{e} (the path recorded at create; if the device moved, pass \
                 --metadata-device PATH)"
            )),
            Some(_) => refuse(e.to_string()),
        })?;
        Ok(Arc::new(st) as Arc<dyn Storage>)
    })
    .map_err(|e| Error::Refused(format!("{}: {e}", path.display())))?;
    if let (Some(g), false) = (given, asked) {
        return Err(Error::Refused(format!(
            "{}: --metadata-device {} given, but the volume keeps its metadata in itself",
            path.display(),
            g.display()
        )));
    }
    options.metadata_device_path = opened.map(|p| p.to_string_lossy().into_owned());
    Ok(joined)
}

/// Opens a volume nobody serves, read-only (`stat`, offline `scrub`).
pub fn open_read_only(
    path: &Path,
    read_cache_bytes: Option<u64>,
    globals: &Globals,
) -> Result<Volume, Error> {
    if let Some(url) = crate::objvol::url_of(path) {
        return crate::objvol::open_read_only(url, read_cache_bytes);
    }
    let storage = open_volume_store(path, Purpose::Read)?;
    let mut options = OpenOptions {
        read_only: true,
        read_cache_bytes,
        ..crate::keyfile::open_options()
    };
    let storage = with_metadata(path, storage, Purpose::Read, globals, &mut options)?;
    match open_with_progress(path, storage, options, None) {
        Opened::Volume(v) => Ok(*v),
        Opened::Failed(e) => Err(e),
        Opened::Stopped => unreachable!("no stop flag"),
    }
}

/// The outcome of [`open_with_progress`].
pub enum Opened {
    Volume(Box<Volume>),
    Failed(Error),
    /// `stop` was raised (SIGTERM/SIGINT) before the open finished.
    Stopped,
}

/// An open that takes longer than this is announced, then reported every
/// [`PROGRESS_EVERY`].
const SLOW_OPEN: Duration = Duration::from_secs(2);
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Opens the volume on a thread of its own, logging progress while it
/// takes long (recovery reads every segment header of a large volume)
/// and returning at once when `stop` is raised: the open is abandoned
/// (crash-safe: it reads, and its only writes are an epoch record a
/// crash could cut just as well).
pub fn open_with_progress(
    path: &Path,
    storage: Arc<dyn Storage>,
    options: OpenOptions,
    stop: Option<&AtomicBool>,
) -> Opened {
    let size = storage.len_bytes();
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("cvol-open".into())
        .spawn(move || {
            let _ = tx.send(Volume::open(storage, options));
        });
    if let Err(e) = spawned {
        return Opened::Failed(Error::io("cannot start the open", e));
    }
    let start = Instant::now();
    let mut next_note = start + SLOW_OPEN;
    loop {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(r) => {
                let took = start.elapsed();
                if took >= SLOW_OPEN {
                    tracing::info!("{}: opened in {:.1} s", path.display(), took.as_secs_f64());
                }
                return match r {
                    Ok(v) => Opened::Volume(Box::new(v)),
                    Err(e) => Opened::Failed(Error::Refused(format!("{}: {e}", path.display()))),
                };
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Opened::Failed(Error::Refused(format!(
                    "{}: the open failed",
                    path.display()
                )))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        if stop.is_some_and(|s| s.load(Ordering::SeqCst)) {
            return Opened::Stopped;
        }
        let now = Instant::now();
        if now >= next_note {
            tracing::info!(
                "{}: still opening after {} s (recovery reads the metadata of {} of backing store)",
                path.display(),
                (now - start).as_secs(),
                human_bytes(size)
            );
            next_note = now + PROGRESS_EVERY;
        }
    }
}
