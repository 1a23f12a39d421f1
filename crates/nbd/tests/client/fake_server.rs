//! The client against scripted fake servers: the `NBD_OPT_EXPORT_NAME`
//! fallbacks, a server without FLUSH, TRIM, WRITE_ZEROES, FUA or
//! multi-conn, and garbled replies (bad magic, wrong handle, a structured
//! reply, data cut short) that drop the connection for a new one.

use std::io::{self, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cvol_nbd::client::Client;
use cvol_nbd::proto::*;

use super::common::pattern;
use super::{assert_error, read_back, MIB};

const FAKE_SIZE: usize = 4 * MIB;

#[derive(Clone, Copy, PartialEq)]
enum Handshake {
    /// Fixed newstyle, answers NBD_OPT_GO.
    Go,
    /// Fixed newstyle, answers NBD_OPT_GO with NBD_REP_ERR_UNSUP.
    GoUnsupported,
    /// Newstyle without the fixed flag (and without NO_ZEROES).
    NotFixed,
}

/// How a connection answers its first request (later ones: `Good`).
#[derive(Clone, Copy, Debug)]
enum Answer {
    Good,
    BadMagic,
    WrongHandle,
    Structured,
    /// A READ reply with half of its data, then the connection closes.
    ShortData,
}

#[derive(Default)]
struct FakeLog {
    client_flags: Vec<u32>,
    options: Vec<u32>,
    /// The data of every NBD_OPT_GO.
    go_data: Vec<Vec<u8>>,
    /// (command, flags, offset, length) of every request.
    requests: Vec<(u16, u16, u64, u32)>,
}

struct FakeServer {
    path: PathBuf,
    log: Arc<Mutex<FakeLog>>,
    connections: Arc<AtomicUsize>,
    _dir: tempfile::TempDir,
}

struct FakeConn {
    s: UnixStream,
    handshake: Handshake,
    flags: u16,
    log: Arc<Mutex<FakeLog>>,
    data: Arc<Mutex<Vec<u8>>>,
}

impl FakeServer {
    /// Serves a `FAKE_SIZE` export advertising `flags`; connection `i`
    /// answers its first request as `script[i]` says.
    fn start(handshake: Handshake, flags: u16, script: Vec<Answer>) -> FakeServer {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fake.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let log = Arc::new(Mutex::new(FakeLog::default()));
        let connections = Arc::new(AtomicUsize::new(0));
        let data = Arc::new(Mutex::new(vec![0u8; FAKE_SIZE]));
        let (log2, connections2) = (Arc::clone(&log), Arc::clone(&connections));
        std::thread::spawn(move || {
            for (i, s) in listener.incoming().enumerate() {
                let Ok(s) = s else { return };
                connections2.fetch_add(1, Ordering::SeqCst);
                let mut conn = FakeConn {
                    s,
                    handshake,
                    flags,
                    log: Arc::clone(&log2),
                    data: Arc::clone(&data),
                };
                let first = script.get(i).copied().unwrap_or(Answer::Good);
                std::thread::spawn(move || conn.serve(first));
            }
        });
        FakeServer {
            path,
            log,
            connections,
            _dir: dir,
        }
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///disk?socket={}", self.path.display())
    }

    fn requests(&self) -> Vec<(u16, u16, u64, u32)> {
        self.log.lock().unwrap().requests.clone()
    }
}

impl FakeConn {
    fn read_n(&mut self, n: usize) -> io::Result<Vec<u8>> {
        let mut v = vec![0u8; n];
        self.s.read_exact(&mut v)?;
        Ok(v)
    }

    fn handshake(&mut self) -> io::Result<()> {
        let fixed = self.handshake != Handshake::NotFixed;
        let handshake_flags = if fixed {
            NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES
        } else {
            0
        };
        self.s.write_all(&encode_greeting(handshake_flags))?;
        let client_flags = u32::from_be_bytes(self.read_n(4)?.try_into().unwrap());
        self.log.lock().unwrap().client_flags.push(client_flags);
        let no_zeroes = client_flags & NBD_FLAG_C_NO_ZEROES != 0;
        loop {
            let header: [u8; 16] = self.read_n(16)?.try_into().unwrap();
            let h = parse_option_header(&header).unwrap();
            let data = self.read_n(h.length_bytes as usize)?;
            let mut log = self.log.lock().unwrap();
            log.options.push(h.option);
            if h.option == NBD_OPT_GO {
                log.go_data.push(data);
            }
            drop(log);
            let reply = match (h.option, self.handshake) {
                (NBD_OPT_GO, Handshake::Go) => {
                    let info = encode_info_export(FAKE_SIZE as u64, self.flags);
                    let mut r = encode_option_reply(NBD_OPT_GO, NBD_REP_INFO, &info);
                    r.extend(encode_option_reply(NBD_OPT_GO, NBD_REP_ACK, &[]));
                    self.s.write_all(&r)?;
                    return Ok(());
                }
                (NBD_OPT_EXPORT_NAME, _) => {
                    let r = encode_export_name_reply(FAKE_SIZE as u64, self.flags, no_zeroes);
                    self.s.write_all(&r)?;
                    return Ok(());
                }
                (option, _) => encode_option_reply(option, NBD_REP_ERR_UNSUP, &[]),
            };
            self.s.write_all(&reply)?;
        }
    }

    /// Runs one request; returns its READ data.
    fn apply(&mut self, h: &RequestHeader) -> io::Result<Vec<u8>> {
        let (offset, length) = (h.offset as usize, h.length as usize);
        let mut data = self.data.lock().unwrap();
        let range = offset..(offset + length).min(FAKE_SIZE);
        match h.command {
            NBD_CMD_WRITE => {
                drop(data);
                let payload = self.read_n(length)?;
                let mut data = self.data.lock().unwrap();
                data[range.clone()].copy_from_slice(&payload[..range.len()]);
                Ok(Vec::new())
            }
            NBD_CMD_READ => Ok(data[range].to_vec()),
            NBD_CMD_WRITE_ZEROES | NBD_CMD_TRIM => {
                data[range].fill(0);
                Ok(Vec::new())
            }
            _ => Ok(Vec::new()),
        }
    }

    fn serve(&mut self, first: Answer) -> io::Result<()> {
        self.handshake()?;
        let mut answer = first;
        loop {
            let header: [u8; REQUEST_HEADER_BYTES] = self.read_n(28)?.try_into().unwrap();
            let h = parse_request_header(&header).unwrap();
            let entry = (h.command, h.flags, h.offset, h.length);
            self.log.lock().unwrap().requests.push(entry);
            if h.command == NBD_CMD_DISC {
                return Ok(());
            }
            let data = self.apply(&h)?;
            let mut reply = match answer {
                Answer::Good | Answer::ShortData => encode_simple_reply(0, h.handle).to_vec(),
                Answer::BadMagic => vec![0xde; 16],
                Answer::WrongHandle => encode_simple_reply(0, h.handle ^ 1).to_vec(),
                Answer::Structured => encode_none_chunk(h.handle).to_vec(),
            };
            if let Answer::ShortData = answer {
                reply.extend_from_slice(&data[..data.len() / 2]);
                return self.s.write_all(&reply);
            }
            reply.extend_from_slice(&data);
            self.s.write_all(&reply)?;
            answer = Answer::Good;
        }
    }
}

/// Everything the fake servers can advertise.
const ALL_FLAGS: u16 = NBD_FLAG_HAS_FLAGS
    | NBD_FLAG_SEND_FLUSH
    | NBD_FLAG_SEND_FUA
    | NBD_FLAG_SEND_TRIM
    | NBD_FLAG_SEND_WRITE_ZEROES
    | NBD_FLAG_CAN_MULTI_CONN;

#[test]
fn go_asks_for_block_size_and_never_for_structured_replies() {
    let fake = FakeServer::start(Handshake::Go, ALL_FLAGS, vec![]);
    let client = Client::connect(&fake.uri()).unwrap();
    assert_eq!(client.size_bytes(), FAKE_SIZE as u64);
    client.write_at(10, b"hello", true).unwrap();
    assert_eq!(read_back(&client, 10, 5), b"hello");
    let log = fake.log.lock().unwrap();
    assert_eq!(log.options, [NBD_OPT_GO]);
    let go = parse_info_request(&log.go_data[0]).unwrap();
    assert_eq!(go.export_name, "disk");
    assert_eq!(go.info_types, [NBD_INFO_BLOCK_SIZE]);
    assert_eq!(
        log.client_flags,
        [NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES]
    );
    assert_eq!(log.requests[0], (NBD_CMD_WRITE, NBD_CMD_FLAG_FUA, 10, 5));
}

#[test]
fn falls_back_to_export_name() {
    for handshake in [Handshake::GoUnsupported, Handshake::NotFixed] {
        let fake = FakeServer::start(handshake, ALL_FLAGS, vec![]);
        let client = Client::connect(&fake.uri()).unwrap();
        assert_eq!(client.size_bytes(), FAKE_SIZE as u64);
        assert!(client.can_trim());
        client.write_at(4096, &pattern(10_000, 2), false).unwrap();
        assert_eq!(read_back(&client, 4096, 10_000), pattern(10_000, 2));
        let log = fake.log.lock().unwrap();
        if handshake == Handshake::NotFixed {
            assert_eq!(log.client_flags, [0]);
            assert_eq!(log.options, [NBD_OPT_EXPORT_NAME]);
        } else {
            assert_eq!(log.options, [NBD_OPT_GO, NBD_OPT_EXPORT_NAME]);
        }
    }
}

#[test]
fn missing_features_without_multi_conn() {
    let fake = FakeServer::start(Handshake::Go, NBD_FLAG_HAS_FLAGS, vec![]);
    let client = Arc::new(Client::connect(&fake.uri()).unwrap());
    assert!(!client.can_flush() && !client.can_trim() && !client.can_fua());
    assert!(!client.can_write_zeroes() && !client.can_multi_conn());
    assert_eq!(client.max_connections(), 1);
    client.write_at(0, &[1; 3 * MIB], true).unwrap();
    client.flush().unwrap();
    client.trim(0, 4096).unwrap();
    // FUA without FUA or FLUSH: a plain write; flush and trim: nothing.
    assert_eq!(fake.requests(), [(NBD_CMD_WRITE, 0, 0, 3 * MIB as u32)]);

    client.write_zeroes(5, 2 * MIB as u64 + 10).unwrap();
    let requests = fake.requests();
    let lengths: Vec<u32> = requests[1..].iter().map(|r| r.3).collect();
    assert_eq!(lengths, [MIB as u32, MIB as u32, 10]);
    assert!(requests[1..].iter().all(|r| r.0 == NBD_CMD_WRITE));
    assert_eq!(read_back(&client, 0, 5), [1; 5]);
    assert_eq!(read_back(&client, 5, 2 * MIB + 10), vec![0; 2 * MIB + 10]);
    assert_eq!(read_back(&client, 2 * MIB as u64 + 15, 10), [1; 10]);

    // Eight threads share the one connection.
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let client = Arc::clone(&client);
            std::thread::spawn(move || {
                for i in 0..20 {
                    let at = t * 65536 + i * 1000;
                    client.write_at(at, &[t as u8; 1000], false).unwrap();
                    assert_eq!(read_back(&client, at, 1000), [t as u8; 1000]);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(fake.connections.load(Ordering::SeqCst), 1);
}

#[test]
fn garbled_replies_are_errors_and_connections_are_replaced() {
    let script = vec![
        Answer::BadMagic,
        Answer::WrongHandle,
        Answer::Structured,
        Answer::ShortData,
    ];
    let fake = FakeServer::start(Handshake::Go, ALL_FLAGS, script);
    let client = Client::connect(&fake.uri()).unwrap();
    client.write_at(0, &[0x42; 8192], false).unwrap_err(); // bad magic
    let mut buf = [0u8; 8192];
    for needle in ["handle", "structured", "closed the connection"] {
        let e = client.read_at(0, &mut buf).unwrap_err();
        assert_error(
            &e,
            io::ErrorKind::InvalidData,
            &[needle, "READ", &fake.uri()],
        );
    }
    assert_eq!(fake.connections.load(Ordering::SeqCst), 4);
    // The fifth connection behaves: the data of the first write landed.
    client.read_at(0, &mut buf).unwrap();
    assert_eq!(buf, [0x42; 8192]);
    assert_eq!(fake.connections.load(Ordering::SeqCst), 5);
}
