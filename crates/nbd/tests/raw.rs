//! Raw-socket tests (no client library): malformed input, limits, error
//! paths, ordering rules, disconnects and shutdown.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::client::{Client, Reply};
use common::{config, pattern, MemBackend, TestServer, MAX_REQUEST_BYTES};
use cvol_nbd::proto::*;
use cvol_nbd::test_util::{go_data, meta_context_data, option_header};
use cvol_nbd::{BackendError, ServerConfig};

const SIZE_BYTES: u64 = 4 * 1024 * 1024;

fn start() -> TestServer {
    TestServer::start(MemBackend::new(SIZE_BYTES, false), config())
}

#[test]
fn bad_request_magic_closes_only_that_connection() {
    let ts = start();
    let (mut good, _, _) = Client::handshake(&ts, false, false);
    let (mut bad, _, _) = Client::handshake(&ts, false, false);
    bad.s.write_all(&[0xde; 28]).unwrap();
    assert!(bad.is_closed());
    assert_eq!(good.write(1, 0, &[9; 512]), 0);
    assert_eq!(good.read(2, 0, 512).unwrap(), vec![9; 512]);
    // A bad option magic during the handshake closes too.
    let mut c = Client::connect(&ts);
    c.greet(NBD_FLAG_C_FIXED_NEWSTYLE);
    c.s.write_all(&[0u8; 16]).unwrap();
    assert!(c.is_closed());
    // Unknown client flags are refused.
    let mut c = Client::connect(&ts);
    c.greet(1 << 5);
    assert!(c.is_closed());
}

/// `NBD_OPT_INFO` asking for NAME, DESCRIPTION and BLOCK_SIZE gets each
/// (export "cvol", description "desc"), then the ACK.
fn info_with_name_description_and_block_size(c: &mut Client) {
    c.send_option(
        NBD_OPT_INFO,
        &go_data(
            "cvol",
            &[NBD_INFO_NAME, NBD_INFO_DESCRIPTION, NBD_INFO_BLOCK_SIZE],
        ),
    );
    let replies = c.option_replies();
    let infos: Vec<&Vec<u8>> = replies
        .iter()
        .filter(|r| r.1 == NBD_REP_INFO)
        .map(|r| &r.2)
        .collect();
    assert!(infos.contains(&&encode_info_string(NBD_INFO_NAME, "cvol")));
    assert!(infos.contains(&&encode_info_string(NBD_INFO_DESCRIPTION, "desc")));
    assert!(infos.contains(&&encode_info_block_size(1, 4096, MAX_REQUEST_BYTES)));
    assert_eq!(replies.last().unwrap().1, NBD_REP_ACK);
}

#[test]
fn options_unknown_starttls_list_info_and_oversized() {
    let ts = TestServer::start(
        MemBackend::new(SIZE_BYTES, false),
        ServerConfig {
            export_name: "cvol".into(),
            description: Some("desc".into()),
            ..config()
        },
    );
    let mut c = Client::connect(&ts);
    c.greet(NBD_FLAG_C_FIXED_NEWSTYLE);
    c.send_option(4242, b"some data");
    assert_eq!(
        c.option_reply(),
        (4242, NBD_REP_ERR_UNSUP, b"option not supported".to_vec())
    );
    c.send_option(NBD_OPT_STARTTLS, &[]);
    assert_eq!(c.option_reply().1, NBD_REP_ERR_POLICY);
    c.send_option(NBD_OPT_LIST, &[]);
    let replies = c.option_replies();
    assert_eq!(replies.len(), 2);
    assert_eq!(replies[0].1, NBD_REP_SERVER);
    assert_eq!(replies[0].2, encode_rep_server("cvol", Some("desc")));
    c.send_option(NBD_OPT_LIST, b"x");
    assert_eq!(c.option_reply().1, NBD_REP_ERR_INVALID);
    // INFO for an unknown export, then a malformed INFO.
    c.send_option(NBD_OPT_INFO, &go_data("other", &[]));
    assert_eq!(c.option_reply().1, NBD_REP_ERR_UNKNOWN);
    c.send_option(NBD_OPT_INFO, &[0, 0, 0, 50, 1]);
    assert_eq!(c.option_reply().1, NBD_REP_ERR_INVALID);
    info_with_name_description_and_block_size(&mut c);
    // Meta context before structured replies: invalid.
    c.send_option(
        NBD_OPT_SET_META_CONTEXT,
        &meta_context_data("", &["base:allocation"]),
    );
    assert_eq!(c.option_reply().1, NBD_REP_ERR_INVALID);
    // Oversized option (100 KiB): skipped, TOO_BIG, connection usable.
    c.send_option(99, &vec![0u8; 100 * 1024]);
    assert_eq!(c.option_reply().1, NBD_REP_ERR_TOO_BIG);
    c.send_option(NBD_OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(c.option_reply().1, NBD_REP_ACK);
    // LIST_META_CONTEXT with "base:" wildcard and an unknown namespace.
    c.send_option(
        NBD_OPT_LIST_META_CONTEXT,
        &meta_context_data("", &["base:", "x-foo:bar"]),
    );
    let replies = c.option_replies();
    assert_eq!(replies.len(), 2);
    assert_eq!(replies[0].2, encode_meta_context(0, "base:allocation"));
    let (size, flags) = c.go("cvol");
    assert_eq!(size, SIZE_BYTES);
    assert_ne!(flags & NBD_FLAG_SEND_DF, 0);
    c.structured = true;
    assert_eq!(c.read(1, 0, 16).unwrap(), vec![0; 16]);

    // An option payload beyond 1 MiB ends the connection.
    let mut c = Client::connect(&ts);
    c.greet(NBD_FLAG_C_FIXED_NEWSTYLE);
    c.s.write_all(&option_header(99, 64 << 20)).unwrap();
    assert!(c.is_closed());
    // ABORT is acknowledged, then the server closes.
    let mut c = Client::connect(&ts);
    c.greet(NBD_FLAG_C_FIXED_NEWSTYLE);
    c.send_option(NBD_OPT_ABORT, &[]);
    assert_eq!(c.option_reply().1, NBD_REP_ACK);
    assert!(c.is_closed());
}

#[test]
fn export_name_with_and_without_zeroes_and_non_fixed_client() {
    let ts = start();
    for (client_flags, padding) in [
        (NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES, 0),
        (0, 124),
    ] {
        let mut c = Client::connect(&ts);
        c.greet(client_flags);
        c.send_option(NBD_OPT_EXPORT_NAME, b"");
        assert_eq!(c.u64(), SIZE_BYTES);
        let flags = c.u16();
        assert_ne!(flags & NBD_FLAG_HAS_FLAGS, 0);
        assert_eq!(
            flags & NBD_FLAG_SEND_DF,
            0,
            "no DF without structured replies"
        );
        assert_eq!(c.read_n(padding), vec![0; padding]);
        assert_eq!(c.read(5, 0, 8).unwrap(), vec![0; 8]);
    }
    // Non-fixed clients may not send other options.
    let mut c = Client::connect(&ts);
    c.greet(0);
    c.send_option(NBD_OPT_LIST, &[]);
    assert!(c.is_closed());
    // EXPORT_NAME for an unknown export: hard disconnect.
    let mut c = Client::connect(&ts);
    c.greet(NBD_FLAG_C_FIXED_NEWSTYLE);
    c.send_option(NBD_OPT_EXPORT_NAME, b"nope");
    assert!(c.is_closed());
}

#[test]
fn unknown_command_and_bad_flags_get_einval_and_connection_stays_usable() {
    let ts = start();
    for structured in [false, true] {
        let (mut c, _, _) = Client::handshake(&ts, structured, false);
        c.request(42, 0, 7, 0, 0, &[]);
        let (reply, _) = c.reply(0);
        assert_eq!((reply.handle(), reply.error()), (7, NBD_EINVAL));
        c.request(NBD_CMD_FLUSH, NBD_CMD_FLAG_REQ_ONE, 8, 0, 0, &[]);
        assert_eq!(c.reply(0).0.error(), NBD_EINVAL);
        // WRITE with a bad flag: its payload is consumed, EINVAL returned.
        c.request(NBD_CMD_WRITE, 1 << 7, 9, 0, 1000, &[1; 1000]);
        assert_eq!(c.reply(0).0.error(), NBD_EINVAL);
        // BLOCK_STATUS without a negotiated context.
        c.request(NBD_CMD_BLOCK_STATUS, 0, 10, 0, 4096, &[]);
        assert_eq!(c.reply(0).0.error(), NBD_EINVAL);
        assert_eq!(c.write(11, 0, &[3; 100]), 0);
        assert_eq!(c.read(12, 0, 100).unwrap(), vec![3; 100]);
    }
}

#[test]
fn out_of_range_requests() {
    let ts = start();
    for structured in [false, true] {
        let (mut c, _, _) = Client::handshake(&ts, structured, structured);
        assert_eq!(c.read(1, SIZE_BYTES - 10, 11), Err(NBD_EINVAL));
        assert_eq!(c.read(2, u64::MAX - 5, 10), Err(NBD_EINVAL));
        assert_eq!(c.write(3, SIZE_BYTES - 10, &[1; 11]), NBD_ENOSPC);
        c.request(NBD_CMD_TRIM, 0, 4, SIZE_BYTES, 1, &[]);
        assert_eq!(c.reply(0).0.error(), NBD_EINVAL);
        c.request(NBD_CMD_WRITE_ZEROES, 0, 5, SIZE_BYTES - 1, 2, &[]);
        assert_eq!(c.reply(0).0.error(), NBD_ENOSPC);
        c.request(NBD_CMD_CACHE, 0, 6, SIZE_BYTES, 1, &[]);
        assert_eq!(c.reply(0).0.error(), NBD_EINVAL);
        if structured {
            c.request(NBD_CMD_BLOCK_STATUS, 0, 7, SIZE_BYTES - 1, 2, &[]);
            let (reply, _) = c.reply(0);
            assert!(matches!(
                reply,
                Reply::Chunk {
                    kind: NBD_REPLY_TYPE_ERROR,
                    flags: NBD_REPLY_FLAG_DONE,
                    ..
                }
            ));
            assert_eq!(reply.error(), NBD_EINVAL);
        }
        // The last byte is fine.
        assert_eq!(c.write(8, SIZE_BYTES - 1, &[5]), 0);
        assert_eq!(c.read(9, SIZE_BYTES - 1, 1).unwrap(), vec![5]);
        // Zero-length requests succeed without touching the backend.
        assert_eq!(c.read(10, 0, 0).unwrap(), Vec::<u8>::new());
    }
}

#[test]
fn oversized_write_is_discarded_or_closes() {
    let ts = start();
    let (mut c, _, _) = Client::handshake(&ts, true, false);
    // Above max_request_bytes but below the discard cap: EINVAL, usable.
    let payload = vec![7u8; MAX_REQUEST_BYTES as usize + 1];
    assert_eq!(c.write(1, 0, &payload), NBD_EINVAL);
    assert_eq!(c.read(2, 0, 4).unwrap(), vec![0; 4]);
    // Read larger than max_request_bytes: EINVAL, no payload.
    assert_eq!(c.read(3, 0, MAX_REQUEST_BYTES + 1), Err(NBD_EINVAL));
    // A WRITE header announcing 100 MiB (above the 64 MiB cap): closed.
    c.request(NBD_CMD_WRITE, 0, 4, 0, 100 << 20, &[]);
    assert!(c.is_closed());
    ts.wait_for_connections(0);
}

#[test]
fn read_only_export_refuses_writes_with_eperm() {
    let ts = TestServer::start(MemBackend::new(SIZE_BYTES, true), config());
    let (mut c, _, flags) = Client::handshake(&ts, false, false);
    assert_ne!(flags & NBD_FLAG_READ_ONLY, 0);
    assert_eq!(flags & NBD_FLAG_SEND_TRIM, 0);
    assert_eq!(c.write(1, 0, &[1; 4096]), NBD_EPERM);
    c.request(NBD_CMD_TRIM, 0, 2, 0, 4096, &[]);
    assert_eq!(c.reply(0).0.error(), NBD_EPERM);
    c.request(NBD_CMD_WRITE_ZEROES, 0, 3, 0, 4096, &[]);
    assert_eq!(c.reply(0).0.error(), NBD_EPERM);
    assert_eq!(c.read(4, 0, 4096).unwrap(), vec![0; 4096]);
    c.request(NBD_CMD_FLUSH, 0, 5, 0, 0, &[]);
    assert_eq!(c.reply(0).0.error(), 0);
}

#[test]
fn read_errors_simple_and_structured() {
    let ts = start();
    let (mut simple, _, _) = Client::handshake(&ts, false, false);
    let (mut structured, _, _) = Client::handshake(&ts, true, true);
    ts.backend.fail_with(Some(BackendError::Io));
    assert_eq!(simple.read(1, 0, 4096), Err(NBD_EIO));
    structured.request(NBD_CMD_READ, 0, 2, 4096, 4096, &[]);
    let (reply, _) = structured.reply(0);
    match &reply {
        Reply::Chunk {
            flags,
            kind,
            handle,
            payload,
        } => {
            assert_eq!(
                (*flags, *kind, *handle),
                (NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_ERROR, 2)
            );
            let message_bytes = u16::from_be_bytes([payload[4], payload[5]]) as usize;
            assert_eq!(payload.len(), 6 + message_bytes);
            assert!(std::str::from_utf8(&payload[6..]).is_ok());
        }
        other => panic!("expected an error chunk, got {other:?}"),
    }
    assert_eq!(reply.error(), NBD_EIO);
    structured.request(NBD_CMD_BLOCK_STATUS, 0, 3, 0, 4096, &[]);
    assert_eq!(structured.reply(0).0.error(), NBD_EIO);
    ts.backend.fail_with(Some(BackendError::NoSpace));
    assert_eq!(structured.write(4, 0, &[1; 10]), NBD_ENOSPC);
    ts.backend.fail_with(Some(BackendError::Overflow));
    assert_eq!(structured.read(5, 0, 10), Err(NBD_EINVAL)); // EOVERFLOW only for DF reads
    ts.backend.fail_with(None);
    assert_eq!(simple.read(6, 0, 4096).unwrap(), vec![0; 4096]);
    assert_eq!(structured.read(7, 0, 4096).unwrap(), vec![0; 4096]);
}

#[test]
fn block_status_merges_and_req_one() {
    let ts = start();
    ts.backend.fill(0, &[1; 8192]);
    let (mut c, _, _) = Client::handshake(&ts, true, true);
    c.request(NBD_CMD_BLOCK_STATUS, 0, 1, 0, 32768, &[]);
    let (reply, _) = c.reply(0);
    let Reply::Chunk {
        kind: NBD_REPLY_TYPE_BLOCK_STATUS,
        payload,
        flags,
        ..
    } = reply
    else {
        panic!("{reply:?}")
    };
    assert_eq!(flags, NBD_REPLY_FLAG_DONE);
    assert_eq!(&payload[0..4], &BASE_ALLOCATION_CONTEXT_ID.to_be_bytes());
    let words: Vec<u32> = payload[4..]
        .chunks(4)
        .map(|w| u32::from_be_bytes(w.try_into().unwrap()))
        .collect();
    assert_eq!(words, vec![8192, 0, 24576, NBD_STATE_HOLE | NBD_STATE_ZERO]);
    c.request(
        NBD_CMD_BLOCK_STATUS,
        NBD_CMD_FLAG_REQ_ONE,
        2,
        100,
        32768,
        &[],
    );
    let (reply, _) = c.reply(0);
    let Reply::Chunk { payload, .. } = reply else {
        panic!()
    };
    assert_eq!(payload.len(), 12);
    assert_eq!(&payload[4..12], &[0, 0, 0x1f, 0x9c, 0, 0, 0, 0]); // 8092 bytes allocated
}

#[test]
fn client_disconnect_mid_payload_and_mid_header() {
    let ts = start();
    let (mut worker, _, _) = Client::handshake(&ts, false, false);
    {
        let (mut c, _, _) = Client::handshake(&ts, false, false);
        c.request(NBD_CMD_WRITE, 0, 1, 0, 200_000, &[1; 100_000]);
    }
    {
        let (mut c, _, _) = Client::handshake(&ts, true, false);
        c.s.write_all(
            &encode_request_header(&RequestHeader {
                flags: 0,
                command: 0,
                handle: 1,
                offset: 0,
                length: 1,
            })[..10],
        )
        .unwrap();
    }
    {
        // Disconnect with pipelined reads still in flight.
        let (mut c, _, _) = Client::handshake(&ts, true, false);
        for h in 0..20 {
            c.request(NBD_CMD_READ, 0, h, 0, 65536, &[]);
        }
    }
    ts.wait_for_connections(1);
    assert_eq!(
        ts.backend.contents(0, 4),
        vec![0; 4],
        "partial write must not be applied"
    );
    assert_eq!(worker.write(1, 0, &[2; 64]), 0);
    assert_eq!(worker.read(2, 0, 64).unwrap(), vec![2; 64]);
}

#[test]
fn many_connections_opened_and_dropped_while_another_client_works() {
    let ts = start();
    let (mut c, _, _) = Client::handshake(&ts, true, false);
    let path = ts.socket_path.clone();
    let churn = std::thread::spawn(move || {
        for i in 0..500 {
            let mut s = UnixStream::connect(&path).unwrap();
            if i % 3 == 1 {
                let mut greeting = [0u8; 18];
                let _ = s.read_exact(&mut greeting);
                let _ = s.write_all(&NBD_FLAG_C_FIXED_NEWSTYLE.to_be_bytes());
            }
        }
    });
    let mut handle = 0;
    while !churn.is_finished() {
        handle += 1;
        let data = pattern(4096, handle as u8);
        let offset = (handle % 64) * 4096;
        assert_eq!(c.write(handle, offset, &data), 0);
        assert_eq!(c.read(handle + 1_000_000, offset, 4096).unwrap(), data);
    }
    churn.join().unwrap();
    ts.wait_for_connections(1);
    assert_eq!(c.read(0, 0, 1).unwrap().len(), 1);
}

#[test]
fn connection_limit_closes_extra_connections() {
    let ts = TestServer::start(
        MemBackend::new(SIZE_BYTES, false),
        ServerConfig {
            max_connections: 2,
            ..config()
        },
    );
    let (mut a, _, _) = Client::handshake(&ts, false, false);
    let (_b, _, _) = Client::handshake(&ts, false, false);
    let mut extra = Client::connect(&ts);
    assert!(extra.is_closed());
    assert_eq!(ts.server.connection_count(), 2);
    assert_eq!(a.read(1, 0, 1).unwrap(), vec![0]);
}

#[test]
fn overlapping_writes_keep_arrival_order_and_replies_can_be_out_of_order() {
    let ts = start();
    ts.backend.delay_ms.store(300, Ordering::SeqCst);
    *ts.backend.slow_write_byte.lock().unwrap() = Some(0xaa);
    let (mut c, _, _) = Client::handshake(&ts, false, false);
    // All three in one send: a request alone on the connection with
    // nothing more to read runs on the connection's thread, which would
    // hold the next ones back while the slow one sleeps (a race with the
    // client's second send otherwise).
    let mut burst = Client::header(NBD_CMD_WRITE, 0, 1, 0, 8192); // slow
    burst.extend_from_slice(&[0xaa; 8192]);
    burst.extend(Client::header(NBD_CMD_WRITE, 0, 3, 65536, 4096)); // independent: may pass
    burst.extend_from_slice(&[0xcc; 4096]);
    burst.extend(Client::header(NBD_CMD_WRITE, 0, 2, 4096, 4096)); // overlaps: must wait
    burst.extend_from_slice(&[0xbb; 4096]);
    c.s.write_all(&burst).unwrap();
    let order: Vec<u64> = (0..3).map(|_| c.reply(0).0.handle()).collect();
    assert_eq!(
        order,
        vec![3, 1, 2],
        "independent write overtakes, overlapping one waits"
    );
    assert_eq!(ts.backend.contents(0, 4096), vec![0xaa; 4096]);
    assert_eq!(ts.backend.contents(4096, 4096), vec![0xbb; 4096]);
    let log = ts.backend.log_lines();
    let end_1 = log
        .iter()
        .position(|l| l.starts_with("write-end 0 "))
        .unwrap();
    let start_2 = log
        .iter()
        .position(|l| l.starts_with("write-start 4096 "))
        .unwrap();
    assert!(end_1 < start_2, "{log:?}");
    // A read overlapping a slow write waits for it, too.
    c.request(NBD_CMD_WRITE, 0, 4, 0, 4096, &[0xaa; 4096]);
    c.request(NBD_CMD_READ, 0, 5, 0, 4096, &[]);
    assert_eq!(c.reply(0).0.handle(), 4);
    let (reply, data) = c.reply(4096);
    assert_eq!((reply.handle(), data), (5, vec![0xaa; 4096]));
}

#[test]
fn flush_waits_for_earlier_writes() {
    let ts = start();
    ts.backend.delay_ms.store(300, Ordering::SeqCst);
    *ts.backend.slow_write_byte.lock().unwrap() = Some(0xaa);
    let (mut c, _, _) = Client::handshake(&ts, true, false);
    c.request(NBD_CMD_WRITE, 0, 1, 0, 4096, &[0xaa; 4096]);
    c.request(NBD_CMD_FLUSH, 0, 2, 0, 0, &[]);
    let handles: Vec<u64> = (0..2).map(|_| c.reply(0).0.handle()).collect();
    assert_eq!(handles, vec![1, 2]);
    let log = ts.backend.log_lines();
    assert_eq!(log.last().unwrap(), "flush", "{log:?}");
    // Flush with offset/length set is still a flush (FUA allowed on any command).
    c.request(NBD_CMD_FLUSH, NBD_CMD_FLAG_FUA, 3, 0, 0, &[]);
    assert_eq!(c.reply(0).0.error(), 0);
}

#[test]
fn reads_complete_out_of_order_and_inflight_is_bounded() {
    let ts = TestServer::start(
        MemBackend::new(SIZE_BYTES, false),
        ServerConfig {
            max_inflight_per_conn: 2,
            ..config()
        },
    );
    ts.backend.delay_ms.store(300, Ordering::SeqCst);
    *ts.backend.slow_read_offset.lock().unwrap() = Some(0);
    let (mut c, _, _) = Client::handshake(&ts, true, false);
    // A first slow read, alone: the connection's reads now wait for a
    // device, so they go to the workers (quick reads would run on the
    // connection's thread, in order).
    c.request(NBD_CMD_READ, 0, 0, 0, 512, &[]);
    assert_eq!(c.reply(0).0.handle(), 0);
    // Both in one send, so the slow one cannot run alone on the
    // connection's thread and hold the second back.
    let mut burst = Client::header(NBD_CMD_READ, 0, 1, 0, 512); // slow
    burst.extend(Client::header(NBD_CMD_READ, 0, 2, 4096, 512));
    c.s.write_all(&burst).unwrap();
    assert_eq!(c.reply(0).0.handle(), 2);
    assert_eq!(c.reply(0).0.handle(), 1);
    ts.backend.delay_ms.store(50, Ordering::SeqCst);
    *ts.backend.slow_read_offset.lock().unwrap() = None;
    ts.backend.max_active.store(0, Ordering::SeqCst);
    for h in 0..10u64 {
        c.request(NBD_CMD_READ, 0, 100 + h, h * 4096, 4096, &[]);
    }
    let mut seen: Vec<u64> = (0..10).map(|_| c.reply(0).0.handle()).collect();
    seen.sort();
    assert_eq!(seen, (100..110).collect::<Vec<_>>());
    assert!(ts.backend.max_active.load(Ordering::SeqCst) <= 2);
}

#[test]
fn disc_finishes_inflight_requests_then_closes() {
    let ts = start();
    ts.backend.delay_ms.store(200, Ordering::SeqCst);
    *ts.backend.slow_write_byte.lock().unwrap() = Some(0xaa);
    let (mut c, _, _) = Client::handshake(&ts, false, false);
    c.request(NBD_CMD_WRITE, 0, 1, 0, 4096, &[0xaa; 4096]);
    c.request(NBD_CMD_DISC, 0, 2, 0, 0, &[]);
    assert_eq!(
        c.reply(0).0,
        Reply::Simple {
            error: 0,
            handle: 1
        }
    );
    assert!(c.is_closed());
    assert_eq!(ts.backend.contents(0, 1), vec![0xaa]);
}

#[test]
fn shutdown_waits_for_inflight_and_closes_everything() {
    let ts = start();
    ts.backend.delay_ms.store(300, Ordering::SeqCst);
    *ts.backend.slow_write_byte.lock().unwrap() = Some(0xaa);
    let (mut c, _, _) = Client::handshake(&ts, false, false);
    let mut idle = Client::connect(&ts); // stuck in the handshake
    idle.greet(NBD_FLAG_C_FIXED_NEWSTYLE);
    c.request(NBD_CMD_WRITE, 0, 1, 0, 4096, &[0xaa; 4096]);
    std::thread::sleep(Duration::from_millis(50));
    let started = Instant::now();
    ts.server.shutdown();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(ts.server.connection_count(), 0);
    assert_eq!(
        ts.backend.contents(0, 1),
        vec![0xaa],
        "in-flight write completed"
    );
    assert_eq!(
        c.reply(0).0,
        Reply::Simple {
            error: 0,
            handle: 1
        }
    );
    assert!(c.is_closed());
    assert!(idle.is_closed());
    assert!(UnixStream::connect(&ts.socket_path)
        .map(|mut s| {
            let mut b = [0u8; 1];
            s.set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            matches!(s.read(&mut b), Ok(0) | Err(_))
        })
        .unwrap_or(true));
    ts.server.shutdown(); // idempotent
}

#[test]
fn tcp_listener_works() {
    let backend = std::sync::Arc::new(MemBackend::new(SIZE_BYTES, false));
    let server = cvol_nbd::Server::new(
        backend.clone() as std::sync::Arc<dyn cvol_nbd::Backend>,
        config(),
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    server.serve_tcp(listener).unwrap();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).unwrap();
    assert_eq!(&greeting[0..8], b"NBDMAGIC");
    s.write_all(&(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    s.write_all(&option_header(NBD_OPT_EXPORT_NAME, 0)).unwrap();
    let mut export = [0u8; 10];
    s.read_exact(&mut export).unwrap();
    assert_eq!(
        u64::from_be_bytes(export[0..8].try_into().unwrap()),
        SIZE_BYTES
    );
    s.write_all(&encode_request_header(&RequestHeader {
        flags: 0,
        command: NBD_CMD_WRITE,
        handle: 1,
        offset: 0,
        length: 3,
    }))
    .unwrap();
    s.write_all(b"abc").unwrap();
    let mut reply = [0u8; 16];
    s.read_exact(&mut reply).unwrap();
    assert_eq!(reply, encode_simple_reply(0, 1));
    assert_eq!(backend.contents(0, 3), b"abc");
    server.shutdown();
}
