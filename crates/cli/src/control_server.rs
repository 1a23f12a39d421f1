//! The server side of the control socket (crate::control): a thread that
//! answers each request with the command that owns it.
use crate::error::Error;
use crate::{control, resize, scrub, sockfile, stat, volumes};
use cvol_engine::pool::Pool;
use cvol_engine::Volume;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The control socket while the server runs: dropped, it removes the
/// socket file and stops a running scrub.
pub struct ControlGuard {
    _socket: sockfile::SocketFile,
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

/// A bound control socket not answered yet (the volume is not open).
pub struct Bound {
    listener: std::os::unix::net::UnixListener,
    socket: sockfile::SocketFile,
}

/// Binds the control socket of `volume` in `dir` (from
/// `control::prepare_run_dir`): a local volume's before it is opened, once
/// its lock is held; an object-store volume's once the server claimed it.
pub fn bind(dir: &Path, volume: &Path) -> Result<Bound, Error> {
    let path = control::socket_path_in(dir, volume).ok_or(Error::Refused(
        "cannot stat the volume for its control socket".into(),
    ))?;
    // A local volume is locked by this process: a socket there is stale.
    // An object-store volume is this server's once it fenced the older
    // one, which may still listen here (stopped, on this host): its
    // socket is replaced, so `stat` asks the server that owns the volume.
    if crate::objvol::url_of(volume).is_some() {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        if std::fs::symlink_metadata(&path).is_ok_and(|m| {
            m.file_type().is_socket() && m.uid() == rustix::process::geteuid().as_raw()
        }) {
            tracing::info!(
                "control socket {}: replacing the socket of the server this one took over from",
                path.display()
            );
            let _ = std::fs::remove_file(&path);
        }
    }
    let (listener, socket) = sockfile::bind(&path, "control socket")?;
    // Only this user (and root) may ask for stat or start a scrub: the
    // directory is the user's, the mode keeps others from connecting, and
    // the peer check below covers the moment between bind and chmod.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| Error::Refused(format!("control socket {}: {e}", path.display())))?;
    Ok(Bound { listener, socket })
}

/// Answers the bound control socket for `vol` (and its `pool`, if it is
/// one) on a thread of its own.
pub fn start(
    bound: Bound,
    vol: Arc<Volume>,
    pool: Option<Arc<Pool>>,
) -> Result<ControlGuard, Error> {
    let Bound { listener, socket } = bound;
    let guard_vol = vol.clone();
    std::thread::Builder::new()
        .name("cvol-control".into())
        .spawn(move || {
            for conn in listener.incoming().flatten() {
                let _ = serve_one(conn, &vol, pool.as_deref());
            }
        })
        .map_err(|e| Error::Refused(format!("cannot start the control socket's thread: {e}")))?;
    Ok(ControlGuard {
        _socket: socket,
        vol: guard_vol,
    })
}

fn serve_one(conn: UnixStream, vol: &Arc<Volume>, pool: Option<&Pool>) -> std::io::Result<()> {
    if !control::peer_trusted(&conn) {
        tracing::warn!("control socket: a connection from another user refused");
        return Ok(());
    }
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut line = String::new();
    BufReader::new((&conn).take(256)).read_line(&mut line)?;
    let reply = match line.trim() {
        stat::REQUEST => stat::reply(vol),
        other if other.starts_with("volume ") => volumes::serve_request(pool, other)
            .unwrap_or_else(|| {
                serde_json::json!({ "error": format!("malformed request '{other}'") }).to_string()
            }),
        other if other.starts_with("store ") => {
            resize::serve_request(vol, other).unwrap_or_else(|| {
                serde_json::json!({ "error": format!("malformed request '{other}'") }).to_string()
            })
        }
        other => scrub::serve_request(vol, other).unwrap_or_else(|| {
            serde_json::json!({ "error": format!("unknown request '{other}'") }).to_string()
        }),
    };
    (&conn).write_all(reply.as_bytes())?;
    (&conn).write_all(b"\n")
}
