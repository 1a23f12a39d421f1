//! Why a command could not run (exit 2): the message after `cvol: `.
use std::fmt;

/// Why a command could not run. The variant says where to look; the
/// message names the flag, path or step and what is wrong with it.
#[derive(Debug)]
pub enum Error {
    /// A flag, an argument or a combination of them is refused before
    /// anything was touched: the command line must change. The message
    /// names the flag (`--size 0 must be ...`).
    Usage(String),
    /// What the command works on refuses it or failed: not a volume, in
    /// use, too short, unreachable, a server's refusal, a failed open,
    /// write or close. The message names the path or step and the reason.
    Refused(String),
    /// An operating-system call failed: `what` names the file, socket or
    /// step (`what: source` is the message).
    Io {
        what: String,
        source: std::io::Error,
    },
}

impl Error {
    /// An I/O failure of `what` (a path shown with `.display()`, or a step).
    pub fn io(what: impl fmt::Display, source: std::io::Error) -> Error {
        Error::Io {
            what: what.to_string(),
            source,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Usage(m) | Error::Refused(m) => f.write_str(m),
            Error::Io { what, source } => write!(f, "{what}: {source}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
