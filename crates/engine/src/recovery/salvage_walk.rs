//! The salvage walk (`salvage_walk`): a roll-forward from a base (a
//! checkpoint whose commit record verifies, or seq 1) over every record a
//! scan of the log found, in chain order, that below the certified seq
//! does not stop at a missing record: the blocks a damaged record held
//! (its header names them) become LOST, a record destroyed with its header
//! is counted as unknown, and the walk goes on (`SalvageIndex`,
//! `SalvageCursor`). Uses `chain` (`Start`, applying a record), `scan`,
//! `certified` and `outcome`.
use super::certified::Certified;
use super::chain::{apply_scanned, Start, DATA_UNIT_BLOCKS_MAX};
use super::outcome::{Recovered, Salvage};
use super::scan::{LogScan, Scanned};
use crate::map::BlockMap;
use cvol_format::record::{RecordHeader, RecordKind};
use cvol_format::{MapEntry, Superblock};
use std::collections::HashMap;

/// A starting point for `salvage`: a checkpoint whose commit record
/// verifies, with every intact chunk loaded; the LBA spans of damaged
/// chunks are unknown.
pub(super) struct SalvageBase {
    pub(super) map: BlockMap,
    pub(super) start: Start,
    pub(super) lost_spans: Vec<(u64, u64)>,
    pub(super) what: String,
}

/// One salvage walk from `base` over every record the scan found.
pub(super) struct SalvageWalk {
    pub(super) recovered: Recovered,
    pub(super) unknown: Vec<u64>,
    /// The base's damaged map chunks: LBA spans set LOST before the walk.
    pub(super) lost_spans: Vec<(u64, u64)>,
    /// Which records the walk applied to the tracked spans, if asked.
    pub(super) touches: Option<Touches>,
}

/// The last seq that changed each block of some LBA spans, as a salvage
/// walk applies records: a block whose last change is newer than every
/// record the walk could not tell is known exactly.
pub(super) struct Touches {
    spans: Vec<(u64, u64)>,
    /// DATA records, block by block (a unit changes the blocks of its mask).
    blocks: HashMap<u64, u64>,
    /// ZERO, TRIM and REF records: (first, end, seq).
    ranges: Vec<(u64, u64, u64)>,
}

impl Touches {
    fn new(spans: Vec<(u64, u64)>) -> Touches {
        Touches {
            spans,
            blocks: HashMap::new(),
            ranges: Vec::new(),
        }
    }

    /// Notes a record the walk applied (or marked lost).
    fn note(&mut self, h: &RecordHeader, logical_blocks: u64) {
        let end = (h.lba + u64::from(h.nblocks)).min(logical_blocks);
        match h.kind {
            RecordKind::Data => {
                for &(a, b) in &self.spans {
                    for l in h.lba.max(a)..end.min(b) {
                        if h.maps(l) {
                            self.blocks.insert(l, h.seq);
                        }
                    }
                }
            }
            RecordKind::Zero | RecordKind::Trim | RecordKind::Ref
                if self.spans.iter().any(|&(a, b)| h.lba < b && a < end) =>
            {
                self.ranges.push((h.lba, end, h.seq));
            }
            _ => {}
        }
    }

    /// The last seq that changed block `l`, if the walk changed it.
    pub(super) fn last(&self, l: u64) -> Option<u64> {
        let ranges = self.ranges.iter().filter(|r| r.0 <= l && l < r.1);
        self.blocks
            .get(&l)
            .copied()
            .into_iter()
            .chain(ranges.map(|r| r.2))
            .max()
    }
}

/// Rolls forward from `base` like recovery, but below the certified seq a
/// missing record does not end the walk: the blocks of a damaged record
/// (its header tells which) become LOST, a record whose header is gone too
/// is counted as unknown, and the walk goes on with the records after it
/// (in the same segment and later ones), so nothing intact is dropped.
/// Above the certified seq the first gap ends it, as in recovery (an
/// unsynced crash tail, never acknowledged as flushed).
pub(super) fn salvage_walk(
    sb: &Superblock,
    scan: &LogScan,
    base: SalvageBase,
    certified: &Certified,
    known: &HashMap<u64, (u64, u32, u32)>,
    track: Option<Vec<(u64, u64)>>,
) -> SalvageWalk {
    let records = SalvageIndex::new(scan, certified);
    let SalvageBase {
        mut map,
        start,
        lost_spans,
        what,
    } = base;
    for &(a, b) in &lost_spans {
        (a..b).for_each(|l| {
            map.set(l, MapEntry::LOST);
        });
    }
    let mut warnings = vec![format!("salvage from the {what}")];
    if !lost_spans.is_empty() {
        warnings.push(format!(
            "damaged map chunks of that checkpoint: LBA spans {lost_spans:?} are lost unless written after it"
        ));
    }
    let mut walk = SalvageCursor::new(&start);
    walk.touches = track.map(Touches::new);
    walk.run(&mut map, sb, &records, certified, known);
    let mut lost_lbas = Vec::new();
    map.for_each_mapped(|l, e| {
        if e == MapEntry::LOST {
            lost_lbas.push(l);
        }
    });
    warnings.extend(loss_warnings(&lost_lbas, &walk.unknown, certified));
    let salvage = Salvage {
        lost_lbas,
        unknown_records: walk.unknown.clone(),
        certified: certified.clone(),
    };
    let mut w = walk.finish(map, sb, scan, start.snapshot_seq, warnings, salvage);
    w.lost_spans = lost_spans;
    w
}

/// The records a scan found, by seq, for the salvage walk: the intact
/// ones, and the damaged ones whose header says what they held.
struct SalvageIndex<'a> {
    by_seq: HashMap<u64, Vec<&'a Scanned>>,
    damaged_by_seq: HashMap<u64, Vec<&'a (u64, usize, RecordHeader)>>,
    /// The highest seq the log holds or certifies: where the walk stops.
    max_seq: u64,
}

impl<'a> SalvageIndex<'a> {
    /// Indexes the scan's intact and damaged records by seq.
    fn new(scan: &'a LogScan, certified: &Certified) -> Self {
        let mut by_seq: HashMap<u64, Vec<&Scanned>> = HashMap::new();
        for r in &scan.records {
            by_seq.entry(r.header.seq).or_default().push(r);
        }
        let mut damaged_by_seq: HashMap<u64, Vec<&(u64, usize, RecordHeader)>> = HashMap::new();
        for d in &scan.damaged_headers {
            damaged_by_seq.entry(d.2.seq).or_default().push(d);
        }
        let max_seq = scan
            .records
            .iter()
            .map(|r| r.header.seq)
            .chain(scan.damaged_headers.iter().map(|d| d.2.seq))
            .max()
            .unwrap_or(0)
            .max(certified.seq);
        SalvageIndex {
            by_seq,
            damaged_by_seq,
            max_seq,
        }
    }

    /// The intact record of seq `expected` that continues the walk (the
    /// epoch rule; after a gap any epoch not older), the newest epoch's.
    fn intact(&self, expected: u64, epoch: u32, gap: bool) -> Option<&'a Scanned> {
        let v = self.by_seq.get(&expected)?;
        v.iter()
            .filter(|r| {
                let h = &r.header;
                h.epoch == epoch
                    || (h.kind == RecordKind::Epoch && h.epoch > epoch)
                    || (gap && h.epoch >= epoch)
            })
            .max_by_key(|r| r.header.epoch)
            .copied()
    }

    /// The damaged record of seq `expected` (segment, byte, header) of an
    /// epoch not older than the walk's, the newest epoch's.
    fn damaged(&self, expected: u64, epoch: u32) -> Option<&'a (u64, usize, RecordHeader)> {
        let v = self.damaged_by_seq.get(&expected)?;
        v.iter()
            .filter(|d| d.2.epoch >= epoch)
            .max_by_key(|d| d.2.epoch)
            .copied()
    }
}

/// Where the salvage walk is and what it has done.
struct SalvageCursor {
    expected: u64,
    epoch: u32,
    /// The previous seq was missing (damaged or destroyed).
    gap: bool,
    replayed: u64,
    applied: u64,
    /// The last record applied: its segment and the byte after it.
    last: (u64, usize),
    needed: HashMap<u64, u64>,
    /// Seqs below the certified seq destroyed with their headers.
    unknown: Vec<u64>,
    touches: Option<Touches>,
}

impl SalvageCursor {
    /// The walk at the base's start: the seq and epoch after its commit.
    fn new(start: &Start) -> Self {
        SalvageCursor {
            expected: start.expected_seq,
            epoch: start.epoch,
            gap: false,
            replayed: 0,
            applied: 0,
            last: (start.segment, start.offset),
            needed: start.checkpoint_segments.clone(),
            unknown: Vec::new(),
            touches: None,
        }
    }

    /// Walks seq by seq up to the highest seq the log holds: an intact
    /// record applies; below the certified seq a missing one is marked
    /// (its blocks LOST, or nothing for a checkpoint record, or unknown)
    /// and skipped; above it the first gap ends the walk.
    fn run(
        &mut self,
        map: &mut BlockMap,
        sb: &Superblock,
        records: &SalvageIndex,
        certified: &Certified,
        known: &HashMap<u64, (u64, u32, u32)>,
    ) {
        while self.expected <= records.max_seq {
            if let Some(r) = records.intact(self.expected, self.epoch, self.gap) {
                self.apply_intact(map, sb, r);
                continue;
            }
            if self.expected > certified.seq {
                break; // an unsynced tail: recovery drops it too
            }
            self.gap = true;
            match records.damaged(self.expected, self.epoch) {
                Some(&(seg, _, h)) => self.mark_damaged(map, sb, seg, &h),
                None if known.contains_key(&self.expected) => {} // a checkpoint record: no blocks
                None => self.unknown.push(self.expected),
            }
            self.expected += 1;
        }
    }

    /// Applies an intact record of the walk and moves past it.
    fn apply_intact(&mut self, map: &mut BlockMap, sb: &Superblock, r: &Scanned) {
        let h = &r.header;
        let changed = apply_scanned(map, sb, r);
        if let Some(t) = self.touches.as_mut().filter(|_| changed) {
            t.note(h, sb.logical_blocks());
        }
        self.applied += u64::from(changed);
        self.replayed += 1;
        let m = self.needed.entry(r.segment).or_insert(0);
        *m = (*m).max(h.seq);
        if !sb.is_metadata_segment(r.segment) {
            // The log goes on after the data stream's last record.
            self.last = (r.segment, r.at + h.total_len());
        }
        self.epoch = h.epoch;
        self.expected += 1;
        self.gap = false;
    }

    /// A damaged record of segment `seg`, by its header: the blocks it held
    /// become LOST (a DATA unit's live blocks; every block of a ZERO, TRIM
    /// or REF); an EPOCH record still moves the epoch on.
    fn mark_damaged(&mut self, map: &mut BlockMap, sb: &Superblock, seg: u64, h: &RecordHeader) {
        let m = self.needed.entry(seg).or_insert(0);
        *m = (*m).max(h.seq);
        let end = (h.lba + u64::from(h.nblocks.min(DATA_UNIT_BLOCKS_MAX))).min(sb.logical_blocks());
        match h.kind {
            RecordKind::Data => (h.lba..end).filter(|&l| h.maps(l)).for_each(|l| {
                map.set(l, MapEntry::LOST);
            }),
            RecordKind::Zero | RecordKind::Trim | RecordKind::Ref => (h.lba..end).for_each(|l| {
                map.set(l, MapEntry::LOST);
            }),
            RecordKind::Epoch => self.epoch = self.epoch.max(h.epoch),
            RecordKind::MapChunk
            | RecordKind::MapDir
            | RecordKind::MapTable
            | RecordKind::CkptCommit
            | RecordKind::Synced => {}
        }
    }

    /// The salvaged recovery: the log continues after every record of the
    /// head's segment, intact or damaged (nothing the map may name is
    /// overwritten), and after the highest seq and epoch the log holds.
    fn finish(
        self,
        map: BlockMap,
        sb: &Superblock,
        scan: &LogScan,
        snapshot_seq: u64,
        warnings: Vec<String>,
        salvage: Salvage,
    ) -> SalvageWalk {
        let (segment, last_end) = self.last;
        let end = scan
            .records
            .iter()
            .filter(|r| r.segment == segment)
            .map(|r| r.at + r.header.total_len())
            .chain(
                scan.damaged_headers
                    .iter()
                    .filter(|d| d.0 == segment)
                    .map(|d| (d.1 + d.2.total_len()).min(sb.segment_size_bytes as usize)),
            )
            .chain(std::iter::once(last_end))
            .max()
            .unwrap_or(0);
        let all_seqs = scan.records.iter().map(|r| (r.header.seq, r.header.epoch));
        let recovered = Recovered {
            map,
            segment,
            end,
            last_seq: all_seqs
                .clone()
                .map(|x| x.0)
                .max()
                .unwrap_or(0)
                .max(self.expected - 1),
            last_epoch: all_seqs.map(|x| x.1).max().unwrap_or(0).max(self.epoch),
            checkpoint_generation: 0,
            replayed_records: self.replayed,
            replayed_map_records: self.applied.max(1),
            snapshot_seq,
            needed_segments: self.needed,
            warnings,
            skipped: Vec::new(),
            rolled_segments: Vec::new(),
            salvage: Some(salvage),
            tables: None,
            new_records: Vec::new(),
            head_segment: None,
        };
        SalvageWalk {
            recovered,
            unknown: self.unknown,
            lost_spans: Vec::new(),
            touches: self.touches,
        }
    }
}

/// How the note listing lost blocks reads, after their count.
pub(super) const LOST_NOTE: &str = "block(s) lost (their newest flushed version was destroyed";

/// What a salvage could not save, for its warnings: the LOST blocks and
/// the destroyed records whose blocks cannot be told.
pub(super) fn loss_warnings(
    lost_lbas: &[u64],
    unknown: &[u64],
    certified: &Certified,
) -> Vec<String> {
    let mut warnings = Vec::new();
    if !lost_lbas.is_empty() {
        warnings.push(format!(
            "{} {LOST_NOTE}; they read as EIO until written again): LBAs {}",
            lost_lbas.len(),
            lba_list(lost_lbas)
        ));
    }
    if !unknown.is_empty() {
        warnings.push(format!(
            "{} record(s) below the certified seq {} are destroyed with their headers (seqs {}): \
             the blocks they held cannot be told and may read an older version",
            unknown.len(),
            certified.seq,
            lba_list(unknown)
        ));
    }
    warnings
}

/// A short list of numbers for messages (the first 100, then a count).
pub fn lba_list(v: &[u64]) -> String {
    let mut s = format!("{:?}", &v[..v.len().min(100)]);
    if v.len() > 100 {
        s += &format!(" and {} more", v.len() - 100);
    }
    s
}
