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
        }
    }
}

// Display includes the inner error, so `source` stays None (printing a
// chain would repeat it).
impl std::error::Error for VolError {}

impl std::error::Error for OpenError {}

/// Why recovery (`recovery.rs`: reading the superblock, loading a
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

#[cfg(test)]
mod tests {
    use super::*;

    // The messages are what recovery said when it returned strings: the CLI
    // and the e2e scripts grep them, and users follow their advice.

    fn assert_messages(cases: Vec<(RecoveryError, &str)>) {
        for (e, want) in cases {
            assert_eq!(e.to_string(), want, "{e:?}");
            let open = VolError::Open(OpenError::Recovery(e));
            assert_eq!(open.to_string(), want);
        }
    }

    fn io() -> io::Error {
        io::Error::other("disk on fire")
    }

    #[test]
    fn superblock_and_io_messages_are_unchanged() {
        assert_messages(vec![
            (
                RecoveryError::NoSuperblock {
                    copy_a: SuperblockCopyError::Read(io()),
                    copy_b: SuperblockCopyError::Read(io()),
                },
                "not a cvol volume (no valid superblock: disk on fire)",
            ),
            (
                RecoveryError::SuperblockBeyondBacking {
                    physical_size_bytes: 100,
                    backing_bytes: 50,
                },
                "superblock says 100 physical bytes but the backing store has 50",
            ),
            (
                RecoveryError::SegmentStartUnreadable {
                    segment: 7,
                    source: io(),
                },
                "reading the start of segment 7: disk on fire",
            ),
            (
                RecoveryError::SegmentUnreadable {
                    segment: 7,
                    source: io(),
                },
                "reading segment 7: disk on fire",
            ),
            (
                RecoveryError::BadRecord {
                    seq: 9,
                    offset: 4096,
                    detail: "ref record: bad".into(),
                },
                "record seq 9 at byte 4096: ref record: bad",
            ),
            (
                RecoveryError::BothSuperblocksDamaged,
                "both superblock copies are damaged: cannot repair",
            ),
            (RecoveryError::RepairIo(io()), "disk on fire"),
        ]);
    }

    #[test]
    fn refusal_messages_are_unchanged() {
        let notes = vec!["first note".to_string(), "second note".to_string()];
        let shortfall = ShortRollForward {
            what: "checkpoint generation 3".into(),
            last_seq: 40,
            segment: 2,
            end: 512,
            certified_seq: 45,
            certified_by: "a SYNCED record (seq 46) in segment 2".into(),
        };
        assert_messages(vec![
            (
                RecoveryError::NoLogStart,
                "no log start (record seq 1) found",
            ),
            (
                RecoveryError::NeverInitialised,
                "no checkpoint and no log start found: the volume was never initialised",
            ),
            (
                RecoveryError::NoIntactRecord,
                "no intact record in the log: nothing to rebuild from",
            ),
            (
                RecoveryError::NoUsableCheckpoint {
                    notes: notes.clone(),
                },
                "no usable checkpoint (first note; second note); refusing to guess the map: \
                 `cvol check --repair` rebuilds it from the log",
            ),
            (
                RecoveryError::RollForwardBelowCertified {
                    shortfall,
                    notes: notes.clone(),
                },
                "flushed data is damaged: checkpoint generation 3: its roll-forward ends at seq \
                 40 (segment 2, byte 512), below seq 45 certified as flushed by a SYNCED record \
                 (seq 46) in segment 2; opening would silently lose what was flushed after that \
                 point, so cvol refuses and writes nothing: `cvol check --repair` salvages every \
                 intact record and lists the blocks that are lost (first note; second note)",
            ),
        ]);
    }

    #[test]
    fn damaged_chain_messages_are_unchanged() {
        let chain = "the log is damaged: its chain of records ends at seq 10, but a later record \
                     certifies that records up to seq 12 were flushed; opening would lose them \
                     silently, so cvol refuses: `cvol check --repair` rebuilds the map from every \
                     intact record";
        let with_notes = format!("{chain} (first note; second note)");
        let notes = vec!["first note".to_string(), "second note".to_string()];
        let damaged = |notes| RecoveryError::ChainEndsBeforeCertified {
            last_seq: 10,
            certified: 12,
            notes,
        };
        assert_messages(vec![
            (damaged(Vec::new()), chain),
            (damaged(notes), &with_notes),
        ]);
    }
}

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
