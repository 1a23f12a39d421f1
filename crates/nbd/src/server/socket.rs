//! A connected stream socket (TCP or Unix) shared by a connection's reader,
//! its reply writers and the server's registry (for shutdown).

use std::io::{self, Read};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

pub(crate) enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Socket {
    fn fd(&self) -> RawFd {
        match self {
            Socket::Tcp(s) => s.as_raw_fd(),
            Socket::Unix(s) => s.as_raw_fd(),
        }
    }

    /// Human-readable peer description for logs.
    pub(crate) fn peer(&self) -> String {
        match self {
            Socket::Tcp(s) => s
                .peer_addr()
                .map_or_else(|_| "tcp:?".into(), |a| format!("tcp:{a}")),
            Socket::Unix(_) => "unix".into(),
        }
    }

    /// Blocking mode, TCP_NODELAY, and a send timeout so that a client that
    /// stops reading replies cannot block a worker forever.
    pub(crate) fn configure(&self, write_timeout: Duration) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => {
                s.set_nonblocking(false)?;
                s.set_nodelay(true)?;
                s.set_write_timeout(Some(write_timeout))
            }
            Socket::Unix(s) => {
                s.set_nonblocking(false)?;
                s.set_write_timeout(Some(write_timeout))
            }
        }
    }

    pub(crate) fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => s.set_read_timeout(timeout),
            Socket::Unix(s) => s.set_read_timeout(timeout),
        }
    }

    /// Shuts down one or both directions; errors (already closed) are ignored.
    pub(crate) fn shutdown(&self, how: Shutdown) {
        let _ = match self {
            Socket::Tcp(s) => s.shutdown(how),
            Socket::Unix(s) => s.shutdown(how),
        };
    }

    pub(crate) fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Socket::Tcp(s) => s.set_write_timeout(timeout),
            Socket::Unix(s) => s.set_write_timeout(timeout),
        }
    }

    /// Writes all of `bytes` with `MSG_NOSIGNAL` (no SIGPIPE if the peer is
    /// gone), blocking up to the socket's send timeout per call.
    pub(crate) fn send_all(&self, bytes: &[u8]) -> io::Result<()> {
        let mut sent = 0;
        while sent < bytes.len() {
            sent += self.send_once(&bytes[sent..], 0)?;
        }
        Ok(())
    }

    /// Writes as much of `bytes` as the socket takes without blocking and
    /// returns how much that was (`WouldBlock` is not an error here).
    pub(crate) fn send_nonblocking(&self, bytes: &[u8]) -> io::Result<usize> {
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
        match self {
            Socket::Tcp(s) => (&*s).read(buf),
            Socket::Unix(s) => (&*s).read(buf),
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
            Listener::Tcp(l) => l.accept().map(|(s, _)| Socket::Tcp(s)),
            Listener::Unix(l) => l.accept().map(|(s, _)| Socket::Unix(s)),
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
