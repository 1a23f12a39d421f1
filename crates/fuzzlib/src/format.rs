//! Target `format_decoders`: every decoder of `cvol_format` (superblock,
//! metadata device label,
//! checkpoint pointer, record header + verify, map entry, checkpoint commit
//! payload, map chunk runs, map directory and table payloads) and the
//! engine's record-to-block decoder on
//! arbitrary bytes.
//!
//! Checksums would stop almost every mutation at the first check, so each
//! checksummed structure is also decoded after the harness has forced its
//! magic and recomputed its checksum: the fuzzer then explores the field
//! validation behind the checksum. Oracles: decoders return `Err`, never
//! panic; whatever decodes re-encodes to something that decodes to the same
//! value.
use cvol_format::checkpoint::{
    decode_runs, push_run, CommitPayload, DirList, DirPayload, DirSummary, DIR_PAGES,
};
use cvol_format::fprints::FpTable;
use cvol_format::pointer::{POINTER_BYTES, POINTER_MAGIC};
use cvol_format::record::{encode_record, RECORD_HEADER_BYTES, RECORD_MAGIC};
use cvol_format::superblock::{FORMAT_VERSION, SUPERBLOCK_BYTES, SUPERBLOCK_MAGIC};
use cvol_format::tables::{TableGroup, TableRoot};
use cvol_format::{
    mapentry::MAP_ENTRY_BYTES, CheckpointPointer, CodecTag, EntryState, MapEntry, RecordHeader,
    RecordKind, Superblock,
};

use crate::input::Input;

/// Offset of the crc32c in a superblock (over the bytes before it).
pub const SUPERBLOCK_CRC_OFFSET: usize = 80;
/// Offset of the crc32c in a checkpoint pointer (over the bytes before it).
pub const POINTER_CRC_OFFSET: usize = 40;
/// Offset of the crc in a record header.
pub const RECORD_CRC_OFFSET: usize = 40;

/// Recomputes a superblock's checksum in place (`b` is at least 84 bytes).
pub fn fix_superblock_crc(b: &mut [u8]) {
    let crc = crc32c::crc32c(&b[..SUPERBLOCK_CRC_OFFSET]);
    b[SUPERBLOCK_CRC_OFFSET..SUPERBLOCK_CRC_OFFSET + 4].copy_from_slice(&crc.to_le_bytes());
}

/// Recomputes a checkpoint pointer's checksum in place (`b` is at least 44 bytes).
pub fn fix_pointer_crc(b: &mut [u8]) {
    let crc = crc32c::crc32c(&b[..POINTER_CRC_OFFSET]);
    b[POINTER_CRC_OFFSET..POINTER_CRC_OFFSET + 4].copy_from_slice(&crc.to_le_bytes());
}

/// Recomputes the crc of the record whose header starts `b` (at least 44
/// bytes), over the payload its header announces, as far as `b` holds it.
/// Returns the crc written.
pub fn fix_record_crc(b: &mut [u8]) -> u32 {
    let payload_len = u32::from_le_bytes(b[36..40].try_into().expect("4 bytes")) as usize;
    let end = RECORD_HEADER_BYTES.saturating_add(payload_len).min(b.len());
    let payload_crc = crc32c::crc32c(&b[RECORD_HEADER_BYTES..end]);
    let crc = crc32c::crc32c_append(payload_crc, &b[..RECORD_CRC_OFFSET]);
    b[RECORD_CRC_OFFSET..RECORD_CRC_OFFSET + 4].copy_from_slice(&crc.to_le_bytes());
    crc
}

/// `data` cut or zero-padded to `n` bytes.
fn padded(data: &[u8], n: usize) -> Vec<u8> {
    let mut v = data[..data.len().min(n)].to_vec();
    v.resize(n, 0);
    v
}

/// The target body. Byte 0 holds parameters (which engine codec to try),
/// bytes 1..9 a logical size in blocks for map chunk runs; every decoder
/// then sees the rest.
pub fn decoders(data: &[u8]) {
    let mut input = Input::new(data);
    let selector = input.u8();
    let logical_blocks = input.u64() >> (selector & 63);
    let body = input.rest();

    superblock(body);
    metadev_label(body);
    trace(body);
    pointer(body);
    record(body, selector);
    map_entries(body);
    commit(body);
    dir(body, logical_blocks);
    dir_summary(body);
    tables(body, logical_blocks);
    runs(body, logical_blocks);
    codecs(body, selector);
}

fn superblock(body: &[u8]) {
    let _ = Superblock::decode(body);
    let mut b = padded(body, SUPERBLOCK_BYTES);
    fix_superblock_crc(&mut b);
    superblock_decoded(&b);
    b[..8].copy_from_slice(&SUPERBLOCK_MAGIC);
    b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    fix_superblock_crc(&mut b);
    superblock_decoded(&b);
}

fn superblock_decoded(b: &[u8]) {
    let Ok(sb) = Superblock::decode(b) else {
        return;
    };
    // Accepted geometry must be usable without overflow.
    let count = sb.segment_count();
    assert!(
        count >= 2,
        "accepted superblock with {count} segments: {sb:?}"
    );
    // The data store's segments end within its physical size; a metadata
    // device's follow them, every offset addressable by a map entry.
    let data_end = sb.segment_offset(sb.data_segment_count());
    assert!(
        data_end <= sb.physical_size_bytes,
        "last data segment beyond the physical size: {sb:?}"
    );
    assert!(
        sb.segment_offset_end() <= cvol_format::PHYSICAL_SIZE_MAX_BYTES,
        "segments beyond what a map entry addresses: {sb:?}"
    );
    assert!(sb.data_segment_count() >= 2 && sb.metadata_segments != 1);
    let _ = (sb.logical_blocks(), sb.volume_tag(), sb.dedup());
    assert_eq!(Superblock::decode(&sb.encode()).as_ref(), Ok(&sb));
}

fn metadev_label(body: &[u8]) {
    use cvol_format::metadev::{MetadevLabel, METADEV_LABEL_BYTES, METADEV_MAGIC};
    let _ = MetadevLabel::decode(body);
    let mut b = padded(body, METADEV_LABEL_BYTES);
    b[..8].copy_from_slice(&METADEV_MAGIC);
    let crc = crc32c::crc32c(&b[..METADEV_LABEL_BYTES - 4]);
    b[METADEV_LABEL_BYTES - 4..].copy_from_slice(&crc.to_le_bytes());
    if let Ok(l) = MetadevLabel::decode(&b) {
        assert_eq!(MetadevLabel::decode(&l.encode()).as_ref(), Ok(&l));
    }
}

/// `cvol trace` files: the header and records, also with checksums fixed
/// up so the field checks run; what decodes re-encodes to itself.
fn trace(body: &[u8]) {
    use cvol_format::trace::{TraceHeader, TraceRecord, TRACE_HEADER_BYTES, TRACE_RECORD_BYTES};
    let _ = TraceHeader::decode(body);
    let mut h = padded(body, TRACE_HEADER_BYTES);
    let crc = crc32c::crc32c(&h[..60]);
    h[60..64].copy_from_slice(&crc.to_le_bytes());
    if let Ok(header) = TraceHeader::decode(&h) {
        assert_eq!(TraceHeader::decode(&header.encode()), Ok(header));
    }
    for chunk in body.chunks(TRACE_RECORD_BYTES) {
        let _ = TraceRecord::decode(chunk);
        let mut r = padded(chunk, TRACE_RECORD_BYTES);
        let crc = crc32c::crc32c(&r[..28]);
        r[28..32].copy_from_slice(&crc.to_le_bytes());
        if let Some(rec) = TraceRecord::decode(&r) {
            assert_eq!(TraceRecord::decode(&rec.encode()), Some(rec));
        }
    }
}

fn pointer(body: &[u8]) {
    let _ = CheckpointPointer::decode(body);
    let mut b = padded(body, POINTER_BYTES);
    b[..8].copy_from_slice(&POINTER_MAGIC);
    fix_pointer_crc(&mut b);
    let p = CheckpointPointer::decode(&b).expect("a pointer with magic and crc decodes");
    assert_eq!(CheckpointPointer::decode(&p.encode()), Ok(p));
    let _ = CheckpointPointer::slot_offset(p.slot());
    let _ = CheckpointPointer::newest(Some(p), CheckpointPointer::decode(body).ok());
}

fn record(body: &[u8], selector: u8) {
    record_decoded(body, selector);
    if body.len() < RECORD_HEADER_BYTES {
        return;
    }
    let mut b = body.to_vec();
    b[..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
    fix_record_crc(&mut b);
    record_decoded(&b, selector);
}

fn record_decoded(b: &[u8], selector: u8) {
    let Ok(h) = RecordHeader::decode(b) else {
        return;
    };
    assert!(h.lba.checked_add(u64::from(h.nblocks)).is_some());
    let Some(payload) = b.get(RECORD_HEADER_BYTES..h.total_len()) else {
        assert!(RecordHeader::decode_verified(b).is_err());
        return;
    };
    let verified = RecordHeader::decode_verified(b);
    assert_eq!(verified.is_ok(), h.verify(b, payload).is_ok());
    // Re-encoding what decoded gives a record that verifies, with the same fields.
    let mut again = h;
    let rec = encode_record(&mut again, payload);
    let (h2, p2) = RecordHeader::decode_verified(&rec).expect("re-encoded record verifies");
    assert_eq!(h2, again);
    assert_eq!(p2, payload);
    if verified.is_ok() {
        assert_eq!(h2, h, "a verified record re-encodes to itself");
        block_record(&h, b, selector);
    }
}

/// The engine's decoder of a DATA record for one block, given a map entry
/// naming this record.
fn block_record(h: &RecordHeader, rec: &[u8], selector: u8) {
    let len = h.total_len() as u32;
    if h.kind != RecordKind::Data || (len as usize) > cvol_format::record::RECORD_MAX_BYTES {
        return;
    }
    let mut out = vec![0u8; cvol_format::BLOCK_SIZE_BYTES as usize];
    let rec = &rec[..len as usize];
    let k = u32::from(selector) % h.nblocks.clamp(1, 16);
    let lba = h.lba + u64::from(k);
    let owner = if h.nblocks > 1 {
        MapEntry::unit(h.codec, 1 << 20, len, h.crc, k)
    } else {
        MapEntry::data(h.codec, 1 << 20, len, h.crc)
    };
    for e in [owner, owner.as_ref_entry()] {
        let _ = cvol_engine::decode_block_record(None, lba, e, rec, &mut out);
        let _ = cvol_engine::decode_block_record(None, lba + 1, e, rec, &mut out);
    }
}

fn map_entries(body: &[u8]) {
    for window in body.windows(MAP_ENTRY_BYTES).take(64) {
        let Ok(e) = MapEntry::decode(window) else {
            continue;
        };
        let state = e.state().expect("a decoded entry has a state");
        let mut b = [0u8; MAP_ENTRY_BYTES];
        e.encode(&mut b);
        assert_eq!(&b[..], window);
        assert_eq!(e.is_unmapped(), state == EntryState::Unmapped);
        if let EntryState::Data { .. } = state {
            let r = e.as_ref_entry();
            assert!(matches!(
                r.state(),
                Ok(EntryState::Data { shared: true, .. })
            ));
            assert!(r.same_record(&e) && e.same_record(&r));
        }
    }
}

fn commit(body: &[u8]) {
    if let Ok(c) = CommitPayload::decode(body) {
        assert_eq!(
            c.encode(),
            body,
            "a commit payload re-encodes byte for byte"
        );
    }
    // The count field (at 16) set to what the length allows.
    if body.len() >= 20 {
        let mut b = body[..20 + (body.len() - 20) / 16 * 16].to_vec();
        let count = ((b.len() - 20) / 16) as u32;
        b[16..20].copy_from_slice(&count.to_le_bytes());
        let c = CommitPayload::decode(&b).expect("well-sized commit payload decodes");
        assert_eq!(c.chunks.len(), count as usize);
        assert_eq!(c.encode(), b);
    }
}

/// A summarized MAP_DIR payload: a summary that decodes names as many
/// pages as its bitmap holds, segments strictly ascending with bytes, and
/// re-encodes (with the rest as its list, or the list record it names)
/// byte for byte.
fn dir_summary(body: &[u8]) {
    if let Ok((s, list)) = DirSummary::decode(body) {
        let bits: u32 = s.bitmap.iter().map(|w| w.count_ones()).sum();
        assert_eq!(bits, s.pages);
        assert!(s.uses.windows(2).all(|w| w[0].segment < w[1].segment));
        assert!(s.uses.iter().all(|u| u.bytes > 0));
        let again = match list {
            DirList::Inline(list) => s.encode(list),
            DirList::Apart(r) => s.encode_apart(&r),
        };
        assert_eq!(again, body, "a summary re-encodes byte for byte");
    }
}

/// A MAP_DIR payload of directory block `selector`: decodes to pages of
/// that block, strictly increasing, and re-encodes byte for byte.
fn dir(body: &[u8], selector: u64) {
    let block = selector % (1 << 20);
    if let Ok(d) = DirPayload::decode(body, block) {
        let range = block * DIR_PAGES..(block + 1) * DIR_PAGES;
        assert!(d.pages.iter().all(|(p, _)| range.contains(p)));
        assert!(d.pages.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!(
            d.encode(),
            body,
            "a directory payload re-encodes byte for byte"
        );
    }
}

/// MAP_TABLE payloads (the root of a volume of `selector` segments, group
/// `selector`): what decodes re-encodes byte for byte, rows in order.
fn tables(body: &[u8], selector: u64) {
    let segments = selector % (1 << 24);
    if let Ok(r) = TableRoot::decode(body, segments) {
        assert_eq!(r.encode(), body, "a table root re-encodes byte for byte");
    }
    for segments in [segments, selector.saturating_add(1)] {
        if let Ok(g) = TableGroup::decode(body, selector, segments) {
            assert!(g.rows.windows(2).all(|w| w[0].offset < w[1].offset));
            assert_eq!(g.encode(), body, "a group table re-encodes byte for byte");
        }
    }
    // A fingerprint table of the part it names (other parts are refused
    // before any row is read).
    let Some(head) = body.get(..12) else {
        return;
    };
    let segment = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
    let part = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
    if let Ok(t) = FpTable::decode(body, segment, part) {
        assert!(t
            .rows
            .iter()
            .all(|r| r.fp != 0 && r.entry().state().is_ok()));
        assert_eq!(
            t.encode(),
            body,
            "a fingerprint table re-encodes byte for byte"
        );
    }
}

fn runs(body: &[u8], logical_blocks: u64) {
    let mut got: Vec<(u64, MapEntry)> = Vec::new();
    let result = decode_runs(body, logical_blocks, |lba, e| got.push((lba, e)));
    for (lba, e) in &got {
        assert!(*lba < logical_blocks, "run entry beyond the volume");
        assert!(e.state().is_ok());
    }
    if result.is_err() || got.is_empty() {
        return;
    }
    // Re-encode as runs of consecutive LBAs; decoding gives the same entries.
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=got.len() {
        if i == got.len() || got[i].0 != got[i - 1].0 + 1 {
            let entries: Vec<MapEntry> = got[start..i].iter().map(|x| x.1).collect();
            push_run(&mut out, got[start].0, &entries);
            start = i;
        }
    }
    let mut again = Vec::new();
    decode_runs(&out, logical_blocks, |lba, e| again.push((lba, e))).expect("re-encoded runs");
    assert_eq!(again, got);
}

/// The engine's decompressors on arbitrary payloads, into a block and a unit.
fn codecs(body: &[u8], selector: u8) {
    let tag = CodecTag::ALL[usize::from(selector >> 6) % 3];
    let mut block = vec![0u8; 4096];
    let _ = cvol_engine::codec::decompress(tag, body, &mut block);
    if selector & 32 != 0 {
        let mut unit = vec![0u8; 16 * 4096];
        let _ = cvol_engine::codec::decompress(tag, body, &mut unit);
    }
    for tag in CodecTag::ALL {
        assert!(CodecTag::from_u8(tag as u8) == Ok(tag));
    }
    let _ = CodecTag::from_u8(selector);
    let _ = RecordKind::from_u8(selector);
}
