use super::*;
use crate::segments::SegState;
use crate::test_util::pseudo_random;
use cvol_format::EntryState;
use cvol_storage::SimStorage;

fn block(tag: u8) -> Vec<u8> {
    format!("block {tag} ").bytes().cycle().take(BS).collect()
}

fn volume(sim: &SimStorage) -> Volume {
    volume_of(sim, 1 << 20, Codec::Lz4)
}

/// A volume of `logical` bytes on all of `sim`, 1 MiB segments.
fn volume_of(sim: &SimStorage, logical: u64, codec: Codec) -> Volume {
    let opts = CreateOptions::new(logical, sim.len_bytes())
        .with_codec(codec)
        .with_segment_size(1 << 20);
    Volume::create(Arc::new(sim.clone()), &opts).unwrap()
}

fn entry(vol: &Volume, lba: u64) -> MapEntry {
    vol.lock_state().unwrap().live.get(lba)
}

/// A fingerprint collision (here planted in the index) must cost a
/// missed dedup, never another block's data.
#[test]
fn a_colliding_fingerprint_is_caught_by_verification() {
    let sim = SimStorage::new(8 << 20);
    let vol = volume(&sim);
    let (a, b) = (block(1), block(2));
    vol.write_at(BS as u64, &b, false).unwrap();
    let b_entry = entry(&vol, 1);
    let d = vol.dedup.as_ref().unwrap();
    let fp_a = crate::dedup::fingerprint(&d.seed, &a);
    d.index.lock().unwrap().hot.insert(fp_a, b_entry, 1);
    vol.write_at(2 * BS as u64, &a, false).unwrap();
    let mut got = vec![0u8; BS];
    vol.read_at(2 * BS as u64, &mut got).unwrap();
    assert!(got == a, "the colliding block must hold its own data");
    assert!(!entry(&vol, 2).same_record(&b_entry));
    assert_eq!(vol.stats().dedup.dedup_hits, 0);
    // A real duplicate still dedups.
    vol.write_at(3 * BS as u64, &b, false).unwrap();
    assert!(entry(&vol, 3).same_record(&b_entry));
    assert_eq!(vol.stats().dedup.dedup_hits, 1);
    vol.verify_refcounts().unwrap();
}

#[test]
fn index_is_empty_after_reopen_until_warmed_up() {
    let sim = SimStorage::new(8 << 20);
    let vol = volume(&sim);
    for t in 0..8u8 {
        vol.write_at(u64::from(t) * BS as u64, &block(t), false)
            .unwrap();
    }
    vol.close().unwrap();
    drop(vol);
    let vol = Volume::open(Arc::new(sim.clone()), OpenOptions::default()).unwrap();
    vol.write_at(100 * BS as u64, &block(3), false).unwrap();
    assert_eq!(
        vol.stats().dedup.dedup_hits,
        0,
        "a fresh index knows nothing"
    );
    // 8 blocks on the volume; block 3 is known already (the copy just written).
    assert_eq!(vol.warm_index(), 7);
    vol.write_at(101 * BS as u64, &block(5), false).unwrap();
    assert_eq!(vol.stats().dedup.dedup_hits, 1);
    assert!(entry(&vol, 101).same_record(&entry(&vol, 5)));
    vol.verify_refcounts().unwrap();
}

/// A panic while the state lock is held (a failed assertion, a bug) turns
/// every later request into `Poisoned`, not into another panic, and `stat`
/// still answers.
#[test]
fn a_panic_under_the_state_lock_poisons_the_volume_instead_of_cascading() {
    let sim = SimStorage::new(8 << 20);
    let vol = Arc::new(volume(&sim));
    vol.write_at(0, &block(1), false).unwrap();
    let v = vol.clone();
    let panicked = std::thread::spawn(move || {
        let _st = v.lock_state().unwrap();
        panic!("an engine bug while the state lock is held");
    })
    .join();
    assert!(panicked.is_err());
    let mut b = vec![0u8; BS];
    assert!(matches!(vol.read_at(0, &mut b), Err(VolError::Poisoned)));
    assert!(matches!(
        vol.write_at(0, &b, false),
        Err(VolError::Poisoned)
    ));
    assert!(matches!(vol.flush(), Err(VolError::Poisoned)));
    assert!(matches!(vol.close(), Err(VolError::Poisoned)));
    assert!(vol.stats().poisoned);
    assert!(vol.verify_refcounts().is_err());
}

/// `stat --json` stays one flat object: the sections of `VolumeStats`
/// are flattened, their keys in the order they always had.
#[test]
fn stats_serialize_flat_in_field_order() {
    let sim = SimStorage::new(8 << 20);
    let vol = volume(&sim);
    let text = serde_json::to_string(&vol.stats()).unwrap();
    let at = |k: &str| {
        text.find(&format!("\"{k}\":"))
            .unwrap_or_else(|| panic!("no key {k} in {text}"))
    };
    assert!(at("write_amplification") < at("cleaner_policy"));
    assert!(at("segments_reclaimed") < at("corrupt_reads"));
    assert!(at("map_memory_bytes") < at("dedup"));
    assert!(at("read_cache_hit_rate") < at("codec_strong"));
    assert!(at("recompress_skipped_units") < at("checkpoint_generation"));
    assert!(at("poisoned") < at("scrub_runs"));
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(at("scrub_runs") < at("cache_hits"));
    assert!(at("cache_dirty_bytes") < at("object_store"));
    assert_eq!(json.as_object().unwrap().len(), 193);
    assert!(at("worst_case_free_logical_bytes") < at("space_pressure"));
    assert!(json["space_pressure"].is_string());
    assert!(json["cache"].is_null(), "not a cache");
    assert!(json["object_store"].is_null(), "not in an object store");
    assert!(json["blocks_by_codec"]["lz4"].is_u64());
}

/// Seed 004's flash figures: pages of the store read per client read,
/// padding, map bytes per mapped block.
#[test]
fn pages_read_per_read_counts_the_store_pages_a_read_touches() {
    let sim = SimStorage::new(16 << 20);
    let vol = volume_of(&sim, 8 << 20, Codec::Lz4);
    // 3 MiB of incompressible blocks (stored raw, a record a little over a
    // page) seal the first segments, whose records are then read from the
    // store, not from the open segment's buffer.
    let noise = pseudo_random(768 * 4096, 0x9e37_79b9_7f4a_7c15);
    for (b, data) in (0u64..).zip(noise.chunks(4096)) {
        vol.write_at(b * 4096, data, false).unwrap();
    }
    vol.flush().unwrap();
    let before = vol.stats();
    let mut buf = vec![0u8; 4096];
    vol.read_at(3 * 4096, &mut buf).unwrap();
    let s = vol.stats();
    assert_eq!(s.elastic.client_reads - before.elastic.client_reads, 1);
    let pages = s.elastic.store_pages_read - before.elastic.store_pages_read;
    // One small record: one page, or two if it straddles a boundary.
    assert!((1..=2).contains(&pages), "{pages}");
    assert!(s.padding_bytes > 0, "the flush padded to a sector");
    assert!(s.map_bytes_per_mapped_block > 0.0);
    assert_eq!(s.pages_written_per_block, s.write_amplification);
}

/// `memory_bytes`: each part is the engine's own count for it (the same
/// figure other keys report), and the parts add up to the total.
#[test]
fn memory_bytes_are_the_engine_counts_and_add_up() {
    let sim = SimStorage::new(16 << 20);
    let vol = volume_of(&sim, 8 << 20, Codec::Lz4);
    // Incompressible blocks seal the first segments; reads of single
    // blocks of them fill the read cache.
    let noise = pseudo_random(768 * 4096, 0x9e37_79b9_7f4a_7c15);
    for (b, data) in (0u64..).zip(noise.chunks(4096)) {
        vol.write_at(b * 4096, data, false).unwrap();
    }
    let mut buf = vec![0u8; 4096];
    for b in (0..64).step_by(2) {
        vol.read_at(b * 4096, &mut buf).unwrap();
    }
    vol.set_edge_memory(Box::new(|| 12_345));
    let s = vol.stats();
    let m = &s.memory.memory_bytes;
    assert_eq!(m.map, s.map_memory_bytes);
    assert_eq!(m.dedup_index, s.dedup.dedup_index_memory_bytes);
    assert!(m.dedup_index > 0);
    assert_eq!(m.dedup_shared, s.dedup.dedup_shared_table_bytes);
    assert_eq!(
        m.fingerprint_rows,
        768 * 24,
        "rows since the last checkpoint"
    );
    assert_eq!(m.segment_buffers, 1 << 20);
    assert_eq!(m.nbd_buffers, 12_345);
    assert!(m.read_cache >= 32 * 4096, "{m:?}");
    assert_eq!(m.total, m.sum());
    let json = serde_json::to_value(&s).unwrap();
    let parts = json["memory_bytes"].as_object().unwrap();
    let sum: u64 = (parts.iter())
        .filter(|(k, _)| *k != "total")
        .map(|(_, v)| v.as_u64().unwrap())
        .sum();
    assert_eq!(sum, parts["total"].as_u64().unwrap());
    assert_eq!(parts.len(), 10);
    #[cfg(target_os = "linux")]
    assert!(s.memory.rss_bytes > 0);
}

/// A server sends `VolumeStats` as JSON and `cvol stat` reads it back:
/// every key comes back, and a missing one is an error, not a zero.
#[test]
fn stats_read_back_from_json() {
    let sim = SimStorage::new(8 << 20);
    let vol = volume(&sim);
    let data: Vec<u8> = (0..3 * 4096u32).map(|i| (i % 251) as u8).collect();
    vol.write_at(0, &data, false).unwrap();
    vol.write_at(8 * 4096, &data, false).unwrap();
    let stats = vol.stats();
    assert!(stats.dedup.dedup_ratio >= 2.0 && stats.mapped_bytes > 0);
    let text = serde_json::to_string(&stats).unwrap();
    let back: crate::VolumeStats = serde_json::from_str(&text).unwrap();
    assert_eq!(serde_json::to_string(&back).unwrap(), text);
    let without = text.replace("\"segments_used\":", "\"segments_in_use\":");
    let err = serde_json::from_str::<crate::VolumeStats>(&without).unwrap_err();
    assert!(err.to_string().contains("segments_used"), "{err}");
}

/// Regression (found by `tests/write_behind.rs`, from the group
/// commit): a flush whose records another flush had already synced
/// returned without a sync of its own, yet freed (and hole-punched) the
/// segments empty *now*, emptied perhaps by records appended after that
/// sync. A crash then kept the map that pointed into the punched segment.
/// Here: a segment's blocks are all overwritten after a sync, and a flush
/// that noted its seq before those overwrites (`write_for_sync` with the
/// old seq, as a racing flush would) must leave the segment alone.
#[test]
fn regression_a_flush_with_nothing_to_sync_frees_no_segment() {
    let sim = SimStorage::new(16 << 20);
    let vol = volume_of(&sim, 4 << 20, Codec::None);
    let old = |l: u64| -> Vec<u8> { format!("old {l} ").bytes().cycle().take(BS).collect() };
    for l in 0..600 {
        vol.write_at(l * BS as u64, &old(l), false).unwrap();
    }
    vol.flush().unwrap();
    vol.checkpoint().unwrap();
    let (seg, offset) = {
        let st = vol.lock_state().unwrap();
        let EntryState::Data { offset, .. } = st.live.get(0).state_valid() else {
            panic!("block 0 is stored");
        };
        (st.segment_of(offset), offset)
    };
    let covers = vol.lock_state().unwrap().log.last_seq();
    // Every block of that segment overwritten, not synced.
    for l in 0..400 {
        let new: Vec<u8> = format!("new {l} ").bytes().cycle().take(BS).collect();
        vol.write_at(l * BS as u64, &new, false).unwrap();
    }
    {
        let st = vol.lock_state().unwrap();
        assert_eq!(
            st.live.usage().live_bytes(seg),
            0,
            "the segment is empty now"
        );
    }
    assert!(
        vol.write_for_sync(covers).unwrap().is_none(),
        "nothing to sync"
    );
    {
        let st = vol.lock_state().unwrap();
        assert_eq!(st.log.segments.state(seg), SegState::Sealed, "not freed");
    }
    // A power cut that keeps only what touched that segment since the sync
    // (a hole punch would): the flushed old blocks must read back.
    let base = offset - offset % (1 << 20);
    let crashed = sim.crash_dropping(|s| !(base..base + (1 << 20)).contains(&s));
    drop(vol);
    let vol = Volume::open(Arc::new(crashed), OpenOptions::default()).unwrap();
    let mut got = vec![0u8; BS];
    for l in 0..600 {
        vol.read_at(l * BS as u64, &mut got).unwrap();
        assert!(got == old(l), "block {l}");
    }
}

/// The unit cache is keyed by place (record offset and length). Once a
/// segment is reused, another record of the same length may sit at that
/// place: the cleaner moving one unit round a nearly full volume puts it
/// back where it was with a new seq (found by the cache simulation, where
/// reads then failed as corrupt). A cached unit that is not the record the
/// map names must be dropped and the store read.
#[test]
fn regression_a_stale_unit_at_a_reused_place_is_not_served() {
    let sim = SimStorage::new(16 << 20);
    let opts = CreateOptions::new(4 << 20, 16 << 20).with_segment_size(1 << 20);
    let vol = Volume::create(Arc::new(sim.clone()), &opts).unwrap();
    let data = |tag: u8| -> Vec<u8> { (0..4 * BS).map(|i| tag ^ (i % 7) as u8).collect() };
    vol.write_at(0, &data(1), false).unwrap();
    vol.write_at(64 * BS as u64, &data(2), false).unwrap();
    // Incompressible filler seals their segment: reads go to the store.
    let filler = pseudo_random(400 * BS, 1);
    vol.write_at(256 * BS as u64, &filler, false).unwrap();
    vol.flush().unwrap();
    let place = |lba: u64| match entry(&vol, lba).state_valid() {
        EntryState::Data {
            offset, len, unit, ..
        } => {
            assert!(unit, "4 blocks make one unit");
            (offset, len)
        }
        other => panic!("block {lba} is {other:?}"),
    };
    let (o0, l0) = place(0);
    let (o1, l1) = place(64);
    let mut rec = vec![0u8; l1 as usize];
    sim.read_at(o1, &mut rec).unwrap();
    let other = Arc::new(crate::records::DecodedUnit::decode(None, &rec).unwrap());
    // The other unit, cached at block 0's place.
    vol.caches.unit.insert((o0, l0), other);
    let mut got = vec![0u8; 4 * BS];
    vol.read_at(0, &mut got)
        .expect("the store is read, not the stale unit");
    assert_eq!(got, data(1));
    // Dedup verification too: the same content is found again.
    vol.caches.unit.insert(
        (o0, l0),
        Arc::new(crate::records::DecodedUnit::decode(None, &rec).unwrap()),
    );
    vol.write_at(128 * BS as u64, &data(1)[..BS], false)
        .unwrap();
    let mut one = vec![0u8; BS];
    vol.read_at(128 * BS as u64, &mut one).unwrap();
    assert_eq!(one, data(1)[..BS]);
}

/// Regression (packing benchmark, 80% utilisation): with live data at 80%
/// of the log, the background cleaner's 25% free target is out of reach;
/// it took every segment as a victim and moved all the live data per
/// pass. Its target is now capped at the free bytes plus half the dead
/// bytes, so a pass moves a fraction of the live data.
#[test]
fn the_cleaners_target_stays_within_reach_at_80_percent_live() {
    let sim = SimStorage::new(32 << 20);
    let opts = CreateOptions::new(64 << 20, 32 << 20)
        .with_codec(Codec::None)
        .with_dedup(false)
        .with_segment_size(1 << 20);
    let vol = Volume::create(Arc::new(sim.clone()), &opts).unwrap();
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let mut noise = |n: usize| -> Vec<u8> {
        let mut v = vec![0u8; n];
        rng.fill(&mut v[..]);
        v
    };
    // 24 MiB live (of ~31 MiB of segments), then random overwrites until
    // fewer than 10% of the segments are free.
    let blocks = (24 << 20) / BS as u64;
    for b in (0..blocks).step_by(64) {
        vol.write_at(b * BS as u64, &noise(64 * BS), false).unwrap();
    }
    let mut lba = 7u64;
    while vol.free_segments_below(10).unwrap().is_none() {
        lba = (lba
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407)
            >> 17)
            % blocks;
        vol.write_at(lba * BS as u64, &noise(BS), false).unwrap();
    }
    vol.flush().unwrap();
    let want = vol
        .free_segments_below(10)
        .unwrap()
        .expect("below 10% free");
    let st = vol.stats();
    let threshold = st.segments_total * 25 / 100 * (1 << 20);
    assert!(
        want < threshold,
        "want {want}: the 25% target is out of reach"
    );
    let live = st.live_bytes;
    vol.clean(want, false).unwrap();
    let moved = vol.stats().cleaner.cleaner_bytes_relocated;
    assert!(moved > 0, "the cleaner ran");
    assert!(
        moved * 2 < live,
        "a pass moved {moved} of {live} live bytes"
    );
}

/// Flushes that come often write zeros past the data head (a chunk at a
/// time, when less than half of one is left), so that the flushes after
/// them write over space the store holds; a flush after a long run of
/// writes writes none. Every flushed block survives a crash, whatever
/// part of the unsynced zeros and records lands.
#[test]
fn frequent_flushes_write_zeros_ahead_of_the_head() {
    const CHUNK: usize = 64 << 10;
    let sim = SimStorage::new(16 << 20);
    volume(&sim).close().unwrap();
    let opts = || OpenOptions {
        zero_ahead_bytes: Some(CHUNK),
        ..OpenOptions::default()
    };
    let vol = Volume::open(Arc::new(sim.clone()), opts()).unwrap();
    for t in 0..40u8 {
        vol.write_at(u64::from(t) * BS as u64, &block(t), false)
            .unwrap();
        vol.flush().unwrap();
    }
    let zeros = vol.stats().zero_ahead_bytes;
    {
        let st = vol.lock_state().unwrap();
        let (head, base) = (&st.log.head, st.log.segment_base());
        assert!(zeros >= CHUNK as u64, "{zeros}");
        assert!(
            head.prepared >= head.fill + CHUNK / 2,
            "{} {}",
            head.prepared,
            head.fill
        );
        assert!(head.prepared % CHUNK == 0 || head.prepared == 1 << 20);
        // Past the head the store holds zeros, up to what was prepared.
        let mut past = vec![0xffu8; head.prepared - head.fill];
        sim.read_at(base + head.fill as u64, &mut past).unwrap();
        assert!(past.iter().all(|&b| b == 0));
        // Zeros went only where the log had not been: at most the log's
        // bytes since open and the two chunks ahead of it.
        let bound = st.log.appended_bytes + 2 * CHUNK as u64;
        assert!(zeros <= bound, "{zeros} > {bound}");
    }
    // A flush after 512 KiB of incompressible writes: no zeros.
    let big = pseudo_random(128 * BS, 0x9e37_79b9_7f4a_7c15);
    vol.write_at(64 * BS as u64, &big, false).unwrap();
    vol.flush().unwrap();
    assert_eq!(
        vol.stats().zero_ahead_bytes,
        zeros,
        "a rare flush wrote zeros"
    );
    // Then often again, with an unsynced tail for the crash to tear.
    for t in 40..60u8 {
        vol.write_at(u64::from(t) * BS as u64, &block(t), false)
            .unwrap();
        vol.flush().unwrap();
    }
    vol.write_at(200 * BS as u64, &block(200), false).unwrap();
    assert!(vol.stats().zero_ahead_bytes > zeros);
    for seed in 0..8 {
        let crashed = sim.crash(seed);
        let vol = Volume::open(Arc::new(crashed), opts()).unwrap();
        let mut got = vec![0u8; BS];
        for t in 0..60u8 {
            vol.read_at(u64::from(t) * BS as u64, &mut got).unwrap();
            assert!(got == block(t), "seed {seed}: block {t}");
        }
        let mut got = vec![0u8; big.len()];
        vol.read_at(64 * BS as u64, &mut got).unwrap();
        assert!(got == big, "seed {seed}: the large write");
    }
}

/// A store whose writes of 64 KiB of zeros fail (a host file system out of
/// space, for the zeros ahead of the log head only).
struct NoZeros(SimStorage);

impl cvol_storage::Storage for NoZeros {
    fn len_bytes(&self) -> u64 {
        self.0.len_bytes()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.0.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        if data.len() >= 64 << 10 && data.iter().all(|&b| b == 0) {
            return Err(std::io::Error::from_raw_os_error(28)); // ENOSPC
        }
        self.0.write_at(offset, data)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.0.sync()
    }
}

/// Zeros ahead of the head that cannot be written fail no flush and
/// poison nothing: they are only an optimization, and are not tried again.
#[test]
fn zeros_ahead_that_fail_do_not_fail_the_flush() {
    let sim = SimStorage::new(16 << 20);
    volume(&sim).close().unwrap();
    let opts = OpenOptions {
        zero_ahead_bytes: Some(64 << 10),
        ..OpenOptions::default()
    };
    let vol = Volume::open(Arc::new(NoZeros(sim.clone())), opts).unwrap();
    for t in 0..20u8 {
        vol.write_at(u64::from(t) * BS as u64, &block(t), false)
            .unwrap();
        vol.flush().unwrap();
    }
    let s = vol.stats();
    assert!(!s.poisoned);
    assert_eq!(s.zero_ahead_bytes, 0);
    assert_eq!(vol.lock_state().unwrap().log.zero_ahead, 0, "tried again");
    vol.close().unwrap();
    drop(vol);
    let vol = Volume::open(Arc::new(sim.crash(7)), OpenOptions::default()).unwrap();
    let mut got = vec![0u8; BS];
    for t in 0..20u8 {
        vol.read_at(u64::from(t) * BS as u64, &mut got).unwrap();
        assert!(got == block(t), "block {t}");
    }
}
