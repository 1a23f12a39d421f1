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
