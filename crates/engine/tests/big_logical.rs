//! A volume of the largest logical size (2^32 blocks, 16 TiB) on a small
//! store, with a few MiB written, costs what it holds: its block map takes
//! what a 1 GiB volume's would, and it writes, checkpoints, reopens (clean
//! and after a crash), scrubs, recompresses and checks as one would.
mod common;
use common::{BS, MIB};
use cvol_engine::volume::ScrubOptions;
use cvol_engine::{Codec, CodecPolicy, Volume};
use cvol_format::LOGICAL_SIZE_MAX_BYTES;
use cvol_storage::SimStorage;

const BLOCKS: u64 = LOGICAL_SIZE_MAX_BYTES / BS as u64;

/// The LBAs written: 1 MiB at the start, and one block in each 1/64th of
/// the volume, the last block among them.
fn lbas() -> Vec<u64> {
    let spread = (1..64).map(|i| BLOCKS / 64 * i + i).chain([BLOCKS - 1]);
    (0..256).chain(spread).collect()
}

fn write_all(vol: &Volume, version: u32) {
    for lba in lbas() {
        let data = common::wordy_block(lba, version);
        vol.write_at(lba * BS as u64, &data, false).unwrap();
    }
    vol.flush().unwrap();
}

fn assert_all(vol: &Volume, version: u32) {
    let mut b = vec![0u8; BS];
    for lba in lbas() {
        vol.read_at(lba * BS as u64, &mut b).unwrap();
        assert!(b == common::wordy_block(lba, version), "lba {lba}");
    }
    // Between the written blocks: zeros.
    vol.read_at((BLOCKS / 2 + 1000) * BS as u64, &mut b)
        .unwrap();
    assert!(b.iter().all(|&x| x == 0));
}

/// The map's memory, as `stat` reports it: what 320 pages' worth of
/// entries take, far below the 64 MiB one slot per page of 2^32 blocks
/// would.
fn assert_small_map(vol: &Volume) {
    let bytes = vol.stats().map_memory_bytes;
    assert!(bytes < 4 * MIB, "map memory {bytes} bytes");
}

#[test]
fn a_16_tib_volume_costs_what_it_holds() {
    let sim = SimStorage::new(64 * MIB);
    let strong = Codec::Zstd(9);
    let opts =
        common::options(&sim, LOGICAL_SIZE_MAX_BYTES).with_codec(CodecPolicy::Auto { strong });
    let vol = common::create(&sim, &opts);
    assert_eq!(vol.size_bytes(), 16 << 40);
    assert_small_map(&vol);
    write_all(&vol, 1);
    vol.checkpoint().unwrap();
    assert_small_map(&vol);
    write_all(&vol, 2);
    common::close_and_check(vol, &sim);

    // Clean reopen.
    let vol = common::open(&sim);
    assert_small_map(&vol);
    assert_all(&vol, 2);
    let mut rewritten = 0;
    loop {
        let r = vol.recompress_pass(64 * MIB, false).unwrap();
        rewritten += r.blocks_rewritten;
        if r.wrapped {
            break;
        }
    }
    assert_eq!(rewritten, lbas().len() as u64, "every lz4 block, once");
    let scrub = ScrubOptions {
        bytes_per_sec: 0,
        yield_to_clients: false,
        max_listed: 10,
    };
    let rep = vol.scrub(&scrub, &|_| {}).unwrap();
    assert!(rep.clean(), "{rep:?}");
    assert_eq!(rep.blocks_checked, lbas().len() as u64);
    write_all(&vol, 3);
    drop(vol); // a crash: no checkpoint since version 3

    let vol = common::open(&sim);
    assert_small_map(&vol);
    assert_all(&vol, 3);
    common::close_and_check(vol, &sim);
}
