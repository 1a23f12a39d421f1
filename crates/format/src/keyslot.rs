//! The key slot of an encrypted volume's superblock: its data key, wrapped
//! by the key-encryption key the user's key file gives.
//!
//! A key file of exactly 32 bytes is a raw key (`head -c 32 /dev/urandom`),
//! used as the key-encryption key as it is. Anything else is a passphrase
//! (one trailing newline dropped, at least 8 bytes left), stretched with
//! Argon2id (RFC 9106) and the slot's random salt; the cost parameters are
//! stored in the slot. The data key is wrapped with the volume's cipher and
//! a random nonce; the slot's other fields and the volume uuid are the
//! associated data, so a slot copied to another volume, or with its cost
//! lowered, does not unwrap. A wrong key fails the tag: `KeyError::WrongKey`.
//!
//! ```text
//! offset size field
//! 0      8    magic "CVOLKEY1"
//! 8      1    cipher: 1 aes-256-gcm, 2 chacha20-poly1305
//! 9      1    key-encryption key: 1 raw 32-byte key, 2 Argon2id passphrase
//! 10     2    reserved (0)
//! 12     4    Argon2id memory cost in KiB (0 for a raw key)
//! 16     4    Argon2id passes (0 for a raw key)
//! 20     4    Argon2id lanes (0 for a raw key)
//! 24     16   salt (random; zero for a raw key)
//! 40     12   nonce of the wrapping (random, new at every wrap)
//! 52     48   the data key sealed: 32 bytes and the 16-byte tag
//! 100    4    crc32c of bytes 0..100
//! ```

use aws_lc_rs::aead::{Aad, Nonce, NONCE_LEN};
use zeroize::Zeroizing;

use crate::seal::{Cipher, KEY_BYTES, SEAL_TAG_BYTES};
use crate::superblock::UUID_BYTES;
use crate::{get_u32, need, put_u32, FormatError};

pub const KEY_SLOT_MAGIC: [u8; 8] = *b"CVOLKEY1";
const OFF_CIPHER: usize = 8;
const OFF_KDF: usize = OFF_CIPHER + 1;
const OFF_M_COST: usize = OFF_KDF + 3;
const OFF_T_COST: usize = OFF_M_COST + 4;
const OFF_P_COST: usize = OFF_T_COST + 4;
const OFF_SALT: usize = OFF_P_COST + 4;
const SALT_BYTES: usize = 16;
const OFF_NONCE: usize = OFF_SALT + SALT_BYTES;
const OFF_WRAPPED: usize = OFF_NONCE + NONCE_LEN;
const WRAPPED_BYTES: usize = KEY_BYTES + SEAL_TAG_BYTES;
const OFF_CRC: usize = OFF_WRAPPED + WRAPPED_BYTES;
pub const KEY_SLOT_BYTES: usize = OFF_CRC + 4;
const _: () = assert!(KEY_SLOT_BYTES == 104);

/// A raw key file is exactly this long.
pub const RAW_KEY_FILE_BYTES: usize = KEY_BYTES;
/// The shortest passphrase taken.
pub const PASSPHRASE_MIN_BYTES: usize = 8;
/// Argon2id costs for new passphrase slots: 64 MiB, 3 passes, 1 lane
/// (RFC 9106's second recommended option, with one lane for small hosts).
pub const ARGON2_M_KIB: u32 = 64 * 1024;
pub const ARGON2_T: u32 = 3;
pub const ARGON2_P: u32 = 1;
/// The largest costs a slot may ask for (a damaged or hostile slot must
/// not make an open allocate without bound).
const ARGON2_M_KIB_MAX: u32 = 4 * 1024 * 1024;
const ARGON2_T_MAX: u32 = 64;
const ARGON2_P_MAX: u32 = 16;

/// How the key-encryption key comes from the key file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kdf {
    /// The file's 32 bytes are the key.
    Raw,
    /// Argon2id of the passphrase and the salt.
    Argon2id { m_kib: u32, t: u32, p: u32 },
}

impl Kdf {
    pub fn name(self) -> &'static str {
        match self {
            Kdf::Raw => "raw key",
            Kdf::Argon2id { .. } => "passphrase (Argon2id)",
        }
    }
}

/// Why a key file does not open a volume, or cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyError {
    /// The key file is well formed, but not this volume's.
    WrongKey,
    /// The file is empty, or its passphrase too short.
    BadKeyFile(&'static str),
}

impl std::fmt::Display for KeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyError::WrongKey => write!(
                f,
                "wrong key: the key file does not unlock this volume's data key"
            ),
            KeyError::BadKeyFile(why) => write!(f, "unusable key file: {why}"),
        }
    }
}

impl std::error::Error for KeyError {}

/// The superblock's key slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeySlot {
    pub cipher: Cipher,
    pub kdf: Kdf,
    pub salt: [u8; SALT_BYTES],
    pub nonce: [u8; NONCE_LEN],
    pub wrapped: [u8; WRAPPED_BYTES],
}

/// 32 fresh random bytes: a new volume's data key.
pub fn new_data_key() -> Zeroizing<[u8; KEY_BYTES]> {
    let mut k = Zeroizing::new([0u8; KEY_BYTES]);
    aws_lc_rs::rand::fill(&mut k[..]).expect("the system random source works");
    k
}

/// What a key file holds: a raw key (exactly 32 bytes) or a passphrase.
fn key_material(file: &[u8]) -> Result<(bool, &[u8]), KeyError> {
    if file.len() == RAW_KEY_FILE_BYTES {
        return Ok((true, file));
    }
    let p = file
        .strip_suffix(b"\r\n")
        .or_else(|| file.strip_suffix(b"\n"))
        .unwrap_or(file);
    if p.is_empty() {
        return Err(KeyError::BadKeyFile("it is empty"));
    }
    if p.len() < PASSPHRASE_MIN_BYTES {
        return Err(KeyError::BadKeyFile(
            "a passphrase needs at least 8 bytes (or give exactly 32 random bytes)",
        ));
    }
    Ok((false, p))
}

impl KeySlot {
    /// Wraps `data_key` for volume `uuid` under the key `key_file` gives.
    pub fn wrap(
        cipher: Cipher,
        uuid: &[u8; UUID_BYTES],
        data_key: &[u8; KEY_BYTES],
        key_file: &[u8],
    ) -> Result<KeySlot, KeyError> {
        let (raw, _) = key_material(key_file)?;
        let mut slot = KeySlot {
            cipher,
            kdf: Kdf::Raw,
            salt: [0; SALT_BYTES],
            nonce: [0; NONCE_LEN],
            wrapped: [0; WRAPPED_BYTES],
        };
        if !raw {
            slot.kdf = Kdf::Argon2id {
                m_kib: ARGON2_M_KIB,
                t: ARGON2_T,
                p: ARGON2_P,
            };
            aws_lc_rs::rand::fill(&mut slot.salt).expect("the system random source works");
        }
        aws_lc_rs::rand::fill(&mut slot.nonce).expect("the system random source works");
        let kek = slot.kek(key_file)?;
        let mut buf = [0u8; KEY_BYTES];
        buf.copy_from_slice(data_key);
        let aad = slot.aad(uuid);
        let tag = cipher
            .key(&kek)
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(slot.nonce),
                Aad::from(&aad[..]),
                &mut buf,
            )
            .expect("wrapping a key cannot fail");
        slot.wrapped[..KEY_BYTES].copy_from_slice(&buf);
        slot.wrapped[KEY_BYTES..].copy_from_slice(tag.as_ref());
        Ok(slot)
    }

    /// The data key, if `key_file` is this volume's key.
    pub fn unwrap(
        &self,
        uuid: &[u8; UUID_BYTES],
        key_file: &[u8],
    ) -> Result<Zeroizing<[u8; KEY_BYTES]>, KeyError> {
        let (raw, _) = key_material(key_file)?;
        if raw != (self.kdf == Kdf::Raw) {
            return Err(KeyError::WrongKey);
        }
        let kek = self.kek(key_file)?;
        let mut buf = Zeroizing::new(self.wrapped);
        let aad = self.aad(uuid);
        let plain = self
            .cipher
            .key(&kek)
            .open_in_place(
                Nonce::assume_unique_for_key(self.nonce),
                Aad::from(&aad[..]),
                &mut buf[..],
            )
            .map_err(|_| KeyError::WrongKey)?;
        let mut key = Zeroizing::new([0u8; KEY_BYTES]);
        key.copy_from_slice(plain);
        Ok(key)
    }

    /// The key-encryption key from the key file.
    fn kek(&self, key_file: &[u8]) -> Result<Zeroizing<[u8; KEY_BYTES]>, KeyError> {
        let (_, material) = key_material(key_file)?;
        let mut kek = Zeroizing::new([0u8; KEY_BYTES]);
        match self.kdf {
            Kdf::Raw => kek.copy_from_slice(material),
            Kdf::Argon2id { m_kib, t, p } => {
                let params = argon2::Params::new(m_kib, t, p, Some(KEY_BYTES)).map_err(|_| {
                    KeyError::BadKeyFile("the key slot's Argon2id costs are invalid")
                })?;
                argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params)
                    .hash_password_into(material, &self.salt, &mut kek[..])
                    .map_err(|_| KeyError::BadKeyFile("Argon2id refused the passphrase"))?;
            }
        }
        Ok(kek)
    }

    /// Associated data of the wrapping: a label, the volume and the slot's
    /// parameters.
    fn aad(&self, uuid: &[u8; UUID_BYTES]) -> Vec<u8> {
        let b = self.encode();
        let mut aad = b"cvol key slot".to_vec();
        aad.extend_from_slice(uuid);
        aad.extend_from_slice(&b[..OFF_NONCE]);
        aad
    }

    pub fn encode(&self) -> [u8; KEY_SLOT_BYTES] {
        let mut b = [0u8; KEY_SLOT_BYTES];
        b[..8].copy_from_slice(&KEY_SLOT_MAGIC);
        b[OFF_CIPHER] = self.cipher as u8;
        let (kdf, m, t, p) = match self.kdf {
            Kdf::Raw => (1, 0, 0, 0),
            Kdf::Argon2id { m_kib, t, p } => (2, m_kib, t, p),
        };
        b[OFF_KDF] = kdf;
        put_u32(&mut b, OFF_M_COST, m);
        put_u32(&mut b, OFF_T_COST, t);
        put_u32(&mut b, OFF_P_COST, p);
        b[OFF_SALT..OFF_SALT + SALT_BYTES].copy_from_slice(&self.salt);
        b[OFF_NONCE..OFF_NONCE + NONCE_LEN].copy_from_slice(&self.nonce);
        b[OFF_WRAPPED..OFF_WRAPPED + WRAPPED_BYTES].copy_from_slice(&self.wrapped);
        let crc = crc32c::crc32c(&b[..OFF_CRC]);
        put_u32(&mut b, OFF_CRC, crc);
        b
    }

    pub fn decode(b: &[u8]) -> Result<KeySlot, FormatError> {
        need(b, KEY_SLOT_BYTES)?;
        if b[..8] != KEY_SLOT_MAGIC {
            return Err(FormatError::BadMagic);
        }
        let stored = get_u32(b, OFF_CRC);
        let computed = crc32c::crc32c(&b[..OFF_CRC]);
        if stored != computed {
            return Err(FormatError::BadChecksum { stored, computed });
        }
        let (m, t, p) = (
            get_u32(b, OFF_M_COST),
            get_u32(b, OFF_T_COST),
            get_u32(b, OFF_P_COST),
        );
        let kdf = match b[OFF_KDF] {
            1 if (m, t, p) == (0, 0, 0) => Kdf::Raw,
            2 if (8..=ARGON2_M_KIB_MAX).contains(&m)
                && (1..=ARGON2_T_MAX).contains(&t)
                && (1..=ARGON2_P_MAX).contains(&p) =>
            {
                Kdf::Argon2id { m_kib: m, t, p }
            }
            _ => return Err(FormatError::Invalid("key slot: key derivation")),
        };
        if b[OFF_KDF + 1..OFF_M_COST] != [0, 0] {
            return Err(FormatError::Invalid("key slot: reserved bytes"));
        }
        Ok(KeySlot {
            cipher: Cipher::from_u8(b[OFF_CIPHER])?,
            kdf,
            salt: b[OFF_SALT..OFF_SALT + SALT_BYTES].try_into().expect("salt"),
            nonce: b[OFF_NONCE..OFF_NONCE + NONCE_LEN]
                .try_into()
                .expect("nonce"),
            wrapped: b[OFF_WRAPPED..OFF_WRAPPED + WRAPPED_BYTES]
                .try_into()
                .expect("wrapped key"),
        })
    }
}

#[cfg(test)]
mod tests;
