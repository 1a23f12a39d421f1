//! The encrypted runs of the simulations (`cvol create --encryption`): a
//! seed's cipher and key, given to the create and to every open and check
//! of its volume. The same seeds run sealed and in the clear; a sealed
//! run's records carry an AEAD tag, so its log differs in every offset.
use cvol_engine::check::{self, CheckReport, RepairReport};
use cvol_engine::{CreateOptions, KeyFile, OpenOptions};
use cvol_format::seal::Cipher;
use cvol_storage::Storage;
use std::sync::Arc;

/// How a simulated volume is sealed: AES-256-GCM on even seeds,
/// ChaCha20-Poly1305 on odd ones, under a raw 32-byte key of the seed
/// (a raw key skips the passphrase KDF, which would dominate a seed).
#[derive(Clone, Debug)]
pub struct Sealing {
    pub cipher: Cipher,
    pub key: KeyFile,
}

impl Sealing {
    pub fn of_seed(seed: u64) -> Sealing {
        let cipher = match seed % 2 {
            0 => Cipher::Aes256Gcm,
            _ => Cipher::ChaCha20Poly1305,
        };
        let mut key = [0u8; 32];
        for (i, b) in key.iter_mut().enumerate() {
            *b = (seed.rotate_left(i as u32 * 7) as u8) ^ (i as u8).wrapping_mul(0x9d);
        }
        Sealing {
            cipher,
            key: KeyFile::new(key.to_vec()),
        }
    }
}

/// `opts`, encrypted when `s` is given.
pub fn create_opts(s: Option<&Sealing>, opts: CreateOptions) -> CreateOptions {
    match s {
        Some(s) => opts.with_encryption(s.cipher, s.key.clone()),
        None => opts,
    }
}

/// `o`, with the key when `s` is given.
pub fn open_opts(s: Option<&Sealing>, o: OpenOptions) -> OpenOptions {
    OpenOptions {
        key: s.map(|s| s.key.clone()),
        ..o
    }
}

/// `check_volume` with the volume's key.
pub fn check(s: Option<&Sealing>, storage: &dyn Storage) -> CheckReport {
    check::check_volume_with_key(storage, s.map(|s| &s.key), &mut |_, _| {})
}

/// `repair_volume` with the volume's key.
pub fn repair(s: Option<&Sealing>, storage: Arc<dyn Storage>) -> RepairReport {
    check::repair_volume_with_key(storage, s.map(|s| s.key.clone()))
}

/// The volume on `storage` is encrypted (so a sealed run did not quietly
/// run in the clear).
pub fn assert_encrypted(storage: &dyn Storage) {
    let (sb, _) = cvol_engine::read_superblock(storage).expect("a superblock");
    assert!(sb.is_encrypted(), "the volume is not encrypted");
}

thread_local! {
    /// The sealing of the seed this thread runs (`with_current`), for the
    /// helpers a simulation shares that open its volume deep down.
    static CURRENT: std::cell::RefCell<Option<Sealing>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` with `s` as this thread's sealing (`current`); the seed runners
/// run each seed whole on one thread.
pub fn with_current<R>(s: Option<Sealing>, f: impl FnOnce() -> R) -> R {
    let before = CURRENT.with(|c| c.replace(s));
    let r = f();
    CURRENT.with(|c| *c.borrow_mut() = before);
    r
}

/// The sealing `with_current` set on this thread (None: in the clear).
pub fn current() -> Option<Sealing> {
    CURRENT.with(|c| c.borrow().clone())
}

/// The payload in the clear of the record at `at` on `storage` (`len`
/// bytes with its header), opened with the volume's key when sealed.
pub fn payload(s: Option<&Sealing>, storage: &dyn Storage, at: u64, len: usize) -> Vec<u8> {
    let (mut sb, _) = cvol_engine::read_superblock(storage).expect("a superblock");
    cvol_engine::keys::unlock(storage, &mut sb, s.map(|s| &s.key)).expect("the volume's key");
    let mut rec = vec![0u8; len];
    storage.read_at(at, &mut rec).expect("read the record");
    let h = cvol_format::RecordHeader::decode(&rec).expect("a record header");
    cvol_format::seal::payload(sb.sealer(), &h, &rec)
        .expect("an intact record")
        .into_owned()
}

/// The unlocked key of the volume on `storage` under this thread's sealing
/// (`current`), for oracles that decode sealed structures themselves (the
/// pool table); None in the clear.
pub fn current_sealer(storage: &dyn Storage) -> Option<Arc<cvol_format::seal::Sealer>> {
    let s = current()?;
    let (mut sb, _) = cvol_engine::read_superblock(storage).expect("a superblock");
    cvol_engine::keys::unlock(storage, &mut sb, Some(&s.key)).expect("the volume's key");
    sb.seal
}
