//! Tests of `cvol_nbd::client::Client`: against this crate's own server
//! (over the in-memory backend), against scripted fake servers (fallbacks,
//! missing features, garbled replies), and against nbdkit when it is
//! installed (skipped with a message otherwise). The fake servers are in
//! `client/fake_server.rs`, the nbdkit tests in `client/nbdkit.rs`.

mod common;
#[path = "client/fake_server.rs"]
mod fake_server;
#[path = "client/nbdkit.rs"]
mod nbdkit;

use std::io;
use std::os::unix::net::UnixListener;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier};

use common::{pattern, MemBackend, TestServer};
use cvol_nbd::client::{Client, MAX_CONNECTIONS};
use cvol_nbd::{Backend, BackendError, Server, ServerConfig};

const MIB: usize = 1024 * 1024;

fn config() -> ServerConfig {
    ServerConfig {
        workers: 8,
        ..ServerConfig::default()
    }
}

/// A server over a fresh `MemBackend` and a client connected to it.
fn own_server(size_bytes: usize, config: ServerConfig) -> (TestServer, Client) {
    let ts = TestServer::start(MemBackend::new(size_bytes as u64, false), config);
    let client = Client::connect(&ts.uri("")).unwrap();
    (ts, client)
}

fn read_back(client: &Client, offset: u64, length: usize) -> Vec<u8> {
    let mut buf = vec![0xa5u8; length];
    client.read_at(offset, &mut buf).unwrap();
    buf
}

/// Asserts that `e` has `kind` and that its message contains every needle.
fn assert_error(e: &io::Error, kind: io::ErrorKind, needles: &[&str]) {
    assert_eq!(e.kind(), kind, "{e}");
    for needle in needles {
        assert!(e.to_string().contains(needle), "{needle:?} not in {e:?}");
    }
}

fn write_starts(backend: &MemBackend) -> Vec<String> {
    backend
        .log_lines()
        .into_iter()
        .filter(|l| l.starts_with("write-start"))
        .collect()
}

// ---------------------------------------------------------------------------
// Against this crate's server
// ---------------------------------------------------------------------------

#[test]
fn connect_reports_the_export() {
    let (ts, client) = own_server(8 * MIB, config());
    assert_eq!(client.size_bytes(), 8 * MIB as u64);
    assert!(!client.read_only());
    assert!(client.can_flush() && client.can_trim() && client.can_fua());
    assert!(client.can_write_zeroes() && client.can_multi_conn());
    assert_eq!(client.max_connections(), MAX_CONNECTIONS);
    // One connection is opened at once, none more until needed.
    ts.wait_for_connections(1);
    drop(client);
    ts.wait_for_connections(0);
}

#[test]
fn round_trip_at_various_offsets_and_sizes() {
    let size = 8 * MIB;
    let (ts, client) = own_server(size, config());
    let cases: [(u64, usize); 8] = [
        (0, 1),
        (1, 4095),
        (4096, 4096),
        (12_345, 100_000),
        (MIB as u64 - 7, 3 * MIB + 11),
        (size as u64 - 1, 1),
        (size as u64 - 65_536, 65_536),
        (5 * MIB as u64, 0),
    ];
    for (i, &(offset, length)) in cases.iter().enumerate() {
        let data = pattern(length, i as u8 + 1);
        client.write_at(offset, &data, i % 2 == 1).unwrap();
        assert_eq!(read_back(&client, offset, length), data, "case {i}");
        assert_eq!(ts.backend.contents(offset, length), data, "case {i}");
    }
    assert!(ts
        .backend
        .log_lines()
        .iter()
        .any(|l| l.contains("fua=true")));
}

#[test]
fn long_requests_are_split_at_the_advertised_maximum() {
    let config = ServerConfig {
        max_request_bytes: 64 * 1024,
        ..config()
    };
    let (ts, client) = own_server(4 * MIB, config);
    let data = pattern(200 * 1024 + 3, 9);
    client.write_at(1000, &data, false).unwrap();
    let starts = write_starts(&ts.backend);
    assert_eq!(starts.len(), 4, "{starts:?}");
    assert!(
        starts[0].starts_with("write-start 1000 65536 "),
        "{starts:?}"
    );
    assert_eq!(read_back(&client, 1000, data.len()), data);
}

#[test]
fn requests_over_32_mib_are_split() {
    let (ts, client) = own_server(64 * MIB, config());
    let data = pattern(40 * MIB + 5, 3);
    let offset = 8 * MIB as u64 + 512;
    client.write_at(offset, &data, false).unwrap();
    let starts = write_starts(&ts.backend);
    assert_eq!(
        starts
            .iter()
            .map(|l| l.split(' ').nth(2).unwrap().to_owned())
            .collect::<Vec<_>>(),
        [(32 * MIB).to_string(), (8 * MIB + 5).to_string()]
    );
    assert_eq!(read_back(&client, offset, data.len()), data);
}

#[test]
fn flush_trim_and_write_zeroes() {
    let (ts, client) = own_server(8 * MIB, config());
    client.write_at(0, &pattern(4 * MIB, 1), false).unwrap();
    let before = ts.backend.flushes.load(Ordering::SeqCst);
    client.flush().unwrap();
    assert_eq!(ts.backend.flushes.load(Ordering::SeqCst), before + 1);

    client.trim(MIB as u64, MIB as u64).unwrap();
    assert_eq!(ts.backend.contents(MIB as u64, MIB), vec![0; MIB]);

    client.write_zeroes(2 * MIB as u64 + 3, 100_000).unwrap();
    assert_eq!(
        read_back(&client, 2 * MIB as u64 + 3, 100_000),
        vec![0; 100_000]
    );
    let all = pattern(4 * MIB, 1);
    assert_eq!(
        read_back(&client, 2 * MIB as u64, 3),
        all[2 * MIB..2 * MIB + 3]
    );
    let after = 2 * MIB + 3 + 100_000;
    assert_eq!(read_back(&client, after as u64, 10), all[after..after + 10]);
    // Zero lengths send nothing and succeed.
    client.trim(0, 0).unwrap();
    client.write_zeroes(8 * MIB as u64, 0).unwrap();
}

#[test]
fn out_of_range_is_refused_before_sending() {
    let (ts, client) = own_server(MIB, config());
    let uri = ts.uri("");
    let size = MIB as u64;
    let mut buf = [0u8; 2];
    let errors = [
        client.read_at(size - 1, &mut buf).unwrap_err(),
        client.read_at(u64::MAX, &mut buf).unwrap_err(),
        client.write_at(size, &[1], false).unwrap_err(),
        client.trim(size - 4096, 8192).unwrap_err(),
        client.write_zeroes(4096, u64::MAX).unwrap_err(),
    ];
    for e in &errors {
        assert_error(e, io::ErrorKind::InvalidInput, &["beyond the end", &uri]);
    }
    assert!(write_starts(&ts.backend).is_empty());
    // The connection is still the first one and still works.
    client.write_at(size - 2, &[7, 8], false).unwrap();
    assert_eq!(read_back(&client, size - 2, 2), [7, 8]);
    ts.wait_for_connections(1);
}

#[test]
fn read_only_export() {
    let ts = TestServer::start(MemBackend::new(MIB as u64, true), config());
    ts.backend.fill(0, &[5; 4096]);
    let client = Client::connect(&ts.uri("")).unwrap();
    assert!(client.read_only() && !client.can_trim() && !client.can_write_zeroes());
    assert_eq!(client.max_connections(), MAX_CONNECTIONS);
    assert_eq!(read_back(&client, 0, 4096), vec![5; 4096]);
    let e = client.write_at(0, &[1], false).unwrap_err();
    assert_error(&e, io::ErrorKind::PermissionDenied, &["read-only"]);
    let e = client.write_zeroes(0, 1).unwrap_err();
    assert_error(&e, io::ErrorKind::PermissionDenied, &["read-only"]);
    client.trim(0, 4096).unwrap(); // Not advertised: a no-op.
}

#[test]
fn eight_threads_in_parallel() {
    let (ts, client) = own_server(16 * MIB, config());
    let client = Arc::new(client);
    let region = 2 * MIB;
    ts.backend.delay_ms.store(100, Ordering::SeqCst);
    *ts.backend.slow_write_byte.lock().unwrap() = Some(0xee);
    let barrier = Arc::new(Barrier::new(8));
    let threads: Vec<_> = (0..8u8)
        .map(|t| {
            let (client, barrier) = (Arc::clone(&client), Arc::clone(&barrier));
            std::thread::spawn(move || {
                let base = u64::from(t) * region as u64;
                barrier.wait();
                client.write_at(base, &[0xee; 4096], false).unwrap();
                let data = pattern(region - 4096, t);
                for (i, piece) in data.chunks(100_000 + 997 * usize::from(t)).enumerate() {
                    let at = base + 4096 + (i * (100_000 + 997 * usize::from(t))) as u64;
                    client.write_at(at, piece, false).unwrap();
                }
                client.flush().unwrap();
                let mut back = vec![0u8; region - 4096];
                client.read_at(base + 4096, &mut back).unwrap();
                assert!(back == data, "thread {t} read back other data");
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for t in 0..8u8 {
        let base = u64::from(t) * region as u64;
        assert_eq!(ts.backend.contents(base, 4096), vec![0xee; 4096]);
        assert!(ts.backend.contents(base + 4096, region - 4096) == pattern(region - 4096, t));
    }
    assert!(ts.backend.max_active.load(Ordering::SeqCst) >= 2);
    assert!(ts.server.connection_count() <= MAX_CONNECTIONS);
    assert!(ts.server.connection_count() >= 2);
}

#[test]
fn backend_errors_become_io_errors_and_the_client_recovers() {
    let (ts, client) = own_server(MIB, config());
    client.write_at(0, &[3; 4096], false).unwrap();
    let mut buf = [0u8; 4096];
    let cases = [
        (BackendError::Io, io::ErrorKind::Other, "EIO"),
        (BackendError::NoSpace, io::ErrorKind::StorageFull, "ENOSPC"),
        (
            BackendError::ReadOnly,
            io::ErrorKind::PermissionDenied,
            "EPERM",
        ),
        (BackendError::Invalid, io::ErrorKind::InvalidInput, "EINVAL"),
    ];
    for (error, kind, name) in cases {
        ts.backend.fail_with(Some(error));
        let e = client.read_at(0, &mut buf).unwrap_err();
        let message = format!("origin server answered {name} to READ of 4096 bytes at offset 0");
        assert_error(&e, kind, &[&message, &ts.uri("")]);
        let e = client.write_at(4096, &[1; 512], true).unwrap_err();
        assert_error(&e, kind, &[name, "WRITE"]);
        let e = client.flush().unwrap_err();
        assert_error(&e, kind, &[name, "FLUSH"]);
    }
    ts.backend.fail_with(None);
    assert_eq!(read_back(&client, 0, 4096), vec![3; 4096]);
    client.write_at(4096, &[1; 512], true).unwrap();
    client.flush().unwrap();
    // Error replies leave the connection usable: still the first one.
    ts.wait_for_connections(1);
}

#[test]
fn wrong_uris_name_the_uri() {
    let ts = TestServer::start(
        MemBackend::new(MIB as u64, false),
        ServerConfig {
            export_name: "cvol".into(),
            ..config()
        },
    );
    let free_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let refused = format!("nbd://127.0.0.1:{free_port}/");
    let dir = tempfile::tempdir().unwrap();
    let missing = format!("nbd+unix:///?socket={}/none.sock", dir.path().display());
    let cases = [
        ("http://127.0.0.1/x", io::ErrorKind::InvalidInput),
        ("nbds://127.0.0.1/x", io::ErrorKind::InvalidInput),
        ("nbd+unix:///x", io::ErrorKind::InvalidInput),
        ("nbd://127.0.0.1:notaport/", io::ErrorKind::InvalidInput),
        (&missing, io::ErrorKind::NotFound),
        (&refused, io::ErrorKind::ConnectionRefused),
        (&ts.uri("nope"), io::ErrorKind::NotFound),
    ];
    for (uri, kind) in cases {
        let e = Client::connect(uri).unwrap_err();
        assert_error(&e, kind, &[uri]);
    }
    let e = Client::connect("ftp://x").unwrap_err();
    assert_error(
        &e,
        io::ErrorKind::InvalidInput,
        &["nbd://HOST", "socket=PATH"],
    );
    assert_eq!(
        Client::connect(&ts.uri("cvol")).unwrap().size_bytes(),
        MIB as u64
    );
    assert_eq!(
        Client::connect(&ts.uri("")).unwrap().size_bytes(),
        MIB as u64
    );
}

#[test]
fn tcp_ipv4_and_ipv6() {
    let ts = TestServer::start(MemBackend::new(MIB as u64, false), config());
    let v4 = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = v4.local_addr().unwrap().port();
    ts.server.serve_tcp(v4).unwrap();
    let client = Client::connect(&format!("nbd://127.0.0.1:{port}")).unwrap();
    client.write_at(100, &pattern(5000, 4), true).unwrap();
    assert_eq!(read_back(&client, 100, 5000), pattern(5000, 4));
    let Ok(v6) = std::net::TcpListener::bind("[::1]:0") else {
        eprintln!("SKIP: no IPv6 loopback");
        return;
    };
    let port = v6.local_addr().unwrap().port();
    ts.server.serve_tcp(v6).unwrap();
    let client = Client::connect(&format!("nbd://[::1]:{port}/")).unwrap();
    assert_eq!(read_back(&client, 100, 5000), pattern(5000, 4));
}

#[test]
fn a_server_going_away_gives_errors_then_the_client_reconnects() {
    let ts = TestServer::start(MemBackend::new(MIB as u64, false), config());
    let uri = ts.uri("");
    let client = Client::connect(&uri).unwrap();
    client.write_at(0, &[9; 512], false).unwrap();
    ts.server.shutdown();
    let mut buf = [0u8; 512];
    // The pooled connection is dead; then no server is there at all.
    client.read_at(0, &mut buf).unwrap_err();
    let e = client.read_at(0, &mut buf).unwrap_err();
    assert!(e.to_string().contains(&uri), "{e}");
    // A new server on the same socket: the next call opens a connection.
    std::fs::remove_file(&ts.socket_path).unwrap();
    let server = Server::new(ts.backend.clone() as Arc<dyn Backend>, config());
    server
        .serve_unix(UnixListener::bind(&ts.socket_path).unwrap())
        .unwrap();
    client.read_at(0, &mut buf).unwrap();
    assert_eq!(buf, [9; 512]);
    server.shutdown();
}
