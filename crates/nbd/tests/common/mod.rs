//! Shared test helpers: a server on a Unix socket over the in-memory
//! backend of `cvol_nbd::test_util`, and (`client`) a raw NBD client.
#![allow(dead_code, reason = "each test binary uses only some of the helpers")]
pub mod client;

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

pub use cvol_nbd::test_util::MemBackend;
use cvol_nbd::{Backend, Server, ServerConfig};

/// `max_request_bytes` of the raw-client tests (limits within cheap reach).
pub const MAX_REQUEST_BYTES: u32 = 256 * 1024;

/// The server settings of the raw-client tests.
pub fn config() -> ServerConfig {
    ServerConfig {
        max_request_bytes: MAX_REQUEST_BYTES,
        workers: 4,
        ..ServerConfig::default()
    }
}

/// A running server on a Unix socket in a temporary directory.
pub struct TestServer {
    pub server: Server,
    pub backend: Arc<MemBackend>,
    pub socket_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl TestServer {
    pub fn start(backend: MemBackend, config: ServerConfig) -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        let socket_path = dir.path().join("nbd.sock");
        let backend = Arc::new(backend);
        let server = Server::new(backend.clone() as Arc<dyn Backend>, config);
        server
            .serve_unix(UnixListener::bind(&socket_path).unwrap())
            .unwrap();
        TestServer {
            server,
            backend,
            socket_path,
            _dir: dir,
        }
    }

    /// NBD URI for the export `name` ("" = default export).
    pub fn uri(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.socket_path.display())
    }

    pub fn wait_for_connections(&self, count: usize) {
        for _ in 0..500 {
            if self.server.connection_count() == count {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!(
            "connection count stayed at {}, wanted {count}",
            self.server.connection_count()
        );
    }
}

/// Returns true if `program` can be run; prints why a test is skipped if not.
pub fn have_tool(program: &str, args: &[&str]) -> bool {
    let ok = Command::new(program)
        .args(args)
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        eprintln!("SKIP: `{program}` is not installed or not working");
    }
    ok
}

/// A Python interpreter with the libnbd bindings (nbdsh's `python3` may be
/// a different interpreter than the one the bindings were built for).
pub fn python_with_libnbd() -> Option<String> {
    for python in ["python3", "/usr/bin/python3"] {
        let ok = Command::new(python)
            .args(["-c", "import nbd"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if ok {
            return Some(python.to_string());
        }
    }
    eprintln!("SKIP: no python3 with the libnbd bindings (python3-libnbd)");
    None
}

pub fn pattern(length: usize, seed: u8) -> Vec<u8> {
    (0..length)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

pub fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}
