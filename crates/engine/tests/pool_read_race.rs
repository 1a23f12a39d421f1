//! Reads racing writes on several volumes of one pool, with a map cache of
//! two pages, so that almost every read finds its map page dropped and
//! reads it without the state lock before taking the lock again for its
//! lookups (`Volume::lock_state_prefaulted`): a read returns a whole block
//! (never half of two writes), never an older version than one whose
//! write had returned before the read began, and never another block's or
//! another volume's data.
mod common;
use common::{BS, MIB};
use cvol_engine::pool::Pool;
use cvol_engine::{CreateOptions, OpenOptions, Volume};
use cvol_storage::{SimStorage, Storage};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

const VOLUMES: u64 = 3;
/// Blocks of each volume: four map pages.
const BLOCKS: u64 = 4 * 512;
const PASSES: u64 = 6;

/// Block `lba` of volume `vol` as version `ver` wrote it: the three
/// numbers, then bytes that depend on them (incompressible enough that
/// no two blocks share a record).
fn block(vol: u64, lba: u64, ver: u64) -> Vec<u8> {
    let mut b = vec![0u8; BS];
    b[..8].copy_from_slice(&vol.to_le_bytes());
    b[8..16].copy_from_slice(&lba.to_le_bytes());
    b[16..24].copy_from_slice(&ver.to_le_bytes());
    let mut r = StdRng::seed_from_u64(vol << 48 | lba << 16 | ver);
    r.fill(&mut b[24..]);
    b
}

fn word(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap())
}

fn open_pool() -> Pool {
    let sim = SimStorage::new(256 * MIB);
    let c = CreateOptions::new(BLOCKS * BS as u64, sim.len_bytes())
        .with_segment_size(MIB)
        .with_dedup(false);
    let p = Pool::create(Arc::new(sim.clone()), &c).unwrap();
    for v in 1..VOLUMES {
        p.create_volume(&format!("v{v}"), BLOCKS * BS as u64)
            .unwrap();
    }
    p.engine().close().unwrap();
    drop(p);
    let o = OpenOptions {
        // Two pages of map in memory; a checkpoint at every flush makes
        // the pages clean, so that they can be dropped.
        map_cache_bytes: Some(2 * cvol_engine::map::PAGE_MEMORY_BYTES),
        checkpoint_interval_bytes: 1,
        ..OpenOptions::default()
    };
    Pool::attach(Arc::new(Volume::open(Arc::new(sim), o).unwrap())).unwrap()
}

fn name(v: u64) -> String {
    if v == 0 {
        "default".into()
    } else {
        format!("v{v}")
    }
}

#[test]
fn reads_racing_writes_on_several_volumes_see_whole_current_blocks() {
    let p = open_pool();
    // Version 1 everywhere first: every block is mapped.
    for v in 0..VOLUMES {
        let view = p.volume(&name(v)).unwrap();
        for lba in 0..BLOCKS {
            view.write_at(lba * BS as u64, &block(v, lba, 1), false)
                .unwrap();
        }
        view.flush().unwrap();
    }
    // done[v][lba]: the newest version of the block whose write returned.
    let done: Vec<Vec<AtomicU64>> = (0..VOLUMES)
        .map(|_| (0..BLOCKS).map(|_| AtomicU64::new(1)).collect())
        .collect();
    let stop = AtomicBool::new(false);
    let reads = AtomicU64::new(0);
    std::thread::scope(|s| {
        let writers: Vec<_> = (0..VOLUMES)
            .map(|v| {
                let (p, done) = (&p, &done);
                s.spawn(move || {
                    let view = p.volume(&name(v)).unwrap();
                    let mut r = StdRng::seed_from_u64(v);
                    for ver in 2..=PASSES {
                        for _ in 0..BLOCKS / 2 {
                            let lba = r.gen_range(0..BLOCKS);
                            let at = &done[v as usize][lba as usize];
                            let next = at.load(Ordering::SeqCst).max(ver);
                            view.write_at(lba * BS as u64, &block(v, lba, next), false)
                                .unwrap();
                            at.store(next, Ordering::SeqCst);
                        }
                        view.flush().unwrap();
                    }
                })
            })
            .collect();
        for t in 0..2u64 {
            let (p, done, stop, reads) = (&p, &done, &stop, &reads);
            s.spawn(move || {
                let views: Vec<_> = (0..VOLUMES).map(|v| p.volume(&name(v)).unwrap()).collect();
                let mut r = StdRng::seed_from_u64(100 + t);
                let mut buf = vec![0u8; BS];
                while !stop.load(Ordering::SeqCst) {
                    let (v, lba) = (r.gen_range(0..VOLUMES), r.gen_range(0..BLOCKS));
                    let before = done[v as usize][lba as usize].load(Ordering::SeqCst);
                    views[v as usize]
                        .read_at(lba * BS as u64, &mut buf)
                        .unwrap();
                    let (bv, bl, ver) = (word(&buf, 0), word(&buf, 1), word(&buf, 2));
                    assert_eq!((bv, bl), (v, lba), "another block's data");
                    assert!(
                        ver >= before,
                        "volume {v} block {lba}: version {ver} after {before}"
                    );
                    assert!(buf == block(v, lba, ver), "volume {v} block {lba}: torn");
                    reads.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        for w in writers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::SeqCst);
    });
    assert!(reads.load(Ordering::Relaxed) > 100, "the readers ran");
    let misses = p.engine().stats().map_cache_misses;
    assert!(misses > 100, "map pages were read back ({misses})");
    p.engine().verify_refcounts().unwrap();
}
