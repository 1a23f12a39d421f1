//! The estimator on data whose answer is known.
use super::report::{estimate, Estimate};
use super::tally::{Config, Tally, BS};
use super::*;
use cvol_engine::codec::Codec;

/// Deterministic incompressible bytes.
fn random(n: usize, seed: u64) -> Vec<u8> {
    use rand::{RngCore, SeedableRng};
    let mut b = vec![0u8; n];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut b);
    b
}

/// Text-like bytes: words from a small vocabulary, picked at random.
fn text(n: usize, seed: u64) -> Vec<u8> {
    const WORDS: [&str; 16] = [
        "the ",
        "volume ",
        "stores ",
        "blocks ",
        "of ",
        "data ",
        "and ",
        "each ",
        "record ",
        "is ",
        "compressed ",
        "when ",
        "it ",
        "saves ",
        "space ",
        "log\n",
    ];
    let picks = random(n, seed);
    let mut out = Vec::with_capacity(n + 16);
    let mut i = 0;
    while out.len() < n {
        out.extend_from_slice(WORDS[usize::from(picks[i % n]) % 16].as_bytes());
        i += 1;
    }
    out.truncate(n);
    out
}

fn run(data: &[u8], cfg: Config) -> Estimate {
    let mut t = Tally::new(cfg);
    for (i, chunk) in data.chunks(1 << 20).enumerate() {
        t.feed(i as u64 * 256, chunk);
    }
    estimate(&t.counts(), (data.len() as u64).div_ceil(BS as u64))
}

fn exact(codec: Codec) -> Config {
    Config {
        codec,
        unit_blocks: 4,
        fp_modulus: 1,
        compress_modulus: 1,
        shared_keep_lz4: false,
    }
}

#[test]
fn four_copies_of_random_data_dedup_four_times_and_do_not_compress() {
    let one = random(1 << 20, 7);
    let data = one.repeat(4);
    let e = run(&data, exact(Codec::Zstd(9)));
    assert_eq!(e.logical_bytes, 4 << 20);
    assert_eq!(e.zero_bytes, 0);
    assert_eq!(e.dedup_ratio, 4.0);
    assert_eq!(e.distinct_bytes, 1 << 20);
    assert_eq!(e.main.compression_ratio, 1.0, "random data is stored raw");
    assert_eq!(e.main.stored_bytes, 1 << 20);
    // du: the data and a header per record (raw: one per block), 5% of
    // that dead, 12 bytes a mapped block and 18 a distinct one.
    let blocks = 256.0;
    let live = (1u64 << 20) as f64 + blocks * 44.0;
    let du = live * 1.05 + 1024.0 * 12.0 + blocks * 18.0;
    assert_eq!(e.main.du_bytes, du as u64);
    assert!(!e.partial);
}

#[test]
fn zeros_cost_nothing_but_metadata_and_a_tail_is_padded() {
    let mut data = vec![0u8; 3 << 20];
    data.extend(random(5000, 3)); // a block and a short tail
    let e = run(&data, exact(Codec::Lz4));
    assert_eq!(e.logical_bytes, (3 << 20) + 2 * 4096);
    assert_eq!(e.zero_bytes, 3 << 20);
    assert_eq!(e.distinct_bytes, 2 * 4096);
    let zeros = run(&vec![0u8; 1 << 20], exact(Codec::Lz4));
    assert_eq!((zeros.zero_bytes, zeros.main.du_bytes), (1 << 20, 0));
    assert_eq!(zeros.dedup_ratio, 1.0);
}

#[test]
fn text_compresses_about_three_times_and_lz4_less() {
    let data = text(4 << 20, 11);
    let e = run(&data, exact(Codec::Zstd(9)));
    assert!(e.dedup_ratio < 1.01, "{e:?}");
    let (z, l) = (e.main.compression_ratio, e.lz4.compression_ratio);
    // 16 words: 4 bits of entropy per ~5.6 bytes: zstd ~ 3.5-5x.
    assert!((2.5..8.0).contains(&z), "zstd {z}");
    assert!(l > 1.3 && l < z, "lz4 {l} zstd {z}");
    // Checked against compressing the units directly.
    let direct: usize = data
        .chunks(4 * BS)
        .map(|u| tally::stored_len(Codec::Zstd(9), u, true).0)
        .sum();
    let want = data.len() as f64 / direct as f64;
    assert!((z / want - 1.0).abs() < 1e-9, "{z} vs {want}");
}

#[test]
fn hash_sampling_estimates_dedup_and_compression_without_bias() {
    // 64 MiB: 16 MiB of text blocks, three more copies of the first 8 MiB
    // at other alignments, and 24 MiB of random: 12288 distinct blocks
    // of 16384. Sampled 1 in 8 fingerprints, 1 in 32 compressions.
    let mut data = text(16 << 20, 5);
    let head = data[..8 << 20].to_vec();
    for _ in 0..3 {
        data.extend_from_slice(&head);
    }
    data.extend(random(24 << 20, 9));
    let exact_e = run(&data, exact(Codec::Zstd(3)));
    let sampled = run(
        &data,
        Config {
            fp_modulus: 8,
            compress_modulus: 32,
            ..exact(Codec::Zstd(3))
        },
    );
    assert!((exact_e.dedup_ratio - 16384.0 / 10240.0).abs() < 1e-9);
    let rel = |a: f64, b: f64| (a / b - 1.0).abs();
    assert!(
        rel(sampled.dedup_ratio, exact_e.dedup_ratio) < 0.1,
        "{sampled:?}"
    );
    let (s, x) = (
        sampled.main.compression_ratio,
        exact_e.main.compression_ratio,
    );
    assert!(rel(s, x) < 0.15, "sampled {s} exact {x}");
    // 4096 distinct text blocks (~4x) and 6144 random: 10240 / (1024 + 6144).
    assert!(x > 1.3 && x < 1.66, "text and random: {x}");
}

#[test]
fn plans_cover_or_spread_and_rates_bound_memory() {
    let whole = plan(5 << 20, 5 << 20);
    assert_eq!(whole.len(), 5);
    assert_eq!(whole.iter().map(|r| r.1).sum::<u64>(), 5 << 20);
    let tail = plan((2 << 20) + 100, u64::MAX);
    assert_eq!(tail.last(), Some(&(2 << 20, 100)));
    let spread = plan(1 << 40, 1 << 30);
    assert_eq!(spread.len(), 1024);
    assert_eq!(spread[1].0, 1 << 30, "uniform");
    assert!(spread.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0));
    assert!(plan(3 << 20, 2 << 20).len() == 2);
    assert_eq!(rates(64 << 20, 4), (1, 4));
    let (fp, c) = rates(1 << 40, 16);
    assert_eq!(fp, 64, "at most 4 Mi fingerprints");
    assert!(c >= fp && c.is_power_of_two());
}

#[test]
fn a_source_that_is_missing_a_directory_or_empty_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let err = |s: &str| Source::open(s).err().unwrap().to_string();
    let missing = dir.path().join("nope");
    let m = err(missing.to_str().unwrap());
    assert!(m.contains("nope") && m.contains("No such file"), "{m}");
    let d = err(dir.path().to_str().unwrap());
    assert!(d.contains("is a directory"), "{d}");
    let empty = dir.path().join("empty");
    std::fs::write(&empty, b"").unwrap();
    assert!(err(empty.to_str().unwrap()).contains("is empty"));
    let u = err("nbd+unix:///x?socket=/nonexistent.sock");
    assert!(u.contains("nbd+unix"), "{u}");
    // Read-only: a 0444 file opens and reads.
    let ro = dir.path().join("ro");
    std::fs::write(&ro, vec![7u8; 8192]).unwrap();
    std::fs::set_permissions(&ro, std::os::unix::fs::PermissionsExt::from_mode(0o444)).unwrap();
    let src = Source::open(ro.to_str().unwrap()).unwrap();
    let mut b = [0u8; 4096];
    src.read_at(4096, &mut b).unwrap();
    assert_eq!((src.len(), b[0]), (8192, 7));
}

#[test]
fn a_copy_ends_a_unit_and_a_shared_unit_keeps_lz4_under_auto() {
    // Window 1: four new text blocks (one unit). Window 2: a copy of the
    // first block, then three new ones: a unit of 3.
    let t = text(8 * BS, 21);
    let mut data = t[..4 * BS].to_vec();
    data.extend_from_slice(&t[..BS]);
    data.extend_from_slice(&t[4 * BS..7 * BS]);
    let count = |keep: bool| {
        let mut tally = Tally::new(Config {
            shared_keep_lz4: keep,
            ..exact(Codec::Zstd(9))
        });
        tally.feed(0, &data);
        tally.counts()
    };
    let (first, second) = (&data[..4 * BS], &data[5 * BS..]);
    let z = |run: &[u8]| tally::stored_len(Codec::Zstd(9), run, true).0 as f64;
    let l = |run: &[u8]| tally::stored_len(Codec::Lz4, run, true).0 as f64;
    let settled = count(false);
    assert_eq!(settled.compressed_blocks, 7);
    assert!((settled.main.payload - (z(first) + z(second))).abs() < 1e-6);
    assert!((settled.lz4.payload - (l(first) + l(second))).abs() < 1e-6);
    assert!((settled.main.records - 2.0).abs() < 1e-9, "two units");
    let auto = count(true);
    assert!((auto.main.payload - (l(first) + z(second))).abs() < 1e-6);
    assert!(z(first) < l(first), "the cases differ");
}
