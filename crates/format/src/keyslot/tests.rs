use super::*;

const UUID: [u8; 16] = [9; 16];

#[test]
fn a_raw_key_wraps_and_unwraps() {
    let dk = new_data_key();
    for cipher in Cipher::ALL {
        let slot = KeySlot::wrap(cipher, &UUID, &dk, &[0x5a; 32]).expect("wraps");
        assert_eq!(slot.kdf, Kdf::Raw);
        let back = KeySlot::decode(&slot.encode()).expect("decodes");
        assert_eq!(back, slot);
        assert_eq!(*back.unwrap(&UUID, &[0x5a; 32]).expect("unwraps"), *dk);
        assert_eq!(back.unwrap(&UUID, &[0x5b; 32]), Err(KeyError::WrongKey));
        assert_eq!(back.unwrap(&[8; 16], &[0x5a; 32]), Err(KeyError::WrongKey));
        assert_eq!(back.unwrap(&UUID, b"a passphrase"), Err(KeyError::WrongKey));
    }
}

#[test]
fn a_passphrase_goes_through_argon2id() {
    let dk = new_data_key();
    let slot =
        KeySlot::wrap(Cipher::Aes256Gcm, &UUID, &dk, b"correct horse battery\n").expect("wraps");
    assert!(matches!(slot.kdf, Kdf::Argon2id { .. }));
    // The trailing newline is not part of the passphrase.
    assert_eq!(
        *slot
            .unwrap(&UUID, b"correct horse battery")
            .expect("unwraps"),
        *dk
    );
    assert_eq!(
        slot.unwrap(&UUID, b"correct horse batterx"),
        Err(KeyError::WrongKey)
    );
    // Lowering the stored cost changes the associated data: refused.
    let mut cheap = slot;
    cheap.kdf = Kdf::Argon2id {
        m_kib: 8,
        t: 1,
        p: 1,
    };
    assert_eq!(
        cheap.unwrap(&UUID, b"correct horse battery"),
        Err(KeyError::WrongKey)
    );
}

#[test]
fn unusable_key_files_are_named() {
    let dk = new_data_key();
    for bad in [&b""[..], b"\n", b"short\n"] {
        assert!(matches!(
            KeySlot::wrap(Cipher::Aes256Gcm, &UUID, &dk, bad),
            Err(KeyError::BadKeyFile(_))
        ));
    }
}

#[test]
fn damaged_slots_are_refused() {
    let dk = new_data_key();
    let b = KeySlot::wrap(Cipher::ChaCha20Poly1305, &UUID, &dk, &[1; 32])
        .expect("wraps")
        .encode();
    for i in 0..KEY_SLOT_BYTES {
        let mut bad = b;
        bad[i] ^= 0x10;
        assert!(KeySlot::decode(&bad).is_err(), "byte {i}");
    }
}
