//! Transmission phase: the per-connection reader loop, in-flight tracking
//! with the ordering rules, and execution of commands on the worker pool.

use std::io::{self, Read};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

mod block_status;
mod busy_poll;
mod outbox;
mod read_cost;

use busy_poll::BusyPoll;
pub(crate) use busy_poll::Pollers;
use outbox::Outbox;
use read_cost::ReadCost;

use super::handshake::{MetaContext, Negotiated};
use super::socket::Socket;
use super::{lock, BudgetShare, Inner, Lane, PayloadBudget};
use crate::proto::{self, Command, ProtoError, RequestError, RequestHeader, TransmissionContext};
use crate::{Backend, BackendError, CommandKind, WriteZeroesFlags};

/// WRITE payloads above `max_request_bytes` but at most this size are read
/// and discarded (reply `EINVAL`); larger ones end the connection.
const MIN_DISCARD_CAP_BYTES: u64 = 64 * 1024 * 1024;
/// Per-connection budget of buffered READ/WRITE payload bytes, at least this.
const MIN_PAYLOAD_BUDGET_BYTES: u64 = 64 * 1024 * 1024;
/// Chunk size used when discarding a payload.
const DISCARD_CHUNK_BYTES: usize = 64 * 1024;
/// Stack of a connection's reply writer thread (it only sends bytes).
const REPLY_WRITER_STACK_BYTES: usize = 256 * 1024;
/// A READ or WRITE of at most this many bytes runs on the connection's
/// reader thread when it is the only request in flight and nothing more
/// has arrived (`runs_inline`).
const INLINE_MAX_BYTES: u32 = 256 * 1024;

/// The connection's request stream: a reader that can tell whether it
/// holds bytes already read from the socket but not yet consumed.
pub(crate) trait Input: Read {
    fn buffered_bytes(&self) -> usize;
}

impl<R: Read> Input for std::io::BufReader<R> {
    fn buffered_bytes(&self) -> usize {
        self.buffer().len()
    }
}

/// A request that has been dispatched and whose reply is not yet sent.
struct Entry {
    id: u64,
    range: Option<(u64, u64)>,
    is_write: bool,
    payload_bytes: u64,
}

#[derive(Default)]
struct Inflight {
    next_id: u64,
    entries: Vec<Entry>,
    payload_bytes: u64,
    /// Entries that write (WRITE, TRIM, WRITE_ZEROES).
    writes: usize,
    /// Threads waiting on `inflight_changed` (the reader, or a close
    /// waiting for idle): a release wakes them only if there are any
    /// (a wake is a syscall, and every reply releases a slot).
    waiters: usize,
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    let (a_start, a_len) = a;
    let (b_start, b_len) = b;
    a_len > 0
        && b_len > 0
        && a_start < b_start.saturating_add(b_len)
        && b_start < a_start.saturating_add(a_len)
}

impl Inflight {
    /// True if `cmd` must wait for an in-flight request (ordering rules).
    fn conflicts(&self, cmd: &Command) -> bool {
        if matches!(cmd, Command::Flush) {
            return self.entries.iter().any(|e| e.is_write);
        }
        let Some(range) = cmd.range() else {
            return false;
        };
        self.entries
            .iter()
            .any(|e| (e.is_write || cmd.is_write()) && e.range.is_some_and(|r| overlaps(r, range)))
    }
}

/// State shared by a connection's reader, its reply writer and the workers
/// running its requests.
pub(crate) struct Conn {
    id: u64,
    socket: Arc<Socket>,
    backend: Arc<dyn Backend>,
    ctx: TransmissionContext,
    /// The metadata contexts BLOCK_STATUS reports, by ascending id.
    meta_contexts: Vec<MetaContext>,
    broken: AtomicBool,
    outbox: Mutex<Outbox>,
    outbox_changed: Condvar,
    /// How long this connection's reads take (where they run).
    read_cost: ReadCost,
    inflight: Mutex<Inflight>,
    inflight_changed: Condvar,
    max_inflight: usize,
    payload_budget_bytes: u64,
    observer: Option<crate::ObserverHandle>,
    /// Server-wide budget of READ/WRITE payload bytes in flight.
    server_budget: Arc<PayloadBudget>,
    /// This connection's holding in `server_budget`.
    budget_share: BudgetShare,
    /// `ServerConfig::send_timeout`.
    send_timeout: Duration,
    /// `ServerConfig::min_reply_bytes_per_sec`.
    min_reply_bytes_per_sec: u64,
}

impl Conn {
    /// Sends an error reply (structured if negotiated) for a request that
    /// never reached a worker; it takes an in-flight slot like any request,
    /// so a client flooding invalid requests cannot queue unbounded replies.
    fn send_error(self: &Arc<Self>, handle: u64, error: u32, message: &str) {
        debug_assert_ne!(error, 0);
        let release = self.reserve_slot(None, false, 0);
        let bytes = if self.ctx.structured_replies {
            proto::encode_error_chunk(handle, error, message)
        } else {
            proto::encode_simple_reply(error, handle).to_vec()
        };
        self.send(bytes, release);
    }

    /// Blocks until `cmd` may be dispatched, then records it as in flight.
    fn reserve(self: &Arc<Self>, cmd: &Command, payload_bytes: u64) -> Release {
        let conflicts = |state: &Inflight| state.conflicts(cmd);
        self.reserve_with(cmd.range(), cmd.is_write(), payload_bytes, conflicts)
    }

    /// Takes an in-flight slot that conflicts with nothing.
    fn reserve_slot(
        self: &Arc<Self>,
        range: Option<(u64, u64)>,
        is_write: bool,
        payload_bytes: u64,
    ) -> Release {
        self.reserve_with(range, is_write, payload_bytes, |_| false)
    }

    fn reserve_with(
        self: &Arc<Self>,
        range: Option<(u64, u64)>,
        is_write: bool,
        payload_bytes: u64,
        conflicts: impl Fn(&Inflight) -> bool,
    ) -> Release {
        let mut state = lock(&self.inflight);
        loop {
            let room = state.entries.len() < self.max_inflight
                && (state.entries.is_empty()
                    || state.payload_bytes + payload_bytes <= self.payload_budget_bytes);
            if room && !conflicts(&state) {
                break;
            }
            state.waiters += 1;
            state = self
                .inflight_changed
                .wait(state)
                .unwrap_or_else(|e| e.into_inner());
            state.waiters -= 1;
        }
        let id = state.next_id;
        state.next_id += 1;
        state.payload_bytes += payload_bytes;
        state.writes += usize::from(is_write);
        state.entries.push(Entry {
            id,
            range,
            is_write,
            payload_bytes,
        });
        assert!(state.entries.len() <= self.max_inflight);
        drop(state);
        // Then the server-wide budget (never while holding the lock above:
        // releases need it). Only this reader waits here.
        self.server_budget
            .acquire(&self.budget_share, payload_bytes);
        Release {
            conn: Arc::clone(self),
            id,
            observed: None,
        }
    }

    fn release(&self, id: u64) {
        let mut state = lock(&self.inflight);
        if let Some(pos) = state.entries.iter().position(|e| e.id == id) {
            let entry = state.entries.swap_remove(pos);
            state.writes -= usize::from(entry.is_write);
            state.payload_bytes -= entry.payload_bytes;
            self.server_budget
                .release(&self.budget_share, entry.payload_bytes);
        }
        let wake = state.waiters > 0;
        drop(state);
        if wake {
            self.inflight_changed.notify_all();
        }
    }

    /// Whether no request is in flight (none read and not yet answered).
    fn is_idle(&self) -> bool {
        lock(&self.inflight).entries.is_empty()
    }

    fn wait_idle(&self) {
        let mut state = lock(&self.inflight);
        while !state.entries.is_empty() {
            state.waiters += 1;
            state = self
                .inflight_changed
                .wait(state)
                .unwrap_or_else(|e| e.into_inner());
            state.waiters -= 1;
        }
    }
}

/// Releases an in-flight slot when dropped (also if a job panics), and
/// tells the observer how long a dispatched request took.
struct Release {
    conn: Arc<Conn>,
    id: u64,
    observed: Option<(CommandKind, Instant)>,
}

impl Drop for Release {
    fn drop(&mut self) {
        self.conn.release(self.id);
        if let (Some((kind, started)), Some(o)) = (self.observed, &self.conn.observer) {
            o.0.request_done(kind, started.elapsed());
        }
    }
}

/// The observer's name for a dispatched command.
fn command_kind(cmd: &Command) -> Option<CommandKind> {
    Some(match cmd {
        Command::Read { .. } => CommandKind::Read,
        Command::Write { .. } => CommandKind::Write,
        Command::Flush => CommandKind::Flush,
        Command::Trim { .. } => CommandKind::Trim,
        Command::WriteZeroes { .. } => CommandKind::WriteZeroes,
        Command::BlockStatus { .. } => CommandKind::BlockStatus,
        Command::Cache { .. } => CommandKind::Cache,
        Command::Disconnect => return None,
    })
}

/// Why a connection's reader stops reading requests (the requests in
/// flight still complete and reply).
#[derive(Debug)]
enum Stop {
    /// End of stream between two requests.
    Eof,
    /// `NBD_CMD_DISC`.
    Disconnect,
    /// The server is shutting down (the request read got `ESHUTDOWN`).
    ShuttingDown,
    /// A request header without the request magic.
    BadMagic(ProtoError),
    /// An invalid WRITE whose payload is too large to read and discard.
    PayloadTooLarge { length_bytes: u64 },
    /// Nothing was sent for the idle timeout while no request was in flight.
    Idle,
    /// Reading a request header failed.
    Io(io::Error),
    /// Reading a request's payload failed.
    IoMidRequest(io::Error),
}

impl Stop {
    /// Logs why: protocol violations as warnings, the rest at debug (a
    /// clean end of stream and shutdown not at all).
    fn log(&self, conn: u64) {
        match self {
            Stop::Eof | Stop::ShuttingDown => {}
            Stop::Disconnect => debug!(conn, "client sent NBD_CMD_DISC"),
            Stop::BadMagic(e) => warn!(error = ?e, "bad request magic, closing connection"),
            Stop::PayloadTooLarge { length_bytes } => warn!(
                conn,
                length_bytes, "WRITE payload too large, closing connection"
            ),
            Stop::Idle => debug!(conn, "connection idle for too long, closing"),
            Stop::Io(e) => debug!(conn, error = %e, "connection read ended"),
            Stop::IoMidRequest(e) => {
                debug!(conn, error = %e, "connection read ended mid-request")
            }
        }
    }
}

/// Runs the transmission phase until DISC, EOF, a protocol violation or
/// shutdown; returns after every in-flight request has replied.
pub(crate) fn serve(
    inner: &Inner,
    socket: &Arc<Socket>,
    reader: &mut impl Input,
    negotiated: Negotiated,
    id: u64,
) {
    let max_request_bytes = inner.config.max_request_bytes;
    let conn = Arc::new(Conn {
        id,
        socket: Arc::clone(socket),
        backend: negotiated.export.backend,
        ctx: TransmissionContext {
            size_bytes: negotiated.size_bytes,
            transmission_flags: negotiated.transmission_flags,
            structured_replies: negotiated.structured_replies,
            base_allocation: !negotiated.meta_contexts.is_empty(),
            max_request_bytes,
        },
        meta_contexts: negotiated.meta_contexts,
        broken: AtomicBool::new(false),
        outbox: Mutex::new(Outbox::default()),
        outbox_changed: Condvar::new(),
        read_cost: ReadCost::default(),
        inflight: Mutex::new(Inflight::default()),
        inflight_changed: Condvar::new(),
        max_inflight: inner.config.max_inflight_per_conn,
        payload_budget_bytes: connection_payload_budget_bytes(&inner.config),
        observer: inner.config.observer.clone(),
        server_budget: Arc::clone(&inner.payload_budget),
        budget_share: BudgetShare::default(),
        send_timeout: inner.config.send_timeout,
        min_reply_bytes_per_sec: inner.config.min_reply_bytes_per_sec,
    });
    let writer_conn = Arc::clone(&conn);
    let writer = std::thread::Builder::new()
        .name(format!("nbd-reply-{id}"))
        .stack_size(REPLY_WRITER_STACK_BYTES)
        .spawn(move || writer_conn.write_replies());
    let writer = match writer {
        Ok(handle) => handle,
        Err(e) => {
            warn!(conn = id, error = %e, "cannot spawn reply writer thread, closing");
            return;
        }
    };
    read_requests(inner, &conn, reader);
    conn.wait_idle();
    conn.close_outbox();
    let _ = writer.join();
}

/// How long a reply of `bytes` may take to send once its sending starts:
/// the send timeout plus its size at the slowest rate allowed.
fn reply_time_allowed(send_timeout: Duration, bytes_per_sec: u64, bytes: usize) -> Duration {
    let at_min_rate = Duration::try_from_secs_f64(bytes as f64 / bytes_per_sec.max(1) as f64)
        .unwrap_or(Duration::MAX);
    send_timeout.saturating_add(at_min_rate)
}

/// Per-connection budget of buffered READ/WRITE payload bytes.
pub(crate) fn connection_payload_budget_bytes(config: &crate::ServerConfig) -> u64 {
    MIN_PAYLOAD_BUDGET_BYTES.max(2 * u64::from(config.max_request_bytes))
}

/// The reader loop: until DISC, EOF, a protocol violation or shutdown.
fn read_requests(inner: &Inner, conn: &Arc<Conn>, reader: &mut impl Input) {
    let discard_cap_bytes = MIN_DISCARD_CAP_BYTES.max(u64::from(conn.ctx.max_request_bytes));
    // Under TLS the session may hold requests a poll of the socket cannot
    // see: the reader does not poll there.
    let mut poll = BusyPoll::new(match conn.socket.is_tls() {
        true => Duration::ZERO,
        false => inner.config.busy_poll,
    });
    let stop = loop {
        if let Err(stop) = next_request(inner, conn, reader, discard_cap_bytes, &mut poll) {
            break stop;
        }
    };
    stop.log(conn.id);
}

/// Reads one request and answers or dispatches it.
fn next_request(
    inner: &Inner,
    conn: &Arc<Conn>,
    reader: &mut impl Input,
    discard_cap_bytes: u64,
    poll: &mut BusyPoll,
) -> Result<(), Stop> {
    let header = next_header(inner, conn, reader, poll)?;
    if inner.is_shutting_down() {
        conn.send_error(
            header.handle,
            proto::NBD_ESHUTDOWN,
            "server is shutting down",
        );
        return Err(Stop::ShuttingDown);
    }
    handle_request(inner, conn, reader, header, discard_cap_bytes)
}

/// Reads the next request header. A reader with nothing in flight and
/// nothing buffered first polls the socket for its connection's window
/// (`busy_poll`), if the gate allows and a polling place is free, and then
/// sleeps in the read as always; the wait adjusts the window.
fn next_header(
    inner: &Inner,
    conn: &Conn,
    reader: &mut impl Input,
    poll: &mut BusyPoll,
) -> Result<RequestHeader, Stop> {
    let idle_limit = inner.config.idle_timeout.is_some();
    if !poll.enabled() || reader.buffered_bytes() > 0 || !conn.is_idle() {
        return read_request_header(conn, reader, idle_limit);
    }
    let started = Instant::now();
    let window = poll.window();
    let gate = &inner.config.busy_poll_gate;
    if !window.is_zero() && gate.as_ref().is_none_or(|g| (g.0)()) {
        if let Some(_place) = inner.pollers.enter(inner.config.busy_poll_threads) {
            let found = conn.socket.busy_wait_input(started + window);
            if let Some(o) = &conn.observer {
                o.0.busy_poll(found, started.elapsed());
            }
        }
    }
    let header = read_request_header(conn, reader, idle_limit);
    poll.adjust(started.elapsed());
    header
}

/// Reads and decodes a request header. With an idle limit (`idle`), the
/// socket's read timeout is that limit: a read that times out ends the
/// connection if no request is in flight, and is retried otherwise.
fn read_request_header(
    conn: &Conn,
    reader: &mut impl Read,
    idle: bool,
) -> Result<RequestHeader, Stop> {
    let mut bytes = [0u8; proto::REQUEST_HEADER_BYTES];
    let mut filled = 0;
    while filled < bytes.len() {
        match reader.read(&mut bytes[filled..]) {
            Ok(0) if filled == 0 => return Err(Stop::Eof),
            Ok(0) => return Err(Stop::Io(io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if idle
                    && matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
            {
                if conn.is_idle() {
                    return Err(Stop::Idle);
                }
            }
            Err(e) => return Err(Stop::Io(e)),
        }
    }
    proto::parse_request_header(&bytes).map_err(Stop::BadMagic)
}

fn handle_request(
    inner: &Inner,
    conn: &Arc<Conn>,
    reader: &mut impl Input,
    header: RequestHeader,
    discard_cap_bytes: u64,
) -> Result<(), Stop> {
    debug!(
        conn = conn.id,
        handle = header.handle,
        command = header.command,
        flags = header.flags,
        offset = header.offset,
        length = header.length,
        "request"
    );
    match proto::validate_request(&header, &conn.ctx) {
        Ok(Command::Disconnect) => Err(Stop::Disconnect),
        Ok(cmd) => dispatch(inner, conn, reader, header.handle, cmd),
        Err(error) => reject(conn, reader, &header, error, discard_cap_bytes),
    }
}

/// Answers an invalid request; a WRITE's payload is consumed first.
fn reject(
    conn: &Arc<Conn>,
    reader: &mut impl Read,
    header: &RequestHeader,
    error: RequestError,
    discard_cap_bytes: u64,
) -> Result<(), Stop> {
    if header.command == proto::NBD_CMD_WRITE {
        let length_bytes = u64::from(header.length);
        if length_bytes > discard_cap_bytes {
            return Err(Stop::PayloadTooLarge { length_bytes });
        }
        discard(reader, length_bytes).map_err(Stop::IoMidRequest)?;
    }
    debug!(
        conn = conn.id,
        handle = header.handle,
        error = error.errno(),
        reason = ?error,
        "request rejected"
    );
    conn.send_error(header.handle, error.errno(), error.message());
    Ok(())
}

fn discard(reader: &mut impl Read, length_bytes: u64) -> io::Result<()> {
    let mut chunk = vec![0u8; DISCARD_CHUNK_BYTES];
    let mut remaining = length_bytes;
    while remaining > 0 {
        let n = remaining.min(DISCARD_CHUNK_BYTES as u64) as usize;
        reader.read_exact(&mut chunk[..n])?;
        remaining -= n as u64;
    }
    Ok(())
}

/// Waits for the ordering rules, reads a WRITE payload and queues the job.
fn dispatch(
    inner: &Inner,
    conn: &Arc<Conn>,
    reader: &mut impl Input,
    handle: u64,
    cmd: Command,
) -> Result<(), Stop> {
    let payload_bytes = match cmd {
        Command::Read { length, .. } | Command::Write { length, .. } => u64::from(length),
        _ => 0,
    };
    let started = Instant::now();
    let mut release = conn.reserve(&cmd, payload_bytes);
    release.observed = command_kind(&cmd).map(|k| (k, started));
    let data = match cmd {
        Command::Write { length, .. } => {
            debug_assert!(length <= conn.ctx.max_request_bytes);
            let mut data = vec![0u8; length as usize];
            // On error `release` frees the slot.
            reader.read_exact(&mut data).map_err(Stop::IoMidRequest)?;
            data
        }
        _ => Vec::new(),
    };
    let lane = match cmd {
        Command::Read { .. } | Command::BlockStatus { .. } => Lane::Read,
        Command::Flush => Lane::Flush,
        _ => Lane::Write,
    };
    if runs_inline(conn, reader, &cmd) {
        let reply = execute(conn, handle, cmd, data);
        conn.send(reply, release);
        return Ok(());
    }
    let job_conn = Arc::clone(conn);
    inner.jobs.submit(
        lane,
        Box::new(move || {
            let reply = execute(&job_conn, handle, cmd, data);
            job_conn.send(reply, release);
        }),
    );
    Ok(())
}

/// Whether `cmd` (in flight, its slot taken) runs here, on the reader
/// thread, rather than on a worker or a flusher:
/// - a small READ, while this connection's reads have been quick (their
///   data in memory: `read_cost`) and none of its writes is in flight,
///   since the hand-off to a worker would cost as much as the read (with
///   writes in flight, the workers compress while the reader, running
///   reads, would leave the next writes unread);
/// - a small READ or WRITE, or a FLUSH, that is the connection's only
///   request in flight, with nothing more from the client buffered or
///   waiting on the socket. A client at queue depth 1 then pays no
///   hand-off and no wake-up (the reader would only wait for the next
///   request, which comes after the reply): a database's commit, a write
///   and then a flush, one at a time, wakes no other thread. A client with
///   more requests coming keeps the workers for its writes and the
///   flushers for its flushes, so the reader goes on reading. (A request
///   that arrives while an inline flush syncs waits for it; with nothing
///   else in flight when the flush came, a client that sends it is one
///   that had just gone idle.)
fn runs_inline(conn: &Conn, reader: &impl Input, cmd: &Command) -> bool {
    let (length, is_read) = match cmd {
        Command::Read { length, .. } => (*length, true),
        Command::Write { length, .. } => (*length, false),
        Command::Flush => (0, false),
        _ => return false,
    };
    if length > INLINE_MAX_BYTES {
        return false;
    }
    // One look at the in-flight table for both rules.
    let (in_flight, writes) = {
        let state = lock(&conn.inflight);
        (state.entries.len(), state.writes)
    };
    (is_read && writes == 0 && conn.read_cost.quick())
        || (in_flight == 1 && reader.buffered_bytes() == 0 && !conn.socket.may_have_input())
}

/// Maps a backend error to the NBD error the spec allows for `cmd`.
fn errno_for(error: BackendError, cmd: &Command) -> u32 {
    match error {
        BackendError::Io => proto::NBD_EIO,
        BackendError::NoSpace => proto::NBD_ENOSPC,
        BackendError::Invalid => proto::NBD_EINVAL,
        BackendError::ReadOnly => proto::NBD_EPERM,
        BackendError::NotSupported => match cmd {
            Command::WriteZeroes {
                fast_zero: true, ..
            } => proto::NBD_ENOTSUP,
            _ => proto::NBD_EINVAL,
        },
        BackendError::Overflow => match cmd {
            Command::Read { df: true, .. } => proto::NBD_EOVERFLOW,
            _ => proto::NBD_EINVAL,
        },
    }
}

/// Runs a backend call, turning a panic into an I/O error.
fn guarded<T>(f: impl FnOnce() -> Result<T, BackendError>) -> Result<T, BackendError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        warn!("backend call panicked");
        Err(BackendError::Io)
    })
}

/// Executes one command and returns the complete reply bytes.
fn execute(conn: &Conn, handle: u64, cmd: Command, data: Vec<u8>) -> Vec<u8> {
    let backend = &*conn.backend;
    let result = match cmd {
        Command::Read { offset, length, .. } => {
            return execute_read(conn, handle, &cmd, offset, length)
        }
        Command::BlockStatus {
            offset,
            length,
            req_one,
        } => return block_status::execute(conn, handle, &cmd, offset, length, req_one),
        Command::Write { offset, fua, .. } if !data.is_empty() => {
            guarded(|| backend.write(offset, &data, fua))
        }
        Command::Flush => guarded(|| backend.flush()),
        Command::Trim {
            offset,
            length,
            fua,
        } if length > 0 => guarded(|| backend.trim(offset, u64::from(length), fua)),
        Command::Cache { offset, length } if length > 0 => {
            guarded(|| backend.cache(offset, u64::from(length)))
        }
        Command::WriteZeroes {
            offset,
            length,
            fua,
            no_hole,
            fast_zero,
        } if length > 0 => {
            let flags = WriteZeroesFlags {
                fua,
                no_hole,
                fast_zero,
            };
            guarded(|| backend.write_zeroes(offset, u64::from(length), flags))
        }
        // Zero-length WRITE/TRIM/CACHE/WRITE_ZEROES succeed without a call.
        _ => Ok(()),
    };
    match result {
        Ok(()) => proto::encode_simple_reply(0, handle).to_vec(),
        Err(e) => error_reply(
            conn,
            handle,
            errno_for(e, &cmd),
            &format!("{cmd:?} failed: {e:?}"),
        ),
    }
}

fn error_reply(conn: &Conn, handle: u64, error: u32, message: &str) -> Vec<u8> {
    debug!(conn = conn.id, handle, error, message, "request failed");
    if conn.ctx.structured_replies {
        proto::encode_error_chunk(handle, error, message)
    } else {
        proto::encode_simple_reply(error, handle).to_vec()
    }
}

/// READ: the data is read straight into the reply buffer after its header.
fn execute_read(conn: &Conn, handle: u64, cmd: &Command, offset: u64, length: u32) -> Vec<u8> {
    let structured = conn.ctx.structured_replies;
    if length == 0 {
        return match structured {
            true => proto::encode_none_chunk(handle).to_vec(),
            false => proto::encode_simple_reply(0, handle).to_vec(),
        };
    }
    let prefix_bytes = match structured {
        true => proto::OFFSET_DATA_PREFIX_BYTES,
        false => proto::SIMPLE_REPLY_HEADER_BYTES,
    };
    let mut reply = vec![0u8; prefix_bytes + length as usize];
    let backend = &*conn.backend;
    let started = Instant::now();
    let read = guarded(|| backend.read(offset, &mut reply[prefix_bytes..]));
    conn.read_cost.add(started.elapsed());
    if let Err(e) = read {
        return error_reply(
            conn,
            handle,
            errno_for(e, cmd),
            &format!("read failed: {e:?}"),
        );
    }
    match structured {
        true => reply[..prefix_bytes]
            .copy_from_slice(&proto::encode_offset_data_prefix(handle, offset, length)),
        false => reply[..prefix_bytes].copy_from_slice(&proto::encode_simple_reply(0, handle)),
    }
    reply
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: u64, range: (u64, u64), is_write: bool) -> Entry {
        Entry {
            id,
            range: Some(range),
            is_write,
            payload_bytes: 0,
        }
    }

    #[test]
    fn overlap_rules() {
        assert!(overlaps((0, 10), (9, 1)));
        assert!(!overlaps((0, 10), (10, 1)));
        assert!(!overlaps((0, 0), (0, 10)));
        assert!(overlaps((u64::MAX - 1, 1), (u64::MAX - 5, 10)));
        let state = Inflight {
            next_id: 2,
            entries: vec![entry(1, (0, 4096), false)],
            payload_bytes: 0,
            writes: 0,
            waiters: 0,
        };
        let read = Command::Read {
            offset: 0,
            length: 10,
            df: false,
        };
        let write = Command::Write {
            offset: 100,
            length: 10,
            fua: false,
        };
        let far_write = Command::Write {
            offset: 8192,
            length: 10,
            fua: false,
        };
        assert!(!state.conflicts(&read));
        assert!(state.conflicts(&write));
        assert!(!state.conflicts(&far_write));
        assert!(!state.conflicts(&Command::Flush));
        let state = Inflight {
            next_id: 2,
            entries: vec![entry(1, (0, 4096), true)],
            payload_bytes: 0,
            writes: 1,
            waiters: 0,
        };
        assert!(state.conflicts(&read));
        assert!(state.conflicts(&Command::Flush));
        assert!(!state.conflicts(&Command::Read {
            offset: 4096,
            length: 1,
            df: false
        }));
    }

    #[test]
    fn errno_mapping_follows_spec() {
        let read = Command::Read {
            offset: 0,
            length: 1,
            df: false,
        };
        let df_read = Command::Read {
            offset: 0,
            length: 1,
            df: true,
        };
        let fast = Command::WriteZeroes {
            offset: 0,
            length: 1,
            fua: false,
            no_hole: false,
            fast_zero: true,
        };
        assert_eq!(errno_for(BackendError::Io, &read), proto::NBD_EIO);
        assert_eq!(errno_for(BackendError::NoSpace, &read), proto::NBD_ENOSPC);
        assert_eq!(errno_for(BackendError::ReadOnly, &read), proto::NBD_EPERM);
        assert_eq!(errno_for(BackendError::Overflow, &read), proto::NBD_EINVAL);
        assert_eq!(
            errno_for(BackendError::Overflow, &df_read),
            proto::NBD_EOVERFLOW
        );
        assert_eq!(
            errno_for(BackendError::NotSupported, &read),
            proto::NBD_EINVAL
        );
        assert_eq!(
            errno_for(BackendError::NotSupported, &fast),
            proto::NBD_ENOTSUP
        );
    }
}
