//! Integration tests driving the server with real NBD clients (libnbd's
//! nbdinfo/nbdsh/nbdcopy and qemu-io/qemu-img). Each test is skipped, with a
//! message, when its tool is missing.

mod common;

use std::process::{Command, Output};

use common::{have_tool, pattern, python_with_libnbd, MemBackend, TestServer};
use cvol_nbd::ServerConfig;

const SIZE_BYTES: u64 = 8 * 1024 * 1024;

fn config(name: &str) -> ServerConfig {
    ServerConfig {
        export_name: name.into(),
        description: Some("cvol test export".into()),
        ..ServerConfig::default()
    }
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("spawn client");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let program = cmd.get_program().to_string_lossy();
    assert!(
        out.status.success(),
        "{program} failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    out
}

#[test]
fn nbdinfo_json_reports_export() {
    if !have_tool("nbdinfo", &["--version"]) {
        return;
    }
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false), config("cvol"));
    let out = run(Command::new("nbdinfo").args(["--json", &ts.uri("cvol")]));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let export = &json["exports"][0];
    assert_eq!(export["export-size"], SIZE_BYTES);
    assert_eq!(export["export-name"], "cvol");
    assert_eq!(export["description"], "cvol test export");
    for key in [
        "can_flush",
        "can_fua",
        "can_multi_conn",
        "can_trim",
        "can_zero",
        "can_fast_zero",
        "can_cache",
        "can_df",
    ] {
        assert_eq!(export[key], true, "{key} in {export}");
    }
    assert_eq!(export["is_read_only"], false);
    assert_eq!(export["block_size_minimum"], 1);
    assert_eq!(export["block_size_preferred"], 4096);
    assert_eq!(export["block_size_maximum"], 32 * 1024 * 1024);
    let contexts = export["contexts"].as_array().unwrap();
    assert!(
        contexts.iter().any(|c| c == "base:allocation"),
        "{contexts:?}"
    );
    assert_eq!(json["protocol"], "newstyle-fixed");

    // The default export ("") is the same export; --list works too.
    let out = run(Command::new("nbdinfo").args(["--json", &ts.uri("")]));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["exports"][0]["export-size"], SIZE_BYTES);
    let out = run(Command::new("nbdinfo").args(["--list", "--json", &ts.uri("")]));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["exports"][0]["export-name"], "cvol");

    // An unknown export is refused (NBD_REP_ERR_UNKNOWN) without hanging.
    let out = Command::new("nbdinfo")
        .args(["--json", &ts.uri("nope")])
        .output()
        .unwrap();
    assert!(!out.status.success());
    ts.server.shutdown();
}

#[test]
fn nbdinfo_read_only_export() {
    if !have_tool("nbdinfo", &["--version"]) {
        return;
    }
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, true), config(""));
    let out = run(Command::new("nbdinfo").args(["--json", &ts.uri("")]));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["exports"][0]["is_read_only"], true);
}

#[test]
fn qemu_io_pattern_roundtrip_including_unaligned() {
    if !have_tool("qemu-io", &["--version"]) {
        return;
    }
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false), config(""));
    let commands = [
        "write -P 0xab 0 64k",
        "read -P 0xab 0 64k",
        "write -P 0x5a 1000 3000",
        "read -P 0x5a 1000 3000",
        "read -P 0xab 0 1000",
        "read -P 0xab 4000 61536",
        "write -z 65536 65536",
        "read -P 0 65536 65536",
        "aio_write -P 0x11 1m 128k",
        "aio_write -P 0x22 2m 128k",
        "aio_flush",
        "read -P 0x11 1m 128k",
        "read -P 0x22 2m 128k",
        "discard 4m 1m",
        "flush",
    ];
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw"]);
    for c in commands {
        cmd.args(["-c", c]);
    }
    cmd.arg(ts.uri(""));
    let out = run(&mut cmd);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !stdout.contains("failed"),
        "qemu-io reported a failure:\n{stdout}"
    );
    assert!(!stdout.contains("Pattern verification"), "{stdout}");
    assert_eq!(ts.backend.contents(1000, 3000), vec![0x5a; 3000]);
    assert_eq!(ts.backend.contents(4000, 1000), vec![0xab; 1000]);
    assert!(ts.backend.flushes.load(std::sync::atomic::Ordering::SeqCst) >= 1);
}

#[test]
fn qemu_img_and_nbdcopy_roundtrip() {
    if !have_tool("qemu-img", &["--version"]) || !have_tool("nbdcopy", &["--version"]) {
        return;
    }
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false), config(""));
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    let mut data = pattern(SIZE_BYTES as usize, 7);
    data[4 * 1024 * 1024..5 * 1024 * 1024].fill(0); // a zero region
    std::fs::write(&src, &data).unwrap();
    // nbdcopy uses several connections (multi-conn) and zero/trim requests.
    run(Command::new("nbdcopy").args([src.to_str().unwrap(), &ts.uri("")]));
    assert_eq!(ts.backend.contents(0, SIZE_BYTES as usize), data);
    let dst = dir.path().join("dst.img");
    run(Command::new("nbdcopy").args([&ts.uri(""), dst.to_str().unwrap()]));
    assert_eq!(std::fs::read(&dst).unwrap(), data);
    // qemu-img: compare the export with the file.
    run(Command::new("qemu-img").args([
        "compare",
        "-f",
        "raw",
        "-F",
        "raw",
        src.to_str().unwrap(),
        &ts.uri(""),
    ]));
    let out =
        run(Command::new("qemu-img").args(["map", "--output=json", "-f", "raw", &ts.uri("")]));
    let map: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(map.as_array().is_some_and(|a| !a.is_empty()));
}

const NBDSH_SCRIPT: &str = r#"
import errno, os
import nbd

uri = os.environ["NBD_TEST_URI"]
h = nbd.NBD()
h.set_strict_mode(0)  # let invalid requests reach the server
h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
h.connect_uri(uri)
size = h.get_size()
assert size == 8 * 1024 * 1024, size
assert h.can_meta_context("base:allocation")
assert h.can_multi_conn() and h.can_flush() and h.can_fua() and h.can_trim() and h.can_zero()

# Pipelined async writes, then pipelined async reads.
CHUNK = 65536
cookies = []
for i in range(32):
    buf = bytes([i + 1]) * CHUNK
    cookies.append(h.aio_pwrite(buf, i * CHUNK, flags=nbd.CMD_FLAG_FUA if i % 2 else 0))
while h.aio_in_flight() > 0:
    h.poll(-1)
for c in cookies:
    assert h.aio_command_completed(c)
bufs = []
for i in range(32):
    b = nbd.Buffer(CHUNK)
    bufs.append((i, b, h.aio_pread(b, i * CHUNK)))
while h.aio_in_flight() > 0:
    h.poll(-1)
for i, b, c in bufs:
    assert h.aio_command_completed(c)
    assert b.to_bytearray() == bytes([i + 1]) * CHUNK, i

def extents(offset, length, flags=0):
    found = []
    def cb(metacontext, off, entries, err):
        assert metacontext == "base:allocation"
        found.extend(zip(entries[0::2], entries[1::2]))
    h.block_status(length, offset, cb, flags)
    return found

# Written data is allocated.
e = extents(0, 4 * CHUNK)
assert e[0][1] == 0, e
# Trim: a hole that reads as zero.
h.trim(2 * CHUNK, 2 * CHUNK)
e = extents(0, 4 * CHUNK)
assert e[0] == (2 * CHUNK, 0), e
assert e[1] == (2 * CHUNK, nbd.STATE_HOLE | nbd.STATE_ZERO), e
assert h.pread(CHUNK, 2 * CHUNK) == bytes(CHUNK)
# Zero with NO_HOLE stays allocated; plain zero punches a hole.
h.zero(CHUNK, 8 * CHUNK, nbd.CMD_FLAG_NO_HOLE)
assert extents(8 * CHUNK, CHUNK)[0][1] == 0
h.zero(CHUNK, 9 * CHUNK)
assert extents(9 * CHUNK, CHUNK)[0] == (CHUNK, 3)
assert h.pread(CHUNK, 9 * CHUNK) == bytes(CHUNK)
# Fast zero that the backend cannot do fast: ENOTSUP.
try:
    h.zero(CHUNK, 8 * CHUNK, nbd.CMD_FLAG_NO_HOLE | nbd.CMD_FLAG_FAST_ZERO)
    assert False, "fast zero should fail"
except nbd.Error as ex:
    assert ex.errnum == errno.ENOTSUP, ex
# REQ_ONE gives exactly one extent.
e = extents(0, 16 * CHUNK, nbd.CMD_FLAG_REQ_ONE)
assert len(e) == 1, e
# The unwritten tail is a hole.
assert extents(size - 4096, 4096) == [(4096, 3)]

# Out-of-range read fails with EINVAL; the connection stays usable.
try:
    h.pread(4096, size - 1024)
    assert False, "out-of-range read should fail"
except nbd.Error as ex:
    assert ex.errnum == errno.EINVAL, ex
try:
    h.pwrite(b"x" * 4096, size)
    assert False, "out-of-range write should fail"
except nbd.Error as ex:
    assert ex.errnum == errno.ENOSPC, ex
assert h.pread(CHUNK, 5 * CHUNK) == bytes([6]) * CHUNK

# Unaligned write/read.
h.pwrite(b"\x77" * 3000, 1000)
assert h.pread(3000, 1000) == b"\x77" * 3000
h.flush()
h.cache(CHUNK, 0)
h.shutdown()
print("OK")
"#;

const NBDSH_READ_ONLY_SCRIPT: &str = r#"
import errno, os
import nbd

h = nbd.NBD()
h.set_strict_mode(0)
h.connect_uri(os.environ["NBD_TEST_URI"])
assert h.is_read_only()
assert h.pread(4096, 0) == bytes(4096)
for name, op in [("write", lambda: h.pwrite(b"a" * 4096, 0)),
                 ("trim", lambda: h.trim(4096, 0)),
                 ("zero", lambda: h.zero(4096, 0))]:
    try:
        op()
        assert False, name + " should fail"
    except nbd.Error as ex:
        assert ex.errnum == errno.EPERM, (name, ex)
assert h.pread(4096, 0) == bytes(4096)
h.shutdown()
print("OK")
"#;

/// `nbdsh -c SCRIPT` with the export URI in `$NBD_TEST_URI`. nbdsh runs
/// `python3 -m nbd`, so the interpreter that has the bindings is put first
/// on PATH.
fn nbdsh(python: &str, script: &str, uri: &str) -> Command {
    let mut cmd = Command::new("nbdsh");
    if let Some(dir) = std::path::Path::new(python)
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
    {
        let path = std::env::var("PATH").unwrap_or_default();
        cmd.env("PATH", format!("{}:{path}", dir.display()));
    }
    cmd.env("NBD_TEST_URI", uri).args(["-c", script]);
    cmd
}

fn nbdsh_available() -> Option<String> {
    let python = python_with_libnbd()?;
    let ok = nbdsh(&python, "pass", "")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("SKIP: nbdsh is not installed or not working");
        return None;
    }
    Some(python)
}

fn run_nbdsh(python: &str, script: &str, uri: &str) {
    let out = run(&mut nbdsh(python, script, uri));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "OK");
}

#[test]
fn nbdsh_pipelined_io_block_status_and_errors() {
    let Some(python) = nbdsh_available() else {
        return;
    };
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false), config(""));
    run_nbdsh(&python, NBDSH_SCRIPT, &ts.uri(""));
    assert!(ts.backend.flushes.load(std::sync::atomic::Ordering::SeqCst) >= 1);
}

#[test]
fn nbdsh_read_only_export_refuses_writes_with_eperm() {
    let Some(python) = nbdsh_available() else {
        return;
    };
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, true), config(""));
    run_nbdsh(&python, NBDSH_READ_ONLY_SCRIPT, &ts.uri(""));
}

#[test]
fn nbdsh_structured_read_error_then_success() {
    let Some(python) = nbdsh_available() else {
        return;
    };
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false), config(""));
    ts.backend.fail_with(Some(cvol_nbd::BackendError::Io));
    let script = r#"
import errno, os, time
import nbd
h = nbd.NBD()
h.connect_uri(os.environ["NBD_TEST_URI"])
assert h.get_structured_replies_negotiated()
try:
    h.pread(4096, 0)
    assert False
except nbd.Error as ex:
    assert ex.errnum == errno.EIO, ex
open(os.environ["NBD_TEST_FLAG"], "w").write("failed")
while open(os.environ["NBD_TEST_FLAG"]).read() != "go":
    time.sleep(0.01)
assert h.pread(4096, 0) == bytes(4096)
h.shutdown()
print("OK")
"#;
    let dir = tempfile::tempdir().unwrap();
    let flag = dir.path().join("flag");
    std::fs::write(&flag, "").unwrap();
    let child = nbdsh(&python, script, &ts.uri(""))
        .env("NBD_TEST_FLAG", &flag)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    for _ in 0..1000 {
        if std::fs::read_to_string(&flag).unwrap() == "failed" {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    ts.backend.fail_with(None);
    std::fs::write(&flag, "go").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "OK");
}
