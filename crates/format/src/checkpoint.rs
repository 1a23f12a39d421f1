//! Checkpoint payloads. A checkpoint is a series of MAP_CHUNK records followed
//! by one CKPT_COMMIT record, all ordinary log records.
//!
//! MAP_CHUNK payload (before the record's codec is applied): a sequence of runs
//! ```text
//! 8  first lba
//! 4  count (n >= 1)
//! 12*n map entries (see mapentry)
//! ```
//! Unmapped blocks are not stored. CKPT_COMMIT payload:
//! ```text
//! 8  snapshot_seq   (the map equals the state after applying every record <= this seq)
//! 8  logical_blocks (sanity check against the superblock)
//! 4  chunk count (c)
//! c * (8 offset, 4 total record length, 4 record crc) locating each MAP_CHUNK record
//! ```
use crate::*;

pub const RUN_HEADER_BYTES: usize = 12;
pub const CHUNK_REF_BYTES: usize = 16;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkRef {
    pub offset: u64,
    pub len: u32,
    pub crc: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitPayload {
    pub snapshot_seq: u64,
    pub logical_blocks: u64,
    pub chunks: Vec<ChunkRef>,
}

impl CommitPayload {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![0u8; 20 + self.chunks.len() * CHUNK_REF_BYTES];
        put_u64(&mut v, 0, self.snapshot_seq);
        put_u64(&mut v, 8, self.logical_blocks);
        put_u32(&mut v, 16, self.chunks.len() as u32);
        for (i, c) in self.chunks.iter().enumerate() {
            let at = 20 + i * CHUNK_REF_BYTES;
            put_u64(&mut v, at, c.offset);
            put_u32(&mut v, at + 8, c.len);
            put_u32(&mut v, at + 12, c.crc);
        }
        v
    }

    pub fn decode(b: &[u8]) -> Result<CommitPayload, FormatError> {
        need(b, 20)?;
        let count = get_u32(b, 16) as usize;
        if b.len() != 20 + count * CHUNK_REF_BYTES {
            return Err(FormatError::Invalid("commit payload length"));
        }
        let chunks = (0..count)
            .map(|i| {
                let at = 20 + i * CHUNK_REF_BYTES;
                ChunkRef {
                    offset: get_u64(b, at),
                    len: get_u32(b, at + 8),
                    crc: get_u32(b, at + 12),
                }
            })
            .collect();
        Ok(CommitPayload {
            snapshot_seq: get_u64(b, 0),
            logical_blocks: get_u64(b, 8),
            chunks,
        })
    }
}

/// Appends one run to a chunk payload being built.
pub fn push_run(out: &mut Vec<u8>, first_lba: u64, entries: &[MapEntry]) {
    assert!(!entries.is_empty());
    let at = out.len();
    out.resize(
        at + RUN_HEADER_BYTES + entries.len() * mapentry::MAP_ENTRY_BYTES,
        0,
    );
    put_u64(out, at, first_lba);
    put_u32(out, at + 8, entries.len() as u32);
    for (i, e) in entries.iter().enumerate() {
        e.encode(&mut out[at + RUN_HEADER_BYTES + i * mapentry::MAP_ENTRY_BYTES..]);
    }
}

/// Decodes a chunk payload, calling `f(lba, entry)` for every stored entry.
/// Entries are validated; LBAs are checked against `logical_blocks`.
pub fn decode_runs(
    mut b: &[u8],
    logical_blocks: u64,
    mut f: impl FnMut(u64, MapEntry),
) -> Result<(), FormatError> {
    while !b.is_empty() {
        need(b, RUN_HEADER_BYTES)?;
        let first = get_u64(b, 0);
        let count = get_u32(b, 8) as usize;
        let bytes = count * mapentry::MAP_ENTRY_BYTES;
        need(b, RUN_HEADER_BYTES + bytes)?;
        if count == 0
            || first
                .checked_add(count as u64)
                .is_none_or(|end| end > logical_blocks)
        {
            return Err(FormatError::Invalid("map run out of range"));
        }
        for i in 0..count {
            let at = RUN_HEADER_BYTES + i * mapentry::MAP_ENTRY_BYTES;
            f(first + i as u64, MapEntry::decode(&b[at..])?);
        }
        b = &b[RUN_HEADER_BYTES + bytes..];
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_roundtrip() {
        let c = CommitPayload {
            snapshot_seq: 9,
            logical_blocks: 1 << 20,
            chunks: vec![
                ChunkRef {
                    offset: 1 << 20,
                    len: 500,
                    crc: 1,
                },
                ChunkRef {
                    offset: 2 << 20,
                    len: 7,
                    crc: 2,
                },
            ],
        };
        assert_eq!(CommitPayload::decode(&c.encode()).unwrap(), c);
        assert!(CommitPayload::decode(&c.encode()[..30]).is_err());
    }

    #[test]
    fn runs_roundtrip_and_bounds() {
        let mut v = Vec::new();
        let e = MapEntry::data(CodecTag::Lz4, 4096, 100, 5);
        push_run(&mut v, 10, &[e, MapEntry::ZERO]);
        push_run(&mut v, 100, &[e]);
        let mut got = Vec::new();
        decode_runs(&v, 101, |l, e| got.push((l, e))).unwrap();
        assert_eq!(got, vec![(10, e), (11, MapEntry::ZERO), (100, e)]);
        assert!(decode_runs(&v, 100, |_, _| {}).is_err());
        assert!(decode_runs(&v[..v.len() - 1], 101, |_, _| {}).is_err());
    }
}
