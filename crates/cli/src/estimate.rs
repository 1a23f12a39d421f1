//! `cvol estimate SOURCE`: what a cvol volume would store for the data in
//! SOURCE (a file, a block device or an NBD export), without writing
//! anything anywhere (VDO's vdoestimator, `zdb -S`).
//!
//! What is read: the whole source when under 1 GiB, else 1 MiB regions
//! spread uniformly over it (1 GiB or 1% of it, whichever is more;
//! `--sample`, `--sample-bytes` choose). What is kept: see `tally`
//! (fingerprints by hash sampling in bounded memory, a compressed sample
//! of the distinct blocks).
mod report;
mod source;
mod tally;
#[cfg(test)]
mod tests;

use crate::error::Error;
use report::Reading;
use source::Source;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Instant;
use tally::{Config, Tally, BS};

/// Bytes read at a time, and the size of a sampled region.
const REGION_BYTES: u64 = 1 << 20;
/// Read all of a source below this size by default.
const WHOLE_READ_MAX: u64 = 1 << 30;
/// Fingerprints remembered at most (about 40 MiB of RAM): the hash-sample
/// rate is the largest power of two keeping the expected count below it.
const FINGERPRINTS_MAX: u64 = 1 << 22;
/// Unit bytes compressed (per codec) at most, expected: the compression
/// sample rate is chosen from it (about 16,000 samples of 4 KiB units).
const COMPRESS_BUDGET_BYTES: u64 = 64 << 20;

/// `cvol estimate`'s command line.
#[derive(clap::Args)]
pub struct EstimateFlags {
    /// The data: a file, a block device (opened read-only) or an NBD URI
    /// (nbd://HOST[:PORT]/EXPORT, nbd+unix:///EXPORT?socket=PATH).
    pub source: String,
    /// Print the estimate as one JSON object (keys listed in docs/CLI.md).
    #[arg(long)]
    pub json: bool,
    /// Percent of the source to read (0.01 to 100), in 1 MiB regions spread
    /// uniformly. Default: all of a source under 1 GiB, else 1 GiB or 1%,
    /// whichever is more.
    #[arg(long, value_name = "PERCENT", conflicts_with = "sample_bytes")]
    pub sample: Option<f64>,
    /// Bytes of the source to read (e.g. 4G), in 1 MiB regions spread
    /// uniformly.
    #[arg(long, value_name = "SIZE")]
    pub sample_bytes: Option<String>,
    /// The codec policy the estimate is for, as `create --codec`: auto
    /// (the default) is estimated with its strong codec (zstd:9: what
    /// background recompression leaves once the data has settled), a fixed
    /// codec with itself. lz4 is always shown next to it.
    #[arg(long, default_value = "auto")]
    pub codec: String,
    /// Compression unit, as `serve --unit-size` (4K to 64K).
    #[arg(long, default_value = "16K")]
    pub unit_size: String,
}

/// Where to read: (offset, length) of each region, in order.
pub fn plan(source_bytes: u64, want: u64) -> Vec<(u64, u64)> {
    if want >= source_bytes {
        let n = source_bytes.div_ceil(REGION_BYTES);
        return (0..n)
            .map(|i| {
                (
                    i * REGION_BYTES,
                    REGION_BYTES.min(source_bytes - i * REGION_BYTES),
                )
            })
            .collect();
    }
    let k = want.div_ceil(REGION_BYTES).max(1);
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(k as usize);
    for i in 0..k {
        let at = (u128::from(i) * u128::from(source_bytes) / u128::from(k)) as u64;
        let mut at = at / REGION_BYTES * REGION_BYTES;
        if let Some(&(prev, len)) = out.last() {
            at = at.max(prev + len);
        }
        if at >= source_bytes {
            break;
        }
        out.push((at, REGION_BYTES.min(source_bytes - at)));
    }
    out
}

/// Bytes to read of a source of `source_bytes`.
fn wanted(flags: &EstimateFlags, source_bytes: u64) -> Result<u64, Error> {
    if let Some(p) = flags.sample {
        if !(0.01..=100.0).contains(&p) {
            return Err(Error::Usage(format!(
                "--sample {p}: give a percentage from 0.01 to 100"
            )));
        }
        return Ok(((source_bytes as f64 * p / 100.0).ceil() as u64).max(BS as u64));
    }
    if let Some(s) = &flags.sample_bytes {
        let n =
            crate::size::parse_size(s).map_err(|e| Error::Usage(format!("--sample-bytes: {e}")))?;
        if n == 0 {
            return Err(Error::Usage(format!(
                "--sample-bytes {s}: give at least 4K"
            )));
        }
        return Ok(n);
    }
    Ok(match source_bytes {
        n if n < WHOLE_READ_MAX => n,
        n => WHOLE_READ_MAX.max(n / 100),
    })
}

/// The sampling rates for reading `read_bytes`: (fingerprint modulus,
/// compression modulus), powers of two.
pub fn rates(read_bytes: u64, unit_blocks: usize) -> (u64, u64) {
    let blocks = read_bytes.div_ceil(BS as u64);
    let fp = blocks.div_ceil(FINGERPRINTS_MAX).next_power_of_two();
    let unit = (unit_blocks * BS) as u64;
    let compress = (read_bytes / fp).saturating_mul(unit / BS as u64) / COMPRESS_BUDGET_BYTES;
    (fp, fp * compress.max(1).next_power_of_two())
}

/// `cvol estimate`.
pub fn cmd_estimate(flags: &EstimateFlags) -> Result<ExitCode, Error> {
    let policy = crate::words::parse_codec(&flags.codec)?;
    let codec = policy.codec();
    let unit_blocks = crate::trace::parse_unit_size(&flags.unit_size)? as usize;
    let src = Source::open(&flags.source)?;
    let source_bytes = src.len();
    let regions = plan(source_bytes, wanted(flags, source_bytes)?);
    let read_bytes: u64 = regions.iter().map(|r| r.1).sum();
    let (fp_modulus, compress_modulus) = rates(read_bytes, unit_blocks);
    let mut tally = Tally::new(Config {
        codec,
        unit_blocks,
        fp_modulus,
        compress_modulus,
        shared_keep_lz4: policy.is_auto(),
    });
    let t0 = Instant::now();
    read_all(&src, &flags.source, &regions, &mut tally)?;
    let reading = Reading {
        source: flags.source.clone(),
        source_bytes,
        read_bytes,
        regions: if read_bytes == source_bytes {
            1
        } else {
            regions.len()
        },
        fp_modulus,
        compress_modulus,
        codec,
        unit_blocks,
        seconds: t0.elapsed().as_secs_f64(),
    };
    let counts = tally.counts();
    let est = report::estimate(&counts, source_bytes.div_ceil(BS as u64));
    if flags.json {
        println!("{}", report::json(&reading, &counts, &est));
    } else {
        print!("{}", report::text(&reading, &counts, &est));
    }
    Ok(ExitCode::SUCCESS)
}

/// Reads the regions (a reader thread ahead of the hashing) into `tally`,
/// with a progress bar on a terminal.
fn read_all(
    src: &Source,
    name: &str,
    regions: &[(u64, u64)],
    tally: &mut Tally,
) -> Result<(), Error> {
    let total: u64 = regions.iter().map(|r| r.1).sum();
    let pb = progress_bar(total);
    let (tx, rx) = crossbeam_channel::bounded::<(u64, Vec<u8>)>(4);
    std::thread::scope(|s| {
        let reader = s.spawn(move || -> Result<(), Error> {
            for &(at, len) in regions {
                let mut buf = vec![0u8; len as usize];
                src.read_at(at, &mut buf)
                    .map_err(|e| Error::io(format!("{name}: reading at byte {at}"), e))?;
                if tx.send((at, buf)).is_err() {
                    break;
                }
            }
            Ok(())
        });
        for (at, buf) in rx {
            tally.feed(at / BS as u64, &buf);
            if let Some(pb) = &pb {
                pb.inc(buf.len() as u64);
            }
        }
        if let Some(pb) = &pb {
            pb.finish_and_clear();
        }
        reader
            .join()
            .unwrap_or_else(|_| Err(Error::Refused(format!("{name}: the reader failed"))))
    })
}

fn progress_bar(total: u64) -> Option<indicatif::ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let pb = indicatif::ProgressBar::new(total);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "estimating [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
    ) {
        pb.set_style(style);
    }
    Some(pb)
}
