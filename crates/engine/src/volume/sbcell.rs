//! The volume's superblock, which a pool's physical resize replaces while
//! the volume is open (`Volume::resize_physical`): everything else in it
//! stays as it was made.
use cvol_format::Superblock;
use std::ops::Deref;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex};

/// The current superblock, read without a lock (`Deref`). Every
/// superblock the volume had is kept until the cell goes (a resize adds
/// one: a few hundred bytes), so a reference taken before a replacement
/// stays valid: a reader holding it sees the old size, which is still
/// consistent (a grow publishes its superblock before any record goes
/// beyond the old end; a shrink only drops segments nothing refers to).
pub(crate) struct SbCell {
    current: AtomicPtr<Superblock>,
    all: Mutex<Vec<Arc<Superblock>>>,
}

impl SbCell {
    pub(crate) fn new(sb: Superblock) -> SbCell {
        let a = Arc::new(sb);
        SbCell {
            current: AtomicPtr::new(Arc::as_ptr(&a).cast_mut()),
            all: Mutex::new(vec![a]),
        }
    }

    /// Makes `sb` the superblock later reads see.
    pub(crate) fn replace(&self, sb: Superblock) {
        let a = Arc::new(sb);
        let p = Arc::as_ptr(&a).cast_mut();
        self.all
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(a);
        self.current.store(p, Ordering::Release);
    }
}

impl Deref for SbCell {
    type Target = Superblock;

    fn deref(&self) -> &Superblock {
        // SAFETY: `current` always points into an `Arc` held by `all`,
        // which only grows and is dropped with the cell: the superblock
        // lives (and is never written: no `&mut` to it is ever made)
        // at least as long as `&self`.
        unsafe { &*self.current.load(Ordering::Acquire) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reference_taken_before_a_replacement_stays_valid() {
        let c = crate::CreateOptions::new(64 << 20, 64 << 20);
        let sb = super::super::lifecycle::new_superblock(&c).unwrap();
        let cell = SbCell::new(sb.clone());
        let old = &*cell;
        let size = old.physical_size_bytes;
        let mut next = sb;
        next.physical_size_bytes = size * 2;
        cell.replace(next);
        assert_eq!(old.physical_size_bytes, size);
        assert_eq!(cell.physical_size_bytes, size * 2);
    }
}
