//! Units without a row: a unit (a record of several blocks)
//! has a row in the shared table only while dedup references point into
//! it; otherwise its liveness is read from its window of the map, where
//! all its owner entries lie. RAM then no longer grows with the units
//! written, and the tables a checkpoint persists carry no row per unit.
mod common;
use common::{BS, MIB};
use cvol_engine::Volume;
use cvol_storage::SimStorage;

/// Unit size of these volumes (the default: 16 KiB).
const UNIT: u64 = 4;

fn write(vol: &Volume, lba: u64, data: &[u8]) {
    vol.write_at(lba * BS as u64, data, false).unwrap();
}

fn read(vol: &Volume, lba: u64, blocks: usize) -> Vec<u8> {
    let mut b = vec![0u8; blocks * BS];
    vol.read_at(lba * BS as u64, &mut b).unwrap();
    b
}

#[test]
fn units_without_references_take_no_row() {
    let sim = SimStorage::new(64 * MIB);
    let vol = common::create(&sim, &common::options(&sim, 32 * MIB));
    let empty = vol.stats().dedup.dedup_shared_table_bytes;
    // 512 units of 4 blocks, unique data.
    write(&vol, 0, &common::text(1, 2048 * BS));
    let st = vol.stats();
    assert_eq!(st.elastic.units_written, 512);
    assert_eq!(st.dedup.dedup_shared_records, 0);
    assert!(
        st.dedup.dedup_shared_table_bytes <= empty + 64,
        "rows for units without references: {} bytes",
        st.dedup.dedup_shared_table_bytes
    );
    vol.verify_refcounts().unwrap();
    // A unit dies with its last block: overwrite one unit block by block.
    let stored = vol.stats().stored_bytes;
    for k in 0..UNIT {
        write(&vol, 8 + k, &common::text(100 + k, BS));
        vol.verify_refcounts().unwrap();
        let now = vol.stats().stored_bytes;
        if k + 1 < UNIT {
            assert!(now > stored, "block {k}: the unit is still live");
        }
    }
    let st = vol.stats();
    // The four single blocks replaced one unit: stored bytes changed by
    // exactly their records less the unit's.
    assert_eq!(st.dedup.dedup_shared_records, 0);
    vol.close().unwrap();
    drop(vol);
    let vol = common::open(&sim);
    assert!(vol.opened_from_tables());
    vol.verify_refcounts().unwrap();
    assert_eq!(vol.stats().stored_bytes, st.stored_bytes);
    common::close_and_check(vol, &sim);
}

#[test]
fn a_reference_keeps_a_unit_alive_after_its_owners_move_on() {
    let sim = SimStorage::new(64 * MIB);
    let vol = common::create(&sim, &common::options(&sim, 32 * MIB));
    let unit = common::text(7, UNIT as usize * BS);
    write(&vol, 0, &unit);
    // Block 2 of the unit, written again far away: a reference into it.
    let far = 5000;
    write(&vol, far, &unit[2 * BS..3 * BS]);
    let st = vol.stats();
    assert_eq!(st.dedup.dedup_hits, 1);
    assert_eq!(st.dedup.dedup_shared_records, 1);
    vol.verify_refcounts().unwrap();
    // Every owner moves on: only the reference holds the unit.
    write(&vol, 0, &common::text(8, UNIT as usize * BS));
    vol.verify_refcounts().unwrap();
    assert_eq!(read(&vol, far, 1), unit[2 * BS..3 * BS]);
    assert_eq!(vol.stats().dedup.dedup_shared_records, 1);
    vol.close().unwrap();
    drop(vol);
    let vol = common::open(&sim);
    assert!(vol.opened_from_tables());
    vol.verify_refcounts().unwrap();
    assert_eq!(read(&vol, far, 1), unit[2 * BS..3 * BS]);
    // The reference goes: the unit dies.
    let stored = vol.stats().stored_bytes;
    write(&vol, far, &common::text(9, BS));
    vol.verify_refcounts().unwrap();
    let st = vol.stats();
    assert_eq!(st.dedup.dedup_shared_records, 0);
    assert!(st.stored_bytes < stored + 4 * BS as u64);
    common::close_and_check(vol, &sim);
}

/// Roll-forward replays a reference into a unit that had no row at the
/// checkpoint, whose window it did not change: open reads the unit's
/// header to find its window and counts the owners there, instead of
/// rebuilding every table from the whole map.
#[test]
fn regression_replayed_reference_into_a_unit_of_an_unchanged_window() {
    let sim = SimStorage::new(64 * MIB);
    let vol = common::create(&sim, &common::options(&sim, 32 * MIB));
    let unit = common::text(11, UNIT as usize * BS);
    write(&vol, 40, &unit);
    // Other pages, so the unit's page is one of several.
    write(&vol, 3000, &common::text(12, 64 * BS));
    vol.flush().unwrap();
    vol.checkpoint().unwrap();
    // After the checkpoint: a reference into the unit from another map
    // page, and one of its owners overwritten in a second case below.
    write(&vol, 6000, &unit[BS..2 * BS]);
    vol.flush().unwrap();
    assert_eq!(vol.stats().dedup.dedup_hits, 1);
    drop(vol); // a crash after the flush
    let vol = common::open(&sim);
    assert_eq!(vol.tables_rejected(), None);
    assert!(vol.opened_from_tables(), "tables and the pages replayed");
    vol.verify_refcounts().unwrap();
    assert_eq!(read(&vol, 6000, 1), unit[BS..2 * BS]);
    assert_eq!(read(&vol, 40, UNIT as usize), unit);
    // Now the owners go after a checkpoint that has the row, and a
    // crash: the row's owners are counted out in the window replayed.
    vol.checkpoint().unwrap();
    write(&vol, 40, &common::text(13, UNIT as usize * BS));
    vol.flush().unwrap();
    drop(vol);
    let vol = common::open(&sim);
    assert_eq!(vol.tables_rejected(), None);
    assert!(vol.opened_from_tables());
    vol.verify_refcounts().unwrap();
    assert_eq!(read(&vol, 6000, 1), unit[BS..2 * BS]);
    common::close_and_check(vol, &sim);
}
