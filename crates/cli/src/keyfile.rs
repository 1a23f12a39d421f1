//! The key file of an encrypted volume: `--key-file FILE` (any command),
//! else the `CVOL_KEY_FILE` environment variable (through clap), else the
//! systemd credential `cvol.key` (`LoadCredential=cvol.key:/etc/cvol/KEY`
//! in the unit: `$CREDENTIALS_DIRECTORY/cvol.key`). Read once at start;
//! every open of a volume in this process is given it.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cvol_engine::{KeyFile, OpenOptions};

use crate::error::Error;

/// The systemd credential name the service unit may load the key under.
pub const CREDENTIAL_NAME: &str = "cvol.key";
/// A key file larger than this is refused (a key or a passphrase is tiny:
/// a large file is a wrong path).
const KEY_FILE_MAX_BYTES: u64 = 4096;

static KEY: OnceLock<Option<KeyFile>> = OnceLock::new();

/// Reads the key file this process opens volumes with (`flag`: the
/// `--key-file` flag or `CVOL_KEY_FILE`). Called once, from `main`.
pub fn load(flag: Option<&Path>) -> Result<(), Error> {
    let path = match flag {
        Some(p) => Some(p.to_path_buf()),
        None => credential(),
    };
    let key = match path {
        Some(p) => Some(read_key_file(&p)?),
        None => None,
    };
    KEY.set(key).ok();
    Ok(())
}

/// The systemd credential's path, if the service manager passed one.
fn credential() -> Option<PathBuf> {
    let dir = std::env::var_os("CREDENTIALS_DIRECTORY")?;
    let p = Path::new(&dir).join(CREDENTIAL_NAME);
    p.is_file().then_some(p)
}

fn read_key_file(path: &Path) -> Result<KeyFile, Error> {
    let what = format!("key file {}", path.display());
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(&what, e))?;
    let meta = f.metadata().map_err(|e| Error::io(&what, e))?;
    if !meta.is_file() {
        return Err(Error::Usage(format!("{what}: not a regular file")));
    }
    if meta.len() > KEY_FILE_MAX_BYTES {
        return Err(Error::Usage(format!(
            "{what}: {} bytes; a key file holds 32 random bytes or a passphrase",
            meta.len()
        )));
    }
    if meta.permissions().mode() & 0o077 != 0 {
        tracing::warn!(
            "{what} can be read by other users (mode {:o}): chmod 600 it",
            meta.permissions().mode() & 0o777
        );
    }
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes).map_err(|e| Error::io(&what, e))?;
    Ok(KeyFile::new(bytes))
}

/// The key file given to this process, if any.
pub fn current() -> Option<KeyFile> {
    KEY.get().cloned().flatten()
}

/// Open options with the key file given to this process.
pub fn open_options() -> OpenOptions {
    OpenOptions {
        key: current(),
        ..OpenOptions::default()
    }
}

/// Reads a second key file (`cvol key rotate --new-key-file`).
pub fn read_other(path: &Path) -> Result<KeyFile, Error> {
    read_key_file(path)
}

/// `cvol stat` of an encrypted volume without its key: what the superblock
/// tells (nothing of the data), as text or JSON; None when the volume is
/// not encrypted or the key was given (the full statistics then).
pub fn locked_stat(path: &Path, json: bool) -> Result<Option<String>, Error> {
    if current().is_some() || crate::objvol::url_of(path).is_some() {
        return Ok(None);
    }
    let Ok((storage, _)) = crate::volfile::open_store(path, crate::volfile::Purpose::Read) else {
        return Ok(None); // the open proper says what is wrong
    };
    let Ok((sb, _)) = cvol_engine::read_superblock(&storage) else {
        return Ok(None);
    };
    let Some(slot) = sb.key_slot else {
        return Ok(None);
    };
    let held = std::fs::metadata(path)
        .ok()
        .filter(|m| m.is_file())
        .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512);
    if json {
        let v = serde_json::json!({
            "volume": path.display().to_string(),
            "served": false,
            "locked": true,
            "encryption": slot.cipher.name(),
            "key_kind": slot.kdf.name(),
            "logical_size_bytes": sb.logical_size_bytes,
            "physical_size_bytes": sb.physical_size_bytes,
            "segment_size_bytes": sb.segment_size_bytes,
            "host_bytes": held,
            "pool": sb.is_pool(),
        });
        return Ok(Some(format!("{v:#}\n")));
    }
    let rows = [
        ("volume", path.display().to_string()),
        (
            "encryption",
            format!(
                "{}, key: {} (locked: give --key-file for the volumes, space and reduction)",
                slot.cipher.name(),
                slot.kdf.name()
            ),
        ),
        (
            "physical size",
            crate::words::human_bytes(sb.physical_size_bytes),
        ),
        (
            "host holds",
            held.map_or("unknown".into(), crate::words::human_bytes),
        ),
    ];
    Ok(Some(
        rows.iter().map(|(k, v)| format!("{k:<24}{v}\n")).collect(),
    ))
}

/// Refuses (exit 2, before anything is read or written) an encrypted
/// volume without its right key, or a key for one in the clear. A store
/// whose superblocks do not decode passes: the command says what is wrong.
pub fn require(path: &Path, storage: &dyn cvol_storage::Storage) -> Result<(), Error> {
    let Ok((mut sb, _)) = cvol_engine::read_superblock(storage) else {
        return Ok(());
    };
    cvol_engine::keys::unlock(storage, &mut sb, current().as_ref())
        .map_err(|e| Error::Refused(format!("{}: {e}", path.display())))
}
