//! Clients that hold what they get over TCP: a connection that never reads
//! the replies to its large READs, one that reads them slowly, hundreds of
//! idle and half-open connections from many addresses (Linux routes all of
//! 127.0.0.0/8 to the loopback device, so each test client can have an
//! address of its own). Meanwhile a well-behaved client must get every
//! reply within a bound, and a new one must still get in.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::FromRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cvol_nbd::proto::*;
use cvol_nbd::test_util::{go_data, option, MemBackend};
use cvol_nbd::{Backend, Server, ServerConfig};

/// Tests here open hundreds of sockets and threads: one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

const SIZE_BYTES: u64 = 16 * 1024 * 1024;
const MIB: u32 = 1024 * 1024;
/// The bound every reply of the well-behaved client must meet (the
/// machine running the tests may be small and shared: generous).
const REPLY_BOUND: Duration = Duration::from_secs(2);

struct TcpServer {
    server: Server,
    addr: SocketAddr,
}

fn start(config: ServerConfig) -> TcpServer {
    let backend = Arc::new(MemBackend::new(SIZE_BYTES, false));
    let server = Server::new(backend as Arc<dyn Backend>, config);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    server.serve_tcp(listener).unwrap();
    TcpServer { server, addr }
}

/// A TCP connection from `local` (any 127.x.y.z) to `server`; with
/// `rcvbuf`, a small receive buffer so that replies back up quickly.
fn connect_from(local: Ipv4Addr, server: SocketAddr, rcvbuf: Option<i32>) -> TcpStream {
    let to_sockaddr = |a: SocketAddrV4| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    let SocketAddr::V4(server) = server else {
        panic!("IPv4 server address expected")
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket calls on a descriptor this function owns; the
    // pointers describe live values of the sizes given.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", io::Error::last_os_error());
        let stream = TcpStream::from_raw_fd(fd);
        if let Some(bytes) = rcvbuf {
            let r = libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                (&bytes as *const i32).cast(),
                std::mem::size_of::<i32>() as libc::socklen_t,
            );
            assert_eq!(r, 0, "SO_RCVBUF: {}", io::Error::last_os_error());
        }
        let local = to_sockaddr(SocketAddrV4::new(local, 0));
        let r = libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len);
        assert_eq!(r, 0, "bind: {}", io::Error::last_os_error());
        let remote = to_sockaddr(server);
        let r = libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len);
        assert_eq!(r, 0, "connect: {}", io::Error::last_os_error());
        stream
    }
}

fn read_u32(s: &mut TcpStream) -> io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

/// Greeting, NBD_OPT_GO, simple replies; an error if the server closed
/// the connection instead (a refused connection).
fn handshake(s: &mut TcpStream) -> io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting)?;
    assert_eq!(&greeting[..8], &NBD_MAGIC.to_be_bytes());
    s.write_all(&(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).to_be_bytes())?;
    s.write_all(&option(NBD_OPT_GO, &go_data("", &[])))?;
    loop {
        let mut head = [0u8; 20];
        s.read_exact(&mut head)?;
        let reply_type = u32::from_be_bytes(head[12..16].try_into().unwrap());
        let length = u32::from_be_bytes(head[16..20].try_into().unwrap());
        let mut data = vec![0u8; length as usize];
        s.read_exact(&mut data)?;
        if reply_type == NBD_REP_ACK {
            return Ok(());
        }
        assert_eq!(reply_type, NBD_REP_INFO, "GO failed: {reply_type:#x}");
    }
}

fn connect_ready(local: Ipv4Addr, ts: &TcpServer, rcvbuf: Option<i32>) -> TcpStream {
    let mut s = connect_from(local, ts.addr, rcvbuf);
    handshake(&mut s).expect("handshake");
    s
}

fn request(command: u16, handle: u64, offset: u64, length: u32) -> Vec<u8> {
    encode_request_header(&RequestHeader {
        flags: 0,
        command,
        handle,
        offset,
        length,
    })
    .to_vec()
}

/// Reads one simple reply (with `data_bytes` of READ data): its handle.
fn simple_reply(s: &mut TcpStream, data_bytes: usize) -> io::Result<u64> {
    assert_eq!(read_u32(s)?, SIMPLE_REPLY_MAGIC);
    assert_eq!(read_u32(s)?, 0, "error reply");
    let mut handle = [0u8; 8];
    s.read_exact(&mut handle)?;
    let mut data = vec![0u8; data_bytes];
    s.read_exact(&mut data)?;
    Ok(u64::from_be_bytes(handle))
}

/// Pipelines `count` READs of `length` bytes.
fn pipeline_reads(s: &mut TcpStream, count: u64, length: u32) {
    let mut burst = Vec::new();
    for h in 0..count {
        let offset = (h * u64::from(length)) % (SIZE_BYTES - u64::from(length));
        burst.extend(request(NBD_CMD_READ, h, offset, length));
    }
    s.write_all(&burst).unwrap();
}

/// One 4 KiB WRITE and READ back; the time of each reply.
fn round_trip(s: &mut TcpStream, round: u64) -> [Duration; 2] {
    let data = vec![round as u8; 4096];
    let offset = (round % 512) * 4096;
    let started = Instant::now();
    let mut write = request(NBD_CMD_WRITE, 2 * round, offset, 4096);
    write.extend(&data);
    s.write_all(&write).unwrap();
    let what = |e: io::Error| format!("round {round}: no reply within the client's timeout: {e}");
    assert_eq!(simple_reply(s, 0).map_err(what).unwrap(), 2 * round);
    let wrote = started.elapsed();
    let started = Instant::now();
    s.write_all(&request(NBD_CMD_READ, 2 * round + 1, offset, 4096))
        .unwrap();
    assert_eq!(simple_reply(s, 4096).map_err(what).unwrap(), 2 * round + 1);
    [wrote, started.elapsed()]
}

/// Whether the server closed `s` (a read that times out: still open).
fn is_closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 4096];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => {
                return !matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                )
            }
        }
    }
}

/// Stops a hostile client thread when the test ends (also by a failed
/// assertion: the server's shutdown waits for its connection).
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

fn addr(a: u8, b: u8, c: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, a, b, c)
}

/// Reads `slow`'s replies at 160 KiB/s (16 KiB every 100 ms) until
/// `stop`; returns the socket.
fn read_slowly(mut slow: TcpStream, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<TcpStream> {
    std::thread::spawn(move || {
        let mut chunk = vec![0u8; 16 * 1024];
        while !stop.load(Ordering::Relaxed) {
            if slow.read_exact(&mut chunk).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        slow
    })
}

/// 200 round trips of the well-behaved client: each reply within
/// `REPLY_BOUND` (the figures printed; `held`: payload the others hold).
fn well_behaved_replies(good: &mut TcpStream, ts: &TcpServer, held: u64) {
    let mut times = Vec::new();
    for round in 0..200 {
        times.extend(round_trip(good, round));
    }
    times.sort();
    let p99 = times[times.len() * 99 / 100];
    let worst = *times.last().unwrap();
    eprintln!(
        "well-behaved client: {} replies, p50 {:?}, p99 {p99:?}, max {worst:?}; \
         payload held by the others {} MiB; connections {}",
        times.len(),
        times[times.len() / 2],
        held >> 20,
        ts.server.connection_count()
    );
    assert!(worst < REPLY_BOUND, "a reply took {worst:?}");
}

/// The hostile mix against the limits as `cvol serve` sets them by
/// default (256 connections, 64 in the handshake, 16 per address), with a
/// payload budget of 64 MiB and 1 MiB requests: one connection that never
/// reads the replies to 128 MiB of READs, one that reads them at 160 KiB/s,
/// 64 idle established connections from 4 addresses and 300 half-open ones
/// (connected, silent) from 15 addresses. A well-behaved client connected
/// before them gets every reply within `REPLY_BOUND`, and a new client
/// gets in once the half-open connections are 2 s old.
#[test]
fn stuck_slow_idle_and_half_open_clients_do_not_stall_a_well_behaved_one() {
    let _serial = serial();
    let ts = start(ServerConfig {
        max_request_bytes: MIB,
        max_buffered_bytes: 64 * u64::from(MIB),
        workers: 4,
        ..ServerConfig::default()
    });
    let local = addr(0, 0, 1);
    let mut good = connect_ready(local, &ts, None);
    good.set_read_timeout(Some(Duration::from_secs(5))).unwrap();

    let mut stuck = connect_ready(local, &ts, Some(4096));
    pipeline_reads(&mut stuck, 128, MIB);
    let mut slow = connect_ready(local, &ts, Some(4096));
    pipeline_reads(&mut slow, 128, MIB);
    let stop = Arc::new(AtomicBool::new(false));
    let _stop_on_exit = StopOnDrop(Arc::clone(&stop));
    let slow_reader = read_slowly(slow, Arc::clone(&stop));

    // 64 idle established connections, 16 from each of 4 addresses.
    let mut idle = Vec::new();
    for i in 0..64u8 {
        idle.push(connect_ready(addr(0, 1, 1 + i / 16), &ts, None));
    }
    // 300 half-open connections: 20 from each of 15 addresses. The server
    // takes 64 into the handshake and closes the rest at once (the
    // handshake limit, and 16 per address).
    let refused_before = ts.server.refused_connection_count();
    let flood_started = Instant::now();
    let mut half_open = Vec::new();
    for i in 0..300u16 {
        half_open.push(connect_from(addr(0, 2, 1 + (i / 20) as u8), ts.addr, None));
    }
    let flooded = Instant::now();
    let started = Instant::now();
    while ts.server.connection_count() > 3 + 64 + 64 {
        assert!(started.elapsed() < Duration::from_secs(10), "refusals");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Let the stuck and slow connections take what they can.
    std::thread::sleep(Duration::from_millis(500));
    let held = ts.server.buffered_payload_bytes();

    well_behaved_replies(&mut good, &ts, held);
    // The stuck and slow connections did hold payload (so the test tests).
    assert!(held >= 16 << 20, "only {held} bytes held");
    // All but 64 refused, unless the flood itself took 2 s (a loaded
    // machine): then newer connections replaced older ones instead.
    let refused = ts.server.refused_connection_count() - refused_before;
    if flooded.duration_since(flood_started) < Duration::from_millis(1500) {
        assert!(refused >= 300 - 64, "{refused} refused");
    }

    // A new client gets in: once every handshake slot has been held for
    // 2 s, a new connection takes the oldest one's.
    std::thread::sleep(Duration::from_millis(2500).saturating_sub(flooded.elapsed()));
    let mut late = connect_from(local, ts.addr, None);
    handshake(&mut late).expect("a new client is refused while half-open ones hold the slots");
    late.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let [w, r] = round_trip(&mut late, 7);
    assert!(w.max(r) < REPLY_BOUND);

    stop.store(true, Ordering::Relaxed);
    let slow = slow_reader.join().unwrap();
    // Closing the hostile sockets lets the server's shutdown finish.
    drop((stuck, slow, idle, half_open));
}

/// A 17th connection from one address is refused; another address still
/// gets in. Unix-socket clients are not limited (see `hostile.rs`).
#[test]
fn connections_per_address_are_capped() {
    let _serial = serial();
    let ts = start(ServerConfig {
        max_connections_per_address: 4,
        ..ServerConfig::default()
    });
    let mut held: Vec<TcpStream> = (0..4)
        .map(|_| connect_ready(addr(0, 3, 1), &ts, None))
        .collect();
    let mut fifth = connect_from(addr(0, 3, 1), ts.addr, None);
    assert!(handshake(&mut fifth).is_err(), "fifth connection served");
    assert_eq!(ts.server.refused_connection_count(), 1);
    held.push(connect_ready(addr(0, 3, 2), &ts, None));
    // A slot freed is a slot again.
    drop(held.remove(0));
    let started = Instant::now();
    while ts.server.connection_count() > 4 {
        assert!(started.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(10));
    }
    held.push(connect_ready(addr(0, 3, 1), &ts, None));
}

/// With an idle limit, a connection with nothing in flight that sends
/// nothing is closed; one that keeps sending requests is not. A client
/// that reads its replies steadily but too slowly is cut off at the reply
/// deadline.
#[test]
fn idle_connections_and_trickling_readers_are_closed() {
    let _serial = serial();
    let ts = start(ServerConfig {
        max_request_bytes: 4 * MIB,
        idle_timeout: Some(Duration::from_millis(500)),
        send_timeout: Duration::from_secs(3),
        min_reply_bytes_per_sec: 8 * u64::from(MIB),
        // Absurd, and harmless: the deadline does not overflow.
        handshake_timeout: Duration::MAX,
        ..ServerConfig::default()
    });
    let local = addr(0, 4, 1);
    let mut idle = connect_ready(local, &ts, None);
    let mut busy = connect_ready(local, &ts, None);
    // 32 MiB of replies read at 850 KiB/s: once the socket buffers are
    // full a 4 MiB reply takes 4.8 s to go out, and has 3.5 s; each send
    // makes progress well within the 3 s send timeout, so only the
    // deadline stops it (without, it would take 38 s).
    let mut trickler = connect_ready(local, &ts, Some(64 * 1024));
    pipeline_reads(&mut trickler, 8, 4 * MIB);
    let stop = Arc::new(AtomicBool::new(false));
    let _stop_on_exit = StopOnDrop(Arc::clone(&stop));
    let trickle = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut chunk = vec![0u8; 256 * 1024];
            while !stop.load(Ordering::Relaxed) && trickler.read_exact(&mut chunk).is_ok() {
                std::thread::sleep(Duration::from_millis(300));
            }
        })
    };
    let started = Instant::now();
    busy.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    for round in 0..10 {
        round_trip(&mut busy, round);
        std::thread::sleep(Duration::from_millis(200));
    }
    idle.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert!(is_closed(&mut idle), "idle connection still open");
    // The server drops the trickling reader (what the kernel already holds
    // for it still trickles out to it, so the server's count tells; the
    // busy client, silent now, is closed as idle).
    while ts.server.connection_count() > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "trickler never cut off"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("trickling reader cut off after {:?}", started.elapsed());
    stop.store(true, Ordering::Relaxed);
    trickle.join().unwrap();
}
