//! The object store's requests as the rooms above use them: list a
//! directory, PUT (create-only or overwriting), GET, the sequence numbers
//! of a listing, and the Tokio runtime the requests run on.
//!
//! Depends on: `format` (object names), `error`.
use super::error::Error;
use crate::format::Names;
use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

/// The runtime a volume's requests run on (two threads).
pub(super) fn runtime() -> Result<tokio::runtime::Runtime, Error> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("cvol-s3-io")
        .enable_all()
        .build()
        .map_err(Error::Runtime)
}

/// Every object under `dir` (a prefix ending at a `/` boundary), name and size.
pub(super) async fn list(
    store: &dyn ObjectStore,
    dir: &str,
) -> object_store::Result<Vec<(String, u64)>> {
    let prefix = (!dir.is_empty()).then(|| ObjPath::from(dir));
    store
        .list(prefix.as_ref())
        .map_ok(|m| (m.location.to_string(), m.size))
        .try_collect()
        .await
}

/// PUTs `body` at `name`: create-only (fails with `AlreadyExists` when the
/// object is there), or overwriting.
pub(super) async fn put(
    store: &dyn ObjectStore,
    name: &str,
    body: Vec<u8>,
    create: bool,
) -> object_store::Result<()> {
    let opts = PutOptions {
        mode: if create {
            PutMode::Create
        } else {
            PutMode::Overwrite
        },
        ..PutOptions::default()
    };
    store
        .put_opts(&ObjPath::from(name), PutPayload::from(body), opts)
        .await
        .map(|_| ())
}

pub(super) async fn get(store: &dyn ObjectStore, name: &str) -> object_store::Result<Bytes> {
    store.get(&ObjPath::from(name)).await?.bytes().await
}

/// The sequence numbers of a listing's numbered objects, ascending.
pub(super) fn numbers(listed: &[(String, u64)]) -> Vec<u64> {
    let mut v: Vec<u64> = listed
        .iter()
        .filter_map(|(n, _)| Names::number(n))
        .collect();
    v.sort_unstable();
    v
}
