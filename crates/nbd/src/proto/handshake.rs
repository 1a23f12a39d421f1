//! The handshake: the server greeting, client option headers, option
//! replies and their payloads (`NBD_REP_SERVER`, `NBD_REP_INFO`,
//! `NBD_REP_META_CONTEXT`), the data of `NBD_OPT_INFO`/`NBD_OPT_GO` and of
//! the metadata-context options, and the transmission flags an export
//! advertises.

use super::wire::{be_u32, be_u64, Cursor};
use super::*;

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

/// Whether `query` selects `base:allocation`. `list` allows the `base:`
/// wildcard. Queries in unknown namespaces select nothing (spec: MUST be
/// ignored).
pub fn query_selects_base_allocation(query: &str, list: bool) -> bool {
    query_selects(query, BASE_ALLOCATION, list)
}

/// Whether `query` selects the context `name`: the same name exactly, or,
/// for `NBD_OPT_LIST_META_CONTEXT` (`list`) only, a namespace with an empty
/// leaf that `name` begins with (`"base:"`, `"qemu:"`,
/// `"qemu:dirty-bitmap:"`). The spec: an empty leaf-name is a wildcard when
/// listing but SHOULD NOT select any context for `NBD_OPT_SET_META_CONTEXT`.
pub fn query_selects(query: &str, name: &str, list: bool) -> bool {
    query == name
        || (list && query.ends_with(':') && query_syntax_valid(query) && name.starts_with(query))
}

/// The contexts of `available` (in its order, each once) that `queries`
/// select; for a LIST without queries, all of them (the spec: zero queries
/// list every context the export offers; zero queries in a SET select none).
pub fn select_meta_contexts<'a>(
    available: &'a [String],
    queries: &[String],
    list: bool,
) -> Vec<&'a str> {
    available
        .iter()
        .filter(|name| {
            (list && queries.is_empty()) || queries.iter().any(|q| query_selects(q, name, list))
        })
        .map(String::as_str)
        .collect()
}

/// A query must start with a non-empty namespace followed by a colon.
pub fn query_syntax_valid(query: &str) -> bool {
    matches!(query.find(':'), Some(i) if i > 0)
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
