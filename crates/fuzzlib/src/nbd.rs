//! NBD targets: the real server (`cvol_nbd::Server`) on an abstract Unix
//! socket over an in-memory backend, fed the fuzz input as the client's byte
//! stream, plus the pure parsers of `cvol_nbd::proto` on the same bytes.
//!
//! Properties: the server never panics (any thread), always closes the
//! connection once the client has sent everything and half-closed (no hang),
//! and every request `validate_request` accepts lies inside the export and
//! the advertised limits.
use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use cvol_nbd::proto::{self, RequestHeader, TransmissionContext};
use cvol_nbd::test_util::{go_data, meta_context_data, option, tls_fixtures, MemBackend};
use cvol_nbd::tls::{TlsCredentials, TlsMode, TlsSettings};
use cvol_nbd::{Extent, Server, ServerConfig};

use crate::input::Input;
use crate::panics;

/// Export size: small (replies stay small) and not a multiple of 4 KiB.
pub const EXPORT_BYTES: u64 = 64 * 1024 + 512;
/// `max_request_bytes` of the fuzzed servers: below the export size, so both
/// "in range but too long" and "too long and out of range" exist.
pub const MAX_REQUEST_BYTES: u32 = 16 * 1024;
/// Inputs are cut to this many bytes (bounds the reply volume per input).
pub const MAX_INPUT_BYTES: usize = 16 * 1024;
/// A connection the server has not closed this long after the client's
/// half-close counts as a hang.
const HANG_TIMEOUT: Duration = Duration::from_secs(20);
/// A read of a block whose first byte is this fails with `Io`; a write whose
/// first byte is this fails with `NoSpace` (error replies get exercised).
const FAIL_BYTE: u8 = 0xe5;

/// The in-memory export: some allocated blocks (so that block status sees
/// both kinds), the rest holes; errors and overshooting extents on demand.
fn backend(read_only: bool) -> MemBackend {
    let backend = MemBackend::new(EXPORT_BYTES, read_only)
        .with_fail_byte(FAIL_BYTE)
        .with_overshooting_extents()
        .without_log();
    let data: Vec<u8> = (0..EXPORT_BYTES as usize)
        .map(|i| if i % 3 == 1 { (i / 4096) as u8 | 1 } else { 0 })
        .collect();
    // Blocks 1 and 3.. allocated; 0 and 2 holes.
    backend.fill(4096, &data[4096..8192]);
    backend.fill(12288, &data[12288..]);
    backend
}

struct Fixture {
    server: Server,
    addr: SocketAddr,
}

fn fixture(read_only: bool) -> &'static Fixture {
    fixture_at(usize::from(read_only))
}

/// Fixtures: 0 writable, 1 read-only, 2 writable with TLS required.
fn fixture_at(which: usize) -> &'static Fixture {
    static FIXTURES: OnceLock<[Fixture; 3]> = OnceLock::new();
    let all = FIXTURES.get_or_init(|| {
        panics::install();
        // libFuzzer's main is not Rust's: SIGPIPE would kill the process
        // when the server closes a connection the client is still writing to.
        // SAFETY: setting a signal disposition to SIG_IGN is always sound.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        [0, 1, 2].map(|which| {
            let ro = which == 1;
            let name = format!("cvol-fuzz-nbd-{}-{which}", std::process::id());
            let addr = SocketAddr::from_abstract_name(name.as_bytes()).expect("socket name");
            let listener = UnixListener::bind_addr(&addr).expect("bind abstract socket");
            let config = ServerConfig {
                export_name: "fuzz".into(),
                description: Some("cvol fuzz export".into()),
                max_request_bytes: MAX_REQUEST_BYTES,
                workers: 2,
                max_inflight_per_conn: 8,
                max_connections: 64,
                tls: (which == 2).then(|| TlsSettings {
                    mode: TlsMode::Require,
                    credentials: Arc::new(
                        TlsCredentials::load(&tls_fixtures().join("server"), false)
                            .expect("TLS fixtures"),
                    ),
                }),
                ..ServerConfig::default()
            };
            let server = Server::new(Arc::new(backend(ro)), config);
            server.serve_unix(listener).expect("serve");
            Fixture { server, addr }
        })
    });
    &all[which]
}

/// Sends `bytes` as the client, half-closes, and returns everything the
/// server sent until it closed the connection. Panics if the server hangs
/// or panicked.
pub fn exchange(read_only: bool, bytes: &[u8]) -> Vec<u8> {
    exchange_with(fixture(read_only), bytes)
}

fn exchange_with(f: &Fixture, bytes: &[u8]) -> Vec<u8> {
    let before = panics::count();
    let stream = UnixStream::connect_addr(&f.addr).expect("connect to the fuzzed server");
    stream
        .set_read_timeout(Some(HANG_TIMEOUT))
        .expect("read timeout");
    // At most MAX_INPUT_BYTES plus a handshake: fits the socket buffer, so
    // writing everything before reading cannot deadlock. The server may
    // close early (protocol violation): a failed write is fine.
    let mut writer = &stream;
    let _ = writer.write_all(bytes);
    let _ = stream.shutdown(Shutdown::Write);
    let started = Instant::now();
    let mut out = Vec::new();
    let mut reader = &stream;
    if let Err(e) = reader.read_to_end(&mut out) {
        let timed_out = matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        );
        assert!(
            !timed_out,
            "server hang: connection still open {:?} after the client finished",
            started.elapsed()
        );
    }
    drop(stream);
    // The connection's thread ends soon after it closed the socket; wait, so
    // that every input starts from an idle server.
    while f.server.connection_count() > 0 {
        assert!(
            started.elapsed() < HANG_TIMEOUT,
            "server hang: connection thread still running after the socket closed"
        );
        std::thread::yield_now();
    }
    assert_eq!(
        panics::count(),
        before,
        "the NBD server panicked on this input"
    );
    out
}

/// How `request` negotiates before the fuzzed transmission bytes.
#[derive(Debug, Clone, Copy)]
pub struct Mode {
    pub structured_replies: bool,
    pub base_allocation: bool,
    pub read_only: bool,
    /// Enter transmission with NBD_OPT_EXPORT_NAME instead of NBD_OPT_GO.
    pub export_name: bool,
    pub no_zeroes: bool,
}

impl Mode {
    pub fn from_byte(b: u8) -> Mode {
        Mode {
            structured_replies: b & 1 != 0,
            base_allocation: b & 2 != 0,
            read_only: b & 4 != 0,
            export_name: b & 8 != 0,
            no_zeroes: b & 16 != 0,
        }
    }

    pub fn to_byte(self) -> u8 {
        u8::from(self.structured_replies)
            | u8::from(self.base_allocation) << 1
            | u8::from(self.read_only) << 2
            | u8::from(self.export_name) << 3
            | u8::from(self.no_zeroes) << 4
    }

    /// The client's handshake bytes for this mode (valid, ends in transmission).
    pub fn handshake(self) -> Vec<u8> {
        let mut flags = proto::NBD_FLAG_C_FIXED_NEWSTYLE;
        if self.no_zeroes {
            flags |= proto::NBD_FLAG_C_NO_ZEROES;
        }
        let mut out = flags.to_be_bytes().to_vec();
        if self.structured_replies {
            out.extend(option(proto::NBD_OPT_STRUCTURED_REPLY, &[]));
        }
        if self.base_allocation {
            let data = meta_context_data("", &[proto::BASE_ALLOCATION]);
            out.extend(option(proto::NBD_OPT_SET_META_CONTEXT, &data));
        }
        if self.export_name {
            out.extend(option(proto::NBD_OPT_EXPORT_NAME, b"fuzz"));
        } else {
            let data = go_data("fuzz", &[proto::NBD_INFO_BLOCK_SIZE]);
            out.extend(option(proto::NBD_OPT_GO, &data));
        }
        out
    }

    /// What the server negotiates in this mode (for the pure validator).
    pub fn context(self) -> TransmissionContext {
        TransmissionContext {
            size_bytes: EXPORT_BYTES,
            transmission_flags: proto::transmission_flags(self.read_only, self.structured_replies),
            structured_replies: self.structured_replies,
            base_allocation: self.structured_replies && self.base_allocation,
            max_request_bytes: MAX_REQUEST_BYTES,
        }
    }
}

/// Target `nbd_handshake`: `data` is everything the client sends after the
/// server's greeting (client flags, options, and whatever follows).
pub fn handshake(data: &[u8]) {
    let data = &data[..data.len().min(MAX_INPUT_BYTES)];
    pure_option_parsers(data);
    let read_only = data.first().is_some_and(|b| b & 0x80 != 0);
    let reply = exchange(read_only, data);
    assert_eq!(
        reply.get(..18),
        Some(
            &proto::encode_greeting(proto::NBD_FLAG_FIXED_NEWSTYLE | proto::NBD_FLAG_NO_ZEROES)[..]
        ),
        "the server must always greet"
    );
}

/// Target `nbd_tls`: a server that requires TLS. If bit 0 of byte 0 is
/// set, the client flags and `NBD_OPT_STARTTLS` come first, so the rest is
/// what the client sends as TLS (its ClientHello and onwards); otherwise
/// the rest is raw client bytes from the first after the greeting.
///
/// Oracle ("require: nothing is listed or served before TLS"): everything
/// the server sends in the clear is the greeting, then option replies that
/// are only errors (`TLS_REQD`, `INVALID`, `TOO_BIG`) or acknowledge
/// `ABORT`/`STARTTLS`; after a `STARTTLS` acknowledgement, only TLS records.
pub fn tls(data: &[u8]) {
    let data = &data[..data.len().min(MAX_INPUT_BYTES)];
    let mut stream = Vec::new();
    if data.first().is_some_and(|b| b & 1 != 0) {
        stream.extend_from_slice(&proto::NBD_FLAG_C_FIXED_NEWSTYLE.to_be_bytes());
        stream.extend(option(proto::NBD_OPT_STARTTLS, &[]));
    }
    stream.extend_from_slice(data.get(1..).unwrap_or_default());
    let reply = exchange_with(fixture_at(2), &stream);
    if let Err(e) = clear_text_reveals_nothing(&reply) {
        panic!("the TLS-required server sent in the clear: {e}");
    }
}

/// What a TLS-required server sent in the clear that it must not have.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ClearTextLeak {
    /// The greeting is missing or wrong.
    NoGreeting,
    /// Bytes (this many) that do not start an option reply.
    NotAnOptionReply(usize),
    /// An option reply that is neither an error nor the ACK of `ABORT` or
    /// `STARTTLS`.
    ReplyType { kind: u32, option: u32 },
    /// An option reply cut short.
    TruncatedOptionReply,
    /// Bytes (this many) after the last option reply.
    TrailingBytes(usize),
    /// After the `STARTTLS` acknowledgement: a header that is no TLS record's.
    NonTlsRecord([u8; 5]),
}

impl std::fmt::Display for ClearTextLeak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClearTextLeak::NoGreeting => f.write_str("no greeting"),
            ClearTextLeak::NotAnOptionReply(n) => write!(f, "{n} bytes that are no option reply"),
            ClearTextLeak::ReplyType { kind, option } => {
                write!(f, "reply type {kind:#x} to option {option}")
            }
            ClearTextLeak::TruncatedOptionReply => f.write_str("a truncated option reply"),
            ClearTextLeak::TrailingBytes(n) => write!(f, "{n} trailing bytes"),
            ClearTextLeak::NonTlsRecord(header) => write!(f, "a non-TLS record header {header:?}"),
        }
    }
}

/// Checks the oracle of [`tls`] on what the server sent.
fn clear_text_reveals_nothing(reply: &[u8]) -> Result<(), ClearTextLeak> {
    let greeting =
        proto::encode_greeting(proto::NBD_FLAG_FIXED_NEWSTYLE | proto::NBD_FLAG_NO_ZEROES);
    if reply.get(..greeting.len()) != Some(&greeting[..]) {
        return Err(ClearTextLeak::NoGreeting);
    }
    let mut rest = &reply[greeting.len()..];
    while rest.len() >= 20 {
        let magic = u64::from_be_bytes(rest[0..8].try_into().expect("8"));
        let option = u32::from_be_bytes(rest[8..12].try_into().expect("4"));
        let kind = u32::from_be_bytes(rest[12..16].try_into().expect("4"));
        let length = u32::from_be_bytes(rest[16..20].try_into().expect("4")) as usize;
        if magic != proto::OPTION_REPLY_MAGIC {
            return Err(ClearTextLeak::NotAnOptionReply(rest.len()));
        }
        let acked = kind == proto::NBD_REP_ACK
            && matches!(option, proto::NBD_OPT_ABORT | proto::NBD_OPT_STARTTLS);
        let refused = matches!(
            kind,
            proto::NBD_REP_ERR_TLS_REQD | proto::NBD_REP_ERR_INVALID | proto::NBD_REP_ERR_TOO_BIG
        );
        if !acked && !refused {
            return Err(ClearTextLeak::ReplyType { kind, option });
        }
        rest = rest
            .get(20 + length..)
            .ok_or(ClearTextLeak::TruncatedOptionReply)?;
        if acked && option == proto::NBD_OPT_STARTTLS {
            return tls_records_only(rest);
        }
    }
    if rest.is_empty() {
        Ok(())
    } else {
        Err(ClearTextLeak::TrailingBytes(rest.len()))
    }
}

/// Whether `bytes` are whole TLS records (the last may be cut short by
/// the close), of the record types TLS defines.
fn tls_records_only(mut bytes: &[u8]) -> Result<(), ClearTextLeak> {
    while bytes.len() >= 5 {
        let (kind, major) = (bytes[0], bytes[1]);
        let length = usize::from(u16::from_be_bytes([bytes[3], bytes[4]]));
        if !(20..=23).contains(&kind) || major != 3 || length > 16384 + 2048 {
            let header = bytes[..5].try_into().expect("5 bytes");
            return Err(ClearTextLeak::NonTlsRecord(header));
        }
        bytes = bytes.get(5 + length..).unwrap_or_default();
    }
    Ok(())
}

/// Option payload parsers on arbitrary bytes (and on every option of the
/// input, split the way the server would).
fn pure_option_parsers(data: &[u8]) {
    let one = |payload: &[u8]| {
        if let Ok(r) = proto::parse_info_request(payload) {
            assert!(r.export_name.len() <= proto::MAX_STRING_BYTES);
        }
        if let Ok(r) = proto::parse_meta_context_request(payload) {
            for q in &r.queries {
                let _ = proto::query_syntax_valid(q);
                let _ = proto::query_selects_base_allocation(q, true);
                let _ = proto::query_selects_base_allocation(q, false);
            }
        }
        if let Ok(s) = proto::parse_string(payload) {
            assert!(!s.contains('\0') && s.len() <= proto::MAX_STRING_BYTES);
            let _ = proto::query_syntax_valid(&s);
        }
    };
    one(data);
    let mut rest = data.get(4..).unwrap_or_default();
    while rest.len() >= proto::OPTION_HEADER_BYTES {
        let header: &[u8; proto::OPTION_HEADER_BYTES] =
            rest[..proto::OPTION_HEADER_BYTES].try_into().expect("16");
        let Ok(h) = proto::parse_option_header(header) else {
            break;
        };
        rest = &rest[proto::OPTION_HEADER_BYTES..];
        let n = (h.length_bytes as usize).min(rest.len());
        one(&rest[..n]);
        rest = &rest[n..];
    }
}

/// Target `nbd_request`: byte 0 picks a [`Mode`]; the rest is the
/// transmission phase (request headers and WRITE payloads) sent after the
/// handshake of that mode.
pub fn request(data: &[u8]) {
    let data = &data[..data.len().min(MAX_INPUT_BYTES)];
    let mut input = Input::new(data);
    let mode = Mode::from_byte(input.u8());
    let requests = input.rest();
    pure_requests(mode, requests);
    let mut stream = mode.handshake();
    stream.extend_from_slice(requests);
    let reply = exchange(mode.read_only, &stream);
    assert!(reply.len() >= 18, "the server must always greet");
}

/// The request parser and validator on every 28-byte window, with oracles.
fn pure_requests(mode: Mode, bytes: &[u8]) {
    let ctx = mode.context();
    for window in bytes.windows(proto::REQUEST_HEADER_BYTES).step_by(4) {
        let window: &[u8; proto::REQUEST_HEADER_BYTES] = window.try_into().expect("28");
        let h = match proto::parse_request_header(window) {
            Ok(h) => h,
            // Also validate the same fields behind a good magic.
            Err(_) => {
                let mut fixed = *window;
                fixed[..4].copy_from_slice(&proto::REQUEST_MAGIC.to_be_bytes());
                proto::parse_request_header(&fixed).expect("magic fixed")
            }
        };
        assert_eq!(proto::encode_request_header(&h)[4..], window[4..]);
        check_validation(&h, &ctx);
        check_validation(&h, &Mode::from_byte(!mode.to_byte()).context());
    }
    extents(bytes);
}

fn check_validation(h: &RequestHeader, ctx: &TransmissionContext) {
    let Ok(cmd) = proto::validate_request(h, ctx) else {
        return;
    };
    let read_only = ctx.transmission_flags & proto::NBD_FLAG_READ_ONLY != 0;
    assert!(
        !(read_only && cmd.is_write()),
        "write accepted on a read-only export: {h:?}"
    );
    if let Some((offset, length)) = cmd.range() {
        assert!(
            offset
                .checked_add(length)
                .is_some_and(|e| e <= ctx.size_bytes),
            "accepted request out of range: {h:?}"
        );
    }
    use proto::Command::*;
    match cmd {
        Read { length, .. } | Write { length, .. } | Cache { length, .. } => {
            assert!(length <= ctx.max_request_bytes, "accepted oversized {h:?}")
        }
        BlockStatus { length, .. } => {
            assert!(length > 0 && ctx.structured_replies && ctx.base_allocation)
        }
        _ => {}
    }
}

/// Block status descriptors from arbitrary extents: never more bytes than
/// asked, never an empty descriptor, never more than the limit.
fn extents(bytes: &[u8]) {
    let mut input = Input::new(bytes);
    let request_length = input.u32();
    let req_one = request_length & 1 != 0;
    let max = usize::from(input.u8() % 8);
    let mut list = Vec::new();
    while !input.is_empty() && list.len() < 64 {
        let length = match input.u8() % 4 {
            0 => u64::from(input.u8()),
            1 => u64::from(input.u32()),
            2 => input.u64(),
            _ => 0,
        };
        let flags = input.u8();
        list.push(Extent {
            length,
            hole: flags & 1 != 0,
            zero: flags & 2 != 0,
        });
    }
    let d = proto::extents_to_descriptors(&list, request_length, req_one, max);
    let total: u64 = d.iter().map(|x| u64::from(x.length)).sum();
    assert!(total <= u64::from(request_length));
    assert!(d.len() <= if req_one { 1 } else { max.max(1) });
    assert!(d.iter().all(|x| x.length > 0));
    let described: u64 = list.iter().map(|e| e.length.min(1)).sum();
    if request_length > 0 && described > 0 {
        assert!(!d.is_empty());
    }
    if !d.is_empty() {
        let chunk = proto::encode_block_status_chunk(7, proto::BASE_ALLOCATION_CONTEXT_ID, &d);
        assert_eq!(
            chunk.len(),
            proto::STRUCTURED_REPLY_HEADER_BYTES + 4 + 8 * d.len()
        );
    }
}
