//! `cvol check [--repair]`: exit 0 only for a volume that is consistent
//! and opens, 1 with the problems found, 2 when it cannot run (not a
//! volume, served, unreadable path).
use crate::error::Error;
use crate::volfile::{self, Globals, Header, Purpose};
use cvol_engine::check::CheckReport;
use cvol_engine::{OpenOptions, Volume};
use std::io::IsTerminal;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

/// A problem found before the engine's check runs (a short backing store).
fn early_report(problem: String) -> CheckReport {
    CheckReport {
        errors: vec![problem],
        ..CheckReport::default()
    }
}

fn print_problems(path: &Path, errors: &[String]) {
    println!("{}: {} problem(s) found", path.display(), errors.len());
    for e in errors {
        println!("  - {e}");
    }
}

pub fn cmd_check(path: &Path, json: bool, globals: &Globals) -> Result<ExitCode, Error> {
    if crate::objvol::url_of(path).is_some() {
        return Err(Error::Refused(format!(
            "{}: check and repair work on local media; for a volume in an object store use \
             `cvol scrub` (it verifies every block, served or not)",
            path.display()
        )));
    }
    let (storage, kind) = volfile::open_store(path, Purpose::Check)?;
    crate::keyfile::require(path, &storage)?;
    let rep = match volfile::read_header(path, &storage, kind)? {
        Header::Short(problem) => early_report(problem),
        header @ (Header::Volume | Header::Damaged) => {
            // A volume whose superblocks are damaged is checked as it is:
            // check says what is wrong with them.
            let storage: Arc<dyn cvol_storage::Storage> = match header {
                Header::Damaged => Arc::new(storage),
                _ => volfile::with_metadata(
                    path,
                    storage,
                    Purpose::Check,
                    globals,
                    &mut Default::default(),
                )?,
            };
            let bar = std::io::stderr().is_terminal().then(|| {
                let pb = indicatif::ProgressBar::new(0);
                pb.set_style(
                    indicatif::ProgressStyle::with_template(
                        "{msg} [{bar:40}] {pos}/{len} blocks ({eta})",
                    )
                    .expect("static template")
                    .progress_chars("=> "),
                );
                pb.set_message("verifying");
                pb
            });
            let mut progress = |done: u64, total: u64| {
                if let Some(pb) = &bar {
                    pb.set_length(total);
                    pb.set_position(done);
                }
            };
            let rep = cvol_engine::check::check_volume_with_key(
                &*storage,
                crate::keyfile::current().as_ref(),
                &mut progress,
            );
            if let Some(pb) = bar {
                pb.finish_and_clear();
            }
            rep
        }
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&rep).map_err(|e| Error::Refused(e.to_string()))?
        );
    } else if rep.consistent() {
        println!(
            "{}: consistent ({} data blocks verified, {} records replayed since the last checkpoint, last seq {})",
            path.display(),
            rep.blocks_checked,
            rep.records_replayed,
            rep.last_seq
        );
    } else {
        print_problems(path, &rep.errors);
    }
    Ok(if rep.consistent() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

pub fn cmd_repair(path: &Path, json: bool, globals: &Globals) -> Result<ExitCode, Error> {
    if crate::objvol::url_of(path).is_some() {
        return Err(Error::Refused(format!(
            "{}: check and repair work on local media; for a volume in an object store use \
             `cvol scrub` (it verifies every block, served or not)",
            path.display()
        )));
    }
    let (storage, kind) = volfile::open_store(path, Purpose::Repair)?;
    crate::keyfile::require(path, &storage)?;
    // A short store cannot be repaired from what is in it: say so, write nothing.
    if let Header::Short(problem) = volfile::read_header(path, &storage, kind)? {
        let problem =
            format!("{problem} (nothing was changed: repair cannot restore missing bytes)");
        if json {
            let rep = cvol_engine::check::RepairReport {
                after: early_report(problem),
                ..Default::default()
            };
            println!(
                "{}",
                serde_json::to_string_pretty(&rep).map_err(|e| Error::Refused(e.to_string()))?
            );
        } else {
            print_problems(path, &[problem]);
        }
        return Ok(ExitCode::from(1));
    }
    let storage = volfile::with_metadata(
        path,
        storage,
        Purpose::Repair,
        globals,
        &mut Default::default(),
    )?;
    let mut rep =
        cvol_engine::check::repair_volume_with_key(storage.clone(), crate::keyfile::current());
    // Consistent records are not enough: the volume must also open.
    if rep.after.consistent() {
        let options = OpenOptions {
            read_only: true,
            dedup_memory_bytes: Some(1 << 20),
            read_cache_bytes: Some(0),
            ..crate::keyfile::open_options()
        };
        if let Err(e) = Volume::open(storage, options) {
            rep.after.errors.push(format!(
                "the volume still does not open after the repair: {e}"
            ));
        }
    }
    print_repair(path, &rep, json)?;
    Ok(if rep.after.consistent() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// What `check --repair` did and what it could not save, as text or JSON.
fn print_repair(
    path: &Path,
    rep: &cvol_engine::check::RepairReport,
    json: bool,
) -> Result<(), Error> {
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(rep).map_err(|e| Error::Refused(e.to_string()))?
        );
    } else {
        if rep.actions.is_empty() && rep.after.consistent() {
            println!("{}: nothing needed repair", path.display());
        }
        for a in &rep.actions {
            println!("repair: {a}");
        }
        if rep.after.consistent() {
            println!(
                "{}: consistent after repair ({} data blocks verified)",
                path.display(),
                rep.after.blocks_checked
            );
        } else {
            println!(
                "{}: {} problem(s) could not be repaired",
                path.display(),
                rep.after.errors.len()
            );
            for e in &rep.after.errors {
                println!("  - {e}");
            }
        }
    }
    Ok(())
}
