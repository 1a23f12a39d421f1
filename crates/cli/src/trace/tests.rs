//! The trace file's records, `show` and `replay`'s data and flags.
use super::*;

#[test]
fn data_kinds_parse_and_fill_as_named() {
    assert_eq!(DataKind::parse("55").unwrap(), DataKind::Compressible(55));
    assert_eq!(DataKind::parse("55%").unwrap(), DataKind::Compressible(55));
    assert_eq!(DataKind::parse("random").unwrap(), DataKind::Random);
    assert!(DataKind::parse("101")
        .unwrap_err()
        .to_string()
        .starts_with("--data"));
    let mut a = vec![1u8; 8192];
    DataKind::Compressible(50).fill(&mut a, 0, 1);
    assert!(a[2048..4096].iter().all(|&b| b == 0) && a[6144..].iter().all(|&b| b == 0));
    assert!(a[..2048].iter().filter(|&&b| b == 0).count() < 64);
    let mut b = vec![0u8; 8192];
    DataKind::Compressible(50).fill(&mut b, 0, 2);
    assert_ne!(a, b, "another request writes other bytes");
    assert_ne!(a[..4096], a[4096..], "blocks differ");
    DataKind::Zero.fill(&mut b, 0, 2);
    assert!(b.iter().all(|&x| x == 0));
}

#[test]
fn unit_sizes_parse_as_serve_reads_them() {
    assert_eq!(parse_unit_size("4K").unwrap(), 1);
    assert_eq!(parse_unit_size("16K").unwrap(), 4);
    assert_eq!(parse_unit_size("64K").unwrap(), 16);
    for bad in ["3K", "2K", "128K", "0"] {
        let e = parse_unit_size(bad).unwrap_err().to_string();
        assert!(e.starts_with("--unit-size"), "{bad}: {e}");
    }
}

#[test]
fn the_volume_report_names_the_figures_as_stat_does() {
    let mut s = cvol_engine::VolumeStats {
        physical_used_bytes: 1 << 20,
        padding_bytes: 1 << 18,
        pages_written_per_block: 1.25,
        map_bytes_per_mapped_block: 2.5,
        ..Default::default()
    };
    s.elastic.client_reads = 10;
    s.elastic.store_pages_read = 15;
    s.elastic.pages_read_per_read = 1.5;
    s.cleaner.cleaner_segments_cleaned = 3;
    let v = volume_json(&s);
    let stat = serde_json::to_value(&s).unwrap();
    for (k, x) in v.as_object().unwrap() {
        assert_eq!(
            Some(x),
            stat.get(k),
            "{k} is not stat's figure of that name"
        );
    }
    assert_eq!(v["pages_read_per_read"], 1.5);
    assert_eq!(v["cleaner_segments_cleaned"], 3);
    let text = volume_lines(&s).join("\n");
    assert!(
        text.contains("padding 262144 bytes (25.00% of physical used)"),
        "{text}"
    );
    assert!(text.contains("1.500 pages per read") && text.contains("3 segments cleaned"));
}

#[test]
fn a_trace_cut_short_reads_up_to_its_last_whole_record() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.trace");
    let recorder = Arc::new(Recorder::create(&path, 1 << 30).unwrap());
    let again = Recorder::create(&path, 1 << 30).map(|_| ());
    assert!(again.unwrap_err().to_string().contains("exists"));
    for i in 0..10u64 {
        recorder.record(TraceRecord {
            start_ns: i * 1000,
            offset: i * 4096,
            length: 4096,
            duration_ns: 10,
            command: TraceCommand::Write,
            flags: 0,
            result: 0,
        });
    }
    recorder.finish();
    let t = read_trace(&path).unwrap();
    assert_eq!((t.records.len(), t.trailing_bytes), (10, 0));
    assert_eq!(t.records[9].offset, 9 * 4096);
    let len = std::fs::metadata(&path).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(len - 5).unwrap();
    let t = read_trace(&path).unwrap();
    assert_eq!((t.records.len(), t.trailing_bytes), (9, 27));
}
