//! Seeded fault simulation: on top of the crash simulation's power cuts and
//! torn sectors, the media misbehaves at rest — bits flip, a write lands in
//! the wrong place (a misdirected write: its data appears elsewhere and its
//! own place keeps stale bytes), whole ranges fail to read. Every feature
//! runs (units, dedup, the cleaner, background recompression, checkpoints).
//! Independent checkers, after every fault:
//! - a block reads either a version the model allows or fails with an
//!   error that an injected fault explains (its record overlaps a damaged
//!   range) — never wrong data;
//! - without damage to the log's metadata, blocks hold their durable or a
//!   later version (nothing flushed is lost that the damage does not
//!   explain);
//! - when the damage makes the volume refuse to open, `repair_volume`
//!   (`cvol check --repair`) makes it open again, and every block then
//!   reads a version that was really written (or zeros), or an error;
//! - `check` names damaged blocks by LBA, and a volume without damage
//!   checks clean.
//!
//!
//! A third of the seeds (2, 5, 8, ...: the named regressions keep one
//! store) keep the volume's metadata on a separate device:
//! power cuts hit both stores (each loses its own unsynced writes), damage
//! at rest hits the data store, and the newest checkpoint's commit on the
//! metadata device.
//!
//! Seeds 0-8, 27-35, ... (`window_of`; none of the named regressions) run
//! the dedup index in a few KiB and persist its hook snapshot every few
//! fingerprint tables, copy earlier blocks elsewhere, and warm the index
//! after every reopen: damage meets the snapshot and the tables it names.
//!
//! One seed: `CVOL_FAULT_SEED=N cargo test --release -p cvol-engine --test fault_sim -- --nocapture`
//! More:     `CVOL_FAULT_SEEDS=2000 cargo test --release -p cvol-engine --test fault_sim`
//! The same on encrypted volumes: `CVOL_SEALED_FAULT_SEED` / `CVOL_SEALED_FAULT_SEEDS`.
mod common;
use common::sealed::{self, Sealing};
use common::seeds;
use common::sim::{self, h, Model};
use common::stores::Stores;
use common::{BS, MIB};
use cvol_engine::{check, CreateOptions, ElasticConfig, OpenOptions, VolError, Volume};
use cvol_format::record::RECORD_HEADER_BYTES;
use cvol_format::superblock::Packing;
use cvol_format::{CheckpointPointer, RecordHeader, RecordKind};
use cvol_storage::{SimConfig, SimStorage, Storage};
use rand::{rngs::StdRng, Rng, SeedableRng};

const BLOCKS: usize = 256;
const PHYS: u64 = 6 * MIB;
/// Start of the data area (superblocks and pointer slots come before).
const DATA_AREA: u64 = cvol_format::DATA_OFFSET_BYTES;

/// Block contents: zeros, random, or text (half the time from a small
/// pool, so dedup finds repeats).
fn content(rng: &mut StdRng, len: usize) -> Vec<u8> {
    sim::content(rng, len, 6, |tag| format!("fault sim block {tag:08x} "))
}

/// Seeds 4 and 6 mod 7 are page-packed (`--packing page`, `page-sorted`);
/// the named regressions' seeds (2392, 2935, 3456, 1751, 794) are not, so
/// they keep the layout they failed with.
fn packing_of(seed: u64) -> Packing {
    match seed % 7 {
        4 => Packing::Page,
        6 => Packing::PageSorted,
        _ => Packing::Compact,
    }
}

/// Seeds 0-8, 27-35, 54-62, ... run the dedup index in 8 KiB (its hooks
/// fill, its table cache evicts) with a hook snapshot due every 4 KiB of
/// fingerprint tables. The named regressions' seeds are not among them.
fn window_of(seed: u64) -> bool {
    (seed / 9).is_multiple_of(3)
}

/// The seed's configuration of a volume on `store`: codec policy, dedup,
/// unit size, load level.
fn setup(rng: &mut StdRng, store: &SimStorage, seed: u64) -> (CreateOptions, OpenOptions) {
    // A u32 draw (crash_sim draws a usize): the seeds stay what they were.
    let codec = sim::codec_policies()[rng.gen_range(0..4u32) as usize];
    let create = common::options(store, (BLOCKS * BS) as u64)
        .with_codec(codec)
        .with_dedup(rng.gen_ratio(3, 4))
        .with_packing(packing_of(seed));
    let open = OpenOptions {
        elastic: ElasticConfig {
            recompress: false,
            ..sim::elastic(rng)
        },
        // Odd seeds keep no clean map page in memory: nearly every
        // operation reads back the pages it touches.
        map_cache_bytes: (seed % 2 == 1).then_some(0),
        // A third of the seeds spill fingerprint rows every ~20 blocks.
        fingerprint_spill_bytes: match seed % 3 {
            0 => 512,
            _ => OpenOptions::default().fingerprint_spill_bytes,
        },
        // Half the seeds keep freed segments' space for the log head to
        // write over: stale records of their earlier lives lie behind the
        // new ones, and the space is returned later.
        warm_segments: (seed % 4 < 2).then_some(3),
        // Three seeds in five write zeros past the log head at flushes.
        zero_ahead_bytes: (seed % 5 < 3).then_some(8 << 10),
        dedup_memory_bytes: window_of(seed).then_some(8 << 10),
        hook_snapshot_bytes: match window_of(seed) {
            true => 4 << 10,
            false => OpenOptions::default().hook_snapshot_bytes,
        },
        ..OpenOptions::default()
    };
    (create, open)
}

/// `CVOL_FAULT_TRACE=LBA`: follow one block through a seed.
fn trace_lba() -> Option<usize> {
    std::env::var("CVOL_FAULT_TRACE").ok()?.parse().ok()
}

fn run_ops(
    vol: &Volume,
    model: &mut Model,
    rng: &mut StdRng,
    ops: usize,
    time: &mut sim::SimClock,
    window: bool,
) {
    for _ in 0..ops {
        time.tick();
        let r: Result<(), VolError> = match rng.gen_range(0..100) {
            0..=54 => {
                let nb = rng.gen_range(1..=16);
                let off = rng.gen_range(0..=BLOCKS - nb) * BS;
                // Window seeds copy earlier blocks elsewhere a third of
                // the time (the others keep their draws).
                let data = match window && rng.gen_ratio(1, 3) {
                    true => sim::copy_of(rng, &model.cur, nb * BS),
                    false => content(rng, nb * BS),
                };
                // A write refused for space changed nothing: the model
                // learns only writes that went in (seed 2392 once counted
                // a refused write as flushed).
                let r = vol.write_at(off as u64, &data, false);
                if r.is_ok() {
                    model.written(off, &data);
                }
                if let Some(l) = trace_lba().filter(|l| (off / BS..off / BS + nb).contains(l)) {
                    eprintln!(
                        "trace write lba {l} h={} {r:?}",
                        h(&data[(l - off / BS) * BS..(l - off / BS + 1) * BS])
                    );
                }
                r
            }
            55..=62 => {
                let nb = rng.gen_range(1..=8);
                let off = rng.gen_range(0..=BLOCKS - nb) * BS;
                let r = vol.trim(off as u64, (nb * BS) as u64, false);
                if r.is_ok() {
                    model.written(off, &vec![0u8; nb * BS]);
                }
                r
            }
            63..=80 => vol.flush().map(|_| model.flushed()),
            81..=84 => vol.checkpoint().map(|_| model.checkpointed()),
            85..=87 => vol.clean(u64::MAX, false).map(|_| ()),
            88..=90 => vol.recompress_pass(u64::MAX, false).map(|_| ()),
            _ => {
                let lba = rng.gen_range(0..BLOCKS);
                let mut b = vec![0u8; BS];
                vol.read_at((lba * BS) as u64, &mut b).map(|_| {
                    assert!(
                        b == model.cur[lba * BS..(lba + 1) * BS],
                        "read of {lba} before any fault"
                    );
                })
            }
        };
        match r {
            Ok(()) | Err(VolError::NoSpace) => {}
            Err(e) => panic!("unexpected error before any fault: {e}"),
        }
    }
}

/// Damage injected at rest: byte ranges whose contents are no longer what
/// was written there.
#[derive(Default)]
struct Damage {
    ranges: Vec<(u64, u64)>,
    kinds: Vec<&'static str>,
    /// A misdirected write left the first sectors of a segment zeroed:
    /// recovery cannot find that segment when the log continues in it
    /// (docs/FORMAT.md, "what open cannot see"); `check` and repair can.
    erased_segment_start: bool,
}

impl Damage {
    fn explains(&self, rec: Option<(u64, u32)>) -> bool {
        rec.is_some_and(|(off, len)| {
            let end = off + u64::from(len);
            self.ranges.iter().any(|&(a, b)| a < end && off < b)
        })
    }

    fn hits_metadata(&self) -> bool {
        self.ranges.iter().any(|&(a, _)| a < DATA_AREA)
    }
}

/// Every record that verifies on the store: (offset, header).
fn verified_records(store: &SimStorage) -> Vec<(u64, RecordHeader)> {
    let mut img = vec![0u8; store.len_bytes() as usize];
    store.read_at(0, &mut img).unwrap();
    let magic = cvol_format::record::RECORD_MAGIC.to_le_bytes();
    (DATA_AREA as usize..img.len() - RECORD_HEADER_BYTES)
        .filter(|&i| img[i..i + 4] == magic)
        .filter_map(|i| {
            let (h, _) = RecordHeader::decode_verified(&img[i..]).ok()?;
            Some((i as u64, h))
        })
        .collect()
}

/// Issue 22's shape: one record of the newest checkpoint (a MAP_CHUNK or
/// its CKPT_COMMIT) and one record of the log after the older checkpoint
/// get a flipped byte, so recovery must fall back and roll forward through
/// a damaged record.
fn damage_checkpoint_and_record(stores: &Stores, rng: &mut StdRng, d: &mut Damage) -> bool {
    let store = &stores.data;
    let mut ptrs: Vec<CheckpointPointer> = (0..2)
        .filter_map(|slot| common::pointer_slot(store, slot))
        .collect();
    ptrs.sort_by_key(|p| std::cmp::Reverse(p.generation));
    let Some(newest) = ptrs.first().copied() else {
        return false;
    };
    let older_seq = ptrs.get(1).map_or(0, |p| p.commit_seq);
    let recs = verified_records(store);
    let mut ck: Vec<(u64, u64)> = vec![(newest.commit_offset, u64::from(newest.commit_len))];
    if let Some((_, h)) = recs.iter().find(|(o, _)| *o == newest.commit_offset) {
        let n = ck.len();
        for (o, r) in &recs {
            if r.kind == RecordKind::MapChunk && r.seq < h.seq && r.seq + 64 >= h.seq {
                ck.push((*o, r.total_len() as u64));
            }
        }
        ck.truncate(n + 64);
    }
    let after: Vec<(u64, u64)> = recs
        .iter()
        .filter(|(_, h)| h.seq > older_seq && h.seq < newest.commit_seq)
        .filter(|(_, h)| {
            matches!(
                h.kind,
                RecordKind::Data | RecordKind::Ref | RecordKind::Zero | RecordKind::Trim
            )
        })
        .map(|(o, h)| (*o, h.total_len() as u64))
        .collect();
    if after.is_empty() {
        return false;
    }
    for (off, len) in [
        ck[rng.gen_range(0..ck.len())],
        after[rng.gen_range(0..after.len())],
    ] {
        let at = off + rng.gen_range(0..len);
        let (sim, own) = stores.route(at);
        sim.flip_bit(own, rng.gen_range(0..8));
        sim.flip_bit(own, rng.gen_range(0..8));
        d.ranges.push((at, at + 1));
    }
    stores.data.sync().unwrap();
    d.kinds.push("newest checkpoint and a log record");
    true
}

fn inject(stores: &Stores, rng: &mut StdRng, used_end: u64) -> Damage {
    let store = &stores.data;
    let mut d = Damage::default();
    let mut bad_reads = Vec::new();
    let span = used_end.max(DATA_AREA + 4096) - DATA_AREA;
    if rng.gen_ratio(1, 4) && damage_checkpoint_and_record(stores, rng, &mut d) {
        return d;
    }
    for _ in 0..rng.gen_range(1..=3) {
        match rng.gen_range(0..3) {
            0 => {
                // Bit rot.
                let at = DATA_AREA + rng.gen_range(0..span);
                store.flip_bit(at, rng.gen_range(0..8));
                d.ranges.push((at, at + 1));
                d.kinds.push("bit flip");
            }
            1 => {
                // A misdirected write of 1-8 sectors: the data lands at
                // `to`, its own place `from` keeps what was there before
                // (here: zeros, as on a never-written sector).
                let n = 512 * rng.gen_range(1..=8u64);
                let from = DATA_AREA + rng.gen_range(0..span.saturating_sub(n).max(1)) / 512 * 512;
                let to = DATA_AREA + rng.gen_range(0..span.saturating_sub(n).max(1)) / 512 * 512;
                let mut b = vec![0u8; n as usize];
                store.read_at(from, &mut b).unwrap();
                store.write_at(to, &b).unwrap();
                store.write_at(from, &vec![0u8; n as usize]).unwrap();
                // (seed 2764: a range across a segment boundary erases the
                // next segment's start as well)
                let next_start = DATA_AREA + (from - DATA_AREA).div_ceil(MIB) * MIB;
                d.erased_segment_start |= next_start < from + n;
                store.sync().unwrap();
                d.ranges.push((from, from + n));
                d.ranges.push((to, to + n));
                d.kinds.push("misdirected write");
            }
            _ => {
                // A range that fails to read.
                let n = 512 * rng.gen_range(1..=16u64);
                let at = DATA_AREA + rng.gen_range(0..span.saturating_sub(n).max(1)) / 512 * 512;
                bad_reads.push((at, at + n));
                d.ranges.push((at, at + n));
                d.kinds.push("read errors");
            }
        }
    }
    // Read errors last: the other injections read the store.
    store.set_config(SimConfig {
        bad_read_ranges: bad_reads,
        ..SimConfig::default()
    });
    d
}

/// Reads every block; checks each against the model and the damage.
/// Returns the image (unreadable blocks as zeros) and how many failed.
fn verify(
    vol: &Volume,
    model: &Model,
    damage: &Damage,
    repaired: Option<&check::RepairReport>,
    seed: u64,
    cycle: usize,
) -> (Vec<u8>, u64, u64, u64) {
    let mut image = vec![0u8; BLOCKS * BS];
    let (mut failed, mut own, mut unseen) = (0, 0, 0);
    let ctx = |lba: usize| {
        format!(
            "seed {seed} cycle {cycle} lba {lba} (damage: {:?}; reproduce: CVOL_FAULT_SEED={seed} \
             cargo test --release -p cvol-engine --test fault_sim -- --nocapture)",
            damage.kinds
        )
    };
    for lba in 0..BLOCKS {
        let buf = &mut image[lba * BS..(lba + 1) * BS];
        match vol.read_at((lba * BS) as u64, buf) {
            Ok(()) => {
                let v = h(buf);
                if let Some(rep) = repaired {
                    assert!(
                        !rep.lost_lbas.contains(&(lba as u64)),
                        "a block repair listed as lost reads without error: {}",
                        ctx(lba)
                    );
                    if rep.unknown_records.is_empty() {
                        // Repair salvaged everything it did not list.
                        assert!(
                            model.certified[lba].contains(&v),
                            "after repair, flushed data lost or older without being listed \
                             (an older version: {}; zeros: {}): {}",
                            model.history[lba].contains(&v),
                            buf.iter().all(|&x| x == 0),
                            ctx(lba)
                        );
                    } else {
                        // It said it cannot tell: a version once written.
                        assert!(
                            model.history[lba].contains(&v),
                            "garbage after repair: {}",
                            ctx(lba)
                        );
                    }
                } else if damage.ranges.is_empty() {
                    assert!(
                        model.allowed[lba].contains(&v),
                        "lost or garbage ({} allowed versions; an older version: {}; zeros: {}): {}",
                        model.allowed[lba].len(),
                        model.history[lba].contains(&v),
                        buf.iter().all(|&x| x == 0),
                        ctx(lba)
                    );
                } else if damage.erased_segment_start {
                    // The one damage open cannot see (the caller requires
                    // `check` to report it): a version once held.
                    assert!(model.history[lba].contains(&v), "garbage: {}", ctx(lba));
                    unseen += u64::from(!model.certified[lba].contains(&v));
                } else {
                    // Opened despite damage: recovery never ends below a
                    // certified seq, so a block holds its certified version
                    // or a later one; an older version or zeros it did not
                    // hold then is silent loss of flushed data.
                    assert!(
                        model.certified[lba].contains(&v),
                        "opened, but flushed data reads older or as zeros ({} certified versions; \
                         an older version: {}; zeros: {}): {}",
                        model.certified[lba].len(),
                        model.history[lba].contains(&v),
                        buf.iter().all(|&x| x == 0),
                        ctx(lba)
                    );
                }
            }
            Err(e @ (VolError::Corrupt { .. } | VolError::Io(_))) => {
                // Explained by the damage: the block's own record was hit,
                // or damage elsewhere broke the chain of records after the
                // last checkpoint and the map still names a place reused
                // since (the magic and crc checks refuse it). Without
                // damage, no read may fail.
                own += u64::from(damage.explains(vol.block_record(lba as u64)));
                assert!(
                    repaired.is_some() || !damage.ranges.is_empty(),
                    "unexplained read failure ({e}; record {:?}; damaged {:?}): {}",
                    vol.block_record(lba as u64),
                    damage.ranges,
                    ctx(lba)
                );
                buf.fill(0);
                failed += 1;
            }
            Err(e) => panic!("unexpected error {e}: {}", ctx(lba)),
        }
    }
    (image, failed, own, unseen)
}

#[derive(Default)]
struct Coverage {
    faults: u64,
    failed_reads: u64,
    repairs: u64,
    refused_opens: u64,
    check_named: u64,
    own_record_hits: u64,
    /// Blocks repair listed as lost, and repairs that could not tell.
    lost_listed: u64,
    unknown_losses: u64,
    /// Cycles with the newest checkpoint and one log record damaged.
    checkpoint_and_record: u64,
    /// Repairs because a damaged map page left blocks unwritable (open
    /// verifies the pages the newest checkpoint carried over when first
    /// used).
    page_repairs: u64,
    /// Cycles where an erased segment start hid flushed records from open
    /// (check reported them).
    unseen_by_open: u64,
    metadata_device_seeds: u64,
    /// Window seeds (`window_of`), their duplicates found through a
    /// fingerprint table, hook snapshots written, and hooks a reopen took
    /// from a snapshot.
    window_seeds: u64,
    hits_table: u64,
    hook_snapshots: u64,
    hook_snapshot_entries: u64,
}

impl Coverage {
    fn add(&mut self, o: Coverage) {
        let Coverage {
            faults,
            failed_reads,
            repairs,
            refused_opens,
            check_named,
            own_record_hits,
            lost_listed,
            unknown_losses,
            checkpoint_and_record,
            page_repairs,
            unseen_by_open,
            metadata_device_seeds,
            window_seeds,
            hits_table,
            hook_snapshots,
            hook_snapshot_entries,
        } = o;
        self.window_seeds += window_seeds;
        self.hits_table += hits_table;
        self.hook_snapshots += hook_snapshots;
        self.hook_snapshot_entries += hook_snapshot_entries;
        self.faults += faults;
        self.failed_reads += failed_reads;
        self.repairs += repairs;
        self.refused_opens += refused_opens;
        self.check_named += check_named;
        self.own_record_hits += own_record_hits;
        self.lost_listed += lost_listed;
        self.unknown_losses += unknown_losses;
        self.checkpoint_and_record += checkpoint_and_record;
        self.page_repairs += page_repairs;
        self.unseen_by_open += unseen_by_open;
        self.metadata_device_seeds += metadata_device_seeds;
    }
}

fn run_seed(seed: u64, sealing: Option<&Sealing>, cov: &mut Coverage) {
    let mut rng = StdRng::seed_from_u64(seed);
    // Seeds 3, 7, 11, ... run nearer full (four data segments beside the
    // superblocks): faults meet the cleaner compacting and writes short of
    // room.
    let phys = if seed % 4 == 3 { 5 * MIB } else { PHYS };
    let mut store = Stores::new(phys, if seed % 3 == 2 { 4 * MIB } else { 0 });
    cov.metadata_device_seeds += u64::from(store.has_meta());
    let (create, open) = setup(&mut rng, &store.data, seed);
    let (create, mut open) = (
        sealed::create_opts(sealing, create),
        sealed::open_opts(sealing, open),
    );
    let mut time = sim::SimClock::new(seed);
    open.clock = time.shared();
    store.create(&create).close().expect("close after create");
    if sealing.is_some() {
        sealed::assert_encrypted(&*store.joined());
    }
    let mut vol = store.open(open.clone()).expect("open");
    let mut model = Model::new(BLOCKS);
    let mut damaged_before = false;
    let window = window_of(seed);
    cov.window_seeds += u64::from(window);
    for cycle in 0..3 {
        let ops = rng.gen_range(30..200);
        run_ops(&vol, &mut model, &mut rng, ops, &mut time, window);
        let d = vol.stats().dedup;
        cov.hits_table += d.dedup_hits_table;
        cov.hook_snapshots += d.dedup_hook_snapshots;
        vol.verify_refcounts()
            .unwrap_or_else(|e| panic!("seed {seed} cycle {cycle}: {e}"));
        // End the cycle with a clean close or a power cut.
        let used_end = (0..BLOCKS as u64)
            .filter_map(|l| vol.block_record(l))
            .map(|(o, l)| o + u64::from(l))
            .max()
            .unwrap_or(DATA_AREA);
        if rng.gen_bool(0.5) {
            vol.close().unwrap();
            model.checkpointed();
            drop(vol);
        } else {
            drop(vol);
            store = store.crash(rng.gen());
        }
        let damage = if rng.gen_ratio(2, 3) {
            cov.faults += 1;
            let d = inject(&store, &mut rng, used_end.max(DATA_AREA + MIB));
            cov.checkpoint_and_record +=
                u64::from(d.kinds.len() == 1 && d.kinds[0].contains("checkpoint"));
            d
        } else {
            Damage::default()
        };
        let (reopened, repaired) = match store.open(open.clone()) {
            Ok(v) => (v, None),
            Err(e) => {
                if std::env::var("CVOL_FAULT_SEED").is_ok() {
                    eprintln!(
                        "cycle {cycle}: damage {:?} {:?}; open refused: {e}",
                        damage.kinds, damage.ranges
                    );
                }
                assert!(
                    !damage.ranges.is_empty(),
                    "seed {seed} cycle {cycle}: open failed without damage: {e}"
                );
                cov.refused_opens += 1;
                store.set_config(SimConfig::default()); // repair needs to read
                if std::env::var("CVOL_FAULT_DUMP").is_ok() {
                    for (o, h) in verified_records(&store.data) {
                        eprintln!(
                            "  before repair {o} {:?} seq {} epoch {} lba {}",
                            h.kind, h.seq, h.epoch, h.lba
                        );
                    }
                }
                let rep = sealed::repair(sealing, store.joined());
                if std::env::var("CVOL_FAULT_DUMP").is_ok() {
                    for (o, h) in verified_records(&store.data) {
                        eprintln!(
                            "  after repair {o} {:?} seq {} epoch {} lba {}",
                            h.kind, h.seq, h.epoch, h.lba
                        );
                    }
                }
                cov.repairs += 1;
                let v = store.open(open.clone()).unwrap_or_else(|e| {
                    panic!(
                        "seed {seed} cycle {cycle}: still refuses after repair ({:?}): {e}",
                        rep.actions
                    )
                });
                cov.lost_listed += rep.lost_lbas.len() as u64;
                cov.unknown_losses += u64::from(!rep.unknown_records.is_empty());
                (v, Some(rep))
            }
        };
        // Window seeds refill the index as a served volume does, from the
        // hook snapshot and the tables, damaged or not: hints only.
        if window {
            reopened.warm_index();
            cov.hook_snapshot_entries += reopened.stats().dedup.dedup_hook_snapshot_entries;
        }
        if let Some(l) = trace_lba() {
            let mut b = vec![0u8; BS];
            let r = reopened.read_at(l as u64 * BS as u64, &mut b);
            eprintln!(
                "trace cycle {cycle}: lba {l} at {:?} reads {:?} h={} allowed={:?}",
                reopened.block_record(l as u64),
                r.err().map(|e| e.to_string()),
                h(&b),
                model.allowed[l]
            );
        }
        if std::env::var("CVOL_FAULT_SEED").is_ok() {
            eprintln!(
                "cycle {cycle}: damage {:?} {:?}; recovery: {:?}",
                damage.kinds,
                damage.ranges,
                reopened.recovery_warnings()
            );
        }
        let (image, failed, own, unseen) =
            verify(&reopened, &model, &damage, repaired.as_ref(), seed, cycle);
        cov.failed_reads += failed;
        cov.own_record_hits += own;
        let rep = sealed::check(sealing, &*store.joined());
        // Damage stays until rewritten: a damaged checkpoint of an earlier
        // cycle that is still the newest is rightly reported (seed 2555).
        damaged_before |= !damage.ranges.is_empty();
        if !damaged_before && repaired.is_none() {
            assert!(
                rep.consistent(),
                "seed {seed} cycle {cycle}: check: {:?}",
                rep.errors
            );
        }
        if unseen > 0 {
            // Open could not see the erased segment; check must.
            assert!(
                !rep.consistent(),
                "seed {seed} cycle {cycle}: {unseen} blocks lost flushed versions and check is clean"
            );
            cov.unseen_by_open += 1;
        }
        if failed > 0 && !damage.hits_metadata() {
            // Damaged data blocks are named by LBA (reads failed; check must see it).
            assert!(
                !rep.consistent(),
                "seed {seed} cycle {cycle}: check missed damaged blocks"
            );
            cov.check_named += 1;
        }
        drop(image);
        vol = restart_from_what_reads(reopened, &store, &open, sealing, &mut model, cov);
    }
}

/// The read errors go away (a replaced cable); damaged records stay
/// damaged. The next cycle starts from what reads now, unreadable blocks
/// rewritten with zeros. A block whose map page is damaged cannot be
/// written either (open leaves the pages the newest checkpoint carried
/// over from the older one to be verified when first used, and the page's
/// other entries are unknown): then the store is repaired first (`cvol
/// check --repair`), as an operator would once `check` named the damage.
fn restart_from_what_reads(
    mut vol: Volume,
    store: &Stores,
    open: &OpenOptions,
    sealing: Option<&Sealing>,
    model: &mut Model,
    cov: &mut Coverage,
) -> Volume {
    store.set_config(SimConfig::default());
    let z = vec![0u8; BS];
    for _ in 0..3 {
        let mut now = vec![0u8; BLOCKS * BS];
        let mut unreadable = Vec::new();
        for (lba, b) in now.chunks_mut(BS).enumerate() {
            if vol.read_at((lba * BS) as u64, b).is_err() {
                b.fill(0);
                unreadable.push(lba);
            }
        }
        model.reset_to(now);
        let mut unwritable = false;
        for lba in unreadable {
            match vol.write_at((lba * BS) as u64, &z, false) {
                Ok(()) => model.written(lba * BS, &z),
                Err(VolError::Corrupt { .. }) => {
                    unwritable = true;
                    break;
                }
                Err(e) => panic!("rewriting unreadable block {lba}: {e}"),
            }
        }
        if !unwritable {
            vol.flush().unwrap();
            model.flushed();
            return vol;
        }
        drop(vol);
        sealed::repair(sealing, store.joined());
        cov.page_repairs += 1;
        vol = (store.open(open.clone())).unwrap_or_else(|e| panic!("refused after repair: {e}"));
    }
    panic!("blocks still unwritable after repairs");
}

#[test]
fn fault_simulation_seeds() {
    let Some((n, cov)) = seeds::run_seeds(
        "CVOL_FAULT_SEED",
        "CVOL_FAULT_SEEDS",
        150,
        |seed, cov| run_seed(seed, None, cov),
        Coverage::add,
    ) else {
        return;
    };
    eprintln!(
        "{n} seeds: {} cycles with injected faults ({} newest checkpoint + log record), {} reads \
         refused (EIO; {} where the block's own record was hit), {} opens refused then repaired \
         ({} blocks listed lost, {} repairs that could not tell), {} repairs of blocks a damaged \
         map page left unwritable, {} times check named damaged blocks; {} cycles where an erased segment start hid flushed records from open and \
         check reported it; {} seeds with a metadata device; {} window seeds: {} duplicates \
         found through fingerprint tables, {} hook snapshots written, {} hooks loaded from \
         snapshots",
        cov.faults,
        cov.checkpoint_and_record,
        cov.failed_reads,
        cov.own_record_hits,
        cov.refused_opens,
        cov.lost_listed,
        cov.unknown_losses,
        cov.page_repairs,
        cov.check_named,
        cov.unseen_by_open,
        cov.metadata_device_seeds,
        cov.window_seeds,
        cov.hits_table,
        cov.hook_snapshots,
        cov.hook_snapshot_entries
    );
    assert!(cov.window_seeds >= n / 4, "too few window seeds");
    assert!(
        cov.hits_table > 0 && cov.hook_snapshots > 0 && cov.hook_snapshot_entries > 0,
        "the dedup window was not exercised"
    );
    assert!(cov.metadata_device_seeds >= n / 4);
    assert!(
        cov.checkpoint_and_record > 0,
        "the damaged-checkpoint-plus-record pattern never ran"
    );

    assert!(cov.faults > n, "faults were injected");
    assert!(
        cov.failed_reads > 0,
        "no fault ever hit live data: the simulation tests nothing"
    );
    assert!(cov.check_named > 0 && cov.own_record_hits > 0);
    assert!(
        cov.refused_opens > 0,
        "damage never made recovery refuse (and repair)"
    );
}

/// The same simulation on encrypted volumes (`Sealing::of_seed`): a
/// flipped bit or a misplaced sector in a sealed record fails its tag,
/// which must read as an error the damage explains, never as other data.
/// Few seeds in a plain run (`CVOL_SEALED_FAULT_SEEDS` for more); seeds
/// 0-35 meet every configuration the seed picks.
#[test]
fn sealed_fault_simulation_seeds() {
    let Some((n, cov)) = seeds::run_seeds(
        "CVOL_SEALED_FAULT_SEED",
        "CVOL_SEALED_FAULT_SEEDS",
        36,
        |seed, cov| run_seed(seed, Some(&Sealing::of_seed(seed)), cov),
        Coverage::add,
    ) else {
        return;
    };
    eprintln!(
        "{n} sealed seeds: {} cycles with faults ({} checkpoint + record), {} reads refused \
         ({} of the block's own record), {} opens refused then repaired, {} times check named \
         damaged blocks",
        cov.faults,
        cov.checkpoint_and_record,
        cov.failed_reads,
        cov.own_record_hits,
        cov.refused_opens,
        cov.check_named,
    );
    assert!(cov.faults > n && cov.checkpoint_and_record > 0);
    assert!(cov.failed_reads > 0 && cov.own_record_hits > 0 && cov.check_named > 0);
    assert!(cov.refused_opens > 0, "damage never made recovery refuse");
}

/// Seed 2935 (found by a 4000-seed run): a misdirected write destroyed the
/// records after the chain's end in one segment, and the next segment,
/// which holds the SYNCED records certifying them, had an unreadable
/// sector. The search for certifying records skipped that whole segment,
/// so open succeeded without them (lba 9 read an older version); it now
/// reads the segment around the unreadable sector and refuses the open.
#[test]
fn regression_seed_2935_an_unreadable_sector_hides_no_certifying_record() {
    run_seed(2935, None, &mut Coverage::default());
}

/// Seed 2392 (found by a 3000-seed run once fingerprint tables moved the
/// log's layout): a write refused with NoSpace changed nothing, but the
/// oracle had already counted it as written, so the next flush made it
/// "certified" and repair was blamed for not returning data that was
/// never stored. The oracle now learns only writes that went in.
#[test]
fn regression_seed_2392_a_write_refused_for_space_is_not_in_the_oracle() {
    run_seed(2392, None, &mut Coverage::default());
}

/// Seed 794 (found by a 2000-seed run once a third of the seeds kept their
/// metadata on a separate device): damage left no usable checkpoint, and
/// repair rebuilt the map from every record of the log; the log was to go
/// on after its newest record, which was a commit on the metadata device,
/// and the open asserted that the data head lay in the data store. The
/// rebuild now goes on after the newest record in the data store.
#[test]
fn regression_seed_794_a_rebuild_from_the_log_goes_on_in_the_data_store() {
    run_seed(794, None, &mut Coverage::default());
}

/// Seed 1181: a misdirected write of zeros landed on the log's last three
/// KiB after a power cut. It destroyed the records of the last two flushes
/// (a TRIM of lba 82 among them) together with both SYNCED records that
/// certified them, so nothing left in the log said they had been flushed:
/// the chain ended early and open served lba 82's older data. The flush
/// mark outside the log still certifies the earlier flush: open refuses,
/// and repair names what it cannot tell.
#[test]
fn regression_seed_1181_misdirected_write_over_the_log_tail() {
    run_seed(1181, None, &mut Coverage::default());
}
