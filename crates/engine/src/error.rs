use cvol_format::FormatError;
use std::fmt;
use std::io;

/// Errors of volume operations. Operating errors, not programmer errors
/// (those are assertions).
#[derive(Debug)]
pub enum VolError {
    /// Request beyond the logical size.
    OutOfRange,
    /// The volume is open read-only.
    ReadOnly,
    /// Live data plus the metadata reserve does not fit.
    NoSpace,
    /// Media I/O failed; the volume refuses writes until reopened.
    Io(io::Error),
    /// An earlier I/O error, or a panic inside the engine (a poisoned
    /// lock), stopped this handle; reopen the volume.
    Poisoned,
    /// A record failed verification; the affected block is unreadable.
    Corrupt { lba: u64, detail: String },
    /// The volume could not be created or opened.
    Open(OpenError),
    /// Metadata read back, or the tables derived from the map, failed a
    /// check (`Volume::verify_refcounts`).
    Meta(MetaError),
}

impl From<MetaError> for VolError {
    fn from(e: MetaError) -> VolError {
        VolError::Meta(e)
    }
}

/// Why a volume could not be created or opened.
#[derive(Debug)]
pub enum OpenError {
    /// The create options describe no valid volume.
    Geometry(FormatError),
    /// The volume's physical size exceeds the backing store.
    BackingTooSmall {
        physical_size_bytes: u64,
        backing_bytes: u64,
    },
    /// No usable superblock: not a volume, or both copies damaged, or one
    /// that claims more bytes than the backing store has.
    Superblock(RecoveryError),
    /// Recovery refused to open: no usable checkpoint, a damaged log, an
    /// unreadable segment (the message names the repair where there is one).
    Recovery(RecoveryError),
    /// The log has no room for the EPOCH record that opening for writing needs.
    LogFull,
    /// The metadata device is missing, too small, or another volume's.
    MetadataDevice(String),
    /// A cache volume's label or origin does not allow serving it.
    Cache(String),
    /// The volume is encrypted and the key is missing or wrong, or a key
    /// was given for a volume without encryption.
    Key(KeyProblem),
}

impl From<OpenError> for VolError {
    fn from(e: OpenError) -> VolError {
        VolError::Open(e)
    }
}

impl fmt::Display for VolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VolError::OutOfRange => write!(f, "request beyond the end of the volume"),
            VolError::ReadOnly => write!(f, "volume is read-only"),
            VolError::NoSpace => write!(f, "no space left on the volume"),
            VolError::Io(e) => write!(f, "I/O error on the backing store: {e}"),
            VolError::Poisoned => {
                write!(
                    f,
                    "volume stopped accepting writes after an I/O error or an internal \
                     failure; reopen it"
                )
            }
            VolError::Corrupt { lba, detail } => write!(f, "block {lba} is corrupt: {detail}"),
            VolError::Open(e) => write!(f, "{e}"),
            VolError::Meta(e) => write!(f, "{e}"),
        }
    }
}

impl fmt::Display for OpenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpenError::Geometry(e) => write!(f, "cannot create volume: {e}"),
            OpenError::BackingTooSmall {
                physical_size_bytes,
                backing_bytes,
            } => write!(
                f,
                "physical size {physical_size_bytes} exceeds the backing store \
                 ({backing_bytes} bytes)"
            ),
            OpenError::Superblock(s) | OpenError::Recovery(s) => write!(f, "{s}"),
            OpenError::LogFull => write!(
                f,
                "the log is full: no room for the epoch record that opening for writing \
                 needs; serve it --read-only to copy the data out"
            ),
            OpenError::MetadataDevice(why) => write!(f, "metadata device: {why}"),
            OpenError::Cache(why) => write!(f, "cache: {why}"),
            OpenError::Key(p) => write!(f, "{p}"),
        }
    }
}

// Display includes the inner error, so `source` stays None (printing a
// chain would repeat it).
impl std::error::Error for VolError {}

impl std::error::Error for OpenError {}

/// Why recovery (`recovery/`: reading the superblock, loading a
/// checkpoint, the roll-forward, salvage, superblock repair) could not
/// produce a map. The messages are user-facing (`cvol serve`, `cvol check`)
/// and name the repair where there is one. docs/FORMAT.md "Recovery"
/// describes the protocol the variants refer to.
#[derive(Debug)]
pub enum RecoveryError {
    /// Neither superblock copy reads and decodes: not a cvol volume, or both
    /// copies destroyed. (The message names copy A's fault, the first tried.)
    NoSuperblock {
        copy_a: SuperblockCopyError,
        copy_b: SuperblockCopyError,
    },
    /// The superblock describes a volume larger than its backing store.
    SuperblockBeyondBacking {
        physical_size_bytes: u64,
        backing_bytes: u64,
    },
    /// The volume keeps its map and checkpoints on a metadata device that
    /// the store given does not include.
    MetadataDeviceMissing { segments: u32 },
    /// Reading the first record header of a segment failed: the segment may
    /// hold the log's continuation, so the open fails rather than end the
    /// chain early.
    SegmentStartUnreadable { segment: u64, source: io::Error },
    /// Reading a whole segment the roll-forward needs failed.
    SegmentUnreadable { segment: u64, source: io::Error },
    /// A record of the chain verifies (crc, tag) but cannot be applied to the
    /// map (an LBA range beyond the volume, a REF naming no shared entry...).
    BadRecord {
        seq: u64,
        offset: u64,
        detail: String,
    },
    /// The log no longer holds its first record (seq 1): a whole-log replay
    /// is impossible (segments reused since).
    NoLogStart,
    /// No checkpoint pointer was ever written and the log has no seq 1.
    NeverInitialised,
    /// Checkpoints existed (valid or damaged pointer slots) but none loads
    /// and rolls forward; `notes` says why, for each one tried.
    NoUsableCheckpoint { notes: Vec<String> },
    /// Every checkpoint that loads rolls forward to below the seq the
    /// volume certified as flushed (the first such shortfall, and the notes
    /// on every checkpoint tried).
    RollForwardBelowCertified {
        shortfall: ShortRollForward,
        notes: Vec<String>,
    },
    /// A SYNCED record beyond the chain's end certifies seq `certified`,
    /// which the chain (ending at `last_seq`) did not reach: records it should
    /// have passed are damaged.
    ChainEndsBeforeCertified {
        last_seq: u64,
        certified: u64,
        notes: Vec<String>,
    },
    /// `rebuild_from_log` found no intact record at all.
    NoIntactRecord,
    /// Superblock repair: neither copy is intact, so neither can be restored
    /// from the other.
    BothSuperblocksDamaged,
    /// Superblock repair: rewriting a copy or syncing it failed.
    RepairIo(io::Error),
}

/// Why one superblock copy is unusable.
#[derive(Debug)]
pub enum SuperblockCopyError {
    /// Reading it failed.
    Read(io::Error),
    /// It does not decode (magic, crc, fields).
    Invalid(FormatError),
}

/// A checkpoint whose roll-forward ends below the certified seq: accepting
/// it would silently drop flushed records.
#[derive(Debug, Clone)]
pub struct ShortRollForward {
    /// Which checkpoint ("checkpoint generation N", "checkpoint found in the
    /// log (commit seq S)").
    pub what: String,
    /// Where its chain ends: the last seq, its segment and the byte after it.
    pub last_seq: u64,
    pub segment: u64,
    pub end: usize,
    /// The seq the volume certified as flushed, and what certifies it
    /// (`recovery::Certified`).
    pub certified_seq: u64,
    pub certified_by: String,
}

impl fmt::Display for SuperblockCopyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SuperblockCopyError::Read(e) => write!(f, "{e}"),
            SuperblockCopyError::Invalid(e) => write!(f, "{e}"),
        }
    }
}

impl fmt::Display for ShortRollForward {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: its roll-forward ends at seq {} (segment {}, byte {}), below seq {} certified \
             as flushed by {}",
            self.what, self.last_seq, self.segment, self.end, self.certified_seq, self.certified_by
        )
    }
}

impl fmt::Display for RecoveryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecoveryError::NoSuperblock { copy_a, .. } => {
                write!(f, "not a cvol volume (no valid superblock: {copy_a})")
            }
            RecoveryError::SuperblockBeyondBacking {
                physical_size_bytes,
                backing_bytes,
            } => write!(
                f,
                "superblock says {physical_size_bytes} physical bytes but the backing store has \
                 {backing_bytes}"
            ),
            RecoveryError::MetadataDeviceMissing { segments } => write!(
                f,
                "the volume keeps its map and checkpoints on a separate metadata device \
                 ({segments} segments), which was not opened with it: pass \
                 --metadata-device PATH"
            ),
            RecoveryError::SegmentStartUnreadable { segment, source } => {
                write!(f, "reading the start of segment {segment}: {source}")
            }
            RecoveryError::SegmentUnreadable { segment, source } => {
                write!(f, "reading segment {segment}: {source}")
            }
            RecoveryError::BadRecord {
                seq,
                offset,
                detail,
            } => write!(f, "record seq {seq} at byte {offset}: {detail}"),
            RecoveryError::NoLogStart => write!(f, "no log start (record seq 1) found"),
            RecoveryError::NeverInitialised => write!(
                f,
                "no checkpoint and no log start found: the volume was never initialised"
            ),
            RecoveryError::NoUsableCheckpoint { notes } => write!(
                f,
                "no usable checkpoint ({}); refusing to guess the map: \
                 `cvol check --repair` rebuilds it from the log",
                notes.join("; ")
            ),
            RecoveryError::RollForwardBelowCertified { shortfall, notes } => write!(
                f,
                "flushed data is damaged: {shortfall}; opening would silently lose what was \
                 flushed after that point, so cvol refuses and writes nothing: `cvol check \
                 --repair` salvages every intact record and lists the blocks that are lost ({})",
                notes.join("; ")
            ),
            RecoveryError::ChainEndsBeforeCertified {
                last_seq,
                certified,
                notes,
            } => {
                write!(
                    f,
                    "the log is damaged: its chain of records ends at seq {last_seq}, but a \
                     later record certifies that records up to seq {certified} were flushed; \
                     opening would lose them silently, so cvol refuses: `cvol check --repair` \
                     rebuilds the map from every intact record"
                )?;
                if !notes.is_empty() {
                    write!(f, " ({})", notes.join("; "))?;
                }
                Ok(())
            }
            RecoveryError::NoIntactRecord => {
                write!(f, "no intact record in the log: nothing to rebuild from")
            }
            RecoveryError::BothSuperblocksDamaged => {
                write!(f, "both superblock copies are damaged: cannot repair")
            }
            RecoveryError::RepairIo(e) => write!(f, "{e}"),
        }
    }
}

// Like VolError: Display includes the underlying error.
impl std::error::Error for RecoveryError {}

/// Why a record read back from the store at a place a map entry, a pointer
/// or a directory names is unusable (`logread::read_record`).
#[derive(Debug)]
pub enum RecordError {
    /// The offset lies before the data area.
    InMetadataArea,
    /// The record would cross a segment boundary (or lie past the last
    /// segment).
    CrossesSegment { offset: u64, len: u32 },
    /// The record would end past the volume's physical size.
    BeyondPhysicalSize { offset: u64, len: u32 },
    /// Reading it failed.
    Read(io::Error),
    /// Its header or checksum does not verify.
    Invalid(FormatError),
    /// It verifies but is another volume's, or not of the length expected.
    NotExpected,
}

/// Why a map entry's place is not one a data record may have
/// (`logread::check_entry_location`).
#[derive(Debug)]
pub enum EntryLocationError {
    /// The entry does not decode.
    Invalid(FormatError),
    /// It points before the data area.
    InMetadataArea,
    /// It points past the data area or across a segment boundary.
    OutsideDataArea { offset: u64, len: u32 },
    /// It points into a segment of the metadata device.
    OnMetadataDevice { offset: u64, len: u32 },
}

/// Why a MAP_CHUNK record (a checkpoint's map in runs, or one map page)
/// is unusable (`logread::LogPages`).
#[derive(Debug)]
pub enum ChunkError {
    /// The record does not read or verify.
    Record(RecordError),
    /// It verifies but is not the record that was named.
    NotNamed { offset: u64 },
    /// Its lz4 payload does not decompress.
    Decompress(lz4_flex::block::DecompressError),
    /// Map records are never zstd-compressed.
    Zstd,
    /// Its runs do not decode.
    Runs(FormatError),
    /// An entry it holds points outside the data area.
    Entry { lba: u64, why: EntryLocationError },
}

/// Why a verified record of the chain cannot be applied to the map
/// (`recovery`'s roll-forward; reported as `RecoveryError::BadRecord`).
#[derive(Debug)]
pub enum ApplyError {
    /// Its LBA range runs past the volume.
    BeyondVolume { lba: u64, end: u64 },
    /// A DATA record of more blocks than a compression unit holds.
    UnitTooLarge { nblocks: u32, max: u32 },
    /// A REF record whose payload is no map entry.
    RefUndecodable(FormatError),
    /// A REF record whose entry is not a shared data entry.
    RefNotShared,
    /// A REF record whose entry points outside the data area.
    RefLocation(EntryLocationError),
}

/// Why a checkpoint cannot be recovered from: its commit record, where its
/// roll-forward starts, or the map records it names (`recovery`'s
/// checkpoint load; the search notes it and tries the next one).
#[derive(Debug)]
pub enum CheckpointError {
    /// The commit record does not read or verify.
    Commit(RecordError),
    /// The record the pointer names is not its commit record.
    NotItsCommit,
    /// The commit's payload does not decode.
    CommitPayload(FormatError),
    /// The checkpoint is of another logical size.
    OtherLogicalSize,
    /// The commit's resume position lies outside the log.
    ResumeOutsideLog { segment: u64, offset: u64 },
    /// The commit's snapshot seq is not below its own seq.
    SnapshotNotBeforeCommit,
    /// The commit record lies outside the data area.
    CommitOutsideData,
    /// The commit's metadata resume position is not on the metadata device.
    MetaResumeOutside { segment: u64, offset: u64 },
    /// The commit's resume segment is on the metadata device.
    ResumeOnMetadataDevice { segment: u64 },
    /// No record of the map the commit names reads.
    NoMapRecordReads,
    /// A MAP_CHUNK of a map kept in runs.
    Chunk(ChunkError),
    /// A MAP_DIR record.
    Dir(DirError),
    /// The commit names its directory blocks out of order.
    DirsOutOfOrder,
    /// A map page a directory names.
    Page { page: u64, why: PageError },
    /// A map page (read to verify a fallback's map) is unusable.
    MapPages(MetaError),
    /// An entry of the map names no intact record holding its block.
    NamesNoRecord { lba: u64, offset: u64 },
    /// The commit's named directory (`FLAG_DIR_NAMED`) disagrees with the
    /// blocks it names, or the volume has no such commits.
    NamedDir(String),
}

/// Why a MAP_DIR record a commit names is unusable.
#[derive(Debug)]
pub enum DirError {
    /// The record does not read or verify.
    Record(RecordError),
    /// It is not the directory block the commit names.
    NotNamed { offset: u64 },
    /// Its directory block lies beyond the volume's slots.
    BeyondVolume { offset: u64 },
    /// Its lz4 payload does not decompress.
    Decompress(lz4_flex::block::DecompressError),
    /// Map records are never zstd-compressed.
    Zstd,
    /// Its payload does not decode.
    Payload(FormatError),
    /// It names a page beyond the volume's slots.
    PageBeyondVolume,
    /// Its summarized list does not decode or disagrees with its summary.
    Summary(String),
    /// The list record its summary names (a list kept apart) is another
    /// record.
    ListNotNamed { offset: u64 },
}

/// Why one map page record a directory names is unusable.
#[derive(Debug)]
pub enum PageError {
    /// The record does not read or verify (lazy load: only its header is
    /// checked).
    Record(RecordError),
    /// It is not the record the directory names.
    NotNamed,
    /// Its entries do not decode.
    Chunk(ChunkError),
    /// It holds another page's entries.
    OtherPage,
}

/// Why the liveness tables a checkpoint names cannot be used (they are
/// then rebuilt from the map).
#[derive(Debug)]
pub enum TableError {
    /// The record does not read or verify.
    Record(RecordError),
    /// Table `table` is not the record the directory names.
    NotNamed { table: usize },
    /// Table `table` has a codec tables are never written with.
    Codec {
        table: usize,
        codec: cvol_format::CodecTag,
    },
    /// Table `table` does not decompress.
    Decompress {
        table: usize,
        source: lz4_flex::block::DecompressError,
    },
    /// The root table does not decode.
    Root(FormatError),
    /// Table `table` (a group) does not decode.
    Group { table: usize, source: FormatError },
}

impl fmt::Display for RecordError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecordError::InMetadataArea => write!(f, "record offset inside the metadata area"),
            RecordError::CrossesSegment { offset, len } => {
                write!(f, "record at {offset} (+{len}) crosses a segment boundary")
            }
            RecordError::BeyondPhysicalSize { offset, len } => {
                write!(f, "record at {offset} (+{len}) beyond the physical size")
            }
            RecordError::Read(e) => write!(f, "{e}"),
            RecordError::Invalid(e) => write!(f, "{e}"),
            RecordError::NotExpected => {
                write!(f, "record belongs to another volume or has another length")
            }
        }
    }
}

impl fmt::Display for EntryLocationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EntryLocationError::Invalid(e) => write!(f, "{e}"),
            EntryLocationError::InMetadataArea => write!(f, "points into the metadata area"),
            EntryLocationError::OutsideDataArea { offset, len } => {
                write!(f, "points outside the data area ({offset}+{len})")
            }
            EntryLocationError::OnMetadataDevice { offset, len } => {
                write!(f, "points into the metadata device ({offset}+{len})")
            }
        }
    }
}

impl fmt::Display for ChunkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChunkError::Record(e) => write!(f, "{e}"),
            ChunkError::NotNamed { offset } => write!(
                f,
                "map chunk at {offset} is not the one the checkpoint names"
            ),
            ChunkError::Decompress(e) => write!(f, "map chunk: {e}"),
            ChunkError::Zstd => write!(f, "map chunk with zstd codec"),
            ChunkError::Runs(e) => write!(f, "{e}"),
            ChunkError::Entry { lba, why } => write!(f, "lba {lba}: {why}"),
        }
    }
}

impl fmt::Display for ApplyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApplyError::BeyondVolume { lba, end } => {
                write!(f, "lba range {lba}..{end} beyond the volume")
            }
            ApplyError::UnitTooLarge { nblocks, max } => {
                write!(f, "data record of {nblocks} blocks (at most {max})")
            }
            ApplyError::RefUndecodable(e) => write!(f, "ref record: {e}"),
            ApplyError::RefNotShared => {
                write!(f, "ref record does not name a shared data entry")
            }
            ApplyError::RefLocation(e) => write!(f, "ref record {e}"),
        }
    }
}

impl fmt::Display for CheckpointError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CheckpointError::Commit(e) => write!(f, "{e}"),
            CheckpointError::NotItsCommit => write!(f, "pointer does not name its commit record"),
            CheckpointError::CommitPayload(e) => write!(f, "{e}"),
            CheckpointError::OtherLogicalSize => {
                write!(f, "checkpoint is for another logical size")
            }
            CheckpointError::ResumeOutsideLog { segment, offset } => {
                write!(f, "resume position {segment}+{offset} outside the log")
            }
            CheckpointError::SnapshotNotBeforeCommit => {
                write!(f, "snapshot seq not before its commit")
            }
            CheckpointError::CommitOutsideData => write!(f, "commit outside the data area"),
            CheckpointError::MetaResumeOutside { segment, offset } => write!(
                f,
                "metadata resume position {segment}+{offset} outside the metadata device"
            ),
            CheckpointError::ResumeOnMetadataDevice { segment } => {
                write!(f, "resume segment {segment} is on the metadata device")
            }
            CheckpointError::NoMapRecordReads => {
                write!(f, "no map record of the checkpoint reads")
            }
            CheckpointError::Chunk(e) => write!(f, "{e}"),
            CheckpointError::Dir(e) => write!(f, "{e}"),
            CheckpointError::DirsOutOfOrder => write!(f, "map directory blocks out of order"),
            CheckpointError::Page { page, why } => write!(f, "map page {page}: {why}"),
            CheckpointError::MapPages(e) => write!(f, "{e}"),
            CheckpointError::NamedDir(why) => write!(f, "named map directory: {why}"),
            CheckpointError::NamesNoRecord { lba, offset } => {
                write!(f, "lba {lba} names no intact record at byte {offset}")
            }
        }
    }
}

impl fmt::Display for DirError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DirError::Record(e) => write!(f, "{e}"),
            DirError::NotNamed { offset } => write!(
                f,
                "map directory at {offset} is not the one the checkpoint names"
            ),
            DirError::BeyondVolume { offset } => {
                write!(f, "map directory at {offset} beyond the volume")
            }
            DirError::Decompress(e) => write!(f, "map directory: {e}"),
            DirError::Zstd => write!(f, "map directory with zstd codec"),
            DirError::Payload(e) => write!(f, "{e}"),
            DirError::PageBeyondVolume => {
                write!(f, "map directory names a page beyond the volume")
            }
            DirError::Summary(why) => write!(f, "map directory: {why}"),
            DirError::ListNotNamed { offset } => write!(
                f,
                "map directory: the record at byte {offset} is not the list its summary names"
            ),
        }
    }
}

impl fmt::Display for PageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PageError::Record(e) => write!(f, "{e}"),
            PageError::NotNamed => write!(f, "not the record the directory names"),
            PageError::Chunk(e) => write!(f, "{e}"),
            PageError::OtherPage => write!(f, "a page record of another page"),
        }
    }
}

impl fmt::Display for TableError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TableError::Record(e) => write!(f, "{e}"),
            TableError::NotNamed { table } => {
                write!(f, "table {table}: not the record the directory names")
            }
            TableError::Codec { table, codec } => write!(f, "table {table}: codec {codec:?}"),
            TableError::Decompress { table, source } => write!(f, "table {table}: {source}"),
            TableError::Root(e) => write!(f, "{e}"),
            TableError::Group { table, source } => write!(f, "table {table}: {source}"),
        }
    }
}

impl std::error::Error for RecordError {}
impl std::error::Error for EntryLocationError {}
impl std::error::Error for ChunkError {}
impl std::error::Error for ApplyError {}
impl std::error::Error for CheckpointError {}
impl std::error::Error for DirError {}
impl std::error::Error for PageError {}
impl std::error::Error for TableError {}

#[cfg(test)]
mod tests;

/// Why metadata read back (a map page, a segment or shared table, a
/// fingerprint table) or the books derived from the map cannot be used.
/// The opener falls back to rebuilding from the map on `Damaged` and
/// `Disagree`; an `Io` error is the store's, and is reported as such.
#[derive(Debug)]
pub enum MetaError {
    /// Reading it from the store failed.
    Io { what: String, source: io::Error },
    /// Its bytes fail verification or do not decode into what they claim.
    Damaged(String),
    /// It decodes, but disagrees with the map or with another table.
    Disagree(String),
}

impl fmt::Display for MetaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetaError::Io { what, source } => write!(f, "{what}: {source}"),
            MetaError::Damaged(why) | MetaError::Disagree(why) => write!(f, "{why}"),
        }
    }
}

impl std::error::Error for MetaError {}

/// A word that names no codec, codec policy or cleaner policy (the
/// message says what was expected).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadWord(pub String);

impl fmt::Display for BadWord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl std::error::Error for BadWord {}

/// Why a key does not open a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyProblem {
    /// The volume is encrypted and no key was given.
    Needed(cvol_format::seal::Cipher),
    /// A key was given for a volume without encryption.
    NotEncrypted,
    /// The key file is not this volume's, or unusable.
    Key(cvol_format::keyslot::KeyError),
}

impl std::fmt::Display for KeyProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyProblem::Needed(c) => write!(
                f,
                "the volume is encrypted ({}): give its key file (--key-file FILE, or the \
                 CVOL_KEY_FILE environment variable)",
                c.name()
            ),
            KeyProblem::NotEncrypted => write!(
                f,
                "a key file was given, but the volume is not encrypted (drop --key-file)"
            ),
            KeyProblem::Key(e) => write!(f, "{e}"),
        }
    }
}
