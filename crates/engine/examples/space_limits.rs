//! What any compression unit could store for an image (not a test; numbers
//! go to docs/BENCHMARKING.md "Settled space against squashfs").
//!
//! Lays an image out as cold data ends up in a volume after idle: zero
//! blocks cost nothing, a block equal to an earlier one is a dedup
//! reference, and the remaining (distinct) blocks of each aligned window of
//! the unit size form one unit, compressed with zstd at a level, or stored
//! raw block by block when that saves under an eighth (the volume's rule,
//! `Codec::compress`). Prints, per unit size and level, the bytes the units
//! take (payload plus a record header each) and what a random 4 KiB read of
//! cold data costs to decompress; then the same with a zstd dictionary
//! trained on a quarter of the image's units (a layout the format does not
//! have: what it would gain). The volume's own cold unit is 64 KiB at
//! zstd:9 (`--codec auto`): compare its `stored_bytes` after idle with that
//! row, and the rows below with what the volume would need to change.
//!
//! `cargo run --release -p cvol-engine --example space_limits IMAGE`
use cvol_engine::codec::decompress;
use cvol_engine::Codec;
use cvol_format::record::RECORD_HEADER_BYTES;
use cvol_format::CodecTag;
use std::collections::HashSet;
use std::time::Instant;

const BS: usize = 4096;

/// The distinct non-zero blocks of each aligned window of `window` bytes,
/// first occurrences in image order (dedup across the whole image).
fn units(img: &[u8], window: usize) -> Vec<Vec<u8>> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for w in img.chunks(window) {
        let mut unit = Vec::new();
        for b in w.chunks(BS) {
            if b.iter().all(|&x| x == 0) || !seen.insert(xxhash_rust::xxh3::xxh3_128(b)) {
                continue;
            }
            unit.extend_from_slice(b);
        }
        if !unit.is_empty() {
            out.push(unit);
        }
    }
    out
}

/// Stored bytes of the units, each compressed by `compress` or raw block by
/// block when that saves under an eighth (a header per record either way).
fn stored(units: &[Vec<u8>], compress: impl Fn(&[u8]) -> Vec<u8> + Sync) -> (u64, u64) {
    let (compressed, raw) = std::thread::scope(|s| {
        let per = units.len().div_ceil(2).max(1);
        let parts: Vec<_> = units
            .chunks(per)
            .map(|part| {
                let compress = &compress;
                s.spawn(move || {
                    let (mut c, mut r) = (0u64, 0u64);
                    for u in part {
                        let z = compress(u);
                        if z.len() <= u.len() - u.len() / 8 {
                            c += (z.len() + RECORD_HEADER_BYTES) as u64;
                        } else {
                            r += (u.len() + u.len() / BS * RECORD_HEADER_BYTES) as u64;
                        }
                    }
                    (c, r)
                })
            })
            .collect();
        parts
            .into_iter()
            .map(|h| h.join().expect("compressing thread"))
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    });
    (compressed, raw)
}

/// Microseconds to decompress the unit a random 4 KiB read of cold data
/// lands in: the mean over a sample of the compressible units, each
/// weighted by its blocks (a read lands in a unit in proportion to them).
fn read_cost_us(units: &[Vec<u8>], level: i32) -> f64 {
    let sample: Vec<(Vec<u8>, usize)> = units
        .iter()
        .step_by((units.len() / 200).max(1))
        .filter_map(|u| Codec::Zstd(level).compress(u).map(|z| (z, u.len())))
        .collect();
    let mut out = vec![0u8; sample.iter().map(|s| s.1).max().unwrap_or(0)];
    let (mut weighted_us, mut blocks) = (0.0, 0.0);
    for (z, len) in &sample {
        let t = Instant::now();
        for _ in 0..5 {
            decompress(CodecTag::Zstd, z, &mut out[..*len]).expect("own output");
        }
        let w = (*len / BS) as f64;
        weighted_us += t.elapsed().as_secs_f64() * 1e6 / 5.0 * w;
        blocks += w;
    }
    weighted_us / blocks.max(1.0)
}

fn mb(b: u64) -> String {
    format!("{:.2} MB", b as f64 / 1e6)
}

fn main() {
    let path = std::env::args()
        .nth(1)
        .expect("usage: space_limits IMAGE (e.g. an ext4 image of a source tree)");
    let img = std::fs::read(&path).expect("reading the image");
    let nonzero = img.chunks(BS).filter(|b| b.iter().any(|&x| x != 0)).count();
    println!(
        "# {path}: {} MiB, {nonzero} non-zero blocks\n",
        img.len() >> 20
    );
    println!("| unit | level | units | compressed units | raw blocks | total | µs to read 4 KiB of cold data |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    for window in [16 << 10, 64 << 10, 128 << 10, 256 << 10] {
        let us = units(&img, window);
        for level in [9, 15, 19] {
            let (c, r) = stored(&us, |u| {
                Codec::Zstd(level).compress(u).unwrap_or_else(|| u.to_vec())
            });
            println!(
                "| {} KiB | zstd:{level} | {} | {} | {} | **{}** | {:.0} |",
                window >> 10,
                us.len(),
                mb(c),
                mb(r),
                mb(c + r),
                read_cost_us(&us, level)
            );
        }
    }
    println!("\n| unit | dictionary | total (dictionary included) |");
    println!("|---|---|---:|");
    let us = units(&img, 64 << 10);
    for dict_bytes in [32usize << 10, 112 << 10] {
        let samples: Vec<&[u8]> = us.iter().step_by(4).flat_map(|u| u.chunks(BS)).collect();
        let dict = zstd::dict::from_samples(&samples, dict_bytes).expect("training a dictionary");
        let (c, r) = stored(&us, |u| {
            let mut z = zstd::bulk::Compressor::with_dictionary(9, &dict).expect("dictionary");
            z.compress(u).expect("compressing")
        });
        println!(
            "| 64 KiB zstd:9 | {} KiB | **{}** |",
            dict.len() >> 10,
            mb(c + r + dict.len() as u64)
        );
    }
}
