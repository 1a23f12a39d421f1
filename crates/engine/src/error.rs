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
    /// No usable superblock: not a volume, or both copies damaged
    /// (recovery's explanation).
    Superblock(String),
    /// Recovery refused to open: no usable checkpoint, a damaged log
    /// (recovery's explanation, naming the repair).
    Recovery(String),
    /// The log has no room for the EPOCH record that opening for writing needs.
    LogFull,
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
        }
    }
}

// Display includes the inner error, so `source` stays None (printing a
// chain would repeat it).
impl std::error::Error for VolError {}

impl std::error::Error for OpenError {}
