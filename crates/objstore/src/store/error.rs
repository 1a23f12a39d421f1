//! What opening, creating and closing a volume can fail with: [`Error`],
//! and [`RecoveryError`] for reading the log back at open. Each says what
//! happened in words a user can act on ([`describe`] words the store's own
//! errors). Converts to the `std::io::Error` of the `Storage` trait.
//!
//! Depends on: `format` (a malformed object's description) only.
use crate::format::Malformed;
use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// An object-store error in words a user can act on: a missing bucket,
/// missing or refused credentials, an unreachable endpoint.
pub fn describe(label: &str, e: &object_store::Error) -> String {
    let text = e.to_string();
    let code = text
        .split("<Code>")
        .nth(1)
        .and_then(|r| r.split("</Code>").next())
        .unwrap_or("");
    let endpoint =
        std::env::var("AWS_ENDPOINT_URL").unwrap_or_else(|_| "AWS (no AWS_ENDPOINT_URL)".into());
    if code == "NoSuchBucket" {
        return format!(
            "{label}: the bucket does not exist at {endpoint}; create it first (any S3 tool; \
             `scripts/ceph-local mkbucket NAME` for the local Ceph)"
        );
    }
    if matches!(
        code,
        "InvalidAccessKeyId" | "SignatureDoesNotMatch" | "AccessDenied"
    ) {
        return format!(
            "{label}: {endpoint} refused the credentials ({code}): check AWS_ACCESS_KEY_ID and \
             AWS_SECRET_ACCESS_KEY"
        );
    }
    if std::env::var_os("AWS_ACCESS_KEY_ID").is_none()
        && (text.contains("169.254.169.254") || text.to_lowercase().contains("credential"))
    {
        return format!(
            "{label}: no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and \
             AWS_ENDPOINT_URL for a store other than AWS); the instance metadata service did not \
             provide any"
        );
    }
    if text.contains("error sending request") {
        return format!("{label}: cannot reach the object store at {endpoint}: {text}");
    }
    let short: String = text.chars().take(400).collect();
    format!("{label}: {short}")
}

/// Why a volume could not be created, opened or closed (`label`: the
/// volume's URL, which every message but a few starts with).
#[derive(Debug)]
pub enum Error {
    /// The shape asked for is not a valid volume.
    Descriptor(Malformed),
    /// The I/O runtime did not start.
    Runtime(io::Error),
    /// The store failed a request: in words a user can act on ([`describe`]).
    Store {
        label: String,
        source: object_store::Error,
    },
    /// The store failed a request, in the store's words.
    Request {
        label: String,
        source: object_store::Error,
    },
    /// `destroy` failed (the store's words alone).
    Destroy(object_store::Error),
    /// Objects are at the prefix already (a volume when `volume`).
    Occupied {
        label: String,
        volume: bool,
        objects: usize,
    },
    /// Deleting an object under the prefix failed (create --force).
    Delete {
        label: String,
        name: String,
        source: object_store::Error,
    },
    /// The store does not honour create-only PUTs, and fencing was not
    /// waived: `why` is what the probe saw.
    NoFencing { label: String, why: String },
    /// No `volume` object at the prefix.
    NoVolume { label: String },
    /// The `volume` object does not decode.
    BadDescriptor { label: String, source: Malformed },
    /// `--cache-dir` could not be made.
    CacheDir { dir: PathBuf, source: io::Error },
    /// Another process holds the cache file.
    CacheInUse { file: PathBuf },
    /// The cache file could not be made.
    CacheFile { file: PathBuf, source: io::Error },
    /// The volume's lease changed within `wait`: `who` serves it.
    Served {
        label: String,
        who: String,
        wait: Duration,
    },
    /// Another server claimed the same epoch at the same time.
    ClaimRace { label: String, epoch: u64 },
    /// The log could not be read back.
    Recovery {
        label: String,
        source: RecoveryError,
    },
    /// A local failure (a thread that did not start, a sync at close).
    Io { label: String, source: io::Error },
    /// The store stopped taking writes before close (`why`: fenced, a
    /// failed PUT).
    NotClosedCleanly { label: String, why: String },
    /// The manifest written at close failed.
    FinalManifest { label: String, source: io::Error },
    /// Releasing the lease at close failed.
    ReleaseLease {
        label: String,
        source: object_store::Error,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Descriptor(e) => write!(f, "{e}"),
            Error::BadDescriptor { label, source } => write!(f, "{label}: {source}"),
            Error::Runtime(e) => write!(f, "cannot start the I/O runtime: {e}"),
            Error::Store { label, source } => f.write_str(&describe(label, source)),
            Error::Request { label, source } => write!(f, "{label}: {source}"),
            Error::Destroy(e) => write!(f, "{e}"),
            Error::Occupied {
                label,
                volume,
                objects,
            } => {
                let what = if *volume {
                    "a cvol volume is there"
                } else {
                    "objects are there"
                };
                write!(
                    f,
                    "{label}: {what} ({objects} objects); --force deletes them"
                )
            }
            Error::Delete {
                label,
                name,
                source,
            } => write!(f, "{label}: deleting {name}: {source}"),
            Error::NoFencing { label, why } => write!(
                f,
                "{label}: the object store does not honour create-only PUTs (If-None-Match: *): \
                 {why}. cvol's single-writer fencing rests on them: without it, a server taken \
                 over after a pause could go on writing and corrupt the volume. Use a store that \
                 honours them (AWS S3 and Ceph RGW do), or, if only one server will ever write \
                 this volume at a time (an old one always gone before a new one starts), pass \
                 --unsafe-no-fencing."
            ),
            Error::NoVolume { label } => write!(
                f,
                "{label}: no cvol volume there (no `volume` object); create it with \
                 `cvol create {label} --size SIZE`"
            ),
            Error::CacheDir { dir, source } => {
                write!(f, "--cache-dir {}: {source}", dir.display())
            }
            Error::CacheInUse { file } => write!(
                f,
                "{}: the cache file is in use by another cvol process",
                file.display()
            ),
            Error::CacheFile { file, source } => write!(f, "{}: {source}", file.display()),
            Error::Served { label, who, wait } => write!(
                f,
                "{label}: being served by another server ({who}; its lease changed within the \
                 last {} s); stop it first",
                wait.as_secs_f64()
            ),
            Error::ClaimRace { label, epoch } => write!(
                f,
                "{label}: another server claimed the volume at the same time (epoch {epoch})"
            ),
            Error::Recovery { label, source } => write!(f, "{label}: {source}"),
            Error::Io { label, source } => write!(f, "{label}: {source}"),
            Error::NotClosedCleanly { label, why } => {
                write!(f, "{label}: not closed cleanly: {why}")
            }
            Error::FinalManifest { label, source } => {
                write!(f, "{label}: final manifest: {source}")
            }
            Error::ReleaseLease { label, source } => {
                write!(f, "{label}: releasing the lease: {source}")
            }
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Runtime(e)
            | Error::CacheDir { source: e, .. }
            | Error::CacheFile { source: e, .. }
            | Error::Io { source: e, .. }
            | Error::FinalManifest { source: e, .. } => Some(e),
            Error::Store { source, .. }
            | Error::Request { source, .. }
            | Error::Delete { source, .. }
            | Error::ReleaseLease { source, .. }
            | Error::Destroy(source) => Some(source),
            Error::Recovery { source, .. } => Some(source),
            Error::Descriptor(e) | Error::BadDescriptor { source: e, .. } => Some(e),
            _ => None,
        }
    }
}

impl From<Error> for io::Error {
    fn from(e: Error) -> io::Error {
        io::Error::other(e)
    }
}

/// For callers that report errors as text (the CLI's commands).
impl From<Error> for String {
    fn from(e: Error) -> String {
        e.to_string()
    }
}

/// Why the log could not be read back at open (fenced, then replayed
/// from the newest manifest).
#[derive(Debug)]
pub enum RecoveryError {
    /// Listing the log or the manifests failed.
    List(object_store::Error),
    /// Every fence attempt lost to a racing writer's delta.
    FenceContended,
    /// The fence's PUT failed.
    Fence(object_store::Error),
    /// A delta or manifest landed above the fence: another server wrote
    /// while this one was starting.
    Overtaken { fence: u64 },
    /// No manifest at all.
    NoManifest,
    /// Manifest `seq` could not be read.
    Manifest {
        seq: u64,
        source: object_store::Error,
    },
    /// Manifest `seq` does not decode.
    ManifestMalformed { seq: u64, source: Malformed },
    /// Manifest `seq` has the wrong chunk count or number.
    ManifestMismatch { seq: u64 },
    /// Delta `seq` (after manifest `manifest`) could not be read.
    Delta {
        seq: u64,
        manifest: u64,
        source: object_store::Error,
    },
    /// Delta `seq` does not decode.
    DeltaMalformed { seq: u64, source: Malformed },
    /// Delta `seq` says it is number `says`.
    DeltaMisnumbered { seq: u64, says: u64 },
    /// Delta `seq` names a chunk beyond the volume.
    ChunkBeyond { seq: u64, chunk: u32 },
    /// Delta `seq` has a range of partial sectors or beyond the volume.
    Unaligned { seq: u64, offset: u64, len: usize },
    /// Applying delta `seq` to the cache file failed.
    Local { seq: u64, source: io::Error },
}

impl fmt::Display for RecoveryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecoveryError::List(e) => write!(f, "{e}"),
            RecoveryError::FenceContended => {
                f.write_str("cannot fence the log: another writer keeps appending")
            }
            RecoveryError::Fence(e) => write!(f, "fencing the log: {e}"),
            RecoveryError::Overtaken { fence } => write!(
                f,
                "another server wrote to the volume while this one was starting (fence {fence}                  is not the newest delta): start again"
            ),
            RecoveryError::NoManifest => {
                f.write_str("no manifest: the volume was not created completely")
            }
            RecoveryError::Manifest { seq, source } => write!(f, "manifest {seq}: {source}"),
            RecoveryError::ManifestMalformed { seq, source } => {
                write!(f, "manifest {seq}: {source}")
            }
            RecoveryError::ManifestMismatch { seq } => {
                write!(f, "manifest {seq} does not match the volume")
            }
            RecoveryError::Delta {
                seq,
                manifest,
                source,
            } => write!(f, "delta {seq} (after manifest {manifest}): {source}"),
            RecoveryError::DeltaMalformed { seq, source } => write!(f, "delta {seq}: {source}"),
            RecoveryError::DeltaMisnumbered { seq, says } => {
                write!(f, "delta {seq} says it is number {says}")
            }
            RecoveryError::ChunkBeyond { seq, chunk } => {
                write!(f, "delta {seq}: chunk {chunk} beyond the volume")
            }
            RecoveryError::Unaligned { seq, offset, len } => write!(
                f,
                "delta {seq}: range {offset}+{len} is not whole sectors of the volume"
            ),
            RecoveryError::Local { seq, source } => write!(f, "delta {seq}: {source}"),
        }
    }
}

impl std::error::Error for RecoveryError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RecoveryError::List(e)
            | RecoveryError::Fence(e)
            | RecoveryError::Manifest { source: e, .. }
            | RecoveryError::Delta { source: e, .. } => Some(e),
            RecoveryError::Local { source, .. } => Some(source),
            RecoveryError::ManifestMalformed { source, .. }
            | RecoveryError::DeltaMalformed { source, .. } => Some(source),
            _ => None,
        }
    }
}
