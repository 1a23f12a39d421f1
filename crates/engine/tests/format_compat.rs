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
//!
//! `fixtures/unit-rows-volume.sectors`: a volume made by cvol while its
//! liveness tables kept a row for every live unit (main at 223cb21), the
//! same way: `create --size 8M --physical-size 3M`, served, 64 KiB at 0
//! (16 blocks `A-block-kkkk;` repeated, four 16 KiB units) written, then
//! block 2 of it again at 1 MiB (a dedup reference into the first unit),
//! stopped cleanly (its tables: a row per unit, the first with a
//! reference); served again, 16 KiB of `B-block-kkkk;` blocks at 0 (the
//! first unit's owners all gone) and block 5 of A at 2 MiB (a reference
//! into the second unit, whose row had none) written and flushed, then
//! killed (kill -9). Made by `fixtures/make-unit-rows-volume.sh`.
mod common;
use cvol_engine::{check, OpenOptions, Volume};
use cvol_format::superblock::SUPERBLOCK_BYTES;
use cvol_format::superblock::{FLAG_RESUME_AT_SNAPSHOT, FLAG_UNIT_WINDOWS};
use cvol_format::{Superblock, SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET};
use cvol_storage::{SimStorage, Storage};
use std::sync::Arc;

const IMAGE_BYTES: u64 = 3 << 20;

fn v1_volume() -> SimStorage {
    volume_of(include_bytes!("fixtures/v1-volume.sectors"))
}

fn volume_of(sectors: &[u8]) -> SimStorage {
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

/// Block `k` of the fixture's data `tag`: `{tag}-block-{k:04};` repeated.
fn tagged_block(tag: &str, k: usize) -> Vec<u8> {
    let head = format!("{tag}-block-{k:04};");
    head.bytes().cycle().take(4096).collect()
}

fn assert_unit_rows_contents(vol: &Volume) {
    let block = |lba: u64| {
        let mut b = vec![0u8; 4096];
        vol.read_at(lba * 4096, &mut b).unwrap();
        b
    };
    for k in 0..16usize {
        let want = if k < 4 {
            tagged_block("B", k)
        } else {
            tagged_block("A", k)
        };
        assert!(block(k as u64) == want, "block {k}");
    }
    assert!(block(256) == tagged_block("A", 2), "the reference at 1 MiB");
    assert!(block(512) == tagged_block("A", 5), "the reference at 2 MiB");
}

/// A volume whose tables have a row per unit opens from them (rows of
/// units without references skipped), rolls forward a reference into a
/// unit whose row it skipped (its window found from its header), and is
/// marked so that the older binary refuses it.
#[test]
fn a_volume_with_a_row_per_unit_opens_from_its_tables_and_is_marked() {
    let sim = volume_of(include_bytes!("fixtures/unit-rows-volume.sectors"));
    for at in [SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET] {
        assert_eq!(flags(&sim, at) & FLAG_UNIT_WINDOWS, 0, "predates the flag");
    }
    let vol = Volume::open(Arc::new(sim.clone()), OpenOptions::default()).unwrap();
    assert_eq!(vol.tables_rejected(), None);
    assert!(vol.opened_from_tables(), "tables and the pages replayed");
    vol.verify_refcounts().unwrap();
    for at in [SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET] {
        assert_ne!(flags(&sim, at) & FLAG_UNIT_WINDOWS, 0);
    }
    assert_unit_rows_contents(&vol);
    assert_eq!(vol.stats().dedup.dedup_shared_records, 2);
    // The reference into the first unit goes: it dies (its owners went).
    vol.write_at(1 << 20, &tagged_block("C", 0), false).unwrap();
    vol.verify_refcounts().unwrap();
    assert_eq!(vol.stats().dedup.dedup_shared_records, 1);
    vol.close().unwrap();
    drop(vol);
    let report = check::check_volume(&sim, &mut |_, _| {});
    assert!(report.consistent(), "{report:?}");
    let vol = Volume::open(Arc::new(sim), OpenOptions::default()).unwrap();
    assert!(vol.opened_from_tables());
    vol.verify_refcounts().unwrap();
    assert_eq!(vol.stats().dedup.dedup_shared_records, 1);
}

/// The sessions both directory upgrades are tested with, on a fixture of
/// three directory blocks with a page each (at 0, 4 and 8 GiB): `flag`
/// set in both superblock copies at the first open for writing; two
/// sessions that write in the first block only (the second's checkpoint
/// carries the other two over); then a read-only open, on which
/// `at_open` looks before the three blocks are read and `after_reads`
/// after; the volume checks consistent.
fn two_sessions_then_read(
    sim: &SimStorage,
    flag: u32,
    at_open: impl Fn(&Volume),
    after_reads: impl Fn(&Volume),
) {
    assert_eq!(flags(sim, SUPERBLOCK_A_OFFSET) & flag, 0);
    const GIB: u64 = 1 << 30;
    let expect = [(0, 0x41u8), (4 * GIB, 0x42), (8 * GIB, 0x43)];
    for (i, at) in [4096, 8192].into_iter().enumerate() {
        let vol = Volume::open(Arc::new(sim.clone()), OpenOptions::default()).unwrap();
        if i == 0 {
            for at in [SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET] {
                assert_ne!(flags(sim, at) & flag, 0);
            }
        }
        vol.write_at(at, &[0x44 + i as u8; 4096], false).unwrap();
        vol.close().unwrap();
    }
    let ro = OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    let vol = Volume::open(Arc::new(sim.clone()), ro).unwrap();
    at_open(&vol);
    let mut b = vec![0u8; 4096];
    for (at, byte) in expect {
        vol.read_at(at, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == byte), "the block at {at}");
    }
    after_reads(&vol);
    drop(vol);
    let report = check::check_volume(sim, &mut |_, _| {});
    assert!(report.consistent(), "{report:?}");
}

/// A volume whose directory blocks predate summaries gets the flag at its
/// first open for writing and every block written summarized by the next
/// checkpoint, not only those changed since (`unsummarized-dirs-volume`).
/// An open after a checkpoint that carried the other two over leaves all
/// three unread (the commit names them: the same first open for writing
/// set `FLAG_DIR_NAMED`; the newest checkpoint's own block needs no check
/// at open either), and the volume reads and checks as before
/// (mutation: not marking the blocks changed at the upgrade leaves those
/// two unsummarized, read whole at open).
#[test]
fn an_older_volumes_directory_is_summarized_at_its_next_checkpoint() {
    use cvol_format::superblock::FLAG_DIR_SUMMARY;
    let sim = volume_of(include_bytes!("fixtures/unsummarized-dirs-volume.sectors"));
    two_sessions_then_read(
        &sim,
        FLAG_DIR_SUMMARY,
        |vol| assert_eq!(vol.map_dir_blocks_unread(), 3),
        |vol| {
            assert_eq!(vol.map_dir_blocks_unread(), 0);
            assert_eq!(vol.map_dir_blocks_packed(), 0);
        },
    );
}

/// A volume whose summarized directory blocks hold their lists inline
/// gets the flag for lists apart at its first open for writing, and every
/// block written with its list apart by the next checkpoint
/// (`inline-lists-volume`: its last two checkpoints carried the last two
/// blocks over, so they are packed at the upgrade's open). An open after
/// a checkpoint that carried them over again leaves all three unread
/// (named by the commit), reads each block and its list when first
/// needed, and
/// the volume reads and checks as before (mutation: not marking the
/// inline blocks changed at the upgrade leaves those two inline, and no
/// list is read).
#[test]
fn an_older_volumes_directory_lists_are_moved_apart_at_its_next_checkpoint() {
    use cvol_format::superblock::FLAG_DIR_LIST_APART;
    let sim = volume_of(include_bytes!("fixtures/inline-lists-volume.sectors"));
    two_sessions_then_read(
        &sim,
        FLAG_DIR_LIST_APART,
        |vol| {
            assert_eq!(vol.map_dir_blocks_unread(), 3);
            assert_eq!(vol.map_dir_lists_read(), 0);
        },
        |vol| {
            assert_eq!(vol.map_dir_blocks_unread(), 0);
            assert_eq!(vol.map_dir_blocks_packed(), 0);
            assert_eq!(vol.map_dir_blocks_read(), 3);
            assert_eq!(vol.map_dir_lists_read(), 3);
        },
    );
}

/// A volume whose commits do not name their directory (made by the cvol
/// before them, `unnamed-dirs-volume`: lists apart, the last two
/// checkpoints carrying the last two blocks over) gets the flag at its
/// first open for writing, and the checkpoints after it name the
/// directory: an open after two of them leaves the three blocks unread
/// (the two carried over and the newest checkpoint's own), reads each
/// (and its list) when first needed, and the volume
/// reads and checks as before (mutation: writing unnamed commits leaves
/// both read at open, packed).
#[test]
fn an_older_volumes_commits_name_their_directory_from_its_next_checkpoint() {
    use cvol_format::superblock::FLAG_DIR_NAMED;
    let sim = volume_of(include_bytes!("fixtures/unnamed-dirs-volume.sectors"));
    two_sessions_then_read(
        &sim,
        FLAG_DIR_NAMED,
        |vol| {
            assert_eq!(vol.map_dir_blocks_unread(), 3);
            assert_eq!(vol.map_dir_blocks_packed(), 0);
            assert_eq!(vol.map_dir_blocks_read(), 0);
        },
        |vol| {
            assert_eq!(vol.map_dir_blocks_unread(), 0);
            assert_eq!(vol.map_dir_blocks_read(), 3);
            assert_eq!(vol.map_dir_lists_read(), 3);
        },
    );
}

/// Liveness tables written before they carried their row counts: open
/// checks and counts their rows; the tables a checkpoint writes after
/// carry counts, and an open after it takes them and leaves the rows
/// packed, the volume reading and checking as before. (Every table is
/// marked changed at such an open, so that the next checkpoint writes
/// them all: `liveness::tables::tests::tables_without_counts_are_written_again`;
/// here the replay of the fixture's last session changes its shared
/// segment anyway.)
#[test]
fn older_liveness_tables_gain_their_row_counts_at_the_next_checkpoint() {
    let sim = volume_of(include_bytes!("fixtures/unit-rows-volume.sectors"));
    let ro = || OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    let vol = Volume::open(Arc::new(sim.clone()), ro()).unwrap();
    assert_eq!(vol.table_rows_taken_at_their_counts(), 0, "none has counts");
    drop(vol);
    let vol = Volume::open(Arc::new(sim.clone()), OpenOptions::default()).unwrap();
    vol.write_at(6 << 20, &tagged_block("D", 0), false).unwrap();
    vol.close().unwrap();
    drop(vol);
    let vol = Volume::open(Arc::new(sim.clone()), ro()).unwrap();
    assert!(vol.table_rows_taken_at_their_counts() > 0);
    assert_eq!(vol.tables_rejected(), None, "the rows are what they said");
    assert_unit_rows_contents(&vol);
    vol.verify_refcounts().unwrap();
    drop(vol);
    let report = check::check_volume(&sim, &mut |_, _| {});
    assert!(report.consistent(), "{report:?}");
}

/// (codec, table index) of the newest liveness *group* table record on
/// the store of each table (MAP_TABLE records in the directory slots
/// after the map pages': table `1 + s` for segment `s`).
fn group_table_codecs(sim: &SimStorage) -> Vec<(cvol_format::CodecTag, u64)> {
    use cvol_format::checkpoint::MAP_PAGE_BLOCKS;
    use cvol_format::record::{RecordHeader, RecordKind, RECORD_HEADER_BYTES, RECORD_MAGIC};
    let mut b = vec![0u8; SUPERBLOCK_BYTES];
    sim.read_at(SUPERBLOCK_A_OFFSET, &mut b).unwrap();
    let sb = Superblock::decode(&b).unwrap();
    let npages = sb.logical_blocks().div_ceil(MAP_PAGE_BLOCKS);
    let mut img = vec![0u8; sim.len_bytes() as usize];
    sim.read_at(0, &mut img).unwrap();
    (0..img.len() - RECORD_HEADER_BYTES)
        .filter(|&i| img[i..i + 4] == RECORD_MAGIC.to_le_bytes())
        .filter_map(|i| RecordHeader::decode(&img[i..]).ok())
        .filter(|h| h.kind == RecordKind::MapTable)
        .map(|h| (h.lba / MAP_PAGE_BLOCKS - npages, (h.seq, h.codec)))
        .filter(|&(t, _)| (1..=sb.segment_count()).contains(&t))
        .fold(std::collections::BTreeMap::new(), |mut m, (t, v)| {
            let e = m.entry(t).or_insert(v);
            *e = (*e).max(v);
            m
        })
        .into_iter()
        .map(|(t, (_, codec))| (codec, t))
        .collect()
}

/// `fixtures/lz4-tables-volume.sectors` (made by
/// `fixtures/make-lz4-tables-volume.sh` with cvol at 3271524): 64 KiB of
/// `A-block-kkkk;` blocks at 0 (four 16 KiB units), then blocks 2 and 5 of
/// it again at 1 MiB and 2 MiB (dedup references into two units), stopped
/// cleanly: its group tables lz4-compressed whole, with row counts.
fn assert_lz4_tables_contents(vol: &Volume, extra: bool) {
    let block = |at: u64| {
        let mut b = vec![0u8; 4096];
        vol.read_at(at, &mut b).unwrap();
        b
    };
    for k in 0..16 {
        assert!(
            block(k * 4096) == tagged_block("A", k as usize),
            "block {k}"
        );
    }
    assert!(block(1 << 20) == tagged_block("A", 2));
    assert!(block(2 << 20) == tagged_block("A", 5));
    if extra {
        assert!(block(6 << 20) == tagged_block("A", 9));
    }
}

/// Group tables of the older layout (lz4 as a whole, with row counts)
/// open at their counts, their rows left packed, and are marked changed:
/// the next checkpoint writes them all head-first (codec none), and an
/// open after it takes those at their counts too, the volume reading and
/// checking as before.
#[test]
fn older_lz4_tables_open_and_changed_ones_are_written_head_first() {
    use cvol_format::CodecTag;
    let sim = volume_of(include_bytes!("fixtures/lz4-tables-volume.sectors"));
    let old = group_table_codecs(&sim);
    assert!(
        !old.is_empty() && old.iter().all(|&(c, _)| c == CodecTag::Lz4),
        "{old:?}"
    );
    let ro = || OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    let vol = Volume::open(Arc::new(sim.clone()), ro()).unwrap();
    assert!(vol.opened_from_tables());
    assert!(
        vol.table_rows_taken_at_their_counts() > 0,
        "lz4 with counts"
    );
    assert_eq!(vol.tables_rejected(), None);
    assert_lz4_tables_contents(&vol, false);
    vol.verify_refcounts().unwrap();
    drop(vol);
    // A checkpoint without a change writes every group table head-first.
    let vol = Volume::open(Arc::new(sim.clone()), OpenOptions::default()).unwrap();
    vol.checkpoint().unwrap();
    let now = group_table_codecs(&sim);
    assert_eq!(now.len(), old.len(), "{now:?}");
    assert!(now.iter().all(|&(c, _)| c == CodecTag::None), "{now:?}");
    // A third reference into the first unit.
    vol.write_at(6 << 20, &tagged_block("A", 9), false).unwrap();
    vol.close().unwrap();
    drop(vol);
    let vol = Volume::open(Arc::new(sim.clone()), ro()).unwrap();
    assert!(
        vol.opened_from_tables(),
        "head-first tables used, not rebuilt"
    );
    assert!(vol.table_rows_taken_at_their_counts() > 0);
    assert_eq!(vol.tables_rejected(), None, "the rows are what they said");
    assert_lz4_tables_contents(&vol, true);
    vol.verify_refcounts().unwrap();
    drop(vol);
    let report = check::check_volume(&sim, &mut |_, _| {});
    assert!(report.consistent(), "{report:?}");
    assert!(report
        .notes
        .iter()
        .all(|n| !n.contains("no liveness tables")));
}

/// A volume written by this build: its group tables head-first (codec
/// none), reopened from them (not rebuilt from the map), the rows taken
/// at their counts and decoded on first use to what they said.
#[test]
fn a_volume_written_now_reopens_from_its_head_first_tables() {
    use cvol_format::CodecTag;
    let sim = SimStorage::new(16 << 20);
    let vol = common::create(&sim, &common::options(&sim, 8 << 20));
    let shared = common::text(7, 4096);
    for i in 0..64u64 {
        vol.write_at(i * 8192, &common::text(100 + i, 4096), false)
            .unwrap();
        vol.write_at(i * 8192 + 4096, &shared, false).unwrap();
    }
    common::close_and_check(vol, &sim);
    let codecs = group_table_codecs(&sim);
    assert!(!codecs.is_empty(), "group tables written");
    assert!(
        codecs.iter().all(|&(c, _)| c == CodecTag::None),
        "{codecs:?}"
    );
    let ro = OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    let vol = Volume::open(Arc::new(sim.clone()), ro).unwrap();
    assert!(vol.opened_from_tables());
    assert!(vol.table_rows_taken_at_their_counts() > 0);
    assert_eq!(vol.stats().dedup.dedup_shared_records, 1);
    assert_eq!(vol.tables_rejected(), None);
    let mut b = vec![0u8; 4096];
    for i in 0..64u64 {
        vol.read_at(i * 8192 + 4096, &mut b).unwrap();
        assert!(b == shared, "block {i}");
    }
    vol.verify_refcounts().unwrap();
}
