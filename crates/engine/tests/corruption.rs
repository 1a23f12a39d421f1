//! Damaged media: a flipped bit costs exactly the blocks it hits, metadata
//! copies cover each other, and `check` names what is wrong. Each test runs
//! on a volume in the clear and on one encrypted with each cipher
//! (`variants`): a damaged sealed record fails its tag, and must read as
//! the same error, never as other data.
mod common;
use common::sealed::{self, Sealing};
use cvol_engine::{check, Codec, CreateOptions, OpenOptions, VolError, Volume};
use cvol_format::record::{encode_record, RecordKind, RECORD_HEADER_BYTES};
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

/// In the clear, then sealed with AES-256-GCM and with ChaCha20-Poly1305.
fn variants() -> [Option<Sealing>; 3] {
    [None, Some(Sealing::of_seed(0)), Some(Sealing::of_seed(1))]
}

fn open(sim: &SimStorage, s: Option<&Sealing>) -> Volume {
    open_with(sim, s, OpenOptions::default())
}

fn open_with(sim: &SimStorage, s: Option<&Sealing>, o: OpenOptions) -> Volume {
    Volume::open(Arc::new(sim.clone()), sealed::open_opts(s, o)).unwrap()
}

fn volume_with_data(sim: &SimStorage, s: Option<&Sealing>) -> Volume {
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
    let opts = sealed::create_opts(s, opts);
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
                && img[i + 4] & 0x7f == 1 // DATA, sealed (bit 7) or not
                && img[i + 24..i + 32] == lba.to_le_bytes()
        })
        .unwrap() as u64
}

#[test]
fn flipped_bit_fails_only_that_block_and_check_names_it() {
    for s in variants() {
        let s = s.as_ref();
        let sim = SimStorage::new(8 * MIB);
        drop(volume_with_data(&sim, s));
        let at = record_offset(&sim, 17);
        sim.flip_bit(at + 60, 3);
        let vol = open(&sim, s);
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
        let rep = sealed::check(s, &sim);
        assert!(!rep.consistent());
        assert!(
            rep.errors.iter().any(|e| e.starts_with("lba 17 ")),
            "{:?}",
            rep.errors
        );
    }
}

#[test]
fn misdirected_record_is_caught_by_the_map_checksum() {
    for s in variants() {
        let s = s.as_ref();
        // Copy the record of lba 5 over the record of lba 6: a valid record, wrong place.
        let sim = SimStorage::new(8 * MIB);
        drop(volume_with_data(&sim, s));
        let (a, b) = (record_offset(&sim, 5), record_offset(&sim, 6));
        let mut rec = vec![0u8; 200];
        sim.read_at(a, &mut rec).unwrap();
        sim.write_at(b, &rec).unwrap();
        let read_only = OpenOptions {
            read_only: true,
            ..Default::default()
        };
        let vol = open_with(&sim, s, read_only);
        let mut buf = vec![0u8; BS as usize];
        assert!(matches!(
            vol.read_at(6 * BS, &mut buf),
            Err(VolError::Corrupt { lba: 6, .. })
        ));
        vol.read_at(5 * BS, &mut buf).unwrap();
    }
}

#[test]
fn one_superblock_copy_lost_still_opens_and_check_reports_it() {
    for s in variants() {
        let s = s.as_ref();
        let sim = SimStorage::new(8 * MIB);
        drop(volume_with_data(&sim, s));
        sim.flip_bit(40, 1); // inside copy A
        let vol = open(&sim, s);
        let mut b = vec![0u8; BS as usize];
        vol.read_at(3 * BS, &mut b).unwrap();
        assert!(b == block(3));
        drop(vol);
        let rep = sealed::check(s, &sim);
        assert!(
            rep.errors.iter().any(|e| e.contains("superblock copy A")),
            "{:?}",
            rep.errors
        );
    }
}

#[test]
fn corrupt_newest_checkpoint_pointer_falls_back_to_the_older_one() {
    for s in variants() {
        let s = s.as_ref();
        let sim = SimStorage::new(8 * MIB);
        drop(volume_with_data(&sim, s));
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
        let vol = open(&sim, s);
        let mut b = vec![0u8; BS as usize];
        for i in 0..64 {
            vol.read_at(i * BS, &mut b).unwrap();
            assert!(b == block(i), "block {i}");
        }
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
    for s in variants() {
        let s = s.as_ref();
        let sim = SimStorage::new(8 * MIB);
        drop(volume_with_data(&sim, s));
        let vol = open(&sim, s);
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
}

#[test]
fn check_cross_checks_segment_usage_against_the_records() {
    for s in variants() {
        let s = s.as_ref();
        // A clean volume: the usage table matches the records and check says so.
        let sim = SimStorage::new(8 * MIB);
        drop(volume_with_data(&sim, s));
        let rep = sealed::check(s, &sim);
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
        let rep = sealed::check(s, &sim);
        assert!(
            rep.errors
                .iter()
                .any(|e| e.starts_with("segment 0: usage table says")),
            "{:?}",
            rep.errors
        );
    }
}

#[test]
fn an_encrypted_volume_is_not_checked_without_its_key() {
    let sim = SimStorage::new(8 * MIB);
    drop(volume_with_data(&sim, Some(&Sealing::of_seed(0))));
    let rep = check::check_volume(&sim, &mut |_, _| {});
    assert_eq!(rep.errors.len(), 1, "{:?}", rep.errors);
    assert!(rep.errors[0].contains("encrypted"), "{:?}", rep.errors);
    let wrong = Sealing::of_seed(2);
    let rep = sealed::check(Some(&wrong), &sim);
    assert!(rep.errors[0].contains("wrong key"), "{:?}", rep.errors);
    assert!(sealed::check(Some(&Sealing::of_seed(0)), &sim).consistent());
}

/// Flips a bit in the payload of the record at `at` and mends its public
/// crc32c, as an attacker with the disk can: only a sealed record's AEAD
/// tag can tell.
fn tamper_mending_crc(sim: &SimStorage, at: u64) {
    let h = common::record_header(sim, at);
    let mut rec = vec![0u8; h.total_len()];
    sim.read_at(at, &mut rec).unwrap();
    rec[RECORD_HEADER_BYTES + 100] ^= 0x04;
    let mut again = h;
    sim.write_at(at, &encode_record(&mut again, &rec[RECORD_HEADER_BYTES..]))
        .unwrap();
    sim.sync().unwrap();
}

/// Raw blocks and no dedup: a block is one DATA record of its own, its
/// payload the block itself (sealed: the block XOR a key stream, so a
/// tag not checked would let the flipped bit through as data).
fn raw_volume(sim: &SimStorage, s: Option<&Sealing>) -> Volume {
    let opts = common::options(sim, 4 * MIB)
        .with_codec(Codec::None)
        .with_dedup(false);
    let vol = Volume::create(Arc::new(sim.clone()), &sealed::create_opts(s, opts)).unwrap();
    for i in 0..8 {
        vol.write_at(i * BS, &block(i), false).unwrap();
    }
    vol
}

/// A sealed DATA record the checkpointed map names, its payload altered
/// and its crc mended: the read fails as corrupt (the map's crc and the
/// tag both disagree), and check names the block.
#[test]
fn regression_a_tampered_sealed_record_the_map_names_reads_as_corrupt() {
    for s in [Sealing::of_seed(0), Sealing::of_seed(1)] {
        let sim = SimStorage::new(8 * MIB);
        raw_volume(&sim, Some(&s)).close().unwrap();
        let at = common::data_records_of(&sim, 5);
        assert_eq!(at.len(), 1, "one record of block 5");
        tamper_mending_crc(&sim, at[0]);
        let vol = open(&sim, Some(&s));
        let mut b = vec![0u8; BS as usize];
        assert!(matches!(
            vol.read_at(5 * BS, &mut b),
            Err(VolError::Corrupt { lba: 5, .. })
        ));
        vol.read_at(4 * BS, &mut b).unwrap();
        assert!(b == block(4));
        drop(vol);
        let rep = sealed::check(Some(&s), &sim);
        assert!(
            rep.errors.iter().any(|e| e.starts_with("lba 5 ")),
            "{:?}",
            rep.errors
        );
    }
}

/// Block 5 rewritten after the last checkpoint and certified by a later
/// flush, then a power cut: recovery replays its record, taking the crc
/// the map keeps from the (mended) header. In the clear nothing can tell
/// and the altered bytes read back (the tamper works); sealed, the tag
/// fails and the open refuses, as for any damaged flushed record, and
/// `check` says why. Never the altered bytes, never the older version.
#[test]
fn regression_a_tampered_sealed_record_replayed_by_roll_forward_is_refused() {
    let v2 = |i: u64| block(100 + i);
    for s in [None, Some(Sealing::of_seed(0)), Some(Sealing::of_seed(1))] {
        let s = s.as_ref();
        let sim = SimStorage::new(8 * MIB);
        raw_volume(&sim, s).close().unwrap();
        let vol = open(&sim, s);
        vol.write_at(5 * BS, &v2(5), false).unwrap();
        vol.flush().unwrap();
        vol.write_at(6 * BS, &v2(6), false).unwrap();
        vol.flush().unwrap();
        let crashed = sim.crash(7);
        drop(vol);
        let replayed = *common::data_records_of(&crashed, 5)
            .iter()
            .max_by_key(|&&o| {
                let h = common::record_header(&crashed, o);
                assert_eq!(h.kind, RecordKind::Data);
                h.seq
            })
            .unwrap();
        tamper_mending_crc(&crashed, replayed);
        let opened = Volume::open(
            Arc::new(crashed.clone()),
            sealed::open_opts(s, OpenOptions::default()),
        );
        let mut b = vec![0u8; BS as usize];
        match (s, opened) {
            (None, Ok(vol)) => {
                vol.read_at(5 * BS, &mut b).unwrap();
                let flipped = b.iter().zip(v2(5)).filter(|&(x, y)| *x != y).count();
                assert_eq!(flipped, 1, "the clear volume reads the tampered bytes");
            }
            (Some(_), Err(e)) => {
                let e = e.to_string();
                assert!(
                    e.contains("certifies") && e.contains("check --repair"),
                    "{e}"
                );
                assert!(!sealed::check(s, &crashed).consistent());
                let rep = sealed::repair(s, Arc::new(crashed.clone()));
                assert_eq!(rep.lost_lbas, vec![5], "{:?}", rep.actions);
                let vol = open(&crashed, s);
                assert!(matches!(
                    vol.read_at(5 * BS, &mut b),
                    Err(VolError::Corrupt { lba: 5, .. })
                ));
                vol.read_at(6 * BS, &mut b).unwrap();
                assert!(b == v2(6));
            }
            (_, r) => panic!("sealed {}: {:?}", s.is_some(), r.map(|_| "opened")),
        }
    }
}
