//! A volume's life: create (format the store, an empty map, a first
//! checkpoint), open (recovery, the tables rebuilt from the recovered map,
//! then a new epoch), close (flush and a final checkpoint), and the
//! accessors of what does not change while it is open.
use super::jobs::{Activity, JobsState};
use super::read::Caches;
use super::stats::Counters;
use super::{dedup_memory_default_bytes, read_cache_default_bytes};
use super::{CreateOptions, Dedup, OpenOptions, State, Volume};
use crate::codec::Codec;
use crate::dedup::{self, hooks::HookGeometry};
use crate::error::{OpenError, VolError};
use crate::liveness::{self, LiveMap};
use crate::locks::{Level, OrderedMutex, OrderedRwLock};
use crate::log::Log;
use crate::policy::CodecPolicy;
use crate::recovery::{self, Recovered};
use crate::segments::SegmentTable;
use cvol_format::record::RECORD_HEADER_BYTES;
use cvol_format::superblock::{
    FLAG_AUTO_CODEC, FLAG_DEDUP, FLAG_DIR_LIST_APART, FLAG_DIR_NAMED, FLAG_DIR_SUMMARY,
    FLAG_FP_TABLES, FLAG_HOOK_SNAPSHOT, FLAG_PAGED_MAP, FLAG_RESUME_AT_SNAPSHOT, FLAG_SEG_TABLES,
    FLAG_UNIT_WINDOWS,
};
use cvol_format::{align_up, CheckpointPointer, EntryState, Superblock};
use cvol_format::{BLOCK_SIZE_BYTES, DATA_OFFSET_BYTES, SECTOR_SIZE_BYTES};
use cvol_format::{SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET};
use cvol_storage::Storage;
use std::collections::HashSet;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// Physical sizes from this one up get large segments.
const LARGE_SEGMENTS_FROM_BYTES: u64 = 1 << 30;
/// The dedup index need not hold more blocks than the log stores at 4:1.
const DEDUP_INDEX_USEFUL_RATIO: u64 = 4;

/// The segment size `cvol create` picks when none is given: 1 MiB below
/// 1 GiB of physical size, else 4 MiB.
pub fn default_segment_size(physical_size_bytes: u64) -> u64 {
    if physical_size_bytes >= LARGE_SEGMENTS_FROM_BYTES {
        4 << 20
    } else {
        1 << 20
    }
}

impl State {
    fn new(live: LiveMap, log: Log, synced_seq: u64, generation: u64, snapshot_seq: u64) -> State {
        State {
            live,
            log,
            synced_seq,
            synced_marked: 0,
            flush_marks: 0,
            checkpoint_generation: generation,
            appended_at_checkpoint: 0,
            appended_at_tables: 0,
            durable_snapshot_seq: snapshot_seq,
            changes_at_checkpoint: 0,
            cleaning: HashSet::new(),
            map_records_moved: false,
        }
    }
}

/// The superblock of a new volume with options `c`.
pub(super) fn new_superblock(c: &CreateOptions) -> Result<Superblock, VolError> {
    let segment_size_bytes = match c.segment_size_bytes {
        0 => default_segment_size(c.physical_size_bytes),
        s => s,
    };
    let flag = |on: bool, f: u32| if on { f } else { 0 };
    let mut sb = Superblock {
        uuid: rand::random(),
        logical_size_bytes: c.logical_size_bytes,
        physical_size_bytes: c.physical_size_bytes,
        segment_size_bytes,
        data_offset_bytes: DATA_OFFSET_BYTES,
        codec: c.codec.codec().tag(),
        codec_level: c.codec.codec().level(),
        created_unix_secs: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        flags: flag(c.dedup, FLAG_DEDUP)
            | flag(c.codec.is_auto(), FLAG_AUTO_CODEC)
            | FLAG_RESUME_AT_SNAPSHOT
            | FLAG_PAGED_MAP
            | FLAG_SEG_TABLES
            | FLAG_FP_TABLES
            | FLAG_UNIT_WINDOWS
            | FLAG_HOOK_SNAPSHOT
            | FLAG_DIR_SUMMARY
            | FLAG_DIR_LIST_APART
            | FLAG_DIR_NAMED,
        metadata_segments: 0,
        key_slot: None,
        seal: None,
    };
    sb.set_packing(c.packing);
    if c.pool {
        sb.logical_size_bytes = cvol_format::LOGICAL_SIZE_MAX_BYTES;
        sb.flags |= cvol_format::superblock::FLAG_POOL;
    }
    if let Some(e) = &c.encryption {
        let (slot, seal) = crate::keys::new_key_slot(&sb.uuid, e).map_err(OpenError::Key)?;
        sb.flags |= cvol_format::superblock::FLAG_ENCRYPTED;
        sb.key_slot = Some(slot);
        sb.seal = Some(seal);
    }
    Ok(sb)
}

/// Writes a pool's first volume table (its one volume, `default`, of
/// `pool_default` bytes), both superblock copies, empty pointer slots and
/// an empty first record header, and syncs.
fn format_store(
    storage: &dyn Storage,
    sb: &Superblock,
    pool_default: Option<u64>,
) -> Result<(), VolError> {
    let io = |r: std::io::Result<()>| r.map_err(VolError::Io);
    if let Some(size) = pool_default.filter(|_| sb.is_pool()) {
        let t = cvol_format::pool::PoolTable::new(sb.uuid, size, sb.created_unix_secs);
        // Before the superblock: a pool whose superblock exists has its table.
        io(storage.write_at(
            cvol_format::pool::POOL_SLOT_OFFSETS[t.slot()],
            &t.encode_with(sb.sealer()),
        ))?;
    }
    let enc = sb.encode();
    io(storage.write_at(SUPERBLOCK_A_OFFSET, &enc))?;
    io(storage.write_at(SUPERBLOCK_B_OFFSET, &enc))?;
    let zero_slot = [0u8; cvol_format::pointer::POINTER_BYTES];
    io(storage.write_at(CheckpointPointer::slot_offset(0), &zero_slot))?;
    io(storage.write_at(CheckpointPointer::slot_offset(1), &zero_slot))?;
    io(storage.write_at(sb.segment_offset(0), &[0u8; RECORD_HEADER_BYTES]))?;
    io(storage.sync())
}

/// The codec policy a superblock records.
fn policy_of(sb: &Superblock) -> CodecPolicy {
    let c = Codec::from_tag(sb.codec, sb.codec_level);
    if sb.auto_codec() {
        CodecPolicy::Auto { strong: c }
    } else {
        CodecPolicy::Fixed(c)
    }
}

impl Volume {
    /// Formats `storage` as a new volume and opens it for writing.
    pub fn create(storage: Arc<dyn Storage>, c: &CreateOptions) -> Result<Volume, VolError> {
        Volume::create_from(storage, new_superblock(c)?, c)
    }

    /// Formats `storage` (joined with its metadata device, if `sb` names
    /// one) as the volume of `sb`, made from `c`, and opens it for writing
    /// (a pool's first volume has `c`'s logical size; the volume keeps
    /// `c`'s key file, for a cache that is formatted again).
    pub(super) fn create_from(
        storage: Arc<dyn Storage>,
        sb: Superblock,
        c: &CreateOptions,
    ) -> Result<Volume, VolError> {
        let pool_default = (c.pool && !sb.is_cache()).then_some(c.logical_size_bytes);
        sb.validate().map_err(OpenError::Geometry)?;
        if sb.physical_size_bytes > storage.len_bytes() {
            return Err(OpenError::BackingTooSmall {
                physical_size_bytes: sb.physical_size_bytes,
                backing_bytes: storage.len_bytes(),
            }
            .into());
        }
        format_store(&*storage, &sb, pool_default)?;
        let mut segs = SegmentTable::for_volume(&sb);
        let first = segs.open_next().expect("a new volume has free segments");
        let log = Log::new(&sb, segs, first, 0, 0, 1);
        let state = State::new(LiveMap::empty(&sb), log, 0, 0, 0);
        let options = OpenOptions {
            key: c.encryption.as_ref().map(|e| e.key.clone()),
            ..OpenOptions::default()
        };
        let vol = Volume::assemble(storage, sb, options, state);
        vol.begin_epoch()?;
        vol.checkpoint()?;
        Ok(vol)
    }

    /// Formats `storage` as a new, empty cache volume (`FLAG_CACHE`: see
    /// `crate::cache`) and opens it; the caller writes its label.
    pub fn create_cache_volume(
        storage: Arc<dyn Storage>,
        c: &CreateOptions,
    ) -> Result<Volume, VolError> {
        let mut sb = new_superblock(c)?;
        sb.flags |= cvol_format::superblock::FLAG_CACHE;
        Volume::create_from(storage, sb, c)
    }

    /// The create options that made this volume (a cache starting cold is
    /// formatted again with them, under a new uuid).
    pub fn create_options_again(&self) -> CreateOptions {
        CreateOptions {
            logical_size_bytes: self.sb.logical_size_bytes,
            physical_size_bytes: self.sb.physical_size_bytes,
            codec: policy_of(&self.sb),
            segment_size_bytes: self.sb.segment_size_bytes,
            dedup: self.sb.dedup(),
            packing: self.sb.packing(),
            pool: false,
            // Never a volume in the clear for an encrypted one: an open or
            // create of an encrypted volume always has its key file.
            encryption: self.sb.key_slot.map(|slot| crate::keys::Encryption {
                cipher: slot.cipher,
                key: (self.options.key.clone()).expect("an encrypted volume has its key file"),
            }),
        }
    }

    /// The store the volume lives on.
    pub fn storage(&self) -> &Arc<dyn Storage> {
        &self.storage
    }

    /// Opens an existing volume: recovery, then (unless read-only) a new epoch.
    pub fn open(storage: Arc<dyn Storage>, options: OpenOptions) -> Result<Volume, VolError> {
        let (sb, r) = recover(&*storage, &options)?;
        let recovery_warnings = r.warnings.clone();
        let recovery_salvage = r.salvage.clone();
        let state = recovered_state(&*storage, &sb, r)?;
        let mut vol = Volume::assemble(storage, sb, options, state);
        vol.recovery_warnings = recovery_warnings;
        vol.recovery_salvage = recovery_salvage;
        if !vol.options.read_only {
            vol.upgrade_superblock()?;
            vol.finish_resize()?;
            match vol.begin_epoch() {
                Err(VolError::NoSpace) => return Err(OpenError::LogFull.into()),
                r => r?,
            }
            let st = vol.lock_state()?;
            vol.note_defer_room(&st);
            drop(st);
        }
        Ok(vol)
    }

    /// Marks a volume made before checkpoints resumed at their snapshot
    /// (`FLAG_RESUME_AT_SNAPSHOT`) or wrote a paged map (`FLAG_PAGED_MAP`)
    /// with liveness tables (`FLAG_SEG_TABLES`) and fingerprint tables
    /// (`FLAG_FP_TABLES`) without a row per unit (`FLAG_UNIT_WINDOWS`) or a
    /// dedup hook snapshot (`FLAG_HOOK_SNAPSHOT`) or summarized directory
    /// blocks (`FLAG_DIR_SUMMARY`) with their lists apart
    /// (`FLAG_DIR_LIST_APART`) and named by the commit (`FLAG_DIR_NAMED`)
    /// before this open writes one, so that older binaries refuse it
    /// rather than misread its commits. Each superblock copy is rewritten
    /// whole (a sector-atomic write each); either copy, old or new, opens
    /// the volume here.
    fn upgrade_superblock(&mut self) -> Result<(), VolError> {
        const NEW: u32 = FLAG_RESUME_AT_SNAPSHOT
            | FLAG_PAGED_MAP
            | FLAG_SEG_TABLES
            | FLAG_FP_TABLES
            | FLAG_UNIT_WINDOWS
            | FLAG_HOOK_SNAPSHOT
            | FLAG_DIR_SUMMARY
            | FLAG_DIR_LIST_APART
            | FLAG_DIR_NAMED;
        if self.sb.flags & NEW == NEW {
            return Ok(());
        }
        let mut sb = self.sb.clone();
        // A volume without summaries has no lists apart either.
        let lists_new = sb.flags & FLAG_DIR_LIST_APART == 0;
        sb.flags |= NEW;
        let enc = sb.encode();
        for at in [SUPERBLOCK_A_OFFSET, SUPERBLOCK_B_OFFSET] {
            let r = self
                .storage
                .write_at(at, &enc)
                .and_then(|()| self.storage.sync());
            self.guard(r.map_err(VolError::Io))?;
        }
        tracing::info!("superblock marked: paged map checkpoints resumed at their snapshot, with liveness and fingerprint tables, units counted in their windows, the dedup hook snapshot, summarized directory blocks with their lists apart, named by each commit (format flags 4, 8, 16, 32, 128, 2048, 16384, 32768, 65536)");
        self.sb.replace(sb);
        if lists_new {
            // Every directory block is written summarized, its list apart,
            // by the next checkpoint (the whole directory once), so that
            // later opens leave the blocks they need not verify packed and
            // read their summaries alone.
            let mut st = self.lock_state()?;
            self.with_log_pages(&mut st, |live, src| {
                live.map_mut().mark_inline_lists_dirty(src)
            })?;
        }
        Ok(())
    }

    fn assemble(
        storage: Arc<dyn Storage>,
        sb: Superblock,
        options: OpenOptions,
        mut state: State,
    ) -> Volume {
        match options.warm_segments {
            Some(n) => state.log.segments.set_warm_max(n),
            None if !storage.overwrite_is_cheaper() => state.log.segments.set_warm_max(0),
            None => {}
        }
        state.log.zero_ahead =
            options
                .zero_ahead_bytes
                .unwrap_or(match storage.overwrite_is_cheaper() {
                    true => super::options::ZERO_AHEAD_DEFAULT_BYTES,
                    false => 0,
                });
        let max_useful = sb.physical_size_bytes * DEDUP_INDEX_USEFUL_RATIO / BLOCK_SIZE_BYTES;
        let dedup = (sb.dedup() && !options.read_only).then(|| {
            let mut index = dedup::Index::new(
                options
                    .dedup_memory_bytes
                    .unwrap_or_else(|| dedup_memory_default_bytes(sb.physical_size_bytes)),
                max_useful,
                hook_geometry(&sb),
            );
            if state.live.fp_tables().is_empty() {
                index.load = dedup::HookLoad::Ready; // nothing to replay
            }
            Dedup {
                seed: dedup::FpKey::of(&sb),
                index: OrderedMutex::new(Level::Index, index),
            }
        });
        Volume {
            map_cache_bytes: super::options::map_cache_limit_bytes(options.map_cache_bytes),
            policy: policy_of(&sb),
            recovery_warnings: Vec::new(),
            recovery_salvage: None,
            rmw: OrderedRwLock::new(Level::Rmw, ()),
            cleaner_lock: OrderedMutex::new(Level::Cleaner, ()),
            checkpoint_lock: OrderedMutex::new(Level::Checkpoint, ()),
            flush_lock: OrderedMutex::new(Level::Flush, ()),
            state: OrderedMutex::new(Level::State, state),
            dedup,
            poisoned: AtomicBool::new(false),
            reported_logical: Default::default(),
            activity: Activity::new(
                (policy_of(&sb).is_auto() && options.elastic.recompress && !options.read_only)
                    .then_some(options.elastic.inline_cpu_percent)
                    .flatten(),
                &options.clock,
                options.cpu.clone(),
            ),
            caches: Caches::new(
                options
                    .read_cache_bytes
                    .unwrap_or_else(|| read_cache_default_bytes(sb.physical_size_bytes)),
            ),
            counters: Counters::default(),
            jobs: JobsState::default(),
            cache_stats: std::sync::OnceLock::new(),
            edge_memory: std::sync::OnceLock::new(),
            storage,
            sb: super::sbcell::SbCell::new(sb),
            options,
        }
    }

    /// Freed segments the log head wrote over without a hole punched in
    /// between (`OpenOptions::warm_segments`), since open.
    #[doc(hidden)]
    pub fn warm_reuses(&self) -> u64 {
        self.lock_state()
            .map(|st| st.log.segments.warm_reused)
            .unwrap_or(0)
    }

    /// Whether open took the liveness tables the checkpoint persisted
    /// (no map change to replay) instead of rebuilding them from the map.
    #[doc(hidden)]
    pub fn opened_from_tables(&self) -> bool {
        self.lock_state().is_ok_and(|st| st.live.loaded_tables())
    }

    /// How many map page records open read to verify them: none for the
    /// newest checkpoint when both pointers decode (its pages are verified
    /// when first read), every one for a fallback or a lone pointer, none
    /// for a checkpoint of whole-map chunks.
    #[doc(hidden)]
    pub fn map_pages_verified_at_open(&self) -> u64 {
        self.lock_state()
            .map(|st| st.live.map().cache_counts().verified_at_open)
            .unwrap_or(0)
    }

    /// Directory blocks of the map still packed: left so by open (their
    /// lists not decoded) and not needed since.
    #[doc(hidden)]
    pub fn map_dir_blocks_packed(&self) -> usize {
        self.lock_state()
            .map(|st| st.live.map().packed_blocks())
            .unwrap_or(0)
    }

    /// Directory blocks open left unread (`FLAG_DIR_NAMED`) and not read
    /// since.
    #[doc(hidden)]
    pub fn map_dir_blocks_unread(&self) -> usize {
        self.lock_state()
            .map(|st| st.live.map().unread_blocks())
            .unwrap_or(0)
    }

    /// Directory blocks open left unread that were read since.
    #[doc(hidden)]
    pub fn map_dir_blocks_read(&self) -> u64 {
        self.lock_state()
            .map(|st| st.live.map().cache_counts().dir_blocks_read)
            .unwrap_or(0)
    }

    /// Directory lists kept apart that were read to decode their packed
    /// blocks (none at open: open reads the summaries alone).
    #[doc(hidden)]
    pub fn map_dir_lists_read(&self) -> u64 {
        self.lock_state()
            .map(|st| st.live.map().cache_counts().dir_lists_read)
            .unwrap_or(0)
    }

    /// Segments whose liveness table rows open left packed at their
    /// tables' counts, unchecked until first used.
    #[doc(hidden)]
    pub fn table_rows_taken_at_their_counts(&self) -> usize {
        self.lock_state()
            .map(|st| st.live.shared().packed_at_their_word())
            .unwrap_or(0)
    }

    /// Why open could not use the liveness tables its checkpoint named
    /// and rebuilt them from the whole map, if it could not, or why rows
    /// it took at their tables' word are not what those said (a bug, or
    /// damage: the simulations count it). Decodes every row still packed.
    #[doc(hidden)]
    pub fn tables_rejected(&self) -> Option<String> {
        let st = self.lock_state().ok()?;
        (st.live.tables_rejected().map(str::to_owned)).or_else(|| st.live.shared().damaged_rows())
    }

    /// Flushes and checkpoints (a clean close). Safe to call more than once.
    pub fn close(&self) -> Result<(), VolError> {
        if self.options.read_only {
            return Ok(());
        }
        self.flush()?;
        self.punch_warm(false)?;
        let unchanged = {
            let st = self.lock_state()?;
            st.live.changes() == st.changes_at_checkpoint
        };
        if unchanged {
            return Ok(()); // the newest checkpoint already holds this map
        }
        match self.checkpoint() {
            Ok(()) => Ok(()),
            Err(VolError::NoSpace) => {
                tracing::warn!(
                    "no space for a final checkpoint; the next open replays the log instead"
                );
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }

    pub fn size_bytes(&self) -> u64 {
        self.sb.logical_size_bytes
    }

    pub fn codec_policy(&self) -> CodecPolicy {
        self.policy
    }

    pub fn read_only(&self) -> bool {
        self.options.read_only
    }

    /// What recovery skipped or rebuilt when this volume was opened.
    pub fn recovery_warnings(&self) -> &[String] {
        &self.recovery_warnings
    }

    /// What the salvage this open ran (`rebuild_from_log`) could not save.
    pub fn recovery_salvage(&self) -> Option<&recovery::Salvage> {
        self.recovery_salvage.as_ref()
    }

    /// Where the record serving `lba` lies (offset, length), if any: for
    /// tests that attribute an unreadable block to an injected fault.
    #[doc(hidden)]
    pub fn block_record(&self, lba: u64) -> Option<(u64, u32)> {
        let mut st = self.lock_state().ok()?;
        if lba < st.live.blocks() {
            self.fault(&mut st, lba, lba + 1).ok()?;
        }
        match (lba < st.live.blocks()).then(|| st.live.get(lba).state_valid()) {
            Some(EntryState::Data { offset, len, .. }) => Some((offset, len)),
            _ => None,
        }
    }
}

/// Reads the superblock and recovers the map: the newest usable checkpoint
/// and roll-forward, or (repair: asked for, not read-only) a salvage of the
/// whole log when that fails or falls short of a certified seq.
fn recover(
    storage: &dyn Storage,
    options: &OpenOptions,
) -> Result<(Superblock, Recovered), VolError> {
    let (mut sb, warnings) = recovery::read_superblock(storage).map_err(OpenError::Superblock)?;
    warnings.iter().for_each(|w| tracing::warn!("{w}"));
    crate::keys::unlock(storage, &mut sb, options.key.as_ref())?;
    recovery::require_metadata_device(storage, &sb).map_err(OpenError::Superblock)?;
    let repair = options.rebuild_from_log && !options.read_only;
    // Repair verifies every map page: a damaged one is salvaged.
    let recovered = match repair {
        true => recovery::recover_lazy_verified(storage, &sb),
        false => recovery::recover_lazy(storage, &sb),
    };
    let r = match recovered {
        // Repair reads the whole log: flushed records the chain cannot
        // reach (a segment whose start was erased) are salvaged too.
        Ok(r) if repair => salvage_if_short(storage, &sb, r)?,
        Ok(r) => r,
        Err(e) if repair => salvage(storage, &sb, e.to_string())?,
        Err(e) => return Err(OpenError::Recovery(e).into()),
    };
    r.warnings.iter().for_each(|w| tracing::warn!("{w}"));
    log_recovered(&r);
    Ok((sb, r))
}

/// The recovered map, unless the log certifies a seq its chain does not
/// reach: then a salvage of the whole log.
fn salvage_if_short(
    storage: &dyn Storage,
    sb: &Superblock,
    r: Recovered,
) -> Result<Recovered, VolError> {
    let c = recovery::certified_in_log(storage, sb);
    if r.last_seq >= c.seq {
        return Ok(r);
    }
    let e = format!(
        "the log's chain ends at seq {} but {} certifies seq {} as flushed",
        r.last_seq, c.by, c.seq
    );
    salvage(storage, sb, e)
}

/// Salvages the map from the whole log (repair), noting why first.
fn salvage(storage: &dyn Storage, sb: &Superblock, why: String) -> Result<Recovered, VolError> {
    tracing::warn!("{why}; salvaging the map from the log");
    let mut r = recovery::salvage(storage, sb).map_err(OpenError::Recovery)?;
    r.warnings.insert(0, why);
    Ok(r)
}

/// A clean close leaves no data records after the last checkpoint (only
/// EPOCH records of opens): says "recovered" only when records that change
/// the map had to be replayed.
fn log_recovered(r: &Recovered) {
    if r.replayed_map_records > 0 {
        // With warnings, they (logged above) say why; without, the last run
        // simply ended before its final checkpoint.
        let why = if r.warnings.is_empty() {
            " (the last run ended without a final checkpoint)"
        } else {
            ""
        };
        tracing::info!(
            checkpoint = r.checkpoint_generation,
            last_seq = r.last_seq,
            "recovered: replayed {} records written after the last checkpoint{why}",
            r.replayed_map_records
        );
    } else {
        tracing::debug!(
            checkpoint = r.checkpoint_generation,
            replayed = r.replayed_records,
            last_seq = r.last_seq,
            "volume opened: no data to replay"
        );
    }
}

/// The recovered map with its liveness tables: those the checkpoint
/// persisted, brought up to date with what roll-forward replayed (unless
/// recovery had to fall back or step over damage: then rebuilt), else
/// rebuilt from the whole map (its pages read from the log one at a time,
/// not kept).
fn recovered_tables(
    storage: &dyn Storage,
    sb: &Superblock,
    r: &mut Recovered,
    head: Option<(u64, u64)>,
) -> Result<(LiveMap, crate::segments::SegmentTable), VolError> {
    let mut map = std::mem::replace(&mut r.map, crate::map::BlockMap::new(0));
    let clean = r.replayed_map_records == 0 || r.warnings.is_empty();
    let mut rejected = None;
    if let Some(t) = r.tables.take().filter(|_| clean) {
        let pages = crate::logread::LogPages {
            storage,
            sb,
            buffered: None,
        };
        let header = |offset: u64| {
            let mut b = [0u8; cvol_format::record::RECORD_HEADER_BYTES];
            storage.read_at(offset, &mut b).ok()?;
            cvol_format::record::RecordHeader::decode(&b)
                .ok()
                .filter(|h| h.volume_tag == sb.volume_tag())
        };
        let replay = liveness::Replay {
            records: r.replayed_map_records,
            new_records: &r.new_records,
            needed: &r.needed_segments,
            open: head,
            source: Some(liveness::ReplaySource {
                pages: &pages,
                header: &header,
            }),
        };
        match LiveMap::from_tables(sb, map, t, replay) {
            Ok(x) => return Ok(x),
            Err(back) => {
                let (m, e) = *back;
                tracing::warn!("liveness tables unusable ({e}): rebuilt from the map");
                map = m;
                rejected = Some(e);
            }
        }
    }
    map.take_originals();
    let src = crate::logread::LogPages {
        storage,
        sb,
        buffered: None,
    };
    // A rebuild reads every page: the directory blocks open left packed
    // are decoded first.
    map.unpack_all(&src).map_err(|e| VolError::Corrupt {
        lba: 0,
        detail: e.to_string(),
    })?;
    let tables =
        liveness::rebuild(sb, &map, Some(&src), &r.needed_segments, head).map_err(|e| {
            VolError::Corrupt {
                lba: 0,
                detail: e.to_string(),
            }
        })?;
    let (mut live, segs) = LiveMap::recovered(sb, map, tables, r.replayed_map_records);
    live.set_tables_rejected(rejected.map(|e| e.to_string()));
    Ok((live, segs))
}

/// The state of a recovered volume: the map with its tables rebuilt, the
/// log head after the chain's last record (its segment in the buffer, as
/// roll-forward read it, else read back).
fn recovered_state(
    storage: &dyn Storage,
    sb: &Superblock,
    r: Recovered,
) -> Result<State, VolError> {
    let fill = (align_up(r.end as u64, SECTOR_SIZE_BYTES)).min(sb.segment_size_bytes) as usize;
    assert!(
        r.end <= fill && r.segment < sb.segment_count(),
        "the chain ends inside a segment"
    );
    let head = Some((r.segment, r.last_seq));
    let mut r = r;
    let (mut live, segs) = recovered_tables(storage, sb, &mut r, head)?;
    if (fill as u64) < sb.segment_size_bytes {
        resume_fp_part(
            storage,
            sb,
            &mut live,
            sb.segment_offset(r.segment) + fill as u64,
        );
    }
    let mut log = Log::new(sb, segs, r.segment, fill, r.last_epoch, r.last_seq + 1);
    // The segment as roll-forward read it, if it did (nothing has written
    // since): not read again.
    match r.head_segment.take() {
        Some(bytes) if bytes.len() as u64 == sb.segment_size_bytes => log.head.adopt(bytes, r.end),
        _ => storage
            .read_at(
                sb.segment_offset(r.segment),
                &mut log.head.buf_mut()[..r.end],
            )
            .map_err(VolError::Io)?,
    }
    Ok(State::new(
        live,
        log,
        r.last_seq,
        r.checkpoint_generation,
        r.snapshot_seq,
    ))
}

/// Takes back the rows of the fingerprint table of the part holding the
/// log head (at `head`), which the next records add to: its next record
/// must keep them. One that cannot be read is left (its hints are lost
/// when the part is written again).
fn resume_fp_part(storage: &dyn Storage, sb: &Superblock, live: &mut LiveMap, head: u64) {
    let t = live.fp_table_of(head);
    let Some(r) = (t < live.map().tables())
        .then(|| live.map().table_ref(t))
        .flatten()
    else {
        return;
    };
    match liveness::read_fp_table(storage, sb, t, &r) {
        Ok(rows) => live.fp_resume(t, rows),
        Err(e) => tracing::warn!("fingerprint table {t} unreadable ({e}): its hints are dropped"),
    }
}

/// Where the volume's fingerprint tables are numbered, for the hook index.
fn hook_geometry(sb: &cvol_format::Superblock) -> HookGeometry {
    let segments = sb.segment_count();
    HookGeometry {
        first_table: cvol_format::tables::table_count(sb.table_segments()),
        parts_per_segment: cvol_format::fprints::fp_parts(sb.segment_size_bytes),
        segments,
    }
}
