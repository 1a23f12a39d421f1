//! Helpers shared by the engine's integration tests: the usual volume
//! options, create and open, and reading record headers off the store;
//! `sim` is what the seeded simulations share (their oracle), `seeds` how
//! they pick seeds, `sealed` their runs on encrypted volumes.
#![allow(dead_code, reason = "each test binary uses only some of the helpers")]
pub mod pools;
pub mod sealed;
pub mod seeds;
pub mod sim;
pub mod stores;

use cvol_engine::{CreateOptions, OpenOptions, Volume};
use cvol_format::record::{RecordHeader, RecordKind, RECORD_HEADER_BYTES, RECORD_MAGIC};
use cvol_format::CheckpointPointer;
use cvol_storage::{SimStorage, Storage};
use std::sync::Arc;

pub const BS: usize = cvol_format::BLOCK_SIZE_BYTES as usize;
pub const MIB: u64 = 1 << 20;

/// A volume of `logical` bytes on all of `sim`: lz4, 1 MiB segments, dedup
/// on. Change what a test needs with the `with_*` methods.
pub fn options(sim: &SimStorage, logical: u64) -> CreateOptions {
    CreateOptions::new(logical, sim.len_bytes()).with_segment_size(MIB)
}

/// Formats `sim` with `opts`; the volume stays open.
pub fn create(sim: &SimStorage, opts: &CreateOptions) -> Volume {
    Volume::create(Arc::new(sim.clone()), opts).expect("create")
}

/// Formats `sim` with `opts` and closes the volume again.
pub fn create_closed(sim: &SimStorage, opts: &CreateOptions) {
    create(sim, opts).close().expect("close after create");
}

/// Opens the volume on `sim` with the default options.
pub fn open(sim: &SimStorage) -> Volume {
    open_with(sim, OpenOptions::default())
}

pub fn open_with(sim: &SimStorage, options: OpenOptions) -> Volume {
    Volume::open(Arc::new(sim.clone()), options).expect("open")
}

/// The record header at byte `at` of the store.
pub fn record_header(sim: &SimStorage, at: u64) -> RecordHeader {
    let mut h = [0u8; RECORD_HEADER_BYTES];
    sim.read_at(at, &mut h).expect("read a record header");
    RecordHeader::decode(&h).expect("a record header")
}

/// Byte offsets of the DATA records on the store whose header names `lba`
/// first.
pub fn data_records_of(sim: &SimStorage, lba: u64) -> Vec<u64> {
    records_of(sim, RecordKind::Data, lba)
}

/// Byte offsets of the records of `kind` on the store whose header names
/// `lba` first.
pub fn records_of(sim: &SimStorage, kind: RecordKind, lba: u64) -> Vec<u64> {
    let mut img = vec![0u8; sim.len_bytes() as usize];
    sim.read_at(0, &mut img).expect("read the store");
    (0..img.len() - RECORD_HEADER_BYTES)
        .filter(|&i| img[i..i + 4] == RECORD_MAGIC.to_le_bytes())
        .filter(|&i| RecordHeader::decode(&img[i..]).is_ok_and(|h| h.kind == kind && h.lba == lba))
        .map(|i| i as u64)
        .collect()
}

/// The checkpoint pointer in slot `i` (0 or 1), if it decodes.
pub fn pointer_slot(sim: &SimStorage, i: usize) -> Option<CheckpointPointer> {
    let mut b = vec![0u8; cvol_format::pointer::POINTER_BYTES];
    sim.read_at(CheckpointPointer::slot_offset(i), &mut b)
        .ok()?;
    CheckpointPointer::decode(&b).ok()
}

/// Compressible text (about 3:1 with lz4), unique per (seed, position).
pub fn text(seed: u64, len: usize) -> Vec<u8> {
    use rand::{Rng, SeedableRng};
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let words = [
        "volume ",
        "segment ",
        "record ",
        "checkpoint ",
        "unit ",
        "codec ",
        "block ",
        "map ",
    ];
    let mut v = Vec::with_capacity(len + 16);
    while v.len() < len {
        if r.gen_ratio(1, 6) {
            v.extend_from_slice(format!("{} ", r.gen::<u16>()).as_bytes());
        }
        v.extend_from_slice(words[r.gen_range(0..words.len())].as_bytes());
    }
    v.truncate(len);
    v
}

/// Checks the reference counts, closes the volume, and runs `check` on the
/// store: it must be consistent.
pub fn close_and_check(vol: Volume, sim: &SimStorage) {
    vol.verify_refcounts().unwrap();
    vol.close().unwrap();
    drop(vol);
    let rep = cvol_engine::check::check_volume(sim, &mut |_, _| {});
    assert!(rep.consistent(), "check: {:?}", rep.errors);
}

/// Runs background recompression passes of `pass_bytes` until one rewrites
/// nothing; returns the blocks rewritten in all.
#[allow(dead_code, reason = "not every test binary recompresses")]
pub fn recompress_to_end(vol: &Volume, pass_bytes: u64) -> u64 {
    let mut total = 0;
    loop {
        let r = vol.recompress_pass(pass_bytes, false).unwrap();
        if r.blocks_rewritten == 0 {
            return total;
        }
        total += r.blocks_rewritten;
    }
}

/// Compressible content unique to (lba, version): words with a random
/// byte now and then (about 3:1 with zstd, 2.2:1 with lz4).
pub fn wordy_block(lba: u64, version: u32) -> Vec<u8> {
    use rand::{Rng, SeedableRng};
    let mut r = rand::rngs::StdRng::seed_from_u64(lba * 1_000_003 + u64::from(version));
    let words = [
        "alpha ", "bravo ", "charlie ", "delta ", "echo ", "foxtrot ", "golf ",
    ];
    let mut v = format!("lba {lba} version {version} ").into_bytes();
    while v.len() < BS {
        v.extend_from_slice(words[r.gen_range(0..words.len())].as_bytes());
        if r.gen_ratio(1, 8) {
            v.push(r.gen());
        }
    }
    v.truncate(BS);
    v
}
