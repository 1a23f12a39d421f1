//! Salvage (`cvol check --repair`, when recovery refuses): the salvage
//! walk from the best base (`salvage_from`: an exact walk from an intact
//! checkpoint if there is one, else the newest that loads, its damaged
//! chunks' spans filled from walks over older bases, `fill_lost_spans`),
//! or, without any usable base, the map rebuilt from every record the log
//! still holds (`rebuild_from_log`). Uses `salvage_walk`, `checkpoint`
//! (loading bases), `chain` (seq 1 as a base, applying records), `scan`,
//! `certified`, `superblock` and `outcome`.
use super::certified::{read_flush_mark, Certified};
use super::chain::{apply_scanned, log_start};
use super::checkpoint::{known_checkpoint_records, load_checkpoint, scanned_commits, Load, Source};
use super::outcome::{Recovered, Salvage};
use super::salvage_walk::{loss_warnings, salvage_walk, SalvageBase, SalvageWalk, LOST_NOTE};
use super::scan::{first_record_index, scan_log, LogScan, Scanned};
use super::superblock::pointers_newest_first;
use crate::error::RecoveryError;
use crate::logread::volume_map;
use cvol_format::record::{RecordHeader, RecordKind};
use cvol_format::{CheckpointPointer, EntryState, MapEntry, Superblock};
use cvol_storage::Storage;
use std::collections::HashMap;

/// The salvage walk from the best base: the first checkpoint (pointers
/// newest first, then commits found in the log) whose walk is exact, else
/// the first whose commit record loads, else the log's first record, else
/// `rebuild_from_log`.
pub(super) fn salvage_from(
    storage: &dyn Storage,
    sb: &Superblock,
    scan: &LogScan,
) -> Result<Recovered, RecoveryError> {
    let ptrs = pointers_newest_first(storage);
    let mut certified = Certified::from_pointers(&ptrs);
    certified.raise_from_flush_mark(read_flush_mark(storage, sb));
    certified.raise_from_scan(storage, sb, scan);
    let known = known_checkpoint_records(storage, sb, &ptrs);
    let mut commits: Vec<(CheckpointPointer, Source)> =
        ptrs.iter().map(|p| (*p, Source::Pointer)).collect();
    commits.extend(
        scanned_commits(sb, scan)
            .into_iter()
            .map(|p| (p, Source::Scan)),
    );
    let mut fallback: Option<SalvageWalk> = None;
    let mut tried = Vec::new();
    for (p, source) in &commits {
        if tried.contains(&p.commit_offset) {
            continue;
        }
        tried.push(p.commit_offset);
        let Some(base) = checkpoint_base(storage, sb, p, source.name(p)) else {
            continue;
        };
        let complete = base.lost_spans.is_empty();
        let walk = salvage_walk(sb, scan, base, &certified, &known, None);
        // Every seq from the base on was found (intact, or damaged with
        // its blocks named): nothing between was reused, so the map names
        // no place reused since, and it is exact but for the LOST blocks.
        if complete && walk.unknown.is_empty() {
            return Ok(walk.recovered);
        }
        fallback.get_or_insert(walk);
    }
    let log_base = || -> Result<Option<SalvageBase>, RecoveryError> {
        let index = first_record_index(storage, sb)?;
        Ok(log_start(&index).map(|start| SalvageBase {
            map: volume_map(sb),
            start,
            lost_spans: Vec::new(),
            what: "start of the log (seq 1)".into(),
        }))
    };
    if let Some(mut w) = fallback {
        if !w.lost_spans.is_empty() {
            let mut alternates: Vec<SalvageBase> = commits
                .iter()
                .filter_map(|(p, s)| checkpoint_base(storage, sb, p, s.name(p)))
                .filter(|b| b.lost_spans.is_empty())
                .collect();
            alternates.extend(log_base()?);
            for base in alternates {
                let spans = Some(w.lost_spans.clone());
                fill_lost_spans(
                    &mut w,
                    &salvage_walk(sb, scan, base, &certified, &known, spans),
                );
            }
        }
        return Ok(w.recovered);
    }
    // No checkpoint at all: from the log's first record, if it is still there.
    if let Some(base) = log_base()? {
        return Ok(salvage_walk(sb, scan, base, &certified, &known, None).recovered);
    }
    let mut r = rebuild_from_log(storage, sb)?;
    r.salvage = Some(Salvage {
        lost_lbas: Vec::new(),
        unknown_records: vec![0],
        certified,
    });
    Ok(r)
}

/// A salvage base from the checkpoint `p` names, if its commit record
/// verifies: every intact map record loaded, the LBA spans of the damaged
/// ones lost (`what` names it in the warnings).
fn checkpoint_base(
    storage: &dyn Storage,
    sb: &Superblock,
    p: &CheckpointPointer,
    what: String,
) -> Option<SalvageBase> {
    let c = load_checkpoint(storage, sb, p, Load::Partial).ok()?;
    Some(SalvageBase {
        map: c.map,
        start: c.start,
        lost_spans: c.lost_spans,
        what,
    })
}

/// Gives blocks of `w`'s damaged-chunk spans that are still LOST the value
/// `alt` (a walk from an older, intact base over the same log) ends with,
/// where that value is certain: the last record that changed the block is
/// newer than every record `alt` could not tell (a destroyed header may
/// have held any block), or `alt` could tell every record. The blocks so
/// recovered leave the lost list; the rest stay LOST.
fn fill_lost_spans(w: &mut SalvageWalk, alt: &SalvageWalk) {
    let Some(touches) = &alt.touches else { return };
    let unknown_max = alt.unknown.iter().max().copied();
    let mut filled = 0u64;
    let map = &mut w.recovered.map;
    for &(a, b) in &w.lost_spans {
        for l in a..b {
            let (mine, theirs) = (map.get(l), alt.recovered.map.get(l));
            if mine != MapEntry::LOST || theirs == MapEntry::LOST {
                continue;
            }
            let certain = match touches.last(l) {
                Some(seq) => unknown_max.is_none_or(|u| seq > u),
                None => unknown_max.is_none(),
            };
            if certain {
                map.set(l, theirs);
                filled += 1;
            }
        }
    }
    if filled == 0 {
        return;
    }
    let Some(s) = w.recovered.salvage.as_mut() else {
        return;
    };
    s.lost_lbas.retain(|&l| map.get(l) == MapEntry::LOST);
    // The loss note the walk wrote counted the blocks recovered here.
    w.recovered.warnings.retain(|m| !m.contains(LOST_NOTE));
    w.recovered.warnings.push(format!(
        "{filled} block(s) of the damaged map chunks recovered exactly from the log's older records"
    ));
    w.recovered
        .warnings
        .extend(loss_warnings(&s.lost_lbas, &[], &s.certified));
}

/// Rebuilds the map from every record the log still holds, without any
/// checkpoint (`cvol check --repair` when no checkpoint is usable). Records
/// apply in (epoch, seq) order, so a later epoch's writes win over records a
/// crashed epoch left behind. What it cannot know: a block whose newest
/// history (a TRIM, an overwrite) sat only in segments already reused may
/// come back with an older version; the warnings say how many records and
/// which damaged places were involved.
pub(super) fn rebuild_from_log(
    storage: &dyn Storage,
    sb: &Superblock,
) -> Result<Recovered, RecoveryError> {
    let scan = scan_log(storage, sb);
    let mut recs: Vec<&Scanned> = scan.records.iter().collect();
    if recs.is_empty() {
        return Err(RecoveryError::NoIntactRecord);
    }
    recs.sort_by_key(|r| (r.header.epoch, r.header.seq));
    let data_at: HashMap<u64, &RecordHeader> = scan
        .records
        .iter()
        .filter(|r| r.header.kind == RecordKind::Data)
        .map(|r| (sb.segment_offset(r.segment) + r.at as u64, &r.header))
        .collect();
    let mut map = volume_map(sb);
    let mut needed: HashMap<u64, u64> = HashMap::new();
    let (mut applied, mut dropped_refs) = (0u64, Vec::new());
    for r in &recs {
        let h = &r.header;
        let m = needed.entry(r.segment).or_insert(0);
        *m = (*m).max(h.seq);
        if h.kind == RecordKind::Ref {
            // The target must be an intact DATA record holding that block.
            let ok = r.ref_entry.is_some_and(|e| match e.state() {
                Ok(EntryState::Data { offset, .. }) => data_at
                    .get(&offset)
                    .is_some_and(|t| e.block_in(t.crc) < t.nblocks.max(1)),
                _ => false,
            });
            if !ok {
                dropped_refs.push(h.lba);
                continue;
            }
        }
        applied += u64::from(apply_scanned(&mut map, sb, r));
    }
    // The log goes on in the data store (a volume with a metadata device
    // keeps map records and commits on the other head).
    let last = (recs.iter().rev())
        .find(|r| !sb.is_metadata_segment(r.segment))
        .ok_or(RecoveryError::NoIntactRecord)?;
    let warnings = rebuild_warnings(recs.len(), applied, &scan, dropped_refs);
    // The log continues after every record of the head's segment: records
    // of a crashed epoch may lie beyond the newest one, and the map may
    // name them now.
    let end = recs
        .iter()
        .filter(|r| r.segment == last.segment)
        .map(|r| r.at + r.header.total_len())
        .max()
        .unwrap_or(0);
    Ok(Recovered {
        map,
        segment: last.segment,
        end,
        last_seq: recs.iter().map(|r| r.header.seq).max().unwrap_or(0),
        last_epoch: recs.iter().map(|r| r.header.epoch).max().unwrap_or(0),
        checkpoint_generation: 0,
        replayed_records: recs.len() as u64,
        replayed_map_records: applied.max(1),
        snapshot_seq: 0,
        needed_segments: needed,
        warnings,
        skipped: Vec::new(),
        salvage: None,
        rolled_segments: Vec::new(),
        tables: None,
        new_records: Vec::new(),
        head_segment: None,
    })
}

/// What `rebuild_from_log` says: how many records it applied, which damaged
/// places it skipped, and which dedup references it dropped (their target
/// record is lost).
fn rebuild_warnings(
    records: usize,
    applied: u64,
    scan: &LogScan,
    mut dropped_refs: Vec<u64>,
) -> Vec<String> {
    let mut warnings = vec![format!(
        "map rebuilt from {} records of the log without a checkpoint ({} map changes); \
         blocks whose newest history was only in reused segments may hold an older version",
        records, applied
    )];
    for (s, at, e) in &scan.damaged {
        warnings.push(format!(
            "segment {s} at byte {at}: damaged record ({e}); the rest of that segment was skipped"
        ));
    }
    if !dropped_refs.is_empty() {
        dropped_refs.truncate(100);
        warnings.push(format!(
            "dedup references whose target record is lost were dropped (LBAs {:?}): those blocks read as holes",
            dropped_refs
        ));
    }
    warnings
}
