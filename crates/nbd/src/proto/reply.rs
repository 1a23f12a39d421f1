//! Transmission replies: the simple reply header, structured reply chunks
//! (`NONE`, `ERROR`, `OFFSET_DATA`) and block status (a context's extents
//! merged into wire descriptors, one chunk per selected context).

use super::*;
use crate::{ContextExtent, Extent};

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
    let runs = extents.iter().map(|e| (e.length, extent_status_flags(e)));
    runs_to_descriptors(runs, request_length, req_one, max_descriptors)
}

/// [`extents_to_descriptors`] for the runs of a backend's own context.
pub fn context_extents_to_descriptors(
    extents: &[ContextExtent],
    request_length: u32,
    req_one: bool,
    max_descriptors: usize,
) -> Vec<BlockDescriptor> {
    let runs = extents.iter().map(|e| (e.length, e.flags));
    runs_to_descriptors(runs, request_length, req_one, max_descriptors)
}

/// (length, status flags) runs into wire descriptors, as
/// [`extents_to_descriptors`] describes.
fn runs_to_descriptors(
    runs: impl Iterator<Item = (u64, u32)>,
    request_length: u32,
    req_one: bool,
    max_descriptors: usize,
) -> Vec<BlockDescriptor> {
    let limit = if req_one { 1 } else { max_descriptors.max(1) };
    let mut out: Vec<BlockDescriptor> = Vec::new();
    let mut remaining = u64::from(request_length);
    for (length, status_flags) in runs {
        if remaining == 0 {
            break;
        }
        let take = length.min(remaining);
        if take == 0 {
            continue;
        }
        remaining -= take;
        let take = take as u32; // ≤ request_length, fits
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
    let mut out = Vec::new();
    push_block_status_chunk(
        &mut out,
        NBD_REPLY_FLAG_DONE,
        handle,
        context_id,
        descriptors,
    );
    out
}

/// The whole reply to a BLOCK_STATUS: one `NBD_REPLY_TYPE_BLOCK_STATUS`
/// chunk per (context id, descriptors), in the order given, the last one
/// marked done. With one context it is [`encode_block_status_chunk`].
pub fn encode_block_status_chunks(
    handle: u64,
    contexts: &[(u32, Vec<BlockDescriptor>)],
) -> Vec<u8> {
    assert!(
        !contexts.is_empty(),
        "block status for at least one context"
    );
    let bytes: usize = contexts
        .iter()
        .map(|(_, d)| STRUCTURED_REPLY_HEADER_BYTES + 4 + 8 * d.len())
        .sum();
    let mut out = Vec::with_capacity(bytes);
    for (i, (context_id, descriptors)) in contexts.iter().enumerate() {
        let flags = if i + 1 == contexts.len() {
            NBD_REPLY_FLAG_DONE
        } else {
            0
        };
        push_block_status_chunk(&mut out, flags, handle, *context_id, descriptors);
    }
    out
}

fn push_block_status_chunk(
    out: &mut Vec<u8>,
    flags: u16,
    handle: u64,
    context_id: u32,
    descriptors: &[BlockDescriptor],
) {
    assert!(
        !descriptors.is_empty(),
        "block status needs at least one descriptor"
    );
    let payload_bytes = 4 + 8 * descriptors.len();
    out.reserve(STRUCTURED_REPLY_HEADER_BYTES + payload_bytes);
    let length = u32::try_from(payload_bytes).expect("block status payload fits u32");
    out.extend_from_slice(&encode_chunk_header(
        flags,
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
}
