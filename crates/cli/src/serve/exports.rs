//! A pool's volumes as NBD exports, by name: each lookup (a client's
//! NBD_OPT_INFO, NBD_OPT_GO or NBD_OPT_EXPORT_NAME) asks the pool, so
//! volumes created while serving are served at once and deleted ones
//! vanish; each connection holds its volume open (`VolumeView::clients`).
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
    let volume = if names.iter().any(|n| n == export) {
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
            None => self
                .pool
                .volumes()
                .into_iter()
                .map(|v| (v.name, None))
                .collect(),
        }
    }
}
