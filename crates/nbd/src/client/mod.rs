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
//!
//! ## Rooms
//!
//! * this file: [`Client`], its public calls and how a call is split into
//!   requests and its errors worded;
//! * `uri`: parsing `nbd://` and `nbd+unix://` URIs;
//! * `stream`: TCP and Unix sockets with timeouts, whole-message reads;
//! * `handshake`: one connection's fixed-newstyle handshake (`NBD_OPT_GO`,
//!   `NBD_OPT_EXPORT_NAME`) and what it learns of the export;
//! * `request`: one request and its simple reply on a connection;
//! * `pool`: the pool of connections calls lease from.

use std::io;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use crate::proto;

mod handshake;
mod pool;
mod request;
mod stream;
mod uri;

#[cfg(test)]
mod tests;

use handshake::{Conn, ExportInfo};
use pool::Pool;
use request::{command_name, errno_kind, Failure, Request};
use uri::{parse_uri, Target};

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
}

/// Prefixes an error with the URI it concerns.
fn context(e: io::Error, uri: &str) -> io::Error {
    io::Error::new(e.kind(), format!("{uri}: {e}"))
}
