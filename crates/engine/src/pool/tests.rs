use super::*;
use crate::Codec;
use cvol_format::pool::EXTENT_BYTES;
use cvol_storage::SimStorage;

const BS: usize = 4096;

fn options(sim: &SimStorage, size: u64) -> CreateOptions {
    CreateOptions::new(size, sim.len_bytes())
        .with_codec(Codec::Lz4)
        .with_segment_size(1 << 20)
}

fn pool(sim: &SimStorage) -> Pool {
    Pool::create(Arc::new(sim.clone()), &options(sim, 8 << 20)).unwrap()
}

fn reopen(sim: &SimStorage) -> Pool {
    let vol = Volume::open(Arc::new(sim.clone()), crate::OpenOptions::default()).unwrap();
    Pool::attach(Arc::new(vol)).unwrap()
}

fn block(tag: u64) -> Vec<u8> {
    format!("block {tag} ").bytes().cycle().take(BS).collect()
}

fn read(v: &VolumeView, offset: u64) -> Vec<u8> {
    let mut b = vec![0u8; BS];
    v.read_at(offset, &mut b).unwrap();
    b
}

#[test]
fn a_new_pool_has_one_volume_default_served_under_the_empty_name_too() {
    let sim = SimStorage::new(64 << 20);
    let p = pool(&sim);
    let names: Vec<_> = p
        .volumes()
        .into_iter()
        .map(|v| (v.name, v.size_bytes))
        .collect();
    assert_eq!(names, vec![("default".to_string(), 8 << 20)]);
    assert_eq!(p.volume("").unwrap().name(), "default");
    assert!(!p.is_legacy());
    assert!(p.engine().superblock().is_pool());
    assert_eq!(p.volume("default").unwrap().size_bytes(), 8 << 20);
}

#[test]
fn volumes_are_isolated_and_share_their_blocks() {
    let sim = SimStorage::new(64 << 20);
    let p = pool(&sim);
    p.create_volume("b", 4 << 20).unwrap();
    let (a, b) = (p.volume("default").unwrap(), p.volume("b").unwrap());
    for i in 0..64u64 {
        a.write_at(i * BS as u64, &block(i), false).unwrap();
        b.write_at(i * BS as u64, &block(i), false).unwrap();
    }
    b.write_at(0, &block(1000), false).unwrap();
    a.flush().unwrap();
    assert_eq!(read(&a, 0), block(0));
    assert_eq!(read(&b, 0), block(1000));
    assert_eq!(read(&b, 5 * BS as u64), block(5));
    assert!(matches!(
        b.read_at(4 << 20, &mut [0u8; BS]),
        Err(VolError::OutOfRange)
    ));
    // 63 blocks of b are a's blocks, stored once.
    let (ua, ub) = (p.usage("default").unwrap(), p.usage("b").unwrap());
    assert_eq!(ua.mapped_bytes, 64 * BS as u64);
    assert_eq!(ub.mapped_bytes, 64 * BS as u64);
    assert!(
        ub.shared_bytes > 0 && ua.shared_bytes == ub.shared_bytes,
        "{ua:?} {ub:?}"
    );
    assert!(
        ua.unique_bytes > 0 && ub.unique_bytes > 0,
        "block 0 of each is its own"
    );
    assert!(ub.unique_bytes < ub.shared_bytes / 10, "{ub:?}");
}

#[test]
fn a_deleted_volume_blocks_never_reach_a_new_one() {
    let sim = SimStorage::new(64 << 20);
    let p = pool(&sim);
    p.create_volume("old", 4 << 20).unwrap();
    let old = p.volume("old").unwrap();
    for i in 0..32u64 {
        old.write_at(i * BS as u64, &block(i), false).unwrap();
    }
    old.flush().unwrap();
    let guard = old.open_guard();
    let busy = p.delete_volume("old", false).unwrap_err();
    assert!(busy.to_string().contains("open by 1 client"), "{busy}");
    p.delete_volume("old", true).unwrap();
    assert!(
        old.read_at(0, &mut [0u8; BS]).is_err(),
        "a deleted volume serves nothing"
    );
    drop(guard);
    assert!(p.volume("old").is_none());
    p.create_volume("new", 4 << 20).unwrap();
    let new = p.volume("new").unwrap();
    for i in 0..32u64 {
        assert_eq!(read(&new, i * BS as u64), vec![0u8; BS], "block {i}");
    }
    let again = reopen(&sim);
    assert_eq!(again.volumes().len(), 2);
    assert_eq!(read(&again.volume("new").unwrap(), 0), vec![0u8; BS]);
}

#[test]
fn resize_grows_reads_zeros_beyond_and_refuses_to_cut_data() {
    let sim = SimStorage::new(64 << 20);
    let p = pool(&sim);
    let v = p.volume("default").unwrap();
    v.write_at((8 << 20) - BS as u64, &block(7), false).unwrap();
    let e = p.resize_volume("default", 4 << 20, false).unwrap_err();
    assert!(
        matches!(e, PoolError::MappedBeyond { first_mapped, .. } if first_mapped == (8 << 20) - 4096),
        "{e}"
    );
    assert_eq!(v.size_bytes(), 8 << 20, "a refused shrink changes nothing");
    assert_eq!(p.resize_volume("default", 4 << 20, true).unwrap(), 8 << 20);
    assert_eq!(v.size_bytes(), 4 << 20);
    p.resize_volume("default", EXTENT_BYTES + (8 << 20), false)
        .unwrap();
    assert_eq!(
        read(&v, (8 << 20) - BS as u64),
        vec![0u8; BS],
        "discarded data stays gone"
    );
    v.write_at(EXTENT_BYTES + BS as u64, &block(9), false)
        .unwrap();
    v.flush().unwrap();
    let again = reopen(&sim);
    let v = again.volume("default").unwrap();
    assert_eq!(v.size_bytes(), EXTENT_BYTES + (8 << 20));
    assert_eq!(read(&v, EXTENT_BYTES + BS as u64), block(9));
}

#[test]
fn mistakes_are_refused_with_their_reason() {
    let sim = SimStorage::new(64 << 20);
    let p = pool(&sim);
    let e = |r: Result<(), PoolError>| r.unwrap_err().to_string();
    assert!(e(p.create_volume("default", 4096)).contains("already has"));
    assert!(e(p.create_volume("a/b", 4096)).contains("'/'"));
    assert!(e(p.create_volume("a@b", 4096)).contains("'@'"));
    assert!(e(p.create_volume("x", 4095)).contains("multiple of 4096"));
    assert!(e(p.create_volume("x", 17 << 40)).contains("16 TiB"));
    assert!(e(p.delete_volume("nope", false)).contains("has: default"));
    p.create_volume("big", 15 << 40).unwrap();
    let full = e(p.create_volume("more", 2 << 40));
    assert!(full.contains("1023 GiB are left"), "{full}");
    assert_eq!(p.volumes().len(), 2);
}

#[test]
fn a_crash_during_operations_leaves_the_old_or_the_new_table() {
    let sim = SimStorage::new(64 << 20);
    let p = pool(&sim);
    for i in 0..6u64 {
        p.create_volume(&format!("v{i}"), 1 << 20).unwrap();
        let v = p.volume(&format!("v{i}")).unwrap();
        v.write_at(0, &block(i), true).unwrap();
        if i % 2 == 1 {
            p.delete_volume(&format!("v{}", i - 1), false).unwrap();
        }
        for seed in 0..4 {
            let crashed = sim.crash(i * 10 + seed);
            let q = reopen(&crashed);
            let names: Vec<_> = q.volumes().into_iter().map(|v| v.name).collect();
            assert!(names.contains(&format!("v{i}")), "{names:?}");
            assert_eq!(read(&q.volume(&format!("v{i}")).unwrap(), 0), block(i));
        }
    }
}

fn consistent(p: &Pool, sim: &SimStorage) {
    p.engine().close().unwrap();
    let r = crate::check::check_volume(sim, &mut |_, _| {});
    assert!(r.consistent(), "{r:?}");
}

#[test]
fn a_snapshot_keeps_what_the_volume_held_and_the_volume_moves_on() {
    let sim = SimStorage::new(64 << 20);
    let p = pool(&sim);
    let v = p.volume("default").unwrap();
    v.write_at(0, &block(1), false).unwrap();
    v.write_at(BS as u64, &block(2), false).unwrap();
    p.create_snapshot("default@s1").unwrap();
    let s = p.volume("default@s1").unwrap();
    assert!(s.read_only());
    v.write_at(0, &block(3), false).unwrap();
    v.trim(BS as u64, BS as u64, false).unwrap();
    v.write_at(2 * BS as u64, &block(4), false).unwrap();
    assert_eq!(read(&s, 0), block(1));
    assert_eq!(read(&s, BS as u64), block(2));
    assert_eq!(read(&s, 2 * BS as u64), vec![0u8; BS]);
    assert_eq!(read(&v, 0), block(3));
    assert_eq!(read(&v, BS as u64), vec![0u8; BS]);
    assert!(matches!(
        s.write_at(0, &block(9), false),
        Err(crate::VolError::ReadOnly)
    ));
    // Changed since s1: blocks 0, 1, 2; not 3.
    let runs = v.changed_since("s1", 0, 4 * BS as u64).unwrap().unwrap();
    assert_eq!(runs, vec![(3 * BS as u64, true), (BS as u64, false)]);
    p.engine().flush().unwrap();
    drop((v, s));
    drop(p);
    let p = reopen(&sim);
    let s = p.volume("default@s1").unwrap();
    assert_eq!(read(&s, 0), block(1));
    assert_eq!(read(&s, BS as u64), block(2));
    assert_eq!(read(&p.volume("default").unwrap(), 0), block(3));
    consistent(&p, &sim);
}

/// A pool whose `default` holds block 1 at 0, snapshotted twice, as
/// `default@a` then `default@b`; and its volume.
fn snapshotted_twice(sim: &SimStorage) -> (Pool, Arc<VolumeView>) {
    let p = pool(sim);
    let v = p.volume("default").unwrap();
    v.write_at(0, &block(1), false).unwrap();
    p.create_snapshot("default@a").unwrap();
    p.create_snapshot("default@b").unwrap();
    (p, v)
}

#[test]
fn deleting_a_middle_snapshot_keeps_the_older_one_whole() {
    let sim = SimStorage::new(64 << 20);
    let (p, v) = snapshotted_twice(&sim);
    v.write_at(0, &block(2), false).unwrap();
    p.create_snapshot("default@c").unwrap();
    v.write_at(0, &block(3), false).unwrap();
    p.delete_snapshot("default@b", false).unwrap();
    assert!(p.volume("default@b").is_none());
    assert_eq!(read(&p.volume("default@a").unwrap(), 0), block(1));
    assert_eq!(read(&p.volume("default@c").unwrap(), 0), block(2));
    p.delete_snapshot("default@c", false).unwrap();
    assert_eq!(read(&p.volume("default@a").unwrap(), 0), block(1));
    assert_eq!(read(&v, 0), block(3));
    let names: Vec<_> = p.snapshots().into_iter().map(|s| s.name).collect();
    assert_eq!(names, vec!["default@a"]);
}

#[test]
fn rollback_and_clones() {
    let sim = SimStorage::new(64 << 20);
    let p = pool(&sim);
    let v = p.volume("default").unwrap();
    v.write_at(0, &block(1), false).unwrap();
    p.create_snapshot("default@s").unwrap();
    p.clone_volume("default@s", "c").unwrap();
    let c = p.volume("c").unwrap();
    assert_eq!(read(&c, 0), block(1));
    c.write_at(BS as u64, &block(7), false).unwrap();
    c.trim(0, BS as u64, false).unwrap();
    assert_eq!(
        read(&c, 0),
        vec![0u8; BS],
        "a clone's trim hides its snapshot"
    );
    v.write_at(0, &block(2), false).unwrap();
    v.write_at(BS as u64, &block(3), false).unwrap();
    assert!(matches!(
        p.delete_snapshot("default@s", false),
        Err(PoolError::HasClones { .. })
    ));
    assert!(matches!(
        p.delete_volume("default", false),
        Err(PoolError::HasSnapshots { .. })
    ));
    p.rollback("default@s").unwrap();
    assert_eq!(read(&v, 0), block(1));
    assert_eq!(read(&v, BS as u64), vec![0u8; BS]);
    assert_eq!(read(&c, BS as u64), block(7));
    assert_eq!(read(&p.volume("default@s").unwrap(), 0), block(1));
    p.delete_volume("c", false).unwrap();
    p.delete_snapshot("default@s", false).unwrap();
    assert_eq!(read(&v, 0), block(1));
    consistent(&p, &sim);
}

#[test]
fn a_snapshot_takes_only_the_extents_its_volume_holds_data_in() {
    let sim = SimStorage::new(64 << 20);
    let p = Pool::create(Arc::new(sim.clone()), &options(&sim, 3 * EXTENT_BYTES)).unwrap();
    let v = p.volume("default").unwrap();
    v.write_at(0, &block(1), false).unwrap();
    p.create_snapshot("default@a").unwrap();
    let free_before = p.lock_table().unwrap().free_extents().len();
    // Extents 1 and 2 were empty: written after the snapshot, it still
    // reads zeros there, and they cost the pool no extent.
    v.write_at(EXTENT_BYTES, &block(2), false).unwrap();
    v.write_at(0, &block(3), false).unwrap();
    let a = p.volume("default@a").unwrap();
    assert_eq!(read(&a, EXTENT_BYTES), vec![0u8; BS]);
    assert_eq!(read(&a, 0), block(1));
    p.create_snapshot("default@b").unwrap();
    assert_eq!(
        p.lock_table().unwrap().free_extents().len(),
        free_before - 2,
        "b takes extents 0 and 1 only"
    );
    // Changed since a: block 0 (kept in a) and block 1 GiB (a has no
    // extent there, the volume maps it now).
    let runs = v
        .changed_since("a", EXTENT_BYTES, 2 * BS as u64)
        .unwrap()
        .unwrap();
    assert_eq!(runs, vec![(BS as u64, true), (BS as u64, false)]);
    v.write_at(EXTENT_BYTES, &block(4), false).unwrap();
    // Deleting b: a read zeros where b kept block 2 (a has no extent there).
    p.delete_snapshot("default@b", false).unwrap();
    assert_eq!(read(&a, EXTENT_BYTES), vec![0u8; BS]);
    assert_eq!(read(&a, 0), block(1));
    p.rollback("default@a").unwrap();
    assert_eq!(read(&v, 0), block(1));
    assert_eq!(
        read(&v, EXTENT_BYTES),
        vec![0u8; BS],
        "rolled back to zeros"
    );
    consistent(&p, &sim);
}

#[test]
fn deleting_a_snapshot_without_an_extent_keeps_the_older_one_zero_there() {
    let sim = SimStorage::new(64 << 20);
    let p = Pool::create(Arc::new(sim.clone()), &options(&sim, 2 * EXTENT_BYTES)).unwrap();
    let v = p.volume("default").unwrap();
    v.write_at(EXTENT_BYTES, &block(1), false).unwrap();
    v.write_at(0, &block(9), false).unwrap();
    p.create_snapshot("default@old").unwrap();
    v.trim(EXTENT_BYTES, EXTENT_BYTES, false).unwrap();
    p.create_snapshot("default@mid").unwrap(); // no extent 1: it was empty
    v.write_at(EXTENT_BYTES + BS as u64, &block(2), false)
        .unwrap();
    let old = p.volume("default@old").unwrap();
    assert_eq!(read(&old, EXTENT_BYTES), block(1));
    assert_eq!(read(&old, EXTENT_BYTES + BS as u64), vec![0u8; BS]);
    p.delete_snapshot("default@mid", false).unwrap();
    assert_eq!(read(&old, EXTENT_BYTES), block(1));
    assert_eq!(
        read(&old, EXTENT_BYTES + BS as u64),
        vec![0u8; BS],
        "the volume's later write stays out of the older snapshot"
    );
    v.write_at(EXTENT_BYTES + 2 * BS as u64, &block(3), false)
        .unwrap();
    assert_eq!(read(&old, EXTENT_BYTES + 2 * BS as u64), vec![0u8; BS]);
    consistent(&p, &sim);
}

#[test]
fn unknown_snapshots_and_volumes_are_named_with_what_exists() {
    let sim = SimStorage::new(64 << 20);
    let p = pool(&sim);
    p.create_snapshot("default@s1").unwrap();
    // These once took the table's lock twice (a hang).
    let e = p.delete_snapshot("default@nosuch", false).unwrap_err();
    assert_eq!(
        e.to_string(),
        "there is no snapshot 'default@nosuch' (snapshots: default@s1)"
    );
    assert!(p.clone_volume("default@nosuch", "c").is_err());
    assert!(p.rollback("default@nosuch").is_err());
    assert!(p.snapshot_usage("default@nosuch").is_err());
    let e = p.delete_volume("default@s1", false).unwrap_err();
    assert_eq!(
        e.to_string(),
        "the pool has no volume named 'default@s1' (it has: default)"
    );
    let guard = p.volume("default").unwrap().open_guard();
    let e = p.rollback("default@s1").unwrap_err().to_string();
    assert!(e.contains("disconnect them before a rollback"), "{e}");
    assert!(!e.contains("--force"), "{e}");
    drop(guard);
}

/// A snapshot's view is made at its first request, not at attach, and
/// once made follows the table like any view: after the newer snapshot
/// it read through is deleted (its entries merged into this one) it
/// still reads its blocks, and its plan is the table's (mutation:
/// leaving views made on request out of `relayout` keeps the plan that
/// read through the deleted layer).
#[test]
fn a_snapshot_view_is_made_when_first_asked_for_and_follows_the_table() {
    let sim = SimStorage::new(64 << 20);
    let (p, v) = snapshotted_twice(&sim);
    p.engine().flush().unwrap();
    drop(v);
    drop(p);
    let p = reopen(&sim);
    assert!(p.existing_view("default@a").is_none(), "made at attach");
    assert!(p.existing_view("default@b").is_none(), "made at attach");
    let a = p.volume("default@a").unwrap();
    assert!(a.read_only());
    assert_eq!(read(&a, 0), block(1));
    assert!(Arc::ptr_eq(&a, &p.volume("default@a").unwrap()), "one view");
    // The volume's change copies block 0's old entry to b, the newest;
    // a reads it through b until b is deleted and a takes it.
    let v = p.volume("default").unwrap();
    v.write_at(0, &block(2), false).unwrap();
    assert_eq!(read(&a, 0), block(1));
    let planned = |p: &Pool| {
        let t = p.table.lock().unwrap();
        layout_of(&layers::LayerSet::of(&t), "default@a")
            .unwrap()
            .plan
    };
    let before = planned(&p);
    p.delete_snapshot("default@b", false).unwrap();
    assert!(p.volume("default@b").is_none());
    let after = planned(&p);
    assert_ne!(before, after, "a no longer reads through b");
    assert_eq!(a.layout.read().unwrap().plan, after, "a's view follows");
    assert_eq!(read(&a, 0), block(1));
    assert_eq!(read(&v, 0), block(2));
    assert!(p.volume("default@nope").is_none());
    assert!(p.volume("nope@a").is_none());
    consistent(&p, &sim);
}
