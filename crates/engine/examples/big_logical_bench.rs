//! What a volume's logical size costs: wall time and peak RSS of each step
//! of a volume's life (create, open, write, checkpoint, cleaner,
//! recompression, scrub, stat, close, open after a crash, check) on a small
//! physical store, whatever its logical size. Not a test: run it for a
//! 1 GiB and a 16 TiB volume and compare.
//!
//! `cargo run --release -p cvol-engine --example big_logical_bench [LOGICAL_GIB] [DIR] [keep]`
//! (`keep`: leave the volume file, for `cvol check` and `cvol stat`)
use cvol_engine::volume::ScrubOptions;
use cvol_engine::{Codec, CodecPolicy, CreateOptions, OpenOptions, Volume};
use cvol_storage::FileStorage;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

const BS: u64 = 4096;
const PHYSICAL: u64 = 256 << 20;

/// A /proc/self/status field, in KiB.
fn status_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    (s.lines())
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

/// Runs `f`, printing its wall time, the peak RSS while it ran and the RSS
/// after it.
fn step<T>(name: &str, f: impl FnOnce() -> T) -> T {
    // Writing 5 to clear_refs resets the peak (VmHWM) to the current RSS.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let t = Instant::now();
    let out = f();
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let (peak, now) = (status_kib("VmHWM:"), status_kib("VmRSS:"));
    println!(
        "{name:<22} {ms:>9.1} ms  peak {:>8.1} MiB  after {:>8.1} MiB",
        peak as f64 / 1024.0,
        now as f64 / 1024.0
    );
    out
}

fn block(lba: u64) -> Vec<u8> {
    let line = format!("block {lba} of a big volume, compressible text. ");
    line.repeat(BS as usize / line.len() + 1).as_bytes()[..BS as usize].to_vec()
}

fn open(path: &Path) -> Volume {
    let st = Arc::new(FileStorage::open(path, true, true).expect("open file"));
    Volume::open(st, OpenOptions::default()).expect("open volume")
}

/// 4 MiB at the start, and one block every `stride` blocks.
fn write(vol: &Volume, logical: u64, round: u64) {
    for lba in 0..1024 {
        vol.write_at(lba * BS, &block(lba + round), false)
            .expect("write");
    }
    let blocks = logical / BS;
    for i in 1..64 {
        let lba = blocks / 64 * i + round;
        vol.write_at(lba * BS, &block(lba), false).expect("write");
    }
    vol.flush().expect("flush");
}

fn main() {
    let mut args = std::env::args().skip(1);
    let gib: u64 = args.next().map_or(16384, |a| a.parse().expect("GiB"));
    let dir = args.next().unwrap_or_else(|| "/tmp".into());
    let path = Path::new(&dir).join(format!("big-logical-{gib}g.cvol"));
    let _ = std::fs::remove_file(&path);
    let logical = gib << 30;
    println!("logical {gib} GiB, physical {} MiB", PHYSICAL >> 20);
    step("create", || {
        let st = Arc::new(FileStorage::create(&path, PHYSICAL).expect("create file"));
        let strong = Codec::Zstd(9);
        let opts = CreateOptions::new(logical, PHYSICAL).with_codec(CodecPolicy::Auto { strong });
        Volume::create(st, &opts)
            .expect("create")
            .close()
            .expect("close");
    });
    let vol = step("open (new)", || open(&path));
    step("write 4 MiB + 63", || write(&vol, logical, 0));
    step("checkpoint", || vol.checkpoint().expect("checkpoint"));
    step("overwrite", || write(&vol, logical, 1));
    let gained = step("clean", || vol.clean(PHYSICAL, false).expect("clean"));
    let rewritten = step("recompress to end", || {
        let mut total = 0;
        loop {
            let r = vol.recompress_pass(64 << 20, false).expect("recompress");
            total += r.blocks_rewritten;
            if r.wrapped {
                return total;
            }
        }
    });
    println!("  (cleaner gained {gained} bytes, recompression rewrote {rewritten} blocks)");
    let opts = ScrubOptions {
        bytes_per_sec: 0,
        yield_to_clients: false,
        max_listed: 10,
    };
    step("scrub", || vol.scrub(&opts, &|_| {}).expect("scrub"));
    step("stats", || vol.stats());
    step("close", || vol.close().expect("close"));
    drop(vol);
    let vol = step("open (clean)", || open(&path));
    step("write (no checkpoint)", || write(&vol, logical, 2));
    drop(vol); // a crash: no checkpoint
    let vol = step("open (after crash)", || open(&path));
    step("close (after crash)", || vol.close().expect("close"));
    drop(vol);
    let st = FileStorage::open(&path, false, true).expect("open file");
    let rep = step("check", || {
        cvol_engine::check::check_volume(&st, &mut |_, _| {})
    });
    assert!(rep.consistent(), "check: {:?}", rep.errors);
    if args.next().as_deref() != Some("keep") {
        let _ = std::fs::remove_file(&path);
    }
}
