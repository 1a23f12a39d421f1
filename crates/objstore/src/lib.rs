//! cvol's object-store backend: a [`cvol_storage::Storage`] whose bytes live
//! in an S3-compatible object store (through the `object_store` crate),
//! served through a bounded local cache. See [`store`] for the protocol
//! and [`format`](mod@format) for the objects; docs/FORMAT.md "Object store".
mod bits;
pub mod format;
pub mod store;
pub mod url;

pub use format::Descriptor;
pub use store::{create, destroy, Config, Error, ObjectStorage, RecoveryError};
pub use url::UrlError;
