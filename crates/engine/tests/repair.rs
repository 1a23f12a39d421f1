//! Metadata redundancy and repair: damaged pointer slots fall back to a
//! checkpoint found in the log; a volume whose every checkpoint is damaged
//! refuses to guess at open and `repair_volume` (`cvol check --repair`)
//! rebuilds its map from the self-describing log; a damaged superblock copy
//! is rewritten; damaged data is reported by LBA, never returned. Each
//! test runs in the clear and sealed with each cipher (`variants`).
mod common;
use common::sealed::{self, Sealing};
use cvol_engine::{Codec, CodecPolicy, CreateOptions, ElasticConfig, OpenOptions, Volume};
use cvol_storage::{SimStorage, Storage};
use std::sync::Arc;

const BS: usize = 4096;
const MIB: u64 = 1 << 20;
const RECORD_MAGIC: [u8; 4] = 0x524c_5643u32.to_le_bytes();

fn block(i: u64, v: u32) -> Vec<u8> {
    format!("block {i} version {v} with some repeated text ")
        .bytes()
        .cycle()
        .take(BS)
        .collect()
}

/// A volume with units, dedup references, a TRIM and zeros, closed cleanly.
/// Returns the expected image.
fn populate(sim: &SimStorage, codec: CodecPolicy, s: Option<&Sealing>) -> Vec<u8> {
    let opts = CreateOptions {
        logical_size_bytes: 8 * MIB,
        physical_size_bytes: sim.len_bytes(),
        codec,
        segment_size_bytes: MIB,
        dedup: true,
        packing: Default::default(),
        pool: false,
        encryption: None,
    };
    Volume::create(Arc::new(sim.clone()), &sealed::create_opts(s, opts))
        .unwrap()
        .close()
        .unwrap();
    let options = OpenOptions {
        elastic: ElasticConfig {
            unit_blocks: 8,
            recompress: false,
            ..ElasticConfig::default()
        },
        ..OpenOptions::default()
    };
    let vol = Volume::open(Arc::new(sim.clone()), sealed::open_opts(s, options)).unwrap();
    let mut image = vec![0u8; 8 * MIB as usize];
    let mut put = |vol: &Volume, lba: u64, data: &[u8]| {
        vol.write_at(lba * BS as u64, data, false).unwrap();
        image[lba as usize * BS..lba as usize * BS + data.len()].copy_from_slice(data);
    };
    // 64 blocks in one write (units), then the same content elsewhere (refs).
    let first: Vec<u8> = (0..64).flat_map(|i| block(i, 0)).collect();
    put(&vol, 0, &first);
    put(&vol, 300, &first[..16 * BS]);
    // Overwrites, a TRIM, zeros, a checkpoint in between, more writes after.
    for i in (0..64).step_by(5) {
        put(&vol, i, &block(i, 1));
    }
    vol.checkpoint().unwrap();
    vol.trim(40 * BS as u64, 8 * BS as u64, false).unwrap();
    put(&vol, 40, &[]); // (the TRIM's effect is applied to the image below)
    put(&vol, 500, &vec![0u8; 4 * BS]);
    for i in 100..140 {
        put(&vol, i, &block(i, 2));
    }
    vol.close().unwrap();
    image[40 * BS..48 * BS].fill(0);
    image
}

fn open(sim: &SimStorage, s: Option<&Sealing>) -> Result<Volume, cvol_engine::VolError> {
    Volume::open(
        Arc::new(sim.clone()),
        sealed::open_opts(s, OpenOptions::default()),
    )
}

/// In the clear, then sealed with AES-256-GCM and with ChaCha20-Poly1305.
fn variants() -> [Option<Sealing>; 3] {
    [None, Some(Sealing::of_seed(0)), Some(Sealing::of_seed(1))]
}

fn assert_image(vol: &Volume, image: &[u8]) {
    let mut got = vec![0u8; image.len()];
    vol.read_at(0, &mut got).unwrap();
    for (b, (g, w)) in got.chunks(BS).zip(image.chunks(BS)).enumerate() {
        assert!(g == w, "lba {b} differs");
    }
}

/// Offsets of every record of `kind` (by scanning the raw bytes).
fn records_of_kind(sim: &SimStorage, kind: u8) -> Vec<u64> {
    let mut img = vec![0u8; sim.len_bytes() as usize];
    sim.read_at(0, &mut img).unwrap();
    (0..img.len() - 44)
        .filter(|&i| img[i..i + 4] == RECORD_MAGIC && img[i + 4] & 0x7f == kind)
        .map(|i| i as u64)
        .collect()
}

fn smash_pointer_slots(sim: &SimStorage) {
    for slot in 0..2 {
        sim.write_at(
            cvol_format::CheckpointPointer::slot_offset(slot) + 20,
            &[0xa5; 8],
        )
        .unwrap();
    }
}

#[test]
fn damaged_pointer_slots_fall_back_to_a_checkpoint_found_in_the_log() {
    for s in variants() {
        damaged_pointer_slots_fall_back_to_a_checkpoint_found_in_the_log_in(s.as_ref());
    }
}

fn damaged_pointer_slots_fall_back_to_a_checkpoint_found_in_the_log_in(s: Option<&Sealing>) {
    let sim = SimStorage::new(16 * MIB);
    let image = populate(&sim, Codec::Lz4.into(), s);
    smash_pointer_slots(&sim);
    let vol = open(&sim, s).expect("opens from a commit record found by scanning");
    assert!(
        vol.recovery_warnings()
            .iter()
            .any(|w| w.contains("checkpoint found in the log")),
        "{:?}",
        vol.recovery_warnings()
    );
    assert_image(&vol, &image);
    vol.close().unwrap();
    drop(vol);
    // Closing wrote a fresh checkpoint into one slot; repair rewrites both.
    let rep = sealed::repair(s, Arc::new(sim.clone()));
    assert!(rep.after.consistent(), "{:?}", rep.after.errors);
    let vol = open(&sim, s).unwrap();
    assert!(
        vol.recovery_warnings().is_empty(),
        "{:?}",
        vol.recovery_warnings()
    );
    assert_image(&vol, &image);
}

#[test]
fn with_every_checkpoint_damaged_open_refuses_and_repair_rebuilds_from_the_log() {
    for s in variants() {
        with_every_checkpoint_damaged_open_refuses_and_repair_rebuilds_from_the_log_in(s.as_ref());
    }
}

fn with_every_checkpoint_damaged_open_refuses_and_repair_rebuilds_from_the_log_in(
    s: Option<&Sealing>,
) {
    for codec in [
        Codec::Lz4.into(),
        CodecPolicy::Auto {
            strong: Codec::Zstd(3),
        },
    ] {
        let sim = SimStorage::new(16 * MIB);
        let image = populate(&sim, codec, s);
        smash_pointer_slots(&sim);
        for at in records_of_kind(&sim, 6) {
            sim.flip_bit(at + 50, 1); // every CKPT_COMMIT payload
        }
        let err = match open(&sim, s) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("opened without any usable checkpoint"),
        };
        assert!(err.contains("check --repair"), "{err}");
        let before = sealed::check(s, &sim);
        assert!(!before.consistent());
        let rep = sealed::repair(s, Arc::new(sim.clone()));
        assert!(
            rep.actions.iter().any(|a| a.contains("salvage from")),
            "{:?}",
            rep.actions
        );
        assert!(rep.lost_lbas.is_empty() && rep.unknown_records.is_empty());
        assert!(rep.after.consistent(), "{:?}", rep.after.errors);
        // Nothing was reused, so the rebuild is exact: units, refs, TRIM, zeros.
        let vol = open(&sim, s).unwrap();
        assert!(vol.recovery_warnings().is_empty());
        assert_image(&vol, &image);
        vol.verify_refcounts().unwrap();
        // And the repaired volume works on.
        vol.write_at(0, &block(0, 9), true).unwrap();
        vol.close().unwrap();
    }
}

#[test]
fn a_damaged_superblock_copy_is_rewritten_from_the_other() {
    for s in variants() {
        a_damaged_superblock_copy_is_rewritten_from_the_other_in(s.as_ref());
    }
}

fn a_damaged_superblock_copy_is_rewritten_from_the_other_in(s: Option<&Sealing>) {
    let sim = SimStorage::new(16 * MIB);
    let image = populate(&sim, Codec::Lz4.into(), s);
    sim.flip_bit(cvol_format::SUPERBLOCK_A_OFFSET + 30, 0);
    let before = sealed::check(s, &sim);
    assert!(!before.consistent(), "check sees the damaged copy");
    let vol = open(&sim, s).expect("copy B covers copy A");
    assert_image(&vol, &image);
    drop(vol);
    let rep = sealed::repair(s, Arc::new(sim.clone()));
    assert!(
        rep.actions
            .iter()
            .any(|a| a.contains("superblock copy A rewritten")),
        "{:?}",
        rep.actions
    );
    assert!(rep.after.consistent(), "{:?}", rep.after.errors);
}

#[test]
fn damaged_data_is_reported_by_lba_and_never_returned() {
    for s in variants() {
        damaged_data_is_reported_by_lba_and_never_returned_in(s.as_ref());
    }
}

fn damaged_data_is_reported_by_lba_and_never_returned_in(s: Option<&Sealing>) {
    let sim = SimStorage::new(16 * MIB);
    let image = populate(&sim, Codec::Lz4.into(), s);
    // The single-block record of lba 130 (version 2): damage its payload.
    let mut img = vec![0u8; sim.len_bytes() as usize];
    sim.read_at(0, &mut img).unwrap();
    let at = (0..img.len() - 44)
        .find(|&i| {
            img[i..i + 4] == RECORD_MAGIC
                && img[i + 4] & 0x7f == 1
                && img[i + 24..i + 32] == 130u64.to_le_bytes()
                && img[i + 32..i + 36] == 1u32.to_le_bytes()
        })
        .or_else(|| {
            // Or the unit that holds it.
            (0..img.len() - 44).rev().find(|&i| {
                let lba = u64::from_le_bytes(img[i + 24..i + 32].try_into().unwrap());
                let n = u64::from(u32::from_le_bytes(img[i + 32..i + 36].try_into().unwrap()));
                img[i..i + 4] == RECORD_MAGIC
                    && img[i + 4] & 0x7f == 1
                    && lba <= 130
                    && 130 < lba + n
            })
        })
        .expect("the record of lba 130") as u64;
    sim.flip_bit(at + 70, 2);
    let rep = sealed::repair(s, Arc::new(sim.clone()));
    assert!(!rep.after.consistent());
    assert!(
        rep.after.errors.iter().any(|e| e.starts_with("lba 130 ")),
        "{:?}",
        rep.after.errors
    );
    let vol = open(&sim, s).unwrap();
    let mut b = vec![0u8; BS];
    assert!(vol.read_at(130 * BS as u64, &mut b).is_err());
    for lba in [0u64, 5, 99, 300, 315] {
        vol.read_at(lba * BS as u64, &mut b).unwrap();
        assert!(b == image[lba as usize * BS..(lba as usize + 1) * BS]);
    }
}

/// Found by the fault simulation (seed 50): damage to a flushed record
/// after the newest checkpoint ended the recovery chain early, and the
/// volume opened silently without the flushed records after it. A SYNCED
/// record written with the next flush now proves they were durable:
/// recovery refuses, and repair rebuilds around the damaged record.
#[test]
fn regression_damage_in_the_flushed_log_tail_is_refused_not_silently_rolled_back() {
    for s in variants() {
        regression_damage_in_the_flushed_log_tail_is_refused_not_silently_rolled_back_in(
            s.as_ref(),
        );
    }
}

fn regression_damage_in_the_flushed_log_tail_is_refused_not_silently_rolled_back_in(
    s: Option<&Sealing>,
) {
    let sim = SimStorage::new(16 * MIB);
    let opts = CreateOptions {
        logical_size_bytes: 8 * MIB,
        physical_size_bytes: sim.len_bytes(),
        codec: Codec::Lz4.into(),
        segment_size_bytes: MIB,
        dedup: false,
        packing: Default::default(),
        pool: false,
        encryption: None,
    };
    let vol = Volume::create(Arc::new(sim.clone()), &sealed::create_opts(s, opts)).unwrap();
    vol.write_at(7 * BS as u64, &block(7, 0), false).unwrap();
    vol.checkpoint().unwrap();
    vol.write_at(7 * BS as u64, &block(7, 1), false).unwrap();
    vol.flush().unwrap();
    for i in 20..40 {
        vol.write_at(i * BS as u64, &block(i, 1), false).unwrap();
    }
    vol.flush().unwrap(); // certifies the previous sync

    // A crash: no checkpoint at close. Then damage the flushed record of
    // lba 7 version 1 (the newest DATA record for it).
    drop(vol);
    let mut img = vec![0u8; sim.len_bytes() as usize];
    sim.read_at(0, &mut img).unwrap();
    let at = (0..img.len() - 44)
        .filter(|&i| {
            img[i..i + 4] == RECORD_MAGIC
                && img[i + 4] & 0x7f == 1
                && img[i + 24..i + 32] == 7u64.to_le_bytes()
        })
        .max_by_key(|&i| u64::from_le_bytes(img[i + 16..i + 24].try_into().unwrap()))
        .unwrap() as u64;
    sim.flip_bit(at + 100, 4);
    let err = match open(&sim, s) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("opened a log with a hole in its flushed records"),
    };
    assert!(err.contains("the log is damaged"), "{err}");
    let rep = sealed::repair(s, Arc::new(sim.clone()));
    assert!(
        rep.actions.iter().any(|a| a.contains("for lba 7+1")),
        "repair names the damaged record's blocks: {:?}",
        rep.actions
    );
    // Lba 7's newest flushed version is gone: listed, and it reads as EIO
    // (never silently the version before the damaged record).
    assert_eq!(rep.lost_lbas, vec![7]);
    assert_eq!(rep.after.lost_lbas, vec![7]);
    assert!(!rep.after.consistent());
    let vol = open(&sim, s).unwrap();
    let mut b = vec![0u8; BS];
    for i in 20..40u64 {
        vol.read_at(i * BS as u64, &mut b).unwrap();
        assert!(
            b == block(i, 1),
            "flushed lba {i} after the damage survives repair"
        );
    }
    assert!(vol.read_at(7 * BS as u64, &mut b).is_err());
    vol.write_at(7 * BS as u64, &block(7, 2), false).unwrap();
    vol.read_at(7 * BS as u64, &mut b).unwrap();
    assert!(b == block(7, 2));
}
