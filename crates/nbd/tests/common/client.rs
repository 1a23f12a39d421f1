//! A raw NBD client for the tests (no client library): the handshake,
//! requests and replies byte by byte, so that tests can also misbehave
//! (write any bytes to `s`, stop reading, vanish mid-message).
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use cvol_nbd::proto::*;
use cvol_nbd::test_util::{go_data, meta_context_data, option};

use super::TestServer;

/// The client flags of a well-behaved client.
pub const CLIENT_FLAGS: u32 = NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES;

pub struct Client {
    pub s: UnixStream,
    /// Structured replies were negotiated (READ replies are chunks).
    pub structured: bool,
}

/// A reply as read back by the raw client.
#[derive(Debug, PartialEq)]
pub enum Reply {
    Simple {
        error: u32,
        handle: u64,
    },
    Chunk {
        flags: u16,
        kind: u16,
        handle: u64,
        payload: Vec<u8>,
    },
}

impl Reply {
    pub fn handle(&self) -> u64 {
        match self {
            Reply::Simple { handle, .. } | Reply::Chunk { handle, .. } => *handle,
        }
    }
    /// Error code of a simple reply or an error chunk.
    pub fn error(&self) -> u32 {
        match self {
            Reply::Simple { error, .. } => *error,
            Reply::Chunk { kind, payload, .. } if kind & 0x8000 != 0 => {
                u32::from_be_bytes(payload[0..4].try_into().unwrap())
            }
            Reply::Chunk { .. } => 0,
        }
    }
}

impl Client {
    /// Connects; every read and write waits at most 20 s (only to turn a
    /// hang into a failure).
    pub fn connect(ts: &TestServer) -> Client {
        Client::connect_to(&ts.socket_path)
    }

    /// [`Client::connect`] to the Unix socket at `socket_path`.
    pub fn connect_to(socket_path: &std::path::Path) -> Client {
        let s = UnixStream::connect(socket_path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
        Client {
            s,
            structured: false,
        }
    }

    pub fn read_n(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        self.s.read_exact(&mut v).unwrap();
        v
    }
    pub fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.read_n(2).try_into().unwrap())
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.read_n(4).try_into().unwrap())
    }
    pub fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.read_n(8).try_into().unwrap())
    }

    /// The server closed the connection (or it failed). A read that times
    /// out is a connection still open: false.
    pub fn is_closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        match self.s.read(&mut b) {
            Ok(n) => n == 0,
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        }
    }

    /// Reads the greeting and sends the client flags.
    pub fn greet(&mut self, client_flags: u32) {
        assert_eq!(self.u64(), NBD_MAGIC);
        assert_eq!(self.u64(), IHAVEOPT);
        assert_eq!(self.u16(), NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES);
        self.s.write_all(&client_flags.to_be_bytes()).unwrap();
    }

    /// Sends one option: IHAVEOPT, option, length, data.
    pub fn send_option(&mut self, option_type: u32, data: &[u8]) {
        self.s.write_all(&option(option_type, data)).unwrap();
    }

    /// One option reply: (option, reply type, data).
    pub fn option_reply(&mut self) -> (u32, u32, Vec<u8>) {
        assert_eq!(self.u64(), OPTION_REPLY_MAGIC);
        let option = self.u32();
        let reply_type = self.u32();
        let length = self.u32() as usize;
        (option, reply_type, self.read_n(length))
    }

    /// Reads option replies up to the final one; returns all of them.
    pub fn option_replies(&mut self) -> Vec<(u32, u32, Vec<u8>)> {
        let mut all = Vec::new();
        loop {
            let r = self.option_reply();
            let done = r.1 == NBD_REP_ACK || r.1 & (1 << 31) != 0;
            all.push(r);
            if done {
                return all;
            }
        }
    }

    /// Full handshake with NBD_OPT_GO; returns (size, transmission flags).
    pub fn handshake(ts: &TestServer, structured: bool, meta: bool) -> (Client, u64, u16) {
        let mut c = Client::connect(ts);
        c.greet(CLIENT_FLAGS);
        if structured {
            c.send_option(NBD_OPT_STRUCTURED_REPLY, &[]);
            assert_eq!(c.option_reply().1, NBD_REP_ACK);
            c.structured = true;
        }
        if meta {
            c.send_option(
                NBD_OPT_SET_META_CONTEXT,
                &meta_context_data("", &["base:allocation"]),
            );
            let replies = c.option_replies();
            assert_eq!(replies.len(), 2, "{replies:?}");
            assert_eq!(replies[0].1, NBD_REP_META_CONTEXT);
        }
        let (size, flags) = c.go("");
        (c, size, flags)
    }

    /// Greeting, optional structured replies, GO: a client in transmission.
    pub fn ready(ts: &TestServer, structured: bool) -> Client {
        Client::handshake(ts, structured, false).0
    }

    /// Sends NBD_OPT_GO for `name` and reads its replies: INFO replies up to
    /// the ACK, nothing else. Returns (size, transmission flags).
    pub fn go(&mut self, name: &str) -> (u64, u16) {
        self.send_option(NBD_OPT_GO, &go_data(name, &[]));
        let mut export = None;
        loop {
            let (option, reply_type, data) = self.option_reply();
            assert_eq!(option, NBD_OPT_GO);
            if reply_type == NBD_REP_ACK {
                return export.expect("NBD_INFO_EXPORT");
            }
            assert_eq!(reply_type, NBD_REP_INFO, "GO failed: {reply_type:#x}");
            if data[0..2] == [0, 0] {
                let size = u64::from_be_bytes(data[2..10].try_into().unwrap());
                export = Some((size, u16::from_be_bytes([data[10], data[11]])));
            }
        }
    }

    /// A request header's bytes.
    pub fn header(command: u16, flags: u16, handle: u64, offset: u64, length: u32) -> Vec<u8> {
        encode_request_header(&RequestHeader {
            flags,
            command,
            handle,
            offset,
            length,
        })
        .to_vec()
    }

    pub fn request(
        &mut self,
        command: u16,
        flags: u16,
        handle: u64,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) {
        let mut m = Client::header(command, flags, handle, offset, length);
        m.extend_from_slice(payload);
        self.s.write_all(&m).unwrap();
    }

    /// Reads one reply; for simple READ replies pass the expected data length.
    pub fn reply(&mut self, simple_read_bytes: usize) -> (Reply, Vec<u8>) {
        let magic = self.u32();
        if magic == SIMPLE_REPLY_MAGIC {
            let error = self.u32();
            let handle = self.u64();
            let data = if error == 0 {
                self.read_n(simple_read_bytes)
            } else {
                Vec::new()
            };
            return (Reply::Simple { error, handle }, data);
        }
        assert_eq!(magic, STRUCTURED_REPLY_MAGIC);
        let flags = self.u16();
        let kind = self.u16();
        let handle = self.u64();
        let length = self.u32() as usize;
        let payload = self.read_n(length);
        (
            Reply::Chunk {
                flags,
                kind,
                handle,
                payload,
            },
            Vec::new(),
        )
    }

    /// Reads one reply that must be whole in one chunk (or simple):
    /// (handle, error, data). READ data comes back for simple replies
    /// (pass its length) and for OFFSET_DATA chunks.
    pub fn reply_one(&mut self, simple_read_bytes: usize) -> (u64, u32, Vec<u8>) {
        let (reply, data) = self.reply(simple_read_bytes);
        let (handle, error) = (reply.handle(), reply.error());
        let Reply::Chunk {
            flags,
            kind,
            payload,
            ..
        } = reply
        else {
            return (handle, error, data);
        };
        assert_ne!(flags & NBD_REPLY_FLAG_DONE, 0, "one chunk per reply");
        match kind {
            NBD_REPLY_TYPE_OFFSET_DATA => (handle, 0, payload[8..].to_vec()),
            _ => (handle, error, Vec::new()),
        }
    }

    /// READ: its data, or the error. A structured reply must be one chunk
    /// (data at `offset`, none for a zero length, or an error).
    pub fn read(&mut self, handle: u64, offset: u64, length: u32) -> Result<Vec<u8>, u32> {
        self.request(NBD_CMD_READ, 0, handle, offset, length, &[]);
        let (reply, data) = self.reply(length as usize);
        assert_eq!(reply.handle(), handle);
        let error = reply.error();
        match reply {
            Reply::Simple { error: 0, .. } => Ok(data),
            Reply::Simple { .. } => Err(error),
            Reply::Chunk {
                flags,
                kind,
                payload,
                ..
            } => {
                assert_eq!(flags, NBD_REPLY_FLAG_DONE, "one chunk per reply");
                match kind {
                    NBD_REPLY_TYPE_NONE => Ok(Vec::new()),
                    NBD_REPLY_TYPE_OFFSET_DATA => {
                        assert_eq!(
                            u64::from_be_bytes(payload[0..8].try_into().unwrap()),
                            offset
                        );
                        Ok(payload[8..].to_vec())
                    }
                    k if k & 0x8000 != 0 => Err(error),
                    k => panic!("unexpected reply chunk type {k} to a READ"),
                }
            }
        }
    }

    /// WRITE; returns the error of its (one-chunk) reply.
    pub fn write(&mut self, handle: u64, offset: u64, data: &[u8]) -> u32 {
        self.request(NBD_CMD_WRITE, 0, handle, offset, data.len() as u32, data);
        let (h, error, _) = self.reply_one(0);
        assert_eq!(h, handle);
        error
    }
}
