//! Unit tests of the wire protocol: layouts, parsing, validation rules,
//! extent merging, and random input that must never panic.

use super::*;
use crate::Extent;

fn ctx() -> TransmissionContext {
    TransmissionContext {
        size_bytes: 1 << 20,
        transmission_flags: transmission_flags(false, true),
        structured_replies: true,
        base_allocation: true,
        max_request_bytes: 65536,
    }
}

fn req(command: u16, flags: u16, offset: u64, length: u32) -> RequestHeader {
    RequestHeader {
        flags,
        command,
        handle: 0xdead_beef_0102_0304,
        offset,
        length,
    }
}

#[test]
fn request_header_roundtrip() {
    let h = req(
        NBD_CMD_WRITE,
        NBD_CMD_FLAG_FUA,
        0x1122_3344_5566_7788,
        0x99aa_bbcc,
    );
    let bytes = encode_request_header(&h);
    assert_eq!(&bytes[0..4], &[0x25, 0x60, 0x95, 0x13]);
    assert_eq!(&bytes[4..8], &[0, 1, 0, 1]);
    assert_eq!(parse_request_header(&bytes), Ok(h));
}

#[test]
fn request_header_bad_magic() {
    let mut bytes = encode_request_header(&req(0, 0, 0, 0));
    bytes[0] ^= 1;
    assert_eq!(parse_request_header(&bytes), Err(ProtoError::BadMagic));
}

#[test]
fn simple_reply_layout() {
    let r = encode_simple_reply(NBD_EINVAL, 0x0102_0304_0506_0708);
    assert_eq!(
        r,
        [0x67, 0x44, 0x66, 0x98, 0, 0, 0, 22, 1, 2, 3, 4, 5, 6, 7, 8]
    );
}

#[test]
fn structured_chunks_layout() {
    let h = encode_chunk_header(NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_OFFSET_DATA, 7, 9);
    assert_eq!(&h[0..4], &[0x66, 0x8e, 0x33, 0xef]);
    assert_eq!(&h[4..8], &[0, 1, 0, 1]);
    assert_eq!(&h[8..16], &7u64.to_be_bytes());
    assert_eq!(&h[16..20], &9u32.to_be_bytes());

    let e = encode_error_chunk(9, NBD_EIO, "boom");
    assert_eq!(e.len(), 20 + 6 + 4);
    assert_eq!(&e[6..8], &NBD_REPLY_TYPE_ERROR.to_be_bytes());
    assert_eq!(&e[16..20], &10u32.to_be_bytes());
    assert_eq!(&e[20..24], &5u32.to_be_bytes());
    assert_eq!(&e[24..26], &4u16.to_be_bytes());
    assert_eq!(&e[26..], b"boom");

    let p = encode_offset_data_prefix(3, 4096, 512);
    assert_eq!(&p[16..20], &520u32.to_be_bytes());
    assert_eq!(&p[20..28], &4096u64.to_be_bytes());

    let n = encode_none_chunk(5);
    assert_eq!(&n[4..8], &[0, 1, 0, 0]);
}

#[test]
fn long_error_message_is_truncated() {
    let msg = "é".repeat(3000); // 6000 bytes
    let e = encode_error_chunk(1, NBD_EIO, &msg);
    let message_bytes = u16::from_be_bytes([e[24], e[25]]) as usize;
    assert!(message_bytes <= MAX_STRING_BYTES);
    assert_eq!(e.len(), 26 + message_bytes);
    assert!(std::str::from_utf8(&e[26..]).is_ok());
}

#[test]
fn option_header_and_reply() {
    let mut b = [0u8; 16];
    b[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
    b[8..12].copy_from_slice(&NBD_OPT_GO.to_be_bytes());
    b[12..16].copy_from_slice(&10u32.to_be_bytes());
    assert_eq!(
        parse_option_header(&b),
        Ok(OptionHeader {
            option: 7,
            length_bytes: 10
        })
    );
    b[0] = 0;
    assert_eq!(parse_option_header(&b), Err(ProtoError::BadMagic));

    let r = encode_option_reply(NBD_OPT_LIST, NBD_REP_ACK, b"");
    assert_eq!(r.len(), 20);
    assert_eq!(&r[0..8], &OPTION_REPLY_MAGIC.to_be_bytes());
    assert_eq!(&r[8..12], &3u32.to_be_bytes());
    assert_eq!(&r[12..16], &1u32.to_be_bytes());
}

fn info_bytes(name: &[u8], infos: &[u16]) -> Vec<u8> {
    let mut v = (name.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(name);
    v.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        v.extend_from_slice(&i.to_be_bytes());
    }
    v
}

#[test]
fn info_request_parsing() {
    let parsed = parse_info_request(&info_bytes(b"cvol", &[3, 1])).unwrap();
    assert_eq!(parsed.export_name, "cvol");
    assert_eq!(parsed.info_types, vec![3, 1]);
    let mut trailing = info_bytes(b"", &[]);
    trailing.push(0);
    assert_eq!(parse_info_request(&trailing), Err(ProtoError::Malformed));
    assert_eq!(
        parse_info_request(&[0, 0, 0, 9, b'a']),
        Err(ProtoError::Malformed)
    );
    assert_eq!(
        parse_info_request(&info_bytes(b"a\0b", &[])),
        Err(ProtoError::BadString)
    );
    assert_eq!(
        parse_info_request(&[0xff, 0xff, 0xff, 0xff]),
        Err(ProtoError::BadString)
    );
    assert_eq!(parse_info_request(&[]), Err(ProtoError::Malformed));
}

#[test]
fn meta_context_parsing() {
    let mut v = 0u32.to_be_bytes().to_vec();
    v.extend_from_slice(&2u32.to_be_bytes());
    for q in ["base:allocation", "qemu:dirty-bitmap:x"] {
        v.extend_from_slice(&(q.len() as u32).to_be_bytes());
        v.extend_from_slice(q.as_bytes());
    }
    let parsed = parse_meta_context_request(&v).unwrap();
    assert_eq!(parsed.export_name, "");
    assert_eq!(
        parsed.queries,
        vec!["base:allocation", "qemu:dirty-bitmap:x"]
    );
    // A huge query count with no data must fail, not allocate.
    let mut huge = 0u32.to_be_bytes().to_vec();
    huge.extend_from_slice(&u32::MAX.to_be_bytes());
    assert_eq!(
        parse_meta_context_request(&huge),
        Err(ProtoError::Malformed)
    );
    assert!(query_selects_base_allocation("base:", true));
    assert!(!query_selects_base_allocation("base:", false));
    assert!(!query_selects_base_allocation("base:other", true));
    assert!(query_syntax_valid("x-a:b"));
    assert!(!query_syntax_valid(":b"));
    assert!(!query_syntax_valid("nocolon"));
}

/// The NBD error a request gets (what the wire carries).
fn validate_errno(h: &RequestHeader, c: &TransmissionContext) -> Result<Command, u32> {
    validate_request(h, c).map_err(RequestError::errno)
}

#[test]
fn validation_errors_say_why() {
    use RequestError::*;
    let c = ctx();
    let simple = TransmissionContext {
        transmission_flags: transmission_flags(true, false),
        structured_replies: false,
        ..c
    };
    let why = |command, flags, offset, length, c: &TransmissionContext| {
        validate_request(&req(command, flags, offset, length), c).unwrap_err()
    };
    for (got, want) in [
        (why(99, 0, 0, 0, &c), UnknownCommand),
        (why(NBD_CMD_READ, 1 << 9, 0, 1, &c), BadFlags),
        (why(NBD_CMD_READ, 0, (1 << 20) - 1, 2, &c), OutOfRange),
        (why(NBD_CMD_TRIM, 0, 1 << 20, 1, &c), OutOfRange),
        (why(NBD_CMD_WRITE, 0, 1 << 20, 1, &c), BeyondEnd),
        (why(NBD_CMD_WRITE_ZEROES, 0, 1 << 20, 1, &c), BeyondEnd),
        (why(NBD_CMD_WRITE, 0, 0, 65537, &c), Oversize),
        (why(NBD_CMD_BLOCK_STATUS, 0, 0, 0, &c), Empty),
        (why(NBD_CMD_TRIM, 0, 0, 1, &simple), ReadOnly),
        (why(NBD_CMD_BLOCK_STATUS, 0, 0, 1, &simple), NotNegotiated),
    ] {
        assert_eq!(got, want);
        // What the reply carries (the errors and messages of before).
        let reply = match want {
            ReadOnly => (NBD_EPERM, "export is read-only"),
            BeyondEnd => (NBD_ENOSPC, "write beyond the end of the export"),
            _ => (NBD_EINVAL, "invalid request"),
        };
        assert_eq!((got.errno(), got.message()), reply, "{got:?}");
    }
}

#[test]
fn validation_rules() {
    let c = ctx();
    let ok = validate_errno(&req(NBD_CMD_READ, 0, 0, 4096), &c);
    assert_eq!(
        ok,
        Ok(Command::Read {
            offset: 0,
            length: 4096,
            df: false
        })
    );
    assert_eq!(
        validate_errno(&req(NBD_CMD_READ, 0, (1 << 20) - 1, 2), &c),
        Err(NBD_EINVAL)
    );
    assert_eq!(
        validate_errno(&req(NBD_CMD_WRITE, 0, 1 << 20, 1), &c),
        Err(NBD_ENOSPC)
    );
    assert_eq!(
        validate_errno(&req(NBD_CMD_WRITE, 0, 0, 65537), &c),
        Err(NBD_EINVAL)
    );
    assert_eq!(
        validate_errno(&req(NBD_CMD_READ, 0, u64::MAX, 1), &c),
        Err(NBD_EINVAL)
    );
    assert_eq!(
        validate_errno(&req(NBD_CMD_TRIM, 0, 1 << 20, 1), &c),
        Err(NBD_EINVAL)
    );
    assert_eq!(
        validate_errno(&req(NBD_CMD_WRITE_ZEROES, 0, 1 << 20, 1), &c),
        Err(NBD_ENOSPC)
    );
    assert_eq!(validate_errno(&req(99, 0, 0, 0), &c), Err(NBD_EINVAL));
    assert_eq!(validate_errno(&req(8, 0, 0, 0), &c), Err(NBD_EINVAL));
    assert_eq!(
        validate_errno(&req(NBD_CMD_WRITE, NBD_CMD_FLAG_REQ_ONE, 0, 1), &c),
        Err(NBD_EINVAL)
    );
    assert_eq!(
        validate_errno(&req(NBD_CMD_READ, 1 << 9, 0, 1), &c),
        Err(NBD_EINVAL)
    );
    assert!(validate_errno(&req(NBD_CMD_FLUSH, NBD_CMD_FLAG_FUA, 0, 0), &c).is_ok());
    assert!(validate_errno(&req(NBD_CMD_READ, NBD_CMD_FLAG_DF, 0, 1), &c).is_ok());
    let wz = validate_errno(&req(NBD_CMD_WRITE_ZEROES, 0x13, 0, 1 << 20), &c);
    assert_eq!(
        wz,
        Ok(Command::WriteZeroes {
            offset: 0,
            length: 1 << 20,
            fua: true,
            no_hole: true,
            fast_zero: true
        })
    );
    let bs = validate_errno(&req(NBD_CMD_BLOCK_STATUS, NBD_CMD_FLAG_REQ_ONE, 0, 512), &c);
    assert_eq!(
        bs,
        Ok(Command::BlockStatus {
            offset: 0,
            length: 512,
            req_one: true
        })
    );
    assert_eq!(
        validate_errno(&req(NBD_CMD_BLOCK_STATUS, 0, 0, 0), &c),
        Err(NBD_EINVAL)
    );
    let no_ctx = TransmissionContext {
        base_allocation: false,
        ..c
    };
    assert_eq!(
        validate_errno(&req(NBD_CMD_BLOCK_STATUS, 0, 0, 512), &no_ctx),
        Err(NBD_EINVAL)
    );
}

#[test]
fn validation_read_only_and_simple() {
    let ro = TransmissionContext {
        transmission_flags: transmission_flags(true, false),
        structured_replies: false,
        ..ctx()
    };
    assert_eq!(
        validate_errno(&req(NBD_CMD_WRITE, 0, 0, 1), &ro),
        Err(NBD_EPERM)
    );
    assert_eq!(
        validate_errno(&req(NBD_CMD_TRIM, 0, 0, 1), &ro),
        Err(NBD_EPERM)
    );
    assert_eq!(
        validate_errno(&req(NBD_CMD_WRITE_ZEROES, 0, 0, 1), &ro),
        Err(NBD_EPERM)
    );
    assert!(validate_errno(&req(NBD_CMD_READ, 0, 0, 1), &ro).is_ok());
    // DF is not advertised without structured replies.
    assert_eq!(
        validate_errno(&req(NBD_CMD_READ, NBD_CMD_FLAG_DF, 0, 1), &ro),
        Err(NBD_EINVAL)
    );
}

#[test]
fn transmission_flag_sets() {
    let rw = transmission_flags(false, false);
    for f in [
        NBD_FLAG_HAS_FLAGS,
        NBD_FLAG_SEND_FLUSH,
        NBD_FLAG_SEND_FUA,
        NBD_FLAG_SEND_TRIM,
        NBD_FLAG_SEND_WRITE_ZEROES,
        NBD_FLAG_SEND_FAST_ZERO,
        NBD_FLAG_CAN_MULTI_CONN,
        NBD_FLAG_SEND_CACHE,
    ] {
        assert_ne!(rw & f, 0);
    }
    assert_eq!(rw & (NBD_FLAG_READ_ONLY | NBD_FLAG_SEND_DF), 0);
    let ro = transmission_flags(true, true);
    assert_ne!(ro & NBD_FLAG_READ_ONLY, 0);
    assert_ne!(ro & NBD_FLAG_SEND_DF, 0);
    assert_eq!(ro & NBD_FLAG_SEND_TRIM, 0);
}

fn ext(length: u64, hole: bool, zero: bool) -> Extent {
    Extent { length, hole, zero }
}

#[test]
fn extent_merging() {
    let extents = [
        ext(4096, false, false),
        ext(4096, false, false),
        ext(8192, true, true),
        ext(0, false, false),
        ext(4096, true, true),
        ext(4096, false, true),
    ];
    let d = extents_to_descriptors(&extents, 1 << 20, false, 100);
    assert_eq!(
        d,
        vec![
            BlockDescriptor {
                length: 8192,
                status_flags: 0
            },
            BlockDescriptor {
                length: 12288,
                status_flags: 3
            },
            BlockDescriptor {
                length: 4096,
                status_flags: 2
            },
        ]
    );
    // Total is capped at the request length.
    let d = extents_to_descriptors(&extents, 10000, false, 100);
    assert_eq!(
        d,
        vec![
            BlockDescriptor {
                length: 8192,
                status_flags: 0
            },
            BlockDescriptor {
                length: 1808,
                status_flags: 3
            }
        ]
    );
    // REQ_ONE keeps exactly one (merged) descriptor.
    let d = extents_to_descriptors(&extents, 1 << 20, true, 100);
    assert_eq!(
        d,
        vec![BlockDescriptor {
            length: 8192,
            status_flags: 0
        }]
    );
    // Descriptor count limit.
    let d = extents_to_descriptors(&extents, 1 << 20, false, 2);
    assert_eq!(d.len(), 2);
    // Huge extents never overflow u32.
    let d = extents_to_descriptors(&[ext(u64::MAX, true, false)], u32::MAX, false, 10);
    assert_eq!(
        d,
        vec![BlockDescriptor {
            length: u32::MAX,
            status_flags: 1
        }]
    );
    assert!(extents_to_descriptors(&[], 10, false, 10).is_empty());
    assert!(extents_to_descriptors(&[ext(0, false, false)], 10, false, 10).is_empty());
}

#[test]
fn block_status_chunk_layout() {
    let d = [BlockDescriptor {
        length: 512,
        status_flags: 3,
    }];
    let c = encode_block_status_chunk(11, BASE_ALLOCATION_CONTEXT_ID, &d);
    assert_eq!(c.len(), 20 + 12);
    assert_eq!(&c[6..8], &NBD_REPLY_TYPE_BLOCK_STATUS.to_be_bytes());
    assert_eq!(&c[16..20], &12u32.to_be_bytes());
    assert_eq!(&c[20..24], &1u32.to_be_bytes());
    assert_eq!(&c[24..28], &512u32.to_be_bytes());
    assert_eq!(&c[28..32], &3u32.to_be_bytes());
}

#[test]
fn block_status_chunks_one_per_context_last_done() {
    let one = |length, status_flags| {
        vec![BlockDescriptor {
            length,
            status_flags,
        }]
    };
    let c = encode_block_status_chunks(9, &[(1, one(512, 3)), (2, one(4096, 1))]);
    assert_eq!(c.len(), 2 * (20 + 12));
    let (first, second) = c.split_at(32);
    assert_eq!(&first[4..6], &0u16.to_be_bytes(), "not done");
    assert_eq!(&second[4..6], &NBD_REPLY_FLAG_DONE.to_be_bytes());
    for (chunk, id, length, flags) in [(first, 1u32, 512u32, 3u32), (second, 2, 4096, 1)] {
        assert_eq!(&chunk[6..8], &NBD_REPLY_TYPE_BLOCK_STATUS.to_be_bytes());
        assert_eq!(&chunk[8..16], &9u64.to_be_bytes());
        assert_eq!(&chunk[16..20], &12u32.to_be_bytes());
        assert_eq!(&chunk[20..24], &id.to_be_bytes());
        assert_eq!(&chunk[24..28], &length.to_be_bytes());
        assert_eq!(&chunk[28..32], &flags.to_be_bytes());
    }
    // One context: byte for byte the single done chunk.
    assert_eq!(
        encode_block_status_chunks(9, &[(1, one(512, 3))]),
        encode_block_status_chunk(9, 1, &one(512, 3))
    );
}

#[test]
fn context_extents_merge_cut_and_req_one() {
    let run = |length, flags| crate::ContextExtent { length, flags };
    let runs = [run(4096, 0), run(4096, 0), run(8192, 1), run(1 << 40, 0)];
    let d: Vec<(u32, u32)> = context_extents_to_descriptors(&runs, 20000, false, 100)
        .iter()
        .map(|d| (d.length, d.status_flags))
        .collect();
    assert_eq!(d, vec![(8192, 0), (8192, 1), (3616, 0)]);
    let d = context_extents_to_descriptors(&runs, 20000, true, 100);
    assert_eq!(
        d,
        vec![BlockDescriptor {
            length: 8192,
            status_flags: 0
        }]
    );
}

#[test]
fn meta_context_queries_select() {
    let available: Vec<String> = [
        BASE_ALLOCATION,
        "qemu:dirty-bitmap:s1",
        "qemu:dirty-bitmap:s2",
        "qemu:other",
        "x-cvol:thing",
    ]
    .map(String::from)
    .to_vec();
    let q = |queries: &[&str]| queries.iter().map(|q| q.to_string()).collect::<Vec<_>>();
    let list = |queries: &[&str]| select_meta_contexts(&available, &q(queries), true);
    let set = |queries: &[&str]| select_meta_contexts(&available, &q(queries), false);
    assert_eq!(list(&[]).len(), 5);
    assert_eq!(
        list(&["qemu:dirty-bitmap:"]),
        ["qemu:dirty-bitmap:s1", "qemu:dirty-bitmap:s2"]
    );
    assert_eq!(list(&["qemu:"]).len(), 3);
    assert_eq!(
        list(&["qemu:dirty-bitmap:s2", "nope:x"]),
        ["qemu:dirty-bitmap:s2"]
    );
    assert_eq!(list(&[":", "qemu:dirty-bitmap"]), Vec::<&str>::new());
    // SET: no wildcards, no queries select nothing, each context once.
    assert_eq!(set(&[]), Vec::<&str>::new());
    assert_eq!(set(&["qemu:dirty-bitmap:", "base:"]), Vec::<&str>::new());
    assert_eq!(
        set(&[
            "qemu:dirty-bitmap:s2",
            BASE_ALLOCATION,
            "qemu:dirty-bitmap:s2"
        ]),
        [BASE_ALLOCATION, "qemu:dirty-bitmap:s2"]
    );
}

#[test]
fn handshake_encoders() {
    let g = encode_greeting(NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES);
    assert_eq!(&g[0..8], b"NBDMAGIC");
    assert_eq!(&g[8..16], b"IHAVEOPT");
    assert_eq!(&g[16..18], &[0, 3]);
    assert!(client_flags_valid(3));
    assert!(!client_flags_valid(4));
    assert_eq!(encode_export_name_reply(1, 1, false).len(), 134);
    assert_eq!(encode_export_name_reply(1, 1, true).len(), 10);
    assert_eq!(encode_info_export(5, 1).len(), 12);
    assert_eq!(encode_info_block_size(1, 4096, 1 << 25).len(), 14);
    assert_eq!(
        encode_rep_server("ab", Some("d")),
        vec![0, 0, 0, 2, b'a', b'b', b'd']
    );
}

/// Decoders and the validator must never panic, whatever the bytes.
#[test]
fn random_input_never_panics() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for _ in 0..20_000 {
        let length_bytes = (next() % 64) as usize;
        let bytes: Vec<u8> = (0..length_bytes).map(|_| next() as u8).collect();
        let _ = parse_info_request(&bytes);
        let _ = parse_meta_context_request(&bytes);
        let _ = parse_string(&bytes);
        let mut header = [0u8; REQUEST_HEADER_BYTES];
        header.iter_mut().for_each(|b| *b = next() as u8);
        header[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        let h = parse_request_header(&header).unwrap();
        let h = RequestHeader {
            command: h.command % 10,
            flags: h.flags % 64,
            ..h
        };
        for c in [
            ctx(),
            TransmissionContext {
                size_bytes: u64::MAX,
                ..ctx()
            },
        ] {
            if let Ok(cmd) = validate_errno(&h, &c) {
                if let Some((offset, length)) = cmd.range() {
                    assert!(offset
                        .checked_add(length)
                        .is_some_and(|end| end <= c.size_bytes));
                }
            }
        }
    }
}
