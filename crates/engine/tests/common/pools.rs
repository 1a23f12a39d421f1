//! What the pool simulations (`pool_sim.rs`, `snap_sim.rs`) share: where
//! their workloads write, the sizes of their volumes, the table on the
//! store, power cuts, resizing the pool's store.
use super::sim::h;
use super::MIB;
use cvol_engine::pool::Pool;
use cvol_engine::{ResizeError, VolError};
use cvol_format::pool::{PoolTable, EXTENT_BLOCKS, POOL_HEADER_BYTES};
use cvol_format::pool::{POOL_SLOT_BYTES, POOL_SLOT_OFFSETS};
use cvol_storage::{SimStorage, Storage};
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

/// The newest valid table on the store, read the way `Pool::attach` does.
pub fn raw_table(store: &dyn Storage, uuid: &[u8; 16]) -> PoolTable {
    let seal = super::sealed::current_sealer(store);
    let mut best: Option<PoolTable> = None;
    for off in POOL_SLOT_OFFSETS {
        let mut b = vec![0u8; POOL_SLOT_BYTES as usize];
        store.read_at(off, &mut b).expect("read a table slot");
        let Ok(n) = PoolTable::payload_len(&b, uuid) else {
            continue;
        };
        if let Ok(t) = PoolTable::decode_with(&b[..POOL_HEADER_BYTES + n], uuid, seal.as_deref()) {
            if best.as_ref().is_none_or(|b| b.generation < t.generation) {
                best = Some(t);
            }
        }
    }
    best.expect("a valid table")
}

/// A power cut: unsynced writes kept, dropped or torn at random, or all
/// kept but some sectors.
pub fn power_cut(store: &SimStorage, rng: &mut StdRng) -> SimStorage {
    if rng.gen_ratio(3, 4) {
        store.crash(rng.gen())
    } else {
        let salt: u64 = rng.gen();
        store.crash_dropping(move |s| h(&(s ^ salt).to_le_bytes()).is_multiple_of(3))
    }
}

/// How a resize of a pool's store ended.
pub enum StoreResize {
    Done,
    /// Refused (the end not free, too little room left): nothing changed.
    Refused,
    /// The store failed under it.
    Failed,
}

/// Resizes the store of `pool` (1 MiB segments, `cur` bytes) by a few
/// segments up or down, within [`min`, `max`] bytes (`arm` is called
/// just before): the size asked for, and how it ended.
pub fn resize_store(
    pool: &Pool,
    rng: &mut StdRng,
    cur: u64,
    (min, max): (u64, u64),
    arm: &dyn Fn(),
) -> (u64, StoreResize) {
    let segs = (cur - MIB) / MIB;
    let k = match rng.gen_bool(0.5) {
        true => segs + rng.gen_range(1..=6),
        false => segs.saturating_sub(rng.gen_range(1..=4)),
    };
    let want = match (MIB + k * MIB).clamp(min, max) {
        w if w != cur => w,
        _ if cur < max => cur + MIB,
        _ => cur - MIB,
    };
    let free = || pool.engine().stats().segments_free;
    let before = free();
    arm();
    let how = match pool.engine().resize_physical(want) {
        Ok(sizes) => {
            assert_eq!(sizes, (cur, want), "a resize of the store");
            // The segments added are free, those dropped were.
            let after = (before * MIB + want).checked_sub(cur).map(|b| b / MIB);
            assert_eq!(Some(free()), after, "free segments after {cur} -> {want}");
            StoreResize::Done
        }
        Err(ResizeError::Busy { .. } | ResizeError::TooFull { .. }) if want < cur => {
            StoreResize::Refused
        }
        Err(ResizeError::Vol(e)) if is_io(&e) => StoreResize::Failed,
        // The simulated store failed to change its length.
        Err(ResizeError::Backing(_)) => StoreResize::Failed,
        Err(e) => panic!("a resize of the store from {cur} to {want}: {e}"),
    };
    (want, how)
}
