//! Micro-benchmarks of the hot paths (issue #6): the codec path, the
//! fingerprint, the block map, record packing into the open segment, and a
//! whole 4 KiB write and read through the engine on in-memory storage.
//!
//! `cargo bench -p cvol-engine --bench hot_paths [FILTER]`. Timings on a
//! shared machine are noisy; for comparisons between two versions of the
//! code use instruction counts:
//! `valgrind --tool=callgrind target/release/deps/hot_paths-* --bench --profile-time 1 FILTER`.
use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use cvol_engine::codec::{self, Codec};
use cvol_engine::log::{Log, Shape};
use cvol_engine::map::BlockMap;
use cvol_engine::segments::SegmentTable;
use cvol_engine::{CreateOptions, OpenOptions, Volume};
use cvol_format::{CodecTag, MapEntry};
use cvol_storage::{SimStorage, Storage};
use rand::{rngs::StdRng, Rng, RngCore, SeedableRng};
use std::sync::Arc;

const BS: usize = 4096;

/// About 2:1 for lz4, like fio's 50%-compressible buffers: half random,
/// half a repeating phrase.
fn half_compressible(rng: &mut StdRng) -> Vec<u8> {
    let mut b = vec![0u8; BS];
    rng.fill_bytes(&mut b[..BS / 2]);
    for (i, x) in b[BS / 2..].iter_mut().enumerate() {
        *x = b"some text that repeats "[i % 23];
    }
    b
}

/// Real text: this crate's own source, 4 KiB from the middle of a file.
fn text_block() -> Vec<u8> {
    let src = include_bytes!("../src/volume/read.rs");
    src[8192..8192 + BS].to_vec()
}

fn codecs(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(1);
    let inputs = [
        ("half", half_compressible(&mut rng)),
        ("text", text_block()),
    ];
    let mut g = c.benchmark_group("codec");
    g.throughput(Throughput::Bytes(BS as u64));
    for (name, block) in &inputs {
        for codec in [Codec::Lz4, Codec::Zstd(1), Codec::Zstd(3)] {
            let label = format!("{codec:?}").to_lowercase().replace(['(', ')'], "");
            g.bench_function(format!("compress/{label}/{name}"), |b| {
                b.iter(|| codec.compress(black_box(block)))
            });
            let packed = codec.compress(block).expect("compressible");
            let mut out = vec![0u8; BS];
            g.bench_function(format!("decompress/{label}/{name}"), |b| {
                b.iter(|| codec::decompress(codec.tag(), black_box(&packed), &mut out).unwrap())
            });
        }
    }
    let random: Vec<u8> = (0..BS).map(|_| rng.gen()).collect();
    g.bench_function("compress/lz4/random (refused, stored raw)", |b| {
        b.iter(|| Codec::Lz4.compress(black_box(&random)))
    });
    g.bench_function("crc32c", |b| {
        b.iter(|| crc32c::crc32c(black_box(&inputs[0].1)))
    });
    use cvol_engine::dedup::{fingerprint, volume_seed, FpKey};
    let seed = FpKey::Seed(volume_seed(&[7; 16]));
    g.bench_function("fingerprint xxh3-128", |b| {
        b.iter(|| fingerprint(&seed, black_box(&inputs[0].1)))
    });
    let keyed = FpKey::Keyed(Box::new([7; 32]));
    g.bench_function("fingerprint keyed (encrypted volumes)", |b| {
        b.iter(|| fingerprint(&keyed, black_box(&inputs[0].1)))
    });
    g.finish();
}

fn map(c: &mut Criterion) {
    let blocks = 1u64 << 20; // a 4 GiB volume
    let mut m = BlockMap::new(blocks);
    let mut rng = StdRng::seed_from_u64(2);
    let entry = |lba: u64| MapEntry::data(CodecTag::Lz4, (1 << 30) + lba * 2000, 2000, lba as u32);
    for lba in 0..blocks {
        m.set(lba, entry(lba));
    }
    let lbas: Vec<u64> = (0..4096).map(|_| rng.gen_range(0..blocks)).collect();
    let mut g = c.benchmark_group("map");
    g.throughput(Throughput::Elements(lbas.len() as u64));
    g.bench_function("get random (4096 lookups)", |b| {
        b.iter(|| lbas.iter().map(|&l| m.get(black_box(l)).crc).sum::<u32>())
    });
    g.bench_function("set random (4096 updates)", |b| {
        b.iter(|| {
            for &l in &lbas {
                black_box(m.set(l, entry(l ^ 1)));
            }
        })
    });
    g.finish();
}

fn packing(c: &mut Criterion) {
    let sim = SimStorage::new(64 << 20);
    let vol = Volume::create(
        Arc::new(sim.clone()),
        &CreateOptions {
            logical_size_bytes: 64 << 20,
            physical_size_bytes: sim.len_bytes(),
            codec: Codec::Lz4.into(),
            segment_size_bytes: 1 << 20,
            dedup: false,
            packing: Default::default(),
            pool: false,
            encryption: None,
        },
    )
    .unwrap();
    let sb = vol.superblock().clone();
    drop(vol);
    let payload = vec![0x5au8; 2048];
    let crc = crc32c::crc32c(&payload);
    let per_batch = 400; // 400 x 2092 bytes fit one 1 MiB segment
    let mut g = c.benchmark_group("packing");
    g.throughput(Throughput::Elements(per_batch));
    g.bench_function("append 2 KiB records to the open segment", |b| {
        b.iter_batched(
            || {
                let mut segs = SegmentTable::new(sb.segment_count(), sb.segment_size_bytes);
                let first = segs.open_next().unwrap();
                Log::new(&sb, segs, first, 0, 1, 1)
            },
            |mut log| {
                for lba in 0..per_batch {
                    black_box(
                        log.append(
                            &sim,
                            Shape::data(CodecTag::Lz4, 0, lba, 1, 0),
                            &payload,
                            crc,
                        )
                        .unwrap(),
                    );
                }
                log
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

fn volume_io(c: &mut Criterion) {
    let mut g = c.benchmark_group("volume");
    g.throughput(Throughput::Bytes(BS as u64));
    for dedup in [false, true] {
        let sim = SimStorage::new(1 << 30);
        drop(
            Volume::create(
                Arc::new(sim.clone()),
                &CreateOptions {
                    logical_size_bytes: 256 << 20,
                    physical_size_bytes: sim.len_bytes(),
                    codec: Codec::Lz4.into(),
                    segment_size_bytes: 0,
                    dedup,
                    packing: Default::default(),
                    pool: false,
                    encryption: None,
                },
            )
            .unwrap(),
        );
        let vol = Volume::open(Arc::new(sim.clone()), OpenOptions::default()).unwrap();
        let mut rng = StdRng::seed_from_u64(3);
        let blocks = (256 << 20) / BS as u64;
        let data: Vec<Vec<u8>> = (0..64).map(|_| half_compressible(&mut rng)).collect();
        let mut i = 0u64;
        let name = if dedup { "dedup on" } else { "dedup off" };
        g.bench_function(format!("write 4 KiB random ({name})"), |b| {
            b.iter(|| {
                i += 1;
                let mut block = data[(i % 64) as usize].clone();
                block[..8].copy_from_slice(&i.to_le_bytes()); // unique
                let lba = rng.gen_range(0..blocks);
                vol.write_at(lba * BS as u64, &block, false).unwrap();
            })
        });
        if !dedup {
            let mut buf = vec![0u8; BS];
            g.bench_function("read 4 KiB random (lz4, read cache off path)", |b| {
                b.iter(|| {
                    let lba = rng.gen_range(0..blocks);
                    vol.read_at(lba * BS as u64, &mut buf).unwrap();
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, codecs, map, packing, volume_io);
criterion_main!(benches);
