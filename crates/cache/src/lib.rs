//! A compressed cache in front of a slow origin ([FlaZ] §2.2 and §4.1,
//! docs/REFERENCES.md).
//!
//! A cache is an ordinary volume (`FLAG_CACHE`) whose logical size is its
//! origin's. Its map tells what is cached: a block the map holds (data or
//! zeros) is served from the cache, an *unmapped* block is a miss, read
//! from the origin. Compression and dedup work inside as on any volume, so
//! the same physical size holds more lines: FlaZ's point.
//!
//! - **Lines.** The origin is read in lines (`line_size_bytes`, default
//!   64 KiB, clipped at the origin's end): a miss reads the whole line,
//!   answers the client, and queues blocks to be *filled* into the cache
//!   by a background thread (FlaZ's asynchronous fill): the whole line
//!   while the cache is under half full (prefetch is free) or when reads
//!   show spatial locality (a second miss in the line, or a miss in the
//!   line after a missed one, among the last 64 misses), else only the
//!   blocks asked for, so a random reader's hot block does not bring a line
//!   of cold ones into a full cache. A fill writes only
//!   blocks still unmapped, and only if nothing unmapped blocks of the line
//!   or wrote it back since the miss (the line slot's generation,
//!   `lines::Slots`).
//! - **Writes.** Write-through (default): the origin first, then the cache;
//!   FLUSH syncs both. Write-back: the cache only, the line marked dirty;
//!   dirty lines go to the origin in the background, before eviction and
//!   at a clean close (`maintain`).
//! - **Eviction.** CLOCK over lines: a line read, written or filled gets a
//!   second chance; when the cache's live bytes pass `EVICT_HIGH_PERCENT`
//!   of the room the log has for them, cold lines are trimmed until
//!   `EVICT_LOW_PERCENT`, and the cleaner reclaims their segments. A client
//!   never sees ENOSPC: a write the cache has no room for goes to the
//!   origin and the cache forgets those blocks.
//! - **Restart** (docs/FORMAT.md "Cache"): the label (`cvol_format::cache`)
//!   is marked open before the first write and clean after the close wrote
//!   everything back. A clean close with the origin unchanged (size, and a
//!   file's mtime, inode, device) starts warm. Otherwise write-through
//!   starts cold (formatted again: the origin holds every completed write,
//!   the cache may hold older lines than a write that reached the origin
//!   just before a crash), and write-back after a crash starts *recovered*:
//!   the cache holds the newest copy of everything it maps, so every cached
//!   line counts dirty and is written back.
mod lines;
mod maintain;
#[cfg(test)]
mod tests;

pub use cvol_format::cache::{CacheLabel, CacheMode, OriginStamp, CACHE_LINE_DEFAULT_BYTES};
pub use maintain::CacheWorker;

use cvol_engine::error::{OpenError, VolError};
use cvol_engine::stats::{CacheInfo, CacheStats};
use cvol_engine::volume::{CreateOptions, OpenOptions, Volume};
use cvol_format::cache::{CACHE_LABEL_A_OFFSET, CACHE_LABEL_BYTES, CACHE_LABEL_B_OFFSET};
use cvol_format::{Superblock, BLOCK_SIZE_BYTES, DATA_OFFSET_BYTES};
use cvol_storage::Storage;
use lines::{Bits, Slots};
use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};

const BS: u64 = BLOCK_SIZE_BYTES;
/// Eviction starts when live bytes pass this share of the log's room...
pub const EVICT_HIGH_PERCENT: u64 = 75;
/// ...and stops at this one (the cleaner needs free segments to work in).
pub const EVICT_LOW_PERCENT: u64 = 65;
/// Below this share of the room, a miss fills its whole line whatever the
/// reads look like: prefetching neighbours costs nothing while nothing has
/// to be evicted for them.
pub const WHOLE_LINE_BELOW_PERCENT: u64 = 50;
/// Lines waiting to be filled, at most (bytes); beyond, a miss is not filled.
const FILL_QUEUE_MAX_BYTES: u64 = 64 << 20;

/// The origin's stamp now (size, and a file's mtime, inode and device).
pub type StampFn = Box<dyn Fn() -> io::Result<OriginStamp> + Send + Sync>;

/// What `cvol create --origin` asks for.
#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// A path or an NBD URI, recorded for `serve` to open.
    pub origin: String,
    pub mode: CacheMode,
    pub line_size_bytes: u32,
}

/// How a served cache started (`stat`'s `cache.start`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    Warm,
    /// Empty: a crash in write-through, or an origin changed while offline.
    Cold,
    /// Write-back after a crash: every cached line counted dirty.
    Recovered,
    /// Read-only and neither warm nor recovered: every read goes to the origin.
    Bypass,
}

impl Start {
    pub fn name(self) -> &'static str {
        match self {
            Start::Warm => "warm",
            Start::Cold => "cold",
            Start::Recovered => "recovered",
            Start::Bypass => "bypass",
        }
    }
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    fill_bytes: AtomicU64,
    evictions: AtomicU64,
    origin_read: AtomicU64,
    origin_written: AtomicU64,
    fills_dropped: AtomicU64,
}

/// Blocks of a line read from the origin, to be written into the cache.
struct Fill {
    line: u64,
    generation: u64,
    /// The first block `data` holds (inside `line`).
    first: u64,
    data: Vec<u8>,
}

/// Missed lines remembered to tell spatial locality (`whole_line`).
const RECENT_MISSES: usize = 64;

pub struct CacheVolume {
    vol: Arc<Volume>,
    origin: Arc<dyn Storage>,
    mode: CacheMode,
    start: Start,
    read_only: bool,
    /// `serve --sync`: every write durable before its reply, at the origin
    /// too (write-through).
    sync_writes: bool,
    line_blocks: u64,
    lines: u64,
    blocks: u64,
    slots: Slots,
    /// Lines with something in the cache.
    resident: Bits,
    /// CLOCK's second-chance bit.
    referenced: Bits,
    /// Write-back: lines written to the cache and not yet to the origin.
    dirty: Bits,
    /// Write-back: lines written to the origin, not yet synced there.
    unsynced: Bits,
    /// Write-back: dirty lines written again since the write-back hand
    /// last passed them (it writes back the others).
    touched: Bits,
    /// Writers of the origin (write-back) share it; an origin sync that
    /// clears `unsynced` holds it alone.
    wb_gate: RwLock<()>,
    fills: Mutex<(VecDeque<Fill>, u64)>,
    /// `fullness_percent` as the background thread last saw it.
    fullness_hint: AtomicU64,
    /// The last missed lines, a ring (and its next slot).
    recent_misses: Mutex<([u64; RECENT_MISSES], usize)>,
    fill_ready: Condvar,
    /// CLOCK hands: eviction's and background write-back's.
    hand: Mutex<u64>,
    wb_hand: Mutex<u64>,
    label: Mutex<CacheLabel>,
    stamp: StampFn,
    /// An invalidation failed: the cache may hold a stale line. Every
    /// request fails until reopened (which starts cold or recovered).
    failed: AtomicBool,
    counters: Counters,
}

fn io_err(e: io::Error) -> VolError {
    VolError::Io(e)
}

fn refuse(why: String) -> VolError {
    OpenError::Cache(why).into()
}

/// The newest label copy of `sb`'s volume.
pub fn read_label(storage: &dyn Storage, sb: &Superblock) -> Result<CacheLabel, VolError> {
    let mut a = vec![0u8; CACHE_LABEL_BYTES];
    let mut b = vec![0u8; CACHE_LABEL_BYTES];
    storage
        .read_at(CACHE_LABEL_A_OFFSET, &mut a)
        .map_err(io_err)?;
    storage
        .read_at(CACHE_LABEL_B_OFFSET, &mut b)
        .map_err(io_err)?;
    CacheLabel::newest([&a, &b], &sb.uuid).ok_or_else(|| {
        refuse(
            "no valid cache label (both copies damaged, or not this volume's): \
             recreate the cache with `cvol create --origin`"
                .into(),
        )
    })
}

/// The newer label copy that decodes, whatever volume it names.
fn any_label(storage: &dyn Storage) -> Option<CacheLabel> {
    [CACHE_LABEL_A_OFFSET, CACHE_LABEL_B_OFFSET]
        .iter()
        .filter_map(|&at| {
            let mut b = vec![0u8; CACHE_LABEL_BYTES];
            storage.read_at(at, &mut b).ok()?;
            CacheLabel::decode(&b).ok()
        })
        .max_by_key(|l| l.sequence)
}

/// Writes `label` (its state, as the next sequence) over both copies in
/// turn, each synced: a torn write, or later damage of one copy, leaves
/// the other saying the same. Between the two writes the newer copy says
/// the new state and the older the old one; the newer wins while it
/// decodes.
fn write_label(storage: &dyn Storage, label: &mut CacheLabel) -> Result<(), VolError> {
    for _ in 0..2 {
        label.sequence += 1;
        storage
            .write_at(label.offset(), &label.encode())
            .and_then(|()| storage.sync())
            .map_err(io_err)?;
    }
    Ok(())
}

/// Lets `stat` of a cache volume nobody serves show its label (`start`
/// reads "offline"); an ordinary volume is left as it is.
pub fn describe_offline(vol: &Volume) {
    if !vol.superblock().is_cache() {
        return;
    }
    let storage = vol.storage().clone();
    let sb = vol.superblock().clone();
    vol.set_cache_stats(Box::new(move || CacheStats {
        cache: read_label(&*storage, &sb)
            .ok()
            .map(|l| info_of(&l, "offline")),
        ..Default::default()
    }));
}

/// `stat`'s `cache` object.
pub fn info_of(label: &CacheLabel, start: &str) -> CacheInfo {
    CacheInfo {
        origin: label.origin.clone(),
        mode: label.mode.name().into(),
        line_size_bytes: u64::from(label.line_size_bytes),
        origin_size_bytes: label.stamp.size_bytes,
        start: start.into(),
    }
}

/// Formats `storage` as an empty cache of an origin stamped `stamp` (whose
/// size must be `c.logical_size_bytes`) and closes it.
pub fn create(
    storage: Arc<dyn Storage>,
    c: &CreateOptions,
    cache: &CacheConfig,
    stamp: OriginStamp,
) -> Result<(), VolError> {
    assert_eq!(
        c.logical_size_bytes, stamp.size_bytes,
        "a cache is its origin's size"
    );
    if cache.origin.len() > cvol_format::cache::CACHE_ORIGIN_MAX_BYTES {
        return Err(refuse(format!(
            "the origin name is {} bytes, more than the label holds ({})",
            cache.origin.len(),
            cvol_format::cache::CACHE_ORIGIN_MAX_BYTES
        )));
    }
    let vol = Volume::create_cache_volume(storage.clone(), c)?;
    let mut label = CacheLabel {
        uuid: vol.superblock().uuid,
        sequence: 0,
        mode: cache.mode,
        clean: true,
        line_size_bytes: cache.line_size_bytes,
        stamp,
        origin: cache.origin.clone(),
    };
    write_label(&*storage, &mut label)?;
    vol.close()
}

impl CacheVolume {
    /// Opens the cache on `storage` in front of `origin` (the store its
    /// label names, opened by the caller): recovery, then warm, cold or
    /// recovered (module docs). `stamp` tells the origin's stamp now.
    pub fn open(
        storage: Arc<dyn Storage>,
        origin: Arc<dyn Storage>,
        options: OpenOptions,
        stamp: StampFn,
    ) -> Result<Arc<CacheVolume>, VolError> {
        let (read_only, sync_writes) = (options.read_only, options.sync_writes);
        // Fills are written by the background thread, off every client's
        // path: deferring their compression (`--inline-cpu`) would only
        // shrink the cache until an idle moment.
        let mut options = options;
        options.elastic.inline_cpu_percent = None;
        let vol = Volume::open(storage.clone(), options.clone())?;
        if !vol.superblock().is_cache() {
            return Err(refuse("not a cache volume (made without --origin)".into()));
        }
        let mut label = match read_label(&*storage, vol.superblock()) {
            Ok(l) => l,
            // A crash between formatting a cold cache again (a new uuid)
            // and writing its label: the old label still names the origin.
            Err(e) => match any_label(&*storage) {
                Some(mut l) => {
                    l.uuid = vol.superblock().uuid;
                    l.clean = false;
                    l
                }
                None => return Err(e),
            },
        };
        let size = vol.size_bytes();
        if origin.len_bytes() != size {
            return Err(refuse(format!(
                "the origin {} is {} bytes; the cache was made for {size}: \
                 recreate the cache for it",
                label.origin,
                origin.len_bytes()
            )));
        }
        let now = stamp().map_err(io_err)?;
        let start = decide_start(&label, now, read_only);
        let vol = match start {
            Start::Cold if !read_only => {
                let why = if label.clean {
                    "the origin changed while the cache was offline"
                } else {
                    "the last server did not stop cleanly (write-through)"
                };
                tracing::warn!("cache starts cold: {why}");
                format_again(vol, storage, options, &mut label)?
            }
            _ => vol,
        };
        if !read_only {
            label.clean = false;
            write_label(&**vol.storage(), &mut label)?;
        }
        let mut cache = CacheVolume::assemble(vol, origin, label, start, read_only, stamp);
        cache.sync_writes = sync_writes;
        let cache = Arc::new(cache);
        cache.scan_resident()?;
        let weak = Arc::downgrade(&cache);
        cache
            .vol
            .set_cache_stats(Box::new(move || match weak.upgrade() {
                Some(c) => c.stats(),
                None => CacheStats::default(),
            }));
        Ok(cache)
    }

    fn assemble(
        vol: Volume,
        origin: Arc<dyn Storage>,
        label: CacheLabel,
        start: Start,
        read_only: bool,
        stamp: StampFn,
    ) -> CacheVolume {
        let blocks = vol.size_bytes() / BS;
        let line_blocks = u64::from(label.line_size_bytes) / BS;
        let lines = blocks.div_ceil(line_blocks);
        CacheVolume {
            vol: Arc::new(vol),
            origin,
            mode: label.mode,
            start,
            read_only,
            sync_writes: false,
            line_blocks,
            lines,
            blocks,
            slots: Slots::new(),
            resident: Bits::new(lines),
            referenced: Bits::new(lines),
            dirty: Bits::new(lines),
            unsynced: Bits::new(lines),
            touched: Bits::new(lines),
            wb_gate: RwLock::new(()),
            fills: Mutex::new((VecDeque::new(), 0)),
            recent_misses: Mutex::new(([u64::MAX; RECENT_MISSES], 0)),
            fullness_hint: AtomicU64::new(0),
            fill_ready: Condvar::new(),
            hand: Mutex::new(0),
            wb_hand: Mutex::new(0),
            label: Mutex::new(label),
            stamp,
            failed: AtomicBool::new(false),
            counters: Counters::default(),
        }
    }

    /// Marks the lines the map holds anything of resident (and, recovered,
    /// dirty).
    fn scan_resident(&self) -> Result<(), VolError> {
        if self.start == Start::Bypass {
            return Ok(());
        }
        const CHUNK_LINES: u64 = 1024;
        let mut line = 0;
        while line < self.lines {
            let end = (line + CHUNK_LINES).min(self.lines);
            let (lba, n) = self.line_span(line, end);
            let mapped = self.vol.mapped_blocks(lba, n as usize)?;
            for (k, _) in mapped.iter().enumerate().filter(|(_, m)| **m) {
                let l = (lba + k as u64) / self.line_blocks;
                if self.resident.set(l) && self.start == Start::Recovered {
                    self.dirty.set(l);
                }
            }
            line = end;
        }
        if self.start == Start::Recovered {
            tracing::warn!(
                lines = self.dirty.count(),
                "write-back cache recovered after a crash: every cached line is written back"
            );
        }
        Ok(())
    }

    /// First block and block count of lines [first, end).
    fn line_span(&self, first: u64, end: u64) -> (u64, u64) {
        let lba = first * self.line_blocks;
        (lba, (end * self.line_blocks).min(self.blocks) - lba)
    }

    pub fn volume(&self) -> &Arc<Volume> {
        &self.vol
    }

    pub fn start(&self) -> Start {
        self.start
    }

    pub fn mode(&self) -> CacheMode {
        self.mode
    }

    pub fn size_bytes(&self) -> u64 {
        self.vol.size_bytes()
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }

    fn check_ok(&self) -> Result<(), VolError> {
        match self.failed.load(Ordering::SeqCst) {
            true => Err(VolError::Poisoned),
            false => Ok(()),
        }
    }

    fn check_write(&self, offset: u64, len: u64) -> Result<(), VolError> {
        self.check_range(offset, len)?;
        self.check_ok()?;
        match self.read_only {
            true => Err(VolError::ReadOnly),
            false => Ok(()),
        }
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), VolError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size_bytes() => Ok(()),
            _ => Err(VolError::OutOfRange),
        }
    }

    /// Lines [first, last] of the bytes [offset, offset + len), len > 0.
    fn lines_of(&self, offset: u64, len: u64) -> (u64, u64) {
        let line_bytes = self.line_blocks * BS;
        (offset / line_bytes, (offset + len - 1) / line_bytes)
    }

    /// Sets the bit of every line in [first, last].
    fn mark(&self, bits: &Bits, first: u64, last: u64) {
        for l in first..=last {
            bits.set(l);
        }
    }

    /// The cache's counters and label for `stat`.
    pub fn stats(&self) -> CacheStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (hits, misses) = (get(&c.hits), get(&c.misses));
        let label = self.label.lock().unwrap_or_else(|e| e.into_inner()).clone();
        CacheStats {
            cache_hits: hits,
            cache_misses: misses,
            cache_hit_ratio: match hits + misses {
                0 => 0.0,
                n => hits as f64 / n as f64,
            },
            cache_fill_bytes: get(&c.fill_bytes),
            cache_evictions: get(&c.evictions),
            origin_bytes_read: get(&c.origin_read),
            origin_bytes_written: get(&c.origin_written),
            cache_dirty_bytes: self.dirty.count() * self.line_blocks * BS,
            cache: Some(info_of(&label, self.start.name())),
        }
    }

    /// Fills dropped (queue full, or no room without evicting first).
    pub fn fills_dropped(&self) -> u64 {
        self.counters.fills_dropped.load(Ordering::Relaxed)
    }

    /// Whether the origin must be synced after a write-through write.
    fn origin_write(&self, offset: u64, data: &[u8]) -> Result<(), VolError> {
        self.origin.write_at(offset, data).map_err(io_err)?;
        self.counters
            .origin_written
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn origin_read(&self, offset: u64, buf: &mut [u8]) -> Result<(), VolError> {
        self.origin.read_at(offset, buf).map_err(io_err)?;
        self.counters
            .origin_read
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Forgets blocks [lba, lba + n) (their newest copy is in the origin),
    /// their lines' slots held: the generation rises, so no fill read from
    /// the origin before lands on them. If even that fails the cache may
    /// hold a stale copy: it stops.
    fn invalidate(
        &self,
        lba: u64,
        n: u64,
        locks: &mut lines::WriteLocks<'_>,
    ) -> Result<(), VolError> {
        locks.bump();
        match self.vol.trim(lba * BS, n * BS, false) {
            Ok(()) => Ok(()),
            Err(e) => {
                tracing::error!(
                    "cache could not forget blocks {lba}+{n} ({e}): stopping; reopen it"
                );
                self.failed.store(true, Ordering::SeqCst);
                Err(VolError::Poisoned)
            }
        }
    }
}

/// How the cache starts, from its label and the origin now (module docs).
fn decide_start(label: &CacheLabel, now: OriginStamp, read_only: bool) -> Start {
    let unchanged = label.stamp == now;
    match (label.mode, label.clean, unchanged, read_only) {
        (_, true, true, _) => Start::Warm,
        (CacheMode::WriteBack, false, _, _) => Start::Recovered,
        (_, _, _, true) => Start::Bypass,
        _ => Start::Cold,
    }
}

/// Formats the cache again, empty, under a new uuid (its label follows).
fn format_again(
    vol: Volume,
    storage: Arc<dyn Storage>,
    options: OpenOptions,
    label: &mut CacheLabel,
) -> Result<Volume, VolError> {
    let c = vol.create_options_again();
    drop(vol);
    // Hand the old lines' space back to the host at once.
    let len = storage.len_bytes().min(c.physical_size_bytes);
    if let Err(e) = storage.discard(DATA_OFFSET_BYTES, len.saturating_sub(DATA_OFFSET_BYTES)) {
        tracing::debug!("discarding the old cache content: {e}");
    }
    let fresh = Volume::create_cache_volume(storage.clone(), &c)?;
    label.uuid = fresh.superblock().uuid;
    label.clean = true;
    write_label(&*storage, label)?;
    fresh.close()?;
    drop(fresh);
    Volume::open(storage, options)
}

mod io_path;
use io_path::runs as io_path_runs;
