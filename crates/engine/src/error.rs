use std::fmt;
use std::io;

/// Errors of volume operations. Operating errors, not programmer errors.
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
    /// An earlier I/O error poisoned this handle.
    Poisoned,
    /// A record failed verification; the affected block is unreadable.
    Corrupt { lba: u64, detail: String },
    /// The volume could not be opened (bad superblock, corrupt metadata...).
    Open(String),
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
                    "volume stopped accepting writes after an I/O error; reopen it"
                )
            }
            VolError::Corrupt { lba, detail } => write!(f, "block {lba} is corrupt: {detail}"),
            VolError::Open(s) => write!(f, "{s}"),
        }
    }
}

impl std::error::Error for VolError {}
