//! Wording shared by every command: byte counts, plurals, and the one
//! description of the codec policies (help, `create`'s message and errors;
//! README.md quotes it), and the values of on/off flags.
use cvol_engine::codec::ZSTD_LEVEL_MAX;
use cvol_engine::policy::{auto_codec, Load, AUTO_STRONG_LEVEL_DEFAULT};
use cvol_engine::{Codec, CodecPolicy};

/// Binary units with one decimal: `0 B`, `512 B`, `1.0 KiB`, `3.5 GiB`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

/// `1 pass`, `2 passes`, `0 passes`.
pub fn count(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// What policy `auto` does, with `strong` its background codec.
pub fn auto_words(strong: Codec) -> String {
    format!(
        "{} while busy, {} under medium load, {} when idle; cold data recompressed to {strong} in the background",
        auto_codec(Load::Busy),
        auto_codec(Load::Medium),
        auto_codec(Load::Idle),
    )
}

/// The accepted forms of `--codec`.
pub fn codec_forms() -> String {
    format!("auto, auto:zstd:LEVEL, lz4, zstd:LEVEL (LEVEL 1-{ZSTD_LEVEL_MAX}) or none")
}

/// `--help` of `create --codec`.
pub fn codec_help() -> String {
    format!(
        "Codec policy: auto (elastic: {}), auto:zstd:LEVEL (the same, recompressing to zstd:LEVEL), \
         or one codec for every block: lz4, zstd:LEVEL (1-{ZSTD_LEVEL_MAX}), none. \
         Incompressible data is stored raw under every policy",
        auto_words(Codec::Zstd(AUTO_STRONG_LEVEL_DEFAULT))
    )
}

/// `--help` of `serve --busy-iops`.
pub fn busy_iops_help() -> String {
    format!(
        "Codec policy auto: 4 KiB-normalised requests per second at or above which \
         the load is busy ({})",
        auto_codec(Load::Busy)
    )
}

/// `--help` of `serve --idle-iops`.
pub fn idle_iops_help() -> String {
    format!(
        "Codec policy auto: requests per second below which the load is idle ({}); \
         between the two, {}",
        auto_codec(Load::Idle),
        auto_codec(Load::Medium)
    )
}

/// A policy as `create` reports it.
pub fn describe_policy(p: CodecPolicy) -> String {
    match p {
        CodecPolicy::Auto { strong } => format!("auto ({})", auto_words(strong)),
        CodecPolicy::Fixed(c) => format!("{c} for every block"),
    }
}

/// Parses an on/off flag's value.
pub fn on_off(flag: &str, v: &str) -> Result<bool, String> {
    match v {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{flag} takes on or off, not {v:?}")),
    }
}

/// Parses `--codec`; an unknown name lists every accepted form.
pub fn parse_codec(s: &str) -> Result<CodecPolicy, String> {
    let known = s == "auto"
        || s.starts_with("auto:")
        || s == "lz4"
        || s == "none"
        || s == "zstd"
        || s.starts_with("zstd:");
    CodecPolicy::parse(s).map_err(|e| {
        if known {
            format!("--codec {s}: {e}")
        } else {
            format!(
                "--codec {s}: not a codec policy; expected {}",
                codec_forms()
            )
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_and_plurals() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1024), "1.0 KiB");
        assert_eq!(human_bytes(3 << 29), "1.5 GiB");
        assert_eq!(human_bytes(16 << 40), "16.0 TiB");
        assert_eq!(count(1, "pass", "passes"), "1 pass");
        assert_eq!(count(0, "pass", "passes"), "0 passes");
    }

    #[test]
    fn codec_words_come_from_the_policy() {
        let w = describe_policy(CodecPolicy::parse("auto").unwrap());
        assert!(
            w.contains("lz4 while busy") && w.contains("zstd:3 when idle") && w.contains("zstd:9"),
            "{w}"
        );
        let e = parse_codec("gzip").unwrap_err();
        assert!(e.contains("auto") && e.contains("lz4"), "{e}");
        let e = parse_codec("zstd:99").unwrap_err();
        assert!(e.contains("out of range"), "{e}");
        assert!(codec_help().contains(&auto_words(Codec::Zstd(9))));
    }
}
