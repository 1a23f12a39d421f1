//! Writes the seed corpora `fuzz/corpus/<target>/` and the recovery image
//! `crates/fuzzlib/images/recovery.img.lz4`:
//!
//! ```text
//! cargo run -p cvol-fuzzlib --example gen_seeds            # seeds + image
//! cargo run -p cvol-fuzzlib --example gen_seeds -- --seeds-only
//! ```
//!
//! Seeds are valid inputs (handshake transcripts, request streams, encoded
//! superblock/pointer/records/checkpoint payloads taken from the image,
//! damage operations on the image); libFuzzer mutates from there. Files are
//! named after what they hold and overwritten in place, so rerunning after a
//! format change refreshes them. With `--seeds-only` the committed image is
//! kept (its records feed the `format_decoders` seeds).
use std::fs;
use std::path::{Path, PathBuf};

use cvol_format::checkpoint::CommitPayload;
use cvol_format::mapentry::MAP_ENTRY_BYTES;
use cvol_format::record::RECORD_HEADER_BYTES;
use cvol_format::{CheckpointPointer, RecordHeader, RecordKind, Superblock};
use cvol_fuzzlib::nbd::Mode;
use cvol_fuzzlib::recovery::{self, Kind};
use cvol_nbd::proto::{self, RequestHeader};
use cvol_nbd::test_util::{self, go_data, meta_context_data};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = root().join("fuzz/corpus").join(target);
    fs::create_dir_all(&dir).expect("create corpus dir");
    fs::write(dir.join(name), bytes).expect("write seed");
}

fn option(out: &mut Vec<u8>, option_type: u32, data: &[u8]) {
    out.extend(test_util::option(option_type, data));
}

fn req(out: &mut Vec<u8>, flags: u16, command: u16, offset: u64, length: u32) {
    let handle = out.len() as u64;
    out.extend_from_slice(&proto::encode_request_header(&RequestHeader {
        flags,
        command,
        handle,
        offset,
        length,
    }));
    if command == proto::NBD_CMD_WRITE {
        out.extend((0..length).map(|i| (i % 251) as u8));
    }
}

/// A typical session's requests (valid for a writable export with
/// structured replies and base:allocation).
fn session_requests(out: &mut Vec<u8>) {
    req(out, 0, proto::NBD_CMD_READ, 0, 4096);
    req(
        out,
        proto::NBD_CMD_FLAG_FUA,
        proto::NBD_CMD_WRITE,
        8192,
        1024,
    );
    req(out, 0, proto::NBD_CMD_WRITE, 100, 10);
    req(out, proto::NBD_CMD_FLAG_DF, proto::NBD_CMD_READ, 8000, 600);
    req(
        out,
        proto::NBD_CMD_FLAG_REQ_ONE,
        proto::NBD_CMD_BLOCK_STATUS,
        0,
        65536,
    );
    req(out, 0, proto::NBD_CMD_BLOCK_STATUS, 4096, 20000);
    req(out, 0, proto::NBD_CMD_TRIM, 4096, 8192);
    req(
        out,
        proto::NBD_CMD_FLAG_NO_HOLE,
        proto::NBD_CMD_WRITE_ZEROES,
        16384,
        4096,
    );
    req(
        out,
        proto::NBD_CMD_FLAG_FAST_ZERO,
        proto::NBD_CMD_WRITE_ZEROES,
        0,
        512,
    );
    req(out, 0, proto::NBD_CMD_CACHE, 0, 16384);
    req(out, 0, proto::NBD_CMD_FLUSH, 0, 0);
    req(out, 0, proto::NBD_CMD_READ, 65536, 512);
    req(out, 0, proto::NBD_CMD_DISC, 0, 0);
}

/// Requests the server must refuse (and keep the connection).
fn bad_requests(out: &mut Vec<u8>) {
    req(out, 0, proto::NBD_CMD_READ, 65536, 4096); // beyond the end
    req(out, 0, proto::NBD_CMD_READ, u64::MAX - 10, 100); // overflow
    req(out, 0, proto::NBD_CMD_READ, 0, 32768); // above max_request_bytes
    req(out, 0x8000, proto::NBD_CMD_READ, 0, 4096); // unknown flag
    req(out, 0, 42, 0, 0); // unknown command
    req(out, 0, proto::NBD_CMD_BLOCK_STATUS, 0, 0); // empty block status
    req(out, 0, proto::NBD_CMD_TRIM, 65000, 4096); // trim beyond the end
    req(out, 0, proto::NBD_CMD_WRITE, 0, 0); // empty write
    out.extend_from_slice(b"not a request magic, the server closes here....");
}

/// A write whose payload is above the limit (read and discarded until the
/// input ends: the connection drops mid-payload).
fn oversized_write(out: &mut Vec<u8>) {
    out.extend_from_slice(&proto::encode_request_header(&RequestHeader {
        flags: 0,
        command: proto::NBD_CMD_WRITE,
        handle: 99,
        offset: 0,
        length: 20000,
    }));
    out.extend(std::iter::repeat_n(0xab, 1000));
}

fn nbd_seeds() {
    nbd_handshake_seeds();
    nbd_request_seeds();
}

/// nbd_handshake: raw client bytes.
fn nbd_handshake_seeds() {
    let fixed = (proto::NBD_FLAG_C_FIXED_NEWSTYLE | proto::NBD_FLAG_C_NO_ZEROES).to_be_bytes();
    let mut s = fixed.to_vec();
    option(&mut s, proto::NBD_OPT_STRUCTURED_REPLY, &[]);
    option(
        &mut s,
        proto::NBD_OPT_SET_META_CONTEXT,
        &meta_context_data("fuzz", &[proto::BASE_ALLOCATION]),
    );
    option(
        &mut s,
        proto::NBD_OPT_GO,
        &go_data("fuzz", &[proto::NBD_INFO_NAME, proto::NBD_INFO_BLOCK_SIZE]),
    );
    session_requests(&mut s);
    write("nbd_handshake", "go-structured-session", &s);

    let mut s = 0u32.to_be_bytes().to_vec(); // old-style client: EXPORT_NAME only
    option(&mut s, proto::NBD_OPT_EXPORT_NAME, b"");
    req(&mut s, 0, proto::NBD_CMD_READ, 0, 4096);
    req(&mut s, 0, proto::NBD_CMD_DISC, 0, 0);
    write("nbd_handshake", "export-name-not-fixed", &s);

    let mut s = fixed.to_vec();
    option(&mut s, proto::NBD_OPT_LIST, &[]);
    option(
        &mut s,
        proto::NBD_OPT_INFO,
        &go_data(
            "",
            &[
                proto::NBD_INFO_NAME,
                proto::NBD_INFO_DESCRIPTION,
                proto::NBD_INFO_BLOCK_SIZE,
            ],
        ),
    );
    option(&mut s, proto::NBD_OPT_STRUCTURED_REPLY, &[]);
    option(
        &mut s,
        proto::NBD_OPT_LIST_META_CONTEXT,
        &meta_context_data("", &["base:", "qemu:dirty-bitmap:x"]),
    );
    option(
        &mut s,
        proto::NBD_OPT_LIST_META_CONTEXT,
        &meta_context_data("", &[]),
    );
    option(&mut s, proto::NBD_OPT_ABORT, &[]);
    write("nbd_handshake", "list-info-meta-abort", &s);

    let mut s = (proto::NBD_FLAG_C_FIXED_NEWSTYLE | 0x80)
        .to_be_bytes()
        .to_vec();
    option(&mut s, proto::NBD_OPT_STARTTLS, &[]);
    option(&mut s, proto::NBD_OPT_STARTTLS, b"x");
    option(&mut s, 0x4242, b"unknown option");
    option(&mut s, proto::NBD_OPT_INFO, &go_data("no such export", &[]));
    option(&mut s, proto::NBD_OPT_GO, b"\0\0\0\x10short");
    option(&mut s, proto::NBD_OPT_LIST, b"data");
    option(
        &mut s,
        proto::NBD_OPT_SET_META_CONTEXT,
        &meta_context_data("", &[]),
    ); // before structured
    option(&mut s, proto::NBD_OPT_STRUCTURED_REPLY, b"x");
    s.extend(test_util::option_header(
        proto::NBD_OPT_INFO,
        proto::MAX_OPTION_PAYLOAD_BYTES + 1,
    ));
    write("nbd_handshake", "errors-then-oversized-option", &s);
}

/// nbd_request: mode byte + transmission bytes.
fn nbd_request_seeds() {
    let all = Mode::from_byte(0b00011);
    let mut s = vec![all.to_byte()];
    session_requests(&mut s);
    write("nbd_request", "structured-session", &s);
    let mut s = vec![0];
    session_requests(&mut s);
    write("nbd_request", "simple-replies-session", &s);
    let mut s = vec![Mode::from_byte(0b10111).to_byte()];
    session_requests(&mut s);
    write("nbd_request", "read-only-session", &s);
    let mut s = vec![Mode::from_byte(0b01001).to_byte()];
    session_requests(&mut s);
    write("nbd_request", "export-name-structured", &s);
    let mut s = vec![all.to_byte()];
    bad_requests(&mut s);
    write("nbd_request", "refused-requests", &s);
    let mut s = vec![0];
    bad_requests(&mut s);
    write("nbd_request", "refused-requests-simple", &s);
    let mut s = vec![all.to_byte()];
    req(&mut s, 0, proto::NBD_CMD_READ, 0, 512);
    oversized_write(&mut s);
    write("nbd_request", "oversized-write", &s);
}

/// Decoder seeds: selector 0, logical size in blocks, then the body.
fn decoder_seed(name: &str, body: &[u8]) {
    let mut s = vec![0u8];
    s.extend_from_slice(&(recovery::LOGICAL_BYTES / 4096).to_le_bytes());
    s.extend_from_slice(body);
    write("format_decoders", name, &s);
}

fn format_seeds(image: &[u8]) {
    let sb = Superblock::decode(image).expect("image superblock");
    decoder_seed("superblock", &sb.encode()[..128]);
    for slot in 0..2 {
        let at = CheckpointPointer::slot_offset(slot) as usize;
        if let Ok(p) = CheckpointPointer::decode(&image[at..at + 512]) {
            decoder_seed(&format!("pointer-slot-{slot}"), &p.encode()[..64]);
        }
    }
    let mut seen = Vec::new();
    let mut kinds = 0;
    for s in recovery::structures_of(image) {
        if s.kind != Kind::Record {
            continue;
        }
        let rec = &image[s.offset..s.offset + s.len];
        let (h, payload) = RecordHeader::decode_verified(rec).expect("verified record");
        let key = (h.kind, h.codec, h.nblocks > 1);
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        kinds += 1;
        let unit = if h.nblocks > 1 { "-unit" } else { "" };
        let name = format!("record-{:?}-{:?}{unit}", h.kind, h.codec).to_lowercase();
        decoder_seed(&name, rec);
        match h.kind {
            RecordKind::CkptCommit => {
                let c = CommitPayload::decode(payload).expect("commit payload");
                decoder_seed("commit-payload", &c.encode());
            }
            RecordKind::MapChunk => {
                let raw = match h.codec {
                    cvol_format::CodecTag::Lz4 => {
                        lz4_flex::block::decompress_size_prepended(payload).expect("map chunk")
                    }
                    _ => payload.to_vec(),
                };
                decoder_seed("map-chunk-runs", &raw[..raw.len().min(4096)]);
                decoder_seed(
                    "map-entries",
                    &raw[12..(12 + 8 * MAP_ENTRY_BYTES).min(raw.len())],
                );
            }
            RecordKind::Ref => decoder_seed("ref-entry", &payload[..MAP_ENTRY_BYTES]),
            _ => {}
        }
    }
    assert!(kinds >= 6, "the image holds every record kind: {seen:?}");
    let _ = RECORD_HEADER_BYTES;
}

/// Recovery seeds: flags byte then damage operations (see `recovery::damage`).
fn recovery_seeds(image: &[u8]) {
    let structures = recovery::structures_of(image);
    let index_of = |pred: &dyn Fn(&recovery::Structure) -> bool| {
        structures.iter().position(pred).expect("structure") as u16
    };
    let sb_a = 0u16;
    let ptr = |slot: usize| {
        index_of(&|s| {
            s.kind == Kind::Pointer && s.offset as u64 == CheckpointPointer::slot_offset(slot)
        })
    };
    let record_of = |kind: RecordKind| {
        index_of(&|s| {
            s.kind == Kind::Record
                && RecordHeader::decode(&image[s.offset..]).map(|h| h.kind) == Ok(kind)
        })
    };
    let field = |idx: u16, f: u8, delta: i8| {
        let mut v = vec![2u8];
        v.extend_from_slice(&idx.to_le_bytes());
        v.push(f);
        v.push(((delta as u8) << 1) & 0xfe);
        v
    };
    write("recovery", "intact-read-write", &[0]);
    write("recovery", "intact-read-only", &[1]);
    write("recovery", "intact-exercise-writes", &[2]);
    // Newest pointer's generation bumped: the other one must not win wrongly.
    let mut s = vec![2];
    s.extend(field(ptr(0), 0, 1));
    s.extend(field(ptr(1), 4, 1)); // seq + 1: names no commit
    write("recovery", "pointers-edited", &s);
    // A data record's lba moved by one, with a valid crc.
    let mut s = vec![0];
    s.extend(field(record_of(RecordKind::Data), 6, 1));
    write("recovery", "data-record-lba-moved", &s);
    // Commit record's payload edited (crc fixed): the checkpoint is refused.
    let mut s = vec![0];
    s.extend([1u8]);
    s.extend(record_of(RecordKind::CkptCommit).to_le_bytes());
    s.extend(60u16.to_le_bytes());
    s.extend([4, 0xff, 0xff, 0xff, 0xff]);
    write("recovery", "commit-payload-edited", &s);
    // Superblock A geometry edited (crc fixed), B intact.
    let mut s = vec![1];
    s.extend(field(sb_a, 3, 1)); // physical size
    write("recovery", "superblock-a-geometry", &s);
    // An EPOCH record's epoch bumped; a REF record's payload edited.
    let mut s = vec![0];
    s.extend(field(record_of(RecordKind::Epoch), 4, 1));
    s.extend([1u8]);
    s.extend(record_of(RecordKind::Ref).to_le_bytes());
    s.extend(44u16.to_le_bytes());
    s.extend([2, 0x10, 0x00]);
    write("recovery", "epoch-and-ref-edited", &s);
    // A range of records copied over another (stale/misdirected), sectors zeroed.
    let data_at = structures
        .iter()
        .find(|s| s.kind == Kind::Record)
        .expect("records")
        .offset as u32;
    let mut s = vec![2, 3];
    s.extend((data_at + 4096).to_le_bytes());
    s.extend((data_at + 300).to_le_bytes());
    s.extend(700u16.to_le_bytes());
    s.extend([4]);
    s.extend((data_at + 8192).to_le_bytes());
    s.extend([3]);
    write("recovery", "copied-and-zeroed", &s);
    // Raw garbage in the middle of the log, with read errors and a write budget.
    let mut s = vec![2 | 4 | 8];
    s.extend((data_at + 2048).to_le_bytes());
    s.extend(512u16.to_le_bytes());
    s.push(3);
    s.push(0);
    s.extend((data_at + 20000).to_le_bytes());
    s.push(16);
    s.extend([0xde; 16]);
    write("recovery", "garbage-read-errors-write-budget", &s);
}

/// A rustls ClientHello for the test server (fresh randoms each run).
fn client_hello() -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    let ca = rustls::pki_types::CertificateDer::from_pem_file(
        test_util::tls_fixtures().join("ca/ca-cert.pem"),
    )
    .expect("CA fixture");
    roots.add(ca).expect("CA");
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
    let mut conn =
        rustls::ClientConnection::new(std::sync::Arc::new(config), name).expect("client");
    let mut hello = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut hello).expect("write_tls");
    }
    hello
}

/// `nbd_tls`: byte 0 bit 0 = flags and STARTTLS first (see `nbd::tls`).
fn nbd_tls_seeds() {
    let hello = client_hello();
    let with_starttls = |rest: &[u8]| [&[1u8][..], rest].concat();
    write("nbd_tls", "client-hello", &with_starttls(&hello));
    write(
        "nbd_tls",
        "client-hello-cut",
        &with_starttls(&hello[..hello.len() / 2]),
    );
    write(
        "nbd_tls",
        "garbage-instead-of-hello",
        &with_starttls(&[0u8; 64]),
    );
    let mut ab = hello.clone();
    ab.extend_from_slice(&[21, 3, 3, 0, 2, 2, 40]);
    write("nbd_tls", "hello-then-alert", &with_starttls(&ab));
    // Options in the clear before TLS, then STARTTLS and a ClientHello.
    let mut s = vec![0u8];
    s.extend_from_slice(&proto::NBD_FLAG_C_FIXED_NEWSTYLE.to_be_bytes());
    option(&mut s, proto::NBD_OPT_LIST, &[]);
    option(&mut s, proto::NBD_OPT_GO, &go_data("fuzz", &[]));
    option(&mut s, proto::NBD_OPT_STRUCTURED_REPLY, &[]);
    option(&mut s, proto::NBD_OPT_STARTTLS, b"x");
    option(&mut s, proto::NBD_OPT_STARTTLS, &[]);
    s.extend_from_slice(&hello);
    write("nbd_tls", "options-before-starttls", &s);
    let mut s = vec![0u8];
    s.extend_from_slice(&proto::NBD_FLAG_C_FIXED_NEWSTYLE.to_be_bytes());
    option(&mut s, proto::NBD_OPT_EXPORT_NAME, b"fuzz");
    write("nbd_tls", "export-name-in-the-clear", &s);
}

fn main() {
    let seeds_only = std::env::args().any(|a| a == "--seeds-only");
    let image = if seeds_only {
        recovery::committed_image().expect("committed image (run without --seeds-only)")
    } else {
        let image = recovery::build_image();
        recovery::image_is_sound(&image).expect("fresh image is sound");
        let packed = lz4_flex::block::compress_prepend_size(&image);
        let path = root().join("crates/fuzzlib/images/recovery.img.lz4");
        fs::write(&path, &packed).expect("write image");
        println!("{}: {} bytes", path.display(), packed.len());
        image
    };
    nbd_seeds();
    nbd_tls_seeds();
    format_seeds(&image);
    recovery_seeds(&image);
    for (target, _) in cvol_fuzzlib::TARGETS {
        let n = fs::read_dir(root().join("fuzz/corpus").join(target))
            .map(|d| d.count())
            .unwrap_or(0);
        println!("fuzz/corpus/{target}: {n} seeds");
    }
}
