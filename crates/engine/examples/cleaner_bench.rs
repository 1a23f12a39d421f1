//! Cleaner benchmark: write amplification and client throughput of random
//! 4 KiB overwrites at 50%, 70% and 85% physical utilisation, greedy against
//! cost-benefit, on uniform and hot/cold (90% of writes to 10% of blocks)
//! workloads. Not a test: numbers go to docs/BENCHMARKING.md.
//!
//! `cargo run --release -p cvol-engine --example cleaner_bench [DIR] [PHYSICAL_MIB] [PASSES]`
//!
//! Data is incompressible (codec none) so that live bytes equal client
//! bytes and write amplification is the cleaner's alone:
//! WA = bytes the log wrote to the store / bytes clients wrote.
use cvol_engine::segments::VictimPolicy;
use cvol_engine::{CleanerConfig, Codec, CreateOptions, OpenOptions, Volume};
use cvol_storage::FileStorage;
use rand::{rngs::StdRng, Rng, RngCore, SeedableRng};
use std::sync::Arc;
use std::time::Instant;

const BS: u64 = 4096;
const RECORD_BYTES: u64 = BS + 44;

struct Row {
    util: u64,
    workload: &'static str,
    policy: VictimPolicy,
    wa: f64,
    mbps: f64,
    relocated_mib: f64,
}

fn run(
    dir: &std::path::Path,
    physical: u64,
    util: u64,
    hot: bool,
    policy: VictimPolicy,
    passes: u64,
) -> Row {
    let path = dir.join("cleaner-bench.cvol");
    let _ = std::fs::remove_file(&path);
    let segments = (physical - (1 << 20)) >> 20;
    let blocks = segments * (1 << 20) * util / 100 / RECORD_BYTES;
    let opts = CreateOptions {
        logical_size_bytes: blocks * BS,
        physical_size_bytes: physical,
        codec: Codec::None.into(),
        segment_size_bytes: 1 << 20,
        dedup: false,
        packing: Default::default(),
        pool: false,
        encryption: None,
    };
    let st = Arc::new(FileStorage::create(&path, physical).expect("create backing file"));
    drop(Volume::create(st, &opts).expect("create volume"));
    let st = Arc::new(FileStorage::open(&path, true, true).expect("open"));
    let cleaner = CleanerConfig {
        policy,
        ..CleanerConfig::default()
    };
    let vol = Volume::open(
        st,
        OpenOptions {
            cleaner,
            ..OpenOptions::default()
        },
    )
    .expect("open volume");
    let mut rng = StdRng::seed_from_u64(util * 7 + u64::from(hot));
    let mut buf = vec![0u8; BS as usize];
    for lba in 0..blocks {
        rng.fill_bytes(&mut buf);
        vol.write_at(lba * BS, &buf, false).expect("fill");
    }
    vol.flush().expect("flush");
    let s0 = vol.stats();
    let writes = passes * physical / BS;
    let hot_blocks = (blocks / 10).max(1);
    let t = Instant::now();
    for i in 0..writes {
        let lba = if hot && rng.gen_ratio(9, 10) {
            rng.gen_range(0..hot_blocks)
        } else {
            rng.gen_range(0..blocks)
        };
        rng.fill_bytes(&mut buf);
        vol.write_at(lba * BS, &buf, false)
            .unwrap_or_else(|e| panic!("overwrite {i} of {writes}: {e}"));
        if i % 4096 == 0 {
            vol.flush().expect("flush");
        }
    }
    vol.flush().expect("flush");
    let secs = t.elapsed().as_secs_f64();
    let s1 = vol.stats();
    let client = s1.client_bytes_written - s0.client_bytes_written;
    let media = s1.media_bytes_written - s0.media_bytes_written;
    drop(vol);
    let _ = std::fs::remove_file(&path);
    Row {
        util,
        workload: if hot { "hot/cold 90/10" } else { "uniform" },
        policy,
        wa: media as f64 / client as f64,
        mbps: client as f64 / secs / 1e6,
        relocated_mib: (s1.cleaner.cleaner_bytes_relocated - s0.cleaner.cleaner_bytes_relocated)
            as f64
            / (1 << 20) as f64,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(
        args.get(1)
            .cloned()
            .unwrap_or_else(|| std::env::temp_dir().display().to_string()),
    );
    let physical = args
        .get(2)
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(128)
        << 20;
    let passes = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(3);
    println!("physical {} MiB, random 4 KiB overwrites of {passes}x the physical size, incompressible data\n", physical >> 20);
    println!(
        "| utilisation | workload | policy | write amplification | client MB/s | relocated MiB |"
    );
    println!("|---|---|---|---|---|---|");
    for util in [50, 70, 85] {
        for hot in [false, true] {
            for policy in [VictimPolicy::Greedy, VictimPolicy::CostBenefit] {
                let r = run(&dir, physical, util, hot, policy, passes);
                println!(
                    "| {}% | {} | {:?} | {:.2} | {:.0} | {:.0} |",
                    r.util, r.workload, r.policy, r.wa, r.mbps, r.relocated_mib
                );
            }
        }
    }
}
