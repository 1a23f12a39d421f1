//! Per-line state of a cache: atomic bitmaps, and the striped line locks
//! that order every change of a line's content in the cache.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// One bit per line, shared between threads.
pub(super) struct Bits {
    words: Vec<AtomicU64>,
    ones: AtomicU64,
}

impl Bits {
    pub(super) fn new(n: u64) -> Bits {
        Bits {
            words: (0..n.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            ones: AtomicU64::new(0),
        }
    }

    pub(super) fn get(&self, i: u64) -> bool {
        self.words[(i / 64) as usize].load(Ordering::SeqCst) & (1 << (i % 64)) != 0
    }

    /// Sets bit `i`; whether it was clear.
    pub(super) fn set(&self, i: u64) -> bool {
        let m = 1 << (i % 64);
        let was = self.words[(i / 64) as usize].fetch_or(m, Ordering::SeqCst) & m == 0;
        if was {
            self.ones.fetch_add(1, Ordering::SeqCst);
        }
        was
    }

    /// Clears bit `i`; whether it was set.
    pub(super) fn clear(&self, i: u64) -> bool {
        let m = 1 << (i % 64);
        let was = self.words[(i / 64) as usize].fetch_and(!m, Ordering::SeqCst) & m != 0;
        if was {
            self.ones.fetch_sub(1, Ordering::SeqCst);
        }
        was
    }

    /// Bits set.
    pub(super) fn count(&self) -> u64 {
        self.ones.load(Ordering::SeqCst)
    }

    /// Lines with the bit set, from `from` on (wrapping), at most `max`.
    pub(super) fn collect_from(&self, from: u64, n: u64, max: usize) -> Vec<u64> {
        let mut out = Vec::new();
        for k in 0..n {
            if out.len() >= max {
                break;
            }
            let i = (from + k) % n;
            if self.get(i) {
                out.push(i);
            }
        }
        out
    }
}

/// Line locks, striped: line l is guarded by slot `l % SLOTS`. The guarded
/// value is the slot's generation, raised whenever blocks of a line in it
/// are unmapped (eviction, TRIM, blocks the cache forgets) or written back
/// to the origin: a fill read from the origin before that must not land
/// on them (it would put an older copy in the cache). Client writes the
/// cache holds do not raise it: a fill skips mapped blocks.
///
/// Rules: reads take slots shared; client writes, fills and evictions
/// exclusive. A caller takes all the slots it needs at once, in ascending
/// order (`lock_*`), or only tries (`try_write`: eviction and
/// write-back never wait for a client). No slot is held while waiting
/// for another thread's progress (the background fill or eviction).
pub(super) struct Slots {
    slots: Vec<RwLock<u64>>,
}

pub(super) const SLOTS: u64 = 4096;

pub(super) struct ReadLocks<'a> {
    guards: Vec<(u64, RwLockReadGuard<'a, u64>)>,
}

pub(super) struct WriteLocks<'a> {
    guards: Vec<(u64, RwLockWriteGuard<'a, u64>)>,
}

/// The guard of line `line`'s slot among `guards` (ascending by slot).
fn held<G>(guards: &[(u64, G)], line: u64) -> &G {
    let s = line % SLOTS;
    let i = guards.binary_search_by_key(&s, |g| g.0).expect("slot held");
    &guards[i].1
}

impl ReadLocks<'_> {
    /// The generation of line `line`'s slot.
    pub(super) fn generation(&self, line: u64) -> u64 {
        **held(&self.guards, line)
    }
}

impl WriteLocks<'_> {
    /// Raises the generation of every slot held (a write changes content).
    pub(super) fn bump(&mut self) {
        for (_, g) in &mut self.guards {
            **g += 1;
        }
    }

    pub(super) fn generation(&self, line: u64) -> u64 {
        **held(&self.guards, line)
    }
}

impl Slots {
    pub(super) fn new() -> Slots {
        Slots {
            slots: (0..SLOTS).map(|_| RwLock::new(0)).collect(),
        }
    }

    /// The slots of lines [first, last], ascending.
    fn of(first: u64, last: u64) -> Vec<u64> {
        if last - first + 1 >= SLOTS {
            return (0..SLOTS).collect();
        }
        let mut v: Vec<u64> = (first..=last).map(|l| l % SLOTS).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    pub(super) fn lock_read(&self, first: u64, last: u64) -> ReadLocks<'_> {
        let guards = Slots::of(first, last)
            .into_iter()
            .map(|s| {
                (
                    s,
                    self.slots[s as usize]
                        .read()
                        .unwrap_or_else(|e| e.into_inner()),
                )
            })
            .collect();
        ReadLocks { guards }
    }

    pub(super) fn lock_write(&self, first: u64, last: u64) -> WriteLocks<'_> {
        let guards = Slots::of(first, last)
            .into_iter()
            .map(|s| {
                (
                    s,
                    self.slots[s as usize]
                        .write()
                        .unwrap_or_else(|e| e.into_inner()),
                )
            })
            .collect();
        WriteLocks { guards }
    }

    /// Line `line`'s slot, exclusive, if no one holds it.
    pub(super) fn try_write(&self, line: u64) -> Option<WriteLocks<'_>> {
        let s = line % SLOTS;
        let g = match self.slots[s as usize].try_write() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        Some(WriteLocks {
            guards: vec![(s, g)],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_count_what_they_hold() {
        let b = Bits::new(130);
        assert!(b.set(129) && !b.set(129) && b.set(3));
        assert_eq!(b.count(), 2);
        assert_eq!(b.collect_from(100, 130, 10), vec![129, 3]);
        assert!(b.clear(3) && !b.clear(3));
        assert_eq!(b.count(), 1);
    }

    #[test]
    fn a_write_raises_the_generation_a_reader_saw() {
        let s = Slots::new();
        let g0 = s.lock_read(5, 7).generation(6);
        s.lock_write(6, 6).bump();
        assert_eq!(s.lock_read(5, 7).generation(6), g0 + 1);
        // Lines one stripe apart share a slot.
        assert_eq!(
            s.lock_read(6 + SLOTS, 6 + SLOTS).generation(6 + SLOTS),
            g0 + 1
        );
        let held = s.lock_write(0, 2 * SLOTS);
        assert!(s.try_write(9).is_none());
        drop(held);
        assert!(s.try_write(9).is_some());
    }
}
