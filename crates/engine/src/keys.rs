//! Encryption keys: the key file an open is given, the data key it
//! unwraps from the superblock's key slot (`unlock`), a new volume's key
//! (`new_key_slot`) and a key rotation (`rotate`), which rewraps the data
//! key under another key file without touching a record. Uses `error`.

use std::sync::Arc;

use cvol_format::keyslot::{new_data_key, KeyError, KeySlot};
use cvol_format::seal::{Cipher, Sealer};
use cvol_format::{Superblock, SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET};
use cvol_storage::Storage;
use zeroize::Zeroizing;

use crate::error::{KeyProblem, OpenError, VolError};

/// The bytes of a key file (a raw 32-byte key or a passphrase), wiped
/// when the last copy is dropped and never printed.
#[derive(Clone)]
pub struct KeyFile(Arc<Zeroizing<Vec<u8>>>);

impl KeyFile {
    pub fn new(bytes: Vec<u8>) -> KeyFile {
        KeyFile(Arc::new(Zeroizing::new(bytes)))
    }

    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for KeyFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeyFile(..)")
    }
}

/// How a new volume is encrypted (`cvol create --encryption`).
#[derive(Debug, Clone)]
pub struct Encryption {
    pub cipher: Cipher,
    pub key: KeyFile,
}

/// A new volume's key slot and sealer: a fresh random data key wrapped
/// under `e`'s key file.
pub fn new_key_slot(uuid: &[u8; 16], e: &Encryption) -> Result<(KeySlot, Arc<Sealer>), KeyProblem> {
    let data_key = new_data_key();
    let slot = KeySlot::wrap(e.cipher, uuid, &data_key, e.key.bytes()).map_err(KeyProblem::Key)?;
    Ok((slot, Arc::new(Sealer::new(e.cipher, &data_key))))
}

/// Gives `sb` its sealer: the data key unwrapped with `key`. Nothing is
/// written. A volume without encryption takes no key. When `sb`'s slot
/// does not take the key, the other superblock copy's is tried (a key
/// rotation cut short by a crash leaves one copy under each key).
pub fn unlock(
    storage: &dyn Storage,
    sb: &mut Superblock,
    key: Option<&KeyFile>,
) -> Result<(), OpenError> {
    let problem = |p| OpenError::Key(p);
    let Some(slot) = sb.key_slot else {
        return match key {
            Some(_) => Err(problem(KeyProblem::NotEncrypted)),
            None => Ok(()),
        };
    };
    let key = key.ok_or(problem(KeyProblem::Needed(slot.cipher)))?;
    let mut result = slot.unwrap(&sb.uuid, key.bytes());
    if result == Err(KeyError::WrongKey) {
        for other in other_slots(storage, sb) {
            if let Ok(k) = other.unwrap(&sb.uuid, key.bytes()) {
                tracing::warn!(
                    "the key opens only one superblock copy (a key rotation was cut short): \
                     run `cvol key rotate` again to finish it"
                );
                result = Ok(k);
                break;
            }
        }
    }
    let data_key = result.map_err(|e| problem(KeyProblem::Key(e)))?;
    sb.seal = Some(Arc::new(Sealer::new(slot.cipher, &data_key)));
    Ok(())
}

/// The key slots of both superblock copies that decode and are of `sb`'s
/// volume, other than `sb`'s own.
fn other_slots(storage: &dyn Storage, sb: &Superblock) -> Vec<KeySlot> {
    let mut out = Vec::new();
    for at in [SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET] {
        let mut b = vec![0u8; cvol_format::superblock::SUPERBLOCK_BYTES];
        if storage.read_at(at, &mut b).is_err() {
            continue;
        }
        if let Ok(copy) = Superblock::decode(&b) {
            if copy.uuid == sb.uuid && copy.key_slot.is_some() && copy.key_slot != sb.key_slot {
                out.extend(copy.key_slot);
            }
        }
    }
    out
}

/// Rewraps the data key of the volume whose (unlocked) superblock is `sb`
/// under `new_key`, and writes both superblock copies, A then B, each
/// synced. A crash between leaves copy A under the new key and B under the
/// old (or, A torn, B under the old): either key opens the volume
/// (`unlock` tries both copies), and a second rotation finishes the job.
/// The caller holds the volume's lock: nobody else has it open.
pub fn rotate(
    storage: &dyn Storage,
    sb: &Superblock,
    old_key: &KeyFile,
    new_key: &KeyFile,
) -> Result<Superblock, VolError> {
    let slot = sb
        .key_slot
        .ok_or(OpenError::Key(KeyProblem::NotEncrypted))?;
    let data_key = slot
        .unwrap(&sb.uuid, old_key.bytes())
        .or_else(|e| {
            other_slots(storage, sb)
                .iter()
                .find_map(|s| s.unwrap(&sb.uuid, old_key.bytes()).ok())
                .ok_or(e)
        })
        .map_err(|e| OpenError::Key(KeyProblem::Key(e)))?;
    let new_slot = KeySlot::wrap(slot.cipher, &sb.uuid, &data_key, new_key.bytes())
        .map_err(|e| OpenError::Key(KeyProblem::Key(e)))?;
    let mut next = sb.clone();
    next.key_slot = Some(new_slot);
    let enc = next.encode();
    for at in [SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET] {
        storage
            .write_at(at, &enc)
            .and_then(|()| storage.sync())
            .map_err(VolError::Io)?;
    }
    let _check: Zeroizing<[u8; 32]> = new_slot
        .unwrap(&sb.uuid, new_key.bytes())
        .map_err(|e| OpenError::Key(KeyProblem::Key(e)))?;
    Ok(next)
}
