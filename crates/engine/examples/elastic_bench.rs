//! Elastic compression benchmark (not a test; numbers go to
//! docs/BENCHMARKING.md). On a real-data image (text, then machine code):
//! 1. per codec, the cost of compressing a 4 KiB block and a 32 KiB unit
//!    (what the load thresholds of `auto` are chosen from);
//! 2. per unit size (4K to 64K) and codec: sequential write throughput,
//!    stored bytes, random 4 KiB read cost and read amplification (bytes
//!    decompressed per byte read, read cache off), sequential read
//!    throughput — what the default unit size is chosen from.
//!
//! `cargo run --release -p cvol-engine --example elastic_bench [DIR] [MIB]`
//! (DIR holds the volume file, default /tmp; MIB the image size, default 64.)
use cvol_engine::{Codec, CreateOptions, ElasticConfig, OpenOptions, Volume};
use cvol_storage::FileStorage;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

const BS: usize = 4096;
const MIB: usize = 1 << 20;

/// Text files from /usr/share/doc and /usr/include, then binaries from
/// /usr/bin and /usr/lib, each half of the image.
fn real_image(bytes: usize) -> Vec<u8> {
    fn fill(dirs: &[&str], want: usize, img: &mut Vec<u8>) {
        let mut stack: Vec<std::path::PathBuf> = dirs.iter().map(|d| d.into()).collect();
        let start = img.len();
        while let Some(p) = stack.pop() {
            if img.len() - start >= want {
                break;
            }
            let Ok(md) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            if md.is_dir() {
                if let Ok(rd) = std::fs::read_dir(&p) {
                    let mut v: Vec<_> = rd.flatten().map(|e| e.path()).collect();
                    v.sort();
                    stack.extend(v.into_iter().rev());
                }
            } else if md.is_file() && md.len() < 64 << 20 {
                if let Ok(b) = std::fs::read(&p) {
                    img.extend_from_slice(&b);
                }
            }
        }
        img.truncate(start + want);
    }
    let mut img = Vec::with_capacity(bytes);
    fill(&["/usr/share/doc", "/usr/include"], bytes / 2, &mut img);
    fill(&["/usr/bin", "/usr/lib"], bytes - img.len(), &mut img);
    img.resize(bytes, 0);
    img
}

fn codec_costs(img: &[u8]) {
    println!("## codec cost per block and per 32 KiB unit (real data, one core)\n");
    println!("| codec | µs per 4 KiB block | ratio | µs per 32 KiB unit | ratio | µs decompress 32 KiB |");
    println!("|---|---|---|---|---|---|");
    let sample = &img[..img.len().min(16 * MIB)];
    for codec in [
        Codec::Lz4,
        Codec::Zstd(1),
        Codec::Zstd(3),
        Codec::Zstd(9),
        Codec::Zstd(19),
    ] {
        let mut row = format!("| {codec} ");
        let mut unit_payloads = Vec::new();
        for unit in [BS, 8 * BS] {
            let t = Instant::now();
            let (mut stored, mut n) = (0usize, 0usize);
            for chunk in sample.chunks_exact(unit) {
                let c = codec.compress(chunk);
                stored += c.as_ref().map_or(unit, Vec::len);
                if unit > BS {
                    unit_payloads.push(c);
                }
                n += 1;
            }
            let us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
            row += &format!("| {us:.1} | {:.2} ", (n * unit) as f64 / stored as f64);
        }
        let t = Instant::now();
        let mut out = vec![0u8; 8 * BS];
        let mut n = 0;
        for p in unit_payloads.iter().flatten() {
            cvol_engine::codec::decompress(codec.tag(), p, &mut out).unwrap();
            n += 1;
        }
        row += &format!(
            "| {:.1} |",
            t.elapsed().as_secs_f64() * 1e6 / n.max(1) as f64
        );
        println!("{row}");
    }
    println!();
}

fn unit_sizes(dir: &Path, img: &[u8]) {
    println!("## unit size: write, space, reads (real data, read cache off)\n");
    println!(
        "| codec | unit | seq write MB/s | stored MiB | ratio | rand 4K read µs | read amplification | seq read MB/s |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let path = dir.join("cvol-elastic-bench.vol");
    let logical = (img.len() as u64).next_power_of_two() * 2;
    for codec in [Codec::Lz4, Codec::Zstd(3)] {
        for unit_blocks in [1u32, 2, 4, 8, 16] {
            let _ = std::fs::remove_file(&path);
            let storage = FileStorage::create(&path, logical).unwrap();
            let opts = CreateOptions {
                logical_size_bytes: logical,
                physical_size_bytes: logical,
                codec: codec.into(),
                segment_size_bytes: 0,
                dedup: false,
                packing: Default::default(),
                pool: false,
                encryption: None,
            };
            Volume::create(Arc::new(storage), &opts)
                .unwrap()
                .close()
                .unwrap();
            let options = OpenOptions {
                read_cache_bytes: Some(0),
                elastic: ElasticConfig {
                    unit_blocks,
                    ..ElasticConfig::default()
                },
                ..OpenOptions::default()
            };
            let open = || {
                let st = FileStorage::open(&path, true, true).unwrap();
                Volume::open(Arc::new(st), options.clone()).unwrap()
            };
            let vol = open();
            let t = Instant::now();
            for (i, c) in img.chunks(MIB).enumerate() {
                vol.write_at((i * MIB) as u64, c, false).unwrap();
            }
            vol.flush().unwrap();
            let write_mbs = img.len() as f64 / 1e6 / t.elapsed().as_secs_f64();
            let stored = vol.stats().stored_bytes;
            vol.close().unwrap();
            drop(vol);
            let vol = open();
            let mut rng = StdRng::seed_from_u64(1);
            let blocks = img.len() / BS;
            let mut b = vec![0u8; BS];
            let reads = 20_000;
            let t = Instant::now();
            for _ in 0..reads {
                let l = rng.gen_range(0..blocks);
                vol.read_at((l * BS) as u64, &mut b).unwrap();
            }
            let read_us = t.elapsed().as_secs_f64() * 1e6 / reads as f64;
            let amp = vol.stats().elastic.read_amplification;
            let mut big = vec![0u8; MIB];
            let t = Instant::now();
            for i in 0..img.len() / MIB {
                vol.read_at((i * MIB) as u64, &mut big).unwrap();
            }
            let read_mbs = img.len() as f64 / 1e6 / t.elapsed().as_secs_f64();
            println!(
                "| {codec} | {}K | {write_mbs:.0} | {:.1} | {:.2} | {read_us:.1} | {amp:.2} | {read_mbs:.0} |",
                unit_blocks * 4,
                stored as f64 / MIB as f64,
                img.len() as f64 / stored as f64,
            );
            vol.close().unwrap();
        }
    }
    let _ = std::fs::remove_file(&path);
    println!();
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = args.next().unwrap_or_else(|| "/tmp".into());
    let mib: usize = args.next().map_or(64, |s| s.parse().expect("MIB"));
    let img = real_image(mib * MIB);
    println!("# elastic_bench: {mib} MiB real-data image\n");
    codec_costs(&img);
    unit_sizes(Path::new(&dir), &img);
}
