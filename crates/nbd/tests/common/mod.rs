//! Shared test helpers: an in-memory backend and a server on a Unix socket.
#![allow(dead_code, reason = "each test binary uses only some of the helpers")]

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Duration;

use cvol_nbd::{Backend, BackendError, Extent, Server, ServerConfig, WriteZeroesFlags};

pub const BLOCK_BYTES: u64 = 4096;

struct MemState {
    data: Vec<u8>,
    /// One flag per 4 KiB block: false = hole (reads as zero).
    allocated: Vec<bool>,
}

/// In-memory backend tracking holes per 4 KiB, with error injection, an
/// optional delay for writes/reads whose first byte matches a trigger, a
/// call log and a concurrency gauge.
pub struct MemBackend {
    state: RwLock<MemState>,
    read_only: bool,
    fail_with: Mutex<Option<BackendError>>,
    pub flushes: AtomicUsize,
    /// Writes whose first data byte equals this value sleep `delay_ms`.
    pub slow_write_byte: Mutex<Option<u8>>,
    /// Reads at this offset sleep `delay_ms`.
    pub slow_read_offset: Mutex<Option<u64>>,
    pub delay_ms: AtomicU64,
    pub log: Mutex<Vec<String>>,
    active: AtomicUsize,
    pub max_active: AtomicUsize,
    /// While true, writes block (see `hold_writes`).
    writes_held: Mutex<bool>,
    writes_released: Condvar,
}

impl MemBackend {
    pub fn new(size_bytes: u64, read_only: bool) -> MemBackend {
        let blocks = size_bytes.div_ceil(BLOCK_BYTES) as usize;
        MemBackend {
            state: RwLock::new(MemState {
                data: vec![0; size_bytes as usize],
                allocated: vec![false; blocks],
            }),
            read_only,
            fail_with: Mutex::new(None),
            flushes: AtomicUsize::new(0),
            slow_write_byte: Mutex::new(None),
            slow_read_offset: Mutex::new(None),
            delay_ms: AtomicU64::new(0),
            log: Mutex::new(Vec::new()),
            active: AtomicUsize::new(0),
            max_active: AtomicUsize::new(0),
            writes_held: Mutex::new(false),
            writes_released: Condvar::new(),
        }
    }

    /// Makes every write block until `hold_writes(false)`.
    pub fn hold_writes(&self, held: bool) {
        *self.writes_held.lock().unwrap() = held;
        self.writes_released.notify_all();
    }

    fn wait_if_held(&self) {
        let mut held = self.writes_held.lock().unwrap();
        while *held {
            held = self.writes_released.wait(held).unwrap();
        }
    }

    pub fn fail_with(&self, error: Option<BackendError>) {
        *self.fail_with.lock().unwrap() = error;
    }

    fn check(&self) -> Result<(), BackendError> {
        match *self.fail_with.lock().unwrap() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    pub fn contents(&self, offset: u64, length: usize) -> Vec<u8> {
        let st = self.state.read().unwrap();
        st.data[offset as usize..offset as usize + length].to_vec()
    }

    pub fn fill(&self, offset: u64, data: &[u8]) {
        let mut st = self.state.write().unwrap();
        st.data[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        mark(&mut st, offset, data.len() as u64, true);
    }

    pub fn log_lines(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    fn note(&self, line: String) {
        self.log.lock().unwrap().push(line);
    }

    fn delay(&self) {
        std::thread::sleep(Duration::from_millis(self.delay_ms.load(Ordering::SeqCst)));
    }

    fn enter(&self) -> ActiveGuard<'_> {
        let now = self.active.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_active.fetch_max(now, Ordering::SeqCst);
        ActiveGuard(&self.active)
    }
}

struct ActiveGuard<'a>(&'a AtomicUsize);
impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Marks whole blocks covered by the range as allocated (any touched block)
/// or deallocated (only fully covered blocks, zeroing them).
fn mark(st: &mut MemState, offset: u64, length: u64, allocated: bool) {
    if allocated {
        let first = offset / BLOCK_BYTES;
        let last = (offset + length).div_ceil(BLOCK_BYTES);
        for b in first..last {
            st.allocated[b as usize] = true;
        }
        return;
    }
    let first = offset.div_ceil(BLOCK_BYTES);
    let last = (offset + length) / BLOCK_BYTES;
    for b in first..last {
        st.allocated[b as usize] = false;
        let start = (b * BLOCK_BYTES) as usize;
        let end = (start + BLOCK_BYTES as usize).min(st.data.len());
        st.data[start..end].fill(0);
    }
}

impl Backend for MemBackend {
    fn size_bytes(&self) -> u64 {
        self.state.read().unwrap().data.len() as u64
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        let _g = self.enter();
        self.check()?;
        if *self.slow_read_offset.lock().unwrap() == Some(offset) {
            self.delay();
        }
        let st = self.state.read().unwrap();
        buf.copy_from_slice(&st.data[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), BackendError> {
        let _g = self.enter();
        self.check()?;
        assert!(
            !self.read_only,
            "server must not call write on a read-only export"
        );
        self.note(format!(
            "write-start {offset} {} {:#x} fua={fua}",
            data.len(),
            data[0]
        ));
        if *self.slow_write_byte.lock().unwrap() == Some(data[0]) {
            self.delay();
        }
        self.wait_if_held();
        {
            let mut st = self.state.write().unwrap();
            st.data[offset as usize..offset as usize + data.len()].copy_from_slice(data);
            mark(&mut st, offset, data.len() as u64, true);
        }
        self.note(format!("write-end {offset} {} {:#x}", data.len(), data[0]));
        Ok(())
    }
    fn flush(&self) -> Result<(), BackendError> {
        self.check()?;
        self.note("flush".into());
        self.flushes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn trim(&self, offset: u64, length: u64, _fua: bool) -> Result<(), BackendError> {
        self.check()?;
        assert!(length > 0);
        let mut st = self.state.write().unwrap();
        mark(&mut st, offset, length, false);
        Ok(())
    }
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        flags: WriteZeroesFlags,
    ) -> Result<(), BackendError> {
        self.check()?;
        assert!(length > 0);
        if flags.fast_zero && flags.no_hole {
            return Err(BackendError::NotSupported);
        }
        let mut st = self.state.write().unwrap();
        st.data[offset as usize..(offset + length) as usize].fill(0);
        if flags.no_hole {
            mark(&mut st, offset, length, true);
        } else {
            mark(&mut st, offset, length, false);
        }
        Ok(())
    }
    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, BackendError> {
        self.check()?;
        let st = self.state.read().unwrap();
        let end = offset + length;
        let mut out = Vec::new();
        let mut pos = offset;
        while pos < end {
            let block = pos / BLOCK_BYTES;
            let block_end = ((block + 1) * BLOCK_BYTES).min(end);
            let hole = !st.allocated[block as usize];
            out.push(Extent {
                length: block_end - pos,
                hole,
                zero: hole,
            });
            pos = block_end;
        }
        Ok(out)
    }
}

/// A running server on a Unix socket in a temporary directory.
pub struct TestServer {
    pub server: Server,
    pub backend: Arc<MemBackend>,
    pub socket_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl TestServer {
    pub fn start(backend: MemBackend, config: ServerConfig) -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        let socket_path = dir.path().join("nbd.sock");
        let backend = Arc::new(backend);
        let server = Server::new(backend.clone() as Arc<dyn Backend>, config);
        server
            .serve_unix(UnixListener::bind(&socket_path).unwrap())
            .unwrap();
        TestServer {
            server,
            backend,
            socket_path,
            _dir: dir,
        }
    }

    /// NBD URI for the export `name` ("" = default export).
    pub fn uri(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.socket_path.display())
    }

    pub fn wait_for_connections(&self, count: usize) {
        for _ in 0..500 {
            if self.server.connection_count() == count {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!(
            "connection count stayed at {}, wanted {count}",
            self.server.connection_count()
        );
    }
}

/// Returns true if `program` can be run; prints why a test is skipped if not.
pub fn have_tool(program: &str, args: &[&str]) -> bool {
    let ok = Command::new(program)
        .args(args)
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        eprintln!("SKIP: `{program}` is not installed or not working");
    }
    ok
}

/// A Python interpreter with the libnbd bindings (nbdsh's `python3` may be
/// a different interpreter than the one the bindings were built for).
pub fn python_with_libnbd() -> Option<String> {
    for python in ["python3", "/usr/bin/python3"] {
        let ok = Command::new(python)
            .args(["-c", "import nbd"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if ok {
            return Some(python.to_string());
        }
    }
    eprintln!("SKIP: no python3 with the libnbd bindings (python3-libnbd)");
    None
}

pub fn pattern(length: usize, seed: u8) -> Vec<u8> {
    (0..length)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

pub fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The byte-level side of a raw NBD test client (the tests' own clients
/// add handshakes and requests on top): big-endian reads, option frames,
/// closed-connection detection.
pub trait NbdWire {
    fn stream(&mut self) -> &mut std::os::unix::net::UnixStream;

    fn read_n(&mut self, n: usize) -> Vec<u8> {
        use std::io::Read;
        let mut v = vec![0u8; n];
        self.stream().read_exact(&mut v).unwrap();
        v
    }
    fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.read_n(2).try_into().unwrap())
    }
    fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.read_n(4).try_into().unwrap())
    }
    fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.read_n(8).try_into().unwrap())
    }

    /// Sends one option: IHAVEOPT, option, length, data.
    fn send_option(&mut self, option: u32, data: &[u8]) {
        use std::io::Write;
        let mut m = cvol_nbd::proto::IHAVEOPT.to_be_bytes().to_vec();
        m.extend_from_slice(&option.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        self.stream().write_all(&m).unwrap();
    }

    /// One option reply: (option, reply type, data).
    fn option_reply(&mut self) -> (u32, u32, Vec<u8>) {
        assert_eq!(self.u64(), cvol_nbd::proto::OPTION_REPLY_MAGIC);
        let option = self.u32();
        let reply_type = self.u32();
        let length = self.u32() as usize;
        (option, reply_type, self.read_n(length))
    }

    /// The server closed the connection (or it failed).
    fn is_closed(&mut self) -> bool {
        use std::io::Read;
        let mut b = [0u8; 1];
        matches!(self.stream().read(&mut b), Ok(0) | Err(_))
    }
}
