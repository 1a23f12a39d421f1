//! A server of many exports ([`Server::with_exports`] over an
//! [`ExportSet`]): each export by its name, `NBD_OPT_LIST`, unknown names,
//! and the set changing while the server runs.

mod common;

use std::io::ErrorKind;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use common::client::{Client as RawClient, CLIENT_FLAGS};
use common::{config, have_tool, MemBackend, MAX_REQUEST_BYTES};
use cvol_nbd::client::Client;
use cvol_nbd::proto::*;
use cvol_nbd::test_util::{go_data, meta_context_data};
use cvol_nbd::{Backend, ExportSet, Exports, Server};

const A_BYTES: u64 = 1024 * 1024;
const B_BYTES: u64 = 3 * 1024 * 1024;
const C_BYTES: u64 = 64 * 1024;

/// A server on a Unix socket of the exports "a" (1 MiB, described), "b"
/// (3 MiB) and "c" (64 KiB, read-only).
struct Pool {
    server: Server,
    set: Arc<ExportSet>,
    a: Arc<MemBackend>,
    b: Arc<MemBackend>,
    socket_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Pool {
    fn start() -> Pool {
        let set = Arc::new(ExportSet::new());
        let a = Arc::new(MemBackend::new(A_BYTES, false));
        let b = Arc::new(MemBackend::new(B_BYTES, false));
        set.insert("a", Some("volume a".into()), a.clone());
        set.insert("b", None, b.clone());
        set.insert("c", None, Arc::new(MemBackend::new(C_BYTES, true)));
        let dir = tempfile::tempdir().unwrap();
        let socket_path = dir.path().join("pool.sock");
        let server = Server::with_exports(set.clone() as Arc<dyn Exports>, config());
        server
            .serve_unix(UnixListener::bind(&socket_path).unwrap())
            .unwrap();
        Pool {
            server,
            set,
            a,
            b,
            socket_path,
            _dir: dir,
        }
    }

    fn uri(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.socket_path.display())
    }

    /// A raw client after the greeting, in option haggling.
    fn raw(&self) -> RawClient {
        let mut c = RawClient::connect_to(&self.socket_path);
        c.greet(CLIENT_FLAGS);
        c
    }
}

#[test]
fn each_export_has_its_own_size_flags_and_data() {
    let pool = Pool::start();
    let a = Client::connect(&pool.uri("a")).unwrap();
    let b = Client::connect(&pool.uri("b")).unwrap();
    let c = Client::connect(&pool.uri("c")).unwrap();
    assert_eq!(
        (a.size_bytes(), b.size_bytes(), c.size_bytes()),
        (A_BYTES, B_BYTES, C_BYTES)
    );
    assert_eq!(
        (a.read_only(), b.read_only(), c.read_only()),
        (false, false, true)
    );
    pool.b.fill(8192, &[0x5b; 4096]);
    a.write_at(8192, &[0xa1; 4096], false).unwrap();
    a.flush().unwrap();
    let mut buf = vec![0u8; 4096];
    b.read_at(8192, &mut buf).unwrap();
    assert_eq!(buf, vec![0x5b; 4096], "b unchanged by the write to a");
    a.read_at(8192, &mut buf).unwrap();
    assert_eq!(buf, vec![0xa1; 4096]);
    assert_eq!(pool.a.contents(8192, 4096), vec![0xa1; 4096]);
    assert_eq!(pool.b.contents(8192, 4096), vec![0x5b; 4096]);
    assert_eq!(pool.a.flushes.load(Ordering::Relaxed), 1);
    assert_eq!(pool.b.flushes.load(Ordering::Relaxed), 0);
    // The server checks ranges against the chosen export's size.
    for (name, expected) in [("a", Err(NBD_EINVAL)), ("b", Ok(vec![0; 512]))] {
        let mut c = pool.raw();
        c.go(name);
        assert_eq!(c.read(1, A_BYTES, 512), expected, "export {name}");
    }
}

#[test]
fn list_names_every_export_in_order_with_its_description() {
    let pool = Pool::start();
    let mut c = pool.raw();
    c.send_option(NBD_OPT_LIST, &[]);
    let replies = c.option_replies();
    let expected = vec![
        (
            NBD_OPT_LIST,
            NBD_REP_SERVER,
            encode_rep_server("a", Some("volume a")),
        ),
        (NBD_OPT_LIST, NBD_REP_SERVER, encode_rep_server("b", None)),
        (NBD_OPT_LIST, NBD_REP_SERVER, encode_rep_server("c", None)),
        (NBD_OPT_LIST, NBD_REP_ACK, vec![]),
    ];
    assert_eq!(replies, expected);
    // The list follows the set.
    pool.set.remove("b");
    c.send_option(NBD_OPT_LIST, &[]);
    let names: Vec<Vec<u8>> = c
        .option_replies()
        .into_iter()
        .filter(|r| r.1 == NBD_REP_SERVER)
        .map(|r| r.2)
        .collect();
    assert_eq!(
        names,
        vec![
            encode_rep_server("a", Some("volume a")),
            encode_rep_server("c", None)
        ]
    );
}

/// `NBD_OPT_INFO` for `name` asking for its name and description: the
/// replies (INFOs, then the ACK or an error).
fn info(c: &mut RawClient, name: &str) -> Vec<(u32, u32, Vec<u8>)> {
    c.send_option(
        NBD_OPT_INFO,
        &go_data(name, &[NBD_INFO_NAME, NBD_INFO_DESCRIPTION]),
    );
    c.option_replies()
}

#[test]
fn info_names_and_describes_the_chosen_export() {
    let pool = Pool::start();
    let mut c = pool.raw();
    let flags = transmission_flags(false, false);
    let replies = info(&mut c, "a");
    let infos: Vec<&Vec<u8>> = replies.iter().map(|r| &r.2).collect();
    assert_eq!(
        infos,
        vec![
            &encode_info_export(A_BYTES, flags),
            &encode_info_block_size(1, 4096, MAX_REQUEST_BYTES),
            &encode_info_string(NBD_INFO_NAME, "a"),
            &encode_info_string(NBD_INFO_DESCRIPTION, "volume a"),
            &vec![],
        ]
    );
    let replies = info(&mut c, "c");
    assert_eq!(
        replies[0].2,
        encode_info_export(C_BYTES, transmission_flags(true, false))
    );
    assert_eq!(replies[2].2, encode_info_string(NBD_INFO_NAME, "c"));
    assert_eq!(replies.len(), 4, "no description for c: {replies:?}");
}

#[test]
fn unknown_names_are_refused() {
    let pool = Pool::start();
    let err = Client::connect(&pool.uri("zz")).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    let mut c = pool.raw();
    for option in [NBD_OPT_INFO, NBD_OPT_GO] {
        c.send_option(option, &go_data("zz", &[]));
        let replies = c.option_replies();
        assert_eq!(
            replies,
            vec![(option, NBD_REP_ERR_UNKNOWN, b"unknown export".to_vec())]
        );
    }
    // No default export unless the set names one.
    c.send_option(NBD_OPT_GO, &go_data("", &[]));
    assert_eq!(c.option_reply().1, NBD_REP_ERR_UNKNOWN);
    c.send_option(NBD_OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(c.option_reply().1, NBD_REP_ACK);
    for option in [NBD_OPT_LIST_META_CONTEXT, NBD_OPT_SET_META_CONTEXT] {
        c.send_option(option, &meta_context_data("zz", &["base:allocation"]));
        assert_eq!(c.option_reply().1, NBD_REP_ERR_UNKNOWN);
    }
    // The connection is still in the handshake: a known name works.
    assert_eq!(c.go("b").0, B_BYTES);
    // NBD_OPT_EXPORT_NAME has no error reply: the server closes.
    let mut c = pool.raw();
    c.send_option(NBD_OPT_EXPORT_NAME, b"zz");
    assert!(c.is_closed());
}

#[test]
fn the_default_export_is_the_one_the_set_names() {
    let pool = Pool::start();
    pool.set.set_default(Some("b"));
    let client = Client::connect(&pool.uri("")).unwrap();
    assert_eq!(client.size_bytes(), B_BYTES);
    let mut c = pool.raw();
    let replies = info(&mut c, "");
    assert_eq!(replies[2].2, encode_info_string(NBD_INFO_NAME, "b"));
    let mut c = pool.raw();
    c.send_option(NBD_OPT_EXPORT_NAME, b"");
    assert_eq!(c.u64(), B_BYTES, "EXPORT_NAME \"\": the size of b");
}

#[test]
fn an_export_added_while_serving_is_reachable() {
    let pool = Pool::start();
    let err = Client::connect(&pool.uri("late")).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    let late = Arc::new(MemBackend::new(2 * C_BYTES, false));
    late.fill(0, b"late data");
    pool.set
        .insert("late", None, late.clone() as Arc<dyn Backend>);
    let client = Client::connect(&pool.uri("late")).unwrap();
    assert_eq!(client.size_bytes(), 2 * C_BYTES);
    let mut buf = [0u8; 9];
    client.read_at(0, &mut buf).unwrap();
    assert_eq!(&buf, b"late data");
}

#[test]
fn a_connection_keeps_its_export_after_it_is_removed() {
    let pool = Pool::start();
    let client = Client::connect(&pool.uri("a")).unwrap();
    let removed = pool.set.remove("a").expect("a was in the set");
    assert_eq!(pool.set.names(), vec!["b".to_string(), "c".to_string()]);
    let err = Client::connect(&pool.uri("a")).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    client.write_at(4096, &[0x77; 4096], true).unwrap();
    let mut buf = vec![0u8; 4096];
    client.read_at(4096, &mut buf).unwrap();
    assert_eq!(buf, vec![0x77; 4096]);
    assert_eq!(pool.a.contents(4096, 4096), vec![0x77; 4096]);
    // The server holds the backend until the connection closes.
    assert_eq!(Arc::strong_count(&pool.a), 3, "pool, removed, connection");
    drop(removed);
    drop(client);
    pool.server.shutdown();
    assert_eq!(Arc::strong_count(&pool.a), 1);
}

#[test]
fn metadata_contexts_hold_only_for_the_export_they_were_set_for() {
    let pool = Pool::start();
    for (set_for, go_to, expected_error) in [("a", "b", NBD_EINVAL), ("b", "b", 0)] {
        let mut c = pool.raw();
        c.send_option(NBD_OPT_STRUCTURED_REPLY, &[]);
        assert_eq!(c.option_reply().1, NBD_REP_ACK);
        c.structured = true;
        c.send_option(
            NBD_OPT_SET_META_CONTEXT,
            &meta_context_data(set_for, &["base:allocation"]),
        );
        let replies = c.option_replies();
        assert_eq!(replies.len(), 2, "{replies:?}");
        assert_eq!(replies[0].1, NBD_REP_META_CONTEXT);
        c.go(go_to);
        c.request(NBD_CMD_BLOCK_STATUS, 0, 1, B_BYTES - 4096, 4096, &[]);
        let (reply, _) = c.reply(0);
        assert_eq!(
            reply.error(),
            expected_error,
            "set for {set_for}: {reply:?}"
        );
    }
}

#[test]
fn nbdinfo_lists_every_export() {
    if !have_tool("nbdinfo", &["--version"]) {
        return;
    }
    let pool = Pool::start();
    let out = Command::new("nbdinfo")
        .args(["--list", "--json", &pool.uri("")])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let exports = json["exports"].as_array().unwrap();
    let listed: Vec<(&str, u64)> = exports
        .iter()
        .map(|e| {
            let name = e["export-name"].as_str().unwrap();
            (name, e["export-size"].as_u64().unwrap())
        })
        .collect();
    assert_eq!(listed, vec![("a", A_BYTES), ("b", B_BYTES), ("c", C_BYTES)]);
    assert_eq!(exports[0]["description"], "volume a");
}
