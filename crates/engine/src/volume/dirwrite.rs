//! What a checkpoint writes of the map's directory: a block's MAP_DIR
//! record (summarized, its list inline or apart), a list kept apart, and
//! what a named directory's commit says of the whole directory
//! (`FLAG_DIR_NAMED`).
use super::State;
use crate::log::Shape;
use cvol_format::checkpoint::{DirName, DirPayload, DirSummary, NamedDir, PageRef};
use cvol_format::record::RecordKind;
use cvol_format::{CodecTag, Superblock};

/// The MAP_DIR record of the directory block at `lba` listing `pages`:
/// summarized (`DirSummary`, codec none: which pages have records and
/// their bytes per segment before the list, so that open reads the list
/// only when first needed), the list after the summary or (`list`) in the
/// record of its own just written (`dir_list_payload`); or, on a volume an
/// older binary may still open, the lz4-compressed list alone.
pub(super) fn dir_record(
    sb: &Superblock,
    lba: u64,
    pages: Vec<(u64, PageRef)>,
    (summarized, list): (bool, Option<PageRef>),
) -> (Shape, Vec<u8>) {
    let summary = summarized.then(|| DirSummary::of(&pages, |o| sb.locate(o).map(|(s, _)| s)));
    let summarized = Shape {
        codec: CodecTag::None,
        ..Shape::map_meta(RecordKind::MapDir, lba)
    };
    match (summary, list) {
        (Some(s), Some(list)) => (summarized, s.encode_apart(&list)),
        (Some(s), None) => (summarized, s.encode(&dir_list_payload(&pages))),
        (None, _) => (
            Shape::map_meta(RecordKind::MapDir, lba),
            dir_list_payload(&pages),
        ),
    }
}

/// A directory block's list of `pages`, lz4-compressed with its length
/// prepended: the payload of an unsummarized MAP_DIR record (codec lz4),
/// and of the record of a list kept apart.
pub(super) fn dir_list_payload(pages: &[(u64, PageRef)]) -> Vec<u8> {
    let raw = DirPayload {
        pages: pages.to_vec(),
    }
    .encode();
    lz4_flex::block::compress_prepend_size(&raw)
}

/// What a named directory's commit says (`FLAG_DIR_NAMED`): the block and
/// seq of each MAP_DIR it names (`dirs`, in block order), and the whole
/// map's allocated pages and records per segment, so that open can leave
/// a block unread.
pub(super) fn named_dir(sb: &Superblock, st: &mut State, dirs: &[(usize, PageRef)]) -> NamedDir {
    let map = st.live.map_mut();
    let (allocated_pages, uses) = map.named_usage(crate::map::Segments::of(sb));
    NamedDir {
        blocks: (dirs.iter())
            .map(|&(b, r)| DirName {
                block: b as u64,
                seq: r.seq,
            })
            .collect(),
        allocated_pages,
        uses,
    }
}
