//! `cvol`: create, serve, inspect and verify compressed volumes.
//!
//! Exit codes: 0 success, 1 `check`/`scrub` found problems, 2 cannot run
//! (the message on stderr names the problem). No command changes a file
//! it was not asked to change; a failed `create` leaves nothing behind.
use crate::error::Error;
mod backend;
mod check;
mod control;
mod control_server;
mod create;
mod edge;
mod error;
mod estimate;
mod keyfile;
mod keys;
mod metrics;
mod objvol;
mod origin;
mod resize;
mod scrub;
mod serve;
mod service;
mod size;
mod snapshots;
mod sockfile;
mod stat;
mod trace;
mod volfile;
mod volumes;
mod words;

use clap::{Parser, Subcommand};
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
    /// The volume's metadata device: with `create`, where its map,
    /// checkpoints and fingerprint tables go (a file, created sparse, or a
    /// block device, e.g. a small fast SSD); with the other commands, where
    /// to find it if not at the path recorded at create.
    #[arg(long, global = true, value_name = "PATH")]
    metadata_device: Option<PathBuf>,
    /// The key file of an encrypted volume: exactly 32 random bytes (a
    /// raw key, `head -c 32 /dev/urandom`) or a passphrase (at least 8
    /// bytes, stretched with Argon2id). With `create --encryption`, the
    /// key the new volume's data key is wrapped under. Default: the
    /// CVOL_KEY_FILE environment variable, else the systemd credential
    /// `cvol.key`.
    #[arg(long, global = true, value_name = "FILE", env = "CVOL_KEY_FILE")]
    key_file: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Create a pool on a file (created sparse) or an existing block device,
    /// with one volume, `default` (add more with `cvol volume create`).
    Create(create::CreateFlags),
    /// Serve a volume over NBD (default: ./cvol-data/default.cvol, created if absent).
    Serve(Box<serve::ServeArgs>),
    /// Show space and reduction statistics (asks the server when the volume is served).
    Stat {
        /// The volume (file or block device).
        volume: PathBuf,
        /// Print every statistic as one JSON object (keys listed in docs/CLI.md).
        #[arg(long)]
        json: bool,
        /// Refresh every SECS seconds (default 1) until interrupted: one
        /// screen with the client's read and write rates over the interval
        /// (like `zpool iostat 1`); with --json, one JSON object per line.
        /// The volume must be served.
        #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "1")]
        watch: Option<f64>,
        /// With --watch: stop after this many refreshes.
        #[arg(long, requires = "watch")]
        count: Option<u64>,
        /// One volume of the pool: its size, mapped bytes, the stored bytes
        /// only it references (`unique_bytes`, what deleting it frees),
        /// those it shares with other blocks (`shared_bytes`) and its
        /// snapshots; or one snapshot, VOLUME@SNAPSHOT.
        #[arg(long = "volume", value_name = "NAME", conflicts_with = "watch")]
        volume_name: Option<String>,
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
    /// Estimate what a volume would store for some data, writing nothing.
    ///
    /// Reads SOURCE (a file, a block device or an NBD URI; read-only) in
    /// 4 KiB blocks and prints its zero, distinct (deduplicated) and
    /// compressed bytes and the `du` a volume holding it would show. All of
    /// a source under 1 GiB is read, else 1 MiB regions spread over it
    /// (--sample): duplicates between a region read and one not read are
    /// not seen, so the dedup ratio is then a lower bound. Every block read
    /// is fingerprinted but only 1 in N fingerprints is kept, chosen by
    /// hash (so a block and its copies are kept together: an unbiased dedup
    /// ratio in bounded memory); a sample of the distinct blocks is
    /// compressed as the volume would (its compression unit, the probe,
    /// the codec). Figures are estimates.
    Estimate(estimate::EstimateFlags),
    /// Show or replay a request trace (`cvol serve --trace FILE`).
    #[command(subcommand)]
    Trace(TraceCommand),
    /// Manage the volumes of a pool: create, list, delete, resize.
    ///
    /// A pool (what `cvol create` makes) holds many volumes in one store:
    /// they share its log, its free space and its dedup index, so a block
    /// written to two volumes is stored once. `cvol serve POOL` serves
    /// each under its name (nbd://HOST/NAME); the first volume is
    /// `default`, also served under the empty name. Each command works
    /// offline and on a served pool (the server runs it).
    #[command(subcommand)]
    Volume(volumes::VolumeCommand),
    /// Snapshots of a pool's volumes: read-only copies that cost nothing
    /// until the volume changes, served as VOLUME@SNAPSHOT, with the
    /// blocks changed since each in the NBD metadata context
    /// `qemu:dirty-bitmap:SNAPSHOT` of the volume's export (incremental
    /// backup). Each command works offline and on a served pool.
    #[command(subcommand)]
    Snapshot(snapshots::SnapshotCommand),
    /// Keys of an encrypted volume (`cvol create --encryption`).
    #[command(subcommand)]
    Key(keys::KeyCommand),
    /// Make a writable volume from a snapshot: it shares every block with
    /// the snapshot until written (works offline and on a served pool).
    Clone(snapshots::CloneArgs),
    /// Change the physical size of a pool's store (offline or served).
    ///
    /// Grows it (a file is extended, sparse; a block device must have grown
    /// first) or shrinks it when nothing lies beyond the new end (a file is
    /// cut). The volumes and their data stay as they are. On a served pool
    /// the server does it while clients go on reading and writing.
    Resize(resize::ResizeFlags),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    ///
    /// e.g. `cvol completions bash > /etc/bash_completion.d/cvol`.
    Completions { shell: clap_complete::Shell },
    /// Write the man pages (cvol.1 and one per command) into DIR.
    Man {
        /// An existing directory.
        dir: PathBuf,
    },
}

#[derive(Subcommand)]
enum TraceCommand {
    /// Print a trace: totals per command, then its requests.
    Show {
        /// The trace file.
        file: PathBuf,
        /// Print as one JSON object.
        #[arg(long)]
        json: bool,
        /// Requests listed at most (default: all).
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Replay a trace against a volume that is not served (opened here,
    /// as `serve` opens it); writes carry generated data. Exit 1 if a
    /// request failed.
    Replay(ReplayFlags),
}

/// `cvol trace replay`'s command line.
#[derive(clap::Args)]
struct ReplayFlags {
    /// The trace file.
    file: PathBuf,
    /// The volume (at least as large as the traced one).
    volume: PathBuf,
    /// Issue each request at its recorded time (default: as fast as
    /// the queue depth allows).
    #[arg(long)]
    recorded_pace: bool,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 16)]
    queue_depth: usize,
    /// What writes carry: the percentage of each 4 KiB block that is
    /// zeros after random bytes (fio's buffer_compress_percentage),
    /// random or zero.
    #[arg(long, default_value = "55")]
    data: String,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Largest merged compression unit, as `serve --unit-size` (4K to 64K).
    #[arg(long, default_value = "16K")]
    unit_size: String,
    /// Open the volume's file with direct I/O (O_DIRECT: past the page
    /// cache, so reads and writes reach the device, as a benchmark of
    /// the device's pages wants).
    #[arg(long)]
    direct: bool,
}

/// `cvol man DIR`: cvol.1 and cvol-COMMAND.1, from the clap definitions.
fn write_man_pages(dir: &std::path::Path) -> Result<ExitCode, Error> {
    use clap::CommandFactory;
    if !dir.is_dir() {
        return Err(Error::Refused(format!(
            "{}: not a directory",
            dir.display()
        )));
    }
    let mut cmd = Cli::command();
    // Global flags (--metadata-device) reach the commands only once built.
    cmd.build();
    let mut pages = vec![(String::from("cvol"), cmd.clone())];
    for sub in cmd.get_subcommands() {
        let name = format!("cvol-{}", sub.get_name());
        pages.push((name.clone(), sub.clone().name(name)));
    }
    for (name, page) in pages {
        let path = dir.join(format!("{name}.1"));
        let mut out = Vec::new();
        clap_mangen::Man::new(page)
            .render(&mut out)
            .map_err(|e| Error::io(format!("{name}.1"), e))?;
        std::fs::write(&path, out).map_err(|e| Error::io(path.display(), e))?;
        println!("{}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    // Before any thread starts: a server's memory stays near what its
    // caches are configured to (ARCHITECTURE.md "State and memory").
    cvol_engine::memory::tune_allocator();
    let filter = tracing_subscriber::EnvFilter::try_from_env("CVOL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    if let Err(msg) = keyfile::load(cli.key_file.as_deref()) {
        eprintln!("cvol: {msg}");
        return ExitCode::from(2);
    }
    let globals = volfile::Globals {
        metadata_device: cli.metadata_device,
    };
    match run(cli.command, &globals) {
        Ok(code) => code,
        Err(msg) => {
            eprintln!("cvol: {msg}");
            ExitCode::from(2)
        }
    }
}

/// Runs one command with the global flags.
fn run(command: Command, globals: &volfile::Globals) -> Result<ExitCode, Error> {
    match command {
        Command::Create(flags) => create::cmd_create(&flags, globals),
        Command::Volume(cmd) => volumes::cmd_volume(cmd, globals),
        Command::Snapshot(cmd) => snapshots::cmd_snapshot(cmd, globals),
        Command::Key(cmd) => keys::cmd_key(cmd, globals),
        Command::Clone(args) => snapshots::cmd_clone(args, globals),
        Command::Resize(flags) => resize::cmd_resize(flags, globals),
        Command::Serve(args) => serve::cmd_serve(*args, globals),
        Command::Stat {
            volume,
            json,
            volume_name: Some(name),
            ..
        } => volumes::cmd_stat_volume(&volume, &name, json, globals),
        Command::Stat {
            volume,
            json,
            watch: None,
            ..
        } => stat::cmd_stat(&volume, json, globals),
        Command::Stat {
            volume,
            json,
            watch: Some(secs),
            count,
            ..
        } => stat::cmd_watch(&volume, json, secs, count, globals),
        Command::Check {
            volume,
            json,
            repair,
        } => match repair {
            false => check::cmd_check(&volume, json, globals),
            true => check::cmd_repair(&volume, json, globals),
        },
        Command::Scrub {
            volume,
            rate,
            json,
            no_wait,
            status,
        } => {
            let args = scrub::ScrubArgs {
                rate: rate.as_deref(),
                json,
                no_wait,
                status,
            };
            scrub::cmd_scrub(&volume, args, globals)
        }
        Command::Estimate(flags) => estimate::cmd_estimate(&flags),
        Command::Completions { shell } => write_completions(shell),
        Command::Man { dir } => write_man_pages(&dir),
        Command::Trace(TraceCommand::Show { file, json, limit }) => {
            trace::cmd_show(&file, json, limit)
        }
        Command::Trace(TraceCommand::Replay(flags)) => run_replay(flags, globals),
    }
}

/// `cvol completions SHELL`.
fn write_completions(shell: clap_complete::Shell) -> Result<ExitCode, Error> {
    use clap::CommandFactory;
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "cvol", &mut script);
    // A reader that stops early (`| head`) is not an error.
    match std::io::Write::write_all(&mut std::io::stdout(), &script) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(Error::io("stdout", e)),
        _ => Ok(ExitCode::SUCCESS),
    }
}

/// `cvol trace replay`: its flags checked, then the replay.
fn run_replay(flags: ReplayFlags, globals: &volfile::Globals) -> Result<ExitCode, Error> {
    let ReplayFlags {
        file,
        volume,
        recorded_pace,
        queue_depth,
        data,
        json,
        unit_size,
        direct,
    } = flags;
    let data = trace::DataKind::parse(&data)?;
    let unit_blocks = trace::parse_unit_size(&unit_size)?;
    if !(1..=1024).contains(&queue_depth) {
        return Err(Error::Usage(format!(
            "--queue-depth {queue_depth}: give from 1 to 1024 requests"
        )));
    }
    let args = trace::ReplayArgs {
        recorded_pace,
        queue_depth,
        data,
        json,
        unit_blocks,
        direct,
    };
    trace::cmd_replay(&file, &volume, &args, globals)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    /// Regression: each command's page was rendered without the global
    /// flags, and clap's debug assertions refused `create` (its
    /// --metadata-size requires the global --metadata-device).
    #[test]
    fn man_pages_render_for_every_command() {
        let dir = tempfile::tempdir().unwrap();
        write_man_pages(dir.path()).unwrap();
        for page in [
            "cvol",
            "cvol-create",
            "cvol-serve",
            "cvol-trace",
            "cvol-man",
        ] {
            let text = std::fs::read_to_string(dir.path().join(format!("{page}.1"))).unwrap();
            assert!(text.contains(".TH"), "{page}.1");
        }
        let create = std::fs::read_to_string(dir.path().join("cvol-create.1")).unwrap();
        assert!(
            create.contains("metadata\\-device"),
            "the global flag is on the page"
        );
    }
}
