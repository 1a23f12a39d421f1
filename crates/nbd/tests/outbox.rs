//! Replies under pressure: many requests in flight on one connection, reads
//! of many sizes (some coalesced into one send, some larger than a socket
//! buffer) mixed with writes, answered by the reader thread and the
//! workers, to a client that reads its replies slowly and in small pieces.
//! Every reply must arrive once, whole, with its own data: a reply lost,
//! sent twice, cut or interleaved with another fails here.
mod common;

use common::client::Client;
use common::{config, pattern, MemBackend, TestServer};
use cvol_nbd::proto::*;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::time::Duration;

const SIZE_BYTES: u64 = 16 * 1024 * 1024;
/// Reads cover the first half, writes the second (no overlap: no waits).
const HALF: u64 = SIZE_BYTES / 2;
const REQUESTS: u64 = 3000;

/// Request `i`: (is_write, offset, length), spread over sizes from 512 B to
/// 256 KiB.
fn request(i: u64) -> (bool, u64, u32) {
    let lengths = [512u32, 4096, 4096, 4096, 16 * 1024, 64 * 1024, 256 * 1024];
    let length = lengths[(i * 7 % lengths.len() as u64) as usize];
    let slot = (i * 2_654_435_761) % (HALF / 4096 - 64);
    let is_write = i.is_multiple_of(5);
    let offset = slot * 4096 + if is_write { HALF } else { 0 };
    (is_write, offset, length)
}

#[test]
fn every_reply_arrives_once_whole_and_in_one_piece_to_a_slow_reader() {
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, false).without_log(), config());
    let mut c = Client::ready(&ts, true);
    let image: Vec<u8> = (0..HALF / 4096)
        .flat_map(|b| pattern(4096, (b * 31 % 251) as u8))
        .collect();
    for (i, chunk) in image.chunks(256 * 1024).enumerate() {
        assert_eq!(c.write(i as u64, (i * 256 * 1024) as u64, chunk), 0);
    }
    // Requests go out from their own thread, so neither side waits for
    // the other's socket buffer.
    let mut tx = c.s.try_clone().unwrap();
    let sender = std::thread::spawn(move || {
        for i in 0..REQUESTS {
            let (is_write, offset, length) = request(i);
            let cmd = if is_write {
                NBD_CMD_WRITE
            } else {
                NBD_CMD_READ
            };
            let mut bytes = Client::header(cmd, 0, 1000 + i, offset, length);
            if is_write {
                bytes.extend(pattern(length as usize, i as u8));
            }
            tx.write_all(&bytes).unwrap();
        }
    });
    let mut seen: HashMap<u64, usize> = HashMap::new();
    for n in 0..REQUESTS {
        if n.is_multiple_of(8) {
            std::thread::sleep(Duration::from_millis(5)); // the socket fills
        }
        let (handle, error, data) = read_reply_in_pieces(&mut c);
        assert_eq!(error, 0, "request {handle} failed");
        *seen.entry(handle).or_default() += 1;
        let (is_write, offset, length) = request(handle - 1000);
        if is_write {
            assert!(data.is_empty());
        } else {
            let want = &image[offset as usize..offset as usize + length as usize];
            assert!(data == want, "reply {handle}: wrong data at {offset}");
        }
    }
    sender.join().unwrap();
    assert_eq!(seen.len() as u64, REQUESTS, "replies missing");
    assert!(seen.values().all(|&n| n == 1));
}

/// One reply (simple, or one structured chunk), read a few bytes at a time.
fn read_reply_in_pieces(c: &mut Client) -> (u64, u32, Vec<u8>) {
    let mut head = [0u8; 16];
    read_slowly(&mut c.s, &mut head);
    let magic = u32::from_be_bytes(head[0..4].try_into().unwrap());
    if magic == SIMPLE_REPLY_MAGIC {
        // WRITE replies are simple (no data follows them here).
        let error = u32::from_be_bytes(head[4..8].try_into().unwrap());
        return (
            u64::from_be_bytes(head[8..16].try_into().unwrap()),
            error,
            Vec::new(),
        );
    }
    assert_eq!(
        magic, STRUCTURED_REPLY_MAGIC,
        "a reply does not start where the last one ended"
    );
    let mut rest = [0u8; 4];
    read_slowly(&mut c.s, &mut rest);
    let flags = u16::from_be_bytes(head[4..6].try_into().unwrap());
    let kind = u16::from_be_bytes(head[6..8].try_into().unwrap());
    let handle = u64::from_be_bytes(head[8..16].try_into().unwrap());
    let length = u32::from_be_bytes(rest) as usize;
    assert_ne!(flags & NBD_REPLY_FLAG_DONE, 0);
    let mut payload = vec![0u8; length];
    read_slowly(&mut c.s, &mut payload);
    match kind {
        NBD_REPLY_TYPE_OFFSET_DATA => (handle, 0, payload[8..].to_vec()),
        NBD_REPLY_TYPE_NONE => (handle, 0, Vec::new()),
        _ => (
            handle,
            u32::from_be_bytes(payload[0..4].try_into().unwrap()),
            Vec::new(),
        ),
    }
}

fn read_slowly(s: &mut impl Read, buf: &mut [u8]) {
    let mut at = 0;
    while at < buf.len() {
        let end = (at + 1500).min(buf.len());
        let n = s.read(&mut buf[at..end]).unwrap();
        assert!(n > 0, "the server closed the connection");
        at += n;
    }
}
