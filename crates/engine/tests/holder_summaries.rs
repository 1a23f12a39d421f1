//! The cleaner's search for the LBAs that hold a victim's records shared
//! by dedup (background work from what changed, not a scan of
//! the whole map): only the map pages whose reference summary may name
//! the victim's part of the log, and the pages of the records' owners,
//! are scanned; a page not in memory since open is scanned once and its
//! summary learnt. Every holder must still be found: a missed one would
//! keep pointing at the old copy of a moved record.
mod common;
use common::{BS, MIB};
use cvol_engine::Volume;
use cvol_storage::SimStorage;
use rand::{RngCore, SeedableRng};

const PAGE: u64 = 512;
/// Pages with one unique block each (no ref entries): what the scan skips.
const PLAIN_PAGES: std::ops::Range<u64> = 4..34;

/// An incompressible block, distinct per (seed, i).
fn block(seed: u64, i: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed * 1_000_003 + i);
    let mut b = vec![0u8; BS];
    rng.fill_bytes(&mut b);
    b
}

fn write(vol: &Volume, lba: u64, data: &[u8]) {
    vol.write_at(lba * BS as u64, data, false).unwrap();
}

fn read(vol: &Volume, lba: u64) -> Vec<u8> {
    let mut b = vec![0u8; BS];
    vol.read_at(lba * BS as u64, &mut b).unwrap();
    b
}

/// One victim with shared records: 64 blocks of `seed` at page `owner`,
/// interleaved with filler blocks at page `owner + 1` that are then
/// overwritten (the victim is half dead), and copies of the 64 blocks at
/// page `copies` (dedup references into the victim). Then a clean.
fn shared_victim_cleaned(vol: &Volume, seed: u64, owner: u64, copies: u64) {
    for i in 0..64 {
        write(vol, owner * PAGE + i, &block(seed, i));
        write(vol, (owner + 1) * PAGE + i, &block(seed + 1, i));
    }
    let hits = vol.stats().dedup.dedup_hits;
    for i in 0..64 {
        write(vol, copies * PAGE + i, &block(seed, i));
    }
    assert_eq!(vol.stats().dedup.dedup_hits - hits, 64, "the copies dedup");
    for i in 0..64 {
        write(vol, (owner + 1) * PAGE + i, &block(seed + 2, i));
    }
    // Past the victim's segment (1 MiB), so that it is sealed.
    for i in 0..PAGE {
        write(vol, (owner + 2) * PAGE + i, &block(seed + 3, i));
    }
    vol.flush().unwrap();
    vol.clean(u64::MAX, false).unwrap();
}

fn check(vol: &Volume, seed: u64, owner: u64, copies: u64) {
    for i in 0..64 {
        let want = block(seed, i);
        assert!(
            read(vol, owner * PAGE + i) == want,
            "owner block {i} of {seed}"
        );
        assert!(read(vol, copies * PAGE + i) == want, "copy {i} of {seed}");
        assert!(read(vol, (owner + 1) * PAGE + i) == block(seed + 2, i));
    }
    for i in (0..PAGE).step_by(7) {
        assert!(read(vol, (owner + 2) * PAGE + i) == block(seed + 3, i));
    }
    for p in PLAIN_PAGES {
        assert!(read(vol, p * PAGE) == block(99, p));
    }
}

/// A new volume (dedup on, 1 MiB segments) with one unique block in
/// each of `PLAIN_PAGES`.
fn volume_with_plain_pages() -> (SimStorage, Volume) {
    let sim = SimStorage::new(64 * MIB);
    let vol = common::create(&sim, &common::options(&sim, 256 * MIB));
    for p in PLAIN_PAGES {
        write(&vol, p * PAGE, &block(99, p));
    }
    (sim, vol)
}

/// (holder scans, pages they scanned) so far.
fn scans(vol: &Volume) -> (u64, u64) {
    let c = vol.stats().cleaner;
    (c.cleaner_holder_scans, c.cleaner_holder_pages_scanned)
}

#[test]
fn the_holder_scan_skips_pages_without_references_into_the_victim() {
    let (sim, vol) = volume_with_plain_pages();
    // Every page has been in memory since the volume was made: known.
    shared_victim_cleaned(&vol, 1, 0, 40);
    let (n, pages) = scans(&vol);
    eprintln!("{n} holder scans, {pages} pages scanned");
    assert!(n >= 1, "no victim with shared records was cleaned");
    // Per scan: the owners' page and the copies' (and at most two whose
    // summaries share a bit with the victim's), of 34 mapped.
    assert!(pages <= 4 * n, "{pages} pages scanned in {n} scans");
    vol.verify_refcounts().unwrap();
    check(&vol, 1, 0, 40);
    common::close_and_check(vol, &sim);
}

#[test]
fn after_open_a_page_is_scanned_once_then_its_summary_is_learnt() {
    let (sim, vol) = volume_with_plain_pages();
    shared_victim_cleaned(&vol, 1, 0, 40);
    vol.close().unwrap();
    drop(vol);
    // Open leaves the pages on disk: their summaries are unknown, so the
    // first scan reads every mapped page; the next ones skip them again.
    let vol = common::open(&sim);
    let mapped = 3 + PLAIN_PAGES.count() as u64 + 1;
    shared_victim_cleaned(&vol, 10, 50, 60);
    let (n1, p1) = scans(&vol);
    assert!(n1 >= 1);
    assert!(p1 >= mapped, "the first scan after open read {p1} pages");
    shared_victim_cleaned(&vol, 20, 70, 80);
    let (n2, p2) = scans(&vol);
    eprintln!(
        "after open: {n1} scans, {p1} pages; then {} scans, {} pages",
        n2 - n1,
        p2 - p1
    );
    assert!(n2 > n1, "no second scan");
    assert!(
        p2 - p1 <= 4 * (n2 - n1),
        "{} pages in {} scans",
        p2 - p1,
        n2 - n1
    );
    vol.verify_refcounts().unwrap();
    check(&vol, 1, 0, 40);
    check(&vol, 10, 50, 60);
    check(&vol, 20, 70, 80);
    vol.close().unwrap();
    drop(vol);
    let vol = common::open(&sim);
    check(&vol, 10, 50, 60);
    check(&vol, 20, 70, 80);
    common::close_and_check(vol, &sim);
}
