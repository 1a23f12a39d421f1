//! TLS at the NBD edge, byte by byte: `NBD_OPT_STARTTLS`, `require` (nothing
//! listed or served in the clear), client certificates (`verify_peer`),
//! credentials reloaded for new connections, hostile TLS handshakes, and
//! `allow` for TCP peers. The client is rustls over the raw test client's
//! option and request helpers. Fixtures: `tests/tls/` (see its make.sh).
mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::client::{Client, CLIENT_FLAGS};
use common::{config, pattern, MemBackend, TestServer};
use cvol_nbd::proto::*;
use cvol_nbd::test_util::{go_data, option};
use cvol_nbd::tls::{TlsCredentials, TlsMode, TlsSettings};
use cvol_nbd::{Backend, Server, ServerConfig};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

const SIZE_BYTES: u64 = 16 * 1024 * 1024;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tls")
}

fn tls_config(mode: TlsMode, dir: &Path, verify_peer: bool) -> ServerConfig {
    ServerConfig {
        tls: Some(TlsSettings {
            mode,
            credentials: Arc::new(TlsCredentials::load(dir, verify_peer).unwrap()),
        }),
        ..config()
    }
}

fn start(mode: TlsMode, verify_peer: bool) -> TestServer {
    TestServer::start(
        MemBackend::new(SIZE_BYTES, false),
        tls_config(mode, &fixtures().join("server"), verify_peer),
    )
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// A rustls client trusting the test CA, with the certificate of
/// `identity` (a fixture directory holding client-cert.pem and
/// client-key.pem), if any.
fn client_config(identity: Option<&str>) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(fixtures().join("ca/ca-cert.pem")).unwrap())
        .unwrap();
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match identity {
        None => builder.with_no_client_auth(),
        Some(name) => {
            let dir = fixtures().join(name);
            let certs = vec![CertificateDer::from_pem_file(dir.join("client-cert.pem")).unwrap()];
            let key = PrivateKeyDer::from_pem_file(dir.join("client-key.pem")).unwrap();
            builder.with_client_auth_cert(certs, key).unwrap()
        }
    };
    Arc::new(config)
}

type Tls = rustls::StreamOwned<rustls::ClientConnection, UnixStream>;

fn read_n(s: &mut impl Read, n: usize) -> std::io::Result<Vec<u8>> {
    let mut v = vec![0u8; n];
    s.read_exact(&mut v)?;
    Ok(v)
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b.try_into().unwrap())
}

/// One option reply over any stream: (option, reply type, data).
fn option_reply(s: &mut impl Read) -> std::io::Result<(u32, u32, Vec<u8>)> {
    let h = read_n(s, 20)?;
    assert_eq!(
        u64::from_be_bytes(h[0..8].try_into().unwrap()),
        OPTION_REPLY_MAGIC
    );
    let data = read_n(s, be32(&h[16..20]) as usize)?;
    Ok((be32(&h[8..12]), be32(&h[12..16]), data))
}

/// NBD_OPT_GO for the default export; Ok(size) or the error reply type
/// (an I/O error if the connection failed, e.g. a TLS alert).
fn go(s: &mut (impl Read + Write)) -> std::io::Result<Result<u64, u32>> {
    s.write_all(&option(NBD_OPT_GO, &go_data("", &[])))?;
    let mut size = None;
    loop {
        let (opt, kind, data) = option_reply(s)?;
        assert_eq!(opt, NBD_OPT_GO);
        match kind {
            NBD_REP_ACK => return Ok(Ok(size.expect("NBD_INFO_EXPORT"))),
            NBD_REP_INFO if data[0..2] == [0, 0] => {
                size = Some(u64::from_be_bytes(data[2..10].try_into().unwrap()))
            }
            NBD_REP_INFO => {}
            error => return Ok(Err(error)),
        }
    }
}

/// Greets, sends STARTTLS, checks its ACK and runs the TLS handshake.
fn starttls(ts: &TestServer, identity: Option<&str>) -> std::io::Result<Tls> {
    let mut c = Client::connect(ts);
    c.greet(CLIENT_FLAGS);
    c.send_option(NBD_OPT_STARTTLS, &[]);
    assert_eq!(c.option_reply(), (NBD_OPT_STARTTLS, NBD_REP_ACK, vec![]));
    let conn = rustls::ClientConnection::new(
        client_config(identity),
        ServerName::try_from("localhost").unwrap(),
    )
    .unwrap();
    let mut tls = rustls::StreamOwned::new(conn, c.s);
    while tls.conn.is_handshaking() {
        tls.conn.complete_io(&mut tls.sock)?;
    }
    Ok(tls)
}

/// A TLS client in transmission (simple replies).
fn ready(ts: &TestServer, identity: Option<&str>) -> Tls {
    let mut tls = starttls(ts, identity).unwrap();
    assert_eq!(go(&mut tls).unwrap(), Ok(SIZE_BYTES));
    tls
}

fn write(s: &mut impl Write, handle: u64, offset: u64, data: &[u8]) {
    let mut req = Client::header(NBD_CMD_WRITE, 0, handle, offset, data.len() as u32);
    req.extend_from_slice(data);
    s.write_all(&req).unwrap();
}

fn read_request(s: &mut impl Write, handle: u64, offset: u64, length: u32) {
    s.write_all(&Client::header(NBD_CMD_READ, 0, handle, offset, length))
        .unwrap();
}

/// A simple reply: (handle, error, `payload` bytes that follow it).
fn simple_reply(s: &mut impl Read, payload: usize) -> (u64, u32, Vec<u8>) {
    let h = read_n(s, 16).unwrap();
    assert_eq!(be32(&h[0..4]), SIMPLE_REPLY_MAGIC);
    let error = be32(&h[4..8]);
    let handle = u64::from_be_bytes(h[8..16].try_into().unwrap());
    let data = if error == 0 {
        read_n(s, payload).unwrap()
    } else {
        vec![]
    };
    (handle, error, data)
}

#[test]
fn require_lists_and_serves_nothing_before_tls() {
    let ts = start(TlsMode::Require, false);
    let mut c = Client::connect(&ts);
    c.greet(CLIENT_FLAGS);
    for (opt, data) in [
        (NBD_OPT_LIST, vec![]),
        (NBD_OPT_INFO, go_data("", &[NBD_INFO_NAME])),
        (NBD_OPT_GO, go_data("", &[])),
        (NBD_OPT_STRUCTURED_REPLY, vec![]),
        (NBD_OPT_LIST_META_CONTEXT, vec![0; 8]),
        (4242, vec![]),
    ] {
        c.send_option(opt, &data);
        let (o, kind, _) = c.option_reply();
        assert_eq!((o, kind), (opt, NBD_REP_ERR_TLS_REQD), "option {opt}");
    }
    // EXPORT_NAME has no error reply: the connection closes, no export sent.
    c.send_option(NBD_OPT_EXPORT_NAME, b"");
    assert!(c.is_closed());
    // ABORT is still answered.
    let mut c = Client::connect(&ts);
    c.greet(CLIENT_FLAGS);
    c.send_option(NBD_OPT_ABORT, &[]);
    assert_eq!(c.option_reply().1, NBD_REP_ACK);
}

#[test]
fn data_round_trips_over_tls_with_a_client_certificate() {
    let ts = start(TlsMode::Require, true);
    let mut tls = ready(&ts, Some("client"));
    let data = pattern(1 << 20, 7);
    for (i, chunk) in data.chunks(256 * 1024).enumerate() {
        write(&mut tls, i as u64, (i * 256 * 1024) as u64, chunk);
    }
    for _ in 0..4 {
        assert_eq!(simple_reply(&mut tls, 0).1, 0);
    }
    tls.write_all(&Client::header(NBD_CMD_FLUSH, 0, 99, 0, 0))
        .unwrap();
    assert_eq!(simple_reply(&mut tls, 0), (99, 0, vec![]));
    // 32 reads of 256 KiB queued before any reply is read: far more than
    // the socket buffers hold, so replies go out partly from workers and
    // partly from the writer thread, with ciphertext left between them.
    const READS: u64 = 32;
    for h in 0..READS {
        read_request(&mut tls, h, (h % 4) * 256 * 1024, 256 * 1024);
    }
    let mut seen = vec![false; READS as usize];
    for _ in 0..READS {
        let (h, error, got) = simple_reply(&mut tls, 256 * 1024);
        assert_eq!(error, 0);
        let at = ((h % 4) * 256 * 1024) as usize;
        assert!(
            got == data[at..at + 256 * 1024],
            "read {h} returned other bytes"
        );
        seen[h as usize] = true;
    }
    assert!(seen.iter().all(|&s| s));
    // One read at a time, read late: a worker sends each reply, the socket
    // takes only part of its ciphertext, and the rest must still go out
    // (the writer thread finishes it).
    for length in [255 * 1024, 256 * 1024 - 16, 256 * 1024 - 4096] {
        read_request(&mut tls, 100, 4096, length);
        // Not reading yet: the socket fills up while the worker sends.
        std::thread::sleep(Duration::from_millis(50));
        let (_, error, got) = simple_reply(&mut tls, length as usize);
        assert_eq!(error, 0);
        assert!(
            got == data[4096..4096 + length as usize],
            "read of {length} returned other bytes"
        );
    }
    assert!(ts.backend.contents(0, data.len()) == data);
    tls.write_all(&Client::header(NBD_CMD_DISC, 0, 0, 0, 0))
        .unwrap();
    // The server closes with a TLS close_notify: a clean end of stream.
    let mut rest = Vec::new();
    assert_eq!(tls.read_to_end(&mut rest).unwrap(), 0);
}

/// Counts busy polls (`ServerConfig::busy_poll`).
#[derive(Default)]
struct CountPolls(std::sync::atomic::AtomicUsize);

impl cvol_nbd::RequestObserver for CountPolls {
    fn request_done(&self, _: cvol_nbd::CommandKind, _: Duration) {}
    fn connections(&self, _: usize) {}
    fn busy_poll(&self, _: bool, _: Duration) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

#[test]
fn a_tls_connection_is_never_busy_polled() {
    // The TLS session may hold a request that a poll of the socket cannot
    // see: its reader sleeps in the read at once, and requests one at a
    // time still get their replies.
    let polls = Arc::new(CountPolls::default());
    let ts = TestServer::start(
        MemBackend::new(SIZE_BYTES, false),
        ServerConfig {
            busy_poll: Duration::from_micros(500),
            busy_poll_threads: 4,
            observer: Some(cvol_nbd::ObserverHandle(polls.clone())),
            ..tls_config(TlsMode::Require, &fixtures().join("server"), false)
        },
    );
    let mut tls = ready(&ts, None);
    for i in 0..100u64 {
        let data = pattern(4096, i as u8);
        write(&mut tls, 2 * i, (i % 16) * 4096, &data);
        assert_eq!(simple_reply(&mut tls, 0), (2 * i, 0, vec![]));
        read_request(&mut tls, 2 * i + 1, (i % 16) * 4096, 4096);
        assert_eq!(simple_reply(&mut tls, 4096), (2 * i + 1, 0, data));
    }
    assert_eq!(polls.0.load(std::sync::atomic::Ordering::Relaxed), 0);
}

#[test]
fn peer_certificates_are_checked() {
    let ts = start(TlsMode::Require, true);
    for identity in [None, Some("rogue"), Some("expired")] {
        // TLS 1.3: the server judges the client's certificate after the
        // client's side of the handshake is done; its alert ends the next read.
        let refused = match starttls(&ts, identity) {
            Err(_) => true,
            Ok(mut tls) => go(&mut tls).is_err(),
        };
        assert!(refused, "client {identity:?} was let in");
    }
    assert!(!ready(&ts, Some("client")).conn.is_handshaking());
}

#[test]
fn tls_on_serves_clear_and_tls_clients_and_starttls_only_once() {
    let ts = start(TlsMode::On, false);
    let (mut c, size, _) = Client::handshake(&ts, false, false);
    assert_eq!(size, SIZE_BYTES);
    c.write(1, 0, &pattern(4096, 1));
    let mut tls = starttls(&ts, None).unwrap();
    tls.write_all(&option(NBD_OPT_STARTTLS, &[])).unwrap();
    assert_eq!(option_reply(&mut tls).unwrap().1, NBD_REP_ERR_INVALID);
    assert_eq!(go(&mut tls).unwrap(), Ok(SIZE_BYTES));
    read_request(&mut tls, 5, 0, 4096);
    assert_eq!(simple_reply(&mut tls, 4096), (5, 0, pattern(4096, 1)));

    let mut c = Client::connect(&ts);
    c.greet(CLIENT_FLAGS);
    c.send_option(NBD_OPT_STARTTLS, b"x");
    assert_eq!(c.option_reply().1, NBD_REP_ERR_INVALID);
}

#[test]
fn what_was_negotiated_before_tls_is_forgotten() {
    let ts = start(TlsMode::On, false);
    let mut c = Client::connect(&ts);
    c.greet(CLIENT_FLAGS);
    c.send_option(NBD_OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(c.option_reply().1, NBD_REP_ACK);
    c.send_option(NBD_OPT_STARTTLS, &[]);
    assert_eq!(c.option_reply().1, NBD_REP_ACK);
    let conn = rustls::ClientConnection::new(
        client_config(None),
        ServerName::try_from("localhost").unwrap(),
    )
    .unwrap();
    let mut tls = rustls::StreamOwned::new(conn, c.s);
    assert_eq!(go(&mut tls).unwrap(), Ok(SIZE_BYTES));
    // Simple replies: structured replies were negotiated in the clear only.
    read_request(&mut tls, 3, 0, 512);
    assert_eq!(simple_reply(&mut tls, 512), (3, 0, vec![0; 512]));
}

#[test]
fn a_client_hello_sent_before_the_ack_is_used() {
    let ts = start(TlsMode::Require, false);
    let mut c = Client::connect(&ts);
    c.greet(CLIENT_FLAGS);
    let mut conn = rustls::ClientConnection::new(
        client_config(None),
        ServerName::try_from("localhost").unwrap(),
    )
    .unwrap();
    let mut hello = option(NBD_OPT_STARTTLS, &[]);
    while conn.wants_write() {
        conn.write_tls(&mut hello).unwrap();
    }
    c.s.write_all(&hello).unwrap();
    assert_eq!(c.option_reply(), (NBD_OPT_STARTTLS, NBD_REP_ACK, vec![]));
    let mut tls = rustls::StreamOwned::new(conn, c.s);
    assert_eq!(go(&mut tls).unwrap(), Ok(SIZE_BYTES));
}

#[test]
fn garbage_instead_of_a_client_hello_ends_only_that_connection() {
    let ts = start(TlsMode::Require, false);
    let keep = ready(&ts, None);
    for garbage in [
        vec![0u8; 1024],
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        // A handshake record header announcing 64 KiB (over the limit).
        vec![22, 3, 1, 0xff, 0xff, 1, 0, 0, 0],
        option(NBD_OPT_GO, &go_data("", &[])),
    ] {
        let mut c = Client::connect(&ts);
        c.greet(CLIENT_FLAGS);
        c.send_option(NBD_OPT_STARTTLS, &[]);
        assert_eq!(c.option_reply().1, NBD_REP_ACK);
        let _ = c.s.write_all(&garbage);
        // A TLS alert (if any), then the end: never NBD data.
        let mut rest = Vec::new();
        let _ = c.s.read_to_end(&mut rest);
        assert!(
            rest.len() <= 7 && rest.first().is_none_or(|&t| t == 21),
            "{rest:?}"
        );
    }
    ts.wait_for_connections(1);
    drop(keep);
}

#[test]
fn a_stalled_tls_handshake_is_cut_off_at_the_deadline() {
    let ts = TestServer::start(
        MemBackend::new(SIZE_BYTES, false),
        ServerConfig {
            handshake_timeout: Duration::from_millis(500),
            ..tls_config(TlsMode::Require, &fixtures().join("server"), false)
        },
    );
    for sent in [0usize, 10] {
        // The deadline runs from the connection: so does the wait measured
        // (a slow client-side setup must not eat into it).
        let t0 = Instant::now();
        let mut c = Client::connect(&ts);
        c.greet(CLIENT_FLAGS);
        c.send_option(NBD_OPT_STARTTLS, &[]);
        assert_eq!(c.option_reply().1, NBD_REP_ACK);
        let mut conn = rustls::ClientConnection::new(
            client_config(None),
            ServerName::try_from("localhost").unwrap(),
        )
        .unwrap();
        let mut hello = Vec::new();
        conn.write_tls(&mut hello).unwrap();
        c.s.write_all(&hello[..sent]).unwrap();
        // At most an alert, then the end of the connection.
        let mut rest = Vec::new();
        c.s.read_to_end(&mut rest).unwrap();
        let waited = t0.elapsed();
        assert!(
            rest.len() <= 7 && rest.first().is_none_or(|&t| t == 21),
            "{rest:?}"
        );
        assert!(
            waited >= Duration::from_millis(300) && waited < Duration::from_secs(10),
            "closed after {waited:?}"
        );
    }
    ts.wait_for_connections(0);
}

fn copy_dir(from: &Path, to: &Path) {
    for f in ["ca-cert.pem", "server-cert.pem", "server-key.pem"] {
        std::fs::copy(from.join(f), to.join(f)).unwrap();
    }
}

fn peer_leaf(tls: &Tls) -> Vec<u8> {
    tls.conn.peer_certificates().unwrap()[0].to_vec()
}

fn leaf(dir: &str) -> Vec<u8> {
    CertificateDer::from_pem_file(fixtures().join(dir).join("server-cert.pem"))
        .unwrap()
        .to_vec()
}

#[test]
fn reloaded_credentials_serve_new_connections_and_a_bad_reload_keeps_the_old() {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixtures().join("server"), dir.path());
    let config = tls_config(TlsMode::Require, dir.path(), false);
    let credentials = config.tls.as_ref().unwrap().credentials.clone();
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false), config);
    let mut old = ready(&ts, None);
    assert_eq!(peer_leaf(&old), leaf("server"));

    copy_dir(&fixtures().join("server2"), dir.path());
    credentials.reload().unwrap();
    let new = ready(&ts, None);
    assert_eq!(peer_leaf(&new), leaf("server2"));
    // The open connection keeps its session.
    read_request(&mut old, 1, 0, 512);
    assert_eq!(simple_reply(&mut old, 512).1, 0);

    std::fs::write(dir.path().join("server-key.pem"), "not a key").unwrap();
    let e = credentials.reload().unwrap_err();
    assert!(e.to_string().contains("server-key.pem"), "{e}");
    assert_eq!(peer_leaf(&ready(&ts, None)), leaf("server2"));
}

#[test]
fn credentials_that_cannot_load_say_which_file() {
    let dir = tempfile::tempdir().unwrap();
    let e = TlsCredentials::load(dir.path(), false).unwrap_err();
    assert!(e.to_string().contains("server-cert.pem"), "{e}");
    copy_dir(&fixtures().join("server"), dir.path());
    std::fs::remove_file(dir.path().join("ca-cert.pem")).unwrap();
    assert!(
        TlsCredentials::load(dir.path(), false).is_ok(),
        "no CA needed without verify_peer"
    );
    let e = TlsCredentials::load(dir.path(), true).unwrap_err();
    assert!(e.to_string().contains("ca-cert.pem"), "{e}");
    // A key that does not match the certificate.
    copy_dir(&fixtures().join("server"), dir.path());
    std::fs::copy(
        fixtures().join("server2/server-key.pem"),
        dir.path().join("server-key.pem"),
    )
    .unwrap();
    assert!(TlsCredentials::load(dir.path(), false).is_err());
    let e = TlsCredentials::load(&dir.path().join("missing"), false).unwrap_err();
    assert!(e.to_string().contains("not a directory"), "{e}");
}

#[test]
fn allow_closes_tcp_peers_outside_the_networks() {
    for (allow, admitted) in [("10.0.0.0/8", false), ("127.0.0.0/8", true)] {
        let backend: Arc<dyn Backend> = Arc::new(MemBackend::new(SIZE_BYTES, false));
        let server = Server::new(
            backend,
            ServerConfig {
                allow: Some(vec![allow.parse().unwrap()]),
                ..config()
            },
        );
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        server.serve_tcp(listener).unwrap();
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut greeting = Vec::new();
        let _ = (&mut s).take(8).read_to_end(&mut greeting);
        if admitted {
            assert_eq!(greeting, NBD_MAGIC.to_be_bytes(), "allow {allow}");
        } else {
            assert!(greeting.is_empty(), "allow {allow}: {greeting:?}");
            assert_eq!(server.disallowed_connection_count(), 1);
        }
    }
}
