//! The pool table's two slots (docs/FORMAT.md "Pools"): open takes the
//! newest table that decodes, reading the older slot's payload only when
//! the newest does not decode.
mod common;
use common::pools::raw_table;
use common::{BS, MIB};
use cvol_engine::pool::Pool;
use cvol_engine::{OpenOptions, Volume};
use cvol_format::pool::POOL_SLOT_OFFSETS;
use cvol_storage::{SimConfig, SimStorage};
use std::sync::Arc;

const BSU: u64 = BS as u64;

/// A pool of 12 MiB with a 256-block `default`.
fn new_pool() -> (SimStorage, Pool) {
    let store = SimStorage::new(12 * MIB);
    let opts = common::options(&store, 256 * BSU);
    let pool = Pool::create(Arc::new(store.clone()), &opts).expect("create a pool");
    (store, pool)
}

fn open_pool(store: &SimStorage) -> Pool {
    let vol = Volume::open(Arc::new(store.clone()), OpenOptions::default())
        .unwrap_or_else(|e| panic!("reopen: {e}"));
    Pool::attach(Arc::new(vol)).unwrap_or_else(|e| panic!("attach: {e}"))
}

/// A closed pool whose newest table (generation returned) names `default`,
/// `x` and `y`, and whose previous one `default` and `x`.
fn two_tables() -> (SimStorage, u64) {
    let (store, pool) = new_pool();
    pool.create_volume("x", 64 * BSU).unwrap();
    pool.create_volume("y", 64 * BSU).unwrap();
    pool.engine().close().unwrap();
    drop(pool);
    let gen = raw_table(&store, &read_uuid(&store)).generation;
    (store, gen)
}

fn read_uuid(store: &SimStorage) -> [u8; 16] {
    cvol_engine::read_superblock(store)
        .expect("a superblock")
        .0
        .uuid
}

/// A table slot that fails to read is an invalid slot: the pool opens
/// with the other one (as it does when a slot's checksum fails).
#[test]
fn an_unreadable_table_slot_leaves_the_other() {
    let (store, gen) = two_tables();
    for (slot, names) in [
        (gen % 2, vec!["default", "x"]),
        (1 - gen % 2, vec!["default", "x", "y"]),
    ] {
        let off = POOL_SLOT_OFFSETS[slot as usize];
        store.set_config(SimConfig {
            bad_read_ranges: vec![(off, off + 512)],
            ..SimConfig::default()
        });
        let pool = open_pool(&store);
        let got: Vec<_> = pool.volumes().into_iter().map(|v| v.name).collect();
        assert_eq!(got, names, "slot {slot} unreadable");
    }
}

/// Open reads the payload of the slot whose header names the newest
/// generation and the other slot's only if that one does not decode: a
/// newest table damaged past its header (its payload checksum fails)
/// leaves the previous one, and damage to the previous one's payload
/// changes nothing.
#[test]
fn a_damaged_newest_table_payload_leaves_the_previous_table() {
    let (store, gen) = two_tables();
    for (slot, names) in [
        (1 - gen % 2, vec!["default", "x", "y"]),
        (gen % 2, vec!["default", "x"]),
    ] {
        let s = store.snapshot_live();
        // A byte of the payload, after the 48-byte header.
        s.flip_bit(POOL_SLOT_OFFSETS[slot as usize] + 60, 3);
        let pool = open_pool(&s);
        let got: Vec<_> = pool.volumes().into_iter().map(|v| v.name).collect();
        assert_eq!(got, names, "payload of slot {slot} damaged");
    }
}
