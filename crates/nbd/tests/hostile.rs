//! Hostile clients at the edge: malformed input of every kind,
//! huge lengths, clients that stop reading or disconnect mid-request,
//! thousands of connections opened and dropped, and the memory and thread
//! bounds that must hold meanwhile. Complements `raw.rs` (which covers the
//! basic malformed messages); every test here keeps a well-behaved client
//! working while the hostile ones do their worst. The table of hostile
//! handshake messages is in `hostile/handshake_cases.rs`.

mod common;
#[path = "hostile/handshake_cases.rs"]
mod handshake_cases;

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::client::{Client, CLIENT_FLAGS};
use common::{config, pattern, MemBackend, TestServer, MAX_REQUEST_BYTES};
use cvol_nbd::proto::*;
use cvol_nbd::test_util::{go_data, option_header};
use cvol_nbd::ServerConfig;
use handshake_cases::{name_and_info_cases, option_cases, structured_cases, Case, Expect};

/// Counts live heap bytes of the whole test process (server and clients),
/// so memory bounds are checked exactly rather than through RSS.
struct CountingAlloc;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);
static PEAK_BYTES: AtomicUsize = AtomicUsize::new(0);
/// Live allocations per size class (class `k`: sizes in [2^(k-1), 2^k)),
/// so that a failed heap bound can say which sizes stayed.
static LIVE_BY_CLASS: [AtomicUsize; 48] = [const { AtomicUsize::new(0) }; 48];

fn class(size: usize) -> usize {
    (usize::BITS - size.leading_zeros()).min(47) as usize
}

fn count_alloc(size: usize) {
    let live = LIVE_BYTES.fetch_add(size, Ordering::Relaxed) + size;
    PEAK_BYTES.fetch_max(live, Ordering::Relaxed);
    LIVE_BY_CLASS[class(size)].fetch_add(1, Ordering::Relaxed);
}

fn count_free(size: usize) {
    LIVE_BYTES.fetch_sub(size, Ordering::Relaxed);
    LIVE_BY_CLASS[class(size)].fetch_sub(1, Ordering::Relaxed);
}

/// Live allocations per size class now.
fn live_by_class() -> Vec<usize> {
    LIVE_BY_CLASS
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .collect()
}

/// The size classes whose live allocations grew from `before` to `after`:
/// "<=SIZE: +N" each.
fn classes_grown(before: &[usize], after: &[usize]) -> String {
    (before.iter().zip(after).enumerate())
        .filter(|(_, (b, a))| a > b)
        .map(|(k, (b, a))| format!("<{}: +{}", 1u64 << k, a - b))
        .collect::<Vec<_>>()
        .join(", ")
}

// SAFETY: forwards to the system allocator, only counting sizes.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            count_alloc(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            count_alloc(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        count_free(layout.size());
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            count_free(layout.size());
            count_alloc(new_size);
        }
        p
    }
}

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Tests here measure process-wide memory and threads: they run one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A line of /proc/self/status, e.g. "Threads" or "VmRSS" (first number).
fn proc_status(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(&format!("{key}:")))
        .unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Polls `cond` (generous limit, only to turn a hang into a failure).
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

const SIZE_BYTES: u64 = 8 * 1024 * 1024;

/// One write + read-back round trip of a well-behaved client, with data
/// that depends on `round` so a stale or misplaced block is caught.
fn round_trip(c: &mut Client, round: u64) {
    let data = pattern(4096, round as u8);
    let offset = (round % 256) * 4096;
    assert_eq!(c.write(2 * round, offset, &data), 0, "round {round}");
    assert_eq!(
        c.read(2 * round + 1, offset, 4096).unwrap(),
        data,
        "round {round}"
    );
}

/// Regression: a client that pipelines reads and never reads the replies
/// used to pin every worker in a blocking send (each waiting for the
/// connection's write lock) until the 60 s send timeout, stalling every
/// other client of the server.
#[test]
fn regression_client_that_never_reads_replies_does_not_stall_other_clients() {
    let _serial = serial();
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false), config());
    let mut good = Client::ready(&ts, true);
    let mut stuck = Client::ready(&ts, true);
    // 64 reads of 256 KiB: 16 MiB of replies, far beyond any socket buffer.
    let mut burst = Vec::new();
    for h in 0..64u64 {
        burst.extend(Client::header(NBD_CMD_READ, 0, h, 0, MAX_REQUEST_BYTES));
    }
    stuck.s.write_all(&burst).unwrap();
    // Give the workers time to pick up the stuck client's reads.
    std::thread::sleep(Duration::from_millis(300));
    for round in 0..20 {
        round_trip(&mut good, round);
    }
    // The stuck client is still connected: the good client did not merely
    // wait for the server to give up on it.
    assert_eq!(ts.server.connection_count(), 2);
    // And its replies are intact when it finally reads them.
    let mut handles: Vec<u64> = (0..64)
        .map(|_| {
            let (h, error, data) = stuck.reply_one(0);
            assert_eq!((error, data.len()), (0, MAX_REQUEST_BYTES as usize));
            h
        })
        .collect();
    handles.sort();
    assert_eq!(handles, (0..64).collect::<Vec<_>>());
}

/// Sends one hostile message on a new connection (after negotiating
/// structured replies if `structured`) and checks what the server did.
fn send_hostile(ts: &TestServer, structured: bool, (what, bytes, expect): &Case) {
    let mut c = Client::connect(ts);
    c.greet(CLIENT_FLAGS);
    if structured {
        c.send_option(NBD_OPT_STRUCTURED_REPLY, &[]);
        assert_eq!(c.option_reply().1, NBD_REP_ACK);
    }
    c.s.write_all(bytes).unwrap();
    match expect {
        Expect::Closed => assert!(c.is_closed(), "{what}: not closed"),
        Expect::Reply(t) => {
            assert_eq!(c.option_reply().1, *t, "{what}");
            // Still in the handshake: it can go on to transmission.
            c.go("");
            c.structured = structured;
            assert_eq!(c.read(1, 0, 8).unwrap().len(), 8, "{what}");
        }
    }
}

/// Every malformed handshake message after the greeting, one connection
/// each; the server answers or closes as the spec says, and a client that
/// connected before keeps working after each.
#[test]
fn handshake_malformed_messages() {
    let _serial = serial();
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false), config());
    let mut good = Client::ready(&ts, true);
    let opt = option_header;
    let mut cases = option_cases();
    cases.extend(name_and_info_cases());
    let mut round = 0;
    for (structured, list) in [(false, cases), (true, structured_cases())] {
        for case in &list {
            send_hostile(&ts, structured, case);
            round += 1;
            round_trip(&mut good, round);
        }
    }
    // Truncated messages: the client vanishes mid-header and mid-payload.
    for cut in [1, 8, 15, 16 + 3] {
        let mut c = Client::connect(&ts);
        c.greet(CLIENT_FLAGS);
        let mut m = opt(NBD_OPT_GO, 6);
        m.extend_from_slice(&go_data("", &[]));
        c.s.write_all(&m[..cut]).unwrap();
        drop(c);
        round += 1;
        round_trip(&mut good, round);
    }
    // Too many options: the 257th is never answered, the connection closes.
    let mut c = Client::connect(&ts);
    c.greet(CLIENT_FLAGS);
    let mut burst = Vec::new();
    for _ in 0..300 {
        burst.extend(opt(4242, 0));
    }
    c.s.write_all(&burst).unwrap();
    for _ in 0..256 {
        assert_eq!(c.option_reply().1, NBD_REP_ERR_UNSUP);
    }
    assert!(c.is_closed());
    ts.wait_for_connections(1);
    round_trip(&mut good, round + 1);
}

/// Regression: the handshake had only a per-read timeout (30 s), so a
/// client trickling one byte at a time could hold a connection slot (of
/// `max_connections`) forever. Now the whole handshake has a deadline.
#[test]
fn regression_handshake_that_trickles_bytes_is_cut_off_at_the_deadline() {
    let _serial = serial();
    let ts = TestServer::start(
        MemBackend::new(SIZE_BYTES, false),
        ServerConfig {
            handshake_timeout: Duration::from_millis(500),
            ..config()
        },
    );
    let mut c = Client::connect(&ts);
    c.greet(CLIENT_FLAGS);
    // 1000 options' worth of bytes, one every 20 ms (well inside any
    // per-read timeout): without a deadline this runs its 20 s course.
    let bytes: Vec<u8> = (0..1000).flat_map(|_| option_header(4242, 0)).collect();
    let mut closed = false;
    for b in bytes.chunks(1) {
        if c.s.write_all(b).is_err() {
            closed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        if ts.server.connection_count() == 0 {
            closed = true;
            break;
        }
    }
    assert!(closed, "a trickling handshake was never cut off");
    ts.wait_for_connections(0);
    // A normal handshake still fits easily.
    let mut good = Client::ready(&ts, true);
    round_trip(&mut good, 1);
}

/// One connection of the malformed-request sweep and its next handle.
struct Sweep {
    c: Client,
    handle: u64,
}

impl Sweep {
    /// Sends one request (and `payload`), expects `error` in its reply, then
    /// checks the connection is still usable: a write and a read back.
    fn expect_error(
        &mut self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
        error: u32,
    ) {
        self.handle += 1;
        let handle = self.handle;
        let mut m = Client::header(command, flags, handle, offset, length);
        m.extend_from_slice(payload);
        self.c.s.write_all(&m).unwrap();
        let (h, e, _) = self.c.reply_one(0);
        assert_eq!(
            (h, e),
            (handle, error),
            "cmd {command} flags {flags:#x} off {offset} len {length}"
        );
        let data = pattern(512, handle as u8);
        self.handle += 1;
        assert_eq!(self.c.write(self.handle, 4096, &data), 0);
        self.handle += 1;
        assert_eq!(self.c.read(self.handle, 4096, 512).unwrap(), data);
    }
}

/// Every unknown command type, and every single flag bit a command does
/// not accept.
fn sweep_commands_and_flags(s: &mut Sweep, structured: bool) {
    for command in (8..=16).chain([0x100, 0x7fff, 0xffff]) {
        s.expect_error(command, 0, 0, 0, &[], NBD_EINVAL);
    }
    // Flags: every single bit a command does not accept.
    let accepted: [(u16, u16); 7] = [
        (
            NBD_CMD_READ,
            NBD_CMD_FLAG_FUA | if structured { NBD_CMD_FLAG_DF } else { 0 },
        ),
        (NBD_CMD_WRITE, NBD_CMD_FLAG_FUA),
        (NBD_CMD_FLUSH, NBD_CMD_FLAG_FUA),
        (NBD_CMD_TRIM, NBD_CMD_FLAG_FUA),
        (NBD_CMD_CACHE, NBD_CMD_FLAG_FUA),
        (
            NBD_CMD_WRITE_ZEROES,
            NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FAST_ZERO,
        ),
        (NBD_CMD_DISC, NBD_CMD_FLAG_FUA),
    ];
    for (command, ok) in accepted {
        for bit in 0..16 {
            let flag = 1u16 << bit;
            if ok & flag != 0 {
                continue;
            }
            let payload = if command == NBD_CMD_WRITE {
                vec![9u8; 100]
            } else {
                Vec::new()
            };
            let length = payload.len().max(1) as u32;
            s.expect_error(command, flag, 0, length, &payload, NBD_EINVAL);
        }
    }
}

/// Lengths beyond the limit, offsets overflowing u64 or past the end, for
/// every command with a range.
fn sweep_lengths_and_offsets(s: &mut Sweep) {
    // Lengths beyond the limit (a WRITE's payload is consumed).
    let max = MAX_REQUEST_BYTES;
    s.expect_error(NBD_CMD_READ, 0, 0, max + 1, &[], NBD_EINVAL);
    s.expect_error(NBD_CMD_READ, 0, 0, u32::MAX, &[], NBD_EINVAL);
    s.expect_error(NBD_CMD_CACHE, 0, 0, u32::MAX, &[], NBD_EINVAL);
    s.expect_error(
        NBD_CMD_WRITE,
        0,
        0,
        2 * max,
        &vec![1; 2 * max as usize],
        NBD_EINVAL,
    );
    s.expect_error(NBD_CMD_TRIM, 0, 0, u32::MAX, &[], NBD_EINVAL);
    s.expect_error(NBD_CMD_WRITE_ZEROES, 0, 0, u32::MAX, &[], NBD_ENOSPC);
    // Offsets: overflow and past the end, for every command with a range.
    for offset in [u64::MAX, u64::MAX - 10, SIZE_BYTES, SIZE_BYTES + 1, 1 << 63] {
        s.expect_error(NBD_CMD_READ, 0, offset, 512, &[], NBD_EINVAL);
        s.expect_error(NBD_CMD_WRITE, 0, offset, 512, &[7; 512], NBD_ENOSPC);
        s.expect_error(NBD_CMD_TRIM, 0, offset, 512, &[], NBD_EINVAL);
        s.expect_error(NBD_CMD_CACHE, 0, offset, 512, &[], NBD_EINVAL);
        s.expect_error(NBD_CMD_WRITE_ZEROES, 0, offset, 512, &[], NBD_ENOSPC);
    }
    // In range at the start, overflowing at the end.
    s.expect_error(NBD_CMD_TRIM, 0, SIZE_BYTES - 1, 2, &[], NBD_EINVAL);
    s.expect_error(NBD_CMD_CACHE, 0, SIZE_BYTES - 1, 2, &[], NBD_EINVAL);
}

/// Malformed requests in transmission, on one connection that must stay
/// usable after every one (simple and structured replies): every unknown
/// command type, every flag a command does not accept, lengths beyond the
/// limit, offset + length overflowing u64 or past the end, for every command.
#[test]
fn transmission_malformed_requests_sweep() {
    let _serial = serial();
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false), config());
    for structured in [false, true] {
        let c = Client::ready(&ts, structured);
        let mut s = Sweep { c, handle: 0 };
        sweep_commands_and_flags(&mut s, structured);
        sweep_lengths_and_offsets(&mut s);
        let c = &mut s.c;
        // Nothing above reached the backend as a write beyond 4096..4608.
        assert!(ts.backend.contents(0, 4096).iter().all(|&b| b == 0));
        // A WRITE announcing more than the discard cap closes the connection.
        c.request(NBD_CMD_WRITE, 0, 1, 0, u32::MAX, &[]);
        assert!(c.is_closed());
    }
    ts.wait_for_connections(0);
}

/// A WRITE whose payload never arrives blocks only its own connection;
/// the other client works, the stalled one's partial data is never
/// applied, and a server shutdown is not held up by it.
#[test]
fn write_payload_that_never_arrives_blocks_only_its_connection() {
    let _serial = serial();
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false), config());
    let mut good = Client::ready(&ts, false);
    let mut stalled = Vec::new();
    for structured in [false, true] {
        let mut c = Client::ready(&ts, structured);
        let mut m = Client::header(NBD_CMD_WRITE, 0, 1, 1 << 20, 65536);
        m.extend_from_slice(&[0xee; 1000]);
        c.s.write_all(&m).unwrap();
        stalled.push(c);
    }
    for round in 0..50 {
        round_trip(&mut good, round);
    }
    assert_eq!(ts.server.connection_count(), 3);
    assert_eq!(ts.backend.contents(1 << 20, 1000), vec![0; 1000]);
    // Shutdown wakes the stalled readers; it completes (run in a thread so
    // that a hang becomes a failure).
    let (tx, rx) = std::sync::mpsc::channel();
    let server = Arc::new(ts);
    let s2 = Arc::clone(&server);
    std::thread::spawn(move || {
        s2.server.shutdown();
        tx.send(()).unwrap();
    });
    rx.recv_timeout(Duration::from_secs(20))
        .expect("shutdown hung on a stalled WRITE payload");
    assert_eq!(server.server.connection_count(), 0);
    assert_eq!(server.backend.contents(1 << 20, 1000), vec![0; 1000]);
    for mut c in stalled {
        assert!(c.is_closed());
    }
}

/// Clients that vanish while their replies are being sent (large READ
/// replies cut after a few bytes, simple and structured) end only their
/// own connection.
#[test]
fn client_disconnects_mid_reply() {
    let _serial = serial();
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false), config());
    const FAR: u64 = 4 * 1024 * 1024; // beyond round_trip's blocks
    ts.backend
        .fill(FAR, &pattern(MAX_REQUEST_BYTES as usize, 3));
    let mut good = Client::ready(&ts, true);
    for i in 0..40u64 {
        let mut c = Client::ready(&ts, i % 2 == 0);
        let mut burst = Vec::new();
        for h in 0..16 {
            burst.extend(Client::header(NBD_CMD_READ, 0, h, FAR, MAX_REQUEST_BYTES));
        }
        c.s.write_all(&burst).unwrap();
        let cut = 1 + (i as usize * 7919) % 100_000;
        let mut some = vec![0u8; cut];
        c.s.read_exact(&mut some).unwrap();
        drop(c);
        round_trip(&mut good, i);
    }
    ts.wait_for_connections(1);
    let back = good.read(1000, FAR, MAX_REQUEST_BYTES).unwrap();
    assert!(
        back == pattern(MAX_REQUEST_BYTES as usize, 3),
        "data changed"
    );
}

/// One hostile connection: how far it gets before it vanishes.
fn hostile_connection(path: &std::path::Path, kind: u64) {
    let Ok(mut s) = UnixStream::connect(path) else {
        return;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(20)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(20)));
    if kind == 0 {
        return; // connect and drop
    }
    let mut greeting = [0u8; 18];
    if s.read_exact(&mut greeting).is_err() {
        return; // refused at the connection limit
    }
    let flags = (NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).to_be_bytes();
    let mut go = option_header(NBD_OPT_GO, 6);
    go.extend_from_slice(&go_data("", &[]));
    match kind {
        1 => {} // after the greeting
        2 => {
            let _ = s.write_all(&flags);
            let _ = s.write_all(&go[..10]); // mid-option
        }
        3 => {
            let _ = s.write_all(&[0xff; 4]); // bad client flags
        }
        _ => {
            let _ = s.write_all(&flags);
            let _ = s.write_all(&go);
            // Skip the option replies: INFO export, INFO block size, ACK.
            let mut replies = [0u8; 20 + 12 + 20 + 14 + 20];
            if s.read_exact(&mut replies).is_err() {
                return;
            }
            let request = match kind {
                4 => Client::header(NBD_CMD_READ, 0, 1, 0, 4096)[..13].to_vec(), // mid-header
                5 => {
                    let mut m = Client::header(NBD_CMD_WRITE, 0, 1, 0, 65536);
                    m.extend_from_slice(&[0xee; 100]); // mid-payload
                    m
                }
                6 => (0..8)
                    .flat_map(|h| Client::header(NBD_CMD_READ, 0, h, 0, 65536))
                    .collect(),
                7 => vec![0xde; 28], // bad request magic
                _ => Client::header(NBD_CMD_WRITE, 0, 1, 0, u32::MAX), // beyond the cap
            };
            let _ = s.write_all(&request);
        }
    }
}

fn live_bytes() -> usize {
    LIVE_BYTES.load(Ordering::Relaxed)
}

/// Thousands of connections opened and dropped (at every stage of the
/// handshake and of a request) while one client keeps writing and reading
/// back: it never sees an error, and threads and heap return to their
/// starting level afterwards.
#[test]
fn thousands_of_connections_dropped_while_a_client_works() {
    let _serial = serial();
    const CONNECTIONS: u64 = 3000;
    const CHURN_THREADS: u64 = 6;
    // Without the backend's call log: it keeps a line and a thread name per
    // call, so the good client's rounds (more of them on a busy machine)
    // grew the heap past the bound with no server memory at all.
    let backend = MemBackend::new(SIZE_BYTES, false).without_log();
    let ts = TestServer::start(backend, config());
    let mut good = Client::ready(&ts, true);
    round_trip(&mut good, 0);
    let threads_before = proc_status("Threads");
    let live_before = live_bytes();
    let classes_before = live_by_class();
    let rss_before_kib = proc_status("VmRSS");
    let path = ts.socket_path.clone();
    let done = Arc::new(AtomicUsize::new(0));
    let churn: Vec<_> = (0..CHURN_THREADS)
        .map(|t| {
            let path = path.clone();
            let done = Arc::clone(&done);
            std::thread::spawn(move || {
                for i in (t..CONNECTIONS).step_by(CHURN_THREADS as usize) {
                    hostile_connection(&path, i % 9);
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let mut round = 1;
    while done.load(Ordering::Relaxed) < CONNECTIONS as usize {
        round_trip(&mut good, round);
        round += 1;
    }
    for t in churn {
        t.join().unwrap();
    }
    ts.wait_for_connections(1);
    for _ in 0..20 {
        round_trip(&mut good, round);
        round += 1;
    }
    assert!(round > 20, "the good client made progress throughout");
    // Every connection thread (reader and reply writer) is gone again.
    wait_until("connection threads to exit", || {
        proc_status("Threads") <= threads_before + 1
    });
    // Heap back to where it was (some slack for lazily grown buffers: a
    // few KiB seen), although 3000 connections each had buffers and
    // threads.
    let live_after = live_bytes();
    assert!(
        live_after <= live_before + 256 * 1024,
        "heap grew from {live_before} to {live_after} bytes (live allocations by size: {})",
        classes_grown(&classes_before, &live_by_class())
    );
    let rss_after_kib = proc_status("VmRSS");
    eprintln!(
        "{CONNECTIONS} connections, {round} good rounds; heap {live_before} -> {live_after} B, \
         RSS {rss_before_kib} -> {rss_after_kib} KiB, threads {threads_before} -> {}, refused {}",
        proc_status("Threads"),
        ts.server.refused_connection_count()
    );
}

/// Beyond `max_connections`, every new connection is closed at once and
/// counted; the open ones keep working and a slot frees up when one closes.
#[test]
fn connections_beyond_the_limit_are_refused_and_counted() {
    let _serial = serial();
    let ts = TestServer::start(
        MemBackend::new(SIZE_BYTES, false),
        ServerConfig {
            max_connections: 8,
            ..config()
        },
    );
    let mut good = Client::ready(&ts, true);
    let idle: Vec<Client> = (0..7).map(|_| Client::ready(&ts, false)).collect();
    let threads_full = proc_status("Threads");
    for i in 0..500 {
        let mut c = Client::connect(&ts);
        assert!(c.is_closed(), "connection {i} beyond the limit was served");
        if i % 50 == 0 {
            round_trip(&mut good, i);
        }
    }
    wait_until("500 refusals counted", || {
        ts.server.refused_connection_count() == 500
    });
    assert_eq!(ts.server.connection_count(), 8);
    assert!(proc_status("Threads") <= threads_full + 1);
    drop(idle);
    ts.wait_for_connections(1);
    let mut again = Client::ready(&ts, false);
    assert_eq!(again.read(1, 0, 1).unwrap().len(), 1);
    round_trip(&mut good, 1000);
}

/// Requests in flight per connection in the budget test
/// (= `max_inflight_per_conn`).
const BUDGET_REQUESTS: u64 = 64;
/// `max_buffered_bytes` of the budget test.
const BUDGET_LIMIT: u64 = 4 * 1024 * 1024;

/// Phase 1 of the budget test: every client pipelines maximum-size WRITEs
/// into a backend that holds them; returns the clients once every write
/// completed, and the heap's peak above its level before.
fn pipelined_writes_into_a_held_backend(
    ts: &TestServer,
    clients: Vec<Client>,
    payload: &Arc<Vec<u8>>,
    live_before: usize,
) -> (Vec<Client>, usize) {
    let max = MAX_REQUEST_BYTES as usize;
    // Phase 1: writes into a backend that holds them (released on any
    // exit, so that a failed assertion cannot leave shutdown hanging).
    struct Unhold(Arc<MemBackend>);
    impl Drop for Unhold {
        fn drop(&mut self) {
            self.0.hold_writes(false);
        }
    }
    let _unhold = Unhold(Arc::clone(&ts.backend));
    ts.backend.hold_writes(true);
    let writers: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, mut c)| {
            let payload = Arc::clone(payload);
            std::thread::spawn(move || {
                for h in 0..BUDGET_REQUESTS {
                    let offset = ((i as u64 * BUDGET_REQUESTS + h) % 128) * max as u64;
                    let header = Client::header(NBD_CMD_WRITE, 0, h, offset, max as u32);
                    c.s.write_all(&header).unwrap();
                    c.s.write_all(&payload).unwrap();
                }
                for _ in 0..BUDGET_REQUESTS {
                    let (_, error, _) = c.reply_one(0);
                    assert_eq!(error, 0);
                }
                c
            })
        })
        .collect();
    // Requests this large come from the shared half of the budget (the
    // other half is set aside as every connection slot's floor).
    wait_until("the write budget to fill", || {
        ts.server.buffered_payload_bytes() + max as u64 > BUDGET_LIMIT / 2
    });
    std::thread::sleep(Duration::from_millis(300)); // let any excess show
    let peak_writes = PEAK_BYTES.load(Ordering::Relaxed) - live_before;
    let buffered_writes = ts.server.buffered_payload_bytes();
    ts.backend.hold_writes(false);
    assert!(
        buffered_writes <= BUDGET_LIMIT,
        "{buffered_writes} bytes buffered"
    );
    let clients: Vec<Client> = writers.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(ts.backend.contents(0, max) == **payload);
    (clients, peak_writes)
}

/// Phase 2 of the budget test: every client pipelines maximum-size READs
/// and reads none of the replies until the budget is full; returns the
/// heap's peak above its level before.
fn pipelined_reads_nobody_reads(
    ts: &TestServer,
    mut clients: Vec<Client>,
    payload: &Arc<Vec<u8>>,
) -> usize {
    let max = MAX_REQUEST_BYTES as usize;
    // Phase 2: reads whose replies nobody reads yet.
    PEAK_BYTES.store(live_bytes(), Ordering::Relaxed);
    let live_before_reads = live_bytes();
    for c in &mut clients {
        let burst: Vec<u8> = (0..BUDGET_REQUESTS)
            .flat_map(|h| Client::header(NBD_CMD_READ, 0, h, 0, max as u32))
            .collect();
        c.s.write_all(&burst).unwrap();
    }
    wait_until("the read budget to fill", || {
        ts.server.buffered_payload_bytes() + max as u64 > BUDGET_LIMIT / 2
    });
    std::thread::sleep(Duration::from_millis(300));
    let peak_reads = PEAK_BYTES.load(Ordering::Relaxed) - live_before_reads;
    // Each client now reads its replies (concurrently, as real clients
    // do: replies parked for one connection hold budget the others need).
    let readers: Vec<_> = clients
        .into_iter()
        .map(|mut c| {
            let payload = Arc::clone(payload);
            std::thread::spawn(move || {
                for _ in 0..BUDGET_REQUESTS {
                    let (_, error, data) = c.reply_one(max);
                    assert_eq!(error, 0);
                    assert!(data == *payload, "READ returned wrong data");
                }
            })
        })
        .collect();
    for r in readers {
        r.join().unwrap();
    }
    peak_reads
}

/// Many connections pipelining maximum-size WRITEs into a stalled backend,
/// then READs whose replies they do not read: the heap held by the server
/// stays within `max_buffered_bytes` (not connections × per-connection
/// budget), and every request completes correctly once things move again.
#[test]
fn buffered_payload_is_bounded_server_wide() {
    let _serial = serial();
    const CONNS: usize = 12;
    let max = MAX_REQUEST_BYTES as usize;
    // Unbounded, the server would hold CONNS × 64 × 256 KiB = 192 MiB.
    // Without the call log, whose lines would count in the peak.
    let ts = TestServer::start(
        MemBackend::new(32 * 1024 * 1024, false).without_log(),
        ServerConfig {
            max_buffered_bytes: BUDGET_LIMIT,
            ..config()
        },
    );
    let payload: Arc<Vec<u8>> = Arc::new(pattern(max, 0x5a));
    let clients: Vec<Client> = (0..CONNS).map(|i| Client::ready(&ts, i % 2 == 0)).collect();
    let live_before = live_bytes();
    PEAK_BYTES.store(live_before, Ordering::Relaxed);

    let (clients, peak_writes) =
        pipelined_writes_into_a_held_backend(&ts, clients, &payload, live_before);
    let peak_reads = pipelined_reads_nobody_reads(&ts, clients, &payload);
    // Slack: request/reply headers, in-flight bookkeeping, 64 KiB read
    // buffers, a few reads a worker allocated before its reply waited.
    let bound = BUDGET_LIMIT as usize + 4 * max + 4 * 1024 * 1024;
    eprintln!(
        "peak heap above baseline: writes {peak_writes} B, reads {peak_reads} B (bound {bound})"
    );
    assert!(peak_writes <= bound, "writes held {peak_writes} bytes");
    assert!(peak_reads <= bound, "reads held {peak_reads} bytes");
    let mut good = Client::ready(&ts, true);
    round_trip(&mut good, 1);
}
