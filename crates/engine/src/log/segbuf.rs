//! The open segment's buffer, shared between the log (under the state lock)
//! and write-behinds that copy its filled part to storage outside the lock.
//!
//! The rule that makes the sharing sound: bytes below the head's `written`
//! mark are never changed while the segment is open (appends and padding
//! only touch bytes at or beyond `fill`, and `written <= fill`), so a
//! write-behind may read `[a, b)` with `b <= written` while the lock holder
//! appends beyond `fill`. The buffer is reused for the next segment only
//! after every write-behind of the old one finished (`wait_idle`, called by
//! the log before it seals a segment or pads it for a flush).
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};

pub struct SegBuf {
    cells: Box<[UnsafeCell<u8>]>,
    /// Write-behinds running outside the state lock.
    inflight: Mutex<usize>,
    idle: Condvar,
    /// A write-behind failed: the segment's bytes on storage are unknown.
    failed: AtomicBool,
}

// SAFETY: shared access follows the rule in the module comment: the bytes a
// write-behind reads (below `written`) are never written while it runs, and
// the bytes the lock holder writes (at or beyond `fill`) are read by no one
// else; `inflight` and `failed` are synchronised.
unsafe impl Sync for SegBuf {}

impl SegBuf {
    /// A zeroed buffer of `len` bytes, allocated zeroed: its pages are
    /// touched only as they are used.
    pub fn new(len: usize) -> SegBuf {
        SegBuf::from_boxed(vec![0u8; len].into_boxed_slice())
    }

    /// A buffer holding `bytes[..keep]`, zero after: the bytes of a
    /// segment read whole (at open, by roll-forward), taken as they are
    /// rather than read again.
    pub fn from_bytes(mut bytes: Vec<u8>, keep: usize) -> SegBuf {
        bytes[keep..].fill(0);
        SegBuf::from_boxed(bytes.into_boxed_slice())
    }

    fn from_boxed(bytes: Box<[u8]>) -> SegBuf {
        // SAFETY: UnsafeCell<u8> is repr(transparent) over u8, so a boxed
        // slice of one is a boxed slice of the other: same length, same
        // allocation and layout.
        let cells = unsafe { Box::from_raw(Box::into_raw(bytes) as *mut [UnsafeCell<u8>]) };
        SegBuf {
            cells,
            inflight: Mutex::new(0),
            idle: Condvar::new(),
            failed: AtomicBool::new(false),
        }
    }

    pub fn len(&self) -> usize {
        self.cells.len()
    }

    /// The bytes `[at, at + len)`, which nobody may change while the slice
    /// lives: a range below the head's `fill` (appended records, padding).
    pub fn bytes(&self, at: usize, len: usize) -> &[u8] {
        let cells = &self.cells[at..at + len];
        // SAFETY: UnsafeCell<u8> has u8's layout; the range is immutable
        // while the segment is open (module comment), and the caller holds
        // the state lock or a claimed write-behind range of it.
        unsafe { std::slice::from_raw_parts(cells.as_ptr().cast::<u8>(), len) }
    }

    /// Copies `src` to `[at, at + src.len())`: a range at or beyond `fill`,
    /// under the state lock.
    pub fn put(&self, at: usize, src: &[u8]) {
        let cells = &self.cells[at..at + src.len()];
        // SAFETY: the caller holds the state lock and writes at or beyond
        // the head's `fill`, which no write-behind reads and no other
        // slice of this buffer covers.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                UnsafeCell::raw_get(cells.as_ptr()),
                src.len(),
            )
        }
    }

    /// Lets `write` fill `[at, at + len)` in place (a sealed payload): the
    /// same range rule as `put`. Returns what `write` returns.
    pub fn fill_with<R>(&self, at: usize, len: usize, write: impl FnOnce(&mut [u8]) -> R) -> R {
        let cells = &self.cells[at..at + len];
        // SAFETY: as for `put`: the caller holds the state lock and writes
        // at or beyond the head's `fill`, which no write-behind reads and no
        // other slice of this buffer covers; the slice lives only while
        // `write` runs.
        let out =
            unsafe { std::slice::from_raw_parts_mut(UnsafeCell::raw_get(cells.as_ptr()), len) };
        write(out)
    }

    /// Zeroes `[a, b)` (padding beyond `fill`, under the state lock).
    pub fn zero(&self, a: usize, b: usize) {
        let cells = &self.cells[a..b];
        // SAFETY: as for `put`.
        unsafe { std::ptr::write_bytes(UnsafeCell::raw_get(cells.as_ptr()), 0, b - a) }
    }

    /// The whole buffer, when nothing else shares it (a head being loaded).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.cells.len();
        // SAFETY: `&mut self`: no other reference to the cells exists.
        unsafe { std::slice::from_raw_parts_mut(UnsafeCell::raw_get(self.cells.as_ptr()), len) }
    }

    /// A write-behind starts (under the state lock).
    pub fn begin(&self) {
        *self.inflight.lock().unwrap_or_else(|e| e.into_inner()) += 1;
    }

    /// A write-behind ended, `ok` or not.
    pub fn end(&self, ok: bool) {
        if !ok {
            self.failed.store(true, Ordering::SeqCst);
        }
        let mut n = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        *n -= 1;
        if *n == 0 {
            self.idle.notify_all();
        }
    }

    /// Waits until no write-behind runs; false if one failed.
    pub fn wait_idle(&self) -> bool {
        let mut n = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        while *n > 0 {
            n = self.idle.wait(n).unwrap_or_else(|e| e.into_inner());
        }
        !self.failed.load(Ordering::SeqCst)
    }
}
