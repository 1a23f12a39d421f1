//! Found in review: the checkpoint reserve (13 bytes per mapped entry + 64 KiB + one
//! segment) does not cover a checkpoint of a fragmented map, so a checkpoint
//! fails with ENOSPC on a volume that client writes filled "legally".
mod common;
use common::{BS, MIB};
use cvol_engine::{Codec, OpenOptions, VolError, Volume};
use cvol_storage::SimStorage;
use rand::{Rng, SeedableRng};
use std::sync::Arc;

#[test]
fn regression_checkpoint_fits_after_client_fills_log_with_fragmented_map() {
    let sim = SimStorage::new(256 * MIB);
    let opts = common::options(&sim, 262144 * MIB).with_dedup(false);
    let vol = Volume::create(Arc::new(sim.clone()), &opts).unwrap();
    // Small, highly compressible blocks at every other LBA: many map entries,
    // one run header per entry in the checkpoint.
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let mut lba = 0u64;
    let mut n = 0u64;
    loop {
        let mut b = vec![0u8; BS];
        let k = rng.gen_range(8..16);
        rng.fill(&mut b[..k]);
        match vol.write_at(lba * BS as u64, &b, false) {
            Ok(()) => {}
            Err(VolError::NoSpace) => break,
            Err(e) => panic!("{e}"),
        }
        lba += rng.gen_range(2..12);
        n += 1;
    }
    vol.flush().unwrap();
    let s = vol.stats();
    eprintln!("{n} blocks written; free {} bytes", s.physical_free_bytes);
    // The reserve promises that a checkpoint of the current map always fits.
    let r = vol.checkpoint();
    // Signed: the checkpoint may also free segments (found by the
    // overflow checks of the test profile).
    let used = s.physical_free_bytes as i64 - vol.stats().physical_free_bytes as i64;
    eprintln!(
        "checkpoint {:?} used {used} bytes ({} per entry)",
        r.is_ok(),
        used as f64 / n as f64
    );
    r.expect("a checkpoint must fit in the reserve");
}

/// A full log makes the volume impossible to open for writing.
#[test]
fn regression_full_log_volume_can_still_be_opened_for_writing() {
    let sim = SimStorage::new(8 * MIB);
    let opts = common::options(&sim, 64 * MIB)
        .with_codec(Codec::None)
        .with_dedup(false);
    let vol = Volume::create(Arc::new(sim.clone()), &opts).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(2);
    let mut lba = 0u64;
    loop {
        let b: Vec<u8> = (0..BS).map(|_| rng.gen()).collect();
        match vol.write_at(lba * BS as u64, &b, false) {
            Ok(()) => lba += 1,
            Err(VolError::NoSpace) => break,
            Err(e) => panic!("{e}"),
        }
    }
    vol.close().unwrap();
    drop(vol);
    // Client writes now get ENOSPC, as designed. But every open writes an
    // EPOCH sector and every close a full checkpoint, none of them bounded by
    // the reserve: after some restarts the volume cannot be opened at all.
    for cycle in 0..1_000 {
        let vol = match Volume::open(Arc::new(sim.clone()), OpenOptions::default()) {
            Ok(v) => v,
            Err(e) => panic!("cycle {cycle}: cannot open the volume for writing any more: {e}"),
        };
        vol.close().unwrap();
    }
}
