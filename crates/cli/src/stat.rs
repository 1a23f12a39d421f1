//! `cvol stat`: the statistics of a volume, from its server or offline.
//! Both ends of the control socket request `stat`: the server answers
//! with `VolumeStats` as JSON, `cvol stat` reads it back into the struct.
use crate::control;
use crate::error::Error;
use crate::volfile::{self, Globals};
use crate::words::{count, human_bytes};
use cvol_engine::pool::Pool;
use cvol_engine::stats::ScrubStats;
use cvol_engine::{Volume, VolumeStats};
use serde_json::Value;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

/// The control socket request.
pub const REQUEST: &str = "stat";

/// The server's answer to [`REQUEST`]: its statistics as `stat --json`
/// shows them, on one line.
pub fn reply(vol: &Volume) -> String {
    serde_json::to_value(shown(vol))
        .unwrap_or_else(
            |e| serde_json::json!({ "error": format!("cannot encode the statistics: {e}") }),
        )
        .to_string()
}

/// The volume's statistics as `stat` shows them (and the metrics export).
pub fn shown(vol: &Volume) -> VolumeStats {
    let mut stats = vol.stats();
    normalize(&mut stats);
    stats
}

/// Asks a running server for its statistics; `None` if none answers.
fn query_served(path: &Path) -> Option<Result<VolumeStats, Error>> {
    let v = control::query(path, REQUEST)?;
    Some(match v["error"].as_str() {
        Some(e) => Err(Error::Refused(format!(
            "{}: the server could not report its statistics: {e}",
            path.display()
        ))),
        None => serde_json::from_value(v).map_err(|e| {
            Error::Refused({
                format!(
                    "{}: the server's statistics do not read as this cvol's ({e}); \
                 a server of another cvol version? restart it with this one",
                    path.display()
                )
            })
        }),
    })
}

/// The `space pressure` line: what the volume is doing about room, what
/// deferral borrowed, and what waited or was refused.
fn space_pressure(s: &VolumeStats) -> String {
    let (sp, c) = (&s.space, &s.cleaner);
    let what = match sp.space_pressure.as_str() {
        "cleaning" => "low: the cleaner collects dead space and compacts units",
        "writers-waiting" => "high: writes wait for the cleaner to make room",
        _ => "none",
    };
    format!(
        "{what}; {} more expected from compaction; deferred raw data {} ({}); {} writes waited, {} refused",
        human_bytes(sp.compactable_bytes),
        human_bytes(sp.deferred_pending_bytes),
        if sp.deferral_room { "deferral on" } else { "deferral paused" },
        c.space_waits,
        c.space_refusals
    )
}

/// Words and bounds the engine leaves raw: the cleaner policy as its flag
/// spells it, and no more "data that fits" than the volume has room for.
/// Idempotent (also applied to what an older server sends).
fn normalize(s: &mut VolumeStats) {
    let flag = match s.cleaner.cleaner_policy.as_str() {
        "CostBenefit" => Some("cost-benefit"),
        "Greedy" => Some("greedy"),
        _ => None,
    };
    if let Some(flag) = flag {
        s.cleaner.cleaner_policy = flag.to_string();
    }
    let logical_free = s.logical_size_bytes.saturating_sub(s.mapped_bytes);
    for n in [
        &mut s.estimated_free_logical_bytes,
        &mut s.worst_case_free_logical_bytes,
    ] {
        *n = (*n).min(logical_free);
    }
}

/// The statistics of one volume as `stat` shows them.
struct Report {
    volume: String,
    /// From the server (counters since it started), or opened here.
    served: bool,
    stats: VolumeStats,
    /// A pool's volumes (`{"volumes": [...]}`), when it is one.
    volumes: Option<Value>,
}

pub fn cmd_stat(path: &Path, json: bool, globals: &Globals) -> Result<ExitCode, Error> {
    let (mut stats, served, volumes) = match query_served(path) {
        Some(stats) => (
            stats?,
            true,
            crate::volumes::list_for_stat(path, true, None),
        ),
        None => {
            if let Some(locked) = crate::keyfile::locked_stat(path, json)? {
                print!("{locked}");
                return Ok(ExitCode::SUCCESS);
            }
            let vol = Arc::new(volfile::open_read_only(path, None, globals)?);
            cvol_cache::describe_offline(&vol);
            // A pool's statistics count its volumes' sizes.
            let pool = (!vol.superblock().is_cache())
                .then(|| Pool::attach(vol.clone()).ok())
                .flatten();
            let volumes = crate::volumes::list_for_stat(path, false, pool.as_ref());
            (vol.stats(), false, volumes)
        }
    };
    normalize(&mut stats);
    let r = Report {
        volume: path.display().to_string(),
        served,
        stats,
        volumes,
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&r.json()?).map_err(|e| Error::Refused(e.to_string()))?
        );
    } else {
        print!("{}", r.text());
    }
    Ok(ExitCode::SUCCESS)
}

/// `stat --watch SECS [--count N]`: the served volume's statistics every
/// SECS seconds, with the client's read and write rates over the last
/// interval; a screen each (cleared), or with `json` a line each.
pub fn cmd_watch(
    path: &Path,
    json: bool,
    secs: f64,
    count: Option<u64>,
    globals: &Globals,
) -> Result<ExitCode, Error> {
    if !(secs.is_finite() && (0.1..=86400.0).contains(&secs)) {
        return Err(Error::Usage(format!(
            "--watch {secs}: give seconds between 0.1 and 86400"
        )));
    }
    let interval = std::time::Duration::from_secs_f64(secs);
    let mut before: Option<(std::time::Instant, VolumeStats)> = None;
    let mut shown = 0u64;
    loop {
        let Some(stats) = query_served(path) else {
            // A wrong path or a file that is no volume says so first.
            volfile::open_read_only(path, None, globals)?;
            return Err(Error::Refused(format!(
                "{}: not being served (or its server stopped); --watch shows a served volume's activity, `cvol stat {}` shows it offline",
                path.display(),
                path.display()
            )));
        };
        let mut stats = stats?;
        normalize(&mut stats);
        let now = std::time::Instant::now();
        let rates = before
            .as_ref()
            .map(|(t, b)| Rates::between(b, &stats, now - *t));
        let r = Report {
            volume: path.display().to_string(),
            served: true,
            stats,
            volumes: None,
        };
        let mut text = String::new();
        if json {
            let mut v = r.json()?;
            if let Some(x) = &rates {
                v["write_bytes_per_second"] = Value::from(x.write);
                v["read_bytes_per_second"] = Value::from(x.read);
            }
            text += &serde_json::to_string(&v).map_err(|e| Error::Refused(e.to_string()))?;
            text.push('\n');
        } else {
            // Clear the screen and go home, as `watch` does.
            text += "\x1b[H\x1b[2J";
            text += &rates.as_ref().map_or_else(
                || format!("cvol stat --watch {secs}: first sample, rates from the next"),
                |x| x.line(secs),
            );
            text.push('\n');
            text += &r.text();
        }
        // A reader that went away (`| head`) ends the watch, quietly.
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        if out
            .write_all(text.as_bytes())
            .and_then(|()| out.flush())
            .is_err()
        {
            return Ok(ExitCode::SUCCESS);
        }
        drop(out);
        shown += 1;
        if count.is_some_and(|n| shown >= n) {
            return Ok(ExitCode::SUCCESS);
        }
        before = Some((now, r.stats));
        std::thread::sleep(interval);
    }
}

/// Client bytes per second between two samples.
struct Rates {
    write: u64,
    read: u64,
}

impl Rates {
    fn between(a: &VolumeStats, b: &VolumeStats, dt: std::time::Duration) -> Rates {
        let per_s = |x: u64, y: u64| {
            // A restarted server counts from zero again: no rate then.
            let d = y.saturating_sub(x) as f64;
            (d / dt.as_secs_f64().max(1e-3)) as u64
        };
        Rates {
            write: per_s(a.client_bytes_written, b.client_bytes_written),
            read: per_s(a.elastic.bytes_read, b.elastic.bytes_read),
        }
    }

    fn line(&self, secs: f64) -> String {
        format!(
            "client writes {}/s, reads {}/s (over the last {secs} s)",
            human_bytes(self.write),
            human_bytes(self.read)
        )
    }
}

impl Report {
    /// `stat --json`: every statistic, `served` and `volume`, keys sorted.
    fn json(&self) -> Result<Value, Error> {
        let mut v = serde_json::to_value(&self.stats)
            .map_err(|e| Error::Refused(format!("cannot encode the statistics: {e}")))?;
        v["served"] = Value::Bool(self.served);
        v["volume"] = Value::String(self.volume.clone());
        if let Some(vols) = &self.volumes {
            v["volumes"] = vols["volumes"].clone();
        }
        Ok(v)
    }

    /// The human table as text, a line per row.
    fn text(&self) -> String {
        (self.table().into_iter())
            .map(|(k, val)| format!("{k:<24}{val}\n"))
            .collect()
    }

    /// The human table: label and value per row.
    fn table(&self) -> Vec<(&'static str, String)> {
        let s = &self.stats;
        let b = human_bytes;
        let mut rows = vec![
            ("volume", self.volume.clone()),
            (
                "served",
                if self.served {
                    "yes (counters since the server started)".to_string()
                } else {
                    "no (activity counters are shown while it is served)".to_string()
                },
            ),
            ("host holds", host_holds(s)),
        ];
        if let Some(vols) = self.volumes.as_ref().and_then(|v| v["volumes"].as_array()) {
            let list: Vec<String> = vols
                .iter()
                .map(|x| {
                    format!(
                        "{} ({})",
                        x["name"].as_str().unwrap_or("?"),
                        b(x["size_bytes"].as_u64().unwrap_or(0))
                    )
                })
                .collect();
            rows.push(("volumes", format!("{}: {}", list.len(), list.join(", "))));
        }
        if let Some(c) = &s.cache.cache {
            rows.extend(cache_rows(s, c, self.served));
        }
        if s.object.object_store.is_some() {
            rows.extend(object_rows(s, self.served));
        }
        rows.extend(space_rows(s, self.served));
        rows.extend(savings_rows(s));
        if s.lost_bytes > 0 {
            let after_zero = rows
                .iter()
                .position(|(k, _)| *k == "zero")
                .map_or(0, |i| i + 1);
            rows.insert(
                after_zero,
                (
                    "lost to damage",
                    format!(
                        "{} (read as EIO until written again; `cvol check` lists them)",
                        b(s.lost_bytes)
                    ),
                ),
            );
        }
        let d = &s.dedup;
        let shared = count(d.dedup_shared_records, "shared record", "shared records");
        if !self.served {
            rows.push((
                "dedup",
                if d.dedup {
                    format!("on: {shared}")
                } else {
                    "off".to_string()
                },
            ));
            return rows;
        }
        rows.push(dedup_row(s));
        if s.dedup.dedup {
            rows.push(window_row(s));
        }
        rows.extend(io_rows(s));
        rows.extend(background_rows(s));
        rows
    }
}

/// What the volume holds and how it is reduced (served or not).
fn space_rows(s: &VolumeStats, served: bool) -> Vec<(&'static str, String)> {
    let b = human_bytes;
    vec![
        (
            "reduction ratio",
            format!(
                "{:.2}x ({} of data in {})",
                s.reduction_ratio,
                b(s.mapped_bytes),
                b(s.physical_used_bytes)
            ),
        ),
        ("  live records", b(s.live_bytes)),
        ("  dead", dead_words(s, served)),
        (
            "codec",
            if s.codec == "auto" {
                format!("auto (strong codec {})", s.elastic.codec_strong)
            } else {
                s.codec.clone()
            },
        ),
        (
            "packing",
            format!("{} ({} padding since start)", s.packing, b(s.padding_bytes)),
        ),
        ("encryption", s.encryption.clone()),
        ("logical size", b(s.logical_size_bytes)),
        ("physical size", b(s.physical_size_bytes)),
        ("mapped (non-zero data)", b(s.mapped_bytes)),
        ("zero", b(s.zero_bytes)),
        ("stored payload", b(s.stored_bytes)),
        ("physical free", b(s.physical_free_bytes)),
        ("free, space kept", b(s.warm_free_bytes)),
        ("metadata device", metadata_device(s)),
        (
            "more data that fits",
            format!(
                "{} at the current ratio, {} worst case",
                b(s.estimated_free_logical_bytes),
                b(s.worst_case_free_logical_bytes)
            ),
        ),
    ]
}

/// Where the savings come from, codec by codec, and the segments in use.
fn savings_rows(s: &VolumeStats) -> Vec<(&'static str, String)> {
    let b = human_bytes;
    vec![
        (
            "savings",
            format!(
                "zeros {}  dedup {}  compression {}",
                b(s.dedup.zero_saved_bytes),
                b(s.dedup.dedup_saved_bytes),
                b(s.dedup.compression_saved_bytes)
            ),
        ),
        (
            "compression ratio",
            format!(
                "{:.2}x (the codec alone; dedup {:.2}x)",
                s.compression_ratio, s.dedup.dedup_ratio
            ),
        ),
        (
            "blocks by codec",
            format!(
                "lz4 {}  zstd {}  none {}",
                s.codec_lz4_blocks, s.codec_zstd_blocks, s.codec_none_blocks
            ),
        ),
        (
            "bytes by codec",
            format!(
                "lz4 {}  zstd {}  none {}",
                b(s.elastic.codec_lz4_bytes),
                b(s.elastic.codec_zstd_bytes),
                b(s.elastic.codec_none_bytes)
            ),
        ),
        (
            "segments used",
            format!(
                "{} of {} ({} each)",
                s.segments_used,
                s.segments_total,
                b(s.segment_size_bytes)
            ),
        ),
    ]
}

/// The served dedup row: hits, the index and its warm-up.
fn dedup_row(s: &VolumeStats) -> (&'static str, String) {
    let b = human_bytes;
    let d = &s.dedup;
    let shared = count(d.dedup_shared_records, "shared record", "shared records");
    (
        "dedup",
        if d.dedup {
            format!(
                "on: {} of {} found stored, {shared}, index {} of {} ({}; \
                 warmed from {} saved, {} read back)",
                d.dedup_hits,
                count(d.dedup_lookups, "block", "blocks"),
                d.dedup_index_entries,
                d.dedup_index_capacity,
                b(d.dedup_index_memory_bytes),
                count(
                    d.dedup_warm_table_fingerprints,
                    "fingerprint",
                    "fingerprints"
                ),
                count(d.dedup_warm_data_blocks, "block", "blocks"),
            )
        } else {
            "off".to_string()
        },
    )
}

/// The served dedup window row: what the index can find, the hooks, the
/// fingerprint tables read for lookups.
fn window_row(s: &VolumeStats) -> (&'static str, String) {
    let b = human_bytes;
    let d = &s.dedup;
    (
        "dedup window",
        format!(
            "{} by locality, {} in any order; hooks {} of {} (1 in 2^{}, {}{}), {}; \
             {} read for lookups ({:.4} a lookup), {} cached ({}); found {} recent, {} by hooks",
            b(d.dedup_window_bytes),
            b(d.dedup_window_hot_bytes),
            d.dedup_hook_entries,
            d.dedup_hook_capacity,
            d.dedup_hook_sample_log2,
            b(d.dedup_hook_memory_bytes),
            if d.dedup_hooks_full { ", full" } else { "" },
            d.dedup_hook_load,
            count(d.dedup_table_reads, "table", "tables"),
            d.dedup_table_reads_per_lookup,
            count(d.dedup_table_cache_tables, "table", "tables"),
            b(d.dedup_table_cache_bytes),
            d.dedup_hits_hot,
            d.dedup_hits_table,
        ),
    )
}

/// The served rows of client I/O: amplification, the read cache, elastic compression.
fn io_rows(s: &VolumeStats) -> Vec<(&'static str, String)> {
    let b = human_bytes;
    let (d, e) = (&s.dedup, &s.elastic);
    vec![
        (
            "write amplification",
            format!(
                "{:.2} ({} written by clients, {} to media{})",
                s.write_amplification,
                b(s.client_bytes_written),
                b(s.media_bytes_written),
                match s.zero_ahead_bytes {
                    0 => String::new(),
                    z => format!(", {} of it zeros ahead of the log head", b(z)),
                }
            ),
        ),
        (
            "read amplification",
            format!(
                "{:.2} (bytes decompressed / bytes read)",
                e.read_amplification
            ),
        ),
        (
            "read cache",
            format!(
                "{:.1}% hits ({} of {})",
                100.0 * d.read_cache_hit_rate,
                d.read_cache_hits,
                count(d.read_cache_hits + d.read_cache_misses, "lookup", "lookups")
            ),
        ),
        (
            "elastic",
            format!(
                "units up to {} ({} written), load {} ({} IOPS{}), probe wrote {} raw, \
             {} deferred",
                count(u64::from(e.unit_blocks), "block", "blocks"),
                e.units_written,
                e.load_level,
                e.load_iops,
                e.load_cpu_percent
                    .map(|p| format!(", machine CPU {p}%"))
                    .unwrap_or_default(),
                count(e.probe_raw_blocks, "block", "blocks"),
                count(e.deferred_blocks, "block", "blocks")
            ),
        ),
    ]
}

/// The served rows of background work: recompression, the cleaner,
/// space pressure, the map cache, checkpoints, damage and scrubs.
fn background_rows(s: &VolumeStats) -> Vec<(&'static str, String)> {
    let b = human_bytes;
    let (e, c) = (&s.elastic, &s.cleaner);
    vec![
        (
            "recompressed",
            format!(
                "{} in {}: {} -> {}",
                count(e.recompressed_blocks, "block", "blocks"),
                count(e.recompress_passes, "pass", "passes"),
                b(e.recompressed_bytes_before),
                b(e.recompressed_bytes_after)
            ),
        ),
        (
            "cleaner",
            format!(
                "{}: {} cleaned, {} relocated, {} reclaimed, {} compacted (saved {})",
                c.cleaner_policy,
                count(c.cleaner_segments_cleaned, "segment", "segments"),
                b(c.cleaner_bytes_relocated),
                count(c.segments_reclaimed, "segment", "segments"),
                count(c.cleaner_units_compacted, "unit", "units"),
                b(c.cleaner_compaction_saved_bytes)
            ),
        ),
        ("space pressure", space_pressure(s)),
        (
            "map cache",
            format!(
                "{} of pages in memory, {:.1}% hits ({} read back), {} dirty",
                b(s.map_cache_bytes),
                100.0 * s.map_cache_hits as f64
                    / (s.map_cache_hits + s.map_cache_misses).max(1) as f64,
                count(s.map_cache_misses, "page", "pages"),
                count(s.map_dirty_pages, "page", "pages")
            ),
        ),
        (
            "checkpoints",
            format!(
                "{} written, the last {} in {:.2} s (generation {})",
                s.checkpoints_written,
                b(s.checkpoint_last_bytes),
                s.checkpoint_last_seconds,
                s.checkpoint_generation
            ),
        ),
        ("memory", memory_line(s)),
        ("corrupt reads", s.corrupt_reads.to_string()),
        ("scrub", scrub_line(&s.scrub)),
    ]
}

/// The `memory` line: `memory_bytes` by use, the allocator's free memory
/// and the process's RSS.
fn memory_line(s: &VolumeStats) -> String {
    let (m, b) = (&s.memory.memory_bytes, human_bytes);
    format!(
        "{} (map {}, dedup index {}, shared table {}, fingerprint rows {}, read cache {}, \
         unit cache {}, segment buffers {}, NBD buffers {}, other {}); allocator free {}; RSS {}",
        b(m.total),
        b(m.map),
        b(m.dedup_index),
        b(m.dedup_shared),
        b(m.fingerprint_rows),
        b(m.read_cache),
        b(m.unit_cache),
        b(m.segment_buffers),
        b(m.nbd_buffers),
        b(m.other),
        b(s.memory.allocator_free_bytes),
        b(s.memory.rss_bytes)
    )
}

fn scrub_line(s: &ScrubStats) -> String {
    let mut parts = Vec::new();
    if s.scrub_in_progress {
        parts.push(format!(
            "running, {} of {} blocks verified",
            s.scrub_progress_blocks, s.scrub_total_blocks
        ));
    }
    let runs = s.scrub_runs;
    if runs == 0 {
        if parts.is_empty() {
            parts.push("none since the server started (`cvol scrub`)".to_string());
        }
    } else {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        parts.push(format!(
            "{} finished, the last {} ago; {} verified, {} found corrupt",
            count(runs, "run", "runs"),
            ago(now.saturating_sub(s.scrub_last_finished_unix)),
            count(s.scrub_blocks_checked, "block", "blocks"),
            count(s.scrub_corrupt_blocks, "block", "blocks")
        ));
    }
    parts.join("; ")
}

fn ago(secs: u64) -> String {
    match secs {
        0..=119 => format!("{secs} s"),
        120..=7199 => format!("{} min", secs / 60),
        7200..=172_799 => format!("{} h", secs / 3600),
        _ => format!("{} days", secs / 86400),
    }
}

/// What the host holds for the volume: `physical_used_bytes`, and the
/// backing file's own `du` when the store can tell.
/// The rows of a cache volume: its origin and mode, and (served) how it
/// serves.
fn cache_rows(
    s: &VolumeStats,
    c: &cvol_engine::stats::CacheInfo,
    served: bool,
) -> Vec<(&'static str, String)> {
    let b = human_bytes;
    let mut rows = vec![(
        "cache of",
        format!(
            "{} ({}, {} lines{})",
            c.origin,
            c.mode,
            b(c.line_size_bytes),
            match served {
                true => format!(", started {}", c.start),
                false => String::new(),
            }
        ),
    )];
    if served {
        let k = &s.cache;
        rows.push((
            "  hits",
            format!(
                "{:.1}% ({} hits, {} misses of 4 KiB)",
                k.cache_hit_ratio * 100.0,
                k.cache_hits,
                k.cache_misses
            ),
        ));
        rows.push((
            "  origin",
            format!(
                "{} read, {} written; filled {}, {} lines evicted, {} dirty",
                b(k.origin_bytes_read),
                b(k.origin_bytes_written),
                b(k.cache_fill_bytes),
                k.cache_evictions,
                b(k.cache_dirty_bytes)
            ),
        ));
    }
    rows
}

/// The rows of a volume in an object store: what the store holds, and
/// (served) the requests and the local cache.
fn object_rows(s: &VolumeStats, served: bool) -> Vec<(&'static str, String)> {
    let b = human_bytes;
    let o = &s.object;
    let mut rows = vec![(
        "object store",
        format!("{} objects, {}", o.object_count, b(o.object_bytes)),
    )];
    if served {
        rows.push((
            "  requests",
            format!(
                "{} PUTs ({}), {} GETs ({}), {} deletes; epoch {}, delta {}",
                o.object_puts,
                b(o.object_put_bytes),
                o.object_gets,
                b(o.object_get_bytes),
                o.object_deletes,
                o.object_epoch,
                o.object_seq
            ),
        ));
        rows.push((
            "  local cache",
            format!(
                "{} of {}; {:.1}% of reads without a GET ({} hits, {} misses), {} chunks evicted",
                b(o.object_cache_bytes),
                b(o.object_cache_limit_bytes),
                o.object_cache_hit_ratio * 100.0,
                o.object_cache_hits,
                o.object_cache_misses,
                o.object_cache_evictions
            ),
        ));
    }
    rows
}

fn host_holds(s: &VolumeStats) -> String {
    let used = human_bytes(s.physical_used_bytes);
    if s.object.object_store.is_some() {
        return format!(
            "{used} (in the object store: {})",
            human_bytes(s.object.object_bytes)
        );
    }
    match s.host_allocated_bytes {
        Some(du) => {
            let what = match s.metadata_device {
                None => "du of the backing file",
                Some(_) => "du of the volume file and its metadata device",
            };
            format!("{used} ({what}: {})", human_bytes(du))
        }
        None => used,
    }
}

/// Dead space, and what idle cleaning will return of it (offline: what a
/// server with the default flags would).
fn dead_words(s: &VolumeStats, served: bool) -> String {
    let dead = human_bytes(s.dead_bytes);
    match (s.cleaner.idle_clean || !served, s.reclaimable_bytes) {
        (_, 0) => format!("{dead} (nothing idle cleaning would collect)"),
        (false, r) => format!(
            "{dead} ({} idle cleaning would collect; it is off)",
            human_bytes(r)
        ),
        (true, _) => format!(
            "{dead} ({} returned to the host when clients are idle)",
            human_bytes(s.reclaimable_bytes)
        ),
    }
}

/// The metadata device line: where, and how much of it is in use.
fn metadata_device(s: &cvol_engine::VolumeStats) -> String {
    match &s.metadata_device {
        None => "none (map and checkpoints in the volume itself)".into(),
        Some(p) => format!(
            "{p}: {} used of {}, {} free",
            human_bytes(s.metadata_used_bytes),
            human_bytes(s.metadata_size_bytes),
            human_bytes(s.metadata_free_bytes)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_names_the_flag_and_caps_at_the_logical_room() {
        let mut s = VolumeStats {
            logical_size_bytes: 4 << 30,
            mapped_bytes: 1 << 30,
            estimated_free_logical_bytes: 11 << 30,
            worst_case_free_logical_bytes: 2 << 30,
            ..VolumeStats::default()
        };
        s.cleaner.cleaner_policy = "CostBenefit".into();
        normalize(&mut s);
        normalize(&mut s);
        assert_eq!(s.cleaner.cleaner_policy, "cost-benefit");
        assert_eq!(s.estimated_free_logical_bytes, 3 << 30);
        assert_eq!(s.worst_case_free_logical_bytes, 2 << 30);
    }

    fn report(served: bool, stats: VolumeStats) -> Report {
        Report {
            volume: "v.cvol".into(),
            served,
            stats,
            volumes: None,
        }
    }

    #[test]
    fn offline_tables_leave_out_server_counters() {
        let mut s = VolumeStats::default();
        s.dedup.dedup = true;
        s.elastic.recompress_passes = 1;
        let offline: Vec<_> = report(false, s.clone())
            .table()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert!(!offline.contains(&"write amplification") && !offline.contains(&"recompressed"));
        let served = report(true, s).table();
        let rec = served.iter().find(|(k, _)| *k == "recompressed").unwrap();
        assert!(rec.1.contains("1 pass:"), "{}", rec.1);
        assert!(served.iter().any(|(k, _)| *k == "scrub"));
        assert!(!served.iter().any(|(k, _)| *k == "lost to damage"));
        let lost = VolumeStats {
            lost_bytes: 8192,
            ..VolumeStats::default()
        };
        let rows = report(false, lost).table();
        let zero = rows.iter().position(|(k, _)| *k == "zero").unwrap();
        assert_eq!(rows[zero + 1].0, "lost to damage");
    }

    /// What a server sends reads back into the same statistics, and
    /// `--json` shows them the same whether served or not.
    #[test]
    fn the_reply_reads_back() {
        let mut s = VolumeStats {
            logical_size_bytes: 1 << 30,
            mapped_bytes: 12345 << 12,
            reduction_ratio: 1.0 / 3.0,
            codec: "auto".into(),
            ..VolumeStats::default()
        };
        s.cleaner.cleaner_policy = "Greedy".into();
        s.elastic.unit_blocks = 4;
        s.scrub.scrub_runs = 2;
        normalize(&mut s);
        let wire = serde_json::to_value(&s).unwrap().to_string();
        let back: VolumeStats = serde_json::from_str(&wire).unwrap();
        let (here, there) = (report(false, s), report(false, back));
        assert_eq!(here.json().unwrap(), there.json().unwrap());
        assert_eq!(here.table(), there.table());
        assert_eq!(here.json().unwrap()["cleaner_policy"], "greedy");
        let missing = wire.replace("\"lost_bytes\"", "\"lost\"");
        assert!(serde_json::from_str::<VolumeStats>(&missing)
            .unwrap_err()
            .to_string()
            .contains("lost_bytes"));
    }
}
