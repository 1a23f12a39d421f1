//! Scrub: a flipped bit is found and named by LBA (only the blocks of the
//! record it hits, dedup references included), the volume keeps serving
//! everything else, `stat` counts it; a scrub racing writes, overwrites and
//! the cleaner reports nothing false; one scrub at a time.
mod common;
use common::{open, MIB};
use cvol_engine::volume::{ScrubOptions, ScrubReport};
use cvol_engine::Volume;
use cvol_format::superblock::Packing;
use cvol_storage::{SimStorage, Storage};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

const BS: u64 = 4096;

/// Compressible content unique to (lba, version).
fn block(lba: u64, version: u32) -> Vec<u8> {
    let mut r = StdRng::seed_from_u64(lba * 1_000_003 + u64::from(version));
    let words = ["alpha ", "bravo ", "charlie ", "delta ", "echo ", "golf "];
    let mut v = format!("lba {lba} version {version} ").into_bytes();
    while v.len() < BS as usize {
        v.extend_from_slice(words[r.gen_range(0..words.len())].as_bytes());
    }
    v.truncate(BS as usize);
    v
}

fn create(sim: &SimStorage, logical: u64) {
    common::create_closed(sim, &common::options(sim, logical));
}

fn fast() -> ScrubOptions {
    ScrubOptions {
        bytes_per_sec: 0,
        yield_to_clients: false,
        ..ScrubOptions::default()
    }
}

/// Byte offset of the DATA record whose header names `lba` first.
fn record_offset(sim: &SimStorage, lba: u64) -> u64 {
    let found = common::data_records_of(sim, lba);
    assert_eq!(found.len(), 1, "one DATA record for lba {lba}");
    found[0]
}

fn corrupt_lbas(rep: &ScrubReport) -> BTreeSet<u64> {
    rep.corrupt.iter().map(|f| f.lba).collect()
}

/// Layout: single-block records at 0..64, four 4-block units at 96..112,
/// dedup references at 200.. to blocks 3, 40 and 101 (inside a unit).
fn write_layout(vol: &Volume) -> Vec<(u64, Vec<u8>)> {
    let mut data = Vec::new();
    for l in 0..64 {
        vol.write_at(l * BS, &block(l, 0), false).unwrap();
        data.push((l, block(l, 0)));
    }
    let unit: Vec<u8> = (96..112).flat_map(|l| block(l, 0)).collect();
    vol.write_at(96 * BS, &unit, false).unwrap();
    data.extend((96..112).map(|l| (l, block(l, 0))));
    for (i, src) in [3u64, 40, 101].into_iter().enumerate() {
        let l = 200 + i as u64;
        vol.write_at(l * BS, &block(src, 0), false).unwrap();
        data.push((l, block(src, 0)));
    }
    data
}

#[test]
fn scrub_names_exactly_the_blocks_of_damaged_records() {
    for packing in Packing::ALL {
        scrub_names_exactly(packing);
    }
}

/// With every packing (page padding between records hides none of them).
fn scrub_names_exactly(packing: Packing) {
    let sim = SimStorage::new(8 * MIB);
    common::create_closed(&sim, &common::options(&sim, 4 * MIB).with_packing(packing));
    let vol = open(&sim);
    let data = write_layout(&vol);
    let st = vol.stats();
    assert!(st.dedup.dedup_hits >= 3, "the layout has dedup references");
    assert!(st.elastic.units_written >= 4, "the layout has units");
    vol.close().unwrap();
    drop(vol);

    // A clean volume scrubs clean.
    let vol = open(&sim);
    let rep = vol.scrub(&fast(), &|_| {}).unwrap();
    assert!(rep.clean(), "{rep:?}");
    assert_eq!(rep.blocks_checked, data.len() as u64);
    assert_eq!(rep.bytes_checked, data.len() as u64 * BS);
    drop(vol);

    // Damage: the record of lba 17, the record of lba 3 (lba 200 refers to
    // it), the unit holding 100..104 (lba 202 refers to its block 101), and
    // a valid record copied over another (lba 5's over lba 6's: misdirected).
    let mut expect = BTreeSet::new();
    let at17 = record_offset(&sim, 17);
    sim.flip_bit(at17 + 60, 3);
    expect.insert(17);
    let at3 = record_offset(&sim, 3);
    sim.flip_bit(at3 + 50, 0);
    expect.extend([3, 200]);
    let at_unit = record_offset(&sim, 100);
    assert_eq!(
        common::record_header(&sim, at_unit).nblocks,
        4,
        "a 4-block unit"
    );
    sim.flip_bit(at_unit + 80, 6);
    expect.extend([100, 101, 102, 103, 202]);
    // (The shorter over the longer, so the next record stays intact.)
    let rec_len = |at: u64| common::record_header(&sim, at).total_len();
    let (a5, a6) = (record_offset(&sim, 5), record_offset(&sim, 6));
    let (from, to, victim) = if rec_len(a5) <= rec_len(a6) {
        (a5, a6, 6)
    } else {
        (a6, a5, 5)
    };
    let mut rec = vec![0u8; rec_len(from)];
    sim.read_at(from, &mut rec).unwrap();
    sim.write_at(to, &rec).unwrap();
    expect.insert(victim);

    let vol = open(&sim);
    let seen = std::sync::Mutex::new(Vec::new());
    let rep = vol
        .scrub(&fast(), &|p| seen.lock().unwrap().push(p.clone()))
        .unwrap();
    assert!(!rep.clean());
    assert_eq!(corrupt_lbas(&rep), expect, "{:?}", rep.corrupt);
    assert_eq!(rep.corrupt_blocks, expect.len() as u64);
    assert_eq!(rep.unreadable_blocks, 0);
    assert!(rep.metadata_errors.is_empty(), "{:?}", rep.metadata_errors);
    assert_eq!(rep.blocks_checked, (data.len() - expect.len()) as u64);
    assert!(rep.corrupt.iter().all(|f| !f.detail.is_empty()));
    let seen = seen.into_inner().unwrap();
    assert!(!seen.is_empty(), "progress was reported");
    assert_eq!(seen.last().unwrap().corrupt_blocks, expect.len() as u64);

    // The volume keeps serving: intact blocks read back, damaged ones fail.
    let mut b = vec![0u8; BS as usize];
    for (l, want) in &data {
        let r = vol.read_at(l * BS, &mut b);
        if expect.contains(l) {
            assert!(r.is_err(), "lba {l} must not return data");
        } else {
            r.unwrap();
            assert!(&b == want, "lba {l}");
        }
    }
    // Counters: scrub findings apart from the client reads refused.
    let st = vol.stats();
    assert_eq!(st.scrub.scrub_runs, 1);
    assert_eq!(st.scrub.scrub_corrupt_blocks, expect.len() as u64);
    assert_eq!(st.scrub.scrub_blocks_checked, rep.blocks_checked);
    assert!(st.scrub.scrub_last_finished_unix > 0);
    assert!(!st.scrub.scrub_in_progress);
    assert_eq!(st.corrupt_reads, expect.len() as u64);
    let status = vol.scrub_status();
    assert!(!status.running);
    assert_eq!(
        status.last_report.unwrap().corrupt_blocks,
        rep.corrupt_blocks
    );

    // The listing is capped; the count is not.
    let capped = vol
        .scrub(
            &ScrubOptions {
                max_listed: 2,
                ..fast()
            },
            &|_| {},
        )
        .unwrap();
    assert_eq!(capped.corrupt.len(), 2);
    assert_eq!(capped.corrupt_blocks, expect.len() as u64);
    assert_eq!(vol.stats().scrub.scrub_runs, 2);
}

#[test]
fn scrub_reports_a_damaged_superblock_copy_and_checkpoint_record() {
    let sim = SimStorage::new(8 * MIB);
    create(&sim, 4 * MIB);
    let vol = open(&sim);
    write_layout(&vol);
    vol.close().unwrap();
    drop(vol);
    sim.flip_bit(cvol_format::SUPERBLOCK_B_OFFSET + 20, 2);
    let vol = open(&sim);
    let rep = vol.scrub(&fast(), &|_| {}).unwrap();
    assert_eq!(rep.corrupt_blocks, 0);
    assert!(
        rep.metadata_errors.len() == 1 && rep.metadata_errors[0].contains("copy B"),
        "{:?}",
        rep.metadata_errors
    );
    assert!(!rep.clean());
    // Now the newest checkpoint's commit record, under the open volume.
    let slot = |i| common::pointer_slot(&sim, i);
    let ptr = cvol_format::CheckpointPointer::newest(slot(0), slot(1)).unwrap();
    sim.flip_bit(ptr.commit_offset + 50, 1);
    let rep = vol.scrub(&fast(), &|_| {}).unwrap();
    assert_eq!(rep.corrupt_blocks, 0);
    assert_eq!(rep.metadata_errors.len(), 2, "{:?}", rep.metadata_errors);
    assert!(rep.metadata_errors[1].contains("commit record"));
}

#[test]
fn only_one_scrub_runs_at_a_time_and_cancel_stops_it() {
    let sim = SimStorage::new(8 * MIB);
    create(&sim, 4 * MIB);
    let vol = Arc::new(open(&sim));
    write_layout(&vol);
    // One block per second: this scrub runs until cancelled.
    let slow = ScrubOptions {
        bytes_per_sec: BS,
        yield_to_clients: false,
        ..ScrubOptions::default()
    };
    let run = vol.start_scrub(slow.clone()).unwrap();
    assert_eq!(run, 1);
    assert!(
        vol.scrub(&fast(), &|_| {}).is_err(),
        "a second scrub is refused"
    );
    let busy = vol.start_scrub(slow).unwrap_err();
    assert_eq!(busy.0.run, 1);
    let status = vol.scrub_status();
    assert!(status.running && status.run == 1);
    assert!(vol.stats().scrub.scrub_in_progress);
    vol.cancel_scrub();
    let deadline = Instant::now() + Duration::from_secs(60);
    while vol.scrub_status().running {
        assert!(Instant::now() < deadline, "cancel did not stop the scrub");
        std::thread::sleep(Duration::from_millis(10));
    }
    let last = vol.scrub_status().last_report.unwrap();
    assert!(last.cancelled && last.run == 1);
    // And the next one runs to the end.
    let rep = vol.scrub(&fast(), &|_| {}).unwrap();
    assert!(rep.clean() && !rep.cancelled && rep.run == 2, "{rep:?}");
    assert_eq!(vol.stats().scrub.scrub_runs, 2);
}

/// Overwrites, dedup, TRIM and the cleaner (a small physical size makes it
/// relocate and reuse segments) race repeated scrubs: no scrub may report a
/// problem, and the data stays right.
#[test]
fn scrub_racing_writes_and_the_cleaner_reports_nothing_false() {
    let sim = SimStorage::new(10 * MIB);
    let blocks = 8 * 256u64; // 8 MiB logical
    create(&sim, blocks * BS);
    let vol = Arc::new(open(&sim));
    let writer = {
        let vol = vol.clone();
        std::thread::spawn(move || {
            let mut rng = StdRng::seed_from_u64(7);
            let mut versions = vec![None::<u32>; blocks as usize];
            let mut turn = 0u32;
            while turn < 1500 {
                turn += 1;
                let n = [1u64, 2, 4, 16, 64][rng.gen_range(0..5)];
                let lba = rng.gen_range(0..blocks - n);
                if rng.gen_ratio(1, 20) {
                    vol.trim(lba * BS, n * BS, false).unwrap();
                    (lba..lba + n).for_each(|l| versions[l as usize] = None);
                } else {
                    // Some content repeats (dedup references), most is new.
                    let v = if rng.gen_ratio(1, 4) { 0 } else { turn };
                    let buf: Vec<u8> = (lba..lba + n)
                        .flat_map(|l| block(if v == 0 { l % 32 } else { l }, v))
                        .collect();
                    vol.write_at(lba * BS, &buf, false).unwrap();
                    (lba..lba + n).for_each(|l| versions[l as usize] = Some(v));
                }
                if turn.is_multiple_of(100) {
                    vol.flush().unwrap();
                    vol.clean(u64::MAX, false).unwrap();
                }
            }
            versions
        })
    };
    let mut runs = 0;
    let mut checked = 0;
    while runs < 3 || !writer.is_finished() {
        let rep = vol.scrub(&fast(), &|_| {}).unwrap();
        assert!(rep.clean(), "false finding: {rep:?}");
        checked += rep.blocks_checked;
        runs += 1;
    }
    assert!(checked > 0);
    eprintln!("{runs} scrubs raced the writer");
    let versions = writer.join().unwrap();
    let st = vol.stats();
    assert!(
        st.cleaner.cleaner_records_relocated > 0,
        "the cleaner must have moved records under the scrubs"
    );
    assert_eq!(st.scrub.scrub_corrupt_blocks, 0);
    let rep = vol.scrub(&fast(), &|_| {}).unwrap();
    assert!(rep.clean() && rep.skipped_blocks == 0, "{rep:?}");
    let mut b = vec![0u8; BS as usize];
    for (l, v) in versions.iter().enumerate() {
        let l = l as u64;
        vol.read_at(l * BS, &mut b).unwrap();
        match v {
            Some(0) => assert!(b == block(l % 32, 0), "lba {l}"),
            Some(v) => assert!(b == block(l, *v), "lba {l}"),
            None => assert!(b.iter().all(|&x| x == 0), "lba {l}"),
        }
    }
    vol.verify_refcounts().unwrap();
}
