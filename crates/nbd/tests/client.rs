//! Tests of `cvol_nbd::client::Client`: against this crate's own server
//! (over the in-memory backend), against scripted fake servers (fallbacks,
//! missing features, garbled replies), and against nbdkit when it is
//! installed (skipped with a message otherwise).

mod common;

use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use common::{have_tool, pattern, MemBackend, TestServer};
use cvol_nbd::client::{Client, MAX_CONNECTIONS};
use cvol_nbd::proto::*;
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

// ---------------------------------------------------------------------------
// Scripted fake servers
// ---------------------------------------------------------------------------

const FAKE_SIZE: usize = 4 * MIB;

#[derive(Clone, Copy, PartialEq)]
enum Handshake {
    /// Fixed newstyle, answers NBD_OPT_GO.
    Go,
    /// Fixed newstyle, answers NBD_OPT_GO with NBD_REP_ERR_UNSUP.
    GoUnsupported,
    /// Newstyle without the fixed flag (and without NO_ZEROES).
    NotFixed,
}

/// How a connection answers its first request (later ones: `Good`).
#[derive(Clone, Copy, Debug)]
enum Answer {
    Good,
    BadMagic,
    WrongHandle,
    Structured,
    /// A READ reply with half of its data, then the connection closes.
    ShortData,
}

#[derive(Default)]
struct FakeLog {
    client_flags: Vec<u32>,
    options: Vec<u32>,
    /// The data of every NBD_OPT_GO.
    go_data: Vec<Vec<u8>>,
    /// (command, flags, offset, length) of every request.
    requests: Vec<(u16, u16, u64, u32)>,
}

struct FakeServer {
    path: PathBuf,
    log: Arc<Mutex<FakeLog>>,
    connections: Arc<AtomicUsize>,
    _dir: tempfile::TempDir,
}

struct FakeConn {
    s: UnixStream,
    handshake: Handshake,
    flags: u16,
    log: Arc<Mutex<FakeLog>>,
    data: Arc<Mutex<Vec<u8>>>,
}

impl FakeServer {
    /// Serves a `FAKE_SIZE` export advertising `flags`; connection `i`
    /// answers its first request as `script[i]` says.
    fn start(handshake: Handshake, flags: u16, script: Vec<Answer>) -> FakeServer {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fake.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let log = Arc::new(Mutex::new(FakeLog::default()));
        let connections = Arc::new(AtomicUsize::new(0));
        let data = Arc::new(Mutex::new(vec![0u8; FAKE_SIZE]));
        let (log2, connections2) = (Arc::clone(&log), Arc::clone(&connections));
        std::thread::spawn(move || {
            for (i, s) in listener.incoming().enumerate() {
                let Ok(s) = s else { return };
                connections2.fetch_add(1, Ordering::SeqCst);
                let mut conn = FakeConn {
                    s,
                    handshake,
                    flags,
                    log: Arc::clone(&log2),
                    data: Arc::clone(&data),
                };
                let first = script.get(i).copied().unwrap_or(Answer::Good);
                std::thread::spawn(move || conn.serve(first));
            }
        });
        FakeServer {
            path,
            log,
            connections,
            _dir: dir,
        }
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///disk?socket={}", self.path.display())
    }

    fn requests(&self) -> Vec<(u16, u16, u64, u32)> {
        self.log.lock().unwrap().requests.clone()
    }
}

impl FakeConn {
    fn read_n(&mut self, n: usize) -> io::Result<Vec<u8>> {
        let mut v = vec![0u8; n];
        self.s.read_exact(&mut v)?;
        Ok(v)
    }

    fn handshake(&mut self) -> io::Result<()> {
        let fixed = self.handshake != Handshake::NotFixed;
        let handshake_flags = if fixed {
            NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES
        } else {
            0
        };
        self.s.write_all(&encode_greeting(handshake_flags))?;
        let client_flags = u32::from_be_bytes(self.read_n(4)?.try_into().unwrap());
        self.log.lock().unwrap().client_flags.push(client_flags);
        let no_zeroes = client_flags & NBD_FLAG_C_NO_ZEROES != 0;
        loop {
            let header: [u8; 16] = self.read_n(16)?.try_into().unwrap();
            let h = parse_option_header(&header).unwrap();
            let data = self.read_n(h.length_bytes as usize)?;
            let mut log = self.log.lock().unwrap();
            log.options.push(h.option);
            if h.option == NBD_OPT_GO {
                log.go_data.push(data);
            }
            drop(log);
            let reply = match (h.option, self.handshake) {
                (NBD_OPT_GO, Handshake::Go) => {
                    let info = encode_info_export(FAKE_SIZE as u64, self.flags);
                    let mut r = encode_option_reply(NBD_OPT_GO, NBD_REP_INFO, &info);
                    r.extend(encode_option_reply(NBD_OPT_GO, NBD_REP_ACK, &[]));
                    self.s.write_all(&r)?;
                    return Ok(());
                }
                (NBD_OPT_EXPORT_NAME, _) => {
                    let r = encode_export_name_reply(FAKE_SIZE as u64, self.flags, no_zeroes);
                    self.s.write_all(&r)?;
                    return Ok(());
                }
                (option, _) => encode_option_reply(option, NBD_REP_ERR_UNSUP, &[]),
            };
            self.s.write_all(&reply)?;
        }
    }

    /// Runs one request; returns its READ data.
    fn apply(&mut self, h: &RequestHeader) -> io::Result<Vec<u8>> {
        let (offset, length) = (h.offset as usize, h.length as usize);
        let mut data = self.data.lock().unwrap();
        let range = offset..(offset + length).min(FAKE_SIZE);
        match h.command {
            NBD_CMD_WRITE => {
                drop(data);
                let payload = self.read_n(length)?;
                let mut data = self.data.lock().unwrap();
                data[range.clone()].copy_from_slice(&payload[..range.len()]);
                Ok(Vec::new())
            }
            NBD_CMD_READ => Ok(data[range].to_vec()),
            NBD_CMD_WRITE_ZEROES | NBD_CMD_TRIM => {
                data[range].fill(0);
                Ok(Vec::new())
            }
            _ => Ok(Vec::new()),
        }
    }

    fn serve(&mut self, first: Answer) -> io::Result<()> {
        self.handshake()?;
        let mut answer = first;
        loop {
            let header: [u8; REQUEST_HEADER_BYTES] = self.read_n(28)?.try_into().unwrap();
            let h = parse_request_header(&header).unwrap();
            let entry = (h.command, h.flags, h.offset, h.length);
            self.log.lock().unwrap().requests.push(entry);
            if h.command == NBD_CMD_DISC {
                return Ok(());
            }
            let data = self.apply(&h)?;
            let mut reply = match answer {
                Answer::Good | Answer::ShortData => encode_simple_reply(0, h.handle).to_vec(),
                Answer::BadMagic => vec![0xde; 16],
                Answer::WrongHandle => encode_simple_reply(0, h.handle ^ 1).to_vec(),
                Answer::Structured => encode_none_chunk(h.handle).to_vec(),
            };
            if let Answer::ShortData = answer {
                reply.extend_from_slice(&data[..data.len() / 2]);
                return self.s.write_all(&reply);
            }
            reply.extend_from_slice(&data);
            self.s.write_all(&reply)?;
            answer = Answer::Good;
        }
    }
}

/// Everything the fake servers can advertise.
const ALL_FLAGS: u16 = NBD_FLAG_HAS_FLAGS
    | NBD_FLAG_SEND_FLUSH
    | NBD_FLAG_SEND_FUA
    | NBD_FLAG_SEND_TRIM
    | NBD_FLAG_SEND_WRITE_ZEROES
    | NBD_FLAG_CAN_MULTI_CONN;

#[test]
fn go_asks_for_block_size_and_never_for_structured_replies() {
    let fake = FakeServer::start(Handshake::Go, ALL_FLAGS, vec![]);
    let client = Client::connect(&fake.uri()).unwrap();
    assert_eq!(client.size_bytes(), FAKE_SIZE as u64);
    client.write_at(10, b"hello", true).unwrap();
    assert_eq!(read_back(&client, 10, 5), b"hello");
    let log = fake.log.lock().unwrap();
    assert_eq!(log.options, [NBD_OPT_GO]);
    let go = parse_info_request(&log.go_data[0]).unwrap();
    assert_eq!(go.export_name, "disk");
    assert_eq!(go.info_types, [NBD_INFO_BLOCK_SIZE]);
    assert_eq!(
        log.client_flags,
        [NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES]
    );
    assert_eq!(log.requests[0], (NBD_CMD_WRITE, NBD_CMD_FLAG_FUA, 10, 5));
}

#[test]
fn falls_back_to_export_name() {
    for handshake in [Handshake::GoUnsupported, Handshake::NotFixed] {
        let fake = FakeServer::start(handshake, ALL_FLAGS, vec![]);
        let client = Client::connect(&fake.uri()).unwrap();
        assert_eq!(client.size_bytes(), FAKE_SIZE as u64);
        assert!(client.can_trim());
        client.write_at(4096, &pattern(10_000, 2), false).unwrap();
        assert_eq!(read_back(&client, 4096, 10_000), pattern(10_000, 2));
        let log = fake.log.lock().unwrap();
        if handshake == Handshake::NotFixed {
            assert_eq!(log.client_flags, [0]);
            assert_eq!(log.options, [NBD_OPT_EXPORT_NAME]);
        } else {
            assert_eq!(log.options, [NBD_OPT_GO, NBD_OPT_EXPORT_NAME]);
        }
    }
}

#[test]
fn missing_features_without_multi_conn() {
    let fake = FakeServer::start(Handshake::Go, NBD_FLAG_HAS_FLAGS, vec![]);
    let client = Arc::new(Client::connect(&fake.uri()).unwrap());
    assert!(!client.can_flush() && !client.can_trim() && !client.can_fua());
    assert!(!client.can_write_zeroes() && !client.can_multi_conn());
    assert_eq!(client.max_connections(), 1);
    client.write_at(0, &[1; 3 * MIB], true).unwrap();
    client.flush().unwrap();
    client.trim(0, 4096).unwrap();
    // FUA without FUA or FLUSH: a plain write; flush and trim: nothing.
    assert_eq!(fake.requests(), [(NBD_CMD_WRITE, 0, 0, 3 * MIB as u32)]);

    client.write_zeroes(5, 2 * MIB as u64 + 10).unwrap();
    let requests = fake.requests();
    let lengths: Vec<u32> = requests[1..].iter().map(|r| r.3).collect();
    assert_eq!(lengths, [MIB as u32, MIB as u32, 10]);
    assert!(requests[1..].iter().all(|r| r.0 == NBD_CMD_WRITE));
    assert_eq!(read_back(&client, 0, 5), [1; 5]);
    assert_eq!(read_back(&client, 5, 2 * MIB + 10), vec![0; 2 * MIB + 10]);
    assert_eq!(read_back(&client, 2 * MIB as u64 + 15, 10), [1; 10]);

    // Eight threads share the one connection.
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let client = Arc::clone(&client);
            std::thread::spawn(move || {
                for i in 0..20 {
                    let at = t * 65536 + i * 1000;
                    client.write_at(at, &[t as u8; 1000], false).unwrap();
                    assert_eq!(read_back(&client, at, 1000), [t as u8; 1000]);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(fake.connections.load(Ordering::SeqCst), 1);
}

#[test]
fn garbled_replies_are_errors_and_connections_are_replaced() {
    let script = vec![
        Answer::BadMagic,
        Answer::WrongHandle,
        Answer::Structured,
        Answer::ShortData,
    ];
    let fake = FakeServer::start(Handshake::Go, ALL_FLAGS, script);
    let client = Client::connect(&fake.uri()).unwrap();
    client.write_at(0, &[0x42; 8192], false).unwrap_err(); // bad magic
    let mut buf = [0u8; 8192];
    for needle in ["handle", "structured", "closed the connection"] {
        let e = client.read_at(0, &mut buf).unwrap_err();
        assert_error(
            &e,
            io::ErrorKind::InvalidData,
            &[needle, "READ", &fake.uri()],
        );
    }
    assert_eq!(fake.connections.load(Ordering::SeqCst), 4);
    // The fifth connection behaves: the data of the first write landed.
    client.read_at(0, &mut buf).unwrap();
    assert_eq!(buf, [0x42; 8192]);
    assert_eq!(fake.connections.load(Ordering::SeqCst), 5);
}

// ---------------------------------------------------------------------------
// Against nbdkit
// ---------------------------------------------------------------------------

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
