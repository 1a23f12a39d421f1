//! What the pool simulations (`pool_sim.rs`, `snap_sim.rs`) share: where
//! their workloads write, the sizes of their volumes.
use cvol_engine::VolError;
use cvol_format::pool::EXTENT_BLOCKS;
use rand::{rngs::StdRng, Rng};

/// A block the workload touches: near the start, near the end, or around
/// an extent boundary inside a volume of `blocks`, within `hot` blocks.
pub fn hot_block(rng: &mut StdRng, blocks: u64, hot: u64) -> u64 {
    let near = |at: u64, rng: &mut StdRng| at.saturating_sub(hot) + rng.gen_range(0..2 * hot);
    let b = match rng.gen_range(0..3) {
        0 => rng.gen_range(0..hot),
        1 => near(blocks, rng),
        _ => near(
            EXTENT_BLOCKS * rng.gen_range(1..=blocks.div_ceil(EXTENT_BLOCKS)),
            rng,
        ),
    };
    b.min(blocks - 1)
}

/// A volume size in blocks: small (`ways - 2` chances in `ways`), or just
/// below or above an extent boundary (two extents).
pub fn size_blocks(rng: &mut StdRng, hot: u64, ways: u32) -> u64 {
    match rng.gen_range(0..ways) {
        0 => EXTENT_BLOCKS - rng.gen_range(0..hot),
        1 => EXTENT_BLOCKS + rng.gen_range(1..2 * hot),
        _ => rng.gen_range(8..4 * hot),
    }
}

/// An error the injected faults cause.
pub fn is_io(e: &VolError) -> bool {
    matches!(e, VolError::Io(_) | VolError::Poisoned)
}
