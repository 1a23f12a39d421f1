//! A connection's replies on their way to the socket.
//!
//! Exactly one thread sends on a connection at a time (`Outbox::busy`): a
//! worker with a reply, with non-blocking sends only, or the connection's
//! writer thread, which may block (up to the send timeout) for a client
//! that reads slowly. The outbox lock is never held across a send: a worker
//! that finds another one sending queues its reply and goes back to work,
//! and the sender takes what queued meanwhile in its next round, several
//! replies in one `send(2)`. Holding the lock across the send, as before,
//! made the workers of a connection wait for each other's system calls:
//! with one server serving four busy connections on two cores, that wait
//! was 17% of the workers' context switches and the cores went idle.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::Ordering;

use tracing::debug;

use super::{Conn, Release};
use crate::server::{deadline_after, lock};

/// Rounds a worker sends what other workers queued behind its own reply
/// before it leaves the rest to the writer thread and goes back to work.
const SENDER_ROUNDS_MAX: usize = 4;
/// Replies queued together are copied into one buffer for one `send(2)`
/// while they total at most this many bytes; larger ones go one by one.
const COALESCE_MAX_BYTES: usize = 256 * 1024;

/// A reply not yet (fully) sent. It holds the request's in-flight slot, so
/// the outbox never holds more replies than `max_inflight_per_conn` nor
/// more payload than the connection's budget.
pub(super) struct Pending {
    bytes: Vec<u8>,
    /// Bytes already written before the socket filled up.
    sent: usize,
    _release: Release,
}

impl Pending {
    fn unsent(&self) -> &[u8] {
        &self.bytes[self.sent..]
    }
}

/// Replies not yet written.
#[derive(Default)]
pub(super) struct Outbox {
    queue: VecDeque<Pending>,
    /// A thread (a worker or the writer thread) is sending: it takes the
    /// queue's replies in order, and nobody else may send.
    busy: bool,
    closed: bool,
}

impl Conn {
    /// Queues one complete reply; replies never interleave. A worker never
    /// blocks on the client here: whatever the socket does not take at once
    /// goes to the connection's writer thread, so a client that stops
    /// reading stalls only itself. After a send error the connection is
    /// dead: later replies are dropped (their slots released).
    pub(super) fn send(&self, bytes: Vec<u8>, release: Release) {
        let pending = Pending {
            bytes,
            sent: 0,
            _release: release,
        };
        let mut outbox = lock(&self.outbox);
        if self.broken.load(Ordering::Acquire) {
            return; // `pending` releases its slot
        }
        if outbox.busy || !outbox.queue.is_empty() {
            // The sender takes it after what is ahead of it; if nobody
            // sends, what is queued waits for the writer thread.
            let idle_writer = !outbox.busy;
            outbox.queue.push_back(pending);
            drop(outbox);
            if idle_writer {
                self.outbox_changed.notify_all();
            }
            return;
        }
        outbox.busy = true;
        drop(outbox);
        self.send_rounds(VecDeque::from([pending]));
    }

    /// The sending worker: sends `batch`, then what queued meanwhile, for at
    /// most `SENDER_ROUNDS_MAX` rounds; what the socket does not take, or
    /// what queues after the last round, goes to the writer thread.
    fn send_rounds(&self, mut batch: VecDeque<Pending>) {
        for round in 1..=SENDER_ROUNDS_MAX {
            let sent = self.send_batch(&mut batch);
            let mut outbox = lock(&self.outbox);
            if let Err(e) = sent {
                outbox.busy = false;
                drop(outbox);
                drop(batch);
                self.fail(&e);
                self.outbox_changed.notify_all();
                return;
            }
            if !batch.is_empty() || round == SENDER_ROUNDS_MAX || outbox.queue.is_empty() {
                // The socket is full, or we have sent enough for others:
                // what is left goes first, to the writer thread.
                while let Some(p) = batch.pop_back() {
                    outbox.queue.push_front(p);
                }
                outbox.busy = false;
                let wake = !outbox.queue.is_empty();
                drop(outbox);
                if wake {
                    self.outbox_changed.notify_all();
                }
                return;
            }
            batch = std::mem::take(&mut outbox.queue);
        }
    }

    /// Sends the replies of `batch` in order without blocking, and drops
    /// (releases) those the socket took whole. What stays in `batch` was
    /// not (fully) taken; under TLS, the last reply also stays while its
    /// ciphertext waits in the session (the writer's next send pushes it).
    fn send_batch(&self, batch: &mut VecDeque<Pending>) -> io::Result<()> {
        let total: usize = batch.iter().map(|p| p.unsent().len()).sum();
        if batch.len() > 1 && total <= COALESCE_MAX_BYTES {
            let mut joined = Vec::with_capacity(total);
            for p in batch.iter() {
                joined.extend_from_slice(p.unsent());
            }
            let mut taken = self.socket.send_nonblocking(&joined)?;
            for p in batch.iter_mut() {
                let n = taken.min(p.bytes.len() - p.sent);
                p.sent += n;
                taken -= n;
            }
        } else {
            for p in batch.iter_mut() {
                let n = self.socket.send_nonblocking(p.unsent())?;
                p.sent += n;
                if !p.unsent().is_empty() {
                    break;
                }
            }
        }
        let keep_last = self.socket.has_unsent();
        while batch
            .front()
            .is_some_and(|p| p.unsent().is_empty() && !(keep_last && batch.len() == 1))
        {
            batch.pop_front(); // releases its slot
        }
        Ok(())
    }

    /// Marks the connection dead after a send error.
    pub(super) fn fail(&self, e: &io::Error) {
        debug!(conn = self.id, error = %e, "reply not sent, dropping connection");
        self.broken.store(true, Ordering::Release);
        self.socket.shutdown(std::net::Shutdown::Both);
        let dropped: Vec<Pending> = lock(&self.outbox).queue.drain(..).collect();
        drop(dropped); // releases the slots outside the outbox lock
    }

    /// The writer thread: sends queued replies (blocking, up to the send
    /// timeout) whenever no worker is sending, until the connection is
    /// closed and the outbox is empty.
    pub(super) fn write_replies(&self) {
        let mut outbox = lock(&self.outbox);
        loop {
            if outbox.closed && outbox.queue.is_empty() {
                return;
            }
            let next = if outbox.busy {
                None
            } else {
                outbox.queue.pop_front()
            };
            let Some(pending) = next else {
                outbox = self
                    .outbox_changed
                    .wait(outbox)
                    .unwrap_or_else(|e| e.into_inner());
                continue;
            };
            outbox.busy = true;
            drop(outbox);
            if !self.broken.load(Ordering::Acquire) {
                let bytes = pending.unsent();
                let deadline = deadline_after(super::reply_time_allowed(
                    self.send_timeout,
                    self.min_reply_bytes_per_sec,
                    bytes.len(),
                ));
                if let Err(e) = self.socket.send_all_by(bytes, deadline, self.send_timeout) {
                    self.fail(&e);
                }
            }
            drop(pending); // the request stops counting as in flight
            outbox = lock(&self.outbox);
            outbox.busy = false;
        }
    }

    /// Lets the writer thread end once the outbox is empty.
    pub(super) fn close_outbox(&self) {
        lock(&self.outbox).closed = true;
        self.outbox_changed.notify_all();
    }
}
