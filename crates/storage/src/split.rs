//! Two stores seen as one: a volume's data store and its metadata device.
//!
//! Offsets below `base` are the data store's own; offsets from `base` on
//! are the metadata device's, shifted by `base - skip` (its first `skip`
//! bytes, its label, are not part of the joined space). An I/O may not
//! straddle `base`. `sync` syncs the data store first, then the metadata
//! device: when it returns, every earlier write to either is durable.
use crate::{check_range, Storage};
use std::io;
use std::sync::Arc;

pub struct SplitStorage {
    data: Arc<dyn Storage>,
    meta: Arc<dyn Storage>,
    base: u64,
    skip: u64,
}

impl SplitStorage {
    /// Joins `data` (its bytes below `base`) and `meta` (its bytes from
    /// `skip` on, at `base` and after).
    pub fn new(data: Arc<dyn Storage>, meta: Arc<dyn Storage>, base: u64, skip: u64) -> Self {
        assert!(base <= data.len_bytes() && skip <= meta.len_bytes());
        SplitStorage {
            data,
            meta,
            base,
            skip,
        }
    }

    pub fn data(&self) -> &Arc<dyn Storage> {
        &self.data
    }

    pub fn metadata(&self) -> &Arc<dyn Storage> {
        &self.meta
    }

    /// The store and its own offset for `[offset, offset + len)`.
    fn route(&self, offset: u64, len: u64) -> io::Result<(&dyn Storage, u64)> {
        check_range(offset, len as usize, self.len_bytes())?;
        if offset >= self.base {
            Ok((&*self.meta, offset - self.base + self.skip))
        } else if offset + len <= self.base {
            Ok((&*self.data, offset))
        } else {
            Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("I/O at {offset}+{len} straddles the data and metadata stores"),
            ))
        }
    }
}

impl Storage for SplitStorage {
    fn len_bytes(&self) -> u64 {
        self.base + (self.meta.len_bytes() - self.skip)
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let (s, at) = self.route(offset, buf.len() as u64)?;
        s.read_at(at, buf)
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let (s, at) = self.route(offset, data.len() as u64)?;
        s.write_at(at, data)
    }

    fn sync(&self) -> io::Result<()> {
        self.data.sync()?;
        self.meta.sync()
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let (s, at) = self.route(offset, len)?;
        s.discard(at, len)
    }

    fn allocated_bytes(&self) -> Option<u64> {
        Some(self.data.allocated_bytes()? + self.meta.allocated_bytes()?)
    }

    /// Warm segments are data segments: the data store decides.
    fn overwrite_is_cheaper(&self) -> bool {
        self.data.overwrite_is_cheaper()
    }

    fn next_data(&self, offset: u64) -> io::Result<Option<u64>> {
        check_range(offset, 0, self.len_bytes())?;
        if offset < self.base {
            match self.data.next_data(offset)? {
                Some(n) if n < self.base => return Ok(Some(n)),
                _ => return self.next_data(self.base),
            }
        }
        let at = offset - self.base + self.skip;
        Ok(self
            .meta
            .next_data(at)?
            .map(|n| n.max(self.skip) - self.skip + self.base))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SimStorage;

    #[test]
    fn routes_each_range_to_its_store_and_refuses_straddles() {
        let data = Arc::new(SimStorage::new(64 << 10));
        let meta = Arc::new(SimStorage::new(32 << 10));
        let s = SplitStorage::new(data.clone(), meta.clone(), 48 << 10, 4 << 10);
        assert_eq!(s.len_bytes(), (48 << 10) + (28 << 10));
        s.write_at(512, &[1; 512]).unwrap();
        s.write_at(48 << 10, &[2; 512]).unwrap();
        let mut b = [0u8; 512];
        meta.read_at(4 << 10, &mut b).unwrap();
        assert_eq!(b, [2; 512]);
        data.read_at(512, &mut b).unwrap();
        assert_eq!(b, [1; 512]);
        assert!(s.write_at((48 << 10) - 512, &[0; 1024]).is_err());
        assert!(s.read_at(s.len_bytes() - 511, &mut b).is_err());
        s.read_at(s.len_bytes() - 512, &mut b).unwrap();
    }
}
