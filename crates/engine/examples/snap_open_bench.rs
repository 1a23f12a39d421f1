//! What snapshots cost a pool's open: a pool with one volume, `fill`
//! blocks of it mapped, then `snaps` snapshots, each after `per` random
//! 4 KiB writes (so each snapshot holds `per` copied map entries, nearly
//! each on its own map page); the open timed in-process before the
//! snapshots, after them and once they are deleted, and the pool file
//! left for `cvol stat --json` and `cvol serve`; its peer is a pool with
//! the same writes and no snapshots (with `SNAP_OPEN_PEER_FLUSHES=1` also
//! the flushes a snapshot makes). Open verifies every record of the log's
//! open segment, whose records differ from pool to pool with where each
//! log ends: a segment of many small records costs more than one of a few
//! large ones, whatever the snapshots.
//!
//! `cargo run --release -p cvol-engine --example snap_open_bench DIR [SNAPS] [PER] [FILL_GIB] [SIZE_GIB]`
//! (the fill writes the first 16 blocks of every map page of FILL_GIB;
//! the random writes fall on those)
//! (DIR/pool-snaps and DIR/pool-none are left behind; with
//! `SNAP_OPEN_REUSE=1` they are timed again, not rebuilt: how a build and
//! its peer time the same pools, one after the other; `SNAP_OPEN_SETTLE=1`
//! first opens each, writes one block and closes, so that the newest
//! checkpoint carries over every other page from the one before it,
//! instead of having written the last snapshots' pages itself;
//! `SNAP_OPEN_SETTLE=log` instead writes fresh incompressible blocks
//! outside the snapshots' extents until the log has opened two new
//! segments, then 256 more, and closes: both pools' open segments then
//! hold the same records, and what is left between them is what the
//! snapshots cost, not where each log happened to end)
//! In-process opens are bimodal with glibc's default malloc (its dynamic
//! mmap threshold and heap trimming make an open either reuse or fault in
//! its segment buffer: 0.6 or 2.1 ms for the same pool); fix the
//! allocator to compare builds:
//! `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=4294967296`.
use cvol_engine::pool::Pool;
use cvol_engine::{Codec, CodecPolicy, CreateOptions, OpenOptions, Volume};
use cvol_storage::FileStorage;
use rand::{Rng, SeedableRng};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

const BS: u64 = 4096;
/// Blocks of a map page.
const PAGE: u64 = 512;
/// Blocks the fill writes at the start of each map page.
const DENSE: u64 = 16;

/// A block that compresses about 90% (as fio's buffer_compress_percentage=90):
/// 400 pseudo-random bytes, then zeros.
fn block(lba: u64, round: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(lba << 16 | round);
    let mut b = vec![0u8; BS as usize];
    rng.fill(&mut b[..400]);
    b
}

/// The process's CPU time (user and system) in ms.
fn cpu_ms() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `ts`.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    ts.tv_sec as f64 * 1e3 + ts.tv_nsec as f64 / 1e6
}

/// Median open time (ms) of `reps` opens, read-only as `cvol stat` does
/// (with `SNAP_OPEN_CPU=1` the CPU time the process spent, which a busy
/// machine disturbs less than the wall-clock time).
fn time_open(path: &Path, reps: usize) -> f64 {
    let cpu = std::env::var_os("SNAP_OPEN_CPU").is_some();
    let mut ms: Vec<f64> = (0..reps)
        .map(|_| {
            let (t, c) = (Instant::now(), cpu_ms());
            let st = Arc::new(FileStorage::open(path, false, false).expect("open file"));
            let o = OpenOptions {
                read_only: true,
                ..OpenOptions::default()
            };
            let vol = Arc::new(Volume::open(st, o).expect("open"));
            let _pool = Pool::attach(vol.clone()).expect("attach");
            let _ = vol.stats();
            if reps == 1 {
                println!(
                    "{}: {} map pages verified at open, {} directory blocks left unread, {} packed",
                    path.display(),
                    vol.map_pages_verified_at_open(),
                    vol.map_dir_blocks_unread(),
                    vol.map_dir_blocks_packed(),
                );
            }
            if !vol.opened_from_tables() {
                println!(
                    "{}: tables rebuilt ({:?})",
                    path.display(),
                    vol.tables_rejected()
                );
            }
            if cpu {
                cpu_ms() - c
            } else {
                t.elapsed().as_secs_f64() * 1e3
            }
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    ms[reps / 2]
}

fn build(path: &Path, snaps: u64, per: u64, fill_blocks: u64, size: u64, take: bool) {
    let _ = std::fs::remove_file(path);
    let st = Arc::new(FileStorage::create(path, 8 << 30).expect("create file"));
    let c = CreateOptions::new(size, 8 << 30).with_codec(CodecPolicy::Fixed(Codec::Lz4));
    let pool = Pool::create(st, &c).expect("create pool");
    let v = pool.volume("default").expect("default");
    // The first DENSE blocks of every map page of the fill region.
    for first in (0..fill_blocks).step_by(PAGE as usize) {
        let data: Vec<u8> = (first..first + DENSE).flat_map(|b| block(b, 0)).collect();
        v.write_at(first * BS, &data, false).expect("fill");
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    for s in 0..snaps {
        for _ in 0..per {
            let b = rng.gen_range(0..fill_blocks / PAGE) * PAGE + rng.gen_range(0..DENSE);
            v.write_at(b * BS, &block(b, s + 1), false).expect("write");
        }
        if take {
            pool.create_snapshot(&format!("default@s{s}"))
                .expect("snapshot");
        } else if std::env::var_os("SNAP_OPEN_PEER_FLUSHES").is_some() {
            // The peer flushes where a snapshot is taken (a snapshot
            // flushes twice), so that its log is written alike.
            v.flush().expect("flush");
            v.flush().expect("flush");
        }
    }
    v.flush().expect("flush");
    drop(v);
    pool.engine().close().expect("close");
}

/// Opens the pool at `path`, rewrites one block of `default` and closes.
fn settle(path: &Path) {
    let st = Arc::new(FileStorage::open(path, true, true).expect("open file"));
    let vol = Arc::new(Volume::open(st, OpenOptions::default()).expect("open"));
    let pool = Pool::attach(vol.clone()).expect("attach");
    let v = pool.volume("default").expect("default");
    v.write_at(0, &block(0, 1 << 20), false).expect("write");
    drop(v);
    vol.close().expect("close");
}

/// Opens the pool at `path`, writes incompressible blocks at 100 GiB
/// (beyond the fill, where no snapshot holds an extent) until the log has
/// opened two new segments, then 256 more, flushes and closes: the open
/// segment then starts with the same records in every pool.
fn settle_log(path: &Path) {
    let st = Arc::new(FileStorage::open(path, true, true).expect("open file"));
    let vol = Arc::new(Volume::open(st, OpenOptions::default()).expect("open"));
    let pool = Pool::attach(vol.clone()).expect("attach");
    let v = pool.volume("default").expect("default");
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut data = vec![0u8; BS as usize];
    let first = (100u64 << 30) / BS;
    let free0 = vol.stats().segments_free;
    let mut n = 0u64;
    let mut extra = None;
    while extra != Some(0) {
        rng.fill(&mut data[..]);
        v.write_at((first + n) * BS, &data, false).expect("write");
        n += 1;
        extra = match extra {
            Some(k) => Some(k - 1),
            None if vol.stats().segments_free + 2 <= free0 => Some(256),
            None => None,
        };
        assert!(n < 1 << 16, "the log did not move on");
    }
    v.flush().expect("flush");
    drop(v);
    vol.close().expect("close");
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = Path::new(args.get(1).map_or("/tmp", |s| s.as_str())).to_path_buf();
    let arg = |i: usize, d: u64| args.get(i).map_or(d, |s| s.parse().expect("number"));
    let (snaps, per, fill_gib, size_gib) = (arg(2, 100), arg(3, 2048), arg(4, 64), arg(5, 128));
    let fill = (fill_gib << 30) / BS;
    let (with, without) = (dir.join("pool-snaps"), dir.join("pool-none"));
    if std::env::var_os("SNAP_OPEN_REUSE").is_none() {
        let t = Instant::now();
        build(&without, snaps, per, fill, size_gib << 30, false);
        build(&with, snaps, per, fill, size_gib << 30, true);
        println!("built in {:.1} s", t.elapsed().as_secs_f64());
    }
    match std::env::var("SNAP_OPEN_SETTLE").as_deref() {
        Ok("log") => {
            settle_log(&without);
            settle_log(&with);
        }
        Ok(_) => {
            settle(&without);
            settle(&with);
        }
        Err(_) => {}
    }
    if let Some(n) = std::env::var("SNAP_OPEN_PROFILE")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        // Only the pool with snapshots, opened n times: for `perf record`.
        let which = if std::env::var_os("SNAP_OPEN_NONE").is_some() {
            &without
        } else {
            &with
        };
        println!("{:.1} ms", time_open(which, n));
        return;
    }
    time_open(&without, 1);
    time_open(&with, 1);
    for _ in 0..3 {
        let (a, b) = (time_open(&without, 9), time_open(&with, 9));
        println!(
            "open (read-only, pool attached, stats): without {a:.2} ms, with {snaps} snapshots {b:.2} ms ({:.2}x)",
            b / a
        );
    }
}
