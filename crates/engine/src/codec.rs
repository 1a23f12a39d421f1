//! Block codecs. A payload is kept compressed only if it saves at least 1/8.
use crate::error::BadWord;
use cvol_format::CodecTag;
use std::cell::RefCell;

/// A volume's configured codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    None,
    Lz4,
    Zstd(i32),
}

pub const ZSTD_LEVEL_MAX: i32 = 19;

impl Codec {
    /// Parses `none`, `lz4`, `zstd` (level 3) or `zstd:LEVEL` (1..=19).
    pub fn parse(s: &str) -> Result<Codec, BadWord> {
        match s {
            "none" => Ok(Codec::None),
            "lz4" => Ok(Codec::Lz4),
            "zstd" => Ok(Codec::Zstd(3)),
            _ => {
                let level = s
                    .strip_prefix("zstd:")
                    .and_then(|l| l.parse::<i32>().ok())
                    .ok_or_else(|| {
                        BadWord(format!(
                            "unknown codec '{s}': expected lz4, zstd:LEVEL or none"
                        ))
                    })?;
                if !(1..=ZSTD_LEVEL_MAX).contains(&level) {
                    return Err(BadWord(format!(
                        "zstd level {level} out of range 1..={ZSTD_LEVEL_MAX}"
                    )));
                }
                Ok(Codec::Zstd(level))
            }
        }
    }

    pub fn tag(self) -> CodecTag {
        match self {
            Codec::None => CodecTag::None,
            Codec::Lz4 => CodecTag::Lz4,
            Codec::Zstd(_) => CodecTag::Zstd,
        }
    }

    pub fn level(self) -> u8 {
        match self {
            Codec::Zstd(l) => l as u8,
            _ => 0,
        }
    }

    pub fn from_tag(tag: CodecTag, level: u8) -> Codec {
        match tag {
            CodecTag::None => Codec::None,
            CodecTag::Lz4 => Codec::Lz4,
            CodecTag::Zstd => Codec::Zstd(i32::from(level).clamp(1, ZSTD_LEVEL_MAX)),
        }
    }

    /// Compresses `data`. Returns `None` when the result would not save at
    /// least 1/8 of the input (the caller stores the data raw).
    pub fn compress(self, data: &[u8]) -> Option<Vec<u8>> {
        let limit = data.len() - data.len() / 8;
        let out = match self {
            Codec::None => return None,
            Codec::Lz4 => lz4_compress(data)?,
            Codec::Zstd(level) => zstd_compress(level, data)?,
        };
        (out.len() <= limit).then_some(out)
    }
}

impl std::fmt::Display for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Codec::None => write!(f, "none"),
            Codec::Lz4 => write!(f, "lz4"),
            Codec::Zstd(l) => write!(f, "zstd:{l}"),
        }
    }
}

thread_local! {
    static ZSTD_C: RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> = const { RefCell::new(None) };
    static ZSTD_D: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

thread_local! {
    /// lz4 output scratch, reused so that a block costs no zeroed allocation.
    static LZ4_OUT: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

fn lz4_compress(data: &[u8]) -> Option<Vec<u8>> {
    LZ4_OUT.with(|out| {
        let mut out = out.borrow_mut();
        let max = lz4_flex::block::get_maximum_output_size(data.len());
        if out.len() < max {
            out.resize(max, 0);
        }
        let n = lz4_flex::block::compress_into(data, &mut out[..]).ok()?;
        Some(out[..n].to_vec())
    })
}

fn zstd_compress(level: i32, data: &[u8]) -> Option<Vec<u8>> {
    ZSTD_C.with(|c| {
        let mut c = c.borrow_mut();
        if c.as_ref().is_none_or(|(l, _)| *l != level) {
            *c = Some((level, zstd::bulk::Compressor::new(level).ok()?));
        }
        let (_, comp) = c.as_mut()?;
        comp.compress(data).ok()
    })
}

/// Why a payload does not decompress to the block(s) its record claims.
#[derive(Debug)]
pub enum DecompressError {
    /// A raw payload of another length than the blocks it holds.
    RawLength {
        got: usize,
        want: usize,
    },
    Lz4(lz4_flex::block::DecompressError),
    Zstd(std::io::Error),
    /// It decompressed to fewer bytes than the blocks it holds.
    Short {
        got: usize,
        want: usize,
    },
}

impl std::fmt::Display for DecompressError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecompressError::RawLength { got, want } => {
                write!(f, "raw payload of {got} bytes, expected {want}")
            }
            DecompressError::Lz4(e) => write!(f, "lz4: {e}"),
            DecompressError::Zstd(e) => write!(f, "zstd: {e}"),
            DecompressError::Short { got, want } => {
                write!(f, "decompressed {got} bytes, expected {want}")
            }
        }
    }
}

impl std::error::Error for DecompressError {}

/// Decompresses `payload` into `out`, which must be filled exactly.
pub fn decompress(tag: CodecTag, payload: &[u8], out: &mut [u8]) -> Result<(), DecompressError> {
    let n = match tag {
        CodecTag::None => {
            if payload.len() != out.len() {
                return Err(DecompressError::RawLength {
                    got: payload.len(),
                    want: out.len(),
                });
            }
            out.copy_from_slice(payload);
            out.len()
        }
        CodecTag::Lz4 => {
            lz4_flex::block::decompress_into(payload, out).map_err(DecompressError::Lz4)?
        }
        CodecTag::Zstd => ZSTD_D.with(|d| {
            let mut d = d.borrow_mut();
            let dec = match &mut *d {
                Some(dec) => dec,
                None => d.insert(zstd::bulk::Decompressor::new().map_err(DecompressError::Zstd)?),
            };
            dec.decompress_to_buffer(payload, out)
                .map_err(DecompressError::Zstd)
        })?,
    };
    if n != out.len() {
        return Err(DecompressError::Short {
            got: n,
            want: out.len(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_block() -> Vec<u8> {
        let s = b"the quick brown fox jumps over the lazy dog; ";
        s.iter().cycle().take(4096).copied().collect()
    }

    #[test]
    fn parse_codecs() {
        assert_eq!(Codec::parse("lz4").unwrap(), Codec::Lz4);
        assert_eq!(Codec::parse("zstd:7").unwrap(), Codec::Zstd(7));
        assert_eq!(Codec::parse("zstd").unwrap(), Codec::Zstd(3));
        assert_eq!(Codec::parse("none").unwrap(), Codec::None);
        assert!(Codec::parse("zstd:0").is_err());
        assert!(Codec::parse("zstd:20").is_err());
        assert!(Codec::parse("gzip").is_err());
        assert_eq!(
            Codec::parse(&Codec::Zstd(5).to_string()).unwrap(),
            Codec::Zstd(5)
        );
    }

    #[test]
    fn roundtrip_every_codec() {
        let data = text_block();
        for codec in [Codec::Lz4, Codec::Zstd(1), Codec::Zstd(19)] {
            let c = codec.compress(&data).expect("text compresses");
            assert!(c.len() < 1000);
            let mut out = vec![0u8; 4096];
            decompress(codec.tag(), &c, &mut out).unwrap();
            assert_eq!(out, data);
        }
    }

    #[test]
    fn incompressible_is_refused() {
        use rand::RngCore;
        let mut data = vec![0u8; 4096];
        rand::thread_rng().fill_bytes(&mut data);
        assert!(Codec::Lz4.compress(&data).is_none());
        assert!(Codec::Zstd(3).compress(&data).is_none());
        assert!(Codec::None.compress(&text_block()).is_none());
    }

    #[test]
    fn corrupt_payload_is_an_error_not_a_panic() {
        let c = Codec::Lz4.compress(&text_block()).unwrap();
        let mut out = vec![0u8; 4096];
        assert!(decompress(CodecTag::Lz4, &c[..c.len() / 2], &mut out).is_err());
        assert!(decompress(CodecTag::Zstd, &c, &mut out).is_err());
        assert!(decompress(CodecTag::None, &c, &mut out).is_err());
    }

    /// lz4_flex runs its faster unsafe decoder here (`checked-decode` on):
    /// mutated and random payloads, into outputs of every size class, must
    /// come back as errors or data, never as a crash or an out-of-bounds
    /// write.
    #[test]
    fn mutated_and_random_lz4_payloads_never_crash() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let good = Codec::Lz4.compress(&text_block()).unwrap();
        for i in 0..20_000 {
            let mut p = if i % 2 == 0 {
                let mut p = good.clone();
                for _ in 0..rng.gen_range(1..8) {
                    let at = rng.gen_range(0..p.len());
                    p[at] = rng.gen();
                }
                p.truncate(rng.gen_range(1..=p.len()));
                p
            } else {
                let n = rng.gen_range(0..600);
                (0..n).map(|_| rng.gen()).collect::<Vec<u8>>()
            };
            if i % 3 == 0 {
                p.extend_from_slice(&good[..rng.gen_range(0..good.len())]);
            }
            let mut out = vec![0u8; [512, 4096, 65536][i % 3]];
            let _ = decompress(CodecTag::Lz4, &p, &mut out);
        }
    }
}
