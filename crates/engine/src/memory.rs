//! The process's memory as the allocator and the kernel see it, and the
//! allocator's settings for a server.
//!
//! glibc's malloc gives each thread that allocates while another holds
//! the main arena an arena of its own (up to 8 per core), and every arena
//! keeps what was freed in it for reuse. A server's threads (connections,
//! NBD workers and flushers, the checkpointer, the cleaner, background
//! recompression) each allocate map pages, records and buffers that
//! another thread frees: measured on a 1 TiB volume with 64 GiB written
//! under `--map-cache 64M --dedup-memory 16M`, RSS grew from 143 to 223
//! MiB over the idle pass after the fill while everything the engine
//! counts stayed at its bound. [`tune_allocator`] caps the arenas, and
//! background jobs give free memory back ([`trim_allocator`]).

/// Arenas a server's allocator may use per core (glibc's `M_ARENA_MAX`;
/// glibc's own default is 8 per core). Two arenas in all cut the idle RSS
/// most, but cost sequential writes 11% and random writes 5% on 2 cores;
/// 2 per core kept them.
pub const SERVER_ARENAS_PER_CORE: usize = 2;

/// The CPUs this process may use, read once (`available_parallelism`
/// reads the cgroup's files each time: about 0.1 ms, a tenth of an
/// open without snapshots).
pub fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Sets the allocator up for a long-running server (call once, before
/// threads start). Does nothing where the allocator is not glibc's; a
/// setting given in glibc's environment variable (`MALLOC_ARENA_MAX`) is
/// left as given. The mmap threshold is left to glibc: fixing it at
/// 256 KiB made every 1 MiB request buffer a fresh mapping, zeroed by the
/// kernel, and halved sequential write throughput.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let cores = cores();
        let arenas = (cores * SERVER_ARENAS_PER_CORE).min(64) as i32;
        if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
            // SAFETY: mallopt takes two integers and changes malloc's
            // parameters; glibc serialises it against allocation.
            unsafe {
                libc::mallopt(libc::M_ARENA_MAX, arenas);
            }
        }
    }
}

/// Least time between two trims: `malloc_trim` walks every free chunk
/// while holding each arena's lock, so a trim after every background
/// pass would slow the passes and stall allocating threads.
const TRIM_INTERVAL: std::time::Duration = std::time::Duration::from_secs(2);

/// Returns the allocator's free memory at the top of its heaps to the
/// system, at most once per `TRIM_INTERVAL` (callers are background
/// jobs). Best effort; does nothing where the allocator is not glibc's.
pub fn trim_allocator() {
    use std::sync::Mutex;
    use std::time::Instant;
    static LAST: Mutex<Option<Instant>> = Mutex::new(None);
    {
        let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|t| t.elapsed() < TRIM_INTERVAL) {
            return;
        }
        *last = Some(Instant::now());
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes an integer and only releases free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// What the allocator holds: bytes in use by the program, and bytes it
/// keeps free for reuse (both 0 where the allocator does not say).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocatorBytes {
    pub in_use: u64,
    pub free: u64,
}

/// The allocator's own counts (glibc's `mallinfo2`, over every arena and
/// the blocks mapped on their own).
pub fn allocator_bytes() -> AllocatorBytes {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 takes no arguments and returns a plain struct.
        let m = unsafe { libc::mallinfo2() };
        AllocatorBytes {
            in_use: (m.uordblks + m.hblkhd) as u64,
            free: m.fordblks as u64,
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    AllocatorBytes::default()
}

/// The process's resident set size in bytes (`/proc/self/statm`), 0 where
/// it cannot be read.
pub fn process_rss_bytes() -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/statm") else {
        return 0;
    };
    let pages: u64 = s
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * page_bytes()
}

fn page_bytes() -> u64 {
    #[cfg(unix)]
    {
        // SAFETY: sysconf takes an integer and reads a system constant.
        let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if n > 0 {
            return n as u64;
        }
    }
    4096
}
