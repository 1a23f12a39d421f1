//! Test helpers (cargo feature `test-util`): an in-memory [`Backend`] and
//! the client side of the handshake's byte layouts. Shared by this crate's
//! integration tests and the NBD fuzz targets (`cvol-fuzzlib`); nothing
//! here is used by the server.
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use crate::proto;
use crate::{Backend, BackendError, ContextExtent, Extent, WriteZeroesFlags};

/// Allocation granularity of [`MemBackend`].
pub const BLOCK_BYTES: u64 = 4096;

struct MemState {
    data: Vec<u8>,
    /// One flag per 4 KiB block: false = hole (reads as zero).
    allocated: Vec<bool>,
}

/// In-memory backend tracking holes per 4 KiB, with error injection, an
/// optional delay for writes/reads whose first byte matches a trigger, a
/// call log and a concurrency gauge. Locks ignore poisoning: a panicking
/// call (a failed assertion) must not turn every later call into a panic
/// too (the fuzz targets count panics).
pub struct MemBackend {
    state: RwLock<MemState>,
    read_only: bool,
    fail_with: Mutex<Option<BackendError>>,
    /// See [`MemBackend::with_fail_byte`].
    fail_byte: Option<u8>,
    /// See [`MemBackend::with_overshooting_extents`].
    overshoot_extents: bool,
    /// See [`MemBackend::without_log`].
    logging: bool,
    /// See [`MemBackend::with_context`].
    contexts: Vec<(String, Vec<ContextExtent>)>,
    pub flushes: AtomicUsize,
    /// Writes whose first data byte equals this value sleep `delay_ms`.
    pub slow_write_byte: Mutex<Option<u8>>,
    /// Reads at this offset sleep `delay_ms`.
    pub slow_read_offset: Mutex<Option<u64>>,
    pub delay_ms: AtomicU64,
    pub log: Mutex<Vec<String>>,
    /// The name of the thread of every read and write (while logging).
    pub threads: Mutex<Vec<String>>,
    active: AtomicUsize,
    pub max_active: AtomicUsize,
    /// While true, writes block (see `hold_writes`).
    writes_held: Mutex<bool>,
    writes_released: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl MemBackend {
    /// An export of `size_bytes` zeros, all holes, logging every call.
    pub fn new(size_bytes: u64, read_only: bool) -> MemBackend {
        let blocks = size_bytes.div_ceil(BLOCK_BYTES) as usize;
        MemBackend {
            state: RwLock::new(MemState {
                data: vec![0; size_bytes as usize],
                allocated: vec![false; blocks],
            }),
            read_only,
            fail_with: Mutex::new(None),
            fail_byte: None,
            overshoot_extents: false,
            logging: true,
            contexts: Vec::new(),
            flushes: AtomicUsize::new(0),
            slow_write_byte: Mutex::new(None),
            slow_read_offset: Mutex::new(None),
            delay_ms: AtomicU64::new(0),
            log: Mutex::new(Vec::new()),
            threads: Mutex::new(Vec::new()),
            active: AtomicUsize::new(0),
            max_active: AtomicUsize::new(0),
            writes_held: Mutex::new(false),
            writes_released: Condvar::new(),
        }
    }

    /// A read whose stored data starts with `byte` fails with `Io`; a write
    /// whose data starts with `byte` fails with `NoSpace` (so that client
    /// bytes alone reach the error replies).
    pub fn with_fail_byte(mut self, byte: u8) -> MemBackend {
        self.fail_byte = Some(byte);
        self
    }

    /// Block status overshoots: a last extent that is a hole is reported
    /// 4 KiB longer than asked (the server must cut it off).
    pub fn with_overshooting_extents(mut self) -> MemBackend {
        self.overshoot_extents = true;
        self
    }

    /// Offers the metadata context `name` (e.g. `qemu:dirty-bitmap:s1`)
    /// whose status is `runs`, from offset 0 on (beyond the runs: flags 0).
    /// Its status calls return the runs of the range asked, the last one
    /// whole (so it may overshoot: the server must cut it off); they fail
    /// as every call does under [`MemBackend::fail_with`].
    pub fn with_context(mut self, name: &str, runs: &[ContextExtent]) -> MemBackend {
        self.contexts.push((name.to_owned(), runs.to_vec()));
        self
    }

    /// No call log (it grows with every write: long runs such as fuzzing).
    pub fn without_log(mut self) -> MemBackend {
        self.logging = false;
        self
    }

    fn state(&self) -> RwLockReadGuard<'_, MemState> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn state_mut(&self) -> RwLockWriteGuard<'_, MemState> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes every write block until `hold_writes(false)`.
    pub fn hold_writes(&self, held: bool) {
        *lock(&self.writes_held) = held;
        self.writes_released.notify_all();
    }

    fn wait_if_held(&self) {
        let mut held = lock(&self.writes_held);
        while *held {
            held = self
                .writes_released
                .wait(held)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Every call from now on fails with `error` (None: none fails).
    pub fn fail_with(&self, error: Option<BackendError>) {
        *lock(&self.fail_with) = error;
    }

    fn check(&self) -> Result<(), BackendError> {
        match *lock(&self.fail_with) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    pub fn contents(&self, offset: u64, length: usize) -> Vec<u8> {
        self.state().data[offset as usize..offset as usize + length].to_vec()
    }

    /// Writes `data` at `offset` behind the server's back (allocating).
    pub fn fill(&self, offset: u64, data: &[u8]) {
        let mut st = self.state_mut();
        st.data[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        mark(&mut st, offset, data.len() as u64, true);
    }

    pub fn log_lines(&self) -> Vec<String> {
        lock(&self.log).clone()
    }

    fn note(&self, line: impl FnOnce() -> String) {
        if self.logging {
            lock(&self.log).push(line());
        }
    }

    fn delay(&self) {
        std::thread::sleep(Duration::from_millis(self.delay_ms.load(Ordering::SeqCst)));
    }

    fn note_thread(&self) {
        if self.logging {
            let name = std::thread::current().name().unwrap_or("").to_string();
            lock(&self.threads).push(name);
        }
    }

    fn enter(&self) -> ActiveGuard<'_> {
        let now = self.active.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_active.fetch_max(now, Ordering::SeqCst);
        ActiveGuard(&self.active)
    }

    fn assert_writable(&self, call: &str) {
        assert!(
            !self.read_only,
            "server must not call {call} on a read-only export"
        );
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
        self.state().data.len() as u64
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), BackendError> {
        let _g = self.enter();
        self.note_thread();
        self.check()?;
        if *lock(&self.slow_read_offset) == Some(offset) {
            self.delay();
        }
        let st = self.state();
        let src = &st.data[offset as usize..offset as usize + buf.len()];
        if self.fail_byte.is_some() && src.first() == self.fail_byte.as_ref() {
            return Err(BackendError::Io);
        }
        buf.copy_from_slice(src);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), BackendError> {
        let _g = self.enter();
        self.note_thread();
        self.check()?;
        self.assert_writable("write");
        if self.fail_byte.is_some() && data.first() == self.fail_byte.as_ref() {
            return Err(BackendError::NoSpace);
        }
        self.note(|| {
            format!(
                "write-start {offset} {} {:#x} fua={fua}",
                data.len(),
                data[0]
            )
        });
        if *lock(&self.slow_write_byte) == Some(data[0]) {
            self.delay();
        }
        self.wait_if_held();
        {
            let mut st = self.state_mut();
            st.data[offset as usize..offset as usize + data.len()].copy_from_slice(data);
            mark(&mut st, offset, data.len() as u64, true);
        }
        self.note(|| format!("write-end {offset} {} {:#x}", data.len(), data[0]));
        Ok(())
    }
    fn flush(&self) -> Result<(), BackendError> {
        self.check()?;
        self.note_thread();
        self.note(|| "flush".into());
        self.flushes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn trim(&self, offset: u64, length: u64, _fua: bool) -> Result<(), BackendError> {
        self.check()?;
        self.assert_writable("trim");
        assert!(length > 0);
        mark(&mut self.state_mut(), offset, length, false);
        Ok(())
    }
    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        flags: WriteZeroesFlags,
    ) -> Result<(), BackendError> {
        self.check()?;
        self.assert_writable("write_zeroes");
        assert!(length > 0);
        if flags.fast_zero && flags.no_hole {
            return Err(BackendError::NotSupported);
        }
        let mut st = self.state_mut();
        st.data[offset as usize..(offset + length) as usize].fill(0);
        mark(&mut st, offset, length, flags.no_hole);
        Ok(())
    }
    fn block_status(&self, offset: u64, length: u64) -> Result<Vec<Extent>, BackendError> {
        self.check()?;
        let st = self.state();
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
        if self.overshoot_extents {
            if let Some(last) = out.last_mut().filter(|e| e.hole) {
                last.length += BLOCK_BYTES;
            }
        }
        Ok(out)
    }
    fn meta_contexts(&self) -> Vec<String> {
        self.contexts.iter().map(|(name, _)| name.clone()).collect()
    }
    fn context_status(
        &self,
        name: &str,
        offset: u64,
        length: u64,
    ) -> Result<Vec<ContextExtent>, BackendError> {
        self.check()?;
        let Some((_, runs)) = self.contexts.iter().find(|(n, _)| n == name) else {
            return Err(BackendError::Invalid);
        };
        let mapped: u64 = runs.iter().map(|r| r.length).sum();
        let rest = ContextExtent {
            length: self.size_bytes().saturating_sub(mapped),
            flags: 0,
        };
        let (end, mut out, mut start) = (offset + length, Vec::new(), 0);
        for run in runs.iter().chain([&rest]) {
            let run_end = start + run.length;
            if run_end > offset && start < end {
                let length = run_end - start.max(offset);
                out.push(ContextExtent { length, ..*run });
            }
            start = run_end;
        }
        Ok(out)
    }
}

/// One handshake option as a client sends it: IHAVEOPT, option, length
/// (`length_bytes`, whatever data follows).
pub fn option_header(option: u32, length_bytes: u32) -> Vec<u8> {
    let mut m = proto::IHAVEOPT.to_be_bytes().to_vec();
    m.extend_from_slice(&option.to_be_bytes());
    m.extend_from_slice(&length_bytes.to_be_bytes());
    m
}

/// One whole option: its header and `data`.
pub fn option(option: u32, data: &[u8]) -> Vec<u8> {
    let mut m = option_header(option, data.len() as u32);
    m.extend_from_slice(data);
    m
}

/// The data of `NBD_OPT_GO` / `NBD_OPT_INFO`: the export name and the
/// information types asked for.
pub fn go_data(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut d = string32(name);
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

/// The data of `NBD_OPT_SET_META_CONTEXT` / `NBD_OPT_LIST_META_CONTEXT`:
/// the export name and the queries.
pub fn meta_context_data(export: &str, queries: &[&str]) -> Vec<u8> {
    let mut d = string32(export);
    d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        d.extend(string32(q));
    }
    d
}

/// A string as options carry it: a 32-bit length, the bytes.
fn string32(s: &str) -> Vec<u8> {
    let mut d = (s.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(s.as_bytes());
    d
}

/// The TLS test fixtures (`tests/tls/` of this crate; see its make.sh):
/// `server/`, `server2/` (credential directories), `ca/ca-cert.pem`, and
/// client identities `client/`, `rogue/` (another CA), `expired/`.
pub fn tls_fixtures() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tls")
}
