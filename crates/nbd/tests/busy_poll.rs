//! `ServerConfig::busy_poll`: a connection with nothing in flight watches
//! its socket for the next request before it sleeps; the window opens for
//! a client that sends one request after another, closes for one that
//! pauses, and is never used when off, when the gate is closed or when no
//! polling place is free.
mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::client::Client;
use common::{config, pattern, MemBackend, TestServer};
use cvol_nbd::{CommandKind, ObserverHandle, PollGate, RequestObserver, ServerConfig};

/// Every busy poll the server reports: (found a request, time polled).
#[derive(Default)]
struct Polls(Mutex<Vec<(bool, Duration)>>);

impl Polls {
    fn taken(&self) -> Vec<(bool, Duration)> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

impl RequestObserver for Polls {
    fn request_done(&self, _: CommandKind, _: Duration) {}
    fn connections(&self, _: usize) {}
    fn busy_poll(&self, found: bool, polled: Duration) {
        self.0.lock().unwrap().push((found, polled));
    }
}

fn server(busy_poll: Duration, threads: usize) -> (TestServer, Arc<Polls>) {
    server_with(busy_poll, threads, None)
}

fn server_with(
    busy_poll: Duration,
    threads: usize,
    busy_poll_gate: Option<PollGate>,
) -> (TestServer, Arc<Polls>) {
    let polls = Arc::new(Polls::default());
    let ts = TestServer::start(
        MemBackend::new(1 << 20, false),
        ServerConfig {
            observer: Some(ObserverHandle(polls.clone())),
            busy_poll,
            busy_poll_threads: threads,
            busy_poll_gate,
            ..config()
        },
    );
    (ts, polls)
}

/// One write and its read back, one request at a time.
fn write_and_read(c: &mut Client, i: u64) {
    let offset = (i % 64) * 4096;
    let data = pattern(4096, i as u8);
    assert_eq!(c.write(2 * i, offset, &data), 0);
    assert_eq!(c.read(2 * i + 1, offset, 4096).unwrap(), data);
}

#[test]
fn a_client_sending_back_to_back_is_polled_for_and_one_that_pauses_is_not() {
    let window = Duration::from_micros(500);
    let (ts, polls) = server(window, 4);
    let mut c = Client::ready(&ts, false);
    for i in 0..200 {
        write_and_read(&mut c, i);
    }
    let busy = polls.taken();
    let found = busy.iter().filter(|p| p.0).count();
    assert!(
        found > 0,
        "requests sent back to back were never found by polling ({} polls)",
        busy.len()
    );

    // A client that pauses 20 ms (forty windows) before every request: each
    // wait halves the window, so the polls stop after at most 10 halvings
    // (500 µs to under 1 µs), and none of them finds a request (unless the
    // server's thread is kept off the CPU for the whole pause).
    for i in 0..30 {
        std::thread::sleep(Duration::from_millis(20));
        let data = pattern(4096, i as u8);
        assert_eq!(c.write(1000 + 2 * i, 0, &data), 0);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(c.read(1001 + 2 * i, 0, 4096).unwrap(), data);
    }
    let paused = polls.taken();
    assert!(
        paused.len() <= 10,
        "the window did not close for a client that pauses: {} polls",
        paused.len()
    );
    assert!(paused.iter().all(|p| !p.0), "{paused:?}");

    // Back to back again: the first wait within the window's maximum opens it.
    for i in 0..200 {
        write_and_read(&mut c, i);
    }
    assert!(
        polls.taken().iter().any(|p| p.0),
        "the window did not reopen"
    );
    drop(c);
    ts.wait_for_connections(0);
}

#[test]
fn off_closed_by_the_gate_or_without_a_polling_place_the_reader_just_sleeps() {
    let window = Duration::from_micros(500);
    let gate = |open: bool| Some(PollGate(Arc::new(move || open)));
    for (busy_poll, threads, gate) in [
        (Duration::ZERO, 4, None),
        (window, 0, None),
        (window, 4, gate(false)),
    ] {
        let (ts, polls) = server_with(busy_poll, threads, gate);
        let mut c = Client::ready(&ts, false);
        for i in 0..100 {
            write_and_read(&mut c, i);
        }
        drop(c);
        ts.wait_for_connections(0);
        assert_eq!(
            polls.taken(),
            [],
            "busy_poll {busy_poll:?}, {threads} places"
        );
    }
    // The same client with the gate open is polled for.
    let (ts, polls) = server_with(window, 4, gate(true));
    let mut c = Client::ready(&ts, false);
    for i in 0..100 {
        write_and_read(&mut c, i);
    }
    assert!(!polls.taken().is_empty());
}
