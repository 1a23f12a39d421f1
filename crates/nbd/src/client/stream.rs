//! The socket under one connection (TCP or Unix), with the read, write
//! and connect timeouts of [`IO_TIMEOUT`], and reads of whole messages.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;

use super::uri::Endpoint;
use super::IO_TIMEOUT;

pub(super) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    pub(super) fn connect(endpoint: &Endpoint) -> io::Result<Stream> {
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

pub(super) fn invalid_data(message: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.into())
}

/// `read_exact` that reports a server going away mid-message as
/// `InvalidData` and a read timeout as `TimedOut`.
pub(super) fn read_full(stream: &mut Stream, buf: &mut [u8]) -> io::Result<()> {
    stream.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => invalid_data("server closed the connection mid-message"),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no answer from the server within {IO_TIMEOUT:?}"),
        ),
        _ => e,
    })
}

pub(super) fn read_array<const N: usize>(stream: &mut Stream) -> io::Result<[u8; N]> {
    let mut b = [0u8; N];
    read_full(stream, &mut b)?;
    Ok(b)
}
