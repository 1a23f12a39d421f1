//! Fixed-newstyle handshake (option haggling).

use std::io::{self, BufRead, BufReader, Read};
use std::time::Instant;

use tracing::{debug, warn};

use super::socket::Socket;
use super::{remaining, Inner, SocketReader};
use crate::proto;
use crate::tls::TlsMode;
use crate::Export;

/// Most options a client may send before entering transmission.
const MAX_OPTIONS_PER_CONNECTION: usize = 256;
/// Oversized option payloads up to this size are skipped and answered with
/// `NBD_REP_ERR_TOO_BIG`; larger ones end the connection.
const MAX_DISCARDED_OPTION_BYTES: u32 = 1024 * 1024;

/// What the handshake settled for the transmission phase.
#[derive(Debug, Clone)]
pub(crate) struct Negotiated {
    /// The export chosen; the connection keeps it until it closes.
    pub(crate) export: Export,
    pub(crate) size_bytes: u64,
    pub(crate) transmission_flags: u16,
    pub(crate) structured_replies: bool,
    /// The metadata contexts selected for this export, by ascending id
    /// (`base:allocation` first, if selected).
    pub(crate) meta_contexts: Vec<MetaContext>,
}

/// A metadata context selected by `NBD_OPT_SET_META_CONTEXT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MetaContext {
    /// The id its BLOCK_STATUS chunks carry.
    pub(crate) id: u32,
    /// Its full name: `base:allocation` (the server's own) or one the
    /// backend offers.
    pub(crate) name: String,
}

/// Per-connection handshake state.
struct Haggle<'a> {
    inner: &'a Inner,
    socket: &'a Socket,
    conn: u64,
    deadline: Instant,
    fixed_newstyle: bool,
    no_zeroes: bool,
    structured_replies: bool,
    /// The contexts the last `NBD_OPT_SET_META_CONTEXT` selected.
    meta_contexts: Vec<MetaContext>,
    /// The canonical name of the export the last `NBD_OPT_SET_META_CONTEXT`
    /// referred to: its contexts hold only if the same export is chosen.
    meta_context_export: Option<String>,
}

/// Outcome of one option: the handshake goes on, or transmission begins.
enum Step {
    Continue,
    /// `NBD_OPT_STARTTLS` was acknowledged: the TLS handshake comes next.
    StartTls,
    Transmission(Negotiated),
}

/// Why a handshake ends without entering transmission (the connection
/// closes).
#[derive(Debug)]
pub(crate) enum HandshakeError {
    /// The client sent `NBD_OPT_ABORT` (acknowledged).
    Aborted,
    /// Client flags this server does not know.
    UnknownClientFlags(u32),
    /// An option header without `IHAVEOPT`.
    BadOptionMagic,
    /// A client without fixed newstyle sent an option other than
    /// `NBD_OPT_EXPORT_NAME`.
    NotFixedNewstyle,
    /// An option payload too large to skip, or an oversized
    /// `NBD_OPT_EXPORT_NAME` (logged where found, as every oversized option).
    OversizedOption,
    /// `NBD_OPT_EXPORT_NAME` for an export this server does not serve.
    UnknownExport,
    /// More than `MAX_OPTIONS_PER_CONNECTION` options.
    TooManyOptions,
    /// `NBD_OPT_EXPORT_NAME` before TLS on a server that requires it (the
    /// option has no error reply: the connection closes).
    TlsRequired,
    /// The TLS handshake failed (bad or missing client certificate, not
    /// TLS at all, timeout); the TLS alert, if any, has been sent.
    Tls(io::Error),
    /// The socket failed, the client went away or the deadline passed.
    Io(io::Error),
}

impl From<io::Error> for HandshakeError {
    fn from(e: io::Error) -> Self {
        HandshakeError::Io(e)
    }
}

impl HandshakeError {
    /// Logs why: protocol violations as warnings, I/O at debug (an abort
    /// and an oversized option not here).
    pub(crate) fn log(&self, conn: u64) {
        match self {
            HandshakeError::Aborted | HandshakeError::OversizedOption => {}
            HandshakeError::UnknownClientFlags(client_flags) => {
                warn!(conn, client_flags, "unknown client flags, closing")
            }
            HandshakeError::BadOptionMagic => warn!(conn, "bad option magic, closing"),
            HandshakeError::NotFixedNewstyle => warn!(
                conn,
                "non-fixed-newstyle client sent an option other than EXPORT_NAME"
            ),
            HandshakeError::UnknownExport => {
                warn!(conn, "NBD_OPT_EXPORT_NAME for an unknown export, closing")
            }
            HandshakeError::TooManyOptions => warn!(conn, "too many options, closing"),
            HandshakeError::TlsRequired => {
                warn!(
                    conn,
                    "NBD_OPT_EXPORT_NAME without TLS, which is required: closing"
                )
            }
            HandshakeError::Tls(e) => warn!(conn, error = %e, "TLS handshake failed, closing"),
            HandshakeError::Io(e) => debug!(conn, error = %e, "handshake ended"),
        }
    }
}

/// Sends during the handshake, waiting at most until `deadline`.
fn send_by(socket: &Socket, deadline: Instant, bytes: &[u8]) -> io::Result<()> {
    socket.set_write_timeout(Some(remaining(deadline)?))?;
    socket.send_all(bytes)
}

/// Runs the handshake; it must be over by `deadline` (the reader enforces it
/// for reads, `send_by` for sends). An error says why the session ended
/// without entering transmission.
pub(crate) fn negotiate(
    inner: &Inner,
    socket: &Socket,
    reader: &mut BufReader<SocketReader>,
    conn: u64,
    deadline: Instant,
) -> Result<Negotiated, HandshakeError> {
    send_by(
        socket,
        deadline,
        &proto::encode_greeting(proto::NBD_FLAG_FIXED_NEWSTYLE | proto::NBD_FLAG_NO_ZEROES),
    )?;
    let mut flag_bytes = [0u8; 4];
    reader.read_exact(&mut flag_bytes)?;
    let client_flags = u32::from_be_bytes(flag_bytes);
    if !proto::client_flags_valid(client_flags) {
        return Err(HandshakeError::UnknownClientFlags(client_flags));
    }
    let mut haggle = Haggle {
        inner,
        socket,
        conn,
        deadline,
        fixed_newstyle: client_flags & proto::NBD_FLAG_C_FIXED_NEWSTYLE != 0,
        no_zeroes: client_flags & proto::NBD_FLAG_C_NO_ZEROES != 0,
        structured_replies: false,
        meta_contexts: Vec::new(),
        meta_context_export: None,
    };
    if !haggle.fixed_newstyle {
        debug!(
            conn,
            "client did not set fixed newstyle; only NBD_OPT_EXPORT_NAME accepted"
        );
    }
    for _ in 0..MAX_OPTIONS_PER_CONNECTION {
        let step = match haggle.next_option(reader)? {
            Step::StartTls => haggle.start_tls(reader)?,
            step => step,
        };
        match step {
            Step::Continue | Step::StartTls => {}
            Step::Transmission(n) => return Ok(n),
        }
    }
    Err(HandshakeError::TooManyOptions)
}

impl Haggle<'_> {
    fn next_option(&mut self, reader: &mut impl Read) -> Result<Step, HandshakeError> {
        let mut header_bytes = [0u8; proto::OPTION_HEADER_BYTES];
        reader.read_exact(&mut header_bytes)?;
        let header = proto::parse_option_header(&header_bytes)
            .map_err(|_| HandshakeError::BadOptionMagic)?;
        debug!(
            conn = self.conn,
            option = header.option,
            length_bytes = header.length_bytes,
            "option"
        );
        if !self.fixed_newstyle && header.option != proto::NBD_OPT_EXPORT_NAME {
            return Err(HandshakeError::NotFixedNewstyle);
        }
        if header.length_bytes > proto::MAX_OPTION_PAYLOAD_BYTES {
            return self.oversized_option(reader, header);
        }
        let mut data = vec![0u8; header.length_bytes as usize];
        reader.read_exact(&mut data)?;
        self.handle_option(header.option, &data)
    }

    fn oversized_option(
        &mut self,
        reader: &mut impl Read,
        header: proto::OptionHeader,
    ) -> Result<Step, HandshakeError> {
        warn!(
            conn = self.conn,
            option = header.option,
            length_bytes = header.length_bytes,
            "oversized option"
        );
        if header.option == proto::NBD_OPT_EXPORT_NAME
            || header.length_bytes > MAX_DISCARDED_OPTION_BYTES
        {
            return Err(HandshakeError::OversizedOption);
        }
        let skipped = io::copy(
            &mut reader.take(u64::from(header.length_bytes)),
            &mut io::sink(),
        )?;
        if skipped != u64::from(header.length_bytes) {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
        }
        self.reply_error(
            header.option,
            proto::NBD_REP_ERR_TOO_BIG,
            "option data too large",
        )?;
        Ok(Step::Continue)
    }

    /// The server's TLS mode, if it offers TLS.
    fn tls_mode(&self) -> Option<TlsMode> {
        self.inner.config.tls.as_ref().map(|t| t.mode)
    }

    fn handle_option(&mut self, option: u32, data: &[u8]) -> Result<Step, HandshakeError> {
        let tls_required = self.tls_mode() == Some(TlsMode::Require) && !self.socket.is_tls();
        if tls_required && !matches!(option, proto::NBD_OPT_STARTTLS | proto::NBD_OPT_ABORT) {
            if option == proto::NBD_OPT_EXPORT_NAME {
                return Err(HandshakeError::TlsRequired);
            }
            debug!(
                conn = self.conn,
                option, "option before TLS, which is required"
            );
            self.reply_error(
                option,
                proto::NBD_REP_ERR_TLS_REQD,
                "TLS is required: use NBD_OPT_STARTTLS first",
            )?;
            return Ok(Step::Continue);
        }
        match option {
            proto::NBD_OPT_EXPORT_NAME => self.export_name(data),
            proto::NBD_OPT_ABORT => {
                // The client may already be gone; ignore send errors.
                let _ = self.reply(option, proto::NBD_REP_ACK, &[]);
                Err(HandshakeError::Aborted)
            }
            proto::NBD_OPT_LIST => self.list(data),
            proto::NBD_OPT_STARTTLS => self.starttls(data),
            proto::NBD_OPT_INFO | proto::NBD_OPT_GO => self.info_or_go(option, data),
            proto::NBD_OPT_STRUCTURED_REPLY => self.structured_reply(data),
            proto::NBD_OPT_LIST_META_CONTEXT | proto::NBD_OPT_SET_META_CONTEXT => {
                self.meta_context(option, data)
            }
            _ => {
                debug!(conn = self.conn, option, "unsupported option");
                self.reply_error(option, proto::NBD_REP_ERR_UNSUP, "option not supported")?;
                Ok(Step::Continue)
            }
        }
    }

    fn starttls(&mut self, data: &[u8]) -> Result<Step, HandshakeError> {
        let option = proto::NBD_OPT_STARTTLS;
        let (problem, message) = if !data.is_empty() {
            (proto::NBD_REP_ERR_INVALID, "STARTTLS takes no data")
        } else if self.tls_mode().is_none() {
            (
                proto::NBD_REP_ERR_POLICY,
                "TLS is not enabled on this server",
            )
        } else if self.socket.is_tls() {
            (proto::NBD_REP_ERR_INVALID, "TLS is already in use")
        } else {
            self.reply(option, proto::NBD_REP_ACK, &[])?;
            return Ok(Step::StartTls);
        };
        self.reply_error(option, problem, message)?;
        Ok(Step::Continue)
    }

    /// Runs the TLS handshake after the acknowledged `STARTTLS`. What was
    /// negotiated in the clear is forgotten (the spec: the client must
    /// negotiate again over TLS).
    fn start_tls(&mut self, reader: &mut BufReader<SocketReader>) -> Result<Step, HandshakeError> {
        let Some(tls) = &self.inner.config.tls else {
            return Err(HandshakeError::Io(io::Error::other("TLS without settings")));
        };
        // Bytes the client sent without waiting for the acknowledgement.
        let early = reader.buffer().to_vec();
        reader.consume(early.len());
        self.socket
            .start_tls(tls.credentials.current(), &early)
            .and_then(|()| self.socket.finish_tls_handshake(self.deadline))
            .map_err(HandshakeError::Tls)?;
        debug!(conn = self.conn, "TLS started");
        self.structured_replies = false;
        self.meta_contexts.clear();
        self.meta_context_export = None;
        Ok(Step::Continue)
    }

    fn reply(&self, option: u32, reply_type: u32, data: &[u8]) -> io::Result<()> {
        let bytes = proto::encode_option_reply(option, reply_type, data);
        send_by(self.socket, self.deadline, &bytes)
    }

    fn reply_error(&self, option: u32, reply_type: u32, message: &str) -> io::Result<()> {
        debug_assert!(reply_type & (1 << 31) != 0, "error replies have bit 31 set");
        self.reply(option, reply_type, message.as_bytes())
    }

    /// The export served under `name` now ("" = the default export).
    fn lookup(&self, name: &str) -> Option<Export> {
        let export = self.inner.exports.lookup(name);
        if export.is_none() {
            debug!(conn = self.conn, export = %name, "unknown export");
        }
        export
    }

    /// What transmission with `export` would be. The metadata contexts
    /// selected hold only if they were selected for the same export.
    fn negotiated(&self, export: Export) -> Negotiated {
        let backend = &export.backend;
        let same_export = self.meta_context_export.as_deref() == Some(export.name.as_str());
        Negotiated {
            size_bytes: backend.size_bytes(),
            transmission_flags: proto::transmission_flags(
                backend.read_only(),
                self.structured_replies,
            ),
            structured_replies: self.structured_replies,
            meta_contexts: match same_export {
                true => self.meta_contexts.clone(),
                false => Vec::new(),
            },
            export,
        }
    }

    fn export_name(&mut self, data: &[u8]) -> Result<Step, HandshakeError> {
        let Ok(name) = proto::parse_string(data) else {
            return Err(HandshakeError::UnknownExport);
        };
        let Some(export) = self.lookup(&name) else {
            return Err(HandshakeError::UnknownExport);
        };
        let negotiated = self.negotiated(export);
        let reply = proto::encode_export_name_reply(
            negotiated.size_bytes,
            negotiated.transmission_flags,
            self.no_zeroes,
        );
        send_by(self.socket, self.deadline, &reply)?;
        debug!(conn = self.conn, export = %name, "entering transmission (EXPORT_NAME)");
        Ok(Step::Transmission(negotiated))
    }

    fn list(&mut self, data: &[u8]) -> Result<Step, HandshakeError> {
        if !data.is_empty() {
            self.reply_error(
                proto::NBD_OPT_LIST,
                proto::NBD_REP_ERR_INVALID,
                "LIST takes no data",
            )?;
            return Ok(Step::Continue);
        }
        for (name, description) in self.inner.exports.list() {
            let server = proto::encode_rep_server(&name, description.as_deref());
            self.reply(proto::NBD_OPT_LIST, proto::NBD_REP_SERVER, &server)?;
        }
        self.reply(proto::NBD_OPT_LIST, proto::NBD_REP_ACK, &[])?;
        Ok(Step::Continue)
    }

    fn structured_reply(&mut self, data: &[u8]) -> Result<Step, HandshakeError> {
        if !data.is_empty() {
            let msg = "STRUCTURED_REPLY takes no data";
            self.reply_error(
                proto::NBD_OPT_STRUCTURED_REPLY,
                proto::NBD_REP_ERR_INVALID,
                msg,
            )?;
            return Ok(Step::Continue);
        }
        self.structured_replies = true;
        self.reply(proto::NBD_OPT_STRUCTURED_REPLY, proto::NBD_REP_ACK, &[])?;
        Ok(Step::Continue)
    }

    fn info_or_go(&mut self, option: u32, data: &[u8]) -> Result<Step, HandshakeError> {
        let request = match proto::parse_info_request(data) {
            Ok(r) => r,
            Err(e) => {
                warn!(conn = self.conn, error = ?e, "malformed INFO/GO request");
                self.reply_error(option, proto::NBD_REP_ERR_INVALID, "malformed request")?;
                return Ok(Step::Continue);
            }
        };
        let Some(export) = self.lookup(&request.export_name) else {
            self.reply_error(option, proto::NBD_REP_ERR_UNKNOWN, "unknown export")?;
            return Ok(Step::Continue);
        };
        let negotiated = self.negotiated(export);
        self.send_infos(option, &request.info_types, &negotiated)?;
        self.reply(option, proto::NBD_REP_ACK, &[])?;
        if option == proto::NBD_OPT_GO {
            debug!(conn = self.conn, export = %request.export_name, "entering transmission (GO)");
            return Ok(Step::Transmission(negotiated));
        }
        Ok(Step::Continue)
    }

    fn send_infos(
        &self,
        option: u32,
        requested: &[u16],
        negotiated: &Negotiated,
    ) -> io::Result<()> {
        let config = &self.inner.config;
        let export =
            proto::encode_info_export(negotiated.size_bytes, negotiated.transmission_flags);
        self.reply(option, proto::NBD_REP_INFO, &export)?;
        // Sent unasked: the maximum differs from the spec's default.
        let block_size = proto::encode_info_block_size(
            proto::MINIMUM_BLOCK_BYTES,
            proto::PREFERRED_BLOCK_BYTES,
            config.max_request_bytes,
        );
        self.reply(option, proto::NBD_REP_INFO, &block_size)?;
        let export = &negotiated.export;
        if requested.contains(&proto::NBD_INFO_NAME) {
            let name = proto::encode_info_string(proto::NBD_INFO_NAME, &export.name);
            self.reply(option, proto::NBD_REP_INFO, &name)?;
        }
        if let (true, Some(text)) = (
            requested.contains(&proto::NBD_INFO_DESCRIPTION),
            &export.description,
        ) {
            let description = proto::encode_info_string(proto::NBD_INFO_DESCRIPTION, text);
            self.reply(option, proto::NBD_REP_INFO, &description)?;
        }
        Ok(())
    }

    fn meta_context(&mut self, option: u32, data: &[u8]) -> Result<Step, HandshakeError> {
        let set = option == proto::NBD_OPT_SET_META_CONTEXT;
        if set {
            // SET replaces the previous selection, even when it fails.
            self.meta_contexts.clear();
            self.meta_context_export = None;
        }
        if !self.structured_replies {
            let msg = "structured replies must be negotiated first";
            self.reply_error(option, proto::NBD_REP_ERR_INVALID, msg)?;
            return Ok(Step::Continue);
        }
        let request = match proto::parse_meta_context_request(data) {
            Ok(r) => r,
            Err(e) => {
                warn!(conn = self.conn, error = ?e, "malformed meta context request");
                self.reply_error(
                    option,
                    proto::NBD_REP_ERR_INVALID,
                    "malformed meta context request",
                )?;
                return Ok(Step::Continue);
            }
        };
        let Some(export) = self.lookup(&request.export_name) else {
            self.reply_error(option, proto::NBD_REP_ERR_UNKNOWN, "unknown export")?;
            return Ok(Step::Continue);
        };
        let available = available_contexts(&export);
        let selected = proto::select_meta_contexts(&available, &request.queries, !set);
        let mut next_id = proto::BASE_ALLOCATION_CONTEXT_ID + 1;
        for name in selected {
            // LIST replies carry id 0 (the spec: ids are only for SET).
            let id = match (set, name == proto::BASE_ALLOCATION) {
                (false, _) => 0,
                (true, true) => proto::BASE_ALLOCATION_CONTEXT_ID,
                (true, false) => {
                    next_id += 1;
                    next_id - 1
                }
            };
            let payload = proto::encode_meta_context(id, name);
            self.reply(option, proto::NBD_REP_META_CONTEXT, &payload)?;
            if set {
                let name = name.to_owned();
                self.meta_contexts.push(MetaContext { id, name });
            }
        }
        if set {
            self.meta_context_export = Some(export.name);
        }
        self.reply(option, proto::NBD_REP_ACK, &[])?;
        Ok(Step::Continue)
    }
}

/// The contexts `export` offers now: `base:allocation`, then the backend's
/// (each once; one that is not `namespace:leaf`, or too long to send as a
/// string, is left out).
fn available_contexts(export: &Export) -> Vec<String> {
    let mut available = vec![proto::BASE_ALLOCATION.to_owned()];
    for name in export.backend.meta_contexts() {
        let valid = proto::query_syntax_valid(&name) && name.len() <= proto::MAX_STRING_BYTES;
        if valid && !available.contains(&name) {
            available.push(name);
        } else {
            debug!(context = %name, "backend context left out (invalid or repeated)");
        }
    }
    available
}
