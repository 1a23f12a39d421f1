//! `cvol resize POOL --physical-size SIZE`: grow the store a pool may use
//! (a file is extended, sparse; a device must have grown), or shrink it
//! when nothing lies beyond the new end (a file is then cut). Offline the
//! pool is opened here; on a served pool the server does it (a `store
//! resize BYTES` request on its control socket) while clients go on.
//! Either way it is `Volume::resize_physical`: only the superblock's
//! physical size changes on the store (both copies, A then B, each
//! synced), and the engine's books follow (docs/FORMAT.md).
use crate::error::Error;
use crate::volfile::{self, Globals, Opened, Purpose};
use crate::words::human_bytes;
use crate::{control, size};
use cvol_engine::Volume;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct ResizeFlags {
    /// The pool (a file or block device made by `cvol create`), served or
    /// not: a served pool is resized by its server while clients go on.
    pool: PathBuf,
    /// The store's new size (e.g. 64G), rounded down to whole segments:
    /// larger (a file is extended; a block device must already be that
    /// large) or smaller (refused while data or metadata lies beyond it,
    /// or fewer than 4 segments would be left free).
    #[arg(long)]
    physical_size: String,
}

/// The control request: `store resize BYTES`.
const REQUEST: &str = "store resize";

/// Longest a server may take (two superblock writes, a file extended).
const SERVED_TIMEOUT: Duration = Duration::from_secs(600);

fn refuse(path: &Path, why: impl std::fmt::Display) -> Error {
    Error::Refused(format!("{}: {why}", path.display()))
}

pub fn cmd_resize(f: ResizeFlags, _globals: &Globals) -> Result<ExitCode, Error> {
    let path = f.pool.as_path();
    if crate::objvol::url_of(path).is_some() {
        return Err(refuse(
            path,
            "a volume in an object store has no physical size to change",
        ));
    }
    let want = size::parse_size(&f.physical_size)?;
    let v = match control::query_for(path, &format!("{REQUEST} {want}"), SERVED_TIMEOUT) {
        Some(v) => v,
        None => resize_offline(path, want)?,
    };
    if let Some(e) = v["error"].as_str() {
        return Err(refuse(path, e));
    }
    let (old, new) = (
        v["old_physical_size_bytes"].as_u64().unwrap_or(0),
        v["physical_size_bytes"].as_u64().unwrap_or(0),
    );
    match new.cmp(&old) {
        std::cmp::Ordering::Equal => {
            println!(
                "{}: the store is already {}",
                path.display(),
                human_bytes(old)
            )
        }
        o => println!(
            "{}: the store {} from {} to {}",
            path.display(),
            if o.is_gt() { "grew" } else { "shrank" },
            human_bytes(old),
            human_bytes(new)
        ),
    }
    Ok(ExitCode::SUCCESS)
}

/// The reply to a resize of `vol`'s store to `want` bytes.
fn run(vol: &Volume, want: u64) -> Value {
    match vol.resize_physical(want) {
        Ok((old, new)) => json!({"old_physical_size_bytes": old, "physical_size_bytes": new}),
        Err(e) => json!({ "error": e.to_string() }),
    }
}

/// The server's answer to a `store resize BYTES` line; None if it is not one.
pub fn serve_request(vol: &Volume, line: &str) -> Option<String> {
    let want = line.strip_prefix(REQUEST)?.trim().parse::<u64>().ok()?;
    Some(run(vol, want).to_string())
}

/// Opens the pool here (nobody serves it), resizes its store, closes it.
fn resize_offline(path: &Path, want: u64) -> Result<Value, Error> {
    let storage = volfile::open_volume_store(path, Purpose::Change)?;
    let (sb, _) = cvol_engine::read_superblock(&storage).map_err(|e| refuse(path, e))?;
    // Refused before an open (a metadata device is not even looked for).
    if let Some(e) = cvol_engine::resize_unsupported(&sb) {
        return Ok(json!({ "error": e.to_string() }));
    }
    let opts = crate::keyfile::open_options();
    let vol = match volfile::open_with_progress(path, Arc::new(storage), opts, None) {
        Opened::Volume(v) => *v,
        Opened::Failed(e) => return Err(e),
        Opened::Stopped => unreachable!("no stop flag"),
    };
    let v = run(&vol, want);
    vol.close()
        .map_err(|e| refuse(path, format!("closing: {e}")))?;
    Ok(v)
}
