//! Damaged media: a flipped bit costs exactly the blocks it hits, metadata
//! copies cover each other, and `check` names what is wrong.
use cvol_engine::{check, Codec, CreateOptions, OpenOptions, VolError, Volume};
use cvol_storage::{SimStorage, Storage};
use std::sync::Arc;

const BS: u64 = 4096;
const MIB: u64 = 1 << 20;

fn block(i: u64) -> Vec<u8> {
    format!("block number {i} with some repeated text ")
        .bytes()
        .cycle()
        .take(BS as usize)
        .collect()
}

fn volume_with_data(sim: &SimStorage) -> Volume {
    let opts = CreateOptions {
        logical_size_bytes: 4 * MIB,
        physical_size_bytes: sim.len_bytes(),
        codec: Codec::Lz4.into(),
        segment_size_bytes: MIB,
        dedup: true,
        packing: Default::default(),
        pool: false,
        encryption: None,
    };
    let vol = Volume::create(Arc::new(sim.clone()), &opts).unwrap();
    for i in 0..64 {
        vol.write_at(i * BS, &block(i), false).unwrap();
    }
    vol.close().unwrap();
    vol
}

/// Byte offset of the DATA record holding `lba` (found by scanning headers).
fn record_offset(sim: &SimStorage, lba: u64) -> u64 {
    let mut img = vec![0u8; sim.len_bytes() as usize];
    sim.read_at(0, &mut img).unwrap();
    (0..img.len() - 44)
        .find(|&i| {
            img[i..i + 4] == 0x524c_5643u32.to_le_bytes()
                && img[i + 4] == 1
                && img[i + 24..i + 32] == lba.to_le_bytes()
        })
        .unwrap() as u64
}

#[test]
fn flipped_bit_fails_only_that_block_and_check_names_it() {
    let sim = SimStorage::new(8 * MIB);
    drop(volume_with_data(&sim));
    let at = record_offset(&sim, 17);
    sim.flip_bit(at + 60, 3);
    let vol = Volume::open(Arc::new(sim.clone()), OpenOptions::default()).unwrap();
    let mut b = vec![0u8; BS as usize];
    match vol.read_at(17 * BS, &mut b) {
        Err(VolError::Corrupt { lba, .. }) => assert_eq!(lba, 17),
        other => panic!("expected a corrupt-block error, got {other:?}"),
    }
    for i in (0..64).filter(|&i| i != 17) {
        vol.read_at(i * BS, &mut b).unwrap();
        assert!(b == block(i), "block {i}");
    }
    assert_eq!(vol.stats().corrupt_reads, 1);
    drop(vol);
    let rep = check::check_volume(&sim, &mut |_, _| {});
    assert!(!rep.consistent());
    assert!(
        rep.errors.iter().any(|e| e.starts_with("lba 17 ")),
        "{:?}",
        rep.errors
    );
}

#[test]
fn misdirected_record_is_caught_by_the_map_checksum() {
    // Copy the record of lba 5 over the record of lba 6: a valid record, wrong place.
    let sim = SimStorage::new(8 * MIB);
    drop(volume_with_data(&sim));
    let (a, b) = (record_offset(&sim, 5), record_offset(&sim, 6));
    let mut rec = vec![0u8; 200];
    sim.read_at(a, &mut rec).unwrap();
    sim.write_at(b, &rec).unwrap();
    let vol = Volume::open(
        Arc::new(sim.clone()),
        OpenOptions {
            read_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    let mut buf = vec![0u8; BS as usize];
    assert!(matches!(
        vol.read_at(6 * BS, &mut buf),
        Err(VolError::Corrupt { lba: 6, .. })
    ));
    vol.read_at(5 * BS, &mut buf).unwrap();
}

#[test]
fn one_superblock_copy_lost_still_opens_and_check_reports_it() {
    let sim = SimStorage::new(8 * MIB);
    drop(volume_with_data(&sim));
    sim.flip_bit(40, 1); // inside copy A
    let vol = Volume::open(Arc::new(sim.clone()), OpenOptions::default()).unwrap();
    let mut b = vec![0u8; BS as usize];
    vol.read_at(3 * BS, &mut b).unwrap();
    assert!(b == block(3));
    drop(vol);
    let rep = check::check_volume(&sim, &mut |_, _| {});
    assert!(
        rep.errors.iter().any(|e| e.contains("superblock copy A")),
        "{:?}",
        rep.errors
    );
}

#[test]
fn corrupt_newest_checkpoint_pointer_falls_back_to_the_older_one() {
    let sim = SimStorage::new(8 * MIB);
    let vol = volume_with_data(&sim);
    drop(vol);
    // Find the slot with the highest generation and damage it.
    let slot = |i: u64| {
        let mut b = vec![0u8; 512];
        sim.read_at(8192 + i * 4096, &mut b).unwrap();
        cvol_format::CheckpointPointer::decode(&b)
            .map(|p| p.generation)
            .unwrap_or(0)
    };
    let newest = if slot(0) > slot(1) { 0 } else { 1 };
    sim.flip_bit(8192 + newest * 4096 + 9, 0);
    let vol = Volume::open(Arc::new(sim.clone()), OpenOptions::default()).unwrap();
    let mut b = vec![0u8; BS as usize];
    for i in 0..64 {
        vol.read_at(i * BS, &mut b).unwrap();
        assert!(b == block(i), "block {i}");
    }
}

#[test]
fn garbage_store_is_refused_cleanly() {
    let sim = SimStorage::new(8 * MIB);
    sim.write_at(0, &vec![0xa5u8; 65536]).unwrap();
    match Volume::open(Arc::new(sim.clone()), OpenOptions::default()) {
        Err(VolError::Open(msg)) => assert!(msg.to_string().contains("not a cvol volume"), "{msg}"),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("opened garbage"),
    }
    let rep = check::check_volume(&sim, &mut |_, _| {});
    assert!(!rep.consistent());
}

#[test]
fn io_error_poisons_writes_but_reads_continue() {
    let sim = SimStorage::new(8 * MIB);
    drop(volume_with_data(&sim));
    let vol = Volume::open(Arc::new(sim.clone()), OpenOptions::default()).unwrap();
    vol.write_at(100 * BS, &block(100), false).unwrap();
    sim.set_config(cvol_storage::SimConfig {
        io_budget: Some(0),
        ..Default::default()
    });
    assert!(matches!(vol.flush(), Err(VolError::Io(_))));
    assert!(matches!(
        vol.write_at(0, &block(0), false),
        Err(VolError::Poisoned)
    ));
    assert!(matches!(vol.flush(), Err(VolError::Poisoned)));
    let mut b = vec![0u8; BS as usize];
    vol.read_at(3 * BS, &mut b).unwrap();
    assert!(b == block(3));
    assert!(vol.stats().poisoned);
}

#[test]
fn check_cross_checks_segment_usage_against_the_records() {
    // A clean volume: the usage table matches the records and check says so.
    let sim = SimStorage::new(8 * MIB);
    drop(volume_with_data(&sim));
    let rep = check::check_volume(&sim, &mut |_, _| {});
    assert!(rep.consistent(), "{:?}", rep.errors);
    assert!(
        rep.notes.iter().any(|n| n.starts_with("segment usage: ")),
        "{:?}",
        rep.notes
    );
    // Break the chain inside the segment at lba 10's record: every later
    // record of the segment is no longer found where the map says, so the
    // live bytes the table derives from the map are not backed by records.
    let at = record_offset(&sim, 10);
    sim.flip_bit(at + 17, 0); // inside the seq field of the header
    let rep = check::check_volume(&sim, &mut |_, _| {});
    assert!(
        rep.errors
            .iter()
            .any(|e| e.starts_with("segment 0: usage table says")),
        "{:?}",
        rep.errors
    );
}
