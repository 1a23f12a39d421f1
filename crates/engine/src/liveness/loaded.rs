//! The liveness tables a checkpoint names, as open reads them
//! (`recovery::checkpoint::read_tables`): the root decoded, each group's
//! head decoded and its rows left encoded, and compressed when its record
//! is head-first (`cvol_format::tables`).
use crate::dedup::GroupRows;
use crate::error::TableError;
use cvol_format::tables::{GroupHead, TableRoot, PACKED_LEN_BYTES, TABLE_PAYLOAD_MAX_BYTES};
use cvol_format::CodecTag;
use std::sync::Arc;

/// The tables a checkpoint names, read at open.
#[derive(Debug, Clone)]
pub struct LoadedTables {
    pub root: TableRoot,
    pub groups: Vec<LoadedGroup>,
}

/// A group table read at open: its header, and its rows still encoded
/// (and compressed, in a head-first table: `GroupRows`); `load_group`
/// checks and counts them, or takes its counts; the shared table decodes
/// a segment's rows when they are first used.
#[derive(Debug, Clone)]
pub struct LoadedGroup {
    pub head: GroupHead,
    pub payload: Arc<GroupRows>,
}

impl LoadedGroup {
    /// Group table `t` of a volume of `segments` segments from its record
    /// `rec` (payload after `RECORD_HEADER_BYTES`), whose header has
    /// `codec`: lz4, the whole payload compressed (an older table:
    /// decompressed here), or none, head-first (the head decoded, the rows
    /// left compressed: their length is checked, not their bytes).
    pub(crate) fn decode(
        t: usize,
        codec: CodecTag,
        rec: Vec<u8>,
        segments: u64,
    ) -> Result<LoadedGroup, TableError> {
        use cvol_format::record::RECORD_HEADER_BYTES;
        let group = t as u64 - 1;
        let bad = |source| TableError::Group { table: t, source };
        let (head, rows) = match codec {
            CodecTag::Lz4 => {
                let raw = decompress_bounded(t, &rec[RECORD_HEADER_BYTES..])?;
                let head = GroupHead::decode(&raw, group, segments).map_err(bad)?;
                (head, GroupRows::Whole(raw))
            }
            CodecTag::None => {
                GroupRows::head_first(rec, RECORD_HEADER_BYTES, group, segments).map_err(bad)?
            }
            codec => return Err(TableError::Codec { table: t, codec }),
        };
        let payload = Arc::new(rows);
        Ok(LoadedGroup { head, payload })
    }
}

/// The root from its record's payload (header `codec`): lz4 (older
/// tables) or raw.
pub(crate) fn decode_root(
    codec: CodecTag,
    payload: &[u8],
    segments: u64,
) -> Result<TableRoot, TableError> {
    match codec {
        CodecTag::Lz4 => TableRoot::decode(&decompress_bounded(0, payload)?, segments),
        CodecTag::None => TableRoot::decode(payload, segments),
        codec => return Err(TableError::Codec { table: 0, codec }),
    }
    .map_err(TableError::Root)
}

/// The lz4 `payload` of table `t` (its length prepended), refused before
/// any allocation when it claims more than any table written.
fn decompress_bounded(t: usize, payload: &[u8]) -> Result<Vec<u8>, TableError> {
    let claimed = payload
        .get(..PACKED_LEN_BYTES)
        .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize);
    if claimed.is_some_and(|n| n > TABLE_PAYLOAD_MAX_BYTES) {
        let source = cvol_format::FormatError::Invalid("table larger than any written");
        return Err(TableError::Group { table: t, source });
    }
    lz4_flex::block::decompress_size_prepended(payload)
        .map_err(|source| TableError::Decompress { table: t, source })
}
