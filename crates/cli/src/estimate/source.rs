//! What `cvol estimate` reads: a file or a block device, opened read-only,
//! or an NBD export (`nbd://HOST[:PORT]/EXPORT`,
//! `nbd+unix:///EXPORT?socket=PATH`) read through `cvol_nbd::client`.
//! Nothing is ever written to it.
use crate::error::Error;
use crate::origin::is_uri;
use cvol_nbd::client::Client;
use std::fs::File;
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt};

/// An opened source.
pub enum Source {
    File { file: File, len: u64 },
    Nbd(Client),
}

/// The URI forms, for messages.
const FORMS: &str = "a file, a block device or an NBD URI \
                     (nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH)";

impl Source {
    /// Opens `spec` for reading only. Refuses a directory, anything but a
    /// file or a block device, and an empty source.
    pub fn open(spec: &str) -> Result<Source, Error> {
        let src = if is_uri(spec) {
            let client = Client::connect(spec).map_err(|e| {
                Error::Refused(match e.to_string() {
                    m if m.contains(spec) => m,
                    m => format!("{spec}: {m}"),
                })
            })?;
            Source::Nbd(client)
        } else {
            open_path(spec)?
        };
        if src.len() == 0 {
            return Err(Error::Refused(format!(
                "{spec} is empty: nothing to estimate"
            )));
        }
        Ok(src)
    }

    /// Bytes in the source.
    pub fn len(&self) -> u64 {
        match self {
            Source::File { len, .. } => *len,
            Source::Nbd(c) => c.size_bytes(),
        }
    }

    /// Fills `buf` from `offset` (inside the source).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        match self {
            Source::File { file, .. } => file.read_exact_at(buf, offset),
            Source::Nbd(c) => c.read_at(offset, buf),
        }
    }
}

/// A file or block device, opened read-only (`O_RDONLY`).
fn open_path(spec: &str) -> Result<Source, Error> {
    let md = std::fs::metadata(spec).map_err(|e| Error::io(spec, e))?;
    let ft = md.file_type();
    if ft.is_dir() {
        return Err(Error::Refused(format!(
            "{spec} is a directory; give {FORMS}"
        )));
    }
    if !ft.is_file() && !ft.is_block_device() {
        return Err(Error::Refused(format!(
            "{spec} is neither a file nor a block device; give {FORMS}"
        )));
    }
    let mut file = File::open(spec).map_err(|e| Error::io(spec, e))?;
    let len = if ft.is_block_device() {
        file.seek(SeekFrom::End(0))
            .map_err(|e| Error::io(format!("{spec}: its size"), e))?
    } else {
        md.len()
    };
    Ok(Source::File { file, len })
}
