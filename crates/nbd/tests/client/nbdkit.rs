//! The client against nbdkit, when it is installed (each test returns at
//! once otherwise): round trips over Unix and TCP, requests in parallel,
//! one connection without multi-conn, WRITE_ZEROES emulated by writes,
//! injected errors and recovery.

use std::io;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use cvol_nbd::client::Client;

use super::common::{have_tool, pattern};
use super::{assert_error, read_back, MIB};

/// A running nbdkit (killed on drop).
struct Nbdkit {
    child: Child,
    uri: String,
    _dir: tempfile::TempDir,
}

impl Nbdkit {
    /// `nbdkit -f --exit-with-parent -U SOCK ARGS…` (None: not installed).
    fn unix(args: &[&str]) -> Option<Nbdkit> {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("nbdkit.sock");
        let uri = format!("nbd+unix:///?socket={}", socket.display());
        let socket = socket.to_str().unwrap().to_owned();
        Nbdkit::start(dir, uri, &["-U", &socket], args)
    }

    /// `nbdkit -f --exit-with-parent -i 127.0.0.1 -p PORT ARGS…`.
    fn tcp(args: &[&str]) -> Option<Nbdkit> {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let uri = format!("nbd://127.0.0.1:{port}/");
        let port = port.to_string();
        let dir = tempfile::tempdir().unwrap();
        Nbdkit::start(dir, uri, &["-i", "127.0.0.1", "-p", &port], args)
    }

    fn start(dir: tempfile::TempDir, uri: String, at: &[&str], args: &[&str]) -> Option<Nbdkit> {
        if !have_tool("nbdkit", &["--version"]) {
            return None;
        }
        let child = Command::new("nbdkit")
            .args(["-f", "--exit-with-parent"])
            .args(at)
            .args(args)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn nbdkit");
        Some(Nbdkit {
            child,
            uri,
            _dir: dir,
        })
    }

    /// Connects, retrying while nbdkit starts up.
    fn client(&self) -> Client {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match Client::connect(&self.uri) {
                Ok(c) => return c,
                Err(e) if Instant::now() > deadline => panic!("nbdkit never answered: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Round trip, split request, flush, trim and zero through a real server.
fn exercise(client: &Client) {
    assert_eq!(client.size_bytes(), 64 * MIB as u64);
    assert!(client.can_flush() && client.can_trim() && client.can_write_zeroes());
    let data = pattern(40 * MIB + 3, 5);
    client.write_at(MIB as u64 - 1, &data, false).unwrap();
    assert!(read_back(client, MIB as u64 - 1, data.len()) == data);
    client
        .write_at(64 * MIB as u64 - 4096, &[7; 4096], true)
        .unwrap();
    assert_eq!(read_back(client, 64 * MIB as u64 - 4096, 4096), [7; 4096]);
    client.flush().unwrap();
    client.trim(2 * MIB as u64, MIB as u64).unwrap();
    client
        .write_zeroes(4 * MIB as u64 + 1, 3 * MIB as u64)
        .unwrap();
    assert_eq!(
        read_back(client, 4 * MIB as u64 + 1, 3 * MIB),
        vec![0; 3 * MIB]
    );
    assert_eq!(
        read_back(client, 4 * MIB as u64, 1),
        data[3 * MIB + 1..3 * MIB + 2]
    );
    let mut buf = [0u8; 2];
    let e = client.read_at(64 * MIB as u64 - 1, &mut buf).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
}

#[test]
fn nbdkit_unix_round_trip() {
    let Some(nbdkit) = Nbdkit::unix(&["memory", "64M"]) else {
        return;
    };
    let client = nbdkit.client();
    assert!(client.can_multi_conn() && client.can_fua());
    exercise(&client);
}

#[test]
fn nbdkit_tcp_round_trip() {
    let Some(nbdkit) = Nbdkit::tcp(&["memory", "64M"]) else {
        return;
    };
    exercise(&nbdkit.client());
}

#[test]
fn nbdkit_requests_run_in_parallel() {
    let Some(nbdkit) = Nbdkit::unix(&["--filter=delay", "memory", "64M", "delay-write=300ms"])
    else {
        return;
    };
    let client = Arc::new(nbdkit.client());
    let barrier = Arc::new(Barrier::new(8));
    let started = Instant::now();
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let (client, barrier) = (Arc::clone(&client), Arc::clone(&barrier));
            std::thread::spawn(move || {
                barrier.wait();
                client
                    .write_at(t * MIB as u64, &[t as u8; 4096], false)
                    .unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let elapsed = started.elapsed();
    // One after the other would take 8 × 300 ms.
    assert!(elapsed < Duration::from_millis(1500), "{elapsed:?}");
    for t in 0..8u64 {
        assert_eq!(read_back(&client, t * MIB as u64, 4096), [t as u8; 4096]);
    }
}

#[test]
fn nbdkit_without_multi_conn_uses_one_connection() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("nbdkit.log");
    let logfile = format!("logfile={}", log.display());
    let args = [
        "--filter=log",
        "--filter=multi-conn",
        "memory",
        "64M",
        "multi-conn-mode=disable",
        &logfile,
    ];
    let Some(nbdkit) = Nbdkit::unix(&args) else {
        return;
    };
    let client = Arc::new(nbdkit.client());
    assert!(!client.can_multi_conn());
    assert_eq!(client.max_connections(), 1);
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let client = Arc::clone(&client);
            std::thread::spawn(move || {
                for i in 0..10 {
                    let at = t * MIB as u64 + i * 4096;
                    client.write_at(at, &[t as u8 + 1; 4096], false).unwrap();
                }
                client.flush().unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(read_back(&client, 7 * MIB as u64, 4096), [8; 4096]);
    drop(client);
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(text.matches(" Connect ").count(), 1, "{text}");
}

#[test]
fn nbdkit_without_write_zeroes_falls_back_to_writes() {
    let args = ["--filter=nozero", "memory", "64M", "zeromode=none"];
    let Some(nbdkit) = Nbdkit::unix(&args) else {
        return;
    };
    let client = nbdkit.client();
    assert!(!client.can_write_zeroes());
    client.write_at(0, &[9; 4 * MIB], false).unwrap();
    client.write_zeroes(7, 3 * MIB as u64).unwrap();
    assert_eq!(read_back(&client, 0, 7), [9; 7]);
    assert_eq!(read_back(&client, 7, 3 * MIB), vec![0; 3 * MIB]);
    assert_eq!(read_back(&client, 3 * MIB as u64 + 7, 10), [9; 10]);
}

#[test]
fn nbdkit_injected_errors_then_recovery() {
    let probe = tempfile::tempdir().unwrap();
    let trigger = probe.path().join("inject");
    let error_file = format!("error-file={}", trigger.display());
    let args = [
        "--filter=error",
        "memory",
        "64M",
        "error=EIO",
        "error-rate=100%",
        &error_file,
    ];
    let Some(nbdkit) = Nbdkit::unix(&args) else {
        return;
    };
    let client = nbdkit.client();
    client.write_at(0, &[4; 4096], false).unwrap();
    touch(&trigger);
    let mut buf = [0u8; 4096];
    let e = client.read_at(0, &mut buf).unwrap_err();
    assert_error(
        &e,
        io::ErrorKind::Other,
        &["origin server answered EIO", "READ"],
    );
    let e = client.write_at(0, &[5; 4096], false).unwrap_err();
    assert_error(&e, io::ErrorKind::Other, &["EIO", "WRITE"]);
    std::fs::remove_file(&trigger).unwrap();
    assert_eq!(read_back(&client, 0, 4096), [4; 4096]);
}

fn touch(path: &Path) {
    std::fs::write(path, b"").unwrap();
}
