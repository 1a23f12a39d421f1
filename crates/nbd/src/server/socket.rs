//! A connected stream socket (TCP or Unix) shared by a connection's reader,
//! its reply writers and the server's registry (for shutdown); after
//! `NBD_OPT_STARTTLS` everything sent and received goes through a TLS
//! session (rustls) on it.
//!
//! TLS keeps the connection's threading: the reader alone reads, and
//! replies go out from whichever worker or writer thread holds the
//! connection's outbox (transmission's rule). The session's state sits
//! behind a mutex held only to encrypt or decrypt, never across socket
//! I/O. Ciphertext that a non-blocking send did not get onto the wire
//! waits in the session's outgoing buffer, whose lock orders every
//! sender's records (lock order: outgoing, then the session); the next
//! send, blocking or not, pushes it out first.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::lock;

/// Plaintext encrypted per step of a send: bounds the ciphertext held in
/// memory when the socket does not take it at once.
const TLS_SEND_CHUNK_BYTES: usize = 256 * 1024;
/// Ciphertext read from the socket per `read(2)` under TLS.
const TLS_READ_BUFFER_BYTES: usize = 64 * 1024;
/// How long a closing connection waits to send its TLS close_notify.
const TLS_CLOSE_TIMEOUT: Duration = Duration::from_secs(1);

pub(crate) enum Raw {
    Tcp(TcpStream),
    Unix(UnixStream),
}

pub(crate) struct Socket {
    raw: Raw,
    tls: OnceLock<TlsSession>,
    /// While a reply is sent by [`Socket::send_all_by`]: its deadline and
    /// the longest a single send may block.
    send_deadline: Mutex<Option<(Instant, Duration)>>,
}

/// A TLS session on a socket, started by `NBD_OPT_STARTTLS`.
struct TlsSession {
    conn: Mutex<rustls::ServerConnection>,
    out: Mutex<Outgoing>,
    /// Ciphertext read but not yet given to rustls (the reader's only).
    incoming: Mutex<Incoming>,
}

/// Encrypted bytes not yet sent: `buf[pos..]`.
#[derive(Default)]
struct Outgoing {
    buf: Vec<u8>,
    pos: usize,
}

impl Outgoing {
    fn pending(&self) -> &[u8] {
        &self.buf[self.pos..]
    }

    fn is_empty(&self) -> bool {
        self.pos == self.buf.len()
    }

    fn advance(&mut self, n: usize) {
        self.pos += n;
        if self.is_empty() {
            self.buf.clear();
            self.pos = 0;
        }
    }
}

/// Ciphertext read from the socket: `buf[pos..len]` not yet fed.
struct Incoming {
    buf: Box<[u8]>,
    pos: usize,
    len: usize,
}

/// What one step of feeding the TLS session did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fed {
    Bytes,
    /// The peer closed its side (the session has been told).
    Eof,
}

/// Moves the session's pending records (encrypted data, handshake
/// messages, alerts) onto the end of `out`.
fn drain(conn: &mut rustls::ServerConnection, out: &mut Outgoing) -> io::Result<()> {
    while conn.wants_write() {
        conn.write_tls(&mut out.buf)?;
    }
    Ok(())
}

/// A TLS error as an I/O error (`InvalidData`), naming TLS.
fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {e}"))
}

impl Socket {
    pub(crate) fn new(raw: Raw) -> Socket {
        Socket {
            raw,
            tls: OnceLock::new(),
            send_deadline: Mutex::new(None),
        }
    }

    fn fd(&self) -> RawFd {
        match &self.raw {
            Raw::Tcp(s) => s.as_raw_fd(),
            Raw::Unix(s) => s.as_raw_fd(),
        }
    }

    /// Human-readable peer description for logs.
    pub(crate) fn peer(&self) -> String {
        match &self.raw {
            Raw::Tcp(s) => s
                .peer_addr()
                .map_or_else(|_| "tcp:?".into(), |a| format!("tcp:{a}")),
            Raw::Unix(_) => "unix".into(),
        }
    }

    /// The peer's IP address (IPv4-mapped IPv6 addresses as IPv4); `None`
    /// for Unix sockets.
    pub(crate) fn peer_ip(&self) -> Option<io::Result<IpAddr>> {
        match &self.raw {
            Raw::Tcp(s) => Some(s.peer_addr().map(|a| a.ip().to_canonical())),
            Raw::Unix(_) => None,
        }
    }

    /// Whether the client has sent bytes the server has not read yet, as
    /// far as a poll without waiting tells: true under TLS (the session
    /// may hold plaintext the poll cannot see) and when the poll fails.
    pub(crate) fn may_have_input(&self) -> bool {
        if self.is_tls() {
            return true;
        }
        let mut pfd = libc::pollfd {
            fd: self.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is a valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, 0) };
        n != 0
    }

    /// Watches the socket without sleeping, yielding the core between
    /// looks, until the client has sent bytes (or closed, or the look
    /// failed: the read that follows tells) or `until` has passed; returns
    /// whether input came. Never under TLS (the caller's rule): there the
    /// answer is always yes at once.
    pub(crate) fn busy_wait_input(&self, until: Instant) -> bool {
        loop {
            if self.may_have_input() {
                return true;
            }
            if Instant::now() >= until {
                return false;
            }
            std::thread::yield_now();
        }
    }

    /// Whether TLS has been started on this connection.
    pub(crate) fn is_tls(&self) -> bool {
        self.tls.get().is_some()
    }

    /// Blocking mode, TCP_NODELAY, and a send timeout so that a client that
    /// stops reading replies cannot block a worker forever.
    pub(crate) fn configure(&self, write_timeout: Duration) -> io::Result<()> {
        match &self.raw {
            Raw::Tcp(s) => {
                s.set_nonblocking(false)?;
                s.set_nodelay(true)?;
                s.set_write_timeout(Some(write_timeout))
            }
            Raw::Unix(s) => {
                s.set_nonblocking(false)?;
                s.set_write_timeout(Some(write_timeout))
            }
        }
    }

    pub(crate) fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match &self.raw {
            Raw::Tcp(s) => s.set_read_timeout(timeout),
            Raw::Unix(s) => s.set_read_timeout(timeout),
        }
    }

    /// Shuts down one or both directions; errors (already closed) are ignored.
    pub(crate) fn shutdown(&self, how: Shutdown) {
        let _ = match &self.raw {
            Raw::Tcp(s) => s.shutdown(how),
            Raw::Unix(s) => s.shutdown(how),
        };
    }

    pub(crate) fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match &self.raw {
            Raw::Tcp(s) => s.set_write_timeout(timeout),
            Raw::Unix(s) => s.set_write_timeout(timeout),
        }
    }

    /// Starts TLS (after `NBD_OPT_STARTTLS` was acknowledged): from now
    /// on every send and read goes through the session. `early` is what
    /// the client sent after the option and was already read (the start
    /// of its ClientHello, if it did not wait for the acknowledgement).
    pub(crate) fn start_tls(
        &self,
        config: Arc<rustls::ServerConfig>,
        early: &[u8],
    ) -> io::Result<()> {
        let mut conn = rustls::ServerConnection::new(config).map_err(tls_error)?;
        // Replies are bounded by the server's payload budget; the session
        // never refuses plaintext (`send_*` encrypt in chunks anyway).
        conn.set_buffer_limit(None);
        let mut buf = vec![0u8; TLS_READ_BUFFER_BYTES.max(early.len())].into_boxed_slice();
        buf[..early.len()].copy_from_slice(early);
        let session = TlsSession {
            conn: Mutex::new(conn),
            out: Mutex::new(Outgoing::default()),
            incoming: Mutex::new(Incoming {
                buf,
                pos: 0,
                len: early.len(),
            }),
        };
        self.tls
            .set(session)
            .map_err(|_| io::Error::other("TLS already started"))
    }

    /// Runs the TLS handshake to its end; reads wait at most until
    /// `deadline`. An error says why it failed (a TLS alert has been sent).
    pub(crate) fn finish_tls_handshake(&self, deadline: std::time::Instant) -> io::Result<()> {
        let tls = self.tls.get().ok_or_else(|| io::Error::other("no TLS"))?;
        let mut incoming = lock(&tls.incoming);
        while lock(&tls.conn).is_handshaking() {
            self.set_read_timeout(Some(super::remaining(deadline)?))?;
            if self.tls_feed(tls, &mut incoming)? == Fed::Eof {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the client closed the connection during the TLS handshake",
                ));
            }
        }
        // The last flight (e.g. TLS 1.3 session tickets).
        let mut out = lock(&tls.out);
        self.tls_drain(tls, &mut out)?;
        self.raw_flush(&mut out)
    }

    /// Sends a TLS close_notify, waiting briefly; errors are ignored (the
    /// connection is closing anyway).
    pub(crate) fn close_tls(&self) {
        let Some(tls) = self.tls.get() else {
            return;
        };
        let _ = self.set_write_timeout(Some(TLS_CLOSE_TIMEOUT));
        let mut out = lock(&tls.out);
        lock(&tls.conn).send_close_notify();
        if self.tls_drain(tls, &mut out).is_ok() {
            let _ = self.raw_flush(&mut out);
        }
    }

    /// Writes all of `bytes` (plaintext under TLS, after any ciphertext a
    /// non-blocking send left), blocking up to the socket's send timeout
    /// per call.
    pub(crate) fn send_all(&self, bytes: &[u8]) -> io::Result<()> {
        let Some(tls) = self.tls.get() else {
            return self.raw_send_all(bytes);
        };
        let mut out = lock(&tls.out);
        self.raw_flush(&mut out)?;
        for chunk in bytes.chunks(TLS_SEND_CHUNK_BYTES) {
            self.tls_encrypt(tls, chunk, &mut out)?;
            self.raw_flush(&mut out)?;
        }
        Ok(())
    }

    /// [`Socket::send_all`] that also gives up (`TimedOut`) once `deadline`
    /// has passed, however slowly the client keeps reading; each send
    /// blocks at most `timeout`.
    pub(crate) fn send_all_by(
        &self,
        bytes: &[u8],
        deadline: Instant,
        timeout: Duration,
    ) -> io::Result<()> {
        *lock(&self.send_deadline) = Some((deadline, timeout));
        let result = self.send_all(bytes);
        *lock(&self.send_deadline) = None;
        // Other blocking sends (TLS records the reader answers) get the
        // whole timeout again, not what this deadline left.
        result.and_then(|()| self.set_write_timeout(Some(timeout)))
    }

    /// Writes as much of `bytes` as the socket takes without blocking and
    /// returns how much that was (`WouldBlock` is not an error here).
    /// Under TLS the count is of plaintext taken: its ciphertext may still
    /// be partly in the session ([`Socket::has_unsent`]) for the next send.
    pub(crate) fn send_nonblocking(&self, bytes: &[u8]) -> io::Result<usize> {
        let Some(tls) = self.tls.get() else {
            return self.raw_send_nonblocking(bytes);
        };
        let mut out = lock(&tls.out);
        let mut taken = 0;
        loop {
            let sent = self.raw_send_nonblocking(out.pending())?;
            out.advance(sent);
            if !out.is_empty() || taken == bytes.len() {
                return Ok(taken);
            }
            let chunk = &bytes[taken..(taken + TLS_SEND_CHUNK_BYTES).min(bytes.len())];
            self.tls_encrypt(tls, chunk, &mut out)?;
            taken += chunk.len();
        }
    }

    /// Whether ciphertext of data already taken waits to be sent (a
    /// `send_all`, even of nothing, sends it).
    pub(crate) fn has_unsent(&self) -> bool {
        self.tls.get().is_some_and(|tls| !lock(&tls.out).is_empty())
    }

    /// Encrypts `plaintext` onto the end of `out`.
    fn tls_encrypt(
        &self,
        tls: &TlsSession,
        plaintext: &[u8],
        out: &mut Outgoing,
    ) -> io::Result<()> {
        let mut conn = lock(&tls.conn);
        conn.writer().write_all(plaintext)?;
        drain(&mut conn, out)
    }

    /// Moves what the session wants to send (handshake, alerts) to `out`.
    fn tls_drain(&self, tls: &TlsSession, out: &mut Outgoing) -> io::Result<()> {
        drain(&mut lock(&tls.conn), out)
    }

    /// Sends all of `out`, blocking.
    fn raw_flush(&self, out: &mut Outgoing) -> io::Result<()> {
        if !out.is_empty() {
            self.raw_send_all(out.pending())?;
            out.advance(out.pending().len());
        }
        Ok(())
    }

    /// Gives the session the next ciphertext (reading the socket if none
    /// is buffered) and sends what it answers (handshake messages, alerts).
    fn tls_feed(&self, tls: &TlsSession, incoming: &mut Incoming) -> io::Result<Fed> {
        if incoming.pos == incoming.len {
            let n = self.raw_read(&mut incoming.buf)?;
            incoming.pos = 0;
            incoming.len = n;
        }
        let mut conn = lock(&tls.conn);
        let fed = if incoming.len == 0 {
            conn.read_tls(&mut io::empty())?;
            Fed::Eof
        } else {
            let n = conn.read_tls(&mut &incoming.buf[incoming.pos..incoming.len])?;
            incoming.pos += n;
            Fed::Bytes
        };
        let state = conn.process_new_packets();
        let wants_write = conn.wants_write();
        drop(conn);
        if wants_write {
            let mut out = lock(&tls.out);
            self.tls_drain(tls, &mut out)?;
            let flushed = self.raw_flush(&mut out);
            if state.is_ok() {
                flushed?;
            }
        }
        state.map_err(tls_error)?;
        Ok(fed)
    }

    /// Plaintext from the TLS session, reading ciphertext as needed.
    fn tls_read(&self, tls: &TlsSession, buf: &mut [u8]) -> io::Result<usize> {
        let mut incoming = lock(&tls.incoming);
        loop {
            match lock(&tls.conn).reader().read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            if self.tls_feed(tls, &mut incoming)? == Fed::Eof {
                // No close_notify: the session reports the truncation.
                return match lock(&tls.conn).reader().read(buf) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
                    other => other,
                };
            }
        }
    }

    fn raw_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match &self.raw {
            Raw::Tcp(s) => (&*s).read(buf),
            Raw::Unix(s) => (&*s).read(buf),
        }
    }

    fn raw_send_all(&self, bytes: &[u8]) -> io::Result<()> {
        let deadline = *lock(&self.send_deadline);
        let mut sent = 0;
        while sent < bytes.len() {
            if let Some((deadline, timeout)) = deadline {
                let left = super::remaining(deadline).map_err(|_| {
                    io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client read the reply too slowly",
                    )
                })?;
                self.set_write_timeout(Some(left.min(timeout)))?;
            }
            sent += self.send_once(&bytes[sent..], 0)?;
        }
        Ok(())
    }

    fn raw_send_nonblocking(&self, bytes: &[u8]) -> io::Result<usize> {
        let mut sent = 0;
        while sent < bytes.len() {
            match self.send_once(&bytes[sent..], libc::MSG_DONTWAIT) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        Ok(sent)
    }
    /// One `send(2)`, retried on EINTR; never returns `Ok(0)` for a
    /// non-empty slice.
    fn send_once(&self, bytes: &[u8], flags: libc::c_int) -> io::Result<usize> {
        loop {
            // SAFETY: the pointer/length pair describes a live, initialised slice.
            let n = unsafe {
                libc::send(
                    self.fd(),
                    bytes.as_ptr().cast(),
                    bytes.len(),
                    libc::MSG_NOSIGNAL | flags,
                )
            };
            if n < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(err);
            }
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            return Ok(n as usize);
        }
    }
}

impl Read for &Socket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.tls.get() {
            Some(tls) => self.tls_read(tls, buf),
            None => self.raw_read(buf),
        }
    }
}

/// A listening socket, polled so that its accept loop can notice shutdown.
pub(crate) enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    pub(crate) fn set_nonblocking(&self) -> io::Result<()> {
        match self {
            Listener::Tcp(l) => l.set_nonblocking(true),
            Listener::Unix(l) => l.set_nonblocking(true),
        }
    }

    pub(crate) fn accept(&self) -> io::Result<Socket> {
        match self {
            Listener::Tcp(l) => l.accept().map(|(s, _)| Socket::new(Raw::Tcp(s))),
            Listener::Unix(l) => l.accept().map(|(s, _)| Socket::new(Raw::Unix(s))),
        }
    }

    /// Waits up to `timeout` for a pending connection.
    pub(crate) fn poll_readable(&self, timeout: Duration) -> io::Result<bool> {
        let fd = match self {
            Listener::Tcp(l) => l.as_raw_fd(),
            Listener::Unix(l) => l.as_raw_fd(),
        };
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let timeout_ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: `pfd` is a valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(err);
        }
        Ok(n > 0)
    }
}
