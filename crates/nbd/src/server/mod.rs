//! The server: accept loops, connection registry, worker pool, shutdown.
//! The handshake and transmission phases live in the submodules.

mod handshake;
mod jobs;
mod socket;
mod transmission;

use std::collections::HashMap;
use std::io::{BufReader, Read};
use std::net::{IpAddr, Shutdown, TcpListener};
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::exports::SingleExport;
use crate::{Backend, Export, Exports, ServerConfig};
pub(crate) use jobs::{JobQueue, Lane};
use socket::{Listener, Socket};

/// How often an accept loop checks for shutdown.
const ACCEPT_POLL_INTERVAL: Duration = Duration::from_millis(100);
/// How long a connection may be in the handshake before a new connection
/// may take its place when every handshake slot is taken.
const HANDSHAKE_EVICTION_AGE: Duration = Duration::from_secs(2);
/// What "never" means for deadlines whose time overflows (about 30 years).
const FAR_FUTURE: Duration = Duration::from_secs(1 << 30);
/// Read buffer of a connection's reader.
const READ_BUFFER_BYTES: usize = 64 * 1024;
/// Smallest accepted `max_request_bytes` (the preferred block size).
const MIN_MAX_REQUEST_BYTES: u32 = 4096;
/// Jobs queued per worker before readers block.
const JOBS_QUEUED_PER_WORKER: usize = 16;

/// Jobs a lane holds before readers block: `JOBS_QUEUED_PER_WORKER` per
/// worker, and at least what `LANE_CONNECTIONS` connections may have in
/// flight (`max_inflight_per_conn` each), so that a server of several
/// exports, each with its client at full queue depth, does not make its
/// readers wait on one another for room (each connection's own limit
/// already holds it back; the payload budget bounds the memory).
fn lane_capacity(config: &ServerConfig) -> usize {
    (config.workers * JOBS_QUEUED_PER_WORKER).max(LANE_CONNECTIONS * config.max_inflight_per_conn)
}

/// Connections at full queue depth a lane has room for (`lane_capacity`).
const LANE_CONNECTIONS: usize = 8;

/// Locks a mutex, ignoring poisoning (state stays consistent: every
/// critical section in this crate is panic-free).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The server-wide budget of READ/WRITE payload bytes held by in-flight
/// requests (WRITE data read from clients, READ replies not yet sent),
/// shared so that no connection can take what another needs to progress:
///
/// * Every connection has a **floor** of `limit / (2 × max_connections)`
///   bytes (512 KiB by default) that is its own: the floors of all
///   connection slots together are set aside, so a connection holding at
///   most its floor never waits for anybody.
/// * What connections hold beyond their floors comes from the **shared**
///   rest of the budget (at least half of it), of which one connection may
///   hold at most half; one request always fits when nobody holds shared
///   bytes.
///
/// So one connection that never reads its replies holds at most its floor
/// plus half the shared part (a quarter of the budget by default); any number of them cannot take the floors
/// of the others. A request waits (its connection's reader waits) until
/// its bytes fit.
pub(crate) struct PayloadBudget {
    floor_bytes: u64,
    shared_bytes: u64,
    max_shared_per_conn_bytes: u64,
    state: Mutex<BudgetState>,
    freed: Condvar,
}

#[derive(Default)]
struct BudgetState {
    used_bytes: u64,
    shared_used_bytes: u64,
    /// Readers waiting for bytes to be freed: a release wakes them only if
    /// there are any (a wake is a syscall, and every reply releases).
    waiters: usize,
}

/// One connection's holding in the [`PayloadBudget`]; changed only under
/// the budget's lock.
#[derive(Default)]
pub(crate) struct BudgetShare {
    held_bytes: AtomicU64,
}

impl PayloadBudget {
    fn new(limit_bytes: u64, max_connections: usize) -> PayloadBudget {
        let slots = (max_connections.max(1) as u64).saturating_mul(2);
        let floor_bytes = limit_bytes / slots;
        let shared_bytes = limit_bytes - floor_bytes * (slots / 2);
        PayloadBudget {
            floor_bytes,
            shared_bytes,
            max_shared_per_conn_bytes: shared_bytes / 2,
            state: Mutex::new(BudgetState::default()),
            freed: Condvar::new(),
        }
    }

    /// Bytes of a holding of `held` that are beyond the floor.
    fn shared_part(&self, held: u64) -> u64 {
        held.saturating_sub(self.floor_bytes)
    }

    /// The shared bytes a connection holding `held` needs to take `bytes`
    /// more, if they are available now.
    fn shared_needed(&self, st: &BudgetState, held: u64, bytes: u64) -> Option<u64> {
        let after = self.shared_part(held + bytes);
        let extra = after - self.shared_part(held);
        let fits = extra == 0
            || st.shared_used_bytes == 0
            || (st.shared_used_bytes + extra <= self.shared_bytes
                && after <= self.max_shared_per_conn_bytes);
        fits.then_some(extra)
    }

    /// Takes `bytes` for the connection of `share`, waiting until they fit.
    pub(crate) fn acquire(&self, share: &BudgetShare, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let mut st = lock(&self.state);
        loop {
            let held = share.held_bytes.load(Ordering::Relaxed);
            if let Some(extra) = self.shared_needed(&st, held, bytes) {
                share.held_bytes.store(held + bytes, Ordering::Relaxed);
                st.shared_used_bytes += extra;
                st.used_bytes += bytes;
                return;
            }
            st.waiters += 1;
            st = self.freed.wait(st).unwrap_or_else(|e| e.into_inner());
            st.waiters -= 1;
        }
    }

    pub(crate) fn release(&self, share: &BudgetShare, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let mut st = lock(&self.state);
        let held = share.held_bytes.load(Ordering::Relaxed);
        let left = held - bytes;
        share.held_bytes.store(left, Ordering::Relaxed);
        st.shared_used_bytes -= self.shared_part(held) - self.shared_part(left);
        st.used_bytes -= bytes;
        let wake = st.waiters > 0;
        drop(st);
        if wake {
            self.freed.notify_all();
        }
    }

    fn used(&self) -> u64 {
        lock(&self.state).used_bytes
    }
}

/// Connections currently registered, for counting, the per-address and
/// handshake limits, and shutdown.
struct Registry {
    next_id: u64,
    slots: HashMap<u64, Slot>,
    /// Connections still in the handshake.
    handshaking: usize,
    /// Connections per TCP peer address.
    per_address: HashMap<IpAddr, usize>,
    stopped: bool,
}

struct Slot {
    socket: Arc<Socket>,
    /// The TCP peer address, counted in `per_address`.
    address: Option<IpAddr>,
    handshaking: bool,
    /// When the connection was accepted.
    since: Instant,
}

/// With every handshake slot taken, a new connection closes the oldest
/// connection still in the handshake if that has been at it for at least
/// [`HANDSHAKE_EVICTION_AGE`], and takes its slot: clients that open
/// connections and never finish the handshake then keep new clients out
/// only by opening `max_handshaking` connections per that time, not one
/// per handshake timeout. Returns whether a slot was freed.
fn evict_stale_handshake(reg: &mut Registry) -> bool {
    let oldest = reg
        .slots
        .values_mut()
        .filter(|slot| slot.handshaking && slot.since.elapsed() >= HANDSHAKE_EVICTION_AGE)
        .min_by_key(|slot| slot.since);
    let Some(slot) = oldest else {
        return false;
    };
    // Its thread sees the socket fail and unregisters; the slot is free now.
    slot.handshaking = false;
    slot.socket.shutdown(Shutdown::Both);
    reg.handshaking -= 1;
    true
}

/// Why a new connection was closed at once.
#[derive(Debug, Clone, Copy)]
enum Refusal {
    Total,
    Handshaking,
    PerAddress,
}

pub(crate) struct Inner {
    /// Looked up by name during each handshake.
    pub(crate) exports: Arc<dyn Exports>,
    pub(crate) config: ServerConfig,
    pub(crate) jobs: JobQueue,
    pub(crate) payload_budget: Arc<PayloadBudget>,
    /// Readers busy-polling their socket now (`ServerConfig::busy_poll`).
    pub(crate) pollers: transmission::Pollers,
    /// Connections closed at once because of `max_connections`.
    refused: AtomicU64,
    /// TCP connections closed at once because their peer is not allowed.
    disallowed: AtomicU64,
    shutting_down: AtomicBool,
    registry: Mutex<Registry>,
    registry_changed: Condvar,
    listeners: Mutex<Vec<JoinHandle<()>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    flushers: Mutex<Vec<JoinHandle<()>>>,
}

impl Inner {
    pub(crate) fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Acquire)
    }

    fn register(&self, socket: &Arc<Socket>) -> Option<u64> {
        // Unix-socket clients are exempt from the per-address cap (the
        // socket file's permissions decide who connects at all).
        let address = socket.peer_ip().and_then(Result::ok);
        let mut reg = lock(&self.registry);
        if reg.stopped {
            return None;
        }
        let config = &self.config;
        let refusal = if reg.slots.len() >= config.max_connections {
            Some(Refusal::Total)
        } else if reg.handshaking >= config.max_handshaking && !evict_stale_handshake(&mut reg) {
            Some(Refusal::Handshaking)
        } else if address.is_some_and(|a| {
            reg.per_address.get(&a).copied().unwrap_or(0) >= config.max_connections_per_address
        }) {
            Some(Refusal::PerAddress)
        } else {
            None
        };
        if let Some(refusal) = refusal {
            drop(reg);
            self.refuse(refusal, address);
            return None;
        }
        let id = reg.next_id;
        reg.next_id += 1;
        reg.slots.insert(
            id,
            Slot {
                socket: Arc::clone(socket),
                address,
                handshaking: true,
                since: Instant::now(),
            },
        );
        reg.handshaking += 1;
        if let Some(a) = address {
            *reg.per_address.entry(a).or_insert(0) += 1;
        }
        if let Some(o) = &config.observer {
            o.0.connections(reg.slots.len());
        }
        Some(id)
    }

    /// Counts and logs (sparsely: a flood of connections must not flood
    /// the log) a connection closed at once.
    fn refuse(&self, refusal: Refusal, address: Option<IpAddr>) {
        let refused = self.refused.fetch_add(1, Ordering::Relaxed) + 1;
        if !(refused.is_power_of_two() || refused.is_multiple_of(1000)) {
            return;
        }
        let config = &self.config;
        match refusal {
            Refusal::Total => warn!(
                limit = config.max_connections,
                refused_total = refused,
                "connection limit reached, closing new connections"
            ),
            Refusal::Handshaking => warn!(
                limit = config.max_handshaking,
                refused_total = refused,
                "too many connections in the handshake, closing new connections"
            ),
            Refusal::PerAddress => warn!(
                peer = %address.map_or_else(String::new, |a| a.to_string()),
                limit = config.max_connections_per_address,
                refused_total = refused,
                "connection limit per address reached, closing its new connections"
            ),
        }
    }

    /// The connection finished its handshake: its handshake slot is free.
    fn established(&self, id: u64) {
        let mut reg = lock(&self.registry);
        let was_handshaking = reg
            .slots
            .get_mut(&id)
            .map(|slot| std::mem::replace(&mut slot.handshaking, false));
        if was_handshaking == Some(true) {
            reg.handshaking -= 1;
        }
    }

    fn unregister(&self, id: u64) {
        let mut reg = lock(&self.registry);
        if let Some(slot) = reg.slots.remove(&id) {
            if slot.handshaking {
                reg.handshaking -= 1;
            }
            if let Some(a) = slot.address {
                if let Some(n) = reg.per_address.get_mut(&a) {
                    *n -= 1;
                    if *n == 0 {
                        reg.per_address.remove(&a);
                    }
                }
            }
        }
        if let Some(o) = &self.config.observer {
            o.0.connections(reg.slots.len());
        }
        self.registry_changed.notify_all();
    }

    /// Whether `socket`'s peer may connect (`ServerConfig::allow`).
    fn allowed(&self, socket: &Socket) -> bool {
        let (Some(allow), Some(peer)) = (&self.config.allow, socket.peer_ip()) else {
            return true;
        };
        let permitted = peer
            .as_ref()
            .is_ok_and(|ip| allow.iter().any(|net| net.contains(ip)));
        if !permitted {
            let n = self.disallowed.fetch_add(1, Ordering::Relaxed) + 1;
            // Logged sparsely: a scan must not flood the log.
            if n.is_power_of_two() || n.is_multiple_of(1000) {
                match &peer {
                    Ok(ip) => {
                        warn!(peer = %ip, refused_total = n, "connection from outside the allowed networks closed")
                    }
                    Err(e) => {
                        warn!(error = %e, refused_total = n, "connection without a peer address closed")
                    }
                }
            }
        }
        permitted
    }

    fn start_connection(self: &Arc<Self>, socket: Socket) {
        if !self.allowed(&socket) {
            return;
        }
        if let Err(e) = socket.configure(self.config.send_timeout) {
            debug!(error = %e, "cannot configure accepted socket");
            return;
        }
        let socket = Arc::new(socket);
        let Some(id) = self.register(&socket) else {
            return;
        };
        let inner = Arc::clone(self);
        let thread_socket = Arc::clone(&socket);
        let spawned = std::thread::Builder::new()
            .name(format!("nbd-conn-{id}"))
            .spawn(move || {
                let _guard = Unregister { inner: &inner, id };
                run_connection(&inner, &thread_socket, id);
            });
        if let Err(e) = spawned {
            warn!(error = %e, "cannot spawn connection thread");
            self.unregister(id);
        }
    }
}

/// Removes a connection from the registry when its thread ends (even by panic).
struct Unregister<'a> {
    inner: &'a Arc<Inner>,
    id: u64,
}

impl Drop for Unregister<'_> {
    fn drop(&mut self) {
        self.inner.unregister(self.id);
    }
}

/// Reads from the shared socket; owned by the connection's BufReader.
/// With a deadline (the handshake), every read waits at most until then,
/// so a client trickling bytes cannot hold a connection slot forever.
pub(crate) struct SocketReader {
    socket: Arc<Socket>,
    deadline: Option<Instant>,
}

impl Read for SocketReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if let Some(deadline) = self.deadline {
            let left = remaining(deadline)?;
            self.socket.set_read_timeout(Some(left))?;
        }
        (&*self.socket).read(buf)
    }
}

/// `timeout` from now, or very far in the future if that overflows.
pub(crate) fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(FAR_FUTURE))
        .unwrap_or(now)
}

/// Time left until `deadline`, or `TimedOut` once it has passed.
pub(crate) fn remaining(deadline: Instant) -> std::io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "deadline passed",
        ));
    }
    Ok(left)
}

fn run_connection(inner: &Arc<Inner>, socket: &Arc<Socket>, id: u64) {
    let peer = socket.peer();
    debug!(conn = id, %peer, "client connected");
    let deadline = deadline_after(inner.config.handshake_timeout);
    let mut reader = BufReader::with_capacity(
        READ_BUFFER_BYTES,
        SocketReader {
            socket: Arc::clone(socket),
            deadline: Some(deadline),
        },
    );
    match handshake::negotiate(inner, socket, &mut reader, id, deadline) {
        Ok(negotiated) => {
            inner.established(id);
            reader.get_mut().deadline = None;
            // With an idle limit, reads wake up to check for idleness.
            let restored = socket
                .set_read_timeout(inner.config.idle_timeout)
                .and_then(|()| socket.set_write_timeout(Some(inner.config.send_timeout)));
            match restored {
                Ok(()) => transmission::serve(inner, socket, &mut reader, negotiated, id),
                Err(e) => debug!(conn = id, error = %e, "cannot reset socket timeouts"),
            }
        }
        Err(e) => e.log(id),
    }
    socket.close_tls();
    socket.shutdown(Shutdown::Both);
    debug!(conn = id, %peer, "client disconnected");
}

fn accept_loop(inner: Arc<Inner>, listener: Listener) {
    while !inner.is_shutting_down() {
        match listener.poll_readable(ACCEPT_POLL_INTERVAL) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => {
                warn!(error = %e, "poll on listener failed");
                std::thread::sleep(ACCEPT_POLL_INTERVAL);
                continue;
            }
        }
        match listener.accept() {
            Ok(socket) => inner.start_connection(socket),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) => {}
            Err(e) => {
                // E.g. EMFILE: back off instead of spinning.
                warn!(error = %e, "accept failed");
                std::thread::sleep(ACCEPT_POLL_INTERVAL);
            }
        }
    }
    debug!("accept loop stopped");
}

/// An NBD server serving one export from a [`Backend`], or a set of
/// [`Exports`] chosen by name.
pub struct Server {
    inner: Arc<Inner>,
}

impl Server {
    /// Creates a server of one export, `backend` under
    /// `config.export_name` (and under "", the default export), described
    /// by `config.description`, and starts its worker pool. No socket is
    /// opened.
    pub fn new(backend: Arc<dyn Backend>, config: ServerConfig) -> Server {
        let export = Export {
            name: config.export_name.clone(),
            description: config.description.clone(),
            backend,
        };
        Server::with_exports(Arc::new(SingleExport(export)), config)
    }

    /// Creates a server of the exports of `exports`, looked up by name
    /// during each handshake (so exports added or removed later are seen by
    /// later connections), and starts its worker pool. `config.export_name`
    /// and `config.description` are not used; every other setting (the
    /// workers, the payload and connection limits) is shared by all
    /// exports. No socket is opened.
    pub fn with_exports(exports: Arc<dyn Exports>, config: ServerConfig) -> Server {
        let config = normalize_config(config);
        let jobs = JobQueue::new(lane_capacity(&config));
        let workers = (0..config.workers)
            .map(|i| {
                let jobs = jobs.clone();
                std::thread::Builder::new()
                    .name(format!("nbd-worker-{i}"))
                    .spawn(move || jobs.worker_loop())
                    .expect("spawn NBD worker thread")
            })
            .collect();
        let flushers = (0..config.workers)
            .map(|i| {
                let jobs = jobs.clone();
                std::thread::Builder::new()
                    .name(format!("nbd-flusher-{i}"))
                    .spawn(move || jobs.flusher_loop())
                    .expect("spawn NBD flusher thread")
            })
            .collect();
        let payload_budget = Arc::new(PayloadBudget::new(
            config.max_buffered_bytes,
            config.max_connections,
        ));
        let inner = Inner {
            exports,
            config,
            jobs,
            payload_budget,
            pollers: transmission::Pollers::default(),
            refused: AtomicU64::new(0),
            disallowed: AtomicU64::new(0),
            shutting_down: AtomicBool::new(false),
            registry: Mutex::new(Registry {
                next_id: 1,
                slots: HashMap::new(),
                handshaking: 0,
                per_address: HashMap::new(),
                stopped: false,
            }),
            registry_changed: Condvar::new(),
            listeners: Mutex::new(Vec::new()),
            workers: Mutex::new(workers),
            flushers: Mutex::new(flushers),
        };
        Server {
            inner: Arc::new(inner),
        }
    }

    /// Serve on an already-bound listener in a background thread; returns at once.
    pub fn serve_tcp(&self, listener: TcpListener) -> std::io::Result<()> {
        self.serve(Listener::Tcp(listener))
    }

    /// Serve on an already-bound Unix listener in a background thread; returns at once.
    pub fn serve_unix(&self, listener: UnixListener) -> std::io::Result<()> {
        self.serve(Listener::Unix(listener))
    }

    fn serve(&self, listener: Listener) -> std::io::Result<()> {
        if self.inner.is_shutting_down() {
            return Err(std::io::Error::other("NBD server is shut down"));
        }
        listener.set_nonblocking()?;
        let inner = Arc::clone(&self.inner);
        let handle = std::thread::Builder::new()
            .name("nbd-accept".into())
            .spawn(move || accept_loop(inner, listener))?;
        lock(&self.inner.listeners).push(handle);
        Ok(())
    }

    /// Graceful stop: stop accepting new connections, stop reading new
    /// requests, wait for all in-flight requests to finish and their replies
    /// to be sent, close connections. After it returns, no backend call is
    /// running or will start. Idempotent.
    pub fn shutdown(&self) {
        let inner = &self.inner;
        // Also called by Drop after an explicit shutdown: report it once.
        let first = !inner.shutting_down.swap(true, Ordering::AcqRel);
        {
            let mut reg = lock(&inner.registry);
            reg.stopped = true;
            for slot in reg.slots.values() {
                // Wakes readers blocked in read(); replies can still be sent.
                slot.socket.shutdown(Shutdown::Read);
            }
        }
        let listeners: Vec<_> = lock(&inner.listeners).drain(..).collect();
        for handle in listeners {
            let _ = handle.join();
        }
        let mut reg = lock(&inner.registry);
        while !reg.slots.is_empty() {
            reg = inner
                .registry_changed
                .wait(reg)
                .unwrap_or_else(|e| e.into_inner());
        }
        drop(reg);
        let workers: Vec<_> = lock(&inner.workers).drain(..).collect();
        inner.jobs.stop_workers();
        for handle in workers {
            let _ = handle.join();
        }
        let flushers: Vec<_> = lock(&inner.flushers).drain(..).collect();
        inner.jobs.stop_flushers();
        for handle in flushers {
            let _ = handle.join();
        }
        if first {
            info!("NBD server stopped");
        }
    }

    /// Number of open client connections (handshake or transmission).
    pub fn connection_count(&self) -> usize {
        lock(&self.inner.registry).slots.len()
    }

    /// Connections closed at once because `max_connections` were open.
    pub fn refused_connection_count(&self) -> u64 {
        self.inner.refused.load(Ordering::Relaxed)
    }

    /// TCP connections closed at once because their peer was outside
    /// `ServerConfig::allow`.
    pub fn disallowed_connection_count(&self) -> u64 {
        self.inner.disallowed.load(Ordering::Relaxed)
    }

    /// READ/WRITE payload bytes held by in-flight requests right now
    /// (server-wide; at most `max_buffered_bytes`, or one request).
    pub fn buffered_payload_bytes(&self) -> u64 {
        self.inner.payload_budget.used()
    }

    /// [`Server::buffered_payload_bytes`] as a function that outlives
    /// the borrow of the server (for a volume's `stat`).
    pub fn buffered_payload_gauge(&self) -> impl Fn() -> u64 + Send + Sync + 'static {
        let budget = self.inner.payload_budget.clone();
        move || budget.used()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn normalize_config(mut config: ServerConfig) -> ServerConfig {
    if config.max_request_bytes < MIN_MAX_REQUEST_BYTES {
        warn!(
            requested = config.max_request_bytes,
            "max_request_bytes raised to 4096"
        );
        config.max_request_bytes = MIN_MAX_REQUEST_BYTES;
    }
    config.workers = config.workers.max(1);
    config.max_inflight_per_conn = config.max_inflight_per_conn.max(1);
    config.max_connections = config.max_connections.max(1);
    config.max_handshaking = config.max_handshaking.clamp(1, config.max_connections);
    config.max_connections_per_address = config.max_connections_per_address.max(1);
    if config.send_timeout.is_zero() {
        config.send_timeout = Duration::from_secs(1);
    }
    config.idle_timeout = config.idle_timeout.filter(|t| !t.is_zero());
    // One request of each kind must always fit.
    config.max_buffered_bytes = config
        .max_buffered_bytes
        .max(u64::from(config.max_request_bytes));
    if config.handshake_timeout.is_zero() {
        config.handshake_timeout = Duration::from_secs(1);
    }
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    impl PayloadBudget {
        /// `acquire` without waiting: whether the bytes were taken.
        fn try_acquire(&self, share: &BudgetShare, bytes: u64) -> bool {
            let mut st = lock(&self.state);
            let held = share.held_bytes.load(Ordering::Relaxed);
            let Some(extra) = self.shared_needed(&st, held, bytes) else {
                return false;
            };
            share.held_bytes.store(held + bytes, Ordering::Relaxed);
            st.shared_used_bytes += extra;
            st.used_bytes += bytes;
            true
        }
    }

    const MIB: u64 = 1024 * 1024;

    /// Takes `chunk` bytes for `share` until the budget refuses; the total.
    fn fill(budget: &PayloadBudget, share: &BudgetShare, chunk: u64) -> u64 {
        let mut taken = 0;
        while budget.try_acquire(share, chunk) {
            taken += chunk;
        }
        taken
    }

    #[test]
    fn connections_that_hold_their_replies_leave_every_floor_free() {
        // 64 MiB for 64 connections: 512 KiB floors, 32 MiB shared.
        let budget = PayloadBudget::new(64 * MIB, 64);
        assert_eq!(
            (budget.floor_bytes, budget.shared_bytes),
            (MIB / 2, 32 * MIB)
        );
        let stuck: Vec<BudgetShare> = (0..10).map(|_| BudgetShare::default()).collect();
        // One connection: at most its floor and half the shared part.
        assert_eq!(fill(&budget, &stuck[0], MIB / 4), MIB / 2 + 16 * MIB);
        // The others together: the rest of the shared part, and their floors.
        let rest: u64 = stuck[1..].iter().map(|s| fill(&budget, s, MIB / 4)).sum();
        assert_eq!(rest, 16 * MIB + 9 * MIB / 2);
        assert!(budget.used() <= 64 * MIB);
        // A newcomer still has its floor, in small requests or one.
        let good = BudgetShare::default();
        assert!(budget.try_acquire(&good, 4096));
        assert!(budget.try_acquire(&good, MIB / 2 - 4096));
        assert!(!budget.try_acquire(&good, 4096), "beyond its floor");
        budget.release(&good, MIB / 2);
        assert!(
            !budget.try_acquire(&good, MIB),
            "a request beyond the floor waits"
        );
        // Once a stuck connection lets go, shared bytes are there again.
        budget.release(&stuck[0], 8 * MIB);
        assert!(budget.try_acquire(&good, MIB));
        budget.release(&good, MIB);
        for s in &stuck {
            let held = s.held_bytes.load(Ordering::Relaxed);
            budget.release(s, held);
        }
        assert_eq!(budget.used(), 0);
        assert_eq!(lock(&budget.state).shared_used_bytes, 0);
    }

    #[test]
    fn one_request_fits_while_nobody_holds_shared_bytes() {
        // A budget of one request (the smallest allowed) for 256 slots.
        let budget = PayloadBudget::new(32 * MIB, 256);
        let share = BudgetShare::default();
        assert!(budget.try_acquire(&share, 32 * MIB));
        let other = BudgetShare::default();
        assert!(!budget.try_acquire(&other, MIB));
        assert!(budget.try_acquire(&other, budget.floor_bytes));
        budget.release(&share, 32 * MIB);
        assert!(budget.try_acquire(&other, 16 * MIB));
    }
}
