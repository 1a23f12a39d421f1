//! `cvol key rotate`: the data key of an encrypted volume rewrapped under
//! a new key file; no record is rewritten (the data key stays).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use crate::error::Error;
use crate::volfile::{self, Globals, Purpose};

#[derive(clap::Subcommand, Debug)]
pub enum KeyCommand {
    /// Rewrap an encrypted volume's data key under a new key file (offline;
    /// seconds, whatever the volume's size: no data is rewritten).
    ///
    /// The old key file is --key-file (or CVOL_KEY_FILE); the old key no
    /// longer opens the volume afterwards. A crash during the rotation
    /// leaves one superblock copy under each key: either opens the
    /// volume, and running the rotation again finishes it.
    Rotate {
        /// The volume (file or block device); it must not be served.
        volume: PathBuf,
        /// The new key file: 32 random bytes or a passphrase.
        #[arg(long, value_name = "FILE")]
        new_key_file: PathBuf,
    },
}

fn refuse(path: &Path, why: impl std::fmt::Display) -> Error {
    Error::Refused(format!("{}: {why}", path.display()))
}

pub fn cmd_key(cmd: KeyCommand, _globals: &Globals) -> Result<ExitCode, Error> {
    let KeyCommand::Rotate {
        volume,
        new_key_file,
    } = cmd;
    let path = volume.as_path();
    if crate::objvol::url_of(path).is_some() {
        return Err(refuse(
            path,
            "key rotation of a volume in an object store is not supported yet",
        ));
    }
    let old = crate::keyfile::current().ok_or_else(|| {
        Error::Usage("give the current key file with --key-file (or CVOL_KEY_FILE)".into())
    })?;
    let new = crate::keyfile::read_other(&new_key_file)?;
    if crate::control::query(path, "stat").is_some() {
        return Err(refuse(path, "the volume is served: stop the server first"));
    }
    let storage = Arc::new(volfile::open_volume_store(path, Purpose::Change)?);
    let (sb, _) = cvol_engine::read_superblock(&*storage).map_err(|e| refuse(path, e))?;
    let slot = sb.key_slot.ok_or_else(|| {
        refuse(
            path,
            "the volume is not encrypted: there is no key to rotate",
        )
    })?;
    cvol_engine::keys::rotate(&*storage, &sb, &old, &new).map_err(|e| refuse(path, e))?;
    println!(
        "{}: data key ({}) rewrapped under {}; the old key no longer opens it",
        path.display(),
        slot.cipher.name(),
        new_key_file.display()
    );
    Ok(ExitCode::SUCCESS)
}
