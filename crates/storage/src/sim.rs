use crate::{check_range, Storage};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

const SECTOR: usize = 512;

/// Fault plan for a simulated store.
#[derive(Debug, Clone, Default)]
pub struct SimConfig {
    /// Number of `write_at`/`sync` calls that succeed; later ones fail with EIO
    /// (models the process dying or the device failing at that point).
    pub io_budget: Option<u64>,
    /// Reads of these byte ranges fail with EIO.
    pub bad_read_ranges: Vec<(u64, u64)>,
}

struct Inner {
    /// What reads see: every write applied.
    live: Vec<u8>,
    /// What survives a crash for sure: state as of the last sync.
    durable: Vec<u8>,
    /// Writes since the last sync, in order.
    pending: Vec<(u64, Vec<u8>)>,
    config: SimConfig,
    io_count: u64,
    syncs: u64,
}

/// In-memory store with crash and fault injection. Clones share the image.
/// (Its length is `live.len()`, which `set_len` changes.)
#[derive(Clone)]
pub struct SimStorage {
    inner: Arc<Mutex<Inner>>,
}

impl SimStorage {
    pub fn new(size_bytes: u64) -> SimStorage {
        SimStorage::from_image(vec![0u8; size_bytes as usize])
    }

    fn from_image(image: Vec<u8>) -> SimStorage {
        let inner = Inner {
            live: image.clone(),
            durable: image,
            pending: Vec::new(),
            config: SimConfig::default(),
            io_count: 0,
            syncs: 0,
        };
        SimStorage {
            inner: Arc::new(Mutex::new(inner)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set_config(&self, config: SimConfig) {
        let mut g = self.lock();
        g.config = config;
        g.io_count = 0;
    }

    /// Number of write/sync calls issued so far (to choose crash points).
    pub fn io_count(&self) -> u64 {
        self.lock().io_count
    }

    pub fn sync_count(&self) -> u64 {
        self.lock().syncs
    }

    /// Simulates a power loss: returns a fresh store holding the durable image
    /// plus, for each unsynced write, all of it, none of it, or a random subset
    /// of its 512-byte sectors (torn). Sector writes themselves are atomic.
    pub fn crash(&self, seed: u64) -> SimStorage {
        let g = self.lock();
        let mut rng = StdRng::seed_from_u64(seed);
        let mut image = g.durable.clone();
        for (offset, data) in &g.pending {
            match rng.gen_range(0..3) {
                0 => {}
                1 => apply(&mut image, *offset, data, |_| true),
                _ => {
                    let keep: Vec<bool> = (0..data.len().div_ceil(SECTOR) + 1)
                        .map(|_| rng.gen())
                        .collect();
                    apply(&mut image, *offset, data, |sector| keep[sector])
                }
            }
        }
        SimStorage::from_image(image)
    }

    /// Simulates a power loss in which every unsynced write lands except the
    /// 512-byte sectors for which `drop_sector(sector offset)` holds.
    pub fn crash_dropping(&self, drop_sector: impl Fn(u64) -> bool) -> SimStorage {
        let g = self.lock();
        let mut image = g.durable.clone();
        for (offset, data) in &g.pending {
            let first = offset / SECTOR as u64;
            apply(&mut image, *offset, data, |i| {
                !drop_sector((first + i as u64) * SECTOR as u64)
            });
        }
        SimStorage::from_image(image)
    }

    /// Image as a reopen after a clean stop would see it (everything written).
    pub fn snapshot_live(&self) -> SimStorage {
        SimStorage::from_image(self.lock().live.clone())
    }

    /// Flips one bit of the live and durable image (corruption injection).
    pub fn flip_bit(&self, offset: u64, bit: u8) {
        let mut g = self.lock();
        g.live[offset as usize] ^= 1 << (bit % 8);
        g.durable[offset as usize] ^= 1 << (bit % 8);
    }

    fn charge(g: &mut Inner) -> io::Result<()> {
        g.io_count += 1;
        match g.config.io_budget {
            Some(b) if g.io_count > b => Err(io::Error::other("simulated I/O failure")),
            _ => Ok(()),
        }
    }
}

/// Applies the sectors of a write for which `keep(sector index within the write)`
/// holds; sectors are counted on the absolute 512-byte grid.
fn apply(image: &mut [u8], offset: u64, data: &[u8], keep: impl Fn(usize) -> bool) {
    let start = offset as usize;
    let first_sector = start / SECTOR;
    let mut pos = 0;
    while pos < data.len() {
        let abs = start + pos;
        let next = ((abs / SECTOR) + 1) * SECTOR;
        let n = (next - abs).min(data.len() - pos);
        if keep(abs / SECTOR - first_sector) {
            image[abs..abs + n].copy_from_slice(&data[pos..pos + n]);
        }
        pos += n;
    }
}

impl Storage for SimStorage {
    fn len_bytes(&self) -> u64 {
        self.lock().live.len() as u64
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let g = self.lock();
        check_range(offset, buf.len(), g.live.len() as u64)?;
        let end = offset + buf.len() as u64;
        if g.config
            .bad_read_ranges
            .iter()
            .any(|&(s, e)| offset < e && s < end)
        {
            return Err(io::Error::other("simulated read error"));
        }
        buf.copy_from_slice(&g.live[offset as usize..end as usize]);
        Ok(())
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut g = self.lock();
        check_range(offset, data.len(), g.live.len() as u64)?;
        SimStorage::charge(&mut g)?;
        let s = offset as usize;
        g.live[s..s + data.len()].copy_from_slice(data);
        g.pending.push((offset, data.to_vec()));
        Ok(())
    }

    /// Exact, so scans that skip zeros run in the simulations too: the first
    /// non-zero byte at or after `offset`, or the first byte of a range
    /// whose reads fail (an unreadable region is never skipped).
    fn next_data(&self, offset: u64) -> io::Result<Option<u64>> {
        let g = self.lock();
        check_range(offset, 0, g.live.len() as u64)?;
        let nonzero = g.live[offset as usize..]
            .iter()
            .position(|&b| b != 0)
            .map(|i| offset + i as u64);
        let bad = g
            .config
            .bad_read_ranges
            .iter()
            .filter(|&&(_, e)| e > offset)
            .map(|&(s, _)| s.max(offset))
            .min();
        Ok(match (nonzero, bad) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        })
    }

    /// Like a hole punch: the range reads as zeros; unsynced, so a crash may undo it.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.write_at(offset, &vec![0u8; len as usize])
    }

    /// As a file's length: counted as an I/O (it may fail), and durable
    /// at once (a file system logs it; the superblock that names the new
    /// size is written and synced after a grow, before a cut). The bytes
    /// a grow adds read as zeros; writes not synced beyond a cut are gone.
    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut g = self.lock();
        SimStorage::charge(&mut g)?;
        let n = usize::try_from(len).map_err(io::Error::other)?;
        g.live.resize(n, 0);
        g.durable.resize(n, 0);
        g.pending.retain_mut(|(offset, data)| {
            let keep = (n as u64).saturating_sub(*offset).min(data.len() as u64);
            data.truncate(keep as usize);
            keep > 0
        });
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        let mut g = self.lock();
        SimStorage::charge(&mut g)?;
        let pending = std::mem::take(&mut g.pending);
        for (offset, data) in pending {
            let s = offset as usize;
            g.durable[s..s + data.len()].copy_from_slice(&data);
        }
        g.syncs += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synced_data_survives_unsynced_may_not() {
        let s = SimStorage::new(8192);
        s.write_at(0, &[1u8; 1024]).unwrap();
        s.sync().unwrap();
        s.write_at(1024, &[2u8; 2048]).unwrap();
        let mut saw_lost = false;
        let mut saw_kept = false;
        for seed in 0..64 {
            let c = s.crash(seed);
            let mut b = vec![0u8; 3072];
            c.read_at(0, &mut b).unwrap();
            assert!(b[..1024].iter().all(|&x| x == 1), "synced data lost");
            for sector in b[1024..].chunks(512) {
                assert!(
                    sector.iter().all(|&x| x == 2) || sector.iter().all(|&x| x == 0),
                    "sector mixed"
                );
            }
            saw_lost |= b[1024..].contains(&0);
            saw_kept |= b[1024..].contains(&2);
        }
        assert!(saw_lost && saw_kept);
    }

    #[test]
    fn set_len_grows_with_zeros_and_a_cut_drops_unsynced_writes_beyond() {
        let s = SimStorage::new(4096);
        s.set_len(8192).unwrap();
        assert_eq!(s.len_bytes(), 8192);
        s.write_at(4096, &[7u8; 4096]).unwrap();
        let c = s.clone();
        c.set_len(6144).unwrap();
        assert_eq!(s.len_bytes(), 6144, "clones share the image");
        let crashed = s.crash_dropping(|_| false);
        assert_eq!(crashed.len_bytes(), 6144);
        let mut b = vec![0u8; 2048];
        crashed.read_at(4096, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 7), "the write's part below the cut");
        assert!(s.read_at(6144, &mut [0u8; 1]).is_err());
    }

    #[test]
    fn next_data_finds_non_zero_bytes_and_unreadable_ranges() {
        let s = SimStorage::new(1 << 16);
        assert_eq!(s.next_data(0).unwrap(), None);
        assert_eq!(s.next_data(1 << 16).unwrap(), None);
        assert!(s.next_data((1 << 16) + 1).is_err());
        s.write_at(5000, &[0, 7]).unwrap();
        assert_eq!(s.next_data(0).unwrap(), Some(5001));
        assert_eq!(s.next_data(5001).unwrap(), Some(5001));
        assert_eq!(s.next_data(5002).unwrap(), None);
        s.set_config(SimConfig {
            bad_read_ranges: vec![(100, 200)],
            ..SimConfig::default()
        });
        assert_eq!(s.next_data(0).unwrap(), Some(100));
        assert_eq!(s.next_data(150).unwrap(), Some(150));
        assert_eq!(s.next_data(200).unwrap(), Some(5001));
    }

    #[test]
    fn io_budget_and_bad_reads() {
        let s = SimStorage::new(4096);
        s.set_config(SimConfig {
            io_budget: Some(1),
            bad_read_ranges: vec![(100, 200)],
        });
        s.write_at(0, b"x").unwrap();
        assert!(s.write_at(0, b"y").is_err());
        assert!(s.sync().is_err());
        let mut b = [0u8; 10];
        assert!(s.read_at(150, &mut b).is_err());
        s.read_at(0, &mut b).unwrap();
        assert_eq!(b[0], b'x');
        assert!(s.read_at(4090, &mut b).is_err());
    }
}
