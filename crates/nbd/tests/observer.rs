//! `ServerConfig::observer` hears every dispatched request once its reply
//! is written (with the time since it was read) and every connection.
mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::client::Client;
use common::{config, pattern, MemBackend, TestServer};
use cvol_nbd::{CommandKind, ObserverHandle, RequestObserver, ServerConfig};

#[derive(Default)]
struct Heard {
    requests: Mutex<Vec<(CommandKind, Duration)>>,
    connections: Mutex<Vec<usize>>,
}

impl RequestObserver for Heard {
    fn request_done(&self, command: CommandKind, elapsed: Duration) {
        self.requests.lock().unwrap().push((command, elapsed));
    }
    fn connections(&self, open: usize) {
        self.connections.lock().unwrap().push(open);
    }
}

#[test]
fn the_observer_hears_requests_with_their_time_and_connections() {
    let heard = Arc::new(Heard::default());
    let backend = MemBackend::new(1 << 20, false);
    // Writes wait 50 ms in the backend: the time heard includes it.
    backend.hold_writes(true);
    let ts = TestServer::start(
        backend,
        ServerConfig {
            observer: Some(ObserverHandle(heard.clone())),
            ..config()
        },
    );
    let mut c = Client::ready(&ts, false);
    let releaser = {
        let backend = ts.backend.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            backend.hold_writes(false);
        })
    };
    assert_eq!(c.write(1, 0, &pattern(4096, 3)), 0);
    releaser.join().unwrap();
    assert_eq!(c.read(2, 0, 4096).unwrap(), pattern(4096, 3));
    drop(c);
    ts.wait_for_connections(0);
    let requests = heard.requests.lock().unwrap().clone();
    let kinds: Vec<_> = requests.iter().map(|r| r.0).collect();
    assert_eq!(kinds, [CommandKind::Write, CommandKind::Read]);
    assert!(requests[0].1 >= Duration::from_millis(40), "{requests:?}");
    assert_eq!(*heard.connections.lock().unwrap(), [1, 0]);
}
