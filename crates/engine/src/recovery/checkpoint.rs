//! Reading one checkpoint: the candidates (`Source`: a pointer slot, or a
//! commit record a scan found, `scanned_commits`), its commit record and
//! where the roll-forward from it starts (`load_checkpoint`,
//! `checkpoint_start`), its map (MAP_CHUNKs of runs, or MAP_DIRs and the
//! pages they name) and liveness tables, whole or (salvage) keeping what
//! reads (`Load`), and the records a pointer names that the roll-forward
//! may step over when damaged (`known_checkpoint_records`). Uses `chain`
//! (`Start`) and `scan` (the records a scan found).
use super::chain::{KnownRecords, Start};
use super::dir_records::{named_matches, page_ref, parse_dir_body, read_dir, read_lists};
use super::dir_records::{DirBody, DirRead};
use super::scan::{LogScan, Scanned};
use crate::error::{CheckpointError, DirError, PageError, RecordError, TableError};
use crate::liveness::{decode_root, LoadedGroup, LoadedTables};
use crate::logread::{
    read_chunk, read_record, read_records, read_records_shared, volume_map, LogPages,
};
use crate::map::{decode_summarized, BlockMap, Page, Segments, SharedBytes};
use cvol_format::checkpoint::{ChunkRef, CommitPayload, DirSummary, NamedDir, PageRef};
use cvol_format::checkpoint::{DIR_PAGES, MAP_PAGE_BLOCKS};
use cvol_format::record::{RecordHeader, RecordKind, RECORD_HEADER_BYTES};
use cvol_format::superblock::FLAG_DIR_NAMED;
use cvol_format::tables::table_count;
use cvol_format::{CheckpointPointer, Superblock};
use cvol_storage::Storage;
use std::collections::HashMap;

/// Where a candidate checkpoint comes from: a pointer slot, or a commit
/// record found by scanning the log.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Source {
    Pointer,
    Scan,
}

impl Source {
    /// How messages name the checkpoint `p` from this source.
    pub(super) fn name(self, p: &CheckpointPointer) -> String {
        match self {
            Source::Pointer => format!("checkpoint generation {}", p.generation),
            Source::Scan => format!("checkpoint found in the log (commit seq {})", p.commit_seq),
        }
    }
}

/// The intact CKPT_COMMIT records a scan found, newest (highest seq) first,
/// as pointers (generation 0): the fallbacks once the pointer slots fail.
pub(super) fn scanned_commits(sb: &Superblock, scan: &LogScan) -> Vec<CheckpointPointer> {
    let mut commits: Vec<&Scanned> = scan
        .records
        .iter()
        .filter(|r| r.header.kind == RecordKind::CkptCommit)
        .collect();
    commits.sort_by_key(|r| std::cmp::Reverse(r.header.seq));
    commits
        .into_iter()
        .map(|c| CheckpointPointer {
            generation: 0,
            commit_offset: sb.segment_offset(c.segment) + c.at as u64,
            commit_len: c.header.total_len() as u32,
            commit_epoch: c.header.epoch,
            commit_seq: c.header.seq,
        })
        .collect()
}

/// Records a pointer names that recovery may step over when damaged,
/// because they change no block: the MAP_CHUNK and CKPT_COMMIT records of
/// the checkpoints the slots name (chunks have the seqs just below their
/// commit's). Keyed by seq: (physical offset, length, epoch).
pub(super) fn known_checkpoint_records(
    storage: &dyn Storage,
    sb: &Superblock,
    ptrs: &[CheckpointPointer],
) -> HashMap<u64, (u64, u32, u32)> {
    let mut known = HashMap::new();
    for p in ptrs {
        known.insert(
            p.commit_seq,
            (p.commit_offset, p.commit_len, p.commit_epoch),
        );
        let Ok((h, rec)) = read_record(storage, sb, p.commit_offset, p.commit_len) else {
            continue;
        };
        if h.kind != RecordKind::CkptCommit || h.seq != p.commit_seq {
            continue;
        }
        let Ok(cp) = CommitPayload::decode(&rec[RECORD_HEADER_BYTES..]) else {
            continue;
        };
        let dirs: Vec<Result<DirRead, DirError>> =
            cp.chunks.iter().map(|c| read_dir(storage, sb, c)).collect();
        if !dirs.iter().any(Result::is_ok) {
            // MAP_CHUNKs of the whole map, appended just before the commit.
            let n = cp.chunks.len() as u64;
            for (i, c) in cp.chunks.iter().enumerate() {
                if let Some(seq) = (p.commit_seq + i as u64).checked_sub(n) {
                    known.insert(seq, (c.offset, c.len, p.commit_epoch));
                }
            }
            continue;
        }
        // A paged map: the directory blocks (and lists kept apart) and
        // pages this checkpoint wrote lie among the records roll-forward
        // passes over; their seqs are in the directory. Its pages may lie
        // below its snapshot seq (a commit whose snapshot follows them:
        // `resume_point`), so every record it names is taken: one an
        // earlier checkpoint of the same epoch wrote is a map record too,
        // and one of an earlier epoch (labelled with this one here) is
        // never where a chain in this epoch expects a record (its seq is
        // below the epoch's first).
        for d in dirs.into_iter().flatten() {
            let own = std::iter::once(d.record).chain(d.list);
            for r in own.chain(d.pages.into_iter().map(|(_, r)| r)) {
                if r.seq < p.commit_seq {
                    known.insert(r.seq, (r.offset, r.len, p.commit_epoch));
                }
            }
        }
    }
    known
}

/// `known_checkpoint_records`, read when first needed: roll-forward asks
/// only where no intact record continues the chain, normally once, at its
/// end, past every pointer's commit seq (no record a pointer names can be
/// there, so nothing is read). Open then reads each MAP_DIR of the newest
/// checkpoint once (`load_checkpoint`), not again for these records, nor
/// the older pointer's at all unless recovery falls back or meets damage.
pub(super) struct Known<'a> {
    storage: &'a dyn Storage,
    sb: &'a Superblock,
    ptrs: &'a [CheckpointPointer],
    records: std::cell::OnceCell<HashMap<u64, (u64, u32, u32)>>,
}

impl KnownRecords for Known<'_> {
    /// Every record a pointer names has a seq at or below its commit's.
    fn record(&self, seq: u64) -> Option<(u64, u32, u32)> {
        if self.ptrs.iter().all(|p| seq > p.commit_seq) {
            return None;
        }
        let records = (self.records)
            .get_or_init(|| known_checkpoint_records(self.storage, self.sb, self.ptrs));
        records.get(&seq).copied()
    }
}

impl<'a> Known<'a> {
    pub(super) fn new(
        storage: &'a dyn Storage,
        sb: &'a Superblock,
        ptrs: &'a [CheckpointPointer],
    ) -> Known<'a> {
        Known {
            storage,
            sb,
            ptrs,
            records: std::cell::OnceCell::new(),
        }
    }
}

/// A checkpoint read: its map, where the roll-forward from it starts, its
/// liveness tables (whole loads), and the LBA spans of its damaged map
/// records (partial loads).
pub(super) struct LoadedCheckpoint {
    pub(super) map: BlockMap,
    pub(super) start: Start,
    pub(super) tables: Option<LoadedTables>,
    pub(super) lost_spans: Vec<(u64, u64)>,
}

/// Reads the checkpoint pointer `p` names: its commit record (which must
/// verify) and the map it names, per `load`.
pub(super) fn load_checkpoint(
    storage: &dyn Storage,
    sb: &Superblock,
    p: &CheckpointPointer,
    load: Load,
) -> Result<LoadedCheckpoint, CheckpointError> {
    let (h, rec) =
        read_record(storage, sb, p.commit_offset, p.commit_len).map_err(CheckpointError::Commit)?;
    if h.kind != RecordKind::CkptCommit || h.seq != p.commit_seq || h.epoch != p.commit_epoch {
        return Err(CheckpointError::NotItsCommit);
    }
    let commit = CommitPayload::decode(&rec[RECORD_HEADER_BYTES..])
        .map_err(CheckpointError::CommitPayload)?;
    if commit.logical_blocks != sb.logical_blocks() {
        return Err(CheckpointError::OtherLogicalSize);
    }
    let mut loaded = load_commit_map(storage, sb, p, &commit, load)?;
    loaded.records.note(sb, p.commit_offset, p.commit_seq);
    let checkpoint_segments = loaded.records.into_map();
    Ok(LoadedCheckpoint {
        map: loaded.map,
        start: checkpoint_start(sb, p, &commit, checkpoint_segments)?,
        tables: loaded.tables,
        lost_spans: loaded.lost_spans,
    })
}

/// Where roll-forward from the checkpoint of `p` starts: at the log head
/// of its snapshot when the commit names it (the checkpoint was written
/// outside the volume lock: client records may lie between the snapshot
/// and the commit, and the checkpoint's own records are passed over),
/// else right after the commit record.
fn checkpoint_start(
    sb: &Superblock,
    p: &CheckpointPointer,
    commit: &CommitPayload,
    checkpoint_segments: HashMap<u64, u64>,
) -> Result<Start, CheckpointError> {
    let (segment, offset, expected_seq) = match commit.resume {
        Some(r) => {
            if r.segment >= sb.segment_count() || r.offset > sb.segment_size_bytes {
                return Err(CheckpointError::ResumeOutsideLog {
                    segment: r.segment,
                    offset: r.offset,
                });
            }
            if commit.snapshot_seq >= p.commit_seq {
                return Err(CheckpointError::SnapshotNotBeforeCommit);
            }
            (r.segment, r.offset as usize, commit.snapshot_seq + 1)
        }
        None => {
            let (segment, at) = sb
                .locate(p.commit_offset)
                .ok_or(CheckpointError::CommitOutsideData)?;
            (segment, at + p.commit_len as usize, p.commit_seq + 1)
        }
    };
    let meta = match (commit.resume, commit.meta_resume) {
        (Some(_), Some(m)) => {
            if !(sb.is_metadata_segment(m.segment) && m.segment < sb.segment_count())
                || m.offset > sb.segment_size_bytes
            {
                return Err(CheckpointError::MetaResumeOutside {
                    segment: m.segment,
                    offset: m.offset,
                });
            }
            Some((m.segment, m.offset as usize))
        }
        _ => None,
    };
    if sb.is_metadata_segment(segment) {
        return Err(CheckpointError::ResumeOnMetadataDevice { segment });
    }
    Ok(Start {
        segment,
        offset,
        meta,
        expected_seq,
        epoch: p.commit_epoch,
        snapshot_seq: commit.snapshot_seq,
        checkpoint_segments,
    })
}

/// How to read a checkpoint's map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Load {
    /// Every record must read; the pages are kept in memory.
    Whole,
    /// The pages are left on disk, to be read (and verified) when first
    /// used. Those whose record is newer than seq `verify_above` are read
    /// and verified now, and must be intact; an older one reads as an
    /// error when first used if damaged (`cvol check` and scrub read every
    /// page). See `Load::lazy_for` for why that is safe.
    Lazy { verify_above: u64 },
    /// A damaged record loses the LBAs it held (`lost_spans`) instead of
    /// failing the load.
    Partial,
}

impl Load {
    /// `Load::Lazy` for a candidate. The newest pointer's checkpoint, when
    /// the older pointer decodes too, verifies no page and reads no
    /// directory block (but those holding tables) now: every record its
    /// commit names (`commit_seq` is above them all) was synced before the
    /// commit was appended, the commit was synced before the pointer was
    /// written, and no segment it names is reused before a newer pointer
    /// is published (docs/FORMAT.md "Checkpoint"). So neither a crash nor
    /// a torn write can leave them damaged, and damage at rest (bit rot, a
    /// misdirected write) is found when a record is first read, as for
    /// any record: the page's blocks then read as errors and take no
    /// writes until `cvol check --repair`. Verifying them at open made
    /// open cost what the last session changed (a 64 GiB volume after
    /// random writes: 320 MB read and checked, 0.25 s). Every other
    /// candidate verifies every page now: a fallback may be stale, and so
    /// may the only pointer that decodes (the other slot may hold a newer
    /// one, damaged, that let the segments this one names be reused).
    pub(super) fn lazy_for(newest: bool, older_commit_seq: Option<u64>, commit_seq: u64) -> Load {
        let verify_above = match (newest, older_commit_seq) {
            (true, Some(_)) => commit_seq,
            _ => 0,
        };
        Load::Lazy { verify_above }
    }
}

/// A checkpoint's map, read from the records its commit names.
struct LoadedMap {
    map: BlockMap,
    /// Its liveness tables, if it names a root and every table reads.
    tables: Option<LoadedTables>,
    /// LBA spans whose entries were in damaged records (partial loads).
    lost_spans: Vec<(u64, u64)>,
    /// The segments of the records read, with their highest seq: those
    /// recovery needs.
    records: SegmentSeqs,
}

/// The highest seq of the records noted in each segment, a slot per
/// segment (seq + 1; 0: none noted): a map names a record per page
/// (hundreds of thousands with many snapshots), which a hash map entry
/// each made a large part of open's time.
struct SegmentSeqs(Vec<u64>);

impl SegmentSeqs {
    fn new(sb: &Superblock) -> SegmentSeqs {
        SegmentSeqs(vec![0; sb.segment_count() as usize])
    }

    /// Notes the record at `offset` (outside the segments: ignored).
    fn note(&mut self, sb: &Superblock, offset: u64, seq: u64) {
        if let Some((seg, _)) = sb.locate(offset) {
            self.note_segment(seg, seq);
        }
    }

    /// Notes records of segment `seg` up to seq `seq` (beyond the
    /// segments: ignored).
    fn note_segment(&mut self, seg: u64, seq: u64) {
        if let Some(m) = self.0.get_mut(seg as usize) {
            *m = seq.saturating_add(1).max(*m);
        }
    }

    /// The segments holding a noted record, with their highest seq.
    fn into_map(self) -> HashMap<u64, u64> {
        (self.0.into_iter().enumerate())
            .filter(|&(_, m)| m > 0)
            .map(|(s, m)| (s as u64, m - 1))
            .collect()
    }
}

/// Reads the map a commit names: MAP_CHUNKs of runs (the whole map), or
/// MAP_DIRs and the page records they name (a paged map), told apart by
/// the kind of the first record that reads.
fn load_commit_map(
    storage: &dyn Storage,
    sb: &Superblock,
    p: &CheckpointPointer,
    commit: &CommitPayload,
    load: Load,
) -> Result<LoadedMap, CheckpointError> {
    let partial = load == Load::Partial;
    let mut loaded = LoadedMap {
        map: volume_map(sb),
        tables: None,
        lost_spans: Vec::new(),
        records: SegmentSeqs::new(sb),
    };
    if let (Some(named), Load::Lazy { verify_above }) = (&commit.named, load) {
        load_named(storage, sb, commit, named, verify_above, &mut loaded)?;
        return Ok(loaded);
    }
    let first = (commit.chunks.iter().enumerate())
        .find_map(|(i, c)| Some((i, read_record(storage, sb, c.offset, c.len).ok()?)));
    let kind = first.as_ref().map(|(_, (h, _))| h.kind);
    match kind {
        None if commit.chunks.is_empty() => {}
        None if partial => loaded.lost_spans.push((0, sb.logical_blocks())),
        None => return Err(CheckpointError::NoMapRecordReads),
        Some(RecordKind::MapDir) => {
            let first = first.expect("a record read above");
            load_paged(storage, sb, commit, first, load, &mut loaded)?;
            if let Some(named) = commit.named.as_ref().filter(|_| load == Load::Whole) {
                named_matches(sb, commit, named, &mut loaded.map)?;
            }
        }
        Some(_) => load_flat(storage, sb, p.commit_seq, commit, partial, &mut loaded)?,
    }
    Ok(loaded)
}

/// The spans of the damaged items of a sequence in LBA order, each from the
/// end of the intact item before it to the start of the one after it;
/// `spans[i]`: Some(span of item i, if it holds entries) when intact.
fn damaged_spans(spans: &[Option<Option<(u64, u64)>>], logical_blocks: u64) -> Vec<(u64, u64)> {
    let mut lost: Vec<(u64, u64)> = Vec::new();
    for (i, sp) in spans.iter().enumerate() {
        if sp.is_some() {
            continue;
        }
        let from = spans[..i]
            .iter()
            .rev()
            .flatten()
            .flatten()
            .next()
            .map_or(0, |s| s.1);
        let to = spans[i + 1..]
            .iter()
            .flatten()
            .flatten()
            .next()
            .map_or(logical_blocks, |s| s.0);
        if lost.last().is_none_or(|&(_, e)| e < from) {
            lost.push((from, to));
        }
    }
    lost
}

/// `load_commit_map` for MAP_CHUNKs holding the whole map in runs. Their
/// segments are needed up to the commit's seq: the map names none of
/// these records (its pages have none until the first paged checkpoint),
/// so nothing else keeps a segment holding only chunks from being reused
/// while this checkpoint is the durable one.
fn load_flat(
    storage: &dyn Storage,
    sb: &Superblock,
    commit_seq: u64,
    commit: &CommitPayload,
    partial: bool,
    loaded: &mut LoadedMap,
) -> Result<(), CheckpointError> {
    // Chunks hold runs in LBA order: a damaged chunk's span lies between
    // the intact chunks around it.
    let mut spans: Vec<Option<Option<(u64, u64)>>> = Vec::new();
    for c in &commit.chunks {
        loaded.records.note(sb, c.offset, commit_seq);
        match read_chunk(storage, sb, c.offset, c.len, c.crc) {
            Ok(v) => {
                spans.push(Some(v.first().map(|f| (f.0, v[v.len() - 1].0 + 1))));
                v.into_iter().for_each(|(lba, e)| {
                    loaded.map.set(lba, e);
                });
            }
            Err(e) if !partial => return Err(CheckpointError::Chunk(e)),
            Err(_) => spans.push(None),
        }
    }
    loaded.lost_spans = damaged_spans(&spans, sb.logical_blocks());
    Ok(())
}

/// `load_commit_map` for MAP_DIRs and the pages they name: every page is
/// read (`Load::Whole`, `Load::Partial`: the map is whole in memory), or
/// named and left on disk (`Load::Lazy`), those it must verify read
/// together once every directory block is named (`verify_pages`).
fn load_paged(
    storage: &dyn Storage,
    sb: &Superblock,
    commit: &CommitPayload,
    first: (usize, Record),
    load: Load,
    loaded: &mut LoadedMap,
) -> Result<(), CheckpointError> {
    let records = dir_records(storage, sb, commit, first);
    let tables = load_dirs(storage, sb, commit, records, load, loaded)?;
    if load != Load::Partial {
        loaded.tables = read_tables(storage, sb, &tables)
            .map_err(|e| tracing::warn!("liveness tables unusable ({e}): rebuilt from the map"))
            .ok()
            .flatten();
    }
    Ok(())
}

/// `load_paged` of a named directory's commit (`FLAG_DIR_NAMED`) on a
/// lazy load: the blocks open need not verify (no newer than
/// `verify_above`) and that hold no table slot are named by their records
/// alone (`install_unread_dir`) and not read; the others are read as
/// `load_dirs` reads any, and must be the blocks the commit names. The
/// commit's totals, less what the blocks read hold, are the unread ones'.
fn load_named(
    storage: &dyn Storage,
    sb: &Superblock,
    commit: &CommitPayload,
    named: &NamedDir,
    verify_above: u64,
    loaded: &mut LoadedMap,
) -> Result<(), CheckpointError> {
    let bad = |why: &str| CheckpointError::NamedDir(why.to_string());
    if sb.flags & FLAG_DIR_NAMED == 0 {
        return Err(bad(
            "a commit naming its directory on a volume without them",
        ));
    }
    // Blocks wholly within the map's pages (the last ones hold tables).
    let page_blocks = sb.logical_blocks().div_ceil(MAP_PAGE_BLOCKS) / DIR_PAGES;
    let (mut read, mut unread) = (Vec::new(), Vec::new());
    for (c, n) in commit.chunks.iter().zip(&named.blocks) {
        match n.seq <= verify_above && n.block < page_blocks {
            true => unread.push((n.block as usize, page_ref(c, n.seq))),
            false => read.push((c.clone(), n.block)),
        }
    }
    let sub = CommitPayload {
        snapshot_seq: commit.snapshot_seq,
        logical_blocks: commit.logical_blocks,
        chunks: read.iter().map(|(c, _)| c.clone()).collect(),
        resume: commit.resume,
        meta_resume: commit.meta_resume,
        named: None,
    };
    let at: Vec<(u64, u32)> = (sub.chunks.iter()).map(|c| (c.offset, c.len)).collect();
    let records = read_records_shared(storage, sb, &at);
    let tables = load_dirs(
        storage,
        sb,
        &sub,
        records,
        Load::Lazy { verify_above },
        loaded,
    )?;
    for (c, b) in &read {
        let r = usize::try_from(*b)
            .ok()
            .and_then(|b| loaded.map.dir_record_of(b));
        if r.is_none_or(|r| r.offset != c.offset) {
            return Err(bad("a block read is not the one the commit names"));
        }
    }
    for (b, r) in unread {
        loaded.records.note(sb, r.offset, r.seq);
        if !loaded.map.install_unread_dir(b, r) {
            return Err(bad("a block named twice"));
        }
    }
    (named.uses.iter()).for_each(|u| loaded.records.note_segment(u.segment, u.max_seq));
    let totals = (named.allocated_pages, &named.uses[..], Segments::of(sb));
    (loaded.map.name_unread(totals.0, totals.1, totals.2))
        .map_err(|e| CheckpointError::NamedDir(e.to_string()))?;
    loaded.tables = read_tables(storage, sb, &tables)
        .map_err(|e| tracing::warn!("liveness tables unusable ({e}): rebuilt from the map"))
        .ok()
        .flatten();
    Ok(())
}

/// The directory's blocks (`records`: the MAP_DIR records `commit` names,
/// in its order) into `loaded`, their pages named or read per `load`;
/// the tables they name (by table index), in order. The lists kept apart
/// of blocks that cannot stay packed are read together after the
/// summaries.
fn load_dirs(
    storage: &dyn Storage,
    sb: &Superblock,
    commit: &CommitPayload,
    records: Vec<Result<(RecordHeader, SharedBytes), RecordError>>,
    load: Load,
    loaded: &mut LoadedMap,
) -> Result<Vec<(usize, PageRef)>, CheckpointError> {
    let partial = load == Load::Partial;
    let mut spans: Vec<Option<Option<(u64, u64)>>> = Vec::new();
    let mut dirs: Vec<(usize, PageRef, Option<PageRef>)> = Vec::new();
    let mut apart = Vec::new();
    let mut taken = Taken::default();
    for (c, rec) in commit.chunks.iter().zip(records) {
        let after = dirs.last().map(|&(last, ..)| last);
        let read = (rec.map_err(DirError::Record))
            .and_then(|(h, rec)| dir_pages(sb, c, &h, &rec, (load, after), loaded));
        let (b, r, list, pages) = match read {
            Ok(d) if after.is_none_or(|last| last < d.0) => d,
            Ok(_) => return Err(CheckpointError::DirsOutOfOrder),
            Err(e) if !partial => return Err(CheckpointError::Dir(e)),
            Err(_) => {
                spans.push(None);
                continue;
            }
        };
        for r in std::iter::once(r).chain(list) {
            loaded.records.note(sb, r.offset, r.seq);
        }
        dirs.push((b, r, list));
        spans.push(Some(Some(block_span(sb, b))));
        match pages {
            BlockPages::Listed(pages) => taken.block(storage, sb, &pages, load, loaded)?,
            BlockPages::Packed => {}
            BlockPages::Apart(s) => {
                let r = list.expect("a list apart is named");
                apart.push((spans.len() - 1, b, s, r));
            }
        }
    }
    let want: Vec<_> = apart.iter().map(|(_, b, s, r)| (*b, &**s, *r)).collect();
    for ((i, ..), pages) in apart.iter().zip(read_lists(storage, sb, &want)) {
        match pages {
            Ok(pages) => taken.block(storage, sb, &pages, load, loaded)?,
            Err(e) if !partial => return Err(CheckpointError::Dir(e)),
            Err(_) => spans[*i] = None,
        }
    }
    verify_pages(storage, sb, &taken.verify, &mut loaded.map)?;
    for &(t, r) in &taken.tables {
        loaded.map.set_table_ref(t, Some(r));
    }
    for (b, r, list) in dirs {
        loaded.map.install_dir_record(b, r, list);
    }
    if matches!(load, Load::Lazy { .. }) {
        loaded.map.record_originals();
    }
    loaded
        .lost_spans
        .extend(damaged_spans(&spans, sb.logical_blocks()));
    loaded.lost_spans.sort_unstable();
    Ok(taken.tables)
}

/// The LBAs of directory block `b` within the volume.
fn block_span(sb: &Superblock, b: usize) -> (u64, u64) {
    let block_blocks = DIR_PAGES * MAP_PAGE_BLOCKS;
    let first = (b as u64 * block_blocks).min(sb.logical_blocks());
    (first, (first + block_blocks).min(sb.logical_blocks()))
}

/// What `load_dirs` took of the blocks' lists so far: the tables they
/// name (by table index), and the page records to verify.
#[derive(Default)]
struct Taken {
    tables: Vec<(usize, PageRef)>,
    verify: Vec<(u64, PageRef)>,
}

impl Taken {
    /// The records of one directory block's list (page or table slot,
    /// record): its tables noted, its pages loaded per `load`.
    fn block(
        &mut self,
        storage: &dyn Storage,
        sb: &Superblock,
        list: &[(u64, PageRef)],
        load: Load,
        loaded: &mut LoadedMap,
    ) -> Result<(), CheckpointError> {
        let npages = sb.logical_blocks().div_ceil(MAP_PAGE_BLOCKS);
        let mut pages = Vec::with_capacity(list.len());
        for &(p, r) in list {
            loaded.records.note(sb, r.offset, r.seq);
            match p.checked_sub(npages) {
                Some(t) => self.tables.push((t as usize, r)),
                None => pages.push((p, r)),
            }
        }
        load_pages(storage, sb, &pages, load, &mut self.verify, loaded)
    }
}

/// The pages of a directory block as `dir_pages` leaves them: listed,
/// left packed, or to be read from the list kept apart its summary names
/// (the block's list record).
enum BlockPages {
    Listed(Vec<(u64, PageRef)>),
    Packed,
    Apart(Box<DirSummary>),
}

/// A directory block read: its index, its record, the record of its list
/// if the list lies apart, its pages.
type DirPages = (usize, PageRef, Option<PageRef>, BlockPages);

/// The directory block, record and pages of the MAP_DIR record `c` names
/// (its header `h`, bytes `rec`), the block read after block `after`. A
/// summarized block stays packed in `loaded` (its pages none here, its
/// list decoded when first needed) on a lazy load when no page of it
/// needs verifying (the block's record is no newer than `verify_above`,
/// so neither are its pages' nor its list's) and it holds no table slot
/// (tables are read now).
fn dir_pages(
    sb: &Superblock,
    c: &ChunkRef,
    h: &RecordHeader,
    rec: &SharedBytes,
    (load, after): (Load, Option<usize>),
    loaded: &mut LoadedMap,
) -> Result<DirPages, DirError> {
    let npages = sb.logical_blocks().div_ceil(MAP_PAGE_BLOCKS);
    let (b, r, body) = parse_dir_body(sb, c, h, rec)?;
    let stays_packed = match load {
        Load::Lazy { verify_above } => {
            r.seq <= verify_above && (b as u64 + 1) * DIR_PAGES <= npages
        }
        _ => false,
    };
    // One out of order fails the load (the caller's check).
    let in_order = after.is_none_or(|last| last < b);
    let (summary, list) = match body {
        DirBody::Pages(pages) => return Ok((b, r, None, BlockPages::Listed(pages))),
        DirBody::Summarized(s, list) if !(in_order && stays_packed) => {
            let d = decode_summarized(b as u64, &s, list, Segments::of(sb))
                .map_err(DirError::Summary)?;
            return Ok((b, r, None, BlockPages::Listed(d.pages)));
        }
        DirBody::Apart(s, list) if !(in_order && stays_packed) => {
            return Ok((b, r, Some(list), BlockPages::Apart(s)))
        }
        // The list is the record's tail: kept where it was read.
        DirBody::Summarized(s, list) => (s, Err(rec.tail(rec.len() - list.len()))),
        DirBody::Apart(s, list) => (s, Ok(list)),
    };
    (summary.uses.iter()).for_each(|u| loaded.records.note_segment(u.segment, u.max_seq));
    let (kept, apart) = match list {
        Ok(r) => (None, Some(r)),
        Err(bytes) => (Some(bytes), None),
    };
    let segments = Segments::of(sb);
    loaded.map.install_packed_block(b, *summary, kept, segments);
    Ok((b, r, apart, BlockPages::Packed))
}

/// Loads the map pages of one directory block (page, record) per `load`:
/// named and left on disk (lazy; those to verify added to `verify`), or
/// read whole (a damaged one failing the load, or, partial, losing its
/// LBAs).
fn load_pages(
    storage: &dyn Storage,
    sb: &Superblock,
    pages: &[(u64, PageRef)],
    load: Load,
    verify: &mut Vec<(u64, PageRef)>,
    loaded: &mut LoadedMap,
) -> Result<(), CheckpointError> {
    if let Load::Lazy { verify_above } = load {
        verify.extend(pages.iter().filter(|(_, r)| r.seq > verify_above));
        loaded.map.install_unread_block(pages);
        return Ok(());
    }
    for &(p, r) in pages {
        if let Err(e) = load_page(storage, sb, p, r, &mut loaded.map) {
            if load != Load::Partial {
                return Err(CheckpointError::Page { page: p, why: e });
            }
            let first = p * MAP_PAGE_BLOCKS;
            let end = (first + MAP_PAGE_BLOCKS).min(sb.logical_blocks());
            loaded.lost_spans.push((first, end));
        }
    }
    Ok(())
}

/// The MAP_DIR records `commit` names, read in the order it names them:
/// `first` (its index, and the record) was read already, the others are
/// read together (`read_records_shared`), each once.
fn dir_records(
    storage: &dyn Storage,
    sb: &Superblock,
    commit: &CommitPayload,
    first: (usize, Record),
) -> Vec<Result<(RecordHeader, SharedBytes), RecordError>> {
    let (i0, (h, rec)) = first;
    let at: Vec<(u64, u32)> = (commit.chunks.iter().enumerate())
        .filter(|&(i, _)| i != i0)
        .map(|(_, c)| (c.offset, c.len))
        .collect();
    let mut out = read_records_shared(storage, sb, &at);
    out.insert(i0, Ok((h, SharedBytes::owned(rec))));
    out
}

/// Verifies the page records `pages` names (page, record), read together
/// (`read_records`): each must be the MAP_CHUNK its directory names
/// (kind, crc, page). The first that is not fails the checkpoint.
fn verify_pages(
    storage: &dyn Storage,
    sb: &Superblock,
    pages: &[(u64, PageRef)],
    map: &mut BlockMap,
) -> Result<(), CheckpointError> {
    let at: Vec<(u64, u32)> = pages.iter().map(|(_, r)| (r.offset, r.len)).collect();
    for (&(p, r), rec) in pages.iter().zip(read_records(storage, sb, &at)) {
        let why = match rec {
            Err(e) => PageError::Record(e),
            Ok((h, _))
                if h.kind != RecordKind::MapChunk
                    || h.crc != r.crc
                    || h.lba != p * MAP_PAGE_BLOCKS =>
            {
                PageError::NotNamed
            }
            Ok(_) => {
                map.count_verified_at_open();
                continue;
            }
        };
        return Err(CheckpointError::Page { page: p, why });
    }
    Ok(())
}

/// Reads page `p`'s record `r` into `map`, whole.
fn load_page(
    storage: &dyn Storage,
    sb: &Superblock,
    p: u64,
    r: PageRef,
    map: &mut BlockMap,
) -> Result<(), PageError> {
    let src = LogPages {
        storage,
        sb,
        buffered: None,
    };
    let entries = src.entries(&r).map_err(PageError::Chunk)?;
    let page = Page::from_entries(p, &entries).ok_or(PageError::OtherPage)?;
    map.install_loaded(p as usize, page, r);
    Ok(())
}

/// The liveness tables a directory names (by table index), if it names a
/// root: None without one (a checkpoint whose tables were incomplete, or
/// of an older cvol).
fn read_tables(
    storage: &dyn Storage,
    sb: &Superblock,
    tables: &[(usize, PageRef)],
) -> Result<Option<LoadedTables>, TableError> {
    let npages = sb.logical_blocks().div_ceil(MAP_PAGE_BLOCKS);
    let mut root = None;
    let mut groups = Vec::new();
    // Fingerprint tables are read by the index warm-up, not at open.
    let liveness = table_count(sb.table_segments()) as usize;
    for &(t, r) in tables.iter().filter(|(t, _)| *t < liveness) {
        let (h, rec) = read_record(storage, sb, r.offset, r.len).map_err(TableError::Record)?;
        let slot = npages + t as u64;
        if h.kind != RecordKind::MapTable || h.crc != r.crc || h.lba != slot * MAP_PAGE_BLOCKS {
            return Err(TableError::NotNamed { table: t });
        }
        // Codec lz4: the payload compressed whole (older tables); none: the
        // root raw, a group head-first, its rows left compressed.
        let segments = sb.segment_count();
        if t == 0 {
            root = Some(decode_root(h.codec, &rec[RECORD_HEADER_BYTES..], segments)?);
        } else {
            groups.push(LoadedGroup::decode(t, h.codec, rec, segments)?);
        }
    }
    Ok(root.map(|root| LoadedTables { root, groups }))
}

/// A record read and verified: its header and bytes (`read_record`).
type Record = (RecordHeader, Vec<u8>);

#[cfg(test)]
mod segment_seqs_tests {
    use crate::recovery::checkpoint::SegmentSeqs;

    #[test]
    fn each_segment_keeps_the_highest_seq_noted_in_it() {
        let sb = crate::test_util::small_superblock();
        let at = |s: u64, off: u64| sb.segment_offset(s) + off;
        let mut seqs = SegmentSeqs::new(&sb);
        seqs.note(&sb, at(3, 100), 9);
        seqs.note(&sb, at(3, 9000), 12);
        seqs.note(&sb, at(3, 5000), 4);
        seqs.note(&sb, at(0, 0), 0);
        seqs.note(&sb, at(7, 64), 5);
        seqs.note(&sb, 1, 99); // before the segments: no segment's
        seqs.note(&sb, sb.segment_offset_end() + 4096, 99);
        let mut got: Vec<(u64, u64)> = seqs.into_map().into_iter().collect();
        got.sort_unstable();
        assert_eq!(got, [(0, 0), (3, 12), (7, 5)]);
    }
}
