//! # cvol-nbd: an NBD server
//!
//! Serves exports, each backed by a [`Backend`], over TCP and/or Unix sockets:
//! one ([`Server::new`]) or a set looked up by name during the handshake
//! ([`Server::with_exports`], [`Exports`], [`ExportSet`]),
//! speaking the fixed-newstyle NBD protocol (`doc/proto.md` of the
//! NetworkBlockDevice project): `NBD_OPT_GO`/`INFO`/`EXPORT_NAME`/`LIST`/
//! `ABORT`, structured replies, the `base:allocation` metadata context and
//! any other a backend names ([`Backend::meta_contexts`], e.g. qemu's
//! `qemu:dirty-bitmap:NAME`), and the commands READ, WRITE, FLUSH, TRIM, WRITE_ZEROES, BLOCK_STATUS, CACHE, DISC.
//! With [`ServerConfig::tls`] the server offers `NBD_OPT_STARTTLS` (rustls,
//! x509 certificates, optional client certificates: [`tls`]), or requires
//! it; without, `NBD_OPT_STARTTLS` gets `NBD_REP_ERR_POLICY`.
//! [`ServerConfig::allow`] limits which TCP peers may connect.
//! The crate also has a small synchronous NBD [`client`] (a pool of
//! connections), used to read and write an origin device behind a cache.
//!
//! ## Threads
//!
//! * One **accept thread per listener** (`serve_tcp`, `serve_unix`). It polls
//!   the listener with a short timeout so that [`Server::shutdown`] can stop it.
//! * One **reader thread per connection**. It runs the handshake, then parses
//!   requests, validates them (see [`proto::validate_request`]), reads WRITE
//!   payloads, and dispatches accepted requests to the worker pool. Requests
//!   rejected at validation are answered by the reader itself.
//! * A shared **worker pool** (`ServerConfig::workers` threads, bounded job
//!   queue) runs the backend calls and hands each reply to its connection.
//!   Replies go out in completion order (out of order), each written whole,
//!   so replies never interleave. A worker only ever writes what the socket
//!   takes without blocking; the rest goes to the connection's outbox.
//! * One **reply writer thread per connection** (in transmission) sends what
//!   is in the outbox, blocking on the socket, so a client that stops
//!   reading its replies stalls only its own connection, never a worker.
//!
//! ## Ordering rules (per connection)
//!
//! A request is dispatched only when it does not conflict with a request of
//! the same connection that is still in flight; until then the reader waits
//! (and stops reading). Two requests conflict when their byte ranges
//! intersect and at least one of them is a write-type command (WRITE, TRIM,
//! WRITE_ZEROES): overlapping writes therefore complete in arrival order and
//! a read never observes half of an overlapping write. FLUSH waits until every
//! write-type request received before it has completed (and replied), then
//! calls [`Backend::flush`]; writes that complete on *other* connections are
//! the backend's business (the server advertises `NBD_FLAG_CAN_MULTI_CONN`,
//! so the backend's flush must cover every completed write).
//! A request counts as in flight until its reply has been written.
//!
//! ## Bounds
//!
//! * READ/WRITE/CACHE length ≤ `max_request_bytes` (default 32 MiB),
//!   advertised as the maximum block size; longer requests get `EINVAL`.
//!   A WRITE whose payload exceeds that limit is read and discarded if it is
//!   at most `max(64 MiB, max_request_bytes)`; beyond that the connection is
//!   dropped (the spec allows a hard disconnect for such payloads).
//! * At most `max_inflight_per_conn` requests in flight per connection
//!   (rejected requests included: their error replies take a slot too), and
//!   at most `max(64 MiB, 2 × max_request_bytes)` of READ/WRITE payload
//!   buffered per connection (one request is always allowed). A request is
//!   in flight until its reply has been written, so the outbox of replies
//!   is bounded by the same limits.
//! * At most `max_buffered_bytes` (default 256 MiB) of READ/WRITE payload
//!   in flight server-wide; a reader whose request does not fit waits.
//!   Each connection slot has a floor of `max_buffered_bytes / (2 ×
//!   max_connections)` set aside for it; beyond its floor a connection
//!   draws on the shared rest, at most half of it, so connections that do
//!   not read their replies never take what another needs to progress.
//! * At most `max_connections` connections, `max_connections_per_address`
//!   per TCP peer address and `max_handshaking` still in the handshake
//!   (when those are all taken, one that has been in the handshake for 2 s
//!   gives its place to a new one); beyond that new connections are
//!   closed at once (counted, logged sparsely). Handshake options are
//!   limited in size (64 KiB buffered, up to 1 MiB skipped) and in number
//!   (256) per connection, and the whole handshake must finish within
//!   `handshake_timeout` (default 30 s). With `idle_timeout`, an
//!   established connection with nothing in flight that sends nothing for
//!   that long is closed.
//! * Every queue is bounded; nothing is allocated from a client-supplied
//!   length before it has been validated against these limits.
//! * A socket write that blocks for longer than `send_timeout` (the client
//!   does not read its replies), or a reply not sent within `send_timeout`
//!   plus its size at `min_reply_bytes_per_sec` (the client trickles),
//!   ends the connection, so a stuck client cannot hold a worker or its
//!   payload forever.
//! * Busy polling (`busy_poll`, off by default) spins at most
//!   `busy_poll_threads` readers at once, each for at most `busy_poll`
//!   per request, yielding its core to any thread that wants it.
//!
//! Client input never panics the server; a protocol violation (such as a bad
//! request magic) ends only the offending connection, after its in-flight
//! requests have completed.

use std::sync::Arc;

pub mod client;
mod exports;
pub mod proto;
pub mod server;
#[cfg(feature = "test-util")]
pub mod test_util;
pub mod tls;

pub use exports::{Export, ExportSet, Exports};
pub use server::Server;

/// Errors a backend returns; mapped to NBD error codes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendError {
    /// `NBD_EIO`.
    Io,
    /// `NBD_ENOSPC`.
    NoSpace,
    /// `NBD_EINVAL`.
    Invalid,
    /// `NBD_EPERM` (the spec's error for writes to a read-only export).
    ReadOnly,
    /// `NBD_ENOTSUP` for WRITE_ZEROES with FAST_ZERO; `NBD_EINVAL` for other
    /// commands (the spec reserves ENOTSUP for fast zero).
    NotSupported,
    /// `NBD_EOVERFLOW` for READ with DF; `NBD_EINVAL` otherwise (the spec
    /// reserves EOVERFLOW for DF reads).
    Overflow,
}

/// An allocation-status extent returned by [`Backend::block_status`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u64,
    /// Not allocated (`NBD_STATE_HOLE`).
    pub hole: bool,
    /// Reads as zeroes (`NBD_STATE_ZERO`).
    pub zero: bool,
}

/// A run of one status in a backend's own metadata context, returned by
/// [`Backend::context_status`]: `length` bytes whose status is `flags`
/// (the context's meaning; for qemu's `qemu:dirty-bitmap:NAME`, bit 0 set
/// = dirty, i.e. changed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextExtent {
    pub length: u64,
    pub flags: u32,
}

/// Flags of a WRITE_ZEROES request.
#[derive(Debug, Clone, Copy, Default)]
pub struct WriteZeroesFlags {
    pub fua: bool,
    /// The range must stay allocated (no hole may be punched).
    pub no_hole: bool,
    /// Fail fast with [`BackendError::NotSupported`] unless zeroing is
    /// faster than writing.
    pub fast_zero: bool,
}

/// What the server calls. Offsets/lengths are in bytes, already validated by
/// the server (in range, length > 0, READ/WRITE/CACHE within
/// `max_request_bytes`; TRIM and WRITE_ZEROES may be up to 4 GiB - 1).
/// Unaligned requests are passed through unchanged: the backend handles
/// read-modify-write. Calls may run concurrently from several worker threads.
pub trait Backend: Send + Sync + 'static {
    fn size_bytes(&self) -> u64;
    fn read_only(&self) -> bool;
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError>;
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), BackendError>;
    fn flush(&self) -> Result<(), BackendError>;
    fn trim(&self, offset: u64, length: u64, fua: bool) -> Result<(), BackendError>;
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        flags: WriteZeroesFlags,
    ) -> Result<(), BackendError>;
    /// Allocation status of [offset, offset+length): returns extents covering
    /// at least the first byte, in order, contiguous from `offset`; a total
    /// ≤ length is fine (anything beyond `length` is cut off).
    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, BackendError>;
    /// NBD_CMD_CACHE: a hint; default no-op is fine for backends.
    fn cache(&self, _offset: u64, _length: u64) -> Result<(), BackendError> {
        Ok(())
    }
    /// Metadata contexts besides `base:allocation` this backend offers now,
    /// by full name (`namespace:leaf`, e.g. `"qemu:dirty-bitmap:snap1"`).
    /// Asked at each `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`
    /// for this export; a context selected stays selected for the
    /// connection (if it goes away, [`Backend::context_status`] fails).
    /// Names must not be `base:allocation` and should be distinct.
    /// Default: none.
    fn meta_contexts(&self) -> Vec<String> {
        Vec::new()
    }
    /// Status of [offset, offset+length) in the context `name` (one of
    /// [`Backend::meta_contexts`]): runs in order, contiguous from
    /// `offset`, covering at least the first byte; a total ≤ length is fine
    /// and anything beyond `length` is cut off. Neighbouring runs with equal
    /// flags are merged by the server. An error is sent to the client as a
    /// failed BLOCK_STATUS. Default: [`BackendError::NotSupported`].
    fn context_status(
        &self,
        _name: &str,
        _offset: u64,
        _length: u64,
    ) -> Result<Vec<ContextExtent>, BackendError> {
        Err(BackendError::NotSupported)
    }
}

/// The NBD commands that reach a backend (what a [`RequestObserver`]
/// hears about, and what metrics and traces are kept by).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CommandKind {
    Read,
    Write,
    Flush,
    Trim,
    WriteZeroes,
    BlockStatus,
    Cache,
}

impl CommandKind {
    /// Every kind, in declaration order (`kind as usize` indexes it).
    pub const ALL: [CommandKind; 7] = [
        CommandKind::Read,
        CommandKind::Write,
        CommandKind::Flush,
        CommandKind::Trim,
        CommandKind::WriteZeroes,
        CommandKind::BlockStatus,
        CommandKind::Cache,
    ];

    /// Lower-case name (`write_zeroes`), for labels and logs.
    pub fn name(self) -> &'static str {
        match self {
            CommandKind::Read => "read",
            CommandKind::Write => "write",
            CommandKind::Flush => "flush",
            CommandKind::Trim => "trim",
            CommandKind::WriteZeroes => "write_zeroes",
            CommandKind::BlockStatus => "block_status",
            CommandKind::Cache => "cache",
        }
    }
}

/// Hears what the server does (metrics): each dispatched request once its
/// reply has been written (or dropped with its connection), and
/// connections opening and closing. Called on server threads: keep it
/// cheap and non-blocking.
pub trait RequestObserver: Send + Sync + 'static {
    /// `elapsed`: from the request read (before it waited for the
    /// ordering rules, the payload budget, the worker queues) to its
    /// reply written: the server's whole share of the latency a client
    /// sees.
    fn request_done(&self, command: CommandKind, elapsed: std::time::Duration);
    /// Open connections now (after one opened or closed).
    fn connections(&self, open: usize);
    /// A connection's reader busy-polled its socket for `polled`
    /// (`ServerConfig::busy_poll`); `found`: a request came meanwhile.
    fn busy_poll(&self, found: bool, polled: std::time::Duration) {
        let _ = (found, polled);
    }
}

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Name of the export of [`Server::new`]; a client asking for "" gets
    /// it too (default export). Not used by [`Server::with_exports`].
    pub export_name: String,
    /// Optional human-readable description (`NBD_INFO_DESCRIPTION`,
    /// `NBD_OPT_LIST`) of the export of [`Server::new`]. Not used by
    /// [`Server::with_exports`].
    pub description: Option<String>,
    /// Max payload of READ/WRITE (and max CACHE length); default 32 MiB.
    pub max_request_bytes: u32,
    /// Worker threads running backend calls; default 2 × cores, at least 4.
    pub workers: usize,
    /// Requests in flight per connection before the reader stops reading; default 64.
    pub max_inflight_per_conn: usize,
    /// Connections served at once; default 256. Beyond, new connections are
    /// accepted and closed at once (before the greeting; logged sparsely,
    /// counted in [`Server::refused_connection_count`]).
    pub max_connections: usize,
    /// Server-wide cap on READ/WRITE payload bytes held by in-flight
    /// requests (WRITE data read but not yet written to the backend, READ
    /// replies not yet sent); default 256 MiB, at least `max_request_bytes`.
    /// A reader whose request does not fit waits (stops reading). Each
    /// connection slot has `max_buffered_bytes / (2 × max_connections)` of
    /// it set aside (its floor); beyond that a connection may hold at most
    /// half of the rest, so clients that do not read their replies cannot
    /// stall the others.
    pub max_buffered_bytes: u64,
    /// The whole handshake (greeting to NBD_OPT_GO/EXPORT_NAME) must finish
    /// within this time, or the connection is closed; default 30 s.
    pub handshake_timeout: std::time::Duration,
    /// Connections one TCP peer address may hold at once (handshaking or
    /// established); beyond, its new connections are closed at once
    /// (counted in [`Server::refused_connection_count`]). Unix-socket
    /// clients are exempt (the socket file's permissions decide who may
    /// connect). Default 16.
    pub max_connections_per_address: usize,
    /// Connections still in the handshake (before NBD_OPT_GO, TLS included)
    /// at once; beyond, new connections are closed at once, so clients
    /// that never finish the handshake cannot take the slots of
    /// established ones. Default 64 (a quarter of the default
    /// `max_connections`); at most `max_connections`.
    pub max_handshaking: usize,
    /// An established connection with no request in flight that sends
    /// nothing for this long is closed; `None` (the default): never.
    pub idle_timeout: Option<std::time::Duration>,
    /// A reply must be sent within this time plus its size at
    /// `min_reply_bytes_per_sec` from when its sending starts, and every
    /// send must make progress within this time, or the connection is
    /// closed (a client that stops reading, or trickles). Default 60 s.
    pub send_timeout: std::time::Duration,
    /// The slowest a client may read a reply, on average, beyond
    /// `send_timeout`; default 64 KiB/s (a 32 MiB reply has 60 s + 512 s).
    pub min_reply_bytes_per_sec: u64,
    /// TLS offered or required (`None`: `NBD_OPT_STARTTLS` is refused).
    pub tls: Option<tls::TlsSettings>,
    /// TCP peers allowed to connect (`None`: any); others are closed at
    /// once, before the greeting. Unix-socket clients are not filtered.
    pub allow: Option<Vec<ipnet::IpNet>>,
    /// Hears requests and connections (metrics); `None`: nobody.
    pub observer: Option<ObserverHandle>,
    /// The longest a connection's reader watches its socket for the next
    /// request, without sleeping, after answering everything it was sent:
    /// a client at queue depth 1 then does not pay a wake-up per request.
    /// The window adapts per connection (it closes for a client that
    /// pauses) and the reader yields its core to any other thread while
    /// it polls. Not under TLS. Zero (the default here; `cvol serve`
    /// uses 100 µs): never.
    pub busy_poll: std::time::Duration,
    /// Readers that may busy-poll at once, server-wide; default half the
    /// cores, at least 1.
    pub busy_poll_threads: usize,
    /// Asked before each busy poll: polls only if it says yes (`None`:
    /// always). `cvol serve` says no while other threads wait for a core.
    pub busy_poll_gate: Option<PollGate>,
}

/// `ServerConfig::busy_poll_gate`: whether a reader may busy-poll now.
/// Called once per wait for a request: keep it to a few atomic loads.
#[derive(Clone)]
pub struct PollGate(pub Arc<dyn Fn() -> bool + Send + Sync>);

impl std::fmt::Debug for PollGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PollGate")
    }
}

/// A [`RequestObserver`] in a [`ServerConfig`].
#[derive(Clone)]
pub struct ObserverHandle(pub Arc<dyn RequestObserver>);

impl std::fmt::Debug for ObserverHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ObserverHandle")
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        ServerConfig {
            export_name: String::new(),
            description: None,
            max_request_bytes: 32 * 1024 * 1024,
            workers: (2 * cores).max(4),
            max_inflight_per_conn: 64,
            max_connections: 256,
            max_buffered_bytes: 256 * 1024 * 1024,
            handshake_timeout: std::time::Duration::from_secs(30),
            max_connections_per_address: 16,
            max_handshaking: 64,
            idle_timeout: None,
            send_timeout: std::time::Duration::from_secs(60),
            min_reply_bytes_per_sec: 64 * 1024,
            tls: None,
            allow: None,
            observer: None,
            busy_poll: std::time::Duration::ZERO,
            busy_poll_threads: (cores / 2).max(1),
            busy_poll_gate: None,
        }
    }
}

/// Convenience alias for the backend handle the server holds.
pub type SharedBackend = Arc<dyn Backend>;
