//! The volume's threads: the background loop (queues uploads, commits
//! changes no FLUSH committed, writes manifests, lets their garbage go,
//! evicts) and the upload workers it feeds through the bounded queue.
//!
//! Depends on: `state`, `upload`, `sync`, `manifest`, `gc`, `cache`.
use super::state::{lock, Inner};
use crossbeam_channel::Sender;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Changes (uploads, discards, dirty bytes) no FLUSH committed for this
/// long are committed by the background.
const BACKGROUND_SYNC_AFTER: Duration = Duration::from_secs(3);

/// Starts the background loop (the upload queue's one sender, `tx`) and,
/// writable, the upload workers; their handles go to `threads` (those
/// started before one that fails too).
pub(super) fn spawn(
    inner: &Arc<Inner>,
    tx: Sender<u32>,
    threads: &mut Vec<JoinHandle<()>>,
) -> std::io::Result<()> {
    let bg = inner.clone();
    threads.push(
        std::thread::Builder::new()
            .name("cvol-s3".into())
            .spawn(move || bg.background(&tx))?,
    );
    if !inner.read_only {
        for i in 0..inner.parallel {
            let worker = inner.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("cvol-s3-up{i}"))
                    .spawn(move || worker.upload_worker())?,
            );
        }
    }
    Ok(())
}

impl Inner {
    fn background(&self, tx: &Sender<u32>) {
        let mut last_evict = Instant::now();
        while !self.stop.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(50));
            if self.read_only {
                self.evict_if_needed(&mut last_evict);
                continue;
            }
            if lock(&self.failed).is_some() {
                continue;
            }
            self.queue_uploads(tx);
            if self.sync_due() {
                // Clients idle without a FLUSH: commit what waits (uploads,
                // discarded segments, so the store can delete them; dirty
                // bytes). A sync clients did not ask for is always allowed.
                if let Err(e) = self.sync_inner(false) {
                    tracing::warn!("{}: background sync: {e}", self.label);
                }
            }
            if self.manifest_due() {
                if let Err(e) = self.sync_inner(true) {
                    tracing::warn!("{}: writing a manifest: {e}", self.label);
                }
            }
            if self.garbage_waits() {
                // Nothing else lands a delta while clients are idle: an
                // empty one lets what the manifest superseded go.
                match self.sync_marker() {
                    Ok(()) => self.delete_ready(),
                    Err(e) => tracing::warn!("{}: {e}", self.label),
                }
            }
            self.evict_if_needed(&mut last_evict);
        }
    }

    /// Changes wait for a delta and none landed for a while.
    fn sync_due(&self) -> bool {
        let idle = lock(&self.sync).last_delta.elapsed() >= BACKGROUND_SYNC_AFTER;
        idle && !lock(&self.changed).is_empty()
    }
}
