//! Where requests run: a client at queue depth 1 has its small READs and
//! WRITEs run on the connection's own thread (no hand-off to a worker, no
//! wake-up), while requests that arrive together go to the workers so the
//! connection goes on reading.
mod common;

use common::client::Client;
use common::{config, pattern, MemBackend, TestServer};
use cvol_nbd::proto::*;
use cvol_nbd::ServerConfig;
use std::io::Write;

const SIZE_BYTES: u64 = 8 * 1024 * 1024;

fn threads(ts: &TestServer) -> Vec<String> {
    std::mem::take(&mut *ts.backend.threads.lock().unwrap())
}

#[test]
fn requests_one_at_a_time_run_on_the_connection_thread() {
    let cfg = ServerConfig {
        max_request_bytes: 1 << 20,
        ..config()
    };
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false), cfg);
    let mut c = Client::ready(&ts, true);
    for i in 0..20u64 {
        let data = pattern(4096, i as u8);
        assert_eq!(c.write(2 * i, i * 4096, &data), 0);
        assert_eq!(c.read(2 * i + 1, i * 4096, 4096).unwrap(), data);
    }
    let names = threads(&ts);
    assert_eq!(names.len(), 40);
    assert!(
        names.iter().all(|n| n.starts_with("nbd-conn-")),
        "requests at queue depth 1 ran on {names:?}"
    );
    // A request above the inline size goes to a worker.
    assert!(c.read(100, 0, 256 * 1024 + 4096).is_ok());
    let names = threads(&ts);
    assert!(
        names.iter().all(|n| n.starts_with("nbd-worker-")),
        "{names:?}"
    );
}

#[test]
fn requests_sent_together_go_to_the_workers() {
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false), config());
    let mut c = Client::ready(&ts, true);
    assert_eq!(c.write(1, 0, &pattern(64 * 4096, 9)), 0);
    threads(&ts);
    // 32 READs in one send: the first is read with the rest buffered.
    let mut burst = Vec::new();
    for i in 0..32u64 {
        burst.extend(Client::header(NBD_CMD_READ, 0, 100 + i, i * 4096, 4096));
    }
    c.s.write_all(&burst).unwrap();
    let mut handles: Vec<u64> = (0..32).map(|_| c.reply_one(4096).0).collect();
    handles.sort_unstable();
    assert_eq!(handles, (100..132).collect::<Vec<_>>());
    let names = threads(&ts);
    assert_eq!(names.len(), 32);
    let on_workers = names
        .iter()
        .filter(|n| n.starts_with("nbd-worker-"))
        .count();
    assert!(
        on_workers >= 31,
        "only {on_workers} of 32 pipelined reads ran on workers: {names:?}"
    );
}
