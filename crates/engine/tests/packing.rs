//! Packing schemes (`--packing`, [SSD-packing]): page packing keeps every DATA
//! record that fits in a 4 KiB page inside one, roll-forward finds the
//! records placed after page padding, and first-fit decreasing pads no
//! more than first fit.
mod common;

use common::{BS, MIB};
use cvol_engine::{Codec, ElasticConfig, OpenOptions, Volume};
use cvol_format::record::{RecordKind, RECORD_HEADER_BYTES, RECORD_MAGIC};
use cvol_format::superblock::{Packing, PACKING_PAGE_BYTES};
use cvol_format::RecordHeader;
use cvol_storage::{SimStorage, Storage};
use rand::{Rng, SeedableRng};
use std::sync::Arc;

const LOGICAL_BLOCKS: u64 = 512;

/// Block `i` of `seed`: a random head of a size that varies from block to
/// block (so compressed records are of many sizes) and zeros after it.
fn block(seed: u64, i: u64) -> Vec<u8> {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed * 1000 + i);
    let head = r.gen_range(200..3900);
    let mut b = vec![0u8; BS];
    r.fill(&mut b[..head]);
    b
}

/// Block `i` of a kind whose records all have nearly one size: 1843
/// random bytes, then zeros (fio's buffer_compress_percentage=55).
fn alike(i: u64) -> Vec<u8> {
    let mut r = rand::rngs::StdRng::seed_from_u64(77_000 + i);
    let mut b = vec![0u8; BS];
    r.fill(&mut b[..1843]);
    b
}

/// Every block written alone (no merged units), lz4, no dedup.
fn opened(sim: &SimStorage) -> Volume {
    let options = OpenOptions {
        elastic: ElasticConfig {
            unit_blocks: 1,
            ..ElasticConfig::default()
        },
        ..OpenOptions::default()
    };
    Volume::open(Arc::new(sim.clone()), options).expect("open")
}

fn create(packing: Packing) -> SimStorage {
    let sim = SimStorage::new(8 * MIB);
    let opts = common::options(&sim, LOGICAL_BLOCKS * BS as u64)
        .with_codec(Codec::Lz4)
        .with_dedup(false)
        .with_packing(packing);
    common::create_closed(&sim, &opts);
    sim
}

/// The DATA records on the store: (offset, total length).
fn data_records(sim: &SimStorage) -> Vec<(u64, u64)> {
    let mut img = vec![0u8; sim.len_bytes() as usize];
    sim.read_at(0, &mut img).unwrap();
    (0..img.len() - RECORD_HEADER_BYTES)
        .filter(|&i| img[i..i + 4] == RECORD_MAGIC.to_le_bytes())
        .filter_map(|i| {
            let h = RecordHeader::decode_verified(&img[i..]).ok()?.0;
            (h.kind == RecordKind::Data).then_some((i as u64, h.total_len() as u64))
        })
        .collect()
}

/// Records that touch more 4 KiB pages than their length needs.
fn straddling(records: &[(u64, u64)]) -> usize {
    let page = PACKING_PAGE_BYTES;
    records
        .iter()
        .filter(|&&(at, len)| (at + len - 1) / page - at / page + 1 > len.div_ceil(page))
        .count()
}

/// Writes every block (a flush every 7: flush padding and page padding
/// meet), flushes, and crashes: the reopened volume must hold every
/// block, and no record may straddle a page it need not under page packing.
fn write_crash_and_verify(packing: Packing, seed: u64) -> (usize, u64) {
    let sim = create(packing);
    let vol = opened(&sim);
    for i in 0..LOGICAL_BLOCKS {
        vol.write_at(i * BS as u64, &block(seed, i), false).unwrap();
        if i % 7 == 6 {
            vol.flush().unwrap();
        }
    }
    vol.flush().unwrap();
    let padding = vol.stats().padding_bytes;
    let crashed = sim.crash(seed);
    drop(vol);
    let back = opened(&crashed);
    let mut got = vec![0u8; BS];
    for i in 0..LOGICAL_BLOCKS {
        back.read_at(i * BS as u64, &mut got).unwrap();
        assert!(
            got == block(seed, i),
            "{packing:?}: block {i} lost or wrong after the crash"
        );
    }
    assert_eq!(back.stats().packing, packing.name());
    common::close_and_check(back, &crashed);
    (straddling(&data_records(&crashed)), padding)
}

#[test]
fn page_packing_keeps_records_in_pages_and_recovery_rolls_past_its_padding() {
    let (compact, compact_pad) = write_crash_and_verify(Packing::Compact, 1);
    // The data has records that straddle pages when packed back to back,
    // or the assertions below prove nothing.
    assert!(
        compact > 50,
        "only {compact} compact records straddle a page"
    );
    for packing in [Packing::Page, Packing::PageSorted] {
        let (straddle, pad) = write_crash_and_verify(packing, 1);
        assert_eq!(straddle, 0, "{packing:?}: records straddle pages");
        assert!(pad > compact_pad, "{packing:?} padded no more than compact");
    }
}

/// One write of many single-block records: first fit fills the gaps
/// in pages that the records' given order leaves, and first-fit
/// decreasing (page-sorted) leaves no more padding than first fit.
#[test]
fn one_write_is_bin_packed_first_fit_and_sorted_pads_least() {
    let data: Vec<u8> = (0..64).flat_map(|i| block(9, i)).collect();
    let mut pads = Vec::new();
    for packing in Packing::ALL {
        let sim = create(packing);
        let vol = opened(&sim);
        let before = vol.stats().padding_bytes;
        vol.write_at(0, &data, false).unwrap();
        pads.push(vol.stats().padding_bytes - before);
        let mut got = vec![0u8; data.len()];
        vol.read_at(0, &mut got).unwrap();
        assert!(got == data, "{packing:?}: the write reads back wrong");
        common::close_and_check(vol, &sim);
    }
    let (compact, page, sorted) = (pads[0], pads[1], pads[2]);
    assert_eq!(compact, 0, "compact pads only at flushes");
    assert!(
        page > 0 && sorted <= page,
        "padding: page {page}, sorted {sorted}"
    );
    // Next fit (a record that does not fit starts the next page, in the
    // given order) would leave more: the first fit's gain is real.
    let sizes: Vec<u64> = {
        let sim = create(Packing::Compact);
        let vol = opened(&sim);
        vol.write_at(0, &data, false).unwrap();
        vol.flush().unwrap();
        let mut r = data_records(&sim);
        r.sort();
        r.iter().map(|&(_, len)| len).collect()
    };
    let mut at = 0;
    let mut next_fit = 0;
    for len in sizes {
        let p = Packing::Page.place(at, len);
        next_fit += p - at;
        at = p + len;
    }
    assert!(page < next_fit, "first fit {page} vs next fit {next_fit}");
}

/// The store, counting its reads.
struct Counting {
    inner: SimStorage,
    reads: std::sync::atomic::AtomicU64,
}

impl Storage for Counting {
    fn len_bytes(&self) -> u64 {
        self.inner.len_bytes()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.inner.write_at(offset, data)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.inner.sync()
    }
}

/// A read of blocks written together is one read of the store in every
/// mode: the page padding between records is read along, not a reason to
/// split the read (with O_DIRECT each split was an I/O of its own: a
/// page-packed file copy replayed at half the requests per second).
#[test]
fn a_read_across_page_padding_is_one_store_read() {
    for packing in Packing::ALL {
        let sim = create(packing);
        let vol = opened(&sim);
        // Blocks alike in size: first fit keeps them in LBA order (two a
        // page, then padding), so the read's records lie in order, with
        // page padding between pairs.
        let data: Vec<u8> = (0..64).flat_map(alike).collect();
        vol.write_at(0, &data, false).unwrap();
        // More writes seal the segment: its records are then read from
        // the store, not from the open segment's buffer.
        let rest: Vec<u8> = (64..LOGICAL_BLOCKS).flat_map(|i| block(6, i)).collect();
        for _ in 0..3 {
            vol.write_at(64 * BS as u64, &rest, false).unwrap();
        }
        vol.close().unwrap();
        drop(vol);
        // No read cache: every block is read from the store.
        let store = Arc::new(Counting {
            inner: sim.clone(),
            reads: Default::default(),
        });
        let options = OpenOptions {
            elastic: ElasticConfig {
                unit_blocks: 1,
                ..ElasticConfig::default()
            },
            read_cache_bytes: Some(0),
            ..OpenOptions::default()
        };
        let vol = Volume::open(store.clone(), options).expect("open");
        let before = store.reads.load(std::sync::atomic::Ordering::Relaxed);
        let mut got = vec![0u8; data.len()];
        vol.read_at(0, &mut got).unwrap();
        assert!(got == data);
        let reads = store.reads.load(std::sync::atomic::Ordering::Relaxed) - before;
        assert!(
            reads <= 2,
            "{packing:?}: {reads} store reads for one client read"
        );
        vol.close().unwrap();
    }
}
