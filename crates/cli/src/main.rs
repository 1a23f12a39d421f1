//! `cvol`: create, serve, inspect and verify compressed volumes.
mod backend;
mod control;
mod scrub;
mod size;

use clap::{Parser, Subcommand};
use cvol_engine::segments::VictimPolicy;
use cvol_engine::{CleanerConfig, CodecPolicy, CreateOptions, ElasticConfig, OpenOptions, Volume};
use cvol_nbd::{Server, ServerConfig};
use cvol_storage::{FileStorage, Storage};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const DEFAULT_VOLUME: &str = "cvol-data/default.cvol";
const DEFAULT_SIZE: &str = "16G";
const DEFAULT_LISTEN: &str = "127.0.0.1:10809";
/// Metadata area plus two 1 MiB segments.
const MIN_PHYSICAL_BYTES: u64 = 3 << 20;

#[derive(Parser)]
#[command(
    name = "cvol",
    version,
    about = "A compressed, crash-safe block device served over NBD"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create a volume on a file (created sparse) or an existing block device.
    Create {
        volume: PathBuf,
        /// Logical size clients see (e.g. 64M, 16G, 1T); may exceed the physical size.
        #[arg(long)]
        size: String,
        /// Backing bytes the volume may use (default: the file's --size, or the device size).
        #[arg(long)]
        physical_size: Option<String>,
        /// auto (elastic: lz4 when busy, zstd when idle, background
        /// recompression to zstd:9), auto:zstd:LEVEL (another strong level),
        /// or one fixed codec for every block: lz4, zstd:LEVEL (1-19), none.
        #[arg(long, default_value = "auto")]
        codec: String,
        /// Overwrite an existing volume.
        #[arg(long)]
        force: bool,
        /// Inline deduplication of 4 KiB blocks: on or off.
        #[arg(long, default_value = "on")]
        dedup: String,
        /// Segment size (power of two, 1M to 1G; default 4M, or 1M below 1 GiB physical).
        #[arg(long, hide = true)]
        segment_size: Option<String>,
    },
    /// Serve a volume over NBD (default: ./cvol-data/default.cvol, created if absent).
    Serve {
        volume: Option<PathBuf>,
        /// Listen on a Unix socket.
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Listen on TCP ADDR:PORT (default 127.0.0.1:10809 when no --socket is given).
        #[arg(long)]
        listen: Option<String>,
        /// Export name (clients asking for "" get it too).
        #[arg(long, default_value = "")]
        export: String,
        #[arg(long)]
        read_only: bool,
        /// Make every write durable before replying.
        #[arg(long)]
        sync: bool,
        /// Worker threads running requests (default: 2 per core, at least 4).
        #[arg(long)]
        workers: Option<usize>,
        /// Cleaner victim policy: cost-benefit (LFS) or greedy (fewest live bytes).
        #[arg(long, default_value = "cost-benefit")]
        cleaner: String,
        /// The background cleaner starts when free segments fall below this percentage...
        #[arg(long, default_value_t = 10)]
        clean_start: u64,
        /// ...and stops once they are above this one.
        #[arg(long, default_value_t = 25)]
        clean_stop: u64,
        /// Memory for the dedup fingerprint index (32 bytes per block remembered).
        #[arg(long, default_value = "128M")]
        dedup_memory: String,
        /// Memory for the cache of recently read, decompressed blocks (0 disables it).
        #[arg(long, default_value = "32M")]
        read_cache: String,
        /// Largest merged compression unit (4K to 64K, a power of two):
        /// contiguous blocks of one write inside an aligned window of this
        /// size are compressed together.
        #[arg(long, default_value = "16K")]
        unit_size: String,
        /// Codec policy auto: 4 KiB-normalised requests per second at or
        /// above which the load is busy (lz4)...
        #[arg(long, default_value_t = ElasticConfig::default().busy_iops)]
        busy_iops: u64,
        /// ...and below which it is idle (the strong zstd level); between
        /// the two, zstd:1.
        #[arg(long, default_value_t = ElasticConfig::default().idle_iops)]
        idle_iops: u64,
        /// Codec policy auto: rewrite cold lz4 data and small units with the
        /// strong codec while clients are idle (on or off).
        #[arg(long, default_value = "on")]
        recompress: String,
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
    },
    /// Show space and reduction statistics (asks the server when the volume is served).
    Stat {
        volume: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Verify every record and all metadata offline; exit 0 only if consistent.
    Check {
        volume: PathBuf,
        #[arg(long)]
        json: bool,
        /// Repair what redundancy and the log allow first: rewrite a damaged
        /// superblock copy, rebuild a lost checkpoint from the log, write
        /// fresh checkpoints; then check and list what could not be saved.
        #[arg(long)]
        repair: bool,
    },
    /// Verify every block (record checksum, map identity, decompression),
    /// both superblock copies and the newest checkpoint, at a limited rate.
    /// A served volume is scrubbed by its server in the background while
    /// it keeps serving; otherwise the volume is opened read-only and
    /// scrubbed here. Exit 0 clean, 1 problems found (listed by LBA), 2 error.
    Scrub {
        volume: PathBuf,
        /// Logical data verified per second at most (e.g. 64M or 64M/s; 0: no limit).
        #[arg(long, default_value = "64M")]
        rate: String,
        #[arg(long)]
        json: bool,
        /// Served volume: start the scrub and return (see --status, `cvol stat`).
        #[arg(long)]
        no_wait: bool,
        /// Served volume: print the running scrub's progress and the last report.
        #[arg(long, conflicts_with = "no_wait")]
        status: bool,
    },
}

fn main() -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CVOL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Create {
            volume,
            size,
            physical_size,
            codec,
            force,
            dedup,
            segment_size,
        } => on_off("--dedup", &dedup).and_then(|dedup| {
            cmd_create(
                &volume,
                &size,
                physical_size.as_deref(),
                &codec,
                force,
                dedup,
                segment_size.as_deref(),
            )
        }),
        Command::Serve {
            volume,
            socket,
            listen,
            export,
            read_only,
            sync,
            workers,
            cleaner,
            clean_start,
            clean_stop,
            dedup_memory,
            read_cache,
            unit_size,
            busy_iops,
            idle_iops,
            recompress,
            max_connections,
            max_buffered,
            handshake_timeout,
        } => cleaner_config(&cleaner, clean_start, clean_stop).and_then(|cleaner| {
            cmd_serve(ServeArgs {
                dedup_memory: size::parse_size(&dedup_memory)?,
                read_cache: size::parse_size(&read_cache)?,
                elastic: elastic_config(&unit_size, busy_iops, idle_iops, &recompress)?,
                limits: limits(max_connections, &max_buffered, handshake_timeout)?,
                volume,
                socket,
                listen,
                export,
                read_only,
                sync,
                workers,
                cleaner,
            })
        }),
        Command::Stat { volume, json } => cmd_stat(&volume, json),
        Command::Check {
            volume,
            json,
            repair: false,
        } => cmd_check(&volume, json),
        Command::Check {
            volume,
            json,
            repair: true,
        } => cmd_repair(&volume, json),
        Command::Scrub {
            volume,
            rate,
            json,
            no_wait,
            status,
        } => scrub::cmd_scrub(
            &volume,
            scrub::ScrubArgs {
                rate: &rate,
                json,
                no_wait,
                status,
            },
        ),
    };
    match r {
        Ok(code) => code,
        Err(msg) => {
            eprintln!("cvol: {msg}");
            ExitCode::from(2)
        }
    }
}

/// Client limits of the NBD server (validated at the edge).
struct Limits {
    max_connections: usize,
    max_buffered: u64,
    handshake_timeout: std::time::Duration,
}

fn limits(
    max_connections: usize,
    max_buffered: &str,
    handshake_secs: u64,
) -> Result<Limits, String> {
    let max_buffered_bytes = size::parse_size(max_buffered)?;
    let min = u64::from(ServerConfig::default().max_request_bytes);
    if max_connections == 0 {
        return Err("--max-connections must be at least 1".into());
    }
    if max_buffered_bytes < min {
        return Err(format!(
            "--max-buffered {max_buffered} must be at least one request ({min} bytes)"
        ));
    }
    if handshake_secs == 0 {
        return Err("--handshake-timeout must be at least 1 second".into());
    }
    Ok(Limits {
        max_connections,
        max_buffered: max_buffered_bytes,
        handshake_timeout: std::time::Duration::from_secs(handshake_secs),
    })
}

fn elastic_config(
    unit_size: &str,
    busy_iops: u64,
    idle_iops: u64,
    recompress: &str,
) -> Result<ElasticConfig, String> {
    let unit = size::parse_size(unit_size)?;
    if !(4096..=65536).contains(&unit) || !unit.is_power_of_two() {
        return Err(format!(
            "--unit-size {unit_size} must be a power of two from 4K to 64K"
        ));
    }
    if idle_iops >= busy_iops {
        return Err(format!(
            "--idle-iops {idle_iops} must be below --busy-iops {busy_iops}"
        ));
    }
    Ok(ElasticConfig {
        unit_blocks: (unit / 4096) as u32,
        busy_iops,
        idle_iops,
        recompress: on_off("--recompress", recompress)?,
        ..ElasticConfig::default()
    })
}

fn on_off(flag: &str, v: &str) -> Result<bool, String> {
    match v {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{flag} takes on or off, not {v:?}")),
    }
}

fn looks_like_volume(path: &Path) -> bool {
    let Ok(st) = FileStorage::open(path, false, false) else {
        return false;
    };
    let mut b = [0u8; 8];
    st.read_at(0, &mut b).is_ok() && &b == b"CVOLSUPR"
}

fn cmd_create(
    path: &Path,
    size: &str,
    physical: Option<&str>,
    codec: &str,
    force: bool,
    dedup: bool,
    segment_size: Option<&str>,
) -> Result<ExitCode, String> {
    let logical = size::parse_size(size)?;
    if logical == 0 || logical % 4096 != 0 {
        return Err(format!(
            "--size {size} must be a non-zero multiple of 4096 bytes"
        ));
    }
    let codec = CodecPolicy::parse(codec)?;
    let is_block = std::fs::metadata(path).map(|m| {
        use std::os::unix::fs::FileTypeExt;
        m.file_type().is_block_device()
    });
    let exists = is_block.is_ok();
    let is_block = is_block.unwrap_or(false);
    if exists && !force {
        let non_empty = std::fs::metadata(path)
            .map(|m| m.len() > 0)
            .unwrap_or(false);
        if looks_like_volume(path) || (!is_block && non_empty) {
            return Err(format!(
                "{} already exists; pass --force to overwrite it",
                path.display()
            ));
        }
    }
    let physical = match physical {
        Some(p) => size::parse_size(p)?,
        None if is_block => FileStorage::open(path, false, false)
            .map_err(|e| e.to_string())?
            .len_bytes(),
        // A tiny file volume still needs its metadata and two segments.
        None => logical.max(MIN_PHYSICAL_BYTES),
    };
    let storage = if is_block {
        FileStorage::open(path, true, true)
    } else {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        }
        FileStorage::create(path, physical)
    }
    .map_err(|e| format!("{}: {e}", path.display()))?;
    let segment_size_bytes = segment_size.map(size::parse_size).transpose()?.unwrap_or(0);
    let opts = CreateOptions {
        logical_size_bytes: logical,
        physical_size_bytes: physical,
        codec,
        segment_size_bytes,
        dedup,
    };
    let vol =
        Volume::create(Arc::new(storage), &opts).map_err(|e| format!("{}: {e}", path.display()))?;
    vol.close().map_err(|e| e.to_string())?;
    println!(
        "created {}: {} logical, {} physical, codec {}, dedup {}",
        path.display(),
        bytesize::ByteSize(logical).to_string_as(true),
        bytesize::ByteSize(physical).to_string_as(true),
        match codec {
            CodecPolicy::Auto { strong } => format!("auto (lz4 when busy, {strong} when idle)"),
            fixed => fixed.to_string(),
        },
        if dedup { "on" } else { "off" }
    );
    Ok(ExitCode::SUCCESS)
}

struct ServeArgs {
    volume: Option<PathBuf>,
    socket: Option<PathBuf>,
    listen: Option<String>,
    export: String,
    read_only: bool,
    sync: bool,
    workers: Option<usize>,
    cleaner: CleanerConfig,
    dedup_memory: u64,
    read_cache: u64,
    elastic: ElasticConfig,
    limits: Limits,
}

fn cleaner_config(policy: &str, start: u64, stop: u64) -> Result<CleanerConfig, String> {
    let policy = VictimPolicy::parse(policy)?;
    if start >= stop || stop > 90 {
        return Err(format!(
            "--clean-start {start} must be below --clean-stop {stop}, which must be at most 90"
        ));
    }
    Ok(CleanerConfig {
        policy,
        low_free_percent: start,
        high_free_percent: stop,
    })
}

fn cmd_serve(args: ServeArgs) -> Result<ExitCode, String> {
    let ServeArgs {
        volume,
        socket,
        listen,
        export,
        read_only,
        sync,
        workers,
        cleaner,
        dedup_memory,
        read_cache,
        elastic,
        limits,
    } = args;
    let path = match volume {
        Some(p) => p,
        None => {
            let p = PathBuf::from(DEFAULT_VOLUME);
            if !p.exists() {
                cmd_create(&p, DEFAULT_SIZE, None, "auto", false, true, None)?;
            }
            p
        }
    };
    let storage = FileStorage::open(&path, !read_only, true)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let options = OpenOptions {
        read_only,
        sync_writes: sync,
        cleaner,
        dedup_memory_bytes: dedup_memory,
        read_cache_bytes: read_cache,
        elastic,
        ..OpenOptions::default()
    };
    let vol = Arc::new(
        Volume::open(Arc::new(storage), options).map_err(|e| format!("{}: {e}", path.display()))?,
    );
    let mut config = ServerConfig {
        export_name: export.clone(),
        max_connections: limits.max_connections,
        max_buffered_bytes: limits.max_buffered,
        handshake_timeout: limits.handshake_timeout,
        ..ServerConfig::default()
    };
    if let Some(w) = workers {
        config.workers = w.max(1);
    }
    let server = Server::new(
        Arc::new(backend::VolumeBackend {
            volume: vol.clone(),
        }),
        config,
    );
    let mut uris = Vec::new();
    if let Some(sock) = &socket {
        let _ = std::fs::remove_file(sock);
        let l = std::os::unix::net::UnixListener::bind(sock)
            .map_err(|e| format!("binding {}: {e}", sock.display()))?;
        server.serve_unix(l).map_err(|e| e.to_string())?;
        uris.push(format!("nbd+unix:///{export}?socket={}", sock.display()));
    }
    if listen.is_some() || socket.is_none() {
        let addr = listen.unwrap_or_else(|| DEFAULT_LISTEN.to_string());
        let l =
            std::net::TcpListener::bind(&addr).map_err(|e| format!("listening on {addr}: {e}"))?;
        let local = l.local_addr().map_err(|e| e.to_string())?;
        server.serve_tcp(l).map_err(|e| e.to_string())?;
        uris.push(format!("nbd://{local}/{export}"));
    }
    let ctl = control::start(&path, vol.clone())?;
    let background_cleaner = (!read_only).then(|| vol.start_background_cleaner());
    // Policy auto: rewrite cold fast-codec data with the strong codec when idle.
    let recompressor = vol.start_background_recompressor();
    // The dedup index is not persisted: refill it from the volume's data
    // while clients are idle.
    let index_warmup = (!read_only).then(|| vol.start_index_warmup());
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone()).map_err(|e| e.to_string())?;
    }
    tracing::info!(volume = %path.display(), read_only, sync, "serving");
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
    drop(index_warmup);
    drop(recompressor);
    drop(background_cleaner);
    drop(ctl);
    if let Some(sock) = &socket {
        let _ = std::fs::remove_file(sock);
    }
    vol.close()
        .map_err(|e| format!("final flush/checkpoint failed: {e}"))?;
    tracing::info!("stopped cleanly");
    Ok(ExitCode::SUCCESS)
}

/// Opens a volume nobody serves, read-only (`stat`, offline `scrub`).
pub(crate) fn open_read_only(path: &Path, read_cache_bytes: u64) -> Result<Volume, String> {
    let storage = FileStorage::open(path, false, false).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock => format!(
            "{}: in use by a cvol process whose control socket could not be reached ({e})",
            path.display()
        ),
        _ => format!("{}: {e}", path.display()),
    })?;
    let options = OpenOptions {
        read_only: true,
        read_cache_bytes,
        ..OpenOptions::default()
    };
    Volume::open(Arc::new(storage), options).map_err(|e| format!("{}: {e}", path.display()))
}

fn cmd_stat(path: &Path, json: bool) -> Result<ExitCode, String> {
    let (mut value, served) = match control::query_stat(path) {
        Some(v) => (v, true),
        None => {
            let vol = open_read_only(path, cvol_engine::volume::READ_CACHE_DEFAULT_BYTES)?;
            (
                serde_json::to_value(vol.stats()).map_err(|e| e.to_string())?,
                false,
            )
        }
    };
    value["served"] = serde_json::Value::Bool(served);
    value["volume"] = serde_json::Value::String(path.display().to_string());
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&value).map_err(|e| e.to_string())?
        );
    } else {
        print_stat_table(&value);
    }
    Ok(ExitCode::SUCCESS)
}

fn print_stat_table(v: &serde_json::Value) {
    let b = |k: &str| bytesize::ByteSize(v[k].as_u64().unwrap_or(0)).to_string_as(true);
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    let rows = [
        ("volume", v["volume"].as_str().unwrap_or("").to_string()),
        ("served", v["served"].to_string()),
        ("codec", v["codec"].as_str().unwrap_or("").to_string()),
        ("logical size", b("logical_size_bytes")),
        ("physical size", b("physical_size_bytes")),
        ("mapped (non-zero data)", b("mapped_bytes")),
        ("zero", b("zero_bytes")),
        ("stored payload", b("stored_bytes")),
        ("physical used", b("physical_used_bytes")),
        ("  live records", b("live_bytes")),
        ("  dead (reclaimable)", b("dead_bytes")),
        ("physical free", b("physical_free_bytes")),
        (
            "more data that fits",
            format!(
                "{} at the current ratio, {} worst case",
                b("estimated_free_logical_bytes"),
                b("worst_case_free_logical_bytes")
            ),
        ),
        (
            "write amplification",
            format!("{:.2}", v["write_amplification"].as_f64().unwrap_or(0.0)),
        ),
        (
            "cleaner",
            format!(
                "{}: {} segments cleaned, {} relocated, {} segments reclaimed",
                v["cleaner_policy"].as_str().unwrap_or(""),
                n("cleaner_segments_cleaned"),
                b("cleaner_bytes_relocated"),
                n("segments_reclaimed")
            ),
        ),
        (
            "reduction ratio",
            format!("{:.2}x", v["reduction_ratio"].as_f64().unwrap_or(0.0)),
        ),
        (
            "savings",
            format!(
                "zeros {}  dedup {}  compression {}",
                b("zero_saved_bytes"),
                b("dedup_saved_bytes"),
                b("compression_saved_bytes")
            ),
        ),
        (
            "dedup",
            if v["dedup"].as_bool().unwrap_or(false) {
                format!(
                    "on: {} of {} blocks found stored, {} shared records, index {} of {} ({})",
                    n("dedup_hits"),
                    n("dedup_lookups"),
                    n("dedup_shared_records"),
                    n("dedup_index_entries"),
                    n("dedup_index_capacity"),
                    b("dedup_index_memory_bytes")
                )
            } else {
                "off".to_string()
            },
        ),
        (
            "read cache",
            format!(
                "{:.1}% hits ({} of {})",
                100.0 * v["read_cache_hit_rate"].as_f64().unwrap_or(0.0),
                n("read_cache_hits"),
                n("read_cache_hits") + n("read_cache_misses")
            ),
        ),
        (
            "compression ratio",
            format!("{:.2}x", v["compression_ratio"].as_f64().unwrap_or(0.0)),
        ),
        (
            "blocks by codec",
            format!(
                "lz4 {}  zstd {}  none {}",
                n("codec_lz4_blocks"),
                n("codec_zstd_blocks"),
                n("codec_none_blocks")
            ),
        ),
        (
            "bytes by codec",
            format!(
                "lz4 {}  zstd {}  none {}",
                b("codec_lz4_bytes"),
                b("codec_zstd_bytes"),
                b("codec_none_bytes")
            ),
        ),
        (
            "elastic",
            format!(
                "strong codec {}, units up to {} blocks ({} written), load {} ({} IOPS), \
                 probe wrote {} blocks raw",
                v["codec_strong"].as_str().unwrap_or(""),
                n("unit_blocks"),
                n("units_written"),
                v["load_level"].as_str().unwrap_or(""),
                n("load_iops"),
                n("probe_raw_blocks")
            ),
        ),
        (
            "recompressed",
            format!(
                "{} blocks in {} passes: {} -> {}",
                n("recompressed_blocks"),
                n("recompress_passes"),
                b("recompressed_bytes_before"),
                b("recompressed_bytes_after")
            ),
        ),
        (
            "read amplification",
            format!(
                "{:.2} (bytes decompressed / bytes read)",
                v["read_amplification"].as_f64().unwrap_or(0.0)
            ),
        ),
        (
            "segments used",
            format!("{} of {}", n("segments_used"), n("segments_total")),
        ),
        ("corrupt reads", n("corrupt_reads").to_string()),
    ];
    for (k, val) in rows {
        println!("{k:<24}{val}");
    }
}

fn cmd_repair(path: &Path, json: bool) -> Result<ExitCode, String> {
    let storage = FileStorage::open(path, true, true).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock => format!(
            "{}: the volume is being served; stop the server to repair it",
            path.display()
        ),
        _ => format!("{}: {e}", path.display()),
    })?;
    let rep = cvol_engine::check::repair_volume(Arc::new(storage));
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&rep).map_err(|e| e.to_string())?
        );
    } else {
        if rep.actions.is_empty() {
            println!("{}: nothing needed repair", path.display());
        }
        for a in &rep.actions {
            println!("repaired: {a}");
        }
        if rep.after.consistent() {
            println!(
                "{}: consistent after repair ({} data blocks verified)",
                path.display(),
                rep.after.blocks_checked
            );
        } else {
            println!(
                "{}: {} problem(s) could not be repaired",
                path.display(),
                rep.after.errors.len()
            );
            for e in &rep.after.errors {
                println!("  - {e}");
            }
        }
    }
    Ok(if rep.after.consistent() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn cmd_check(path: &Path, json: bool) -> Result<ExitCode, String> {
    let storage = FileStorage::open(path, false, false).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock => format!(
            "{}: the volume is being served; stop the server to check it",
            path.display()
        ),
        _ => format!("{}: {e}", path.display()),
    })?;
    let bar = std::io::stderr().is_terminal().then(|| {
        let pb = indicatif::ProgressBar::new(0);
        pb.set_style(
            indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} blocks ({eta})")
                .expect("static template")
                .progress_chars("=> "),
        );
        pb.set_message("verifying");
        pb
    });
    let mut progress = |done: u64, total: u64| {
        if let Some(pb) = &bar {
            pb.set_length(total);
            pb.set_position(done);
        }
    };
    let rep = cvol_engine::check::check_volume(&storage, &mut progress);
    if let Some(pb) = bar {
        pb.finish_and_clear();
    }
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&rep).map_err(|e| e.to_string())?
        );
    } else if rep.consistent() {
        println!(
            "{}: consistent ({} data blocks verified, {} records replayed since the last checkpoint, last seq {})",
            path.display(),
            rep.blocks_checked,
            rep.records_replayed,
            rep.last_seq
        );
    } else {
        println!("{}: {} problem(s) found", path.display(), rep.errors.len());
        for e in &rep.errors {
            println!("  - {e}");
        }
    }
    Ok(if rep.consistent() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
