//! `cvol snapshot create|list|delete|rollback` and `cvol clone`: frozen,
//! read-only copies of a pool's volumes, and writable volumes made from
//! them. Offline and on a served pool (the server runs them), through the
//! same requests as `cvol volume` (`volumes::Op`).
use crate::error::Error;
use crate::volfile::Globals;
use crate::volumes::{run, Op};
use crate::words::human_bytes;
use cvol_engine::pool::{Pool, PoolError};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Subcommand, Debug)]
pub enum SnapshotCommand {
    /// Take a snapshot: a read-only copy of the volume as it is now, which
    /// costs nothing until the volume changes (copy-on-write of its map).
    Create {
        /// The pool (a file or block device made by `cvol create`).
        pool: PathBuf,
        /// VOLUME@SNAPSHOT (the snapshot's name: letters, digits and . _ - + :).
        name: String,
    },
    /// List a pool's snapshots.
    List {
        pool: PathBuf,
        /// Print them as JSON (`{"snapshots": [{"name", "volume", ...}]}`).
        #[arg(long)]
        json: bool,
    },
    /// Delete a snapshot; the space only it held goes back to the host in
    /// the background. Refused while clones read through it.
    Delete {
        pool: PathBuf,
        /// VOLUME@SNAPSHOT.
        name: String,
        /// Delete it even while clients read it (their requests then fail).
        #[arg(long)]
        force: bool,
    },
    /// Roll a volume back to its newest snapshot (the snapshot stays).
    /// Refused while clients have the volume open.
    Rollback {
        pool: PathBuf,
        /// VOLUME@SNAPSHOT.
        name: String,
    },
}

/// `cvol clone POOL VOLUME@SNAP NEWVOLUME`.
#[derive(clap::Args, Debug)]
pub struct CloneArgs {
    /// The pool.
    pub pool: PathBuf,
    /// The snapshot to clone, VOLUME@SNAPSHOT.
    pub snapshot: String,
    /// The new volume's name.
    pub name: String,
}

pub fn list_json(pool: &Pool) -> Value {
    let snaps: Vec<Value> = (pool.snapshots().into_iter())
        .map(|s| {
            json!({
                "name": s.name, "volume": s.volume, "id": s.id,
                "size_bytes": s.size_bytes, "created_unix_secs": s.created_unix_secs,
                "clients": s.clients, "clones": s.clones,
            })
        })
        .collect();
    json!({ "snapshots": snaps })
}

/// `cvol stat POOL --volume VOLUME@SNAP`: what the snapshot holds.
pub fn stat_json(pool: &Pool, name: &str) -> Result<Value, PoolError> {
    let u = pool.snapshot_usage(name)?;
    let info = pool.snapshots().into_iter().find(|s| s.name == name);
    Ok(json!({
        "name": name,
        "logical_size_bytes": u.size_bytes,
        "changed_bytes": (u.mapped_bytes + u.zero_bytes),
        "unique_bytes": u.unique_bytes,
        "shared_bytes": u.shared_bytes,
        "clients": info.as_ref().map_or(0, |i| i.clients),
        "created_unix_secs": info.as_ref().map_or(0, |i| i.created_unix_secs),
        "clones": info.map_or(Vec::new(), |i| i.clones),
    }))
}

/// The snapshots of volume `name` for its `stat --volume`: each one's
/// name, creation time, the old content it keeps (`changed_bytes`) and
/// the stored bytes only it references (`unique_bytes`, like ZFS's
/// usedbysnapshots per snapshot).
pub fn of_volume_json(pool: &Pool, name: &str) -> Result<Value, PoolError> {
    let mut out = Vec::new();
    for s in pool.snapshots().into_iter().filter(|s| s.volume == name) {
        let u = pool.snapshot_usage(&s.name)?;
        out.push(json!({
            "name": s.name,
            "created_unix_secs": s.created_unix_secs,
            "changed_bytes": u.mapped_bytes + u.zero_bytes,
            "unique_bytes": u.unique_bytes,
            "clones": s.clones,
        }));
    }
    Ok(Value::Array(out))
}

pub fn cmd_snapshot(cmd: SnapshotCommand, globals: &Globals) -> Result<ExitCode, Error> {
    let (path, op, json_out) = match cmd {
        SnapshotCommand::Create { pool, name } => (pool, Op::SnapCreate(name), false),
        SnapshotCommand::List { pool, json } => (pool, Op::SnapList, json),
        SnapshotCommand::Delete { pool, name, force } => (pool, Op::SnapDelete(name, force), false),
        SnapshotCommand::Rollback { pool, name } => (pool, Op::Rollback(name), false),
    };
    let v = run(&path, &op, globals)?;
    let at = path.display();
    match (&op, json_out) {
        (Op::SnapList, true) => println!("{}", serde_json::to_string_pretty(&v).expect("json")),
        (Op::SnapList, false) => print!("{}", list_text(&v)),
        (Op::SnapCreate(n), _) => println!("{at}: snapshot '{n}' created"),
        (Op::SnapDelete(n, _), _) => println!("{at}: snapshot '{n}' deleted"),
        (Op::Rollback(n), _) => println!("{at}: rolled back to '{n}'"),
        _ => unreachable!("not a snapshot subcommand"),
    }
    Ok(ExitCode::SUCCESS)
}

pub fn cmd_clone(a: CloneArgs, globals: &Globals) -> Result<ExitCode, Error> {
    run(
        &a.pool,
        &Op::Clone(a.snapshot.clone(), a.name.clone()),
        globals,
    )?;
    println!(
        "{}: volume '{}' cloned from '{}'",
        a.pool.display(),
        a.name,
        a.snapshot
    );
    Ok(ExitCode::SUCCESS)
}

fn list_text(v: &Value) -> String {
    let mut out = format!(
        "{:<32} {:>12} {:>8}  {}\n",
        "NAME", "SIZE", "CLIENTS", "CLONES"
    );
    for x in v["snapshots"].as_array().into_iter().flatten() {
        let clones: Vec<&str> = (x["clones"].as_array().into_iter().flatten())
            .filter_map(|c| c.as_str())
            .collect();
        out += &format!(
            "{:<32} {:>12} {:>8}  {}\n",
            x["name"].as_str().unwrap_or("?"),
            human_bytes(x["size_bytes"].as_u64().unwrap_or(0)),
            x["clients"].as_u64().unwrap_or(0),
            clones.join(",")
        );
    }
    out
}
