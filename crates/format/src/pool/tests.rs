use super::*;

const UUID: [u8; 16] = [7; 16];

fn table() -> PoolTable {
    let mut t = PoolTable::new(UUID, 3 * EXTENT_BYTES + 4096, 1_700_000_000);
    t.volumes.push(PoolVolume {
        name: "vm-2.disk".into(),
        id: 2,
        size_bytes: 8192,
        created_unix_secs: 5,
        extents: vec![9],
        parent: 0,
    });
    t.next_id = 3;
    t.pending = vec![4, 5];
    t.generation = 7;
    t
}

#[test]
fn round_trip() {
    let t = table();
    assert_eq!(t.volumes[0].extents, vec![0, 1, 2, 3]);
    let b = t.encode();
    assert_eq!(
        PoolTable::payload_len(&b, &UUID).unwrap() + POOL_HEADER_BYTES,
        b.len()
    );
    assert_eq!(PoolTable::decode(&b, &UUID).unwrap(), t);
    assert_eq!(t.slot(), 1);
    let free = t.free_extents();
    assert_eq!(&free[..3], &[6, 7, 8]);
    assert_eq!(free.len() as u32, POOL_EXTENTS - 7);
}

#[test]
fn every_flipped_byte_is_refused() {
    let b = table().encode();
    for i in 0..b.len() {
        let mut d = b.clone();
        d[i] ^= 0x10;
        assert!(
            PoolTable::decode(&d, &UUID).is_err(),
            "byte {i} flipped was taken"
        );
    }
    assert!(PoolTable::decode(&b[..b.len() - 1], &UUID).is_err());
    assert!(
        PoolTable::decode(&b, &[8; 16]).is_err(),
        "another volume's table"
    );
}

/// A table whose checksums are right but whose content breaks a rule.
fn refused(mutate: impl FnOnce(&mut PoolTable)) -> String {
    let mut t = table();
    mutate(&mut t);
    match PoolTable::decode(&t.encode(), &UUID) {
        Err(FormatError::Invalid(why)) => why.to_string(),
        other => panic!("taken: {other:?}"),
    }
}

#[test]
fn invalid_content_is_refused() {
    assert!(refused(|t| t.volumes[1].extents = vec![2]).contains("used twice"));
    assert!(refused(|t| t.pending.push(0)).contains("used twice"));
    assert!(refused(|t| t.volumes[1].extents = vec![POOL_EXTENTS]).contains("out of range"));
    assert!(refused(|t| t.volumes[1].size_bytes = EXTENT_BYTES + 4096).contains("size"));
    assert!(refused(|t| t.volumes[1].size_bytes = 4095).contains("size"));
    assert!(refused(|t| t.volumes[1].name = "default".into()).contains("twice"));
    assert!(refused(|t| t.volumes[1].id = 1).contains("twice"));
    assert!(refused(|t| t.volumes[1].name = "a/b".into()).contains("name"));
    assert!(refused(|t| t.next_id = 2).contains("id out of range"));
    assert!(refused(|t| t.generation = 0).contains("generation"));
}

#[test]
fn names() {
    for ok in ["default", "vm1", "a.b_c-d+e:f", &"x".repeat(64)] {
        assert_eq!(name_problem(ok), None, "{ok}");
    }
    let cases = [
        ("", "empty"),
        ("a/b", "'/'"),
        ("vm@snap", "'@'"),
        ("-x", "start"),
        (".x", "start"),
        ("a b", "only"),
        ("é", "only"),
    ];
    for (bad, why) in cases {
        assert!(name_problem(bad).unwrap().contains(why), "{bad}");
    }
    assert!(name_problem(&"x".repeat(65)).unwrap().contains("64"));
}

#[test]
fn a_full_table_fits_its_slot_up_to_4096_volumes() {
    let mut t = PoolTable::new(UUID, EXTENT_BYTES, 0);
    for i in 1..4096u32 {
        t.volumes.push(PoolVolume {
            name: format!("{:064}", i),
            id: u64::from(i) + 1,
            size_bytes: 4 * EXTENT_BYTES,
            created_unix_secs: 0,
            extents: (0..4).map(|k| i * 4 + k).collect(),
            parent: 0,
        });
    }
    t.next_id = 4098;
    assert!(t.fits(), "{} bytes", t.encode().len());
    t.validate().unwrap();
}

fn table_v2() -> PoolTable {
    let mut t = table();
    t.snapshots.push(PoolSnapshot {
        name: "monday".into(),
        id: 3,
        volume: 1,
        size_bytes: 3 * EXTENT_BYTES + 4096,
        created_unix_secs: 9,
        state: SnapState::Live,
        extents: vec![10, NO_EXTENT, 12, 13],
    });
    t.volumes.push(PoolVolume {
        name: "clone".into(),
        id: 4,
        size_bytes: 4096,
        created_unix_secs: 10,
        extents: vec![20],
        parent: 3,
    });
    t.next_id = 5;
    t
}

#[test]
fn snapshots_round_trip_as_version_2() {
    assert_eq!(table().version(), POOL_VERSION, "no snapshot: version 1");
    let t = table_v2();
    assert_eq!(t.version(), POOL_VERSION_SNAPSHOTS);
    let b = t.encode();
    assert_eq!(u32::from_le_bytes(b[8..12].try_into().unwrap()), 2);
    assert_eq!(PoolTable::decode(&b, &UUID).unwrap(), t);
    assert_eq!(t.snapshot("default", "monday").unwrap().id, 3);
    assert!(t.snapshot("vm-2.disk", "monday").is_none());
    assert!(!t.free_extents().contains(&12));
    assert!(
        t.free_extents().contains(&11),
        "a snapshot extent not taken"
    );
    for i in 0..b.len() {
        let mut d = b.clone();
        d[i] ^= 0x10;
        assert!(PoolTable::decode(&d, &UUID).is_err(), "byte {i} flipped");
    }
}

fn refused_v2(mutate: impl FnOnce(&mut PoolTable)) -> String {
    let mut t = table_v2();
    mutate(&mut t);
    match PoolTable::decode(&t.encode(), &UUID) {
        Err(FormatError::Invalid(why)) => why.to_string(),
        other => panic!("taken: {other:?}"),
    }
}

#[test]
fn snapshot_rules() {
    assert!(refused_v2(|t| t.snapshots[0].volume = 9).contains("of no volume"));
    assert!(refused_v2(|t| t.snapshots[0].id = 2).contains("taken"));
    assert!(refused_v2(|t| t.snapshots[0].extents[0] = 9).contains("used twice"));
    assert!(refused_v2(|t| t.snapshots[0].extents.pop().map_or((), drop)).contains("size"));
    assert!(refused_v2(|t| t.volumes[2].parent = 2).contains("clone of no snapshot"));
    assert!(refused_v2(|t| t.snapshots[0].name = "a@b".into()).contains("name invalid"));
    let dup = |t: &mut PoolTable| {
        let mut s = t.snapshots[0].clone();
        s.id = 4;
        s.extents = vec![30, 31, 32, 33];
        t.volumes.pop();
        t.snapshots.push(s);
    };
    assert!(refused_v2(dup).contains("name used twice"));
    assert_eq!(
        snapshot_name_problem("a/b"),
        Some("a snapshot name cannot contain '/'")
    );
}
