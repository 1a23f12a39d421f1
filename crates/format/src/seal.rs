//! Encryption at rest: sealed records and the data key's subkeys.
//!
//! On an encrypted volume (superblock flag `FLAG_ENCRYPTED`) every record is
//! *sealed*: its payload is AEAD-encrypted (AES-256-GCM or
//! ChaCha20-Poly1305, through aws-lc-rs) and followed by the 16-byte tag,
//! and bit 7 of the header's kind byte is set. The header stays in the
//! clear (sizes, positions, LBAs, seqs) and is authenticated with the
//! payload:
//!
//! ```text
//! nonce (12 bytes) = epoch u32 || seq u64          (little-endian)
//! AAD              = header bytes 0..40            (everything but the crc)
//! payload on disk  = ciphertext || tag (16 bytes)  (payload_len counts both)
//! crc              = crc32c over the header and the sealed payload, as always
//! ```
//!
//! A nonce never repeats under one key: `(epoch, seq)` is unique per record
//! ever written (seq rises by one per record within an open, and every open
//! for writing takes an epoch above any the log holds, synced before its
//! first other record). The cleaner's copies, recompression and relocation
//! are new records with new seqs, sealed again.
//!
//! The data key (32 random bytes, wrapped in the superblock's key slot,
//! `keyslot`) is never used directly: `blake3::derive_key` gives one
//! subkey per use (records, dedup fingerprints, other sealed blobs).

use std::borrow::Cow;
use std::ops::Range;

use aws_lc_rs::aead::{
    Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, CHACHA20_POLY1305, NONCE_LEN,
};
use zeroize::Zeroizing;

use crate::record::{RecordHeader, RECORD_HEADER_BYTES};
use crate::FormatError;

/// The AEAD tag after every sealed payload.
pub const SEAL_TAG_BYTES: usize = 16;
/// Bit 7 of a record header's kind byte: the payload is sealed.
pub const KIND_SEALED_BIT: u8 = 0x80;
/// Header bytes authenticated as associated data (all but the crc).
pub const SEAL_AAD_BYTES: usize = RECORD_HEADER_BYTES - 4;
/// Length of a data key and of every subkey.
pub const KEY_BYTES: usize = 32;
/// A sealed blob: nonce (random), ciphertext, tag.
pub const BLOB_OVERHEAD_BYTES: usize = NONCE_LEN + SEAL_TAG_BYTES;

/// The AEAD a volume is encrypted with (`--encryption`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Cipher {
    Aes256Gcm = 1,
    ChaCha20Poly1305 = 2,
}

impl Cipher {
    pub const ALL: [Cipher; 2] = [Cipher::Aes256Gcm, Cipher::ChaCha20Poly1305];

    pub fn name(self) -> &'static str {
        match self {
            Cipher::Aes256Gcm => "aes-256-gcm",
            Cipher::ChaCha20Poly1305 => "chacha20-poly1305",
        }
    }

    pub fn parse(s: &str) -> Option<Cipher> {
        Cipher::ALL.into_iter().find(|c| c.name() == s)
    }

    pub fn from_u8(v: u8) -> Result<Cipher, FormatError> {
        match v {
            1 => Ok(Cipher::Aes256Gcm),
            2 => Ok(Cipher::ChaCha20Poly1305),
            _ => Err(FormatError::Invalid("unknown cipher")),
        }
    }

    /// An AEAD key of this cipher.
    pub(crate) fn key(self, bytes: &[u8; KEY_BYTES]) -> LessSafeKey {
        let alg = match self {
            Cipher::Aes256Gcm => &AES_256_GCM,
            Cipher::ChaCha20Poly1305 => &CHACHA20_POLY1305,
        };
        LessSafeKey::new(UnboundKey::new(alg, bytes).expect("a 32-byte key fits both ciphers"))
    }
}

/// The subkey contexts (`blake3::derive_key`): fixed strings, never reused
/// for another purpose.
const RECORDS_CONTEXT: &str = "cvol 2026-11 record sealing key";
const FINGERPRINT_CONTEXT: &str = "cvol 2026-11 dedup fingerprint key";
const BLOBS_CONTEXT: &str = "cvol 2026-11 blob sealing key";
const KEY_ID_CONTEXT: &str = "cvol 2026-11 key identifier";

/// A volume's unwrapped data key, ready to seal and open. Cheap to share
/// (`Arc`); the key bytes are wiped when it is dropped.
pub struct Sealer {
    cipher: Cipher,
    records: LessSafeKey,
    blobs: LessSafeKey,
    fingerprint_key: Zeroizing<[u8; KEY_BYTES]>,
    /// Identifies the data key (not secret: a one-way derivation) so that
    /// two superblocks can be compared without comparing keys.
    id: [u8; 16],
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sealer({})", self.cipher.name())
    }
}

impl PartialEq for Sealer {
    fn eq(&self, other: &Sealer) -> bool {
        self.cipher == other.cipher && self.id == other.id
    }
}
impl Eq for Sealer {}

impl Sealer {
    pub fn new(cipher: Cipher, data_key: &[u8; KEY_BYTES]) -> Sealer {
        let sub = |context| Zeroizing::new(blake3::derive_key(context, data_key));
        let id = blake3::derive_key(KEY_ID_CONTEXT, data_key);
        Sealer {
            cipher,
            records: cipher.key(&sub(RECORDS_CONTEXT)),
            blobs: cipher.key(&sub(BLOBS_CONTEXT)),
            fingerprint_key: sub(FINGERPRINT_CONTEXT),
            id: id[..16].try_into().expect("16 bytes"),
        }
    }

    pub fn cipher(&self) -> Cipher {
        self.cipher
    }

    /// The key of the dedup fingerprints (a keyed BLAKE3).
    pub fn fingerprint_key(&self) -> &[u8; KEY_BYTES] {
        &self.fingerprint_key
    }

    fn record_nonce(epoch: u32, seq: u64) -> Nonce {
        let mut n = [0u8; NONCE_LEN];
        n[..4].copy_from_slice(&epoch.to_le_bytes());
        n[4..].copy_from_slice(&seq.to_le_bytes());
        Nonce::assume_unique_for_key(n)
    }

    /// Seals `payload` into `out` (`payload.len() + SEAL_TAG_BYTES` bytes)
    /// for the record whose header bytes 0..40 are `aad` (kind byte with
    /// `KIND_SEALED_BIT`, payload length counting the tag).
    pub fn seal_record(&self, aad: &[u8], epoch: u32, seq: u64, payload: &[u8], out: &mut [u8]) {
        assert_eq!(aad.len(), SEAL_AAD_BYTES);
        assert_eq!(out.len(), payload.len() + SEAL_TAG_BYTES);
        let (body, tag_out) = out.split_at_mut(payload.len());
        body.copy_from_slice(payload);
        let tag = self
            .records
            .seal_in_place_separate_tag(Self::record_nonce(epoch, seq), Aad::from(aad), body)
            .expect("sealing a record cannot fail");
        tag_out.copy_from_slice(tag.as_ref());
    }

    /// The plaintext payload of sealed record `rec` (header `h`, already
    /// decoded; its crc may or may not have been verified). A record
    /// that was changed, moved to another seq or epoch, or sealed under
    /// another key fails (`FormatError::Unauthentic`).
    pub fn open_record(&self, h: &RecordHeader, rec: &[u8]) -> Result<Vec<u8>, FormatError> {
        let mut buf = rec.get(..h.total_len()).unwrap_or(rec).to_vec();
        let at = self.open_record_in_place(h, &mut buf)?;
        buf.truncate(at.end);
        buf.drain(..at.start);
        Ok(buf)
    }

    /// [`Sealer::open_record`] in the record's own buffer: the payload is
    /// decrypted where it lies (no copy), and its plaintext's place in
    /// `rec` returned. A record that fails leaves its payload bytes
    /// unspecified: the caller drops the buffer.
    pub fn open_record_in_place(
        &self,
        h: &RecordHeader,
        rec: &mut [u8],
    ) -> Result<Range<usize>, FormatError> {
        if !h.sealed {
            return Err(FormatError::NotSealed);
        }
        if rec.len() < h.total_len() {
            return Err(FormatError::TooShort {
                needed: h.total_len(),
                got: rec.len(),
            });
        }
        let (head, rest) = rec.split_at_mut(RECORD_HEADER_BYTES);
        let body = &mut rest[..h.total_len() - RECORD_HEADER_BYTES];
        let n = self
            .records
            .open_in_place(
                Self::record_nonce(h.epoch, h.seq),
                Aad::from(&head[..SEAL_AAD_BYTES]),
                body,
            )
            .map_err(|_| FormatError::Unauthentic)?
            .len();
        Ok(RECORD_HEADER_BYTES..RECORD_HEADER_BYTES + n)
    }

    /// Seals a blob that is not a record (a random nonce, stored in front:
    /// written rarely, so 2^-96 per pair bounds a repeat). `domain` names
    /// what it is and is authenticated with it.
    pub fn seal_blob(&self, domain: &[u8], plain: &[u8]) -> Vec<u8> {
        let mut nonce = [0u8; NONCE_LEN];
        aws_lc_rs::rand::fill(&mut nonce).expect("the system random source works");
        let mut out = Vec::with_capacity(plain.len() + BLOB_OVERHEAD_BYTES);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(plain);
        let tag = self
            .blobs
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(domain),
                &mut out[NONCE_LEN..],
            )
            .expect("sealing a blob cannot fail");
        out.extend_from_slice(tag.as_ref());
        out
    }

    /// Opens a blob `seal_blob` made for `domain`.
    pub fn open_blob(&self, domain: &[u8], sealed: &[u8]) -> Result<Vec<u8>, FormatError> {
        if sealed.len() < BLOB_OVERHEAD_BYTES {
            return Err(FormatError::Unauthentic);
        }
        let nonce: [u8; NONCE_LEN] = sealed[..NONCE_LEN].try_into().expect("nonce");
        let mut buf = sealed[NONCE_LEN..].to_vec();
        let n = self
            .blobs
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(domain),
                &mut buf,
            )
            .map_err(|_| FormatError::Unauthentic)?
            .len();
        buf.truncate(n);
        Ok(buf)
    }
}

/// A record's payload as its content: the bytes after the header on a
/// volume without encryption (`seal` None), the opened plaintext with it.
/// A sealed record where no key is given, or an unsealed one where one is,
/// is refused: a record of another volume, or tampering.
pub fn payload<'a>(
    seal: Option<&Sealer>,
    h: &RecordHeader,
    rec: &'a [u8],
) -> Result<Cow<'a, [u8]>, FormatError> {
    match seal {
        None if h.sealed => Err(FormatError::Sealed),
        None => {
            let end = h.total_len();
            rec.get(RECORD_HEADER_BYTES..end)
                .map(Cow::Borrowed)
                .ok_or(FormatError::TooShort {
                    needed: end,
                    got: rec.len(),
                })
        }
        Some(s) => s.open_record(h, rec).map(Cow::Owned),
    }
}

/// [`payload`] in the record's own buffer: where the payload's content
/// lies in `rec` once opened in place (a sealed record's plaintext, or the
/// bytes after the header), with the same refusals.
pub fn payload_in_place(
    seal: Option<&Sealer>,
    h: &RecordHeader,
    rec: &mut [u8],
) -> Result<Range<usize>, FormatError> {
    match seal {
        None if h.sealed => Err(FormatError::Sealed),
        None if rec.len() < h.total_len() => Err(FormatError::TooShort {
            needed: h.total_len(),
            got: rec.len(),
        }),
        None => Ok(RECORD_HEADER_BYTES..h.total_len()),
        Some(s) => s.open_record_in_place(h, rec),
    }
}

/// Authenticates a record without using its content (ZERO, TRIM, EPOCH
/// records replayed by recovery: their meaning is in the header, which
/// the tag covers). Nothing to check without a key, but a sealed record
/// is refused then.
pub fn authenticate(
    seal: Option<&Sealer>,
    h: &RecordHeader,
    rec: &[u8],
) -> Result<(), FormatError> {
    payload(seal, h, rec).map(|_| ())
}

#[cfg(test)]
mod tests;
