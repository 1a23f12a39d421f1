//! Write-behind outside the state lock: client writes copy the open
//! segment's filled sectors to storage after they drop the lock, so other
//! writers append while those copies run. A crash then must keep exactly
//! what FLUSH promised: every block of every writer reads back as the
//! version it had when that writer's last flush returned, or as one it
//! wrote after that flush (never an older version, never zeros). Several
//! writer threads and a flusher, with deferred compression on half the
//! rounds (raw 64 KiB units: the write-behind claims fill quickly).
//!
//! Regression (found by this test, from the group commit): a
//! flush that found its records synced by another returned without a sync
//! but reclaimed the segments empty *now*, emptied perhaps by records
//! appended since that sync; a crash then recovered a map that pointed
//! into a freed, hole-punched segment ("its records hold 0 bytes": 4 of
//! 360 rounds before the fix, 0 of 360 after).
mod common;
use common::{BS, MIB};
use cvol_engine::{Codec, CodecPolicy, ElasticConfig, OpenOptions, Volume};
use cvol_storage::SimStorage;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::time::{Duration, Instant};

const WRITERS: u64 = 3;
/// Blocks each writer owns (disjoint ranges).
const SLOTS: u64 = 512;
const WRITE_BLOCKS: u64 = 16;

/// Versions a writer's block may read back as after a crash.
#[derive(Default)]
struct Oracle {
    /// The version each block had at the last flush.
    flushed: HashMap<u64, u64>,
    /// Versions written since the last flush.
    since: HashMap<u64, Vec<u64>>,
}

/// Block `lba` of version `v`: the two numbers, then filler, random (the
/// probe stores it raw) or compressible.
fn block(lba: u64, v: u64, random: bool) -> Vec<u8> {
    let mut b = Vec::with_capacity(BS);
    b.extend_from_slice(&lba.to_le_bytes());
    b.extend_from_slice(&v.to_le_bytes());
    let mut x = (lba << 32 ^ v) | 1;
    while b.len() < BS {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b.push(if random {
            x as u8
        } else {
            (b.len() % 61) as u8
        });
    }
    b
}

fn writer(vol: &Volume, t: u64, seed: u64, until: Instant, random: bool) -> Oracle {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed * 100 + t);
    let first = t * SLOTS;
    let mut o = Oracle::default();
    let mut v = 0u64;
    while Instant::now() < until {
        let at = first + rng.gen_range(0..SLOTS / WRITE_BLOCKS) * WRITE_BLOCKS;
        v += 1;
        let data: Vec<u8> = (at..at + WRITE_BLOCKS)
            .flat_map(|l| block(l, v, random))
            .collect();
        vol.write_at(at * BS as u64, &data, false).unwrap();
        for l in at..at + WRITE_BLOCKS {
            o.since.entry(l).or_default().push(v);
        }
        if rng.gen_range(0..24) == 0 {
            vol.flush().unwrap();
            for (l, vs) in o.since.drain() {
                o.flushed.insert(l, *vs.last().expect("a version"));
            }
        }
    }
    o
}

fn round(seed: u64) {
    let sim = SimStorage::new(64 * MIB);
    // Odd seeds: compressible data, every unit deferred (stored raw);
    // even seeds: random data, stored raw by the probe.
    let defer = seed % 2 == 1;
    let opts = common::options(&sim, WRITERS * SLOTS * BS as u64).with_codec(CodecPolicy::Auto {
        strong: Codec::Zstd(3),
    });
    common::create_closed(&sim, &opts);
    let options = OpenOptions {
        elastic: ElasticConfig {
            busy_iops: 0,
            idle_iops: 0,
            recompress: defer,
            inline_cpu_percent: defer.then_some(0),
            ..ElasticConfig::default()
        },
        ..OpenOptions::default()
    };
    let vol = common::open_with(&sim, options.clone());
    let until = Instant::now() + Duration::from_millis(600);
    let oracles: Vec<Oracle> = std::thread::scope(|s| {
        // A flusher besides the writers' own flushes: flushes that find
        // their records synced by another return without a sync (group
        // commit), the path regression seed 3 / 6 / 9 / 12 went through.
        s.spawn(|| {
            while Instant::now() < until {
                vol.flush().unwrap();
                std::thread::sleep(Duration::from_micros(500));
            }
        });
        let hs: Vec<_> = (0..WRITERS)
            .map(|t| {
                let vol = &vol;
                s.spawn(move || writer(vol, t, seed, until, !defer))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let st = vol.stats();
    assert!(
        st.media_bytes_written > 8 * MIB,
        "seed {seed}: too little written to exercise write-behind"
    );
    assert_eq!(defer, st.elastic.deferred_blocks > 0, "seed {seed}");
    let crashed = sim.crash(seed);
    drop(vol);
    let vol = common::open_with(&crashed, options);
    vol.verify_refcounts()
        .unwrap_or_else(|e| panic!("seed {seed}: after recovery: {e}"));
    let rep = cvol_engine::check::check_volume(&crashed, &mut |_, _| {});
    assert!(
        rep.consistent(),
        "seed {seed}: check after recovery: {:?} (recovery notes {:?})",
        rep.errors,
        vol.recovery_warnings()
    );
    let mut buf = vec![0u8; BS];
    for (t, o) in oracles.iter().enumerate() {
        for l in t as u64 * SLOTS..(t as u64 + 1) * SLOTS {
            vol.read_at(l * BS as u64, &mut buf)
                .unwrap_or_else(|e| panic!("seed {seed}: writer {t} block {l}: {e}"));
            let flushed = o.flushed.get(&l).copied();
            let later = o.since.get(&l).map_or(&[][..], |v| &v[..]);
            let ok = flushed
                .into_iter()
                .chain(later.iter().copied())
                .any(|v| buf == block(l, v, !defer))
                || (flushed.is_none() && buf.iter().all(|&b| b == 0));
            assert!(
                ok,
                "seed {seed}: writer {t} block {l}: flushed {flushed:?}, later {later:?}, \
                 read {:?}",
                &buf[..16]
            );
        }
    }
    vol.close().unwrap();
}

#[test]
fn flushed_writes_survive_a_crash_with_write_behinds_in_flight() {
    let rounds = std::env::var("CVOL_WRITE_BEHIND_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(16u64);
    for seed in 1..=rounds {
        round(seed);
    }
}
