//! Whether the store honours create-only PUTs (`If-None-Match: *`), on
//! which single-writer fencing rests: the probe, and the decision a
//! create or a writable open takes from it.
//!
//! Depends on: `objects`, `config`, `error`.
use super::config::Config;
use super::error::Error;
use super::objects::put;
use crate::format::Names;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt};
use std::sync::atomic::{AtomicU64, Ordering};

/// What a store does with create-only PUTs (`PutMode::Create`, S3's
/// `If-None-Match: *`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreateOnly {
    /// A second create-only PUT of an object fails: fencing holds.
    Honoured,
    /// It does not (the reason, in words): a stale server's delta would
    /// silently replace its successor's.
    NotHonoured(String),
}

/// Probes whether `store` honours create-only PUTs: PUTs a new probe
/// object under the volume's prefix create-only, then again, and expects
/// "already exists"; the probe is deleted. Errors are the store's (no
/// access, no bucket), not an answer.
pub async fn probe_create_only(
    store: &dyn ObjectStore,
    names: &Names,
) -> object_store::Result<CreateOnly> {
    static PROBES: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let name = names.dir(&format!(
        "probe/{}-{nanos:x}-{}",
        std::process::id(),
        PROBES.fetch_add(1, Ordering::Relaxed)
    ));
    let body = || b"cvol create-only probe\n".to_vec();
    let answer = match put(store, &name, body(), true).await {
        Ok(()) => match put(store, &name, body(), true).await {
            Err(object_store::Error::AlreadyExists { .. }) => Ok(CreateOnly::Honoured),
            Ok(()) => Ok(CreateOnly::NotHonoured(
                "a second create-only PUT of the same object succeeded".into(),
            )),
            Err(e) => Ok(CreateOnly::NotHonoured(format!(
                "a second create-only PUT of the same object failed with another error than \
                 \"already exists\": {e}"
            ))),
        },
        Err(e @ object_store::Error::NotImplemented { .. }) => {
            return Ok(CreateOnly::NotHonoured(format!(
                "{e} (is AWS_CONDITIONAL_PUT set to disabled?)"
            )))
        }
        Err(e) => return Err(e),
    };
    if let Err(e) = store.delete(&ObjPath::from(name.as_str())).await {
        tracing::warn!("deleting the probe object {name}: {e}");
    }
    answer
}

/// Probes the store ([`probe_create_only`]) before anything is written;
/// true: PUTs meant create-only are (fencing holds). A store that does
/// not honour them is refused, unless `cfg.unsafe_no_fencing` (then
/// false: every PUT overwrites, which such a store may be doing anyway).
pub(super) async fn settle_fencing(
    store: &dyn ObjectStore,
    names: &Names,
    cfg: &Config,
) -> Result<bool, Error> {
    let label = &cfg.label;
    let probed = probe_create_only(store, names)
        .await
        .map_err(|source| Error::Store {
            label: label.clone(),
            source,
        })?;
    let why = match probed {
        CreateOnly::Honoured => {
            if cfg.unsafe_no_fencing {
                tracing::info!(
                    "{label}: the store honours create-only PUTs, so fencing stays on \
                     (--unsafe-no-fencing is not needed)"
                );
            }
            return Ok(true);
        }
        CreateOnly::NotHonoured(why) => why,
    };
    if cfg.unsafe_no_fencing {
        tracing::warn!(
            "WARNING: {label}: fencing is OFF (--unsafe-no-fencing): the store does not honour \
             create-only PUTs ({why}). Nothing stops a second server from writing this volume \
             at the same time, which corrupts it: run one writer only, and make sure an old \
             server is gone before a new one starts."
        );
        return Ok(false);
    }
    Err(Error::NoFencing {
        label: label.clone(),
        why,
    })
}
