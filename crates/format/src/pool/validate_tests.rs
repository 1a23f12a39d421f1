//! `PoolTable::validate` against its plain definition (each volume and
//! snapshot compared with every earlier one), on random tables near the
//! rules' edges: the same tables taken, the same error for the others.
use super::*;
use rand::{Rng, SeedableRng};

/// The rules as first written: every pair compared, every id looked up
/// by a scan.
fn plain_validate(t: &PoolTable) -> Result<(), FormatError> {
    let bad = FormatError::Invalid;
    if t.generation == 0 {
        return Err(bad("pool table generation 0"));
    }
    let mut used = vec![false; POOL_EXTENTS as usize];
    let mut take = |e: u32| -> Result<(), FormatError> {
        let slot = (used.get_mut(e as usize)).ok_or(bad("pool table extent out of range"))?;
        if std::mem::replace(slot, true) {
            return Err(bad("pool table extent used twice"));
        }
        Ok(())
    };
    for (i, v) in t.volumes.iter().enumerate() {
        if name_problem(&v.name).is_some() {
            return Err(bad("pool table volume name invalid"));
        }
        if (t.volumes[..i].iter()).any(|o| o.name == v.name || o.id == v.id) {
            return Err(bad("pool table volume name or id used twice"));
        }
        if v.id == 0 || v.id >= t.next_id {
            return Err(bad("pool table volume id out of range"));
        }
        if v.size_bytes == 0
            || !v.size_bytes.is_multiple_of(BLOCK_SIZE_BYTES)
            || v.size_bytes > LOGICAL_SIZE_MAX_BYTES
            || v.extents.len() as u64 != extents_for(v.size_bytes)
        {
            return Err(bad("pool table volume size invalid"));
        }
        for &e in &v.extents {
            take(e)?;
        }
    }
    for s in &t.snapshots {
        for &e in s.extents.iter().filter(|&&e| e != NO_EXTENT) {
            take(e)?;
        }
    }
    for &e in &t.pending {
        take(e)?;
    }
    plain_snapshots(t)
}

fn plain_snapshots(t: &PoolTable) -> Result<(), FormatError> {
    let bad = FormatError::Invalid;
    for (i, s) in t.snapshots.iter().enumerate() {
        if snapshot_name_problem(&s.name).is_some() {
            return Err(bad("pool table snapshot name invalid"));
        }
        if s.id == 0 || s.id >= t.next_id || t.volume_by_id(s.id).is_some() {
            return Err(bad("pool table snapshot id out of range or taken"));
        }
        if i > 0 && t.snapshots[i - 1].id >= s.id {
            return Err(bad("pool table snapshots out of order"));
        }
        if t.volume_by_id(s.volume).is_none() {
            return Err(bad("pool table snapshot of no volume"));
        }
        let earlier = &t.snapshots[..i];
        if (earlier.iter()).any(|o| o.volume == s.volume && o.name == s.name) {
            return Err(bad("pool table snapshot name used twice"));
        }
        if s.state == SnapState::RollbackTarget
            && (earlier.iter())
                .any(|o| o.volume == s.volume && o.state == SnapState::RollbackTarget)
        {
            return Err(bad("pool table has two rollbacks of one volume"));
        }
        if s.size_bytes == 0
            || !s.size_bytes.is_multiple_of(BLOCK_SIZE_BYTES)
            || s.size_bytes > LOGICAL_SIZE_MAX_BYTES
            || s.extents.len() as u64 != extents_for(s.size_bytes)
        {
            return Err(bad("pool table snapshot size invalid"));
        }
    }
    for v in &t.volumes {
        if v.parent != 0 && t.snapshot_by_id(v.parent).is_none() {
            return Err(bad("pool table clone of no snapshot"));
        }
    }
    Ok(())
}

/// A valid table of a few volumes, snapshots and clones, then a few
/// changes that each may break a rule (names and ids from small sets, so
/// that repeats are common).
fn random_table(rng: &mut rand::rngs::StdRng) -> PoolTable {
    let mut t = PoolTable::new([1; 16], 4096, 0);
    let states = [
        SnapState::Live,
        SnapState::Deleting,
        SnapState::RollbackTarget,
    ];
    for e in 1..rng.gen_range(1..31) {
        let id = t.next_id;
        t.next_id += 1;
        if rng.gen_range(0..3) == 0 {
            let parent = match t.snapshots.len() {
                0 => 0,
                n => t.snapshots[rng.gen_range(0..n)].id,
            };
            t.volumes.push(PoolVolume {
                name: format!("v{}", rng.gen_range(0..40)),
                id,
                size_bytes: 4096,
                created_unix_secs: 0,
                extents: vec![e],
                parent,
            });
        } else {
            let volume = t.volumes[rng.gen_range(0..t.volumes.len())].id;
            let state = states[rng.gen_range(0..8usize).saturating_sub(5)];
            let name = format!("s{}", rng.gen_range(0..12));
            t.snapshots.push(PoolSnapshot {
                name,
                id,
                volume,
                size_bytes: 4096,
                created_unix_secs: 0,
                state,
                extents: vec![if rng.gen() { NO_EXTENT } else { e }],
            });
        }
    }
    for _ in 0..rng.gen_range(0..3) {
        mutate(rng, &mut t);
    }
    t
}

fn mutate(rng: &mut rand::rngs::StdRng, t: &mut PoolTable) {
    let (nv, ns) = (t.volumes.len(), t.snapshots.len());
    let id = rng.gen_range(0..t.next_id + 2);
    match rng.gen_range(0..8) {
        0 => t.volumes[rng.gen_range(0..nv)].id = id,
        1 => t.volumes[rng.gen_range(0..nv)].parent = id,
        2 => t.volumes[rng.gen_range(0..nv)].name = format!("v{}", rng.gen_range(0..3)),
        3 if ns > 0 => t.snapshots[rng.gen_range(0..ns)].id = id,
        4 if ns > 0 => t.snapshots[rng.gen_range(0..ns)].volume = id,
        5 if ns > 0 => t.snapshots[rng.gen_range(0..ns)].name = format!("s{}", rng.gen_range(0..3)),
        6 if ns > 0 => t.snapshots[rng.gen_range(0..ns)].state = SnapState::RollbackTarget,
        _ => t.next_id = rng.gen_range(1..t.next_id + 1),
    }
}

#[test]
fn validate_matches_its_plain_definition() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut seen = std::collections::BTreeMap::new();
    for _ in 0..20_000 {
        let t = random_table(&mut rng);
        let want = format!("{:?}", plain_validate(&t));
        assert_eq!(format!("{:?}", t.validate()), want, "{t:?}");
        *seen.entry(want).or_insert(0) += 1;
    }
    // Taken, and refused for each rule the changes can break.
    for why in [
        "Ok(())",
        "volume name or id used twice",
        "volume id out of range",
        "snapshot id out of range or taken",
        "snapshots out of order",
        "snapshot of no volume",
        "snapshot name used twice",
        "two rollbacks of one volume",
        "clone of no snapshot",
    ] {
        let n: usize = (seen.iter())
            .filter(|(k, _)| k.contains(why))
            .map(|(_, n)| n)
            .sum();
        assert!(n >= 50, "{why}: {n} of {seen:?}");
    }
}

#[test]
fn first_repeat_finds_the_first_key_seen_before() {
    let plain = |k: &[u32]| (0..k.len()).find(|&i| k[..i].contains(&k[i]));
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    for _ in 0..5000 {
        let k: Vec<u32> = (0..rng.gen_range(0..12))
            .map(|_| rng.gen_range(0..10))
            .collect();
        assert_eq!(first_repeat(k.iter()), plain(&k), "{k:?}");
    }
}
