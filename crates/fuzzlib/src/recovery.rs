//! Target `recovery`: `cvol check` and `Volume::open` over a damaged backing
//! store.
//!
//! The store starts as a small volume with a history (three epochs, a
//! checkpoint, records after it to roll forward, DATA/ZERO/TRIM/REF/EPOCH/
//! MAP_CHUNK/CKPT_COMMIT records, raw and lz4 payloads). The image is
//! committed (`crates/fuzzlib/images/recovery.img.lz4`, made by
//! `cargo run -p cvol-fuzzlib --example gen_seeds`) so that every run sees
//! the same bytes — a fresh `Volume::create` picks a random uuid, and with
//! it every checksum. If the committed image no longer opens (the format
//! changed), a fresh one is built and a warning printed; the test
//! `committed_recovery_image_is_current` fails until it is regenerated.
//!
//! The input is a flags byte followed by damage operations (raw patches,
//! field edits of a superblock/pointer/record *with its checksum recomputed*
//! so the damage gets past the checksum, copies of byte ranges — stale or
//! misdirected records — and zeroed sectors), then:
//! 1. `check_volume` must not panic;
//! 2. `Volume::open` (read-only or not) returns Ok or an error;
//! 3. if it opened: every block reads as data or an error, block status and
//!    stats work, the dedup reference counts match the map; optionally a few
//!    writes, trim, write-zeroes, flush, checkpoint, a cleaning pass (a block
//!    that was written reads back as written or fails, never other data),
//!    then a close and a second open (no panic).
use std::sync::{Arc, Mutex, OnceLock};

use cvol_engine::{check, Codec, CodecPolicy, CreateOptions, OpenOptions, VolError, Volume};
use cvol_format::record::{RecordHeader, RECORD_HEADER_BYTES, RECORD_MAGIC};
use cvol_storage::{SimStorage, Storage};

use crate::format::{fix_pointer_crc, fix_record_crc, fix_superblock_crc};
use crate::input::Input;
use crate::panics;

pub const MIB: u64 = 1 << 20;
/// Backing store: 1 MiB metadata area + 3 segments of 1 MiB.
pub const PHYSICAL_BYTES: u64 = 4 * MIB;
pub const LOGICAL_BYTES: u64 = 2 * MIB;
pub const SEGMENT_BYTES: u64 = MIB;
const BS: usize = 4096;
const BLOCKS: u64 = LOGICAL_BYTES / BS as u64;

/// The committed image (lz4 with the size prepended).
static COMMITTED: &[u8] = include_bytes!("../images/recovery.img.lz4");

/// A checksummed structure of the image the operations can edit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Superblock,
    Pointer,
    Record,
}

#[derive(Debug, Clone, Copy)]
pub struct Structure {
    pub kind: Kind,
    pub offset: usize,
    /// Bytes of it worth editing (header + payload for records).
    pub len: usize,
}

pub struct Image {
    pub bytes: Vec<u8>,
    pub structures: Vec<Structure>,
    /// True if this is the committed image, false if built at start-up.
    pub committed: bool,
}

/// Block `i` of the history: compressible, different per block and version.
pub fn block(i: u64, version: u64) -> Vec<u8> {
    format!("cvol fuzz image block {i} version {version}; ")
        .bytes()
        .cycle()
        .take(BS)
        .collect()
}

/// An incompressible block (stored raw).
fn noise(i: u64) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..BS)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn options(read_only: bool) -> OpenOptions {
    OpenOptions {
        read_only,
        dedup_memory_bytes: Some(MIB),
        read_cache_bytes: Some(256 * 1024),
        ..OpenOptions::default()
    }
}

/// Builds a fresh image with the engine (random uuid: not reproducible
/// byte for byte; see the module docs).
pub fn build_image() -> Vec<u8> {
    let sim = SimStorage::new(PHYSICAL_BYTES);
    let store: Arc<dyn Storage> = Arc::new(sim.clone());
    let create = CreateOptions {
        logical_size_bytes: LOGICAL_BYTES,
        physical_size_bytes: PHYSICAL_BYTES,
        codec: CodecPolicy::Fixed(Codec::Lz4),
        segment_size_bytes: SEGMENT_BYTES,
        dedup: true,
        packing: Default::default(),
        pool: false,
        encryption: None,
    };
    let w = |vol: &Volume, lba: u64, data: &[u8]| {
        vol.write_at(lba * BS as u64, data, false)
            .expect("image write")
    };
    // Epoch 1: data, raw data, zeros, duplicates, an unaligned write; a
    // checkpoint; then trim, write-zeroes and overwrites left to roll forward.
    let vol = Volume::create(Arc::clone(&store), &create).expect("create image volume");
    for i in 0..64 {
        w(&vol, i, &block(i, 0));
    }
    for i in 64..68 {
        w(&vol, i, &noise(i));
    }
    w(&vol, 68, &vec![0u8; 4 * BS]);
    // One write of 12 blocks: merged compression units (multi-block records).
    let unit: Vec<u8> = (120..132).flat_map(|i| block(i, 0)).collect();
    w(&vol, 120, &unit);
    for i in 80..84 {
        w(&vol, i, &block(3, 0));
    }
    vol.write_at(5000, &[7u8; 3000], false).expect("unaligned");
    vol.flush().expect("flush");
    vol.checkpoint().expect("checkpoint");
    vol.trim(20 * BS as u64, 6 * BS as u64, false)
        .expect("trim");
    vol.write_zeroes(40 * BS as u64, 4 * BS as u64, true, false)
        .expect("zeroes");
    vol.write_zeroes(44 * BS as u64, 2 * BS as u64, false, false)
        .expect("zeroes");
    for i in 50..56 {
        w(&vol, i, &block(i, 1));
    }
    w(&vol, 125, &block(125, 1)); // one block of a unit overwritten
    vol.flush().expect("flush");
    drop(vol);
    // Epoch 2: more data, a duplicate of an epoch-1 block, a checkpoint,
    // then records after it.
    let vol = Volume::open(Arc::clone(&store), options(false)).expect("reopen image volume");
    for i in 200..232 {
        w(&vol, i, &block(i, 2));
    }
    w(&vol, 240, &block(5, 0));
    vol.flush().expect("flush");
    vol.checkpoint().expect("checkpoint");
    for i in 300..310 {
        w(&vol, i, &block(i, 2));
    }
    vol.trim(202 * BS as u64, BS as u64, false).expect("trim");
    vol.flush().expect("flush");
    drop(vol);
    // Epoch 3: a few records, the last ones never flushed (a crashed run).
    let vol = Volume::open(Arc::clone(&store), options(false)).expect("reopen image volume");
    for i in 400..404 {
        w(&vol, i, &block(i, 3));
    }
    vol.flush().expect("flush");
    w(&vol, 404, &block(404, 3));
    drop(vol);
    let mut bytes = vec![0u8; PHYSICAL_BYTES as usize];
    sim.snapshot_live()
        .read_at(0, &mut bytes)
        .expect("read image");
    bytes
}

/// Finds the superblocks, pointer slots and every verified record.
pub fn structures_of(bytes: &[u8]) -> Vec<Structure> {
    let mut out = vec![
        Structure {
            kind: Kind::Superblock,
            offset: cvol_format::SUPERBLOCK_A_OFFSET as usize,
            len: 84,
        },
        Structure {
            kind: Kind::Superblock,
            offset: cvol_format::SUPERBLOCK_B_OFFSET as usize,
            len: 84,
        },
        Structure {
            kind: Kind::Pointer,
            offset: cvol_format::POINTER_SLOT_0_OFFSET as usize,
            len: 44,
        },
        Structure {
            kind: Kind::Pointer,
            offset: cvol_format::POINTER_SLOT_1_OFFSET as usize,
            len: 44,
        },
    ];
    let magic = RECORD_MAGIC.to_le_bytes();
    let start = cvol_format::DATA_OFFSET_BYTES as usize;
    for at in start..bytes.len().saturating_sub(RECORD_HEADER_BYTES) {
        if bytes[at..at + 4] != magic {
            continue;
        }
        if let Ok((h, _)) = RecordHeader::decode_verified(&bytes[at..]) {
            out.push(Structure {
                kind: Kind::Record,
                offset: at,
                len: h.total_len(),
            });
        }
    }
    out
}

/// Why an image is not the sound, committed one the recovery target
/// starts from.
#[derive(Debug)]
pub enum ImageError {
    /// `check` found these inconsistencies.
    Unclean(Vec<String>),
    /// The volume does not open, or block 3 does not read.
    Volume(VolError),
    /// Block 3 reads back other data than was written.
    WrongBlock,
    /// The committed image does not decompress.
    Decompress(lz4_flex::block::DecompressError),
    /// The committed image has this many bytes, not [`PHYSICAL_BYTES`].
    Size(usize),
}

impl std::fmt::Display for ImageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ImageError::Unclean(errors) => write!(f, "check: {errors:?}"),
            ImageError::Volume(e) => write!(f, "{e}"),
            ImageError::WrongBlock => f.write_str("block 3 reads back wrong"),
            ImageError::Decompress(e) => write!(f, "{e}"),
            ImageError::Size(n) => write!(f, "{n} bytes, expected {PHYSICAL_BYTES}"),
        }
    }
}

impl std::error::Error for ImageError {}

/// Is `bytes` a volume that opens and checks clean?
pub fn image_is_sound(bytes: &[u8]) -> Result<(), ImageError> {
    let store = MemStore::new(bytes.to_vec(), Faults::default());
    let rep = check::check_volume(&store, &mut |_, _| {});
    if !rep.consistent() {
        return Err(ImageError::Unclean(rep.errors));
    }
    let vol = Volume::open(Arc::new(store), options(true)).map_err(ImageError::Volume)?;
    let mut b = vec![0u8; BS];
    vol.read_at(3 * BS as u64, &mut b)
        .map_err(ImageError::Volume)?;
    if b != block(3, 0) {
        return Err(ImageError::WrongBlock);
    }
    Ok(())
}

/// Decompresses the committed image.
pub fn committed_image() -> Result<Vec<u8>, ImageError> {
    let bytes =
        lz4_flex::block::decompress_size_prepended(COMMITTED).map_err(ImageError::Decompress)?;
    if bytes.len() as u64 != PHYSICAL_BYTES {
        return Err(ImageError::Size(bytes.len()));
    }
    Ok(bytes)
}

/// The image every input starts from (built once per process).
pub fn image() -> &'static Image {
    static IMAGE: OnceLock<Image> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let (bytes, committed) = match committed_image().and_then(|b| image_is_sound(&b).map(|_| b))
        {
            Ok(b) => (b, true),
            Err(e) => {
                eprintln!(
                    "WARNING: the committed recovery fuzz image is unusable ({e}); using a fresh \
                     one (runs are not reproducible byte for byte). Regenerate it with \
                     `cargo run -p cvol-fuzzlib --example gen_seeds`."
                );
                (build_image(), false)
            }
        };
        let structures = structures_of(&bytes);
        Image {
            bytes,
            structures,
            committed,
        }
    })
}

/// I/O faults of a [`MemStore`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Faults {
    /// Reads touching [start, end) fail.
    pub bad_reads: Option<(u64, u64)>,
    /// Writes and syncs after this many fail.
    pub io_budget: Option<u32>,
}

/// A plain in-memory store (one copy of the image, not SimStorage's three).
pub struct MemStore {
    bytes: Mutex<Vec<u8>>,
    faults: Faults,
    ios: std::sync::atomic::AtomicU32,
}

impl MemStore {
    pub fn new(bytes: Vec<u8>, faults: Faults) -> MemStore {
        MemStore {
            bytes: Mutex::new(bytes),
            faults,
            ios: Default::default(),
        }
    }

    fn charge(&self) -> std::io::Result<()> {
        let n = self.ios.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        match self.faults.io_budget {
            Some(b) if n >= b => Err(std::io::Error::other("injected write failure")),
            _ => Ok(()),
        }
    }

    fn range(&self, offset: u64, len: usize) -> std::io::Result<std::ops::Range<usize>> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= PHYSICAL_BYTES => Ok(offset as usize..end as usize),
            _ => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("I/O at {offset}+{len} beyond the store"),
            )),
        }
    }
}

impl Storage for MemStore {
    fn len_bytes(&self) -> u64 {
        PHYSICAL_BYTES
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let r = self.range(offset, buf.len())?;
        if let Some((s, e)) = self.faults.bad_reads {
            if (r.start as u64) < e && s < r.end as u64 {
                return Err(std::io::Error::other("injected read error"));
            }
        }
        buf.copy_from_slice(&self.bytes.lock().unwrap_or_else(|e| e.into_inner())[r]);
        Ok(())
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let r = self.range(offset, data.len())?;
        self.charge()?;
        self.bytes.lock().unwrap_or_else(|e| e.into_inner())[r].copy_from_slice(data);
        Ok(())
    }
    fn sync(&self) -> std::io::Result<()> {
        self.charge()
    }
}

/// Editable fields (offset, width in bytes) of each structure kind.
fn fields(kind: Kind) -> &'static [(usize, usize)] {
    match kind {
        // flags, uuid[0..8], logical, physical, segment, data offset, codec, level
        Kind::Superblock => &[
            (12, 4),
            (16, 8),
            (32, 8),
            (40, 8),
            (48, 8),
            (56, 8),
            (64, 1),
            (65, 1),
        ],
        // generation, commit offset, commit len, epoch, seq
        Kind::Pointer => &[(8, 8), (16, 8), (24, 4), (28, 4), (32, 8)],
        // kind, codec, flags, volume tag, epoch, seq, lba, nblocks, payload len
        Kind::Record => &[
            (4, 1),
            (5, 1),
            (6, 2),
            (8, 4),
            (12, 4),
            (16, 8),
            (24, 8),
            (32, 4),
            (36, 4),
        ],
    }
}

fn fix_crc(img: &mut [u8], s: Structure) {
    match s.kind {
        Kind::Superblock => fix_superblock_crc(&mut img[s.offset..]),
        Kind::Pointer => fix_pointer_crc(&mut img[s.offset..]),
        Kind::Record => {
            // A record never spans segments: the payload ends there at most.
            let seg_end = (s.offset as u64 - cvol_format::DATA_OFFSET_BYTES) / SEGMENT_BYTES
                * SEGMENT_BYTES
                + SEGMENT_BYTES
                + cvol_format::DATA_OFFSET_BYTES;
            fix_record_crc(&mut img[s.offset..seg_end as usize]);
        }
    }
}

/// Applies the damage operations of `input` to `img`.
fn damage(img: &mut [u8], structures: &[Structure], input: &mut Input) {
    let len = img.len();
    while !input.is_empty() {
        match input.u8() % 5 {
            // Raw bytes anywhere (no checksum fixed: what random corruption does).
            0 => {
                let at = input.u32() as usize % len;
                let n = usize::from(input.u8() % 65);
                let src = input.bytes(n);
                let n = src.len().min(len - at);
                img[at..at + n].copy_from_slice(&src[..n]);
            }
            // Bytes inside a structure, checksum recomputed.
            1 => {
                let s = structures[usize::from(input.u16()) % structures.len()];
                let rel = usize::from(input.u16()) % s.len;
                let n = usize::from(input.u8() % 9);
                let src = input.bytes(n);
                let at = s.offset + rel;
                let n = src.len().min(len - at);
                img[at..at + n].copy_from_slice(&src[..n]);
                fix_crc(img, s);
            }
            // A field of a structure nudged by a small delta or set, checksum recomputed.
            2 => {
                let s = structures[usize::from(input.u16()) % structures.len()];
                let f = fields(s.kind);
                let (off, width) = f[usize::from(input.u8()) % f.len()];
                let at = s.offset + off;
                let mut cur = [0u8; 8];
                cur[..width].copy_from_slice(&img[at..at + width]);
                let old = u64::from_le_bytes(cur);
                let op = input.u8();
                let new = if op & 1 == 0 {
                    old.wrapping_add(i64::from(op as i8 >> 1) as u64)
                } else {
                    input.u64()
                };
                img[at..at + width].copy_from_slice(&new.to_le_bytes()[..width]);
                fix_crc(img, s);
            }
            // A range copied elsewhere (stale or misdirected writes).
            3 => {
                let src = input.u32() as usize % len;
                let dst = input.u32() as usize % len;
                let n = (usize::from(input.u16()) % 8192)
                    .min(len - src)
                    .min(len - dst);
                img.copy_within(src..src + n, dst);
            }
            // Sectors zeroed (lost writes, holes).
            _ => {
                let at = input.u32() as usize % len / 512 * 512;
                let n = ((usize::from(input.u8()) + 1) * 512).min(len - at);
                img[at..at + n].fill(0);
            }
        }
    }
}

/// The target body.
pub fn recovery(data: &[u8]) {
    panics::install();
    let image = image();
    let mut input = Input::new(data);
    let flags = input.u8();
    let read_only = flags & 1 != 0;
    let exercise_writes = flags & 2 != 0;
    let mut faults = Faults::default();
    if flags & 4 != 0 {
        let start = u64::from(input.u32()) % PHYSICAL_BYTES;
        faults.bad_reads = Some((start, start + u64::from(input.u16()) + 1));
    }
    if flags & 8 != 0 {
        faults.io_budget = Some(u32::from(input.u8()));
    }
    let mut img = image.bytes.clone();
    damage(&mut img, &image.structures, &mut input);
    let before = panics::count();

    let _ = check::check_volume(&MemStore::new(img.clone(), faults), &mut |_, _| {});
    let store = Arc::new(MemStore::new(img, faults));
    let Ok(vol) = Volume::open(Arc::clone(&store) as Arc<dyn Storage>, options(read_only)) else {
        return;
    };
    exercise(&vol, exercise_writes);
    if exercise_writes && !read_only {
        let _ = vol.close();
        drop(vol);
        if let Ok(vol) = Volume::open(Arc::clone(&store) as Arc<dyn Storage>, options(true)) {
            read_everything(&vol);
        }
        let _ = check::check_volume(&*store, &mut |_, _| {});
    }
    assert_eq!(panics::count(), before, "a thread panicked");
}

/// Reads every block (in runs, then one by one where a run fails).
fn read_everything(vol: &Volume) {
    let run = 64usize;
    let mut buf = vec![0u8; run * BS];
    for first in (0..BLOCKS).step_by(run) {
        if vol.read_at(first * BS as u64, &mut buf).is_ok() {
            continue;
        }
        for lba in first..first + run as u64 {
            match vol.read_at(lba * BS as u64, &mut buf[..BS]) {
                Ok(()) | Err(VolError::Corrupt { .. }) | Err(VolError::Io(_)) => {}
                Err(e) => panic!("read of lba {lba} failed with an unexpected error: {e}"),
            }
        }
    }
    let _ = vol.block_status(0, LOGICAL_BYTES);
    let _ = vol.stats();
}

fn exercise(vol: &Volume, writes: bool) {
    read_everything(vol);
    if !vol.read_only() {
        if let Err(e) = vol.verify_refcounts() {
            panic!("reference counts after open differ from the map: {e}");
        }
    }
    if !writes || vol.read_only() {
        return;
    }
    let b = block(7, 9);
    let mut got = vec![0u8; BS];
    for lba in [0u64, 3, 81, 300, 511] {
        if vol.write_at(lba * BS as u64, &b, false).is_ok()
            && vol.read_at(lba * BS as u64, &mut got).is_ok()
        {
            assert!(got == b, "lba {lba} read back other data than just written");
        }
    }
    let _ = vol.write_at(10 * BS as u64 + 100, &[9u8; 5000], false);
    let _ = vol.trim(60 * BS as u64, 8 * BS as u64, false);
    let _ = vol.write_zeroes(70 * BS as u64, 3 * BS as u64, true, false);
    let _ = vol.write_zeroes(74 * BS as u64 + 10, 3 * BS as u64, false, true);
    let _ = vol.flush();
    let _ = vol.checkpoint();
    let _ = vol.clean(SEGMENT_BYTES, false);
    if !vol.read_only() {
        if let Err(e) = vol.verify_refcounts() {
            panic!("reference counts after writes differ from the map: {e}");
        }
    }
    read_everything(vol);
}
