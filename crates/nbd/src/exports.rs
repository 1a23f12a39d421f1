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
