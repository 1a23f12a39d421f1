//! Replays the committed fuzz corpora (`fuzz/corpus/<target>/`) and the
//! saved crash inputs (`fuzz/regressions/<target>/`) through the same target
//! bodies libFuzzer runs, on stable Rust. A failing file is named in the
//! panic message; reproduce it alone with
//! `CVOL_FUZZ_FILE=path cargo test -p cvol-fuzzlib --test fuzz_corpus -- --nocapture`.
use std::path::{Path, PathBuf};

use cvol_fuzzlib::{recovery, TARGETS};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    v.retain(|p| {
        p.is_file()
            && !p
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'))
    });
    v.sort();
    v
}

/// Runs every file of one target; returns the files that failed.
fn replay(target: &str) -> (usize, Vec<String>) {
    let mut count = 0;
    let mut failed = Vec::new();
    let only = std::env::var_os("CVOL_FUZZ_FILE").map(PathBuf::from);
    for dir in ["fuzz/corpus", "fuzz/regressions"] {
        for file in files(&root().join(dir).join(target)) {
            if only
                .as_ref()
                .is_some_and(|o| !file.ends_with(o) && *o != file)
            {
                continue;
            }
            let data = std::fs::read(&file).expect("read corpus file");
            count += 1;
            let result = std::panic::catch_unwind(|| cvol_fuzzlib::run(target, &data));
            if result.is_err() {
                failed.push(file.display().to_string());
            }
        }
    }
    (count, failed)
}

#[test]
fn fuzz_corpus_replay() {
    let results: Vec<(&str, (usize, Vec<String>))> = std::thread::scope(|s| {
        let handles: Vec<_> = TARGETS
            .iter()
            .map(|(name, _)| (*name, s.spawn(move || replay(name))))
            .collect();
        handles
            .into_iter()
            .map(|(name, h)| (name, h.join().expect("replay thread")))
            .collect()
    });
    let mut failures = Vec::new();
    for (target, (count, failed)) in &results {
        eprintln!("{target}: replayed {count} inputs");
        if std::env::var_os("CVOL_FUZZ_FILE").is_none() {
            assert!(*count > 0, "no seed corpus for fuzz target {target}");
        }
        failures.extend(failed.iter().map(|f| format!("{target}: {f}")));
    }
    assert!(
        failures.is_empty(),
        "fuzz inputs that fail (panic or hang):\n  {}",
        failures.join("\n  ")
    );
}

/// The committed recovery image must still be a sound volume; when the
/// on-disk format changes, regenerate it (and the seeds) with
/// `cargo run -p cvol-fuzzlib --example gen_seeds`.
#[test]
fn committed_recovery_image_is_current() {
    let image = recovery::committed_image().expect("committed image decompresses");
    if let Err(e) = recovery::image_is_sound(&image) {
        panic!(
            "crates/fuzzlib/images/recovery.img.lz4 no longer opens cleanly ({e}); regenerate it \
             with `cargo run -p cvol-fuzzlib --example gen_seeds`"
        );
    }
}

/// The engine still builds the image the generator commits.
#[test]
fn fresh_recovery_image_is_sound() {
    recovery::image_is_sound(&recovery::build_image()).expect("fresh image");
}
