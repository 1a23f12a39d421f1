//! Where requests run: a client at queue depth 1 has its small READs and
//! WRITEs run on the connection's own thread (no hand-off to a worker, no
//! wake-up), and so do small READs that arrive together while the
//! connection's reads are quick (in memory); WRITEs that arrive together,
//! and READs that wait for a device, go to the workers.
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

/// Sends `n` requests of `command` (4 KiB at 4 KiB steps from `first`)
/// in one write, so the first is read with the rest buffered, and returns
/// the threads they ran on.
fn burst(ts: &TestServer, c: &mut Client, command: u16, n: u64, first: u64) -> Vec<String> {
    threads(ts);
    let mut bytes = Vec::new();
    for i in 0..n {
        bytes.extend(Client::header(
            command,
            0,
            100 + i,
            (first + i) * 4096,
            4096,
        ));
        if command == NBD_CMD_WRITE {
            bytes.extend(pattern(4096, i as u8));
        }
    }
    c.s.write_all(&bytes).unwrap();
    let reply_bytes = if command == NBD_CMD_READ { 4096 } else { 0 };
    let mut handles: Vec<u64> = (0..n).map(|_| c.reply_one(reply_bytes).0).collect();
    handles.sort_unstable();
    assert_eq!(handles, (100..100 + n).collect::<Vec<_>>());
    let names = threads(ts);
    assert_eq!(names.len() as u64, n);
    names
}

fn on_workers(names: &[String]) -> usize {
    names
        .iter()
        .filter(|n| n.starts_with("nbd-worker-"))
        .count()
}

#[test]
fn writes_sent_together_go_to_the_workers() {
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false), config());
    let mut c = Client::ready(&ts, true);
    let names = burst(&ts, &mut c, NBD_CMD_WRITE, 32, 0);
    assert!(
        on_workers(&names) >= 31,
        "only {} of 32 pipelined writes ran on workers: {names:?}",
        on_workers(&names)
    );
}

#[test]
fn quick_reads_sent_together_run_on_the_connection_thread() {
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false), config());
    let mut c = Client::ready(&ts, true);
    assert_eq!(c.write(1, 0, &pattern(64 * 4096, 9)), 0);
    let names = burst(&ts, &mut c, NBD_CMD_READ, 32, 0);
    assert_eq!(on_workers(&names), 0, "{names:?}");
}

#[test]
fn reads_that_wait_go_to_the_workers() {
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false), config());
    let mut c = Client::ready(&ts, true);
    assert_eq!(c.write(1, 0, &pattern(64 * 4096, 9)), 0);
    // One read waits 5 ms (a device, not memory): the connection's next
    // reads are handed to the workers, which wait in parallel.
    *ts.backend.slow_read_offset.lock().unwrap() = Some(0);
    ts.backend
        .delay_ms
        .store(5, std::sync::atomic::Ordering::Relaxed);
    assert!(c.read(2, 0, 4096).is_ok());
    let names = burst(&ts, &mut c, NBD_CMD_READ, 8, 1);
    // The last may run inline all the same: read when the others had
    // replied, it was the only request in flight.
    assert!(on_workers(&names) >= 7, "{names:?}");
}

#[test]
fn quick_reads_go_to_the_workers_while_a_write_is_in_flight() {
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false), config());
    let mut c = Client::ready(&ts, true);
    assert_eq!(c.write(1, 0, &pattern(64 * 4096, 9)), 0);
    // A write held in the backend, then reads of other blocks: the reader
    // leaves them to the workers, so it goes on reading the client's next
    // writes while the workers compress.
    ts.backend.hold_writes(true);
    let mut bytes = Client::header(NBD_CMD_WRITE, 0, 50, 63 * 4096, 4096);
    bytes.extend(pattern(4096, 1));
    for i in 0..8u64 {
        bytes.extend(Client::header(NBD_CMD_READ, 0, 100 + i, i * 4096, 4096));
    }
    threads(&ts);
    c.s.write_all(&bytes).unwrap();
    let mut handles: Vec<u64> = (0..8).map(|_| c.reply_one(4096).0).collect();
    ts.backend.hold_writes(false);
    handles.push(c.reply_one(0).0);
    handles.sort_unstable();
    assert_eq!(handles, [50, 100, 101, 102, 103, 104, 105, 106, 107]);
    let names = threads(&ts);
    assert_eq!(on_workers(&names), 9, "{names:?}");
}

#[test]
fn a_flush_one_at_a_time_runs_on_the_connection_thread_and_one_with_requests_behind_on_a_flusher() {
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false), config());
    let mut c = Client::ready(&ts, true);
    // A database's commits: a write, then a flush, each after the reply
    // to the one before. Neither wakes another thread.
    for i in 0..10u64 {
        assert_eq!(c.write(2 * i, i * 4096, &pattern(4096, i as u8)), 0);
        c.request(NBD_CMD_FLUSH, 0, 2 * i + 1, 0, 0, &[]);
        assert_eq!(c.reply_one(0), (2 * i + 1, 0, Vec::new()));
    }
    let names = threads(&ts);
    assert_eq!(names.len(), 20, "{names:?}");
    assert!(
        names.iter().all(|n| n.starts_with("nbd-conn-")),
        "a write and a flush at queue depth 1 ran on {names:?}"
    );
    assert_eq!(
        ts.backend.flushes.load(std::sync::atomic::Ordering::SeqCst),
        10
    );
    // A flush with more requests behind it goes to a flusher: the reader
    // goes on reading them.
    let mut bytes = Client::header(NBD_CMD_FLUSH, 0, 200, 0, 0);
    for i in 0..8u64 {
        bytes.extend(Client::header(NBD_CMD_WRITE, 0, 100 + i, i * 4096, 4096));
        bytes.extend(pattern(4096, i as u8));
    }
    c.s.write_all(&bytes).unwrap();
    let mut handles: Vec<u64> = (0..9).map(|_| c.reply_one(0).0).collect();
    handles.sort_unstable();
    assert_eq!(handles, [100, 101, 102, 103, 104, 105, 106, 107, 200]);
    let names = threads(&ts);
    assert_eq!(names.len(), 9, "{names:?}");
    assert_eq!(
        names
            .iter()
            .filter(|n| n.starts_with("nbd-flusher-"))
            .count(),
        1,
        "{names:?}"
    );
}
