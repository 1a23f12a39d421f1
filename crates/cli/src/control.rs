//! The control socket of a running server, so `stat` and `scrub` work
//! while serving: where it is, and asking it. One request per connection:
//! the client sends one line and reads one line of JSON. The commands own
//! their requests, both ends: `stat` (crate::stat), `scrub RATE`,
//! `scrub-status` and `scrub-cancel` (crate::scrub). The server side is
//! crate::control_server.
use crate::error::Error;
use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The socket's file name, derived from the volume's device and inode (so
/// any path to the same volume finds it), or for an object-store volume
/// from a hash of its address.
fn socket_name(volume: &Path) -> Option<String> {
    if let Some(url) = crate::objvol::url_of(volume) {
        let h = xxhash_rust::xxh3::xxh3_64(url.trim_end_matches('/').as_bytes());
        return Some(format!("cvol-s3-{h:016x}.ctl"));
    }
    let md = std::fs::metadata(volume).ok()?;
    let id = if md.file_type().is_file() {
        (md.dev(), md.ino())
    } else {
        (md.rdev(), 0)
    };
    Some(format!("cvol-{:x}-{:x}.ctl", id.0, id.1))
}

/// Where the service (`cvol@.service`, and any server run as root) keeps
/// control sockets.
const SERVICE_RUN_DIR: &str = "/run/cvol";

/// The directory of this user's control sockets: `CVOL_RUN_DIR` if set;
/// else /run/cvol for root, `$XDG_RUNTIME_DIR/cvol` for a user who has one,
/// and otherwise `cvol-UID` in the temporary directory. Server and client
/// compute the same path.
pub fn run_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CVOL_RUN_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let uid = rustix::process::geteuid().as_raw();
    if uid == 0 && Path::new("/run").is_dir() {
        return PathBuf::from(SERVICE_RUN_DIR);
    }
    if let Some(x) = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|x| x.is_absolute() && x.is_dir())
    {
        return x.join("cvol");
    }
    std::env::temp_dir().join(format!("cvol-{uid}"))
}

/// Whether `uid` may own or use this user's control sockets: the user
/// itself, or root.
fn trusted(uid: u32) -> bool {
    uid == 0 || uid == rustix::process::geteuid().as_raw()
}

/// Why `dir` cannot hold control sockets safely, if it cannot: it must be
/// a directory itself (not a symbolic link), belong to this user or root,
/// and be writable by nobody else (or another user could replace or squat
/// a socket there). `private` (a directory cvol made) also asks that only
/// its owner may enter it (mode 0700).
fn unsafe_dir(dir: &Path, private: bool) -> Option<String> {
    let md = match std::fs::symlink_metadata(dir) {
        Ok(md) => md,
        Err(e) => return Some(e.to_string()),
    };
    let mode = md.mode() & 0o7777;
    if md.file_type().is_symlink() {
        Some("a symbolic link, not a directory".into())
    } else if !md.is_dir() {
        Some("not a directory".into())
    } else if !trusted(md.uid()) {
        Some(format!("belongs to another user (uid {})", md.uid()))
    } else if mode & 0o022 != 0 {
        Some(format!("others may write to it (mode {mode:o})"))
    } else if private && mode & 0o077 != 0 {
        Some(format!("others may enter it (mode {mode:o}, expected 700)"))
    } else {
        None
    }
}

/// Makes (mode 0700) or checks the run directory before a server opens
/// its volume, and returns it: a directory another user made or can write
/// to is refused with the reason, as nothing there could be trusted.
pub fn prepare_run_dir() -> Result<PathBuf, Error> {
    let dir = run_dir();
    let given = std::env::var_os("CVOL_RUN_DIR").is_some_and(|d| !d.is_empty());
    if !given {
        use std::os::unix::fs::DirBuilderExt;
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                return Err(Error::Refused(format!(
                    "control socket directory {}: {e} (set CVOL_RUN_DIR to a directory of yours)",
                    dir.display()
                )))
            }
        }
    }
    match unsafe_dir(&dir, !given) {
        None => Ok(dir),
        Some(why) => Err(Error::Refused(format!(
            "control socket directory {}: {why}, so another user could replace or squat the \
             control socket; {}",
            dir.display(),
            if given {
                "set CVOL_RUN_DIR to a directory only you can write to"
            } else {
                "remove it (cvol makes it afresh, mode 0700), or set CVOL_RUN_DIR to a \
                 directory only you can write to"
            }
        ))),
    }
}

/// The control socket path of `volume` in `dir` (None: the volume cannot
/// be found to name it).
pub fn socket_path_in(dir: &Path, volume: &Path) -> Option<PathBuf> {
    Some(dir.join(socket_name(volume)?))
}

/// Whether the client at the other end of a control connection may use
/// it: the server's user or root (the socket is also mode 0600).
pub fn peer_trusted(conn: &UnixStream) -> bool {
    rustix::net::sockopt::socket_peercred(conn).is_ok_and(|c| trusted(c.uid.as_raw()))
}

/// The socket of a running server of `volume`: in this user's run
/// directory, or in the service's, in a directory no other user can write
/// to and made by this user or root.
fn live_socket(volume: &Path) -> Option<PathBuf> {
    let name = socket_name(volume)?;
    let mut dirs = vec![run_dir(), PathBuf::from(SERVICE_RUN_DIR)];
    dirs.dedup();
    dirs.into_iter()
        .filter(|d| unsafe_dir(d, false).is_none())
        .map(|d| d.join(&name))
        .find(|p| {
            std::fs::symlink_metadata(p)
                .is_ok_and(|md| md.file_type().is_socket() && trusted(md.uid()))
        })
}

/// Sends one request line to a running server; its JSON reply, or `None`
/// if none answers (or the socket is not one this user's server made).
pub fn query(volume: &Path, request: &str) -> Option<serde_json::Value> {
    query_for(volume, request, Duration::from_secs(5))
}

/// [`query`], waiting up to `timeout` for the reply (an operation the
/// server runs, such as deleting a volume).
pub fn query_for(volume: &Path, request: &str, timeout: Duration) -> Option<serde_json::Value> {
    let path = live_socket(volume)?;
    let conn = UnixStream::connect(path).ok()?;
    // The server must be this user's or root's: never tell another user's
    // process what we ask, nor believe its answer.
    if !peer_trusted(&conn) {
        return None;
    }
    let mut conn = conn;
    conn.set_read_timeout(Some(timeout)).ok()?;
    conn.write_all(format!("{request}\n").as_bytes()).ok()?;
    let mut s = String::new();
    conn.read_to_string(&mut s).ok()?;
    serde_json::from_str(s.trim()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A directory to hold control sockets must be a real directory of
    /// this user (or root) that nobody else may write to; one cvol makes
    /// must also be closed to others (0700).
    #[test]
    fn run_dirs_others_could_touch_are_refused() {
        let base = tempfile::tempdir().unwrap();
        let d = base.path().join("run");
        std::fs::create_dir(&d).unwrap();
        let chmod = |p: &Path, m| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m));
        chmod(&d, 0o700).unwrap();
        assert_eq!(unsafe_dir(&d, true), None);
        chmod(&d, 0o755).unwrap();
        assert_eq!(unsafe_dir(&d, false), None, "given: others may enter");
        assert!(unsafe_dir(&d, true).unwrap().contains("mode 755"));
        chmod(&d, 0o1777).unwrap();
        assert!(unsafe_dir(&d, false).unwrap().contains("others may write"));
        chmod(&d, 0o700).unwrap();
        let link = base.path().join("link");
        std::os::unix::fs::symlink(&d, &link).unwrap();
        assert!(unsafe_dir(&link, true).unwrap().contains("symbolic link"));
        let file = base.path().join("file");
        std::fs::write(&file, b"").unwrap();
        assert!(unsafe_dir(&file, true).unwrap().contains("not a directory"));
        // Another user's directory (only root can make one to test with).
        if rustix::process::geteuid().is_root() {
            let theirs = base.path().join("theirs");
            std::fs::create_dir(&theirs).unwrap();
            chmod(&theirs, 0o700).unwrap();
            std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
            assert!(unsafe_dir(&theirs, true)
                .unwrap()
                .contains("belongs to another user (uid 65534)"));
        }
    }

    /// The name a server binds and the name a client looks for agree, for
    /// any path to the same file.
    #[test]
    fn server_and_client_name_the_same_socket() {
        let base = tempfile::tempdir().unwrap();
        let v = base.path().join("v.cvol");
        std::fs::write(&v, b"x").unwrap();
        let alias = base.path().join("alias");
        std::os::unix::fs::symlink(&v, &alias).unwrap();
        let dir = Path::new("/x");
        assert_eq!(socket_path_in(dir, &v), socket_path_in(dir, &alias));
        assert!(socket_path_in(dir, &base.path().join("missing")).is_none());
        let s3 = socket_path_in(dir, Path::new("s3://b/p/")).unwrap();
        assert_eq!(Some(s3), socket_path_in(dir, Path::new("s3://b/p")));
    }
}
