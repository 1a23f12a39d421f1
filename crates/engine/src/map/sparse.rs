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

    /// Sets the members of `word` at 64-aligned index `at` (bit `i` of the
    /// word: index `at + i`); returns how many of them were set already.
    pub fn or_word(&mut self, at: usize, word: u64) -> u32 {
        if word == 0 {
            return 0;
        }
        assert!(
            at.is_multiple_of(64) && at < self.len,
            "word at {at} of {}",
            self.len
        );
        let (c, w) = (at / BIT_CHUNK, at % BIT_CHUNK / 64);
        let ch = self.chunks[c].get_or_insert_with(|| Box::new([0; BIT_CHUNK_WORDS]));
        let before = ch[w] & word;
        ch[w] |= word;
        before.count_ones()
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
