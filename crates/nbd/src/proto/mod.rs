//! NBD wire protocol: constants, wire structs, encode/decode and request
//! validation. Everything here is pure (no I/O) so it can be unit-tested and
//! fuzzed; the server module only moves bytes between sockets and these
//! functions.
//!
//! All integers on the wire are big-endian ("network byte order").
//!
//! The rooms, in the order a connection meets them:
//!
//! * this file: the protocol's numbers (magics, flags, option, command,
//!   reply and error codes, sizes and limits) and [`ProtoError`];
//! * `wire`: big-endian reads, the bounds-checked cursor, [`parse_string`];
//! * `handshake`: the greeting, option headers and replies, `NBD_OPT_INFO`/
//!   `GO` and metadata-context requests, the advertised transmission flags;
//! * `request`: transmission request headers and their validation into a
//!   [`Command`] (or a [`RequestError`]);
//! * `reply`: simple replies, structured reply chunks and block-status
//!   descriptors (`base:allocation` and a backend's own contexts).

mod handshake;
mod reply;
mod request;
mod wire;

#[cfg(test)]
mod tests;

pub use handshake::*;
pub use reply::*;
pub use request::*;
pub use wire::parse_string;

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

/// The metadata context this server knows itself (backends may name more).
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Context id handed out for `base:allocation` by `NBD_OPT_SET_META_CONTEXT`;
/// a backend's contexts get the ids after it (2, 3, ...).
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
