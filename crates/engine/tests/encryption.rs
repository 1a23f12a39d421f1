//! Encryption at rest (`cvol create --encryption`): what an encrypted
//! volume keeps to itself, and how it refuses a missing or wrong key.
mod common;

use common::{options, BS, MIB};
use cvol_engine::{KeyFile, KeyProblem, OpenError, OpenOptions, VolError, Volume};
use cvol_format::keyslot::KeyError;
use cvol_format::seal::Cipher;
use cvol_storage::{SimStorage, Storage};
use std::sync::Arc;

fn key(b: u8) -> KeyFile {
    KeyFile::new(vec![b; 32])
}

fn keyed(k: &KeyFile) -> OpenOptions {
    OpenOptions {
        key: Some(k.clone()),
        ..OpenOptions::default()
    }
}

/// Text that compresses and deduplicates, with a marker to search for.
fn block(i: u64) -> Vec<u8> {
    let line = format!("secret payroll line {i:08} of the quarterly report;  ");
    line.into_bytes().into_iter().cycle().take(BS).collect()
}

fn bytes_of(sim: &SimStorage) -> Vec<u8> {
    let mut all = vec![0u8; sim.len_bytes() as usize];
    sim.read_at(0, &mut all).expect("read the store");
    all
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn written_data_never_reaches_the_store_in_the_clear() {
    for cipher in Cipher::ALL {
        let sim = SimStorage::new(64 * MIB);
        let k = key(1);
        let opts = options(&sim, 32 * MIB).with_encryption(cipher, k.clone());
        let vol = Volume::create(Arc::new(sim.clone()), &opts).expect("create");
        for i in 0..512u64 {
            vol.write_at(i * BS as u64, &block(i % 300), false)
                .expect("write");
        }
        vol.flush().expect("flush");
        // Dedup still works inside the volume: 300 distinct blocks stored.
        let hits = vol.stats().dedup.dedup_hits;
        assert!(hits >= 200, "dedup hits {hits}");
        vol.checkpoint().expect("checkpoint");
        vol.close().expect("close");
        let store = bytes_of(&sim);
        assert!(!contains(&store, b"secret payroll"), "{}", cipher.name());
        assert!(!contains(&store, b"quarterly report"), "{}", cipher.name());
        // The same volume in the clear shows it: the search works.
        let clear = SimStorage::new(64 * MIB);
        let vol = Volume::create(Arc::new(clear.clone()), &options(&clear, 32 * MIB)).unwrap();
        vol.write_at(0, &block(7), false).unwrap();
        vol.close().unwrap();
        assert!(contains(&bytes_of(&clear), b"secret payroll"));

        let vol = Volume::open(Arc::new(sim.clone()), keyed(&k)).expect("open with the key");
        let mut got = vec![0u8; BS];
        for i in [0u64, 1, 299, 300, 511] {
            vol.read_at(i * BS as u64, &mut got).expect("read");
            assert_eq!(got, block(i % 300), "block {i}");
        }
        vol.close().unwrap();
    }
}

fn open_error(sim: &SimStorage, o: OpenOptions) -> VolError {
    match Volume::open(Arc::new(sim.clone()), o) {
        Ok(_) => panic!("opened"),
        Err(e) => e,
    }
}

#[test]
fn a_missing_or_wrong_key_is_refused_before_anything_is_written() {
    let sim = SimStorage::new(32 * MIB);
    let opts = options(&sim, 16 * MIB).with_encryption(Cipher::Aes256Gcm, key(1));
    let vol = Volume::create(Arc::new(sim.clone()), &opts).unwrap();
    vol.write_at(0, &block(1), false).unwrap();
    vol.close().unwrap();
    let before = bytes_of(&sim);
    let e = open_error(&sim, OpenOptions::default());
    assert!(
        matches!(
            e,
            VolError::Open(OpenError::Key(KeyProblem::Needed(Cipher::Aes256Gcm)))
        ),
        "{e}"
    );
    assert!(e.to_string().contains("encrypted"), "{e}");
    let e = open_error(&sim, keyed(&key(2)));
    assert!(
        matches!(
            e,
            VolError::Open(OpenError::Key(KeyProblem::Key(KeyError::WrongKey)))
        ),
        "{e}"
    );
    assert!(e.to_string().contains("wrong key"), "{e}");
    assert_eq!(bytes_of(&sim), before, "a refused open wrote nothing");

    // A key for a volume without encryption is refused too.
    let clear = SimStorage::new(32 * MIB);
    common::create_closed(&clear, &options(&clear, 16 * MIB));
    let e = open_error(&clear, keyed(&key(1)));
    assert!(
        matches!(e, VolError::Open(OpenError::Key(KeyProblem::NotEncrypted))),
        "{e}"
    );
}

#[test]
fn a_tampered_record_reads_as_an_error_not_as_data() {
    let sim = SimStorage::new(32 * MIB);
    let k = key(3);
    let opts = options(&sim, 16 * MIB)
        .with_encryption(Cipher::ChaCha20Poly1305, k.clone())
        .with_dedup(false);
    let vol = Volume::create(Arc::new(sim.clone()), &opts).unwrap();
    vol.write_at(5 * BS as u64, &block(5), false).unwrap();
    vol.close().unwrap();
    let at = common::data_records_of(&sim, 5)[0];
    // Flip a payload bit and mend the (public) crc: only the tag sees it.
    let h = common::record_header(&sim, at);
    let mut rec = vec![0u8; h.total_len()];
    sim.read_at(at, &mut rec).unwrap();
    rec[cvol_format::record::RECORD_HEADER_BYTES + 3] ^= 0x20;
    let mut again = h;
    let fixed = cvol_format::record::encode_record(
        &mut again,
        &rec[cvol_format::record::RECORD_HEADER_BYTES..],
    );
    sim.write_at(at, &fixed).unwrap();
    let vol = Volume::open(Arc::new(sim.clone()), keyed(&k)).unwrap();
    let mut got = vec![0u8; BS];
    // The map names the record by its crc: the mended crc differs, so the
    // read fails as corrupt either way; never the altered bytes.
    assert!(vol.read_at(5 * BS as u64, &mut got).is_err());
}

#[test]
fn rotating_the_key_keeps_the_data_and_retires_the_old_key() {
    let sim = SimStorage::new(32 * MIB);
    let (old, new) = (key(4), KeyFile::new(b"a long enough passphrase\n".to_vec()));
    let opts = options(&sim, 16 * MIB).with_encryption(Cipher::Aes256Gcm, old.clone());
    let vol = Volume::create(Arc::new(sim.clone()), &opts).unwrap();
    vol.write_at(0, &block(9), false).unwrap();
    vol.close().unwrap();
    let (sb, _) = cvol_engine::read_superblock(&sim).unwrap();
    cvol_engine::keys::rotate(&sim, &sb, &old, &new).expect("rotate");
    let e = open_error(&sim, keyed(&old));
    assert!(e.to_string().contains("wrong key"), "{e}");
    let vol = Volume::open(Arc::new(sim.clone()), keyed(&new)).unwrap();
    let mut got = vec![0u8; BS];
    vol.read_at(0, &mut got).unwrap();
    assert_eq!(got, block(9));
    vol.close().unwrap();
    // A rotation cut short after copy A: either key opens the volume.
    let (sb, _) = cvol_engine::read_superblock(&sim).unwrap();
    let third = key(5);
    let b_copy = {
        let mut b = vec![0u8; 4096];
        sim.read_at(cvol_format::SUPERBLOCK_B_OFFSET, &mut b)
            .unwrap();
        b
    };
    cvol_engine::keys::rotate(&sim, &sb, &new, &third).unwrap();
    sim.write_at(cvol_format::SUPERBLOCK_B_OFFSET, &b_copy)
        .unwrap();
    for k in [&new, &third] {
        let vol = Volume::open(Arc::new(sim.clone()), keyed(k)).expect("either key");
        vol.close().unwrap();
    }
}

/// A pool's table (volume and snapshot names, sizes) is sealed too: the
/// names are not in the store, and the pool opens again with the key.
#[test]
fn a_pools_volume_and_snapshot_names_are_sealed() {
    use cvol_engine::pool::Pool;
    let sim = SimStorage::new(64 * MIB);
    let k = key(6);
    let opts = options(&sim, 16 * MIB)
        .as_pool()
        .with_encryption(Cipher::Aes256Gcm, k.clone());
    let pool = Pool::create(Arc::new(sim.clone()), &opts).expect("pool");
    pool.create_volume("payroll-database", 8 * MIB)
        .expect("volume");
    pool.create_snapshot("payroll-database@before-audit")
        .expect("snapshot");
    drop(pool); // the table is durable once written (each change syncs it)
    let store = bytes_of(&sim);
    assert!(!contains(&store, b"payroll-database"));
    assert!(!contains(&store, b"before-audit"));
    let vol = Volume::open(Arc::new(sim.clone()), keyed(&k)).expect("open");
    let pool = Pool::attach(Arc::new(vol)).expect("attach");
    let names: Vec<String> = pool.volumes().into_iter().map(|v| v.name).collect();
    assert!(names.iter().any(|n| n == "payroll-database"), "{names:?}");
}
