//! `cvol serve`. A start that fails leaves the volume untouched: the
//! arguments are checked, the volume file is checked and locked, and every
//! listener is bound before the volume is opened (opening writes it).
//! SIGTERM/SIGINT at any point stop it cleanly (exit 0).
use crate::create::{self, CreateArgs};
use crate::error::Error;
use crate::volfile::{self, Globals, Opened, Purpose};
use crate::{backend, control_server, edge, metrics, origin, service, sockfile, trace};
use cvol_cache::{CacheLabel, CacheVolume};
use cvol_engine::pool::Pool;
use cvol_engine::{OpenOptions, Volume};
use cvol_format::superblock::{Superblock, SUPERBLOCK_BYTES};
use cvol_format::{SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET};
use cvol_nbd::Backend;
use cvol_storage::{FileStorage, Storage};
pub use flags::ServeArgs;

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

/// What a serve has checked and set up before it touches the volume.
struct Prepared {
    options: OpenOptions,
    config: ServerConfig,
    /// The control socket's directory.
    run_dir: PathBuf,
    /// Raised by SIGTERM/SIGINT.
    stop: Arc<AtomicBool>,
}

/// Checks the flags; makes the control socket's directory; makes sure the
/// threads the server will need can start (a process limit fails here,
/// not after the volume was opened) and that a trace file is new; from
/// then on SIGTERM/SIGINT raise `stop` instead of killing.
fn prepare(args: &ServeArgs) -> Result<Prepared, Error> {
    let options = args.open_options()?;
    let config = args.server_config()?;
    if !config.busy_poll.is_zero() && std::fs::read("/proc/pressure/cpu").is_err() {
        tracing::warn!(
            "--busy-poll: this kernel reports no CPU pressure (/proc/pressure/cpu; \
             boot with psi=1), so the server cannot tell when polling would take a core \
             from other work: it does not poll"
        );
    }
    let run_dir = crate::control::prepare_run_dir()?;
    probe_threads(2 * config.workers.max(CACHE_WORKERS_MIN) + 16)?;
    if let Some(p) = &args.trace {
        trace::check_new_file(p)?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone())
            .map_err(|e| Error::io("installing the signal handlers", e))?;
    }
    Ok(Prepared {
        options,
        config,
        run_dir,
        stop,
    })
}

pub fn cmd_serve(args: ServeArgs, globals: &Globals) -> Result<ExitCode, Error> {
    let Prepared {
        options,
        config,
        run_dir,
        stop,
    } = prepare(&args)?;
    let purpose = Purpose::Serve {
        writable: !args.read_only,
    };
    if let Some(p) = &args.volume {
        crate::objvol::refuse_for_local(p, &args.object.flags(args.read_only))?;
        if let Some(url) = crate::objvol::url_of(p) {
            return serve_object(url, options, config, &args, &run_dir, &stop);
        }
    }
    let (path, store) = find_store(&args, purpose)?;
    let listeners = bind_listeners(&args)?;
    let store = match store {
        Some(s) => s,
        None => create_default(&path, purpose)?,
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
    let pool = Arc::new(
        Pool::attach(vol.clone())
            .map_err(|e| Error::Refused(format!("{}: {e}", path.display())))?,
    );
    let names: Vec<String> = pool.volumes().into_iter().map(|v| v.name).collect();
    tracing::info!("pool of {} volume(s): {}", names.len(), names.join(", "));
    let only = exports::only(&pool, &args.export)
        .map_err(|e| Error::Usage(format!("--export {}: {e}", args.export)))?;
    let served = run(
        &path,
        &vol,
        Serving::Pool(pool, only),
        None,
        listeners,
        config,
        &args,
        ctl,
        &stop,
    );
    let closed = vol
        .close()
        .map_err(|e| Error::Refused(format!("final flush/checkpoint failed: {e}")));
    served?;
    closed?;
    tracing::info!("stopped cleanly");
    Ok(ExitCode::SUCCESS)
}

/// The local volume to serve and its store: the path given, or the
/// default volume (no store if it does not exist yet).
fn find_store(args: &ServeArgs, purpose: Purpose) -> Result<(PathBuf, Option<FileStorage>), Error> {
    Ok(match &args.volume {
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
    })
}

/// Creates the default volume (16 GiB, its directory too) and opens its store.
fn create_default(path: &Path, purpose: Purpose) -> Result<FileStorage, Error> {
    let made = create::create_volume(
        path,
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
            encryption: None,
        },
    )?;
    tracing::info!("{made}");
    volfile::open_volume_store(path, purpose)
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
        Opened::Failed(e) => {
            // A wrong key, say: the next server need not wait for the lease.
            store.release();
            return Err(e);
        }
        Opened::Stopped => {
            store.release();
            tracing::info!("stopped by a signal while opening {url}: nothing was served");
            return Ok(ExitCode::SUCCESS);
        }
    };
    // One volume, served as a pool of one (`default`, also under "").
    let pool =
        Arc::new(Pool::attach(vol.clone()).map_err(|e| Error::Refused(format!("{url}: {e}")))?);
    let only = exports::only(&pool, &args.export)
        .map_err(|e| Error::Usage(format!("--export {}: {e}", args.export)))?;
    let served = run(
        path,
        &vol,
        Serving::Pool(pool, only),
        None,
        listeners,
        config,
        args,
        ctl,
        stop,
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
    sb.is_cache()
        .then(|| cvol_cache::read_label(store, &sb).map_err(|e| Error::Refused(e.to_string())))
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
        Serving::One(backend),
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
    serving: Serving,
    cache: Option<&Arc<CacheVolume>>,
    listeners: Listeners,
    config: ServerConfig,
    args: &ServeArgs,
    ctl: control_server::Bound,
    stop: &AtomicBool,
) -> Result<(), Error> {
    let pool = match &serving {
        Serving::Pool(p, _) => Some(p.clone()),
        Serving::One(_) => None,
    };
    let ctl = control_server::start(ctl, vol.clone(), pool)?;
    let reloader = edge::Reloader::install(&config)?;
    let traced_size = match &serving {
        Serving::One(b) => b.size_bytes(),
        Serving::Pool(p, _) => p.logical_bytes(),
    };
    let recorder = args
        .trace
        .as_deref()
        .map(|p| trace::Recorder::create(p, traced_size).map(Arc::new))
        .transpose()?;
    let recorder_finish = recorder.clone();
    let mut config = config;
    let metrics = with_metrics(path, vol, listeners.metrics, &mut config)?;
    let wrap = wrapper(recorder, metrics);
    let server = match serving {
        Serving::One(b) => Server::new(wrap(b), config),
        Serving::Pool(pool, only) => Server::with_exports(
            Arc::new(exports::PoolExports::new(pool, only, wrap)),
            config,
        ),
    };
    vol.set_edge_memory(Box::new(server.buffered_payload_gauge()));
    let cache_worker = cache
        .filter(|_| !args.read_only)
        .map(|c| c.start_background());
    let (uris, socket_file) = listen(&server, listeners.unix, listeners.tcp, args)?;
    let background_cleaner = (!args.read_only).then(|| vol.start_background_cleaner());
    // Checkpoints a FLUSH finds due are written here: no request waits for one.
    let checkpointer = vol.start_background_checkpointer();
    // Policy auto: rewrite cold fast-codec data with the strong codec when idle.
    let recompressor = vol.start_background_recompressor();
    // The dedup index is memory only: refill it from the fingerprint
    // tables (or the data of an older volume) while clients are idle.
    let index_warmup = (!args.read_only).then(|| vol.start_index_warmup());
    announce(path, vol, args, &uris)?;
    let mut systemd = service::Systemd::ready(&uris);
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(std::time::Duration::from_millis(50));
        reloader.poll();
        systemd.tick(vol);
    }
    systemd.stopping();
    tracing::info!("stopping: finishing in-flight requests");
    server.shutdown();
    drop(server);
    if let Some(r) = &recorder_finish {
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

/// How each export's backend is wrapped: traced (`--trace`), then
/// counted and timed (`--metrics`).
fn wrapper(
    recorder: Option<Arc<trace::Recorder>>,
    metrics: Option<Arc<metrics::Metrics>>,
) -> exports::Wrap {
    Arc::new(move |b| {
        let b = match &recorder {
            Some(r) => r.wrap(b),
            None => b,
        };
        match &metrics {
            Some(m) => m.wrap(b),
            None => b,
        }
    })
}

/// `--metrics`: the backend counted and timed, the exporter serving.
fn with_metrics(
    path: &Path,
    vol: &Arc<Volume>,
    listener: Option<TcpListener>,
    config: &mut ServerConfig,
) -> Result<Option<Arc<metrics::Metrics>>, Error> {
    let Some(l) = listener else {
        return Ok(None);
    };
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
    Ok(Some(m))
}

/// Starts serving on the bound listeners: the URIs clients use, and the
/// socket file (removed when dropped).
fn listen(
    server: &Server,
    unix: Option<(UnixListener, sockfile::SocketFile)>,
    tcp: Option<TcpListener>,
    args: &ServeArgs,
) -> Result<(Vec<String>, Option<sockfile::SocketFile>), Error> {
    let export = &args.export;
    let scheme = if args.edge.tls_enabled() {
        "nbds"
    } else {
        "nbd"
    };
    let mut uris = Vec::new();
    let mut socket_file = None;
    if let Some((l, file)) = unix {
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
    if let Some(l) = tcp {
        let local = l
            .local_addr()
            .map_err(|e| Error::io("the listener's address", e))?;
        server
            .serve_tcp(l)
            .map_err(|e| Error::Refused(e.to_string()))?;
        uris.push(format!("{scheme}://{local}/{export}"));
    }
    Ok((uris, socket_file))
}

/// Logs what is served and prints the URIs on stdout, one a line.
fn announce(path: &Path, vol: &Volume, args: &ServeArgs, uris: &[String]) -> Result<(), Error> {
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
    for u in uris {
        writeln!(out, "{u}").map_err(|e| Error::io("stdout", e))?;
    }
    out.flush().map_err(|e| Error::io("stdout", e))
}

/// What a server serves: one backend (a cache, an object-store volume),
/// or a pool's volumes by name (all, or the one `--export` names).
enum Serving {
    One(Arc<dyn Backend>),
    Pool(Arc<Pool>, Option<exports::Only>),
}

mod exports;
mod flags;
#[cfg(test)]
mod tests;
