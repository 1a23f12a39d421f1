use crate::{check_range, Storage};
use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::Path;
use std::sync::Mutex;

/// A regular file or a block device, accessed with pread/pwrite.
pub struct FileStorage {
    file: File,
    size_bytes: u64,
    is_block_device: bool,
    /// Set by `set_direct`: the file is open with O_DIRECT; every I/O goes
    /// through an aligned bounce buffer, and writes that cover part of a
    /// page read the page and write it whole, one at a time (the lock).
    direct: Option<Mutex<()>>,
    /// Held across each large buffered write (`QUEUED_WRITE_MIN_BYTES`)
    /// and each hole punch of a regular file.
    /// The kernel serializes them on the inode lock anyway (ext4, xfs),
    /// but its waiters *spin* while the holder copies a 1 MiB write-behind
    /// into the page cache: 5% of a sequential write's CPU went to that
    /// spinning. Waiting here parks the thread instead.
    inode_writes: TicketLock,
}

/// Buffered writes of at least this many bytes (write-behind chunks,
/// segment tails) queue on `inode_writes`; smaller ones go straight in.
const QUEUED_WRITE_MIN_BYTES: usize = 128 << 10;

/// A first-come, first-served lock: `std::sync::Mutex` lets a thread that
/// just released it take it again ahead of a parked one, which tripled a
/// sequential write's p99 latency where the kernel's lock hands off.
#[derive(Default)]
struct TicketLock {
    /// (next ticket to hand out, ticket being served)
    tickets: Mutex<(u64, u64)>,
    turn: std::sync::Condvar,
}

struct Ticket<'a>(&'a TicketLock);

impl TicketLock {
    fn lock(&self) -> Ticket<'_> {
        let mut t = self
            .tickets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mine = t.0;
        t.0 += 1;
        while t.1 != mine {
            t = self
                .turn
                .wait(t)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        Ticket(self)
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut t = self
            .0
            .tickets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        t.1 += 1;
        let waiting = t.0 != t.1;
        drop(t);
        if waiting {
            self.0.turn.notify_all();
        }
    }
}

/// The alignment O_DIRECT I/O is done at (offsets, lengths, buffers).
pub const DIRECT_ALIGN_BYTES: u64 = 4096;

/// A zeroed buffer of `len` bytes whose start is `DIRECT_ALIGN_BYTES`
/// aligned: the Vec and the offset of the aligned start in it.
fn aligned_buffer(len: usize) -> (Vec<u8>, usize) {
    let v = vec![0u8; len + DIRECT_ALIGN_BYTES as usize];
    let at = v.as_ptr().align_offset(DIRECT_ALIGN_BYTES as usize);
    (v, at)
}

impl FileStorage {
    /// The lock a buffered write or hole punch holds (`inode_writes`).
    fn lock_inode_writes(&self) -> Ticket<'_> {
        self.inode_writes.lock()
    }

    /// Opens `path`. With `lock_exclusive` the call fails at once when another
    /// process holds the volume (advisory `flock`); otherwise a shared lock is
    /// taken, which also fails while a writer holds it.
    pub fn open(path: &Path, writable: bool, lock_exclusive: bool) -> io::Result<FileStorage> {
        let mut file = OpenOptions::new().read(true).write(writable).open(path)?;
        let mode = if lock_exclusive {
            rustix::fs::FlockOperation::NonBlockingLockExclusive
        } else {
            rustix::fs::FlockOperation::NonBlockingLockShared
        };
        rustix::fs::flock(&file, mode).map_err(|e| {
            if e == rustix::io::Errno::WOULDBLOCK {
                io::Error::new(
                    io::ErrorKind::WouldBlock,
                    "in use by another cvol process (locked)".to_string(),
                )
            } else {
                io::Error::from(e)
            }
        })?;
        let is_block_device = file.metadata()?.file_type().is_block_device();
        let size_bytes = file.seek(SeekFrom::End(0))?;
        Ok(FileStorage {
            file,
            size_bytes,
            is_block_device,
            direct: None,
            inode_writes: TicketLock::default(),
        })
    }

    /// Switches to direct I/O (O_DIRECT: the page cache is bypassed, as a
    /// benchmark of what reaches the device wants). Fails on a file system
    /// without it or a size that is not a multiple of 4096.
    pub fn set_direct(&mut self) -> io::Result<()> {
        if !self.size_bytes.is_multiple_of(DIRECT_ALIGN_BYTES) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("direct I/O needs a size that is a multiple of {DIRECT_ALIGN_BYTES}"),
            ));
        }
        let flags = rustix::fs::fcntl_getfl(&self.file)?;
        rustix::fs::fcntl_setfl(&self.file, flags | rustix::fs::OFlags::DIRECT).map_err(|e| {
            io::Error::new(
                io::ErrorKind::Unsupported,
                format!("direct I/O (O_DIRECT) refused: {e}"),
            )
        })?;
        self.direct = Some(Mutex::new(()));
        Ok(())
    }

    /// Reads `buf` from `offset` through an aligned bounce buffer.
    fn read_direct(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let a = offset - offset % DIRECT_ALIGN_BYTES;
        let e = (offset + buf.len() as u64).next_multiple_of(DIRECT_ALIGN_BYTES);
        let (mut v, at) = aligned_buffer((e - a) as usize);
        let bounce = &mut v[at..at + (e - a) as usize];
        self.file.read_exact_at(bounce, a)?;
        let head = (offset - a) as usize;
        buf.copy_from_slice(&bounce[head..head + buf.len()]);
        Ok(())
    }

    /// Writes `data` at `offset` through an aligned bounce buffer; pages it
    /// covers in part are read first, under `rmw` (two writers of parts of
    /// one page must not each write back the other's old bytes).
    fn write_direct(&self, offset: u64, data: &[u8], rmw: &Mutex<()>) -> io::Result<()> {
        let a = offset - offset % DIRECT_ALIGN_BYTES;
        let end = offset + data.len() as u64;
        let e = end.next_multiple_of(DIRECT_ALIGN_BYTES);
        let (mut v, at) = aligned_buffer((e - a) as usize);
        let bounce = &mut v[at..at + (e - a) as usize];
        let partial = a != offset || e != end;
        let _held = partial.then(|| rmw.lock().unwrap_or_else(|p| p.into_inner()));
        let page = DIRECT_ALIGN_BYTES as usize;
        if a != offset {
            self.file.read_exact_at(&mut bounce[..page], a)?;
        }
        if e != end && (e - DIRECT_ALIGN_BYTES >= offset || a == offset) {
            let n = bounce.len();
            self.file
                .read_exact_at(&mut bounce[n - page..], e - DIRECT_ALIGN_BYTES)?;
        }
        let head = (offset - a) as usize;
        bounce[head..head + data.len()].copy_from_slice(data);
        self.file.write_all_at(bounce, a)
    }

    /// Creates (or truncates, for a file) a backing store of `size_bytes`.
    /// A regular file is created sparse; a block device must be large enough.
    pub fn create(path: &Path, size_bytes: u64) -> io::Result<FileStorage> {
        let exists = path.exists();
        let is_block = exists && std::fs::metadata(path)?.file_type().is_block_device();
        if !is_block {
            // Create without truncating: the old contents go only once the lock is ours.
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)?;
        }
        let mut st = FileStorage::open(path, true, true)?;
        if !is_block {
            st.file.set_len(0)?;
            st.file.set_len(size_bytes)?;
            st.size_bytes = size_bytes;
        }
        if st.size_bytes < size_bytes {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} holds {} bytes, less than the {} requested",
                    path.display(),
                    st.size_bytes,
                    size_bytes
                ),
            ));
        }
        Ok(st)
    }

    pub fn is_block_device(&self) -> bool {
        self.is_block_device
    }
}

impl Storage for FileStorage {
    fn len_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        check_range(offset, buf.len(), self.size_bytes)?;
        if self.direct.is_some() {
            return self.read_direct(offset, buf);
        }
        self.file.read_exact_at(buf, offset)
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        check_range(offset, data.len(), self.size_bytes)?;
        if let Some(rmw) = &self.direct {
            return self.write_direct(offset, data, rmw);
        }
        // Only large writes queue: a small one (a flush's padded tail, a
        // record) is over before a parked thread would even be woken, and
        // parking it behind a 1 MiB copy cost pgbench a fifth of its TPS.
        let _serial = (!self.is_block_device && data.len() >= QUEUED_WRITE_MIN_BYTES)
            .then(|| self.lock_inode_writes());
        self.file.write_all_at(data, offset)
    }

    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn overwrite_is_cheaper(&self) -> bool {
        !self.is_block_device
    }

    fn allocated_bytes(&self) -> Option<u64> {
        use std::os::unix::fs::MetadataExt;
        if self.is_block_device {
            return None;
        }
        // st_blocks counts 512-byte units whatever the file system's block size.
        self.file.metadata().ok().map(|m| m.blocks() * 512)
    }

    fn next_data(&self, offset: u64) -> io::Result<Option<u64>> {
        check_range(offset, 0, self.size_bytes)?;
        if self.is_block_device || offset == self.size_bytes {
            return Ok((offset < self.size_bytes).then_some(offset));
        }
        // Positional I/O ignores the file offset this moves.
        match rustix::fs::seek(&self.file, rustix::fs::SeekFrom::Data(offset)) {
            Ok(at) => Ok(Some(at.min(self.size_bytes))),
            // ENXIO: no data at or after `offset`.
            Err(rustix::io::Errno::NXIO) => Ok(None),
            // A file system without SEEK_DATA: data may be anywhere.
            Err(_) => Ok(Some(offset)),
        }
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(offset, 0, self.size_bytes)?;
        if self.is_block_device {
            return blk_discard(&self.file, offset, len);
        }
        let _serial = self.lock_inode_writes();
        rustix::fs::fallocate(
            &self.file,
            rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
            offset,
            len,
        )
        .map_err(io::Error::from)
    }
}

/// Passes a discard down to a block device (BLKDISCARD). Devices without
/// discard support answer EOPNOTSUPP, which the caller may ignore.
fn blk_discard(file: &File, offset: u64, len: u64) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    const BLKDISCARD: libc::c_ulong = 0x1277; // _IO(0x12, 119)
    let range: [u64; 2] = [offset, len];
    // SAFETY: BLKDISCARD reads two u64 (offset, length) from the pointer,
    // which points at a live array of exactly that shape.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKDISCARD as _, range.as_ptr()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lock around buffered writes excludes, and serves in arrival
    /// order: a thread that queued behind a holder gets it before the
    /// holder can take it again.
    #[test]
    fn ticket_lock_excludes_and_serves_in_order() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let lock = TicketLock::default();
        let held = AtomicBool::new(false);
        let overlaps = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..6 {
                s.spawn(|| {
                    for _ in 0..2000 {
                        let _t = lock.lock();
                        if held.swap(true, Ordering::SeqCst) {
                            overlaps.fetch_add(1, Ordering::SeqCst);
                        }
                        std::hint::spin_loop();
                        held.store(false, Ordering::SeqCst);
                    }
                });
            }
        });
        assert_eq!(overlaps.load(Ordering::SeqCst), 0);

        // Order: the holder releases and at once asks again; the waiter
        // that queued first must have been served in between.
        let order = Mutex::new(Vec::new());
        let first = lock.lock();
        let issued = lock.tickets.lock().unwrap().0;
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                let _t = lock.lock();
                order.lock().unwrap().push("waiter");
            });
            while lock.tickets.lock().unwrap().0 == issued {
                std::thread::yield_now(); // until the waiter holds a ticket
            }
            drop(first);
            let _again = lock.lock();
            order.lock().unwrap().push("holder again");
            drop(_again);
            waiter.join().unwrap();
        });
        assert_eq!(*order.lock().unwrap(), ["waiter", "holder again"]);
    }

    #[test]
    fn next_data_skips_holes() {
        let dir = std::env::temp_dir().join(format!("cvol-storage-holes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let s = FileStorage::create(&dir.join("vol"), 64 << 20).unwrap();
        assert_eq!(s.next_data(0).unwrap(), None, "a new file is one hole");
        s.write_at(40 << 20, &[1u8; 4096]).unwrap();
        let at = s.next_data(0).unwrap().expect("data after the write");
        // File systems report data at their block granularity.
        assert!(at <= 40 << 20 && at > 30 << 20, "data found at {at}");
        assert_eq!(s.next_data(41 << 20).unwrap(), None);
        assert_eq!(s.next_data(64 << 20).unwrap(), None);
        assert!(s.next_data((64 << 20) + 1).is_err());
        drop(s);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn create_write_read_lock() {
        let dir = std::env::temp_dir().join(format!("cvol-storage-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("vol");
        let s = FileStorage::create(&p, 1 << 20).unwrap();
        assert_eq!(s.len_bytes(), 1 << 20);
        s.write_at(4096, b"abc").unwrap();
        s.sync().unwrap();
        let mut b = [0u8; 3];
        s.read_at(4096, &mut b).unwrap();
        assert_eq!(&b, b"abc");
        assert!(s.read_at((1 << 20) - 1, &mut b).is_err());
        let e = FileStorage::open(&p, true, true)
            .err()
            .expect("second exclusive open must fail");
        assert!(e.to_string().contains("in use"), "{e}");
        let e = FileStorage::create(&p, 1 << 20)
            .err()
            .expect("create over a locked volume must fail");
        assert!(e.to_string().contains("in use"), "{e}");
        let mut b = [0u8; 3];
        s.read_at(4096, &mut b).unwrap();
        assert_eq!(&b, b"abc", "a refused create must not touch the volume");
        drop(s);
        FileStorage::open(&p, false, false).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Direct I/O: unaligned reads and writes of every shape read back as
    /// with buffered I/O, and concurrent writers of parts of the same pages
    /// (the log's write-behinds) lose none of each other's bytes.
    #[test]
    fn direct_io_reads_and_writes_any_range() {
        let dir = std::env::temp_dir().join(format!("cvol-direct-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("vol");
        let size = 1u64 << 20;
        let mut s = FileStorage::create(&p, size).unwrap();
        if let Err(e) = s.set_direct() {
            // A file system without O_DIRECT: nothing to test here, say so.
            eprintln!("no O_DIRECT under {}: {e}", dir.display());
            std::fs::remove_dir_all(&dir).unwrap();
            return;
        }
        let mut model = vec![0u8; size as usize];
        let mut x = 9u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..300 {
            let len = (next() % 20000) as usize;
            let off = next() % (size - len as u64);
            let data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            s.write_at(off, &data).unwrap();
            model[off as usize..off as usize + len].copy_from_slice(&data);
            let rl = (next() % 9000) as usize;
            let ro = next() % (size - rl as u64);
            let mut got = vec![0u8; rl];
            s.read_at(ro, &mut got).unwrap();
            assert!(
                got == model[ro as usize..ro as usize + rl],
                "read {ro}+{rl}"
            );
        }
        // Eight writers, each of every eighth 700-byte piece: pieces share pages.
        let s = std::sync::Arc::new(s);
        let piece = 700u64;
        std::thread::scope(|sc| {
            for t in 0..8u64 {
                let s = s.clone();
                sc.spawn(move || {
                    for k in (t..1000).step_by(8) {
                        s.write_at(k * piece, &vec![(k % 251) as u8 + 1; piece as usize])
                            .unwrap();
                    }
                });
            }
        });
        let mut all = vec![0u8; (1000 * piece) as usize];
        s.read_at(0, &mut all).unwrap();
        for k in 0..1000u64 {
            let want = (k % 251) as u8 + 1;
            let got = &all[(k * piece) as usize..((k + 1) * piece) as usize];
            assert!(got.iter().all(|&b| b == want), "piece {k} lost");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
