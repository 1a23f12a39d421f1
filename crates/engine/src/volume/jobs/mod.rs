//! Background work on a volume: the cleaner, background recompression and
//! the dedup index warm-up (each a thread behind one `Worker` handle type),
//! the checkpointer (a thread woken by flushes), and scrub. The first three
//! share the view of client activity (`Activity`): each yields while
//! clients are busy.
pub(in crate::volume) mod checkpointer;
pub(in crate::volume) mod cleaner;
mod holders;
mod metaclean;
pub(in crate::volume) mod recompress;
mod relocate;
pub(in crate::volume) mod scrub;
pub(in crate::volume) mod warmup;

use super::Volume;
use crate::clock::Clock;
use crate::policy::{InlineBudget, LoadMonitor};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

/// A client request this recent makes background work pause.
const CLIENT_BUSY_MS: u64 = 20;
/// Nice value of the background threads (checkpointer, cleaner,
/// recompression, index warm-up, scrub), above the request threads' 0: on
/// a machine whose cores the clients keep busy, a checkpoint encoding
/// every dirty map page (a second of CPU at 128 GiB mapped) otherwise
/// takes a core from the requests in one burst, and every request in
/// flight waits for it (write latency max 70-90 ms there, 40 ms on a fresh
/// volume). At 5 such a thread still gets about a quarter of a core's
/// share under full load, and all of it when the clients leave any.
const BACKGROUND_NICE: i32 = 5;

/// Lowers the calling thread's scheduling priority to `BACKGROUND_NICE`
/// (best effort: where the call fails, the thread runs at the default).
pub(in crate::volume) fn background_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid and setpriority take and return plain integers
        // and touch no memory of ours; on Linux, PRIO_PROCESS with a
        // thread id sets that thread's nice value only.
        let r = unsafe {
            let tid = libc::gettid();
            libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, BACKGROUND_NICE)
        };
        if r != 0 {
            tracing::debug!(
                "background thread priority unchanged: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// What a background step asks for next.
pub(in crate::volume) enum Next {
    /// Run again after this pause.
    After(Duration),
    /// The work is done: the thread ends.
    Stop,
}

/// Handle of a background thread working on a volume. The thread holds only
/// a weak reference to the volume between steps (so it never keeps a
/// closed volume alive) and stops when the handle drops.
pub struct Worker {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Worker {
    /// Starts thread `name`: after `first` it runs `step` on the volume,
    /// then again after the pause each step asks for, until the handle
    /// drops, the volume is gone or a step says `Stop`.
    pub(in crate::volume) fn spawn(
        name: &str,
        vol: &Arc<Volume>,
        first: Duration,
        mut step: impl FnMut(&Volume) -> Next + Send + 'static,
    ) -> Worker {
        let stop = Arc::new(AtomicBool::new(false));
        let (weak, flag): (Weak<Volume>, _) = (Arc::downgrade(vol), stop.clone());
        let handle = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                background_priority();
                let mut pause = first;
                while !flag.load(Ordering::SeqCst) {
                    std::thread::sleep(pause);
                    let Some(v) = weak.upgrade() else { return };
                    if flag.load(Ordering::SeqCst) {
                        return;
                    }
                    match step(&v) {
                        Next::After(d) => pause = d,
                        Next::Stop => return,
                    }
                }
            })
            .unwrap_or_else(|e| panic!("cannot spawn the {name} thread: {e}"));
        Worker {
            stop,
            handle: Some(handle),
        }
    }

    /// A handle with no thread (work that does not apply to this volume).
    pub(in crate::volume) fn none() -> Worker {
        Worker {
            stop: Arc::new(AtomicBool::new(true)),
            handle: None,
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            // A worker that panicked has poisoned what it held; nothing to add.
            let _ = h.join();
        }
    }
}

/// What the clients are doing, as background work and the codec policy see it.
pub(in crate::volume) struct Activity {
    /// I/O intensity for the auto codec policy.
    pub(in crate::volume) load: LoadMonitor,
    clock: Arc<dyn Clock>,
    /// `clock` at the open, ns.
    opened_ns: u64,
    /// Milliseconds since `opened` of the last client request.
    last_client_io_ms: AtomicU64,
    /// Writers waiting for the cleaner to make room (the cleaner stops yielding).
    pub(in crate::volume) space_waiters: AtomicUsize,
    /// The CPU share inline compression may use while busy (policy auto).
    pub(in crate::volume) inline_budget: InlineBudget,
    /// Enough free segments to defer compression (written at each write's
    /// commit: at least the cleaner's stop threshold free).
    pub(in crate::volume) defer_room: AtomicBool,
}

impl Activity {
    /// `inline_cpu_percent`: the budget of inline compression (None:
    /// always compress inline); `cpu`: the machine's CPU gauge, if any.
    pub(in crate::volume) fn new(
        inline_cpu_percent: Option<u32>,
        clock: &Arc<dyn Clock>,
        cpu: Option<Arc<dyn crate::cpu::CpuGauge>>,
    ) -> Activity {
        let cores = crate::memory::cores();
        Activity {
            load: LoadMonitor::new(clock.clone()).with_cpu(cpu),
            clock: clock.clone(),
            opened_ns: clock.now_ns(),
            last_client_io_ms: AtomicU64::new(0),
            space_waiters: AtomicUsize::new(0),
            inline_budget: InlineBudget::new(cores, inline_cpu_percent, clock.clone()),
            defer_room: AtomicBool::new(false),
        }
    }

    fn now_ms(&self) -> u64 {
        self.clock.now_ns().saturating_sub(self.opened_ns) / 1_000_000
    }

    pub(in crate::volume) fn note_client_io(&self) {
        self.last_client_io_ms
            .store(self.now_ms(), Ordering::Relaxed);
    }

    /// Milliseconds since the last client request, 0 while one is in
    /// flight. A request that waits inside the engine (for the cleaner to
    /// make room, say) is a busy client, however long ago it arrived:
    /// counted from its arrival alone, 32 writers all waiting for the
    /// cleaner lock made the volume look idle, background recompression
    /// started a pass over the whole volume holding that lock, and the
    /// writers waited the 30 s it took.
    pub(in crate::volume) fn idle_ms(&self) -> u64 {
        if self.load.inflight() > 0 {
            return 0;
        }
        self.now_ms()
            .saturating_sub(self.last_client_io_ms.load(Ordering::Relaxed))
    }

    /// Is a client request in flight, or did one arrive in the last
    /// `CLIENT_BUSY_MS`?
    pub(in crate::volume) fn clients_busy(&self) -> bool {
        self.idle_ms() < CLIENT_BUSY_MS
    }

    /// Is a writer waiting for the cleaner to make room?
    pub(in crate::volume) fn space_wanted(&self) -> bool {
        self.space_waiters.load(Ordering::SeqCst) > 0
    }
}

/// Per-volume state of the jobs that is not a thread: where background
/// recompression resumes, the scrub's run state and counters.
#[derive(Default)]
pub(in crate::volume) struct JobsState {
    /// Next window the background recompressor scans.
    pub(in crate::volume) recompress_cursor: AtomicU64,
    /// Background recompression may still have work: idle cleaning waits
    /// for it (cleaning first would move data about to be rewritten).
    pub(in crate::volume) recompress_pending: AtomicBool,
    pub(in crate::volume) scrub: scrub::ScrubState,
    /// Where flushes hand due checkpoints to the background checkpointer.
    pub(in crate::volume) checkpointer: checkpointer::CheckpointerSlot,
    /// The open data segment's (segment, fill) when its tail was last
    /// given back to the host (`Volume::punch_head_tail`).
    pub(in crate::volume) tail_punched: std::sync::Mutex<Option<(u64, usize)>>,
}
