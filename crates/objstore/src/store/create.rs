//! Making a new volume's objects (its descriptor and an empty manifest)
//! and deleting a volume's objects (a failed create's undo).
//!
//! Depends on: `objects`, `fencing`, `config`, `error`.
use super::config::Config;
use super::error::Error;
use super::fencing::settle_fencing;
use super::objects::{list, put, runtime};
use crate::format::{Descriptor, Manifest, Names};
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt};

/// Writes a new volume's descriptor and empty manifest. An existing
/// volume at the prefix is refused unless `force` (then every object
/// under the prefix is deleted first).
pub fn create(cfg: &Config, d: &Descriptor, force: bool) -> Result<(), Error> {
    d.validate().map_err(Error::Descriptor)?;
    let rt = runtime()?;
    let names = Names::new(&cfg.prefix);
    let store = cfg.store.clone();
    let label = || cfg.label.clone();
    rt.block_on(async {
        clear(&*store, &names, &cfg.label, force).await?;
        let create_only = settle_fencing(&*store, &names, cfg).await?;
        put(&*store, &names.descriptor(), d.encode(), create_only)
            .await
            .map_err(|source| Error::Request {
                label: label(),
                source,
            })?;
        let m = Manifest {
            seq: 0,
            epoch: 0,
            chunks: vec![None; d.chunk_count() as usize],
            fences: Vec::new(),
        };
        put(&*store, &names.manifest(0), m.encode(), create_only)
            .await
            .map_err(|source| Error::Request {
                label: label(),
                source,
            })
    })
}

/// Refuses a prefix with objects under it, or (`force`) deletes them.
async fn clear(
    store: &dyn ObjectStore,
    names: &Names,
    label: &str,
    force: bool,
) -> Result<(), Error> {
    let listed = list(store, &names.dir(""))
        .await
        .map_err(|source| Error::Store {
            label: label.to_string(),
            source,
        })?;
    if listed.is_empty() {
        return Ok(());
    }
    if !force {
        return Err(Error::Occupied {
            label: label.to_string(),
            volume: listed.iter().any(|(n, _)| *n == names.descriptor()),
            objects: listed.len(),
        });
    }
    for (n, _) in &listed {
        store
            .delete(&ObjPath::from(n.as_str()))
            .await
            .map_err(|source| Error::Delete {
                label: label.to_string(),
                name: n.clone(),
                source,
            })?;
    }
    Ok(())
}

/// Deletes every object of a volume (a failed create's undo).
pub fn destroy(cfg: &Config) -> Result<(), Error> {
    let rt = runtime()?;
    let names = Names::new(&cfg.prefix);
    rt.block_on(async {
        for (n, _) in list(&*cfg.store, &names.dir(""))
            .await
            .map_err(Error::Destroy)?
        {
            cfg.store
                .delete(&ObjPath::from(n.as_str()))
                .await
                .map_err(Error::Destroy)?;
        }
        Ok(())
    })
}
