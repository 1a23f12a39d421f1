//! Why a pool operation was refused. Every message names the problem; a
//! refused operation changed nothing.
use crate::error::VolError;
use std::fmt;

#[derive(Debug)]
pub enum PoolError {
    /// The file predates pools: it holds its one volume only.
    Legacy,
    /// The pool is open read-only.
    ReadOnly,
    /// A name `name_problem` refuses.
    BadName {
        name: String,
        why: &'static str,
    },
    Exists(String),
    NotFound {
        name: String,
        known: Vec<String>,
    },
    /// A size that is not a positive multiple of 4096, or above 16 TiB.
    BadSize {
        size_bytes: u64,
    },
    /// Not enough free space in the pool's 16 TiB logical space.
    NoRoom {
        needed_bytes: u64,
        free_bytes: u64,
    },
    TooManyVolumes,
    /// Clients have the volume open.
    InUse {
        name: String,
        clients: usize,
    },
    /// A shrink would cut off mapped data.
    MappedBeyond {
        name: String,
        size_bytes: u64,
        first_mapped: u64,
    },
    /// A name `snapshot_name_problem` refuses, or one without '@'.
    BadSnapshotName {
        name: String,
        why: &'static str,
    },
    SnapshotExists(String),
    SnapshotNotFound {
        name: String,
        known: Vec<String>,
    },
    /// A volume with snapshots cannot be deleted.
    HasSnapshots {
        name: String,
        snapshots: Vec<String>,
    },
    /// A snapshot clones depend on cannot be deleted.
    HasClones {
        name: String,
        clones: Vec<String>,
    },
    /// A rollback to a snapshot that is not the volume's newest.
    NotNewest {
        name: String,
        newer: Vec<String>,
    },
    /// A rollback of a volume resized since the snapshot.
    SizeChanged {
        name: String,
        size_bytes: u64,
        snapshot_bytes: u64,
    },
    /// A shrink of a volume with snapshots, or of a clone.
    ShrinkLayered {
        name: String,
    },
    /// Both copies of the volume table are unreadable.
    Table(String),
    Vol(VolError),
}

impl From<VolError> for PoolError {
    fn from(e: VolError) -> PoolError {
        PoolError::Vol(e)
    }
}

impl From<std::io::Error> for PoolError {
    fn from(e: std::io::Error) -> PoolError {
        PoolError::Vol(VolError::Io(e))
    }
}

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolError::Legacy => write!(
                f,
                "this volume file was made before pools: it holds its one volume \
                 ('default') and has no room for others or for a new size; copy its \
                 data into a pool made by `cvol create` (nbdcopy) to use volumes"
            ),
            PoolError::ReadOnly => write!(f, "the pool is open read-only"),
            PoolError::BadName { name, why } => write!(f, "invalid volume name '{name}': {why}"),
            PoolError::Exists(name) => write!(f, "the pool already has a volume named '{name}'"),
            PoolError::NotFound { name, known } => write!(
                f,
                "the pool has no volume named '{name}' (it has: {})",
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            ),
            PoolError::BadSize { size_bytes } => write!(
                f,
                "invalid volume size {size_bytes} bytes: it must be a positive multiple of \
                 4096, at most 16 TiB"
            ),
            PoolError::NoRoom {
                needed_bytes,
                free_bytes,
            } => write!(
                f,
                "the pool's volumes and snapshots may total 16 TiB of logical size, in \
                 1 GiB steps: this needs {} GiB more, {} GiB are left",
                needed_bytes >> 30,
                free_bytes >> 30
            ),
            PoolError::TooManyVolumes => write!(f, "a pool holds at most 4096 volumes"),
            PoolError::InUse { name, clients } => write!(
                f,
                "volume '{name}' is open by {clients} client(s): disconnect them first, \
                 or pass --force"
            ),
            PoolError::MappedBeyond {
                name,
                size_bytes,
                first_mapped,
            } => write!(
                f,
                "volume '{name}' holds data at byte {first_mapped}, beyond the new size \
                 {size_bytes}: trim it first (e.g. shrink the file system), or pass \
                 --discard to drop it"
            ),
            PoolError::BadSnapshotName { name, why } => {
                write!(f, "invalid snapshot name '{name}': {why}")
            }
            PoolError::SnapshotExists(name) => write!(f, "snapshot '{name}' already exists"),
            PoolError::SnapshotNotFound { name, known } => write!(
                f,
                "there is no snapshot '{name}' (snapshots: {})",
                list_or_none(known)
            ),
            PoolError::HasSnapshots { name, snapshots } => write!(
                f,
                "volume '{name}' has snapshots ({}): delete them first",
                snapshots.join(", ")
            ),
            PoolError::HasClones { name, clones } => write!(
                f,
                "snapshot '{name}' has clones that read through it ({}): delete them first",
                clones.join(", ")
            ),
            PoolError::NotNewest { name, newer } => write!(
                f,
                "'{name}' is not the volume's newest snapshot (newer: {}): a rollback \
                 goes to the newest; delete the newer ones first",
                newer.join(", ")
            ),
            PoolError::SizeChanged {
                name,
                size_bytes,
                snapshot_bytes,
            } => write!(
                f,
                "volume '{name}' is {size_bytes} bytes, its snapshot {snapshot_bytes}: \
                 resized since, so it cannot be rolled back"
            ),
            PoolError::ShrinkLayered { name } => write!(
                f,
                "volume '{name}' has snapshots or is a clone: it can grow, not shrink"
            ),
            PoolError::Table(why) => write!(f, "the pool's volume table is unreadable: {why}"),
            PoolError::Vol(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for PoolError {}

fn list_or_none(v: &[String]) -> String {
    if v.is_empty() {
        "none".to_string()
    } else {
        v.join(", ")
    }
}
