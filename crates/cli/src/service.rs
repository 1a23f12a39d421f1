//! Running under systemd (`contrib/systemd/cvol@.service`, `Type=notify`):
//! `READY=1` once the volume is open and every listener serves (the URIs
//! in `STATUS=`), `WATCHDOG=1` at half of `WatchdogSec` while the volume
//! takes writes, `STOPPING=1` at a stop. Outside systemd (no
//! `NOTIFY_SOCKET`) nothing is sent.
//!
//! The watchdog pings stop once the volume refuses writes after an I/O
//! error (`poisoned` in `stat`): systemd then restarts the service
//! (`Restart=on-failure`), and the reopen is what brings it back, as it
//! would by hand.
use cvol_engine::Volume;
use sd_notify::NotifyState;
use std::time::{Duration, Instant};

pub struct Systemd {
    notify: bool,
    watchdog: Option<Duration>,
    last_ping: Instant,
    /// The poisoned state was reported (once).
    reported_poison: bool,
}

fn send(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(false, states) {
        tracing::warn!("systemd notify: {e}");
    }
}

impl Systemd {
    /// Tells systemd the service is ready (if it asked).
    pub fn ready(uris: &[String]) -> Systemd {
        let notify = std::env::var_os("NOTIFY_SOCKET").is_some();
        let mut usec = 0;
        let watchdog = sd_notify::watchdog_enabled(false, &mut usec)
            .then(|| Duration::from_micros(usec))
            .filter(|d| !d.is_zero());
        if notify {
            let status = format!("serving {}", uris.join(" "));
            send(&[NotifyState::Ready, NotifyState::Status(&status)]);
        }
        if let Some(w) = watchdog {
            tracing::info!("systemd watchdog every {:?}", w);
        }
        Systemd {
            notify,
            watchdog,
            last_ping: Instant::now(),
            reported_poison: false,
        }
    }

    /// Called from the serve loop: pings the watchdog when due.
    pub fn tick(&mut self, vol: &Volume) {
        let Some(every) = self.watchdog else {
            return;
        };
        if self.last_ping.elapsed() < every / 2 {
            return;
        }
        self.last_ping = Instant::now();
        if vol.stats().poisoned {
            if !self.reported_poison {
                self.reported_poison = true;
                tracing::error!(
                    "the volume refuses writes after an I/O error: watchdog pings stop, so systemd restarts (reopens) it"
                );
                send(&[NotifyState::Status(
                    "I/O error: writes refused; waiting for the watchdog restart",
                )]);
            }
            return;
        }
        send(&[NotifyState::Watchdog]);
    }

    /// Tells systemd the service is stopping.
    pub fn stopping(&self) {
        if self.notify {
            send(&[NotifyState::Stopping]);
        }
    }
}
