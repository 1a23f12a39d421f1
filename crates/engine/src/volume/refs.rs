//! Liveness of records: which map entries point at which record, kept exact
//! through every map change (segment live bytes, stored bytes, shared
//! records), rebuilt from the map at open and cross-checked by
//! `verify_refcounts`.
//!
//! Rules (see crate::dedup): a record has at most one *owner* entry (the LBA
//! in its header, created once, when the record is appended or moved) and any
//! number of *ref* entries (dedup). A record with ref entries is in the
//! shared table; a record is live while any entry points at it, and then its
//! bytes count once in its segment's live bytes and in `stored_payload_bytes`.
use super::{State, Volume};
use crate::dedup::{Fingerprint, Shared, SharedTable, UnitLive};
use crate::map::BlockMap;
use crate::segments::{SegState, SegmentTable};
use cvol_format::record::RECORD_HEADER_BYTES;
use cvol_format::{CodecTag, EntryState, MapEntry, Superblock};
use std::collections::HashMap;

/// Everything derived from the map about records: rebuilt at open.
pub(crate) struct Liveness {
    pub segments: SegmentTable,
    pub shared: SharedTable,
    pub stored_payload_bytes: u64,
    pub stored_codec_bytes: [u64; 3],
}

fn seg_of(sb: &Superblock, off: u64) -> u64 {
    (off - sb.data_offset_bytes) / sb.segment_size_bytes
}

/// Rebuilds liveness from a map: live bytes per segment (each record once),
/// the shared table (records with ref entries, and units), stored payload
/// bytes. `needed` marks segments recovery needs (sealed with their newest
/// seq); `open` is the log head.
pub(crate) fn rebuild(
    sb: &Superblock,
    map: &BlockMap,
    needed: &HashMap<u64, u64>,
    open: Option<(u64, u64)>,
) -> Liveness {
    let mut lens: HashMap<u64, (u32, CodecTag)> = HashMap::new();
    let mut shared: HashMap<u64, Shared> = HashMap::new();
    let mut units: HashMap<u64, UnitLive> = HashMap::new();
    map.for_each_mapped(|_, e| {
        if let EntryState::Data {
            offset,
            len,
            shared: is_ref,
            unit,
            codec,
        } = e.state_valid()
        {
            if unit {
                lens.insert(offset, (len, codec));
                let u = units
                    .entry(offset)
                    .or_insert(UnitLive { refs: 0, owners: 0 });
                if is_ref {
                    u.refs += 1;
                } else {
                    u.owners += 1;
                }
            } else if is_ref {
                lens.insert(offset, (len, codec));
                shared
                    .entry(offset)
                    .or_insert(Shared {
                        refs: 0,
                        owners: 0,
                        crc: e.crc,
                        fp: 0,
                    })
                    .refs += 1;
            }
        }
    });
    let mut t = SegmentTable::new(sb.segment_count(), sb.segment_size_bytes);
    let mut stored = 0u64;
    let mut by_codec = [0u64; 3];
    let mut live = |t: &mut SegmentTable, offset: u64, len: u32, codec: CodecTag| {
        let s = seg_of(sb, offset);
        if t.state(s) == SegState::Free {
            t.mark(s, SegState::Sealed, 0);
        }
        t.add_live(s, u64::from(len));
        stored += u64::from(len) - RECORD_HEADER_BYTES as u64;
        by_codec[codec as usize] += u64::from(len) - RECORD_HEADER_BYTES as u64;
    };
    map.for_each_mapped(|_, e| {
        if let EntryState::Data {
            offset,
            len,
            shared: false,
            unit: false,
            codec,
        } = e.state_valid()
        {
            match shared.get_mut(&offset) {
                Some(s) => s.owners = 1,
                None => live(&mut t, offset, len, codec),
            }
        }
    });
    let mut extra = 0u64;
    for (&offset, s) in &shared {
        let (len, codec) = lens[&offset];
        live(&mut t, offset, len, codec);
        extra += s.extra();
    }
    for (&offset, u) in &units {
        let (len, codec) = lens[&offset];
        live(&mut t, offset, len, codec);
        extra += u64::from(u.refs);
    }
    for (&s, &max_seq) in needed {
        t.mark(s, SegState::Sealed, max_seq);
    }
    if let Some((s, seq)) = open {
        t.mark(s, SegState::Open, seq);
    }
    Liveness {
        segments: t,
        shared: SharedTable {
            records: shared,
            units,
            extra_refs: extra,
        },
        stored_payload_bytes: stored,
        stored_codec_bytes: by_codec,
    }
}

impl Volume {
    /// Sets one map entry and keeps liveness exact: the new entry's record
    /// gains a reference (it is new, or live already), the old one loses one.
    pub(super) fn set_entry_fp(&self, st: &mut State, lba: u64, e: MapEntry, fp: Fingerprint) {
        st.map_changes_since_checkpoint += 1;
        let old = st.map.set(lba, e);
        st.counters.remove(old);
        st.counters.add(e);
        if let EntryState::Data {
            offset,
            len,
            shared,
            unit,
            codec,
        } = e.state_valid()
        {
            if shared || unit {
                if st.shared.acquire(offset, e.crc, fp, unit, shared) {
                    self.record_born(st, offset, len, codec);
                }
            } else {
                debug_assert!(
                    st.shared.get(offset).is_none(),
                    "owner entry of a shared record"
                );
                self.record_born(st, offset, len, codec);
            }
        }
        if let EntryState::Data {
            offset,
            len,
            shared,
            codec,
            ..
        } = old.state_valid()
        {
            let dead = match st.shared.release(offset, shared) {
                Some(dead) => dead,
                None => {
                    debug_assert!(!shared, "ref entry of an unshared record");
                    true
                }
            };
            if dead {
                self.record_died(st, offset, len, codec);
            }
        }
    }

    fn record_born(&self, st: &mut State, offset: u64, len: u32, codec: CodecTag) {
        st.log
            .segments
            .add_live(seg_of(&self.sb, offset), u64::from(len));
        let payload = u64::from(len) - RECORD_HEADER_BYTES as u64;
        st.counters.stored_payload_bytes += payload;
        st.counters.stored_codec_bytes[codec as usize] += payload;
    }

    fn record_died(&self, st: &mut State, offset: u64, len: u32, codec: CodecTag) {
        st.log
            .segments
            .sub_live(seg_of(&self.sb, offset), u64::from(len));
        let payload = u64::from(len) - RECORD_HEADER_BYTES as u64;
        st.counters.stored_payload_bytes -= payload;
        st.counters.stored_codec_bytes[codec as usize] -= payload;
    }

    /// Is the record `e` (indexed with LBA `owner`) still live, and still
    /// holding that block? For a unit block, exactly when its owner still
    /// points at it (conservative: a unit block whose owner moved on is
    /// not offered for dedup).
    pub(super) fn record_live(&self, st: &State, e: MapEntry, owner: u64) -> bool {
        let EntryState::Data { offset, unit, .. } = e.state_valid() else {
            return false;
        };
        if !unit {
            if let Some(s) = st.shared.get(offset) {
                return s.crc == e.crc;
            }
        }
        owner < st.map.blocks() && st.map.get(owner) == e
    }

    /// Recomputes reference counts, live bytes per segment and stored bytes
    /// from the map and compares them with the running tables.
    pub fn verify_refcounts(&self) -> Result<(), String> {
        let st = self.lock_state();
        let fresh = rebuild(&self.sb, &st.map, &HashMap::new(), None);
        let mut errors = Vec::new();
        for (off, s) in &st.shared.records {
            match fresh.shared.records.get(off) {
                Some(f) if f == s || (f.fp == 0 && Shared { fp: 0, ..*s } == *f) => {}
                other => errors.push(format!(
                    "record at {off}: running {s:?}, from the map {other:?}"
                )),
            }
        }
        if fresh.shared.units != st.shared.units {
            let differ = st
                .shared
                .units
                .iter()
                .filter(|(o, u)| fresh.shared.units.get(o) != Some(u))
                .count();
            errors.push(format!(
                "units: {} running, {} from the map, {differ} differ",
                st.shared.units.len(),
                fresh.shared.units.len()
            ));
        }
        for (off, f) in &fresh.shared.records {
            if !st.shared.records.contains_key(off) {
                errors.push(format!(
                    "record at {off}: shared per the map ({f:?}), not in the table"
                ));
            }
        }
        if fresh.shared.extra_refs != st.shared.extra_refs {
            errors.push(format!(
                "extra refs: running {}, from the map {}",
                st.shared.extra_refs, fresh.shared.extra_refs
            ));
        }
        if fresh.stored_codec_bytes != st.counters.stored_codec_bytes {
            errors.push(format!(
                "stored bytes by codec: running {:?}, from the map {:?}",
                st.counters.stored_codec_bytes, fresh.stored_codec_bytes
            ));
        }
        if fresh.stored_payload_bytes != st.counters.stored_payload_bytes {
            errors.push(format!(
                "stored bytes: running {}, from the map {}",
                st.counters.stored_payload_bytes, fresh.stored_payload_bytes
            ));
        }
        for s in 0..st.log.segments.count() {
            let (a, b) = (st.log.segments.live_bytes(s), fresh.segments.live_bytes(s));
            if a != b {
                errors.push(format!(
                    "segment {s}: live bytes running {a}, from the map {b}"
                ));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            errors.truncate(20);
            Err(errors.join("; "))
        }
    }
}
