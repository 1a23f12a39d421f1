//! The worker pool's queues: a read lane and a write lane that the workers
//! share, and a FLUSH lane of its own for the flushers.
//!
//! One mutex guards the three lanes; workers and flushers wait on a
//! condition variable each, and readers whose lane is full on a third. A
//! thread with nothing to do blocks at once. (The pool first used
//! crossbeam channels, whose receivers spin and then call `sched_yield`
//! several times before they block: under pgbench on a 2-core machine,
//! where the database and the NBD client want every cycle, that was 5,800
//! yields a second, and a third more context switches than qemu-nbd.)

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};

use super::lock;

/// A unit of work for the worker pool.
pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

/// Which queue a job goes to: workers take read work first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lane {
    /// READ and BLOCK_STATUS: a client waits on them and they are cheap.
    Read,
    /// WRITE, TRIM, WRITE_ZEROES: compression and log work.
    Write,
    /// FLUSH: threads of their own (`flusher_loop`). Flushes wait for one
    /// another (a backend syncs one at a time); on the write lane, a
    /// client that queued a FLUSH in every free slot (fio with `fsync=N`
    /// does) parked every worker on the first one's sync, and every other
    /// connection's writes waited that long (55 ms at 128 GiB mapped). As
    /// many flushers as workers: flushes waiting together are covered by
    /// one sync (the backend's group commit), not one sync each.
    Flush,
}

/// Reads a worker takes in a row while write work waits, so that a flood of
/// reads delays writes but never starves them.
pub(crate) const READS_IN_A_ROW_MAX: u32 = 8;

/// The two pools: workers (read and write lanes) and flushers.
const WORKERS: usize = 0;
const FLUSHERS: usize = 1;

/// The pool that runs a lane's jobs.
fn pool(lane: Lane) -> usize {
    match lane {
        Lane::Read | Lane::Write => WORKERS,
        Lane::Flush => FLUSHERS,
    }
}

#[derive(Default)]
struct Lanes {
    reads: VecDeque<Job>,
    writes: VecDeque<Job>,
    flushes: VecDeque<Job>,
    /// Readers waiting for room in a full lane.
    waiting_for_room: usize,
    /// Threads of each pool waiting for a job: a submit wakes one only if
    /// there is one (a wake is a syscall; busy threads look at the lanes
    /// before they wait).
    idle: [usize; 2],
    /// Set at shutdown, per pool: its threads run what is queued and
    /// return; a job submitted after that runs on the submitter's thread.
    stopped: [bool; 2],
}

impl Lanes {
    fn lane(&mut self, lane: Lane) -> &mut VecDeque<Job> {
        match lane {
            Lane::Read => &mut self.reads,
            Lane::Write => &mut self.writes,
            Lane::Flush => &mut self.flushes,
        }
    }
}

struct Queues {
    lanes: Mutex<Lanes>,
    /// Per pool: a job for it was queued, or it was stopped.
    work: [Condvar; 2],
    /// A job left a lane.
    room: Condvar,
    /// Jobs each lane holds before readers wait.
    capacity: usize,
}

/// Handle used by connections to hand jobs to the worker pool.
#[derive(Clone)]
pub(crate) struct JobQueue {
    q: Arc<Queues>,
}

impl JobQueue {
    /// Lanes of `capacity` jobs each (at least 1).
    pub(crate) fn new(capacity: usize) -> JobQueue {
        JobQueue {
            q: Arc::new(Queues {
                lanes: Mutex::new(Lanes::default()),
                work: [Condvar::new(), Condvar::new()],
                room: Condvar::new(),
                capacity: capacity.max(1),
            }),
        }
    }

    /// Queues a job, blocking while its lane is full. If the pool is gone
    /// (never while connections exist), the job runs on the caller's thread.
    pub(crate) fn submit(&self, lane: Lane, job: Job) {
        let (q, p) = (&self.q, pool(lane));
        let mut lanes = lock(&q.lanes);
        while !lanes.stopped[p] && lanes.lane(lane).len() >= q.capacity {
            lanes.waiting_for_room += 1;
            lanes = q.room.wait(lanes).unwrap_or_else(|e| e.into_inner());
            lanes.waiting_for_room -= 1;
        }
        if lanes.stopped[p] {
            drop(lanes);
            job();
            return;
        }
        lanes.lane(lane).push_back(job);
        let idle = lanes.idle[p];
        drop(lanes);
        if idle > 0 {
            q.work[p].notify_one();
        }
    }

    /// Runs jobs, read lane first (reads are latency-critical, writes are
    /// acknowledged from memory, as in Klonatos et al., *Transparent Online
    /// Storage Compression at the Block-Level*), until the workers are stopped
    /// and nothing is queued on their lanes.
    pub(crate) fn worker_loop(&self) {
        let mut reads_in_a_row = 0u32;
        self.run(WORKERS, |lanes| {
            if reads_in_a_row < READS_IN_A_ROW_MAX {
                if let Some(job) = lanes.reads.pop_front() {
                    reads_in_a_row += 1;
                    return Some(job);
                }
            }
            reads_in_a_row = 0;
            lanes.writes.pop_front().or_else(|| lanes.reads.pop_front())
        });
    }

    /// Runs FLUSH jobs one after another until the flushers are stopped
    /// and none is queued.
    pub(crate) fn flusher_loop(&self) {
        self.run(FLUSHERS, |lanes| lanes.flushes.pop_front());
    }

    /// A pool thread: runs what `next` takes from the lanes, waiting while
    /// it takes nothing, until the pool is stopped and `next` finds nothing.
    fn run(&self, p: usize, mut next: impl FnMut(&mut Lanes) -> Option<Job>) {
        let q = &self.q;
        loop {
            let mut lanes = lock(&q.lanes);
            let job = loop {
                if let Some(job) = next(&mut lanes) {
                    break Some(job);
                }
                if lanes.stopped[p] {
                    break None;
                }
                lanes.idle[p] += 1;
                lanes = q.work[p].wait(lanes).unwrap_or_else(|e| e.into_inner());
                lanes.idle[p] -= 1;
            };
            let room = lanes.waiting_for_room > 0;
            drop(lanes);
            if room {
                q.room.notify_all();
            }
            match job {
                Some(job) => job(),
                None => return,
            }
        }
    }

    /// Lets the workers return once their lanes are empty.
    pub(crate) fn stop_workers(&self) {
        self.stop(WORKERS);
    }

    /// Lets the flushers return once their lane is empty.
    pub(crate) fn stop_flushers(&self) {
        self.stop(FLUSHERS);
    }

    fn stop(&self, p: usize) {
        lock(&self.q.lanes).stopped[p] = true;
        self.q.work[p].notify_all();
        self.q.room.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::sync_channel;
    use std::time::Duration;

    /// Queues `lanes` behind a job that holds the only worker, then lets it
    /// go and returns the order in which the queued jobs ran.
    fn run_order(lanes: &[Lane]) -> Vec<usize> {
        let q = JobQueue::new(64);
        let worker = {
            let q = q.clone();
            std::thread::spawn(move || q.worker_loop())
        };
        let (gate_tx, gate_rx) = sync_channel::<()>(0);
        let (held_tx, held_rx) = sync_channel::<()>(1);
        q.submit(
            Lane::Write,
            Box::new(move || {
                held_tx.send(()).unwrap();
                let _ = gate_rx.recv();
            }),
        );
        held_rx.recv().unwrap(); // the worker is busy: everything below queues
        let order = Arc::new(Mutex::new(Vec::new()));
        for (i, &lane) in lanes.iter().enumerate() {
            let order = Arc::clone(&order);
            q.submit(lane, Box::new(move || lock(&order).push(i)));
        }
        gate_tx.send(()).unwrap();
        q.stop_workers();
        worker.join().unwrap();
        let v = lock(&order).clone();
        v
    }

    #[test]
    fn a_flush_waiting_on_its_sync_holds_no_write_worker() {
        // One worker, one flusher: writes queued behind flushes that block
        // (a backend sync) still run. On the write lane they waited for
        // every flush ahead of them.
        let q = JobQueue::new(64);
        let worker = {
            let q = q.clone();
            std::thread::spawn(move || q.worker_loop())
        };
        let flusher = {
            let q = q.clone();
            std::thread::spawn(move || q.flusher_loop())
        };
        let (gate_tx, gate_rx) = sync_channel::<()>(0);
        q.submit(
            Lane::Flush,
            Box::new(move || {
                let _ = gate_rx.recv();
            }),
        );
        let (done_tx, done_rx) = sync_channel::<()>(1);
        q.submit(Lane::Write, Box::new(move || done_tx.send(()).unwrap()));
        let ran = done_rx.recv_timeout(Duration::from_secs(30));
        gate_tx.send(()).unwrap();
        assert!(ran.is_ok(), "the write waited for the flush");
        q.stop_workers();
        q.stop_flushers();
        worker.join().unwrap();
        flusher.join().unwrap();
    }

    #[test]
    fn queued_reads_run_before_queued_writes() {
        use Lane::{Read, Write};
        assert_eq!(
            run_order(&[Write, Write, Write, Read, Read]),
            vec![3, 4, 0, 1, 2]
        );
    }

    #[test]
    fn a_flood_of_reads_does_not_starve_a_write() {
        let mut lanes = vec![Lane::Write];
        lanes.extend(std::iter::repeat_n(Lane::Read, 30));
        let order = run_order(&lanes);
        let at = order.iter().position(|&i| i == 0).unwrap();
        assert_eq!(at, READS_IN_A_ROW_MAX as usize, "{order:?}");
        assert_eq!(order.len(), 31);
    }

    /// A full lane makes its submitter wait until a worker takes a job
    /// (nothing is dropped or run out of turn), and every job runs once.
    #[test]
    fn a_full_lane_blocks_its_submitter_until_a_job_leaves() {
        let q = JobQueue::new(2);
        let (gate_tx, gate_rx) = sync_channel::<()>(0);
        let (held_tx, held_rx) = sync_channel::<()>(1);
        let worker = {
            let q = q.clone();
            std::thread::spawn(move || q.worker_loop())
        };
        q.submit(
            Lane::Write,
            Box::new(move || {
                held_tx.send(()).unwrap();
                let _ = gate_rx.recv();
            }),
        );
        held_rx.recv().unwrap();
        let ran = Arc::new(Mutex::new(Vec::new()));
        let submitter = {
            let (q, ran) = (q.clone(), Arc::clone(&ran));
            std::thread::spawn(move || {
                for i in 0..5 {
                    let ran = Arc::clone(&ran);
                    q.submit(Lane::Write, Box::new(move || lock(&ran).push(i)));
                }
            })
        };
        // Two fit; the third waits for room while the worker is held.
        while lock(&q.q.lanes).waiting_for_room == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(lock(&q.q.lanes).writes.len(), 2);
        gate_tx.send(()).unwrap();
        submitter.join().unwrap();
        q.stop_workers();
        worker.join().unwrap();
        assert_eq!(*lock(&ran), vec![0, 1, 2, 3, 4]);
    }

    /// Many submitters, small lanes, workers and flushers going idle and
    /// busy all the time: every job runs exactly once and nothing hangs (a
    /// wake skipped while a thread was about to wait would leave a job
    /// queued and its submitter, or the stop, waiting forever).
    #[test]
    fn no_job_is_lost_between_busy_and_idle_threads() {
        use std::sync::atomic::{AtomicU64, Ordering};
        const PER_SUBMITTER: u64 = 20_000;
        let (done_tx, done_rx) = sync_channel(1);
        std::thread::spawn(move || {
            let q = JobQueue::new(4);
            let ran = Arc::new(AtomicU64::new(0));
            let mut threads: Vec<_> = (0..3)
                .map(|_| {
                    let q = q.clone();
                    std::thread::spawn(move || q.worker_loop())
                })
                .collect();
            threads.extend((0..2).map(|_| {
                let q = q.clone();
                std::thread::spawn(move || q.flusher_loop())
            }));
            let submitters: Vec<_> = (0..3u64)
                .map(|t| {
                    let (q, ran) = (q.clone(), Arc::clone(&ran));
                    std::thread::spawn(move || {
                        for i in 0..PER_SUBMITTER {
                            let lane =
                                [Lane::Read, Lane::Write, Lane::Flush][((i + t) % 3) as usize];
                            let ran = Arc::clone(&ran);
                            q.submit(
                                lane,
                                Box::new(move || {
                                    ran.fetch_add(1, Ordering::Relaxed);
                                }),
                            );
                            if i % 1000 == 0 {
                                std::thread::sleep(Duration::from_millis(1)); // let them idle
                            }
                        }
                    })
                })
                .collect();
            for s in submitters {
                s.join().unwrap();
            }
            q.stop_workers();
            q.stop_flushers();
            for t in threads {
                t.join().unwrap();
            }
            done_tx.send(ran.load(Ordering::Relaxed)).unwrap();
        });
        let ran = done_rx
            .recv_timeout(Duration::from_secs(120))
            .expect("the pool hung");
        assert_eq!(ran, 3 * PER_SUBMITTER);
    }

    /// After the pool stopped, a job runs on the submitter's thread.
    #[test]
    fn a_job_after_stop_runs_on_the_caller() {
        let q = JobQueue::new(4);
        q.stop_workers();
        q.stop_flushers();
        let me = std::thread::current().id();
        let (tx, rx) = sync_channel(2);
        for lane in [Lane::Write, Lane::Flush] {
            let tx = tx.clone();
            q.submit(
                lane,
                Box::new(move || tx.send(std::thread::current().id()).unwrap()),
            );
        }
        assert_eq!(rx.recv().unwrap(), me);
        assert_eq!(rx.recv().unwrap(), me);
    }
}
