//! A pool's open reads no map page (nor directory block without tables)
//! that the newest checkpoint names, when both checkpoint pointers decode:
//! every such record was synced before that checkpoint's commit, and its
//! pointer after the commit, so no crash can have damaged it (a fallback
//! candidate, which may be stale, is verified whole). Pages are verified
//! when first read. A damaged page reads as an error where it is used,
//! refuses writes into its range (its other entries are unknown), `check`
//! and scrub report it, and `check --repair` (which verifies every page)
//! falls back past it.
mod common;
use common::{BS, MIB};
use cvol_engine::pool::Pool;
use cvol_engine::volume::ScrubOptions;
use cvol_engine::{OpenOptions, Volume};
use cvol_format::checkpoint::{DIR_PAGES, MAP_PAGE_BLOCKS};
use cvol_format::pool::{PoolTable, EXTENT_BLOCKS, POOL_HEADER_BYTES, POOL_SLOT_BYTES};
use cvol_format::pool::{NO_EXTENT, POOL_SLOT_OFFSETS};
use cvol_format::record::{RecordHeader, RecordKind, RECORD_HEADER_BYTES, RECORD_MAGIC};
use cvol_format::CodecTag;
use cvol_storage::{SimStorage, Storage};
use std::sync::Arc;

const BSU: u64 = BS as u64;
/// Map pages the volume writes a block in (and its snapshot copies).
const PAGES: u64 = 40;
const VOLUME_BYTES: u64 = PAGES * MAP_PAGE_BLOCKS * BSU;

fn block(lba: u64, version: u64) -> Vec<u8> {
    let line = format!("block {lba} version {version} of a snapshotted volume. ");
    line.repeat(BS / line.len() + 1).as_bytes()[..BS].to_vec()
}

fn open_pool(store: &SimStorage) -> Pool {
    let vol = Volume::open(Arc::new(store.clone()), OpenOptions::default()).expect("open");
    Pool::attach(Arc::new(vol)).expect("attach")
}

/// The newest valid pool table on the store.
fn table(store: &SimStorage, uuid: &[u8; 16]) -> PoolTable {
    let mut best: Option<PoolTable> = None;
    for off in POOL_SLOT_OFFSETS {
        let mut b = vec![0u8; POOL_SLOT_BYTES as usize];
        store.read_at(off, &mut b).expect("read a table slot");
        let Ok(n) = PoolTable::payload_len(&b, uuid) else {
            continue;
        };
        if let Ok(t) = PoolTable::decode_with(&b[..POOL_HEADER_BYTES + n], uuid, None) {
            if best.as_ref().is_none_or(|b| b.generation < t.generation) {
                best = Some(t);
            }
        }
    }
    best.expect("a valid table")
}

/// A pool whose volume `default` wrote a block in each of `PAGES` map
/// pages, took snapshot `default@s`, and overwrote them all (so the
/// snapshot's map holds `PAGES` pages of copied entries); then closed and
/// reopened once, writing one block, so that the checkpoint that wrote
/// those pages is the older of the two pointers. Returns the store and
/// the pool LBAs of the snapshot's extents.
fn snapshotted_pool() -> (SimStorage, Vec<(u64, u64)>) {
    let (store, pool) = snapshotted_pool_of(VOLUME_BYTES);
    pool.engine().close().unwrap();
    let uuid = pool.engine().superblock().uuid;
    let t = table(&store, &uuid);
    let base = u64::from(t.volume("default").expect("default").extents[0]) * EXTENT_BLOCKS;
    DEFAULT_BASE.with(|b| b.set(base));
    let s = t.snapshot("default", "s").expect("the snapshot");
    let extents = (s.extents.iter())
        .filter(|&&e| e != NO_EXTENT)
        .map(|&e| {
            (
                u64::from(e) * EXTENT_BLOCKS,
                (u64::from(e) + 1) * EXTENT_BLOCKS,
            )
        })
        .collect();
    (store, extents)
}

thread_local! {
    /// The pool LBA of volume `default`'s block 0 (`snapshotted_pool`).
    static DEFAULT_BASE: std::cell::Cell<u64> = const { std::cell::Cell::new(u64::MAX) };
}

/// The pool map page of volume `default`'s map page `p`.
fn default_page(p: u64) -> u64 {
    let base = DEFAULT_BASE.with(|b| b.get());
    assert!(base != u64::MAX, "snapshotted_pool first");
    (base + p * MAP_PAGE_BLOCKS) / MAP_PAGE_BLOCKS
}

/// Offsets of the MAP_CHUNK records on the store whose page lies in one
/// of `ranges` (pool LBAs).
fn page_records_in(store: &SimStorage, ranges: &[(u64, u64)]) -> Vec<u64> {
    let mut img = vec![0u8; store.len_bytes() as usize];
    store.read_at(0, &mut img).expect("read the store");
    (0..img.len() - RECORD_HEADER_BYTES)
        .filter(|&i| img[i..i + 4] == RECORD_MAGIC.to_le_bytes())
        .filter(|&i| {
            RecordHeader::decode_verified(&img[i..]).is_ok_and(|(h, _)| {
                h.kind == RecordKind::MapChunk
                    && ranges.iter().any(|&(a, b)| (a..b).contains(&h.lba))
            })
        })
        .map(|i| i as u64)
        .collect()
}

#[test]
fn open_verifies_no_page_the_newest_checkpoint_names() {
    let (store, snap) = snapshotted_pool();
    assert_eq!(page_records_in(&store, &snap).len() as u64, PAGES);
    let pool = open_pool(&store);
    let vol = pool.engine();
    // The last session changed one page (and wrote its record), the one
    // before wrote the volume's and the snapshot's: open reads none of
    // them (mutation: verifying at open the pages the newest checkpoint
    // wrote, as before, reads the changed one; verifying every page reads
    // them all).
    let verified = vol.map_pages_verified_at_open();
    assert_eq!(
        verified, 0,
        "map pages verified at open (the volume's {PAGES} and the snapshot's {PAGES} \
         were written by the older checkpoint, one by the newest)"
    );
    // Pages are read (and verified) when used.
    snapshot_reads_its_blocks(&pool, "");
}

#[test]
fn a_damaged_snapshot_page_reads_as_an_error_and_check_reports_it() {
    let (store, snap) = snapshotted_pool();
    let records = page_records_in(&store, &snap);
    assert_eq!(records.len() as u64, PAGES);
    // Damage at rest: a byte of each snapshot page's payload.
    for &at in &records {
        store.flip_bit(at + RECORD_HEADER_BYTES as u64 + 1, 3);
    }
    store.sync().unwrap();
    // Open does not read those pages: it opens (before, every page was
    // verified at open, the older checkpoint names the same records, and
    // open refused).
    let pool = open_pool(&store);
    let v = pool.volume("default").expect("default");
    let s = pool.volume("default@s").expect("the snapshot's view");
    let mut b = vec![0u8; BS];
    for p in 0..PAGES {
        let l = p * MAP_PAGE_BLOCKS + 7;
        v.read_at(l * BSU, &mut b).unwrap();
        let want = block(l, if l == 7 { 3 } else { 2 });
        assert!(b == want, "the volume's block {l} reads its own page");
        let e = s.read_at(l * BSU, &mut b).expect_err("a damaged page");
        assert!(
            matches!(e, cvol_engine::VolError::Corrupt { .. }),
            "the snapshot's block {l}: {e}"
        );
    }
    let scrub = pool.engine().scrub(&ScrubOptions::default(), &|_| {});
    let scrub = scrub.expect("no scrub runs");
    assert!(
        scrub.metadata_errors.iter().any(|e| e.contains("map page")),
        "scrub: {:?}",
        scrub.metadata_errors
    );
    drop((v, s));
    drop(pool);
    let rep = cvol_engine::check::check_volume(&store, &mut |_, _| {});
    assert!(!rep.consistent(), "check finds the damaged pages");
    // Repair verifies every page of the checkpoint it takes: it falls back
    // past them (to an older commit in the log, rolling forward), and the
    // snapshot reads its blocks again.
    cvol_engine::check::repair_volume(Arc::new(store.clone()));
    snapshot_reads_its_blocks_and_checks_clean(&store, "after repair");
}

/// `check` finds the store's damaged page; `repair_volume` runs, and the
/// pool opens again.
fn checked_then_repaired(store: &SimStorage) -> Pool {
    let rep = cvol_engine::check::check_volume(store, &mut |_, _| {});
    assert!(!rep.consistent(), "check finds the damaged page");
    cvol_engine::check::repair_volume(Arc::new(store.clone()));
    open_pool(store)
}

/// (offset, seq) of every MAP_CHUNK record on the store whose page is
/// page `page` of pool LBA space.
fn page_records_of(store: &SimStorage, page: u64) -> Vec<(u64, u64)> {
    let lba = page * MAP_PAGE_BLOCKS;
    common::records_of(store, RecordKind::MapChunk, lba)
        .into_iter()
        .map(|at| (at, common::record_header(store, at).seq))
        .collect()
}

/// The two checkpoint pointers' commit seqs, newest first.
fn pointer_seqs(store: &SimStorage) -> (u64, u64) {
    let mut ptrs: Vec<_> = (0..2)
        .filter_map(|i| common::pointer_slot(store, i))
        .collect();
    ptrs.sort_by_key(|p| std::cmp::Reverse(p.generation));
    assert_eq!(ptrs.len(), 2, "two checkpoints published");
    (ptrs[0].commit_seq, ptrs[1].commit_seq)
}

#[test]
fn a_damaged_page_the_newest_checkpoint_wrote_is_an_error_where_it_is_used() {
    let (store, _) = snapshotted_pool();
    let (newest, older) = pointer_seqs(&store);
    // The last session wrote block 7 (version 3): page 0's newest record
    // is the newest checkpoint's own (written after the older commit).
    let recs = page_records_of(&store, default_page(0));
    let &(at, seq) = recs.iter().max_by_key(|r| r.1).expect("page 0's records");
    assert!(
        seq > older && seq < newest,
        "seq {seq}, commits {older} and {newest}"
    );
    // Damage at rest (bit rot; no crash can damage a record synced before
    // the commit its published pointer names): open takes the newest
    // checkpoint and leaves the page on disk.
    store.flip_bit(at + RECORD_HEADER_BYTES as u64 + 1, 5);
    store.sync().unwrap();
    let pool = open_pool(&store);
    let warnings = pool.engine().recovery_warnings().join("; ");
    assert!(
        !warnings.contains("recovered from the checkpoint generation"),
        "open takes the newest checkpoint (mutation: verifying its own pages at \
         open falls back to the older one): {warnings}"
    );
    // The page's blocks read as errors, the other pages' as written.
    let v = pool.volume("default").expect("default");
    let mut b = vec![0u8; BS];
    let e = v.read_at(7 * BSU, &mut b).expect_err("page 0 is damaged");
    assert!(matches!(e, cvol_engine::VolError::Corrupt { .. }), "{e}");
    for p in 1..PAGES {
        let l = p * MAP_PAGE_BLOCKS + 7;
        v.read_at(l * BSU, &mut b).unwrap();
        assert!(b == block(l, 2), "block {l}");
    }
    drop(v);
    drop(pool);
    // `check`, which falls back past the damaged page, names the blocks it
    // holds, those the served volume refuses (mutation: naming only what
    // its own fallback reads names none).
    let rep = cvol_engine::check::check_volume(&store, &mut |_, _| {});
    let p0 = default_page(0) * MAP_PAGE_BLOCKS;
    assert_eq!(rep.damaged_page_lbas, [(p0, p0 + MAP_PAGE_BLOCKS)]);
    // Repair verifies every page of the checkpoint it takes: it falls back
    // to the older one and rolls forward, and every block reads again.
    let pool = checked_then_repaired(&store);
    let v = pool.volume("default").expect("default");
    for p in 0..PAGES {
        let l = p * MAP_PAGE_BLOCKS + 7;
        v.read_at(l * BSU, &mut b).unwrap();
        assert!(
            b == block(l, if l == 7 { 3 } else { 2 }),
            "block {l} after repair"
        );
    }
    drop(v);
    drop(pool);
    snapshot_reads_its_blocks_and_checks_clean(&store, "after repair");
}

#[test]
fn a_write_into_a_damaged_carried_over_page_is_refused_and_keeps_its_entries() {
    let (store, _) = snapshotted_pool();
    let (_, older) = pointer_seqs(&store);
    // Volume page 3 (block 3 * 512 + 7, version 2) was written by the
    // older checkpoint and carried over by the newest: open leaves it.
    let recs = page_records_of(&store, default_page(3));
    let &(at, seq) = recs.iter().max_by_key(|r| r.1).expect("page 3's records");
    assert!(seq <= older, "seq {seq}, older commit {older}");
    store.flip_bit(at + RECORD_HEADER_BYTES as u64 + 1, 2);
    store.sync().unwrap();
    let pool = open_pool(&store);
    assert!(
        pool.engine().map_pages_verified_at_open() <= 2,
        "page 3 is not read at open"
    );
    let v = pool.volume("default").expect("default");
    let l = 3 * MAP_PAGE_BLOCKS + 7;
    // A write elsewhere in that page would have to rewrite the page whole:
    // it is refused (mutation: taking the unreadable page for an empty one
    // writes it with the one new entry, dropping block `l` silently).
    let other = 3 * MAP_PAGE_BLOCKS + 100;
    let e = (v.write_at(other * BSU, &block(other, 9), false)).expect_err("refused");
    assert!(matches!(e, cvol_engine::VolError::Corrupt { .. }), "{e}");
    let mut b = vec![0u8; BS];
    let e = v.read_at(l * BSU, &mut b).expect_err("its page is damaged");
    assert!(matches!(e, cvol_engine::VolError::Corrupt { .. }), "{e}");
    // Pages around it take writes.
    let next = 4 * MAP_PAGE_BLOCKS + 100;
    v.write_at(next * BSU, &block(next, 9), false).unwrap();
    drop(v);
    pool.engine().close().unwrap();
    drop(pool);
    let pool = checked_then_repaired(&store);
    let v = pool.volume("default").expect("default");
    v.read_at(l * BSU, &mut b).unwrap();
    assert!(b == block(l, 2), "block {l} after repair");
    v.read_at(next * BSU, &mut b).unwrap();
    assert!(b == block(next, 9), "block {next} after repair");
    v.read_at(other * BSU, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0), "block {other} was never written");
}

#[test]
fn open_counts_the_records_of_the_pages_it_leaves_on_disk_live() {
    // The snapshot's page records were written by the older checkpoint:
    // open counts them live (summed per segment from the directory)
    // without reading them. The volume is then rewritten many times over
    // (16 MiB store, 1 MiB segments: the log reuses what it frees), and
    // `check`, which parses every segment, finds each segment's live bytes
    // right and the snapshot reads its blocks (mutations: counting only
    // the first map record of each segment, or none of the pages', fail
    // the check).
    let (store, snap) = snapshotted_pool();
    let before = page_records_in(&store, &snap);
    assert_eq!(before.len() as u64, PAGES);
    let pool = open_pool(&store);
    assert!(pool.engine().opened_from_tables(), "open took the tables");
    rewrite_many_times(&pool, 97);
    pool.engine().close().unwrap();
    drop(pool);
    snapshot_reads_its_blocks_and_checks_clean(&store, "after the log reused segments");
}

/// Rewrites 16 blocks of each of `default`'s `PAGES` pages 12 times over,
/// incompressible and new every round (2.5 MiB a round; `salt` varies the
/// data), a checkpoint after each round: the log reuses what it frees.
fn rewrite_many_times(pool: &Pool, salt: u64) {
    let v = pool.volume("default").expect("default");
    for round in 0..12u64 {
        for p in 0..PAGES {
            let l = p * MAP_PAGE_BLOCKS + 7;
            let data: Vec<u8> = (0..16 * BS as u64)
                .map(|i| (i.wrapping_mul(2_654_435_761) ^ (l * salt + round * 31)).to_le_bytes()[3])
                .collect();
            v.write_at(l * BSU, &data, false).unwrap();
        }
        v.flush().unwrap();
        pool.engine().checkpoint().unwrap();
    }
}

/// `default@s` of `pool` reads block (l, 1) at block 7 of every page.
fn snapshot_reads_its_blocks(pool: &Pool, when: &str) {
    let s = pool.volume("default@s").expect("the snapshot's view");
    let mut b = vec![0u8; BS];
    for p in 0..PAGES {
        let l = p * MAP_PAGE_BLOCKS + 7;
        s.read_at(l * BSU, &mut b).unwrap();
        assert!(b == block(l, 1), "the snapshot's block {l} {when}");
    }
}

/// Opens the pool: `default@s` reads block (l, 1) at block 7 of every page,
/// and `check` finds the store consistent.
fn snapshot_reads_its_blocks_and_checks_clean(store: &SimStorage, when: &str) {
    let pool = open_pool(store);
    snapshot_reads_its_blocks(&pool, when);
    drop(pool);
    let rep = cvol_engine::check::check_volume(store, &mut |_, _| {});
    assert!(rep.consistent(), "{when}: {:?}", rep.errors);
}

/// The pool of `snapshotted_pool` with a volume of `bytes`, closed once
/// and reopened, its last session's block written.
fn snapshotted_pool_of(bytes: u64) -> (SimStorage, Pool) {
    let store = SimStorage::new(16 * MIB);
    let opts = common::options(&store, bytes);
    let pool = Pool::create(Arc::new(store.clone()), &opts).expect("create a pool");
    let v = pool.volume("default").expect("default");
    let lbas: Vec<u64> = (0..PAGES).map(|p| p * MAP_PAGE_BLOCKS + 7).collect();
    for &l in &lbas {
        v.write_at(l * BSU, &block(l, 1), false).unwrap();
    }
    pool.create_snapshot("default@s").unwrap();
    for &l in &lbas {
        v.write_at(l * BSU, &block(l, 2), false).unwrap();
    }
    drop(v);
    pool.engine().close().unwrap();
    drop(pool);
    let pool = open_pool(&store);
    let v = pool.volume("default").expect("default");
    v.write_at(7 * BSU, &block(7, 3), false).unwrap();
    drop(v);
    (store, pool)
}

/// `snapshotted_pool` with an 8 GiB volume: the snapshot's extents lie
/// 8 GiB on, in directory blocks (4 GiB of pool space each) the volume's
/// writes never touch, so the newest checkpoint carries them over.
fn snapshotted_pool_of_its_own_blocks() -> SimStorage {
    let (store, pool) = snapshotted_pool_of(8 << 30);
    pool.engine().close().unwrap();
    store
}

#[test]
fn open_leaves_directory_blocks_unread_and_counts_their_records_live() {
    // The snapshot's directory blocks are named by the commit and the
    // older checkpoint wrote them: open leaves them unread and counts
    // their records live from the commit's totals.
    // The volume is then rewritten many times over while they stay so
    // (the log reuses what it frees); `check` finds every segment's live
    // bytes right and the snapshot reads its blocks (mutations: reading
    // every block at open fails the first assertion; counting an unread
    // block's records as none fails the check).
    let store = snapshotted_pool_of_its_own_blocks();
    let pool = open_pool(&store);
    let unread = pool.engine().map_dir_blocks_unread();
    assert!(unread >= 1, "{unread} directory blocks left unread at open");
    assert!(pool.engine().opened_from_tables(), "open took the tables");
    // Neither their records nor their lists were read (mutation: reading
    // them at open counts them here).
    assert_eq!(pool.engine().map_dir_blocks_read(), 0);
    assert_eq!(pool.engine().map_dir_lists_read(), 0);
    rewrite_many_times(&pool, 89);
    pool.engine()
        .verify_refcounts()
        .expect("running counts match the map");
    pool.engine().close().unwrap();
    drop(pool);
    snapshot_reads_its_blocks_and_checks_clean(&store, "after the log reused segments");
    // Reading the snapshot decoded its blocks, each list read then.
    let pool = open_pool(&store);
    let unread = pool.engine().map_dir_blocks_unread() as u64;
    snapshot_reads_its_blocks(&pool, "once more");
    assert_eq!(pool.engine().map_dir_blocks_unread(), 0);
    assert_eq!(pool.engine().map_dir_blocks_packed(), 0);
    assert_eq!(pool.engine().map_dir_blocks_read(), unread);
    assert_eq!(pool.engine().map_dir_lists_read(), unread);
}

/// A checkpoint taken while directory blocks are unread names them as
/// they are: the next open takes it without a warning, leaves them unread
/// again, and the snapshot reads its blocks (mutation: leaving unread
/// blocks out of the directory the commit names loses the snapshot's
/// pages, or makes open fall back).
#[test]
fn a_checkpoint_names_the_blocks_open_left_unread() {
    let store = snapshotted_pool_of_its_own_blocks();
    let pool = open_pool(&store);
    let unread = pool.engine().map_dir_blocks_unread();
    assert!(unread >= 1, "{unread} directory blocks left unread at open");
    // (A write to the volume would read them: it looks up the snapshot's
    // entry of the block it replaces.)
    pool.engine().checkpoint().unwrap();
    assert_eq!(
        pool.engine().map_dir_blocks_unread(),
        unread,
        "read by the checkpoint"
    );
    pool.engine().close().unwrap();
    drop(pool);
    let pool = open_pool(&store);
    assert_eq!(pool.engine().recovery_warnings(), [] as [String; 0]);
    let again = pool.engine().map_dir_blocks_unread();
    assert!(again >= unread, "{again} blocks unread, {unread} before");
    drop(pool);
    snapshot_reads_its_blocks_and_checks_clean(&store, "after a checkpoint with blocks unread");
}

/// Flips a bit (at `byte` of the payload) in each MAP_DIR record of codec
/// `codec` in the directory blocks of the snapshot of
/// `snapshotted_pool_of_its_own_blocks`, then opens the pool: the blocks
/// are left unread, the volume reads its own blocks, the snapshot's reads
/// fail as Corrupt (the blocks staying unread), and scrub and `check`
/// report the damage.
fn damaged_snapshot_records_are_errors_where_used(codec: CodecTag, byte: u64) {
    let store = snapshotted_pool_of_its_own_blocks();
    let uuid = {
        let pool = open_pool(&store);
        let uuid = pool.engine().superblock().uuid;
        pool.engine().close().unwrap();
        uuid
    };
    let t = table(&store, &uuid);
    let s = t.snapshot("default", "s").expect("the snapshot");
    let block_lbas = DIR_PAGES * MAP_PAGE_BLOCKS;
    let mut damaged = Vec::new();
    for &e in s.extents.iter().filter(|&&e| e != NO_EXTENT) {
        let lba = u64::from(e) * EXTENT_BLOCKS / block_lbas * block_lbas;
        let recs = common::records_of(&store, RecordKind::MapDir, lba);
        damaged.extend(
            (recs.into_iter()).filter(|&at| common::record_header(&store, at).codec == codec),
        );
    }
    assert!(!damaged.is_empty(), "the snapshot's block has such records");
    for &at in &damaged {
        store.flip_bit(at + RECORD_HEADER_BYTES as u64 + byte, 5);
    }
    store.sync().unwrap();
    let pool = open_pool(&store);
    assert!(pool.engine().map_dir_blocks_unread() >= 1);
    let v = pool.volume("default").expect("default");
    let snap = pool.volume("default@s").expect("the snapshot's view");
    let mut b = vec![0u8; BS];
    v.read_at(7 * BSU, &mut b).unwrap();
    assert!(b == block(7, 3), "the volume reads its own blocks");
    let e = snap.read_at(7 * BSU, &mut b).expect_err("a damaged record");
    assert!(matches!(e, cvol_engine::VolError::Corrupt { .. }), "{e}");
    let scrub = pool.engine().scrub(&ScrubOptions::default(), &|_| {});
    let scrub = scrub.expect("no scrub runs");
    assert!(!scrub.metadata_errors.is_empty(), "scrub reports it");
    drop((v, snap));
    drop(pool);
    let rep = cvol_engine::check::check_volume(&store, &mut |_, _| {});
    assert!(!rep.consistent(), "check finds it");
}

#[test]
fn a_damaged_directory_list_kept_apart_is_an_error_where_it_is_used() {
    // The snapshot's directory block is left unread at open, its list
    // (a record of its own, lz4) too: damage in that list does not stop
    // the open, and surfaces where the list is needed (mutation: reading
    // the lists of blocks left unread at open, as an inline list was,
    // refuses the open).
    damaged_snapshot_records_are_errors_where_used(CodecTag::Lz4, 2);
}

#[test]
fn a_damaged_directory_block_left_unread_is_an_error_where_it_is_used() {
    // The same with the block's own record (its summary, codec none)
    // damaged (mutation: reading every block at open, as before the
    // commit named them, refuses the open).
    damaged_snapshot_records_are_errors_where_used(CodecTag::None, 9);
}

/// Incompressible 4 KiB block `n` of a stream.
fn noise(n: u64) -> Vec<u8> {
    (0..BSU)
        .map(|i| ((n * BSU + i).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
        .collect()
}

/// The snapshot simulation's seed 458, made plain: a checkpoint written
/// after a block open left unread was read and rewritten names, for the
/// segment of that block's old page record, the highest seq open knew
/// (the old record's), while the records left there are older. That
/// bound is what the commit names on purpose (a segment's highest seq
/// only delays its reuse), and `check` takes it (mutation: requiring
/// the exact seq refuses the checkpoint, "its bytes per segment are not
/// its blocks'").
#[test]
fn regression_seed_458_a_rewritten_unread_block_leaves_a_bound_on_its_segment_seq() {
    let store = SimStorage::new(16 * MIB);
    let gib = (1u64 << 30) / BSU;
    let opts = common::options(&store, 12 << 30);
    let pool = Pool::create(Arc::new(store.clone()), &opts).expect("create a pool");
    let v = pool.volume("default").expect("default");
    // Blocks in three directory blocks (4 GiB of pool space each): their
    // page records go to one segment, the last one's with the highest seq.
    let (a, b, c) = (4 * gib + gib / 2, 8 * gib + gib / 2, gib / 2);
    for l in [a, b, c] {
        v.write_at(l * BSU, &block(l, 1), false).unwrap();
    }
    pool.engine().checkpoint().unwrap();
    // The log moves on (2 MiB of data), and a later checkpoint writes only
    // the first block's pages: the other two are left unread at open.
    for n in 0..512 {
        v.write_at((c + 1 + n) * BSU, &noise(n), false).unwrap();
    }
    pool.engine().checkpoint().unwrap();
    drop(v);
    pool.engine().close().unwrap();
    drop(pool);
    let pool = open_pool(&store);
    let unread = pool.engine().map_dir_blocks_unread();
    assert!(unread >= 2, "{unread} directory blocks left unread at open");
    // A write reads the last block and rewrites its page elsewhere.
    let v = pool.volume("default").expect("default");
    v.write_at(b * BSU, &block(b, 2), false).unwrap();
    assert!(
        pool.engine().map_dir_blocks_unread() < unread,
        "read by the write"
    );
    pool.engine().checkpoint().unwrap();
    drop(v);
    pool.engine().close().unwrap();
    drop(pool);
    let rep = cvol_engine::check::check_volume(&store, &mut |_, _| {});
    assert!(rep.consistent(), "{:?}", rep.errors);
    let pool = open_pool(&store);
    assert_eq!(pool.engine().recovery_warnings(), [] as [String; 0]);
    let v = pool.volume("default").expect("default");
    let mut got = vec![0u8; BS];
    for (l, version) in [(a, 1), (b, 2), (c, 1)] {
        v.read_at(l * BSU, &mut got).unwrap();
        assert!(got == block(l, version), "block {l}");
    }
}
