//! `cvol serve`'s flags, each group checked into the configuration it
//! feeds: `OpenOptions` (the volume) and `ServerConfig` (the NBD server).
use super::DEFAULT_LISTEN;
use crate::error::Error;
use crate::words::{self, OnOff};
use crate::{edge, size};
use cvol_engine::segments::VictimPolicy;
use cvol_engine::{CleanerConfig, Codec, ElasticConfig, OpenOptions};
use cvol_nbd::ServerConfig;
use std::net::ToSocketAddrs;
use std::path::PathBuf;
use std::sync::Arc;

/// Least `--map-cache`: ten map pages (the tests use it to page all the time).
const MAP_CACHE_MIN_BYTES: u64 = 64 << 10;
/// Most `--workers`.
const WORKERS_MAX: usize = 1024;
/// Most `--handshake-timeout`: an hour.
const HANDSHAKE_TIMEOUT_MAX_SECS: u64 = 3600;

/// `cvol serve`'s command line. Each group of flags checks itself into
/// the configuration it feeds: `open_options` (the volume) and
/// `server_config` (the NBD server).
#[derive(clap::Args)]
pub struct ServeArgs {
    /// The volume (default ./cvol-data/default.cvol, a 16 GiB volume created if absent).
    pub(super) volume: Option<PathBuf>,
    /// Listen on a Unix socket at PATH (refused if PATH exists, unless
    /// it is the stale socket of a server that is gone).
    #[arg(long, value_name = "PATH")]
    pub(super) socket: Option<PathBuf>,
    /// Listen on TCP ADDR:PORT (default 127.0.0.1:10809 when no --socket is given).
    #[arg(long, value_name = "ADDR:PORT")]
    pub(super) listen: Option<String>,
    /// Serve Prometheus metrics at http://ADDR:PORT/metrics (PORT alone:
    /// on 127.0.0.1): request counts, latency histograms, every stat figure.
    #[arg(long, value_name = "[ADDR:]PORT")]
    pub(super) metrics: Option<String>,
    /// Record every client request (time, command, offset, length, flags,
    /// duration, result) into FILE, a new file (`cvol trace show|replay`).
    #[arg(long, value_name = "FILE")]
    pub(super) trace: Option<PathBuf>,
    /// Serve only this volume of the pool, under this name (clients asking
    /// for "" get it too). Default: every volume under its own name, and
    /// `default` under "" as well. On a pool of one volume, a name that is
    /// no volume's serves that volume under it.
    #[arg(long, default_value = "")]
    pub(super) export: String,
    /// Serve read-only: clients cannot write and the volume is not written.
    #[arg(long)]
    pub(super) read_only: bool,
    /// Make every write durable before replying.
    #[arg(long)]
    pub(super) sync: bool,
    /// Worker threads running requests (default: 2 per core, at least 4).
    #[arg(long)]
    pub(super) workers: Option<usize>,
    /// Microseconds a connection with nothing in flight watches its socket
    /// for the client's next request before it sleeps, or off. A client
    /// that sends one request at a time (a database's commits, a copy at
    /// queue depth 1) then does not wait for the server to wake up each
    /// time: on a virtual machine whose idle cores halt, that wake-up is
    /// most of a small request's latency. The window adapts to each client
    /// (it closes for one that pauses between requests); the polling
    /// thread gives its core to any other that wants it, at most half the
    /// cores poll at once, and none while threads wait for a core (the
    /// kernel's CPU pressure at 20% or more). Not used under TLS.
    #[arg(long, value_name = "MICROSECONDS|off", default_value = "100")]
    pub(super) busy_poll: String,
    #[command(flatten)]
    pub(super) cleaner: CleanerFlags,
    /// Memory for the dedup index: the exact index of recent blocks, the
    /// sampled hooks into the volume's fingerprint tables (a copy of old
    /// data is found at any age) and a cache of tables read [default: 1/64
    /// of the physical size, 1M to 128M]
    #[arg(long)]
    pub(super) dedup_memory: Option<String>,
    /// Memory for the cache of recently read, decompressed blocks (0
    /// disables it) [default: 1/128 of the physical size, 1M to 32M]
    #[arg(long)]
    pub(super) read_cache: Option<String>,
    /// Memory for block map pages (12 bytes per mapped block, 3 MiB per
    /// GiB written); pages beyond it are dropped when clean and read back
    /// from the volume on demand [default: 512M; at least 64K]
    #[arg(long)]
    pub(super) map_cache: Option<String>,
    #[command(flatten)]
    pub(super) elastic: ElasticFlags,
    #[command(flatten)]
    pub(super) limits: LimitFlags,
    #[command(flatten)]
    pub(super) edge: edge::EdgeFlags,
    #[command(flatten)]
    pub(super) object: ObjectFlags,
}

/// A volume in an object store (`cvol serve s3://BUCKET/PREFIX`).
#[derive(clap::Args)]
pub(super) struct ObjectFlags {
    /// Object-store volume: the directory of its local cache (a sparse
    /// file of the volume's physical size; started empty on every serve).
    #[arg(long, value_name = "DIR")]
    pub(super) cache_dir: Option<PathBuf>,
    /// Object-store volume: bytes the local cache may hold; clean data
    /// beyond it is evicted (default 1G).
    #[arg(long)]
    pub(super) cache_size: Option<String>,
    /// Object-store volume: a server whose lease did not change for this
    /// many seconds is gone, and another may take the volume over.
    #[arg(long, default_value_t = 10.0, value_name = "SECS")]
    pub(super) lease: f64,
    /// Object-store volume: serve it even if the store does not honour
    /// create-only PUTs (If-None-Match), which fencing a second server
    /// out needs. Unsafe: run only one server of the volume, ever at a
    /// time, and make sure an old one is gone before starting another.
    #[arg(long)]
    pub(super) unsafe_no_fencing: bool,
}

impl ObjectFlags {
    pub(super) fn flags(&self, read_only: bool) -> crate::objvol::ServeFlags<'_> {
        crate::objvol::ServeFlags {
            cache_dir: self.cache_dir.as_deref(),
            cache_size: self.cache_size.as_deref(),
            lease: self.lease,
            read_only,
            unsafe_no_fencing: self.unsafe_no_fencing,
        }
    }
}

/// The background cleaner: `OpenOptions::cleaner`.
#[derive(clap::Args)]
pub(super) struct CleanerFlags {
    /// Cleaner victim policy: cost-benefit (LFS) or greedy (fewest live bytes).
    #[arg(long, default_value = "cost-benefit", value_parser = words::choice::<CleanerPolicy>())]
    pub(super) cleaner: CleanerPolicy,
    /// The background cleaner starts when free segments fall below this percentage...
    #[arg(long, default_value_t = 10)]
    pub(super) clean_start: u64,
    /// ...and stops once they are above this one.
    #[arg(long, default_value_t = 25)]
    pub(super) clean_stop: u64,
    /// Idle cleaning: once clients are idle and background recompression is
    /// done, collect dead space (segments at most 90% live) until it is at
    /// most 5% of the live data, so the host gets it back: on or off.
    #[arg(long, default_value = "on", value_parser = words::choice::<OnOff>())]
    pub(super) idle_clean: OnOff,
}

/// `--cleaner`'s words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum CleanerPolicy {
    CostBenefit,
    Greedy,
}

impl CleanerPolicy {
    fn policy(self) -> VictimPolicy {
        match self {
            CleanerPolicy::CostBenefit => VictimPolicy::CostBenefit,
            CleanerPolicy::Greedy => VictimPolicy::Greedy,
        }
    }
}

/// Elastic compression: `OpenOptions::elastic`.
#[derive(clap::Args)]
pub(super) struct ElasticFlags {
    /// Largest merged compression unit (4K to 64K, a power of two):
    /// contiguous blocks of one write inside an aligned window of this
    /// size are compressed together.
    #[arg(long, default_value = "16K")]
    pub(super) unit_size: String,
    /// Codec policy auto: the unit background recompression merges cold
    /// data into (4K to 64K, a power of two, at least --unit-size): larger
    /// units take less space, and a random 4 KiB read of cold data
    /// decompresses its whole unit.
    #[arg(long, default_value = "64K")]
    pub(super) cold_unit_size: String,
    #[arg(long, default_value_t = ElasticConfig::default().busy_iops, help = words::busy_iops_help())]
    pub(super) busy_iops: u64,
    #[arg(long, default_value_t = ElasticConfig::default().idle_iops, help = words::idle_iops_help())]
    pub(super) idle_iops: u64,
    /// Codec policy auto: rewrite cold lz4 data and small units with the
    /// strong codec (zstd:9, or the LEVEL of auto:zstd:LEVEL) while clients
    /// are idle (on or off).
    #[arg(long, default_value = "on", value_parser = words::choice::<OnOff>())]
    pub(super) recompress: OnOff,
    /// Codec policy auto with --recompress on: the share of the machine's
    /// CPU (percent of all cores) inline compression may use while the
    /// load is busy; beyond it, units are written raw and compressed by
    /// background recompression once clients are idle (EDC's lightest
    /// level). 0 defers every unit while busy; off always compresses inline
    /// [default: 30; off for a volume in an object store, where the store
    /// is the bottleneck and a deferred unit would be PUT twice]
    #[arg(long, value_name = "PERCENT|off")]
    pub(super) inline_cpu: Option<String>,
    /// Background recompression rewrites data only if that saves at least
    /// this percent of the bytes it replaces [default: 6; 50 for a volume
    /// in an object store, where a rewrite must save as many bytes as it
    /// PUTs]
    #[arg(long, value_name = "PERCENT")]
    pub(super) recompress_min_gain: Option<String>,
    /// Codec policy auto: the codec of compressible data while the load is
    /// busy, lz4 or zstd:LEVEL [default: lz4; zstd:1 for a volume in an
    /// object store, where the store, not the CPU, is the bottleneck]
    #[arg(long, value_name = "CODEC")]
    pub(super) busy_codec: Option<String>,
    /// Codec policy auto: when the machine's CPU (all cores, every process,
    /// over about the last second) is at least this busy, compressible
    /// writes get the busy codec whatever the I/O rate: the CPU, which the
    /// clients need too, is then the bottleneck (EDC picks the codec by
    /// the bottleneck). off: the I/O rate alone decides [default: 70; off
    /// for a volume in an object store, where the store is the bottleneck]
    #[arg(long, value_name = "PERCENT|off")]
    pub(super) busy_cpu: Option<String>,
}

/// `--max-handshaking` is at least this by default (or `--max-connections`
/// if lower): clients open their connections in parallel (nbdcopy, four).
const MIN_DEFAULT_HANDSHAKING: usize = 16;

/// What clients may hold of the NBD server: part of its `ServerConfig`.
#[derive(clap::Args)]
pub(super) struct LimitFlags {
    /// Clients served at once; more are refused (closed before the greeting).
    #[arg(long, default_value_t = ServerConfig::default().max_connections)]
    pub(super) max_connections: usize,
    /// Request payload (READ/WRITE data) the server holds at once across
    /// all connections; a client whose request does not fit waits.
    #[arg(long, default_value = "256M")]
    pub(super) max_buffered: String,
    /// Seconds a client has for the whole handshake.
    #[arg(long, default_value_t = 30)]
    pub(super) handshake_timeout: u64,
    /// Connections one client IP address may hold at once (TCP; clients
    /// of --socket are not limited); more are refused.
    #[arg(long, default_value_t = ServerConfig::default().max_connections_per_address)]
    pub(super) max_connections_per_address: usize,
    /// Connections still in the handshake (before TLS and the export are
    /// agreed) at once, so that they cannot take the slots of established
    /// clients; when all are taken, one that has been in the handshake for
    /// 2 s or more is closed to make room, else the newcomer is refused
    /// [default: a quarter of --max-connections, at least 16]
    #[arg(long)]
    pub(super) max_handshaking: Option<usize>,
    /// Seconds a connected client with no request in flight may send
    /// nothing before it is disconnected, or off (never).
    #[arg(long, default_value = "off")]
    pub(super) idle_timeout: String,
}

impl ServeArgs {
    /// How the volume is opened. Checks the flags of the cleaner, the
    /// memory budgets and elastic compression, in that order.
    pub(super) fn open_options(&self) -> Result<OpenOptions, Error> {
        let cleaner = self.cleaner.config()?;
        // Memory budgets: from a floor that still works to this machine's memory.
        let memory = |flag: &str, v: &Option<String>, min: u64, zero_ok: bool| {
            v.as_deref()
                .map(|s| size::parse_memory(flag, s, min, zero_ok))
                .transpose()
        };
        let dedup_memory_bytes = memory("--dedup-memory", &self.dedup_memory, 1 << 20, false)?;
        let read_cache_bytes = memory("--read-cache", &self.read_cache, 64 << 10, true)?;
        let map_cache_bytes = memory("--map-cache", &self.map_cache, MAP_CACHE_MIN_BYTES, false)?;
        Ok(OpenOptions {
            read_only: self.read_only,
            sync_writes: self.sync,
            cleaner,
            dedup_memory_bytes,
            read_cache_bytes,
            map_cache_bytes,
            elastic: self.elastic.config(self.in_object_store())?,
            cpu: Some(machine_cpu()),
            ..crate::keyfile::open_options()
        })
    }

    /// Is the volume an `s3://` URL?
    fn in_object_store(&self) -> bool {
        self.volume
            .as_deref()
            .is_some_and(|p| crate::objvol::url_of(p).is_some())
    }

    /// How the NBD server runs. Checks the client limits, then TLS and
    /// `--allow` (loading the certificates).
    pub(super) fn server_config(&self) -> Result<ServerConfig, Error> {
        let mut config = ServerConfig {
            export_name: self.export.clone(),
            ..ServerConfig::default()
        };
        self.limits.apply(&mut config)?;
        let (reach, addr) = self.tcp_reach();
        self.edge.apply(&mut config, self.read_only, reach, addr)?;
        if let Some(w) = self.workers {
            if w > WORKERS_MAX {
                return Err(Error::Usage(format!(
                    "--workers {w}: at most {WORKERS_MAX} worker threads"
                )));
            }
            config.workers = w.max(1);
        }
        config.busy_poll = busy_poll(&self.busy_poll)?;
        if !config.busy_poll.is_zero() {
            let cpu = machine_cpu();
            config.busy_poll_gate = Some(cvol_nbd::PollGate(Arc::new(move || {
                cpu.pressure_percent()
                    .is_some_and(|p| p < BUSY_POLL_MAX_PRESSURE_PERCENT)
            })));
        }
        Ok(config)
    }
}

impl ServeArgs {
    /// Whom the TCP listener reaches, and its address (as given): none
    /// with only `--socket`. An address that does not resolve counts as
    /// loopback here (the bind refuses it).
    pub(super) fn tcp_reach(&self) -> (edge::Reach, &str) {
        if self.listen.is_none() && self.socket.is_some() {
            return (edge::Reach::NoTcp, "");
        }
        let addr = self.listen.as_deref().unwrap_or(DEFAULT_LISTEN);
        let reach = addr
            .to_socket_addrs()
            .map_or(edge::Reach::Loopback, edge::Reach::of_all);
        (reach, addr)
    }
}

impl CleanerFlags {
    fn config(&self) -> Result<CleanerConfig, Error> {
        let (start, stop) = (self.clean_start, self.clean_stop);
        let policy = self.cleaner.policy();
        if start >= stop || stop > 90 {
            return Err(Error::Usage(format!(
                "--clean-start {start} must be below --clean-stop {stop}, which must be at most 90"
            )));
        }
        Ok(CleanerConfig {
            policy,
            low_free_percent: start,
            high_free_percent: stop,
            idle: self.idle_clean.on(),
        })
    }
}

impl ElasticFlags {
    /// The elastic configuration; `object_store`: the volume is kept in
    /// an object store, which changes two defaults
    /// (`ElasticConfig::for_object_store`).
    fn config(&self, object_store: bool) -> Result<ElasticConfig, Error> {
        let defaults = if object_store {
            ElasticConfig::for_object_store()
        } else {
            ElasticConfig::default()
        };
        let (unit_size, busy_iops, idle_iops) = (&self.unit_size, self.busy_iops, self.idle_iops);
        let unit_blocks = crate::trace::parse_unit_size(unit_size)?;
        let cold_unit_blocks =
            crate::trace::parse_unit_size(&self.cold_unit_size).map_err(|_| {
                Error::Usage(format!(
                    "--cold-unit-size {} must be a power of two from 4K to 64K",
                    self.cold_unit_size
                ))
            })?;
        if cold_unit_blocks < unit_blocks {
            return Err(Error::Usage(format!(
                "--cold-unit-size {} must be at least --unit-size {unit_size}",
                self.cold_unit_size
            )));
        }
        if idle_iops >= busy_iops {
            return Err(Error::Usage(format!(
                "--idle-iops {idle_iops} must be below --busy-iops {busy_iops}"
            )));
        }
        Ok(ElasticConfig {
            unit_blocks,
            recompress_unit_blocks: cold_unit_blocks,
            busy_iops,
            idle_iops,
            recompress: self.recompress.on(),
            inline_cpu_percent: given_or(
                &self.inline_cpu,
                inline_cpu,
                defaults.inline_cpu_percent,
            )?,
            recompress_min_gain_percent: given_or(
                &self.recompress_min_gain,
                min_gain,
                defaults.recompress_min_gain_percent,
            )?,
            busy_codec: given_or(&self.busy_codec, busy_codec, defaults.busy_codec)?,
            busy_cpu_percent: given_or(&self.busy_cpu, busy_cpu, defaults.busy_cpu_percent)?,
            ..defaults
        })
    }
}

/// `--inline-cpu PERCENT|off`.
fn inline_cpu(v: &str) -> Result<Option<u32>, Error> {
    if v == "off" {
        return Ok(None);
    }
    match v.trim_end_matches('%').parse::<u32>() {
        Ok(p) if p <= 100 => Ok(Some(p)),
        _ => Err(Error::Usage(format!(
            "--inline-cpu {v}: expected a percentage from 0 to 100, or off"
        ))),
    }
}

/// Busy polling pauses while the machine's CPU pressure (the share of the
/// last second during which some runnable thread waited for a core) is at
/// least this: polling would then take a core from a thread that has work.
/// Measured on 2 cores: 4-11% with one client at queue depth 1, 63-70%
/// under PostgreSQL's pgbench, whose TPS a fixed 50 µs window lowered by
/// 2.5% (the adaptive window alone polled 0.16 s in a minute there).
pub(super) const BUSY_POLL_MAX_PRESSURE_PERCENT: u32 = 20;

/// The machine's CPU gauge, one per process: the volumes' codec policy and
/// the server's busy polling read the same samples.
fn machine_cpu() -> Arc<dyn cvol_engine::cpu::CpuGauge> {
    static CPU: std::sync::OnceLock<Arc<dyn cvol_engine::cpu::CpuGauge>> =
        std::sync::OnceLock::new();
    CPU.get_or_init(cvol_engine::cpu::MachineCpu::shared)
        .clone()
}

/// `--busy-poll MICROSECONDS|off`: a window from 1 µs to 1 ms.
fn busy_poll(v: &str) -> Result<std::time::Duration, Error> {
    const MAX_MICROS: u64 = 1000;
    if v == "off" {
        return Ok(std::time::Duration::ZERO);
    }
    let digits = v.strip_suffix("us").or(v.strip_suffix("µs")).unwrap_or(v);
    match digits.parse::<u64>() {
        Ok(us) if (1..=MAX_MICROS).contains(&us) => Ok(std::time::Duration::from_micros(us)),
        _ => Err(Error::Usage(format!(
            "--busy-poll {v}: expected microseconds from 1 to {MAX_MICROS}, or off"
        ))),
    }
}

/// `--busy-cpu PERCENT|off`.
fn busy_cpu(v: &str) -> Result<Option<u32>, Error> {
    if v == "off" {
        return Ok(None);
    }
    match v.trim_end_matches('%').parse::<u32>() {
        Ok(p) if (1..=100).contains(&p) => Ok(Some(p)),
        _ => Err(Error::Usage(format!(
            "--busy-cpu {v}: expected a percentage from 1 to 100, or off"
        ))),
    }
}

/// A flag's value parsed with `parse` if it was given, else `default`.
fn given_or<T>(
    flag: &Option<String>,
    parse: fn(&str) -> Result<T, Error>,
    default: T,
) -> Result<T, Error> {
    flag.as_deref().map_or(Ok(default), parse)
}

/// `--busy-codec lz4|zstd:LEVEL`.
fn busy_codec(v: &str) -> Result<Codec, Error> {
    match Codec::parse(v) {
        Ok(Codec::None) => Err(Error::Usage(
            "--busy-codec none: to leave compression to the background while busy, \
             use --inline-cpu 0"
                .into(),
        )),
        Ok(c) => Ok(c),
        Err(e) => Err(Error::Usage(format!("--busy-codec {v}: {e}"))),
    }
}

/// `--recompress-min-gain PERCENT`.
fn min_gain(v: &str) -> Result<u32, Error> {
    match v.trim_end_matches('%').parse::<u32>() {
        Ok(p) if p < 100 => Ok(p),
        _ => Err(Error::Usage(format!(
            "--recompress-min-gain {v}: expected a percentage from 0 to 99"
        ))),
    }
}

impl LimitFlags {
    fn apply(&self, config: &mut ServerConfig) -> Result<(), Error> {
        let max_buffered = &self.max_buffered;
        let max_buffered_bytes = size::parse_size(max_buffered)
            .map_err(|e| Error::Usage(format!("--max-buffered: {e}")))?;
        let min = u64::from(config.max_request_bytes);
        if self.max_connections == 0 {
            return Err(Error::Usage("--max-connections must be at least 1".into()));
        }
        if max_buffered_bytes < min {
            return Err(Error::Usage(format!(
                "--max-buffered {max_buffered} must be at least one request ({min} bytes)"
            )));
        }
        size::parse_memory("--max-buffered", max_buffered, min, false)?;
        if !(1..=HANDSHAKE_TIMEOUT_MAX_SECS).contains(&self.handshake_timeout) {
            return Err(Error::Usage(format!(
                "--handshake-timeout {}: give seconds from 1 to {HANDSHAKE_TIMEOUT_MAX_SECS}",
                self.handshake_timeout
            )));
        }
        if self.max_connections_per_address == 0 {
            return Err(Error::Usage(
                "--max-connections-per-address must be at least 1".into(),
            ));
        }
        let max_handshaking = self.max_handshaking.unwrap_or(
            (self.max_connections / 4).max(self.max_connections.min(MIN_DEFAULT_HANDSHAKING)),
        );
        if max_handshaking == 0 || max_handshaking > self.max_connections {
            return Err(Error::Usage(format!(
                "--max-handshaking {max_handshaking} must be from 1 to --max-connections ({})",
                self.max_connections
            )));
        }
        config.idle_timeout = match self.idle_timeout.as_str() {
            "off" => None,
            v => match v.parse::<u64>() {
                Ok(secs) if secs > 0 => Some(std::time::Duration::from_secs(secs)),
                _ => {
                    return Err(Error::Usage(format!(
                        "--idle-timeout {v}: expected a number of seconds (at least 1), or off"
                    )))
                }
            },
        };
        config.max_connections_per_address = self.max_connections_per_address;
        config.max_handshaking = max_handshaking;
        config.max_connections = self.max_connections;
        config.max_buffered_bytes = max_buffered_bytes;
        config.handshake_timeout = std::time::Duration::from_secs(self.handshake_timeout);
        Ok(())
    }
}
