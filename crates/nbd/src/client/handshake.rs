//! One connection's handshake: the greeting, `NBD_OPT_GO` asking for
//! `NBD_INFO_BLOCK_SIZE` (or `NBD_OPT_EXPORT_NAME` for an old server), and
//! what it learns of the export (size, flags, largest payload).

use std::io::{self, Write};

use super::stream::{invalid_data, read_array, read_full, Stream};
use super::uri::Target;
use super::MAX_REQUEST_BYTES;
use crate::proto;

/// Longest option reply payload accepted during the handshake.
const MAX_OPTION_REPLY_BYTES: u32 = 64 * 1024;
/// Most replies accepted for one option.
const MAX_OPTION_REPLIES: usize = 64;
/// What the handshake found out about the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ExportInfo {
    pub(super) size_bytes: u64,
    pub(super) transmission_flags: u16,
    /// Longest READ/WRITE payload per request.
    pub(super) max_payload_bytes: u32,
}

/// `NBD_INFO_BLOCK_SIZE` as received.
#[derive(Debug, Clone, Copy)]
pub(super) struct BlockSize {
    pub(super) minimum: u32,
    pub(super) maximum: u32,
}

/// Largest request payload honouring [`MAX_REQUEST_BYTES`] and the server's
/// block sizes (a multiple of its minimum).
pub(super) fn max_payload(block_size: Option<BlockSize>) -> u32 {
    let Some(bs) = block_size else {
        return MAX_REQUEST_BYTES;
    };
    let minimum = bs.minimum.clamp(1, 64 * 1024);
    let maximum = bs.maximum.min(MAX_REQUEST_BYTES);
    (maximum / minimum * minimum).max(minimum)
}

fn option_error(reply_type: u32, data: &[u8], export: &str) -> io::Error {
    let text: String = String::from_utf8_lossy(data).chars().take(200).collect();
    let (kind, what) = match reply_type {
        proto::NBD_REP_ERR_UNKNOWN => (io::ErrorKind::NotFound, "unknown export"),
        proto::NBD_REP_ERR_POLICY => (io::ErrorKind::PermissionDenied, "refused by policy"),
        proto::NBD_REP_ERR_TLS_REQD => (io::ErrorKind::Unsupported, "server requires TLS"),
        proto::NBD_REP_ERR_SHUTDOWN => (io::ErrorKind::ConnectionAborted, "server shutting down"),
        proto::NBD_REP_ERR_INVALID => (io::ErrorKind::InvalidInput, "invalid option"),
        _ => (io::ErrorKind::Other, "option failed"),
    };
    io::Error::new(
        kind,
        format!("NBD_OPT_GO for export {export:?}: {what} (reply {reply_type:#x}) {text:?}"),
    )
}

/// One open connection in transmission.
pub(super) struct Conn {
    pub(super) stream: Stream,
    pub(super) next_handle: u64,
}

impl Conn {
    /// Connects and runs the handshake.
    pub(super) fn open(target: &Target) -> io::Result<(Conn, ExportInfo)> {
        let mut conn = Conn {
            stream: Stream::connect(&target.endpoint)?,
            next_handle: 1,
        };
        let info = conn.handshake(&target.export)?;
        Ok((conn, info))
    }

    fn handshake(&mut self, export: &str) -> io::Result<ExportInfo> {
        let magic = u64::from_be_bytes(read_array(&mut self.stream)?);
        let style = u64::from_be_bytes(read_array(&mut self.stream)?);
        if magic != proto::NBD_MAGIC || style != proto::IHAVEOPT {
            return Err(invalid_data("not a newstyle NBD server (bad greeting)"));
        }
        let handshake_flags = u16::from_be_bytes(read_array(&mut self.stream)?);
        let fixed = handshake_flags & proto::NBD_FLAG_FIXED_NEWSTYLE != 0;
        let no_zeroes = handshake_flags & proto::NBD_FLAG_NO_ZEROES != 0;
        let mut client_flags = 0;
        if fixed {
            client_flags |= proto::NBD_FLAG_C_FIXED_NEWSTYLE;
        }
        if no_zeroes {
            client_flags |= proto::NBD_FLAG_C_NO_ZEROES;
        }
        self.stream.write_all(&client_flags.to_be_bytes())?;
        if fixed {
            if let Some(info) = self.opt_go(export)? {
                return Ok(info);
            }
        }
        self.opt_export_name(export, no_zeroes)
    }

    fn send_option(&mut self, option: u32, data: &[u8]) -> io::Result<()> {
        let length = u32::try_from(data.len()).map_err(|_| invalid_data("option too long"))?;
        let mut m = Vec::with_capacity(16 + data.len());
        m.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
        m.extend_from_slice(&option.to_be_bytes());
        m.extend_from_slice(&length.to_be_bytes());
        m.extend_from_slice(data);
        self.stream.write_all(&m)
    }

    /// One option reply to `option`: (reply type, data).
    fn option_reply(&mut self, option: u32) -> io::Result<(u32, Vec<u8>)> {
        let header: [u8; 20] = read_array(&mut self.stream)?;
        let field =
            |i: usize| u32::from_be_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
        if header[0..8] != proto::OPTION_REPLY_MAGIC.to_be_bytes() {
            return Err(invalid_data("bad option reply magic"));
        }
        if field(8) != option {
            return Err(invalid_data(format!(
                "option reply for option {} to option {option}",
                field(8)
            )));
        }
        let length = field(16);
        if length > MAX_OPTION_REPLY_BYTES {
            return Err(invalid_data(format!("option reply of {length} bytes")));
        }
        let mut data = vec![0u8; length as usize];
        read_full(&mut self.stream, &mut data)?;
        Ok((field(12), data))
    }

    /// `NBD_OPT_GO`; `None` if the server answers `NBD_REP_ERR_UNSUP`.
    fn opt_go(&mut self, export: &str) -> io::Result<Option<ExportInfo>> {
        let name_bytes = u32::try_from(export.len()).map_err(|_| invalid_data("long name"))?;
        let mut data = name_bytes.to_be_bytes().to_vec();
        data.extend_from_slice(export.as_bytes());
        data.extend_from_slice(&1u16.to_be_bytes());
        data.extend_from_slice(&proto::NBD_INFO_BLOCK_SIZE.to_be_bytes());
        self.send_option(proto::NBD_OPT_GO, &data)?;
        let mut export_info = None;
        let mut block_size = None;
        for _ in 0..MAX_OPTION_REPLIES {
            let (reply_type, data) = self.option_reply(proto::NBD_OPT_GO)?;
            match reply_type {
                proto::NBD_REP_ACK => {
                    let (size_bytes, transmission_flags) = export_info.ok_or_else(|| {
                        invalid_data("NBD_OPT_GO acknowledged without export info")
                    })?;
                    return Ok(Some(ExportInfo {
                        size_bytes,
                        transmission_flags,
                        max_payload_bytes: max_payload(block_size),
                    }));
                }
                proto::NBD_REP_INFO => parse_info(&data, &mut export_info, &mut block_size)?,
                proto::NBD_REP_ERR_UNSUP => return Ok(None),
                t if t & (1 << 31) != 0 => return Err(option_error(t, &data, export)),
                _ => {} // Another informational reply: not ours to interpret.
            }
        }
        Err(invalid_data("too many replies to NBD_OPT_GO"))
    }

    /// `NBD_OPT_EXPORT_NAME` (no error reply: an unknown export closes).
    fn opt_export_name(&mut self, export: &str, no_zeroes: bool) -> io::Result<ExportInfo> {
        self.send_option(proto::NBD_OPT_EXPORT_NAME, export.as_bytes())?;
        let reply: [u8; 10] = read_array(&mut self.stream).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("NBD_OPT_EXPORT_NAME for export {export:?} (unknown export?): {e}"),
            )
        })?;
        if !no_zeroes {
            let _padding: [u8; proto::EXPORT_NAME_PADDING_BYTES] = read_array(&mut self.stream)?;
        }
        let mut size = [0u8; 8];
        size.copy_from_slice(&reply[0..8]);
        Ok(ExportInfo {
            size_bytes: u64::from_be_bytes(size),
            transmission_flags: u16::from_be_bytes([reply[8], reply[9]]),
            max_payload_bytes: MAX_REQUEST_BYTES,
        })
    }
}

/// Reads one `NBD_REP_INFO` payload into what the client keeps.
fn parse_info(
    data: &[u8],
    export: &mut Option<(u64, u16)>,
    block_size: &mut Option<BlockSize>,
) -> io::Result<()> {
    let Some(info_type) = data.get(0..2).map(|b| u16::from_be_bytes([b[0], b[1]])) else {
        return Err(invalid_data("empty NBD_REP_INFO"));
    };
    let u32_at = |i: usize| u32::from_be_bytes([data[i], data[i + 1], data[i + 2], data[i + 3]]);
    match info_type {
        proto::NBD_INFO_EXPORT if data.len() == 12 => {
            let mut size = [0u8; 8];
            size.copy_from_slice(&data[2..10]);
            *export = Some((
                u64::from_be_bytes(size),
                u16::from_be_bytes([data[10], data[11]]),
            ));
        }
        proto::NBD_INFO_BLOCK_SIZE if data.len() == 14 => {
            *block_size = Some(BlockSize {
                minimum: u32_at(2),
                maximum: u32_at(10),
            });
        }
        proto::NBD_INFO_EXPORT | proto::NBD_INFO_BLOCK_SIZE => {
            return Err(invalid_data(format!(
                "NBD_REP_INFO type {info_type} of {} bytes",
                data.len()
            )));
        }
        _ => {} // Name, description, unknown: ignored.
    }
    Ok(())
}
