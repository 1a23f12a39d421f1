//! Reading records back from the store, for every room that reads the log
//! after it was written: the empty map of a volume (`volume_map`), one
//! verified record at a place a map entry, pointer or directory names
//! (`read_record`, several at once `read_records`), where a data entry may point (`check_entry_location`),
//! and the map pages of the log (`LogPages`, the map's `PageSource`).
//!
//! It depends on `error`, `map` and `cvol-format`/`cvol-storage` only, so
//! `liveness`, `recovery`, `check` and the volume share it without
//! depending on each other.
use crate::error::{ChunkError, DirError, EntryLocationError, MetaError, RecordError};
use crate::map::{BlockMap, DirLoaded, PageSource, SharedBytes};
use cvol_format::checkpoint::{decode_runs, ChunkRef, DirList, DirPayload, DirSummary, PageRef};
use cvol_format::checkpoint::{DIR_PAGES, MAP_PAGE_BLOCKS};
use cvol_format::fprints::directory_tables;
use cvol_format::record::{RecordHeader, RecordKind, RECORD_HEADER_BYTES};
use cvol_format::seal;
use cvol_format::superblock::{FLAG_DIR_LIST_APART, FLAG_DIR_SUMMARY};
use cvol_format::{CodecTag, EntryState, MapEntry, Superblock};
use cvol_storage::Storage;
use std::sync::Arc;

/// An empty map of the volume, with directory slots for its tables.
pub(crate) fn volume_map(sb: &Superblock) -> BlockMap {
    let tables = directory_tables(sb.table_segments(), sb.segment_size_bytes);
    BlockMap::with_tables(sb.logical_blocks(), tables as usize)
}

/// Reads and verifies one whole record at a physical offset.
pub(crate) fn read_record(
    storage: &dyn Storage,
    sb: &Superblock,
    offset: u64,
    len: u32,
) -> Result<(RecordHeader, Vec<u8>), RecordError> {
    record_bounds(sb, offset, len)?;
    let mut b = vec![0u8; len as usize];
    storage.read_at(offset, &mut b).map_err(RecordError::Read)?;
    verify_record(sb, b)
}

/// `read_record` for each of `at` (offset, length), in that order; records
/// that lie close together in one segment (a checkpoint's page records
/// are written side by side) are read with one read of the store. A
/// read that fails is retried record by record, so that each record's
/// result is its own.
pub(crate) fn read_records(
    storage: &dyn Storage,
    sb: &Superblock,
    at: &[(u64, u32)],
) -> Vec<Result<(RecordHeader, Vec<u8>), RecordError>> {
    (read_records_shared(storage, sb, at).into_iter())
        .map(|r| r.map(|(h, b)| (h, b.into_vec())))
        .collect()
}

/// `read_records`, each record's bytes left in the buffer it was read
/// into with its neighbours (what open keeps of thousands of directory
/// blocks, without a copy of each).
pub(crate) fn read_records_shared(
    storage: &dyn Storage,
    sb: &Superblock,
    at: &[(u64, u32)],
) -> Vec<Result<(RecordHeader, SharedBytes), RecordError>> {
    /// The most one read takes, and the widest hole it reads over.
    const SPAN_BYTES: u64 = 4 << 20;
    const GAP_BYTES: u64 = 64 << 10;
    let segment = |o: u64| (o - sb.data_offset_bytes) / sb.segment_size_bytes;
    let mut order: Vec<usize> = (0..at.len()).collect();
    order.sort_unstable_by_key(|&i| at[i].0);
    let mut out: Vec<Option<_>> = (0..at.len()).map(|_| None).collect();
    let one =
        |o: u64, l: u32| read_record(storage, sb, o, l).map(|(h, b)| (h, SharedBytes::owned(b)));
    let mut i = 0;
    while i < order.len() {
        let (first, len) = at[order[i]];
        if record_bounds(sb, first, len).is_err() {
            out[order[i]] = Some(one(first, len));
            i += 1;
            continue;
        }
        let (mut end, mut j) = (first + u64::from(len), i + 1);
        while let Some(&(o, l)) = order.get(j).map(|&k| &at[k]) {
            let next_end = o + u64::from(l);
            if record_bounds(sb, o, l).is_err()
                || segment(o) != segment(first)
                || o > end + GAP_BYTES
                || next_end - first > SPAN_BYTES
            {
                break;
            }
            (end, j) = (end.max(next_end), j + 1);
        }
        let mut buf = vec![0u8; (end - first) as usize];
        let read = storage.read_at(first, &mut buf).is_ok();
        // Records that fill most of what was read share it; sparse ones
        // (holes read over) are copied out, so that a record kept does
        // not keep the holes around it.
        let used: u64 = order[i..j].iter().map(|&k| u64::from(at[k].1)).sum();
        let share = used * 2 >= end - first;
        let buf = Arc::new(buf);
        for &k in &order[i..j] {
            let (o, l) = at[k];
            let range = (o - first) as usize..(o - first) as usize + l as usize;
            let bytes = match share {
                true => SharedBytes::new(buf.clone(), range),
                false => SharedBytes::owned(buf[range].to_vec()),
            };
            out[k] = Some(match read {
                true => verify_shared(sb, bytes),
                false => one(o, l),
            });
        }
        i = j;
    }
    out.into_iter()
        .map(|r| r.expect("every record read"))
        .collect()
}

/// Where a record may lie: inside one segment of the data area.
fn record_bounds(sb: &Superblock, offset: u64, len: u32) -> Result<(), RecordError> {
    let seg_rel = offset
        .checked_sub(sb.data_offset_bytes)
        .ok_or(RecordError::InMetadataArea)?;
    if (len as usize) < RECORD_HEADER_BYTES
        || seg_rel / sb.segment_size_bytes >= sb.segment_count()
        || seg_rel % sb.segment_size_bytes + u64::from(len) > sb.segment_size_bytes
    {
        return Err(RecordError::CrossesSegment { offset, len });
    }
    if offset
        .checked_add(u64::from(len))
        .is_none_or(|end| end > sb.segment_offset_end())
    {
        return Err(RecordError::BeyondPhysicalSize { offset, len });
    }
    Ok(())
}

/// A record's bytes (read, or taken from the log's buffer), checked: its
/// header and payload crc, this volume's tag, and its whole length. On an
/// encrypted volume the payload is opened (authenticated and decrypted):
/// the bytes returned are the header's, then the payload in the clear, so
/// `rec[RECORD_HEADER_BYTES..]` is always the content (and `h.plain_len()`
/// long).
pub(crate) fn verify_record(
    sb: &Superblock,
    b: Vec<u8>,
) -> Result<(RecordHeader, Vec<u8>), RecordError> {
    verify_shared(sb, SharedBytes::owned(b)).map(|(h, b)| (h, b.into_vec()))
}

/// `verify_record` of bytes that may share their buffer: left where they
/// are unless sealed.
fn verify_shared(
    sb: &Superblock,
    b: SharedBytes,
) -> Result<(RecordHeader, SharedBytes), RecordError> {
    let (h, _) = RecordHeader::decode_verified(&b).map_err(RecordError::Invalid)?;
    if h.volume_tag != sb.volume_tag() || h.total_len() != b.len() {
        return Err(RecordError::NotExpected);
    }
    if sb.sealer().is_none() && !h.sealed {
        return Ok((h, b));
    }
    let plain = seal::payload(sb.sealer(), &h, &b).map_err(RecordError::Invalid)?;
    let mut rec = Vec::with_capacity(RECORD_HEADER_BYTES + plain.len());
    rec.extend_from_slice(&b[..RECORD_HEADER_BYTES]);
    rec.extend_from_slice(&plain);
    Ok((h, SharedBytes::owned(rec)))
}

/// A data entry must point inside one segment of the data area.
pub(crate) fn check_entry_location(sb: &Superblock, e: MapEntry) -> Result<(), EntryLocationError> {
    if let EntryState::Data { offset, len, .. } = e.state().map_err(EntryLocationError::Invalid)? {
        let rel = offset
            .checked_sub(sb.data_offset_bytes)
            .ok_or(EntryLocationError::InMetadataArea)?;
        let segment = rel / sb.segment_size_bytes;
        if segment >= sb.segment_count()
            || rel % sb.segment_size_bytes + u64::from(len) > sb.segment_size_bytes
        {
            return Err(EntryLocationError::OutsideDataArea { offset, len });
        }
        if sb.is_metadata_segment(segment) {
            return Err(EntryLocationError::OnMetadataDevice { offset, len });
        }
    }
    Ok(())
}

/// The page records of a volume's log, read on a map cache miss: from the
/// open segment's buffer while they are still there (`buffered`), else
/// from the store.
pub(crate) struct LogPages<'a> {
    pub(crate) storage: &'a dyn Storage,
    pub(crate) sb: &'a Superblock,
    pub(crate) buffered: Option<&'a dyn Fn(u64, usize) -> Option<Vec<u8>>>,
}

impl LogPages<'_> {
    /// The record `r` names, verified: from the open segment's buffer
    /// while it is there, else from the store.
    fn record(&self, r: &PageRef) -> Result<(RecordHeader, Vec<u8>), RecordError> {
        match self.buffered.and_then(|f| f(r.offset, r.len as usize)) {
            Some(rec) if rec.len() == r.len as usize => verify_record(self.sb, rec),
            Some(_) => Err(RecordError::NotExpected),
            None => read_record(self.storage, self.sb, r.offset, r.len),
        }
    }

    /// The entries of the page record `r` names, verified.
    pub(crate) fn entries(&self, r: &PageRef) -> Result<Vec<(u64, MapEntry)>, ChunkError> {
        let (h, rec) = self.record(r).map_err(ChunkError::Record)?;
        chunk_entries(self.sb, &h, &rec, r.offset, r.crc)
    }
}

impl PageSource for LogPages<'_> {
    fn load(&self, _page: u64, r: &PageRef) -> Result<Vec<(u64, MapEntry)>, MetaError> {
        self.entries(r)
            .map_err(|e| MetaError::Damaged(e.to_string()))
    }

    fn dir_list(&self, block: u64, r: &PageRef) -> Result<Vec<u8>, MetaError> {
        let damaged = |e: DirError| MetaError::Damaged(format!("map directory block {block}: {e}"));
        let (h, mut rec) = self.record(r).map_err(|e| damaged(DirError::Record(e)))?;
        check_dir_list(&h, block, r).map_err(damaged)?;
        rec.drain(..RECORD_HEADER_BYTES);
        Ok(rec)
    }

    fn dir_block(&self, block: u64, r: &PageRef) -> Result<DirLoaded, MetaError> {
        let damaged = |e: DirError| MetaError::Damaged(format!("map directory block {block}: {e}"));
        let (h, rec) = self.record(r).map_err(|e| damaged(DirError::Record(e)))?;
        let c = ChunkRef {
            offset: r.offset,
            len: r.len,
            crc: r.crc,
        };
        let (b, _, body) = parse_dir_body(self.sb, &c, &h, &rec).map_err(damaged)?;
        if b as u64 != block || h.seq != r.seq {
            return Err(damaged(DirError::NotNamed { offset: r.offset }));
        }
        Ok(match body {
            DirBody::Pages(pages) => DirLoaded::Pages(pages),
            DirBody::Summarized(s, list) => DirLoaded::Summarized(s, list.to_vec()),
            DirBody::Apart(s, list) => DirLoaded::Apart(s, list),
        })
    }
}

/// Checks that the record read for the list of directory block `block`
/// that its summary names as `r` (`FLAG_DIR_LIST_APART`) is that list: a
/// MAP_DIR of the block, lz4, with `r`'s crc and seq.
pub(crate) fn check_dir_list(h: &RecordHeader, block: u64, r: &PageRef) -> Result<(), DirError> {
    let lba = block * DIR_PAGES * MAP_PAGE_BLOCKS;
    let named = h.kind == RecordKind::MapDir
        && h.codec == CodecTag::Lz4
        && h.crc == r.crc
        && h.seq == r.seq
        && h.lba == lba;
    if named {
        Ok(())
    } else {
        Err(DirError::ListNotNamed { offset: r.offset })
    }
}

/// What a MAP_DIR record holds past its header: its list, or (a summarized
/// record, `FLAG_DIR_SUMMARY`) its summary and its list still compressed,
/// or its summary and the record of its list (`FLAG_DIR_LIST_APART`).
pub(crate) enum DirBody<'a> {
    Pages(Vec<(u64, PageRef)>),
    Summarized(Box<DirSummary>, &'a [u8]),
    Apart(Box<DirSummary>, PageRef),
}

/// The directory block, record and body of the MAP_DIR record `c` names
/// (its header `h`, bytes `rec`), checked against the volume's slots.
pub(crate) fn parse_dir_body<'a>(
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

/// The entries of one MAP_CHUNK record, verified.
pub(crate) fn read_chunk(
    storage: &dyn Storage,
    sb: &Superblock,
    offset: u64,
    len: u32,
    crc: u32,
) -> Result<Vec<(u64, MapEntry)>, ChunkError> {
    let (ch, rec) = read_record(storage, sb, offset, len).map_err(ChunkError::Record)?;
    chunk_entries(sb, &ch, &rec, offset, crc)
}

/// The entries of a MAP_CHUNK record read whole (`rec`, its header `ch`).
fn chunk_entries(
    sb: &Superblock,
    ch: &RecordHeader,
    rec: &[u8],
    offset: u64,
    crc: u32,
) -> Result<Vec<(u64, MapEntry)>, ChunkError> {
    if ch.kind != RecordKind::MapChunk || ch.crc != crc {
        return Err(ChunkError::NotNamed { offset });
    }
    let raw = match ch.codec {
        CodecTag::Lz4 => lz4_flex::block::decompress_size_prepended(&rec[RECORD_HEADER_BYTES..])
            .map_err(ChunkError::Decompress)?,
        CodecTag::None => rec[RECORD_HEADER_BYTES..].to_vec(),
        CodecTag::Zstd => return Err(ChunkError::Zstd),
    };
    let mut out = Vec::new();
    let mut bad = None;
    decode_runs(&raw, sb.logical_blocks(), |lba, e| {
        if let Err(why) = check_entry_location(sb, e) {
            bad.get_or_insert(ChunkError::Entry { lba, why });
        }
        out.push((lba, e));
    })
    .map_err(ChunkError::Runs)?;
    bad.map_or(Ok(out), Err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cvol_format::record::{encode_record, RecordKind};
    use cvol_storage::SimStorage;

    /// A record of `len` payload bytes written at `offset`: (offset, length).
    fn put(st: &SimStorage, sb: &Superblock, offset: u64, seq: u64, len: usize) -> (u64, u32) {
        let payload = vec![seq as u8; len];
        let mut h = RecordHeader {
            kind: RecordKind::MapDir,
            codec: CodecTag::None,
            level: 0,
            mask: 0,
            volume_tag: sb.volume_tag(),
            epoch: 1,
            seq,
            lba: 0,
            nblocks: 1,
            payload_len: len as u32,
            crc: 0,
            sealed: false,
        };
        let rec = encode_record(&mut h, &payload);
        st.write_at(offset, &rec).unwrap();
        (offset, rec.len() as u32)
    }

    /// Records read together share the buffer they were read into when
    /// they fill most of it, and are copied out of it when holes between
    /// them would take most of it (a kept record must not hold the holes).
    #[test]
    fn records_read_together_share_their_buffer_only_when_they_fill_it() {
        let sb = crate::test_util::small_superblock();
        let (data, seg) = (sb.data_offset_bytes, sb.segment_size_bytes);
        let st = SimStorage::new(sb.physical_size_bytes);
        let dense = [
            put(&st, &sb, data, 1, 3000),
            put(&st, &sb, data + 3100, 2, 3000),
        ];
        let sparse = [
            put(&st, &sb, data + seg, 3, 3000),
            put(&st, &sb, data + seg + 40_000, 4, 3000),
        ];
        for (at, shared) in [(&dense, true), (&sparse, false)] {
            let got = read_records_shared(&st, &sb, at);
            let got: Vec<_> = got.into_iter().map(|r| r.expect("reads")).collect();
            for ((h, b), &(_, len)) in got.iter().zip(at.iter()) {
                assert_eq!(b.len(), len as usize);
                assert_eq!(b[RECORD_HEADER_BYTES], h.seq as u8);
            }
            assert_eq!(got[0].1.buffer_bytes() > got[0].1.len(), shared);
            assert_eq!(got[1].1.buffer_bytes() > got[1].1.len(), shared);
        }
        // `read_records` gives each its own bytes either way.
        let owned = read_records(&st, &sb, &dense);
        assert_eq!(owned[1].as_ref().unwrap().1.len(), dense[1].1 as usize);
    }
}
