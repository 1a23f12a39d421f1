//! Metadata contexts a backend names besides `base:allocation` (qemu's
//! `qemu:dirty-bitmap:NAME` convention): listing and selecting them in the
//! handshake, BLOCK_STATUS with one chunk per selected context, and real
//! clients (nbdinfo, libnbd's Python bindings, qemu-img), each skipped with a message
//! when missing.

mod common;

use std::process::Command;

use common::client::{Client, Reply};
use common::{config, have_tool, python_with_libnbd, MemBackend, TestServer};
use cvol_nbd::proto::*;
use cvol_nbd::test_util::meta_context_data;
use cvol_nbd::{BackendError, ContextExtent};

const SIZE_BYTES: u64 = 4 * 1024 * 1024;
const KIB: u64 = 1024;
const S1: &str = "qemu:dirty-bitmap:s1";
const S2: &str = "qemu:dirty-bitmap:s2";
const OTHER: &str = "x-cvol:other";

fn run(length: u64, flags: u32) -> ContextExtent {
    ContextExtent { length, flags }
}

/// `s1`: 64 KiB clean, 128 KiB dirty, 64 KiB clean, 4 KiB dirty, the rest
/// clean. `s2`: the first 1 MiB dirty. `x-cvol:other`: all flags 7.
fn backend() -> MemBackend {
    MemBackend::new(SIZE_BYTES, false)
        .with_context(
            S1,
            &[
                run(64 * KIB, 0),
                run(128 * KIB, 1),
                run(64 * KIB, 0),
                run(4 * KIB, 1),
            ],
        )
        .with_context(S2, &[run(1024 * KIB, 1)])
        .with_context(OTHER, &[run(SIZE_BYTES, 7)])
}

fn start() -> TestServer {
    TestServer::start(backend(), config())
}

/// A client past the greeting with structured replies.
fn structured(ts: &TestServer) -> Client {
    let mut c = Client::connect(ts);
    c.greet(common::client::CLIENT_FLAGS);
    c.send_option(NBD_OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(c.option_reply().1, NBD_REP_ACK);
    c.structured = true;
    c
}

/// Sends a LIST or SET for the default export; returns the (id, name) of
/// each context replied, after checking the final ACK.
fn meta(c: &mut Client, option: u32, queries: &[&str]) -> Vec<(u32, String)> {
    c.send_option(option, &meta_context_data("", queries));
    let mut replies = c.option_replies();
    let (last_option, last_type, _) = replies.pop().unwrap();
    assert_eq!((last_option, last_type), (option, NBD_REP_ACK));
    replies
        .into_iter()
        .map(|(o, t, data)| {
            assert_eq!((o, t), (option, NBD_REP_META_CONTEXT));
            let id = u32::from_be_bytes(data[0..4].try_into().unwrap());
            (id, String::from_utf8(data[4..].to_vec()).unwrap())
        })
        .collect()
}

fn named(pairs: &[(u32, &str)]) -> Vec<(u32, String)> {
    pairs.iter().map(|&(id, n)| (id, n.to_string())).collect()
}

#[test]
fn list_all_by_namespace_and_exact() {
    let ts = start();
    let mut c = structured(&ts);
    let list = NBD_OPT_LIST_META_CONTEXT;
    assert_eq!(
        meta(&mut c, list, &[]),
        named(&[(0, BASE_ALLOCATION), (0, S1), (0, S2), (0, OTHER)])
    );
    assert_eq!(
        meta(&mut c, list, &["qemu:dirty-bitmap:"]),
        named(&[(0, S1), (0, S2)])
    );
    assert_eq!(meta(&mut c, list, &[S2]), named(&[(0, S2)]));
    // Unknown names and namespaces are ignored, not errors.
    assert_eq!(
        meta(&mut c, list, &["qemu:dirty-bitmap:nope", "x-foo:", "base:"]),
        named(&[(0, BASE_ALLOCATION)])
    );
    // SET ignores wildcards; exact names get ids 1 (base:allocation), 2, ...
    let set = NBD_OPT_SET_META_CONTEXT;
    assert_eq!(meta(&mut c, set, &["qemu:dirty-bitmap:", "base:"]), vec![]);
    assert_eq!(
        meta(
            &mut c,
            set,
            &[S2, "qemu:dirty-bitmap:nope", BASE_ALLOCATION, S1]
        ),
        named(&[(1, BASE_ALLOCATION), (2, S1), (3, S2)])
    );
}

/// BLOCK_STATUS of [offset, offset+length): each chunk as (flags, context
/// id, [(length, status flags)]), up to the one marked done.
fn block_status(c: &mut Client, flags: u16, offset: u64, length: u32) -> Vec<Chunk> {
    c.request(NBD_CMD_BLOCK_STATUS, flags, 77, offset, length, &[]);
    let mut chunks = Vec::new();
    loop {
        let (reply, _) = c.reply(0);
        let Reply::Chunk {
            flags,
            kind,
            handle: 77,
            payload,
        } = reply
        else {
            panic!("{reply:?}")
        };
        assert_eq!(kind, NBD_REPLY_TYPE_BLOCK_STATUS, "{payload:?}");
        let words: Vec<u32> = payload
            .chunks(4)
            .map(|w| u32::from_be_bytes(w.try_into().unwrap()))
            .collect();
        let runs = words[1..].chunks(2).map(|p| (p[0], p[1])).collect();
        chunks.push((flags, words[0], runs));
        if flags & NBD_REPLY_FLAG_DONE != 0 {
            return chunks;
        }
    }
}

type Chunk = (u16, u32, Vec<(u32, u32)>);

#[test]
fn block_status_one_chunk_per_selected_context() {
    let ts = start();
    ts.backend.fill(0, &[1; 8192]);
    let mut c = structured(&ts);
    let set = NBD_OPT_SET_META_CONTEXT;
    assert_eq!(
        meta(&mut c, set, &[BASE_ALLOCATION, S1]),
        named(&[(1, BASE_ALLOCATION), (2, S1)])
    );
    c.go("");
    let hole = NBD_STATE_HOLE | NBD_STATE_ZERO;
    let done = NBD_REPLY_FLAG_DONE;
    assert_eq!(
        block_status(&mut c, 0, 0, 300 * 1024),
        vec![
            (0, 1, vec![(8192, 0), (300 * 1024 - 8192, hole)]),
            (
                done,
                2,
                vec![(65536, 0), (131072, 1), (65536, 0), (4096, 1), (40960, 0)]
            ),
        ]
    );
    // From inside a run, cut at the request's end.
    assert_eq!(
        block_status(&mut c, 0, 100 * 1024, 100 * 1024),
        vec![
            (0, 1, vec![(100 * 1024, hole)]),
            (done, 2, vec![(92 * 1024, 1), (8 * 1024, 0)]),
        ]
    );
    // REQ_ONE: one descriptor per context.
    assert_eq!(
        block_status(&mut c, NBD_CMD_FLAG_REQ_ONE, 4096, 1 << 20),
        vec![(0, 1, vec![(4096, 0)]), (done, 2, vec![(61440, 0)])]
    );
    // A failing backend: the error alone, as for base:allocation.
    ts.backend.fail_with(Some(BackendError::Io));
    c.request(NBD_CMD_BLOCK_STATUS, 0, 78, 0, 4096, &[]);
    let (reply, _) = c.reply(0);
    assert!(
        matches!(reply, Reply::Chunk { flags, kind, handle: 78, .. }
            if flags == done && kind == NBD_REPLY_TYPE_ERROR),
        "{reply:?}"
    );
    assert_eq!(reply.error(), NBD_EIO);
}

#[test]
fn only_a_backend_context_selected() {
    let ts = start();
    let mut c = structured(&ts);
    let set = NBD_OPT_SET_META_CONTEXT;
    assert_eq!(meta(&mut c, set, &[S2]), named(&[(2, S2)]));
    c.go("");
    assert_eq!(
        block_status(&mut c, 0, 1024 * KIB - 512, 4096),
        vec![(NBD_REPLY_FLAG_DONE, 2, vec![(512, 1), (3584, 0)])]
    );
}

/// Runs `program args`, asserts success, returns its stdout.
fn stdout_of(program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{program} {args:?}: {}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

#[test]
fn nbdinfo_maps_and_lists_the_bitmap() {
    if !have_tool("nbdinfo", &["--version"]) {
        return;
    }
    let ts = start();
    let uri = ts.uri("");
    let map = stdout_of("nbdinfo", &[&format!("--map={S1}"), &uri]);
    let lines: Vec<Vec<&str>> = map
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        lines,
        vec![
            vec!["0", "65536", "0", "clean"],
            vec!["65536", "131072", "1", "dirty"],
            vec!["196608", "65536", "0", "clean"],
            vec!["262144", "4096", "1", "dirty"],
            vec!["266240", "3928064", "0", "clean"],
        ],
        "{map}"
    );
    for args in [vec!["--json"], vec!["--list", "--json"]] {
        let json = stdout_of("nbdinfo", &[&args[..], &[&uri]].concat());
        let json: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(
            json["exports"][0]["contexts"],
            serde_json::json!([BASE_ALLOCATION, S1, S2, OTHER]),
            "{args:?}"
        );
    }
    let text = stdout_of("nbdinfo", &[&uri]);
    let contexts: Vec<&str> = text
        .lines()
        .skip_while(|l| l.trim() != "contexts:")
        .skip(1)
        .take(4)
        .map(str::trim)
        .collect();
    assert_eq!(contexts, [BASE_ALLOCATION, S1, S2, OTHER], "{text}");
}

const LIBNBD_SCRIPT: &str = r#"
import os, nbd
h = nbd.NBD()
h.add_meta_context("base:allocation")
h.add_meta_context("qemu:dirty-bitmap:s1")
h.add_meta_context("qemu:dirty-bitmap:missing")
h.connect_uri(os.environ["NBD_TEST_URI"])
assert h.can_meta_context("base:allocation")
assert h.can_meta_context("qemu:dirty-bitmap:s1")
assert not h.can_meta_context("qemu:dirty-bitmap:missing")
seen = []
def cb(context, offset, entries, err):
    seen.append((context, offset, list(entries)))
h.block_status(256 * 1024, 0, cb)
print(seen)
"#;

#[test]
fn libnbd_block_status_sees_both_contexts() {
    let Some(python) = python_with_libnbd() else {
        return;
    };
    let ts = start();
    let out = Command::new(python)
        .args(["-c", LIBNBD_SCRIPT])
        .env("NBD_TEST_URI", ts.uri(""))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout.trim(),
        "[('base:allocation', 0, [262144, 3]), \
         ('qemu:dirty-bitmap:s1', 0, [65536, 0, 131072, 1, 65536, 0])]"
    );
}

#[test]
fn qemu_img_map_reads_the_bitmap() {
    if !have_tool("qemu-img", &["--version"]) {
        return;
    }
    let ts = start();
    let opts = format!(
        "driver=nbd,server.type=unix,server.path={},x-dirty-bitmap={S1}",
        ts.socket_path.display()
    );
    let map = stdout_of("qemu-img", &["map", "--output=json", "--image-opts", &opts]);
    // qemu's x-dirty-bitmap reports dirty ranges as "data": false.
    let map: serde_json::Value = serde_json::from_str(&map).unwrap();
    let runs: Vec<(u64, u64, bool)> = map
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let n = |k: &str| e[k].as_u64().unwrap();
            (n("start"), n("length"), e["data"].as_bool().unwrap())
        })
        .collect();
    assert_eq!(
        runs,
        [
            (0, 65536, true),
            (65536, 131072, false),
            (196608, 65536, true),
            (262144, 4096, false),
            (266240, 3928064, true),
        ]
    );
}
