//! `cvol volume ...`: the volumes of a pool, and `cvol stat POOL --volume
//! NAME`. Each works offline (the pool opened here) and on a served pool
//! (through its control socket, the server doing the operation), and
//! prints the same. Both ends of the control requests live here:
//! `volume list`, `volume stat NAME`, `volume create NAME SIZE`,
//! `volume delete NAME force|keep`, `volume resize NAME SIZE discard|keep`.
use crate::error::Error;
use crate::volfile::{self, Globals, Opened, Purpose};
use crate::words::human_bytes;
use crate::{control, size};
use cvol_engine::pool::{Pool, PoolError};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Subcommand, Debug)]
pub enum VolumeCommand {
    /// Create an empty volume in a pool (thin: it takes no space until written).
    Create {
        /// The pool (a file or block device made by `cvol create`).
        pool: PathBuf,
        /// The new volume's name: letters, digits and . _ - + : (no '/' or '@').
        name: String,
        /// Its size (4096, 64M, 10G, 1T); the pool's volumes total at most 16 TiB.
        #[arg(long)]
        size: String,
    },
    /// List a pool's volumes.
    List {
        pool: PathBuf,
        /// Print them as JSON (`{"volumes": [{"name", "size_bytes", ...}]}`).
        #[arg(long)]
        json: bool,
    },
    /// Delete a volume and give its space back (blocks other volumes share stay).
    Delete {
        pool: PathBuf,
        name: String,
        /// Delete it even while clients have it open (their requests then fail).
        #[arg(long)]
        force: bool,
    },
    /// Grow or shrink a volume; clients see the new size when they reconnect.
    Resize {
        pool: PathBuf,
        name: String,
        /// The new size.
        #[arg(long)]
        size: String,
        /// Shrink even when data lies beyond the new end: it is dropped.
        #[arg(long)]
        discard: bool,
    },
}

/// A request the server runs (or this process, offline).
pub(crate) enum Op {
    List,
    Stat(String),
    Create(String, u64),
    Delete(String, bool),
    Resize(String, u64, bool),
    SnapCreate(String),
    SnapList,
    SnapDelete(String, bool),
    Rollback(String),
    Clone(String, String),
}

impl Op {
    fn line(&self) -> String {
        let flag = |b: bool, yes: &str| if b { yes.to_string() } else { "keep".into() };
        match self {
            Op::List => "volume list".into(),
            Op::Stat(n) => format!("volume stat {n}"),
            Op::Create(n, s) => format!("volume create {n} {s}"),
            Op::Delete(n, f) => format!("volume delete {n} {}", flag(*f, "force")),
            Op::Resize(n, s, d) => format!("volume resize {n} {s} {}", flag(*d, "discard")),
            Op::SnapCreate(n) => format!("volume snapshot-create {n}"),
            Op::SnapList => "volume snapshot-list".into(),
            Op::SnapDelete(n, f) => format!("volume snapshot-delete {n} {}", flag(*f, "force")),
            Op::Rollback(n) => format!("volume rollback {n}"),
            Op::Clone(n, c) => format!("volume clone {n} {c}"),
        }
    }

    fn parse(line: &str) -> Option<Op> {
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |s: &str| s.parse::<u64>().ok();
        Some(match w.as_slice() {
            ["volume", "list"] => Op::List,
            ["volume", "stat", n] => Op::Stat(n.to_string()),
            ["volume", "create", n, s] => Op::Create(n.to_string(), num(s)?),
            ["volume", "delete", n, f] => Op::Delete(n.to_string(), *f == "force"),
            ["volume", "resize", n, s, d] => Op::Resize(n.to_string(), num(s)?, *d == "discard"),
            ["volume", "snapshot-create", n] => Op::SnapCreate(n.to_string()),
            ["volume", "snapshot-list"] => Op::SnapList,
            ["volume", "snapshot-delete", n, f] => Op::SnapDelete(n.to_string(), *f == "force"),
            ["volume", "rollback", n] => Op::Rollback(n.to_string()),
            ["volume", "clone", n, c] => Op::Clone(n.to_string(), c.to_string()),
            _ => return None,
        })
    }

    fn writes(&self) -> bool {
        !matches!(self, Op::List | Op::Stat(_) | Op::SnapList)
    }

    /// Runs on `pool`: the reply (as the server sends it).
    fn run(&self, pool: &Pool) -> Result<Value, PoolError> {
        match self {
            Op::List => Ok(list_json(pool)),
            Op::Stat(n) => stat_json(pool, n),
            Op::Create(n, s) => pool.create_volume(n, *s).map(|()| json!({"created": n})),
            Op::Delete(n, f) => pool.delete_volume(n, *f).map(|()| json!({"deleted": n})),
            Op::Resize(n, s, d) => pool
                .resize_volume(n, *s, *d)
                .map(|old| json!({"resized": n, "old_size_bytes": old, "size_bytes": s})),
            Op::SnapCreate(n) => pool.create_snapshot(n).map(|()| json!({"created": n})),
            Op::SnapList => Ok(crate::snapshots::list_json(pool)),
            Op::SnapDelete(n, f) => pool.delete_snapshot(n, *f).map(|()| json!({"deleted": n})),
            Op::Rollback(n) => pool.rollback(n).map(|()| json!({"rolled_back": n})),
            Op::Clone(n, c) => pool
                .clone_volume(n, c)
                .map(|()| json!({"cloned": n, "volume": c})),
        }
    }
}

fn list_json(pool: &Pool) -> Value {
    let vols: Vec<Value> = pool
        .volumes()
        .into_iter()
        .map(|v| {
            json!({
                "name": v.name, "id": v.id, "size_bytes": v.size_bytes,
                "created_unix_secs": v.created_unix_secs, "clients": v.clients,
            })
        })
        .collect();
    json!({ "volumes": vols })
}

fn stat_json(pool: &Pool, name: &str) -> Result<Value, PoolError> {
    if name.contains('@') {
        return crate::snapshots::stat_json(pool, name);
    }
    let u = pool.usage(name)?;
    let info = pool.volumes().into_iter().find(|v| v.name == name);
    Ok(json!({
        "name": name,
        "logical_size_bytes": u.size_bytes,
        "mapped_bytes": u.mapped_bytes,
        "zero_bytes": u.zero_bytes,
        "unique_bytes": u.unique_bytes,
        "shared_bytes": u.shared_bytes,
        "clients": info.as_ref().map_or(0, |i| i.clients),
        "created_unix_secs": info.as_ref().map_or(0, |i| i.created_unix_secs),
        "snapshots": crate::snapshots::of_volume_json(pool, name)?,
    }))
}

/// The server's answer to a `volume ...` line; None if it is not one.
pub fn serve_request(pool: Option<&Pool>, line: &str) -> Option<String> {
    let op = Op::parse(line)?;
    let reply = match pool {
        None => json!({"error": "this volume is not a pool (a cache or an object-store volume)"}),
        Some(p) => op
            .run(p)
            .unwrap_or_else(|e| json!({ "error": e.to_string() })),
    };
    Some(reply.to_string())
}

/// Longest a server may take for an operation (a delete unmaps its blocks).
const SERVED_OP_TIMEOUT: Duration = Duration::from_secs(3600);

/// Runs `op` on the pool at `path`: through its server, or opened here.
pub(crate) fn run(path: &Path, op: &Op, globals: &Globals) -> Result<Value, Error> {
    if let Some(v) = control::query_for(path, &op.line(), SERVED_OP_TIMEOUT) {
        return match v["error"].as_str() {
            Some(e) => Err(Error::Refused(format!("{}: {e}", path.display()))),
            None => Ok(v),
        };
    }
    let pool = open(path, op.writes(), globals)?;
    let r = op.run(&pool);
    let closed = pool.engine().close();
    let v = r.map_err(|e| Error::Refused(format!("{}: {e}", path.display())))?;
    closed.map_err(|e| Error::Refused(format!("{}: closing: {e}", path.display())))?;
    Ok(v)
}

/// Opens the pool at `path` here (nobody serves it).
pub fn open(path: &Path, writable: bool, globals: &Globals) -> Result<Pool, Error> {
    if crate::objvol::url_of(path).is_some() {
        return Err(Error::Refused(format!(
            "{}: volumes in an object store hold one volume; pools are for files and block \
             devices",
            path.display()
        )));
    }
    let vol = if writable {
        let storage = volfile::open_volume_store(path, Purpose::Change)?;
        let mut options = crate::keyfile::open_options();
        let storage =
            volfile::with_metadata(path, storage, Purpose::Change, globals, &mut options)?;
        match volfile::open_with_progress(path, storage, options, None) {
            Opened::Volume(v) => *v,
            Opened::Failed(e) => return Err(e),
            Opened::Stopped => unreachable!("no stop flag"),
        }
    } else {
        volfile::open_read_only(path, None, globals)?
    };
    if vol.superblock().is_cache() {
        return Err(Error::Refused(format!(
            "{}: a cache (`cvol create --origin`) holds one volume, its origin's copy",
            path.display()
        )));
    }
    Pool::attach(Arc::new(vol)).map_err(|e| Error::Refused(format!("{}: {e}", path.display())))
}

pub fn cmd_volume(cmd: VolumeCommand, globals: &Globals) -> Result<ExitCode, Error> {
    let bytes = |s: &str| -> Result<u64, Error> {
        let n = size::parse_size(s)?;
        if n == 0 || n % 4096 != 0 {
            return Err(Error::Usage(format!(
                "--size {s}: a volume's size must be a positive multiple of 4096 bytes"
            )));
        }
        Ok(n)
    };
    let (path, op, json_out) = match cmd {
        VolumeCommand::Create { pool, name, size } => {
            (pool, Op::Create(name, bytes(&size)?), false)
        }
        VolumeCommand::List { pool, json } => (pool, Op::List, json),
        VolumeCommand::Delete { pool, name, force } => (pool, Op::Delete(name, force), false),
        VolumeCommand::Resize {
            pool,
            name,
            size,
            discard,
        } => (pool, Op::Resize(name, bytes(&size)?, discard), false),
    };
    let v = run(&path, &op, globals)?;
    match (&op, json_out) {
        (Op::List, true) => crate::words::print_out(&format!("{:#}\n", v))?,
        (Op::List, false) => crate::words::print_out(&list_text(&v))?,
        (Op::Create(n, s), _) => println!(
            "{}: volume '{n}' created ({})",
            path.display(),
            human_bytes(*s)
        ),
        (Op::Delete(n, _), _) => println!("{}: volume '{n}' deleted", path.display()),
        (Op::Resize(n, s, _), _) => println!(
            "{}: volume '{n}' resized from {} to {}",
            path.display(),
            human_bytes(v["old_size_bytes"].as_u64().unwrap_or(0)),
            human_bytes(*s)
        ),
        _ => unreachable!("not a volume subcommand"),
    }
    Ok(ExitCode::SUCCESS)
}

fn list_text(v: &Value) -> String {
    let mut out = format!("{:<24} {:>12} {:>8}\n", "NAME", "SIZE", "CLIENTS");
    for x in v["volumes"].as_array().into_iter().flatten() {
        out += &format!(
            "{:<24} {:>12} {:>8}\n",
            x["name"].as_str().unwrap_or("?"),
            human_bytes(x["size_bytes"].as_u64().unwrap_or(0)),
            x["clients"].as_u64().unwrap_or(0)
        );
    }
    out
}

/// `cvol stat POOL --volume NAME [--json]`.
pub fn cmd_stat_volume(
    path: &Path,
    name: &str,
    json_out: bool,
    globals: &Globals,
) -> Result<ExitCode, Error> {
    let v = run(path, &Op::Stat(name.into()), globals)?;
    if json_out {
        crate::words::print_out(&format!("{:#}\n", v))?;
        return Ok(ExitCode::SUCCESS);
    }
    let b = |k: &str| human_bytes(v[k].as_u64().unwrap_or(0));
    if name.contains('@') {
        println!("snapshot          {} in {}", name, path.display());
        println!("logical size      {}", b("logical_size_bytes"));
        println!(
            "changed since     {} (old content it keeps)",
            b("changed_bytes")
        );
        println!(
            "unique            {} stored only for it (what deleting it frees)",
            b("unique_bytes")
        );
        println!("clients           {}", v["clients"].as_u64().unwrap_or(0));
        return Ok(ExitCode::SUCCESS);
    }
    println!("volume            {} in {}", name, path.display());
    println!("logical size      {}", b("logical_size_bytes"));
    println!(
        "mapped            {} (and {} written as zeros)",
        b("mapped_bytes"),
        b("zero_bytes")
    );
    println!(
        "unique            {} stored only for this volume (what deleting it frees)",
        b("unique_bytes")
    );
    println!(
        "shared            {} stored once for it and other blocks (dedup)",
        b("shared_bytes")
    );
    println!("clients           {}", v["clients"].as_u64().unwrap_or(0));
    for x in v["snapshots"].as_array().into_iter().flatten() {
        println!(
            "snapshot          {}: {} changed since, {} unique",
            x["name"].as_str().unwrap_or("?"),
            human_bytes(x["changed_bytes"].as_u64().unwrap_or(0)),
            human_bytes(x["unique_bytes"].as_u64().unwrap_or(0))
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The `volumes` of a pool for `cvol stat POOL`: from its server, or the
/// pool opened here; None for what is not a pool.
pub fn list_for_stat(path: &Path, served: bool, pool: Option<&Pool>) -> Option<Value> {
    if served {
        return control::query(path, &Op::List.line()).filter(|v| v["error"].is_null());
    }
    pool.map(list_json)
}
