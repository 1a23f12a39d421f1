//! Superblock: static volume configuration, written twice at create time.
//!
//! ```text
//! offset size field
//! 0      8    magic "CVOLSUPR"
//! 8      4    version (1)
//! 12     4    flags: bit 0 = inline deduplication on; bit 1 = codec policy
//!             auto (the codec below is then the strong, idle-time codec);
//!             bit 2 = checkpoint commits may carry a resume position
//!             (written outside the volume lock; set at create, and at
//!             the first open for writing of an older volume); bits 3-7:
//!             `FLAG_PAGED_MAP`, `FLAG_SEG_TABLES`, `FLAG_FP_TABLES`,
//!             `FLAG_METADATA_DEVICE`, `FLAG_UNIT_WINDOWS`; bit 8 `FLAG_CACHE`; bits
//!             9-10 `FLAG_PAGE_PACKING`, `FLAG_PAGE_SORTED` (below); bit 11
//!             `FLAG_HOOK_SNAPSHOT`: the map directory has the hook
//!             snapshot's slots (set at create and at the first open for
//!             writing of an older volume); bits 12-16 `FLAG_POOL`,
//!             `FLAG_ENCRYPTED`, `FLAG_DIR_SUMMARY`, `FLAG_DIR_LIST_APART`,
//!             `FLAG_DIR_NAMED` (below); other bits 0
//! 16     16   volume uuid (random)
//! 32     8    logical_size_bytes   (multiple of 4096)
//! 40     8    physical_size_bytes  (backing bytes the volume may use)
//! 48     8    segment_size_bytes   (power of two, >= 1 MiB)
//! 56     8    data_offset_bytes    (first byte of segment 0)
//! 64     1    codec tag (volume default)
//! 65     1    codec level (zstd level, 0 otherwise)
//! 66     2    reserved (0)
//! 68     4    metadata_segments (segments on the metadata device; 0 unless
//!             flag bit 6, `FLAG_METADATA_DEVICE`)
//! 72     8    created_unix_secs
//! 80     4    crc32c of bytes [0, 80)
//! 84          end; the rest of the 4 KiB copy is zero
//! ```
use std::sync::Arc;

use crate::keyslot::{KeySlot, KEY_SLOT_BYTES};
use crate::seal::Sealer;
use crate::*;

pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"CVOLSUPR";
pub const FORMAT_VERSION: u32 = 1;
pub const SUPERBLOCK_BYTES: usize = 4096;
const OFF_VERSION: usize = 8;
const OFF_FLAGS: usize = OFF_VERSION + 4;
const OFF_UUID: usize = OFF_FLAGS + 4;
pub const UUID_BYTES: usize = 16;
const OFF_LOGICAL: usize = OFF_UUID + UUID_BYTES;
const OFF_PHYSICAL: usize = OFF_LOGICAL + 8;
const OFF_SEGMENT: usize = OFF_PHYSICAL + 8;
const OFF_DATA: usize = OFF_SEGMENT + 8;
const OFF_CODEC: usize = OFF_DATA + 8;
const OFF_LEVEL: usize = OFF_CODEC + 1;
const OFF_RESERVED: usize = OFF_LEVEL + 1;
const RESERVED_BYTES: usize = 2;
const OFF_META_SEGMENTS: usize = OFF_RESERVED + RESERVED_BYTES;
const OFF_CREATED: usize = OFF_META_SEGMENTS + 4;
const OFF_CRC: usize = OFF_CREATED + 8;
const END: usize = OFF_CRC + 4;

/// Superblock flag: blocks are deduplicated inline (REF records may appear).
pub const FLAG_DEDUP: u32 = 1;
/// Elastic codec choice (policy `auto`).
pub const FLAG_AUTO_CODEC: u32 = 2;
/// Checkpoint commits may name a resume position (`checkpoint::Resume`):
/// binaries that predate it refuse the volume instead of misreading them.
pub const FLAG_RESUME_AT_SNAPSHOT: u32 = 4;
/// Checkpoint commits may name MAP_DIR records (a paged map: one MAP_CHUNK
/// per map page, shared by every checkpoint until the page changes):
/// binaries that predate it refuse the volume instead of misreading it.
pub const FLAG_PAGED_MAP: u32 = 8;
/// The map directory may name MAP_TABLE records (persisted liveness tables,
/// `tables`) in slots after the map's pages: binaries that predate them
/// refuse the volume instead of misreading its directory.
pub const FLAG_SEG_TABLES: u32 = 16;
/// The map directory may name fingerprint tables (`fprints`) in slots
/// after the liveness tables': binaries that predate them refuse the
/// volume instead of failing on its directory.
pub const FLAG_FP_TABLES: u32 = 32;
/// Map records, checkpoint commits and fingerprint tables live on a
/// separate metadata device (`metadev`): its `metadata_segments` segments
/// follow the data segments in the volume's offset space. Binaries that
/// predate it refuse the volume instead of missing half of it.
pub const FLAG_METADATA_DEVICE: u32 = 64;
/// Liveness tables hold a row for a unit (a record of several blocks)
/// only while dedup references point into it: its owner entries all lie
/// in its window of the map (`record`), where they are counted. Binaries
/// that predate it refuse the volume instead of taking the units without
/// a row for dead.
pub const FLAG_UNIT_WINDOWS: u32 = 128;
/// The volume is a cache in front of an origin (`cache`): an unmapped
/// block is not cached (read the origin), not zeros. Binaries that predate
/// it refuse the volume instead of serving zeros for every miss.
pub const FLAG_CACHE: u32 = 256;
/// Records are placed by page packing (`Packing::Page`): a record never
/// straddles a 4 KiB page of its segment unless it is longer than a page,
/// so a log may hold zero padding up to a page boundary anywhere, and
/// roll-forward also looks for the next record at the next page boundary.
/// Binaries that predate it refuse the volume instead of ending the chain
/// at the first page padding (and dropping the flushed records after it).
pub const FLAG_PAGE_PACKING: u32 = 512;
/// With `FLAG_PAGE_PACKING`: the records of one commit are placed largest
/// first (`Packing::PageSorted`). A placement policy only: the log reads
/// the same either way.
pub const FLAG_PAGE_SORTED: u32 = 1024;
/// The map directory has the hook snapshot's slots (`hooks`) after the
/// fingerprint tables': binaries that predate it refuse the volume instead
/// of failing on its directory. Set at create and at the first open for
/// writing of an older volume.
pub const FLAG_HOOK_SNAPSHOT: u32 = 2048;
/// The volume is a pool (`pool`): its logical size is the pool's whole
/// space, which a volume table in the header area cuts into volumes. Set
/// at create only: an older binary would serve the pool's space as one
/// volume.
pub const FLAG_POOL: u32 = 4096;
/// The volume is encrypted (`seal`): every record is sealed, and a key
/// slot (`keyslot`) at `KEY_SLOT_OFFSET` holds the wrapped data key. Set at
/// create only: an older binary would read sealed records as damaged.
pub const FLAG_ENCRYPTED: u32 = 8192;
/// Map directory blocks may be summarized (MAP_DIR records with codec
/// none, `checkpoint::DirSummary`): which pages have records and the
/// bytes and highest seq of those records per segment come before the
/// compressed list, so open reads a block's list only when first needed.
/// Set at create and at the first open for writing of an older volume:
/// an older binary would misread a summarized block.
pub const FLAG_DIR_SUMMARY: u32 = 16384;
/// With `FLAG_DIR_SUMMARY`: a summarized directory block's list may lie
/// in a record of its own, which the summary names
/// (`checkpoint::DirList::Apart`), so that open reads the summaries
/// alone. Set at create and at the first open for writing of an older
/// volume: an older binary would take a named list for a damaged one.
pub const FLAG_DIR_LIST_APART: u32 = 32768;
/// A paged commit names its directory (`checkpoint::NamedDir`): the block
/// and seq of each MAP_DIR, the map's allocated pages and the bytes its
/// records hold per segment, so that open leaves the blocks it need not
/// verify unread. Set at create and at the first open for writing of an
/// older volume: an older binary would misread such a commit.
pub const FLAG_DIR_NAMED: u32 = 65536;
/// Where the key slot lies in each superblock copy (after the fields
/// above and their crc; its own crc covers it).
pub const KEY_SLOT_OFFSET: usize = 256;
const FLAGS_KNOWN: u32 = FLAG_DEDUP
    | FLAG_AUTO_CODEC
    | FLAG_RESUME_AT_SNAPSHOT
    | FLAG_PAGED_MAP
    | FLAG_SEG_TABLES
    | FLAG_FP_TABLES
    | FLAG_METADATA_DEVICE
    | FLAG_UNIT_WINDOWS
    | FLAG_CACHE
    | FLAG_PAGE_PACKING
    | FLAG_PAGE_SORTED
    | FLAG_HOOK_SNAPSHOT
    | FLAG_POOL
    | FLAG_ENCRYPTED
    | FLAG_DIR_SUMMARY
    | FLAG_DIR_NAMED
    | FLAG_DIR_LIST_APART;

/// The page records are packed into under `Packing::Page*` (flash's page).
pub const PACKING_PAGE_BYTES: u64 = 4096;

/// How records are laid out in a segment (the schemes of *Compression
/// schemes inside SSDs*; the chunk-based one is the merged compression
/// unit, `--unit-size`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Packing {
    /// Back to back, byte-granular: a record may straddle two pages.
    #[default]
    Compact,
    /// Bin-packing into 4 KiB page bins: a record that would straddle a
    /// page boundary it need not straddle starts at the next page instead
    /// (the gap is zeros), first fit over the records of one commit.
    Page,
    /// `Page`, with the records of one commit placed largest first
    /// (first-fit decreasing: the re-ordering bin-packing of *Compression
    /// schemes inside SSDs*).
    PageSorted,
}

impl Packing {
    pub const ALL: [Packing; 3] = [Packing::Compact, Packing::Page, Packing::PageSorted];

    /// The name `--packing` takes and `cvol stat` shows.
    pub fn name(self) -> &'static str {
        match self {
            Packing::Compact => "compact",
            Packing::Page => "page",
            Packing::PageSorted => "page-sorted",
        }
    }

    pub fn parse(s: &str) -> Option<Packing> {
        Packing::ALL.into_iter().find(|p| p.name() == s)
    }

    /// Does it keep records inside pages?
    pub fn paged(self) -> bool {
        self != Packing::Compact
    }

    fn flags(self) -> u32 {
        match self {
            Packing::Compact => 0,
            Packing::Page => FLAG_PAGE_PACKING,
            Packing::PageSorted => FLAG_PAGE_PACKING | FLAG_PAGE_SORTED,
        }
    }

    /// Where a record of `len` bytes goes in a log whose head is at `fill`:
    /// `fill` itself, or (paged, when the record would touch more pages
    /// from there than it must) the next page boundary.
    pub fn place(self, fill: u64, len: u64) -> u64 {
        if !self.paged() || len == 0 {
            return fill;
        }
        let page = PACKING_PAGE_BYTES;
        let touched = (fill + len - 1) / page - fill / page + 1;
        if touched > len.div_ceil(page) {
            align_up(fill, page)
        } else {
            fill
        }
    }
}

pub const SEGMENT_SIZE_MIN_BYTES: u64 = 1 << 20;
pub const SEGMENT_SIZE_MAX_BYTES: u64 = 1 << 30;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub uuid: [u8; UUID_BYTES],
    pub logical_size_bytes: u64,
    pub physical_size_bytes: u64,
    pub segment_size_bytes: u64,
    pub data_offset_bytes: u64,
    pub codec: CodecTag,
    pub codec_level: u8,
    pub created_unix_secs: u64,
    /// `FLAG_*` bits.
    pub flags: u32,
    /// Segments on the metadata device (0: none, everything in one store).
    pub metadata_segments: u32,
    /// The wrapped data key of an encrypted volume (`FLAG_ENCRYPTED`).
    pub key_slot: Option<KeySlot>,
    /// The unwrapped data key, once an open was given the right key file:
    /// held in memory only, never encoded. Records are sealed and opened
    /// with it wherever the superblock goes.
    pub seal: Option<Arc<Sealer>>,
}

impl Superblock {
    /// Is this volume encrypted (`FLAG_ENCRYPTED`)?
    pub fn is_encrypted(&self) -> bool {
        self.flags & FLAG_ENCRYPTED != 0
    }

    /// The key records are sealed and opened with (None on a volume
    /// without encryption; an encrypted one opened without its key has
    /// none either, and reads no record).
    pub fn sealer(&self) -> Option<&Sealer> {
        self.seal.as_deref()
    }

    /// What each of this volume's records takes beyond its payload in the
    /// clear: the header, and the AEAD tag when it is encrypted.
    pub fn record_overhead(&self) -> usize {
        let tag = if self.is_encrypted() {
            crate::seal::SEAL_TAG_BYTES
        } else {
            0
        };
        crate::record::RECORD_HEADER_BYTES + tag
    }

    /// Is this volume a cache in front of an origin (`cache`)?
    pub fn is_cache(&self) -> bool {
        self.flags & FLAG_CACHE != 0
    }

    /// Whether this is a pool of volumes (`FLAG_POOL`).
    pub fn is_pool(&self) -> bool {
        self.flags & FLAG_POOL != 0
    }

    /// How the records of this volume are packed.
    pub fn packing(&self) -> Packing {
        match (
            self.flags & FLAG_PAGE_PACKING != 0,
            self.flags & FLAG_PAGE_SORTED != 0,
        ) {
            (false, _) => Packing::Compact,
            (true, false) => Packing::Page,
            (true, true) => Packing::PageSorted,
        }
    }

    /// Sets the packing flags (at create).
    pub fn set_packing(&mut self, p: Packing) {
        self.flags = (self.flags & !(FLAG_PAGE_PACKING | FLAG_PAGE_SORTED)) | p.flags();
    }

    pub fn dedup(&self) -> bool {
        self.flags & FLAG_DEDUP != 0
    }

    /// Is the codec policy `auto` (elastic)?
    pub fn auto_codec(&self) -> bool {
        self.flags & FLAG_AUTO_CODEC != 0
    }

    /// Tag every record carries so that records of another volume are rejected.
    pub fn volume_tag(&self) -> u32 {
        crc32c::crc32c(&self.uuid)
    }

    /// The segment count the map directory's table slots are numbered for
    /// (`fprints::directory_tables`): a pool's are numbered for the most
    /// segments its segment size allows (8 TiB of them, and its metadata
    /// segments), so that its physical size can change without moving a
    /// table; other volumes' for their segments.
    pub fn table_segments(&self) -> u64 {
        if self.is_pool() {
            PHYSICAL_SIZE_MAX_BYTES / self.segment_size_bytes + u64::from(self.metadata_segments)
        } else {
            self.segment_count()
        }
    }

    /// Segments of the whole volume: the data store's, then the metadata
    /// device's (numbered on, at offsets on from `metadata_base`).
    pub fn segment_count(&self) -> u64 {
        self.data_segment_count() + u64::from(self.metadata_segments)
    }

    /// The volume offset after the last segment (the metadata device's last,
    /// if there is one).
    pub fn segment_offset_end(&self) -> u64 {
        self.data_offset_bytes + self.segment_count() * self.segment_size_bytes
    }

    /// Segments in the data store (all of them without a metadata device).
    pub fn data_segment_count(&self) -> u64 {
        (self.physical_size_bytes - self.data_offset_bytes) / self.segment_size_bytes
    }

    /// Whether the volume keeps its metadata on a separate device.
    pub fn has_metadata_device(&self) -> bool {
        self.metadata_segments > 0
    }

    /// Is segment `s` on the metadata device?
    pub fn is_metadata_segment(&self, s: u64) -> bool {
        s >= self.data_segment_count()
    }

    /// The volume offset of the metadata device's first segment (metadata
    /// device byte `metadev::METADATA_DATA_OFFSET_BYTES`): the offset space
    /// goes on past the data store's last whole segment.
    pub fn metadata_base(&self) -> u64 {
        self.data_offset_bytes + self.data_segment_count() * self.segment_size_bytes
    }

    pub fn logical_blocks(&self) -> u64 {
        self.logical_size_bytes / BLOCK_SIZE_BYTES
    }

    pub fn segment_offset(&self, segment: u64) -> u64 {
        debug_assert!(segment <= self.segment_count());
        self.data_offset_bytes + segment * self.segment_size_bytes
    }

    /// The segment and the byte within it of a physical offset in the data
    /// area (`None` outside it).
    pub fn locate(&self, offset: u64) -> Option<(u64, usize)> {
        let rel = offset.checked_sub(self.data_offset_bytes)?;
        let segment = rel / self.segment_size_bytes;
        (segment < self.segment_count())
            .then_some((segment, (rel % self.segment_size_bytes) as usize))
    }

    /// Checks the fields against each other; used after decode and before create.
    pub fn validate(&self) -> Result<(), FormatError> {
        if self.is_encrypted() != self.key_slot.is_some() {
            return Err(FormatError::Invalid(
                "encryption flag and key slot disagree",
            ));
        }
        if self.logical_size_bytes == 0 || !self.logical_size_bytes.is_multiple_of(BLOCK_SIZE_BYTES)
        {
            return Err(FormatError::Invalid(
                "logical size must be a non-zero multiple of 4096",
            ));
        }
        if self.logical_size_bytes > LOGICAL_SIZE_MAX_BYTES {
            return Err(FormatError::Invalid("logical size above 16 TiB"));
        }
        if !self.segment_size_bytes.is_power_of_two()
            || self.segment_size_bytes < SEGMENT_SIZE_MIN_BYTES
            || self.segment_size_bytes > SEGMENT_SIZE_MAX_BYTES
        {
            return Err(FormatError::Invalid(
                "segment size must be a power of two in [1 MiB, 1 GiB]",
            ));
        }
        if self.data_offset_bytes < DATA_OFFSET_BYTES
            || !self.data_offset_bytes.is_multiple_of(SECTOR_SIZE_BYTES)
        {
            return Err(FormatError::Invalid("data offset"));
        }
        if self.physical_size_bytes > PHYSICAL_SIZE_MAX_BYTES {
            return Err(FormatError::Invalid("physical size above 8 TiB"));
        }
        if self.flags & FLAG_PAGE_SORTED != 0 && self.flags & FLAG_PAGE_PACKING == 0 {
            return Err(FormatError::Invalid(
                "sorted page packing flag without the page packing flag",
            ));
        }
        if (self.flags & FLAG_METADATA_DEVICE != 0) != (self.metadata_segments > 0) {
            return Err(FormatError::Invalid(
                "metadata segments without the metadata-device flag, or the reverse",
            ));
        }
        // Checked: a corrupt data offset near u64::MAX must not wrap past this test.
        let needed = self
            .data_offset_bytes
            .checked_add(2 * self.segment_size_bytes);
        if needed.is_none_or(|n| self.physical_size_bytes < n) {
            return Err(FormatError::Invalid(
                "physical size too small: need metadata plus two segments",
            ));
        }
        if self.metadata_segments == 1 {
            return Err(FormatError::Invalid(
                "a metadata device needs at least two segments",
            ));
        }
        // Every segment of both stores must be addressable by a map entry.
        let end = u64::from(self.metadata_segments)
            .checked_mul(self.segment_size_bytes)
            .and_then(|m| m.checked_add(self.metadata_base()));
        if end.is_none_or(|e| e > PHYSICAL_SIZE_MAX_BYTES) {
            return Err(FormatError::Invalid(
                "data and metadata segments above 8 TiB",
            ));
        }
        Ok(())
    }

    pub fn encode(&self) -> [u8; SUPERBLOCK_BYTES] {
        let mut b = [0u8; SUPERBLOCK_BYTES];
        b[0..8].copy_from_slice(&SUPERBLOCK_MAGIC);
        put_u32(&mut b, OFF_VERSION, FORMAT_VERSION);
        put_u32(&mut b, OFF_FLAGS, self.flags);
        b[OFF_UUID..OFF_UUID + UUID_BYTES].copy_from_slice(&self.uuid);
        put_u64(&mut b, OFF_LOGICAL, self.logical_size_bytes);
        put_u64(&mut b, OFF_PHYSICAL, self.physical_size_bytes);
        put_u64(&mut b, OFF_SEGMENT, self.segment_size_bytes);
        put_u64(&mut b, OFF_DATA, self.data_offset_bytes);
        b[OFF_CODEC] = self.codec as u8;
        b[OFF_LEVEL] = self.codec_level;
        put_u32(&mut b, OFF_META_SEGMENTS, self.metadata_segments);
        put_u64(&mut b, OFF_CREATED, self.created_unix_secs);
        let crc = crc32c::crc32c(&b[..OFF_CRC]);
        put_u32(&mut b, OFF_CRC, crc);
        if let Some(slot) = &self.key_slot {
            b[KEY_SLOT_OFFSET..KEY_SLOT_OFFSET + KEY_SLOT_BYTES].copy_from_slice(&slot.encode());
        }
        b
    }

    pub fn decode(b: &[u8]) -> Result<Superblock, FormatError> {
        need(b, END)?;
        if b[0..8] != SUPERBLOCK_MAGIC {
            return Err(FormatError::BadMagic);
        }
        let stored = get_u32(b, OFF_CRC);
        let computed = crc32c::crc32c(&b[..OFF_CRC]);
        if stored != computed {
            return Err(FormatError::BadChecksum { stored, computed });
        }
        let version = get_u32(b, OFF_VERSION);
        if version != FORMAT_VERSION {
            return Err(FormatError::UnsupportedVersion(version));
        }
        let flags = get_u32(b, OFF_FLAGS);
        if flags & !FLAGS_KNOWN != 0 {
            return Err(FormatError::Invalid("unknown superblock flags"));
        }
        let mut uuid = [0u8; UUID_BYTES];
        uuid.copy_from_slice(&b[OFF_UUID..OFF_UUID + UUID_BYTES]);
        let sb = Superblock {
            uuid,
            logical_size_bytes: get_u64(b, OFF_LOGICAL),
            physical_size_bytes: get_u64(b, OFF_PHYSICAL),
            segment_size_bytes: get_u64(b, OFF_SEGMENT),
            data_offset_bytes: get_u64(b, OFF_DATA),
            codec: CodecTag::from_u8(b[OFF_CODEC])?,
            codec_level: b[OFF_LEVEL],
            created_unix_secs: get_u64(b, OFF_CREATED),
            flags,
            metadata_segments: get_u32(b, OFF_META_SEGMENTS),
            key_slot: match flags & FLAG_ENCRYPTED != 0 {
                true => Some(KeySlot::decode(b.get(KEY_SLOT_OFFSET..).unwrap_or(&[]))?),
                false => None,
            },
            seal: None,
        };
        sb.validate()?;
        Ok(sb)
    }
}

/// A valid superblock for other modules' tests.
#[cfg(test)]
pub(crate) fn tests_sample() -> Superblock {
    tests::sample()
}

#[cfg(test)]
mod tests {
    use super::*;

    pub fn sample() -> Superblock {
        Superblock {
            uuid: [7; 16],
            logical_size_bytes: 1 << 30,
            physical_size_bytes: 1 << 29,
            segment_size_bytes: 4 << 20,
            data_offset_bytes: DATA_OFFSET_BYTES,
            codec: CodecTag::Zstd,
            codec_level: 3,
            created_unix_secs: 1_700_000_000,
            flags: FLAG_DEDUP,
            metadata_segments: 0,
            key_slot: None,
            seal: None,
        }
    }

    #[test]
    fn packing_roundtrips_and_a_sorted_flag_alone_is_refused() {
        for p in Packing::ALL {
            let mut sb = sample();
            sb.set_packing(p);
            let back = Superblock::decode(&sb.encode()).unwrap();
            assert_eq!(back.packing(), p);
            assert_eq!(Packing::parse(p.name()), Some(p));
        }
        let mut sb = sample();
        sb.flags |= FLAG_PAGE_SORTED;
        assert!(sb.validate().is_err());
        assert_eq!(Packing::parse("pages"), None);
    }

    #[test]
    fn page_packing_moves_only_records_that_would_straddle_a_page_needlessly() {
        let (c, p) = (Packing::Compact, Packing::Page);
        assert_eq!(c.place(4000, 200), 4000, "compact never moves a record");
        assert_eq!(p.place(4000, 96), 4000, "ends exactly at the boundary");
        assert_eq!(p.place(4000, 97), 4096, "would straddle: next page");
        assert_eq!(p.place(4096, 4096), 4096);
        // Longer than a page: it touches as few pages as it can.
        assert_eq!(
            p.place(4060, 4140),
            4096,
            "from 4060 it would touch 3 pages"
        );
        assert_eq!(p.place(100, 4140), 100, "from 100 it touches 2, the least");
        assert_eq!(p.place(4096, 4140), 4096, "from a boundary it touches 2");
        assert_eq!(p.place(50, 8000), 50, "from 50 it touches 2, the least");
        assert_eq!(p.place(8192 + 4000, 0), 8192 + 4000, "nothing to place");
        assert_eq!(Packing::PageSorted.place(4000, 97), 4096);
    }

    #[test]
    fn roundtrip() {
        let sb = sample();
        assert_eq!(Superblock::decode(&sb.encode()).unwrap(), sb);
        assert_eq!(sb.segment_count(), ((1 << 29) - (1 << 20)) / (4 << 20));
    }

    #[test]
    fn the_hook_snapshot_and_pool_flags_are_known_and_the_next_bit_is_not() {
        let mut sb = sample();
        sb.flags |= FLAG_HOOK_SNAPSHOT
            | FLAG_FP_TABLES
            | FLAG_POOL
            | FLAG_DIR_SUMMARY
            | FLAG_DIR_LIST_APART
            | FLAG_DIR_NAMED;
        assert_eq!(FLAG_HOOK_SNAPSHOT, 1 << 11);
        assert_eq!(FLAG_POOL, 1 << 12);
        assert_eq!(FLAG_DIR_SUMMARY, 1 << 14);
        assert_eq!(FLAG_DIR_LIST_APART, 1 << 15);
        assert_eq!(FLAG_DIR_NAMED, 1 << 16);
        assert_eq!(Superblock::decode(&sb.encode()).unwrap().flags, sb.flags);
        assert!(sb.is_pool());
        sb.flags |= FLAG_DIR_NAMED << 1;
        assert_eq!(
            Superblock::decode(&sb.encode()),
            Err(FormatError::Invalid("unknown superblock flags"))
        );
    }

    #[test]
    fn every_single_bit_flip_is_detected() {
        let b = sample().encode();
        for bit in 0..(END * 8) {
            let mut c = b;
            c[bit / 8] ^= 1 << (bit % 8);
            assert!(
                Superblock::decode(&c).is_err(),
                "bit {bit} flip not detected"
            );
        }
    }

    #[test]
    fn rejects_bad_geometry() {
        let mut sb = sample();
        sb.segment_size_bytes = 3 << 20;
        assert!(sb.validate().is_err());
        let mut sb = sample();
        sb.physical_size_bytes = 2 << 20;
        assert!(sb.validate().is_err());
        assert!(Superblock::decode(&[0u8; 10]).is_err());
    }

    /// Found by the `format_decoders` fuzz target
    /// (fuzz/regressions/format_decoders/superblock-data-offset-overflow):
    /// a data offset near u64::MAX overflowed the size check (a panic with
    /// overflow checks; without them the check wrapped, passed, and the
    /// segment count underflowed to an astronomically large number).
    #[test]
    fn regression_huge_data_offset_is_rejected_without_overflow() {
        for data_offset_bytes in [u64::MAX - 511, u64::MAX - (1 << 30) + 1, 1 << 63] {
            let sb = Superblock {
                data_offset_bytes: data_offset_bytes / 512 * 512,
                ..sample()
            };
            assert!(sb.validate().is_err(), "{data_offset_bytes}");
            assert!(Superblock::decode(&sb.encode()).is_err());
        }
    }
}
