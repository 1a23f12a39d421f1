//! Unit tests of the client: URI parsing, the payload limit, `Send + Sync`.

use super::handshake::{max_payload, BlockSize};
use super::uri::{parse_uri, Endpoint, Target, ACCEPTED_FORMS};
use super::*;

fn tcp(host: &str, port: u16, export: &str) -> Target {
    Target {
        endpoint: Endpoint::Tcp {
            host: host.into(),
            port,
        },
        export: export.into(),
    }
}

#[test]
fn tcp_uris() {
    let ok = |uri: &str| parse_uri(uri).unwrap();
    assert_eq!(ok("nbd://h"), tcp("h", 10809, ""));
    assert_eq!(ok("nbd://h/"), tcp("h", 10809, ""));
    assert_eq!(ok("nbd://h:1234/disk"), tcp("h", 1234, "disk"));
    assert_eq!(ok("nbd://[::1]/a%20b"), tcp("::1", 10809, "a b"));
    assert_eq!(ok("nbd://[::1]:99"), tcp("::1", 99, ""));
    assert_eq!(ok("nbd://127.0.0.1:5/x/y"), tcp("127.0.0.1", 5, "x/y"));
    for bad in [
        "nbd://",
        "nbd://:80",
        "nbd://h:port",
        "nbd://h:99999",
        "nbd://[::1",
        "nbd://[::1]x",
        "nbd://h/x?tls=on",
        "nbd://u@h/",
        "nbd://h/%zz",
        "nbd://h/%00",
        "nbds://h/",
        "http://h/",
        "",
    ] {
        let e = parse_uri(bad).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{bad}");
        assert!(e.to_string().contains(ACCEPTED_FORMS), "{e}");
    }
}

#[test]
fn unix_uris() {
    let t = parse_uri("nbd+unix:///?socket=/tmp/s.sock").unwrap();
    assert_eq!(t.endpoint, Endpoint::Unix("/tmp/s.sock".into()));
    assert_eq!(t.export, "");
    let t = parse_uri("nbd+unix:///disk?socket=/tmp/a%20b").unwrap();
    assert_eq!(t.endpoint, Endpoint::Unix("/tmp/a b".into()));
    assert_eq!(t.export, "disk");
    let t = parse_uri("nbd+unix://?socket=s").unwrap();
    assert_eq!(t.endpoint, Endpoint::Unix("s".into()));
    for bad in [
        "nbd+unix:///disk",
        "nbd+unix:///disk?socket=",
        "nbd+unix://host/disk?socket=/s",
        "nbd+unix:///?socket=/s&tls=on",
        "nbd+unix:///?sock=/s",
    ] {
        let e = parse_uri(bad).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{bad}");
        assert!(e.to_string().contains(bad), "{e}");
    }
}

#[test]
fn payload_limit_follows_block_sizes() {
    let bs = |minimum, maximum| Some(BlockSize { minimum, maximum });
    assert_eq!(max_payload(None), MAX_REQUEST_BYTES);
    assert_eq!(max_payload(bs(1, u32::MAX)), MAX_REQUEST_BYTES);
    assert_eq!(max_payload(bs(1, 65536)), 65536);
    assert_eq!(max_payload(bs(512, 1000)), 512);
    assert_eq!(max_payload(bs(4096, 100)), 4096);
    assert_eq!(max_payload(bs(0, 0)), 1);
}

#[test]
fn client_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Client>();
}
