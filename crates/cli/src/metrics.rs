//! `cvol serve --metrics [ADDR:]PORT`: Prometheus metrics at `/metrics`
//! (text format 0.0.4, through `prometheus-client`).
//!
//! Two sources, every series labelled `volume`:
//! * **Requests**, measured around each call of the volume by the NBD
//!   server (a [`Hook`] around its calls): `cvol_requests_total{command}`,
//!   `cvol_request_bytes_total{command}`, `cvol_request_errors_total{command,error}`,
//!   `cvol_request_duration_seconds{command}` (a histogram) and
//!   `cvol_requests_in_flight` (the queue depth at the volume).
//! * **Every `stat` figure**, read at each scrape ([`StatCollector`]):
//!   `cvol_<key>` for gauges, `cvol_<key>_total` for counters (what counts
//!   up from the server's start: [`COUNTERS`]), `cvol_blocks_by_codec{codec}`,
//!   `cvol_memory_bytes{use}`,
//!   and `cvol_volume_info{...} 1` carrying the text figures as labels.
//!   Booleans are 0 or 1; figures a volume does not have (null) are left out.
use crate::backend::{Call, Hook, Hooked};
use crate::error::Error;
use cvol_engine::Volume;
use cvol_nbd::{Backend, BackendError, CommandKind, ObserverHandle};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod server;
pub use server::ServerMetrics;

/// `stat` keys that count up from the server's start (exported as
/// counters, `_total`); every other number is a gauge. A test checks that
/// each names a numeric `stat` key.
pub const COUNTERS: &[&str] = &[
    "client_bytes_written",
    "media_bytes_written",
    "padding_bytes",
    "zero_ahead_bytes",
    "corrupt_reads",
    "map_cache_hits",
    "map_cache_misses",
    "map_cache_evictions",
    "map_records_moved",
    "checkpoints_written",
    "fingerprint_spills",
    "fingerprint_spill_bytes",
    "cleaner_segments_cleaned",
    "cleaner_records_relocated",
    "cleaner_bytes_relocated",
    "segments_reclaimed",
    "idle_clean_passes",
    "idle_clean_bytes_relocated",
    "cleaner_holder_scans",
    "cleaner_holder_pages_scanned",
    "cleaner_units_compacted",
    "cleaner_compaction_saved_bytes",
    "space_waits",
    "space_refusals",
    "dedup_lookups",
    "dedup_hits",
    "dedup_warm_table_fingerprints",
    "dedup_warm_data_blocks",
    "dedup_hook_lookups",
    "dedup_hook_hits",
    "dedup_hook_misses",
    "dedup_hook_stale",
    "dedup_hook_evictions",
    "dedup_hook_sweeps",
    "dedup_hook_replayed_tables",
    "dedup_hook_snapshot_entries",
    "dedup_hook_snapshots",
    "dedup_hook_snapshot_bytes",
    "dedup_hook_snapshot_skipped",
    "dedup_table_cache_hits",
    "dedup_table_cache_misses",
    "dedup_table_reads",
    "dedup_table_prefetches",
    "dedup_table_read_errors",
    "dedup_hits_hot",
    "dedup_hits_table",
    "dedup_verify_rejects",
    "read_cache_hits",
    "read_cache_misses",
    "units_written",
    "unit_blocks_written",
    "probe_raw_blocks",
    "deferred_units",
    "deferred_blocks",
    "auto_lz4_units",
    "auto_zstd_fast_units",
    "auto_zstd_strong_units",
    "auto_cpu_busy_units",
    "client_reads",
    "store_pages_read",
    "bytes_read",
    "bytes_decoded",
    "unit_cache_hits",
    "unit_cache_misses",
    "recompress_passes",
    "recompressed_blocks",
    "recompressed_bytes_before",
    "recompressed_bytes_after",
    "recompress_skipped_units",
    "recompress_uncollectable_windows",
    "scrub_runs",
    "scrub_blocks_checked",
    "scrub_corrupt_blocks",
    "cache_hits",
    "cache_misses",
    "cache_fill_bytes",
    "cache_evictions",
    "origin_bytes_read",
    "origin_bytes_written",
    "object_gets",
    "object_get_bytes",
    "object_puts",
    "object_put_bytes",
    "object_deletes",
    "object_cache_hits",
    "object_cache_misses",
    "object_cache_evictions",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CommandLabel {
    command: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    command: &'static str,
    error: &'static str,
}

/// One command's series, resolved once (no family lookup per request).
struct PerCommand {
    requests: Counter,
    bytes: Counter,
    seconds: Histogram,
}

/// The request series of one volume.
pub struct RequestMetrics {
    per: Vec<PerCommand>,
    errors: Family<ErrorLabels, Counter>,
    in_flight: Gauge,
}

impl RequestMetrics {
    fn register(registry: &mut Registry) -> RequestMetrics {
        let requests = Family::<CommandLabel, Counter>::default();
        let bytes = Family::<CommandLabel, Counter>::default();
        let seconds = Family::<CommandLabel, Histogram>::new_with_constructor(|| {
            // 2 us to 8.4 s: most requests the volume serves from memory
            // take a few microseconds.
            Histogram::new(exponential_buckets(2e-6, 2.0, 23))
        });
        let errors = Family::<ErrorLabels, Counter>::default();
        let in_flight = Gauge::default();
        registry.register(
            "requests",
            "NBD requests the volume completed, by command",
            requests.clone(),
        );
        registry.register(
            "request_bytes",
            "Bytes of READ and WRITE requests completed (other commands: 0)",
            bytes.clone(),
        );
        registry.register(
            "request_errors",
            "Requests that failed, by command and error",
            errors.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Time the volume took per request, by command (after the NBD server's queues)",
            seconds.clone(),
        );
        registry.register(
            "requests_in_flight",
            "Requests the volume is working on now",
            in_flight.clone(),
        );
        // Every error series exists from the start (at 0), so that rate()
        // and increase() see the first error.
        for command in CommandKind::ALL.map(CommandKind::name) {
            for error in ERRORS {
                let _ = errors.get_or_create(&ErrorLabels { command, error });
            }
        }
        let per = CommandKind::ALL
            .iter()
            .map(|kind| {
                let label = CommandLabel {
                    command: kind.name(),
                };
                PerCommand {
                    requests: requests.get_or_create(&label).clone(),
                    bytes: bytes.get_or_create(&label).clone(),
                    seconds: seconds.get_or_create(&label).clone(),
                }
            })
            .collect();
        RequestMetrics {
            per,
            errors,
            in_flight,
        }
    }
}

impl Hook for RequestMetrics {
    fn around<T>(
        &self,
        call: Call,
        f: impl FnOnce() -> Result<T, BackendError>,
    ) -> Result<T, BackendError> {
        self.in_flight.inc();
        let started = Instant::now();
        let result = f();
        let seconds = started.elapsed().as_secs_f64();
        self.in_flight.dec();
        let m = &self.per[call.kind as usize];
        m.requests.inc();
        m.seconds.observe(seconds);
        match &result {
            Ok(_) if matches!(call.kind, CommandKind::Read | CommandKind::Write) => {
                m.bytes.inc_by(call.length);
            }
            Ok(_) => {}
            Err(e) => {
                let labels = ErrorLabels {
                    command: call.kind.name(),
                    error: error_name(*e),
                };
                self.errors.get_or_create(&labels).inc();
            }
        }
        result
    }
}

/// The `error` label values.
const ERRORS: [&str; 6] = [
    "io",
    "no_space",
    "invalid",
    "read_only",
    "not_supported",
    "overflow",
];

fn error_name(e: BackendError) -> &'static str {
    match e {
        BackendError::Io => "io",
        BackendError::NoSpace => "no_space",
        BackendError::Invalid => "invalid",
        BackendError::ReadOnly => "read_only",
        BackendError::NotSupported => "not_supported",
        BackendError::Overflow => "overflow",
    }
}

/// Every `stat` figure, read from the volume at each scrape.
pub struct StatCollector {
    vol: Arc<Volume>,
}

impl std::fmt::Debug for StatCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StatCollector")
    }
}

impl Collector for StatCollector {
    fn encode(&self, encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let stats = serde_json::to_value(crate::stat::shown(&self.vol)).unwrap_or_default();
        encode_stats(&stats, encoder)
    }
}

/// `stat` objects of numbers exported as one gauge family: the key, the
/// label naming each part, the help text.
const LABELLED: [(&str, &str, &str); 2] = [
    (
        "blocks_by_codec",
        "codec",
        "cvol stat: mapped blocks by the codec that stored them",
    ),
    (
        "memory_bytes",
        "use",
        "cvol stat: heap memory by use (the parts and their total)",
    ),
];

/// Encodes a `stat --json` object (see the module's naming rules).
fn encode_stats(stats: &serde_json::Value, mut encoder: DescriptorEncoder) -> std::fmt::Result {
    use serde_json::Value;
    let Some(map) = stats.as_object() else {
        return Ok(());
    };
    let mut info: Vec<(String, String)> = Vec::new();
    for (key, value) in map {
        let help = format!("cvol stat: {key}");
        let name = metric_name(key);
        match value {
            Value::Number(n) if COUNTERS.contains(&key.as_str()) => {
                let c = ConstCounter::new(n.as_u64().unwrap_or(0));
                c.encode(encoder.encode_descriptor(name, &help, None, c.metric_type())?)?;
            }
            Value::Number(n) => {
                let g = ConstGauge::new(n.as_f64().unwrap_or(0.0));
                g.encode(encoder.encode_descriptor(name, &help, None, g.metric_type())?)?;
            }
            Value::Bool(b) => {
                let g = ConstGauge::new(i64::from(*b));
                g.encode(encoder.encode_descriptor(name, &help, None, g.metric_type())?)?;
            }
            // A level that changes would churn the info series: a gauge.
            Value::String(s) if key == "load_level" => {
                let level = match s.as_str() {
                    "busy" => 2,
                    "medium" => 1,
                    _ => 0,
                };
                let g = ConstGauge::new(level);
                g.encode(encoder.encode_descriptor(
                    key,
                    "cvol stat: load_level as the auto codec policy sees it: 0 idle, 1 medium, 2 busy",
                    None,
                    g.metric_type(),
                )?)?;
            }
            Value::String(s) => info.push((key.clone(), s.clone())),
            Value::Object(parts) if LABELLED.iter().any(|l| l.0 == key) => {
                let (_, label, help) = LABELLED.iter().find(|l| l.0 == key).expect("matched");
                let g = ConstGauge::new(0i64);
                let mut family = encoder.encode_descriptor(key, help, None, g.metric_type())?;
                for (part, n) in parts {
                    let labels = vec![(label.to_string(), part.clone())];
                    ConstGauge::new(n.as_i64().unwrap_or(0))
                        .encode(family.encode_family(&labels)?)?;
                }
            }
            Value::Object(parts) => {
                for (part, v) in parts {
                    if let Some(s) = v.as_str() {
                        info.push((format!("{key}_{part}"), s.to_string()));
                    } else if let Some(n) = v.as_u64() {
                        info.push((format!("{key}_{part}"), n.to_string()));
                    }
                }
            }
            Value::Null | Value::Array(_) => {}
        }
    }
    let g = ConstGauge::new(1i64);
    let mut family = encoder.encode_descriptor(
        "volume_info",
        "cvol stat: the volume's text figures (codec policy, cleaner, load level...) as labels",
        None,
        g.metric_type(),
    )?;
    g.encode(family.encode_family(&info)?)
}

/// The registry of one served volume.
pub struct Metrics {
    registry: Registry,
    requests: Arc<RequestMetrics>,
    server: Arc<ServerMetrics>,
}

impl Metrics {
    pub fn new(volume_label: &str, vol: Arc<Volume>) -> Metrics {
        let mut root = Registry::with_prefix("cvol");
        let registry = root.sub_registry_with_label((
            std::borrow::Cow::Borrowed("volume"),
            std::borrow::Cow::Owned(volume_label.to_string()),
        ));
        let requests = Arc::new(RequestMetrics::register(registry));
        let server = Arc::new(ServerMetrics::register(registry));
        registry.register_collector(Box::new(StatCollector { vol }));
        Metrics {
            registry: root,
            requests,
            server,
        }
    }

    /// What the NBD server reports to (`ServerConfig::observer`).
    pub fn observer(&self) -> ObserverHandle {
        ObserverHandle(self.server.clone())
    }

    /// `backend`, its calls measured.
    pub fn wrap(&self, backend: Arc<dyn Backend>) -> Arc<dyn Backend> {
        Arc::new(Hooked {
            inner: backend,
            hook: self.requests.clone(),
        })
    }

    /// The exposition: OpenMetrics text, as `prometheus-client` encodes
    /// it, or (`openmetrics` false) the Prometheus text format 0.0.4 that
    /// older scrapers and `promtool check metrics` read.
    pub fn render(&self, openmetrics: bool) -> String {
        let mut text = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            tracing::warn!("metrics: cannot encode: {e}");
        }
        if openmetrics {
            text
        } else {
            to_text_format(&text)
        }
    }
}

/// OpenMetrics text to Prometheus text 0.0.4: a counter's HELP and TYPE
/// name its samples (`x_total`, not the family `x`); no `# UNIT`, no
/// `# EOF`. Samples are the same lines.
fn to_text_format(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len() + 64 * counters.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|tag| {
            let rest = line.strip_prefix(tag)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{tag}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// Stat keys whose names read as another metric type's suffix: exported
/// under these names instead (`_count` is a histogram's, `_total` a
/// counter's).
const RENAMED: &[(&str, &str)] = &[("object_count", "objects"), ("segments_total", "segments")];

fn metric_name(key: &str) -> &str {
    RENAMED
        .iter()
        .find(|(k, _)| *k == key)
        .map_or(key, |(_, name)| name)
}

/// `--metrics`: `PORT` (on 127.0.0.1) or `ADDR:PORT`.
pub fn parse_addr(v: &str) -> Result<Vec<SocketAddr>, Error> {
    let with_host = if v.parse::<u16>().is_ok() {
        format!("127.0.0.1:{v}")
    } else {
        v.to_string()
    };
    let addrs: Vec<_> = with_host
        .to_socket_addrs()
        .map_err(|e| {
            Error::Usage({
                format!("--metrics {v}: {e} (expected PORT or ADDR:PORT, e.g. 127.0.0.1:9810)")
            })
        })?
        .collect();
    if addrs.is_empty() {
        return Err(Error::Usage(format!("--metrics {v}: no address")));
    }
    Ok(addrs)
}

/// Binds `--metrics` (before the volume is opened, as every listener).
pub fn bind(v: &str) -> Result<TcpListener, Error> {
    let addrs = parse_addr(v)?;
    let l = TcpListener::bind(&addrs[..]).map_err(|e| {
        Error::Usage(match e.kind() {
            std::io::ErrorKind::AddrInUse => {
                format!("--metrics {v}: {e} (another exporter? choose another port)")
            }
            _ => format!("--metrics {v}: {e}"),
        })
    })?;
    let local = l
        .local_addr()
        .map_err(|e| Error::io(format!("--metrics {v}"), e))?;
    if !local.ip().to_canonical().is_loopback() {
        tracing::warn!(
            "metrics on {local} are readable from the network (volume names, sizes, load)"
        );
    }
    Ok(l)
}

/// Most bytes of a request's head; more ends the connection.
const MAX_HEAD_BYTES: u64 = 8192;

/// Scrapes answered at once; connections beyond are closed at once.
const MAX_CONCURRENT_SCRAPES: usize = 16;
/// A whole exchange (request read, answer sent) must end within this.
const SCRAPE_DEADLINE: Duration = Duration::from_secs(5);

/// Serves `/metrics` on `listener` until the process ends: each
/// connection on a thread of its own, at most [`MAX_CONCURRENT_SCRAPES`]
/// at once, each ended after [`SCRAPE_DEADLINE`], so a slow or stuck
/// client delays no other scrape.
pub fn serve(listener: TcpListener, metrics: Arc<Metrics>) -> Result<(), Error> {
    std::thread::Builder::new()
        .name("cvol-metrics".into())
        .spawn(move || accept_scrapes(&listener, &metrics))
        .map(|_| ())
        .map_err(|e| Error::Refused(e.to_string()))
}

fn accept_scrapes(listener: &TcpListener, metrics: &Arc<Metrics>) {
    let active = Arc::new(AtomicUsize::new(0));
    let mut refused: u64 = 0;
    for conn in listener.incoming() {
        let conn = match conn {
            Ok(conn) => conn,
            Err(e) => {
                // E.g. EMFILE: back off instead of spinning.
                tracing::debug!("metrics: accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if active.fetch_add(1, Ordering::AcqRel) >= MAX_CONCURRENT_SCRAPES {
            active.fetch_sub(1, Ordering::AcqRel);
            refused += 1;
            if refused.is_power_of_two() {
                tracing::warn!(
                    refused_total = refused,
                    "metrics: {MAX_CONCURRENT_SCRAPES} scrapes already in progress, closing new connections"
                );
            }
            continue;
        }
        let (metrics, done) = (Arc::clone(metrics), Arc::clone(&active));
        let spawned = std::thread::Builder::new()
            .name("cvol-scrape".into())
            .spawn(move || {
                let deadline = Instant::now() + SCRAPE_DEADLINE;
                if let Err(e) = answer(&conn, &metrics, deadline) {
                    tracing::debug!("metrics: {e}");
                }
                done.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            active.fetch_sub(1, Ordering::AcqRel);
            tracing::debug!("metrics: cannot start a thread: {e}");
        }
    }
}

/// Time left until `deadline`, as an I/O error once it has passed.
fn time_left(deadline: Instant) -> std::io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "the scrape took too long",
        ));
    }
    Ok(left)
}

/// Reads from a scrape's connection, each read waiting at most until the
/// deadline.
struct ByDeadline<'a> {
    conn: &'a TcpStream,
    deadline: Instant,
}

impl Read for ByDeadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.conn
            .set_read_timeout(Some(time_left(self.deadline)?))?;
        (&mut &*self.conn).read(buf)
    }
}

/// Writes all of `bytes`, each write waiting at most until the deadline.
fn write_by(conn: &TcpStream, deadline: Instant, bytes: &[u8]) -> std::io::Result<()> {
    for chunk in bytes.chunks(64 * 1024) {
        let mut chunk = chunk;
        while !chunk.is_empty() {
            conn.set_write_timeout(Some(time_left(deadline)?))?;
            match (&mut &*conn).write(chunk) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => chunk = &chunk[n..],
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// Whether the scraper asks for OpenMetrics (Prometheus does, in `Accept`).
fn accepts_openmetrics(headers: &[String]) -> bool {
    headers.iter().any(|h| {
        h.split_once(':').is_some_and(|(name, value)| {
            name.trim().eq_ignore_ascii_case("accept")
                && value.contains("application/openmetrics-text")
        })
    })
}

/// One HTTP/1.x exchange: `GET /metrics` gets the text, `/` a pointer to
/// it, anything else 404 (405 for other methods). The connection closes;
/// the whole exchange ends by `deadline`.
fn answer(conn: &TcpStream, metrics: &Metrics, deadline: Instant) -> std::io::Result<()> {
    let mut head = BufReader::new(ByDeadline { conn, deadline }.take(MAX_HEAD_BYTES));
    let mut request_line = String::new();
    head.read_line(&mut request_line)?;
    // The rest of the head (headers) up to the blank line.
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        if head.read_line(&mut line)? == 0 || line == "\r\n" || line == "\n" {
            break;
        }
        headers.push(line);
    }
    let openmetrics = accepts_openmetrics(&headers);
    let mut parts = request_line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    let (status, content_type, body) = match (method, path) {
        ("GET" | "HEAD", "/metrics") if openmetrics => (
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.render(true),
        ),
        ("GET" | "HEAD", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            metrics.render(false),
        ),
        ("GET" | "HEAD", "/") => (
            "200 OK",
            "text/html; charset=utf-8",
            "<html><body><a href=\"/metrics\">/metrics</a></body></html>\n".to_string(),
        ),
        ("GET" | "HEAD", _) => ("404 Not Found", "text/plain", "not found\n".to_string()),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "only GET\n".to_string(),
        ),
    };
    let mut reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if method != "HEAD" {
        reply.push_str(&body);
    }
    write_by(conn, deadline, reply.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_of(stats: &serde_json::Value) -> String {
        #[derive(Debug)]
        struct Fixed(serde_json::Value);
        impl Collector for Fixed {
            fn encode(&self, encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
                encode_stats(&self.0, encoder)
            }
        }
        let mut registry = Registry::with_prefix("cvol");
        registry.register_collector(Box::new(Fixed(stats.clone())));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    }

    #[test]
    fn every_counter_names_a_numeric_stat_key() {
        let stats = serde_json::to_value(cvol_engine::VolumeStats::default()).unwrap();
        for key in COUNTERS {
            assert!(
                stats.get(key).is_some_and(|v| v.is_number()),
                "{key} is no numeric stat key"
            );
        }
    }

    #[test]
    fn every_stat_figure_becomes_a_series() {
        let stats = serde_json::to_value(cvol_engine::VolumeStats::default()).unwrap();
        let text = text_of(&stats);
        for (key, value) in stats.as_object().unwrap() {
            let key = metric_name(key);
            let want = match value {
                serde_json::Value::Number(_) if COUNTERS.contains(&key) => {
                    format!("\ncvol_{key}_total ")
                }
                serde_json::Value::Number(_) | serde_json::Value::Bool(_) => {
                    format!("\ncvol_{key} ")
                }
                serde_json::Value::String(_) if key == "load_level" => {
                    format!("\ncvol_{key} ")
                }
                serde_json::Value::String(_) => format!("{key}=\""),
                serde_json::Value::Object(_) if key == "blocks_by_codec" => {
                    "\ncvol_blocks_by_codec{codec=\"lz4\"} ".to_string()
                }
                serde_json::Value::Object(_) if key == "memory_bytes" => {
                    "\ncvol_memory_bytes{use=\"map\"} ".to_string()
                }
                _ => continue,
            };
            assert!(text.contains(&want), "{key}: no {want:?} in\n{text}");
        }
        assert!(text.contains("# TYPE cvol_client_bytes_written counter"));
        assert!(text.contains("# TYPE cvol_physical_used_bytes gauge"));
    }

    #[test]
    fn requests_are_counted_timed_and_errors_named() {
        let mut registry = Registry::with_prefix("cvol");
        let m = RequestMetrics::register(&mut registry);
        let call = |kind, length| Call {
            kind,
            offset: 0,
            length,
            fua: false,
            no_hole: false,
            fast_zero: false,
        };
        m.around(call(CommandKind::Read, 4096), || Ok(())).unwrap();
        m.around(call(CommandKind::Read, 4096), || Ok(())).unwrap();
        let write = call(CommandKind::Write, 8192);
        let _ = m.around(write, || Err::<(), _>(BackendError::NoSpace));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("cvol_requests_total{command=\"read\"} 2"),
            "{text}"
        );
        assert!(text.contains("cvol_request_bytes_total{command=\"read\"} 8192"));
        assert!(text.contains("cvol_request_bytes_total{command=\"write\"} 0"));
        assert!(text.contains("cvol_request_errors_total{command=\"write\",error=\"no_space\"} 1"));
        assert!(text.contains("cvol_request_errors_total{command=\"flush\",error=\"io\"} 0"));
        assert!(text.contains("cvol_request_duration_seconds_count{command=\"read\"} 2"));
        assert!(text.contains("cvol_requests_in_flight 0"));
    }

    #[test]
    fn the_text_format_names_counters_by_their_samples() {
        let om = "# HELP cvol_x things.\n# TYPE cvol_x counter\ncvol_x_total{volume=\"v\"} 3\n\
                  # HELP cvol_y level.\n# TYPE cvol_y gauge\n# UNIT cvol_y bytes\ncvol_y 1\n# EOF\n";
        assert_eq!(
            to_text_format(om),
            "# HELP cvol_x_total things.\n# TYPE cvol_x_total counter\ncvol_x_total{volume=\"v\"} 3\n\
             # HELP cvol_y level.\n# TYPE cvol_y gauge\ncvol_y 1\n"
        );
        assert!(accepts_openmetrics(&[
            "Accept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5\r\n".into()
        ]));
        assert!(!accepts_openmetrics(&["Accept: */*\r\n".into()]));
    }

    #[test]
    fn no_gauge_takes_another_types_suffix() {
        let stats = serde_json::to_value(cvol_engine::VolumeStats::default()).unwrap();
        for key in stats.as_object().unwrap().keys() {
            let name = metric_name(key);
            if !COUNTERS.contains(&key.as_str()) {
                for suffix in ["_total", "_count", "_sum", "_bucket", "_created"] {
                    assert!(!name.ends_with(suffix), "gauge {name}");
                }
            }
        }
    }

    #[test]
    fn metrics_address_defaults_to_loopback() {
        assert_eq!(parse_addr("9810").unwrap()[0].to_string(), "127.0.0.1:9810");
        assert_eq!(
            parse_addr("[::1]:9810").unwrap()[0].to_string(),
            "[::1]:9810"
        );
        assert!(parse_addr("nonsense")
            .unwrap_err()
            .to_string()
            .starts_with("--metrics"));
    }
}
