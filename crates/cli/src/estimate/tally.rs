//! The estimator proper: blocks in, counts out. Knows nothing of files
//! or NBD; `feed` takes buffers of whole 4 KiB blocks that start on a
//! compression-unit boundary.
//!
//! Dedup by hash sampling (the trick behind `zdb -S`-style estimates and
//! VDO's sparse index): every non-zero block read is fingerprinted, and
//! only fingerprints in a fixed 1/`fp_modulus` subset of the hash space
//! are remembered. Whether a block is in the subset depends on its content
//! alone, so every copy of a block is in or out together: the ratio of
//! blocks to distinct blocks inside the subset is an unbiased estimate of
//! the whole data's dedup ratio, in memory bounded by the subset's size.
//!
//! Compression: the first occurrence of a fingerprint in a smaller nested
//! subset (1/`compress_modulus`) is compressed as cvol would store it: the
//! run of contiguous non-zero blocks of its aligned compression unit, the
//! compressibility probe first, then the codec (kept only if it saves at
//! least 1/8, as the engine does). Its share of the unit's stored bytes
//! samples the stored bytes of the distinct data.
use cvol_engine::codec::Codec;
use cvol_engine::dedup::{fingerprint, key, volume_seed};
use cvol_engine::policy::probe_compressible;
use std::collections::HashSet;

/// A block, as cvol stores and deduplicates it.
pub const BS: usize = 4096;

/// What the estimator computes and how finely it samples.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// The codec the estimate is for (the first column).
    pub codec: Codec,
    /// Blocks per compression unit (a power of two, 1 to 16).
    pub unit_blocks: usize,
    /// Remember a fingerprint when its key is a multiple of this (a power
    /// of two; 1: every fingerprint).
    pub fp_modulus: u64,
    /// Compress a distinct block when its key is a multiple of this (a
    /// power of two, a multiple of `fp_modulus`).
    pub compress_modulus: u64,
}

/// Stored bytes of the compressed sample, per codec.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stored {
    /// Payload bytes (each sampled block's share of its unit's record).
    pub payload: f64,
    /// Records (each sampled block's share: 1 / blocks in its unit).
    pub records: f64,
}

/// Counts so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counts {
    /// Blocks read (the tail of a source not a multiple of 4 KiB counts
    /// as one block, zero-padded).
    pub blocks: u64,
    /// Of those, all zeros.
    pub zero_blocks: u64,
    /// Non-zero blocks whose fingerprint is in the remembered subset.
    pub kept_blocks: u64,
    /// Distinct fingerprints among them.
    pub kept_distinct: u64,
    /// Distinct blocks compressed (the compression sample).
    pub compressed_blocks: u64,
    /// With the configured codec.
    pub main: Stored,
    /// With lz4 (the codec cvol uses while busy).
    pub lz4: Stored,
}

/// What a unit is stored as, per codec: (payload bytes, records).
#[derive(Clone, Copy)]
struct Unit {
    main: (usize, usize),
    lz4: (usize, usize),
}

/// The estimator's state.
pub struct Tally {
    cfg: Config,
    seed: u64,
    seen: HashSet<u64>,
    counts: Counts,
    /// The unit last compressed: its first block, blocks, and what each
    /// codec stores for it, so two sampled blocks of one unit compress it
    /// once.
    last_unit: Option<(u64, usize, Unit)>,
}

impl Tally {
    pub fn new(cfg: Config) -> Tally {
        assert!(cfg.fp_modulus.is_power_of_two() && cfg.compress_modulus.is_power_of_two());
        assert!(cfg.compress_modulus >= cfg.fp_modulus);
        assert!(cfg.unit_blocks.is_power_of_two() && cfg.unit_blocks <= 16);
        Tally {
            cfg,
            // A fixed seed: the estimate does not depend on a volume.
            seed: volume_seed(&[0; 16]),
            seen: HashSet::new(),
            counts: Counts::default(),
            last_unit: None,
        }
    }

    pub fn counts(&self) -> &Counts {
        &self.counts
    }

    /// Takes `buf` (whole blocks; a short tail is zero-padded) whose first
    /// block is block `first` of the source, a multiple of the unit.
    pub fn feed(&mut self, first: u64, buf: &[u8]) {
        debug_assert!(first.is_multiple_of(self.cfg.unit_blocks as u64));
        let padded;
        let buf = if buf.len().is_multiple_of(BS) {
            buf
        } else {
            let mut v = buf.to_vec();
            v.resize(buf.len().next_multiple_of(BS), 0);
            padded = v;
            &padded
        };
        let zero: Vec<bool> = buf.chunks_exact(BS).map(is_zero).collect();
        for (i, block) in buf.chunks_exact(BS).enumerate() {
            self.counts.blocks += 1;
            if zero[i] {
                self.counts.zero_blocks += 1;
                continue;
            }
            let k = key(fingerprint(self.seed, block));
            if !k.is_multiple_of(self.cfg.fp_modulus) {
                continue;
            }
            self.counts.kept_blocks += 1;
            if !self.seen.insert(k) {
                continue;
            }
            self.counts.kept_distinct += 1;
            if k.is_multiple_of(self.cfg.compress_modulus) {
                self.sample_compression(first, buf, &zero, i);
            }
        }
    }

    /// Compresses block `i`'s unit (its run of contiguous non-zero blocks
    /// inside its aligned window) and counts the block's share.
    fn sample_compression(&mut self, first: u64, buf: &[u8], zero: &[bool], i: usize) {
        let unit = self.cfg.unit_blocks;
        let w0 = i / unit * unit;
        let w1 = (w0 + unit).min(zero.len());
        let start = (w0..i).rev().find(|&j| zero[j]).map_or(w0, |j| j + 1);
        let end = (i..w1).find(|&j| zero[j]).unwrap_or(w1);
        let n = end - start;
        let at = first + start as u64;
        let u = match self.last_unit {
            Some((a, m, u)) if a == at && m == n => u,
            _ => {
                let run = &buf[start * BS..end * BS];
                let probe = probe_compressible(run);
                let u = Unit {
                    main: stored_len(self.cfg.codec, run, probe),
                    lz4: stored_len(Codec::Lz4, run, probe),
                };
                self.last_unit = Some((at, n, u));
                u
            }
        };
        let c = &mut self.counts;
        c.compressed_blocks += 1;
        for (s, (payload, records)) in [(&mut c.main, u.main), (&mut c.lz4, u.lz4)] {
            s.payload += payload as f64 / n as f64;
            s.records += records as f64 / n as f64;
        }
    }
}

/// The payload bytes and records cvol stores for `run`: raw, one record
/// per block, when the probe judges it incompressible or the codec saves
/// less than 1/8; else one compressed record.
pub fn stored_len(codec: Codec, run: &[u8], probe: bool) -> (usize, usize) {
    let raw = (run.len(), run.len() / BS);
    if !probe {
        return raw;
    }
    codec.compress(run).map_or(raw, |c| (c.len(), 1))
}

pub fn is_zero(block: &[u8]) -> bool {
    // OR-folds of 64 bytes vectorise; data blocks stop at the first.
    block
        .chunks(64)
        .all(|c| c.iter().fold(0u8, |a, &b| a | b) == 0)
}
