//! Where each view of a pool reads through and keeps old entries
//! (`crate::volume::Layers`), planned from the table: a snapshot reads
//! through the newer snapshots of its volume, then the volume (and what
//! that reads through); a clone reads through its snapshot's layers; a
//! volume with snapshots keeps a block's old entry in its newest snapshot
//! before the block first changes.
use super::Layout;
use crate::volume::{Keep, Layers};
use cvol_format::pool::{PoolTable, SnapState, EXTENT_BLOCKS, NO_EXTENT};
use cvol_format::BLOCK_SIZE_BYTES;
use std::collections::HashMap;
use std::sync::Arc;

/// One layer: its extents and size in blocks. The extents are shared:
/// every view of a volume with n snapshots reads through up to n layers,
/// each a clone of one of the table's (`LayerSet`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Layer {
    pub extents: Arc<[u32]>,
    pub blocks: u64,
}

impl Layer {
    /// The pool LBA of block `b`, if the layer has it.
    /// The pool LBA of block `b`, if the layer has it: None beyond its
    /// size or in an extent not taken (both read as zeros).
    pub(super) fn lba(&self, b: u64) -> Option<u64> {
        let e = *self.extents.get((b / EXTENT_BLOCKS) as usize)?;
        (b < self.blocks && e != NO_EXTENT)
            .then(|| u64::from(e) * EXTENT_BLOCKS + b % EXTENT_BLOCKS)
    }
}

/// A view's layers, from the table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub read_only: bool,
    pub below: Vec<Layer>,
    pub keep: Option<Layer>,
    pub guards: Vec<Layer>,
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

/// The layer of every snapshot and volume of a table, built once for all
/// the plans made from it.
pub struct LayerSet<'t> {
    t: &'t PoolTable,
    snaps: HashMap<u64, Layer>,
    vols: HashMap<u64, Layer>,
}

impl<'t> LayerSet<'t> {
    pub fn of(t: &'t PoolTable) -> LayerSet<'t> {
        LayerSet {
            t,
            snaps: (t.snapshots.iter())
                .map(|s| (s.id, layer(&s.extents, s.size_bytes)))
                .collect(),
            vols: (t.volumes.iter())
                .map(|v| (v.id, layer(&v.extents, v.size_bytes)))
                .collect(),
        }
    }

    /// The table the layers are of.
    pub fn table(&self) -> &'t PoolTable {
        self.t
    }

    fn snap(&self, id: u64) -> Layer {
        self.snaps[&id].clone()
    }

    fn vol(&self, id: u64) -> Layer {
        self.vols[&id].clone()
    }
}

/// What a block of snapshot `id` reads through after the snapshot itself.
fn below_snapshot(ls: &LayerSet, id: u64) -> Vec<Layer> {
    let t = ls.t;
    let Some(s) = t.snapshot_by_id(id) else {
        return Vec::new();
    };
    let mut out: Vec<Layer> = (t.snapshots_of(s.volume))
        .filter(|n| n.id > id)
        .map(|n| ls.snap(n.id))
        .collect();
    if let Some(v) = t.volume_by_id(s.volume) {
        out.push(ls.vol(v.id));
        out.extend(below_volume(ls, v.id));
    }
    out
}

/// What a block of volume `id` reads through (a clone: its snapshot).
fn below_volume(ls: &LayerSet, id: u64) -> Vec<Layer> {
    let t = ls.t;
    match t.volume_by_id(id) {
        Some(v) if v.parent != 0 => match t.snapshot_by_id(v.parent) {
            Some(s) => {
                let mut out = vec![ls.snap(s.id)];
                out.extend(below_snapshot(ls, s.id));
                out
            }
            None => Vec::new(),
        },
        _ => Vec::new(),
    }
}

/// The plan of volume `id`.
pub fn plan_volume(ls: &LayerSet, id: u64) -> Plan {
    let snaps: Vec<_> = ls.t.snapshots_of(id).collect();
    let target = snaps.iter().rposition(|s| s.state != SnapState::Deleting);
    Plan {
        read_only: false,
        below: below_volume(ls, id),
        keep: target.map(|i| ls.snap(snaps[i].id)),
        guards: target.map_or(Vec::new(), |i| {
            snaps[i + 1..].iter().map(|s| ls.snap(s.id)).collect()
        }),
        snaps: snaps
            .iter()
            .map(|s| (s.name.clone(), s.state, ls.snap(s.id)))
            .collect(),
    }
}

/// The plan of snapshot `id` (read-only).
pub fn plan_snapshot(ls: &LayerSet, id: u64) -> Plan {
    Plan {
        read_only: true,
        below: below_snapshot(ls, id),
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
