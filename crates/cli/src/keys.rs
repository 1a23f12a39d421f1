//! `cvol key rotate`: the data key of an encrypted volume rewrapped under
//! a new key file; no record is rewritten (the data key stays).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use cvol_engine::keys::KeyFile;
use cvol_storage::Storage;

use crate::error::Error;
use crate::volfile::{self, Globals, Purpose};

#[derive(clap::Subcommand, Debug)]
pub enum KeyCommand {
    /// Rewrap an encrypted volume's data key under a new key file (offline;
    /// seconds, whatever the volume's size: no data is rewritten). A volume
    /// in an object store is claimed like a server claims it, so it must
    /// not be served anywhere.
    ///
    /// The old key file is --key-file (or CVOL_KEY_FILE); the old key no
    /// longer opens the volume afterwards. A crash during the rotation
    /// leaves one superblock copy under each key: either opens the
    /// volume, and running the rotation again finishes it.
    Rotate {
        /// The volume (file, block device or s3://BUCKET/PREFIX); it must not
        /// be served.
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
    let old = crate::keyfile::current().ok_or_else(|| {
        Error::Usage("give the current key file with --key-file (or CVOL_KEY_FILE)".into())
    })?;
    let new = crate::keyfile::read_other(&new_key_file)?;
    if crate::control::query(path, "stat").is_some() {
        return Err(refuse(path, "the volume is served: stop the server first"));
    }
    let cipher = match crate::objvol::url_of(path) {
        Some(url) => rotate_in_store(url, &old, &new)?,
        None => {
            let storage = Arc::new(volfile::open_volume_store(path, Purpose::Change)?);
            rotate_on(path, &*storage, &old, &new)?
        }
    };
    println!(
        "{}: data key ({cipher}) rewrapped under {}; the old key no longer opens it",
        path.display(),
        new_key_file.display()
    );
    Ok(ExitCode::SUCCESS)
}

/// Rewraps the key of the volume in `storage` (opened for change, nobody
/// else serving it); returns its cipher's name.
fn rotate_on(
    path: &Path,
    storage: &dyn Storage,
    old: &KeyFile,
    new: &KeyFile,
) -> Result<&'static str, Error> {
    let (sb, _) = cvol_engine::read_superblock(storage).map_err(|e| refuse(path, e))?;
    let slot = sb.key_slot.ok_or_else(|| {
        refuse(
            path,
            "the volume is not encrypted: there is no key to rotate",
        )
    })?;
    cvol_engine::keys::rotate(storage, &sb, old, new).map_err(|e| refuse(path, e))?;
    Ok(slot.cipher.name())
}

/// The rotation of a volume in an object store: the volume is claimed like
/// a server claims it (refused while one renews its lease), both
/// superblock copies are rewritten through it (each sync is a delta in the
/// store) and it is closed (a manifest, the lease released); a refused
/// rotation (a wrong key) only releases the lease.
fn rotate_in_store(url: &str, old: &KeyFile, new: &KeyFile) -> Result<&'static str, Error> {
    let (_cache, st) = crate::objvol::open_for_change(url)?;
    let cipher = rotate_on(Path::new(url), &*st, old, new).inspect_err(|_| st.release())?;
    st.close()
        .map_err(|e| Error::Refused(format!("{url}: closing after the rotation: {e}")))?;
    Ok(cipher)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cvol_engine::{CreateOptions, OpenOptions, Volume};
    use cvol_format::seal::Cipher;
    use cvol_objstore::{Config, Descriptor, ObjectStorage};
    use object_store::memory::InMemory;

    const MIB: u64 = 1 << 20;

    fn config(mem: &Arc<InMemory>, dir: &Path) -> Config {
        let mut c = Config::new(mem.clone(), "vols/k", dir.to_path_buf());
        c.lease = std::time::Duration::from_millis(100);
        c
    }

    fn keyed(k: &KeyFile) -> OpenOptions {
        OpenOptions {
            key: Some(k.clone()),
            ..OpenOptions::default()
        }
    }

    fn open_with(cfg: &Config, k: &KeyFile) -> Result<(Arc<ObjectStorage>, Volume), String> {
        let st = Arc::new(ObjectStorage::open(cfg).map_err(|e| e.to_string())?);
        match Volume::open(st.clone(), keyed(k)) {
            Ok(v) => Ok((st, v)),
            Err(e) => {
                st.close().expect("close the store");
                drop(st);
                Err(e.to_string())
            }
        }
    }

    /// The rotation of a volume in an object store, through the store's
    /// own deltas: the new key opens it with its data, the old is refused.
    #[test]
    fn rotation_in_an_object_store_retires_the_old_key() {
        let mem = Arc::new(InMemory::new());
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(&mem, dir.path());
        let (old, new) = (
            KeyFile::new(vec![3; 32]),
            KeyFile::new(b"a passphrase".to_vec()),
        );
        let opts = CreateOptions::new(32 * MIB, 64 * MIB)
            .with_segment_size(MIB)
            .with_encryption(Cipher::Aes256Gcm, old.clone());
        let d = Descriptor {
            size_bytes: opts.physical_size_bytes,
            head_bytes: cvol_format::DATA_OFFSET_BYTES,
            chunk_bytes: opts.segment_size_bytes,
        };
        cvol_objstore::create(&cfg, &d, false).unwrap();
        let st = Arc::new(ObjectStorage::open(&cfg).unwrap());
        let vol = Volume::create(st.clone(), &opts).unwrap();
        let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        vol.write_at(8192, &data, true).unwrap();
        vol.close().unwrap();
        drop(vol);
        st.close().unwrap();
        drop(st);

        let st = Arc::new(ObjectStorage::open(&cfg).unwrap());
        assert_eq!(
            rotate_on(Path::new("s3://b/k"), &*st, &old, &new).unwrap(),
            "aes-256-gcm"
        );
        st.close().unwrap();
        drop(st);

        let err = open_with(&cfg, &old).err().expect("the old key opened it");
        assert!(err.contains("key"), "{err}");
        let (st, vol) = open_with(&cfg, &new).expect("the new key");
        let mut got = vec![0u8; 4096];
        vol.read_at(8192, &mut got).unwrap();
        assert_eq!(got, data);
        vol.close().unwrap();
        drop(vol);
        st.close().unwrap();
        drop(st);
    }
}
