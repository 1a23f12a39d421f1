//! Helpers shared by the crate's unit tests.

/// `n` bytes of xorshift64 output (incompressible: the probe and every
/// codec store it raw), the same for the same `seed`.
pub(crate) fn pseudo_random(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A superblock of a 1 GiB volume on 512 MiB with 4 MiB segments, in the
/// clear: for tests of tables and books that only need its geometry.
pub(crate) fn small_superblock() -> cvol_format::Superblock {
    cvol_format::Superblock {
        uuid: [7; 16],
        logical_size_bytes: 1 << 30,
        physical_size_bytes: 1 << 29,
        segment_size_bytes: 4 << 20,
        data_offset_bytes: cvol_format::DATA_OFFSET_BYTES,
        codec: cvol_format::CodecTag::Lz4,
        codec_level: 0,
        created_unix_secs: 0,
        flags: 0,
        metadata_segments: 0,
        key_slot: None,
        seal: None,
    }
}
