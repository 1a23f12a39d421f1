//! What the NBD server reports to the metrics (`ServerConfig::observer`):
//! its own share of each request's latency, its connections, and what busy
//! polling (`--busy-poll`) costs.

use super::CommandLabel;
use cvol_nbd::{CommandKind, RequestObserver};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::time::Duration;

/// What the NBD server itself sees: each request from being read to its
/// reply written (queues included), and the open connections.
pub struct ServerMetrics {
    seconds: Vec<Histogram>,
    connections: Gauge,
    /// `--busy-poll`: polls that found the next request, and that did not.
    polls_found: Counter,
    polls_missed: Counter,
    poll_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
}

impl ServerMetrics {
    pub(super) fn register(registry: &mut Registry) -> ServerMetrics {
        let seconds = Family::<CommandLabel, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(2e-6, 2.0, 23))
        });
        let connections = Gauge::default();
        registry.register(
            "nbd_request_duration_seconds",
            "Time from reading a request to writing its reply, by command: the server's \
             whole share of the client's latency (its queues, the volume, the reply)",
            seconds.clone(),
        );
        registry.register(
            "nbd_connections",
            "NBD client connections open",
            connections.clone(),
        );
        let polls = Family::<PollLabel, Counter>::default();
        registry.register(
            "nbd_busy_polls",
            "Waits for a client's next request that began by watching the socket without \
             sleeping (--busy-poll), by whether the request came within the window",
            polls.clone(),
        );
        let poll_seconds = Counter::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "nbd_busy_poll_seconds",
            "Time connections spent watching their sockets for the next request (--busy-poll): \
             CPU time given to queue-depth-1 latency, yielded to any thread that wanted it",
            poll_seconds.clone(),
        );
        let polls_found = polls.get_or_create(&PollLabel { found: "request" }).clone();
        let polls_missed = polls.get_or_create(&PollLabel { found: "none" }).clone();
        let seconds = CommandKind::ALL
            .iter()
            .map(|kind| {
                let label = CommandLabel {
                    command: kind.name(),
                };
                seconds.get_or_create(&label).clone()
            })
            .collect();
        ServerMetrics {
            seconds,
            connections,
            polls_found,
            polls_missed,
            poll_seconds,
        }
    }
}

impl RequestObserver for ServerMetrics {
    fn request_done(&self, command: CommandKind, elapsed: Duration) {
        self.seconds[command as usize].observe(elapsed.as_secs_f64());
    }

    fn connections(&self, open: usize) {
        self.connections
            .set(i64::try_from(open).unwrap_or(i64::MAX));
    }

    fn busy_poll(&self, found: bool, polled: Duration) {
        match found {
            true => self.polls_found.inc(),
            false => self.polls_missed.inc(),
        };
        self.poll_seconds.inc_by(polled.as_secs_f64());
    }
}

/// `found` of `nbd_busy_polls`: `request` or `none`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PollLabel {
    found: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_side_latency_and_connections_are_exported() {
        let mut registry = Registry::with_prefix("cvol");
        let m = ServerMetrics::register(&mut registry);
        m.request_done(CommandKind::Flush, Duration::from_micros(300));
        m.request_done(CommandKind::Read, Duration::from_micros(3));
        m.connections(3);
        m.busy_poll(true, Duration::from_micros(30));
        m.busy_poll(true, Duration::from_micros(40));
        m.busy_poll(false, Duration::from_micros(100));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("cvol_nbd_request_duration_seconds_count{command=\"flush\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "cvol_nbd_request_duration_seconds_bucket{le=\"0.000512\",command=\"flush\"} 1"
            ) || text.contains(
                "cvol_nbd_request_duration_seconds_bucket{command=\"flush\",le=\"0.000512\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains("cvol_nbd_request_duration_seconds_count{command=\"read\"} 1"));
        assert!(text.contains("cvol_nbd_connections 3"));
        assert!(
            text.contains("cvol_nbd_busy_polls_total{found=\"request\"} 2"),
            "{text}"
        );
        assert!(text.contains("cvol_nbd_busy_polls_total{found=\"none\"} 1"));
        let seconds = text
            .lines()
            .find_map(|l| l.strip_prefix("cvol_nbd_busy_poll_seconds_total "))
            .and_then(|v| v.parse::<f64>().ok())
            .expect("the time polled is exported");
        assert!((seconds - 170e-6).abs() < 1e-9, "{seconds}");
    }
}
