//! The MAP_DIR records of a checkpoint: one parsed against the volume's
//! directory slots (`parse_dir_body`), a list kept apart from its summary
//! read and checked (`read_lists`, `FLAG_DIR_LIST_APART`), and a record
//! read whole with its list decoded (`read_dir`). Uses only `logread`.
use crate::error::DirError;
use crate::logread::{check_dir_list, read_record, read_records_shared};
use crate::map::{decode_summarized, Segments};
use cvol_format::checkpoint::{ChunkRef, DirList, DirPayload, DirSummary, PageRef};
use cvol_format::checkpoint::{DIR_PAGES, MAP_PAGE_BLOCKS};
use cvol_format::fprints::directory_tables;
use cvol_format::record::{RecordHeader, RecordKind, RECORD_HEADER_BYTES};
use cvol_format::superblock::{FLAG_DIR_LIST_APART, FLAG_DIR_SUMMARY};
use cvol_format::{CodecTag, Superblock};
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

/// What a MAP_DIR record holds past its header: its list, or (a summarized
/// record, `FLAG_DIR_SUMMARY`) its summary and its list still compressed,
/// or its summary and the record of its list (`FLAG_DIR_LIST_APART`).
pub(super) enum DirBody<'a> {
    Pages(Vec<(u64, PageRef)>),
    Summarized(Box<DirSummary>, &'a [u8]),
    Apart(Box<DirSummary>, PageRef),
}

/// The directory block, record and body of the MAP_DIR record `c` names
/// (its header `h`, bytes `rec`), checked against the volume's slots.
pub(super) fn parse_dir_body<'a>(
    sb: &Superblock,
    c: &ChunkRef,
    h: &RecordHeader,
    rec: &'a [u8],
) -> Result<(usize, PageRef, DirBody<'a>), DirError> {
    let block_blocks = DIR_PAGES * MAP_PAGE_BLOCKS;
    if h.kind != RecordKind::MapDir || h.crc != c.crc || !h.lba.is_multiple_of(block_blocks) {
        return Err(DirError::NotNamed { offset: c.offset });
    }
    // Directory slots: the map's pages, then its tables.
    let slots = sb.logical_blocks().div_ceil(MAP_PAGE_BLOCKS)
        + directory_tables(sb.table_segments(), sb.segment_size_bytes);
    if h.lba / MAP_PAGE_BLOCKS >= slots {
        return Err(DirError::BeyondVolume { offset: c.offset });
    }
    let block = h.lba / block_blocks;
    let payload = &rec[RECORD_HEADER_BYTES..];
    let body = match h.codec {
        CodecTag::None if sb.flags & FLAG_DIR_SUMMARY != 0 => {
            let (s, list) = DirSummary::decode(payload).map_err(DirError::Payload)?;
            let last = s.bitmap.iter().enumerate().rev().find(|(_, w)| **w != 0);
            let last = last
                .map(|(i, w)| block * DIR_PAGES + i as u64 * 64 + 63 - w.leading_zeros() as u64);
            if last.is_some_and(|p| p >= slots) {
                return Err(DirError::PageBeyondVolume);
            }
            match list {
                DirList::Inline(list) => DirBody::Summarized(Box::new(s), list),
                DirList::Apart(r) if sb.flags & FLAG_DIR_LIST_APART != 0 => {
                    DirBody::Apart(Box::new(s), r)
                }
                // No binary writes a list apart without the flag.
                DirList::Apart(_) => return Err(DirError::ListNotNamed { offset: c.offset }),
            }
        }
        codec => {
            let raw = match codec {
                CodecTag::Lz4 => lz4_flex::block::decompress_size_prepended(payload)
                    .map_err(DirError::Decompress)?,
                CodecTag::None => payload.to_vec(),
                CodecTag::Zstd => return Err(DirError::Zstd),
            };
            let d = DirPayload::decode(&raw, block).map_err(DirError::Payload)?;
            if d.pages.last().is_some_and(|&(p, _)| p >= slots) {
                return Err(DirError::PageBeyondVolume);
            }
            DirBody::Pages(d.pages)
        }
    };
    let r = PageRef {
        offset: c.offset,
        len: c.len,
        crc: c.crc,
        seq: h.seq,
    };
    Ok((block as usize, r, body))
}
