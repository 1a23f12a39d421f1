//! BLOCK_STATUS: the status of a range in every selected metadata context
//! (`base:allocation` from [`crate::Backend::block_status`], a backend's
//! own from [`crate::Backend::context_status`]), one reply chunk each.

use tracing::warn;

use super::{errno_for, error_reply, guarded, Conn};
use crate::proto::{self, BlockDescriptor, Command};

/// Why a context's status cannot be sent: the error the reply carries.
struct Failure {
    errno: u32,
    message: String,
}

/// The whole reply: one `NBD_REPLY_TYPE_BLOCK_STATUS` chunk per selected
/// context, by ascending id, the last marked done; if any context fails,
/// only the error (as a single error chunk).
pub(super) fn execute(
    conn: &Conn,
    handle: u64,
    cmd: &Command,
    offset: u64,
    length: u32,
    req_one: bool,
) -> Vec<u8> {
    let mut chunks = Vec::with_capacity(conn.meta_contexts.len());
    for context in &conn.meta_contexts {
        match descriptors(conn, cmd, &context.name, offset, length, req_one) {
            Ok(descriptors) => chunks.push((context.id, descriptors)),
            Err(f) => return error_reply(conn, handle, f.errno, &f.message),
        }
    }
    proto::encode_block_status_chunks(handle, &chunks)
}

/// The wire descriptors of [offset, offset+length) in the context `name`.
fn descriptors(
    conn: &Conn,
    cmd: &Command,
    name: &str,
    offset: u64,
    length: u32,
    req_one: bool,
) -> Result<Vec<BlockDescriptor>, Failure> {
    let backend = &*conn.backend;
    let max = proto::MAX_BLOCK_STATUS_DESCRIPTORS;
    let failed = |e| Failure {
        errno: errno_for(e, cmd),
        message: match name {
            proto::BASE_ALLOCATION => format!("block status failed: {e:?}"),
            _ => format!("block status of {name} failed: {e:?}"),
        },
    };
    let descriptors = if name == proto::BASE_ALLOCATION {
        let extents =
            guarded(|| backend.block_status(offset, u64::from(length))).map_err(failed)?;
        proto::extents_to_descriptors(&extents, length, req_one, max)
    } else {
        let extents =
            guarded(|| backend.context_status(name, offset, u64::from(length))).map_err(failed)?;
        proto::context_extents_to_descriptors(&extents, length, req_one, max)
    };
    if descriptors.is_empty() {
        warn!(
            conn = conn.id,
            offset,
            length,
            context = name,
            "backend returned no extents"
        );
        return Err(Failure {
            errno: proto::NBD_EIO,
            message: "backend returned no extents".into(),
        });
    }
    Ok(descriptors)
}
