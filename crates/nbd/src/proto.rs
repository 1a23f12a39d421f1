//! NBD wire protocol: constants, wire structs, encode/decode and request
//! validation. Everything here is pure (no I/O) so it can be unit-tested and
//! fuzzed; the server module only moves bytes between sockets and these
//! functions.
//!
//! All integers on the wire are big-endian ("network byte order").

use crate::Extent;

// ---------------------------------------------------------------------------
// Magic numbers
// ---------------------------------------------------------------------------

/// `NBDMAGIC`, first 8 bytes sent by the server.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`, newstyle magic (server greeting and every client option).
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of every option reply in fixed newstyle.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// ---------------------------------------------------------------------------
// Handshake flags
// ---------------------------------------------------------------------------

pub const NBD_FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const NBD_FLAG_NO_ZEROES: u16 = 1 << 1;
pub const NBD_FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const NBD_FLAG_C_NO_ZEROES: u32 = 1 << 1;

// ---------------------------------------------------------------------------
// Transmission flags
// ---------------------------------------------------------------------------

pub const NBD_FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const NBD_FLAG_READ_ONLY: u16 = 1 << 1;
pub const NBD_FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const NBD_FLAG_SEND_FUA: u16 = 1 << 3;
pub const NBD_FLAG_ROTATIONAL: u16 = 1 << 4;
pub const NBD_FLAG_SEND_TRIM: u16 = 1 << 5;
pub const NBD_FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const NBD_FLAG_SEND_DF: u16 = 1 << 7;
pub const NBD_FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const NBD_FLAG_SEND_RESIZE: u16 = 1 << 9;
pub const NBD_FLAG_SEND_CACHE: u16 = 1 << 10;
pub const NBD_FLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// ---------------------------------------------------------------------------
// Options and option replies
// ---------------------------------------------------------------------------

pub const NBD_OPT_EXPORT_NAME: u32 = 1;
pub const NBD_OPT_ABORT: u32 = 2;
pub const NBD_OPT_LIST: u32 = 3;
pub const NBD_OPT_STARTTLS: u32 = 5;
pub const NBD_OPT_INFO: u32 = 6;
pub const NBD_OPT_GO: u32 = 7;
pub const NBD_OPT_STRUCTURED_REPLY: u32 = 8;
pub const NBD_OPT_LIST_META_CONTEXT: u32 = 9;
pub const NBD_OPT_SET_META_CONTEXT: u32 = 10;

pub const NBD_REP_ACK: u32 = 1;
pub const NBD_REP_SERVER: u32 = 2;
pub const NBD_REP_INFO: u32 = 3;
pub const NBD_REP_META_CONTEXT: u32 = 4;
pub const NBD_REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub const NBD_REP_ERR_POLICY: u32 = (1 << 31) + 2;
pub const NBD_REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub const NBD_REP_ERR_PLATFORM: u32 = (1 << 31) + 4;
pub const NBD_REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
pub const NBD_REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
pub const NBD_REP_ERR_SHUTDOWN: u32 = (1 << 31) + 7;
pub const NBD_REP_ERR_BLOCK_SIZE_REQD: u32 = (1 << 31) + 8;
pub const NBD_REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

pub const NBD_INFO_EXPORT: u16 = 0;
pub const NBD_INFO_NAME: u16 = 1;
pub const NBD_INFO_DESCRIPTION: u16 = 2;
pub const NBD_INFO_BLOCK_SIZE: u16 = 3;

// ---------------------------------------------------------------------------
// Commands, command flags, reply types, errors
// ---------------------------------------------------------------------------

pub const NBD_CMD_READ: u16 = 0;
pub const NBD_CMD_WRITE: u16 = 1;
pub const NBD_CMD_DISC: u16 = 2;
pub const NBD_CMD_FLUSH: u16 = 3;
pub const NBD_CMD_TRIM: u16 = 4;
pub const NBD_CMD_CACHE: u16 = 5;
pub const NBD_CMD_WRITE_ZEROES: u16 = 6;
pub const NBD_CMD_BLOCK_STATUS: u16 = 7;

pub const NBD_CMD_FLAG_FUA: u16 = 1 << 0;
pub const NBD_CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const NBD_CMD_FLAG_DF: u16 = 1 << 2;
pub const NBD_CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const NBD_CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

pub const NBD_REPLY_FLAG_DONE: u16 = 1 << 0;

pub const NBD_REPLY_TYPE_NONE: u16 = 0;
pub const NBD_REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const NBD_REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const NBD_REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const NBD_REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
pub const NBD_REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;

pub const NBD_EPERM: u32 = 1;
pub const NBD_EIO: u32 = 5;
pub const NBD_ENOMEM: u32 = 12;
pub const NBD_EINVAL: u32 = 22;
pub const NBD_ENOSPC: u32 = 28;
pub const NBD_EOVERFLOW: u32 = 75;
pub const NBD_ENOTSUP: u32 = 95;
pub const NBD_ESHUTDOWN: u32 = 108;

/// `base:allocation` status flags.
pub const NBD_STATE_HOLE: u32 = 1 << 0;
pub const NBD_STATE_ZERO: u32 = 1 << 1;

/// The only metadata context this server knows.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Context id handed out for `base:allocation` by `NBD_OPT_SET_META_CONTEXT`.
pub const BASE_ALLOCATION_CONTEXT_ID: u32 = 1;

// ---------------------------------------------------------------------------
// Sizes and limits
// ---------------------------------------------------------------------------

pub const REQUEST_HEADER_BYTES: usize = 28;
pub const SIMPLE_REPLY_HEADER_BYTES: usize = 16;
pub const STRUCTURED_REPLY_HEADER_BYTES: usize = 20;
pub const OPTION_HEADER_BYTES: usize = 16;
/// Length of the zero padding after an `NBD_OPT_EXPORT_NAME` reply.
pub const EXPORT_NAME_PADDING_BYTES: usize = 124;
/// Spec: strings MUST be no longer than 4096 bytes.
pub const MAX_STRING_BYTES: usize = 4096;
/// Option payloads larger than this are refused without being buffered.
pub const MAX_OPTION_PAYLOAD_BYTES: u32 = 64 * 1024;
/// At most this many block status descriptors are sent in one reply.
pub const MAX_BLOCK_STATUS_DESCRIPTORS: usize = 16 * 1024;
/// Preferred block size advertised in `NBD_INFO_BLOCK_SIZE`.
pub const PREFERRED_BLOCK_BYTES: u32 = 4096;
/// Minimum block size advertised in `NBD_INFO_BLOCK_SIZE`.
pub const MINIMUM_BLOCK_BYTES: u32 = 1;

/// Errors found while decoding client bytes. Each one is a protocol
/// violation or a malformed message; the caller decides whether it can be
/// answered with an error reply or must end the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProtoError {
    BadMagic,
    /// A length field points past the end of the message, or bytes are left.
    Malformed,
    /// A string is not UTF-8, contains NUL or exceeds 4096 bytes.
    BadString,
}

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

// ---------------------------------------------------------------------------
// Big-endian helpers
// ---------------------------------------------------------------------------

fn be_u16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// A cursor over a client message that never reads out of bounds.
struct Cursor<'a> {
    rest: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ProtoError> {
        if self.rest.len() < n {
            return Err(ProtoError::Malformed);
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }
    fn u16(&mut self) -> Result<u16, ProtoError> {
        self.take(2).map(be_u16)
    }
    fn u32(&mut self) -> Result<u32, ProtoError> {
        self.take(4).map(be_u32)
    }
    /// A string prefixed with a 32-bit length.
    fn string32(&mut self) -> Result<String, ProtoError> {
        let length_bytes = self.u32()? as usize;
        if length_bytes > MAX_STRING_BYTES {
            return Err(ProtoError::BadString);
        }
        parse_string(self.take(length_bytes)?)
    }
    fn finish(self) -> Result<(), ProtoError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(ProtoError::Malformed)
        }
    }
}

/// Validates an NBD string: UTF-8, no NUL, at most 4096 bytes.
pub fn parse_string(bytes: &[u8]) -> Result<String, ProtoError> {
    if bytes.len() > MAX_STRING_BYTES || bytes.contains(&0) {
        return Err(ProtoError::BadString);
    }
    std::str::from_utf8(bytes)
        .map(str::to_owned)
        .map_err(|_| ProtoError::BadString)
}

// ---------------------------------------------------------------------------
// Handshake
// ---------------------------------------------------------------------------

/// Server greeting: NBDMAGIC, IHAVEOPT, handshake flags (18 bytes).
pub fn encode_greeting(handshake_flags: u16) -> [u8; 18] {
    let mut out = [0u8; 18];
    out[0..8].copy_from_slice(&NBD_MAGIC.to_be_bytes());
    out[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    out[16..18].copy_from_slice(&handshake_flags.to_be_bytes());
    out
}

/// Client flags are valid if they only contain bits the server advertised.
pub fn client_flags_valid(client_flags: u32) -> bool {
    client_flags & !(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES) == 0
}

/// Header of a client option.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub length_bytes: u32,
}

/// Decodes the 16-byte option header (magic, option, length).
pub fn parse_option_header(bytes: &[u8; OPTION_HEADER_BYTES]) -> Result<OptionHeader, ProtoError> {
    if be_u64(&bytes[0..8]) != IHAVEOPT {
        return Err(ProtoError::BadMagic);
    }
    Ok(OptionHeader {
        option: be_u32(&bytes[8..12]),
        length_bytes: be_u32(&bytes[12..16]),
    })
}

/// Encodes a fixed-newstyle option reply (header and data).
pub fn encode_option_reply(option: u32, reply_type: u32, data: &[u8]) -> Vec<u8> {
    let length_bytes = u32::try_from(data.len()).expect("option reply data fits u32");
    let mut out = Vec::with_capacity(20 + data.len());
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    out.extend_from_slice(&length_bytes.to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// Reply to `NBD_OPT_EXPORT_NAME`: size, transmission flags, optional zeroes.
pub fn encode_export_name_reply(
    size_bytes: u64,
    transmission_flags: u16,
    no_zeroes: bool,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(10 + EXPORT_NAME_PADDING_BYTES);
    out.extend_from_slice(&size_bytes.to_be_bytes());
    out.extend_from_slice(&transmission_flags.to_be_bytes());
    if !no_zeroes {
        out.extend_from_slice(&[0u8; EXPORT_NAME_PADDING_BYTES]);
    }
    out
}

/// Payload of an `NBD_REP_SERVER` reply: name length, name, description.
pub fn encode_rep_server(name: &str, description: Option<&str>) -> Vec<u8> {
    let name_bytes = u32::try_from(name.len()).expect("name fits u32");
    let mut out = Vec::new();
    out.extend_from_slice(&name_bytes.to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(description.unwrap_or("").as_bytes());
    out
}

/// Payload of `NBD_REP_INFO` / `NBD_INFO_EXPORT`.
pub fn encode_info_export(size_bytes: u64, transmission_flags: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(12);
    out.extend_from_slice(&NBD_INFO_EXPORT.to_be_bytes());
    out.extend_from_slice(&size_bytes.to_be_bytes());
    out.extend_from_slice(&transmission_flags.to_be_bytes());
    out
}

/// Payload of `NBD_REP_INFO` / `NBD_INFO_BLOCK_SIZE`.
pub fn encode_info_block_size(
    minimum_bytes: u32,
    preferred_bytes: u32,
    maximum_bytes: u32,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(14);
    out.extend_from_slice(&NBD_INFO_BLOCK_SIZE.to_be_bytes());
    out.extend_from_slice(&minimum_bytes.to_be_bytes());
    out.extend_from_slice(&preferred_bytes.to_be_bytes());
    out.extend_from_slice(&maximum_bytes.to_be_bytes());
    out
}

/// Payload of `NBD_REP_INFO` carrying a string (`NBD_INFO_NAME`, `NBD_INFO_DESCRIPTION`).
pub fn encode_info_string(info_type: u16, text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + text.len());
    out.extend_from_slice(&info_type.to_be_bytes());
    out.extend_from_slice(text.as_bytes());
    out
}

/// Payload of `NBD_REP_META_CONTEXT`.
pub fn encode_meta_context(context_id: u32, name: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + name.len());
    out.extend_from_slice(&context_id.to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out
}

/// Data of `NBD_OPT_INFO` / `NBD_OPT_GO`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub export_name: String,
    pub info_types: Vec<u16>,
}

/// Decodes `NBD_OPT_INFO` / `NBD_OPT_GO` data: name, count, info types.
pub fn parse_info_request(data: &[u8]) -> Result<InfoRequest, ProtoError> {
    let mut cur = Cursor { rest: data };
    let export_name = cur.string32()?;
    let count = cur.u16()? as usize;
    if cur.rest.len() != count * 2 {
        return Err(ProtoError::Malformed);
    }
    let mut info_types = Vec::with_capacity(count);
    for _ in 0..count {
        info_types.push(cur.u16()?);
    }
    cur.finish()?;
    Ok(InfoRequest {
        export_name,
        info_types,
    })
}

/// Data of `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextRequest {
    pub export_name: String,
    pub queries: Vec<String>,
}

/// Decodes meta context option data: name, number of queries, queries.
/// The query count is never used to pre-allocate.
pub fn parse_meta_context_request(data: &[u8]) -> Result<MetaContextRequest, ProtoError> {
    let mut cur = Cursor { rest: data };
    let export_name = cur.string32()?;
    let count = cur.u32()?;
    let mut queries = Vec::new();
    for _ in 0..count {
        queries.push(cur.string32()?);
    }
    cur.finish()?;
    Ok(MetaContextRequest {
        export_name,
        queries,
    })
}

/// Which contexts a query selects. `list` allows the `base:` wildcard.
/// Queries in unknown namespaces select nothing (spec: MUST be ignored).
pub fn query_selects_base_allocation(query: &str, list: bool) -> bool {
    query == BASE_ALLOCATION || (list && query == "base:")
}

/// A query must start with a non-empty namespace followed by a colon.
pub fn query_syntax_valid(query: &str) -> bool {
    matches!(query.find(':'), Some(i) if i > 0)
}

// ---------------------------------------------------------------------------
// Transmission: requests
// ---------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------
// Transmission: replies
// ---------------------------------------------------------------------------

/// Simple reply header (16 bytes); read data, if any, follows.
pub fn encode_simple_reply(error: u32, handle: u64) -> [u8; SIMPLE_REPLY_HEADER_BYTES] {
    let mut out = [0u8; SIMPLE_REPLY_HEADER_BYTES];
    out[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&error.to_be_bytes());
    out[8..16].copy_from_slice(&handle.to_be_bytes());
    out
}

/// Structured reply chunk header (20 bytes); `length_bytes` of payload follow.
pub fn encode_chunk_header(
    flags: u16,
    reply_type: u16,
    handle: u64,
    length_bytes: u32,
) -> [u8; STRUCTURED_REPLY_HEADER_BYTES] {
    let mut out = [0u8; STRUCTURED_REPLY_HEADER_BYTES];
    out[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&flags.to_be_bytes());
    out[6..8].copy_from_slice(&reply_type.to_be_bytes());
    out[8..16].copy_from_slice(&handle.to_be_bytes());
    out[16..20].copy_from_slice(&length_bytes.to_be_bytes());
    out
}

/// A complete `NBD_REPLY_TYPE_ERROR` chunk marked done. The message is cut
/// to the 4096-byte string limit (on a char boundary).
pub fn encode_error_chunk(handle: u64, error: u32, message: &str) -> Vec<u8> {
    assert_ne!(error, 0, "error chunks carry a nonzero error");
    let message = truncate_str(message, MAX_STRING_BYTES);
    let message_bytes = message.len() as u16;
    let payload_bytes = 6 + u32::from(message_bytes);
    let mut out = Vec::with_capacity(STRUCTURED_REPLY_HEADER_BYTES + payload_bytes as usize);
    out.extend_from_slice(&encode_chunk_header(
        NBD_REPLY_FLAG_DONE,
        NBD_REPLY_TYPE_ERROR,
        handle,
        payload_bytes,
    ));
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&message_bytes.to_be_bytes());
    out.extend_from_slice(message.as_bytes());
    out
}

fn truncate_str(s: &str, max_bytes: usize) -> &str {
    if s.len() <= max_bytes {
        return s;
    }
    let mut end = max_bytes;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// A complete `NBD_REPLY_TYPE_NONE` chunk marked done.
pub fn encode_none_chunk(handle: u64) -> [u8; STRUCTURED_REPLY_HEADER_BYTES] {
    encode_chunk_header(NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_NONE, handle, 0)
}

/// Bytes before the data of a single, final `NBD_REPLY_TYPE_OFFSET_DATA`
/// chunk: chunk header (20) and offset (8).
pub const OFFSET_DATA_PREFIX_BYTES: usize = STRUCTURED_REPLY_HEADER_BYTES + 8;

/// Prefix of a final `OFFSET_DATA` chunk carrying `data_bytes` (≥ 1) of data.
pub fn encode_offset_data_prefix(
    handle: u64,
    offset: u64,
    data_bytes: u32,
) -> [u8; OFFSET_DATA_PREFIX_BYTES] {
    assert!(
        data_bytes > 0 && data_bytes <= u32::MAX - 8,
        "offset data chunk length"
    );
    let mut out = [0u8; OFFSET_DATA_PREFIX_BYTES];
    out[..STRUCTURED_REPLY_HEADER_BYTES].copy_from_slice(&encode_chunk_header(
        NBD_REPLY_FLAG_DONE,
        NBD_REPLY_TYPE_OFFSET_DATA,
        handle,
        data_bytes + 8,
    ));
    out[STRUCTURED_REPLY_HEADER_BYTES..].copy_from_slice(&offset.to_be_bytes());
    out
}

/// One block status descriptor as sent on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockDescriptor {
    pub length: u32,
    pub status_flags: u32,
}

/// `base:allocation` flags of an extent.
pub fn extent_status_flags(extent: &Extent) -> u32 {
    let hole = if extent.hole { NBD_STATE_HOLE } else { 0 };
    let zero = if extent.zero { NBD_STATE_ZERO } else { 0 };
    hole | zero
}

/// Turns backend extents into wire descriptors: skips empty extents, merges
/// neighbours with equal flags, caps the total at `request_length` (so every
/// descriptor fits u32), keeps one descriptor for `req_one` and at most
/// `max_descriptors` otherwise. The result is empty only if the input
/// describes no bytes.
pub fn extents_to_descriptors(
    extents: &[Extent],
    request_length: u32,
    req_one: bool,
    max_descriptors: usize,
) -> Vec<BlockDescriptor> {
    let limit = if req_one { 1 } else { max_descriptors.max(1) };
    let mut out: Vec<BlockDescriptor> = Vec::new();
    let mut remaining = u64::from(request_length);
    for extent in extents {
        if remaining == 0 {
            break;
        }
        let take = extent.length.min(remaining);
        if take == 0 {
            continue;
        }
        remaining -= take;
        let take = take as u32; // ≤ request_length, fits
        let status_flags = extent_status_flags(extent);
        let full = out.len() == limit;
        match out.last_mut() {
            Some(last) if last.status_flags == status_flags => last.length += take,
            _ if full => break,
            _ => out.push(BlockDescriptor {
                length: take,
                status_flags,
            }),
        }
    }
    out
}

/// A complete `NBD_REPLY_TYPE_BLOCK_STATUS` chunk marked done.
pub fn encode_block_status_chunk(
    handle: u64,
    context_id: u32,
    descriptors: &[BlockDescriptor],
) -> Vec<u8> {
    assert!(
        !descriptors.is_empty(),
        "block status needs at least one descriptor"
    );
    let payload_bytes = 4 + 8 * descriptors.len();
    let mut out = Vec::with_capacity(STRUCTURED_REPLY_HEADER_BYTES + payload_bytes);
    let length = u32::try_from(payload_bytes).expect("block status payload fits u32");
    out.extend_from_slice(&encode_chunk_header(
        NBD_REPLY_FLAG_DONE,
        NBD_REPLY_TYPE_BLOCK_STATUS,
        handle,
        length,
    ));
    out.extend_from_slice(&context_id.to_be_bytes());
    for d in descriptors {
        assert!(d.length > 0, "descriptor length must be nonzero");
        out.extend_from_slice(&d.length.to_be_bytes());
        out.extend_from_slice(&d.status_flags.to_be_bytes());
    }
    out
}

/// Transmission flags advertised for an export.
pub fn transmission_flags(read_only: bool, structured_replies: bool) -> u16 {
    let mut flags = NBD_FLAG_HAS_FLAGS
        | NBD_FLAG_SEND_FLUSH
        | NBD_FLAG_SEND_FUA
        | NBD_FLAG_CAN_MULTI_CONN
        | NBD_FLAG_SEND_CACHE;
    if read_only {
        flags |= NBD_FLAG_READ_ONLY;
    } else {
        flags |= NBD_FLAG_SEND_TRIM | NBD_FLAG_SEND_WRITE_ZEROES | NBD_FLAG_SEND_FAST_ZERO;
    }
    if structured_replies {
        flags |= NBD_FLAG_SEND_DF;
    }
    flags
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> TransmissionContext {
        TransmissionContext {
            size_bytes: 1 << 20,
            transmission_flags: transmission_flags(false, true),
            structured_replies: true,
            base_allocation: true,
            max_request_bytes: 65536,
        }
    }

    fn req(command: u16, flags: u16, offset: u64, length: u32) -> RequestHeader {
        RequestHeader {
            flags,
            command,
            handle: 0xdead_beef_0102_0304,
            offset,
            length,
        }
    }

    #[test]
    fn request_header_roundtrip() {
        let h = req(
            NBD_CMD_WRITE,
            NBD_CMD_FLAG_FUA,
            0x1122_3344_5566_7788,
            0x99aa_bbcc,
        );
        let bytes = encode_request_header(&h);
        assert_eq!(&bytes[0..4], &[0x25, 0x60, 0x95, 0x13]);
        assert_eq!(&bytes[4..8], &[0, 1, 0, 1]);
        assert_eq!(parse_request_header(&bytes), Ok(h));
    }

    #[test]
    fn request_header_bad_magic() {
        let mut bytes = encode_request_header(&req(0, 0, 0, 0));
        bytes[0] ^= 1;
        assert_eq!(parse_request_header(&bytes), Err(ProtoError::BadMagic));
    }

    #[test]
    fn simple_reply_layout() {
        let r = encode_simple_reply(NBD_EINVAL, 0x0102_0304_0506_0708);
        assert_eq!(
            r,
            [0x67, 0x44, 0x66, 0x98, 0, 0, 0, 22, 1, 2, 3, 4, 5, 6, 7, 8]
        );
    }

    #[test]
    fn structured_chunks_layout() {
        let h = encode_chunk_header(NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_OFFSET_DATA, 7, 9);
        assert_eq!(&h[0..4], &[0x66, 0x8e, 0x33, 0xef]);
        assert_eq!(&h[4..8], &[0, 1, 0, 1]);
        assert_eq!(&h[8..16], &7u64.to_be_bytes());
        assert_eq!(&h[16..20], &9u32.to_be_bytes());

        let e = encode_error_chunk(9, NBD_EIO, "boom");
        assert_eq!(e.len(), 20 + 6 + 4);
        assert_eq!(&e[6..8], &NBD_REPLY_TYPE_ERROR.to_be_bytes());
        assert_eq!(&e[16..20], &10u32.to_be_bytes());
        assert_eq!(&e[20..24], &5u32.to_be_bytes());
        assert_eq!(&e[24..26], &4u16.to_be_bytes());
        assert_eq!(&e[26..], b"boom");

        let p = encode_offset_data_prefix(3, 4096, 512);
        assert_eq!(&p[16..20], &520u32.to_be_bytes());
        assert_eq!(&p[20..28], &4096u64.to_be_bytes());

        let n = encode_none_chunk(5);
        assert_eq!(&n[4..8], &[0, 1, 0, 0]);
    }

    #[test]
    fn long_error_message_is_truncated() {
        let msg = "é".repeat(3000); // 6000 bytes
        let e = encode_error_chunk(1, NBD_EIO, &msg);
        let message_bytes = u16::from_be_bytes([e[24], e[25]]) as usize;
        assert!(message_bytes <= MAX_STRING_BYTES);
        assert_eq!(e.len(), 26 + message_bytes);
        assert!(std::str::from_utf8(&e[26..]).is_ok());
    }

    #[test]
    fn option_header_and_reply() {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
        b[8..12].copy_from_slice(&NBD_OPT_GO.to_be_bytes());
        b[12..16].copy_from_slice(&10u32.to_be_bytes());
        assert_eq!(
            parse_option_header(&b),
            Ok(OptionHeader {
                option: 7,
                length_bytes: 10
            })
        );
        b[0] = 0;
        assert_eq!(parse_option_header(&b), Err(ProtoError::BadMagic));

        let r = encode_option_reply(NBD_OPT_LIST, NBD_REP_ACK, b"");
        assert_eq!(r.len(), 20);
        assert_eq!(&r[0..8], &OPTION_REPLY_MAGIC.to_be_bytes());
        assert_eq!(&r[8..12], &3u32.to_be_bytes());
        assert_eq!(&r[12..16], &1u32.to_be_bytes());
    }

    fn info_bytes(name: &[u8], infos: &[u16]) -> Vec<u8> {
        let mut v = (name.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(name);
        v.extend_from_slice(&(infos.len() as u16).to_be_bytes());
        for i in infos {
            v.extend_from_slice(&i.to_be_bytes());
        }
        v
    }

    #[test]
    fn info_request_parsing() {
        let parsed = parse_info_request(&info_bytes(b"cvol", &[3, 1])).unwrap();
        assert_eq!(parsed.export_name, "cvol");
        assert_eq!(parsed.info_types, vec![3, 1]);
        let mut trailing = info_bytes(b"", &[]);
        trailing.push(0);
        assert_eq!(parse_info_request(&trailing), Err(ProtoError::Malformed));
        assert_eq!(
            parse_info_request(&[0, 0, 0, 9, b'a']),
            Err(ProtoError::Malformed)
        );
        assert_eq!(
            parse_info_request(&info_bytes(b"a\0b", &[])),
            Err(ProtoError::BadString)
        );
        assert_eq!(
            parse_info_request(&[0xff, 0xff, 0xff, 0xff]),
            Err(ProtoError::BadString)
        );
        assert_eq!(parse_info_request(&[]), Err(ProtoError::Malformed));
    }

    #[test]
    fn meta_context_parsing() {
        let mut v = 0u32.to_be_bytes().to_vec();
        v.extend_from_slice(&2u32.to_be_bytes());
        for q in ["base:allocation", "qemu:dirty-bitmap:x"] {
            v.extend_from_slice(&(q.len() as u32).to_be_bytes());
            v.extend_from_slice(q.as_bytes());
        }
        let parsed = parse_meta_context_request(&v).unwrap();
        assert_eq!(parsed.export_name, "");
        assert_eq!(
            parsed.queries,
            vec!["base:allocation", "qemu:dirty-bitmap:x"]
        );
        // A huge query count with no data must fail, not allocate.
        let mut huge = 0u32.to_be_bytes().to_vec();
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(
            parse_meta_context_request(&huge),
            Err(ProtoError::Malformed)
        );
        assert!(query_selects_base_allocation("base:", true));
        assert!(!query_selects_base_allocation("base:", false));
        assert!(!query_selects_base_allocation("base:other", true));
        assert!(query_syntax_valid("x-a:b"));
        assert!(!query_syntax_valid(":b"));
        assert!(!query_syntax_valid("nocolon"));
    }

    /// The NBD error a request gets (what the wire carries).
    fn validate_errno(h: &RequestHeader, c: &TransmissionContext) -> Result<Command, u32> {
        validate_request(h, c).map_err(RequestError::errno)
    }

    #[test]
    fn validation_errors_say_why() {
        use RequestError::*;
        let c = ctx();
        let simple = TransmissionContext {
            transmission_flags: transmission_flags(true, false),
            structured_replies: false,
            ..c
        };
        let why = |command, flags, offset, length, c: &TransmissionContext| {
            validate_request(&req(command, flags, offset, length), c).unwrap_err()
        };
        for (got, want) in [
            (why(99, 0, 0, 0, &c), UnknownCommand),
            (why(NBD_CMD_READ, 1 << 9, 0, 1, &c), BadFlags),
            (why(NBD_CMD_READ, 0, (1 << 20) - 1, 2, &c), OutOfRange),
            (why(NBD_CMD_TRIM, 0, 1 << 20, 1, &c), OutOfRange),
            (why(NBD_CMD_WRITE, 0, 1 << 20, 1, &c), BeyondEnd),
            (why(NBD_CMD_WRITE_ZEROES, 0, 1 << 20, 1, &c), BeyondEnd),
            (why(NBD_CMD_WRITE, 0, 0, 65537, &c), Oversize),
            (why(NBD_CMD_BLOCK_STATUS, 0, 0, 0, &c), Empty),
            (why(NBD_CMD_TRIM, 0, 0, 1, &simple), ReadOnly),
            (why(NBD_CMD_BLOCK_STATUS, 0, 0, 1, &simple), NotNegotiated),
        ] {
            assert_eq!(got, want);
            // What the reply carries (the errors and messages of before).
            let reply = match want {
                ReadOnly => (NBD_EPERM, "export is read-only"),
                BeyondEnd => (NBD_ENOSPC, "write beyond the end of the export"),
                _ => (NBD_EINVAL, "invalid request"),
            };
            assert_eq!((got.errno(), got.message()), reply, "{got:?}");
        }
    }

    #[test]
    fn validation_rules() {
        let c = ctx();
        let ok = validate_errno(&req(NBD_CMD_READ, 0, 0, 4096), &c);
        assert_eq!(
            ok,
            Ok(Command::Read {
                offset: 0,
                length: 4096,
                df: false
            })
        );
        assert_eq!(
            validate_errno(&req(NBD_CMD_READ, 0, (1 << 20) - 1, 2), &c),
            Err(NBD_EINVAL)
        );
        assert_eq!(
            validate_errno(&req(NBD_CMD_WRITE, 0, 1 << 20, 1), &c),
            Err(NBD_ENOSPC)
        );
        assert_eq!(
            validate_errno(&req(NBD_CMD_WRITE, 0, 0, 65537), &c),
            Err(NBD_EINVAL)
        );
        assert_eq!(
            validate_errno(&req(NBD_CMD_READ, 0, u64::MAX, 1), &c),
            Err(NBD_EINVAL)
        );
        assert_eq!(
            validate_errno(&req(NBD_CMD_TRIM, 0, 1 << 20, 1), &c),
            Err(NBD_EINVAL)
        );
        assert_eq!(
            validate_errno(&req(NBD_CMD_WRITE_ZEROES, 0, 1 << 20, 1), &c),
            Err(NBD_ENOSPC)
        );
        assert_eq!(validate_errno(&req(99, 0, 0, 0), &c), Err(NBD_EINVAL));
        assert_eq!(validate_errno(&req(8, 0, 0, 0), &c), Err(NBD_EINVAL));
        assert_eq!(
            validate_errno(&req(NBD_CMD_WRITE, NBD_CMD_FLAG_REQ_ONE, 0, 1), &c),
            Err(NBD_EINVAL)
        );
        assert_eq!(
            validate_errno(&req(NBD_CMD_READ, 1 << 9, 0, 1), &c),
            Err(NBD_EINVAL)
        );
        assert!(validate_errno(&req(NBD_CMD_FLUSH, NBD_CMD_FLAG_FUA, 0, 0), &c).is_ok());
        assert!(validate_errno(&req(NBD_CMD_READ, NBD_CMD_FLAG_DF, 0, 1), &c).is_ok());
        let wz = validate_errno(&req(NBD_CMD_WRITE_ZEROES, 0x13, 0, 1 << 20), &c);
        assert_eq!(
            wz,
            Ok(Command::WriteZeroes {
                offset: 0,
                length: 1 << 20,
                fua: true,
                no_hole: true,
                fast_zero: true
            })
        );
        let bs = validate_errno(&req(NBD_CMD_BLOCK_STATUS, NBD_CMD_FLAG_REQ_ONE, 0, 512), &c);
        assert_eq!(
            bs,
            Ok(Command::BlockStatus {
                offset: 0,
                length: 512,
                req_one: true
            })
        );
        assert_eq!(
            validate_errno(&req(NBD_CMD_BLOCK_STATUS, 0, 0, 0), &c),
            Err(NBD_EINVAL)
        );
        let no_ctx = TransmissionContext {
            base_allocation: false,
            ..c
        };
        assert_eq!(
            validate_errno(&req(NBD_CMD_BLOCK_STATUS, 0, 0, 512), &no_ctx),
            Err(NBD_EINVAL)
        );
    }

    #[test]
    fn validation_read_only_and_simple() {
        let ro = TransmissionContext {
            transmission_flags: transmission_flags(true, false),
            structured_replies: false,
            ..ctx()
        };
        assert_eq!(
            validate_errno(&req(NBD_CMD_WRITE, 0, 0, 1), &ro),
            Err(NBD_EPERM)
        );
        assert_eq!(
            validate_errno(&req(NBD_CMD_TRIM, 0, 0, 1), &ro),
            Err(NBD_EPERM)
        );
        assert_eq!(
            validate_errno(&req(NBD_CMD_WRITE_ZEROES, 0, 0, 1), &ro),
            Err(NBD_EPERM)
        );
        assert!(validate_errno(&req(NBD_CMD_READ, 0, 0, 1), &ro).is_ok());
        // DF is not advertised without structured replies.
        assert_eq!(
            validate_errno(&req(NBD_CMD_READ, NBD_CMD_FLAG_DF, 0, 1), &ro),
            Err(NBD_EINVAL)
        );
    }

    #[test]
    fn transmission_flag_sets() {
        let rw = transmission_flags(false, false);
        for f in [
            NBD_FLAG_HAS_FLAGS,
            NBD_FLAG_SEND_FLUSH,
            NBD_FLAG_SEND_FUA,
            NBD_FLAG_SEND_TRIM,
            NBD_FLAG_SEND_WRITE_ZEROES,
            NBD_FLAG_SEND_FAST_ZERO,
            NBD_FLAG_CAN_MULTI_CONN,
            NBD_FLAG_SEND_CACHE,
        ] {
            assert_ne!(rw & f, 0);
        }
        assert_eq!(rw & (NBD_FLAG_READ_ONLY | NBD_FLAG_SEND_DF), 0);
        let ro = transmission_flags(true, true);
        assert_ne!(ro & NBD_FLAG_READ_ONLY, 0);
        assert_ne!(ro & NBD_FLAG_SEND_DF, 0);
        assert_eq!(ro & NBD_FLAG_SEND_TRIM, 0);
    }

    fn ext(length: u64, hole: bool, zero: bool) -> Extent {
        Extent { length, hole, zero }
    }

    #[test]
    fn extent_merging() {
        let extents = [
            ext(4096, false, false),
            ext(4096, false, false),
            ext(8192, true, true),
            ext(0, false, false),
            ext(4096, true, true),
            ext(4096, false, true),
        ];
        let d = extents_to_descriptors(&extents, 1 << 20, false, 100);
        assert_eq!(
            d,
            vec![
                BlockDescriptor {
                    length: 8192,
                    status_flags: 0
                },
                BlockDescriptor {
                    length: 12288,
                    status_flags: 3
                },
                BlockDescriptor {
                    length: 4096,
                    status_flags: 2
                },
            ]
        );
        // Total is capped at the request length.
        let d = extents_to_descriptors(&extents, 10000, false, 100);
        assert_eq!(
            d,
            vec![
                BlockDescriptor {
                    length: 8192,
                    status_flags: 0
                },
                BlockDescriptor {
                    length: 1808,
                    status_flags: 3
                }
            ]
        );
        // REQ_ONE keeps exactly one (merged) descriptor.
        let d = extents_to_descriptors(&extents, 1 << 20, true, 100);
        assert_eq!(
            d,
            vec![BlockDescriptor {
                length: 8192,
                status_flags: 0
            }]
        );
        // Descriptor count limit.
        let d = extents_to_descriptors(&extents, 1 << 20, false, 2);
        assert_eq!(d.len(), 2);
        // Huge extents never overflow u32.
        let d = extents_to_descriptors(&[ext(u64::MAX, true, false)], u32::MAX, false, 10);
        assert_eq!(
            d,
            vec![BlockDescriptor {
                length: u32::MAX,
                status_flags: 1
            }]
        );
        assert!(extents_to_descriptors(&[], 10, false, 10).is_empty());
        assert!(extents_to_descriptors(&[ext(0, false, false)], 10, false, 10).is_empty());
    }

    #[test]
    fn block_status_chunk_layout() {
        let d = [BlockDescriptor {
            length: 512,
            status_flags: 3,
        }];
        let c = encode_block_status_chunk(11, BASE_ALLOCATION_CONTEXT_ID, &d);
        assert_eq!(c.len(), 20 + 12);
        assert_eq!(&c[6..8], &NBD_REPLY_TYPE_BLOCK_STATUS.to_be_bytes());
        assert_eq!(&c[16..20], &12u32.to_be_bytes());
        assert_eq!(&c[20..24], &1u32.to_be_bytes());
        assert_eq!(&c[24..28], &512u32.to_be_bytes());
        assert_eq!(&c[28..32], &3u32.to_be_bytes());
    }

    #[test]
    fn handshake_encoders() {
        let g = encode_greeting(NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES);
        assert_eq!(&g[0..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(&g[16..18], &[0, 3]);
        assert!(client_flags_valid(3));
        assert!(!client_flags_valid(4));
        assert_eq!(encode_export_name_reply(1, 1, false).len(), 134);
        assert_eq!(encode_export_name_reply(1, 1, true).len(), 10);
        assert_eq!(encode_info_export(5, 1).len(), 12);
        assert_eq!(encode_info_block_size(1, 4096, 1 << 25).len(), 14);
        assert_eq!(
            encode_rep_server("ab", Some("d")),
            vec![0, 0, 0, 2, b'a', b'b', b'd']
        );
    }

    /// Decoders and the validator must never panic, whatever the bytes.
    #[test]
    fn random_input_never_panics() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..20_000 {
            let length_bytes = (next() % 64) as usize;
            let bytes: Vec<u8> = (0..length_bytes).map(|_| next() as u8).collect();
            let _ = parse_info_request(&bytes);
            let _ = parse_meta_context_request(&bytes);
            let _ = parse_string(&bytes);
            let mut header = [0u8; REQUEST_HEADER_BYTES];
            header.iter_mut().for_each(|b| *b = next() as u8);
            header[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
            let h = parse_request_header(&header).unwrap();
            let h = RequestHeader {
                command: h.command % 10,
                flags: h.flags % 64,
                ..h
            };
            for c in [
                ctx(),
                TransmissionContext {
                    size_bytes: u64::MAX,
                    ..ctx()
                },
            ] {
                if let Ok(cmd) = validate_errno(&h, &c) {
                    if let Some((offset, length)) = cmd.range() {
                        assert!(offset
                            .checked_add(length)
                            .is_some_and(|end| end <= c.size_bytes));
                    }
                }
            }
        }
    }
}
