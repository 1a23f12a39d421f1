//! The shape of the source tree: functions at most [`MAX_FN_LINES`] lines,
//! files under [`MAX_FILE_LINES`] lines, over every crate.
//!
//! The function scan is textual, as `rustfmt`-formatted code allows: a line
//! that starts an item `fn` (after `pub`, `pub(...)`, `const`, `async`,
//! `unsafe`) opens a function, which ends where its braces balance; string
//! and char literals and comments are skipped when braces are counted. A
//! function's length counts its signature and closing brace.
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Longest function allowed, in lines (signature and closing brace included).
const MAX_FN_LINES: usize = 80;
/// A source file must be shorter than this many lines.
const MAX_FILE_LINES: usize = 900;

/// Functions longer than [`MAX_FN_LINES`] today, as `path::name` (path from
/// the workspace root), each to be split. This list must shrink to empty:
/// the test fails for an entry that no longer offends, so remove an entry
/// as soon as its function is split.
const ALLOWED_LONG_FNS: &[&str] = &[];

/// Files of [`MAX_FILE_LINES`] lines or more today, each to be split. This
/// list must shrink to empty: the test fails for an entry that no longer
/// offends, so remove an entry as soon as its file is split.
const ALLOWED_LONG_FILES: &[&str] = &[
    "crates/engine/src/recovery.rs",
];

/// Every function over [`MAX_FN_LINES`] lines is in [`ALLOWED_LONG_FNS`],
/// and every entry there still is one.
#[test]
fn fn_lengths() {
    let root = workspace_root();
    let mut dirs: Vec<PathBuf> = crate_dirs(&root)
        .into_iter()
        .map(|c| c.join("src"))
        .collect();
    dirs.push(root.join("fuzz").join("fuzz_targets"));
    let mut over = BTreeMap::new();
    for file in dirs.iter().flat_map(|d| rust_files(d)) {
        let text = std::fs::read_to_string(&file).unwrap();
        for f in functions(&text) {
            if f.lines > MAX_FN_LINES {
                let key = format!("{}::{}", relative(&root, &file), f.name);
                let at = format!("line {}: {} lines", f.line, f.lines);
                over.entry(key).or_insert_with(Vec::new).push(at);
            }
        }
    }
    let problems = judge(&over, ALLOWED_LONG_FNS, "ALLOWED_LONG_FNS");
    assert!(
        problems.is_empty(),
        "functions longer than {MAX_FN_LINES} lines:\n{}",
        problems.join("\n")
    );
}

/// Every `.rs` file under `crates/*/src` and `crates/*/tests` is shorter
/// than [`MAX_FILE_LINES`] lines, but those [`ALLOWED_LONG_FILES`] names
/// (each of which still is that long).
#[test]
fn file_sizes() {
    let root = workspace_root();
    let mut over = BTreeMap::new();
    for krate in crate_dirs(&root) {
        for file in ["src", "tests"]
            .iter()
            .flat_map(|d| rust_files(&krate.join(d)))
        {
            let lines = std::fs::read_to_string(&file).unwrap().lines().count();
            if lines >= MAX_FILE_LINES {
                over.insert(relative(&root, &file), vec![format!("{lines} lines")]);
            }
        }
    }
    let problems = judge(&over, ALLOWED_LONG_FILES, "ALLOWED_LONG_FILES");
    assert!(
        problems.is_empty(),
        "files of {MAX_FILE_LINES} lines or more:\n{}",
        problems.join("\n")
    );
}

/// The scanner finds what the scan promises (a guard against a scan that
/// silently finds nothing).
#[test]
fn the_scan_counts_functions_and_skips_literals() {
    let src =
        "pub(crate) fn a() {\n    let s = \"}\";\n    let c = '{';\n    // }\n    /* { */\n}\n\
               fn decl();\n\
               const fn b() -> u8 { 1 }\n\
               async unsafe fn c() {\n    let r = r#\"\"}\"#;\n    let e = '\\'';\n}\n";
    let found: Vec<(String, usize, usize)> = functions(src)
        .into_iter()
        .map(|f| (f.name, f.line, f.lines))
        .collect();
    let want = [("a", 1, 6), ("b", 8, 1), ("c", 9, 4)];
    let want: Vec<(String, usize, usize)> = want
        .iter()
        .map(|&(n, l, k)| (n.to_string(), l, k))
        .collect();
    assert_eq!(found, want);
    let root = workspace_root();
    let engine = rust_files(&root.join("crates/engine/src"));
    let n: usize = engine
        .iter()
        .map(|f| functions(&std::fs::read_to_string(f).unwrap()).len())
        .sum();
    assert!(n > 500, "only {n} functions found in the engine");
}

/// The problems with `over` (offender -> where) against an allowance list:
/// offenders not listed, and listed entries that no longer offend.
fn judge(over: &BTreeMap<String, Vec<String>>, allowed: &[&str], list: &str) -> Vec<String> {
    let allowed: BTreeSet<&str> = allowed.iter().copied().collect();
    let mut problems = Vec::new();
    for (key, at) in over {
        if !allowed.contains(key.as_str()) {
            problems.push(format!("{key} ({}): split it", at.join(", ")));
        }
    }
    for key in allowed {
        if !over.contains_key(key) {
            problems.push(format!(
                "{key} is in {list} but no longer too long: remove it from the list"
            ));
        }
    }
    problems
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// `crates/*`, sorted.
fn crate_dirs(root: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root.join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// Every `.rs` file under `dir` (none if it does not exist), sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries {
        let path = e.unwrap().path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
    out.sort();
    out
}

fn relative(root: &Path, file: &Path) -> String {
    file.strip_prefix(root)
        .unwrap()
        .to_string_lossy()
        .replace('\\', "/")
}

/// A function the scan found.
#[derive(Debug)]
struct Function {
    name: String,
    /// 1-based line of its signature.
    line: usize,
    /// Lines from the signature to the closing brace, both included.
    lines: usize,
}

/// The functions with a body in `text`.
fn functions(text: &str) -> Vec<Function> {
    let mut state = Literal::default();
    let code: Vec<String> = text.split('\n').map(|l| strip(l, &mut state)).collect();
    let mut found = Vec::new();
    for (start, line) in code.iter().enumerate() {
        let Some(name) = fn_name(line) else { continue };
        if let Some(end) = body_end(&code[start..]) {
            found.push(Function {
                name: name.to_string(),
                line: start + 1,
                lines: end + 1,
            });
        }
    }
    found
}

/// The index of the line where the function starting at `code[0]` closes,
/// or `None` for a declaration without a body (`;` before any `{`).
fn body_end(code: &[String]) -> Option<usize> {
    let mut depth = 0i64;
    let mut opened = false;
    for (k, line) in code.iter().enumerate() {
        for ch in line.chars() {
            match ch {
                '{' => {
                    depth += 1;
                    opened = true;
                }
                '}' => depth -= 1,
                ';' if !opened && depth == 0 => return None,
                _ => {}
            }
        }
        if opened && depth == 0 {
            return Some(k);
        }
    }
    None
}

/// The name of the function a (stripped) line declares:
/// `[pub[(...)]] [const] [async] [unsafe] [extern "ABI"] fn NAME`.
fn fn_name(line: &str) -> Option<&str> {
    let mut s = line.trim_start();
    if let Some(rest) = s.strip_prefix("pub") {
        let rest = match rest.strip_prefix('(') {
            Some(r) => r.find(')').map_or(rest, |j| &r[j + 1..]),
            None => rest,
        };
        if let Some(rest) = after_space(rest) {
            s = rest;
        }
    }
    for word in ["const", "async", "unsafe"] {
        if let Some(rest) = s.strip_prefix(word).and_then(after_space) {
            s = rest;
        }
    }
    if let Some(rest) = s.strip_prefix("extern").and_then(after_space) {
        if let Some(abi) = rest.strip_prefix('"') {
            if let Some(rest) = abi.find('"').and_then(|j| after_space(&abi[j + 1..])) {
                s = rest;
            }
        }
    }
    let rest = after_space(s.strip_prefix("fn")?)?;
    let end = rest
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(rest.len());
    let name = &rest[..end];
    let first = name.chars().next()?;
    (first.is_ascii_alphabetic() || first == '_').then_some(name)
}

/// `s` after one or more whitespace characters, if it starts with one.
fn after_space(s: &str) -> Option<&str> {
    let rest = s.trim_start();
    (rest.len() < s.len()).then_some(rest)
}

/// What a line leaves open for the next: a block comment, or a string
/// literal with the delimiter that ends it (`"` or `"#...` for raw ones).
#[derive(Default)]
struct Literal {
    block_comment: bool,
    string_end: Option<String>,
}

/// The line without literals and comments.
fn strip(line: &str, state: &mut Literal) -> String {
    let chars: Vec<char> = line.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        if state.block_comment {
            let Some(j) = find(&chars, i, "*/") else {
                return out;
            };
            state.block_comment = false;
            i = j + 2;
            continue;
        }
        if let Some(end) = state.string_end.take() {
            match string_close(&chars, i, &end) {
                Some(next) => i = next,
                None => {
                    state.string_end = Some(end);
                    return out;
                }
            }
            continue;
        }
        if starts(&chars, i, "//") {
            break;
        }
        if starts(&chars, i, "/*") {
            state.block_comment = true;
            i += 2;
            continue;
        }
        if let Some((len, hashes)) = raw_string_start(&chars, i) {
            state.string_end = Some(format!("\"{}", "#".repeat(hashes)));
            i += len;
            continue;
        }
        if chars[i] == '"' {
            state.string_end = Some("\"".into());
            i += 1;
            continue;
        }
        if chars[i] == '\'' {
            if let Some(len) = char_literal(&chars[i..]) {
                i += len;
                continue;
            }
        }
        out.push(chars[i]);
        i += 1;
    }
    out
}

/// Where the string literal open at `i` ends (the index after its closing
/// delimiter `end`), or `None` if it goes on past the line. A plain `"`
/// honours backslash escapes; a raw string's `"#...` does not.
fn string_close(chars: &[char], mut i: usize, end: &str) -> Option<usize> {
    if end == "\"" {
        while i < chars.len() {
            match chars[i] {
                '\\' => i += 2,
                '"' => return Some(i + 1),
                _ => i += 1,
            }
        }
        None
    } else {
        find(chars, i, end).map(|j| j + end.chars().count())
    }
}

/// `b?r#*"` at `i`, not inside an identifier: its length and the number of `#`.
fn raw_string_start(chars: &[char], i: usize) -> Option<(usize, usize)> {
    if i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_') {
        return None;
    }
    let mut j = i;
    if chars.get(j) == Some(&'b') {
        j += 1;
    }
    if chars.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let hashes = chars[j..].iter().take_while(|&&c| c == '#').count();
    j += hashes;
    (chars.get(j) == Some(&'"')).then_some((j + 1 - i, hashes))
}

/// The length of a char literal at the start of `s` (`'x'`, `'\n'`,
/// `'\u{1F600}'`, `'\x7f'`), or `None` (a lifetime or label).
fn char_literal(s: &[char]) -> Option<usize> {
    let quote_at = |k: usize| (s.get(k) == Some(&'\'')).then_some(k + 1);
    match s.get(1)? {
        '\\' => {
            if s.get(2).is_some() {
                if let Some(n) = quote_at(3) {
                    return Some(n);
                }
            }
            match s.get(2)? {
                'u' if s.get(3) == Some(&'{') => {
                    let digits = s[4..].iter().take_while(|c| c.is_ascii_hexdigit()).count();
                    if digits == 0 || s.get(4 + digits) != Some(&'}') {
                        return None;
                    }
                    quote_at(5 + digits)
                }
                'x' if s.len() > 4 && s[3..5].iter().all(|c| c.is_ascii_hexdigit()) => quote_at(5),
                _ => None,
            }
        }
        '\'' => None,
        _ => quote_at(2),
    }
}

fn starts(chars: &[char], i: usize, pat: &str) -> bool {
    let pat: Vec<char> = pat.chars().collect();
    chars.len() >= i + pat.len() && chars[i..i + pat.len()] == pat[..]
}

/// The first index at or after `from` where `pat` starts.
fn find(chars: &[char], from: usize, pat: &str) -> Option<usize> {
    (from..chars.len()).find(|&j| starts(chars, j, pat))
}
