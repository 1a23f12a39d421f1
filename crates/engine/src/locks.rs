//! The volume's locks: their order, checked in debug builds, and what a
//! lock poisoned by a panic becomes (an error, never a second panic).
//!
//! Lock order, outermost first: a thread holding one of these may only take
//! locks further down the list, never one above it or the same one again.
//!
//! | level | lock (`Volume` field) | serialises |
//! |---|---|---|
//! | 1 `Rmw` | `rmw` (RwLock) | unaligned writes (read-modify-write, exclusive) against every other write (shared) |
//! | 2 `Cleaner` | `cleaner_lock` | cleaning passes (background and foreground) and recompression passes |
//! | 3 `Checkpoint` | `checkpoint_lock` | checkpoints, one at a time, for their whole length |
//! | 4 `Flush` | `flush_lock` | flushes, a checkpoint's commit (append, sync, publish), the EPOCH record at open |
//! | 5 `State` | `state` | the map and its books (`LiveMap`), the log head, sync and checkpoint bookkeeping |
//! | 6 `Index` | `Dedup::index` | the dedup fingerprint index (hints; never held across I/O) |
//!
//! Why this order: a write holds `rmw` while it may clean for space
//! (cleaner), a clean checkpoints and flushes, a checkpoint takes the
//! flush lock only for its commit (flushes go on while it encodes and
//! appends its map), a flush takes the state for its short steps, and
//! commits update the index under the state.
//! Nothing does I/O on the store under `index`.
//!
//! With `debug_assertions` (tests, the `checked` profile) every acquisition
//! asserts that the thread holds only outer locks: a wrong order is a test
//! failure at the first run that takes it, not a deadlock under load.
//!
//! Poisoning: a panic while one of these is held (an assertion, a bug)
//! poisons it. Every later `lock` returns `VolError::Poisoned` (reopen the
//! volume), so one panic does not turn into a panic on every later call.
//! `lock_for_report` reads through the poison for `stat`.
use crate::error::VolError;
use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// A lock's place in the order (outermost first).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    Rmw = 0,
    Cleaner = 1,
    Checkpoint = 2,
    Flush = 3,
    State = 4,
    Index = 5,
}

#[cfg(debug_assertions)]
mod order {
    use super::Level;
    use std::cell::Cell;

    thread_local! {
        /// Levels this thread holds, one bit each.
        static HELD: Cell<u8> = const { Cell::new(0) };
    }

    pub(super) fn acquire(level: Level) {
        let bit = 1u8 << level as u8;
        HELD.with(|held| {
            let h = held.get();
            // Every level held must be outer: its bit below this one's.
            assert!(
                h < bit,
                "lock order violated: taking {level:?} while holding {:?}",
                held_levels(h)
            );
            held.set(h | bit);
        });
    }

    pub(super) fn release(level: Level) {
        let bit = 1u8 << level as u8;
        HELD.with(|held| {
            assert!(held.get() & bit != 0, "releasing {level:?}, not held");
            held.set(held.get() & !bit);
        });
    }

    fn held_levels(h: u8) -> Vec<Level> {
        [
            Level::Rmw,
            Level::Cleaner,
            Level::Flush,
            Level::State,
            Level::Index,
        ]
        .into_iter()
        .filter(|&l| h & (1 << l as u8) != 0)
        .collect()
    }
}

#[cfg(not(debug_assertions))]
mod order {
    use super::Level;
    pub(super) fn acquire(_: Level) {}
    pub(super) fn release(_: Level) {}
}

/// A guard of an ordered lock: releases its level when dropped.
pub(crate) struct Held<G> {
    guard: G,
    level: Level,
}

impl<G> Held<G> {
    fn new(r: Result<G, ()>, level: Level) -> Result<Held<G>, VolError> {
        match r {
            Ok(guard) => Ok(Held { guard, level }),
            Err(()) => {
                order::release(level);
                Err(VolError::Poisoned)
            }
        }
    }
}

impl<G: Deref> Deref for Held<G> {
    type Target = G::Target;
    fn deref(&self) -> &G::Target {
        &self.guard
    }
}

impl<G: DerefMut> DerefMut for Held<G> {
    fn deref_mut(&mut self) -> &mut G::Target {
        &mut self.guard
    }
}

impl<G> Drop for Held<G> {
    fn drop(&mut self) {
        order::release(self.level);
    }
}

/// A mutex with a place in the lock order.
pub(crate) struct OrderedMutex<T> {
    level: Level,
    inner: Mutex<T>,
}

impl<T> OrderedMutex<T> {
    pub(crate) fn new(level: Level, value: T) -> OrderedMutex<T> {
        OrderedMutex {
            level,
            inner: Mutex::new(value),
        }
    }

    /// Locks, after checking the order (before blocking: a wrong order
    /// could otherwise deadlock instead of failing). `Poisoned` if a panic
    /// left the lock poisoned.
    pub(crate) fn lock(&self) -> Result<Held<MutexGuard<'_, T>>, VolError> {
        order::acquire(self.level);
        Held::new(self.inner.lock().map_err(|_| ()), self.level)
    }

    /// Locks for a read-only report (`stat`): a poisoned lock's data is
    /// returned as it is (possibly half-updated) rather than refused.
    pub(crate) fn lock_for_report(&self) -> Held<MutexGuard<'_, T>> {
        order::acquire(self.level);
        let guard = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        Held {
            guard,
            level: self.level,
        }
    }
}

/// A reader-writer lock with a place in the lock order.
pub(crate) struct OrderedRwLock<T> {
    level: Level,
    inner: RwLock<T>,
}

impl<T> OrderedRwLock<T> {
    pub(crate) fn new(level: Level, value: T) -> OrderedRwLock<T> {
        OrderedRwLock {
            level,
            inner: RwLock::new(value),
        }
    }

    pub(crate) fn read(&self) -> Result<Held<RwLockReadGuard<'_, T>>, VolError> {
        order::acquire(self.level);
        Held::new(self.inner.read().map_err(|_| ()), self.level)
    }

    pub(crate) fn write(&self) -> Result<Held<RwLockWriteGuard<'_, T>>, VolError> {
        order::acquire(self.level);
        Held::new(self.inner.write().map_err(|_| ()), self.level)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_an_error_for_every_later_caller() {
        let m = std::sync::Arc::new(OrderedMutex::new(Level::State, 0u32));
        let m2 = m.clone();
        let r = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("a bug while holding the lock");
        })
        .join();
        assert!(r.is_err());
        for _ in 0..3 {
            assert!(matches!(m.lock(), Err(VolError::Poisoned)));
        }
        assert_eq!(*m.lock_for_report(), 0);
        // The failed attempts released their level: the order still holds.
        let outer = OrderedMutex::new(Level::Flush, ());
        drop(outer.lock().unwrap());
    }

    #[test]
    fn locks_taken_in_order_pass() {
        let (rmw, flush, state) = (
            OrderedRwLock::new(Level::Rmw, ()),
            OrderedMutex::new(Level::Flush, ()),
            OrderedMutex::new(Level::State, ()),
        );
        let r = rmw.read().unwrap();
        let f = flush.lock().unwrap();
        drop(r); // released out of order: fine
        let s = state.lock().unwrap();
        drop((f, s));
        let _again = rmw.write().unwrap();
    }

    #[cfg(debug_assertions)]
    #[test]
    #[should_panic(expected = "lock order violated")]
    fn taking_an_outer_lock_inside_an_inner_one_fails() {
        let (flush, state) = (
            OrderedMutex::new(Level::Flush, ()),
            OrderedMutex::new(Level::State, ()),
        );
        let _s = state.lock().unwrap();
        let _f = flush.lock();
    }

    #[cfg(debug_assertions)]
    #[test]
    #[should_panic(expected = "lock order violated")]
    fn taking_the_same_level_twice_fails() {
        let (a, b) = (
            OrderedMutex::new(Level::State, ()),
            OrderedMutex::new(Level::State, ()),
        );
        let _a = a.lock().unwrap();
        let _b = b.lock();
    }
}
