//! Persisted hook index snapshot (volumes with `FLAG_HOOK_SNAPSHOT`): the
//! dedup hook index (a sampled, 8-byte-per-entry map from a fingerprint's
//! key to the fingerprint table holding its row) is a function of the
//! fingerprint tables, so it is rebuilt by replaying them; a snapshot saved
//! now and then lets an open replay only the tables written after it (the
//! log/flush split of OpenZFS's fast dedup, with the tables as the log).
//!
//! The map directory has `1 + HOOK_CHUNKS_MAX` slots after the fingerprint
//! tables (`fprints`): table index `hook_root_table(segments, segment size)`
//! names the *root*, index `hook_root_table(..) + 1 + c` names *chunk* `c`.
//! Both are MAP_TABLE records (lz4, as every table); these are their
//! payloads before compression.
//!
//! Root:
//! ```text
//! 8  version (1)
//! 8  slots: the hook array's entry count (its bucket count * 8)
//! 1  sample bits k (0..=8: a key is a hook iff its top k bits are 0)
//! 7  pad (0)
//! 8  snapshot seq: the log seq when the copying began
//! 4  chunk count (at most HOOK_CHUNKS_MAX; exactly enough to hold every
//!    bucket: ceil(slots / 8 / buckets per chunk))
//! 4  buckets per chunk (1..=HOOK_CHUNK_MAX_BUCKETS; `buckets_per_chunk`)
//! 40 end
//! ```
//!
//! Chunk `c` (buckets `c * buckets per chunk` on, the last chunk shorter):
//! ```text
//! 4  chunk c
//! 4  bucket count n (at most HOOK_CHUNK_MAX_BUCKETS)
//! n * 8 entries, each a little-endian u64, in slot order (bucket by
//!    bucket, 8 entries a bucket; 0 = empty)
//! ```
//! The entries are opaque here: the engine's hook index defines their bits
//! (a tag of the key, the table's segment generation, the table index) and
//! writes them with the generation zeroed and dead entries zeroed (lz4
//! squeezes the empties).
//!
//! The snapshot is a *hint*. At load an entry is used only if the
//! directory names its fingerprint table with a record seq no later than
//! the root's snapshot seq (a table rewritten or freed since is not); the
//! tables newer than the snapshot are replayed. A damaged or missing
//! snapshot means a rebuild from the tables, never wrong data: every hook
//! costs at most one table read, and every row a byte compare.
use crate::*;

/// Directory slots for hook chunks (after the root's).
pub const HOOK_CHUNKS_MAX: u64 = 4096;
/// Entries in one bucket (one 64-byte cache line).
pub const HOOK_BUCKET_ENTRIES: u64 = 8;
/// Bytes of one bucket in a chunk payload.
pub const HOOK_BUCKET_BYTES: usize = HOOK_BUCKET_ENTRIES as usize * 8;
/// Version of the root payload.
pub const HOOK_ROOT_VERSION: u64 = 1;
/// Bytes of the root payload.
pub const HOOK_ROOT_BYTES: usize = 40;
/// Header of a chunk payload.
pub const HOOK_CHUNK_HEADER_BYTES: usize = 8;
/// Largest sample bit count.
pub const HOOK_SAMPLE_BITS_MAX: u8 = 8;
/// Fewest buckets a chunk holds (but the last), 64 KiB of entries.
pub const HOOK_CHUNK_MIN_BUCKETS: u32 = 1024;
/// Most buckets a chunk holds: 120 KiB of entries, so that the payload,
/// even incompressible, stays a single record.
pub const HOOK_CHUNK_MAX_BUCKETS: u32 = 1920;
/// Largest chunk payload (before lz4).
pub const HOOK_CHUNK_MAX_BYTES: usize =
    HOOK_CHUNK_HEADER_BYTES + HOOK_CHUNK_MAX_BUCKETS as usize * HOOK_BUCKET_BYTES;
// lz4's worst case (n + n/255 + 16) and its 4-byte length prefix fit.
const _: () = assert!(
    HOOK_CHUNK_MAX_BYTES + HOOK_CHUNK_MAX_BYTES / 255 + 64
        < record::RECORD_MAX_BYTES - record::RECORD_HEADER_BYTES
);
const _: () = assert!(HOOK_CHUNK_MIN_BUCKETS <= HOOK_CHUNK_MAX_BUCKETS);

const OFF_VERSION: usize = 0;
const OFF_SLOTS: usize = OFF_VERSION + 8;
const OFF_SAMPLE_BITS: usize = OFF_SLOTS + 8;
const OFF_PAD: usize = OFF_SAMPLE_BITS + 1;
const PAD_BYTES: usize = 7;
const OFF_SNAPSHOT_SEQ: usize = OFF_PAD + PAD_BYTES;
const OFF_CHUNKS: usize = OFF_SNAPSHOT_SEQ + 8;
const OFF_BUCKETS_PER_CHUNK: usize = OFF_CHUNKS + 4;
const _: () = assert!(OFF_BUCKETS_PER_CHUNK + 4 == HOOK_ROOT_BYTES);
const OFF_CHUNK: usize = 0;
const OFF_CHUNK_BUCKETS: usize = OFF_CHUNK + 4;
const _: () = assert!(OFF_CHUNK_BUCKETS + 4 == HOOK_CHUNK_HEADER_BYTES);

/// Table index of the hook root: the first after the fingerprint tables.
pub const fn hook_root_table(segments: u64, segment_size: u64) -> u64 {
    tables::table_count(segments) + segments * fprints::fp_parts(segment_size)
}

/// Table index of hook chunk `chunk`.
pub const fn hook_chunk_table(segments: u64, segment_size: u64, chunk: u32) -> u64 {
    hook_root_table(segments, segment_size) + 1 + chunk as u64
}

/// Buckets per chunk for a hook array of `total_buckets` buckets: at least
/// `HOOK_CHUNK_MIN_BUCKETS`, and enough for `HOOK_CHUNKS_MAX` chunks to
/// hold them all; `None` if that takes more than `HOOK_CHUNK_MAX_BUCKETS`
/// (the index is too large to persist).
pub fn buckets_per_chunk(total_buckets: u64) -> Option<u32> {
    let per = total_buckets
        .div_ceil(HOOK_CHUNKS_MAX)
        .max(u64::from(HOOK_CHUNK_MIN_BUCKETS));
    (per <= u64::from(HOOK_CHUNK_MAX_BUCKETS)).then_some(per as u32)
}

/// Why a hook snapshot payload is not valid. Decoders never panic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HookFormatError {
    /// A root payload of another length than `HOOK_ROOT_BYTES`.
    RootLength {
        got: usize,
    },
    UnsupportedVersion(u64),
    NonZeroPad,
    SampleBits(u8),
    /// A slot count that is not a whole number of buckets.
    SlotsNotBuckets(u64),
    BucketsPerChunk(u32),
    TooManyChunks(u32),
    /// The chunks hold fewer buckets than the slots need.
    ChunksTooFew {
        slots: u64,
        chunks: u32,
        buckets_per_chunk: u32,
    },
    /// More chunks than the slots need (the last one would be empty).
    ChunksTooMany {
        slots: u64,
        chunks: u32,
        buckets_per_chunk: u32,
    },
    /// A chunk payload shorter than its header.
    ChunkTooShort {
        got: usize,
    },
    WrongChunk {
        expected: u32,
        found: u32,
    },
    ChunkBuckets(u32),
    /// A chunk payload whose length is not its header plus its buckets.
    ChunkLength {
        expected: usize,
        got: usize,
    },
}

impl std::fmt::Display for HookFormatError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use HookFormatError as E;
        match self {
            E::RootLength { got } => {
                write!(f, "hook root: {got} bytes, not {HOOK_ROOT_BYTES}")
            }
            E::UnsupportedVersion(v) => write!(f, "hook root: unsupported version {v}"),
            E::NonZeroPad => write!(f, "hook root: non-zero padding"),
            E::SampleBits(k) => {
                write!(f, "hook root: {k} sample bits, at most {HOOK_SAMPLE_BITS_MAX}")
            }
            E::SlotsNotBuckets(s) => write!(f, "hook root: {s} slots is not a multiple of 8"),
            E::BucketsPerChunk(n) => write!(
                f,
                "hook root: {n} buckets per chunk, not in 1..={HOOK_CHUNK_MAX_BUCKETS}"
            ),
            E::TooManyChunks(n) => {
                write!(f, "hook root: {n} chunks, at most {HOOK_CHUNKS_MAX}")
            }
            E::ChunksTooFew {
                slots,
                chunks,
                buckets_per_chunk,
            } => write!(
                f,
                "hook root: {chunks} chunks of {buckets_per_chunk} buckets cannot hold {slots} slots"
            ),
            E::ChunksTooMany {
                slots,
                chunks,
                buckets_per_chunk,
            } => write!(
                f,
                "hook root: {chunks} chunks of {buckets_per_chunk} buckets for {slots} slots, more than needed"
            ),
            E::ChunkTooShort { got } => write!(
                f,
                "hook chunk: {got} bytes, shorter than its {HOOK_CHUNK_HEADER_BYTES}-byte header"
            ),
            E::WrongChunk { expected, found } => {
                write!(f, "hook chunk: chunk {found} where chunk {expected} belongs")
            }
            E::ChunkBuckets(n) => write!(
                f,
                "hook chunk: {n} buckets, at most {HOOK_CHUNK_MAX_BUCKETS}"
            ),
            E::ChunkLength { expected, got } => {
                write!(f, "hook chunk: {got} bytes, its buckets take {expected}")
            }
        }
    }
}

impl std::error::Error for HookFormatError {}

/// The root of a hook snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HookRoot {
    /// Entries of the hook array (its bucket count * 8).
    pub slots: u64,
    /// Sample bits `k` when the snapshot was taken.
    pub sample_bits: u8,
    /// The log seq when the copying began.
    pub snapshot_seq: u64,
    pub chunks: u32,
    pub buckets_per_chunk: u32,
}

impl HookRoot {
    /// The root of a snapshot of a hook array of `slots` entries, chunked
    /// by `buckets_per_chunk`; `None` if `slots` is not a whole number of
    /// buckets or the array is too large to persist.
    pub fn plan(slots: u64, sample_bits: u8, snapshot_seq: u64) -> Option<HookRoot> {
        if !slots.is_multiple_of(HOOK_BUCKET_ENTRIES) || sample_bits > HOOK_SAMPLE_BITS_MAX {
            return None;
        }
        let buckets = slots / HOOK_BUCKET_ENTRIES;
        let per = buckets_per_chunk(buckets)?;
        Some(HookRoot {
            slots,
            sample_bits,
            snapshot_seq,
            chunks: buckets.div_ceil(u64::from(per)) as u32,
            buckets_per_chunk: per,
        })
    }

    /// Buckets of the hook array.
    pub fn buckets(&self) -> u64 {
        self.slots / HOOK_BUCKET_ENTRIES
    }

    /// Buckets chunk `chunk` holds (the last may hold fewer; 0 past it).
    pub fn chunk_buckets(&self, chunk: u32) -> u32 {
        let first = u64::from(chunk) * u64::from(self.buckets_per_chunk);
        let left = self.buckets().saturating_sub(first);
        left.min(u64::from(self.buckets_per_chunk)) as u32
    }

    /// The payload (before lz4).
    pub fn encode(&self) -> Vec<u8> {
        let mut v = vec![0u8; HOOK_ROOT_BYTES];
        put_u64(&mut v, OFF_VERSION, HOOK_ROOT_VERSION);
        put_u64(&mut v, OFF_SLOTS, self.slots);
        v[OFF_SAMPLE_BITS] = self.sample_bits;
        put_u64(&mut v, OFF_SNAPSHOT_SEQ, self.snapshot_seq);
        put_u32(&mut v, OFF_CHUNKS, self.chunks);
        put_u32(&mut v, OFF_BUCKETS_PER_CHUNK, self.buckets_per_chunk);
        v
    }

    pub fn decode(b: &[u8]) -> Result<HookRoot, HookFormatError> {
        use HookFormatError as E;
        if b.len() != HOOK_ROOT_BYTES {
            return Err(E::RootLength { got: b.len() });
        }
        let version = get_u64(b, OFF_VERSION);
        if version != HOOK_ROOT_VERSION {
            return Err(E::UnsupportedVersion(version));
        }
        if b[OFF_PAD..OFF_PAD + PAD_BYTES].iter().any(|&x| x != 0) {
            return Err(E::NonZeroPad);
        }
        let r = HookRoot {
            slots: get_u64(b, OFF_SLOTS),
            sample_bits: b[OFF_SAMPLE_BITS],
            snapshot_seq: get_u64(b, OFF_SNAPSHOT_SEQ),
            chunks: get_u32(b, OFF_CHUNKS),
            buckets_per_chunk: get_u32(b, OFF_BUCKETS_PER_CHUNK),
        };
        r.validate()?;
        Ok(r)
    }

    fn validate(&self) -> Result<(), HookFormatError> {
        use HookFormatError as E;
        if self.sample_bits > HOOK_SAMPLE_BITS_MAX {
            return Err(E::SampleBits(self.sample_bits));
        }
        if !self.slots.is_multiple_of(HOOK_BUCKET_ENTRIES) {
            return Err(E::SlotsNotBuckets(self.slots));
        }
        if self.buckets_per_chunk == 0 || self.buckets_per_chunk > HOOK_CHUNK_MAX_BUCKETS {
            return Err(E::BucketsPerChunk(self.buckets_per_chunk));
        }
        if u64::from(self.chunks) > HOOK_CHUNKS_MAX {
            return Err(E::TooManyChunks(self.chunks));
        }
        let needed = self.buckets().div_ceil(u64::from(self.buckets_per_chunk));
        let (slots, chunks, buckets_per_chunk) = (self.slots, self.chunks, self.buckets_per_chunk);
        if u64::from(chunks) < needed {
            return Err(E::ChunksTooFew {
                slots,
                chunks,
                buckets_per_chunk,
            });
        }
        if u64::from(chunks) > needed {
            return Err(E::ChunksTooMany {
                slots,
                chunks,
                buckets_per_chunk,
            });
        }
        Ok(())
    }
}

/// A chunk of a hook snapshot: a run of the hook array's buckets.
pub struct HookChunk;

impl HookChunk {
    /// The payload (before lz4) of chunk `chunk` holding `entries`.
    ///
    /// # Panics
    /// If `entries` is not a whole number of buckets, or more than
    /// `HOOK_CHUNK_MAX_BUCKETS` of them (a caller's bug: `HookRoot` says
    /// how many buckets each chunk holds).
    pub fn encode(chunk: u32, entries: &[u64]) -> Vec<u8> {
        let per = HOOK_BUCKET_ENTRIES as usize;
        assert!(
            entries.len().is_multiple_of(per),
            "hook chunk of {} entries: not whole buckets",
            entries.len()
        );
        let buckets = entries.len() / per;
        assert!(
            buckets <= HOOK_CHUNK_MAX_BUCKETS as usize,
            "hook chunk of {buckets} buckets"
        );
        let mut v = Vec::with_capacity(HOOK_CHUNK_HEADER_BYTES + entries.len() * 8);
        v.extend_from_slice(&chunk.to_le_bytes());
        v.extend_from_slice(&(buckets as u32).to_le_bytes());
        for e in entries {
            v.extend_from_slice(&e.to_le_bytes());
        }
        v
    }

    /// Decodes chunk `expected_chunk`: its bucket count and its entries.
    pub fn decode(b: &[u8], expected_chunk: u32) -> Result<(u32, Vec<u64>), HookFormatError> {
        use HookFormatError as E;
        if b.len() < HOOK_CHUNK_HEADER_BYTES {
            return Err(E::ChunkTooShort { got: b.len() });
        }
        let found = get_u32(b, OFF_CHUNK);
        if found != expected_chunk {
            return Err(E::WrongChunk {
                expected: expected_chunk,
                found,
            });
        }
        let buckets = get_u32(b, OFF_CHUNK_BUCKETS);
        if buckets > HOOK_CHUNK_MAX_BUCKETS {
            return Err(E::ChunkBuckets(buckets));
        }
        let expected = HOOK_CHUNK_HEADER_BYTES + buckets as usize * HOOK_BUCKET_BYTES;
        if b.len() != expected {
            return Err(E::ChunkLength {
                expected,
                got: b.len(),
            });
        }
        let entries = b[HOOK_CHUNK_HEADER_BYTES..]
            .chunks_exact(8)
            .map(|e| get_u64(e, 0))
            .collect();
        Ok((buckets, entries))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, RngCore, SeedableRng};
    use HookFormatError as E;

    fn root() -> HookRoot {
        HookRoot::plan(8 * 5000, 3, 77).unwrap()
    }

    /// A root payload with one field overwritten.
    fn root_with(at: usize, bytes: &[u8]) -> Vec<u8> {
        let mut b = root().encode();
        b[at..at + bytes.len()].copy_from_slice(bytes);
        b
    }

    #[test]
    fn a_root_round_trips_with_its_fields_where_the_layout_says() {
        let r = root();
        assert_eq!((r.chunks, r.buckets_per_chunk), (5, 1024));
        assert_eq!(
            (r.chunk_buckets(0), r.chunk_buckets(4)),
            (1024, 5000 - 4 * 1024)
        );
        assert_eq!(r.chunk_buckets(5), 0);
        let b = r.encode();
        assert_eq!(b.len(), HOOK_ROOT_BYTES);
        assert_eq!(b[..8], 1u64.to_le_bytes());
        assert_eq!(b[8..16], 40_000u64.to_le_bytes());
        assert_eq!((b[16], &b[17..24]), (3, &[0u8; 7][..]));
        assert_eq!(b[24..32], 77u64.to_le_bytes());
        assert_eq!(b[32..36], 5u32.to_le_bytes());
        assert_eq!(b[36..40], 1024u32.to_le_bytes());
        assert_eq!(HookRoot::decode(&b), Ok(r));
        let empty = HookRoot::plan(0, 0, 1).unwrap();
        assert_eq!(empty.chunks, 0);
        assert_eq!(HookRoot::decode(&empty.encode()), Ok(empty));
    }

    #[test]
    fn a_root_refuses_each_bad_field() {
        let mut long = root().encode();
        long.push(0);
        assert_eq!(HookRoot::decode(&long), Err(E::RootLength { got: 41 }));
        assert_eq!(
            HookRoot::decode(&long[..39]),
            Err(E::RootLength { got: 39 })
        );
        let b = root_with(OFF_VERSION, &2u64.to_le_bytes());
        assert_eq!(HookRoot::decode(&b), Err(E::UnsupportedVersion(2)));
        for at in OFF_PAD..OFF_PAD + PAD_BYTES {
            assert_eq!(HookRoot::decode(&root_with(at, &[1])), Err(E::NonZeroPad));
        }
        assert_eq!(
            HookRoot::decode(&root_with(OFF_SAMPLE_BITS, &[8])).map(|r| r.sample_bits),
            Ok(8)
        );
        let b = root_with(OFF_SAMPLE_BITS, &[9]);
        assert_eq!(HookRoot::decode(&b), Err(E::SampleBits(9)));
        let b = root_with(OFF_SLOTS, &40_004u64.to_le_bytes());
        assert_eq!(HookRoot::decode(&b), Err(E::SlotsNotBuckets(40_004)));
        for n in [0, HOOK_CHUNK_MAX_BUCKETS + 1] {
            let b = root_with(OFF_BUCKETS_PER_CHUNK, &n.to_le_bytes());
            assert_eq!(HookRoot::decode(&b), Err(E::BucketsPerChunk(n)));
        }
        let b = root_with(OFF_CHUNKS, &4097u32.to_le_bytes());
        assert_eq!(HookRoot::decode(&b), Err(E::TooManyChunks(4097)));
    }

    #[test]
    fn a_root_needs_exactly_the_chunks_its_slots_take() {
        let (slots, buckets_per_chunk) = (40_000, 1024);
        let b = root_with(OFF_CHUNKS, &4u32.to_le_bytes());
        assert_eq!(
            HookRoot::decode(&b),
            Err(E::ChunksTooFew {
                slots,
                chunks: 4,
                buckets_per_chunk
            })
        );
        let b = root_with(OFF_CHUNKS, &6u32.to_le_bytes());
        assert_eq!(
            HookRoot::decode(&b),
            Err(E::ChunksTooMany {
                slots,
                chunks: 6,
                buckets_per_chunk
            })
        );
        // Larger chunks may hold it in fewer: 3 of 1920 is 5760 buckets.
        let mut b = root_with(OFF_CHUNKS, &3u32.to_le_bytes());
        b[OFF_BUCKETS_PER_CHUNK..][..4].copy_from_slice(&1920u32.to_le_bytes());
        assert_eq!(HookRoot::decode(&b).map(|r| r.chunks), Ok(3));
        // Every slot of the largest persisted index has a chunk.
        let most = u64::from(HOOK_CHUNK_MAX_BUCKETS) * HOOK_CHUNKS_MAX;
        let big = HookRoot::plan(8 * most, 8, u64::MAX).unwrap();
        assert_eq!((big.chunks, big.buckets_per_chunk), (4096, 1920));
        assert_eq!(HookRoot::decode(&big.encode()), Ok(big));
        assert_eq!(HookRoot::plan(8 * most + 8, 8, 0), None);
        assert_eq!(HookRoot::plan(12, 0, 0), None);
        assert_eq!(HookRoot::plan(8, 9, 0), None);
    }

    #[test]
    fn buckets_per_chunk_grows_past_4096_chunks_and_stops_at_the_cap() {
        assert_eq!(buckets_per_chunk(0), Some(1024));
        assert_eq!(buckets_per_chunk(1024 * 4096), Some(1024));
        assert_eq!(buckets_per_chunk(1024 * 4096 + 1), Some(1025));
        assert_eq!(buckets_per_chunk(1920 * 4096), Some(1920));
        assert_eq!(buckets_per_chunk(1920 * 4096 + 1), None);
        assert_eq!(buckets_per_chunk(u64::MAX), None);
    }

    #[test]
    fn hook_slots_follow_the_fingerprint_tables() {
        let (segments, seg) = (10, 4 << 20);
        let root = hook_root_table(segments, seg);
        assert_eq!(root, fprints::fp_table_index(segments, seg, 9, 7) + 1);
        assert_eq!(hook_chunk_table(segments, seg, 0), root + 1);
        assert_eq!(
            hook_chunk_table(segments, seg, 4095) + 1,
            fprints::directory_tables(segments, seg)
        );
    }

    #[test]
    fn a_chunk_round_trips_and_refuses_each_bad_field() {
        let entries: Vec<u64> = (0..16)
            .map(|i| (i * 0x0101_0101_0101) | (u64::from(i == 3) << 63))
            .collect();
        let b = HookChunk::encode(9, &entries);
        assert_eq!(b.len(), 8 + 16 * 8);
        assert_eq!(
            (&b[..4], &b[4..8]),
            (&9u32.to_le_bytes()[..], &2u32.to_le_bytes()[..])
        );
        assert_eq!(b[8 + 8 * 3..8 + 8 * 4], entries[3].to_le_bytes());
        assert_eq!(HookChunk::decode(&b, 9), Ok((2, entries.clone())));
        assert_eq!(
            HookChunk::decode(&HookChunk::encode(0, &[]), 0),
            Ok((0, vec![]))
        );
        assert_eq!(
            HookChunk::decode(&b, 8),
            Err(E::WrongChunk {
                expected: 8,
                found: 9
            })
        );
        assert_eq!(
            HookChunk::decode(&b[..7], 9),
            Err(E::ChunkTooShort { got: 7 })
        );
        for len in [b.len() - 1, b.len() - 64, 8] {
            assert_eq!(
                HookChunk::decode(&b[..len], 9),
                Err(E::ChunkLength {
                    expected: 136,
                    got: len
                })
            );
        }
        let mut long = b.clone();
        long.extend_from_slice(&[0; 64]);
        assert_eq!(
            HookChunk::decode(&long, 9),
            Err(E::ChunkLength {
                expected: 136,
                got: 200
            })
        );
        let mut many = b.clone();
        many[4..8].copy_from_slice(&(HOOK_CHUNK_MAX_BUCKETS + 1).to_le_bytes());
        assert_eq!(
            HookChunk::decode(&many, 9),
            Err(E::ChunkBuckets(HOOK_CHUNK_MAX_BUCKETS + 1))
        );
        let full = vec![u64::MAX; HOOK_CHUNK_MAX_BUCKETS as usize * 8];
        let b = HookChunk::encode(4095, &full);
        assert_eq!(b.len(), HOOK_CHUNK_MAX_BYTES);
        assert_eq!(
            HookChunk::decode(&b, 4095),
            Ok((HOOK_CHUNK_MAX_BUCKETS, full))
        );
    }

    #[test]
    #[should_panic(expected = "not whole buckets")]
    fn encoding_a_partial_bucket_is_a_bug() {
        HookChunk::encode(0, &[1; 7]);
    }

    /// Random, truncated and bit-flipped payloads: every decode returns,
    /// none panics, and a decoded root is self-consistent.
    #[test]
    fn random_payloads_never_panic() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let good_root = root().encode();
        let good_chunk = HookChunk::encode(2, &[5; 64]);
        let (mut roots, mut chunks) = (0, 0);
        for i in 0..20_000 {
            let mut b = match i % 3 {
                0 => good_root.clone(),
                1 => good_chunk.clone(),
                _ => {
                    let mut b = vec![0u8; rng.gen_range(0..600)];
                    rng.fill_bytes(&mut b);
                    b
                }
            };
            if !b.is_empty() && rng.gen_bool(0.5) {
                let at = rng.gen_range(0..b.len());
                b[at] ^= 1 << rng.gen_range(0..8);
            }
            if rng.gen_bool(0.5) {
                b.truncate(rng.gen_range(0..=b.len()));
            }
            if let Ok(r) = HookRoot::decode(&b) {
                assert_eq!(r.encode(), b);
                roots += 1;
            }
            if let Ok((n, e)) = HookChunk::decode(&b, 2) {
                assert_eq!(e.len(), n as usize * 8);
                chunks += 1;
            }
        }
        // A quarter of the good payloads are left whole, and a flip in a
        // root's snapshot seq or a chunk's entries keeps it valid too.
        assert!(roots > 1500 && chunks > 2500, "{roots} {chunks}");
    }
}
