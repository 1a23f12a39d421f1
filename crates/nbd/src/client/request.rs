//! One request on one connection: the request header (and WRITE data)
//! out, the simple reply (and READ data) in; how an NBD errno is named and
//! which `io::ErrorKind` it becomes.

use std::io::{self, Write};

use super::handshake::Conn;
use super::stream::{invalid_data, read_array, read_full};
use crate::proto::{self, RequestHeader};

/// One request as sent.
#[derive(Debug, Clone, Copy)]
pub(super) struct Request<'a> {
    pub(super) command: u16,
    pub(super) flags: u16,
    pub(super) offset: u64,
    pub(super) length: u32,
    /// WRITE data (empty for the other commands).
    pub(super) payload: &'a [u8],
}

/// Why a request failed.
pub(super) enum Failure {
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
    pub(super) fn transact(
        &mut self,
        req: &Request<'_>,
        data_in: &mut [u8],
    ) -> Result<(), Failure> {
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
    pub(super) fn disconnect(mut self) {
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

pub(super) fn command_name(command: u16) -> &'static str {
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
pub(super) fn errno_kind(errno: u32) -> (io::ErrorKind, String) {
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
