//! What the seeded simulations (crash_sim, fault_sim) share: the oracle of
//! what every block may read after a crash, the random block contents and
//! the random volume configuration of a seed.
use cvol_engine::{Codec, CodecPolicy, ElasticConfig};
use rand::{rngs::StdRng, Rng};
use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::ops::Range;

use super::BS;

/// The hash the model keeps of a block's contents.
pub fn h(b: &[u8]) -> u64 {
    let mut s = std::collections::hash_map::DefaultHasher::new();
    b.hash(&mut s);
    s.finish()
}

/// The oracle: what each block may hold, exactly as cvol promises it.
/// - `allowed`: after a crash without damage, its version at the last
///   completed flush (or FUA write of it) or any later write;
/// - `certified`: with damage at rest, its version at the last *certified*
///   flush or any later write. A completed flush certifies the flush
///   before it (its SYNCED record); a checkpoint or a clean close certifies
///   everything. Only the records of the very last flush before a power
///   cut are uncertified: damage to them may roll those blocks back to the
///   previous flush, never further, and never to zeros they did not hold;
/// - `history`: every version it ever held (zeros included), for the
///   single case where repair itself says it cannot tell (records
///   destroyed with their headers).
///
/// `certified` ⊇ `allowed` and `history` ⊇ `certified` always hold: every
/// write adds its version to all three, and only `allowed` ever shrinks
/// below what `certified` holds.
pub struct Model {
    /// What the client wrote last, block after block.
    pub cur: Vec<u8>,
    pub allowed: Vec<HashSet<u64>>,
    pub certified: Vec<HashSet<u64>>,
    pub history: Vec<HashSet<u64>>,
    /// Written since the last flush (so a flush syncs something new).
    dirty: bool,
}

impl Model {
    /// A volume of `blocks` blocks of zeros.
    pub fn new(blocks: usize) -> Model {
        let zero = h(&[0u8; BS]);
        Model {
            cur: vec![0u8; blocks * BS],
            allowed: vec![HashSet::from([zero]); blocks],
            certified: vec![HashSet::from([zero]); blocks],
            history: vec![HashSet::from([zero]); blocks],
            dirty: false,
        }
    }

    fn block(&self, b: usize) -> &[u8] {
        &self.cur[b * BS..(b + 1) * BS]
    }

    /// Records a write that may or may not persist.
    pub fn written(&mut self, offset: usize, data: &[u8]) {
        self.cur[offset..offset + data.len()].copy_from_slice(data);
        for b in offset / BS..(offset + data.len()).div_ceil(BS) {
            let v = h(self.block(b));
            self.allowed[b].insert(v);
            self.certified[b].insert(v);
            self.history[b].insert(v);
        }
        self.dirty = true;
    }

    /// A completed FUA write: `blocks` are durable with their current
    /// content. Certification is left as it is (a stricter `allowed` only;
    /// crash_sim, the one user, checks `allowed`).
    pub fn durable(&mut self, blocks: Range<usize>) {
        for b in blocks {
            self.allowed[b] = HashSet::from([h(self.block(b))]);
        }
    }

    /// A completed client flush: every block is durable with its current
    /// content, and the previous flush is certified.
    pub fn flushed(&mut self) {
        if self.dirty {
            self.certified = self.allowed.clone();
        }
        self.durable(0..self.allowed.len());
        self.dirty = false;
    }

    /// A checkpoint or a clean close: everything is certified.
    pub fn checkpointed(&mut self) {
        self.flushed();
        self.certified = self.allowed.clone();
    }

    /// After recovery: what the volume holds now is the new durable state.
    /// It is certified only by the next flush that writes something (the
    /// records a crash left uncertified stay so until then), so the
    /// versions certified before stay possible too.
    pub fn reset_to(&mut self, image: Vec<u8>) {
        for (b, blk) in image.chunks(BS).enumerate() {
            self.allowed[b] = HashSet::from([h(blk)]);
            self.certified[b].insert(h(blk));
        }
        self.cur = image;
        self.dirty = false;
    }
}

/// `len` bytes of block contents: one time in `kinds` zeros, one time
/// random, else `text(tag)` repeated, the tag half the time from a small
/// pool so that dedup finds repeats.
pub fn content(rng: &mut StdRng, len: usize, kinds: u32, text: fn(u32) -> String) -> Vec<u8> {
    match rng.gen_range(0..kinds) {
        0 => vec![0u8; len],
        1 => (0..len).map(|_| rng.gen()).collect(),
        _ => {
            let tag: u32 = if rng.gen_bool(0.5) {
                rng.gen_range(0..8)
            } else {
                rng.gen()
            };
            text(tag)
                .into_bytes()
                .into_iter()
                .cycle()
                .take(len)
                .collect()
        }
    }
}

/// `len` bytes (whole blocks) copied from a random place of `cur`, the
/// blocks a volume holds now: written at another place, they are
/// duplicates that the dedup index may have forgotten and only the
/// fingerprint tables still know.
pub fn copy_of(rng: &mut StdRng, cur: &[u8], len: usize) -> Vec<u8> {
    assert!(
        len.is_multiple_of(BS) && len <= cur.len(),
        "whole blocks of the volume"
    );
    let from = rng.gen_range(0..=(cur.len() - len) / BS) * BS;
    cur[from..from + len].to_vec()
}

/// The codec policies a seed picks from. (The simulations draw the index
/// differently, a `usize` or a `u32`: each keeps the seeds it had.)
pub fn codec_policies() -> [CodecPolicy; 4] {
    [
        Codec::Lz4.into(),
        Codec::Zstd(1).into(),
        Codec::None.into(),
        CodecPolicy::Auto {
            strong: Codec::Zstd(3),
        },
    ]
}

/// Elastic settings for one seed: a unit size, and load thresholds that
/// pin the auto policy to one load level (the measured load depends on
/// timing, which a seed must not).
pub fn elastic(rng: &mut StdRng) -> ElasticConfig {
    let (busy_iops, idle_iops) =
        [(0, 0), (u64::MAX, 0), (u64::MAX, u64::MAX - 1)][rng.gen_range(0..3)];
    ElasticConfig {
        unit_blocks: [1, 4, 8, 16][rng.gen_range(0..4)],
        busy_iops,
        idle_iops,
        busy_inflight: usize::MAX,
        // Busy seeds defer compression half the time (every multi-block
        // unit raw, for background recompression): deterministic, unlike
        // the CPU budget.
        inline_cpu_percent: [None, Some(0)][rng.gen_range(0..2)],
        ..ElasticConfig::default()
    }
}

/// A seed's time: a `ManualClock` that moves 0-2 ms per operation, drawn
/// from its own generator (the operations' draws stay what they were), so
/// the seed fixes every decision the codec policy's load monitor and CPU
/// budget make.
pub struct SimClock {
    pub clock: std::sync::Arc<cvol_engine::clock::ManualClock>,
    rng: StdRng,
}

impl SimClock {
    pub fn new(seed: u64) -> SimClock {
        use rand::SeedableRng;
        SimClock {
            clock: std::sync::Arc::new(cvol_engine::clock::ManualClock::new()),
            rng: StdRng::seed_from_u64(seed ^ 0xC10C_C10C),
        }
    }

    /// The clock to open the seed's volumes with.
    pub fn shared(&self) -> std::sync::Arc<dyn cvol_engine::clock::Clock> {
        self.clock.clone()
    }

    /// The time one operation takes.
    pub fn tick(&mut self) {
        let us = self.rng.gen_range(0..2000);
        self.clock.advance(std::time::Duration::from_micros(us));
    }
}
