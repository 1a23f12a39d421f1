//! The background checkpointer (issue 16): a FLUSH that finds a checkpoint
//! due hands it to this thread and returns once its own sync is done, so
//! no client request waits for a checkpoint. Without it (the library's
//! default, the simulations) the flush writes the checkpoint itself.
use super::{Next, Worker};
use crate::volume::Volume;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// How often the checkpointer looks for a checkpoint asked for.
const POLL: Duration = Duration::from_millis(10);

/// Handle of the background checkpointer: while it lives, due checkpoints
/// are written by its thread; dropping it stops the thread and hands them
/// back to the flushes.
pub struct Checkpointer {
    worker: Option<Worker>,
    vol: Weak<Volume>,
}

impl Volume {
    /// Starts the background checkpointer (volumes open for writing; None
    /// otherwise).
    pub fn start_background_checkpointer(self: &Arc<Self>) -> Option<Checkpointer> {
        if self.read_only() {
            return None;
        }
        self.jobs.checkpointer.store(true, Ordering::SeqCst);
        let worker = Worker::spawn("cvol-checkpoint", self, POLL, |v| {
            v.background_checkpoint();
            Next::After(POLL)
        });
        Some(Checkpointer {
            worker: Some(worker),
            vol: Arc::downgrade(self),
        })
    }

    fn background_checkpoint(&self) {
        if !self.jobs.checkpoint_wanted.swap(false, Ordering::SeqCst) {
            return;
        }
        if let Err(e) = self.checkpoint_if_due() {
            tracing::warn!("background checkpoint: {e}");
        }
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        drop(self.worker.take());
        if let Some(v) = self.vol.upgrade() {
            v.jobs.checkpointer.store(false, Ordering::SeqCst);
            // One asked for and not written: the next flush writes it.
            v.jobs.checkpoint_wanted.store(false, Ordering::SeqCst);
        }
    }
}
