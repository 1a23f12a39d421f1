//! `cvol create`: every limit is checked before any file is touched, and a
//! create that fails leaves nothing behind (no file, no directory, an
//! empty file it was given stays empty).
use crate::error::Error;
use crate::volfile::{self, Globals, Kind};
use crate::words::{describe_policy, human_bytes};
use crate::{origin, size, words};
use cvol_cache::{CacheConfig, CacheMode, OriginStamp, CACHE_LINE_DEFAULT_BYTES};
use cvol_engine::{CreateOptions, Encryption, Volume};
use cvol_format::seal::Cipher;
use cvol_format::superblock::{Packing, SEGMENT_SIZE_MAX_BYTES, SEGMENT_SIZE_MIN_BYTES};
use cvol_format::{DATA_OFFSET_BYTES, LOGICAL_SIZE_MAX_BYTES, PHYSICAL_SIZE_MAX_BYTES};
use cvol_storage::{FileStorage, Storage};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

/// Metadata area plus two 1 MiB segments.
const MIN_PHYSICAL_BYTES: u64 = DATA_OFFSET_BYTES + 2 * SEGMENT_SIZE_MIN_BYTES;

/// `cvol create`'s command line.
#[derive(clap::Args)]
pub struct CreateFlags {
    /// The file to create (its directory must exist) or block device to format.
    pub volume: PathBuf,
    /// Logical size clients see (e.g. 64M, 16G, 1T); may exceed the physical size.
    /// A cache (--origin) takes its origin's size instead.
    #[arg(long, required_unless_present = "origin", conflicts_with = "origin")]
    pub size: Option<String>,
    /// Backing bytes the volume may use (default: the file's --size, or the device size).
    #[arg(long)]
    pub physical_size: Option<String>,
    #[arg(long, default_value = "auto", help = words::codec_help())]
    pub codec: String,
    /// Overwrite an existing volume or non-empty file.
    #[arg(long)]
    pub force: bool,
    /// Inline deduplication of 4 KiB blocks: on or off.
    #[arg(long, default_value = "on", value_parser = words::choice::<words::OnOff>())]
    pub dedup: words::OnOff,
    /// How compressed records are laid out in the log:
    /// compact (back to back, byte-granular: the least space), page (a
    /// record never straddles a 4 KiB page it need not: a block read
    /// touches one page; first-fit bin-packing within each write) or
    /// page-sorted (page, largest records placed first). Chunk-based
    /// packing is serve's --unit-size. Fixed at create.
    #[arg(long, default_value = "compact", value_parser = words::choice::<PackingWord>())]
    pub packing: PackingWord,
    /// Segment size (power of two, 1M to 1G; default 4M, or 1M below 1 GiB physical).
    #[arg(long, hide = true)]
    pub segment_size: Option<String>,
    /// Size of a --metadata-device file (default: 1/64 of --size, at
    /// least 16 segments); a block device is used whole.
    #[arg(long, requires = "metadata_device")]
    pub metadata_size: Option<String>,
    /// Make a compressed cache in front of this slow origin: a file, a
    /// block device, or an NBD URI (nbd://HOST[:PORT]/EXPORT,
    /// nbd+unix:///EXPORT?socket=PATH). Its logical size is the
    /// origin's; --physical-size is the cache's room on this device.
    #[arg(long, value_name = "ORIGIN")]
    pub origin: Option<String>,
    /// write-through (default: the origin gets every write first) or
    /// write-back (writes stay in the cache until written back).
    #[arg(long, value_parser = words::choice::<CacheModeWord>())]
    pub cache_mode: Option<CacheModeWord>,
    /// The unit a miss reads from the origin and fills (power of two, 4K to 1M).
    #[arg(long)]
    pub line_size: Option<String>,
    /// Object-store volume: create it even if the store does not honour
    /// create-only PUTs (If-None-Match), which single-writer fencing
    /// needs. Unsafe: only one server may then ever write the volume
    /// at a time (serve needs the flag too).
    #[arg(long)]
    pub unsafe_no_fencing: bool,
    /// Encrypt every record and all metadata at rest with this AEAD
    /// (aes-256-gcm or chacha20-poly1305), keeping dedup (by keyed
    /// fingerprints) and compression. Needs --key-file: the volume's
    /// random data key is wrapped under it. Fixed at create.
    #[arg(long, value_name = "CIPHER", value_parser = words::choice::<CipherWord>())]
    pub encryption: Option<CipherWord>,
}

/// `--encryption`'s words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CipherWord {
    #[value(name = "aes-256-gcm")]
    Aes256Gcm,
    #[value(name = "chacha20-poly1305")]
    Chacha20Poly1305,
}

impl CipherWord {
    pub fn cipher(self) -> Cipher {
        match self {
            CipherWord::Aes256Gcm => Cipher::Aes256Gcm,
            CipherWord::Chacha20Poly1305 => Cipher::ChaCha20Poly1305,
        }
    }
}

/// `--packing`'s words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PackingWord {
    Compact,
    Page,
    PageSorted,
}

impl PackingWord {
    fn packing(self) -> Packing {
        match self {
            PackingWord::Compact => Packing::Compact,
            PackingWord::Page => Packing::Page,
            PackingWord::PageSorted => Packing::PageSorted,
        }
    }
}

/// `--cache-mode`'s words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CacheModeWord {
    WriteThrough,
    WriteBack,
}

impl CacheModeWord {
    fn mode(self) -> CacheMode {
        match self {
            CacheModeWord::WriteThrough => CacheMode::WriteThrough,
            CacheModeWord::WriteBack => CacheMode::WriteBack,
        }
    }
}

/// `cvol create`: checks the flags that need each other, then creates.
pub fn cmd_create(f: &CreateFlags, globals: &Globals) -> Result<ExitCode, Error> {
    if f.unsafe_no_fencing && crate::objvol::url_of(&f.volume).is_none() {
        return Err(Error::Usage(format!(
            "--unsafe-no-fencing is for a volume in an object store (s3://BUCKET/PREFIX), \
             not {}",
            f.volume.display()
        )));
    }
    // `--size` conflicts with `--origin`, so clap's `requires`
    // cannot be used for these: checked here.
    if f.origin.is_none() {
        for (flag, given) in [
            ("--cache-mode", f.cache_mode.is_some()),
            ("--line-size", f.line_size.is_some()),
        ] {
            if given {
                return Err(Error::Refused(format!(
                    "{flag} is for a cache: give --origin too"
                )));
            }
        }
    }
    let args = CreateArgs {
        size: f.size.as_deref().unwrap_or_default(),
        cache: f.origin.as_deref().map(|o| CacheArgs {
            origin: o,
            mode: f
                .cache_mode
                .map_or(CacheMode::WriteThrough, CacheModeWord::mode),
            line_size: f.line_size.as_deref(),
        }),
        physical_size: f.physical_size.as_deref(),
        codec: &f.codec,
        force: f.force,
        dedup: f.dedup.on(),
        packing: f.packing.packing(),
        segment_size: f.segment_size.as_deref(),
        make_parent: false,
        metadata_device: globals.metadata_device.as_deref(),
        metadata_size: f.metadata_size.as_deref(),
        unsafe_no_fencing: f.unsafe_no_fencing,
        encryption: encryption(f.encryption)?,
    };
    println!("{}", create_volume(&f.volume, &args)?);
    Ok(ExitCode::SUCCESS)
}

pub struct CreateArgs<'a> {
    pub size: &'a str,
    pub physical_size: Option<&'a str>,
    pub codec: &'a str,
    pub force: bool,
    pub dedup: bool,
    /// `--packing`.
    pub packing: Packing,
    pub segment_size: Option<&'a str>,
    /// Create the missing parent directory (only for serve's default volume).
    pub make_parent: bool,
    /// Where the map, checkpoints and fingerprints go (`--metadata-device`).
    pub metadata_device: Option<&'a Path>,
    /// Its size, for a file (`--metadata-size`; default from the volume's).
    pub metadata_size: Option<&'a str>,
    /// A cache in front of an origin (`--origin`); `size` is then unused.
    pub cache: Option<CacheArgs<'a>>,
    /// Object store: `--unsafe-no-fencing`.
    pub unsafe_no_fencing: bool,
    /// `--encryption` with the key file.
    pub encryption: Option<Encryption>,
}

/// `--encryption` and the key file: both or neither.
pub fn encryption(word: Option<CipherWord>) -> Result<Option<Encryption>, Error> {
    match (word, crate::keyfile::current()) {
        (Some(w), Some(key)) => Ok(Some(Encryption {
            cipher: w.cipher(),
            key,
        })),
        (Some(_), None) => Err(Error::Usage(
            "--encryption needs --key-file FILE (32 random bytes, or a passphrase)".into(),
        )),
        (None, Some(_)) => Err(Error::Usage(
            "a key file was given (--key-file or CVOL_KEY_FILE) without --encryption: \
             say --encryption aes-256-gcm (or chacha20-poly1305) to encrypt the volume"
                .into(),
        )),
        (None, None) => Ok(None),
    }
}

/// `--origin`, `--cache-mode`, `--line-size`.
pub struct CacheArgs<'a> {
    pub origin: &'a str,
    pub mode: CacheMode,
    pub line_size: Option<&'a str>,
}

/// A checked cache create: what the label records, and the origin's stamp.
struct CachePlan {
    config: CacheConfig,
    stamp: OriginStamp,
}

/// Checks the cache flags and reads the origin's size and stamp (the origin
/// is only read: a create never writes it).
fn plan_cache(path: &Path, c: &CacheArgs) -> Result<(u64, CachePlan), Error> {
    let mode = c.mode;
    let line = match c.line_size {
        Some(s) => size::parse_size(s).map_err(|e| Error::Usage(format!("--line-size: {e}")))?,
        None => u64::from(CACHE_LINE_DEFAULT_BYTES),
    };
    if !line.is_power_of_two() || !(4096..=1 << 20).contains(&line) {
        return Err(Error::Usage(format!(
            "--line-size {} must be a power of two from 4K to 1M",
            c.line_size.unwrap_or("")
        )));
    }
    if !origin::is_uri(c.origin) && volfile::same_file(path, Path::new(c.origin)) {
        return Err(Error::Usage(format!(
            "--origin {} is the cache itself: name the slow device the cache sits in front of",
            c.origin
        )));
    }
    let o = origin::open(c.origin, true)?;
    let size = o.store.len_bytes();
    if size == 0 || !size.is_multiple_of(4096) || size > LOGICAL_SIZE_MAX_BYTES {
        return Err(Error::Refused(format!(
            "origin {} is {size} bytes: a cache needs an origin of a non-zero multiple of \
             4096 bytes, at most {} TiB",
            c.origin,
            LOGICAL_SIZE_MAX_BYTES >> 40
        )));
    }
    let stamp = (o.stamp)().map_err(|e| Error::Refused(format!("origin {}: {e}", c.origin)))?;
    // A path is recorded absolute (serve may run elsewhere), like
    // --metadata-device's.
    let recorded = match origin::is_uri(c.origin) {
        true => c.origin.to_string(),
        false => std::path::absolute(c.origin)
            .map_err(|e| Error::Usage(format!("--origin {}: {e}", c.origin)))?
            .to_string_lossy()
            .into_owned(),
    };
    let config = CacheConfig {
        origin: recorded,
        mode,
        line_size_bytes: line as u32,
    };
    Ok((size, CachePlan { config, stamp }))
}

/// The metadata device of a volume being created.
struct MetaPlan {
    path: PathBuf,
    target: Target,
    size: u64,
}

/// Where the volume goes, as found before anything is written.
enum Target {
    /// No such file yet: created here (and removed if the create fails).
    NewFile,
    /// An existing regular file: empty, or overwritten with --force.
    File {
        len: u64,
    },
    /// A volume in an object store (`s3://BUCKET/PREFIX`).
    Object,
    BlockDevice {
        len: u64,
    },
}

/// Creates the volume; what was created, in words.
pub fn create_volume(path: &Path, a: &CreateArgs) -> Result<String, Error> {
    let (logical, cache) = logical_size(path, a)?;
    let codec = words::parse_codec(a.codec)?;
    let segment_size = segment_size(a)?;
    let target = volume_target(path, a)?;
    let (physical, segment_size_bytes) = physical_size(path, a, &target, logical, segment_size)?;
    let meta = match a.metadata_device {
        Some(m) => Some(plan_metadata(path, m, a, logical, segment_size_bytes)?),
        None => None,
    };
    let opts = CreateOptions {
        logical_size_bytes: logical,
        physical_size_bytes: physical,
        codec,
        segment_size_bytes,
        dedup: a.dedup,
        packing: a.packing,
        pool: false,
        encryption: a.encryption.clone(),
    };
    write_or_undo(path, &target, a, &opts, meta.as_ref(), cache.as_ref())?;
    Ok(summary(path, a, &opts, meta.as_ref(), cache.as_ref()))
}

/// The logical size: `--size`, or a cache's origin's (its plan then).
fn logical_size(path: &Path, a: &CreateArgs) -> Result<(u64, Option<CachePlan>), Error> {
    let (logical, cache) = match &a.cache {
        Some(c) => {
            if a.metadata_device.is_some() {
                return Err(Error::Usage(
                    "--metadata-device is not supported for a cache (--origin)".into(),
                ));
            }
            if a.physical_size.is_none()
                && !matches!(volfile::existing_kind(path), Ok(Kind::BlockDevice))
            {
                return Err(Error::Usage(format!(
                    "a cache on a file needs --physical-size: how much of the fast device it \
                     may use (the origin is {})",
                    c.origin
                )));
            }
            let (size, plan) = plan_cache(path, c)?;
            (size, Some(plan))
        }
        None => (
            size::parse_size(a.size).map_err(|e| Error::Usage(format!("--size: {e}")))?,
            None,
        ),
    };
    if logical == 0 || !logical.is_multiple_of(4096) {
        return Err(Error::Usage(format!(
            "--size {} must be a non-zero multiple of 4096 bytes",
            a.size
        )));
    }
    if logical > LOGICAL_SIZE_MAX_BYTES {
        return Err(Error::Usage(format!(
            "--size {} is above the largest logical size, {} TiB",
            a.size,
            LOGICAL_SIZE_MAX_BYTES >> 40
        )));
    }
    Ok((logical, cache))
}

/// `--segment-size`, checked.
fn segment_size(a: &CreateArgs) -> Result<Option<u64>, Error> {
    Ok(match a.segment_size {
        Some(s) => {
            let b =
                size::parse_size(s).map_err(|e| Error::Usage(format!("--segment-size: {e}")))?;
            if !b.is_power_of_two()
                || !(SEGMENT_SIZE_MIN_BYTES..=SEGMENT_SIZE_MAX_BYTES).contains(&b)
            {
                return Err(Error::Usage(format!(
                    "--segment-size {s} must be a power of two from 1M to 1G"
                )));
            }
            Some(b)
        }
        None => None,
    })
}

/// Where the volume goes: an object store, or what the path names.
fn volume_target(path: &Path, a: &CreateArgs) -> Result<Target, Error> {
    Ok(match crate::objvol::url_of(path) {
        Some(_) if a.cache.is_some() || a.metadata_device.is_some() => {
            return Err(Error::Usage(
                "--origin and --metadata-device are not supported for a volume in an object store"
                    .into(),
            ))
        }
        Some(u) => {
            cvol_objstore::url::S3Url::parse(u).map_err(|e| Error::Usage(e.to_string()))?;
            Target::Object
        }
        None => find_target(path, a)?,
    })
}

/// The physical size (`--physical-size`, the device's, or the logical
/// size) and the segment size, checked against each other and the target.
fn physical_size(
    path: &Path,
    a: &CreateArgs,
    target: &Target,
    logical: u64,
    segment_size: Option<u64>,
) -> Result<(u64, u64), Error> {
    let physical = match (a.physical_size, target) {
        (Some(p), _) => {
            size::parse_size(p).map_err(|e| Error::Usage(format!("--physical-size: {e}")))?
        }
        (None, Target::BlockDevice { len }) => (*len).min(PHYSICAL_SIZE_MAX_BYTES),
        // A tiny file volume still needs its metadata and two segments.
        (None, _) => logical.max(MIN_PHYSICAL_BYTES),
    };
    if physical > PHYSICAL_SIZE_MAX_BYTES {
        return Err(Error::Usage(match a.physical_size {
            Some(p) => format!(
                "--physical-size {p} is above the largest physical size, {} TiB",
                PHYSICAL_SIZE_MAX_BYTES >> 40
            ),
            None => format!(
                "--size {} needs a --physical-size of at most {} TiB: without it the \
                 physical size is --size (a volume may be larger than its backing store)",
                a.size,
                PHYSICAL_SIZE_MAX_BYTES >> 40
            ),
        }));
    }
    let segment_size_bytes =
        segment_size.unwrap_or_else(|| cvol_engine::volume::default_segment_size(physical));
    let min = DATA_OFFSET_BYTES + 2 * segment_size_bytes;
    if physical < min {
        return Err(Error::Usage(format!(
            "--physical-size {} is too small: a volume needs at least {} ({min} bytes: \
             its metadata and two {} segments)",
            a.physical_size.unwrap_or(a.size),
            human_bytes(min),
            human_bytes(segment_size_bytes)
        )));
    }
    if let Target::BlockDevice { len } = target {
        if physical > *len {
            return Err(Error::Refused(format!(
                "{}: --physical-size {} is larger than the device ({len} bytes)",
                path.display(),
                human_bytes(physical)
            )));
        }
    }
    Ok((physical, segment_size_bytes))
}

/// Writes the volume (and its metadata device); a failure takes back
/// every file and directory made and every empty file grown.
fn write_or_undo(
    path: &Path,
    target: &Target,
    a: &CreateArgs,
    opts: &CreateOptions,
    meta: Option<&MetaPlan>,
    cache: Option<&CachePlan>,
) -> Result<(), Error> {
    // Everything is checked: from here on, undo what a failure leaves.
    let (mut undo, mut meta_undo) = (Undo::default(), Undo::default());
    let r = write_volume(
        path,
        target,
        a,
        opts,
        &mut undo,
        meta,
        &mut meta_undo,
        cache,
    );
    if r.is_err() {
        undo.run(path);
        if let Some(m) = meta {
            meta_undo.run(&m.path);
        }
    }
    r?;
    // The new names reach the disk with the data: fsync each directory a
    // file (or directory) was made in.
    for (u, p) in [
        (&undo, Some(path)),
        (&meta_undo, meta.map(|m| m.path.as_path())),
    ] {
        if let (Some(p), true) = (p, u.made_file) {
            sync_dir(&parent(p))?;
            if let Some(d) = &u.made_dir {
                sync_dir(&parent(d))?;
            }
        }
    }
    Ok(())
}

/// What was created, in words.
fn summary(
    path: &Path,
    a: &CreateArgs,
    opts: &CreateOptions,
    meta: Option<&MetaPlan>,
    cache: Option<&CachePlan>,
) -> String {
    let on_meta = match meta {
        Some(m) => format!(
            ", metadata on {} ({})",
            m.path.display(),
            human_bytes(m.size)
        ),
        None => String::new(),
    };
    let on_meta = match cache {
        Some(c) => format!(
            ", a {} cache of {} ({}-byte lines)",
            c.config.mode.name(),
            c.config.origin,
            c.config.line_size_bytes
        ),
        None => on_meta,
    };
    let packing = match a.packing {
        Packing::Compact => String::new(),
        p => format!(", packing {}", p.name()),
    };
    let packing = match &a.encryption {
        Some(e) => format!("{packing}, encrypted ({})", e.cipher.name()),
        None => packing,
    };
    format!(
        "created {}: {} logical, {} physical, codec {}, dedup {}{packing}{on_meta}",
        path.display(),
        human_bytes(opts.logical_size_bytes),
        human_bytes(opts.physical_size_bytes),
        describe_policy(opts.codec),
        if a.dedup { "on" } else { "off" }
    )
}

/// The default metadata device size for a file: room for the map of the
/// whole logical size (12 bytes a block at most) and the fingerprint
/// tables (about 18 bytes a block written) twice over, for the log's dead
/// space: 1/64 of the logical size, at least 16 segments.
fn default_metadata_bytes(logical: u64, segment_size: u64) -> u64 {
    let segments = (logical / 64).div_ceil(segment_size).max(16);
    DATA_OFFSET_BYTES + segments * segment_size
}

/// Checks the metadata device path (the same rules as the volume's: an
/// existing volume or non-empty file needs --force) and its size.
fn plan_metadata(
    volume: &Path,
    m: &Path,
    a: &CreateArgs,
    logical: u64,
    segment_size: u64,
) -> Result<MetaPlan, Error> {
    let abs = std::path::absolute(m).map_err(|e| Error::io(m.display(), e))?;
    if volfile::same_file(volume, m) || std::path::absolute(volume).is_ok_and(|v| v == abs) {
        return Err(Error::Usage(format!(
            "--metadata-device {} is the volume itself: name another file or device",
            m.display()
        )));
    }
    let target = find_target(m, a).map_err(|e| Error::Usage(format!("--metadata-device: {e}")))?;
    let asked = match a.metadata_size {
        Some(s) => {
            Some(size::parse_size(s).map_err(|e| Error::Usage(format!("--metadata-size: {e}")))?)
        }
        None => None,
    };
    let size = match (&target, asked) {
        (Target::BlockDevice { .. }, Some(_)) => {
            return Err(Error::Usage(format!(
                "--metadata-size is for a file: the block device {} is used whole",
                m.display()
            )))
        }
        (Target::BlockDevice { len }, None) => *len,
        (_, Some(s)) => s,
        (_, None) => default_metadata_bytes(logical, segment_size),
    };
    if asked.is_some() && size > PHYSICAL_SIZE_MAX_BYTES {
        return Err(Error::Usage(format!(
            "--metadata-size {} is above the largest, {} TiB",
            a.metadata_size.unwrap_or(""),
            PHYSICAL_SIZE_MAX_BYTES >> 40
        )));
    }
    let min = DATA_OFFSET_BYTES + 2 * segment_size;
    if size < min {
        return Err(Error::Usage(format!(
            "--metadata-size {} is too small: a metadata device needs at least {} \
             (1 MiB and two {} segments)",
            human_bytes(size),
            human_bytes(min),
            human_bytes(segment_size)
        )));
    }
    Ok(MetaPlan {
        path: abs,
        target,
        size,
    })
}

fn find_target(path: &Path, a: &CreateArgs) -> Result<Target, Error> {
    match std::fs::metadata(path) {
        Ok(md) => {
            let kind = volfile::kind_of(path, &md)?;
            let len = match kind {
                Kind::File => md.len(),
                Kind::BlockDevice => FileStorage::open(path, false, false)
                    .map_err(|e| Error::io(path.display(), e))?
                    .len_bytes(),
            };
            if !a.force && (looks_like_volume(path) || (kind == Kind::File && len > 0)) {
                return Err(Error::Refused(format!(
                    "{} already exists; pass --force to overwrite it",
                    path.display()
                )));
            }
            Ok(match kind {
                Kind::File => Target::File { len },
                Kind::BlockDevice => Target::BlockDevice { len },
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if std::fs::symlink_metadata(path).is_ok() {
                return Err(Error::Refused(format!(
                    "{} is a symbolic link to a missing file",
                    path.display()
                )));
            }
            let dir = parent(path);
            match std::fs::metadata(&dir) {
                Ok(md) if md.is_dir() => {}
                Ok(_) => {
                    return Err(Error::Refused(format!(
                        "{} is not a directory",
                        dir.display()
                    )))
                }
                Err(_) if a.make_parent => {}
                Err(_) => {
                    return Err(Error::Refused(format!(
                        "{}: directory {} does not exist",
                        path.display(),
                        dir.display()
                    )))
                }
            }
            Ok(Target::NewFile)
        }
        Err(e) => {
            let dir = parent(path);
            Err(Error::Refused(match std::fs::metadata(&dir) {
                Ok(md) if !md.is_dir() => {
                    format!("{}: {} is not a directory", path.display(), dir.display())
                }
                _ => format!("{}: {e}", path.display()),
            }))
        }
    }
}

/// fsync of a directory, so the entries made in it are durable.
fn sync_dir(dir: &Path) -> Result<(), Error> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::Refused(format!("{}: fsync of the directory: {e}", dir.display())))
}

fn parent(path: &Path) -> PathBuf {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn looks_like_volume(path: &Path) -> bool {
    let Ok(st) = FileStorage::open(path, false, false) else {
        return false;
    };
    let mut b = [0u8; 8];
    st.read_at(0, &mut b).is_ok() && b == cvol_format::superblock::SUPERBLOCK_MAGIC
}

/// What to take back when the create fails after it started writing.
#[derive(Default)]
struct Undo {
    made_dir: Option<PathBuf>,
    made_file: bool,
    /// An existing empty file (not --force) grown to the volume's size.
    emptied_file: bool,
}

impl Undo {
    fn run(&self, path: &Path) {
        if self.made_file {
            let _ = std::fs::remove_file(path);
        } else if self.emptied_file {
            if let Ok(f) = std::fs::OpenOptions::new().write(true).open(path) {
                let _ = f.set_len(0);
            }
        }
        if let Some(d) = &self.made_dir {
            let _ = std::fs::remove_dir(d);
        }
    }
}

#[expect(
    clippy::too_many_arguments,
    reason = "one call site, each argument checked before"
)]
fn write_volume(
    path: &Path,
    target: &Target,
    a: &CreateArgs,
    opts: &CreateOptions,
    undo: &mut Undo,
    meta: Option<&MetaPlan>,
    meta_undo: &mut Undo,
    cache: Option<&CachePlan>,
) -> Result<(), Error> {
    if let Some(url) = crate::objvol::url_of(path) {
        return crate::objvol::create(url, opts, a.force, a.unsafe_no_fencing);
    }
    let storage = open_target(path, target, a, opts.physical_size_bytes, undo)?;
    if let Some(c) = cache {
        return cvol_cache::create(Arc::new(storage), opts, &c.config, c.stamp)
            .map_err(|e| Error::Refused(format!("{}: {e}", path.display())));
    }
    // A local volume is a pool (`cvol volume`); its first volume, `default`,
    // has the size asked for.
    let opts = &opts.clone().as_pool();
    let vol = match meta {
        None => Volume::create(Arc::new(storage), opts),
        Some(m) => {
            let meta_store = open_target(&m.path, &m.target, a, m.size, meta_undo)?;
            let recorded = m.path.to_string_lossy();
            Volume::create_with_metadata(Arc::new(storage), Arc::new(meta_store), &recorded, opts)
        }
    }
    .map_err(|e| Error::Refused(format!("{}: {e}", path.display())))?;
    vol.close()
        .map_err(|e| Error::Refused(format!("{}: {e}", path.display())))
}

/// Opens (making or growing a file to `size`) what a create writes to.
fn open_target(
    path: &Path,
    target: &Target,
    a: &CreateArgs,
    size: u64,
    undo: &mut Undo,
) -> Result<FileStorage, Error> {
    let here = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::FileTooLarge => Error::Refused(format!(
            "{}: the file system cannot hold a file of {} ({e})",
            path.display(),
            human_bytes(size)
        )),
        _ => Error::io(path.display(), e),
    };
    let storage = match target {
        Target::BlockDevice { .. } => FileStorage::open(path, true, true).map_err(here)?,
        Target::Object => unreachable!("an object-store volume is written by objvol::create"),
        Target::NewFile => {
            let dir = parent(path);
            if a.make_parent && !dir.exists() {
                use std::os::unix::fs::DirBuilderExt;
                // Private: only its owner may list or add files there.
                std::fs::DirBuilder::new()
                    .mode(0o700)
                    .create(&dir)
                    .map_err(|e| Error::Refused(format!("creating {}: {e}", dir.display())))?;
                undo.made_dir = Some(dir);
            }
            // O_EXCL|O_NOFOLLOW, mode 0600: a file (or link) that appeared
            // meanwhile is not ours to touch or remove.
            let st = FileStorage::create_new(path, size).map_err(here)?;
            undo.made_file = true;
            st
        }
        Target::File { len } => {
            // Grown only once the lock is ours (a refused lock changes nothing).
            let st = FileStorage::create(path, size).map_err(here)?;
            undo.emptied_file = *len == 0 && !a.force;
            st
        }
    };
    Ok(storage)
}
