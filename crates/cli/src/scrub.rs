//! `cvol scrub`: verify every block of a volume, rate-limited.
//!
//! Served volume: the server runs the scrub on a thread of its own (control
//! socket requests `scrub RATE`, `scrub-status`, `scrub-cancel`, one JSON
//! line each) and this command polls its progress until the report is
//! there. Volume not served: it is opened read-only and scrubbed here.
use crate::error::Error;
use crate::volfile::Globals;
use crate::{control, size};
use cvol_engine::volume::{ScrubOptions, ScrubProgress, ScrubReport};
use cvol_engine::Volume;
use serde_json::{json, Value};
use std::io::IsTerminal;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

/// How often the command asks a server for progress.
const POLL: Duration = Duration::from_millis(200);

/// `--rate` on a served volume when none is given (offline: no limit, as
/// nothing competes with the scrub).
const SERVED_RATE_DEFAULT: &str = "64M";

pub struct ScrubArgs<'a> {
    pub rate: Option<&'a str>,
    pub json: bool,
    pub no_wait: bool,
    pub status: bool,
}

/// `64M`, `64M/s`, `0` (no limit) to bytes per second.
pub fn parse_rate(rate: &str) -> Result<u64, Error> {
    let t = rate.trim();
    let t = t
        .strip_suffix("/s")
        .or_else(|| t.strip_suffix("/S"))
        .unwrap_or(t);
    let r = size::parse_size(t).map_err(|e| Error::Usage(format!("--rate: {e}")))?;
    if r != 0 && !(RATE_MIN..=RATE_MAX).contains(&r) {
        return Err(Error::Usage(format!(
            "--rate {rate}: give 0 (no limit) or from 1M/s to 1P/s"
        )));
    }
    Ok(r)
}

/// `--rate`'s range (0 aside: no limit).
const RATE_MIN: u64 = 1 << 20;
const RATE_MAX: u64 = 1 << 50;

/// Answers a control socket request about scrubbing, if `line` is one.
pub fn serve_request(vol: &Arc<Volume>, line: &str) -> Option<String> {
    let reply = match line
        .split_once(' ')
        .map_or((line, ""), |(a, b)| (a, b.trim()))
    {
        ("scrub-status", "") => serde_json::to_value(vol.scrub_status()).ok()?,
        ("scrub-cancel", "") => {
            vol.cancel_scrub();
            json!({ "cancelled": true })
        }
        ("scrub", rate) => match rate.parse::<u64>() {
            Err(_) => {
                json!({ "error": format!("scrub takes a rate in bytes per second, not '{rate}'") })
            }
            Ok(bytes_per_sec) => {
                let opts = ScrubOptions {
                    bytes_per_sec,
                    ..ScrubOptions::default()
                };
                match vol.start_scrub(opts) {
                    Ok(run) => json!({ "started": true, "run": run }),
                    Err(busy) => json!({
                        "started": false,
                        "already_running": true,
                        "run": busy.0.run,
                        "progress": busy.0,
                    }),
                }
            }
        },
        _ => return None,
    };
    Some(reply.to_string())
}

pub fn cmd_scrub(path: &Path, args: ScrubArgs, globals: &Globals) -> Result<ExitCode, Error> {
    let rate = args.rate.map(parse_rate).transpose()?;
    if control::query(path, "scrub-status").is_some() {
        let rate = match rate {
            Some(r) => r,
            None => parse_rate(SERVED_RATE_DEFAULT)?,
        };
        return scrub_served(path, rate, &args);
    }
    if args.status || args.no_wait {
        return Err(Error::Usage(format!(
            "{}: not served; --status and --no-wait need a running `cvol serve`",
            path.display()
        )));
    }
    scrub_offline(path, rate.unwrap_or(0), args.json, globals)
}

fn scrub_served(path: &Path, rate: u64, args: &ScrubArgs) -> Result<ExitCode, Error> {
    let gone = || Error::Refused(format!("{}: the server stopped answering", path.display()));
    if args.status {
        let st = control::query(path, "scrub-status").ok_or_else(gone)?;
        println!(
            "{}",
            serde_json::to_string_pretty(&st).map_err(|e| Error::Refused(e.to_string()))?
        );
        return Ok(ExitCode::SUCCESS);
    }
    let started = control::query(path, &format!("scrub {rate}")).ok_or_else(gone)?;
    if let Some(e) = started["error"].as_str() {
        return Err(Error::Refused(format!("{}: {e}", path.display())));
    }
    let run = started["run"].as_u64().unwrap_or(0);
    if started["already_running"].as_bool() == Some(true) {
        let p = &started["progress"];
        eprintln!(
            "{}: a scrub is already running (run {run}, {} of {} blocks){}",
            path.display(),
            p["blocks_checked"],
            p["blocks_total"],
            if args.no_wait { "" } else { "; following it" }
        );
    } else if args.no_wait {
        println!(
            "{}: scrub run {run} started; see `cvol scrub --status` or the scrub_* keys of `cvol stat`",
            path.display()
        );
    }
    if args.no_wait {
        return Ok(ExitCode::SUCCESS);
    }
    let bar = progress_bar();
    let report = loop {
        let st = control::query(path, "scrub-status").ok_or_else(gone)?;
        let last = &st["last_report"];
        if last["run"].as_u64() == Some(run) {
            break last.clone();
        }
        if st["run"].as_u64().unwrap_or(0) > run && !st["running"].as_bool().unwrap_or(false) {
            return Err(Error::Refused(format!(
                "{}: the report of scrub run {run} was replaced by a later run",
                path.display()
            )));
        }
        if let (Some(pb), Some(p)) = (&bar, st.get("progress").filter(|p| !p.is_null())) {
            pb.set_length(p["blocks_total"].as_u64().unwrap_or(0));
            pb.set_position(p["blocks_checked"].as_u64().unwrap_or(0));
        }
        std::thread::sleep(POLL);
    };
    if let Some(pb) = bar {
        pb.finish_and_clear();
    }
    let report: ScrubReportView = ScrubReportView::from_json(&report)
        .ok_or(Error::Refused("malformed scrub report".into()))?;
    finish(path, true, report, args.json)
}

fn scrub_offline(path: &Path, rate: u64, json: bool, globals: &Globals) -> Result<ExitCode, Error> {
    let vol = crate::volfile::open_read_only(path, Some(0), globals)?;
    let bar = progress_bar();
    let progress = |p: &ScrubProgress| {
        if let Some(pb) = &bar {
            pb.set_length(p.blocks_total);
            pb.set_position(p.blocks_checked);
        }
    };
    let opts = ScrubOptions {
        bytes_per_sec: rate,
        yield_to_clients: false,
        ..ScrubOptions::default()
    };
    let rep = vol
        .scrub(&opts, &progress)
        .map_err(|e| Error::Refused(e.to_string()))?;
    if let Some(pb) = bar {
        pb.finish_and_clear();
    }
    let view = ScrubReportView::from_json(
        &serde_json::to_value(&rep).map_err(|e| Error::Refused(e.to_string()))?,
    )
    .ok_or(Error::Refused("malformed scrub report".into()))?;
    finish(path, false, view, json)
}

fn progress_bar() -> Option<indicatif::ProgressBar> {
    std::io::stderr().is_terminal().then(|| {
        let pb = indicatif::ProgressBar::new(0);
        pb.set_style(
            indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} blocks ({eta})")
                .expect("static template")
                .progress_chars("=> "),
        );
        pb.set_message("scrubbing");
        pb
    })
}

/// The report as it came (from the server as JSON, or made here).
struct ScrubReportView {
    json: Value,
    report: ScrubReport,
}

impl ScrubReportView {
    fn from_json(v: &Value) -> Option<ScrubReportView> {
        let n = |k: &str| v[k].as_u64();
        let findings = |k: &str| -> Option<Vec<cvol_engine::volume::ScrubFinding>> {
            v[k].as_array()?
                .iter()
                .map(|f| {
                    Some(cvol_engine::volume::ScrubFinding {
                        lba: f["lba"].as_u64()?,
                        detail: f["detail"].as_str()?.to_string(),
                    })
                })
                .collect()
        };
        let report = ScrubReport {
            run: n("run")?,
            blocks_checked: n("blocks_checked")?,
            bytes_checked: n("bytes_checked")?,
            records_checked: n("records_checked")?,
            stored_bytes_read: n("stored_bytes_read")?,
            corrupt_blocks: n("corrupt_blocks")?,
            corrupt: findings("corrupt")?,
            unreadable_blocks: n("unreadable_blocks")?,
            unreadable: findings("unreadable")?,
            skipped_blocks: n("skipped_blocks")?,
            metadata_errors: v["metadata_errors"]
                .as_array()?
                .iter()
                .map(|s| s.as_str().map(str::to_string))
                .collect::<Option<_>>()?,
            cancelled: v["cancelled"].as_bool()?,
            elapsed_secs: v["elapsed_secs"].as_f64()?,
            finished_unix: n("finished_unix")?,
        };
        Some(ScrubReportView {
            json: v.clone(),
            report,
        })
    }
}

/// Prints the report; exit 0 clean, 1 problems found, 2 cancelled.
fn finish(path: &Path, served: bool, view: ScrubReportView, json: bool) -> Result<ExitCode, Error> {
    let r = &view.report;
    if json {
        let mut v = view.json.clone();
        v["volume"] = Value::String(path.display().to_string());
        v["served"] = Value::Bool(served);
        v["clean"] = Value::Bool(r.clean());
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| Error::Refused(e.to_string()))?
        );
    } else {
        let what = format!(
            "{} data blocks ({}) verified in {:.1}s, {} records read",
            r.blocks_checked,
            crate::words::human_bytes(r.bytes_checked),
            r.elapsed_secs,
            r.records_checked
        );
        if r.clean() {
            println!("{}: clean ({what})", path.display());
        } else {
            println!(
                "{}: {} corrupt block(s), {} unreadable block(s), {} metadata problem(s) ({what})",
                path.display(),
                r.corrupt_blocks,
                r.unreadable_blocks,
                r.metadata_errors.len()
            );
            for f in &r.corrupt {
                println!("  - lba {} corrupt: {}", f.lba, f.detail);
            }
            if r.corrupt_blocks > r.corrupt.len() as u64 {
                println!(
                    "  ... and {} more corrupt blocks",
                    r.corrupt_blocks - r.corrupt.len() as u64
                );
            }
            for f in &r.unreadable {
                println!("  - lba {} unreadable: {}", f.lba, f.detail);
            }
            if r.unreadable_blocks > r.unreadable.len() as u64 {
                println!(
                    "  ... and {} more unreadable blocks",
                    r.unreadable_blocks - r.unreadable.len() as u64
                );
            }
            for e in &r.metadata_errors {
                println!("  - {e}");
            }
        }
        if r.skipped_blocks > 0 {
            println!(
                "  ({} blocks changed under the scrub on every attempt and were not verified)",
                r.skipped_blocks
            );
        }
    }
    if !r.clean() {
        return Ok(ExitCode::from(1));
    }
    if r.cancelled {
        eprintln!(
            "cvol: {}: the scrub was cancelled before the end (server stopping?)",
            path.display()
        );
        return Ok(ExitCode::from(2));
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse() {
        assert_eq!(parse_rate("64M").unwrap(), 64 << 20);
        assert_eq!(parse_rate("64M/s").unwrap(), 64 << 20);
        assert_eq!(parse_rate("0").unwrap(), 0);
        assert!(parse_rate("fast").is_err());
        for absurd in ["1", "512K/s", "99999T", "2P"] {
            let e = parse_rate(absurd).unwrap_err().to_string();
            assert!(e.contains("1M/s to 1P/s"), "{e}");
        }
    }

    #[test]
    fn a_report_survives_the_json_round_trip() {
        let r = ScrubReport {
            run: 3,
            blocks_checked: 10,
            corrupt_blocks: 1,
            corrupt: vec![cvol_engine::volume::ScrubFinding {
                lba: 17,
                detail: "bad crc".into(),
            }],
            metadata_errors: vec!["superblock copy B".into()],
            ..ScrubReport::default()
        };
        let v = ScrubReportView::from_json(&serde_json::to_value(&r).unwrap()).unwrap();
        assert_eq!(v.report.corrupt, r.corrupt);
        assert_eq!(v.report.metadata_errors, r.metadata_errors);
        assert!(!v.report.clean());
    }
}
