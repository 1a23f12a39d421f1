//! Deleting objects nothing references any more: the garbage list's
//! deletes, and at a writable open the sweep of what older epochs and
//! older manifests left behind.
//!
//! Depends on: `state`, `objects`.
use super::objects::list;
use super::state::{lock, Inner};
use crate::format::{Manifest, Names};
use futures::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::ObjectStoreExt;
use std::sync::atomic::Ordering;

impl Inner {
    /// Deletes the objects nothing references any more.
    pub(super) fn delete_ready(&self) {
        let doomed: Vec<String> = std::mem::take(&mut *lock(&self.garbage));
        if doomed.is_empty() {
            return;
        }
        let n = doomed.len() as u64;
        let store = self.store.clone();
        let r: Vec<object_store::Result<()>> = self.block(
            futures::stream::iter(doomed.into_iter().map(|name| {
                let store = store.clone();
                async move {
                    match store.delete(&ObjPath::from(name.as_str())).await {
                        Err(object_store::Error::NotFound { .. }) => Ok(()),
                        r => r,
                    }
                }
            }))
            .buffer_unordered(16)
            .collect(),
        );
        self.c.deletes.fetch_add(n, Ordering::Relaxed);
        if let Some(e) = r.into_iter().find_map(Result::err) {
            tracing::warn!("{}: deleting a superseded object: {e}", self.label);
        }
    }

    /// Deletes what no server can need any more: chunk objects of older
    /// epochs the manifest and log do not reference, and deltas and
    /// manifests older than the manifest in use (`m`). Best effort.
    pub(super) fn collect_garbage(&self, m: u64, man: &Manifest) {
        match self.block(self.unreferenced(m, man)) {
            Ok(doomed) => {
                if !doomed.is_empty() {
                    tracing::info!(
                        "{}: deleting {} objects no one needs",
                        self.label,
                        doomed.len()
                    );
                }
                lock(&self.garbage).extend(doomed);
                self.delete_ready();
            }
            Err(e) => tracing::warn!("{}: listing for garbage failed: {e}", self.label),
        }
    }

    /// The objects [`Inner::collect_garbage`] deletes.
    async fn unreferenced(&self, m: u64, man: &Manifest) -> object_store::Result<Vec<String>> {
        let store = &*self.store;
        let mut doomed = Vec::new();
        for (n, _) in list(store, &self.names.dir("chunk")).await? {
            if let Some((c, o)) = Names::parse_chunk(&n) {
                let used = lock(&self.chunks[c.min(self.chunks.len() as u32 - 1) as usize]).object
                    == Some(o)
                    || man.chunks.get(c as usize) == Some(&Some(o));
                if !used && o.epoch < self.epoch {
                    doomed.push(n);
                }
            }
        }
        for (dir, keep_from) in [("log", m + 1), ("manifest", m)] {
            for (n, _) in list(store, &self.names.dir(dir)).await? {
                let old = Names::number(&n).filter(|&s| s < keep_from);
                let fence = dir == "log" && old.is_some_and(|s| man.fences.contains(&s));
                if old.is_some() && !fence {
                    doomed.push(n);
                }
            }
        }
        Ok(doomed)
    }
}
