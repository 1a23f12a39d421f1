//! A small synchronous NBD client, used to read and write an "origin"
//! device behind a cache.
//!
//! [`Client::connect`] takes an NBD URI (`nbd://HOST[:PORT][/EXPORT]` or
//! `nbd+unix:///EXPORT?socket=PATH`), opens one connection at once (so a
//! wrong URI or a missing server fails there), runs the fixed-newstyle
//! handshake with `NBD_OPT_GO` (falling back to `NBD_OPT_EXPORT_NAME` only
//! for a server without fixed newstyle or one answering GO with
//! `NBD_REP_ERR_UNSUP`) and reads the export size and transmission flags.
//! It asks for `NBD_INFO_BLOCK_SIZE` and never for structured replies, so
//! every reply is a simple reply. TLS is not supported.
//!
//! ## Threads and connections
//!
//! A [`Client`] is `Send + Sync` and is meant to be shared by worker
//! threads. It keeps a pool of at most [`MAX_CONNECTIONS`] connections.
//! Each call takes an idle connection (or opens a new one while fewer than
//! the limit exist, else waits for one to come back), sends one request,
//! reads its reply and puts the connection back: there is never more than
//! one request in flight per connection, and up to [`MAX_CONNECTIONS`]
//! requests run in parallel from different threads. A connection that
//! failed (I/O error, timeout, garbled reply, `NBD_ESHUTDOWN`) is closed
//! and not returned; a later call opens a new one. A failed call is not
//! retried: the caller gets the error.
//!
//! ## Flush rule (multi-conn)
//!
//! A server that advertises `NBD_FLAG_CAN_MULTI_CONN` promises that a FLUSH
//! on one connection covers the writes completed on all of them: the pool
//! then holds up to [`MAX_CONNECTIONS`] connections and [`Client::flush`]
//! sends one `NBD_CMD_FLUSH` on any of them. A writable export **without**
//! `CAN_MULTI_CONN` gets a pool of exactly one connection, so that the one
//! FLUSH covers every write (requests are then serialized). A read-only
//! export has no writes to flush and always gets the full pool.
//!
//! ## Ordering
//!
//! Calls from different threads may reach the server in any order and run
//! there concurrently; a call returns only after its reply (for a split
//! request: all of its replies) has arrived, so a call that starts after
//! another one returned is ordered after it. Callers must not issue
//! overlapping writes concurrently.
//!
//! ## Bounds
//!
//! * READ and WRITE are split into requests of at most
//!   [`MAX_REQUEST_BYTES`] (32 MiB, the spec's safe maximum) or the
//!   server's advertised maximum block size if smaller (rounded down to a
//!   multiple of its minimum block size); TRIM and WRITE_ZEROES into
//!   requests of at most 1 GiB. The pieces of one call are sent one after
//!   the other on whichever connection is free.
//! * Ranges are checked against the export size before anything is sent
//!   (`InvalidInput`).
//! * Every socket has read and write timeouts of [`IO_TIMEOUT`] (connects
//!   too), so a dead origin cannot hang a caller forever.
//! * Server input never panics the client and is never trusted for an
//!   allocation: option replies are limited to 64 KiB, READ data goes only
//!   into the caller's buffer. A bad magic, a wrong handle, an unexpected
//!   structured reply or a reply cut short is an `InvalidData` error and the
//!   connection is dropped.
//!
//! ## Errors
//!
//! An NBD error reply becomes an [`io::Error`] whose kind follows the errno
//! (`EIO` → `Other`, `EPERM` → `PermissionDenied`, `ENOSPC` →
//! `StorageFull`, `EINVAL` → `InvalidInput`, `ENOTSUP` → `Unsupported`,
//! `ENOMEM` → `OutOfMemory`, `ESHUTDOWN` → `ConnectionAborted`) and whose
//! message names the errno, the command, the range and the URI, e.g.
//! "origin server answered EIO to READ of 4096 bytes at offset 0
//! (nbd://…)". Requests must respect the server's minimum block size
//! (1 for cvol's server and for nbdkit; a server with a larger one answers
//! misaligned requests with `EINVAL`).

use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::ffi::OsStringExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::proto::{self, RequestHeader};

/// Most connections one [`Client`] keeps open (and requests in flight).
pub const MAX_CONNECTIONS: usize = 8;
/// Longest READ/WRITE payload sent in one request (longer calls are split).
pub const MAX_REQUEST_BYTES: u32 = 32 * 1024 * 1024;
/// Read, write and connect timeout of every socket.
pub const IO_TIMEOUT: Duration = Duration::from_secs(60);
/// Port of `nbd://` URIs that name none.
pub const DEFAULT_PORT: u16 = 10809;

/// Longest TRIM/WRITE_ZEROES request (a multiple of any block size).
const MAX_TRIM_ZERO_BYTES: u64 = 1 << 30;
/// Largest zero buffer written when the server has no WRITE_ZEROES.
const ZERO_BUFFER_BYTES: u32 = 1024 * 1024;
/// Longest option reply payload accepted during the handshake.
const MAX_OPTION_REPLY_BYTES: u32 = 64 * 1024;
/// Most replies accepted for one option.
const MAX_OPTION_REPLIES: usize = 64;
/// Error message of a URI that is not one of the accepted forms.
const ACCEPTED_FORMS: &str =
    "accepted forms: nbd://HOST[:PORT][/EXPORT] and nbd+unix:///EXPORT?socket=PATH";

// ---------------------------------------------------------------------------
// URIs
// ---------------------------------------------------------------------------

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Endpoint {
    Tcp { host: String, port: u16 },
    Unix(PathBuf),
}

/// A parsed NBD URI.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    endpoint: Endpoint,
    export: String,
}

fn bad_uri(uri: &str, why: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{uri}: {why}; {ACCEPTED_FORMS}"),
    )
}

/// Decodes `%XX` escapes.
fn percent_decode(s: &str) -> Option<Vec<u8>> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Some(out)
}

/// The export name of a URI path ("" or "/NAME"), percent-decoded.
fn parse_export(uri: &str, path: &str) -> io::Result<String> {
    let name = path.strip_prefix('/').unwrap_or(path);
    let bytes = percent_decode(name).ok_or_else(|| bad_uri(uri, "bad %-escape in export"))?;
    proto::parse_string(&bytes).map_err(|_| bad_uri(uri, "export name is not a valid NBD string"))
}

fn parse_tcp(uri: &str, rest: &str) -> io::Result<Target> {
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    if path.contains(['?', '#']) || authority.contains(['?', '#', '@']) {
        return Err(bad_uri(uri, "nbd:// takes no query, fragment or user"));
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (host, tail) = v6
            .split_once(']')
            .ok_or_else(|| bad_uri(uri, "unclosed [ in host"))?;
        (
            host,
            tail.strip_prefix(':').or(tail.is_empty().then_some("")),
        )
    } else {
        match authority.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, Some("")),
        }
    };
    let port = match port {
        Some("") => DEFAULT_PORT,
        Some(p) => p.parse().map_err(|_| bad_uri(uri, "bad port"))?,
        None => return Err(bad_uri(uri, "junk after ]")),
    };
    if host.is_empty() {
        return Err(bad_uri(uri, "no host"));
    }
    let endpoint = Endpoint::Tcp {
        host: host.to_owned(),
        port,
    };
    let export = parse_export(uri, path)?;
    Ok(Target { endpoint, export })
}

fn parse_unix(uri: &str, rest: &str) -> io::Result<Target> {
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    if !(path.is_empty() || path.starts_with('/')) || query.contains('#') {
        return Err(bad_uri(uri, "nbd+unix:// takes no host or fragment"));
    }
    let mut socket = None;
    for param in query.split('&').filter(|p| !p.is_empty()) {
        match param.split_once('=') {
            Some(("socket", value)) if !value.is_empty() => {
                let bytes =
                    percent_decode(value).ok_or_else(|| bad_uri(uri, "bad %-escape in socket"))?;
                socket = Some(PathBuf::from(OsString::from_vec(bytes)));
            }
            _ => return Err(bad_uri(uri, &format!("unknown query parameter {param:?}"))),
        }
    }
    let socket = socket.ok_or_else(|| bad_uri(uri, "missing socket=PATH"))?;
    let export = parse_export(uri, path)?;
    Ok(Target {
        endpoint: Endpoint::Unix(socket),
        export,
    })
}

/// Parses an NBD URI (see [`Client::connect`]).
fn parse_uri(uri: &str) -> io::Result<Target> {
    if let Some(rest) = uri.strip_prefix("nbd://") {
        parse_tcp(uri, rest)
    } else if let Some(rest) = uri.strip_prefix("nbd+unix://") {
        parse_unix(uri, rest)
    } else {
        Err(bad_uri(uri, "unsupported NBD URI"))
    }
}

// ---------------------------------------------------------------------------
// Sockets
// ---------------------------------------------------------------------------

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn connect(endpoint: &Endpoint) -> io::Result<Stream> {
        let stream = match endpoint {
            Endpoint::Unix(path) => Stream::Unix(UnixStream::connect(path)?),
            Endpoint::Tcp { host, port } => Stream::Tcp(connect_tcp(host, *port)?),
        };
        match &stream {
            Stream::Unix(s) => {
                s.set_read_timeout(Some(IO_TIMEOUT))?;
                s.set_write_timeout(Some(IO_TIMEOUT))?;
            }
            Stream::Tcp(s) => {
                s.set_read_timeout(Some(IO_TIMEOUT))?;
                s.set_write_timeout(Some(IO_TIMEOUT))?;
                s.set_nodelay(true)?;
            }
        }
        Ok(stream)
    }
}

fn connect_tcp(host: &str, port: u16) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "host has no address");
    for addr in (host, port).to_socket_addrs()? {
        match TcpStream::connect_timeout(&addr, IO_TIMEOUT) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn invalid_data(message: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.into())
}

/// `read_exact` that reports a server going away mid-message as
/// `InvalidData` and a read timeout as `TimedOut`.
fn read_full(stream: &mut Stream, buf: &mut [u8]) -> io::Result<()> {
    stream.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => invalid_data("server closed the connection mid-message"),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no answer from the server within {IO_TIMEOUT:?}"),
        ),
        _ => e,
    })
}

fn read_array<const N: usize>(stream: &mut Stream) -> io::Result<[u8; N]> {
    let mut b = [0u8; N];
    read_full(stream, &mut b)?;
    Ok(b)
}

// ---------------------------------------------------------------------------
// Handshake
// ---------------------------------------------------------------------------

/// What the handshake found out about the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ExportInfo {
    size_bytes: u64,
    transmission_flags: u16,
    /// Longest READ/WRITE payload per request.
    max_payload_bytes: u32,
}

/// `NBD_INFO_BLOCK_SIZE` as received.
#[derive(Debug, Clone, Copy)]
struct BlockSize {
    minimum: u32,
    maximum: u32,
}

/// Largest request payload honouring [`MAX_REQUEST_BYTES`] and the server's
/// block sizes (a multiple of its minimum).
fn max_payload(block_size: Option<BlockSize>) -> u32 {
    let Some(bs) = block_size else {
        return MAX_REQUEST_BYTES;
    };
    let minimum = bs.minimum.clamp(1, 64 * 1024);
    let maximum = bs.maximum.min(MAX_REQUEST_BYTES);
    (maximum / minimum * minimum).max(minimum)
}

fn option_error(reply_type: u32, data: &[u8], export: &str) -> io::Error {
    let text: String = String::from_utf8_lossy(data).chars().take(200).collect();
    let (kind, what) = match reply_type {
        proto::NBD_REP_ERR_UNKNOWN => (io::ErrorKind::NotFound, "unknown export"),
        proto::NBD_REP_ERR_POLICY => (io::ErrorKind::PermissionDenied, "refused by policy"),
        proto::NBD_REP_ERR_TLS_REQD => (io::ErrorKind::Unsupported, "server requires TLS"),
        proto::NBD_REP_ERR_SHUTDOWN => (io::ErrorKind::ConnectionAborted, "server shutting down"),
        proto::NBD_REP_ERR_INVALID => (io::ErrorKind::InvalidInput, "invalid option"),
        _ => (io::ErrorKind::Other, "option failed"),
    };
    io::Error::new(
        kind,
        format!("NBD_OPT_GO for export {export:?}: {what} (reply {reply_type:#x}) {text:?}"),
    )
}

/// One open connection in transmission.
struct Conn {
    stream: Stream,
    next_handle: u64,
}

impl Conn {
    /// Connects and runs the handshake.
    fn open(target: &Target) -> io::Result<(Conn, ExportInfo)> {
        let mut conn = Conn {
            stream: Stream::connect(&target.endpoint)?,
            next_handle: 1,
        };
        let info = conn.handshake(&target.export)?;
        Ok((conn, info))
    }

    fn handshake(&mut self, export: &str) -> io::Result<ExportInfo> {
        let magic = u64::from_be_bytes(read_array(&mut self.stream)?);
        let style = u64::from_be_bytes(read_array(&mut self.stream)?);
        if magic != proto::NBD_MAGIC || style != proto::IHAVEOPT {
            return Err(invalid_data("not a newstyle NBD server (bad greeting)"));
        }
        let handshake_flags = u16::from_be_bytes(read_array(&mut self.stream)?);
        let fixed = handshake_flags & proto::NBD_FLAG_FIXED_NEWSTYLE != 0;
        let no_zeroes = handshake_flags & proto::NBD_FLAG_NO_ZEROES != 0;
        let mut client_flags = 0;
        if fixed {
            client_flags |= proto::NBD_FLAG_C_FIXED_NEWSTYLE;
        }
        if no_zeroes {
            client_flags |= proto::NBD_FLAG_C_NO_ZEROES;
        }
        self.stream.write_all(&client_flags.to_be_bytes())?;
        if fixed {
            if let Some(info) = self.opt_go(export)? {
                return Ok(info);
            }
        }
        self.opt_export_name(export, no_zeroes)
    }

    fn send_option(&mut self, option: u32, data: &[u8]) -> io::Result<()> {
        let length = u32::try_from(data.len()).map_err(|_| invalid_data("option too long"))?;
        let mut m = Vec::with_capacity(16 + data.len());
        m.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
        m.extend_from_slice(&option.to_be_bytes());
        m.extend_from_slice(&length.to_be_bytes());
        m.extend_from_slice(data);
        self.stream.write_all(&m)
    }

    /// One option reply to `option`: (reply type, data).
    fn option_reply(&mut self, option: u32) -> io::Result<(u32, Vec<u8>)> {
        let header: [u8; 20] = read_array(&mut self.stream)?;
        let field =
            |i: usize| u32::from_be_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
        if header[0..8] != proto::OPTION_REPLY_MAGIC.to_be_bytes() {
            return Err(invalid_data("bad option reply magic"));
        }
        if field(8) != option {
            return Err(invalid_data(format!(
                "option reply for option {} to option {option}",
                field(8)
            )));
        }
        let length = field(16);
        if length > MAX_OPTION_REPLY_BYTES {
            return Err(invalid_data(format!("option reply of {length} bytes")));
        }
        let mut data = vec![0u8; length as usize];
        read_full(&mut self.stream, &mut data)?;
        Ok((field(12), data))
    }

    /// `NBD_OPT_GO`; `None` if the server answers `NBD_REP_ERR_UNSUP`.
    fn opt_go(&mut self, export: &str) -> io::Result<Option<ExportInfo>> {
        let name_bytes = u32::try_from(export.len()).map_err(|_| invalid_data("long name"))?;
        let mut data = name_bytes.to_be_bytes().to_vec();
        data.extend_from_slice(export.as_bytes());
        data.extend_from_slice(&1u16.to_be_bytes());
        data.extend_from_slice(&proto::NBD_INFO_BLOCK_SIZE.to_be_bytes());
        self.send_option(proto::NBD_OPT_GO, &data)?;
        let mut export_info = None;
        let mut block_size = None;
        for _ in 0..MAX_OPTION_REPLIES {
            let (reply_type, data) = self.option_reply(proto::NBD_OPT_GO)?;
            match reply_type {
                proto::NBD_REP_ACK => {
                    let (size_bytes, transmission_flags) = export_info.ok_or_else(|| {
                        invalid_data("NBD_OPT_GO acknowledged without export info")
                    })?;
                    return Ok(Some(ExportInfo {
                        size_bytes,
                        transmission_flags,
                        max_payload_bytes: max_payload(block_size),
                    }));
                }
                proto::NBD_REP_INFO => parse_info(&data, &mut export_info, &mut block_size)?,
                proto::NBD_REP_ERR_UNSUP => return Ok(None),
                t if t & (1 << 31) != 0 => return Err(option_error(t, &data, export)),
                _ => {} // Another informational reply: not ours to interpret.
            }
        }
        Err(invalid_data("too many replies to NBD_OPT_GO"))
    }

    /// `NBD_OPT_EXPORT_NAME` (no error reply: an unknown export closes).
    fn opt_export_name(&mut self, export: &str, no_zeroes: bool) -> io::Result<ExportInfo> {
        self.send_option(proto::NBD_OPT_EXPORT_NAME, export.as_bytes())?;
        let reply: [u8; 10] = read_array(&mut self.stream).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("NBD_OPT_EXPORT_NAME for export {export:?} (unknown export?): {e}"),
            )
        })?;
        if !no_zeroes {
            let _padding: [u8; proto::EXPORT_NAME_PADDING_BYTES] = read_array(&mut self.stream)?;
        }
        let mut size = [0u8; 8];
        size.copy_from_slice(&reply[0..8]);
        Ok(ExportInfo {
            size_bytes: u64::from_be_bytes(size),
            transmission_flags: u16::from_be_bytes([reply[8], reply[9]]),
            max_payload_bytes: MAX_REQUEST_BYTES,
        })
    }
}

/// Reads one `NBD_REP_INFO` payload into what the client keeps.
fn parse_info(
    data: &[u8],
    export: &mut Option<(u64, u16)>,
    block_size: &mut Option<BlockSize>,
) -> io::Result<()> {
    let Some(info_type) = data.get(0..2).map(|b| u16::from_be_bytes([b[0], b[1]])) else {
        return Err(invalid_data("empty NBD_REP_INFO"));
    };
    let u32_at = |i: usize| u32::from_be_bytes([data[i], data[i + 1], data[i + 2], data[i + 3]]);
    match info_type {
        proto::NBD_INFO_EXPORT if data.len() == 12 => {
            let mut size = [0u8; 8];
            size.copy_from_slice(&data[2..10]);
            *export = Some((
                u64::from_be_bytes(size),
                u16::from_be_bytes([data[10], data[11]]),
            ));
        }
        proto::NBD_INFO_BLOCK_SIZE if data.len() == 14 => {
            *block_size = Some(BlockSize {
                minimum: u32_at(2),
                maximum: u32_at(10),
            });
        }
        proto::NBD_INFO_EXPORT | proto::NBD_INFO_BLOCK_SIZE => {
            return Err(invalid_data(format!(
                "NBD_REP_INFO type {info_type} of {} bytes",
                data.len()
            )));
        }
        _ => {} // Name, description, unknown: ignored.
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Transmission
// ---------------------------------------------------------------------------

/// One request as sent.
#[derive(Debug, Clone, Copy)]
struct Request<'a> {
    command: u16,
    flags: u16,
    offset: u64,
    length: u32,
    /// WRITE data (empty for the other commands).
    payload: &'a [u8],
}

/// Why a request failed.
enum Failure {
    /// The server answered with this NBD error; the connection is fine
    /// (except after `NBD_ESHUTDOWN`).
    Errno(u32),
    /// The connection is broken or out of step: it is dropped.
    Broken(io::Error),
}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Self {
        Failure::Broken(e)
    }
}

impl Conn {
    /// Sends `req` and reads its simple reply; READ data goes to `data_in`
    /// (whose length is `req.length`, empty for other commands).
    fn transact(&mut self, req: &Request<'_>, data_in: &mut [u8]) -> Result<(), Failure> {
        let handle = self.next_handle;
        self.next_handle = self.next_handle.wrapping_add(1);
        let header = proto::encode_request_header(&RequestHeader {
            flags: req.flags,
            command: req.command,
            handle,
            offset: req.offset,
            length: req.length,
        });
        self.stream.write_all(&header)?;
        if !req.payload.is_empty() {
            self.stream.write_all(req.payload)?;
        }
        let reply: [u8; proto::SIMPLE_REPLY_HEADER_BYTES] = read_array(&mut self.stream)?;
        let magic = u32::from_be_bytes([reply[0], reply[1], reply[2], reply[3]]);
        let error = u32::from_be_bytes([reply[4], reply[5], reply[6], reply[7]]);
        let mut got = [0u8; 8];
        got.copy_from_slice(&reply[8..16]);
        let got = u64::from_be_bytes(got);
        if magic == proto::STRUCTURED_REPLY_MAGIC {
            return Err(invalid_data("structured reply, never negotiated").into());
        }
        if magic != proto::SIMPLE_REPLY_MAGIC {
            return Err(invalid_data(format!("bad reply magic {magic:#010x}")).into());
        }
        if got != handle {
            return Err(invalid_data(format!("reply for handle {got}, expected {handle}")).into());
        }
        if error != 0 {
            return Err(Failure::Errno(error));
        }
        read_full(&mut self.stream, data_in)?;
        Ok(())
    }

    /// Best-effort `NBD_CMD_DISC` before closing an idle connection.
    fn disconnect(mut self) {
        let header = proto::encode_request_header(&RequestHeader {
            flags: 0,
            command: proto::NBD_CMD_DISC,
            handle: self.next_handle,
            offset: 0,
            length: 0,
        });
        let _ = self.stream.write_all(&header);
    }
}

fn command_name(command: u16) -> &'static str {
    match command {
        proto::NBD_CMD_READ => "READ",
        proto::NBD_CMD_WRITE => "WRITE",
        proto::NBD_CMD_FLUSH => "FLUSH",
        proto::NBD_CMD_TRIM => "TRIM",
        proto::NBD_CMD_WRITE_ZEROES => "WRITE_ZEROES",
        _ => "command",
    }
}

/// The `io::ErrorKind` and name of an NBD errno.
fn errno_kind(errno: u32) -> (io::ErrorKind, String) {
    let (kind, name) = match errno {
        proto::NBD_EPERM => (io::ErrorKind::PermissionDenied, "EPERM"),
        proto::NBD_EIO => (io::ErrorKind::Other, "EIO"),
        proto::NBD_ENOMEM => (io::ErrorKind::OutOfMemory, "ENOMEM"),
        proto::NBD_EINVAL => (io::ErrorKind::InvalidInput, "EINVAL"),
        proto::NBD_ENOSPC => (io::ErrorKind::StorageFull, "ENOSPC"),
        proto::NBD_EOVERFLOW => (io::ErrorKind::Other, "EOVERFLOW"),
        proto::NBD_ENOTSUP => (io::ErrorKind::Unsupported, "ENOTSUP"),
        proto::NBD_ESHUTDOWN => (io::ErrorKind::ConnectionAborted, "ESHUTDOWN"),
        other => return (io::ErrorKind::Other, format!("error {other}")),
    };
    (kind, name.to_owned())
}

// ---------------------------------------------------------------------------
// The pool
// ---------------------------------------------------------------------------

struct Pool {
    idle: Vec<Conn>,
    /// Connections open, idle or in use (or being opened).
    open: usize,
}

/// A connection taken from the pool. Dropping it returns the connection
/// if `keep` was set, else closes it and frees its slot.
struct Lease<'a> {
    client: &'a Client,
    conn: Option<Conn>,
    keep: bool,
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        let conn = self.conn.take().filter(|_| self.keep);
        let mut pool = self.client.lock_pool();
        match conn {
            Some(conn) => pool.idle.push(conn),
            None => pool.open = pool.open.saturating_sub(1),
        }
        drop(pool);
        self.client.slot_freed.notify_one();
    }
}

/// A pool of connections to one NBD export; see the [module docs](self).
pub struct Client {
    uri: String,
    target: Target,
    info: ExportInfo,
    /// [`MAX_CONNECTIONS`], or 1 for a writable export without multi-conn.
    max_connections: usize,
    pool: Mutex<Pool>,
    slot_freed: Condvar,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("uri", &self.uri)
            .field("size_bytes", &self.info.size_bytes)
            .field("transmission_flags", &self.info.transmission_flags)
            .field("max_connections", &self.max_connections)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Parses `uri` and connects. URIs: `nbd://HOST[:PORT][/EXPORT]`
    /// (default port 10809, IPv6 as `[::1]`) and
    /// `nbd+unix:///EXPORT?socket=PATH` (EXPORT may be empty: the default
    /// export); the export name and socket path may be %-escaped. Anything
    /// else is an `InvalidInput` error naming the accepted forms. One
    /// connection is opened and handshaken at once, so a wrong URI or an
    /// unreachable server fails here, with the URI in the message.
    pub fn connect(uri: &str) -> io::Result<Client> {
        let target = parse_uri(uri)?;
        let (conn, info) = Conn::open(&target).map_err(|e| context(e, uri))?;
        let flags = info.transmission_flags;
        let multi_conn = flags & proto::NBD_FLAG_CAN_MULTI_CONN != 0;
        let read_only = flags & proto::NBD_FLAG_READ_ONLY != 0;
        let max_connections = if multi_conn || read_only {
            MAX_CONNECTIONS
        } else {
            1
        };
        Ok(Client {
            uri: uri.to_owned(),
            target,
            info,
            max_connections,
            pool: Mutex::new(Pool {
                idle: vec![conn],
                open: 1,
            }),
            slot_freed: Condvar::new(),
        })
    }

    /// Size of the export in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.info.size_bytes
    }

    fn has_flag(&self, flag: u16) -> bool {
        let flags = self.info.transmission_flags;
        flags & proto::NBD_FLAG_HAS_FLAGS != 0 && flags & flag != 0
    }

    /// The server exports read-only (`NBD_FLAG_READ_ONLY`).
    pub fn read_only(&self) -> bool {
        self.has_flag(proto::NBD_FLAG_READ_ONLY)
    }

    /// The server takes `NBD_CMD_FLUSH`.
    pub fn can_flush(&self) -> bool {
        self.has_flag(proto::NBD_FLAG_SEND_FLUSH)
    }

    /// The server takes `NBD_CMD_TRIM`.
    pub fn can_trim(&self) -> bool {
        self.has_flag(proto::NBD_FLAG_SEND_TRIM)
    }

    /// The server takes `NBD_CMD_WRITE_ZEROES`.
    pub fn can_write_zeroes(&self) -> bool {
        self.has_flag(proto::NBD_FLAG_SEND_WRITE_ZEROES)
    }

    /// The server takes the FUA flag on writes.
    pub fn can_fua(&self) -> bool {
        self.has_flag(proto::NBD_FLAG_SEND_FUA)
    }

    /// The server advertises `NBD_FLAG_CAN_MULTI_CONN` (a flush on one
    /// connection covers all of them).
    pub fn can_multi_conn(&self) -> bool {
        self.has_flag(proto::NBD_FLAG_CAN_MULTI_CONN)
    }

    /// Most connections this client opens: [`MAX_CONNECTIONS`], or 1 for a
    /// writable export without multi-conn (see the flush rule).
    pub fn max_connections(&self) -> usize {
        self.max_connections
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        let piece = self.info.max_payload_bytes as usize;
        let mut at = offset;
        for chunk in buf.chunks_mut(piece) {
            let length = chunk.len() as u32; // ≤ max_payload_bytes
            let req = Request {
                command: proto::NBD_CMD_READ,
                flags: 0,
                offset: at,
                length,
                payload: &[],
            };
            self.run(&req, chunk)?;
            at += u64::from(length);
        }
        Ok(())
    }

    /// Writes `data` at `offset`. With `fua`, the data is durable when this
    /// returns: the FUA flag if the server takes it, else a flush after the
    /// write (nothing if the server has neither).
    pub fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        self.check_range(offset, data.len() as u64)?;
        self.check_writable()?;
        let flags = if fua && self.can_fua() {
            proto::NBD_CMD_FLAG_FUA
        } else {
            0
        };
        self.write_pieces(offset, data, flags)?;
        if fua && !self.can_fua() {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes `data` in requests of at most the payload limit.
    fn write_pieces(&self, offset: u64, data: &[u8], flags: u16) -> io::Result<()> {
        let mut at = offset;
        for chunk in data.chunks(self.info.max_payload_bytes as usize) {
            let length = chunk.len() as u32; // ≤ max_payload_bytes
            let req = Request {
                command: proto::NBD_CMD_WRITE,
                flags,
                offset: at,
                length,
                payload: chunk,
            };
            self.run(&req, &mut [])?;
            at += u64::from(length);
        }
        Ok(())
    }

    /// Makes every write that completed before this call durable (one
    /// `NBD_CMD_FLUSH`; see the flush rule in the module docs). `Ok` without
    /// sending anything if the server does not advertise FLUSH.
    pub fn flush(&self) -> io::Result<()> {
        if !self.can_flush() {
            return Ok(());
        }
        let req = Request {
            command: proto::NBD_CMD_FLUSH,
            flags: 0,
            offset: 0,
            length: 0,
            payload: &[],
        };
        self.run(&req, &mut [])
    }

    /// Discards `len` bytes at `offset` (a hint: the data may read back as
    /// anything). `Ok` without sending anything if the server does not
    /// advertise TRIM (a read-only export never does).
    pub fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check_range(offset, len)?;
        if !self.can_trim() {
            return Ok(());
        }
        self.ranged(proto::NBD_CMD_TRIM, offset, len)
    }

    /// Makes `len` bytes at `offset` read as zeros: `NBD_CMD_WRITE_ZEROES`
    /// (holes allowed) if advertised, else writes of zero buffers of at
    /// most 1 MiB each.
    pub fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check_range(offset, len)?;
        self.check_writable()?;
        if self.can_write_zeroes() {
            return self.ranged(proto::NBD_CMD_WRITE_ZEROES, offset, len);
        }
        let piece = ZERO_BUFFER_BYTES.min(self.info.max_payload_bytes);
        let zeros = vec![0u8; piece.min(u32::try_from(len).unwrap_or(u32::MAX)) as usize];
        let mut at = offset;
        let end = offset + len; // check_range: no overflow
        while at < end {
            let n = (end - at).min(zeros.len() as u64);
            self.write_pieces(at, &zeros[..n as usize], 0)?;
            at += n;
        }
        Ok(())
    }

    /// TRIM or WRITE_ZEROES of a range, in requests of at most 1 GiB.
    fn ranged(&self, command: u16, offset: u64, len: u64) -> io::Result<()> {
        let end = offset + len; // check_range: no overflow
        let mut at = offset;
        while at < end {
            let length = (end - at).min(MAX_TRIM_ZERO_BYTES);
            let req = Request {
                command,
                flags: 0,
                offset: at,
                length: length as u32, // ≤ 1 GiB
                payload: &[],
            };
            self.run(&req, &mut [])?;
            at += length;
        }
        Ok(())
    }

    fn check_range(&self, offset: u64, len: u64) -> io::Result<()> {
        let size = self.info.size_bytes;
        if offset.checked_add(len).is_some_and(|end| end <= size) {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{len} bytes at offset {offset} are beyond the end of {} ({size} bytes)",
                self.uri
            ),
        ))
    }

    fn check_writable(&self) -> io::Result<()> {
        if self.read_only() {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{} is a read-only export", self.uri),
            ));
        }
        Ok(())
    }

    /// Runs one request on a pooled connection.
    fn run(&self, req: &Request<'_>, data_in: &mut [u8]) -> io::Result<()> {
        let mut lease = self.lease()?;
        let result = match lease.conn.as_mut() {
            Some(conn) => conn.transact(req, data_in),
            None => Err(Failure::Broken(io::Error::other("no connection"))),
        };
        match result {
            Ok(()) => {
                lease.keep = true;
                Ok(())
            }
            Err(Failure::Errno(errno)) => {
                lease.keep = errno != proto::NBD_ESHUTDOWN;
                Err(self.errno_error(errno, req))
            }
            Err(Failure::Broken(e)) => Err(io::Error::new(
                e.kind(),
                format!(
                    "{} of {} bytes at offset {} on {}: {e}",
                    command_name(req.command),
                    req.length,
                    req.offset,
                    self.uri
                ),
            )),
        }
    }

    fn errno_error(&self, errno: u32, req: &Request<'_>) -> io::Error {
        let (kind, name) = errno_kind(errno);
        let command = command_name(req.command);
        let what = if req.command == proto::NBD_CMD_FLUSH {
            command.to_owned()
        } else {
            format!("{command} of {} bytes at offset {}", req.length, req.offset)
        };
        io::Error::new(
            kind,
            format!("origin server answered {name} to {what} ({})", self.uri),
        )
    }

    fn lock_pool(&self) -> MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes an idle connection, or opens one while below the limit, or
    /// waits for one to be returned or closed.
    fn lease(&self) -> io::Result<Lease<'_>> {
        let mut pool = self.lock_pool();
        loop {
            if let Some(conn) = pool.idle.pop() {
                return Ok(self.leased(conn));
            }
            if pool.open < self.max_connections {
                pool.open += 1;
                drop(pool);
                return match self.open_another() {
                    Ok(conn) => Ok(self.leased(conn)),
                    Err(e) => {
                        self.lock_pool().open -= 1;
                        self.slot_freed.notify_one();
                        Err(context(e, &self.uri))
                    }
                };
            }
            pool = self
                .slot_freed
                .wait(pool)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn leased(&self, conn: Conn) -> Lease<'_> {
        Lease {
            client: self,
            conn: Some(conn),
            keep: false,
        }
    }

    /// A further connection; it must show the export as the first one did.
    fn open_another(&self) -> io::Result<Conn> {
        let (conn, info) = Conn::open(&self.target)?;
        if info != self.info {
            return Err(invalid_data(format!(
                "export changed: now {} bytes, flags {:#x} (was {} bytes, flags {:#x})",
                info.size_bytes,
                info.transmission_flags,
                self.info.size_bytes,
                self.info.transmission_flags
            )));
        }
        Ok(conn)
    }
}

impl Drop for Client {
    /// Sends `NBD_CMD_DISC` on every idle connection (best effort).
    fn drop(&mut self) {
        let idle = std::mem::take(&mut self.lock_pool().idle);
        for conn in idle {
            conn.disconnect();
        }
    }
}

/// Prefixes an error with the URI it concerns.
fn context(e: io::Error, uri: &str) -> io::Error {
    io::Error::new(e.kind(), format!("{uri}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(host: &str, port: u16, export: &str) -> Target {
        Target {
            endpoint: Endpoint::Tcp {
                host: host.into(),
                port,
            },
            export: export.into(),
        }
    }

    #[test]
    fn tcp_uris() {
        let ok = |uri: &str| parse_uri(uri).unwrap();
        assert_eq!(ok("nbd://h"), tcp("h", 10809, ""));
        assert_eq!(ok("nbd://h/"), tcp("h", 10809, ""));
        assert_eq!(ok("nbd://h:1234/disk"), tcp("h", 1234, "disk"));
        assert_eq!(ok("nbd://[::1]/a%20b"), tcp("::1", 10809, "a b"));
        assert_eq!(ok("nbd://[::1]:99"), tcp("::1", 99, ""));
        assert_eq!(ok("nbd://127.0.0.1:5/x/y"), tcp("127.0.0.1", 5, "x/y"));
        for bad in [
            "nbd://",
            "nbd://:80",
            "nbd://h:port",
            "nbd://h:99999",
            "nbd://[::1",
            "nbd://[::1]x",
            "nbd://h/x?tls=on",
            "nbd://u@h/",
            "nbd://h/%zz",
            "nbd://h/%00",
            "nbds://h/",
            "http://h/",
            "",
        ] {
            let e = parse_uri(bad).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{bad}");
            assert!(e.to_string().contains(ACCEPTED_FORMS), "{e}");
        }
    }

    #[test]
    fn unix_uris() {
        let t = parse_uri("nbd+unix:///?socket=/tmp/s.sock").unwrap();
        assert_eq!(t.endpoint, Endpoint::Unix("/tmp/s.sock".into()));
        assert_eq!(t.export, "");
        let t = parse_uri("nbd+unix:///disk?socket=/tmp/a%20b").unwrap();
        assert_eq!(t.endpoint, Endpoint::Unix("/tmp/a b".into()));
        assert_eq!(t.export, "disk");
        let t = parse_uri("nbd+unix://?socket=s").unwrap();
        assert_eq!(t.endpoint, Endpoint::Unix("s".into()));
        for bad in [
            "nbd+unix:///disk",
            "nbd+unix:///disk?socket=",
            "nbd+unix://host/disk?socket=/s",
            "nbd+unix:///?socket=/s&tls=on",
            "nbd+unix:///?sock=/s",
        ] {
            let e = parse_uri(bad).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{bad}");
            assert!(e.to_string().contains(bad), "{e}");
        }
    }

    #[test]
    fn payload_limit_follows_block_sizes() {
        let bs = |minimum, maximum| Some(BlockSize { minimum, maximum });
        assert_eq!(max_payload(None), MAX_REQUEST_BYTES);
        assert_eq!(max_payload(bs(1, u32::MAX)), MAX_REQUEST_BYTES);
        assert_eq!(max_payload(bs(1, 65536)), 65536);
        assert_eq!(max_payload(bs(512, 1000)), 512);
        assert_eq!(max_payload(bs(4096, 100)), 4096);
        assert_eq!(max_payload(bs(0, 0)), 1);
    }

    #[test]
    fn client_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Client>();
    }
}
