//! A pool's store changes size (`cvol resize --physical-size`): only the
//! superblock's physical size changes, because a pool's directory numbers
//! its table slots for the most segments its segment size allows. The
//! volumes read back; data beyond the old size fits; and the dedup window
//! still finds data written before the resize (its fingerprint tables
//! kept their slots), past what the exact (hot) index holds.
mod common;
use common::{BS, MIB};
use cvol_engine::pool::Pool;
use cvol_engine::{CreateOptions, OpenOptions, Volume};
use cvol_format::{Superblock, SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET};
use cvol_storage::{SimStorage, Storage};
use std::sync::Arc;

/// Blocks of the first fill: four times what a 64 KiB hot index holds.
const BLOCKS: u64 = 8 * 1024;
const REQ: u64 = 64;

fn block(seed: u64, i: u64) -> Vec<u8> {
    common::text((seed << 32) | i, BS)
}

fn run(seed: u64, first: u64, n: u64) -> Vec<u8> {
    (first..first + n).flat_map(|i| block(seed, i)).collect()
}

fn open(sim: &SimStorage) -> Pool {
    let options = OpenOptions {
        dedup_memory_bytes: Some(64 << 10),
        ..OpenOptions::default()
    };
    let vol = Volume::open(Arc::new(sim.clone()), options).unwrap();
    vol.warm_index();
    Pool::attach(Arc::new(vol)).unwrap()
}

fn write(p: &Pool, name: &str, seed: u64, n: u64) {
    let v = p.volume(name).unwrap();
    for k in (0..n).step_by(REQ as usize) {
        v.write_at(k * BS as u64, &run(seed, k, REQ), false)
            .unwrap();
    }
    v.flush().unwrap();
}

fn assert_reads(p: &Pool, name: &str, seed: u64, n: u64) {
    let v = p.volume(name).unwrap();
    let mut buf = vec![0u8; REQ as usize * BS];
    for k in (0..n).step_by(REQ as usize) {
        v.read_at(k * BS as u64, &mut buf).unwrap();
        assert!(buf == run(seed, k, REQ), "{name}: blocks {k}..");
    }
}

/// What `cvol resize` writes: both superblock copies with the new size.
fn set_physical(sim: &SimStorage, bytes: u64) {
    let (mut sb, _): (Superblock, _) = cvol_engine::read_superblock(sim).unwrap();
    sb.physical_size_bytes = bytes;
    sb.validate().unwrap();
    for off in [SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET] {
        sim.write_at(off, &sb.encode()).unwrap();
        sim.sync().unwrap();
    }
}

fn close(p: Pool) {
    p.engine().close().unwrap();
}

#[test]
fn a_grown_pool_keeps_its_data_and_its_dedup_memory() {
    let sim = SimStorage::new(256 * MIB);
    let c = CreateOptions::new(64 * MIB, 48 * MIB).with_segment_size(MIB);
    close(Pool::create(Arc::new(sim.clone()), &c).unwrap());
    let p = open(&sim);
    write(&p, "default", 1, BLOCKS);
    close(p);
    set_physical(&sim, 200 * MIB);
    let p = open(&sim);
    assert_eq!(p.engine().superblock().physical_size_bytes, 200 * MIB);
    assert_reads(&p, "default", 1, BLOCKS);
    // More distinct data than the old store held (stored about 1:3).
    p.create_volume("b", 512 * MIB).unwrap();
    write(&p, "b", 2, 4 * BLOCKS);
    close(p);
    let p = open(&sim);
    assert_reads(&p, "default", 1, BLOCKS);
    assert_reads(&p, "b", 2, 4 * BLOCKS);
    let before = p.engine().stats().dedup.dedup_hits;
    p.create_volume("copy", 64 * MIB).unwrap();
    write(&p, "copy", 1, BLOCKS);
    let hits = p.engine().stats().dedup.dedup_hits - before;
    eprintln!("pool_resize: a copy of data written before the resize: {hits} of {BLOCKS} found");
    assert!(hits * 10 >= BLOCKS * 9, "{hits} of {BLOCKS} blocks found");
    assert_reads(&p, "copy", 1, BLOCKS);
    close(p);
    let rep = cvol_engine::check::check_volume(&sim, &mut |_, _| {});
    assert!(rep.consistent(), "{:?}", rep.errors);
}

#[test]
fn a_shrunk_pool_keeps_its_data() {
    let sim = SimStorage::new(128 * MIB);
    let c = CreateOptions::new(64 * MIB, 128 * MIB).with_segment_size(MIB);
    close(Pool::create(Arc::new(sim.clone()), &c).unwrap());
    let p = open(&sim);
    write(&p, "default", 3, 1024);
    let (busy, commit_beyond) = p.engine().shrink_blockers(40).unwrap();
    assert_eq!(
        (busy, commit_beyond),
        (0, false),
        "a small fill stays at the start"
    );
    let (busy, _) = p.engine().shrink_blockers(1).unwrap();
    assert!(busy > 0, "segment 1 on holds the data");
    close(p);
    set_physical(&sim, 41 * MIB);
    let p = open(&sim);
    assert_eq!(p.engine().superblock().data_segment_count(), 40);
    assert_reads(&p, "default", 3, 1024);
    write(&p, "default", 4, 1024);
    assert_reads(&p, "default", 4, 1024);
    close(p);
    let rep = cvol_engine::check::check_volume(&sim, &mut |_, _| {});
    assert!(rep.consistent(), "{:?}", rep.errors);
}
