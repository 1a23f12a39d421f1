//! A pool's volumes as NBD exports, by name: each lookup (a client's
//! NBD_OPT_INFO, NBD_OPT_GO or NBD_OPT_EXPORT_NAME) asks the pool, so
//! volumes created while serving are served at once and deleted ones
//! vanish; each connection holds its volume open (`VolumeView::clients`).
//! Each snapshot is served read-only as `VOLUME@SNAP`.
use crate::backend::ViewBackend;
use cvol_engine::pool::Pool;
use cvol_format::pool::DEFAULT_VOLUME;
use cvol_nbd::{Backend, Export, Exports};
use std::sync::Arc;

/// How every export's backend is wrapped (trace, metrics).
pub type Wrap = Arc<dyn Fn(Arc<dyn Backend>) -> Arc<dyn Backend> + Send + Sync>;

/// `--export NAME`: the one volume served, and the name it is served as
/// (also answering "").
#[derive(Debug, Clone)]
pub struct Only {
    pub name: String,
    pub volume: String,
}

/// What `--export NAME` serves: nothing given, every volume; a volume of
/// that name, it alone; otherwise a pool of one volume serves it under
/// that name (as before pools: the flag named the export), and a pool of
/// several refuses.
pub fn only(pool: &Pool, export: &str) -> Result<Option<Only>, String> {
    if export.is_empty() {
        return Ok(None);
    }
    let names: Vec<String> = pool.volumes().into_iter().map(|v| v.name).collect();
    let snapshot = export.contains('@') && pool.volume(export).is_some();
    let volume = if snapshot || names.iter().any(|n| n == export) {
        export.to_string()
    } else if let [one] = names.as_slice() {
        one.clone()
    } else {
        return Err(format!(
            "the pool has no volume of that name (it has: {})",
            names.join(", ")
        ));
    };
    Ok(Some(Only {
        name: export.to_string(),
        volume,
    }))
}

pub struct PoolExports {
    pool: Arc<Pool>,
    only: Option<Only>,
    wrap: Wrap,
}

impl PoolExports {
    pub fn new(pool: Arc<Pool>, only: Option<Only>, wrap: Wrap) -> PoolExports {
        PoolExports { pool, only, wrap }
    }
}

impl Exports for PoolExports {
    fn lookup(&self, name: &str) -> Option<Export> {
        let (shown, volume) = match &self.only {
            Some(o) if name.is_empty() || name == o.name => (o.name.clone(), o.volume.as_str()),
            Some(_) => return None,
            None if name.is_empty() => (DEFAULT_VOLUME.to_string(), DEFAULT_VOLUME),
            None => (name.to_string(), name),
        };
        let view = self.pool.volume(volume)?;
        let backend: Arc<dyn Backend> = Arc::new(ViewBackend {
            guard: view.open_guard(),
        });
        Some(Export {
            name: shown,
            description: None,
            backend: (self.wrap)(backend),
        })
    }

    fn list(&self) -> Vec<(String, Option<String>)> {
        match &self.only {
            Some(o) => vec![(o.name.clone(), None)],
            None => {
                let snaps = self.pool.snapshots().into_iter().map(|s| {
                    let about = format!("snapshot of '{}' (read-only)", s.volume);
                    (s.name, Some(about))
                });
                let mut all: Vec<_> = (self.pool.volumes().into_iter())
                    .map(|v| (v.name, None))
                    .chain(snaps)
                    .collect();
                all.sort();
                all
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cvol_engine::CreateOptions;
    use cvol_storage::{SimStorage, Storage};

    fn pool(names: &[&str]) -> Arc<Pool> {
        let sim = SimStorage::new(32 << 20);
        let c = CreateOptions::new(1 << 20, sim.len_bytes()).with_segment_size(1 << 20);
        let p = Pool::create(Arc::new(sim), &c).unwrap();
        for n in names {
            p.create_volume(n, 2 << 20).unwrap();
        }
        Arc::new(p)
    }

    fn exports(p: &Arc<Pool>, export: &str) -> PoolExports {
        let only = only(p, export).unwrap();
        PoolExports::new(p.clone(), only, Arc::new(|b| b))
    }

    fn size(e: &PoolExports, name: &str) -> Option<(String, u64)> {
        e.lookup(name).map(|x| (x.name, x.backend.size_bytes()))
    }

    #[test]
    fn every_volume_by_name_and_default_under_the_empty_name() {
        let p = pool(&["a"]);
        let e = exports(&p, "");
        let names: Vec<String> = e.list().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["a", "default"]);
        assert_eq!(size(&e, ""), Some(("default".into(), 1 << 20)));
        assert_eq!(size(&e, "a"), Some(("a".into(), 2 << 20)));
        assert_eq!(size(&e, "b"), None);
        p.create_volume("b", 4096).unwrap();
        assert_eq!(
            size(&e, "b"),
            Some(("b".into(), 4096)),
            "created while served"
        );
        let held = e.lookup("a").unwrap();
        assert_eq!(
            p.volume("a").unwrap().clients(),
            1,
            "a connection holds it open"
        );
        drop(held);
        assert_eq!(p.volume("a").unwrap().clients(), 0);
    }

    #[test]
    fn export_limits_to_one_volume_or_renames_the_only_one() {
        let p = pool(&["a"]);
        let e = exports(&p, "a");
        assert_eq!(e.list(), vec![("a".to_string(), None)]);
        assert_eq!(size(&e, ""), Some(("a".into(), 2 << 20)));
        assert_eq!(size(&e, "default"), None);
        let err = only(&p, "nope").unwrap_err();
        assert!(err.contains("it has: a, default"), "{err}");
        let single = pool(&[]);
        let e = exports(&single, "disk0");
        assert_eq!(size(&e, "disk0"), Some(("disk0".into(), 1 << 20)));
        assert_eq!(size(&e, ""), Some(("disk0".into(), 1 << 20)));
    }
}
