//! The MAP_DIR records of a checkpoint: one parsed against the volume's
//! directory slots (`logread::parse_dir_body`), a list kept apart from its summary
//! read and checked (`read_lists`, `FLAG_DIR_LIST_APART`), and a record
//! read whole with its list decoded (`read_dir`), and a named directory's
//! totals checked against the blocks read (`named_matches`). Uses only
//! `logread` and the map.
use crate::error::{CheckpointError, DirError};
use crate::logread::{check_dir_list, read_record, read_records_shared};
pub(super) use crate::logread::{parse_dir_body, DirBody};
use crate::map::{decode_summarized, BlockMap, Segments};
use cvol_format::checkpoint::{ChunkRef, CommitPayload, DirSummary, NamedDir, PageRef, SegmentUse};
use cvol_format::record::RECORD_HEADER_BYTES;
use cvol_format::Superblock;
use cvol_storage::Storage;

/// A directory block read: its record, the record of its list when the
/// list lies apart, and the pages it lists.
pub(super) struct DirRead {
    pub(super) record: PageRef,
    pub(super) list: Option<PageRef>,
    pub(super) pages: Vec<(u64, PageRef)>,
}

/// One MAP_DIR record a commit names, verified: its directory block, its
/// reference, and the pages it lists (a list kept apart read too).
pub(super) fn read_dir(
    storage: &dyn Storage,
    sb: &Superblock,
    c: &ChunkRef,
) -> Result<DirRead, DirError> {
    let (h, rec) = read_record(storage, sb, c.offset, c.len).map_err(DirError::Record)?;
    let (block, record, body) = parse_dir_body(sb, c, &h, &rec)?;
    let (pages, list) = match body {
        DirBody::Pages(pages) => (pages, None),
        DirBody::Summarized(s, list) => {
            let d = decode_summarized(block as u64, &s, list, Segments::of(sb));
            (d.map_err(DirError::Summary)?.pages, None)
        }
        DirBody::Apart(s, r) => {
            let pages = read_lists(storage, sb, &[(block, &s, r)]).remove(0)?;
            (pages, Some(r))
        }
    };
    Ok(DirRead {
        record,
        list,
        pages,
    })
}

/// The lists kept apart of directory blocks (block, its summary, the
/// record its summary names), read together (lists a checkpoint wrote lie
/// side by side), each checked (`check_dir_list`) and decoded against its
/// summary: the pages each lists, in the order asked.
pub(super) fn read_lists(
    storage: &dyn Storage,
    sb: &Superblock,
    lists: &[(usize, &DirSummary, PageRef)],
) -> Vec<Result<Vec<(u64, PageRef)>, DirError>> {
    let at: Vec<(u64, u32)> = lists.iter().map(|(_, _, r)| (r.offset, r.len)).collect();
    let read = read_records_shared(storage, sb, &at);
    (lists.iter().zip(read))
        .map(|(&(block, summary, r), rec)| {
            let (h, rec) = rec.map_err(DirError::Record)?;
            check_dir_list(&h, block as u64, &r)?;
            let list = &rec[RECORD_HEADER_BYTES..];
            let d = decode_summarized(block as u64, summary, list, Segments::of(sb));
            Ok(d.map_err(DirError::Summary)?.pages)
        })
        .collect()
}

/// Checks what a named directory's commit says against its map read
/// whole (`cvol check`): the block and seq of each MAP_DIR, the pages
/// with records and the bytes per segment the directory names. A lazy
/// open trusts them (they are covered by the commit's crc): a difference
/// is a bug, which the checkpoint is refused for.
pub(super) fn named_matches(
    sb: &Superblock,
    commit: &CommitPayload,
    named: &NamedDir,
    map: &mut BlockMap,
) -> Result<(), CheckpointError> {
    let bad = |why: &str| Err(CheckpointError::NamedDir(why.to_string()));
    let dirs = map.dir_records().unwrap_or_default();
    let names = (commit.chunks.iter().zip(&named.blocks))
        .map(|(c, n)| (n.block as usize, page_ref(c, n.seq)));
    if !dirs.iter().copied().eq(names) {
        return bad("its blocks are not the records it names");
    }
    let (pages, uses) = map.named_usage(Segments::of(sb));
    if pages != named.allocated_pages {
        return bad(&format!(
            "it names {} pages with records, its blocks {pages}",
            named.allocated_pages
        ));
    }
    // The bytes per segment exactly; the highest seq no lower than the
    // blocks' (a bound: a checkpoint written while blocks were left
    // unread keeps the highest seq they had when open named them, which a
    // block read and rewritten since may have lowered).
    let bytes = |u: &[SegmentUse]| u.iter().map(|u| (u.segment, u.bytes)).collect::<Vec<_>>();
    if bytes(&uses) != bytes(&named.uses) {
        return bad("its bytes per segment are not its blocks'");
    }
    if let Some((n, b)) = (named.uses.iter().zip(&uses)).find(|(n, b)| n.max_seq < b.max_seq) {
        return bad(&format!(
            "it names seq {} as the highest in segment {}, its blocks hold seq {}",
            n.max_seq, n.segment, b.max_seq
        ));
    }
    Ok(())
}

/// The reference to the MAP_DIR record `c` names, of seq `seq`.
pub(super) fn page_ref(c: &ChunkRef, seq: u64) -> PageRef {
    PageRef {
        offset: c.offset,
        len: c.len,
        crc: c.crc,
        seq,
    }
}
