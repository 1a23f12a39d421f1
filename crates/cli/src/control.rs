//! Control socket of a running server, so `cvol stat` works while serving.
//! One request per connection: the client sends `stat\n` and reads one line of JSON.
//! `scrub RATE`, `scrub-status` and `scrub-cancel` drive a background scrub
//! (crate::scrub).
use cvol_engine::Volume;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Socket path derived from the volume's device and inode, so any path to
/// the same volume finds it. `CVOL_RUN_DIR` overrides the directory.
pub fn socket_path(volume: &Path) -> Option<PathBuf> {
    let md = std::fs::metadata(volume).ok()?;
    let dir = std::env::var_os("CVOL_RUN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let id = if md.file_type().is_file() {
        (md.dev(), md.ino())
    } else {
        (md.rdev(), 0)
    };
    Some(dir.join(format!("cvol-{:x}-{:x}.ctl", id.0, id.1)))
}

pub struct ControlGuard {
    _socket: crate::sockfile::SocketFile,
    vol: Arc<Volume>,
}

impl Drop for ControlGuard {
    fn drop(&mut self) {
        // A running scrub stops before the volume closes.
        self.vol.cancel_scrub();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while self.vol.scrub_status().running && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

pub fn start(volume: &Path, vol: Arc<Volume>) -> Result<ControlGuard, String> {
    let path = socket_path(volume).ok_or("cannot stat the volume for its control socket")?;
    // The volume is locked by this process: a socket there is stale.
    let (listener, socket) = crate::sockfile::bind(&path, "control socket")?;
    let guard_vol = vol.clone();
    std::thread::Builder::new()
        .name("cvol-control".into())
        .spawn(move || {
            for conn in listener.incoming().flatten() {
                let _ = serve_one(conn, &vol);
            }
        })
        .map_err(|e| e.to_string())?;
    Ok(ControlGuard {
        _socket: socket,
        vol: guard_vol,
    })
}

fn serve_one(conn: UnixStream, vol: &Arc<Volume>) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut line = String::new();
    BufReader::new((&conn).take(256)).read_line(&mut line)?;
    let reply = match line.trim() {
        "stat" => crate::stat::stats_value(vol).to_string(),
        other => crate::scrub::serve_request(vol, other).unwrap_or_else(|| {
            serde_json::json!({ "error": format!("unknown request '{other}'") }).to_string()
        }),
    };
    (&conn).write_all(reply.as_bytes())?;
    (&conn).write_all(b"\n")
}

/// Asks a running server for its statistics; `None` if none answers.
pub fn query_stat(volume: &Path) -> Option<serde_json::Value> {
    let path = socket_path(volume)?;
    let mut conn = UnixStream::connect(path).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    conn.write_all(b"stat\n").ok()?;
    let mut s = String::new();
    conn.read_to_string(&mut s).ok()?;
    let v: serde_json::Value = serde_json::from_str(s.trim()).ok()?;
    v.get("logical_size_bytes").is_some().then_some(v)
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
