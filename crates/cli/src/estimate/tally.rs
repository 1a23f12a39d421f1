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
//! run of contiguous new blocks (not zero, not a copy of an earlier block)
//! of its aligned compression unit, the compressibility probe first, then
//! the codec (kept only if it saves at least 1/8, as the engine does). Its
//! share of the unit's stored bytes samples the stored bytes of the
//! distinct data. A unit one of whose blocks is copied later is shared,
//! and policy auto does not recompress shared records: with
//! `shared_keep_lz4` its share counts at lz4 in the first column.
use cvol_engine::codec::Codec;
use cvol_engine::dedup::{fingerprint, key, volume_seed, FpKey};
use cvol_engine::policy::probe_compressible;
use std::collections::{HashMap, HashSet};

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
    /// A unit shared by dedup keeps lz4 in the first column: policy auto,
    /// whose background recompression leaves shared records as written
    /// (lz4 for a copy at full speed).
    pub shared_keep_lz4: bool,
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

/// A unit compressed for the sample.
struct Sampled {
    unit: Unit,
    blocks: usize,
    /// A later block is a copy of one of the unit's: the record is shared,
    /// and background recompression leaves shared records as written.
    shared: bool,
}

/// A block as the volume's write path sees it.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Zero,
    /// A copy of a block seen before: a dedup reference.
    Dup(u64),
    /// The first of its content.
    New(u64),
    /// Its fingerprint is outside the remembered part: new or not, unknown
    /// (taken as new data).
    Unknown,
}

/// The estimator's state.
pub struct Tally {
    cfg: Config,
    seed: FpKey,
    seen: HashSet<u64>,
    counts: Counts,
    /// The units compressed.
    units: Vec<Sampled>,
    /// Each sampled block's unit (an index into `units`).
    samples: Vec<usize>,
    /// The fingerprints of the new blocks of each sampled unit: which unit
    /// a later copy makes shared.
    owner: HashMap<u64, usize>,
    /// The unit last compressed (its first block, blocks, index), so two
    /// sampled blocks of one unit compress it once.
    last_unit: Option<(u64, usize, usize)>,
}

impl Tally {
    pub fn new(cfg: Config) -> Tally {
        assert!(cfg.fp_modulus.is_power_of_two() && cfg.compress_modulus.is_power_of_two());
        assert!(cfg.compress_modulus >= cfg.fp_modulus);
        assert!(cfg.unit_blocks.is_power_of_two() && cfg.unit_blocks <= 16);
        Tally {
            cfg,
            // A fixed seed: the estimate does not depend on a volume.
            seed: FpKey::Seed(volume_seed(&[0; 16])),
            seen: HashSet::new(),
            counts: Counts::default(),
            units: Vec::new(),
            samples: Vec::new(),
            owner: HashMap::new(),
            last_unit: None,
        }
    }

    /// The counts so far, the compressed sample summed.
    pub fn counts(&self) -> Counts {
        let mut c = self.counts.clone();
        for s in self.samples.iter().map(|&u| &self.units[u]) {
            let n = s.blocks as f64;
            let main = match s.shared && self.cfg.shared_keep_lz4 {
                true => s.unit.lz4,
                false => s.unit.main,
            };
            for (t, (payload, records)) in [(&mut c.main, main), (&mut c.lz4, s.unit.lz4)] {
                t.payload += payload as f64 / n;
                t.records += records as f64 / n;
            }
        }
        c.compressed_blocks = self.samples.len() as u64;
        c
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
        let kinds: Vec<Kind> = buf.chunks_exact(BS).map(|b| self.classify(b)).collect();
        for (i, &k) in kinds.iter().enumerate() {
            match k {
                Kind::New(k) if k.is_multiple_of(self.cfg.compress_modulus) => {
                    self.sample_compression(first, buf, &kinds, i)
                }
                _ => {}
            }
        }
        for &k in &kinds {
            if let Kind::Dup(k) = k {
                if let Some(&s) = self.owner.get(&k) {
                    self.units[s].shared = true;
                }
            }
        }
    }

    /// Counts one block and says what it is.
    fn classify(&mut self, block: &[u8]) -> Kind {
        self.counts.blocks += 1;
        if is_zero(block) {
            self.counts.zero_blocks += 1;
            return Kind::Zero;
        }
        let k = key(fingerprint(&self.seed, block));
        if !k.is_multiple_of(self.cfg.fp_modulus) {
            return Kind::Unknown;
        }
        self.counts.kept_blocks += 1;
        if !self.seen.insert(k) {
            return Kind::Dup(k);
        }
        self.counts.kept_distinct += 1;
        Kind::New(k)
    }

    /// Compresses block `i`'s unit as the write path would (its run of
    /// contiguous new blocks inside its aligned window: zeros and copies
    /// end a run) and keeps the block's share.
    fn sample_compression(&mut self, first: u64, buf: &[u8], kinds: &[Kind], i: usize) {
        let unit = self.cfg.unit_blocks;
        let data = |j: usize| matches!(kinds[j], Kind::New(_) | Kind::Unknown);
        let w0 = i / unit * unit;
        let w1 = (w0 + unit).min(kinds.len());
        let start = (w0..i).rev().find(|&j| !data(j)).map_or(w0, |j| j + 1);
        let end = (i..w1).find(|&j| !data(j)).unwrap_or(w1);
        let n = end - start;
        let at = first + start as u64;
        let u = match self.last_unit {
            Some((a, m, u)) if a == at && m == n => u,
            _ => {
                let run = &buf[start * BS..end * BS];
                let probe = probe_compressible(run);
                let u = self.units.len();
                self.units.push(Sampled {
                    unit: Unit {
                        main: stored_len(self.cfg.codec, run, probe),
                        lz4: stored_len(Codec::Lz4, run, probe),
                    },
                    blocks: n,
                    shared: false,
                });
                for &k in &kinds[start..end] {
                    if let Kind::New(k) = k {
                        self.owner.insert(k, u);
                    }
                }
                self.last_unit = Some((at, n, u));
                u
            }
        };
        self.samples.push(u);
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
