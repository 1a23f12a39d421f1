//! The request trace file of `cvol serve --trace FILE` (blktrace for NBD):
//! a header, then one fixed-size record per client request that reached
//! the volume, in completion order. Little-endian, like every layout here.
//!
//! ```text
//! header (64 bytes)
//!  0  magic        8  "CVOLTRC\0"
//!  8  version      4  1
//! 12  record_bytes 4  32
//! 16  start_unix_ns 8 wall clock when the trace started
//! 24  volume_bytes 8  the export's size
//! 32  reserved    28  zero
//! 60  crc32c       4  of bytes 0..60
//!
//! record (32 bytes)
//!  0  start_ns     8  when the request reached the volume, since start
//!  8  offset       8  bytes
//! 16  length       4  bytes (0 for FLUSH)
//! 20  duration_ns  4  time the volume took (saturates at 4.29 s)
//! 24  command      1  TraceCommand
//! 25  flags        1  bit 0 FUA, bit 1 NO_HOLE, bit 2 FAST_ZERO
//! 26  result       1  0 done, else the error (TraceResult)
//! 27  reserved     1  zero
//! 28  crc32c       4  of bytes 0..28
//! ```
//!
//! A reader stops at the first record that is short or fails its
//! checksum (a trace cut by a crash ends there).

/// `CVOLTRC\0`.
pub const TRACE_MAGIC: [u8; 8] = *b"CVOLTRC\0";
pub const TRACE_VERSION: u32 = 1;
pub const TRACE_HEADER_BYTES: usize = 64;
pub const TRACE_RECORD_BYTES: usize = 32;

pub const TRACE_FLAG_FUA: u8 = 1;
pub const TRACE_FLAG_NO_HOLE: u8 = 2;
pub const TRACE_FLAG_FAST_ZERO: u8 = 4;

/// The commands a trace records (NBD's, as the volume saw them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum TraceCommand {
    Read = 0,
    Write = 1,
    Flush = 2,
    Trim = 3,
    WriteZeroes = 4,
    BlockStatus = 5,
    Cache = 6,
}

impl TraceCommand {
    pub const ALL: [TraceCommand; 7] = [
        TraceCommand::Read,
        TraceCommand::Write,
        TraceCommand::Flush,
        TraceCommand::Trim,
        TraceCommand::WriteZeroes,
        TraceCommand::BlockStatus,
        TraceCommand::Cache,
    ];

    pub fn from_u8(v: u8) -> Option<TraceCommand> {
        Self::ALL.get(usize::from(v)).copied()
    }

    pub fn name(self) -> &'static str {
        match self {
            TraceCommand::Read => "read",
            TraceCommand::Write => "write",
            TraceCommand::Flush => "flush",
            TraceCommand::Trim => "trim",
            TraceCommand::WriteZeroes => "write_zeroes",
            TraceCommand::BlockStatus => "block_status",
            TraceCommand::Cache => "cache",
        }
    }
}

/// The trace file's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceHeader {
    pub start_unix_ns: u64,
    pub volume_bytes: u64,
}

/// Why a trace header does not decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TraceError {
    Short,
    Magic,
    Version(u32),
    RecordSize(u32),
    Checksum,
}

impl std::fmt::Display for TraceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TraceError::Short => write!(f, "shorter than a trace header"),
            TraceError::Magic => write!(f, "not a cvol trace (bad magic)"),
            TraceError::Version(v) => write!(f, "trace version {v}, this cvol reads 1"),
            TraceError::RecordSize(n) => write!(f, "records of {n} bytes, this cvol reads 32"),
            TraceError::Checksum => write!(f, "the trace header's checksum does not match"),
        }
    }
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

impl TraceHeader {
    pub fn encode(&self) -> [u8; TRACE_HEADER_BYTES] {
        let mut b = [0u8; TRACE_HEADER_BYTES];
        b[0..8].copy_from_slice(&TRACE_MAGIC);
        b[8..12].copy_from_slice(&TRACE_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(TRACE_RECORD_BYTES as u32).to_le_bytes());
        b[16..24].copy_from_slice(&self.start_unix_ns.to_le_bytes());
        b[24..32].copy_from_slice(&self.volume_bytes.to_le_bytes());
        let crc = crc32c::crc32c(&b[..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<TraceHeader, TraceError> {
        let b = b.get(..TRACE_HEADER_BYTES).ok_or(TraceError::Short)?;
        if b[0..8] != TRACE_MAGIC {
            return Err(TraceError::Magic);
        }
        if crc32c::crc32c(&b[..60]) != le32(b, 60) {
            return Err(TraceError::Checksum);
        }
        match (le32(b, 8), le32(b, 12)) {
            (TRACE_VERSION, 32) => {}
            (TRACE_VERSION, n) => return Err(TraceError::RecordSize(n)),
            (v, _) => return Err(TraceError::Version(v)),
        }
        Ok(TraceHeader {
            start_unix_ns: le64(b, 16),
            volume_bytes: le64(b, 24),
        })
    }
}

/// One request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceRecord {
    pub start_ns: u64,
    pub offset: u64,
    pub length: u32,
    pub duration_ns: u32,
    pub command: TraceCommand,
    pub flags: u8,
    /// 0: done; else an error code of the volume's (see the CLI's trace
    /// module for names).
    pub result: u8,
}

impl TraceRecord {
    pub fn encode(&self) -> [u8; TRACE_RECORD_BYTES] {
        let mut b = [0u8; TRACE_RECORD_BYTES];
        b[0..8].copy_from_slice(&self.start_ns.to_le_bytes());
        b[8..16].copy_from_slice(&self.offset.to_le_bytes());
        b[16..20].copy_from_slice(&self.length.to_le_bytes());
        b[20..24].copy_from_slice(&self.duration_ns.to_le_bytes());
        b[24] = self.command as u8;
        b[25] = self.flags;
        b[26] = self.result;
        let crc = crc32c::crc32c(&b[..28]);
        b[28..32].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// `None`: short, a failed checksum or an unknown command (the end of
    /// a usable trace).
    pub fn decode(b: &[u8]) -> Option<TraceRecord> {
        let b = b.get(..TRACE_RECORD_BYTES)?;
        if crc32c::crc32c(&b[..28]) != le32(b, 28) {
            return None;
        }
        Some(TraceRecord {
            start_ns: le64(b, 0),
            offset: le64(b, 8),
            length: le32(b, 16),
            duration_ns: le32(b, 20),
            command: TraceCommand::from_u8(b[24])?,
            flags: b[25],
            result: b[26],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_and_records_round_trip_and_damage_is_seen() {
        let h = TraceHeader {
            start_unix_ns: 1_795_000_000_000_000_000,
            volume_bytes: 1 << 40,
        };
        let hb = h.encode();
        assert_eq!(TraceHeader::decode(&hb), Ok(h));
        for at in [0, 9, 20, 61] {
            let mut bad = hb;
            bad[at] ^= 1;
            assert!(TraceHeader::decode(&bad).is_err(), "byte {at}");
        }
        assert_eq!(TraceHeader::decode(&hb[..63]), Err(TraceError::Short));
        for command in TraceCommand::ALL {
            let r = TraceRecord {
                start_ns: 123_456_789,
                offset: 4096 * 77,
                length: 65536,
                duration_ns: 42_000,
                command,
                flags: TRACE_FLAG_FUA | TRACE_FLAG_NO_HOLE,
                result: 0,
            };
            let rb = r.encode();
            assert_eq!(TraceRecord::decode(&rb), Some(r));
            for at in 0..TRACE_RECORD_BYTES {
                let mut bad = rb;
                bad[at] ^= 0x10;
                assert_eq!(TraceRecord::decode(&bad), None, "byte {at}");
            }
            assert_eq!(TraceRecord::decode(&rb[..31]), None);
        }
    }
}
