//! Where each view of a pool reads through and keeps old entries
//! (`crate::volume::Layers`), planned from the table: a snapshot reads
//! through the newer snapshots of its volume, then the volume (and what
//! that reads through); a clone reads through its snapshot's layers; a
//! volume with snapshots keeps a block's old entry in its newest snapshot
//! before the block first changes.
use super::Layout;
use crate::volume::{Keep, Layers};
use cvol_format::pool::{PoolSnapshot, PoolTable, PoolVolume, SnapState, EXTENT_BLOCKS, NO_EXTENT};
use cvol_format::BLOCK_SIZE_BYTES;
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// One layer: its extents and size in blocks. The extents are shared:
/// a layer lies in the chain of its volume and in those of the volume's
/// clones (`LayerSet`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Layer {
    pub extents: Arc<[u32]>,
    pub blocks: u64,
}

impl Layer {
    /// The pool LBA of block `b`, if the layer has it: None beyond its
    /// size or in an extent not taken (both read as zeros).
    pub(super) fn lba(&self, b: u64) -> Option<u64> {
        let e = *self.extents.get((b / EXTENT_BLOCKS) as usize)?;
        (b < self.blocks && e != NO_EXTENT)
            .then(|| u64::from(e) * EXTENT_BLOCKS + b % EXTENT_BLOCKS)
    }
}

/// Consecutive layers of a chain (`LayerSet`), shared by every plan that
/// reads through them: what a snapshot reads through is the tail of its
/// volume's chain, so n snapshots share one chain instead of holding
/// n(n+1)/2 layers between them. Reads as a slice.
#[derive(Clone, Default)]
pub struct LayerRange {
    chain: Option<Arc<[Layer]>>,
    from: usize,
    to: usize,
}

impl LayerRange {
    /// `chain[range]`.
    fn of(chain: &Arc<[Layer]>, range: std::ops::Range<usize>) -> LayerRange {
        assert!(range.start <= range.end && range.end <= chain.len());
        LayerRange {
            chain: Some(chain.clone()),
            from: range.start,
            to: range.end,
        }
    }
}

impl std::ops::Deref for LayerRange {
    type Target = [Layer];
    fn deref(&self) -> &[Layer] {
        self.chain
            .as_deref()
            .map_or(&[], |c| &c[self.from..self.to])
    }
}

impl PartialEq for LayerRange {
    fn eq(&self, o: &LayerRange) -> bool {
        **self == **o
    }
}

impl Eq for LayerRange {}

impl std::fmt::Debug for LayerRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// A view's layers, from the table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub read_only: bool,
    pub below: LayerRange,
    pub keep: Option<Layer>,
    pub guards: LayerRange,
    /// The volume's snapshots, oldest first, with their state (for
    /// changed-block tracking).
    pub snaps: Vec<(String, SnapState, Layer)>,
}

fn layer(extents: &[u32], size_bytes: u64) -> Layer {
    Layer {
        extents: extents.into(),
        blocks: size_bytes / BLOCK_SIZE_BYTES,
    }
}

/// The layers of a table, built once for all the plans made from it: the
/// *chain* of each volume id is its snapshots' layers, oldest first, then
/// (if the volume exists) its own layer and what it reads through (a
/// clone: the chain of its snapshot's volume from that snapshot on). A
/// snapshot reads through the rest of its volume's chain after itself
/// (the table keeps snapshots in id order, so the newer ones follow it).
pub struct LayerSet<'t> {
    t: &'t PoolTable,
    /// By volume id: its chain, and the indexes of its snapshots in
    /// `t.snapshots`, oldest first.
    chains: FxHashMap<u64, (Arc<[Layer]>, Vec<usize>)>,
    /// By snapshot id: its index in `t.snapshots` and in its volume's chain.
    snap_at: FxHashMap<u64, (usize, usize)>,
    /// By volume id: its index in `t.volumes`.
    vols: FxHashMap<u64, usize>,
}

/// A chain being built (`LayerSet::of`).
struct Build<'t> {
    t: &'t PoolTable,
    snaps: Vec<Layer>,
    vols: FxHashMap<u64, usize>,
    of_vol: FxHashMap<u64, Vec<usize>>,
    snap_at: FxHashMap<u64, (usize, usize)>,
    /// None while a chain is being built: a clone cycle (which no table
    /// the pool writes has) reads through nothing at the repeat.
    chains: FxHashMap<u64, Option<Arc<[Layer]>>>,
}

impl Build<'_> {
    fn chain(&mut self, vid: u64) -> Option<Arc<[Layer]>> {
        if let Some(c) = self.chains.get(&vid) {
            return c.clone();
        }
        self.chains.insert(vid, None);
        let mut out: Vec<Layer> = (self.of_vol.get(&vid).into_iter().flatten())
            .map(|&i| self.snaps[i].clone())
            .collect();
        if let Some(&vi) = self.vols.get(&vid) {
            let v = &self.t.volumes[vi];
            out.push(layer(&v.extents, v.size_bytes));
            if let Some(&(i, at)) = self.snap_at.get(&v.parent).filter(|_| v.parent != 0) {
                let w = self.t.snapshots[i].volume;
                if let Some(c) = self.chain(w) {
                    out.extend_from_slice(&c[at..]);
                }
            }
        }
        let c: Arc<[Layer]> = out.into();
        self.chains.insert(vid, Some(c.clone()));
        Some(c)
    }
}

impl<'t> LayerSet<'t> {
    pub fn of(t: &'t PoolTable) -> LayerSet<'t> {
        let mut b = Build {
            t,
            snaps: (t.snapshots.iter())
                .map(|s| layer(&s.extents, s.size_bytes))
                .collect(),
            vols: FxHashMap::default(),
            of_vol: FxHashMap::default(),
            snap_at: FxHashMap::default(),
            chains: FxHashMap::default(),
        };
        for (i, v) in t.volumes.iter().enumerate() {
            b.vols.entry(v.id).or_insert(i);
        }
        for (i, s) in t.snapshots.iter().enumerate() {
            let of = b.of_vol.entry(s.volume).or_default();
            b.snap_at.entry(s.id).or_insert((i, of.len()));
            of.push(i);
        }
        let ids: Vec<u64> = (t.volumes.iter().map(|v| v.id))
            .chain(t.snapshots.iter().map(|s| s.volume))
            .collect();
        for id in ids {
            b.chain(id);
        }
        let mut of_vol = b.of_vol;
        let chains = (b.chains.into_iter())
            .filter_map(|(id, c)| Some((id, (c?, of_vol.remove(&id).unwrap_or_default()))))
            .collect();
        LayerSet {
            t,
            chains,
            snap_at: b.snap_at,
            vols: b.vols,
        }
    }

    /// The table the layers are of.
    pub fn table(&self) -> &'t PoolTable {
        self.t
    }

    /// The extents of volume `v` of the table, shared with its layer.
    pub fn volume_extents(&self, v: &PoolVolume) -> Arc<[u32]> {
        let own = (self.chains.get(&v.id))
            .filter(|_| {
                (self.vols.get(&v.id)).is_some_and(|&i| std::ptr::eq(&self.t.volumes[i], v))
            })
            .map(|(chain, snaps)| chain[snaps.len()].extents.clone());
        own.unwrap_or_else(|| v.extents.as_slice().into())
    }

    /// The extents of snapshot `s` of the table, shared with its layer.
    pub fn snapshot_extents(&self, s: &PoolSnapshot) -> Arc<[u32]> {
        let own = (self.snap_at.get(&s.id))
            .filter(|&&(i, _)| std::ptr::eq(&self.t.snapshots[i], s))
            .map(|&(_, at)| self.chains[&s.volume].0[at].extents.clone());
        own.unwrap_or_else(|| s.extents.as_slice().into())
    }
}

/// The plan of volume `id`.
pub fn plan_volume(ls: &LayerSet, id: u64) -> Plan {
    let Some((chain, snaps)) = ls.chains.get(&id) else {
        return Plan::default();
    };
    let snaps: Vec<_> = snaps.iter().map(|&i| &ls.t.snapshots[i]).collect();
    let n = snaps.len();
    let target = snaps.iter().rposition(|s| s.state != SnapState::Deleting);
    let exists = ls.vols.contains_key(&id);
    Plan {
        read_only: false,
        below: if exists {
            LayerRange::of(chain, n + 1..chain.len())
        } else {
            LayerRange::default()
        },
        keep: target.map(|i| chain[i].clone()),
        guards: target.map_or(LayerRange::default(), |i| LayerRange::of(chain, i + 1..n)),
        snaps: (snaps.iter().zip(chain.iter()))
            .map(|(s, l)| (s.name.clone(), s.state, l.clone()))
            .collect(),
    }
}

/// The plan of snapshot `id` (read-only).
pub fn plan_snapshot(ls: &LayerSet, id: u64) -> Plan {
    let below = ls
        .snap_at
        .get(&id)
        .map_or(LayerRange::default(), |&(i, at)| {
            let (chain, _) = &ls.chains[&ls.t.snapshots[i].volume];
            LayerRange::of(chain, at + 1..chain.len())
        });
    Plan {
        read_only: true,
        below,
        ..Plan::default()
    }
}

impl Layout {
    /// Where the piece starting at the view's block `b` ends at most: the
    /// nearest end of a layer below after `b` (the layers below a clone
    /// end where its snapshot does).
    pub(super) fn piece_end(&self, b: u64) -> u64 {
        (self.plan.below.iter())
            .map(|l| l.blocks)
            .filter(|&e| e > b)
            .min()
            .unwrap_or(u64::MAX)
    }

    /// The layers of the view's block `b` (a request's first).
    pub(super) fn layers_at(&self, b: u64) -> Layers {
        let p = &self.plan;
        // A layer that ends before `b`, or has no extent there, ends the
        // chain: the view reads zeros there, whatever lies below.
        let below = p.below.iter().map_while(|l| l.lba(b)).collect();
        // A guard without an extent here read zeros here (its volume held
        // nothing when it was taken), as if it mapped every block: a
        // block changed since it needs no keeping in an older target.
        let keep = p.keep.as_ref().and_then(|k| {
            Some(Keep {
                target: k.lba(b)?,
                blocks: k.blocks - b,
                guards: p.guards.iter().map(|g| g.lba(b)).collect::<Option<_>>()?,
            })
        });
        Layers { below, keep }
    }
}

#[cfg(test)]
mod tests;
