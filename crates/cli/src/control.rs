//! The control socket of a running server, so `stat` and `scrub` work
//! while serving: where it is, and asking it. One request per connection:
//! the client sends one line and reads one line of JSON. The commands own
//! their requests, both ends: `stat` (crate::stat), `scrub RATE`,
//! `scrub-status` and `scrub-cancel` (crate::scrub). The server side is
//! crate::control_server.
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Socket path derived from the volume's device and inode, so any path to
/// the same volume finds it. `CVOL_RUN_DIR` overrides the directory.
pub fn socket_path(volume: &Path) -> Option<PathBuf> {
    let dir = run_dir();
    if let Some(url) = crate::objvol::url_of(volume) {
        // An object-store volume: named by a hash of its address.
        let h = xxhash_rust::xxh3::xxh3_64(url.trim_end_matches('/').as_bytes());
        return Some(dir.join(format!("cvol-s3-{h:016x}.ctl")));
    }
    let md = std::fs::metadata(volume).ok()?;
    let id = if md.file_type().is_file() {
        (md.dev(), md.ino())
    } else {
        (md.rdev(), 0)
    };
    Some(dir.join(format!("cvol-{:x}-{:x}.ctl", id.0, id.1)))
}

/// The directory of control sockets: `CVOL_RUN_DIR`, or the temporary
/// directory.
fn run_dir() -> PathBuf {
    std::env::var_os("CVOL_RUN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
}

/// Whether `uid` may own or use this user's control sockets: the user
/// itself, or root.
fn trusted(uid: u32) -> bool {
    uid == 0 || uid == rustix::process::geteuid().as_raw()
}

/// Checks, before a server binds its control socket there, that no other
/// user can replace or squat the socket: the directory belongs to this
/// user or root, and others cannot write to it unless it is sticky (as
/// /tmp is).
pub fn check_run_dir() -> Result<(), String> {
    let dir = run_dir();
    let md = std::fs::metadata(&dir)
        .map_err(|e| format!("control socket directory {}: {e}", dir.display()))?;
    if !md.is_dir() {
        return Err(format!(
            "control socket directory {}: not a directory (set CVOL_RUN_DIR to one)",
            dir.display()
        ));
    }
    let mode = md.mode();
    let shared_writable = mode & 0o022 != 0 && mode & 0o1000 == 0;
    if !trusted(md.uid()) || shared_writable {
        return Err(format!(
            "control socket directory {}: {} (mode {:o}, owner uid {}), so another user could \
             replace the control socket; set CVOL_RUN_DIR to a directory of yours",
            dir.display(),
            if trusted(md.uid()) {
                "others may write to it and it is not sticky"
            } else {
                "belongs to another user"
            },
            mode & 0o7777,
            md.uid()
        ));
    }
    Ok(())
}

/// Whether the client at the other end of a control connection may use
/// it: the server's user or root (the socket is also mode 0600).
pub fn peer_trusted(conn: &UnixStream) -> bool {
    rustix::net::sockopt::socket_peercred(conn).is_ok_and(|c| trusted(c.uid.as_raw()))
}

/// Where systemd's `cvol@.service` keeps control sockets
/// (`CVOL_RUN_DIR=/run/cvol`): clients look there too.
const SERVICE_RUN_DIR: &str = "/run/cvol";

/// The socket of a running server of `volume`: in the run directory, or
/// in the service's, made by this user or root.
fn live_socket(volume: &Path) -> Option<PathBuf> {
    let path = socket_path(volume)?;
    let name = path.file_name()?.to_owned();
    [path, Path::new(SERVICE_RUN_DIR).join(name)]
        .into_iter()
        .find(|p| std::fs::symlink_metadata(p).is_ok_and(|md| trusted(md.uid())))
}

/// Sends one request line to a running server; its JSON reply, or `None`
/// if none answers (or the socket is not one this user's server made).
pub fn query(volume: &Path, request: &str) -> Option<serde_json::Value> {
    let path = live_socket(volume)?;
    let mut conn = UnixStream::connect(path).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    conn.write_all(format!("{request}\n").as_bytes()).ok()?;
    let mut s = String::new();
    conn.read_to_string(&mut s).ok()?;
    serde_json::from_str(s.trim()).ok()
}
