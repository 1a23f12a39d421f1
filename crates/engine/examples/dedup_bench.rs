//! Dedup benchmark (not a test; numbers go to docs/BENCHMARKING.md):
//! 1. fingerprint cost per 4 KiB block: keyed BLAKE3 against xxh3-128, and
//!    what xxh3 adds on a match (a verification read: lz4 decompress +
//!    compare, from memory, so a lower bound);
//! 2. random 4 KiB writes of unique, half-compressible data, dedup on
//!    against off, alternated, same volume size, on a real file;
//! 3. a clone workload: N copies of one real image (DIR tree as a tar-like
//!    concatenation), dedup on against off: stored bytes and time.
//!
//! `cargo run --release -p cvol-engine --example dedup_bench [DIR] [IMAGE_SOURCE_DIR]`
use cvol_engine::{Codec, CreateOptions, OpenOptions, Volume};
use cvol_storage::FileStorage;
use rand::{rngs::StdRng, Rng, RngCore, SeedableRng};
use std::sync::Arc;
use std::time::Instant;

const BS: usize = 4096;

fn half_compressible(rng: &mut StdRng) -> Vec<u8> {
    let mut b = vec![0u8; BS];
    rng.fill_bytes(&mut b[..BS / 2]);
    for (i, x) in b[BS / 2..].iter_mut().enumerate() {
        *x = b"some text that repeats "[i % 23];
    }
    // Unique: a counter-like prefix.
    b
}

fn hashes() {
    let mut rng = StdRng::seed_from_u64(1);
    let blocks: Vec<Vec<u8>> = (0..16384).map(|_| half_compressible(&mut rng)).collect();
    let blocks: Vec<Vec<u8>> = blocks
        .into_iter()
        .enumerate()
        .map(|(i, mut b)| {
            b[..8].copy_from_slice(&(i as u64).to_le_bytes());
            b
        })
        .collect();
    let seed = cvol_engine::dedup::FpKey::Seed(cvol_engine::dedup::volume_seed(&[7; 16]));
    let key = blake3::derive_key("cvol bench", &[7; 16]);
    let keyed = cvol_engine::dedup::FpKey::Keyed(Box::new(key));
    let mut best = [f64::MAX; 4];
    for _ in 0..5 {
        let t = Instant::now();
        let mut acc = 0u128;
        for b in &blocks {
            let h = blake3::keyed_hash(&key, b);
            acc ^= u128::from_le_bytes(h.as_bytes()[..16].try_into().unwrap());
        }
        std::hint::black_box(acc);
        best[0] = best[0].min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let mut acc = 0u128;
        for b in &blocks {
            acc ^= cvol_engine::dedup::fingerprint(&seed, b);
        }
        std::hint::black_box(acc);
        best[1] = best[1].min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let mut acc = 0u128;
        for b in &blocks {
            acc ^= cvol_engine::dedup::fingerprint(&keyed, b);
        }
        std::hint::black_box(acc);
        best[3] = best[3].min(t.elapsed().as_secs_f64());
        // What a verification read costs at least: decompress the stored
        // copy and compare (no I/O counted).
        let compressed: Vec<Vec<u8>> = blocks[..4096]
            .iter()
            .map(|b| lz4_flex::block::compress(b))
            .collect();
        let t = Instant::now();
        let mut out = vec![0u8; BS];
        let mut same = 0;
        for (c, b) in compressed.iter().zip(&blocks) {
            lz4_flex::block::decompress_into(c, &mut out).unwrap();
            same += usize::from(out == *b);
        }
        std::hint::black_box(same);
        best[2] = best[2].min(t.elapsed().as_secs_f64() * 4.0);
    }
    let per = |s: f64| s / blocks.len() as f64 * 1e9;
    println!("## fingerprints (best of 5, 16384 blocks of 4 KiB)\n");
    println!("| method | ns per block | MB/s |");
    println!("|---|---|---|");
    for (name, s) in [
        ("BLAKE3 keyed of the whole block, 128 bits", best[0]),
        ("xxh3-128 seeded (volumes in the clear)", best[1]),
        (
            "xxh3-128, then BLAKE3 keyed of it (encrypted volumes)",
            best[3],
        ),
        (
            "verify on match (lz4 decompress + compare, no I/O)",
            best[2],
        ),
    ] {
        println!(
            "| {name} | {:.0} | {:.0} |",
            per(s),
            (blocks.len() * BS) as f64 / s / 1e6
        );
    }
    println!();
}

fn volume(dir: &std::path::Path, name: &str, size: u64, dedup: bool) -> Volume {
    let path = dir.join(name);
    let _ = std::fs::remove_file(&path);
    let st = FileStorage::create(&path, size).unwrap();
    let opts = CreateOptions {
        logical_size_bytes: size,
        physical_size_bytes: size,
        codec: Codec::Lz4.into(),
        segment_size_bytes: 0,
        dedup,
        packing: Default::default(),
        pool: false,
        encryption: None,
    };
    drop(Volume::create(Arc::new(st), &opts).unwrap());
    let st = FileStorage::open(&path, true, true).unwrap();
    Volume::open(Arc::new(st), OpenOptions::default()).unwrap()
}

/// Random unique 4 KiB writes from two threads; returns MB/s. The data is
/// generated before the clock starts (a 64 MiB pool per thread, each block
/// stamped with a unique counter as it is written), and an untimed first
/// pass of the same size warms the map and the index (page faults).
fn random_writes(dir: &std::path::Path, dedup: bool, seed: u64) -> f64 {
    let size = 2u64 << 30;
    let vol = Arc::new(volume(dir, "dedup-bench-rand.cvol", size, dedup));
    let per_thread = 32768usize; // 2 x 128 MiB
    let pools: Vec<Vec<Vec<u8>>> = (0..2)
        .map(|k| {
            let mut rng = StdRng::seed_from_u64(seed * 10 + k);
            (0..per_thread / 2)
                .map(|_| half_compressible(&mut rng))
                .collect()
        })
        .collect();
    let pools = Arc::new(pools);
    let pass = |p: u64| {
        let threads: Vec<_> = (0..2)
            .map(|k| {
                let (vol, pools) = (vol.clone(), pools.clone());
                std::thread::spawn(move || {
                    let pool = &pools[k];
                    let mut rng = StdRng::seed_from_u64(seed * 100 + p * 10 + k as u64);
                    let blocks = size / BS as u64;
                    let mut b = vec![0u8; BS];
                    for i in 0..per_thread {
                        b.copy_from_slice(&pool[i % pool.len()]);
                        let stamp = i as u64 ^ ((k as u64) << 40) ^ (p << 50);
                        b[..8].copy_from_slice(&stamp.to_le_bytes());
                        let lba = rng.gen_range(0..blocks);
                        vol.write_at(lba * BS as u64, &b, false).unwrap();
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        vol.flush().unwrap();
    };
    pass(0);
    let t = Instant::now();
    pass(1);
    let secs = t.elapsed().as_secs_f64();
    (2 * per_thread * BS) as f64 / secs / 1e6
}

fn image_from(src: &std::path::Path, want: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        let mut entries: Vec<_> = rd.flatten().map(|e| e.path()).collect();
        entries.sort();
        for p in entries {
            if out.len() >= want {
                break;
            }
            if p.is_dir() {
                stack.push(p);
            } else if let Ok(b) = std::fs::read(&p) {
                out.extend_from_slice(&b);
                // File-system-like alignment: each file starts on a block.
                out.resize(out.len().div_ceil(BS) * BS, 0);
            }
        }
    }
    out.truncate(want.min(out.len()) / BS * BS);
    out
}

fn clones(dir: &std::path::Path, image: &[u8], copies: u64, dedup: bool) -> (f64, u64, u64) {
    let size = (image.len() as u64 * (copies + 1)).next_power_of_two();
    let vol = volume(dir, "dedup-bench-clones.cvol", size, dedup);
    let t = Instant::now();
    for c in 0..copies {
        // Different offsets: a whole number of blocks apart, not aligned to the image.
        let off = c * (image.len() as u64 + 7 * BS as u64);
        for chunk in image.chunks(1 << 20).enumerate() {
            vol.write_at(off + (chunk.0 << 20) as u64, chunk.1, false)
                .unwrap();
        }
    }
    vol.flush().unwrap();
    let secs = t.elapsed().as_secs_f64();
    let s = vol.stats();
    (
        (image.len() as u64 * copies) as f64 / secs / 1e6,
        s.stored_bytes,
        s.physical_used_bytes,
    )
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(args.get(1).map_or("/tmp", |s| s.as_str()));
    let src = std::path::PathBuf::from(args.get(2).map_or("/usr/share/doc", |s| s.as_str()));
    if let Ok(mode) = std::env::var("DEDUP_BENCH_ONLY") {
        // For profiling one side: DEDUP_BENCH_ONLY=on|off.
        let mbps = random_writes(&dir, mode == "on", 1);
        println!("random writes, dedup {mode}: {mbps:.0} MB/s");
        return;
    }
    hashes();

    println!("## random 4 KiB writes of unique half-compressible data (2 threads, 256 MiB timed after 256 MiB warm-up, 2 GiB volume, lz4)\n");
    println!("| run | dedup off MB/s | dedup on MB/s | on / off |");
    println!("|---|---|---|---|");
    let (mut off_sum, mut on_sum) = (0.0, 0.0);
    for rep in 0..3 {
        let off = random_writes(&dir, false, rep);
        let on = random_writes(&dir, true, rep);
        off_sum += off;
        on_sum += on;
        println!("| {} | {off:.0} | {on:.0} | {:.2} |", rep + 1, on / off);
    }
    println!(
        "| mean | {:.0} | {:.0} | {:.2} |\n",
        off_sum / 3.0,
        on_sum / 3.0,
        on_sum / off_sum
    );

    let image = image_from(&src, 32 << 20);
    let copies = 20;
    println!(
        "## {copies} clones of a {:.1} MiB image of {} at different offsets\n",
        image.len() as f64 / 1048576.0,
        src.display()
    );
    println!("| dedup | MB/s | stored_bytes | physical_used_bytes | stored per copy |");
    println!("|---|---|---|---|---|");
    for dedup in [false, true] {
        let (mbps, stored, used) = clones(&dir, &image, copies, dedup);
        println!(
            "| {} | {mbps:.0} | {stored} | {used} | {:.3} |",
            if dedup { "on" } else { "off" },
            stored as f64 / copies as f64 / image.len() as f64
        );
    }
    let _ = std::fs::remove_file(dir.join("dedup-bench-rand.cvol"));
    let _ = std::fs::remove_file(dir.join("dedup-bench-clones.cvol"));
}
