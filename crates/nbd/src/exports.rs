//! The exports a server offers, looked up by name during the handshake.
//!
//! A [`Server`](crate::Server) serves an [`Exports`] set: every option of
//! the NBD handshake that names an export (`NBD_OPT_INFO`, `NBD_OPT_GO`,
//! `NBD_OPT_EXPORT_NAME`, `NBD_OPT_LIST_META_CONTEXT`,
//! `NBD_OPT_SET_META_CONTEXT`) looks it up when it arrives, and
//! `NBD_OPT_LIST` lists the set as it is then. The set may change while the
//! server runs; a connection keeps the [`Export`] (and so the backend) it
//! entered transmission with until it closes, whatever happens to the set.
//!
//! [`ExportSet`] is a ready-made set that can be changed at run time.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::Backend;

/// One export: what a lookup of its name hands the server.
#[derive(Clone)]
pub struct Export {
    /// The export's canonical name (`NBD_INFO_NAME`); a lookup of the
    /// default export ("") answers with the name of the export it selects.
    pub name: String,
    /// Human-readable description (`NBD_INFO_DESCRIPTION`).
    pub description: Option<String>,
    /// Serves the export's data; its `size_bytes` and `read_only` make the
    /// export's size and flags.
    pub backend: Arc<dyn Backend>,
}

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Export")
            .field("name", &self.name)
            .field("description", &self.description)
            .finish_non_exhaustive()
    }
}

/// The set of exports a server offers. Called on connection threads during
/// the handshake: keep it cheap (no long blocking).
pub trait Exports: Send + Sync + 'static {
    /// The export served under `name` ("" = the default export, if any);
    /// `None` if there is no such export (the client gets
    /// `NBD_REP_ERR_UNKNOWN`, or is disconnected after
    /// `NBD_OPT_EXPORT_NAME`).
    fn lookup(&self, name: &str) -> Option<Export>;
    /// Every export's name and optional description, in a stable order:
    /// one `NBD_REP_SERVER` reply each for `NBD_OPT_LIST`.
    fn list(&self) -> Vec<(String, Option<String>)>;
}

/// One export under one name that the default export ("") selects too:
/// what [`Server::new`](crate::Server::new) serves.
pub(crate) struct SingleExport(pub(crate) Export);

impl Exports for SingleExport {
    fn lookup(&self, name: &str) -> Option<Export> {
        (name.is_empty() || name == self.0.name).then(|| self.0.clone())
    }

    fn list(&self) -> Vec<(String, Option<String>)> {
        vec![(self.0.name.clone(), self.0.description.clone())]
    }
}

/// An [`Exports`] set that can change while the server runs: exports are
/// inserted and removed by name, listed in name order. The default export
/// ("") is the export named by [`ExportSet::set_default`], if any (or an
/// export inserted under the name "" itself).
#[derive(Default)]
pub struct ExportSet {
    state: RwLock<SetState>,
}

#[derive(Default)]
struct SetState {
    exports: BTreeMap<String, Export>,
    default_name: Option<String>,
}

impl ExportSet {
    /// An empty set (every lookup fails until an export is inserted).
    pub fn new() -> ExportSet {
        ExportSet::default()
    }

    fn read(&self) -> RwLockReadGuard<'_, SetState> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, SetState> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Offers `backend` under `name` from now on; returns the backend that
    /// was offered under that name before, if any (connections using it
    /// keep it).
    pub fn insert(
        &self,
        name: &str,
        description: Option<String>,
        backend: Arc<dyn Backend>,
    ) -> Option<Arc<dyn Backend>> {
        let export = Export {
            name: name.to_owned(),
            description,
            backend,
        };
        self.write()
            .exports
            .insert(name.to_owned(), export)
            .map(|old| old.backend)
    }

    /// Stops offering `name` to new connections; returns its backend, if it
    /// was offered. Connections already using it keep it until they close.
    pub fn remove(&self, name: &str) -> Option<Arc<dyn Backend>> {
        self.write().exports.remove(name).map(|old| old.backend)
    }

    /// Makes the default export ("") select the export `name` (whenever it
    /// is in the set), or nothing with `None`.
    pub fn set_default(&self, name: Option<&str>) {
        self.write().default_name = name.map(str::to_owned);
    }

    /// The names offered now, in order.
    pub fn names(&self) -> Vec<String> {
        self.read().exports.keys().cloned().collect()
    }
}

impl Exports for ExportSet {
    fn lookup(&self, name: &str) -> Option<Export> {
        let state = self.read();
        if let Some(export) = state.exports.get(name) {
            return Some(export.clone());
        }
        let default_name = state.default_name.as_deref().filter(|_| name.is_empty())?;
        state.exports.get(default_name).cloned()
    }

    fn list(&self) -> Vec<(String, Option<String>)> {
        self.read()
            .exports
            .values()
            .map(|e| (e.name.clone(), e.description.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BackendError, Extent, WriteZeroesFlags};

    /// A backend of `size_bytes` that serves nothing (only its size counts).
    struct Sized(u64);

    impl Backend for Sized {
        fn size_bytes(&self) -> u64 {
            self.0
        }
        fn read_only(&self) -> bool {
            true
        }
        fn read(&self, _: u64, _: &mut [u8]) -> Result<(), BackendError> {
            Err(BackendError::Io)
        }
        fn write(&self, _: u64, _: &[u8], _: bool) -> Result<(), BackendError> {
            Err(BackendError::ReadOnly)
        }
        fn flush(&self) -> Result<(), BackendError> {
            Ok(())
        }
        fn trim(&self, _: u64, _: u64, _: bool) -> Result<(), BackendError> {
            Err(BackendError::ReadOnly)
        }
        fn write_zeroes(&self, _: u64, _: u64, _: WriteZeroesFlags) -> Result<(), BackendError> {
            Err(BackendError::ReadOnly)
        }
        fn block_status(&self, _: u64, _: u64) -> Result<Vec<Extent>, BackendError> {
            Err(BackendError::Io)
        }
    }

    /// The size of the export `name` selects, if any.
    fn size_of(set: &dyn Exports, name: &str) -> Option<u64> {
        set.lookup(name).map(|e| e.backend.size_bytes())
    }

    #[test]
    fn export_set_names_and_the_default_export() {
        let set = ExportSet::new();
        assert!(set.insert("b", None, Arc::new(Sized(2))).is_none());
        set.insert("a", Some("first".into()), Arc::new(Sized(1)));
        assert_eq!((size_of(&set, "a"), size_of(&set, "b")), (Some(1), Some(2)));
        assert_eq!((size_of(&set, ""), size_of(&set, "c")), (None, None));
        set.set_default(Some("b"));
        assert_eq!(set.lookup("").map(|e| e.name), Some("b".to_string()));
        set.set_default(Some("c"));
        assert_eq!(size_of(&set, ""), None, "the default names no export");
        // An export named "" is the default export itself.
        set.insert("", None, Arc::new(Sized(9)));
        assert_eq!(size_of(&set, ""), Some(9));
        let old = set.insert("a", None, Arc::new(Sized(3))).unwrap();
        assert_eq!(old.size_bytes(), 1);
        assert_eq!(
            set.list(),
            vec![("".into(), None), ("a".into(), None), ("b".into(), None)]
        );
        assert_eq!(set.remove("a").map(|b| b.size_bytes()), Some(3));
        assert_eq!(
            (size_of(&set, "a"), set.names()),
            (None, vec!["".into(), "b".into()])
        );
    }

    #[test]
    fn a_single_export_answers_its_name_and_the_default() {
        let export = Export {
            name: "vol".into(),
            description: Some("d".into()),
            backend: Arc::new(Sized(5)),
        };
        let single = SingleExport(export);
        assert_eq!(
            (size_of(&single, "vol"), size_of(&single, "")),
            (Some(5), Some(5))
        );
        assert_eq!(single.lookup("").map(|e| e.name), Some("vol".to_string()));
        assert_eq!(size_of(&single, "other"), None);
        assert_eq!(single.list(), vec![("vol".into(), Some("d".into()))]);
    }
}
