//! `cvol serve`. A start that fails leaves the volume untouched: the
//! arguments are checked, the volume file is checked and locked, and every
//! listener is bound before the volume is opened (opening writes it).
//! SIGTERM/SIGINT at any point stop it cleanly (exit 0).
use crate::create::{self, CreateArgs};
use crate::error::Error;
use crate::volfile::{self, Globals, Opened, Purpose};
use crate::words::OnOff;
use crate::{
    backend, control_server, edge, metrics, origin, service, size, sockfile, trace, words,
};
use cvol_engine::cache::{CacheLabel, CacheVolume};
use cvol_engine::segments::VictimPolicy;
use cvol_engine::{CleanerConfig, ElasticConfig, OpenOptions, Volume};
use cvol_format::superblock::{Superblock, SUPERBLOCK_BYTES};
use cvol_format::{SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET};
use cvol_nbd::Backend;
use cvol_storage::{FileStorage, Storage};

/// Least `--map-cache`: ten map pages (the tests use it to page all the time).
const MAP_CACHE_MIN_BYTES: u64 = 64 << 10;
/// Most `--workers`.
const WORKERS_MAX: usize = 1024;
/// Most `--handshake-timeout`: an hour.
const HANDSHAKE_TIMEOUT_MAX_SECS: u64 = 3600;
use cvol_nbd::{Server, ServerConfig};
use std::io::Write;
use std::net::{TcpListener, ToSocketAddrs};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub const DEFAULT_VOLUME: &str = "cvol-data/default.cvol";
const DEFAULT_SIZE: &str = "16G";
pub const DEFAULT_LISTEN: &str = "127.0.0.1:10809";

/// `cvol serve`'s command line. Each group of flags checks itself into
/// the configuration it feeds: `open_options` (the volume) and
/// `server_config` (the NBD server).
#[derive(clap::Args)]
pub struct ServeArgs {
    /// The volume (default ./cvol-data/default.cvol, a 16 GiB volume created if absent).
    volume: Option<PathBuf>,
    /// Listen on a Unix socket at PATH (refused if PATH exists, unless
    /// it is the stale socket of a server that is gone).
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Listen on TCP ADDR:PORT (default 127.0.0.1:10809 when no --socket is given).
    #[arg(long, value_name = "ADDR:PORT")]
    listen: Option<String>,
    /// Serve Prometheus metrics at http://ADDR:PORT/metrics (PORT alone:
    /// on 127.0.0.1): request counts, latency histograms, every stat figure.
    #[arg(long, value_name = "[ADDR:]PORT")]
    metrics: Option<String>,
    /// Record every client request (time, command, offset, length, flags,
    /// duration, result) into FILE, a new file (`cvol trace show|replay`).
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Export name (clients asking for "" get it too).
    #[arg(long, default_value = "")]
    export: String,
    /// Serve read-only: clients cannot write and the volume is not written.
    #[arg(long)]
    read_only: bool,
    /// Make every write durable before replying.
    #[arg(long)]
    sync: bool,
    /// Worker threads running requests (default: 2 per core, at least 4).
    #[arg(long)]
    workers: Option<usize>,
    #[command(flatten)]
    cleaner: CleanerFlags,
    /// Memory for the dedup fingerprint index (24 bytes per block
    /// remembered) [default: 1/64 of the physical size, 1M to 128M]
    #[arg(long)]
    dedup_memory: Option<String>,
    /// Memory for the cache of recently read, decompressed blocks (0
    /// disables it) [default: 1/128 of the physical size, 1M to 32M]
    #[arg(long)]
    read_cache: Option<String>,
    /// Memory for block map pages (12 bytes per mapped block, 3 MiB per
    /// GiB written); pages beyond it are dropped when clean and read back
    /// from the volume on demand [default: 512M; at least 64K]
    #[arg(long)]
    map_cache: Option<String>,
    #[command(flatten)]
    elastic: ElasticFlags,
    #[command(flatten)]
    limits: LimitFlags,
    #[command(flatten)]
    edge: edge::EdgeFlags,
    #[command(flatten)]
    object: ObjectFlags,
}

/// A volume in an object store (`cvol serve s3://BUCKET/PREFIX`).
#[derive(clap::Args)]
struct ObjectFlags {
    /// Object-store volume: the directory of its local cache (a sparse
    /// file of the volume's physical size; started empty on every serve).
    #[arg(long, value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// Object-store volume: bytes the local cache may hold; clean data
    /// beyond it is evicted (default 1G).
    #[arg(long)]
    cache_size: Option<String>,
    /// Object-store volume: a server whose lease did not change for this
    /// many seconds is gone, and another may take the volume over.
    #[arg(long, default_value_t = 10.0, value_name = "SECS")]
    lease: f64,
    /// Object-store volume: serve it even if the store does not honour
    /// create-only PUTs (If-None-Match), which fencing a second server
    /// out needs. Unsafe: run only one server of the volume, ever at a
    /// time, and make sure an old one is gone before starting another.
    #[arg(long)]
    unsafe_no_fencing: bool,
}

impl ObjectFlags {
    fn flags(&self, read_only: bool) -> crate::objvol::ServeFlags<'_> {
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
struct CleanerFlags {
    /// Cleaner victim policy: cost-benefit (LFS) or greedy (fewest live bytes).
    #[arg(long, default_value = "cost-benefit", value_parser = words::choice::<CleanerPolicy>())]
    cleaner: CleanerPolicy,
    /// The background cleaner starts when free segments fall below this percentage...
    #[arg(long, default_value_t = 10)]
    clean_start: u64,
    /// ...and stops once they are above this one.
    #[arg(long, default_value_t = 25)]
    clean_stop: u64,
    /// Idle cleaning: once clients are idle and background recompression is
    /// done, collect dead space (segments at most 90% live) until it is at
    /// most 5% of the live data, so the host gets it back: on or off.
    #[arg(long, default_value = "on", value_parser = words::choice::<OnOff>())]
    idle_clean: OnOff,
}

/// `--cleaner`'s words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum CleanerPolicy {
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
struct ElasticFlags {
    /// Largest merged compression unit (4K to 64K, a power of two):
    /// contiguous blocks of one write inside an aligned window of this
    /// size are compressed together.
    #[arg(long, default_value = "16K")]
    unit_size: String,
    #[arg(long, default_value_t = ElasticConfig::default().busy_iops, help = words::busy_iops_help())]
    busy_iops: u64,
    #[arg(long, default_value_t = ElasticConfig::default().idle_iops, help = words::idle_iops_help())]
    idle_iops: u64,
    /// Codec policy auto: rewrite cold lz4 data and small units with the
    /// strong codec (zstd:9, or the LEVEL of auto:zstd:LEVEL) while clients
    /// are idle (on or off).
    #[arg(long, default_value = "on", value_parser = words::choice::<OnOff>())]
    recompress: OnOff,
    /// Codec policy auto with --recompress on: the share of the machine's
    /// CPU (percent of all cores) inline compression may use while the
    /// load is busy; beyond it, units are written raw and compressed by
    /// background recompression once clients are idle (EDC's lightest
    /// level). 0 defers every unit while busy; off always compresses inline.
    #[arg(long, default_value = "30")]
    inline_cpu: String,
}

/// `--max-handshaking` is at least this by default (or `--max-connections`
/// if lower): clients open their connections in parallel (nbdcopy, four).
const MIN_DEFAULT_HANDSHAKING: usize = 16;

/// What clients may hold of the NBD server: part of its `ServerConfig`.
#[derive(clap::Args)]
struct LimitFlags {
    /// Clients served at once; more are refused (closed before the greeting).
    #[arg(long, default_value_t = ServerConfig::default().max_connections)]
    max_connections: usize,
    /// Request payload (READ/WRITE data) the server holds at once across
    /// all connections; a client whose request does not fit waits.
    #[arg(long, default_value = "256M")]
    max_buffered: String,
    /// Seconds a client has for the whole handshake.
    #[arg(long, default_value_t = 30)]
    handshake_timeout: u64,
    /// Connections one client IP address may hold at once (TCP; clients
    /// of --socket are not limited); more are refused.
    #[arg(long, default_value_t = ServerConfig::default().max_connections_per_address)]
    max_connections_per_address: usize,
    /// Connections still in the handshake (before TLS and the export are
    /// agreed) at once, so that they cannot take the slots of established
    /// clients; when all are taken, one that has been in the handshake for
    /// 2 s or more is closed to make room, else the newcomer is refused
    /// [default: a quarter of --max-connections, at least 16]
    #[arg(long)]
    max_handshaking: Option<usize>,
    /// Seconds a connected client with no request in flight may send
    /// nothing before it is disconnected, or off (never).
    #[arg(long, default_value = "off")]
    idle_timeout: String,
}

impl ServeArgs {
    /// How the volume is opened. Checks the flags of the cleaner, the
    /// memory budgets and elastic compression, in that order.
    fn open_options(&self) -> Result<OpenOptions, Error> {
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
            elastic: self.elastic.config()?,
            ..OpenOptions::default()
        })
    }

    /// How the NBD server runs. Checks the client limits, then TLS and
    /// `--allow` (loading the certificates).
    fn server_config(&self) -> Result<ServerConfig, Error> {
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
        Ok(config)
    }
}

impl ServeArgs {
    /// Whom the TCP listener reaches, and its address (as given): none
    /// with only `--socket`. An address that does not resolve counts as
    /// loopback here (the bind refuses it).
    fn tcp_reach(&self) -> (edge::Reach, &str) {
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
    fn config(&self) -> Result<ElasticConfig, Error> {
        let (unit_size, busy_iops, idle_iops) = (&self.unit_size, self.busy_iops, self.idle_iops);
        let unit_blocks = crate::trace::parse_unit_size(unit_size)?;
        if idle_iops >= busy_iops {
            return Err(Error::Usage(format!(
                "--idle-iops {idle_iops} must be below --busy-iops {busy_iops}"
            )));
        }
        Ok(ElasticConfig {
            unit_blocks,
            busy_iops,
            idle_iops,
            recompress: self.recompress.on(),
            inline_cpu_percent: inline_cpu(&self.inline_cpu)?,
            ..ElasticConfig::default()
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

/// The bound listeners (the Unix socket file goes with its listener).
struct Listeners {
    unix: Option<(UnixListener, sockfile::SocketFile)>,
    tcp: Option<TcpListener>,
    /// `--metrics`.
    metrics: Option<TcpListener>,
}

fn bind_listeners(args: &ServeArgs) -> Result<Listeners, Error> {
    let (socket, listen) = (args.socket.as_deref(), args.listen.as_deref());
    let unix = socket.map(|s| sockfile::bind(s, "--socket")).transpose()?;
    let tcp = if listen.is_some() || socket.is_none() {
        let addr = listen.unwrap_or(DEFAULT_LISTEN);
        let addrs: Vec<_> = addr
            .to_socket_addrs()
            .map_err(|e| {
                Error::Usage({
                    format!("--listen {addr}: {e} (expected ADDR:PORT, e.g. {DEFAULT_LISTEN})")
                })
            })?
            .collect();
        let l = TcpListener::bind(&addrs[..]).map_err(|e| {
            Error::Refused(match e.kind() {
                std::io::ErrorKind::AddrInUse => {
                    format!(
                    "listening on {addr}: {e} (another server? choose another port with --listen)"
                )
                }
                _ => format!("listening on {addr}: {e}"),
            })
        })?;
        Some(l)
    } else {
        None
    };
    let metrics = args.metrics.as_deref().map(metrics::bind).transpose()?;
    Ok(Listeners { unix, tcp, metrics })
}

pub fn cmd_serve(args: ServeArgs, globals: &Globals) -> Result<ExitCode, Error> {
    let options = args.open_options()?;
    let config = args.server_config()?;
    // Before the volume is touched: the control socket's directory, and
    // the threads the server will need (a process limit fails here, not
    // after the volume was opened).
    let run_dir = crate::control::prepare_run_dir()?;
    probe_threads(2 * config.workers.max(CACHE_WORKERS_MIN) + 16)?;
    if let Some(p) = &args.trace {
        trace::check_new_file(p)?;
    }
    // From here on SIGTERM/SIGINT raise `stop` instead of killing.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone())
            .map_err(|e| Error::io("installing the signal handlers", e))?;
    }
    let purpose = Purpose::Serve {
        writable: !args.read_only,
    };
    if let Some(p) = &args.volume {
        crate::objvol::refuse_for_local(p, &args.object.flags(args.read_only))?;
        if let Some(url) = crate::objvol::url_of(p) {
            return serve_object(url, options, config, &args, &run_dir, &stop);
        }
    }
    let (path, store) = match &args.volume {
        Some(p) => (p.clone(), Some(volfile::open_volume_store(p, purpose)?)),
        None => {
            let p = PathBuf::from(DEFAULT_VOLUME);
            let store = if std::fs::symlink_metadata(&p).is_ok() {
                Some(volfile::open_volume_store(&p, purpose)?)
            } else {
                None
            };
            (p, store)
        }
    };
    let listeners = bind_listeners(&args)?;
    let store = match store {
        Some(s) => s,
        None => {
            let made = create::create_volume(
                &path,
                &CreateArgs {
                    size: DEFAULT_SIZE,
                    physical_size: None,
                    codec: "auto",
                    force: false,
                    dedup: true,
                    packing: cvol_format::superblock::Packing::Compact,
                    segment_size: None,
                    make_parent: true,
                    metadata_device: None,
                    metadata_size: None,
                    cache: None,
                    unsafe_no_fencing: false,
                },
            )?;
            tracing::info!("{made}");
            volfile::open_volume_store(&path, purpose)?
        }
    };
    // Bound before the volume opens: a squatted path refuses the start
    // with the volume untouched.
    let ctl = control_server::bind(&run_dir, &path)?;
    if stop.load(Ordering::SeqCst) {
        tracing::info!("stopped by a signal before opening {}", path.display());
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(label) = cache_label(&store) {
        return serve_cache(
            &path, store, &label, options, listeners, config, &args, ctl, &stop,
        );
    }
    let mut options = options;
    let store = volfile::with_metadata(&path, store, purpose, globals, &mut options)?;
    let vol = match volfile::open_with_progress(&path, store, options, Some(&stop)) {
        Opened::Volume(v) => Arc::new(*v),
        Opened::Failed(e) => return Err(e),
        Opened::Stopped => {
            // The open runs on; leaving now is as safe as a crash at start.
            tracing::info!(
                "stopped by a signal while opening {}: nothing was served",
                path.display()
            );
            return Ok(ExitCode::SUCCESS);
        }
    };
    let backend = Arc::new(backend::VolumeBackend {
        volume: vol.clone(),
    });
    let served = run(
        &path, &vol, backend, None, listeners, config, &args, ctl, &stop,
    );
    let closed = vol
        .close()
        .map_err(|e| Error::Refused(format!("final flush/checkpoint failed: {e}")));
    served?;
    closed?;
    tracing::info!("stopped cleanly");
    Ok(ExitCode::SUCCESS)
}

/// Serves a volume kept in an object store: claimed (fencing any older
/// server), recovered from the objects, served, then closed (a manifest,
/// the lease released).
fn serve_object(
    url: &str,
    options: OpenOptions,
    config: ServerConfig,
    args: &ServeArgs,
    run_dir: &Path,
    stop: &AtomicBool,
) -> Result<ExitCode, Error> {
    let listeners = bind_listeners(args)?;
    let store = crate::objvol::open(url, &args.object.flags(args.read_only))?;
    let path = Path::new(url);
    // Once claimed: a stopped older server's socket here is replaced.
    let ctl = control_server::bind(run_dir, path)?;
    let mut options = options;
    options.read_only = args.read_only;
    let vol = match volfile::open_with_progress(path, store.clone(), options, Some(stop)) {
        Opened::Volume(v) => Arc::new(*v),
        Opened::Failed(e) => return Err(e),
        Opened::Stopped => {
            tracing::info!("stopped by a signal while opening {url}: nothing was served");
            return Ok(ExitCode::SUCCESS);
        }
    };
    let backend = Arc::new(backend::VolumeBackend {
        volume: vol.clone(),
    });
    let served = run(
        path, &vol, backend, None, listeners, config, args, ctl, stop,
    );
    let closed = vol
        .close()
        .map_err(|e| Error::Refused(format!("final flush/checkpoint failed: {e}")));
    drop(vol);
    let stored = store.close().map_err(|e| Error::Refused(e.to_string()));
    served?;
    closed?;
    stored?;
    tracing::info!("stopped cleanly");
    Ok(ExitCode::SUCCESS)
}

/// Starts `n` threads (small stacks, parked until all are up) and ends
/// them: refused with the reason when the process may not have that many
/// (a process limit such as `ulimit -u`), before anything is opened.
fn probe_threads(n: usize) -> Result<(), Error> {
    let (tx, rx) = crossbeam_channel::bounded::<()>(0);
    let mut started = Vec::with_capacity(n);
    let mut failed = None;
    for _ in 0..n {
        let rx = rx.clone();
        match std::thread::Builder::new()
            .stack_size(64 << 10)
            .spawn(move || while rx.recv().is_ok() {})
        {
            Ok(h) => started.push(h),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    drop(tx);
    let got = started.len();
    for h in started {
        let _ = h.join();
    }
    match failed {
        None => Ok(()),
        Some(e) => Err(Error::Refused(format!(
            "cannot start the server's threads: {got} of the {n} needed started ({e}); \
             lower --workers or raise the process limit (ulimit -u)"
        ))),
    }
}

/// Worker threads of a cache's server at least (`--workers` overrides).
const CACHE_WORKERS_MIN: usize = 16;

/// The label of a cache volume (None: an ordinary volume, or a store
/// whose superblock the engine's open will judge).
fn cache_label(store: &FileStorage) -> Option<Result<CacheLabel, Error>> {
    let sb = [SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET]
        .iter()
        .find_map(|&at| {
            let mut b = vec![0u8; SUPERBLOCK_BYTES];
            store.read_at(at, &mut b).ok()?;
            Superblock::decode(&b).ok()
        })?;
    sb.is_cache().then(|| {
        cvol_engine::cache::read_label(store, &sb).map_err(|e| Error::Refused(e.to_string()))
    })
}

/// Serves a cache volume: its origin opened, the cache opened (warm, cold
/// or recovered), served until `stop`, then closed cleanly.
#[expect(
    clippy::too_many_arguments,
    reason = "cmd_serve's state, handed on once"
)]
fn serve_cache(
    path: &Path,
    store: FileStorage,
    label: &Result<CacheLabel, Error>,
    options: OpenOptions,
    listeners: Listeners,
    config: ServerConfig,
    args: &ServeArgs,
    ctl: control_server::Bound,
    stop: &AtomicBool,
) -> Result<ExitCode, Error> {
    let label = label
        .as_ref()
        .map_err(|e| Error::Refused(format!("{}: {e}", path.display())))?;
    // A miss holds a worker while the origin answers (milliseconds for a
    // disk or a remote server): more workers keep hits flowing meanwhile.
    let mut config = config;
    if args.workers.is_none() {
        config.workers = config.workers.max(CACHE_WORKERS_MIN);
    }
    let origin = origin::open(&label.origin, args.read_only)?;
    let cache = CacheVolume::open(Arc::new(store), origin.store, options, origin.stamp)
        .map_err(|e| Error::Refused(format!("{}: {e}", path.display())))?;
    tracing::info!(
        origin = %label.origin,
        mode = cache.mode().name(),
        start = cache.start().name(),
        "cache opened"
    );
    let vol = cache.volume().clone();
    let backend = Arc::new(backend::CacheBackend {
        cache: cache.clone(),
    });
    let served = run(
        path,
        &vol,
        backend,
        Some(&cache),
        listeners,
        config,
        args,
        ctl,
        stop,
    );
    let closed = cache
        .close()
        .map_err(|e| Error::Refused(format!("final write-back/flush/checkpoint failed: {e}")));
    served?;
    closed?;
    tracing::info!("stopped cleanly");
    Ok(ExitCode::SUCCESS)
}

/// Serves until `stop`; the caller closes the volume.
#[expect(clippy::too_many_arguments, reason = "the serve's parts, each named")]
fn run(
    path: &Path,
    vol: &Arc<Volume>,
    backend: Arc<dyn Backend>,
    cache: Option<&Arc<CacheVolume>>,
    listeners: Listeners,
    config: ServerConfig,
    args: &ServeArgs,
    ctl: control_server::Bound,
    stop: &AtomicBool,
) -> Result<(), Error> {
    let export = &args.export;
    let ctl = control_server::start(ctl, vol.clone())?;
    let reloader = edge::Reloader::install(&config)?;
    let recorder = args
        .trace
        .as_deref()
        .map(|p| trace::Recorder::create(p, backend.size_bytes()).map(Arc::new))
        .transpose()?;
    let backend = match &recorder {
        Some(r) => r.wrap(backend),
        None => backend,
    };
    let mut config = config;
    let backend = match listeners.metrics {
        Some(l) => {
            let m = Arc::new(metrics::Metrics::new(
                &path.display().to_string(),
                vol.clone(),
            ));
            let local = l
                .local_addr()
                .map_err(|e| Error::io("the metrics listener's address", e))?;
            metrics::serve(l, m.clone())?;
            tracing::info!("metrics at http://{local}/metrics");
            config.observer = Some(m.observer());
            m.wrap(backend)
        }
        None => backend,
    };
    let scheme = if args.edge.tls_enabled() {
        "nbds"
    } else {
        "nbd"
    };
    let server = Server::new(backend, config);
    let cache_worker = cache
        .filter(|_| !args.read_only)
        .map(|c| c.start_background());
    let mut uris = Vec::new();
    let mut socket_file = None;
    if let Some((l, file)) = listeners.unix {
        server
            .serve_unix(l)
            .map_err(|e| Error::Refused(e.to_string()))?;
        if let Some(sock) = &args.socket {
            uris.push(format!(
                "{scheme}+unix:///{export}?socket={}",
                sock.display()
            ));
        }
        socket_file = Some(file);
    }
    if let Some(l) = listeners.tcp {
        let local = l
            .local_addr()
            .map_err(|e| Error::io("the listener's address", e))?;
        server
            .serve_tcp(l)
            .map_err(|e| Error::Refused(e.to_string()))?;
        uris.push(format!("{scheme}://{local}/{export}"));
    }
    let background_cleaner = (!args.read_only).then(|| vol.start_background_cleaner());
    // Checkpoints a FLUSH finds due are written here: no request waits for one.
    let checkpointer = vol.start_background_checkpointer();
    // Policy auto: rewrite cold fast-codec data with the strong codec when idle.
    let recompressor = vol.start_background_recompressor();
    // The dedup index is memory only: refill it from the fingerprint
    // tables (or the data of an older volume) while clients are idle.
    let index_warmup = (!args.read_only).then(|| vol.start_index_warmup());
    let metadata = vol
        .stats()
        .metadata_device
        .unwrap_or_else(|| "in the volume".into());
    tracing::info!(
        volume = %path.display(),
        metadata = %metadata,
        read_only = args.read_only,
        sync = args.sync,
        "serving"
    );
    let mut out = std::io::stdout().lock();
    for u in &uris {
        writeln!(out, "{u}").map_err(|e| Error::io("stdout", e))?;
    }
    out.flush().map_err(|e| Error::io("stdout", e))?;
    drop(out);
    let mut systemd = service::Systemd::ready(&uris);
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(std::time::Duration::from_millis(50));
        reloader.poll();
        systemd.tick(vol);
    }
    systemd.stopping();
    tracing::info!("stopping: finishing in-flight requests");
    server.shutdown();
    if let Some(r) = &recorder {
        r.finish();
    }
    drop(cache_worker);
    drop(socket_file);
    drop(index_warmup);
    drop(recompressor);
    drop(background_cleaner);
    drop(checkpointer);
    drop(ctl);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(flags: &[&str]) -> ServeArgs {
        Cmd::try_parse_from(std::iter::once("serve").chain(flags.iter().copied()))
            .unwrap()
            .serve
    }

    #[test]
    fn defaults_are_the_engine_and_server_defaults() {
        let a = parse(&[]);
        let o = a.open_options().unwrap();
        let d = OpenOptions::default();
        assert_eq!(o.cleaner.low_free_percent, 10);
        assert_eq!(o.cleaner.high_free_percent, 25);
        assert_eq!(o.dedup_memory_bytes, None, "scaled to the volume");
        assert_eq!(o.read_cache_bytes, d.read_cache_bytes);
        assert_eq!(o.elastic.unit_blocks, 4);
        assert_eq!(o.elastic.busy_iops, d.elastic.busy_iops);
        assert!(o.elastic.recompress && !o.read_only && !o.sync_writes);
        assert_eq!(o.elastic.inline_cpu_percent, d.elastic.inline_cpu_percent);
        let c = a.server_config().unwrap();
        let dc = ServerConfig::default();
        assert_eq!(c.max_connections, dc.max_connections);
        assert_eq!(c.max_buffered_bytes, dc.max_buffered_bytes);
        assert_eq!(c.handshake_timeout, dc.handshake_timeout);
        assert_eq!(
            c.max_connections_per_address,
            dc.max_connections_per_address
        );
        assert_eq!(c.max_handshaking, dc.max_handshaking);
        assert_eq!(c.idle_timeout, None);
        assert_eq!(c.export_name, "");
    }

    #[test]
    fn inline_cpu_takes_a_percentage_or_off() {
        let pct = |v: &str| parse(&["--inline-cpu", v]).open_options();
        assert_eq!(pct("off").unwrap().elastic.inline_cpu_percent, None);
        assert_eq!(pct("0").unwrap().elastic.inline_cpu_percent, Some(0));
        assert_eq!(pct("45%").unwrap().elastic.inline_cpu_percent, Some(45));
        for bad in ["101", "1.5", "of", ""] {
            let e = pct(bad).unwrap_err().to_string();
            assert!(e.contains("--inline-cpu") && e.contains("0 to 100"), "{e}");
        }
    }

    #[test]
    fn each_group_names_its_flag() {
        let err = |flags: &[&str]| {
            let a = parse(flags);
            a.open_options()
                .and_then(|_| a.server_config().map(|_| OpenOptions::default()))
                .err()
                .unwrap()
                .to_string()
        };
        assert!(err(&["--clean-start", "30"]).contains("--clean-start 30"));
        assert!(err(&["--read-cache", "lots"]).starts_with("--read-cache"));
        assert!(err(&["--map-cache", "4k"]).starts_with("--map-cache"));
        assert!(parse(&["--map-cache", "64k"]).open_options().is_ok());
        assert!(err(&["--map-cache", "lots"]).starts_with("--map-cache"));
        assert!(err(&["--unit-size", "3K"]).contains("--unit-size 3K"));
        assert!(err(&["--idle-iops", "9", "--busy-iops", "9"]).contains("--idle-iops 9"));
        let refused = |flags: &[&str]| {
            let args = std::iter::once("serve").chain(flags.iter().copied());
            Cmd::try_parse_from(args).err().unwrap().to_string()
        };
        let e = refused(&["--recompress", "yes"]);
        assert!(
            e.contains("--recompress takes on or off, not \"yes\""),
            "{e}"
        );
        let e = refused(&["--cleaner", "fifo"]);
        assert!(e.contains("--cleaner takes cost-benefit or greedy"), "{e}");
        assert!(err(&["--max-connections", "0"]).contains("--max-connections"));
        assert!(err(&["--max-buffered", "4K"]).contains("--max-buffered 4K"));
        assert!(err(&["--handshake-timeout", "0"]).contains("--handshake-timeout"));
        let e = err(&[
            "--tls",
            "on",
            "--tls-certificates",
            "/p",
            "--tls-verify-peer",
        ]);
        assert!(e.contains("use --tls require"), "{e}");
        assert!(err(&["--socket", "/s", "--allow", "::1"]).starts_with("--allow"));
        let reach = |flags: &[&str]| {
            let args = parse(flags);
            let (r, a) = args.tcp_reach();
            (r, a.to_string())
        };
        assert_eq!(reach(&[]), (edge::Reach::Loopback, DEFAULT_LISTEN.into()));
        assert_eq!(reach(&["--socket", "/s"]).0, edge::Reach::NoTcp);
        assert_eq!(reach(&["--listen", "[::1]:9"]).0, edge::Reach::Loopback);
        let r = reach(&["--listen", "0.0.0.0:9", "--socket", "/s"]);
        assert_eq!(r, (edge::Reach::Network, "0.0.0.0:9".into()));
        let e = err(&["--max-connections-per-address", "0"]);
        assert!(e.contains("--max-connections-per-address"), "{e}");
        let e = err(&["--max-handshaking", "300"]);
        assert!(
            e.contains("--max-handshaking 300") && e.contains("(256)"),
            "{e}"
        );
        for bad in ["0", "soon", "1.5", "18446744073709551616"] {
            let e = err(&["--idle-timeout", bad]);
            assert!(e.contains(&format!("--idle-timeout {bad}")), "{e}");
        }
        let limits = |flags: &[&str]| parse(flags).server_config().unwrap();
        let c = limits(&["--max-connections", "40", "--idle-timeout", "600"]);
        assert_eq!(c.max_handshaking, 16);
        assert_eq!(limits(&["--max-connections", "8"]).max_handshaking, 8);
        assert_eq!(limits(&["--max-connections", "400"]).max_handshaking, 100);
        assert_eq!(c.idle_timeout, Some(std::time::Duration::from_secs(600)));
        // The cleaner is checked first, as it always was.
        assert!(err(&["--unit-size", "3K", "--clean-stop", "95"]).contains("--clean-start"));
        // Absurd numbers are refused with the range, never a panic.
        let e = err(&["--handshake-timeout", "18446744073709551615"]);
        assert!(e.contains("from 1 to 3600"), "{e}");
        assert!(err(&["--workers", "5000"]).contains("at most 1024"));
        for (flag, v) in [
            ("--read-cache", "99999T"),
            ("--dedup-memory", "0"),
            ("--dedup-memory", "99999T"),
            ("--map-cache", "99999T"),
            ("--max-buffered", "99999T"),
        ] {
            let e = err(&[flag, v]);
            assert!(e.starts_with(&format!("{flag} {v}: ")), "{e}");
        }
        assert_eq!(
            parse(&["--read-cache", "0"])
                .open_options()
                .unwrap()
                .read_cache_bytes,
            Some(0)
        );
        let a = parse(&["--workers", "0", "--export", "x", "--read-only"]);
        assert_eq!(a.server_config().unwrap().workers, 1);
        assert_eq!(a.server_config().unwrap().export_name, "x");
        assert!(a.open_options().unwrap().read_only);
    }

    /// The thread probe starts and ends its threads (a process limit is
    /// tried end to end: scripts/e2e/hostile-local.sh).
    #[test]
    fn thread_probe_starts_and_ends_its_threads() {
        probe_threads(64).unwrap();
    }
}
