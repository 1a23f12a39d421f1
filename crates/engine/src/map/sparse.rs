//! The block map's per-page tables, sized by what they hold rather than by
//! the map's logical size: a map of 2^32 blocks has 8 M pages, of which a
//! volume with a few MiB written uses a handful. Both tables are two-level:
//! a small top level of chunk slots (one per `SLOT_CHUNK` pages), and a
//! chunk allocated when its first entry is set and freed when its last is
//! cleared.

/// Pages per chunk of a `Slots` table (16 KiB of slots a chunk).
const SLOT_CHUNK: usize = 2048;

/// One optional `T` per index, in chunks allocated on first use.
pub struct Slots<T> {
    chunks: Vec<Option<Chunk<T>>>,
    len: usize,
}

struct Chunk<T> {
    slots: Box<[Option<T>]>,
    /// Slots that hold a value.
    count: usize,
}

impl<T> Slots<T> {
    /// A table of `len` empty slots.
    pub fn new(len: usize) -> Slots<T> {
        Slots {
            chunks: (0..len.div_ceil(SLOT_CHUNK)).map(|_| None).collect(),
            len,
        }
    }

    /// Slots in the table (held or not).
    pub fn len(&self) -> usize {
        self.len
    }

    fn split(&self, i: usize) -> (usize, usize) {
        assert!(i < self.len, "slot {i} of {}", self.len);
        (i / SLOT_CHUNK, i % SLOT_CHUNK)
    }

    pub fn get(&self, i: usize) -> Option<&T> {
        let (c, k) = self.split(i);
        self.chunks[c].as_ref()?.slots[k].as_ref()
    }

    pub fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        let (c, k) = self.split(i);
        self.chunks[c].as_mut()?.slots[k].as_mut()
    }

    /// Whether slot `i` holds a value.
    pub fn has(&self, i: usize) -> bool {
        self.get(i).is_some()
    }

    /// Puts `v` in slot `i`, returning what it held.
    pub fn put(&mut self, i: usize, v: T) -> Option<T> {
        let (c, k) = self.split(i);
        let chunk = self.chunks[c].get_or_insert_with(|| Chunk {
            slots: (0..SLOT_CHUNK).map(|_| None).collect(),
            count: 0,
        });
        let old = chunk.slots[k].replace(v);
        chunk.count += usize::from(old.is_none());
        old
    }

    /// Empties slot `i`, returning what it held; a chunk left empty is freed.
    pub fn take(&mut self, i: usize) -> Option<T> {
        let (c, k) = self.split(i);
        let chunk = self.chunks[c].as_mut()?;
        let old = chunk.slots[k].take();
        chunk.count -= usize::from(old.is_some());
        if chunk.count == 0 {
            self.chunks[c] = None;
        }
        old
    }

    /// Bytes of heap the table uses.
    pub fn memory_bytes(&self) -> usize {
        let chunks = self.chunks.iter().flatten().count();
        self.chunks.capacity() * std::mem::size_of::<Option<Chunk<T>>>()
            + chunks * SLOT_CHUNK * std::mem::size_of::<Option<T>>()
    }
}

/// Words per chunk of a `Bits` set (4096 bits, 512 bytes).
const BIT_CHUNK_WORDS: usize = 64;
const BIT_CHUNK: usize = BIT_CHUNK_WORDS * 64;

/// A set of indexes below `len`, in chunks of bits allocated on first use:
/// finding the next member skips a missing chunk at once, and reads a
/// present one 64 indexes a word.
pub struct Bits {
    chunks: Vec<Option<Box<[u64; BIT_CHUNK_WORDS]>>>,
    len: usize,
}

impl Bits {
    pub fn new(len: usize) -> Bits {
        Bits {
            chunks: (0..len.div_ceil(BIT_CHUNK)).map(|_| None).collect(),
            len,
        }
    }

    fn split(&self, i: usize) -> (usize, usize, u64) {
        assert!(i < self.len, "bit {i} of {}", self.len);
        let k = i % BIT_CHUNK;
        (i / BIT_CHUNK, k / 64, 1 << (k % 64))
    }

    pub fn get(&self, i: usize) -> bool {
        let (c, w, mask) = self.split(i);
        self.chunks[c].as_ref().is_some_and(|ch| ch[w] & mask != 0)
    }

    /// Sets or clears bit `i`; a chunk left without bits is freed.
    pub fn set(&mut self, i: usize, on: bool) {
        let (c, w, mask) = self.split(i);
        if on {
            self.chunks[c].get_or_insert_with(|| Box::new([0; BIT_CHUNK_WORDS]))[w] |= mask;
            return;
        }
        let Some(ch) = self.chunks[c].as_mut() else {
            return;
        };
        if ch[w] & mask != 0 {
            ch[w] &= !mask;
            if ch[w] == 0 && ch.iter().all(|&x| x == 0) {
                self.chunks[c] = None;
            }
        }
    }

    /// Sets the members of consecutive words from 64-aligned index `at`
    /// (bit `i` of word `k`: index `at + 64 k + i`), each chunk looked up
    /// once; returns how many of them were set already.
    pub fn or_words(&mut self, at: usize, words: &[u64]) -> u32 {
        assert!(
            at.is_multiple_of(64) && at + words.len() * 64 <= self.len.next_multiple_of(64),
            "words at {at} of {}",
            self.len
        );
        let mut before = 0;
        let mut k = 0;
        while k < words.len() {
            let i = at + k * 64;
            let (c, w) = (i / BIT_CHUNK, i % BIT_CHUNK / 64);
            let n = (BIT_CHUNK_WORDS - w).min(words.len() - k);
            let part = &words[k..k + n];
            k += n;
            if part.iter().all(|&x| x == 0) {
                continue;
            }
            let ch = self.chunks[c].get_or_insert_with(|| Box::new([0; BIT_CHUNK_WORDS]));
            for (dst, &x) in ch[w..w + n].iter_mut().zip(part) {
                before += (*dst & x).count_ones();
                *dst |= x;
            }
        }
        before
    }

    /// The first member at or after `start`.
    pub fn next_set(&self, start: usize) -> Option<usize> {
        if start >= self.len {
            return None;
        }
        let (mut c, mut w) = (start / BIT_CHUNK, start % BIT_CHUNK / 64);
        let mut mask = u64::MAX << (start % 64);
        while c < self.chunks.len() {
            if let Some(ch) = &self.chunks[c] {
                while w < BIT_CHUNK_WORDS {
                    let bits = ch[w] & mask;
                    if bits != 0 {
                        return Some(c * BIT_CHUNK + w * 64 + bits.trailing_zeros() as usize);
                    }
                    (w, mask) = (w + 1, u64::MAX);
                }
            }
            (c, w, mask) = (c + 1, 0, u64::MAX);
        }
        None
    }

    /// Every member, in order.
    pub fn ones(&self) -> impl Iterator<Item = usize> + '_ {
        let mut next = self.next_set(0);
        std::iter::from_fn(move || {
            let i = next?;
            next = self.next_set(i + 1);
            Some(i)
        })
    }

    /// Bytes of heap the set uses.
    pub fn memory_bytes(&self) -> usize {
        let chunks = self.chunks.iter().flatten().count();
        self.chunks.capacity() * std::mem::size_of::<Option<Box<[u64; BIT_CHUNK_WORDS]>>>()
            + chunks * BIT_CHUNK_WORDS * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Words across a chunk's end set the same members as bit by bit, and
    /// count those set before; zero words allocate no chunk.
    #[test]
    fn words_set_the_members_a_bit_at_a_time_would() {
        let mut a = Bits::new(3 * BIT_CHUNK);
        let mut b = Bits::new(3 * BIT_CHUNK);
        let at = BIT_CHUNK - 2 * 64;
        let words = [1u64 << 63 | 5, 0, u64::MAX, 1 << 7];
        a.set(at + 2, true);
        b.set(at + 2, true);
        assert_eq!(a.or_words(at, &words), 1);
        for (k, w) in words.iter().enumerate() {
            (0..64)
                .filter(|i| w >> i & 1 == 1)
                .for_each(|i| b.set(at + k * 64 + i, true));
        }
        assert_eq!(a.ones().collect::<Vec<_>>(), b.ones().collect::<Vec<_>>());
        assert_eq!(a.or_words(2 * BIT_CHUNK, &[0; 8]), 0);
        assert_eq!(a.memory_bytes(), b.memory_bytes(), "no chunk for zeros");
    }
}
