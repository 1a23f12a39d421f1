//! A pool's store resized while the pool is open and written
//! (`Volume::resize_physical`, what `cvol resize --physical-size` does,
//! offline and through the server): a grow's new segments take data at
//! once, beyond what the old store held; a shrink is refused while
//! anything lies beyond the new end, and once done the log stays below
//! it. Writers and readers run during the resize; the pool reopens at the
//! new size with every block, and `check` finds it consistent.
mod common;
use common::{BS, MIB};
use cvol_engine::pool::Pool;
use cvol_engine::{CreateOptions, OpenOptions, ResizeError, VolError, Volume};
use cvol_storage::{SimStorage, Storage};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::Arc;

const REQ: u64 = 64;
const BSU: u64 = BS as u64;

/// Request `k` (REQ blocks) of stream `seed`: incompressible, distinct.
fn noise(seed: u64, k: u64) -> Vec<u8> {
    let mut r = StdRng::seed_from_u64(seed << 32 | k);
    (0..REQ as usize * BS).map(|_| r.gen()).collect()
}

fn create(store_bytes: u64) -> (SimStorage, Pool) {
    let sim = SimStorage::new(store_bytes);
    let c = CreateOptions::new(64 * MIB, store_bytes)
        .with_segment_size(MIB)
        .with_dedup(false);
    let p = Pool::create(Arc::new(sim.clone()), &c).unwrap();
    p.create_volume("v", 1024 * MIB).unwrap();
    (sim, p)
}

fn reopen(sim: &SimStorage) -> Pool {
    let vol = Volume::open(Arc::new(sim.clone()), OpenOptions::default()).unwrap();
    Pool::attach(Arc::new(vol)).unwrap()
}

/// Writes requests [first, end) of stream `seed` at request `at` on; the
/// number written before the pool ran out of space.
fn fill(p: &Pool, seed: u64, at: u64, n: u64) -> u64 {
    let v = p.volume("v").unwrap();
    for k in 0..n {
        match v.write_at((at + k) * REQ * BSU, &noise(seed, k), false) {
            Ok(()) => {}
            Err(VolError::NoSpace) => return k,
            Err(e) => panic!("write {k}: {e}"),
        }
    }
    v.flush().unwrap();
    n
}

fn assert_reads(p: &Pool, seed: u64, at: u64, n: u64) {
    let v = p.volume("v").unwrap();
    let mut buf = vec![0u8; REQ as usize * BS];
    for k in 0..n {
        v.read_at((at + k) * REQ * BSU, &mut buf).unwrap();
        assert!(buf == noise(seed, k), "stream {seed}: request {k}");
    }
}

fn close_and_check(p: Pool, sim: &SimStorage) {
    p.engine().verify_refcounts().unwrap();
    p.engine().close().unwrap();
    drop(p);
    let rep = cvol_engine::check::check_volume(sim, &mut |_, _| {});
    assert!(rep.consistent(), "check: {:?}", rep.errors);
}

/// Requests of `REQ` blocks that `bytes` of store hold at most.
fn requests_in(bytes: u64) -> u64 {
    bytes / (REQ * BSU)
}

#[test]
fn an_open_pool_grows_while_written_and_fills_beyond_its_old_size() {
    let (sim, p) = create(24 * MIB);
    assert_eq!(fill(&p, 1, 0, 32), 32, "8 MiB fit in 24");
    let p = Arc::new(p);
    // A writer (and reader) on its own blocks all through the resize.
    let w = {
        let p = p.clone();
        std::thread::spawn(move || {
            let n = fill(&p, 2, 1000, 24);
            assert_reads(&p, 2, 1000, n);
            n
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(5));
    let (old, new) = p.engine().resize_physical(96 * MIB).unwrap();
    assert_eq!((old, new), (24 * MIB, 96 * MIB));
    assert_eq!(
        w.join().unwrap(),
        24,
        "the writer ran short during the grow"
    );
    assert_eq!(sim.len_bytes(), 96 * MIB, "the store was extended");
    let stats = p.engine().stats();
    assert_eq!(stats.physical_size_bytes, 96 * MIB);
    // 8 + 6 MiB written; 48 more is twice what the old store held.
    let more = requests_in(48 * MIB);
    assert_eq!(fill(&p, 3, 2000, more), more, "the new space takes data");
    assert_reads(&p, 1, 0, 32);
    assert_reads(&p, 3, 2000, more);
    let p = Arc::into_inner(p).unwrap();
    close_and_check(p, &sim);
    let p = reopen(&sim);
    assert_eq!(p.engine().superblock().physical_size_bytes, 96 * MIB);
    assert_reads(&p, 1, 0, 32);
    assert_reads(&p, 2, 1000, 24);
    assert_reads(&p, 3, 2000, more);
    close_and_check(p, &sim);
}

#[test]
fn an_open_pool_shrinks_only_when_the_end_is_free() {
    let (sim, p) = create(64 * MIB);
    assert_eq!(fill(&p, 1, 0, 64), 64);
    let e = p.engine().resize_physical(8 * MIB).unwrap_err();
    assert!(
        matches!(e, ResizeError::Busy { segments, .. } if segments > 0),
        "{e}"
    );
    assert!(e.is_refusal());
    // Free segments beyond 20 MiB, but too few left below it.
    let e = p.engine().resize_physical(20 * MIB).unwrap_err();
    assert!(
        matches!(e, ResizeError::TooFull { .. } | ResizeError::Busy { .. }),
        "{e}"
    );
    assert_eq!(
        p.engine().stats().physical_size_bytes,
        64 * MIB,
        "refused: unchanged"
    );
    assert_eq!(sim.len_bytes(), 64 * MIB);
    let p = Arc::new(p);
    let w = {
        let p = p.clone();
        std::thread::spawn(move || fill(&p, 2, 1000, 8))
    };
    let (old, new) = p.engine().resize_physical(40 * MIB + 4096).unwrap();
    assert_eq!((old, new), (64 * MIB, 40 * MIB));
    assert_eq!(w.join().unwrap(), 8);
    assert_eq!(sim.len_bytes(), 40 * MIB, "the store was cut");
    assert_eq!(p.engine().stats().physical_size_bytes, 40 * MIB);
    // The log keeps below the end: writes fill the rest, then run short.
    let n = fill(&p, 3, 2000, requests_in(40 * MIB));
    assert!(
        n > 0 && n < requests_in(40 * MIB - 18 * MIB),
        "{n} requests fit"
    );
    assert_reads(&p, 1, 0, 64);
    assert_reads(&p, 2, 1000, 8);
    assert_reads(&p, 3, 2000, n);
    let p = Arc::into_inner(p).unwrap();
    close_and_check(p, &sim);
    let p = reopen(&sim);
    assert_eq!(p.engine().superblock().physical_size_bytes, 40 * MIB);
    assert_reads(&p, 1, 0, 64);
    assert_reads(&p, 3, 2000, n);
    close_and_check(p, &sim);
}

#[test]
fn a_resize_refuses_what_cannot_change_size() {
    let sim = SimStorage::new(64 * MIB);
    let c = CreateOptions::new(64 * MIB, 64 * MIB).with_segment_size(MIB);
    let v = Volume::create(Arc::new(sim.clone()), &c).unwrap();
    let e = v.resize_physical(96 * MIB).unwrap_err();
    assert!(matches!(e, ResizeError::Unsupported(_)), "{e}");
    drop(v);
    let (_sim, p) = create(32 * MIB);
    let e = p.engine().resize_physical(MIB).unwrap_err();
    assert!(matches!(e, ResizeError::Size(_)), "{e}");
    let same = p.engine().resize_physical(32 * MIB + 4096).unwrap();
    assert_eq!(same, (32 * MIB, 32 * MIB));
}
