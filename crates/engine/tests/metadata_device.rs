//! `--metadata-device` ([VDO] §5.2): map records, checkpoint
//! commits and fingerprint tables on a second store, joined with the data
//! store into one offset space. The data store then holds no map record;
//! open finds the map on the metadata device; a device of another volume,
//! one too small, or none at all is refused with a clear error.
mod common;
use common::{BS, MIB};
use cvol_engine::volume::metadev;
use cvol_engine::{OpenOptions, Volume};
use cvol_format::record::{RecordHeader, RecordKind, RECORD_HEADER_BYTES, RECORD_MAGIC};
use cvol_storage::{SimStorage, Storage};
use std::sync::Arc;

/// Kinds of the record headers found on a store, by scanning every byte.
fn kinds_on(sim: &SimStorage) -> Vec<RecordKind> {
    let mut img = vec![0u8; sim.len_bytes() as usize];
    sim.read_at(0, &mut img).unwrap();
    (0..img.len() - RECORD_HEADER_BYTES)
        .filter(|&i| img[i..i + 4] == RECORD_MAGIC.to_le_bytes())
        .filter_map(|i| RecordHeader::decode(&img[i..]).ok().map(|h| h.kind))
        .collect()
}

fn create(data: &SimStorage, meta: &SimStorage, logical: u64) -> Volume {
    let opts = common::options(data, logical);
    Volume::create_with_metadata(
        Arc::new(data.clone()),
        Arc::new(meta.clone()),
        "/dev/fast",
        &opts,
    )
    .expect("create with a metadata device")
}

fn open(data: &SimStorage, meta: &SimStorage) -> Result<Volume, cvol_engine::VolError> {
    let joined = metadev::open_stores(Arc::new(data.clone()), |path| {
        assert_eq!(path.as_deref(), Some("/dev/fast"), "the recorded path");
        Ok(Arc::new(meta.clone()))
    })?;
    Volume::open(joined, OpenOptions::default())
}

fn write_blocks(vol: &Volume, n: u64, seed: u64) {
    for i in 0..n {
        let data = common::text(seed * 1_000_000 + i, BS);
        vol.write_at(i * 7 * BS as u64, &data, false).unwrap();
    }
}

fn assert_blocks(vol: &Volume, n: u64, seed: u64) {
    for i in 0..n {
        let mut b = vec![0u8; BS];
        vol.read_at(i * 7 * BS as u64, &mut b).unwrap();
        assert_eq!(b, common::text(seed * 1_000_000 + i, BS), "block {i}");
    }
}

#[test]
fn map_records_live_on_the_metadata_device_and_a_reopen_finds_them() {
    let (data, meta) = (SimStorage::new(24 * MIB), SimStorage::new(8 * MIB));
    let vol = create(&data, &meta, 64 * MIB);
    write_blocks(&vol, 2000, 1);
    vol.flush().unwrap();
    vol.checkpoint().unwrap();
    write_blocks(&vol, 500, 2); // after the checkpoint: rolled forward
    vol.flush().unwrap();
    let st = vol.stats();
    assert!(st.metadata_used_bytes > 0, "the metadata device is in use");
    drop(vol); // no close: a crash after the flush
    let on_data = kinds_on(&data);
    let on_meta = kinds_on(&meta);
    let is_map = |k: &RecordKind| {
        matches!(
            k,
            RecordKind::MapChunk
                | RecordKind::MapDir
                | RecordKind::MapTable
                | RecordKind::CkptCommit
        )
    };
    assert!(on_data.contains(&RecordKind::Data));
    assert!(
        !on_data.iter().any(is_map),
        "no map record on the data store"
    );
    assert!(on_meta.contains(&RecordKind::CkptCommit));
    assert!(
        on_meta.iter().all(is_map),
        "only map records on the metadata device"
    );
    let vol = open(&data.crash(7), &meta.crash(8)).expect("reopen");
    assert_blocks(&vol, 500, 2);
    for i in 500..2000 {
        let mut b = vec![0u8; BS];
        vol.read_at(i * 7 * BS as u64, &mut b).unwrap();
        assert_eq!(b, common::text(1_000_000 + i, BS), "block {i}");
    }
    vol.verify_refcounts().unwrap();
}

#[test]
fn a_volume_fills_and_cleans_both_devices() {
    // Rewrites of a working set several times the data store: the cleaner
    // reclaims data segments, the metadata cleaning its own segments.
    let (data, meta) = (SimStorage::new(16 * MIB), SimStorage::new(4 * MIB));
    let vol = create(&data, &meta, 128 * MIB);
    for round in 0..40 {
        write_blocks(&vol, 900, 10 + round);
        // A page written once and never again: its record pins a metadata
        // segment that the hot pages' rewrites leave otherwise dead.
        let pin = common::text(round, BS);
        vol.write_at((7000 + round * 512) * BS as u64, &pin, false)
            .unwrap();
        vol.flush().unwrap();
        vol.checkpoint().unwrap();
    }
    assert_blocks(&vol, 900, 49);
    let st = vol.stats();
    eprintln!(
        "meta used {} free {} size {}; map records moved {}; reclaimed {}",
        st.metadata_used_bytes,
        st.metadata_free_bytes,
        st.metadata_size_bytes,
        st.map_records_moved,
        st.cleaner.segments_reclaimed
    );
    assert!(st.map_records_moved > 0, "metadata segments were cleaned");
    assert!(st.metadata_used_bytes <= st.metadata_size_bytes);
    vol.close().unwrap();
    drop(vol);
    let vol = open(&data, &meta).expect("reopen");
    assert_blocks(&vol, 900, 49);
    for round in 0..40 {
        let mut b = vec![0u8; BS];
        vol.read_at((7000 + round * 512) * BS as u64, &mut b)
            .unwrap();
        assert_eq!(b, common::text(round, BS), "pinned block {round}");
    }
    let joined = metadev::open_stores(Arc::new(data.clone()), |_| Ok(Arc::new(meta.clone())));
    vol.close().unwrap();
    drop(vol);
    let rep = cvol_engine::check::check_volume(&*joined.unwrap(), &mut |_, _| {});
    assert!(rep.consistent(), "check: {:?}", rep.errors);
}

#[test]
fn a_wrong_missing_or_small_metadata_device_is_refused() {
    let (data, meta) = (SimStorage::new(16 * MIB), SimStorage::new(4 * MIB));
    create(&data, &meta, 32 * MIB).close().unwrap();
    // The data store alone.
    let e = Volume::open(Arc::new(data.clone()), OpenOptions::default())
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("--metadata-device"), "{e}");
    // Another volume's metadata device.
    let (d2, m2) = (SimStorage::new(16 * MIB), SimStorage::new(4 * MIB));
    create(&d2, &m2, 32 * MIB).close().unwrap();
    let e = open(&data, &m2).err().expect("refused").to_string();
    assert!(e.contains("another volume"), "{e}");
    // A blank device.
    let e = open(&data, &SimStorage::new(4 * MIB))
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("no cvol metadata device label"), "{e}");
    // Too small to create on.
    let e = Volume::create_with_metadata(
        Arc::new(SimStorage::new(16 * MIB)),
        Arc::new(SimStorage::new(2 * MIB)),
        "/dev/small",
        &common::options(&data, 32 * MIB),
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(e.contains("too small"), "{e}");
    // The right one still opens.
    open(&data, &meta).expect("reopen").close().unwrap();
}
