//! `cvol`: create, serve, inspect and verify compressed volumes.
//!
//! Exit codes: 0 success, 1 `check`/`scrub` found problems, 2 cannot run
//! (the message on stderr names the problem). No command changes a file
//! it was not asked to change; a failed `create` leaves nothing behind.
mod backend;
mod check;
mod control;
mod create;
mod scrub;
mod serve;
mod size;
mod sockfile;
mod stat;
mod volfile;
mod words;

use clap::{Parser, Subcommand};
use cvol_engine::segments::VictimPolicy;
use cvol_engine::{CleanerConfig, ElasticConfig};
use cvol_nbd::ServerConfig;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

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
        /// The file to create (its directory must exist) or block device to format.
        volume: PathBuf,
        /// Logical size clients see (e.g. 64M, 16G, 1T); may exceed the physical size.
        #[arg(long)]
        size: String,
        /// Backing bytes the volume may use (default: the file's --size, or the device size).
        #[arg(long)]
        physical_size: Option<String>,
        #[arg(long, default_value = "auto", help = words::codec_help())]
        codec: String,
        /// Overwrite an existing volume or non-empty file.
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
        /// The volume (default ./cvol-data/default.cvol, a 16 GiB volume created if absent).
        volume: Option<PathBuf>,
        /// Listen on a Unix socket at PATH (refused if PATH exists, unless
        /// it is the stale socket of a server that is gone).
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// Listen on TCP ADDR:PORT (default 127.0.0.1:10809 when no --socket is given).
        #[arg(long, value_name = "ADDR:PORT")]
        listen: Option<String>,
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
        #[arg(long, default_value_t = ElasticConfig::default().busy_iops, help = words::busy_iops_help())]
        busy_iops: u64,
        #[arg(long, default_value_t = ElasticConfig::default().idle_iops, help = words::idle_iops_help())]
        idle_iops: u64,
        /// Codec policy auto: rewrite cold lz4 data and small units with the
        /// strong codec (zstd:9, or the LEVEL of auto:zstd:LEVEL) while clients
        /// are idle (on or off).
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
        /// The volume (file or block device).
        volume: PathBuf,
        /// Print every statistic as one JSON object (keys listed in README.md).
        #[arg(long)]
        json: bool,
    },
    /// Verify every record and all metadata offline; exit 0 only if consistent.
    ///
    /// Exit 0 consistent, 1 problems found (listed), 2 cannot run (not a
    /// volume, or being served).
    Check {
        /// The volume (file or block device); it must not be served.
        volume: PathBuf,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// Repair what redundancy and the log allow first: rewrite a damaged
        /// superblock copy, rebuild a lost checkpoint from the log, write
        /// fresh checkpoints; then check and list what could not be saved.
        #[arg(long)]
        repair: bool,
    },
    /// Verify every block of a volume, served or not.
    ///
    /// Checks each mapped block (record checksum, map identity,
    /// decompression), both superblock copies and the newest checkpoint.
    /// A served volume is scrubbed by its server in the background while
    /// it keeps serving; otherwise the volume is opened read-only and
    /// scrubbed here. Exit 0 clean, 1 problems found (listed by LBA), 2 error.
    Scrub {
        /// The volume (file or block device).
        volume: PathBuf,
        /// Logical data verified per second at most (e.g. 64M or 64M/s; 0: no
        /// limit). Default: 64M on a served volume, no limit offline.
        #[arg(long)]
        rate: Option<String>,
        /// Print the report (with --status: the status) as JSON.
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
            create::cmd_create(
                &volume,
                &create::CreateArgs {
                    size: &size,
                    physical_size: physical_size.as_deref(),
                    codec: &codec,
                    force,
                    dedup,
                    segment_size: segment_size.as_deref(),
                    make_parent: false,
                },
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
            serve::cmd_serve(serve::ServeArgs {
                dedup_memory: size::parse_size(&dedup_memory)
                    .map_err(|e| format!("--dedup-memory: {e}"))?,
                read_cache: size::parse_size(&read_cache)
                    .map_err(|e| format!("--read-cache: {e}"))?,
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
        Command::Stat { volume, json } => stat::cmd_stat(&volume, json),
        Command::Check {
            volume,
            json,
            repair: false,
        } => check::cmd_check(&volume, json),
        Command::Check {
            volume,
            json,
            repair: true,
        } => check::cmd_repair(&volume, json),
        Command::Scrub {
            volume,
            rate,
            json,
            no_wait,
            status,
        } => scrub::cmd_scrub(
            &volume,
            scrub::ScrubArgs {
                rate: rate.as_deref(),
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
pub struct Limits {
    pub max_connections: usize,
    pub max_buffered: u64,
    pub handshake_timeout: std::time::Duration,
}

fn limits(
    max_connections: usize,
    max_buffered: &str,
    handshake_secs: u64,
) -> Result<Limits, String> {
    let max_buffered_bytes =
        size::parse_size(max_buffered).map_err(|e| format!("--max-buffered: {e}"))?;
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
    let unit = size::parse_size(unit_size).map_err(|e| format!("--unit-size: {e}"))?;
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
        ..CleanerConfig::default()
    })
}
