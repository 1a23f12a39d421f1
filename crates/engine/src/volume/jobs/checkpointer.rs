//! The background checkpointer: a FLUSH that finds a checkpoint
//! due hands it to this thread and returns once its own sync is done, so
//! no client request waits for a checkpoint. Without it (the library's
//! default, the simulations) the flush writes the checkpoint itself. The
//! thread sleeps on a channel: an idle volume costs it nothing.
use crate::volume::Volume;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::thread::JoinHandle;

/// Where flushes hand due checkpoints over, while a checkpointer runs. A
/// leaf lock: nothing is taken under it, and it is held only to send.
#[derive(Default)]
pub(in crate::volume) struct CheckpointerSlot(Mutex<Option<SyncSender<()>>>);

impl CheckpointerSlot {
    fn lock(&self) -> MutexGuard<'_, Option<SyncSender<()>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Asks the checkpointer for a checkpoint; false if none runs. A
    /// request already waiting covers this one.
    pub(in crate::volume) fn hand_over(&self) -> bool {
        match self.lock().as_ref().map(|tx| tx.try_send(())) {
            Some(Ok(()) | Err(TrySendError::Full(()))) => true,
            Some(Err(TrySendError::Disconnected(()))) | None => false,
        }
    }
}

/// Handle of the background checkpointer: while it lives, due checkpoints
/// are written by its thread; dropping it stops the thread (after the
/// checkpoint it may be writing) and hands them back to the flushes.
pub struct Checkpointer {
    vol: Weak<Volume>,
    handle: Option<JoinHandle<()>>,
}

impl Volume {
    /// Starts the background checkpointer (volumes open for writing; None
    /// otherwise).
    pub fn start_background_checkpointer(self: &Arc<Self>) -> Option<Checkpointer> {
        if self.read_only() {
            return None;
        }
        let (tx, rx) = sync_channel::<()>(1);
        *self.jobs.checkpointer.lock() = Some(tx);
        let vol = Arc::downgrade(self);
        let weak = vol.clone();
        let handle = std::thread::Builder::new()
            .name("cvol-checkpoint".into())
            .spawn(move || {
                super::background_priority();
                while rx.recv().is_ok() {
                    let Some(v) = weak.upgrade() else { return };
                    let before = v.counters.checkpoints.load(Ordering::Relaxed);
                    if let Err(e) = v.checkpoint_if_due() {
                        tracing::warn!("background checkpoint: {e}");
                    }
                    // A checkpoint frees what it encoded and the pages it
                    // wrote may leave: give the allocator's free pages back
                    // (crate::memory), here, off the request path.
                    if v.counters.checkpoints.load(Ordering::Relaxed) != before {
                        crate::memory::trim_allocator();
                    }
                }
            })
            .unwrap_or_else(|e| panic!("cannot spawn the cvol-checkpoint thread: {e}"));
        Some(Checkpointer {
            vol,
            handle: Some(handle),
        })
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        // Dropping the sender ends the thread's wait (a volume already gone
        // dropped it with itself).
        if let Some(v) = self.vol.upgrade() {
            v.jobs.checkpointer.lock().take();
        }
        if let Some(h) = self.handle.take() {
            // A thread that panicked has poisoned what it held; nothing to add.
            let _ = h.join();
        }
    }
}
