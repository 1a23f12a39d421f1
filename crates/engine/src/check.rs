//! Offline verification: superblock copies, checkpoint pointers, the newest
//! checkpoint, the whole log chain, every mapped record (checksum, owner,
//! decompression), and the checkpointed map against a full replay of the log.
use crate::map::BlockMap;
use crate::records::decode_block_record;
use crate::recovery::{self, Recovered};
use cvol_format::superblock::SUPERBLOCK_BYTES;
use cvol_format::{EntryState, MapEntry, RecordKind, Superblock, BLOCK_SIZE_BYTES};
use cvol_storage::Storage;
use std::collections::HashMap;

#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct CheckReport {
    pub errors: Vec<String>,
    pub notes: Vec<String>,
    pub blocks_checked: u64,
    pub records_replayed: u64,
    pub last_seq: u64,
    /// Blocks marked lost by an earlier repair (they read as EIO until
    /// written again).
    pub lost_lbas: Vec<u64>,
    /// LBA ranges [first, end) whose map page is damaged in the checkpoint
    /// open takes (it verifies that checkpoint's pages when first read):
    /// served, they read and write as EIO until `cvol check --repair`.
    pub damaged_page_lbas: Vec<(u64, u64)>,
}

impl CheckReport {
    pub fn consistent(&self) -> bool {
        self.errors.is_empty()
    }
}

/// Verifies the volume on `storage`. `progress(done, total)` is called as
/// mapped blocks are verified.
pub fn check_volume(storage: &dyn Storage, progress: &mut dyn FnMut(u64, u64)) -> CheckReport {
    check_volume_with_key(storage, None, progress)
}

/// `check_volume` of a volume that may be encrypted: `key` opens it.
pub fn check_volume_with_key(
    storage: &dyn Storage,
    key: Option<&crate::keys::KeyFile>,
    progress: &mut dyn FnMut(u64, u64),
) -> CheckReport {
    let mut rep = CheckReport::default();
    let mut sb = match check_superblocks(storage, &mut rep) {
        Some(sb) => sb,
        None => return rep,
    };
    if let Err(e) = crate::keys::unlock(storage, &mut sb, key) {
        rep.errors.push(e.to_string());
        return rep;
    }
    if let Err(e) = recovery::require_metadata_device(storage, &sb) {
        rep.errors.push(e.to_string());
        return rep;
    }
    let ptrs = recovery::read_pointers(storage);
    if ptrs.iter().all(Option::is_none) {
        rep.errors
            .push("no valid checkpoint pointer in either slot".into());
    }
    let mut recovered = match recovery::recover(storage, &sb) {
        Ok(r) => r,
        Err(e) => {
            rep.errors.push(format!("recovery failed: {e}"));
            damaged_pages_open_takes(storage, &sb, &mut rep, Some(progress));
            return rep;
        }
    };
    rep.errors.extend(recovered.warnings.iter().cloned());
    // Open takes the newest pointer's checkpoint without verifying its
    // pages when both pointers decode: where this check fell back from
    // it, name the blocks its damaged pages hold.
    let newest = ptrs.iter().flatten().map(|p| p.generation).max();
    let both = ptrs.iter().flatten().count() == 2;
    if both && newest.is_some_and(|g| recovered.checkpoint_generation < g) {
        damaged_pages_open_takes(storage, &sb, &mut rep, None);
    }
    let certified = recovery::certified_in_log(storage, &sb);
    if recovered.last_seq < certified.seq {
        rep.errors.push(format!(
            "flushed records are missing: recovery reaches seq {} but {} certifies seq {} as \
             flushed (damage hides part of the log from the open); `cvol check --repair` \
             salvages them",
            recovered.last_seq, certified.by, certified.seq
        ));
    }
    rep.records_replayed = recovered.replayed_records;
    rep.last_seq = recovered.last_seq;
    // Once the cleaner has reused segments the log no longer goes back to
    // seq 1; the cross-check is possible only while it does.
    match recovery::replay_full(storage, &sb) {
        Ok(full) if full.last_seq == recovered.last_seq => compare_maps(&recovered, &full, &mut rep),
        Ok(full) => rep.notes.push(format!(
            "log from seq 1 ends at seq {} (older segments reclaimed); full-log cross-check skipped",
            full.last_seq
        )),
        Err(e) => rep.notes.push(format!("full-log cross-check skipped: {e}")),
    }
    if sb.is_pool() {
        check_pool_table(storage, &sb, &recovered.map, &mut rep);
    }
    check_tables(&sb, &mut recovered, &mut rep);
    check_fp_tables(storage, &sb, &recovered, &mut rep);
    check_segment_usage(storage, &sb, &recovered, &mut rep);
    verify_records(storage, &sb, &recovered.map, &mut rep, progress);
    rep
}

/// When the checkpoint open takes (its pages verified when first read)
/// is not the one this check recovered with every page verified: the
/// pages of it that are damaged (each one's LBAs read and write as EIO
/// once served, named in `damaged_page_lbas`), and, with `progress` (this
/// check recovered nothing else to verify), the records its other pages
/// name, verified as `verify_records` does.
fn damaged_pages_open_takes(
    storage: &dyn Storage,
    sb: &Superblock,
    rep: &mut CheckReport,
    progress: Option<&mut dyn FnMut(u64, u64)>,
) {
    use cvol_format::checkpoint::{DIR_PAGES, MAP_PAGE_BLOCKS};
    let Ok(mut r) = recovery::recover_lazy(storage, sb) else {
        return;
    };
    let src = crate::logread::LogPages {
        storage,
        sb,
        buffered: None,
    };
    let blocks = sb.logical_blocks();
    let mut damaged: Vec<(u64, u64, String)> = Vec::new();
    let mut read: Vec<(u64, u64)> = Vec::new();
    let mut note = |first: u64, end: u64, why: String| match damaged.last_mut() {
        Some(last) if last.1 == first => last.1 = end,
        _ => damaged.push((first, end, why)),
    };
    // A directory block's range at a time, page by page where it fails.
    let block_blocks = DIR_PAGES * MAP_PAGE_BLOCKS;
    let mut first = 0;
    while first < blocks {
        let end = (first + block_blocks).min(blocks);
        if r.map.fault_in(first, end, &src).is_ok() {
            read.push((first, end));
        } else {
            let mut p = first;
            while p < end {
                let e = (p + MAP_PAGE_BLOCKS).min(end);
                match r.map.fault_in(p, e, &src) {
                    Ok(()) => read.push((p, e)),
                    Err(why) => note(p, e, why.to_string()),
                }
                p = e;
            }
        }
        first = end;
    }
    for (first, end, why) in &damaged {
        if rep.errors.len() < 100 {
            rep.errors.push(format!(
                "lbas {first}-{}: their map page is damaged ({why}); open takes the newest \
                 checkpoint, and they read and write as EIO until `cvol check --repair`",
                end - 1
            ));
        }
        rep.damaged_page_lbas.push((*first, *end));
    }
    let Some(progress) = progress else {
        return;
    };
    let map = &r.map;
    let each = |f: &mut dyn FnMut(u64, MapEntry)| {
        for &(first, end) in &read {
            map.for_each_mapped_in(first, end, &mut *f);
        }
    };
    verify_entries(storage, sb, each, rep, progress);
}

/// A pool's volume table (`cvol_format::pool`): one slot at least must
/// hold a valid table, and no block may be mapped in an extent no volume
/// holds (a freed extent still pending its unmapping is finished at the
/// next open for writing: a note).
fn check_pool_table(storage: &dyn Storage, sb: &Superblock, map: &BlockMap, rep: &mut CheckReport) {
    use cvol_format::pool::{EXTENT_BLOCKS, POOL_EXTENTS};
    let Some(t) = newest_pool_table(storage, sb, rep) else {
        rep.errors
            .push("the pool's volume table is unreadable in both slots".into());
        return;
    };
    let mut owner = vec![None; POOL_EXTENTS as usize];
    for v in &t.volumes {
        for (k, &e) in v.extents.iter().enumerate() {
            let end = (v.blocks() - k as u64 * EXTENT_BLOCKS).min(EXTENT_BLOCKS);
            owner[e as usize] = Some((v.name.as_str(), end));
        }
    }
    let snap_names: Vec<String> = (t.snapshots.iter())
        .map(|s| {
            let v = t.volume_by_id(s.volume).map_or("?", |v| v.name.as_str());
            format!("{v}@{}", s.name)
        })
        .collect();
    for (s, name) in t.snapshots.iter().zip(&snap_names) {
        for (k, &e) in s.extents.iter().enumerate() {
            if e == cvol_format::pool::NO_EXTENT {
                continue; // not taken: reads zeros
            }
            let end =
                (s.size_bytes / BLOCK_SIZE_BYTES - k as u64 * EXTENT_BLOCKS).min(EXTENT_BLOCKS);
            owner[e as usize] = Some((name.as_str(), end));
        }
        if s.state != cvol_format::pool::SnapState::Live {
            rep.notes.push(format!(
                "snapshot '{name}' is {:?}: the next open for writing finishes it",
                s.state
            ));
        }
    }
    for &e in &t.pending {
        rep.notes
            .push(format!("pool extent {e} is pending its unmapping"));
        owner[e as usize] = Some(("(pending)", EXTENT_BLOCKS));
    }
    let mut lba = 0;
    while let Some(l) = map.next_allocated_page_lba(lba) {
        let e = (l / EXTENT_BLOCKS) as usize;
        let within = l % EXTENT_BLOCKS;
        match owner.get(e).copied().flatten() {
            None => rep.errors.push(format!(
                "blocks are mapped at pool block {l}, in extent {e}, which no volume holds"
            )),
            Some((name, end)) if within >= end => rep.notes.push(format!(
                "volume '{name}' has blocks mapped beyond its end (pool block {l}): \
                 a shrink cut short; unreachable, freed when the volume is deleted"
            )),
            Some(_) => {}
        }
        lba = l - l % cvol_format::checkpoint::MAP_PAGE_BLOCKS
            + cvol_format::checkpoint::MAP_PAGE_BLOCKS;
    }
    rep.notes.push(format!(
        "pool: {} volume(s), {} snapshot(s), table generation {}",
        t.volumes.len(),
        t.snapshots.len(),
        t.generation
    ));
}

/// The newest pool table that decodes (a note for each slot that does not).
fn newest_pool_table(
    storage: &dyn Storage,
    sb: &Superblock,
    rep: &mut CheckReport,
) -> Option<cvol_format::pool::PoolTable> {
    use cvol_format::pool::{PoolTable, POOL_SLOT_BYTES, POOL_SLOT_OFFSETS};
    let mut best: Option<PoolTable> = None;
    for (i, &off) in POOL_SLOT_OFFSETS.iter().enumerate() {
        let mut b = vec![0u8; POOL_SLOT_BYTES as usize];
        let t = storage
            .read_at(off, &mut b)
            .map_err(|e| e.to_string())
            .and_then(|()| {
                PoolTable::decode_with(&b, &sb.uuid, sb.sealer()).map_err(|e| e.to_string())
            });
        match t {
            Ok(t) if best.as_ref().is_none_or(|b| b.generation < t.generation) => best = Some(t),
            Ok(_) => {}
            Err(e) => rep.notes.push(format!("pool table slot {i}: {e}")),
        }
    }
    best
}

/// The liveness tables the checkpoint persisted (what an open takes
/// instead of reading the map) against a rebuild from the map, when
/// nothing was replayed since the checkpoint (else open brings them up to
/// date, which the simulations verify).
fn check_tables(sb: &Superblock, recovered: &mut Recovered, rep: &mut CheckReport) {
    match &recovered.tables {
        Some(_) if recovered.replayed_map_records > 0 => rep.notes.push(format!(
            "liveness tables not compared: {} map records were replayed since the checkpoint",
            recovered.replayed_map_records
        )),
        Some(t) => {
            if let Err(e) = crate::liveness::check_tables(sb, &mut recovered.map, t) {
                rep.errors.push(format!(
                    "checkpoint liveness tables disagree with its map: {e}"
                ));
            }
        }
        None if recovered.map.allocated_pages() > 0 && recovered.map.tables() > 0 => {
            rep.notes.push(
                "the checkpoint names no liveness tables (open rebuilds them from the map)".into(),
            )
        }
        None => {}
    }
}

/// Reads every fingerprint table the directory names. They are hints (a
/// lost one costs dedup hits after the next open, never data), so damage
/// is a note, with what it costs.
fn check_fp_tables(storage: &dyn Storage, sb: &Superblock, r: &Recovered, rep: &mut CheckReport) {
    let first = cvol_format::tables::table_count(sb.table_segments()) as usize;
    let end = cvol_format::hooks::hook_root_table(sb.table_segments(), sb.segment_size_bytes);
    let (mut good, mut rows, mut bad) = (0u64, 0u64, Vec::new());
    for (t, pr) in r.map.table_refs(first, end as usize) {
        match crate::liveness::read_fp_table(storage, sb, t, &pr) {
            Ok(v) => {
                good += 1;
                rows += v.len() as u64;
            }
            Err(e) => bad.push(format!("table {t}: {e}")),
        }
    }
    if good > 0 {
        rep.notes.push(format!(
            "{good} fingerprint tables read ({rows} dedup hints)"
        ));
    }
    if !bad.is_empty() {
        bad.truncate(5);
        rep.notes.push(format!(
            "fingerprint tables unreadable (their dedup hints are lost; data is not): {}",
            bad.join("; ")
        ));
    }
}

/// Cross-checks the segment usage table an open builds from the map against
/// the segments themselves: every DATA entry must point at the start of a
/// record in its segment's chain, and each segment's live bytes must equal
/// the sizes of the records the map points at, found by parsing it.
fn check_segment_usage(
    storage: &dyn Storage,
    sb: &Superblock,
    rec: &Recovered,
    rep: &mut CheckReport,
) {
    let live = crate::liveness::rebuild(
        sb,
        &rec.map,
        None,
        &rec.needed_segments,
        Some((rec.segment, rec.last_seq)),
    )
    .expect("a recovered map is whole in memory");
    let table = live.segments;
    let refs = MapReferences::count(&rec.map);
    let errors_before = rep.errors.len();
    let mut map_records = HashMap::new();
    rec.map.for_each_record(|off, len| {
        map_records.insert(off, len);
    });
    for r in rec.map.retired() {
        map_records.insert(r.offset, r.len);
    }
    check_segment_records(storage, sb, &table, &refs.refs, &map_records, rep);
    let shared = refs.dedup_refs.len();
    let holders: u64 = refs.dedup_refs.keys().map(|o| refs.refs[o]).sum();
    if !refs.units.is_empty() {
        rep.notes.push(format!(
            "units: {} merged compression units serve {} blocks",
            refs.units.len(),
            refs.unit_blocks
        ));
    }
    if shared > 0 {
        let verdict = if rep.errors.len() == errors_before {
            "reference counts match the records"
        } else {
            "see the errors above"
        };
        rep.notes.push(format!(
            "dedup: {shared} records shared by {holders} blocks, {verdict}"
        ));
    }
    rep.notes.push(format!(
        "segment usage: {} live bytes in {} segments, {} free",
        table.total_live_bytes(),
        (0..table.count())
            .filter(|&s| table.live_bytes(s) > 0)
            .count(),
        table.free_count()
    ));
}

/// The map's DATA entries, counted by the record they point at.
struct MapReferences {
    /// Map entries per record offset.
    refs: HashMap<u64, u64>,
    /// Shared (dedup) entries per record offset.
    dedup_refs: HashMap<u64, u64>,
    /// Blocks served by merged compression units, and those units' offsets.
    unit_blocks: u64,
    units: std::collections::HashSet<u64>,
}

impl MapReferences {
    /// Counts every DATA entry of `map`.
    fn count(map: &BlockMap) -> Self {
        let mut r = MapReferences {
            refs: HashMap::new(),
            dedup_refs: HashMap::new(),
            unit_blocks: 0,
            units: std::collections::HashSet::new(),
        };
        map.for_each_mapped(|_, e| {
            if let EntryState::Data {
                offset,
                shared,
                unit,
                ..
            } = e.state_valid()
            {
                *r.refs.entry(offset).or_default() += 1;
                if shared {
                    *r.dedup_refs.entry(offset).or_default() += 1;
                }
                if unit {
                    r.unit_blocks += 1;
                    r.units.insert(offset);
                }
            }
        });
        r
    }
}

/// For every segment the usage table says holds live bytes: parses its
/// records and reports an error unless the records the map points at
/// (`refs`: entries per record offset) hold exactly those bytes and every
/// map reference into the segment lands on one of them.
fn check_segment_records(
    storage: &dyn Storage,
    sb: &Superblock,
    table: &crate::liveness::RebuiltSegments,
    refs: &HashMap<u64, u64>,
    map_records: &HashMap<u64, u32>,
    rep: &mut CheckReport,
) {
    let tag = sb.volume_tag();
    let mut buf = vec![0u8; sb.segment_size_bytes as usize];
    for s in 0..table.count() {
        let want = table.live_bytes(s);
        if want == 0 {
            continue;
        }
        let base = sb.segment_offset(s);
        if let Err(e) = storage.read_at(base, &mut buf) {
            rep.errors.push(format!("segment {s}: read error: {e}"));
            continue;
        }
        let mut found = 0u64;
        let mut referenced = 0u64;
        for f in crate::records::data_records(&buf, tag) {
            if let Some(&n) = refs.get(&(base + f.at as u64)) {
                found += f.header.total_len() as u64; // once, however many blocks share it
                referenced += n;
            }
        }
        // The map's own records (pages, directory blocks) live there too.
        for (at, h) in crate::records::walk_segment(&buf, tag).records {
            let is_map = matches!(
                h.kind,
                RecordKind::MapChunk | RecordKind::MapDir | RecordKind::MapTable
            );
            if is_map && map_records.get(&(base + at as u64)) == Some(&(h.total_len() as u32)) {
                found += h.total_len() as u64;
            }
        }
        let expected: u64 = refs
            .iter()
            .filter(|(&off, _)| off >= base && off < base + sb.segment_size_bytes)
            .map(|(_, &n)| n)
            .sum();
        if found != want || referenced != expected {
            rep.errors.push(format!(
                "segment {s}: usage table says {want} live bytes in {expected} map references, \
                 its records hold {found} bytes for {referenced} of them"
            ));
        }
    }
}

fn check_superblocks(storage: &dyn Storage, rep: &mut CheckReport) -> Option<Superblock> {
    let mut copies = Vec::new();
    for (name, off) in [
        ("A", cvol_format::SUPERBLOCK_A_OFFSET),
        ("B", cvol_format::SUPERBLOCK_B_OFFSET),
    ] {
        let mut b = vec![0u8; SUPERBLOCK_BYTES];
        let r = storage.read_at(off, &mut b).map_err(|e| e.to_string());
        match r.and_then(|_| Superblock::decode(&b).map_err(|e| e.to_string())) {
            Ok(sb) => copies.push(sb),
            Err(e) => rep
                .errors
                .push(format!("superblock copy {name} at byte {off}: {e}")),
        }
    }
    if copies.len() == 2 && copies[0] != copies[1] {
        rep.errors.push("superblock copies A and B differ".into());
    }
    if copies.is_empty() {
        rep.errors
            .push("no valid superblock: not a cvol volume, or both copies destroyed".into());
    }
    copies.into_iter().next()
}

/// The checkpoint + roll-forward map must equal a replay of the whole log.
fn compare_maps(rec: &Recovered, full: &Recovered, rep: &mut CheckReport) {
    let mut diffs = Vec::new();
    let mut lba = 0;
    while lba < rec.map.blocks() && diffs.len() < 20 {
        let a = next_interesting(&rec.map, &full.map, lba);
        let Some(l) = a else { break };
        if rec.map.get(l) != full.map.get(l) {
            diffs.push(l);
        }
        lba = l + 1;
    }
    if !diffs.is_empty() {
        rep.errors.push(format!(
            "checkpointed map differs from the log at LBAs {diffs:?}"
        ));
    }
}

fn next_interesting(a: &BlockMap, b: &BlockMap, lba: u64) -> Option<u64> {
    match (
        a.next_allocated_page_lba(lba),
        b.next_allocated_page_lba(lba),
    ) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, y) => x.or(y),
    }
}

fn verify_records(
    storage: &dyn Storage,
    sb: &Superblock,
    map: &BlockMap,
    rep: &mut CheckReport,
    progress: &mut dyn FnMut(u64, u64),
) {
    verify_entries(storage, sb, |f| map.for_each_mapped(f), rep, progress);
}

/// `verify_records` of the entries `each` calls its argument with.
fn verify_entries(
    storage: &dyn Storage,
    sb: &Superblock,
    each: impl Fn(&mut dyn FnMut(u64, MapEntry)),
    rep: &mut CheckReport,
    progress: &mut dyn FnMut(u64, u64),
) {
    let mut total = 0u64;
    each(&mut |_, e| total += u64::from(matches!(e.state_valid(), EntryState::Data { .. })));
    let mut bad: Vec<(u64, String)> = Vec::new();
    let mut done = 0u64;
    let mut out = vec![0u8; BLOCK_SIZE_BYTES as usize];
    each(&mut |lba, e| {
        if e.state_valid() == EntryState::Lost {
            rep.lost_lbas.push(lba);
        }
        if let EntryState::Data { offset, len, .. } = e.state_valid() {
            if let Err(why) = verify_one(storage, sb, lba, e, offset, len, &mut out) {
                bad.push((lba, why.to_string()));
            }
            done += 1;
            if done.is_multiple_of(4096) || done == total {
                progress(done, total);
            }
        }
    });
    rep.blocks_checked = done;
    if !rep.lost_lbas.is_empty() {
        rep.errors.push(format!(
            "{} block(s) lost to damage (a repair could not salvage their newest flushed \
             version; they read as EIO until written again): LBAs {}",
            rep.lost_lbas.len(),
            recovery::lba_list(&rep.lost_lbas)
        ));
    }
    for (lba, why) in bad.iter().take(100) {
        rep.errors.push(format!(
            "lba {lba} (byte {}): {why}",
            lba * BLOCK_SIZE_BYTES
        ));
    }
    if bad.len() > 100 {
        rep.errors
            .push(format!("... and {} more bad blocks", bad.len() - 100));
    }
}

/// Why `check` finds a mapped block unreadable.
#[derive(Debug)]
enum BadBlock {
    Location(crate::error::EntryLocationError),
    Read(std::io::Error),
    Record(crate::records::BlockError),
}

impl std::fmt::Display for BadBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BadBlock::Location(e) => write!(f, "{e}"),
            BadBlock::Read(e) => write!(f, "read error: {e}"),
            BadBlock::Record(e) => write!(f, "{e}"),
        }
    }
}

fn verify_one(
    storage: &dyn Storage,
    sb: &Superblock,
    lba: u64,
    e: MapEntry,
    offset: u64,
    len: u32,
    out: &mut [u8],
) -> Result<(), BadBlock> {
    crate::logread::check_entry_location(sb, e).map_err(BadBlock::Location)?;
    let mut rec = vec![0u8; len as usize];
    storage.read_at(offset, &mut rec).map_err(BadBlock::Read)?;
    decode_block_record(sb.sealer(), lba, e, &rec, out).map_err(BadBlock::Record)
}

/// What `cvol check --repair` did and what it could not save.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct RepairReport {
    /// Repairs made, in order.
    pub actions: Vec<String>,
    /// Blocks whose newest flushed version the repair found destroyed:
    /// they read as EIO until written again.
    pub lost_lbas: Vec<u64>,
    /// Destroyed records whose blocks cannot be told (by seq): some blocks
    /// may read an older version. Empty when every loss is in `lost_lbas`.
    pub unknown_records: Vec<u64>,
    /// The check after the repair: its errors are what could not be saved
    /// (each names the LBAs affected).
    pub after: CheckReport,
}

/// Repairs what can be repaired from redundancy and the self-describing
/// log: a damaged superblock copy is rewritten from the other; a volume
/// with no usable checkpoint gets its map rebuilt from the log (newest
/// checkpoint whose commit record is intact, else every record in
/// (epoch, seq) order) and two fresh checkpoints, so both pointer slots are
/// valid again. Damaged data records cannot be repaired (there is no second
/// copy): the final check lists their LBAs, which keep reading as EIO.
pub fn repair_volume(storage: std::sync::Arc<dyn Storage>) -> RepairReport {
    repair_volume_with_key(storage, None)
}

/// `repair_volume` of a volume that may be encrypted: `key` opens it.
pub fn repair_volume_with_key(
    storage: std::sync::Arc<dyn Storage>,
    key: Option<crate::keys::KeyFile>,
) -> RepairReport {
    let mut rep = RepairReport::default();
    match recovery::repair_superblocks(&*storage) {
        Ok(notes) => rep.actions.extend(notes),
        Err(e) => {
            rep.after.errors.push(e.to_string());
            return rep;
        }
    }
    let options = crate::OpenOptions {
        rebuild_from_log: true,
        dedup_memory_bytes: Some(1 << 20),
        read_cache_bytes: Some(0),
        key: key.clone(),
        ..crate::OpenOptions::default()
    };
    match crate::Volume::open(storage.clone(), options) {
        Ok(vol) => {
            rep.actions.extend(
                vol.recovery_warnings()
                    .iter()
                    .map(|w| format!("recovery: {w}")),
            );
            if let Some(s) = vol.recovery_salvage() {
                rep.lost_lbas = s.lost_lbas.clone();
                rep.unknown_records = s.unknown_records.clone();
            }
            let mut written = 0;
            for _ in 0..2 {
                match vol.checkpoint() {
                    Ok(()) => written += 1,
                    Err(e) => rep.actions.push(format!("checkpoint failed: {e}")),
                }
            }
            if written > 0 {
                rep.actions.push(format!(
                    "{written} fresh checkpoint(s) written (both pointer slots)"
                ));
            }
            if let Err(e) = vol.close() {
                rep.actions.push(format!("close failed: {e}"));
            }
        }
        Err(e) => rep
            .actions
            .push(format!("could not open the volume to repair it: {e}")),
    }
    rep.after = check_volume_with_key(&*storage, key.as_ref(), &mut |_, _| {});
    rep
}
