use super::*;

// The messages are what recovery said when it returned strings: the CLI
// and the e2e scripts grep them, and users follow their advice.

fn assert_messages(cases: Vec<(RecoveryError, &str)>) {
    for (e, want) in cases {
        assert_eq!(e.to_string(), want, "{e:?}");
        let open = VolError::Open(OpenError::Recovery(e));
        assert_eq!(open.to_string(), want);
    }
}

fn io() -> io::Error {
    io::Error::other("disk on fire")
}

#[test]
fn superblock_and_io_messages_are_unchanged() {
    assert_messages(vec![
        (
            RecoveryError::NoSuperblock {
                copy_a: SuperblockCopyError::Read(io()),
                copy_b: SuperblockCopyError::Read(io()),
            },
            "not a cvol volume (no valid superblock: disk on fire)",
        ),
        (
            RecoveryError::SuperblockBeyondBacking {
                physical_size_bytes: 100,
                backing_bytes: 50,
            },
            "superblock says 100 physical bytes but the backing store has 50",
        ),
        (
            RecoveryError::SegmentStartUnreadable {
                segment: 7,
                source: io(),
            },
            "reading the start of segment 7: disk on fire",
        ),
        (
            RecoveryError::SegmentUnreadable {
                segment: 7,
                source: io(),
            },
            "reading segment 7: disk on fire",
        ),
        (
            RecoveryError::BadRecord {
                seq: 9,
                offset: 4096,
                detail: "ref record: bad".into(),
            },
            "record seq 9 at byte 4096: ref record: bad",
        ),
        (
            RecoveryError::BothSuperblocksDamaged,
            "both superblock copies are damaged: cannot repair",
        ),
        (RecoveryError::RepairIo(io()), "disk on fire"),
    ]);
}

#[test]
fn refusal_messages_are_unchanged() {
    let notes = vec!["first note".to_string(), "second note".to_string()];
    let shortfall = ShortRollForward {
        what: "checkpoint generation 3".into(),
        last_seq: 40,
        segment: 2,
        end: 512,
        certified_seq: 45,
        certified_by: "a SYNCED record (seq 46) in segment 2".into(),
    };
    assert_messages(vec![
        (
            RecoveryError::NoLogStart,
            "no log start (record seq 1) found",
        ),
        (
            RecoveryError::NeverInitialised,
            "no checkpoint and no log start found: the volume was never initialised",
        ),
        (
            RecoveryError::NoIntactRecord,
            "no intact record in the log: nothing to rebuild from",
        ),
        (
            RecoveryError::NoUsableCheckpoint {
                notes: notes.clone(),
            },
            "no usable checkpoint (first note; second note); refusing to guess the map: \
             `cvol check --repair` rebuilds it from the log",
        ),
        (
            RecoveryError::RollForwardBelowCertified {
                shortfall,
                notes: notes.clone(),
            },
            "flushed data is damaged: checkpoint generation 3: its roll-forward ends at seq \
             40 (segment 2, byte 512), below seq 45 certified as flushed by a SYNCED record \
             (seq 46) in segment 2; opening would silently lose what was flushed after that \
             point, so cvol refuses and writes nothing: `cvol check --repair` salvages every \
             intact record and lists the blocks that are lost (first note; second note)",
        ),
    ]);
}

#[test]
fn damaged_chain_messages_are_unchanged() {
    let chain = "the log is damaged: its chain of records ends at seq 10, but a later record \
                 certifies that records up to seq 12 were flushed; opening would lose them \
                 silently, so cvol refuses: `cvol check --repair` rebuilds the map from every \
                 intact record";
    let with_notes = format!("{chain} (first note; second note)");
    let notes = vec!["first note".to_string(), "second note".to_string()];
    let damaged = |notes| RecoveryError::ChainEndsBeforeCertified {
        last_seq: 10,
        certified: 12,
        notes,
    };
    assert_messages(vec![
        (damaged(Vec::new()), chain),
        (damaged(notes), &with_notes),
    ]);
}

// Recovery's internal errors were strings; the notes a refusal lists
// (and `cvol check` prints) read as before.
#[test]
fn record_and_checkpoint_messages_are_unchanged() {
    let location = EntryLocationError::OutsideDataArea {
        offset: 4096,
        len: 100,
    };
    let cases: Vec<(Box<dyn std::error::Error>, &str)> = vec![
        (
            Box::new(RecordError::CrossesSegment {
                offset: 8192,
                len: 64,
            }),
            "record at 8192 (+64) crosses a segment boundary",
        ),
        (
            Box::new(RecordError::NotExpected),
            "record belongs to another volume or has another length",
        ),
        (
            Box::new(ChunkError::Entry {
                lba: 3,
                why: location,
            }),
            "lba 3: points outside the data area (4096+100)",
        ),
        (
            Box::new(ApplyError::RefLocation(EntryLocationError::InMetadataArea)),
            "ref record points into the metadata area",
        ),
        (
            Box::new(CheckpointError::Page {
                page: 2,
                why: PageError::NotNamed,
            }),
            "map page 2: not the record the directory names",
        ),
        (
            Box::new(CheckpointError::ResumeOutsideLog {
                segment: 9,
                offset: 512,
            }),
            "resume position 9+512 outside the log",
        ),
        (
            Box::new(CheckpointError::Dir(DirError::NotNamed { offset: 77 })),
            "map directory at 77 is not the one the checkpoint names",
        ),
        (
            Box::new(TableError::NotNamed { table: 4 }),
            "table 4: not the record the directory names",
        ),
    ];
    for (e, want) in cases {
        assert_eq!(e.to_string(), want);
    }
}
