//! What a snapshot costs the writes just after it: a pool with one volume,
//! `FILL_GIB` of it written sequentially (1 MiB writes of 90%-compressible
//! blocks, lz4, as `scripts/bench/mapped` fills), served in-process with
//! the server's background jobs; then pairs of runs of random 4 KiB writes
//! of new data (`PCT`% of the filled blocks, in `THREADS` threads, each
//! run followed by a checkpoint): one with no snapshot, one just after
//! `snapshot-create`, their order alternated (even pairs: without first),
//! every snapshot deleted, a checkpoint written and the volume idle (its
//! background jobs under 5% of a core for a second) before each run (as
//! `scripts/bench/snapshots`'s `cow` part). Nearly every write is the first of its block since the snapshot,
//! and the snapshot's map gets a few entries on each of its pages, as a
//! few seconds of random writes over a large volume do. Each pair gives
//! the write rate after / without and the process CPU per write without /
//! after (all threads: writers and background jobs), of the writes alone
//! and with the checkpoint after; medians over pairs.
//!
//! `cargo run --release -p cvol-engine --example snap_write_bench DIR [FILL_GIB] [PAIRS] [PCT] [THREADS]`
//! (DIR/pool-snapwrite is made and removed; `SNAP_WRITE_REUSE=1` keeps
//! and reuses a filled one, so a build and its peer time the same pool;
//! `SNAP_WRITE_ONLY=snap` or `none` runs one kind only, for a profiler)
use cvol_engine::pool::Pool;
use cvol_engine::{Codec, CodecPolicy, CreateOptions, OpenOptions, Volume};
use cvol_storage::FileStorage;
use rand::{Rng, SeedableRng};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

const BS: u64 = 4096;

/// A block that compresses about 90% (as fio's buffer_compress_percentage=90):
/// 400 pseudo-random bytes, then zeros.
fn fill_block(rng: &mut impl Rng, b: &mut [u8]) {
    rng.fill(&mut b[..400]);
    b[400..].fill(0);
}

/// User + system CPU seconds of the whole process.
fn cpu_secs() -> f64 {
    // SAFETY: rusage is plain integers, for which zeros are valid.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage fills the struct it is given.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// CPU seconds of the process's threads named `name` (from /proc).
fn thread_cpu_secs(name: &str) -> f64 {
    // SAFETY: sysconf reads a system constant.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    let mut total = 0.0;
    for t in tasks.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        // Fields after the command's closing parenthesis: utime is the 12th.
        let rest = stat.rsplit_once(')').map_or("", |x| x.1);
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
        total += (ticks(11) + ticks(12)) / tick;
    }
    total
}

fn open(path: &Path) -> Pool {
    let st = Arc::new(FileStorage::open(path, true, true).expect("open file"));
    let vol = Arc::new(Volume::open(st, OpenOptions::default()).expect("open"));
    Pool::attach(vol).expect("attach")
}

fn build(path: &Path, fill_blocks: u64) {
    let _ = std::fs::remove_file(path);
    let phys = (fill_blocks * BS / 4).max(2 << 30);
    let st = Arc::new(FileStorage::create(path, phys).expect("create file"));
    let size = (fill_blocks * BS * 2).max(8 << 30);
    let c = CreateOptions::new(size, phys).with_codec(CodecPolicy::Fixed(Codec::Lz4));
    let pool = Pool::create(st, &c).expect("create pool");
    let v = pool.volume("default").expect("default");
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let per = 256u64; // blocks per 1 MiB write
    let mut buf = vec![0u8; (per * BS) as usize];
    for first in (0..fill_blocks).step_by(per as usize) {
        for b in buf.chunks_mut(BS as usize) {
            fill_block(&mut rng, b);
        }
        v.write_at(first * BS, &buf, false).expect("fill");
    }
    v.flush().expect("flush");
    drop(v);
    pool.engine().close().expect("close");
}

struct Arm {
    writes: u64,
    secs: f64,
    cpu: f64,
    /// The checkpoint after the writes: seconds, CPU seconds.
    ck_secs: f64,
    ck_cpu: f64,
    /// Checkpoints the background checkpointer wrote during the writes.
    checkpoints: u64,
    /// CPU seconds of the cleaner during the writes.
    cleaner: f64,
}

/// One run: `writes` random writes of new data in `threads` threads, then
/// a checkpoint (what the writes left dirty, written once).
fn run(pool: &Pool, fill_blocks: u64, threads: u64, writes: u64, seed: u64) -> Arm {
    let v = pool.volume("default").expect("default");
    let ck0 = pool.engine().stats().checkpoints_written;
    // New data in every run of every process (a reused pool holds the
    // blocks of earlier ones: no dedup hits).
    let base: u64 = rand::random();
    let (t0, c0, k0) = (Instant::now(), cpu_secs(), thread_cpu_secs("cvol-cleaner"));
    std::thread::scope(|s| {
        for t in 0..threads {
            let v = v.clone();
            s.spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(base ^ (seed << 8 | t));
                let mut b = vec![0u8; BS as usize];
                for _ in 0..writes / threads {
                    fill_block(&mut rng, &mut b);
                    let lba = rng.gen_range(0..fill_blocks);
                    v.write_at(lba * BS, &b, false).expect("write");
                }
            });
        }
    });
    let (secs, cpu) = (t0.elapsed().as_secs_f64(), cpu_secs() - c0);
    let cleaner = thread_cpu_secs("cvol-cleaner") - k0;
    let checkpoints = pool.engine().stats().checkpoints_written - ck0;
    let (t1, c1) = (Instant::now(), cpu_secs());
    pool.engine().checkpoint().expect("checkpoint");
    Arm {
        writes: writes / threads * threads,
        secs,
        cpu,
        ck_secs: t1.elapsed().as_secs_f64(),
        ck_cpu: cpu_secs() - c1,
        checkpoints,
        cleaner,
    }
}

/// Deletes every snapshot, checkpoints, and waits until the background
/// jobs are idle (under 5% of a core for a second, at most 60 s: the
/// cleaner reclaims what the deleted snapshot held).
fn settle(pool: &Pool) {
    for s in pool.snapshots() {
        pool.delete_snapshot(&s.name, true).expect("delete");
    }
    pool.engine().checkpoint().expect("checkpoint");
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(60) {
        let c = cpu_secs();
        std::thread::sleep(Duration::from_secs(1));
        if cpu_secs() - c < 0.05 {
            break;
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = Path::new(args.get(1).map_or("/tmp", |s| s.as_str())).to_path_buf();
    let arg = |i: usize, d: f64| args.get(i).map_or(d, |s| s.parse().expect("number"));
    let (fill_gib, pairs, pct, threads) = (arg(2, 32.0), arg(3, 7.0), arg(4, 2.0), arg(5, 4.0));
    let fill = (fill_gib * (1u64 << 30) as f64) as u64 / BS;
    let writes = (fill as f64 * pct / 100.0) as u64;
    let path = dir.join("pool-snapwrite");
    let reuse = std::env::var_os("SNAP_WRITE_REUSE").is_some();
    if !(reuse && path.exists()) {
        let t = Instant::now();
        build(&path, fill);
        println!(
            "filled {fill_gib} GiB in {:.1} s",
            t.elapsed().as_secs_f64()
        );
    }
    let pool = open(&path);
    let vol = pool.engine().clone();
    let jobs = (
        vol.start_background_checkpointer(),
        vol.start_background_cleaner(),
        vol.start_background_recompressor(),
    );
    // A first run brings the map's pages into memory.
    settle(&pool);
    run(&pool, fill, threads as u64, writes, 1 << 20);
    let mut r: [Vec<f64>; 4] = Default::default();
    let only = std::env::var("SNAP_WRITE_ONLY").ok();
    for i in 0..pairs as u64 {
        let order = if i % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        let mut arms = [None, None];
        if let Some(only) = &only {
            // Profiling: one kind of run only.
            settle(&pool);
            if only == "snap" {
                pool.create_snapshot(&format!("default@w{i}"))
                    .expect("snapshot");
            }
            let a = run(&pool, fill, threads as u64, writes, 2 * i);
            println!(
                "{only}: {:.2} us a write, the cleaner's {:.2}",
                a.cpu * 1e6 / a.writes as f64,
                a.cleaner * 1e6 / a.writes as f64
            );
            continue;
        }
        for snap in order {
            settle(&pool);
            if snap {
                pool.create_snapshot(&format!("default@w{i}"))
                    .expect("snapshot");
            }
            let seed = 2 * i + u64::from(snap);
            arms[usize::from(snap)] = Some(run(&pool, fill, threads as u64, writes, seed));
        }
        let [Some(none), Some(snap)] = arms else {
            unreachable!()
        };
        let rate = |a: &Arm| a.writes as f64 / a.secs;
        let us = |a: &Arm| a.cpu * 1e6 / a.writes as f64;
        let rate_ck = |a: &Arm| a.writes as f64 / (a.secs + a.ck_secs);
        let us_ck = |a: &Arm| (a.cpu + a.ck_cpu) * 1e6 / a.writes as f64;
        let x = [
            rate(&snap) / rate(&none),
            us(&none) / us(&snap),
            rate_ck(&snap) / rate_ck(&none),
            us_ck(&none) / us_ck(&snap),
        ];
        println!(
            "pair {i} ({} first): {:.0} / {:.0} writes/s after a snapshot / without: {:.2}x; \
             CPU {:.2} / {:.2} us a write: {:.2}x; with the checkpoint after ({:.0} / {:.0} ms): \
             {:.2}x, CPU {:.2}x; background checkpoints {} / {}",
            if order[0] { "snap" } else { "none" },
            rate(&snap),
            rate(&none),
            x[0],
            us(&snap),
            us(&none),
            x[1],
            snap.ck_secs * 1e3,
            none.ck_secs * 1e3,
            x[2],
            x[3],
            snap.checkpoints,
            none.checkpoints,
        );
        for (v, x) in r.iter_mut().zip(x) {
            v.push(x);
        }
    }
    let [a, b, c, d] = r.map(median);
    println!(
        "median of {pairs} pairs ({writes} writes each): writes/s after / without {a:.2}x, \
         CPU per write without / after {b:.2}x; with the checkpoint after: {c:.2}x, CPU {d:.2}x"
    );
    settle(&pool);
    drop(jobs);
    drop(pool);
    vol.close().expect("close");
    if !reuse {
        let _ = std::fs::remove_file(&path);
    }
}
