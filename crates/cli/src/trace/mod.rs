//! Request traces: `cvol serve --trace FILE` records every client request
//! that reaches the volume (layout: `cvol_format::trace`, docs/FORMAT.md
//! "Trace file"); `cvol trace show FILE` prints one, `cvol trace replay
//! FILE VOLUME` runs it against a volume that is not served.
//!
//! Recording stays off the I/O path: a request only pushes a 32-byte
//! record into a bounded queue (never waiting: a full queue drops the
//! record and counts it), and a thread of its own writes the file through
//! a 1 MiB buffer, flushed every second and at the stop.
use crate::backend::{Call, Hook, Hooked, ViewBackend};
use crate::error::Error;
use crate::volfile::{self, Globals, Opened, Purpose};
use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender, TrySendError};
use cvol_engine::Volume;
use cvol_format::trace::{
    TraceCommand, TraceHeader, TraceRecord, TRACE_FLAG_FAST_ZERO, TRACE_FLAG_FUA,
    TRACE_FLAG_NO_HOLE, TRACE_HEADER_BYTES, TRACE_RECORD_BYTES,
};
use cvol_nbd::{Backend, BackendError, CommandKind, WriteZeroesFlags};
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Records queued for the writer thread at most (2 MiB).
const QUEUE_RECORDS: usize = 65536;

/// A trace result code: 0 done, else the error.
fn result_code(e: BackendError) -> u8 {
    match e {
        BackendError::Io => 1,
        BackendError::NoSpace => 2,
        BackendError::Invalid => 3,
        BackendError::ReadOnly => 4,
        BackendError::NotSupported => 5,
        BackendError::Overflow => 6,
    }
}

fn result_name(code: u8) -> &'static str {
    match code {
        0 => "ok",
        1 => "EIO",
        2 => "ENOSPC",
        3 => "EINVAL",
        4 => "EPERM",
        5 => "ENOTSUP",
        6 => "EOVERFLOW",
        _ => "?",
    }
}

/// Checks, before the volume is opened, that `--trace FILE` can be made:
/// no such file yet, in a directory that exists.
pub fn check_new_file(path: &Path) -> Result<(), Error> {
    if std::fs::symlink_metadata(path).is_ok() {
        return Err(Error::Usage(format!(
            "--trace {}: exists; refusing to replace it (choose a new file)",
            path.display()
        )));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(Error::Usage(format!(
            "--trace {}: the directory {} does not exist",
            path.display(),
            dir.display()
        )));
    }
    Ok(())
}

/// The recording side of `--trace`: creates the file (refusing one that
/// exists) and starts its writer thread.
pub struct Recorder {
    queue: Sender<TraceRecord>,
    started: Instant,
    dropped: AtomicU64,
    closing: Arc<AtomicBool>,
    writer: Mutex<Option<std::thread::JoinHandle<std::io::Result<u64>>>>,
    path: String,
}

impl Recorder {
    pub fn create(path: &Path, volume_bytes: u64) -> Result<Recorder, Error> {
        use std::os::unix::fs::OpenOptionsExt;
        // Private like a volume: the trace shows what clients did.
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| {
                Error::Usage(match e.kind() {
                    std::io::ErrorKind::AlreadyExists => format!(
                        "--trace {}: exists; refusing to replace it (choose a new file)",
                        path.display()
                    ),
                    _ => format!("--trace {}: {e}", path.display()),
                })
            })?;
        let start_unix_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(
            &TraceHeader {
                start_unix_ns,
                volume_bytes,
            }
            .encode(),
        )
        .map_err(|e| Error::Usage(format!("--trace {}: {e}", path.display())))?;
        let (tx, rx) = bounded(QUEUE_RECORDS);
        let closing = Arc::new(AtomicBool::new(false));
        let writer_closing = closing.clone();
        let writer = std::thread::Builder::new()
            .name("cvol-trace".into())
            .spawn(move || write_records(&rx, out, &writer_closing))
            .map_err(|e| Error::io("cannot start the trace writer", e))?;
        Ok(Recorder {
            queue: tx,
            started: Instant::now(),
            dropped: AtomicU64::new(0),
            closing,
            writer: Mutex::new(Some(writer)),
            path: path.display().to_string(),
        })
    }

    /// `backend`, its requests recorded.
    pub fn wrap(self: &Arc<Self>, backend: Arc<dyn Backend>) -> Arc<dyn Backend> {
        Arc::new(Hooked {
            inner: backend,
            hook: self.clone(),
        })
    }

    fn record(&self, r: TraceRecord) {
        if let Err(TrySendError::Full(_)) = self.queue.try_send(r) {
            let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            if n.is_power_of_two() {
                tracing::warn!(
                    dropped = n,
                    "trace: the writer falls behind, records dropped"
                );
            }
        }
    }

    /// Ends the trace: the writer drains the queue, flushes and syncs.
    /// Called at the server's stop, after the last request.
    pub fn finish(&self) {
        self.closing.store(true, Ordering::Release);
        let handle = self.writer.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(h) = handle else {
            return;
        };
        let dropped = self.dropped.load(Ordering::Relaxed);
        match h.join() {
            Ok(Ok(n)) => tracing::info!(records = n, dropped, "trace {} written", self.path),
            Ok(Err(e)) => tracing::error!("trace {}: {e}", self.path),
            Err(_) => tracing::error!("trace {}: the writer thread panicked", self.path),
        }
    }
}

/// The writer thread: records to the file, flushed every second and at
/// the end. Returns how many it wrote.
fn write_records(
    rx: &Receiver<TraceRecord>,
    mut out: BufWriter<File>,
    closing: &AtomicBool,
) -> std::io::Result<u64> {
    let mut written = 0u64;
    let mut last_flush = Instant::now();
    loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(r) => {
                out.write_all(&r.encode())?;
                written += 1;
            }
            Err(RecvTimeoutError::Timeout) if closing.load(Ordering::Acquire) => break,
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        if last_flush.elapsed() >= Duration::from_secs(1) {
            out.flush()?;
            last_flush = Instant::now();
        }
    }
    while let Ok(r) = rx.try_recv() {
        out.write_all(&r.encode())?;
        written += 1;
    }
    let file = out.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    Ok(written)
}

/// The trace's name of a command.
fn trace_command(kind: CommandKind) -> TraceCommand {
    match kind {
        CommandKind::Read => TraceCommand::Read,
        CommandKind::Write => TraceCommand::Write,
        CommandKind::Flush => TraceCommand::Flush,
        CommandKind::Trim => TraceCommand::Trim,
        CommandKind::WriteZeroes => TraceCommand::WriteZeroes,
        CommandKind::BlockStatus => TraceCommand::BlockStatus,
        CommandKind::Cache => TraceCommand::Cache,
    }
}

/// Each call becomes a record once it is done.
impl Hook for Recorder {
    fn around<T>(
        &self,
        call: Call,
        f: impl FnOnce() -> Result<T, BackendError>,
    ) -> Result<T, BackendError> {
        let started = Instant::now();
        let result = f();
        let flag = |on: bool, bit: u8| if on { bit } else { 0 };
        self.record(TraceRecord {
            start_ns: started.saturating_duration_since(self.started).as_nanos() as u64,
            offset: call.offset,
            length: u32::try_from(call.length).unwrap_or(u32::MAX),
            duration_ns: u32::try_from(started.elapsed().as_nanos()).unwrap_or(u32::MAX),
            command: trace_command(call.kind),
            flags: flag(call.fua, TRACE_FLAG_FUA)
                | flag(call.no_hole, TRACE_FLAG_NO_HOLE)
                | flag(call.fast_zero, TRACE_FLAG_FAST_ZERO),
            result: result.as_ref().err().map_or(0, |e| result_code(*e)),
        });
        result
    }
}

/// A trace read back: its header and the records up to the first damaged
/// or short one.
pub struct Trace {
    pub header: TraceHeader,
    pub records: Vec<TraceRecord>,
    /// Bytes after the last good record (a trace cut by a crash).
    pub trailing_bytes: u64,
}

pub fn read_trace(path: &Path) -> Result<Trace, Error> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|e| Error::io(path.display(), e))?;
    let header = TraceHeader::decode(&bytes)
        .map_err(|e| Error::Refused(format!("{}: {e}", path.display())))?;
    let body = &bytes[TRACE_HEADER_BYTES..];
    let mut records = Vec::with_capacity(body.len() / TRACE_RECORD_BYTES);
    for chunk in body.chunks(TRACE_RECORD_BYTES) {
        match TraceRecord::decode(chunk) {
            Some(r) => records.push(r),
            None => break,
        }
    }
    let trailing_bytes = (body.len() - records.len() * TRACE_RECORD_BYTES) as u64;
    Ok(Trace {
        header,
        records,
        trailing_bytes,
    })
}

fn flag_names(flags: u8) -> String {
    let mut v = Vec::new();
    for (bit, name) in [
        (TRACE_FLAG_FUA, "fua"),
        (TRACE_FLAG_NO_HOLE, "no_hole"),
        (TRACE_FLAG_FAST_ZERO, "fast_zero"),
    ] {
        if flags & bit != 0 {
            v.push(name);
        }
    }
    v.join(",")
}

/// Per-command totals of a trace or a replay.
#[derive(Default, Clone, Copy)]
struct Totals {
    requests: u64,
    bytes: u64,
    errors: u64,
    duration_ns: u128,
}

fn totals(records: &[TraceRecord]) -> Vec<(TraceCommand, Totals)> {
    let mut t = [Totals::default(); 7];
    for r in records {
        let e = &mut t[r.command as usize];
        e.requests += 1;
        e.bytes += u64::from(r.length);
        e.errors += u64::from(r.result != 0);
        e.duration_ns += u128::from(r.duration_ns);
    }
    TraceCommand::ALL
        .iter()
        .map(|&c| (c, t[c as usize]))
        .filter(|(_, t)| t.requests > 0)
        .collect()
}

impl Totals {
    fn mean_us(&self) -> f64 {
        self.duration_ns as f64 / self.requests as f64 / 1000.0
    }
}

/// Per-command totals as `show --json` and `replay --json` print them.
fn totals_json(t: &[(TraceCommand, Totals)]) -> serde_json::Value {
    t.iter()
        .map(|(c, t)| {
            let v = serde_json::json!({
                "requests": t.requests, "bytes": t.bytes, "errors": t.errors,
                "mean_duration_us": t.mean_us(),
            });
            (c.name().to_string(), v)
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// Per-command totals, one line each, for the text reports.
fn totals_lines(t: &[(TraceCommand, Totals)]) -> Vec<String> {
    t.iter()
        .map(|(c, t)| {
            format!(
                "  {:<12} {:>10} requests {:>14} bytes {:>6} errors  mean {:.1} us",
                c.name(),
                t.requests,
                t.bytes,
                t.errors,
                t.mean_us()
            )
        })
        .collect()
}

/// `cvol trace show FILE`: a summary, then the first `limit` records.
pub fn cmd_show(path: &Path, json: bool, limit: Option<usize>) -> Result<ExitCode, Error> {
    let trace = read_trace(path)?;
    let span_ns = trace.records.iter().map(|r| r.start_ns).max().unwrap_or(0);
    let shown = &trace.records[..limit.unwrap_or(usize::MAX).min(trace.records.len())];
    let mut out = std::io::stdout().lock();
    let w = |out: &mut std::io::StdoutLock<'_>, s: String| -> Result<(), Error> {
        match writeln!(out, "{s}") {
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(Error::io("stdout", e)),
            _ => Ok(()),
        }
    };
    if json {
        let by_command = totals_json(&totals(&trace.records));
        let records: Vec<_> = shown
            .iter()
            .map(|r| {
                serde_json::json!({
                    "start_ns": r.start_ns, "command": r.command.name(), "offset": r.offset,
                    "length": r.length, "duration_ns": r.duration_ns, "flags": flag_names(r.flags),
                    "result": result_name(r.result),
                })
            })
            .collect();
        let v = serde_json::json!({
            "start_unix_ns": trace.header.start_unix_ns,
            "volume_bytes": trace.header.volume_bytes,
            "records": trace.records.len(),
            "trailing_bytes": trace.trailing_bytes,
            "span_seconds": span_ns as f64 / 1e9,
            "by_command": by_command,
            "shown": records,
        });
        w(&mut out, v.to_string())?;
        return Ok(ExitCode::SUCCESS);
    }
    w(
        &mut out,
        format!(
            "trace {}: {} requests over {:.3} s, volume {} bytes{}",
            path.display(),
            trace.records.len(),
            span_ns as f64 / 1e9,
            trace.header.volume_bytes,
            if trace.trailing_bytes > 0 {
                format!(
                    " ({} bytes after the last whole record ignored)",
                    trace.trailing_bytes
                )
            } else {
                String::new()
            }
        ),
    )?;
    for line in totals_lines(&totals(&trace.records)) {
        w(&mut out, line)?;
    }
    for r in shown {
        w(
            &mut out,
            format!(
                "{:>14.6} {:<12} offset {:>14} length {:>9} {:>9.1} us {} {}",
                r.start_ns as f64 / 1e9,
                r.command.name(),
                r.offset,
                r.length,
                f64::from(r.duration_ns) / 1000.0,
                result_name(r.result),
                flag_names(r.flags)
            ),
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// What replayed writes carry (a trace has no data).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataKind {
    /// Each 4 KiB block: this percentage of zeros after random bytes (as
    /// fio's buffer_compress_percentage).
    Compressible(u8),
    Random,
    Zero,
}

impl DataKind {
    pub fn parse(v: &str) -> Result<DataKind, Error> {
        match v {
            "random" => Ok(DataKind::Random),
            "zero" => Ok(DataKind::Zero),
            _ => match v.trim_end_matches('%').parse::<u8>() {
                Ok(p) if p <= 100 => Ok(DataKind::Compressible(p)),
                _ => Err(Error::Usage(format!(
                    "--data {v}: expected a compressibility percentage (0-100), random or zero"
                ))),
            },
        }
    }

    /// Fills `buf` for a write at `offset`, the `n`th request of the trace:
    /// blocks differ by offset and request, so dedup finds only what the
    /// zero share makes alike.
    fn fill(self, buf: &mut [u8], offset: u64, n: u64) {
        let zero_percent = match self {
            DataKind::Zero => {
                buf.fill(0);
                return;
            }
            DataKind::Random => 0,
            DataKind::Compressible(p) => usize::from(p),
        };
        for (i, block) in buf.chunks_mut(4096).enumerate() {
            let mut x = (offset / 4096 + i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
                ^ n.wrapping_mul(0xd1b5_4a32_d192_ed03)
                | 1;
            let random = block.len() - block.len() * zero_percent / 100;
            for chunk in block[..random].chunks_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
            }
            block[random..].fill(0);
        }
    }
}

/// `cvol trace replay`'s settings.
pub struct ReplayArgs {
    /// Issue each request at its recorded time (else as fast as possible).
    pub recorded_pace: bool,
    pub queue_depth: usize,
    pub data: DataKind,
    pub json: bool,
    /// Blocks per merged compression unit (`--unit-size`, as `serve`'s:
    /// `OpenOptions::elastic.unit_blocks`).
    pub unit_blocks: u32,
    /// `--direct`: the volume's file with O_DIRECT.
    pub direct: bool,
}

/// `--unit-size SIZE` (`cvol serve`, `cvol trace replay`): a power of two from 4K to
/// 64K, returned in 4 KiB blocks.
pub fn parse_unit_size(v: &str) -> Result<u32, Error> {
    let unit = crate::size::parse_size(v).map_err(|e| Error::Usage(format!("--unit-size: {e}")))?;
    if !(4096..=65536).contains(&unit) || !unit.is_power_of_two() {
        return Err(Error::Usage(format!(
            "--unit-size {v} must be a power of two from 4K to 64K"
        )));
    }
    Ok((unit / 4096) as u32)
}

/// Requests in flight, for FLUSH's barrier.
struct InFlight {
    n: Mutex<usize>,
    zero: std::sync::Condvar,
}

impl InFlight {
    fn add(&self) {
        *self.n.lock().unwrap_or_else(|e| e.into_inner()) += 1;
    }
    fn done(&self) {
        let mut n = self.n.lock().unwrap_or_else(|e| e.into_inner());
        *n -= 1;
        if *n == 0 {
            self.zero.notify_all();
        }
    }
    fn wait_idle(&self) {
        let mut n = self.n.lock().unwrap_or_else(|e| e.into_inner());
        while *n > 0 {
            n = self.zero.wait(n).unwrap_or_else(|e| e.into_inner());
        }
    }
}

fn execute(
    backend: &dyn Backend,
    r: &TraceRecord,
    n: u64,
    data: DataKind,
) -> Result<(), BackendError> {
    let fua = r.flags & TRACE_FLAG_FUA != 0;
    let length = u64::from(r.length);
    match r.command {
        TraceCommand::Read => {
            let mut buf = vec![0u8; r.length as usize];
            backend.read(r.offset, &mut buf)
        }
        TraceCommand::Write => {
            let mut buf = vec![0u8; r.length as usize];
            data.fill(&mut buf, r.offset, n);
            backend.write(r.offset, &buf, fua)
        }
        TraceCommand::Flush => backend.flush(),
        TraceCommand::Trim => backend.trim(r.offset, length, fua),
        TraceCommand::WriteZeroes => backend.write_zeroes(
            r.offset,
            length,
            WriteZeroesFlags {
                fua,
                no_hole: r.flags & TRACE_FLAG_NO_HOLE != 0,
                fast_zero: false,
            },
        ),
        TraceCommand::BlockStatus => backend.block_status(r.offset, length).map(|_| ()),
        TraceCommand::Cache => backend.cache(r.offset, length),
    }
}

/// Opens `volume` for writing, as `serve` does (it must not be served),
/// with merged compression units of `unit_blocks` blocks.
fn open_for_replay(
    volume: &Path,
    args: &ReplayArgs,
    globals: &Globals,
) -> Result<Arc<Volume>, Error> {
    let purpose = Purpose::Serve { writable: true };
    let mut store = volfile::open_volume_store(volume, purpose)?;
    if args.direct {
        store
            .set_direct()
            .map_err(|e| Error::Refused(format!("{}: --direct: {e}", volume.display())))?;
    }
    let unit_blocks = args.unit_blocks;
    let mut options = crate::keyfile::open_options();
    options.elastic.unit_blocks = unit_blocks;
    let store = volfile::with_metadata(volume, store, purpose, globals, &mut options)?;
    match volfile::open_with_progress(volume, store, options, None) {
        Opened::Volume(v) => Ok(Arc::new(*v)),
        Opened::Failed(e) => Err(e),
        Opened::Stopped => Err(Error::Refused("stopped while opening".into())),
    }
}

/// `cvol trace replay FILE VOLUME`: every request of the trace, in its
/// order, `queue_depth` at a time; a FLUSH waits for everything before it
/// (as a client's FLUSH covers what completed). Prints what it did and
/// the volume's space figures after a final flush.
pub fn cmd_replay(
    trace_path: &Path,
    volume: &Path,
    args: &ReplayArgs,
    globals: &Globals,
) -> Result<ExitCode, Error> {
    let trace = read_trace(trace_path)?;
    let vol = open_for_replay(volume, args, globals)?;
    // Replayed into the pool's volume `default` (a volume file made before
    // pools: the volume itself).
    let pool = cvol_engine::pool::Pool::attach(vol.clone())
        .map_err(|e| Error::Refused(format!("{}: {e}", volume.display())))?;
    let Some(view) = pool.volume("") else {
        let _ = vol.close();
        return Err(Error::Refused(format!(
            "{}: the pool has no volume 'default' to replay into",
            volume.display()
        )));
    };
    if trace.header.volume_bytes > view.size_bytes() {
        let size = view.size_bytes();
        let _ = vol.close();
        return Err(Error::Refused(format!(
            "{}: the trace is of a {}-byte volume and {} is {size} bytes; create one at least as large",
            trace_path.display(),
            trace.header.volume_bytes,
            volume.display()
        )));
    }
    let cleaner = vol.start_background_cleaner();
    let checkpointer = vol.start_background_checkpointer();
    let backend: Arc<dyn Backend> = Arc::new(ViewBackend {
        guard: view.open_guard(),
    });
    let results = replay_records(&trace.records, &backend, args);
    let flushed = backend.flush();
    let elapsed = results.elapsed;
    drop(checkpointer);
    drop(cleaner);
    let stats = vol.stats();
    let closed = vol
        .close()
        .map_err(|e| Error::Refused(format!("closing {}: {e}", volume.display())));
    report(&results, elapsed, &stats, args.json)?;
    flushed.map_err(|e| Error::Refused(format!("the final flush failed: {e:?}")))?;
    closed?;
    Ok(if results.errors > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// What a replay did.
struct Replayed {
    by_command: Vec<(TraceCommand, Totals)>,
    errors: u64,
    /// Failed requests by what they failed with (ENOSPC, EIO...).
    errors_by_result: std::collections::BTreeMap<&'static str, u64>,
    elapsed: Duration,
}

fn replay_records(
    records: &[TraceRecord],
    backend: &Arc<dyn Backend>,
    args: &ReplayArgs,
) -> Replayed {
    let in_flight = Arc::new(InFlight {
        n: Mutex::new(0),
        zero: std::sync::Condvar::new(),
    });
    let done: Arc<Mutex<Vec<TraceRecord>>> =
        Arc::new(Mutex::new(Vec::with_capacity(records.len())));
    let (tx, rx) = bounded::<(u64, TraceRecord)>(args.queue_depth);
    let started = Instant::now();
    let workers: Vec<_> = (0..args.queue_depth.max(1))
        .map(|_| {
            let (rx, backend, in_flight, done, data) = (
                rx.clone(),
                backend.clone(),
                in_flight.clone(),
                done.clone(),
                args.data,
            );
            std::thread::spawn(move || {
                for (n, r) in rx {
                    let t0 = Instant::now();
                    let result = execute(&*backend, &r, n, data);
                    let mut out = r;
                    out.duration_ns = u32::try_from(t0.elapsed().as_nanos()).unwrap_or(u32::MAX);
                    out.result = result.err().map_or(0, result_code);
                    done.lock().unwrap_or_else(|e| e.into_inner()).push(out);
                    in_flight.done();
                }
            })
        })
        .collect();
    for (n, r) in records.iter().enumerate() {
        if args.recorded_pace {
            let at = Duration::from_nanos(r.start_ns);
            if let Some(wait) = at.checked_sub(started.elapsed()) {
                std::thread::sleep(wait);
            }
        }
        if r.command == TraceCommand::Flush {
            in_flight.wait_idle();
        }
        in_flight.add();
        if tx.send((n as u64, *r)).is_err() {
            in_flight.done();
            break;
        }
        if r.command == TraceCommand::Flush {
            in_flight.wait_idle();
        }
    }
    drop(tx);
    for w in workers {
        let _ = w.join();
    }
    let elapsed = started.elapsed();
    let done = done.lock().unwrap_or_else(|e| e.into_inner());
    let by_command = totals(&done);
    let errors = by_command.iter().map(|(_, t)| t.errors).sum();
    let mut errors_by_result = std::collections::BTreeMap::new();
    for r in done.iter().filter(|r| r.result != 0) {
        *errors_by_result.entry(result_name(r.result)).or_insert(0) += 1;
    }
    Replayed {
        by_command,
        errors,
        errors_by_result,
        elapsed,
    }
}

fn report(
    r: &Replayed,
    elapsed: Duration,
    stats: &cvol_engine::VolumeStats,
    json: bool,
) -> Result<(), Error> {
    let secs = elapsed.as_secs_f64().max(1e-9);
    let requests: u64 = r.by_command.iter().map(|(_, t)| t.requests).sum();
    let bytes: u64 = r
        .by_command
        .iter()
        .filter(|(c, _)| matches!(c, TraceCommand::Read | TraceCommand::Write))
        .map(|(_, t)| t.bytes)
        .sum();
    let space = volume_json(stats);
    if json {
        let by_command = totals_json(&r.by_command);
        let v = serde_json::json!({
            "requests": requests, "errors": r.errors,
            "errors_by_result": r.errors_by_result, "seconds": secs,
            "requests_per_second": requests as f64 / secs,
            "bytes_per_second": bytes as f64 / secs,
            "by_command": by_command, "volume": space,
        });
        println!("{v}");
        return Ok(());
    }
    println!(
        "replayed {requests} requests in {secs:.2} s: {:.0} requests/s, {:.1} MiB/s read+written, {} errors",
        requests as f64 / secs,
        bytes as f64 / secs / 1048576.0,
        r.errors
    );
    if !r.errors_by_result.is_empty() {
        let kinds: Vec<String> = r
            .errors_by_result
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        println!("  errors: {}", kinds.join(", "));
    }
    for line in totals_lines(&r.by_command) {
        println!("{line}");
    }
    for line in volume_lines(stats) {
        println!("{line}");
    }
    Ok(())
}

/// The volume's figures after a replay (`replay --json`'s "volume"),
/// named as `cvol stat --json` names them. Counts are since the replay
/// opened the volume.
fn volume_json(s: &cvol_engine::VolumeStats) -> serde_json::Value {
    let (c, e) = (&s.cleaner, &s.elastic);
    serde_json::json!({
        "physical_size_bytes": s.physical_size_bytes,
        "mapped_bytes": s.mapped_bytes,
        "stored_bytes": s.stored_bytes,
        "physical_used_bytes": s.physical_used_bytes,
        "host_allocated_bytes": s.host_allocated_bytes,
        "live_bytes": s.live_bytes,
        "dead_bytes": s.dead_bytes,
        "reduction_ratio": s.reduction_ratio,
        "compression_ratio": s.compression_ratio,
        "unit_blocks": e.unit_blocks,
        "deferred_blocks": e.deferred_blocks,
        "probe_raw_blocks": e.probe_raw_blocks,
        "client_bytes_written": s.client_bytes_written,
        "media_bytes_written": s.media_bytes_written,
        "write_amplification": s.write_amplification,
        "pages_written_per_block": s.pages_written_per_block,
        "padding_bytes": s.padding_bytes,
        "client_reads": e.client_reads,
        "store_pages_read": e.store_pages_read,
        "pages_read_per_read": e.pages_read_per_read,
        "read_amplification": e.read_amplification,
        "map_bytes_per_mapped_block": s.map_bytes_per_mapped_block,
        "cleaner_segments_cleaned": c.cleaner_segments_cleaned,
        "cleaner_records_relocated": c.cleaner_records_relocated,
        "cleaner_bytes_relocated": c.cleaner_bytes_relocated,
        "segments_reclaimed": c.segments_reclaimed,
    })
}

/// The text report's lines about the volume.
fn volume_lines(s: &cvol_engine::VolumeStats) -> Vec<String> {
    let (c, e) = (&s.cleaner, &s.elastic);
    let padding_percent = if s.physical_used_bytes > 0 {
        100.0 * s.padding_bytes as f64 / s.physical_used_bytes as f64
    } else {
        0.0
    };
    vec![
        format!(
            "volume: stored {} bytes, physical used {} bytes, reduction {:.2}:1, write amplification {:.2}",
            s.stored_bytes, s.physical_used_bytes, s.reduction_ratio, s.write_amplification
        ),
        format!(
            "  written: {} client bytes, {} media bytes, {:.3} pages per block, padding {} bytes ({padding_percent:.2}% of physical used)",
            s.client_bytes_written, s.media_bytes_written, s.pages_written_per_block, s.padding_bytes
        ),
        format!(
            "  read: {} client reads, {} store pages, {:.3} pages per read, read amplification {:.2}",
            e.client_reads, e.store_pages_read, e.pages_read_per_read, e.read_amplification
        ),
        format!(
            "  map {:.2} bytes per mapped block; units of {} blocks ({} blocks stored raw by the probe, {} deferred); cleaner: {} segments cleaned, {} records ({} bytes) relocated, {} segments reclaimed",
            s.map_bytes_per_mapped_block,
            e.unit_blocks,
            e.probe_raw_blocks,
            e.deferred_blocks,
            c.cleaner_segments_cleaned,
            c.cleaner_records_relocated,
            c.cleaner_bytes_relocated,
            c.segments_reclaimed
        ),
    ]
}

#[cfg(test)]
mod tests;
