//! The objects of a volume kept in an object store, byte by byte (no I/O
//! here). Every object ends with a CRC32C of the bytes before it; integers
//! are little-endian. Names under the volume's prefix:
//!
//! | name                         | what                                         | written |
//! |------------------------------|----------------------------------------------|---------|
//! | `volume`                     | [`Descriptor`]: size and chunking            | create-only, once |
//! | `epoch/EEEEEEEEEEEEEEEE`     | a server's claim of epoch E (text)           | create-only |
//! | `lease/EEEEEEEEEEEEEEEE`     | epoch E's heartbeat (text; `released` at a clean stop) | overwritten by E's server only |
//! | `log/SSSSSSSSSSSSSSSS`       | [`Delta`] number S (a fence delta is never deleted) | create-only, S in order |
//! | `manifest/SSSSSSSSSSSSSSSS`  | [`Manifest`]: every chunk's object as of delta S | create-only |
//! | `chunk/CCCCCCCC/EEEEEEEEEEEEEEEE-NNNNNNNNNNNNNNNN` | chunk C's bytes, uploaded by epoch E (its N-th upload) | create-only |
//!
//! Numbers are 16 (8 for chunks) lower-case hex digits, so names sort as
//! numbers. docs/FORMAT.md "Object store" gives the protocol.

/// Bytes of the descriptor.
const DESCRIPTOR_MAGIC: &[u8; 8] = b"CVOLOBJ1";
const DELTA_MAGIC: &[u8; 8] = b"CVOLDLT1";
const MANIFEST_MAGIC: &[u8; 8] = b"CVOLMAN1";
pub const FORMAT_VERSION: u32 = 1;

/// The unit of the local cache's validity and of delta ranges.
pub const SECTOR: u64 = 512;

/// A decode failure: what is wrong, in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed(pub String);

impl std::fmt::Display for Malformed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Malformed {}

fn bad(what: &str) -> Malformed {
    Malformed(what.to_string())
}

/// A volume's shape: `size` bytes cut into chunks, the first `head_bytes`
/// long (the engine's metadata area) and the others `chunk_bytes` (one log
/// segment each), the last one clipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    pub size_bytes: u64,
    pub head_bytes: u64,
    pub chunk_bytes: u64,
}

impl Descriptor {
    pub fn validate(&self) -> Result<(), Malformed> {
        let ok_unit = |b: u64| b >= SECTOR && b.is_multiple_of(SECTOR) && b <= 1 << 30;
        if !ok_unit(self.head_bytes) || !ok_unit(self.chunk_bytes) {
            return Err(bad(
                "chunk sizes must be multiples of 512 bytes up to 1 GiB",
            ));
        }
        if self.size_bytes < self.head_bytes || !self.size_bytes.is_multiple_of(SECTOR) {
            return Err(bad(
                "size must cover the first chunk and be a multiple of 512",
            ));
        }
        if self.chunk_count() > u32::MAX as u64 {
            return Err(bad("too many chunks"));
        }
        Ok(())
    }

    pub fn chunk_count(&self) -> u64 {
        1 + (self.size_bytes - self.head_bytes).div_ceil(self.chunk_bytes)
    }

    /// The chunk holding byte `offset`.
    pub fn chunk_of(&self, offset: u64) -> u32 {
        if offset < self.head_bytes {
            0
        } else {
            (1 + (offset - self.head_bytes) / self.chunk_bytes) as u32
        }
    }

    /// Start and length of chunk `c`.
    pub fn chunk_range(&self, c: u32) -> (u64, u64) {
        if c == 0 {
            return (0, self.head_bytes);
        }
        let start = self.head_bytes + (c as u64 - 1) * self.chunk_bytes;
        (start, self.chunk_bytes.min(self.size_bytes - start))
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(48);
        b.extend_from_slice(DESCRIPTOR_MAGIC);
        b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        b.extend_from_slice(&self.size_bytes.to_le_bytes());
        b.extend_from_slice(&self.head_bytes.to_le_bytes());
        b.extend_from_slice(&self.chunk_bytes.to_le_bytes());
        seal(b)
    }

    pub fn decode(b: &[u8]) -> Result<Descriptor, Malformed> {
        let mut r = Reader::open(b, DESCRIPTOR_MAGIC, "volume descriptor")?;
        let version = r.u32()?;
        if version != FORMAT_VERSION {
            return Err(Malformed(format!(
                "volume descriptor version {version}; this cvol reads version {FORMAT_VERSION}"
            )));
        }
        let d = Descriptor {
            size_bytes: r.u64()?,
            head_bytes: r.u64()?,
            chunk_bytes: r.u64()?,
        };
        r.done()?;
        d.validate()?;
        Ok(d)
    }
}

/// One uploaded object of a chunk: the epoch that wrote it and its number
/// in that epoch (from 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjId {
    pub epoch: u64,
    pub n: u64,
}

/// A change of a chunk's object in a delta: a new object, or none (the
/// whole chunk discarded: it reads as zeros).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkRef {
    pub chunk: u32,
    pub object: Option<ObjId>,
}

/// Bytes written at `offset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Range {
    pub offset: u64,
    pub data: Vec<u8>,
}

/// What one sync made durable: chunk object changes first, then byte
/// ranges on top of them, in order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Delta {
    pub seq: u64,
    pub epoch: u64,
    /// The empty delta a server writes at open to fence older servers:
    /// kept forever (a stale server's next delta is exactly this name).
    pub fence: bool,
    pub refs: Vec<ChunkRef>,
    pub ranges: Vec<Range>,
}

impl Delta {
    pub fn encode(&self) -> Vec<u8> {
        let data: usize = self.ranges.iter().map(|r| r.data.len() + 12).sum();
        let mut b = Vec::with_capacity(40 + self.refs.len() * 21 + data);
        b.extend_from_slice(DELTA_MAGIC);
        b.extend_from_slice(&self.seq.to_le_bytes());
        b.extend_from_slice(&self.epoch.to_le_bytes());
        b.extend_from_slice(&u32::from(self.fence).to_le_bytes());
        b.extend_from_slice(&(self.refs.len() as u32).to_le_bytes());
        b.extend_from_slice(&(self.ranges.len() as u32).to_le_bytes());
        for r in &self.refs {
            b.extend_from_slice(&r.chunk.to_le_bytes());
            put_obj(&mut b, r.object);
        }
        for r in &self.ranges {
            b.extend_from_slice(&r.offset.to_le_bytes());
            b.extend_from_slice(&(r.data.len() as u32).to_le_bytes());
            b.extend_from_slice(&r.data);
        }
        seal(b)
    }

    pub fn decode(b: &[u8]) -> Result<Delta, Malformed> {
        let mut r = Reader::open(b, DELTA_MAGIC, "delta")?;
        let seq = r.u64()?;
        let epoch = r.u64()?;
        let flags = r.u32()?;
        if flags > 1 {
            return Err(bad("delta: unknown flags"));
        }
        let (nrefs, nranges) = (r.u32()?, r.u32()?);
        let mut d = Delta {
            seq,
            epoch,
            fence: flags == 1,
            ..Delta::default()
        };
        for _ in 0..nrefs {
            let chunk = r.u32()?;
            d.refs.push(ChunkRef {
                chunk,
                object: r.obj()?,
            });
        }
        for _ in 0..nranges {
            let offset = r.u64()?;
            let len = r.u32()? as usize;
            d.ranges.push(Range {
                offset,
                data: r.bytes(len)?.to_vec(),
            });
        }
        r.done()?;
        Ok(d)
    }
}

/// Every chunk's object as of delta `seq` (None: the chunk reads as zeros).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    pub seq: u64,
    pub epoch: u64,
    pub chunks: Vec<Option<ObjId>>,
    /// The fence deltas at or before `seq` (never deleted).
    pub fences: Vec<u64>,
}

impl Manifest {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(32 + self.chunks.len() * 16);
        b.extend_from_slice(MANIFEST_MAGIC);
        b.extend_from_slice(&self.seq.to_le_bytes());
        b.extend_from_slice(&self.epoch.to_le_bytes());
        b.extend_from_slice(&(self.chunks.len() as u32).to_le_bytes());
        for c in &self.chunks {
            let (e, n) = c.map_or((0, 0), |o| (o.epoch, o.n));
            b.extend_from_slice(&e.to_le_bytes());
            b.extend_from_slice(&n.to_le_bytes());
        }
        b.extend_from_slice(&(self.fences.len() as u32).to_le_bytes());
        for f in &self.fences {
            b.extend_from_slice(&f.to_le_bytes());
        }
        seal(b)
    }

    pub fn decode(b: &[u8]) -> Result<Manifest, Malformed> {
        let mut r = Reader::open(b, MANIFEST_MAGIC, "manifest")?;
        let seq = r.u64()?;
        let epoch = r.u64()?;
        let n = r.u32()? as usize;
        if n > r.left() / 16 {
            return Err(bad("manifest: more chunks than bytes"));
        }
        let mut chunks = Vec::with_capacity(n);
        for _ in 0..n {
            let (e, k) = (r.u64()?, r.u64()?);
            chunks.push((k != 0).then_some(ObjId { epoch: e, n: k }));
        }
        let nf = r.u32()? as usize;
        if nf > r.left() / 8 {
            return Err(bad("manifest: more fences than bytes"));
        }
        let mut fences = Vec::with_capacity(nf);
        for _ in 0..nf {
            fences.push(r.u64()?);
        }
        r.done()?;
        Ok(Manifest {
            seq,
            epoch,
            chunks,
            fences,
        })
    }
}

fn put_obj(b: &mut Vec<u8>, o: Option<ObjId>) {
    match o {
        None => b.push(0),
        Some(_) => b.push(1),
    }
    let (e, n) = o.map_or((0, 0), |o| (o.epoch, o.n));
    b.extend_from_slice(&e.to_le_bytes());
    b.extend_from_slice(&n.to_le_bytes());
}

fn seal(mut b: Vec<u8>) -> Vec<u8> {
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// A bounds-checked reader over a sealed object.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn open(b: &'a [u8], magic: &[u8; 8], what: &str) -> Result<Reader<'a>, Malformed> {
        if b.len() < 12 || &b[..8] != magic {
            return Err(Malformed(format!("not a cvol {what} (bad magic)")));
        }
        let (body, crc) = b.split_at(b.len() - 4);
        if crc32c::crc32c(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(Malformed(format!("{what}: checksum mismatch")));
        }
        Ok(Reader { b: body, at: 8 })
    }

    fn left(&self) -> usize {
        self.b.len() - self.at
    }

    fn bytes(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        if self.left() < n {
            return Err(bad("truncated object"));
        }
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, Malformed> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().expect("4")))
    }

    fn u64(&mut self) -> Result<u64, Malformed> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().expect("8")))
    }

    fn obj(&mut self) -> Result<Option<ObjId>, Malformed> {
        let tag = self.bytes(1)?[0];
        let (epoch, n) = (self.u64()?, self.u64()?);
        match tag {
            0 => Ok(None),
            1 if n != 0 => Ok(Some(ObjId { epoch, n })),
            _ => Err(bad("bad chunk reference")),
        }
    }

    fn done(&self) -> Result<(), Malformed> {
        if self.left() == 0 {
            Ok(())
        } else {
            Err(bad("trailing bytes"))
        }
    }
}

/// Object names under a prefix (no leading or trailing slash; may be empty).
#[derive(Debug, Clone)]
pub struct Names {
    prefix: String,
}

impl Names {
    pub fn new(prefix: &str) -> Names {
        Names {
            prefix: prefix.trim_matches('/').to_string(),
        }
    }

    fn join(&self, rest: &str) -> String {
        if self.prefix.is_empty() {
            rest.to_string()
        } else {
            format!("{}/{rest}", self.prefix)
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn descriptor(&self) -> String {
        self.join("volume")
    }

    pub fn dir(&self, kind: &str) -> String {
        self.join(kind)
    }

    pub fn epoch(&self, e: u64) -> String {
        self.join(&format!("epoch/{e:016x}"))
    }

    pub fn lease(&self, e: u64) -> String {
        self.join(&format!("lease/{e:016x}"))
    }

    pub fn delta(&self, s: u64) -> String {
        self.join(&format!("log/{s:016x}"))
    }

    pub fn manifest(&self, s: u64) -> String {
        self.join(&format!("manifest/{s:016x}"))
    }

    pub fn chunk(&self, c: u32, o: ObjId) -> String {
        self.join(&format!("chunk/{c:08x}/{:016x}-{:016x}", o.epoch, o.n))
    }

    /// The number at the end of an `epoch/`, `lease/`, `log/` or `manifest/` name.
    pub fn number(name: &str) -> Option<u64> {
        let last = name.rsplit('/').next()?;
        (last.len() == 16).then(|| u64::from_str_radix(last, 16).ok())?
    }

    /// The chunk and object of a `chunk/` name.
    pub fn parse_chunk(name: &str) -> Option<(u32, ObjId)> {
        let mut parts = name.rsplit('/');
        let obj = parts.next()?;
        let chunk = parts.next()?;
        let (e, n) = obj.split_once('-')?;
        if chunk.len() != 8 || e.len() != 16 || n.len() != 16 {
            return None;
        }
        Some((
            u32::from_str_radix(chunk, 16).ok()?,
            ObjId {
                epoch: u64::from_str_radix(e, 16).ok()?,
                n: u64::from_str_radix(n, 16).ok()?,
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_round_trip_and_detect_damage() {
        let d = Descriptor {
            size_bytes: 9 << 20,
            head_bytes: 1 << 20,
            chunk_bytes: 4 << 20,
        };
        assert_eq!(Descriptor::decode(&d.encode()), Ok(d));
        assert_eq!(d.chunk_count(), 3);
        assert_eq!(d.chunk_of((1 << 20) - 1), 0);
        assert_eq!(d.chunk_of(1 << 20), 1);
        assert_eq!(d.chunk_of(5 << 20), 2);
        assert_eq!(d.chunk_range(2), (5 << 20, 4 << 20));
        let delta = Delta {
            seq: 7,
            epoch: 2,
            fence: false,
            refs: vec![
                ChunkRef {
                    chunk: 1,
                    object: Some(ObjId { epoch: 2, n: 9 }),
                },
                ChunkRef {
                    chunk: 2,
                    object: None,
                },
            ],
            ranges: vec![Range {
                offset: 4096,
                data: vec![7; 512],
            }],
        };
        let mut b = delta.encode();
        assert_eq!(Delta::decode(&b), Ok(delta));
        b[20] ^= 1;
        assert!(Delta::decode(&b).is_err());
        let m = Manifest {
            seq: 3,
            epoch: 1,
            chunks: vec![None, Some(ObjId { epoch: 1, n: 2 })],
            fences: vec![1, 3],
        };
        assert_eq!(Manifest::decode(&m.encode()), Ok(m));
        assert!(Manifest::decode(&d.encode()).is_err());
    }

    #[test]
    fn names_parse_back() {
        let n = Names::new("/vols/a/");
        assert_eq!(n.delta(10), "vols/a/log/000000000000000a");
        assert_eq!(Names::number(&n.delta(10)), Some(10));
        let o = ObjId { epoch: 3, n: 4 };
        assert_eq!(Names::parse_chunk(&n.chunk(5, o)), Some((5, o)));
        assert_eq!(Names::new("").descriptor(), "volume");
    }
}
