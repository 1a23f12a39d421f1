//! A volume's metadata device (`--metadata-device`, [VDO] §5.2): map
//! records, checkpoint commits and fingerprint tables on a second store,
//! joined with the data store into one offset space (`SplitStorage`), its
//! segments after the data store's. Everything else (the chain of seqs,
//! roll-forward, the cleaner) sees one log with two heads.
use super::Volume;
use crate::error::{OpenError, VolError};
use crate::recovery;
use crate::volume::CreateOptions;
use cvol_format::metadev::{
    MetadevLabel, METADATA_DATA_OFFSET_BYTES, METADEV_LABEL_A_OFFSET, METADEV_LABEL_BYTES,
};
use cvol_format::{Superblock, SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET};
use cvol_storage::{SplitStorage, Storage};
use std::sync::Arc;

/// Label copies: at the start of the metadata device; in the data store.
const DEVICE_LABELS: [u64; 2] = [SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET];
const DATA_LABELS: [u64; 2] = [
    METADEV_LABEL_A_OFFSET,
    METADEV_LABEL_A_OFFSET + METADEV_LABEL_BYTES as u64,
];

/// Why a metadata device cannot be used.
fn refuse(why: String) -> VolError {
    OpenError::MetadataDevice(why).into()
}

/// Segments a metadata device of `len` bytes holds (after its label area).
pub fn metadata_segments_of(len: u64, segment_size: u64) -> u64 {
    len.saturating_sub(METADATA_DATA_OFFSET_BYTES) / segment_size
}

/// The first label of `at` that decodes.
fn read_label(storage: &dyn Storage, at: [u64; 2]) -> Option<MetadevLabel> {
    at.iter().find_map(|&off| {
        let mut b = vec![0u8; METADEV_LABEL_BYTES];
        storage.read_at(off, &mut b).ok()?;
        MetadevLabel::decode(&b).ok()
    })
}

/// The metadata device path a data store records (None: the volume has
/// none, or its labels are damaged; then the user names it).
pub fn recorded_metadata_path(data: &dyn Storage) -> Option<String> {
    read_label(data, DATA_LABELS).map(|l| l.path)
}

/// Joins a volume's data store (superblock `sb`) and its metadata device,
/// refusing a device that is not this volume's or is too short for it.
pub fn join(
    sb: &Superblock,
    data: Arc<dyn Storage>,
    meta: Arc<dyn Storage>,
) -> Result<Arc<dyn Storage>, VolError> {
    assert!(sb.has_metadata_device());
    let Some(label) = read_label(&*meta, DEVICE_LABELS) else {
        return Err(refuse(
            "no cvol metadata device label at its start: not a metadata device, \
             or its labels are damaged"
                .into(),
        ));
    };
    if !label.matches(sb) {
        return Err(refuse(
            "the metadata device belongs to another volume (its label names another \
             volume uuid or geometry)"
                .into(),
        ));
    }
    check_sizes(sb, &*data, &*meta)?;
    let split = SplitStorage::new(data, meta, sb.metadata_base(), METADATA_DATA_OFFSET_BYTES);
    Ok(Arc::new(split))
}

/// Refuses stores shorter than the volume `sb` says they are.
fn check_sizes(sb: &Superblock, data: &dyn Storage, meta: &dyn Storage) -> Result<(), VolError> {
    let need = METADATA_DATA_OFFSET_BYTES + u64::from(sb.metadata_segments) * sb.segment_size_bytes;
    if meta.len_bytes() < need {
        return Err(refuse(format!(
            "the metadata device has {} bytes, the volume needs {need}",
            meta.len_bytes()
        )));
    }
    if data.len_bytes() < sb.physical_size_bytes {
        return Err(OpenError::BackingTooSmall {
            physical_size_bytes: sb.physical_size_bytes,
            backing_bytes: data.len_bytes(),
        }
        .into());
    }
    Ok(())
}

/// Reads `data`'s superblock and, if the volume has a metadata device,
/// joins the one `open_meta` opens (given the path the data store
/// records, if it can be read). A volume without one, or whose superblock
/// does not read (open and check then say why), is `data` itself.
pub fn open_stores(
    data: Arc<dyn Storage>,
    open_meta: impl FnOnce(Option<String>) -> Result<Arc<dyn Storage>, VolError>,
) -> Result<Arc<dyn Storage>, VolError> {
    let Ok((sb, _)) = recovery::read_superblock(&*data) else {
        return Ok(data);
    };
    if !sb.has_metadata_device() {
        return Ok(data);
    }
    let meta = open_meta(recorded_metadata_path(&*data))?;
    join(&sb, data, meta)
}

impl Volume {
    /// Formats a new volume on `data` with its metadata (map records,
    /// checkpoints, fingerprint tables) on `meta`, whose path `path` is
    /// recorded in both so that opening the data store finds it.
    pub fn create_with_metadata(
        data: Arc<dyn Storage>,
        meta: Arc<dyn Storage>,
        path: &str,
        c: &CreateOptions,
    ) -> Result<Volume, VolError> {
        let mut sb = super::lifecycle::new_superblock(c)?;
        let segments = metadata_segments_of(meta.len_bytes(), sb.segment_size_bytes);
        if segments < 2 {
            return Err(refuse(format!(
                "the metadata device is too small: it needs 1 MiB plus two segments \
                 of {} bytes, and has {} bytes",
                sb.segment_size_bytes,
                meta.len_bytes()
            )));
        }
        sb.metadata_segments = u32::try_from(segments)
            .map_err(|_| refuse("the metadata device has too many segments".into()))?;
        sb.flags |= cvol_format::superblock::FLAG_METADATA_DEVICE;
        sb.validate().map_err(OpenError::Geometry)?;
        let label = MetadevLabel::new(&sb, path)
            .ok_or_else(|| refuse("the metadata device's path is too long to record".into()))?;
        check_sizes(&sb, &*data, &*meta)?;
        let enc = label.encode();
        for (store, at) in [(&meta, DEVICE_LABELS), (&data, DATA_LABELS)] {
            for off in at {
                store.write_at(off, &enc).map_err(VolError::Io)?;
            }
            store.sync().map_err(VolError::Io)?;
        }
        let joined = join(&sb, data, meta)?;
        Volume::create_from(joined, sb, c)
    }
}
