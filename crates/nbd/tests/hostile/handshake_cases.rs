//! The hostile handshake messages of `handshake_malformed_messages`: each
//! with what the server must do (close, or answer and stay in the
//! handshake).

use cvol_nbd::proto::*;
use cvol_nbd::test_util::{go_data, option_header};

/// What the server must do with a hostile message.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Expect {
    /// Close the connection.
    Closed,
    /// Answer the option with this reply type and stay in the handshake.
    Reply(u32),
}

/// A hostile handshake message: what it is, its bytes, what must happen.
pub type Case = (&'static str, Vec<u8>, Expect);

/// An option message: header and data.
fn with(option: u32, data: &[u8]) -> Vec<u8> {
    let mut m = option_header(option, data.len() as u32);
    m.extend_from_slice(data);
    m
}

/// Bad magic, unknown options, options that take no data, declared
/// lengths beyond every limit.
pub fn option_cases() -> Vec<Case> {
    let opt = option_header;
    vec![
        (
            "bad option magic",
            b"IHAVEOPX\0\0\0\x07\0\0\0\0".to_vec(),
            Expect::Closed,
        ),
        (
            "unknown option 0",
            with(0, &[]),
            Expect::Reply(NBD_REP_ERR_UNSUP),
        ),
        (
            "unknown option u32::MAX",
            with(u32::MAX, b"x"),
            Expect::Reply(NBD_REP_ERR_UNSUP),
        ),
        (
            "STARTTLS with data",
            with(NBD_OPT_STARTTLS, b"x"),
            Expect::Reply(NBD_REP_ERR_INVALID),
        ),
        (
            "STRUCTURED_REPLY with data",
            with(NBD_OPT_STRUCTURED_REPLY, b"x"),
            Expect::Reply(NBD_REP_ERR_INVALID),
        ),
        (
            "declared length u32::MAX",
            opt(NBD_OPT_GO, u32::MAX),
            Expect::Closed,
        ),
        (
            "declared length 1 MiB + 1",
            opt(99, (1 << 20) + 1),
            Expect::Closed,
        ),
    ]
}

/// Junk export names, lying INFO/GO counts, a metadata-context option
/// before structured replies.
pub fn name_and_info_cases() -> Vec<Case> {
    let opt = option_header;
    let mut name_5000 = 5000u32.to_be_bytes().to_vec();
    name_5000.extend_from_slice(&[b'a'; 5000]);
    name_5000.extend_from_slice(&[0, 0]);
    let mut info_count_lies = go_data("", &[]);
    info_count_lies.truncate(info_count_lies.len() - 2);
    info_count_lies.extend_from_slice(&[0xff, 0xff, 0, 1]); // 65535 infos, 1 given
    let mut meta_count_huge = 0u32.to_be_bytes().to_vec();
    meta_count_huge.extend_from_slice(&u32::MAX.to_be_bytes());
    vec![
        (
            "EXPORT_NAME of 64 KiB + 1",
            opt(NBD_OPT_EXPORT_NAME, (64 << 10) + 1),
            Expect::Closed,
        ),
        (
            "EXPORT_NAME not UTF-8",
            with(NBD_OPT_EXPORT_NAME, &[0xff, 0xfe]),
            Expect::Closed,
        ),
        (
            "EXPORT_NAME with NUL",
            with(NBD_OPT_EXPORT_NAME, b"\0"),
            Expect::Closed,
        ),
        (
            "EXPORT_NAME of 5000 bytes",
            with(NBD_OPT_EXPORT_NAME, &[b'a'; 5000]),
            Expect::Closed,
        ),
        (
            "GO with empty data",
            with(NBD_OPT_GO, &[]),
            Expect::Reply(NBD_REP_ERR_INVALID),
        ),
        (
            "GO with a 5000-byte name",
            with(NBD_OPT_GO, &name_5000),
            Expect::Reply(NBD_REP_ERR_INVALID),
        ),
        (
            "GO with a lying info count",
            with(NBD_OPT_GO, &info_count_lies),
            Expect::Reply(NBD_REP_ERR_INVALID),
        ),
        (
            "INFO with name length u32::MAX",
            with(NBD_OPT_INFO, &[0xff; 6]),
            Expect::Reply(NBD_REP_ERR_INVALID),
        ),
        (
            "LIST_META_CONTEXT before structured replies",
            with(NBD_OPT_LIST_META_CONTEXT, &meta_count_huge),
            Expect::Reply(NBD_REP_ERR_INVALID),
        ),
    ]
}

/// Metadata-context options with huge counts and lengths (sent after
/// structured replies were negotiated).
pub fn structured_cases() -> Vec<Case> {
    let mut meta_count_huge = 0u32.to_be_bytes().to_vec();
    meta_count_huge.extend_from_slice(&u32::MAX.to_be_bytes());
    let mut meta_query_huge = 0u32.to_be_bytes().to_vec();
    meta_query_huge.extend_from_slice(&1u32.to_be_bytes());
    meta_query_huge.extend_from_slice(&u32::MAX.to_be_bytes());
    vec![
        (
            "meta context count u32::MAX",
            with(NBD_OPT_SET_META_CONTEXT, &meta_count_huge),
            Expect::Reply(NBD_REP_ERR_INVALID),
        ),
        (
            "meta context query length u32::MAX",
            with(NBD_OPT_LIST_META_CONTEXT, &meta_query_huge),
            Expect::Reply(NBD_REP_ERR_INVALID),
        ),
    ]
}
