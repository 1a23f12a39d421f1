//! The cleaner's record movers: a victim's live records go to the log
//! head as they are, or compacted (a unit's dead blocks zeroed and the rest
//! compressed again, `Compacted`); shared records keep their dedup
//! references; the map, the liveness tables and the dedup index follow
//! every move under the state lock. `cleaner.rs` picks the victims and
//! makes the moves durable.
use super::cleaner::Victim;
use crate::codec::Codec;
use crate::dedup::Fingerprint;
use crate::error::VolError;
use crate::log::Shape;
use crate::policy::CodecPolicy;
use crate::records::{full_mask, Found};
use crate::volume::commit::fp_row;
use crate::volume::space::{self};
use crate::volume::{State, Volume};
use cvol_format::record::RecordHeader;
use cvol_format::{CodecTag, EntryState, MapEntry};
use std::sync::atomic::Ordering;

/// A unit rewritten as the cleaner moves it: the blocks that were live when
/// the victim was read (`mask`; the others zeroed) compressed with the
/// cleaner's codec. Used only if it is smaller than the record by at least
/// 1/16 and its live blocks are still a subset of `mask` at the move.
pub(super) struct Compacted {
    pub(super) codec: CodecTag,
    pub(super) level: u8,
    pub(super) payload: Vec<u8>,
    pub(super) crc: u32,
    pub(super) mask: u16,
}

impl Volume {
    /// The codec the cleaner compacts units with: the volume's fixed
    /// codec, or under policy auto the one for the current load (lz4 while
    /// clients are busy), the strong codec once clients have been quiet as
    /// long as background recompression waits for (what the cleaner then
    /// compacts is cold, and recompression does not visit it again); None
    /// for a volume that stores everything raw.
    pub(super) fn compaction_codec(&self) -> Option<Codec> {
        match self.policy {
            CodecPolicy::Fixed(Codec::None) => None,
            CodecPolicy::Fixed(c) => Some(c),
            CodecPolicy::Auto { strong }
                if self.activity.idle_ms() >= self.options.elastic.recompress_idle_ms =>
            {
                Some(strong)
            }
            CodecPolicy::Auto { .. } => Some(
                self.options
                    .elastic
                    .codec_at(self.activity.load.load(&self.options.elastic)),
            ),
        }
    }

    /// For each found record of `base`'s victim: for a unit, the blocks a
    /// compacted form keeps, if compacting it may pay; else None. A unit no
    /// dedup reference points into keeps the blocks the map still points
    /// at (worth it if some are dead, or it is raw); one that references
    /// point into keeps every block (the references' blocks are found only
    /// at the move), worth it if it is raw, or lz4 while the cleaner's codec
    /// is not: compressed again, as background recompression cannot (it
    /// leaves shared records alone).
    pub(super) fn unit_live_masks(
        &self,
        base: u64,
        found: &[Found],
    ) -> Result<Vec<Option<u16>>, VolError> {
        let lz4_gains = !matches!(self.compaction_codec(), None | Some(Codec::Lz4));
        let mut st = self.lock_state()?;
        let mut out = Vec::with_capacity(found.len());
        for f in found {
            let h = &f.header;
            let off = base + f.at as u64;
            let end = h.lba + u64::from(h.nblocks);
            if h.nblocks < 2 || end > st.live.blocks() {
                out.push(None);
                continue;
            }
            if st.live.shared().unit(off).is_some() {
                let weak = h.codec == CodecTag::None || (h.codec == CodecTag::Lz4 && lz4_gains);
                out.push(weak.then(|| full_mask(h.nblocks)));
                continue;
            }
            self.fault(&mut st, h.lba, end)?;
            let len = h.total_len() as u32;
            let mask = (0..h.nblocks)
                .filter(|&k| {
                    st.live.get(h.lba + u64::from(k)) == MapEntry::unit(h.codec, off, len, h.crc, k)
                })
                .fold(0u16, |m, k| m | (1 << k));
            let worth = mask != 0 && (mask != full_mask(h.nblocks) || h.codec == CodecTag::None);
            out.push(worth.then_some(mask));
        }
        Ok(out)
    }

    /// Refuses a move that could leave no room for a checkpoint.
    pub(super) fn check_relocation_room(&self, st: &State, holders: usize) -> Result<(), VolError> {
        let need = space::relocation_bytes(holders, self.checkpoint_estimate_bytes(st));
        if st.log.free_bytes() < need {
            return Err(VolError::NoSpace);
        }
        Ok(())
    }

    /// Moves a multi-block unit: its owners (blocks of its range that still
    /// point at it) are repointed and named in the copy's live mask, so
    /// roll-forward maps exactly them; dedup holders get REF records.
    pub(super) fn move_unit_record(
        &self,
        st: &mut State,
        v: &Victim,
        i: usize,
        holders: &[u64],
    ) -> Result<(), VolError> {
        let f = &v.found[i];
        let h = &f.header;
        let (off, len) = (v.base + f.at as u64, h.total_len() as u32);
        let owners: Vec<u32> = (0..h.nblocks)
            .filter(|&k| {
                let l = h.lba + u64::from(k);
                l < st.live.blocks()
                    && st.live.get(l) == MapEntry::unit(h.codec, off, len, h.crc, k)
            })
            .collect();
        let refs: Vec<(u64, u32)> = holders
            .iter()
            .filter_map(|&l| unit_ref_block(st.live.get(l), off, h.crc, h.nblocks).map(|k| (l, k)))
            .collect();
        if owners.is_empty() && refs.is_empty() {
            return Ok(());
        }
        self.check_relocation_room(st, refs.len())?;
        let mask = owners.iter().fold(0u16, |m, &k| m | (1 << k));
        assert!(
            u32::from(mask) >> h.nblocks == 0,
            "live mask beyond the unit"
        );
        // Compacted only if every block still live is in it, the owners'
        // and the references' (blocks only die while the segment is
        // cleaned: no new reference may point in).
        let compact = v.compact[i]
            .as_ref()
            .filter(|c| mask & !c.mask == 0 && refs.iter().all(|&(_, k)| c.mask & (1 << k) != 0));
        let new = match compact {
            Some(c) => self.append_compacted(st, h, c, mask)?,
            None => self.copy_record(st, v, f, h.lba, mask)?,
        };
        let EntryState::Data {
            offset, len, codec, ..
        } = new.state_valid()
        else {
            unreachable!("copy is data")
        };
        let crc = new.block_in(0);
        let mut moved: Vec<u32> = owners.clone();
        for &k in &owners {
            let e = MapEntry::unit(codec, offset, len, crc, k);
            st.set_entry(h.lba + u64::from(k), e, 0);
        }
        for (l, k) in refs {
            let e = MapEntry::unit(codec, offset, len, crc, k);
            self.commit_ref(st, l, e, 0, Some(h.lba))?;
            moved.push(k);
        }
        assert!(st.live.shared().get(off).is_none(), "every holder moved");
        moved.sort_unstable();
        moved.dedup();
        for k in moved {
            let (from, to) = (
                MapEntry::unit(h.codec, off, h.total_len() as u32, h.crc, k),
                MapEntry::unit(codec, offset, len, crc, k),
            );
            self.reindex_moved(st, v.fp(i, k), &from, to, h.lba + u64::from(k))?;
        }
        Ok(())
    }

    /// Appends a copy of one record if the map still points at the original.
    pub(super) fn move_record(&self, st: &mut State, v: &Victim, i: usize) -> Result<(), VolError> {
        let f = &v.found[i];
        let h = &f.header;
        let old = MapEntry::data(h.codec, v.base + f.at as u64, h.total_len() as u32, h.crc);
        let lbas = h.lba..h.lba + u64::from(h.nblocks);
        if !lbas
            .clone()
            .any(|l| l < st.live.blocks() && st.live.get(l) == old)
        {
            return Ok(());
        }
        let new = self.copy_record(st, v, f, h.lba, 0)?;
        for l in lbas {
            if st.live.get(l) == old {
                st.set_entry(l, new, 0);
            }
        }
        self.reindex_moved(st, v.fp(i, 0), &old, new, h.lba)
    }

    /// Moves a record that dedup references share: the copy's owner is the
    /// old owner if it still points at the record, else one of the holders;
    /// every other holder gets a REF record to the copy, so roll-forward
    /// repoints them all.
    pub(super) fn move_shared_record(
        &self,
        st: &mut State,
        v: &Victim,
        i: usize,
        holders: &[u64],
    ) -> Result<(), VolError> {
        let f = &v.found[i];
        let h = &f.header;
        let offset = v.base + f.at as u64;
        let old = MapEntry::data(h.codec, offset, h.total_len() as u32, h.crc);
        let lbas: Vec<u64> = holders
            .iter()
            .copied()
            .filter(|&l| st.live.get(l).same_record(&old))
            .collect();
        let Some(&first) = lbas.first() else {
            return Ok(()); // every holder moved on since the scan
        };
        self.check_relocation_room(st, lbas.len())?;
        let fp = st.live.shared().fingerprint_of(offset);
        let owner = if h.lba < st.live.blocks() && st.live.get(h.lba) == old {
            h.lba
        } else {
            first
        };
        let new = self.copy_record(st, v, f, owner, 0)?;
        st.set_entry(owner, new, fp);
        for &l in lbas.iter().filter(|&&l| l != owner) {
            self.commit_ref(st, l, new, fp, None)?;
        }
        assert!(st.live.shared().get(offset).is_none(), "all holders moved");
        let fp = if fp != 0 { fp } else { v.fp(i, 0) };
        self.reindex_moved(st, fp, &old, new, owner)
    }

    /// The dedup index follows a moved block: its fingerprint's slot, if it
    /// named the original, names the copy; a fingerprint the index does
    /// not hold is learnt when its set has room (never evicting).
    pub(super) fn reindex_moved(
        &self,
        st: &mut State,
        fp: Fingerprint,
        from: &MapEntry,
        to: MapEntry,
        owner: u64,
    ) -> Result<(), VolError> {
        if fp == 0 {
            return Ok(());
        }
        if let Some(mut ix) = self.lock_index()? {
            ix.hot.moved(fp, from, to, owner);
            if let Some(t) = st.live.fp_note(fp_row(fp, to, owner)) {
                ix.learn_hook(crate::dedup::key(fp), t);
            }
        }
        Ok(())
    }

    /// Appends the record's bytes again (new seq, header naming `owner`,
    /// live mask `mask` for a unit), without recompressing. Returns the
    /// copy's owner map entry (of block 0 for a unit).
    pub(super) fn copy_record(
        &self,
        st: &mut State,
        v: &Victim,
        f: &Found,
        owner: u64,
        mask: u16,
    ) -> Result<MapEntry, VolError> {
        let h = &f.header;
        let shape = Shape::data(h.codec, h.level, owner, h.nblocks, mask);
        let payload = f
            .payload(self.sb.sealer(), &v.buf)
            .map_err(|e| VolError::Corrupt {
                lba: h.lba,
                detail: format!("a record the cleaner moves: {e}"),
            })?;
        let p = self.append(st, shape, &payload)?;
        assert_eq!(p.len as usize, h.total_len(), "a copy is the same record");
        let stats = &self.counters.cleaner;
        stats.records_relocated.fetch_add(1, Ordering::Relaxed);
        stats
            .bytes_relocated
            .fetch_add(u64::from(p.len), Ordering::Relaxed);
        Ok(MapEntry::data(h.codec, p.offset, p.len, p.crc))
    }

    /// Appends the compacted form of the unit `h` (live mask `mask`).
    /// Returns the copy's owner map entry (of block 0).
    pub(super) fn append_compacted(
        &self,
        st: &mut State,
        h: &RecordHeader,
        c: &Compacted,
        mask: u16,
    ) -> Result<MapEntry, VolError> {
        let shape = Shape::data(c.codec, c.level, h.lba, h.nblocks, mask);
        let p = self.append_with_crc(st, shape, &c.payload, c.crc)?;
        let stats = &self.counters.cleaner;
        stats.records_relocated.fetch_add(1, Ordering::Relaxed);
        stats
            .bytes_relocated
            .fetch_add(u64::from(p.len), Ordering::Relaxed);
        stats.units_compacted.fetch_add(1, Ordering::Relaxed);
        stats.compaction_bytes_saved.fetch_add(
            (h.total_len() as u64).saturating_sub(u64::from(p.len)),
            Ordering::Relaxed,
        );
        Ok(MapEntry::data(c.codec, p.offset, p.len, p.crc))
    }
}

/// The block of the unit at `off` (crc `crc`, `nblocks`) that ref entry
/// `e` names, if it is a ref to that unit.
pub(super) fn unit_ref_block(e: MapEntry, off: u64, crc: u32, nblocks: u32) -> Option<u32> {
    match e.state_valid() {
        EntryState::Data {
            offset,
            shared: true,
            unit: true,
            ..
        } if offset == off && e.block_in(crc) < nblocks => Some(e.block_in(crc)),
        _ => None,
    }
}

/// The compacted form of the unit `f` (decoded: `data`): the blocks of
/// `mask` kept, the others zeroed (they compress to almost nothing),
/// compressed with `codec`; None unless it saves 1/16 of the record.
pub(super) fn compacted(
    f: &Found,
    mut data: Vec<u8>,
    mask: u16,
    codec: Codec,
) -> Option<Compacted> {
    const BS: usize = cvol_format::BLOCK_SIZE_BYTES as usize;
    for (k, block) in data.chunks_mut(BS).enumerate() {
        if mask & (1 << k) == 0 {
            block.fill(0);
        }
    }
    let payload = codec.compress(&data)?;
    let old = f.header.total_len();
    let new = f.header.total_len() - f.header.plain_len() + payload.len();
    (new + old / 16 <= old).then(|| Compacted {
        codec: codec.tag(),
        level: codec.level(),
        crc: crc32c::crc32c(&payload),
        payload,
        mask,
    })
}
