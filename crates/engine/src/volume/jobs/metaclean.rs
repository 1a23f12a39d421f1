//! Cleaning the metadata device (a volume with `--metadata-device`): its
//! segments hold only map records, commits and fingerprint tables, which
//! the cleaner never copies: a victim's live map records are marked to be
//! written again by the next checkpoint (as for a data victim holding
//! some), after which the victim is empty and reused once that checkpoint
//! is durable. Run before each checkpoint, when the metadata device's
//! free segments are short or its segments mostly dead.
use crate::error::VolError;
use crate::segments::Region;
use crate::volume::Volume;

/// The metadata device is short of space below this share of its segments
/// free (at least two).
const META_FREE_DIVISOR: u64 = 4;
/// It is sparse when over this many segments are in use and under half of
/// their bytes are live: fingerprint and liveness tables pin segments whose
/// pages were all rewritten since, and `du` of a metadata file would grow
/// while no pressure ever cleans them.
const META_SPARSE_MIN_SEGMENTS: u64 = 8;

impl Volume {
    /// When the metadata device is short of free segments, or sparse,
    /// marks the live map records of its emptiest segments (at most 90%
    /// live when short, half when sparse; their live bytes within half of
    /// what is free) to be rewritten
    /// by the coming checkpoint. Returns how many victims it marked.
    pub(in crate::volume) fn mark_metadata_victims(&self) -> Result<usize, VolError> {
        if !self.sb.has_metadata_device() {
            return Ok(0);
        }
        let victims = {
            let st = self.lock_state()?;
            let (segs, usage) = (&st.log.segments, st.live.usage());
            let size = self.sb.segment_size_bytes;
            let total = u64::from(self.sb.metadata_segments);
            let want = (total / META_FREE_DIVISOR).max(2);
            let used = total - segs.free_in(Region::Meta);
            let live: u64 = segs.range(Region::Meta).map(|s| usage.live_bytes(s)).sum();
            let short = segs.free_in(Region::Meta) < want;
            let sparse = used > META_SPARSE_MIN_SEGMENTS && live * 2 < used * size;
            if !short && !sparse {
                return Ok(0);
            }
            let mut c = segs.candidates_in(Region::Meta, usage);
            c.sort_by_key(|&(_, live, _)| live);
            let mut budget = st.log.meta_free_bytes() / 2;
            let most = if short { size / 10 * 9 } else { size / 2 };
            let mut picked = Vec::new();
            for (s, live, _) in c {
                if live > budget || live > most || picked.len() as u64 >= want {
                    break;
                }
                budget -= live;
                picked.push(s);
            }
            picked
        };
        for &v in &victims {
            self.relocate_segment(v)?;
        }
        if !victims.is_empty() {
            tracing::debug!(segments = victims.len(), "metadata device segments cleaned");
        }
        Ok(victims.len())
    }
}
