//! Elastic compression: the probe writes incompressible data raw, codec tags
//! round-trip under every policy, merged units read back exactly at every
//! offset (also after overwrite, TRIM, cleaning, dedup and reopen), and
//! background recompression shrinks fast-codec data without changing it,
//! also while a client writes.
mod common;
use common::{close_and_check, text, BS, MIB};
use cvol_engine::{Codec, CodecPolicy, ElasticConfig, OpenOptions, Volume};
use cvol_storage::SimStorage;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::Arc;

fn random(seed: u64, len: usize) -> Vec<u8> {
    let mut r = StdRng::seed_from_u64(seed);
    (0..len).map(|_| r.gen()).collect()
}

/// Thresholds that pin the auto policy to one load level.
fn pinned(load: &str, unit_blocks: u32) -> ElasticConfig {
    let (busy_iops, idle_iops) = match load {
        "busy" => (0, 0),
        "medium" => (u64::MAX, 0),
        _ => (u64::MAX, u64::MAX - 1),
    };
    ElasticConfig {
        unit_blocks,
        busy_iops,
        idle_iops,
        busy_inflight: usize::MAX,
        recompress: false,
        ..ElasticConfig::default()
    }
}

fn volume(sim: &SimStorage, codec: CodecPolicy, dedup: bool, elastic: ElasticConfig) -> Volume {
    let opts = common::options(sim, 16 * MIB)
        .with_codec(codec)
        .with_dedup(dedup);
    common::create_closed(sim, &opts);
    reopen(sim, elastic)
}

fn reopen(sim: &SimStorage, elastic: ElasticConfig) -> Volume {
    let options = OpenOptions {
        elastic,
        ..OpenOptions::default()
    };
    common::open_with(sim, options)
}

/// Blocks stored raw, lz4, zstd.
fn blocks_by_codec(st: &cvol_engine::VolumeStats) -> [u64; 3] {
    [
        st.codec_none_blocks,
        st.codec_lz4_blocks,
        st.codec_zstd_blocks,
    ]
}

fn auto() -> CodecPolicy {
    CodecPolicy::Auto {
        strong: Codec::Zstd(9),
    }
}

fn read(vol: &Volume, offset: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    vol.read_at(offset, &mut b).unwrap();
    b
}

/// Every 4 KiB block alone, and byte ranges that straddle unit edges.
fn assert_reads(vol: &Volume, image: &[u8]) {
    for b in 0..image.len() / BS {
        assert!(
            read(vol, (b * BS) as u64, BS) == image[b * BS..(b + 1) * BS],
            "block {b}"
        );
    }
    let mut r = StdRng::seed_from_u64(7);
    for _ in 0..200 {
        let off = r.gen_range(0..image.len() - 1);
        let len = r.gen_range(1..=(image.len() - off).min(80_000));
        assert!(
            read(vol, off as u64, len) == image[off..off + len],
            "{off}+{len}"
        );
    }
    assert!(read(vol, 0, image.len()) == image);
}

#[test]
fn the_probe_writes_random_data_raw_without_compressing_it() {
    let sim = SimStorage::new(32 * MIB);
    let vol = volume(&sim, auto(), false, pinned("idle", 16));
    let data = random(1, 256 * 1024);
    vol.write_at(0, &data, false).unwrap();
    let st = vol.stats();
    assert_eq!(st.elastic.probe_raw_blocks, 64);
    assert_eq!((st.codec_none_blocks, st.elastic.units_written), (64, 0));
    assert_eq!(st.elastic.codec_none_bytes, 256 * 1024);
    // Compressible data next to it is compressed.
    vol.write_at(MIB, &text(2, 256 * 1024), false).unwrap();
    let st = vol.stats();
    assert_eq!(st.elastic.probe_raw_blocks, 64);
    assert_eq!(st.codec_zstd_blocks, 64);
    assert!(
        st.elastic.codec_zstd_bytes < 128 * 1024,
        "{}",
        st.elastic.codec_zstd_bytes
    );
    assert!(read(&vol, 0, data.len()) == data);
    close_and_check(vol, &sim);
}

#[test]
fn codec_tags_round_trip_under_every_policy() {
    let cases: [(CodecPolicy, &str, [u64; 3]); 7] = [
        (Codec::None.into(), "busy", [64, 0, 0]),
        (Codec::Lz4.into(), "busy", [0, 64, 0]),
        (Codec::Zstd(1).into(), "idle", [0, 0, 64]),
        (Codec::Zstd(19).into(), "busy", [0, 0, 64]),
        (auto(), "busy", [0, 64, 0]),
        (auto(), "medium", [0, 0, 64]),
        (auto(), "idle", [0, 0, 64]),
    ];
    for (policy, load, by_codec) in cases {
        let sim = SimStorage::new(32 * MIB);
        let vol = volume(&sim, policy, true, pinned(load, 8));
        let data = text(3, 256 * 1024);
        vol.write_at(0, &data, false).unwrap();
        let st = vol.stats();
        let got = blocks_by_codec(&st);
        assert_eq!(got, by_codec, "{policy} {load}");
        assert_eq!(st.codec, policy.to_string());
        assert!(read(&vol, 0, data.len()) == data, "{policy} {load}");
        vol.close().unwrap();
        drop(vol);
        let vol = reopen(&sim, pinned(load, 8));
        let st = vol.stats();
        let got = blocks_by_codec(&st);
        assert_eq!(got, by_codec, "{policy} {load} after reopen");
        assert_eq!(st.codec, policy.to_string(), "the policy is persistent");
        assert!(read(&vol, 0, data.len()) == data);
        close_and_check(vol, &sim);
    }
}

#[test]
fn merged_units_read_back_exactly_at_every_offset() {
    for unit in [1u32, 2, 4, 8, 16] {
        let sim = SimStorage::new(32 * MIB);
        let vol = volume(&sim, Codec::Lz4.into(), false, pinned("busy", unit));
        // One large write, an unaligned one, and one that starts mid-window.
        let mut image = text(u64::from(unit), 512 * 1024);
        vol.write_at(0, &image, false).unwrap();
        let odd = text(99, 3 * BS + 100);
        vol.write_at(200 * 1024 + 333, &odd, false).unwrap();
        image[200 * 1024 + 333..200 * 1024 + 333 + odd.len()].copy_from_slice(&odd);
        let st = vol.stats();
        if unit > 1 {
            assert!(st.elastic.units_written > 0 && st.elastic.unit_blocks_written <= 128 + 8);
            assert!(
                st.elastic.unit_blocks_written >= u64::from(unit) * st.elastic.units_written / 2
            );
        } else {
            assert_eq!(st.elastic.units_written, 0);
        }
        assert_reads(&vol, &image);
        // Overwrite one block inside a unit, trim another, zero a third.
        let one = text(1000, BS);
        vol.write_at(5 * BS as u64, &one, false).unwrap();
        image[5 * BS..6 * BS].copy_from_slice(&one);
        vol.trim(9 * BS as u64, BS as u64, false).unwrap();
        image[9 * BS..10 * BS].fill(0);
        vol.write_zeroes(17 * BS as u64, BS as u64, false, false)
            .unwrap();
        image[17 * BS..18 * BS].fill(0);
        assert_reads(&vol, &image);
        vol.verify_refcounts().unwrap();
        // The cleaner moves partly dead units (live mask) and reopen replays them.
        vol.clean(u64::MAX, false).unwrap();
        vol.flush().unwrap();
        vol.verify_refcounts().unwrap();
        assert_reads(&vol, &image);
        vol.close().unwrap();
        drop(vol);
        let vol = reopen(&sim, pinned("busy", unit));
        assert_reads(&vol, &image);
        close_and_check(vol, &sim);
    }
}

#[test]
fn dedup_finds_blocks_inside_units_and_survives_their_owners() {
    let sim = SimStorage::new(32 * MIB);
    let vol = volume(&sim, Codec::Lz4.into(), true, pinned("busy", 16));
    let a = text(5, 128 * 1024);
    vol.write_at(0, &a, false).unwrap();
    let stored = vol.stats().stored_bytes;
    // The same content one block further on: every block is a duplicate of
    // a block inside a unit (different unit boundaries).
    vol.write_at(MIB + BS as u64, &a, false).unwrap();
    let st = vol.stats();
    assert_eq!(st.dedup.dedup_hits, 32);
    assert_eq!(st.stored_bytes, stored);
    // The owners go away; the references keep the units alive.
    vol.write_at(0, &text(6, 128 * 1024), false).unwrap();
    assert!(read(&vol, MIB + BS as u64, a.len()) == a);
    vol.verify_refcounts().unwrap();
    vol.clean(u64::MAX, false).unwrap();
    vol.flush().unwrap();
    assert!(read(&vol, MIB + BS as u64, a.len()) == a);
    vol.close().unwrap();
    drop(vol);
    let vol = reopen(&sim, pinned("busy", 16));
    assert!(read(&vol, MIB + BS as u64, a.len()) == a);
    close_and_check(vol, &sim);
}

#[test]
fn recompression_shrinks_lz4_data_and_keeps_it_exact() {
    let sim = SimStorage::new(64 * MIB);
    // Busy: lz4, written in 4 KiB requests (single-block records).
    let vol = volume(&sim, auto(), true, pinned("busy", 16));
    let image = text(8, 4 * MIB as usize);
    for (i, b) in image.chunks(BS).enumerate() {
        vol.write_at((i * BS) as u64, b, false).unwrap();
    }
    let before = vol.stats();
    assert_eq!(before.codec_lz4_blocks, 1024);
    let mut total = 0;
    loop {
        let r = vol.recompress_pass(MIB, false).unwrap();
        total += r.blocks_rewritten;
        assert!(r.bytes_after <= r.bytes_before);
        if r.blocks_rewritten == 0 {
            break;
        }
    }
    let after = vol.stats();
    assert_eq!(total, 1024);
    assert_eq!((after.codec_zstd_blocks, after.codec_lz4_blocks), (1024, 0));
    assert_eq!(after.elastic.recompressed_blocks, 1024);
    assert!(
        after.elastic.units_written == 0,
        "recompression units are not client units"
    );
    assert!(
        after.stored_bytes * 10 < before.stored_bytes * 8,
        "{} -> {}",
        before.stored_bytes,
        after.stored_bytes
    );
    assert_reads(&vol, &image);
    // A second sweep finds nothing left to do.
    assert_eq!(
        vol.recompress_pass(u64::MAX, false)
            .unwrap()
            .blocks_rewritten,
        0
    );
    // Fixed codecs never recompress.
    vol.close().unwrap();
    drop(vol);
    let vol = reopen(&sim, pinned("busy", 16));
    assert_reads(&vol, &image);
    close_and_check(vol, &sim);
    let sim2 = SimStorage::new(32 * MIB);
    let fixed = volume(&sim2, Codec::Lz4.into(), false, pinned("busy", 1));
    fixed.write_at(0, &text(9, 256 * 1024), false).unwrap();
    assert_eq!(
        fixed
            .recompress_pass(u64::MAX, false)
            .unwrap()
            .blocks_rewritten,
        0
    );
}

/// In an object store a rewrite costs a PUT of what it writes: a rewrite
/// saving less than `recompress_min_gain_percent` of what it replaces is
/// left alone, and the busy codec is what the configuration names.
#[test]
fn recompression_rewrites_only_what_saves_the_least_gain() {
    let image = text(8, MIB as usize);
    let lz4_volume = |min_gain: u32| {
        let sim = SimStorage::new(64 * MIB);
        let cfg = ElasticConfig {
            recompress_min_gain_percent: min_gain,
            ..pinned("busy", 16)
        };
        let vol = volume(&sim, auto(), true, cfg);
        for (i, b) in image.chunks(BS).enumerate() {
            vol.write_at((i * BS) as u64, b, false).unwrap();
        }
        assert_eq!(vol.stats().codec_lz4_blocks, 256);
        let r = vol.recompress_pass(u64::MAX, false).unwrap();
        (vol, r)
    };
    // lz4 single blocks to zstd:9 units of 16 saves 20-50% of this text.
    let (vol, r) = lz4_volume(6);
    assert_eq!(r.blocks_rewritten, 256);
    assert!(r.bytes_after * 10 < r.bytes_before * 8, "{r:?}");
    let saved = 100 - r.bytes_after * 100 / r.bytes_before;
    assert!(saved < 90, "{r:?}");
    assert_reads(&vol, &image);
    let (vol, r) = lz4_volume(90);
    assert_eq!(r.blocks_rewritten, 0, "{r:?}");
    assert!(r.skipped > 0, "{r:?}");
    assert_eq!(vol.stats().codec_lz4_blocks, 256);
    assert_reads(&vol, &image);
    // The busy codec of an object store: zstd:1 inline.
    let sim = SimStorage::new(64 * MIB);
    let cfg = ElasticConfig {
        busy_codec: Codec::Zstd(1),
        ..pinned("busy", 4)
    };
    let vol = volume(&sim, auto(), true, cfg);
    vol.write_at(0, &image, false).unwrap();
    assert_eq!(blocks_by_codec(&vol.stats()), [0, 0, 256]);
    assert_reads(&vol, &image);
}

#[test]
fn recompression_racing_a_writer_never_loses_the_newer_write() {
    racing_a_writer(1);
    // Windows compressed by several threads and committed in order: a
    // write that lands between a window's read and its commit wins too.
    racing_a_writer(4);
}

fn racing_a_writer(recompress_threads: usize) {
    let sim = SimStorage::new(96 * MIB);
    let cfg = ElasticConfig {
        recompress_threads,
        ..pinned("busy", 8)
    };
    let vol = Arc::new(volume(&sim, auto(), false, cfg));
    let blocks = 2048u64;
    let mut versions = vec![0u32; blocks as usize];
    for l in 0..blocks {
        vol.write_at(l * BS as u64, &text(l << 8, BS), false)
            .unwrap();
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let bg = {
        let (vol, stop) = (vol.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                n += vol
                    .recompress_pass(256 * 1024, false)
                    .unwrap()
                    .blocks_rewritten;
            }
            n
        })
    };
    let mut r = StdRng::seed_from_u64(11);
    for _ in 0..6000 {
        let l = r.gen_range(0..blocks);
        versions[l as usize] += 1;
        let v = u64::from(versions[l as usize]);
        vol.write_at(l * BS as u64, &text((l << 8) | v, BS), false)
            .unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let rewritten = bg.join().unwrap();
    assert!(rewritten > 0, "recompression never ran against the writer");
    for l in 0..blocks {
        let v = u64::from(versions[l as usize]);
        assert!(
            read(&vol, l * BS as u64, BS) == text((l << 8) | v, BS),
            "lba {l}"
        );
    }
    let vol = Arc::try_unwrap(vol).ok().unwrap();
    close_and_check(vol, &sim);
}

/// A pass whose windows are read and compressed by several threads
/// commits exactly what a pass on one thread commits, in the same order:
/// the same rewrites (and the same windows left alone: incompressible
/// ones stored raw, and those holding dedup references), the same bytes,
/// the same data.
#[test]
fn a_pass_on_several_threads_commits_what_one_thread_commits() {
    let mut image = Vec::new();
    for i in 0..96u64 {
        match i % 6 {
            // Does not pay with the strong codec.
            0 => image.extend(random(i, 16 * 1024)),
            // A duplicate of the window before: a dedup reference.
            1 => image.extend(image[image.len() - 16 * 1024..].to_vec()),
            _ => image.extend(text(i, 16 * 1024)),
        }
    }
    let outcome = |recompress_threads: usize| {
        let sim = SimStorage::new(64 * MIB);
        let cfg = ElasticConfig {
            recompress_threads,
            ..pinned("busy", 4)
        };
        let vol = volume(&sim, auto(), true, cfg);
        for (i, c) in image.chunks(64 * 1024).enumerate() {
            vol.write_at((i * 64 * 1024) as u64, c, false).unwrap();
        }
        let r = vol.recompress_pass(u64::MAX, false).unwrap();
        assert_reads(&vol, &image);
        let st = vol.stats();
        let stored = (
            st.stored_bytes,
            st.elastic.codec_zstd_bytes,
            blocks_by_codec(&st),
        );
        close_and_check(vol, &sim);
        (r, stored)
    };
    let one = outcome(1);
    assert!(one.0.blocks_rewritten > 0, "{one:?}");
    for threads in [2, 3, 8] {
        assert_eq!(outcome(threads), one, "{threads} threads");
    }
}

/// Issue 16: a pass counts only windows that hold mapped pages, so one pass
/// over a 16 TiB volume with a little data at both ends reaches the end and
/// rewrites it all (a pass used to cover 2^18 windows of the logical range
/// whatever they held: a 16 TiB volume needed 4096 passes to sweep once,
/// and an idle server burned half a core doing it).
#[test]
fn a_pass_over_a_large_sparse_volume_skips_unmapped_windows() {
    const TIB: u64 = 1 << 40;
    let sim = SimStorage::new(32 * MIB);
    let opts = common::options(&sim, 16 * TIB).with_codec(auto());
    common::create_closed(&sim, &opts);
    let vol = reopen(&sim, pinned("busy", 4));
    let head = text(3, 64 * 1024);
    let tail = text(4, 64 * 1024);
    let tail_at = 16 * TIB - 1024 * 1024;
    for (i, b) in head.chunks(BS).enumerate() {
        vol.write_at((i * BS) as u64, b, false).unwrap();
    }
    for (i, b) in tail.chunks(BS).enumerate() {
        vol.write_at(tail_at + (i * BS) as u64, b, false).unwrap();
    }
    assert_eq!(vol.stats().codec_lz4_blocks, 32);
    let r = vol.recompress_pass(u64::MAX, false).unwrap();
    assert!(r.wrapped, "one pass reaches the end: {r:?}");
    assert_eq!(r.blocks_rewritten, 32, "{r:?}");
    assert_eq!(vol.stats().codec_zstd_blocks, 32);
    assert_eq!(read(&vol, 0, head.len()), head);
    assert_eq!(read(&vol, tail_at, tail.len()), tail);
    let again = vol.recompress_pass(u64::MAX, false).unwrap();
    assert!(again.wrapped && again.blocks_rewritten == 0, "{again:?}");
}

/// Busy, with inline compression deferred for every unit (a budget of 0).
fn deferring(unit_blocks: u32) -> ElasticConfig {
    ElasticConfig {
        recompress: true,
        inline_cpu_percent: Some(0),
        ..pinned("busy", unit_blocks)
    }
}

#[test]
fn deferred_units_are_stored_raw_then_recompressed_exactly() {
    let sim = SimStorage::new(64 * MIB);
    let vol = volume(&sim, auto(), true, deferring(4));
    let image = text(11, 4 * MIB as usize);
    // Large writes: every 4-block unit deferred, stored as one raw record.
    for (i, c) in image.chunks(256 * 1024).enumerate() {
        vol.write_at((i * 256 * 1024) as u64, c, false).unwrap();
    }
    // A single-block write is compressed all the same: a raw single block
    // would be taken for incompressible and never retried.
    let one = text(12, BS);
    vol.write_at(8 * MIB, &one, false).unwrap();
    let before = vol.stats();
    assert_eq!(before.elastic.deferred_blocks, 1024);
    assert_eq!(before.elastic.deferred_units, 256);
    assert_eq!(before.elastic.inline_cpu_percent, Some(0));
    assert_eq!(blocks_by_codec(&before), [1024, 1, 0]);
    assert!(
        before.stored_bytes > 4 * MIB,
        "raw: {}",
        before.stored_bytes
    );
    assert_reads(&vol, &image);
    // Idle: background recompression compresses them with the strong codec.
    let total = common::recompress_to_end(&vol, MIB);
    assert_eq!(total, 1025, "the deferred units and the lz4 block");
    let after = vol.stats();
    assert_eq!(blocks_by_codec(&after), [0, 0, 1025]);
    assert!(
        after.stored_bytes * 3 < before.stored_bytes,
        "{} -> {}",
        before.stored_bytes,
        after.stored_bytes
    );
    assert_reads(&vol, &image);
    assert_eq!(read(&vol, 8 * MIB, BS), one);
    vol.close().unwrap();
    drop(vol);
    let vol = reopen(&sim, deferring(4));
    assert_reads(&vol, &image);
    close_and_check(vol, &sim);
}

#[test]
fn a_deferred_unit_that_does_not_compress_is_settled_as_raw_blocks() {
    // Data the probe passes (a repeated 32-byte run wherever the probe
    // samples a 4-block unit) but no codec shrinks by 1/16: deferred,
    // then rewritten once as raw single blocks, which no later pass visits.
    let sim = SimStorage::new(64 * MIB);
    let vol = volume(&sim, auto(), false, deferring(4));
    let mut image = random(13, MIB as usize);
    let run = image[..32].to_vec();
    for unit in image.chunks_mut(4 * BS) {
        for at in cvol_engine::policy::probe_offsets(unit.len()) {
            unit[at..at + 32].copy_from_slice(&run);
        }
    }
    vol.write_at(0, &image, false).unwrap();
    let before = vol.stats();
    assert_eq!(before.elastic.deferred_blocks, 256, "the probe passed it");
    let first = vol.recompress_pass(u64::MAX, false).unwrap();
    assert_eq!(first.blocks_rewritten, 256);
    let again = vol.recompress_pass(u64::MAX, false).unwrap();
    assert_eq!((again.candidates, again.blocks_rewritten), (0, 0));
    let after = vol.stats();
    assert_eq!(after.codec_none_blocks, 256);
    assert_reads(&vol, &image);
    close_and_check(vol, &sim);
}

/// The policy's load is read from the volume's clock (`OpenOptions::clock`),
/// not the wall clock: with the clock held still, 400 one-block writes are
/// 400 requests in one instant (busy: lz4); once the clock moves past the
/// load monitor's second, the same writes find the volume idle (the strong
/// codec). Wall time plays no part, so the counts are exact.
#[test]
fn the_policy_reads_the_clock_it_is_given() {
    use cvol_engine::clock::ManualClock;
    let sim = SimStorage::new(32 * MIB);
    let opts = common::options(&sim, 16 * MIB).with_codec(auto());
    common::create_closed(&sim, &opts);
    let clock = Arc::new(ManualClock::new());
    let elastic = ElasticConfig {
        unit_blocks: 1,
        busy_iops: 100,
        idle_iops: 50,
        busy_inflight: usize::MAX,
        recompress: false,
        inline_cpu_percent: None,
        ..ElasticConfig::default()
    };
    let options = OpenOptions {
        elastic,
        clock: clock.clone(),
        ..OpenOptions::default()
    };
    let vol = common::open_with(&sim, options);
    // A frozen clock: every request lands in the last 200 ms (x5 per
    // second): from the 20th on, the load is at least 100 IOPS.
    for i in 0..400u64 {
        vol.write_at(i * BS as u64, &text(i, BS), false).unwrap();
    }
    let st = vol.stats();
    assert_eq!(st.elastic.auto_lz4_units, 400 - 19, "{:?}", st.elastic);
    // Two seconds later, one write at a time, each a second apart: idle.
    for i in 0..5u64 {
        clock.advance(std::time::Duration::from_secs(2));
        let at = (400 + i) * BS as u64;
        vol.write_at(at, &text(400 + i, BS), false).unwrap();
    }
    let st2 = vol.stats();
    assert_eq!(st2.elastic.auto_lz4_units, st.elastic.auto_lz4_units);
    assert_eq!(
        st2.elastic.auto_zstd_strong_units,
        st.elastic.auto_zstd_strong_units + 5
    );
    close_and_check(vol, &sim);
}

/// The machine's CPU counts as load for the codec: under a medium I/O
/// load, writes get the busy codec (lz4) while the gauge reads at least
/// `busy_cpu_percent`, zstd:1 below it or with the rule off, and never a
/// deferral for it (the inline budget is spent: a unit of two blocks
/// would be deferred under a busy I/O load). Every write reads back.
#[test]
fn a_busy_cpu_gives_writes_the_busy_codec_but_never_defers_them() {
    use cvol_engine::cpu::FixedCpu;
    let sim = SimStorage::new(32 * MIB);
    let opts = common::options(&sim, 16 * MIB).with_codec(auto());
    common::create_closed(&sim, &opts);
    let cpu = FixedCpu::shared(95);
    let open = |busy_cpu_percent| {
        let options = OpenOptions {
            elastic: ElasticConfig {
                busy_cpu_percent,
                inline_cpu_percent: Some(0),
                recompress: true,
                recompress_idle_ms: u64::MAX,
                ..pinned("medium", 4)
            },
            cpu: Some(cpu.clone() as Arc<dyn cvol_engine::cpu::CpuGauge>),
            ..OpenOptions::default()
        };
        common::open_with(&sim, options)
    };
    let vol = open(Some(70));
    let image = text(9, 64 * BS);
    let units = |vol: &Volume| {
        let e = vol.stats().elastic;
        [
            e.auto_lz4_units,
            e.auto_zstd_fast_units,
            e.auto_cpu_busy_units,
            e.deferred_units,
        ]
    };
    // 95% busy: 4 units of 4 blocks each, lz4, counted as the CPU's.
    vol.write_at(0, &image[..16 * BS], false).unwrap();
    assert_eq!(units(&vol), [4, 0, 4, 0]);
    let st = vol.stats();
    assert_eq!((st.codec_lz4_blocks, st.codec_zstd_blocks), (16, 0));
    assert_eq!(
        (st.elastic.load_cpu_percent, st.elastic.busy_cpu_percent),
        (Some(95), Some(70))
    );
    // At the threshold still busy; below it, zstd:1.
    cpu.set(70);
    vol.write_at(16 * BS as u64, &image[16 * BS..32 * BS], false)
        .unwrap();
    assert_eq!(units(&vol), [8, 0, 8, 0]);
    cpu.set(69);
    vol.write_at(32 * BS as u64, &image[32 * BS..48 * BS], false)
        .unwrap();
    assert_eq!(units(&vol), [8, 4, 8, 0]);
    assert_eq!(read(&vol, 0, 48 * BS), image[..48 * BS]);
    close_and_check(vol, &sim);
    // With the rule off, a busy machine changes nothing.
    cpu.set(100);
    let vol = open(None);
    vol.write_at(48 * BS as u64, &image[48 * BS..], false)
        .unwrap();
    assert_eq!(units(&vol), [0, 4, 0, 0]);
    assert_eq!(vol.stats().elastic.load_cpu_percent, Some(100));
    assert_eq!(read(&vol, 0, image.len()), image);
    close_and_check(vol, &sim);
}

/// Writes `data` one block per request (lz4 single blocks when busy).
fn write_blocks(vol: &Volume, lba: u64, data: &[u8]) {
    for (i, b) in data.chunks(BS).enumerate() {
        vol.write_at((lba + i as u64) * BS as u64, b, false)
            .unwrap();
    }
}

/// A window holding a dedup reference is recompressed around it (its
/// runs end at the reference), and the record references point at is
/// left alone: rewriting its owner would store its data twice (the
/// references keep the old record live).
#[test]
fn recompression_works_around_dedup_references_and_leaves_shared_records_alone() {
    let sim = SimStorage::new(64 * MIB);
    let vol = volume(&sim, auto(), true, pinned("busy", 1));
    let a = text(21, 16 * BS);
    let b = text(22, 16 * BS);
    write_blocks(&vol, 0, &a);
    // LBA 100 holds a's block 5 (a reference to its record), amid b.
    write_blocks(&vol, 96, &b[..4 * BS]);
    write_blocks(&vol, 100, &a[5 * BS..6 * BS]);
    write_blocks(&vol, 101, &b[5 * BS..]);
    let before = vol.stats();
    assert_eq!(before.dedup.dedup_hits, 1);
    assert_eq!(blocks_by_codec(&before), [0, 32, 0]);
    common::recompress_to_end(&vol, MIB);
    let after = vol.stats();
    assert_eq!(
        blocks_by_codec(&after),
        [0, 2, 30],
        "all but the shared record (its owner and its reference) is strong"
    );
    assert_eq!(after.dedup.dedup_saved_bytes, BS as u64, "stored once");
    assert!(after.stored_bytes < before.stored_bytes);
    vol.verify_refcounts().unwrap();
    assert!(read(&vol, 0, a.len()) == a);
    assert!(read(&vol, 100 * BS as u64, BS) == a[5 * BS..6 * BS]);
    assert!(read(&vol, 101 * BS as u64, 11 * BS) == b[5 * BS..]);
    close_and_check(vol, &sim);
}

/// A deferred raw unit that a dedup reference points into is left raw by
/// background recompression (it leaves shared records alone); the
/// cleaner compresses it as it moves it, keeping every block (the
/// reference's too), with the strong codec once clients are idle.
#[test]
fn the_cleaner_compresses_a_shared_raw_unit_as_it_moves_it() {
    use cvol_engine::clock::ManualClock;
    let sim = SimStorage::new(64 * MIB);
    let opts = common::options(&sim, 16 * MIB).with_codec(auto());
    common::create_closed(&sim, &opts);
    let clock = Arc::new(ManualClock::new());
    let elastic = deferring(4);
    let open = |clock: &Arc<ManualClock>| OpenOptions {
        elastic,
        clock: clock.clone(),
        ..OpenOptions::default()
    };
    let vol = common::open_with(&sim, open(&clock));
    let image = text(23, 64 * BS);
    vol.write_at(0, &image, false).unwrap();
    // One block of the first unit again, alone (never deferred): a
    // reference into the raw unit.
    vol.write_at(200 * BS as u64, &image[2 * BS..3 * BS], false)
        .unwrap();
    let st = vol.stats();
    assert_eq!((st.dedup.dedup_hits, st.elastic.deferred_units), (1, 16));
    // Data written after it, then zeroed: the unit's segment is sealed and
    // mostly dead (a victim).
    vol.write_at(4 * MIB, &random(24, MIB as usize), false)
        .unwrap();
    vol.write_at(4 * MIB, &vec![0; MIB as usize], false)
        .unwrap();
    common::recompress_to_end(&vol, MIB);
    let st = vol.stats();
    assert_eq!(
        blocks_by_codec(&st),
        [5, 0, 60],
        "the shared unit stays raw"
    );
    // Clients idle as long as recompression waits for: the strong codec.
    clock.advance(std::time::Duration::from_secs(2));
    vol.clean(u64::MAX, false).unwrap();
    let after = vol.stats();
    assert_eq!(
        blocks_by_codec(&after),
        [0, 0, 65],
        "compressed as it moved"
    );
    assert!(after.stored_bytes + 2 * BS as u64 <= st.stored_bytes);
    vol.verify_refcounts().unwrap();
    assert!(read(&vol, 0, image.len()) == image);
    assert!(read(&vol, 200 * BS as u64, BS) == image[2 * BS..3 * BS]);
    vol.close().unwrap();
    drop(vol);
    let vol = common::open_with(&sim, open(&clock));
    assert!(read(&vol, 0, image.len()) == image);
    assert!(read(&vol, 200 * BS as u64, BS) == image[2 * BS..3 * BS]);
    close_and_check(vol, &sim);
}

/// Cold data is rewritten in units of `recompress_unit_blocks` (64 KiB by
/// default), larger than the units clients write.
#[test]
fn recompression_merges_cold_data_into_cold_units() {
    for (cold, records) in [(16u32, 4u64), (4, 16)] {
        let sim = SimStorage::new(64 * MIB);
        let cfg = ElasticConfig {
            recompress_unit_blocks: cold,
            ..pinned("busy", 4)
        };
        let vol = volume(&sim, auto(), false, cfg);
        let image = text(24, 64 * BS);
        vol.write_at(0, &image, false).unwrap();
        let before = vol.stats();
        assert_eq!(blocks_by_codec(&before), [0, 64, 0]);
        assert_eq!(common::recompress_to_end(&vol, MIB), 64);
        let after = vol.stats();
        assert_eq!(blocks_by_codec(&after), [0, 0, 64]);
        let offsets: std::collections::BTreeSet<u64> = (0..64u64)
            .filter_map(|l| vol.block_record(l))
            .map(|(o, _)| o)
            .collect();
        assert_eq!(offsets.len() as u64, records, "cold units of {cold} blocks");
        assert_reads(&vol, &image);
        close_and_check(vol, &sim);
    }
}
