//! Unix socket paths a server binds (`--socket`, the control socket):
//! never replace anything but the stale socket of a dead server, and at
//! exit remove only the socket this process created.
use crate::error::Error;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// The socket file this process bound; removed on drop if it is still
/// that file (not one another process put there since).
pub struct SocketFile {
    path: PathBuf,
    id: (u64, u64),
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if let Ok(md) = std::fs::symlink_metadata(&self.path) {
            if (md.dev(), md.ino()) == self.id {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

/// Binds a listener at `path`. An existing path is refused (nothing is
/// touched) unless it is a socket nobody answers on, which is removed:
/// `what` names the path in messages (e.g. "--socket").
pub fn bind(path: &Path, what: &str) -> Result<(UnixListener, SocketFile), Error> {
    match std::fs::symlink_metadata(path) {
        Ok(md) if md.file_type().is_socket() => match UnixStream::connect(path) {
            Ok(_) => {
                return Err(Error::Refused(format!(
                    "{what} {}: a running server listens on this socket; stop it or choose another path",
                    path.display()
                )))
            }
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                std::fs::remove_file(path).map_err(|e| Error::Refused({
                    format!(
                        "{what} {}: cannot remove the stale socket: {e}",
                        path.display()
                    )
                }))?;
                tracing::info!(
                    "{what} {}: removed a stale socket (no server answered on it)",
                    path.display()
                );
            }
            Err(e) => {
                return Err(Error::Refused(format!(
                    "{what} {}: a socket is there and cannot be tested ({e}); refusing to replace it",
                    path.display()
                )))
            }
        },
        Ok(md) => {
            let ft = md.file_type();
            let kind = if ft.is_dir() {
                "a directory"
            } else if ft.is_symlink() {
                "a symbolic link"
            } else if ft.is_file() {
                "a file"
            } else {
                "not a socket"
            };
            return Err(Error::Refused(format!(
                "{what} {} exists ({kind}); refusing to replace it: choose another path",
                path.display()
            )));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(format!("{what} {}", path.display()), e)),
    }
    let l =
        UnixListener::bind(path).map_err(|e| Error::io(format!("{what} {}", path.display()), e))?;
    let md = std::fs::symlink_metadata(path)
        .map_err(|e| Error::io(format!("{what} {}", path.display()), e))?;
    Ok((
        l,
        SocketFile {
            path: path.to_path_buf(),
            id: (md.dev(), md.ino()),
        },
    ))
}
