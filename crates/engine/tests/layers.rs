//! The engine's rooms keep their order: a module may use only the rooms
//! below it in [`LAYERS`], so an upward import (and with it any import
//! circle) fails this test.
//!
//! The scan is textual: every `crate::room` path (grouped `crate::{a, b}`
//! imports included) in a room's non-test source, comments and string
//! literals skipped. Test code (`tests.rs` files, `test_util`, and inline
//! `#[cfg(test)] mod` blocks) may reach anywhere.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The rooms from the bottom up; `lib.rs` says what each one holds.
const LAYERS: &[&str] = &[
    "error", "memory", "keys", "clock", "cpu", "codec", "policy", "records", "map", "logread",
    "segments", "dedup", "stats", "liveness", "log", "locks", "recovery", "volume", "check",
    "pool",
];

/// Rooms only tests use.
const TEST_ONLY: &[&str] = &["test_util"];

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The top-level rooms in src/ (`foo.rs` and `foo/`), without `lib`.
fn rooms(src: &Path) -> BTreeSet<String> {
    std::fs::read_dir(src)
        .expect("read src/")
        .map(|e| e.expect("dir entry").path())
        .filter_map(|p| {
            let stem = p.file_stem()?.to_str()?.to_owned();
            (p.is_dir() || p.extension().is_some_and(|x| x == "rs")).then_some(stem)
        })
        .filter(|r| r != "lib")
        .collect()
}

/// The non-test source files of a room.
fn room_files(src: &Path, room: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let file = src.join(format!("{room}.rs"));
    if file.is_file() {
        out.push(file);
    }
    let mut stack = vec![src.join(room)];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries {
            let p = e.expect("dir entry").path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs")
                && p.file_name().is_some_and(|n| n != "tests.rs")
            {
                out.push(p);
            }
        }
    }
    out
}

/// `text` without comments and string/char literals (replaced by spaces),
/// and cut at the first inline `#[cfg(test)] mod name {` block.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            i = text[i + 2..].find("*/").map_or(b.len(), |j| i + 2 + j + 2);
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(' ');
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    let mut cut = out.len();
    let mut from = 0;
    while let Some(j) = out[from..].find("#[cfg(test)]") {
        let at = from + j;
        let rest = out[at + 12..].trim_start();
        let block = rest.find('{');
        if rest.starts_with("mod ") && block.is_some_and(|k| rest.find(';').is_none_or(|s| k < s)) {
            cut = at;
            break;
        }
        from = at + 12;
    }
    out.truncate(cut);
    out
}

fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The rooms a piece of code names through `crate::`.
fn crate_paths(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        if at > 0 && code.as_bytes()[at - 1].is_ascii_alphanumeric() {
            continue; // e.g. `$crate::`, `cvol_format::crate::` never occurs
        }
        let rest = code[at + 7..].trim_start();
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.insert(ident(item.trim()).to_owned());
                        item.clear();
                        continue;
                    }
                    _ => {}
                }
                item.push(c);
            }
            out.insert(ident(item.trim()).to_owned());
        } else {
            out.insert(ident(rest).to_owned());
        }
    }
    out.retain(|r| !r.is_empty());
    out
}

/// room -> the other rooms its non-test code names.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let all = rooms(src);
    all.iter()
        .filter(|r| !TEST_ONLY.contains(&r.as_str()))
        .map(|room| {
            let mut deps = BTreeSet::new();
            for f in room_files(src, room) {
                let text = std::fs::read_to_string(&f).expect("read source");
                deps.extend(crate_paths(&code_only(&text)));
            }
            deps.retain(|d| d != room && all.contains(d));
            (room.clone(), deps)
        })
        .collect()
}

/// Every edge that goes up (or to a room missing from `order`).
fn upward_edges(g: &BTreeMap<String, BTreeSet<String>>, order: &[&str]) -> Vec<String> {
    let rank = |r: &str| order.iter().position(|x| *x == r);
    let mut bad = Vec::new();
    for (room, deps) in g {
        let Some(me) = rank(room) else {
            bad.push(format!("room `{room}` is not in LAYERS"));
            continue;
        };
        for d in deps {
            match rank(d) {
                Some(them) if them < me => {}
                _ => bad.push(format!("`{room}` uses `{d}`, which is not below it")),
            }
        }
    }
    bad
}

#[test]
fn every_room_uses_only_rooms_below_it() {
    let g = graph(&src_dir());
    let bad = upward_edges(&g, LAYERS);
    assert!(
        bad.is_empty(),
        "layer order broken:\n  {}",
        bad.join("\n  ")
    );
}

#[test]
fn layers_names_only_rooms_that_exist() {
    let all = rooms(&src_dir());
    for r in LAYERS {
        assert!(
            all.contains(*r),
            "LAYERS names `{r}`, which src/ does not have"
        );
    }
}

/// The checker itself: it sees grouped imports, ignores comments, strings
/// and inline test modules, and reports a circle as an upward edge.
#[test]
fn checker_sees_upward_imports_and_ignores_comments() {
    let code = code_only(
        "use crate::{map::BlockMap, records};\n// crate::volume in a comment\n\
         let s = \"crate::check\";\nfn f() { crate::segments::x(); }\n\
         #[cfg(test)]\nmod tests { use crate::volume; }\n",
    );
    let found = crate_paths(&code);
    let want: BTreeSet<String> = ["map", "records", "segments"].map(String::from).into();
    assert_eq!(found, want);

    let mut g = BTreeMap::new();
    g.insert("map".to_owned(), BTreeSet::from(["records".to_owned()]));
    g.insert("records".to_owned(), BTreeSet::from(["map".to_owned()]));
    let bad = upward_edges(&g, &["records", "map"]);
    assert_eq!(bad, vec!["`records` uses `map`, which is not below it"]);
}
