//! Transmission requests: the 28-byte request header, the per-connection
//! facts a request is checked against, and validation into a [`Command`]
//! or a [`RequestError`] (the errno and message of its error reply).

use super::wire::{be_u16, be_u32, be_u64};
use super::*;

/// Why a request header is refused. The request gets an error reply
/// ([`RequestError::errno`], [`RequestError::message`]) and the connection
/// goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestError {
    /// A command type this server does not know.
    UnknownCommand,
    /// A write-type command (WRITE, TRIM, WRITE_ZEROES) on a read-only export.
    ReadOnly,
    /// A flag the command does not take, or one not advertised.
    BadFlags,
    /// A command whose transmission flag was not advertised (FLUSH, TRIM,
    /// WRITE_ZEROES), or BLOCK_STATUS without structured replies and
    /// `base:allocation`.
    NotNegotiated,
    /// A WRITE or WRITE_ZEROES that does not end inside the export.
    BeyondEnd,
    /// Another command's range that does not lie inside the export.
    OutOfRange,
    /// READ, WRITE or CACHE longer than `max_request_bytes`.
    Oversize,
    /// A BLOCK_STATUS of zero bytes.
    Empty,
}

impl RequestError {
    /// The NBD error of the reply: `EPERM` for a write to a read-only
    /// export, `ENOSPC` for a write beyond the end, else `EINVAL`.
    pub fn errno(self) -> u32 {
        self.reply().0
    }

    /// The message of a structured error reply.
    pub fn message(self) -> &'static str {
        self.reply().1
    }

    fn reply(self) -> (u32, &'static str) {
        use RequestError::*;
        match self {
            ReadOnly => (NBD_EPERM, "export is read-only"),
            BeyondEnd => (NBD_ENOSPC, "write beyond the end of the export"),
            UnknownCommand | BadFlags | NotNegotiated | OutOfRange | Oversize | Empty => {
                (NBD_EINVAL, "invalid request")
            }
        }
    }
}

/// A decoded 28-byte request header. `command` is the raw type so that
/// unknown commands can still be answered with `EINVAL`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub command: u16,
    pub handle: u64,
    pub offset: u64,
    pub length: u32,
}

/// Decodes a request header; fails only on a bad magic.
pub fn parse_request_header(
    bytes: &[u8; REQUEST_HEADER_BYTES],
) -> Result<RequestHeader, ProtoError> {
    if be_u32(&bytes[0..4]) != REQUEST_MAGIC {
        return Err(ProtoError::BadMagic);
    }
    Ok(RequestHeader {
        flags: be_u16(&bytes[4..6]),
        command: be_u16(&bytes[6..8]),
        handle: be_u64(&bytes[8..16]),
        offset: be_u64(&bytes[16..24]),
        length: be_u32(&bytes[24..28]),
    })
}

/// Encodes a request header (used by tests and clients).
pub fn encode_request_header(h: &RequestHeader) -> [u8; REQUEST_HEADER_BYTES] {
    let mut out = [0u8; REQUEST_HEADER_BYTES];
    out[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&h.flags.to_be_bytes());
    out[6..8].copy_from_slice(&h.command.to_be_bytes());
    out[8..16].copy_from_slice(&h.handle.to_be_bytes());
    out[16..24].copy_from_slice(&h.offset.to_be_bytes());
    out[24..28].copy_from_slice(&h.length.to_be_bytes());
    out
}

/// Per-connection facts needed to validate requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransmissionContext {
    pub size_bytes: u64,
    pub transmission_flags: u16,
    pub structured_replies: bool,
    /// A metadata context was selected (`base:allocation`, or any other
    /// the backend offers), so BLOCK_STATUS is allowed. Named for the
    /// first context this server knew.
    pub base_allocation: bool,
    pub max_request_bytes: u32,
}

impl TransmissionContext {
    fn read_only(&self) -> bool {
        self.transmission_flags & NBD_FLAG_READ_ONLY != 0
    }
    fn has(&self, flag: u16) -> bool {
        self.transmission_flags & flag != 0
    }
}

/// A request that passed validation, ready for the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read {
        offset: u64,
        length: u32,
        df: bool,
    },
    Write {
        offset: u64,
        length: u32,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        length: u32,
        fua: bool,
    },
    Cache {
        offset: u64,
        length: u32,
    },
    WriteZeroes {
        offset: u64,
        length: u32,
        fua: bool,
        no_hole: bool,
        fast_zero: bool,
    },
    BlockStatus {
        offset: u64,
        length: u32,
        req_one: bool,
    },
    Disconnect,
}

impl Command {
    /// Byte range touched, for ordering; `None` for commands without one.
    pub fn range(&self) -> Option<(u64, u64)> {
        match *self {
            Command::Read { offset, length, .. }
            | Command::Write { offset, length, .. }
            | Command::Trim { offset, length, .. }
            | Command::Cache { offset, length }
            | Command::WriteZeroes { offset, length, .. }
            | Command::BlockStatus { offset, length, .. } => Some((offset, u64::from(length))),
            Command::Flush | Command::Disconnect => None,
        }
    }
    /// True for commands that modify the export.
    pub fn is_write(&self) -> bool {
        matches!(
            self,
            Command::Write { .. } | Command::Trim { .. } | Command::WriteZeroes { .. }
        )
    }
}

/// Flags a command accepts (given what was advertised).
fn allowed_flags(command: u16, ctx: &TransmissionContext) -> u16 {
    let fua = if ctx.has(NBD_FLAG_SEND_FUA) {
        NBD_CMD_FLAG_FUA
    } else {
        0
    };
    match command {
        NBD_CMD_READ if ctx.has(NBD_FLAG_SEND_DF) => fua | NBD_CMD_FLAG_DF,
        NBD_CMD_WRITE_ZEROES if ctx.has(NBD_FLAG_SEND_FAST_ZERO) => {
            fua | NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FAST_ZERO
        }
        NBD_CMD_WRITE_ZEROES => fua | NBD_CMD_FLAG_NO_HOLE,
        NBD_CMD_BLOCK_STATUS => fua | NBD_CMD_FLAG_REQ_ONE,
        _ => fua,
    }
}

fn is_write_command(command: u16) -> bool {
    matches!(command, NBD_CMD_WRITE | NBD_CMD_TRIM | NBD_CMD_WRITE_ZEROES)
}

/// True if `[offset, offset + length)` lies inside the export.
fn in_range(offset: u64, length: u32, size_bytes: u64) -> bool {
    offset
        .checked_add(u64::from(length))
        .is_some_and(|end| end <= size_bytes)
}

/// Validates a request header against the negotiated state. Returns the
/// command or why it is refused. Pure; safe on any input.
pub fn validate_request(
    h: &RequestHeader,
    ctx: &TransmissionContext,
) -> Result<Command, RequestError> {
    if h.command > NBD_CMD_BLOCK_STATUS {
        return Err(RequestError::UnknownCommand);
    }
    if is_write_command(h.command) && ctx.read_only() {
        return Err(RequestError::ReadOnly);
    }
    if h.flags & !allowed_flags(h.command, ctx) != 0 {
        return Err(RequestError::BadFlags);
    }
    validate_by_command(h, ctx)
}

fn validate_by_command(
    h: &RequestHeader,
    ctx: &TransmissionContext,
) -> Result<Command, RequestError> {
    let (offset, length) = (h.offset, h.length);
    let fua = h.flags & NBD_CMD_FLAG_FUA != 0;
    let range_ok = in_range(offset, length, ctx.size_bytes);
    let small_enough = length <= ctx.max_request_bytes;
    match h.command {
        NBD_CMD_READ => {
            check(range_ok, RequestError::OutOfRange)?;
            check(small_enough, RequestError::Oversize)?;
            Ok(Command::Read {
                offset,
                length,
                df: h.flags & NBD_CMD_FLAG_DF != 0,
            })
        }
        NBD_CMD_WRITE => {
            check(range_ok, RequestError::BeyondEnd)?;
            check(small_enough, RequestError::Oversize)?;
            Ok(Command::Write {
                offset,
                length,
                fua,
            })
        }
        NBD_CMD_DISC => Ok(Command::Disconnect),
        NBD_CMD_FLUSH => {
            check(ctx.has(NBD_FLAG_SEND_FLUSH), RequestError::NotNegotiated)?;
            Ok(Command::Flush)
        }
        NBD_CMD_TRIM => {
            check(ctx.has(NBD_FLAG_SEND_TRIM), RequestError::NotNegotiated)?;
            check(range_ok, RequestError::OutOfRange)?;
            Ok(Command::Trim {
                offset,
                length,
                fua,
            })
        }
        NBD_CMD_CACHE => {
            check(range_ok, RequestError::OutOfRange)?;
            check(small_enough, RequestError::Oversize)?;
            Ok(Command::Cache { offset, length })
        }
        NBD_CMD_WRITE_ZEROES => validate_write_zeroes(h, ctx, range_ok),
        _ => validate_block_status(h, ctx, range_ok),
    }
}

fn validate_write_zeroes(
    h: &RequestHeader,
    ctx: &TransmissionContext,
    range_ok: bool,
) -> Result<Command, RequestError> {
    check(
        ctx.has(NBD_FLAG_SEND_WRITE_ZEROES),
        RequestError::NotNegotiated,
    )?;
    check(range_ok, RequestError::BeyondEnd)?;
    Ok(Command::WriteZeroes {
        offset: h.offset,
        length: h.length,
        fua: h.flags & NBD_CMD_FLAG_FUA != 0,
        no_hole: h.flags & NBD_CMD_FLAG_NO_HOLE != 0,
        fast_zero: h.flags & NBD_CMD_FLAG_FAST_ZERO != 0,
    })
}

fn validate_block_status(
    h: &RequestHeader,
    ctx: &TransmissionContext,
    range_ok: bool,
) -> Result<Command, RequestError> {
    debug_assert_eq!(h.command, NBD_CMD_BLOCK_STATUS);
    check(
        ctx.structured_replies && ctx.base_allocation,
        RequestError::NotNegotiated,
    )?;
    check(range_ok, RequestError::OutOfRange)?;
    check(h.length > 0, RequestError::Empty)?;
    Ok(Command::BlockStatus {
        offset: h.offset,
        length: h.length,
        req_one: h.flags & NBD_CMD_FLAG_REQ_ONE != 0,
    })
}

fn check(condition: bool, error: RequestError) -> Result<(), RequestError> {
    if condition {
        Ok(())
    } else {
        Err(error)
    }
}
