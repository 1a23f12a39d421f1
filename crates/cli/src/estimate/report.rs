//! From the counts of a read to the estimate: scaled to the whole source,
//! printed as text or as one JSON object (keys in docs/CLI.md).
use super::tally::{Counts, Stored, BS};
use crate::words::human_bytes;
use cvol_engine::codec::Codec;

/// Bytes of a record's header in the log (docs/FORMAT.md).
const RECORD_HEADER_BYTES: f64 = 44.0;
/// Metadata per mapped block: its map entry.
const MAP_BYTES_PER_BLOCK: f64 = 12.0;
/// Metadata per stored (distinct) block: its fingerprint-table row.
const FP_TABLE_BYTES_PER_BLOCK: f64 = 18.0;
/// Dead space idle cleaning leaves in the log, per live byte: it stops
/// once dead space is at most 5% of live data.
const DEAD_PER_LIVE: f64 = 0.05;

/// How the source was read.
pub struct Reading {
    pub source: String,
    pub source_bytes: u64,
    pub read_bytes: u64,
    pub regions: usize,
    pub fp_modulus: u64,
    pub compress_modulus: u64,
    pub codec: Codec,
    pub unit_blocks: usize,
    pub seconds: f64,
}

/// One codec's column.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Column {
    pub compression_ratio: f64,
    pub stored_bytes: u64,
    pub du_bytes: u64,
}

/// The estimate for the whole source.
#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    pub logical_bytes: u64,
    pub zero_bytes: u64,
    pub distinct_bytes: u64,
    pub dedup_ratio: f64,
    pub metadata_bytes: u64,
    pub main: Column,
    pub lz4: Column,
    /// Only part of the source was read: duplicates between a region read
    /// and one not read are not seen, so `dedup_ratio` is a lower bound.
    pub partial: bool,
}

/// Scales the counts of `blocks_read` blocks to a source of
/// `logical_blocks` blocks.
pub fn estimate(c: &Counts, logical_blocks: u64) -> Estimate {
    let read = c.blocks.max(1) as f64;
    let scale = logical_blocks as f64 / read;
    let zero = (c.zero_blocks as f64 * scale).round();
    let nonzero = logical_blocks as f64 - zero;
    let dedup_ratio = match c.kept_distinct {
        0 => 1.0,
        d => c.kept_blocks as f64 / d as f64,
    };
    let distinct = nonzero / dedup_ratio;
    let metadata = nonzero * MAP_BYTES_PER_BLOCK + distinct * FP_TABLE_BYTES_PER_BLOCK;
    let sampled = c.compressed_blocks as f64;
    let column = |s: &Stored| {
        let (ratio, records_per_block) = match c.compressed_blocks {
            0 => (1.0, 1.0),
            _ => (sampled * BS as f64 / s.payload, s.records / sampled),
        };
        let stored = distinct * BS as f64 / ratio;
        let live = stored + distinct * records_per_block * RECORD_HEADER_BYTES;
        Column {
            compression_ratio: ratio,
            stored_bytes: stored.round() as u64,
            du_bytes: (live * (1.0 + DEAD_PER_LIVE) + metadata).round() as u64,
        }
    };
    Estimate {
        logical_bytes: logical_blocks * BS as u64,
        zero_bytes: zero as u64 * BS as u64,
        distinct_bytes: (distinct * BS as f64).round() as u64,
        dedup_ratio,
        metadata_bytes: metadata.round() as u64,
        main: column(&c.main),
        lz4: column(&c.lz4),
        partial: c.blocks < logical_blocks,
    }
}

/// Logical bytes per byte the host would hold (`None`: nothing stored).
fn reduction(e: &Estimate, col: &Column) -> Option<f64> {
    (col.du_bytes > 0).then(|| e.logical_bytes as f64 / col.du_bytes as f64)
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The JSON object `--json` prints.
pub fn json(r: &Reading, c: &Counts, e: &Estimate) -> serde_json::Value {
    let red = |col: &Column| reduction(e, col).map(round3);
    serde_json::json!({
        "source": r.source,
        "source_bytes": r.source_bytes,
        "logical_bytes": e.logical_bytes,
        "sampled_bytes": r.read_bytes,
        "sampled_fraction": round3(r.read_bytes as f64 / r.source_bytes as f64),
        "sampled_regions": r.regions,
        "whole_source_read": !e.partial,
        "zero_bytes": e.zero_bytes,
        "nonzero_bytes": e.logical_bytes - e.zero_bytes,
        "distinct_bytes_estimate": e.distinct_bytes,
        "dedup_ratio": round3(e.dedup_ratio),
        "dedup_ratio_is_lower_bound": e.partial,
        "fingerprint_sample_rate": 1.0 / r.fp_modulus as f64,
        "fingerprints_kept": c.kept_distinct,
        "codec": r.codec.to_string(),
        "unit_bytes": r.unit_blocks * BS,
        "compressed_sample_blocks": c.compressed_blocks,
        "compression_sample_rate": 1.0 / r.compress_modulus as f64,
        "compression_ratio": round3(e.main.compression_ratio),
        "stored_bytes_estimate": e.main.stored_bytes,
        "metadata_bytes_estimate": e.metadata_bytes,
        "du_bytes_estimate": e.main.du_bytes,
        "reduction_ratio": red(&e.main),
        "compression_ratio_lz4": round3(e.lz4.compression_ratio),
        "stored_bytes_estimate_lz4": e.lz4.stored_bytes,
        "du_bytes_estimate_lz4": e.lz4.du_bytes,
        "reduction_ratio_lz4": red(&e.lz4),
        "seconds": round3(r.seconds),
    })
}

/// The human-readable report.
pub fn text(r: &Reading, c: &Counts, e: &Estimate) -> String {
    let pct = |n: u64| 100.0 * n as f64 / e.logical_bytes.max(1) as f64;
    let red = |col: &Column| reduction(e, col).map_or("-".into(), |x| format!("{x:.2}x"));
    let mut s = format!(
        "{}: {} read of {} ({:.1}%{}) in {:.1}s\n",
        r.source,
        human_bytes(r.read_bytes),
        human_bytes(r.source_bytes),
        100.0 * r.read_bytes as f64 / r.source_bytes as f64,
        match r.regions {
            1 => String::new(),
            n => format!(", {n} regions of 1 MiB spread over it"),
        },
        r.seconds,
    );
    s += &format!("  logical           {}\n", human_bytes(e.logical_bytes));
    s += &format!(
        "  zero blocks       {} ({:.1}%, stored as nothing)\n",
        human_bytes(e.zero_bytes),
        pct(e.zero_bytes)
    );
    s += &format!(
        "  distinct data     {} (dedup {:.2}x{}{})\n",
        human_bytes(e.distinct_bytes),
        e.dedup_ratio,
        if r.fp_modulus > 1 {
            format!(", from 1 in {} fingerprints", r.fp_modulus)
        } else {
            String::new()
        },
        if e.partial {
            "; a lower bound: duplicates outside the regions read are not seen"
        } else {
            ""
        }
    );
    s += &format!(
        "  {:<8} compression {:.2}x: stored {}, du {} (reduction {})\n",
        r.codec.to_string(),
        e.main.compression_ratio,
        human_bytes(e.main.stored_bytes),
        human_bytes(e.main.du_bytes),
        red(&e.main)
    );
    s += &format!(
        "  {:<8} compression {:.2}x: stored {}, du {} (reduction {})\n",
        "lz4",
        e.lz4.compression_ratio,
        human_bytes(e.lz4.stored_bytes),
        human_bytes(e.lz4.du_bytes),
        red(&e.lz4)
    );
    s += &format!(
        "  (estimates: compression from {} distinct blocks in {} units; du adds \
         record headers, 5% dead space and {} of metadata)\n",
        c.compressed_blocks,
        human_bytes((r.unit_blocks * BS) as u64),
        human_bytes(e.metadata_bytes)
    );
    s
}
