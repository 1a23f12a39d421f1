//! The single-writer lease: claiming the next epoch (after the current
//! one's lease was released or stopped changing for the lease time),
//! renewing it while serving, and releasing it.
//!
//! Depends on: `state`, `objects`, `error`.
use super::error::Error;
use super::objects::{get, list, numbers, put};
use super::state::{lock, Inner};
use crate::format::Names;
use bytes::Bytes;
use object_store::ObjectStore;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A lease released by a clean close (the next server starts at once).
pub(super) const RELEASED: &[u8] = b"released\n";

/// A lease object's body: who serves, and for how long a lease.
pub(super) fn lease_body(epoch: u64, n: u64, lease: Duration) -> Vec<u8> {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!(
        "serving epoch={epoch} host={} pid={} lease_ms={} renewal={n}\n",
        host.trim(),
        std::process::id(),
        lease.as_millis()
    )
    .into_bytes()
}

/// The lease time a lease body names (its server renews every quarter of it).
pub(super) fn lease_of(body: &[u8]) -> Option<Duration> {
    let text = std::str::from_utf8(body).ok()?;
    let ms = text
        .split_whitespace()
        .find_map(|w| w.strip_prefix("lease_ms="))?;
    Some(Duration::from_millis(ms.parse().ok()?))
}

/// Claims the next epoch: the current one's lease must be released or
/// unchanged for `lease` (its server is gone).
pub(super) async fn claim(
    store: &dyn ObjectStore,
    names: &Names,
    label: &str,
    lease: Duration,
    create_only: bool,
) -> Result<u64, Error> {
    let here = |source: object_store::Error| Error::Store {
        label: label.to_string(),
        source,
    };
    let epochs = numbers(&list(store, &names.dir("epoch")).await.map_err(here)?);
    let last = epochs.last().copied().unwrap_or(0);
    if last > 0 {
        await_lapse(store, names, label, lease, last).await?;
    }
    let epoch = last + 1;
    let body = lease_body(epoch, 0, lease);
    match put(store, &names.epoch(epoch), body.clone(), create_only).await {
        Ok(()) => {}
        Err(object_store::Error::AlreadyExists { .. }) => {
            return Err(Error::ClaimRace {
                label: label.to_string(),
                epoch,
            })
        }
        Err(e) => return Err(here(e)),
    }
    put(store, &names.lease(epoch), body, false)
        .await
        .map_err(here)?;
    Ok(epoch)
}

/// Returns once epoch `last`'s lease is released, or unchanged for the
/// longer of its lease time and ours (its server is gone); refuses when
/// it changed meanwhile.
async fn await_lapse(
    store: &dyn ObjectStore,
    names: &Names,
    label: &str,
    lease: Duration,
    last: u64,
) -> Result<(), Error> {
    let read = || async {
        match get(store, &names.lease(last)).await {
            Ok(b) => Ok(Some(b)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(source) => Err(Error::Store {
                label: label.to_string(),
                source,
            }),
        }
    };
    let first: Option<Bytes> = read().await?;
    if first.as_deref() == Some(RELEASED) {
        return Ok(());
    }
    // Its server renews every quarter of *its* lease time: wait the
    // longer of the two (capped at an hour).
    let wait = first
        .as_deref()
        .and_then(lease_of)
        .map_or(lease, |theirs| theirs.max(lease))
        .min(Duration::from_secs(3600));
    tracing::info!(
        "{label}: epoch {last} did not release its lease; waiting {} s to see \
         whether its server still renews it",
        wait.as_secs_f64()
    );
    tokio::time::sleep(wait).await;
    let second = read().await?;
    if second != first {
        let who = second
            .map(|b| String::from_utf8_lossy(&b).trim().to_string())
            .unwrap_or_default();
        return Err(Error::Served {
            label: label.to_string(),
            who,
            wait,
        });
    }
    tracing::info!("{label}: epoch {last}'s lease lapsed: taking the volume over");
    Ok(())
}

impl Inner {
    /// Marks the lease released (best effort: an open that failed).
    pub(super) fn release_lease(&self) {
        if let Err(e) = self.put_released() {
            tracing::warn!("{}: releasing the lease: {e}", self.label);
        }
    }

    /// PUTs the released lease.
    pub(super) fn put_released(&self) -> object_store::Result<()> {
        self.block(put(
            &*self.store,
            &self.names.lease(self.epoch),
            RELEASED.to_vec(),
            false,
        ))
    }

    /// Renews the lease every quarter of the lease time until stopped or
    /// failed (a fenced server stops renewing).
    pub(super) fn renew_lease(&self) {
        let mut renewal = 0u64;
        let mut last = Instant::now();
        while !self.stop_lease.load(Ordering::SeqCst) && lock(&self.failed).is_none() {
            std::thread::sleep(Duration::from_millis(20));
            if last.elapsed() < self.lease / 4 {
                continue;
            }
            renewal += 1;
            let r = self.block(put(
                &*self.store,
                &self.names.lease(self.epoch),
                lease_body(self.epoch, renewal, self.lease),
                false,
            ));
            if let Err(e) = r {
                tracing::warn!("{}: renewing the lease: {e}", self.label);
            }
            last = Instant::now();
        }
    }
}
