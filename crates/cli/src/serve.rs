//! `cvol serve`. A start that fails leaves the volume untouched: the
//! arguments are checked, the volume file is checked and locked, and every
//! listener is bound before the volume is opened (opening writes it).
//! SIGTERM/SIGINT at any point stop it cleanly (exit 0).
use crate::create::{self, CreateArgs};
use crate::volfile::{self, Opened, Purpose};
use crate::{backend, control, sockfile, Limits};
use cvol_engine::{CleanerConfig, ElasticConfig, OpenOptions, Volume};
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

pub struct ServeArgs {
    pub volume: Option<PathBuf>,
    pub socket: Option<PathBuf>,
    pub listen: Option<String>,
    pub export: String,
    pub read_only: bool,
    pub sync: bool,
    pub workers: Option<usize>,
    pub cleaner: CleanerConfig,
    pub dedup_memory: u64,
    pub read_cache: u64,
    pub elastic: ElasticConfig,
    pub limits: Limits,
}

/// The bound listeners (the Unix socket file goes with its listener).
struct Listeners {
    unix: Option<(UnixListener, sockfile::SocketFile)>,
    tcp: Option<TcpListener>,
}

fn bind_listeners(socket: Option<&Path>, listen: Option<&str>) -> Result<Listeners, String> {
    let unix = socket.map(|s| sockfile::bind(s, "--socket")).transpose()?;
    let tcp = if listen.is_some() || socket.is_none() {
        let addr = listen.unwrap_or(DEFAULT_LISTEN);
        let addrs: Vec<_> = addr
            .to_socket_addrs()
            .map_err(|e| {
                format!("--listen {addr}: {e} (expected ADDR:PORT, e.g. {DEFAULT_LISTEN})")
            })?
            .collect();
        let l = TcpListener::bind(&addrs[..]).map_err(|e| match e.kind() {
            std::io::ErrorKind::AddrInUse => {
                format!(
                    "listening on {addr}: {e} (another server? choose another port with --listen)"
                )
            }
            _ => format!("listening on {addr}: {e}"),
        })?;
        Some(l)
    } else {
        None
    };
    Ok(Listeners { unix, tcp })
}

pub fn cmd_serve(args: ServeArgs) -> Result<ExitCode, String> {
    // From here on SIGTERM/SIGINT raise `stop` instead of killing.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone()).map_err(|e| e.to_string())?;
    }
    let purpose = Purpose::Serve {
        writable: !args.read_only,
    };
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
    let listeners = bind_listeners(args.socket.as_deref(), args.listen.as_deref())?;
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
                    segment_size: None,
                    make_parent: true,
                },
            )?;
            tracing::info!("{made}");
            volfile::open_volume_store(&path, purpose)?
        }
    };
    if stop.load(Ordering::SeqCst) {
        tracing::info!("stopped by a signal before opening {}", path.display());
        return Ok(ExitCode::SUCCESS);
    }
    let options = OpenOptions {
        read_only: args.read_only,
        sync_writes: args.sync,
        cleaner: args.cleaner,
        dedup_memory_bytes: args.dedup_memory,
        read_cache_bytes: args.read_cache,
        elastic: args.elastic,
        ..OpenOptions::default()
    };
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
    let served = run(&path, &vol, listeners, &args, &stop);
    let closed = vol
        .close()
        .map_err(|e| format!("final flush/checkpoint failed: {e}"));
    served?;
    closed?;
    tracing::info!("stopped cleanly");
    Ok(ExitCode::SUCCESS)
}

/// Serves until `stop`; the caller closes the volume.
fn run(
    path: &Path,
    vol: &Arc<Volume>,
    listeners: Listeners,
    args: &ServeArgs,
    stop: &AtomicBool,
) -> Result<(), String> {
    let export = &args.export;
    let mut config = ServerConfig {
        export_name: export.clone(),
        max_connections: args.limits.max_connections,
        max_buffered_bytes: args.limits.max_buffered,
        handshake_timeout: args.limits.handshake_timeout,
        ..ServerConfig::default()
    };
    if let Some(w) = args.workers {
        config.workers = w.max(1);
    }
    let ctl = control::start(path, vol.clone())?;
    let server = Server::new(
        Arc::new(backend::VolumeBackend {
            volume: vol.clone(),
        }),
        config,
    );
    let mut uris = Vec::new();
    let mut socket_file = None;
    if let Some((l, file)) = listeners.unix {
        server.serve_unix(l).map_err(|e| e.to_string())?;
        if let Some(sock) = &args.socket {
            uris.push(format!("nbd+unix:///{export}?socket={}", sock.display()));
        }
        socket_file = Some(file);
    }
    if let Some(l) = listeners.tcp {
        let local = l.local_addr().map_err(|e| e.to_string())?;
        server.serve_tcp(l).map_err(|e| e.to_string())?;
        uris.push(format!("nbd://{local}/{export}"));
    }
    let background_cleaner = (!args.read_only).then(|| vol.start_background_cleaner());
    // Policy auto: rewrite cold fast-codec data with the strong codec when idle.
    let recompressor = vol.start_background_recompressor();
    // The dedup index is not persisted: refill it from the volume's data
    // while clients are idle.
    let index_warmup = (!args.read_only).then(|| vol.start_index_warmup());
    tracing::info!(volume = %path.display(), read_only = args.read_only, sync = args.sync, "serving");
    let mut out = std::io::stdout().lock();
    for u in &uris {
        writeln!(out, "{u}").map_err(|e| e.to_string())?;
    }
    out.flush().map_err(|e| e.to_string())?;
    drop(out);
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    tracing::info!("stopping: finishing in-flight requests");
    server.shutdown();
    drop(socket_file);
    drop(index_warmup);
    drop(recompressor);
    drop(background_cleaner);
    drop(ctl);
    Ok(())
}
