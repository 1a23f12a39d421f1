//! The pool of connections: a call leases an idle connection (or opens
//! one while below the limit, or waits); the lease returns it when the
//! call succeeded and closes it when the connection broke.

use std::io;
use std::sync::{MutexGuard, PoisonError};

use super::handshake::Conn;
use super::stream::invalid_data;
use super::{context, Client};

pub(super) struct Pool {
    pub(super) idle: Vec<Conn>,
    /// Connections open, idle or in use (or being opened).
    pub(super) open: usize,
}

/// A connection taken from the pool. Dropping it returns the connection
/// if `keep` was set, else closes it and frees its slot.
pub(super) struct Lease<'a> {
    pub(super) client: &'a Client,
    pub(super) conn: Option<Conn>,
    pub(super) keep: bool,
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        let conn = self.conn.take().filter(|_| self.keep);
        let mut pool = self.client.lock_pool();
        match conn {
            Some(conn) => pool.idle.push(conn),
            None => pool.open = pool.open.saturating_sub(1),
        }
        drop(pool);
        self.client.slot_freed.notify_one();
    }
}

impl Client {
    pub(super) fn lock_pool(&self) -> MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes an idle connection, or opens one while below the limit, or
    /// waits for one to be returned or closed.
    pub(super) fn lease(&self) -> io::Result<Lease<'_>> {
        let mut pool = self.lock_pool();
        loop {
            if let Some(conn) = pool.idle.pop() {
                return Ok(self.leased(conn));
            }
            if pool.open < self.max_connections {
                pool.open += 1;
                drop(pool);
                return match self.open_another() {
                    Ok(conn) => Ok(self.leased(conn)),
                    Err(e) => {
                        self.lock_pool().open -= 1;
                        self.slot_freed.notify_one();
                        Err(context(e, &self.uri))
                    }
                };
            }
            pool = self
                .slot_freed
                .wait(pool)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    pub(super) fn leased(&self, conn: Conn) -> Lease<'_> {
        Lease {
            client: self,
            conn: Some(conn),
            keep: false,
        }
    }

    /// A further connection; it must show the export as the first one did.
    pub(super) fn open_another(&self) -> io::Result<Conn> {
        let (conn, info) = Conn::open(&self.target)?;
        if info != self.info {
            return Err(invalid_data(format!(
                "export changed: now {} bytes, flags {:#x} (was {} bytes, flags {:#x})",
                info.size_bytes,
                info.transmission_flags,
                self.info.size_bytes,
                self.info.transmission_flags
            )));
        }
        Ok(conn)
    }
}

impl Drop for Client {
    /// Sends `NBD_CMD_DISC` on every idle connection (best effort).
    fn drop(&mut self) {
        let idle = std::mem::take(&mut self.lock_pool().idle);
        for conn in idle {
            conn.disconnect();
        }
    }
}
