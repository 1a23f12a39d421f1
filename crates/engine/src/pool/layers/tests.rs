//! The shared chains against the plain definition of what each view reads
//! through (every layer looked up and copied per view), on random tables.
use super::*;
use cvol_format::pool::{PoolSnapshot, PoolVolume};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// The plain definition: each snapshot reads through the newer snapshots
/// of its volume, then the volume and what that reads through; a clone
/// reads through its snapshot and what that reads through.
struct Plain<'t> {
    t: &'t PoolTable,
    snaps: HashMap<u64, Layer>,
    vols: HashMap<u64, Layer>,
}

impl Plain<'_> {
    fn of(t: &PoolTable) -> Plain<'_> {
        Plain {
            t,
            snaps: (t.snapshots.iter().rev())
                .map(|s| (s.id, layer(&s.extents, s.size_bytes)))
                .collect(),
            vols: (t.volumes.iter().rev())
                .map(|v| (v.id, layer(&v.extents, v.size_bytes)))
                .collect(),
        }
    }

    fn below_snapshot(&self, id: u64) -> Vec<Layer> {
        let Some(s) = self.t.snapshot_by_id(id) else {
            return Vec::new();
        };
        let mut out: Vec<Layer> = (self.t.snapshots_of(s.volume))
            .filter(|n| n.id > id)
            .map(|n| self.snaps[&n.id].clone())
            .collect();
        if let Some(v) = self.t.volume_by_id(s.volume) {
            out.push(self.vols[&v.id].clone());
            out.extend(self.below_volume(v.id));
        }
        out
    }

    fn below_volume(&self, id: u64) -> Vec<Layer> {
        match self.t.volume_by_id(id) {
            Some(v) if v.parent != 0 => match self.t.snapshot_by_id(v.parent) {
                Some(s) => {
                    let mut out = vec![self.snaps[&s.id].clone()];
                    out.extend(self.below_snapshot(s.id));
                    out
                }
                None => Vec::new(),
            },
            _ => Vec::new(),
        }
    }

    /// (read_only, below, keep, guards, snaps) of volume `id`.
    fn volume(&self, id: u64) -> PlainPlan {
        let snaps: Vec<_> = self.t.snapshots_of(id).collect();
        let target = snaps.iter().rposition(|s| s.state != SnapState::Deleting);
        (
            false,
            self.below_volume(id),
            target.map(|i| self.snaps[&snaps[i].id].clone()),
            target.map_or(Vec::new(), |i| {
                snaps[i + 1..]
                    .iter()
                    .map(|s| self.snaps[&s.id].clone())
                    .collect()
            }),
            (snaps.iter())
                .map(|s| (s.name.clone(), s.state, self.snaps[&s.id].clone()))
                .collect(),
        )
    }

    fn snapshot(&self, id: u64) -> PlainPlan {
        (true, self.below_snapshot(id), None, Vec::new(), Vec::new())
    }
}

type PlainPlan = (
    bool,
    Vec<Layer>,
    Option<Layer>,
    Vec<Layer>,
    Vec<(String, SnapState, Layer)>,
);

fn flat(p: &Plan) -> PlainPlan {
    (
        p.read_only,
        p.below.to_vec(),
        p.keep.clone(),
        p.guards.to_vec(),
        p.snaps.clone(),
    )
}

/// A random table as the pool makes them (ids increasing in creation
/// order, clones of earlier snapshots), with volumes deleted and parents
/// or volumes that are gone, so that every branch of the plain
/// definition is taken.
fn random_table(rng: &mut rand::rngs::StdRng) -> PoolTable {
    let mut t = PoolTable::new([0; 16], 4096, 0);
    t.volumes.clear();
    let extents = |rng: &mut rand::rngs::StdRng, n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| match rng.gen_range(0..4) {
                0 => NO_EXTENT,
                _ => rng.gen_range(0..1000),
            })
            .collect()
    };
    let states = [
        SnapState::Live,
        SnapState::Deleting,
        SnapState::RollbackTarget,
    ];
    for _ in 0..rng.gen_range(1..40) {
        let id = t.next_id;
        t.next_id += 1;
        let size_bytes = rng.gen_range(1..4u64) * EXTENT_BLOCKS * BLOCK_SIZE_BYTES
            - rng.gen_range(0..2u64) * BLOCK_SIZE_BYTES;
        let n = extents_for_test(size_bytes);
        if t.volumes.is_empty() || rng.gen_range(0..3) == 0 {
            let parent = match rng.gen_range(0..4) {
                0 if !t.snapshots.is_empty() => t.snapshots[rng.gen_range(0..t.snapshots.len())].id,
                1 => rng.gen_range(0..id),
                _ => 0,
            };
            t.volumes.push(PoolVolume {
                name: format!("v{id}"),
                id,
                size_bytes,
                created_unix_secs: 0,
                extents: extents(rng, n),
                parent,
            });
        } else {
            let volume = match rng.gen_range(0..8) {
                0 => id + 1000,
                _ => t.volumes[rng.gen_range(0..t.volumes.len())].id,
            };
            t.snapshots.push(PoolSnapshot {
                name: format!("s{id}"),
                id,
                volume,
                size_bytes,
                created_unix_secs: 0,
                state: states[rng.gen_range(0..3)],
                extents: extents(rng, n),
            });
        }
    }
    for _ in 0..rng.gen_range(0..2) {
        let i = rng.gen_range(0..t.volumes.len());
        t.volumes.remove(i);
    }
    t
}

fn extents_for_test(size_bytes: u64) -> usize {
    size_bytes.div_ceil(EXTENT_BLOCKS * BLOCK_SIZE_BYTES) as usize
}

#[test]
fn chains_match_the_plain_definition() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (mut views, mut deepest) = (0, 0);
    for _ in 0..3000 {
        let t = random_table(&mut rng);
        let (ls, plain) = (LayerSet::of(&t), Plain::of(&t));
        let ids = (t.volumes.iter().map(|v| v.id))
            .chain(t.snapshots.iter().map(|s| s.volume))
            .chain([0, t.next_id]);
        for id in ids {
            assert_eq!(
                flat(&plan_volume(&ls, id)),
                plain.volume(id),
                "volume {id} of {t:?}"
            );
            views += 1;
        }
        for v in &t.volumes {
            assert_eq!(*ls.volume_extents(v), v.extents[..]);
            let mut other = v.clone();
            other.extents.push(5);
            assert_eq!(
                *ls.volume_extents(&other),
                other.extents[..],
                "not the table's"
            );
        }
        for s in &t.snapshots {
            assert_eq!(*ls.snapshot_extents(s), s.extents[..]);
            let mut other = s.clone();
            other.extents.push(5);
            assert_eq!(
                *ls.snapshot_extents(&other),
                other.extents[..],
                "not the table's"
            );
        }
        for id in (t.snapshots.iter().map(|s| s.id)).chain([0, t.next_id]) {
            let p = plan_snapshot(&ls, id);
            deepest = deepest.max(p.below.len());
            assert_eq!(flat(&p), plain.snapshot(id), "snapshot {id} of {t:?}");
            views += 1;
        }
    }
    assert!(
        views > 50_000 && deepest > 20,
        "{views} views, deepest {deepest}"
    );
}

#[test]
fn plans_share_their_chain() {
    let mut t = PoolTable::new([0; 16], 4096, 0);
    for i in 0..100 {
        t.snapshots.push(PoolSnapshot {
            name: format!("s{i}"),
            id: t.next_id,
            volume: 1,
            size_bytes: 4096,
            created_unix_secs: 0,
            state: SnapState::Live,
            extents: vec![10 + i],
        });
        t.next_id += 1;
    }
    let ls = LayerSet::of(&t);
    let (a, b) = (plan_snapshot(&ls, 2), plan_snapshot(&ls, 50));
    assert_eq!((a.below.len(), b.below.len()), (100, 52));
    assert!(
        std::ptr::eq(&a.below[48], &b.below[0]),
        "one chain, not copies"
    );
    let s3 = ls.snapshot_extents(&t.snapshots[1]);
    assert!(
        Arc::ptr_eq(&s3, &a.below[0].extents),
        "a view's extents are its layer's"
    );
    let v = plan_volume(&ls, 1);
    assert_eq!(v.keep.as_ref().map(|k| k.extents[0]), Some(109));
    assert!(v.guards.is_empty() && v.below.is_empty());
}
