//! `cvol serve`'s flags: defaults, each refusal names its flag.
use super::flags::*;
use super::*;
use clap::Parser;
use cvol_engine::Codec;

#[derive(Parser)]
struct Cmd {
    #[command(flatten)]
    serve: ServeArgs,
}

/// What the flags' checks refuse them with (cleaner, memory, elastic,
/// then the server's).
fn err(flags: &[&str]) -> String {
    let a = parse(flags);
    a.open_options()
        .and_then(|_| a.server_config().map(|_| OpenOptions::default()))
        .err()
        .unwrap()
        .to_string()
}

/// What clap refuses the flags with.
fn refused(flags: &[&str]) -> String {
    let args = std::iter::once("serve").chain(flags.iter().copied());
    Cmd::try_parse_from(args).err().unwrap().to_string()
}

#[test]
fn the_tcp_reach_follows_listen_and_socket() {
    let reach = |flags: &[&str]| {
        let args = parse(flags);
        let (r, a) = args.tcp_reach();
        (r, a.to_string())
    };
    assert_eq!(reach(&[]), (edge::Reach::Loopback, DEFAULT_LISTEN.into()));
    assert_eq!(reach(&["--socket", "/s"]).0, edge::Reach::NoTcp);
    assert_eq!(reach(&["--listen", "[::1]:9"]).0, edge::Reach::Loopback);
    let r = reach(&["--listen", "0.0.0.0:9", "--socket", "/s"]);
    assert_eq!(r, (edge::Reach::Network, "0.0.0.0:9".into()));
}

fn parse(flags: &[&str]) -> ServeArgs {
    Cmd::try_parse_from(std::iter::once("serve").chain(flags.iter().copied()))
        .unwrap()
        .serve
}

#[test]
fn defaults_are_the_engine_and_server_defaults() {
    let a = parse(&[]);
    let o = a.open_options().unwrap();
    let d = OpenOptions::default();
    assert_eq!(o.cleaner.low_free_percent, 10);
    assert_eq!(o.cleaner.high_free_percent, 25);
    assert_eq!(o.dedup_memory_bytes, None, "scaled to the volume");
    assert_eq!(o.read_cache_bytes, d.read_cache_bytes);
    assert_eq!(o.elastic.unit_blocks, 4);
    assert_eq!(
        o.elastic.recompress_unit_blocks,
        d.elastic.recompress_unit_blocks
    );
    assert_eq!(o.elastic.busy_iops, d.elastic.busy_iops);
    assert!(o.elastic.recompress && !o.read_only && !o.sync_writes);
    assert_eq!(o.elastic.inline_cpu_percent, d.elastic.inline_cpu_percent);
    let c = a.server_config().unwrap();
    let dc = ServerConfig::default();
    assert_eq!(c.max_connections, dc.max_connections);
    assert_eq!(c.max_buffered_bytes, dc.max_buffered_bytes);
    assert_eq!(c.handshake_timeout, dc.handshake_timeout);
    assert_eq!(
        c.max_connections_per_address,
        dc.max_connections_per_address
    );
    assert_eq!(c.max_handshaking, dc.max_handshaking);
    assert_eq!(c.idle_timeout, None);
    assert_eq!(c.export_name, "");
}

#[test]
fn cold_unit_size_is_a_unit_size_no_smaller_than_the_unit() {
    let cold = |f: &[&str]| {
        parse(f)
            .open_options()
            .map(|o| o.elastic.recompress_unit_blocks)
    };
    assert_eq!(cold(&[]).unwrap(), 16);
    assert_eq!(cold(&["--cold-unit-size", "16K"]).unwrap(), 4);
    assert_eq!(
        cold(&["--cold-unit-size", "64K", "--unit-size", "64K"]).unwrap(),
        16
    );
    assert!(cold(&["--cold-unit-size", "128K"]).is_err());
    assert!(cold(&["--cold-unit-size", "12K"]).is_err());
    assert!(cold(&["--cold-unit-size", "16K", "--unit-size", "32K"]).is_err());
}

#[test]
fn inline_cpu_takes_a_percentage_or_off() {
    let pct = |v: &str| parse(&["--inline-cpu", v]).open_options();
    assert_eq!(pct("off").unwrap().elastic.inline_cpu_percent, None);
    assert_eq!(pct("0").unwrap().elastic.inline_cpu_percent, Some(0));
    assert_eq!(pct("45%").unwrap().elastic.inline_cpu_percent, Some(45));
    for bad in ["101", "1.5", "of", ""] {
        let e = pct(bad).unwrap_err().to_string();
        assert!(e.contains("--inline-cpu") && e.contains("0 to 100"), "{e}");
    }
}

#[test]
fn busy_cpu_takes_a_percentage_or_off_and_the_server_reads_the_machine() {
    let o = |v: &[&str]| parse(v).open_options();
    let d = o(&["vol.cvol"]).unwrap();
    assert_eq!(d.elastic.busy_cpu_percent, Some(70));
    assert!(d.cpu.is_some(), "a server counts the machine's CPU");
    let pct = |v: &str| o(&["vol.cvol", "--busy-cpu", v]);
    assert_eq!(pct("off").unwrap().elastic.busy_cpu_percent, None);
    assert_eq!(pct("85%").unwrap().elastic.busy_cpu_percent, Some(85));
    assert_eq!(pct("100").unwrap().elastic.busy_cpu_percent, Some(100));
    for bad in ["0", "101", "7.5", "on", ""] {
        let e = pct(bad).unwrap_err().to_string();
        assert!(e.contains("--busy-cpu") && e.contains("1 to 100"), "{e}");
    }
}

#[test]
fn busy_poll_takes_microseconds_or_off() {
    use std::time::Duration;
    let poll = |v: &[&str]| parse(v).server_config().map(|c| c.busy_poll);
    assert_eq!(poll(&["vol.cvol"]).unwrap(), Duration::from_micros(100));
    let gate = |v: &[&str]| parse(v).server_config().unwrap().busy_poll_gate;
    assert!(
        gate(&["vol.cvol"]).is_some(),
        "polling asks the CPU pressure"
    );
    assert!(gate(&["vol.cvol", "--busy-poll", "off"]).is_none());
    let given = |v: &str| poll(&["vol.cvol", "--busy-poll", v]);
    assert_eq!(given("off").unwrap(), Duration::ZERO);
    assert_eq!(given("1").unwrap(), Duration::from_micros(1));
    assert_eq!(given("200us").unwrap(), Duration::from_micros(200));
    assert_eq!(given("1000").unwrap(), Duration::from_millis(1));
    for bad in ["0", "1001", "2.5", "on", "", "50ms"] {
        let e = given(bad).unwrap_err().to_string();
        assert!(e.contains("--busy-poll") && e.contains("1 to 1000"), "{e}");
    }
}

#[test]
fn an_object_store_volume_compresses_inline_and_rewrites_only_what_pays() {
    let file = parse(&["vol.cvol"]).open_options().unwrap().elastic;
    assert_eq!(file.inline_cpu_percent, Some(30));
    assert_eq!(file.recompress_min_gain_percent, 6);
    assert_eq!(file.busy_codec, Codec::Lz4);
    let s3 = parse(&["s3://bucket/vol"]).open_options().unwrap().elastic;
    assert_eq!(s3.inline_cpu_percent, None, "a deferred unit is PUT twice");
    assert_eq!(s3.recompress_min_gain_percent, 50);
    assert_eq!(s3.busy_codec, Codec::Zstd(1));
    assert_eq!(s3.busy_cpu_percent, None, "the store is the bottleneck");
    // The flags still win.
    let flags = [
        "s3://bucket/vol",
        "--inline-cpu",
        "20",
        "--recompress-min-gain",
        "10%",
        "--busy-codec",
        "lz4",
        "--busy-cpu",
        "90",
    ];
    let s3 = parse(&flags).open_options().unwrap().elastic;
    assert_eq!(s3.inline_cpu_percent, Some(20));
    assert_eq!(s3.recompress_min_gain_percent, 10);
    assert_eq!(s3.busy_codec, Codec::Lz4);
    assert_eq!(s3.busy_cpu_percent, Some(90));
    assert!(err(&["--recompress-min-gain", "100"]).contains("0 to 99"));
    assert!(err(&["--busy-codec", "none"]).contains("--inline-cpu 0"));
    assert!(err(&["--busy-codec", "zstd:99"]).starts_with("--busy-codec zstd:99"));
}

#[test]
fn each_group_names_its_flag() {
    assert!(err(&["--clean-start", "30"]).contains("--clean-start 30"));
    assert!(err(&["--read-cache", "lots"]).starts_with("--read-cache"));
    assert!(err(&["--map-cache", "4k"]).starts_with("--map-cache"));
    assert!(parse(&["--map-cache", "64k"]).open_options().is_ok());
    assert!(err(&["--map-cache", "lots"]).starts_with("--map-cache"));
    assert!(err(&["--unit-size", "3K"]).contains("--unit-size 3K"));
    assert!(err(&["--idle-iops", "9", "--busy-iops", "9"]).contains("--idle-iops 9"));
    let e = refused(&["--recompress", "yes"]);
    assert!(
        e.contains("--recompress takes on or off, not \"yes\""),
        "{e}"
    );
    let e = refused(&["--cleaner", "fifo"]);
    assert!(e.contains("--cleaner takes cost-benefit or greedy"), "{e}");
    assert!(err(&["--max-connections", "0"]).contains("--max-connections"));
    assert!(err(&["--max-buffered", "4K"]).contains("--max-buffered 4K"));
    assert!(err(&["--handshake-timeout", "0"]).contains("--handshake-timeout"));
    let e = err(&[
        "--tls",
        "on",
        "--tls-certificates",
        "/p",
        "--tls-verify-peer",
    ]);
    assert!(e.contains("use --tls require"), "{e}");
    assert!(err(&["--socket", "/s", "--allow", "::1"]).starts_with("--allow"));
}

/// The limits' refusals and defaults; absurd numbers are refused with
/// the range, never a panic.
#[test]
fn limits_name_their_flag() {
    let e = err(&["--max-connections-per-address", "0"]);
    assert!(e.contains("--max-connections-per-address"), "{e}");
    let e = err(&["--max-handshaking", "300"]);
    assert!(
        e.contains("--max-handshaking 300") && e.contains("(256)"),
        "{e}"
    );
    for bad in ["0", "soon", "1.5", "18446744073709551616"] {
        let e = err(&["--idle-timeout", bad]);
        assert!(e.contains(&format!("--idle-timeout {bad}")), "{e}");
    }
    let limits = |flags: &[&str]| parse(flags).server_config().unwrap();
    let c = limits(&["--max-connections", "40", "--idle-timeout", "600"]);
    assert_eq!(c.max_handshaking, 16);
    assert_eq!(limits(&["--max-connections", "8"]).max_handshaking, 8);
    assert_eq!(limits(&["--max-connections", "400"]).max_handshaking, 100);
    assert_eq!(c.idle_timeout, Some(std::time::Duration::from_secs(600)));
    // The cleaner is checked first, as it always was.
    assert!(err(&["--unit-size", "3K", "--clean-stop", "95"]).contains("--clean-start"));
    // Absurd numbers are refused with the range, never a panic.
    let e = err(&["--handshake-timeout", "18446744073709551615"]);
    assert!(e.contains("from 1 to 3600"), "{e}");
    assert!(err(&["--workers", "5000"]).contains("at most 1024"));
    for (flag, v) in [
        ("--read-cache", "99999T"),
        ("--dedup-memory", "0"),
        ("--dedup-memory", "99999T"),
        ("--map-cache", "99999T"),
        ("--max-buffered", "99999T"),
    ] {
        let e = err(&[flag, v]);
        assert!(e.starts_with(&format!("{flag} {v}: ")), "{e}");
    }
    assert_eq!(
        parse(&["--read-cache", "0"])
            .open_options()
            .unwrap()
            .read_cache_bytes,
        Some(0)
    );
    let a = parse(&["--workers", "0", "--export", "x", "--read-only"]);
    assert_eq!(a.server_config().unwrap().workers, 1);
    assert_eq!(a.server_config().unwrap().export_name, "x");
    assert!(a.open_options().unwrap().read_only);
}

/// The thread probe starts and ends its threads (a process limit is
/// tried end to end: scripts/e2e/hostile-local.sh).
#[test]
fn thread_probe_starts_and_ends_its_threads() {
    probe_threads(64).unwrap();
}
