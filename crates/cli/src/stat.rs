//! `cvol stat`: the statistics of a volume, from its server or offline.
use crate::words::{count, human_bytes};
use crate::{control, volfile};
use cvol_engine::Volume;
use serde_json::Value;
use std::path::Path;
use std::process::ExitCode;

/// The statistics as `stat --json` shows them (the server answers its
/// control socket with the same).
pub fn stats_value(vol: &Volume) -> Value {
    let mut v = serde_json::to_value(vol.stats()).unwrap_or_else(
        |e| serde_json::json!({ "error": format!("cannot encode the statistics: {e}") }),
    );
    normalize(&mut v);
    v
}

/// Words and bounds the engine leaves raw: the cleaner policy as its flag
/// spells it, and no more "data that fits" than the volume has room for.
/// Idempotent (also applied to what an older server sends).
fn normalize(v: &mut Value) {
    if let Some(p) = v["cleaner_policy"].as_str() {
        let flag = match p {
            "CostBenefit" => "cost-benefit",
            "Greedy" => "greedy",
            other => other,
        };
        v["cleaner_policy"] = Value::String(flag.to_string());
    }
    let logical_free = v["logical_size_bytes"]
        .as_u64()
        .unwrap_or(0)
        .saturating_sub(v["mapped_bytes"].as_u64().unwrap_or(0));
    for k in [
        "estimated_free_logical_bytes",
        "worst_case_free_logical_bytes",
    ] {
        if let Some(n) = v[k].as_u64() {
            v[k] = Value::from(n.min(logical_free));
        }
    }
}

pub fn cmd_stat(path: &Path, json: bool) -> Result<ExitCode, String> {
    let (mut value, served) = match control::query_stat(path) {
        Some(v) => (v, true),
        None => {
            let vol = volfile::open_read_only(path, cvol_engine::volume::READ_CACHE_DEFAULT_BYTES)?;
            (stats_value(&vol), false)
        }
    };
    normalize(&mut value);
    value["served"] = Value::Bool(served);
    value["volume"] = Value::String(path.display().to_string());
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&value).map_err(|e| e.to_string())?
        );
    } else {
        for (k, val) in table(&value, served) {
            println!("{k:<24}{val}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn table(v: &Value, served: bool) -> Vec<(&'static str, String)> {
    let b = |k: &str| human_bytes(v[k].as_u64().unwrap_or(0));
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
    let s = |k: &str| v[k].as_str().unwrap_or("").to_string();
    let mut rows = vec![
        ("volume", s("volume")),
        (
            "served",
            if served {
                "yes (counters since the server started)".to_string()
            } else {
                "no (activity counters are shown while it is served)".to_string()
            },
        ),
        (
            "codec",
            if s("codec") == "auto" {
                format!("auto (strong codec {})", s("codec_strong"))
            } else {
                s("codec")
            },
        ),
        ("logical size", b("logical_size_bytes")),
        ("physical size", b("physical_size_bytes")),
        ("mapped (non-zero data)", b("mapped_bytes")),
        ("zero", b("zero_bytes")),
        ("stored payload", b("stored_bytes")),
        ("physical used", b("physical_used_bytes")),
        ("  live records", b("live_bytes")),
        ("  dead (reclaimable)", b("dead_bytes")),
        ("physical free", b("physical_free_bytes")),
        (
            "more data that fits",
            format!(
                "{} at the current ratio, {} worst case",
                b("estimated_free_logical_bytes"),
                b("worst_case_free_logical_bytes")
            ),
        ),
        ("reduction ratio", format!("{:.2}x", f("reduction_ratio"))),
        (
            "savings",
            format!(
                "zeros {}  dedup {}  compression {}",
                b("zero_saved_bytes"),
                b("dedup_saved_bytes"),
                b("compression_saved_bytes")
            ),
        ),
        (
            "compression ratio",
            format!("{:.2}x", f("compression_ratio")),
        ),
        (
            "blocks by codec",
            format!(
                "lz4 {}  zstd {}  none {}",
                n("codec_lz4_blocks"),
                n("codec_zstd_blocks"),
                n("codec_none_blocks")
            ),
        ),
        (
            "bytes by codec",
            format!(
                "lz4 {}  zstd {}  none {}",
                b("codec_lz4_bytes"),
                b("codec_zstd_bytes"),
                b("codec_none_bytes")
            ),
        ),
        (
            "segments used",
            format!(
                "{} of {} ({} each)",
                n("segments_used"),
                n("segments_total"),
                b("segment_size_bytes")
            ),
        ),
    ];
    if n("lost_bytes") > 0 {
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
                    b("lost_bytes")
                ),
            ),
        );
    }
    let dedup_on = v["dedup"].as_bool().unwrap_or(false);
    if !served {
        rows.push((
            "dedup",
            if dedup_on {
                format!(
                    "on: {}",
                    count(n("dedup_shared_records"), "shared record", "shared records")
                )
            } else {
                "off".to_string()
            },
        ));
        return rows;
    }
    rows.extend([
        (
            "dedup",
            if dedup_on {
                format!(
                    "on: {} of {} found stored, {}, index {} of {} ({})",
                    n("dedup_hits"),
                    count(n("dedup_lookups"), "block", "blocks"),
                    count(n("dedup_shared_records"), "shared record", "shared records"),
                    n("dedup_index_entries"),
                    n("dedup_index_capacity"),
                    b("dedup_index_memory_bytes")
                )
            } else {
                "off".to_string()
            },
        ),
        (
            "write amplification",
            format!(
                "{:.2} ({} written by clients, {} to media)",
                f("write_amplification"),
                b("client_bytes_written"),
                b("media_bytes_written")
            ),
        ),
        (
            "read amplification",
            format!(
                "{:.2} (bytes decompressed / bytes read)",
                f("read_amplification")
            ),
        ),
        (
            "read cache",
            format!(
                "{:.1}% hits ({} of {})",
                100.0 * f("read_cache_hit_rate"),
                n("read_cache_hits"),
                count(
                    n("read_cache_hits") + n("read_cache_misses"),
                    "lookup",
                    "lookups"
                )
            ),
        ),
        (
            "elastic",
            format!(
                "units up to {} ({} written), load {} ({} IOPS), probe wrote {} raw",
                count(n("unit_blocks"), "block", "blocks"),
                n("units_written"),
                s("load_level"),
                n("load_iops"),
                count(n("probe_raw_blocks"), "block", "blocks")
            ),
        ),
        (
            "recompressed",
            format!(
                "{} in {}: {} -> {}",
                count(n("recompressed_blocks"), "block", "blocks"),
                count(n("recompress_passes"), "pass", "passes"),
                b("recompressed_bytes_before"),
                b("recompressed_bytes_after")
            ),
        ),
        (
            "cleaner",
            format!(
                "{}: {} cleaned, {} relocated, {} reclaimed",
                s("cleaner_policy"),
                count(n("cleaner_segments_cleaned"), "segment", "segments"),
                b("cleaner_bytes_relocated"),
                count(n("segments_reclaimed"), "segment", "segments")
            ),
        ),
        ("corrupt reads", n("corrupt_reads").to_string()),
        ("scrub", scrub_line(v)),
    ]);
    rows
}

fn scrub_line(v: &Value) -> String {
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    let mut parts = Vec::new();
    if v["scrub_in_progress"].as_bool().unwrap_or(false) {
        parts.push(format!(
            "running, {} of {} blocks verified",
            n("scrub_progress_blocks"),
            n("scrub_total_blocks")
        ));
    }
    let runs = n("scrub_runs");
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
            ago(now.saturating_sub(n("scrub_last_finished_unix"))),
            count(n("scrub_blocks_checked"), "block", "blocks"),
            count(n("scrub_corrupt_blocks"), "block", "blocks")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_names_the_flag_and_caps_at_the_logical_room() {
        let mut v = serde_json::json!({
            "cleaner_policy": "CostBenefit",
            "logical_size_bytes": 4u64 << 30,
            "mapped_bytes": 1u64 << 30,
            "estimated_free_logical_bytes": 11u64 << 30,
            "worst_case_free_logical_bytes": 2u64 << 30,
        });
        normalize(&mut v);
        normalize(&mut v);
        assert_eq!(v["cleaner_policy"], "cost-benefit");
        assert_eq!(v["estimated_free_logical_bytes"], 3u64 << 30);
        assert_eq!(v["worst_case_free_logical_bytes"], 2u64 << 30);
    }

    #[test]
    fn offline_tables_leave_out_server_counters() {
        let v = serde_json::json!({ "dedup": true, "recompress_passes": 1 });
        let offline: Vec<_> = table(&v, false).into_iter().map(|(k, _)| k).collect();
        assert!(!offline.contains(&"write amplification") && !offline.contains(&"recompressed"));
        let served = table(&v, true);
        let rec = served.iter().find(|(k, _)| *k == "recompressed").unwrap();
        assert!(rec.1.contains("1 pass:"), "{}", rec.1);
        assert!(served.iter().any(|(k, _)| *k == "scrub"));
        assert!(!served.iter().any(|(k, _)| *k == "lost to damage"));
        let lost = serde_json::json!({ "lost_bytes": 8192 });
        let rows = table(&lost, false);
        let zero = rows.iter().position(|(k, _)| *k == "zero").unwrap();
        assert_eq!(rows[zero + 1].0, "lost to damage");
    }
}
