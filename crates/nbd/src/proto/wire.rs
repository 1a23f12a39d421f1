//! Big-endian reads and a cursor over client bytes that never reads out of
//! bounds; NBD strings.

use super::{ProtoError, MAX_STRING_BYTES};

pub(super) fn be_u16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
pub(super) fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
pub(super) fn be_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// A cursor over a client message that never reads out of bounds.
pub(super) struct Cursor<'a> {
    pub(super) rest: &'a [u8],
}

impl<'a> Cursor<'a> {
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], ProtoError> {
        if self.rest.len() < n {
            return Err(ProtoError::Malformed);
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }
    pub(super) fn u16(&mut self) -> Result<u16, ProtoError> {
        self.take(2).map(be_u16)
    }
    pub(super) fn u32(&mut self) -> Result<u32, ProtoError> {
        self.take(4).map(be_u32)
    }
    /// A string prefixed with a 32-bit length.
    pub(super) fn string32(&mut self) -> Result<String, ProtoError> {
        let length_bytes = self.u32()? as usize;
        if length_bytes > MAX_STRING_BYTES {
            return Err(ProtoError::BadString);
        }
        parse_string(self.take(length_bytes)?)
    }
    pub(super) fn finish(self) -> Result<(), ProtoError> {
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
