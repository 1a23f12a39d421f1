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
    let dir = std::env::var_os("CVOL_RUN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
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

/// Sends one request line to a running server; its JSON reply, or `None`
/// if none answers.
pub fn query(volume: &Path, request: &str) -> Option<serde_json::Value> {
    let path = socket_path(volume)?;
    let mut conn = UnixStream::connect(path).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    conn.write_all(format!("{request}\n").as_bytes()).ok()?;
    let mut s = String::new();
    conn.read_to_string(&mut s).ok()?;
    serde_json::from_str(s.trim()).ok()
}
