//! Space the host sees: idle cleaning returns dead space to the
//! host, the dedup index follows every block the cleaner or the
//! recompressor moves, an identical overwrite appends nothing, and the
//! ratios of an empty volume are 1.0.
mod common;
use common::{close_and_check, text, BS, MIB};
use cvol_engine::{Codec, CodecPolicy, ElasticConfig, OpenOptions, Volume};
use cvol_storage::SimStorage;
use std::time::Instant;

/// Elastic settings with background recompression off (tests drive it).
fn manual(busy: bool) -> ElasticConfig {
    ElasticConfig {
        busy_iops: if busy { 0 } else { u64::MAX },
        idle_iops: if busy { 0 } else { u64::MAX - 1 },
        busy_inflight: usize::MAX,
        recompress: false,
        ..ElasticConfig::default()
    }
}

fn volume(sim: &SimStorage, logical: u64, codec: CodecPolicy) -> Volume {
    let opts = common::options(sim, logical).with_codec(codec);
    common::create_closed(sim, &opts);
    common::open_with(
        sim,
        OpenOptions {
            elastic: manual(true),
            ..OpenOptions::default()
        },
    )
}

fn write_chunks(vol: &Volume, at: u64, data: &[u8], chunk: usize) {
    for (i, c) in data.chunks(chunk).enumerate() {
        vol.write_at(at + (i * chunk) as u64, c, false).unwrap();
    }
}

fn assert_image(vol: &Volume, at: u64, image: &[u8]) {
    let mut got = vec![0u8; image.len()];
    vol.read_at(at, &mut got).unwrap();
    for (b, (g, w)) in got.chunks(BS).zip(image.chunks(BS)).enumerate() {
        assert!(g == w, "block {b} after lba {}", at / BS as u64);
    }
}

/// Dead bytes in sealed segments after idle cleaning are within the
/// target: 5% of live, plus the one segment holding the old checkpoint
/// and tails a pass cannot avoid.
fn assert_dead_within_target(st: &cvol_engine::VolumeStats) {
    let allowed = st.live_bytes / 20 + 2 * st.segment_size_bytes;
    assert!(
        st.dead_bytes <= allowed,
        "dead {} > allowed {} (live {})",
        st.dead_bytes,
        allowed,
        st.live_bytes
    );
}

#[test]
fn idle_cleaning_returns_dead_space_to_the_host() {
    let sim = SimStorage::new(96 * MIB);
    let vol = volume(&sim, 64 * MIB, Codec::Lz4.into());
    let a = text(1, 24 * MIB as usize);
    write_chunks(&vol, 0, &a, 64 << 10);
    // Overwrite every other 64 KiB: each segment of `a` becomes half dead.
    let b = text(2, 24 * MIB as usize);
    let mut image = a.clone();
    for off in (0..a.len()).step_by(128 << 10) {
        let end = off + (64 << 10);
        vol.write_at(off as u64, &b[off..end], false).unwrap();
        image[off..end].copy_from_slice(&b[off..end]);
    }
    vol.flush().unwrap();
    let before = vol.stats();
    assert!(
        before.reclaimable_bytes > before.live_bytes / 4,
        "the overwrites left dead space: {before:?}"
    );
    let r = vol.idle_clean(false).unwrap();
    assert!(r.segments > 0 && !r.yielded, "{r:?}");
    assert!(r.segments_reclaimed >= r.segments / 2, "{r:?}");
    let after = vol.stats();
    assert_dead_within_target(&after);
    assert!(
        after.physical_used_bytes + before.reclaimable_bytes / 2 < before.physical_used_bytes,
        "physical used {} -> {} with {} reclaimable",
        before.physical_used_bytes,
        after.physical_used_bytes,
        before.reclaimable_bytes
    );
    assert_eq!(after.cleaner.idle_clean_passes, 1);
    assert_eq!(after.cleaner.idle_clean_bytes_relocated, r.bytes_relocated);
    assert_eq!(
        after.stored_bytes, before.stored_bytes,
        "moves change no data"
    );
    // Nothing changed since: a second pass has nothing to do.
    let again = vol.idle_clean(false).unwrap();
    assert_eq!(again.segments, 0, "{again:?}");
    assert_image(&vol, 0, &image);
    close_and_check(vol, &sim);
    // The cleaned layout recovers.
    let vol = common::open(&sim);
    assert_image(&vol, 0, &image);
    close_and_check(vol, &sim);
}

#[test]
fn dedup_and_identical_overwrites_survive_cleaner_moves() {
    let sim = SimStorage::new(96 * MIB);
    let vol = volume(&sim, 64 * MIB, Codec::Lz4.into());
    let a = text(3, 8 * MIB as usize);
    let filler = text(4, 8 * MIB as usize);
    // `a` and filler interleaved in the log, then the filler overwritten:
    // `a`'s segments are half dead and idle cleaning moves `a`.
    for (i, (x, y)) in a.chunks(64 << 10).zip(filler.chunks(64 << 10)).enumerate() {
        vol.write_at((i * (64 << 10)) as u64, x, false).unwrap();
        vol.write_at(((i * (64 << 10)) as u64) + 16 * MIB, y, false)
            .unwrap();
    }
    vol.write_zeroes(16 * MIB, 8 * MIB, false, false).unwrap();
    vol.flush().unwrap();
    let r = vol.idle_clean(false).unwrap();
    assert!(r.bytes_relocated > 0, "{r:?}");
    let moved = vol.stats();
    // The same data at the same place: nothing appended at all.
    write_chunks(&vol, 0, &a, 64 << 10);
    let same = vol.stats();
    assert_eq!(
        same.last_seq, moved.last_seq,
        "identical overwrite appended records"
    );
    assert_eq!(same.media_bytes_written, moved.media_bytes_written);
    // The same data elsewhere: every block a reference to the moved copy.
    let hits = same.dedup.dedup_hits;
    write_chunks(&vol, 32 * MIB, &a, 64 << 10);
    let copy = vol.stats();
    assert_eq!(copy.dedup.dedup_hits - hits, (a.len() / BS) as u64);
    assert_eq!(copy.stored_bytes, same.stored_bytes);
    assert_image(&vol, 0, &a);
    assert_image(&vol, 32 * MIB, &a);
    close_and_check(vol, &sim);
}

#[test]
fn dedup_survives_recompression() {
    let sim = SimStorage::new(64 * MIB);
    let auto = CodecPolicy::Auto {
        strong: Codec::Zstd(9),
    };
    let vol = volume(&sim, 32 * MIB, auto);
    let a = text(5, 4 * MIB as usize);
    write_chunks(&vol, 0, &a, BS); // busy: lz4, single-block records
    let rewritten = common::recompress_to_end(&vol, MIB);
    assert_eq!(rewritten, (a.len() / BS) as u64);
    let before = vol.stats();
    write_chunks(&vol, 0, &a, BS);
    let same = vol.stats();
    assert_eq!(
        same.last_seq, before.last_seq,
        "identical overwrite appended records"
    );
    write_chunks(&vol, 16 * MIB, &a, 64 << 10);
    let after = vol.stats();
    assert_eq!(
        after.dedup.dedup_hits - same.dedup.dedup_hits,
        (a.len() / BS) as u64,
        "every block of the copy deduplicated against the recompressed records"
    );
    assert_eq!(after.stored_bytes, before.stored_bytes);
    assert_image(&vol, 16 * MIB, &a);
    close_and_check(vol, &sim);
}

#[test]
fn ratios_of_an_empty_volume_are_one() {
    let sim = SimStorage::new(16 * MIB);
    let vol = volume(&sim, 8 * MIB, Codec::Lz4.into());
    let st = vol.stats();
    assert_eq!(
        (
            st.reduction_ratio,
            st.compression_ratio,
            st.dedup.dedup_ratio
        ),
        (1.0, 1.0, 1.0)
    );
    // Two copies of compressible data: dedup 2x, and compression alone
    // does not count the copy.
    let a = text(6, 2 * MIB as usize);
    write_chunks(&vol, 0, &a, 64 << 10);
    write_chunks(&vol, 4 * MIB, &a, 64 << 10);
    let st = vol.stats();
    assert!(
        (st.dedup.dedup_ratio - 2.0).abs() < 1e-9,
        "{}",
        st.dedup.dedup_ratio
    );
    let unique = (st.mapped_bytes / 2) as f64;
    assert!((st.compression_ratio - unique / st.stored_bytes as f64).abs() < 1e-9);
    assert!(st.compression_ratio > 1.5 && st.compression_ratio < 8.0);
    close_and_check(vol, &sim);
}

#[test]
fn recompression_leaves_alone_what_cleaning_cannot_collect() {
    let sim = SimStorage::new(96 * MIB);
    let opts = common::options(&sim, 64 * MIB).with_codec(CodecPolicy::Auto {
        strong: Codec::Zstd(9),
    });
    common::create_closed(&sim, &opts);
    // Idle load: zstd:3. 64 KiB of units (strong enough), every third
    // followed in the log by one lone 4 KiB block (a single-block record: a
    // recompression candidate) at the far end of the volume: every segment
    // is about 97% units, so rewriting the lone blocks would free space no
    // cleaning collects.
    let vol = common::open_with(
        &sim,
        OpenOptions {
            elastic: manual(false),
            ..OpenOptions::default()
        },
    );
    let units = text(7, 32 * MIB as usize);
    let lone = text(8, 512 * BS);
    for (i, u) in units.chunks(64 << 10).enumerate() {
        vol.write_at((i * (64 << 10)) as u64, u, false).unwrap();
        if i % 3 == 0 {
            let at = 32 * MIB + (i * (64 << 10)) as u64;
            vol.write_at(at, &lone[i * BS..(i + 1) * BS], false)
                .unwrap();
        }
    }
    vol.flush().unwrap();
    let before = vol.stats();
    let r = vol.recompress_pass(u64::MAX, false).unwrap();
    assert!(r.candidates >= 160, "{r:?}");
    // All but those in the open segment (little live yet) are left alone.
    assert!(r.uncollectable * 10 >= r.candidates * 9, "{r:?}");
    assert_eq!(r.blocks_rewritten, r.candidates - r.uncollectable, "{r:?}");
    let after = vol.stats();
    assert!(after.physical_used_bytes <= before.physical_used_bytes + MIB);
    assert_eq!(
        after.elastic.recompress_uncollectable_windows,
        r.uncollectable
    );
    close_and_check(vol, &sim);
}

/// While background recompression rewrites deferred raw units, the
/// segments each pass empties are collected before the next pass appends
/// more: the space used grows by about a pass at most, not by every
/// rewrite until the sweep ends.
#[test]
fn background_recompression_collects_what_it_empties_as_it_goes() {
    let sim = SimStorage::new(96 * MIB);
    let opts = common::options(&sim, 64 * MIB).with_codec(CodecPolicy::Auto {
        strong: Codec::Zstd(9),
    });
    common::create_closed(&sim, &opts);
    // Busy with no inline CPU budget: every unit is deferred (stored raw;
    // deferral needs recompression on, whose worker this test starts
    // only later).
    let deferring = ElasticConfig {
        inline_cpu_percent: Some(0),
        recompress: true,
        ..manual(true)
    };
    let vol = common::open_with(
        &sim,
        OpenOptions {
            elastic: deferring,
            ..OpenOptions::default()
        },
    );
    let image = text(11, 24 * MIB as usize);
    write_chunks(&vol, 0, &image, 64 << 10);
    vol.flush().unwrap();
    let end_of_copy = vol.stats();
    assert!(end_of_copy.elastic.deferred_units > 0, "{end_of_copy:?}");
    vol.close().unwrap();
    drop(vol);
    // Idle, recompressing in the background 1 MiB of data per pass.
    let idle = ElasticConfig {
        recompress: true,
        recompress_idle_ms: 0,
        recompress_pass_bytes: MIB,
        ..manual(false)
    };
    let vol = std::sync::Arc::new(common::open_with(
        &sim,
        OpenOptions {
            elastic: idle,
            ..OpenOptions::default()
        },
    ));
    let worker = vol.start_background_recompressor().expect("policy auto");
    let mut peak = 0;
    let t0 = std::time::Instant::now();
    let settled = loop {
        let st = vol.stats();
        peak = peak.max(st.physical_used_bytes);
        if st.codec_none_blocks == 0 || t0.elapsed().as_secs() > 120 {
            break st;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    };
    drop(worker);
    assert_eq!(settled.codec_none_blocks, 0, "recompressed everything");
    // A pass appends about 1 MiB compressed; 4 MiB covers the open
    // segments and a checkpoint. Without collecting as it goes, the
    // space used grew by the whole compressed image (about 8 MiB).
    assert!(
        peak <= end_of_copy.physical_used_bytes + 4 * MIB,
        "peak {peak} vs {} at the end of the copy",
        end_of_copy.physical_used_bytes
    );
    assert_image(&vol, 0, &image);
    let vol = std::sync::Arc::try_unwrap(vol)
        .ok()
        .expect("worker stopped");
    close_and_check(vol, &sim);
}

/// `du` of a file under the volume: a SimStorage that counts the 4 KiB
/// blocks written since their last discard (a file system allocates what
/// is written, zeros too, and a hole punch returns it), with the highest
/// count since `reset_peak`, seen at every write. Overwrites are cheap,
/// as in a file: the log writes zeros ahead of its head and keeps freed
/// segments warm.
#[derive(Clone)]
struct DuStorage {
    sim: SimStorage,
    blocks: std::sync::Arc<std::sync::Mutex<DuBlocks>>,
}

#[derive(Default)]
struct DuBlocks {
    held: std::collections::BTreeSet<u64>,
    peak: u64,
}

impl DuStorage {
    fn new(size: u64) -> DuStorage {
        DuStorage {
            sim: SimStorage::new(size),
            blocks: Default::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, DuBlocks> {
        self.blocks.lock().unwrap()
    }

    fn du(&self) -> u64 {
        self.lock().held.len() as u64 * BS as u64
    }

    /// The most `du` was since the last call, and starts over from now.
    fn reset_peak(&self) -> u64 {
        let mut g = self.lock();
        let now = g.held.len() as u64 * BS as u64;
        std::mem::replace(&mut g.peak, now)
    }
}

impl cvol_storage::Storage for DuStorage {
    fn len_bytes(&self) -> u64 {
        self.sim.len_bytes()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.sim.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.sim.write_at(offset, data)?;
        let b = BS as u64;
        let mut g = self.lock();
        g.held
            .extend(offset / b..(offset + data.len() as u64).div_ceil(b));
        g.peak = g.peak.max(g.held.len() as u64 * b);
        Ok(())
    }
    fn sync(&self) -> std::io::Result<()> {
        self.sim.sync()
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.sim.discard(offset, len)?;
        let b = BS as u64;
        let mut g = self.lock();
        for block in offset.div_ceil(b)..(offset + len) / b {
            g.held.remove(&block);
        }
        Ok(())
    }
    fn next_data(&self, offset: u64) -> std::io::Result<Option<u64>> {
        self.sim.next_data(offset)
    }
    fn overwrite_is_cheaper(&self) -> bool {
        true
    }
    fn allocated_bytes(&self) -> Option<u64> {
        Some(self.du())
    }
}

/// A volume of `logical` bytes on a `DuStorage` of `physical`, created
/// with 1 MiB segments and policy auto (zstd:9), open with no inline CPU
/// budget (every unit written raw) and background recompression passes
/// of `pass_bytes` once idle, within what the host gave back or not.
fn raw_writer(
    physical: u64,
    logical: u64,
    pass_bytes: u64,
    within_host_bytes: bool,
) -> (DuStorage, std::sync::Arc<Volume>) {
    let du = DuStorage::new(physical);
    let opts = cvol_engine::CreateOptions::new(logical, physical)
        .with_segment_size(MIB)
        .with_codec(CodecPolicy::Auto {
            strong: Codec::Zstd(9),
        });
    let store: std::sync::Arc<dyn cvol_storage::Storage> = std::sync::Arc::new(du.clone());
    Volume::create(store.clone(), &opts)
        .unwrap()
        .close()
        .unwrap();
    // Busy with no inline CPU budget: every unit is stored raw; the
    // workers start once the copy is done, and find the volume idle.
    let elastic = ElasticConfig {
        inline_cpu_percent: Some(0),
        recompress: true,
        recompress_idle_ms: 0,
        recompress_pass_bytes: pass_bytes,
        recompress_within_host_bytes: within_host_bytes,
        ..manual(true)
    };
    let options = OpenOptions {
        elastic,
        ..OpenOptions::default()
    };
    (
        du,
        std::sync::Arc::new(Volume::open(store, options).unwrap()),
    )
}

/// What the host holds (`du`, seen at every write) from the end of a copy
/// written raw (no inline CPU budget) while background recompression
/// rewrites it and the segments it empties are collected, until it
/// settles: (end of copy, peak, settled).
fn du_while_idle(within_host_bytes: bool) -> (u64, u64, u64) {
    let (du, vol) = raw_writer(96 * MIB, 64 * MIB, 4 * MIB, within_host_bytes);
    let image = text(12, 24 * MIB as usize);
    write_chunks(&vol, 0, &image, 64 << 10);
    vol.flush().unwrap();
    assert!(vol.stats().elastic.deferred_units > 0);
    du.reset_peak();
    let end_of_copy = du.du();
    let workers = (
        vol.start_background_recompressor().expect("policy auto"),
        vol.start_background_cleaner(),
    );
    // Settled: everything recompressed and `du` unchanged for 3 s.
    let (t0, mut last, mut since) = (Instant::now(), u64::MAX, Instant::now());
    while t0.elapsed().as_secs() < 120 && since.elapsed().as_secs() < 3 {
        std::thread::sleep(std::time::Duration::from_millis(5));
        let now = du.du();
        if now != last || vol.stats().codec_none_blocks > 0 {
            (last, since) = (now, Instant::now());
        }
    }
    drop(workers);
    assert_eq!(vol.stats().codec_none_blocks, 0, "recompressed everything");
    assert_image(&vol, 0, &image);
    let settled = du.du();
    let peak = du.reset_peak();
    let vol = std::sync::Arc::try_unwrap(vol)
        .ok()
        .expect("workers stopped");
    vol.close().unwrap();
    (end_of_copy, peak, settled)
}

/// The promise of idle time on a file: `du` never exceeds its value at
/// the end of the copy by more than one segment. (Not strictly never
/// above: the first pass must append the rewrite of one segment, and a
/// checkpoint, before the host gets anything back; here +0.3 MiB.) Before
/// the passes were bounded by what the host gave back, `du` grew by most
/// of a pass (+1.6 MiB here, 4 MiB passes).
#[test]
fn idle_sweep_never_holds_more_than_at_the_end_of_the_copy() {
    let (end_of_copy, peak, settled) = du_while_idle(true);
    assert!(
        peak <= end_of_copy + MIB,
        "peak {peak} > end of copy {end_of_copy} + one segment"
    );
    assert!(
        settled * 4 < end_of_copy,
        "settled {settled} of {end_of_copy}"
    );
}

/// An idle sweep's passes follow each other at once: a pass that rewrote
/// data and was not interrupted is not followed by the recompressor's
/// idle period (200 ms), which with 16 MiB passes was a third of the time
/// a sweep of a 1 GiB copy took to settle. Here 8 MiB in passes of
/// 256 KiB: every step that rewrote data asks for the next at once, the
/// one that finds nothing left does not (mutations: never asking, or
/// always, fail it). What it saves is measured in docs/BENCHMARKING.md
/// ("Settling time"), not timed here.
#[test]
fn idle_sweep_passes_follow_each_other_at_once() {
    let (_, vol) = raw_writer(64 * MIB, 32 * MIB, 256 << 10, true);
    let image = text(13, 8 * MIB as usize);
    write_chunks(&vol, 0, &image, 64 << 10);
    vol.flush().unwrap();
    assert!(vol.stats().codec_none_blocks > 0);
    let mut steps = 0;
    while vol.stats().codec_none_blocks > 0 && steps < 10_000 {
        let before = vol.stats().elastic.recompressed_blocks;
        let again = vol.background_recompress_step();
        let rewrote = vol.stats().elastic.recompressed_blocks > before;
        assert_eq!(
            again, rewrote,
            "step {steps}: again {again}, rewrote {rewrote}"
        );
        steps += 1;
    }
    assert_eq!(vol.stats().codec_none_blocks, 0, "recompressed everything");
    assert!(steps >= 32, "{steps} steps");
    assert!(
        !vol.background_recompress_step(),
        "nothing left: the idle period"
    );
}

/// The open segment holds host space past its records (the zeros written
/// ahead of the head for frequent flushes, or a warm segment's old bytes):
/// once clients are idle that tail is given back (`punch_head_tail`), once
/// per head position, and the volume reads back and recovers exactly.
#[test]
fn the_open_segments_tail_is_given_back_when_idle() {
    let (du, vol) = raw_writer(64 * MIB, 32 * MIB, MIB, true);
    let vol = std::sync::Arc::try_unwrap(vol).ok().expect("no worker");
    // Small writes, each flushed: zeros are written ahead of the head.
    let image = text(31, 16 * BS);
    for (i, b) in image.chunks(BS).enumerate() {
        vol.write_at((i * BS) as u64, b, false).unwrap();
        vol.flush().unwrap();
    }
    let st = vol.stats();
    assert!(st.zero_ahead_bytes > 0, "zeros ahead: {st:?}");
    let held = du.du();
    let given = vol.punch_head_tail().unwrap();
    assert!(given >= 128 * 1024, "gave back {given}");
    assert!(
        du.du() + 128 * 1024 <= held,
        "du {} -> {}: the tail's blocks are free",
        held,
        du.du()
    );
    assert_eq!(vol.punch_head_tail().unwrap(), 0, "once per head position");
    // Writes go on past the punched tail, and a reopen finds them all.
    let more = text(32, 8 * BS);
    vol.write_at(64 * BS as u64, &more, false).unwrap();
    vol.flush().unwrap();
    assert_image(&vol, 0, &image);
    vol.close().unwrap();
    drop(vol);
    let store: std::sync::Arc<dyn cvol_storage::Storage> = std::sync::Arc::new(du.clone());
    let vol = Volume::open(store, OpenOptions::default()).unwrap();
    assert_image(&vol, 0, &image);
    assert_image(&vol, 64 * BS as u64, &more);
    vol.verify_refcounts().unwrap();
    vol.close().unwrap();
}
