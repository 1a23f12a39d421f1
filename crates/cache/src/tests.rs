use super::*;
use cvol_engine::volume::CreateOptions;
use cvol_storage::{SimConfig, SimStorage};

const ORIGIN_BYTES: u64 = 4 << 20;
const MIB: u64 = 1 << 20;

fn blk(tag: u8) -> Vec<u8> {
    (0..BS as usize).map(|i| tag ^ (i % 13) as u8).collect()
}

struct Setup {
    store: SimStorage,
    origin: SimStorage,
    stamp: Arc<Mutex<OriginStamp>>,
}

impl Setup {
    fn new(mode: CacheMode, cache_mib: u64) -> Setup {
        let origin = SimStorage::new(ORIGIN_BYTES);
        for b in 0..ORIGIN_BYTES / BS {
            origin.write_at(b * BS, &blk(b as u8)).unwrap();
        }
        origin.sync().unwrap();
        let store = SimStorage::new(cache_mib * MIB);
        let c = CreateOptions::new(ORIGIN_BYTES, cache_mib * MIB).with_segment_size(MIB);
        let stamp = OriginStamp {
            size_bytes: ORIGIN_BYTES,
            mtime_ns: 1,
            ..OriginStamp::default()
        };
        let cfg = CacheConfig {
            origin: "sim".into(),
            mode,
            line_size_bytes: 4 * BS as u32,
        };
        create(Arc::new(store.clone()), &c, &cfg, stamp).unwrap();
        Setup {
            store,
            origin,
            stamp: Arc::new(Mutex::new(stamp)),
        }
    }

    fn open(&self) -> Arc<CacheVolume> {
        let s = self.stamp.clone();
        CacheVolume::open(
            Arc::new(self.store.clone()),
            Arc::new(self.origin.clone()),
            OpenOptions::default(),
            Box::new(move || Ok(*s.lock().unwrap())),
        )
        .unwrap()
    }
}

/// Two misses in line 0 (blocks 1 and 2): the second queues a fill of the
/// whole line (spatial locality), holding the origin's block 0 as it is now.
fn miss_line_0_twice(c: &CacheVolume) {
    assert_eq!(read(c, 1), blk(1));
    assert_eq!(read(c, 2), blk(2));
}

fn read(c: &CacheVolume, lba: u64) -> Vec<u8> {
    let mut b = vec![0u8; BS as usize];
    c.read_at(lba * BS, &mut b).unwrap();
    b
}

/// Found by the cache simulation: a fill read from the origin *after* a
/// write-back write (so its generation check passed) holds the origin's
/// older copy of the written block; once the line was written back and
/// evicted, the fill landed on the now unmapped block and served the old
/// copy. A write-back raises the slot's generation.
#[test]
fn regression_a_fill_does_not_land_after_its_line_was_written_back() {
    let s = Setup::new(CacheMode::WriteBack, 8);
    let c = s.open();
    c.write_at(0, &blk(200), false).unwrap(); // block 0 of line 0, dirty
    miss_line_0_twice(&c); // line 0 queued, with block 0 old
    assert!(c.evict_all().unwrap() >= 1); // written back, then trimmed
    c.run_maintenance().unwrap(); // the fill comes too late
    assert_eq!(
        read(&c, 0),
        blk(200),
        "the fill put back the origin's old block"
    );
}

/// A write to a block of a line whose fill is queued keeps the write: the
/// fill skips blocks the cache holds, and still fills the others (a line
/// read and written at once is not refetched for ever: seen in pgbench).
#[test]
fn a_fill_read_before_a_write_keeps_the_write_and_fills_the_rest() {
    for mode in [CacheMode::WriteThrough, CacheMode::WriteBack] {
        let s = Setup::new(mode, 8);
        let c = s.open();
        let mut line = vec![0u8; 4 * BS as usize];
        c.read_at(4 * BS, &mut line).unwrap(); // line 1 missed whole: filled whole
        c.write_at(5 * BS, &blk(99), false).unwrap();
        c.run_maintenance().unwrap();
        assert_eq!(read(&c, 5), blk(99), "{mode:?}");
        let misses = c.stats().cache_misses;
        assert_eq!(read(&c, 6), blk(6), "{mode:?}");
        assert_eq!(
            c.stats().cache_misses,
            misses,
            "{mode:?}: the rest was filled"
        );
        // A full cache: a lone random miss fills only its block.
        c.fullness_hint
            .store(WHOLE_LINE_BELOW_PERCENT, Ordering::Relaxed);
        assert_eq!(read(&c, 41), blk(41));
        c.run_maintenance().unwrap();
        c.fullness_hint
            .store(WHOLE_LINE_BELOW_PERCENT, Ordering::Relaxed);
        let misses = c.stats().cache_misses;
        assert_eq!(read(&c, 41), blk(41));
        assert_eq!(read(&c, 42), blk(42));
        assert_eq!(
            c.stats().cache_misses,
            misses + 1,
            "{mode:?}: only 41 filled"
        );
        // A roomy one: the whole line (prefetch is free).
        c.fullness_hint.store(0, Ordering::Relaxed);
        assert_eq!(read(&c, 81), blk(81));
        c.run_maintenance().unwrap();
        let misses = c.stats().cache_misses;
        assert_eq!(read(&c, 82), blk(82));
        assert_eq!(
            c.stats().cache_misses,
            misses,
            "{mode:?}: line 20 filled whole"
        );
    }
}

/// Once a write-through line is evicted, a fill read before a write to it
/// must not put the origin's older block on the unmapped block.
#[test]
fn a_fill_does_not_land_on_blocks_an_eviction_unmapped() {
    let s = Setup::new(CacheMode::WriteThrough, 8);
    let c = s.open();
    miss_line_0_twice(&c); // line 0 queued, with block 0 old
    c.write_at(0, &blk(200), false).unwrap(); // origin and cache
    assert!(c.evict_all().unwrap() >= 1);
    c.run_maintenance().unwrap();
    assert_eq!(read(&c, 0), blk(200));
}

#[test]
fn warm_after_a_clean_close_cold_when_the_origin_changed() {
    let s = Setup::new(CacheMode::WriteThrough, 8);
    let c = s.open();
    let mut all = vec![0u8; 64 * BS as usize];
    c.read_at(0, &mut all).unwrap();
    c.run_maintenance().unwrap();
    c.close().unwrap();
    drop(c);
    let c = s.open();
    assert_eq!(c.start(), Start::Warm);
    assert_eq!(read(&c, 3), blk(3));
    assert!(c.stats().cache_hits > 0, "a warm cache serves from itself");
    c.close().unwrap();
    drop(c);
    // Changed behind the cache's back while it was offline.
    s.origin.write_at(3 * BS, &blk(77)).unwrap();
    s.stamp.lock().unwrap().mtime_ns = 2;
    let c = s.open();
    assert_eq!(c.start(), Start::Cold);
    assert_eq!(read(&c, 3), blk(77), "never a stale line");
}

#[test]
fn a_write_the_cache_has_no_room_for_goes_to_the_origin() {
    for mode in [CacheMode::WriteThrough, CacheMode::WriteBack] {
        // Three segments: the cache fills at once.
        let s = Setup::new(mode, 4);
        let c = s.open();
        let data = {
            use rand::{RngCore, SeedableRng};
            let mut b = vec![0u8; ORIGIN_BYTES as usize];
            rand::rngs::StdRng::seed_from_u64(7).fill_bytes(&mut b);
            b
        };
        for (k, chunk) in data.chunks(256 << 10).enumerate() {
            c.write_at((k as u64) << 18, chunk, false).unwrap();
            c.run_maintenance().unwrap();
        }
        c.flush().unwrap();
        let mut back = vec![0u8; ORIGIN_BYTES as usize];
        c.read_at(0, &mut back).unwrap();
        assert!(back == data, "{mode:?}");
        c.close().unwrap();
        let mut origin = vec![0u8; ORIGIN_BYTES as usize];
        s.origin.read_at(0, &mut origin).unwrap();
        assert!(
            origin == data,
            "{mode:?}: the origin holds every write after a close"
        );
    }
}

#[test]
fn unaligned_writes_and_zeroes_read_back_in_both_modes() {
    for mode in [CacheMode::WriteThrough, CacheMode::WriteBack] {
        let s = Setup::new(mode, 8);
        let c = s.open();
        let mut model = vec![0u8; 16 * BS as usize];
        c.read_at(0, &mut model).unwrap();
        c.run_maintenance().unwrap(); // blocks 0..16 cached
        let bytes: Vec<u8> = (0..9000).map(|i| (i * 7 % 251) as u8).collect();
        c.write_at(1000, &bytes, false).unwrap(); // cached blocks, partial edges
        model[1000..10000].copy_from_slice(&bytes);
        c.write_at(20 * BS + 100, &bytes[..300], false).unwrap(); // uncached
        c.write_zeroes(3 * BS + 5, 2 * BS, false).unwrap();
        model[3 * BS as usize + 5..5 * BS as usize + 5].fill(0);
        let mut got = vec![0u8; 16 * BS as usize];
        c.read_at(0, &mut got).unwrap();
        assert!(got == model, "{mode:?}");
        let mut b = vec![0u8; 300];
        c.read_at(20 * BS + 100, &mut b).unwrap();
        assert_eq!(b, bytes[..300], "{mode:?}");
        c.close().unwrap();
        let mut o = vec![0u8; 16 * BS as usize];
        s.origin.read_at(0, &mut o).unwrap();
        assert!(o == model, "{mode:?}: the origin after a close");
    }
}

#[test]
fn an_origin_error_is_an_error_and_the_cache_stays_usable() {
    let s = Setup::new(CacheMode::WriteThrough, 8);
    let c = s.open();
    s.origin.set_config(SimConfig {
        bad_read_ranges: vec![(8 * BS, 9 * BS)],
        ..SimConfig::default()
    });
    let mut b = vec![0u8; BS as usize];
    assert!(matches!(c.read_at(8 * BS, &mut b), Err(VolError::Io(_))));
    assert_eq!(read(&c, 20), blk(20), "other lines still served");
    s.origin.set_config(SimConfig::default());
    assert_eq!(read(&c, 8), blk(8));
    s.origin.set_config(SimConfig {
        io_budget: Some(0),
        ..SimConfig::default()
    });
    assert!(matches!(
        c.write_at(0, &blk(1), false),
        Err(VolError::Io(_))
    ));
    s.origin.set_config(SimConfig::default());
    assert_eq!(
        read(&c, 0),
        blk(0),
        "a failed write-through leaves the old block"
    );
}

#[test]
fn a_damaged_label_copy_leaves_the_other_saying_the_same() {
    let s = Setup::new(CacheMode::WriteBack, 8);
    let c = s.open(); // marks both copies open
    c.write_at(0, &blk(9), true).unwrap();
    drop(c); // a crash: no close
    let sb = {
        let mut b = vec![0u8; 4096];
        s.store.read_at(0, &mut b).unwrap();
        Superblock::decode(&b).unwrap()
    };
    let newest = read_label(&s.store, &sb).unwrap();
    assert!(!newest.clean);
    s.store.flip_bit(newest.offset() + 100, 1);
    let other = read_label(&s.store, &sb).unwrap();
    assert!(other.sequence < newest.sequence && !other.clean);
    // Still a crash: recovered, the FUA write kept and written back.
    let c = s.open();
    assert_eq!(c.start(), Start::Recovered);
    assert_eq!(read(&c, 0), blk(9));
    c.close().unwrap();
    let mut o = vec![0u8; BS as usize];
    s.origin.read_at(0, &mut o).unwrap();
    assert_eq!(o, blk(9));
}

/// Found by scripts/e2e/cache.sh (kill -9, write-back, a full 8 MiB cache):
/// a FUA write the cache had no room for went to the origin (synced), but
/// the TRIM that made the cache forget its older copy was not durable; after
/// a crash the recovered start wrote that older copy back over it.
#[test]
fn regression_a_fua_write_without_room_survives_a_crash() {
    let s = Setup::new(CacheMode::WriteBack, 4);
    let c = s.open();
    let mut x = 3u64;
    let mut noise = || -> Vec<u8> {
        (0..64 << 10)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    };
    let first = noise();
    c.write_at(0, &first, true).unwrap(); // durable in the cache
    let mut at = 64 * BS;
    // Incompressible data, no maintenance: the cache fills until a write
    // goes to the origin instead.
    while c.stats().origin_bytes_written == 0 {
        c.write_at(at, &noise(), false).unwrap();
        at += 64 << 10;
        assert!(at < ORIGIN_BYTES, "the cache never filled");
    }
    let before = c.stats().origin_bytes_written;
    let second = noise();
    c.write_at(0, &second, true).unwrap(); // no room: to the origin, FUA
    assert!(
        c.stats().origin_bytes_written > before,
        "the FUA write went to the origin"
    );
    // A power cut: every unsynced write of both stores lost.
    let store = s.store.crash_dropping(|_| true);
    let origin = s.origin.crash_dropping(|_| true);
    drop(c);
    let stamp = *s.stamp.lock().unwrap();
    let c = CacheVolume::open(
        Arc::new(store),
        Arc::new(origin.clone()),
        OpenOptions::default(),
        Box::new(move || Ok(stamp)),
    )
    .unwrap();
    assert_eq!(c.start(), Start::Recovered);
    let mut got = vec![0u8; 64 << 10];
    c.read_at(0, &mut got).unwrap();
    assert!(got == second, "the FUA write came back older");
    c.close().unwrap();
    origin.read_at(0, &mut got).unwrap();
    assert!(got == second, "written back over by the older copy");
}
