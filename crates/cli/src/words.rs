//! Wording shared by every command: byte counts, plurals, and the one
//! description of the codec policies (help, `create`'s message and errors;
//! docs/CLI.md quotes it), and the parser of word flags (on/off and the like).
use crate::error::Error;
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
        "{} while busy (or while the machine's CPU is), {} under medium load, {} when idle; cold data recompressed to {strong} in the background",
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

/// The value of an on/off flag (`--dedup`, `--recompress`, `--idle-clean`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

impl OnOff {
    pub fn on(self) -> bool {
        self == OnOff::On
    }
}

/// The parser of a word flag (a clap `ValueEnum`): `--help` lists its
/// words, and a word it does not know is refused in cvol's words, naming
/// the flag, every word it takes and the value given:
/// `--dedup takes on or off, not "maybe"`.
pub fn choice<T: clap::ValueEnum + Clone + Send + Sync + 'static>() -> Choice<T> {
    Choice(std::marker::PhantomData)
}

/// See [`choice`].
#[derive(Clone)]
pub struct Choice<T>(std::marker::PhantomData<T>);

impl<T: clap::ValueEnum + Clone + Send + Sync + 'static> clap::builder::TypedValueParser
    for Choice<T>
{
    type Value = T;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<T, clap::Error> {
        let v = value.to_string_lossy();
        T::from_str(&v, false).map_err(|_| {
            let flag = arg
                .and_then(|a| a.get_long())
                .map_or_else(|| "the value".to_string(), |l| format!("--{l}"));
            let msg = format!("{flag} takes {}, not {v:?}\n", words_of::<T>());
            clap::Error::raw(clap::error::ErrorKind::InvalidValue, msg).with_cmd(cmd)
        })
    }

    fn possible_values(
        &self,
    ) -> Option<Box<dyn Iterator<Item = clap::builder::PossibleValue> + '_>> {
        let values = T::value_variants()
            .iter()
            .filter_map(clap::ValueEnum::to_possible_value);
        Some(Box::new(values))
    }
}

/// A word flag's words: `on or off`, `a, b or c`.
pub fn words_of<T: clap::ValueEnum>() -> String {
    let names: Vec<String> = T::value_variants()
        .iter()
        .filter_map(|v| v.to_possible_value())
        .map(|p| p.get_name().to_string())
        .collect();
    match names.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// Parses `--codec`; an unknown name lists every accepted form.
pub fn parse_codec(s: &str) -> Result<CodecPolicy, Error> {
    let known = s == "auto"
        || s.starts_with("auto:")
        || s == "lz4"
        || s == "none"
        || s == "zstd"
        || s.starts_with("zstd:");
    CodecPolicy::parse(s).map_err(|e| {
        Error::Usage(if known {
            format!("--codec {s}: {e}")
        } else {
            format!(
                "--codec {s}: not a codec policy; expected {}",
                codec_forms()
            )
        })
    })
}

/// Prints `text` to stdout; a reader that stopped early (`| grep -q`,
/// `| head`) is not an error, and no panic either.
pub fn print_out(text: &str) -> Result<(), crate::error::Error> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(crate::error::Error::io("stdout", e))
        }
        _ => Ok(()),
    }
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
        let e = parse_codec("gzip").unwrap_err().to_string();
        assert!(e.contains("auto") && e.contains("lz4"), "{e}");
        let e = parse_codec("zstd:99").unwrap_err().to_string();
        assert!(e.contains("out of range"), "{e}");
        assert!(codec_help().contains(&auto_words(Codec::Zstd(9))));
    }
}
