use crate::{check_range, Storage};
use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// A regular file or a block device, accessed with pread/pwrite.
pub struct FileStorage {
    file: File,
    /// The store's length: changed only by `set_len` (and at creation).
    size_bytes: AtomicU64,
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

    /// Opens `path` and locks it: a writable open takes a write lock, which
    /// fails at once while any other process holds a lock on the file; a
    /// read-only open takes a read lock, which fails only while a writer
    /// holds it. (`lock_exclusive` asks for the write lock; a read-only
    /// descriptor can only hold a read lock, see [`lock`].)
    pub fn open(path: &Path, writable: bool, lock_exclusive: bool) -> io::Result<FileStorage> {
        let file = OpenOptions::new().read(true).write(writable).open(path)?;
        FileStorage::from_file(file, writable && lock_exclusive)
    }

    /// Locks `file` (see [`lock`]) and takes it as the store.
    fn from_file(mut file: File, write_lock: bool) -> io::Result<FileStorage> {
        lock(&file, write_lock)?;
        let is_block_device = file.metadata()?.file_type().is_block_device();
        let size_bytes = file.seek(SeekFrom::End(0))?;
        Ok(FileStorage {
            file,
            size_bytes: AtomicU64::new(size_bytes),
            is_block_device,
            direct: None,
            inode_writes: TicketLock::default(),
        })
    }

    /// Creates the new file `path` of `size_bytes` (sparse), mode 0600,
    /// with O_CREAT|O_EXCL|O_NOFOLLOW: fails if anything is there (a file,
    /// a symbolic link, even one to nowhere), so nothing is ever followed
    /// or truncated.
    pub fn create_new(path: &Path, size_bytes: u64) -> io::Result<FileStorage> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)?;
        let mut st = FileStorage::from_file(file, true)?;
        st.file.set_len(size_bytes)?;
        *st.size_bytes.get_mut() = size_bytes;
        Ok(st)
    }

    /// Creates the local cache file `path` of `size_bytes` for a store
    /// whose data lives elsewhere: a new file as [`FileStorage::create_new`]
    /// makes it. An existing one (a cache a previous run left in a
    /// directory of the user's choosing) is reused, emptied, only when it
    /// is a regular file of this user with no other link, opened without
    /// following a symbolic link; anything else is refused.
    pub fn create_private(path: &Path, size_bytes: u64) -> io::Result<FileStorage> {
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        match FileStorage::create_new(path, size_bytes) {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            r => return r,
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ELOOP) => io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "a symbolic link is there; refusing to follow it",
                ),
                _ => e,
            })?;
        let md = file.metadata()?;
        let me = rustix::process::geteuid().as_raw();
        if !md.file_type().is_file() || md.uid() != me || md.nlink() != 1 {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "exists and is not a cache file of this user (a regular file owned by \
                     uid {me} with one link); refusing to use it"
                ),
            ));
        }
        // Made private, as a new one would be.
        file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        let mut st = FileStorage::from_file(file, true)?;
        st.file.set_len(0)?;
        st.file.set_len(size_bytes)?;
        *st.size_bytes.get_mut() = size_bytes;
        Ok(st)
    }

    /// The file's permission bits (e.g. 0o600).
    pub fn mode(&self) -> io::Result<u32> {
        use std::os::unix::fs::PermissionsExt;
        Ok(self.file.metadata()?.permissions().mode() & 0o7777)
    }

    /// Switches to direct I/O (O_DIRECT: the page cache is bypassed, as a
    /// benchmark of what reaches the device wants). Fails on a file system
    /// without it or a size that is not a multiple of 4096.
    pub fn set_direct(&mut self) -> io::Result<()> {
        if !self.len_bytes().is_multiple_of(DIRECT_ALIGN_BYTES) {
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
    /// A regular file is created sparse, mode 0600 (only its owner reads
    /// the data or can lock it); a block device must be large enough.
    pub fn create(path: &Path, size_bytes: u64) -> io::Result<FileStorage> {
        use std::os::unix::fs::OpenOptionsExt;
        // Create without truncating: the old contents go only once the lock is ours.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)?;
        let is_block = file.metadata()?.file_type().is_block_device();
        let mut st = FileStorage::from_file(file, true)?;
        if !is_block {
            st.file.set_len(0)?;
            st.file.set_len(size_bytes)?;
            *st.size_bytes.get_mut() = size_bytes;
        }
        if st.len_bytes() < size_bytes {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} holds {} bytes, less than the {} requested",
                    path.display(),
                    st.len_bytes(),
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
        self.size_bytes.load(Ordering::Acquire)
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        check_range(offset, buf.len(), self.len_bytes())?;
        if self.direct.is_some() {
            return self.read_direct(offset, buf);
        }
        self.file.read_exact_at(buf, offset)
    }

    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        check_range(offset, data.len(), self.len_bytes())?;
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
        let size = self.len_bytes();
        check_range(offset, 0, size)?;
        if self.is_block_device || offset == size {
            return Ok((offset < size).then_some(offset));
        }
        // Positional I/O ignores the file offset this moves.
        match rustix::fs::seek(&self.file, rustix::fs::SeekFrom::Data(offset)) {
            Ok(at) => Ok(Some(at.min(size))),
            // ENXIO: no data at or after `offset`.
            Err(rustix::io::Errno::NXIO) => Ok(None),
            // A file system without SEEK_DATA: data may be anywhere.
            Err(_) => Ok(Some(offset)),
        }
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        if self.is_block_device {
            // Positional I/O ignores the file offset this moves.
            let have = rustix::fs::seek(&self.file, rustix::fs::SeekFrom::End(0))?;
            if have < len {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("the device holds {have} bytes, less than {len}"),
                ));
            }
            self.size_bytes.store(have, Ordering::Release);
            return Ok(());
        }
        let _serial = self.lock_inode_writes();
        // A shrink stops I/O beyond the new end before the file is cut; a
        // grow makes the file longer before I/O may go there, and keeps a
        // file already made longer (`truncate -s`) at its length.
        if len < self.len_bytes() {
            self.size_bytes.store(len, Ordering::Release);
            self.file.set_len(len)?;
        } else if self.file.metadata()?.len() < len {
            self.file.set_len(len)?;
        }
        self.size_bytes.store(len, Ordering::Release);
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(offset, 0, self.len_bytes())?;
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

/// Takes an open file description lock (fcntl F_OFD_SETLK) on the whole of
/// `file`, without waiting: a write lock when `write` (the descriptor must
/// be open for writing), else a read lock. Write locks exclude each other
/// and read locks; read locks share.
///
/// Why not `flock`: flock's shared lock needs only a descriptor open for
/// reading, and `flock -s` by any user who can read the file kept a
/// server from starting. Locks of the two kinds do not see each other on
/// Linux, so flock(1) can no longer get in the way, and a write lock
/// needs write access. A process that can open the file at all can still
/// hold an fcntl read lock on it, and no advisory lock on a file can
/// shut out a reader, so volumes are created mode 0600 (only the owner
/// and root can open them) and `cvol serve` warns about a volume file
/// others can read. The error names which kind of lock is in the way.
pub fn lock(file: &File, write: bool) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut fl = whole_file_lock(if write { libc::F_WRLCK } else { libc::F_RDLCK });
    // SAFETY: F_OFD_SETLK reads one `struct flock`, which `fl` is.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &mut fl) };
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if !matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) {
        return Err(e);
    }
    // Who is in the way: a writer (another server) or a reader.
    let mut q = whole_file_lock(if write { libc::F_WRLCK } else { libc::F_RDLCK });
    // SAFETY: F_OFD_GETLK reads and fills in one `struct flock`.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut q) };
    let held_by_reader = rc == 0 && i32::from(q.l_type) == libc::F_RDLCK;
    Err(io::Error::new(
        io::ErrorKind::WouldBlock,
        if held_by_reader {
            "in use: a process that reads it holds a lock on it (cvol stat or check, or any \
             process of a user who can open the file)"
        } else {
            "in use by another cvol process (locked)"
        },
    ))
}

/// A `struct flock` over the whole file, of type `kind`.
fn whole_file_lock(kind: libc::c_int) -> libc::flock {
    // SAFETY: `struct flock` is plain integers; all-zero is a valid value
    // (start 0, length 0: the whole file; l_pid must be 0 for OFD locks).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl
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
    fn set_len_extends_cuts_and_keeps_a_longer_file() {
        let dir = std::env::temp_dir().join(format!("cvol-storage-len-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("vol");
        let s = FileStorage::create(&p, 1 << 20).unwrap();
        assert!(s.write_at(2 << 20, b"x").is_err());
        s.set_len(3 << 20).unwrap();
        assert_eq!(
            (s.len_bytes(), std::fs::metadata(&p).unwrap().len()),
            (3 << 20, 3 << 20)
        );
        s.write_at(2 << 20, b"x").unwrap();
        s.set_len(2 << 20).unwrap();
        assert_eq!(
            (s.len_bytes(), std::fs::metadata(&p).unwrap().len()),
            (2 << 20, 2 << 20)
        );
        assert!(s.write_at(2 << 20, b"x").is_err(), "beyond the cut");
        // Made longer outside (truncate -s): a grow keeps the file's length.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(8 << 20)
            .unwrap();
        s.set_len(4 << 20).unwrap();
        assert_eq!(
            (s.len_bytes(), std::fs::metadata(&p).unwrap().len()),
            (4 << 20, 8 << 20)
        );
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

    /// Files are created 0600, and the cache file of a store is never a
    /// planted link: a symbolic link (dangling or to a victim) is refused
    /// and its target untouched, and so is a hard link or another user's file.
    #[test]
    fn created_files_are_private_and_links_are_never_followed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("cvol-storage-private-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let v = dir.join("vol");
        drop(FileStorage::create(&v, 1 << 20).unwrap());
        assert_eq!(mode(&v), 0o600);
        let n = dir.join("new");
        drop(FileStorage::create_new(&n, 1 << 20).unwrap());
        assert_eq!(mode(&n), 0o600);
        assert!(FileStorage::create_new(&n, 1 << 20).is_err(), "exists");

        let victim = dir.join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let link = dir.join("link.cache");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let e = FileStorage::create_private(&link, 4 << 20).err().unwrap();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert!(FileStorage::create_new(&link, 4 << 20).is_err());
        let dangling = dir.join("dangling.cache");
        std::os::unix::fs::symlink(dir.join("nowhere"), &dangling).unwrap();
        assert!(FileStorage::create_private(&dangling, 4 << 20).is_err());
        assert!(
            !dir.join("nowhere").exists(),
            "nothing created through the link"
        );
        let hard = dir.join("hard.cache");
        std::fs::hard_link(&victim, &hard).unwrap();
        let e = FileStorage::create_private(&hard, 4 << 20).err().unwrap();
        assert!(e.to_string().contains("refusing"), "{e}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");

        // A cache a previous run left is reused, emptied.
        let c = dir.join("ok.cache");
        FileStorage::create_private(&c, 1 << 20)
            .unwrap()
            .write_at(0, b"old")
            .unwrap();
        let st = FileStorage::create_private(&c, 2 << 20).unwrap();
        assert_eq!(st.len_bytes(), 2 << 20);
        let mut b = [9u8; 3];
        st.read_at(0, &mut b).unwrap();
        assert_eq!(b, [0; 3]);
        assert_eq!(st.mode().unwrap(), 0o600);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The lock: writers exclude each other and readers; readers share;
    /// a flock(2) of the file (`flock -s`, by any reader) does not stop a
    /// writer; and a refusal says whether a writer or a reader is in the way.
    #[test]
    fn write_locks_exclude_and_flock_does_not_interfere() {
        let dir = std::env::temp_dir().join(format!("cvol-storage-lock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("vol");
        drop(FileStorage::create(&p, 1 << 20).unwrap());
        // Someone holds a shared flock: a writer opens anyway.
        let reader = File::open(&p).unwrap();
        rustix::fs::flock(&reader, rustix::fs::FlockOperation::NonBlockingLockShared).unwrap();
        let w = FileStorage::open(&p, true, true).unwrap();
        let e = FileStorage::open(&p, true, true).err().unwrap();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        assert!(e.to_string().contains("another cvol process"), "{e}");
        assert!(
            FileStorage::open(&p, false, false).is_err(),
            "a writer holds it"
        );
        drop(w);
        let r1 = FileStorage::open(&p, false, false).unwrap();
        let _r2 = FileStorage::open(&p, false, true).unwrap();
        let e = FileStorage::open(&p, true, true).err().unwrap();
        assert!(e.to_string().contains("reads it"), "{e}");
        drop((r1, _r2, reader));
        FileStorage::open(&p, true, true).unwrap();
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
