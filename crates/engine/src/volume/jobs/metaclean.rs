//! Cleaning the metadata device (a volume with `--metadata-device`): its
//! segments hold only map records, commits and fingerprint tables, which
//! the cleaner never copies: a victim's live map records are marked to be
//! written again by the next checkpoint (as for a data victim holding
//! some), after which the victim is empty and reused once that checkpoint
//! is durable. Run before each checkpoint that falls due, when the
//! metadata device's free segments are short.
use crate::error::VolError;
use crate::segments::Region;
use crate::volume::Volume;

/// The metadata device is short of space below this share of its segments
/// free (at least two).
const META_FREE_DIVISOR: u64 = 4;

impl Volume {
    /// When the metadata device is short of free segments, marks the live
    /// map records of its emptiest segments (their live bytes within half
    /// of what is free) to be rewritten by the coming checkpoint. Returns
    /// how many victims it marked.
    pub(in crate::volume) fn mark_metadata_victims(&self) -> Result<usize, VolError> {
        if !self.sb.has_metadata_device() {
            return Ok(0);
        }
        let victims = {
            let st = self.lock_state()?;
            let segs = &st.log.segments;
            let total = u64::from(self.sb.metadata_segments);
            let want = (total / META_FREE_DIVISOR).max(2);
            if segs.free_in(Region::Meta) >= want {
                return Ok(0);
            }
            let mut c = segs.candidates_in(Region::Meta, st.live.usage());
            c.sort_by_key(|&(_, live, _)| live);
            let mut budget = st.log.meta_free_bytes() / 2;
            let mut picked = Vec::new();
            for (s, live, _) in c {
                if live > budget || picked.len() as u64 >= want {
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
