use super::*;
use crate::record::{RecordHeader, RecordKind};
use crate::CodecTag;

fn header(payload_len: usize) -> RecordHeader {
    RecordHeader {
        kind: RecordKind::Data,
        codec: CodecTag::Lz4,
        level: 0,
        mask: 0,
        volume_tag: 0x1234_5678,
        epoch: 7,
        seq: 4242,
        lba: 99,
        nblocks: 1,
        payload_len: (payload_len + SEAL_TAG_BYTES) as u32,
        crc: 0,
        sealed: true,
    }
}

/// Builds a sealed record the way the log does: the header without its
/// crc is the associated data, then the crc over the sealed bytes.
fn sealed_record(s: &Sealer, plain: &[u8]) -> Vec<u8> {
    let mut h = header(plain.len());
    let aad = h.encode_with_crc(0);
    let mut sealed = vec![0u8; plain.len() + SEAL_TAG_BYTES];
    s.seal_record(&aad[..SEAL_AAD_BYTES], h.epoch, h.seq, plain, &mut sealed);
    crate::record::encode_record(&mut h, &sealed)
}

#[test]
fn a_sealed_record_opens_with_its_key_only() {
    let plain = b"the quick brown fox jumps over the lazy dog".repeat(20);
    for cipher in Cipher::ALL {
        let s = Sealer::new(cipher, &[1; 32]);
        let rec = sealed_record(&s, &plain);
        let (h, _) = RecordHeader::decode_verified(&rec).expect("verifies");
        assert!(h.sealed);
        assert_eq!(h.plain_len(), plain.len());
        assert_eq!(
            payload(Some(&s), &h, &rec).expect("opens").as_ref(),
            &plain[..]
        );
        // The plaintext appears nowhere in the record.
        assert!(!rec.windows(16).any(|w| w == &plain[..16]));
        let other = Sealer::new(cipher, &[2; 32]);
        assert_eq!(other.open_record(&h, &rec), Err(FormatError::Unauthentic));
        assert_eq!(payload(None, &h, &rec), Err(FormatError::Sealed));
    }
}

#[test]
fn every_changed_byte_fails_authentication() {
    let s = Sealer::new(Cipher::Aes256Gcm, &[3; 32]);
    let rec = sealed_record(&s, &[0xab; 300]);
    for i in 0..rec.len() {
        if (40..44).contains(&i) {
            continue; // the crc is not authenticated (it is a checksum)
        }
        let mut bad = rec.clone();
        bad[i] ^= 1;
        let Ok(h) = RecordHeader::decode(&bad) else {
            continue; // a header byte that no longer decodes
        };
        assert!(
            s.open_record(&h, &bad).is_err(),
            "a flip of byte {i} went unnoticed"
        );
    }
}

#[test]
fn a_record_in_the_clear_is_refused_on_an_encrypted_volume() {
    let mut h = header(0);
    h.sealed = false;
    h.payload_len = 5;
    let rec = crate::record::encode_record(&mut h, b"hello");
    let s = Sealer::new(Cipher::ChaCha20Poly1305, &[4; 32]);
    assert_eq!(payload(Some(&s), &h, &rec), Err(FormatError::NotSealed));
    assert_eq!(payload(None, &h, &rec).expect("clear").as_ref(), b"hello");
}

/// Known answer of the record format. The expected bytes were computed
/// outside cvol, by Python's `cryptography` (OpenSSL) from the subkey, the
/// nonce (`epoch 7 || seq 4242`, little-endian) and the associated data
/// pinned here: a change of nonce layout, AAD or subkey derivation, or an
/// AEAD that is not the standard one, fails it.
#[test]
fn known_answer_of_the_record_format() {
    const SUBKEY: &str = "dfe3257df4385a45046ae7d07a1e6aec65c79cd4938d15632ab25237003ac256";
    const AAD: &str =
        "43564c52810100007856341207000000921000000000000063000000000000000100000021000000";
    let expect = [
        (
            Cipher::Aes256Gcm,
            "7394d57c1df15021591449b127cc72f6f0dd8b91be6156017dc8a9aa9808107746",
        ),
        (
            Cipher::ChaCha20Poly1305,
            "af389a92e0d30013bf7a92d2e4d6d833737f6540aace261032bbd703b2113d0b9c",
        ),
    ];
    let mut key = [0u8; 32];
    for (i, k) in key.iter_mut().enumerate() {
        *k = i as u8;
    }
    let hex = |b: &[u8]| b.iter().map(|b| format!("{b:02x}")).collect::<String>();
    assert_eq!(hex(&blake3::derive_key(RECORDS_CONTEXT, &key)), SUBKEY);
    for (cipher, want) in expect {
        let s = Sealer::new(cipher, &key);
        let rec = sealed_record(&s, b"cvol known answer");
        assert_eq!(hex(&rec[..SEAL_AAD_BYTES]), AAD);
        assert_eq!(hex(&rec[RECORD_HEADER_BYTES..]), want, "{}", cipher.name());
    }
}

#[test]
fn blobs_open_in_their_domain_only() {
    let s = Sealer::new(Cipher::Aes256Gcm, &[5; 32]);
    let b = s.seal_blob(b"pool table", b"volume names");
    assert_ne!(
        b,
        s.seal_blob(b"pool table", b"volume names"),
        "fresh nonce"
    );
    assert_eq!(
        s.open_blob(b"pool table", &b).expect("opens"),
        b"volume names"
    );
    assert_eq!(s.open_blob(b"other", &b), Err(FormatError::Unauthentic));
    let mut bad = b.clone();
    bad[20] ^= 4;
    assert_eq!(
        s.open_blob(b"pool table", &bad),
        Err(FormatError::Unauthentic)
    );
}

#[test]
fn subkeys_differ_by_use_and_key() {
    let a = Sealer::new(Cipher::Aes256Gcm, &[6; 32]);
    let b = Sealer::new(Cipher::Aes256Gcm, &[7; 32]);
    assert_ne!(a.fingerprint_key(), b.fingerprint_key());
    assert_ne!(a.fingerprint_key(), &[6; 32]);
    assert_eq!(a, Sealer::new(Cipher::Aes256Gcm, &[6; 32]));
    assert_ne!(a, b);
}

/// Opening in place gives the same plaintext as `open_record`, at the
/// place the range names; every changed byte fails it too; and a record
/// in the clear, or a sealed one without a key, is refused as by `payload`.
#[test]
fn opening_in_place_matches_opening_a_copy() {
    let plain = b"in place, in the record's own buffer; ".repeat(30);
    for cipher in Cipher::ALL {
        let s = Sealer::new(cipher, &[5; 32]);
        let rec = sealed_record(&s, &plain);
        let (h, _) = RecordHeader::decode_verified(&rec).expect("verifies");
        let mut buf = rec.clone();
        buf.extend_from_slice(&[0xee; 10]); // the next record's bytes
        let r = payload_in_place(Some(&s), &h, &mut buf).expect("opens");
        assert_eq!(&buf[r.clone()], &plain[..]);
        assert_eq!(&buf[r], &s.open_record(&h, &rec).unwrap()[..]);
        assert_eq!(&buf[rec.len()..], &[0xee; 10], "past the record untouched");
        for i in (0..rec.len()).filter(|i| !(40..44).contains(i)) {
            let mut bad = rec.clone();
            bad[i] ^= 0x40;
            let Ok(h) = RecordHeader::decode(&bad) else {
                continue;
            };
            assert!(
                payload_in_place(Some(&s), &h, &mut bad).is_err(),
                "{}: a flip of byte {i} went unnoticed",
                cipher.name()
            );
        }
        let mut copy = rec.clone();
        assert_eq!(
            payload_in_place(None, &h, &mut copy),
            Err(FormatError::Sealed)
        );
    }
    let mut h = header(0);
    h.sealed = false;
    h.payload_len = 5;
    let mut rec = crate::record::encode_record(&mut h, b"hello");
    let s = Sealer::new(Cipher::Aes256Gcm, &[6; 32]);
    assert_eq!(
        payload_in_place(Some(&s), &h, &mut rec),
        Err(FormatError::NotSealed)
    );
    let r = payload_in_place(None, &h, &mut rec).expect("clear");
    assert_eq!(&rec[r], b"hello");
    let mut short = rec[..rec.len() - 1].to_vec();
    assert!(payload_in_place(None, &h, &mut short).is_err());
}
