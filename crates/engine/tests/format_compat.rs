//! Volumes made by earlier cvol versions open, keep their data, and are
//! marked so that those versions refuse them afterwards.
//!
//! `fixtures/v1-volume.sectors`: a volume made by cvol before checkpoints
//! named a resume position (main at 5286416): `create --size 8M
//! --physical-size 3M`, served, 64 KiB of 0x61 at 0 and 16 KiB of 0x62 at
//! 1 MiB written and flushed, stopped cleanly (its checkpoint has no resume
//! position); served again, 8 KiB of 0x63 at 2 MiB and 4 KiB of 0x64 at
//! 4 KiB written and flushed, then killed (kill -9): recovery loads the old
//! checkpoint and rolls forward from after its commit. Stored as its
//! non-zero 512-byte sectors: (offset u64 LE, 512 bytes) each.
mod common;
use cvol_engine::{check, OpenOptions, Volume};
use cvol_format::superblock::FLAG_RESUME_AT_SNAPSHOT;
use cvol_format::superblock::SUPERBLOCK_BYTES;
use cvol_format::{Superblock, SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET};
use cvol_storage::{SimStorage, Storage};
use std::sync::Arc;

const IMAGE_BYTES: u64 = 3 << 20;

fn v1_volume() -> SimStorage {
    let sectors = include_bytes!("fixtures/v1-volume.sectors");
    let sim = SimStorage::new(IMAGE_BYTES);
    for s in sectors.chunks(8 + 512) {
        let at = u64::from_le_bytes(s[..8].try_into().unwrap());
        sim.write_at(at, &s[8..]).unwrap();
    }
    sim.sync().unwrap();
    sim
}

fn flags(sim: &SimStorage, at: u64) -> u32 {
    let mut b = vec![0u8; SUPERBLOCK_BYTES];
    sim.read_at(at, &mut b).unwrap();
    Superblock::decode(&b).unwrap().flags
}

fn assert_contents(vol: &Volume) {
    let expect: [(u64, usize, u8); 5] = [
        (0, 4096, 0x61),
        (4096, 4096, 0x64),
        (8192, 56 << 10, 0x61),
        (1 << 20, 16 << 10, 0x62),
        (2 << 20, 8 << 10, 0x63),
    ];
    for (off, len, byte) in expect {
        let mut b = vec![0u8; len];
        vol.read_at(off, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == byte), "{len} bytes at {off}");
    }
    let mut b = vec![0xffu8; 64 << 10];
    vol.read_at(3 << 20, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0), "unwritten space reads zeros");
}

#[test]
fn a_volume_of_the_previous_format_opens_and_is_marked() {
    let sim = v1_volume();
    for at in [SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET] {
        assert_eq!(
            flags(&sim, at) & FLAG_RESUME_AT_SNAPSHOT,
            0,
            "the fixture predates the flag"
        );
    }
    // Read-only: the data, and nothing written.
    let ro = OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    assert_contents(&Volume::open(Arc::new(sim.clone()), ro).unwrap());
    assert_eq!(
        flags(&sim, SUPERBLOCK_A_OFFSET) & FLAG_RESUME_AT_SNAPSHOT,
        0
    );
    // For writing: marked in both copies before anything else is written.
    let vol = Volume::open(Arc::new(sim.clone()), OpenOptions::default()).unwrap();
    for at in [SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET] {
        assert_ne!(flags(&sim, at) & FLAG_RESUME_AT_SNAPSHOT, 0);
    }
    assert_contents(&vol);
    vol.write_at(6 << 20, &[0x65; 4096], false).unwrap();
    vol.checkpoint().unwrap();
    drop(vol);
    let crashed = sim.crash(3);
    let report = check::check_volume(&crashed, &mut |_, _| {});
    assert!(report.consistent(), "{report:?}");
    let vol = Volume::open(Arc::new(crashed), OpenOptions::default()).unwrap();
    assert_contents(&vol);
    let mut b = vec![0u8; 4096];
    vol.read_at(6 << 20, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0x65));
}

#[test]
fn an_older_volume_without_fingerprint_tables_is_warmed_from_its_data() {
    let sim = v1_volume();
    let vol = Volume::open(Arc::new(sim.clone()), OpenOptions::default()).unwrap();
    // Four distinct contents (0x61..0x64 blocks), none in a table: read
    // from the data.
    assert_eq!(vol.warm_index(), 4);
    assert!(vol.stats().dedup.dedup_warm_data_blocks > 4);
    let hits = vol.stats().dedup.dedup_hits;
    vol.write_at(5 << 20, &[0x62u8; 4096], false).unwrap();
    assert_eq!(vol.stats().dedup.dedup_hits, hits + 1);
    vol.close().unwrap();
}
