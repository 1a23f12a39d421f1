//! State-machine property test: the volume against a plain byte array,
//! through writes (aligned and not), trims, write-zeroes, flushes,
//! checkpoints and clean reopens. Also checks the space accounting:
//! mapped_bytes is exactly 4 KiB per block of the model holding non-zero data.
mod common;
use common::BS;
use cvol_engine::{Codec, Volume};
use cvol_storage::SimStorage;
use proptest::prelude::*;
use std::sync::Arc;

const BLOCKS: usize = 256;
const SIZE: usize = BLOCKS * BS;

#[derive(Debug, Clone)]
enum Op {
    Write {
        off: usize,
        len: usize,
        seed: u8,
        zero_ratio: u8,
    },
    Trim {
        off: usize,
        len: usize,
    },
    Zero {
        off: usize,
        len: usize,
        no_hole: bool,
    },
    Flush,
    Checkpoint,
    Reopen,
    Read {
        off: usize,
        len: usize,
    },
}

fn range() -> impl Strategy<Value = (usize, usize)> {
    prop_oneof![
        (0..BLOCKS, 1..16usize).prop_map(|(b, n)| (b * BS, n.min(BLOCKS - b) * BS)),
        (0..SIZE - 1, 1..20_000usize).prop_map(|(o, l)| (o, l.min(SIZE - o))),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (range(), any::<u8>(), 0..4u8).prop_map(|((off, len), seed, zero_ratio)| Op::Write { off, len, seed, zero_ratio }),
        1 => range().prop_map(|(off, len)| Op::Trim { off, len }),
        1 => (range(), any::<bool>()).prop_map(|((off, len), no_hole)| Op::Zero { off, len, no_hole }),
        1 => Just(Op::Flush),
        1 => Just(Op::Checkpoint),
        1 => Just(Op::Reopen),
        2 => range().prop_map(|(off, len)| Op::Read { off, len }),
    ]
}

/// Compressible text, with some all-zero 4 KiB stretches.
fn data(len: usize, seed: u8, zero_ratio: u8) -> Vec<u8> {
    let text = format!("seed {seed} some words that repeat ");
    let mut v: Vec<u8> = text.bytes().cycle().take(len).collect();
    if zero_ratio > 0 {
        for (i, c) in v.chunks_mut(BS).enumerate() {
            if (i + seed as usize).is_multiple_of(5 - zero_ratio as usize) {
                c.fill(0);
            }
        }
    }
    v
}

fn check_stats(vol: &Volume, model: &[u8]) {
    let nonzero = model
        .chunks(BS)
        .filter(|b| b.iter().any(|&x| x != 0))
        .count() as u64;
    let s = vol.stats();
    assert_eq!(s.mapped_bytes, nonzero * BS as u64, "mapped_bytes");
    assert_eq!(
        s.mapped_bytes + s.zero_bytes + s.unmapped_bytes,
        SIZE as u64
    );
    assert_eq!(
        s.codec_lz4_blocks + s.codec_none_blocks + s.codec_zstd_blocks,
        nonzero
    );
    assert!(s.stored_bytes <= s.mapped_bytes);
    assert!(s.dedup.dedup_saved_bytes <= s.mapped_bytes);
    if let Err(e) = vol.verify_refcounts() {
        panic!("reference counts: {e}");
    }
}

fn run(ops: Vec<Op>, codec: Codec, dedup: bool) {
    let sim = SimStorage::new(48 << 20);
    let opts = common::options(&sim, SIZE as u64)
        .with_codec(codec)
        .with_dedup(dedup);
    let mut vol = common::create(&sim, &opts);
    let mut model = vec![0u8; SIZE];
    for op in ops {
        match op {
            Op::Write {
                off,
                len,
                seed,
                zero_ratio,
            } => {
                let d = data(len, seed, zero_ratio);
                vol.write_at(off as u64, &d, false).unwrap();
                model[off..off + len].copy_from_slice(&d);
            }
            Op::Trim { off, len } => {
                vol.trim(off as u64, len as u64, false).unwrap();
                let (first, end) = (off.div_ceil(BS), (off + len) / BS);
                if first < end {
                    model[first * BS..end * BS].fill(0);
                }
            }
            Op::Zero { off, len, no_hole } => {
                vol.write_zeroes(off as u64, len as u64, no_hole, false)
                    .unwrap();
                model[off..off + len].fill(0);
            }
            Op::Flush => vol.flush().unwrap(),
            Op::Checkpoint => vol.checkpoint().unwrap(),
            Op::Reopen => {
                vol.close().unwrap();
                drop(vol);
                vol = common::open(&sim);
            }
            Op::Read { off, len } => {
                let mut b = vec![0u8; len];
                vol.read_at(off as u64, &mut b).unwrap();
                prop_assert_eq_bytes(&b, &model[off..off + len], off);
            }
        }
        check_stats(&vol, &model);
    }
    let mut all = vec![0u8; SIZE];
    vol.read_at(0, &mut all).unwrap();
    prop_assert_eq_bytes(&all, &model, 0);
    let rep = cvol_engine::check::check_volume(&sim, &mut |_, _| {});
    assert!(rep.consistent(), "{:?}", rep.errors);
}

fn prop_assert_eq_bytes(got: &[u8], want: &[u8], base: usize) {
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("byte {} differs: got {} want {}", base + i, got[i], want[i]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn volume_matches_model_lz4(ops in proptest::collection::vec(op(), 1..60)) {
        run(ops, Codec::Lz4, true);
    }

    #[test]
    fn volume_matches_model_zstd(ops in proptest::collection::vec(op(), 1..40)) {
        run(ops, Codec::Zstd(5), false);
    }
}

#[test]
fn concurrent_writers_and_readers_on_disjoint_ranges() {
    let sim = SimStorage::new(64 << 20);
    let opts = common::options(&sim, 16 << 20);
    let vol = Arc::new(common::create(&sim, &opts));
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let vol = vol.clone();
            std::thread::spawn(move || {
                let base = t as usize * (4 << 20);
                for round in 0..20u8 {
                    for i in 0..16usize {
                        let off = base + i * 65536 + (round as usize % 3) * 100;
                        let d = data(60_000, round.wrapping_add(t), 0);
                        vol.write_at(off as u64, &d, round % 5 == 0).unwrap();
                        let mut b = vec![0u8; d.len()];
                        vol.read_at(off as u64, &mut b).unwrap();
                        prop_assert_eq_bytes(&b, &d, off);
                    }
                    if round % 4 == 0 {
                        vol.flush().unwrap();
                    }
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    vol.close().unwrap();
    assert!(cvol_engine::check::check_volume(&sim, &mut |_, _| {}).consistent());
}
