//! A fixed pool of compute threads for the forward pass.
//!
//! One decode step runs a few hundred short parallel regions (every matrix
//! product of every layer), so the cost of starting a region matters more than
//! anything a general-purpose pool optimises for. This pool:
//!
//! 1. starts `threads_count - 1` workers once; the calling thread is the last worker;
//! 2. publishes a job by writing it, opening it and bumping an epoch counter;
//! 3. lets workers spin briefly on the epoch, then sleep on a condvar;
//! 4. hands out task indices with one atomic counter, so uneven tasks balance,
//!    and counts *finished tasks*: the caller never waits for a worker that has
//!    not started (on a loaded machine a worker may not get a core for
//!    milliseconds; the caller then runs every task itself);
//! 5. closes the job when every task is done, then waits until no worker is
//!    inside it: a worker enters (counted in `active`) before it looks at the
//!    job and touches it only while it is open. That is what makes lending the
//!    job's borrowed closure to the workers sound.
//!
//! A panic inside a task (a failed ownership assertion, say) is caught, the
//! task counts as finished, and the panic is re-raised on the calling thread
//! after the region ends.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Most threads a pool may have.
pub const THREADS_MAX: usize = 256;
/// Spins on the epoch before a worker goes to sleep (~tens of microseconds).
const SPINS_BEFORE_SLEEP: u32 = 20_000;

/// A task body: `(task_index, worker_index)`. `worker_index < threads_count()`.
pub type Task<'a> = dyn Fn(usize, usize) + Sync + 'a;

struct Job {
    /// Lifetime erased; valid until `run` returns (see module doc, point 5).
    task: *const Task<'static>,
    tasks_count: usize,
}

struct Inner {
    epoch: AtomicU64,
    job: UnsafeCell<Job>,
    /// The job may be worked on (point 5 of the module doc).
    open: AtomicBool,
    /// Workers inside the current job.
    active: AtomicUsize,
    next_task: AtomicUsize,
    tasks_done: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the thread inside `run` while the job is closed
// and no worker is active in it, and read by workers only while they are counted in
// `active` and have seen the job open (all SeqCst).
unsafe impl Sync for Inner {}
// SAFETY: as above; the raw task pointer is only dereferenced under that protocol.
unsafe impl Send for Inner {}

/// A fixed set of compute threads.
pub struct Threads {
    inner: Arc<Inner>,
    workers: Vec<JoinHandle<()>>,
    /// Serialises callers: one region at a time.
    running: Mutex<()>,
}

impl Threads {
    /// Starts a pool of `threads_count` threads (the caller counts as one).
    pub fn new(threads_count: usize) -> Threads {
        let threads_count = threads_count.clamp(1, THREADS_MAX);
        let inner = Arc::new(Inner {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(Job {
                task: &noop as &Task<'static> as *const Task<'static>,
                tasks_count: 0,
            }),
            open: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            next_task: AtomicUsize::new(0),
            tasks_done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..threads_count)
            .map(|worker| {
                let inner = Arc::clone(&inner);
                std::thread::Builder::new()
                    .name(format!("bulkhead-compute-{worker}"))
                    .spawn(move || worker_loop(&inner, worker))
                    .expect("spawning a compute thread at startup")
            })
            .collect();
        Threads {
            inner,
            workers,
            running: Mutex::new(()),
        }
    }

    /// Number of threads, the caller included.
    pub fn threads_count(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `task(i, worker)` for every `i in 0..tasks_count`, spread over the pool,
    /// and returns when all have finished.
    pub fn run(&self, tasks_count: usize, task: &Task<'_>) {
        if self.workers.is_empty() || tasks_count <= 1 {
            (0..tasks_count).for_each(|i| task(i, 0));
            return;
        }
        let _guard = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let inner = &*self.inner;
        // SAFETY: the job is closed and no worker is active in it (the previous
        // `run` waited for both), so nobody reads `job` now. The erased lifetime is
        // upheld by closing the job and waiting for `active == 0` before returning.
        unsafe {
            let erased: *const Task<'static> = std::mem::transmute(task as *const Task<'_>);
            *inner.job.get() = Job {
                task: erased,
                tasks_count,
            };
        }
        inner.next_task.store(0, Ordering::SeqCst);
        inner.tasks_done.store(0, Ordering::SeqCst);
        inner.open.store(true, Ordering::SeqCst);
        inner.epoch.fetch_add(1, Ordering::SeqCst);
        if inner.sleepers.load(Ordering::SeqCst) > 0 {
            let _lock = inner.lock.lock().unwrap_or_else(|e| e.into_inner());
            inner.wake.notify_all();
        }
        claim_tasks(inner, task, tasks_count, 0);
        wait_until(|| inner.tasks_done.load(Ordering::SeqCst) == tasks_count);
        inner.open.store(false, Ordering::SeqCst);
        wait_until(|| inner.active.load(Ordering::SeqCst) == 0);
        if inner.panicked.swap(false, Ordering::SeqCst) {
            panic!("a compute task panicked");
        }
    }
}

/// Spins on `done`, then yields the core, until it holds.
fn wait_until(done: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !done() {
        spins += 1;
        if spins < SPINS_BEFORE_SLEEP {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

fn noop(_: usize, _: usize) {}

fn claim_tasks(inner: &Inner, task: &Task<'_>, tasks_count: usize, worker: usize) {
    loop {
        let i = inner.next_task.fetch_add(1, Ordering::SeqCst);
        if i >= tasks_count {
            return;
        }
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| task(i, worker)));
        if result.is_err() {
            inner.panicked.store(true, Ordering::SeqCst);
        }
        inner.tasks_done.fetch_add(1, Ordering::SeqCst);
    }
}

fn worker_loop(inner: &Inner, worker: usize) {
    let mut seen = 0u64;
    loop {
        seen = wait_for_epoch(inner, seen);
        if inner.shutdown.load(Ordering::SeqCst) {
            return;
        }
        inner.active.fetch_add(1, Ordering::SeqCst);
        if inner.open.load(Ordering::SeqCst) {
            // SAFETY: counted in `active` and the job is open, so `run` has
            // finished writing it and will not return (ending the closure's
            // lifetime) or rewrite it until this worker leaves `active`.
            let (task, tasks_count) = unsafe {
                let job = &*inner.job.get();
                (&*job.task, job.tasks_count)
            };
            claim_tasks(inner, task, tasks_count, worker);
        }
        inner.active.fetch_sub(1, Ordering::SeqCst);
    }
}

fn wait_for_epoch(inner: &Inner, seen: u64) -> u64 {
    for _ in 0..SPINS_BEFORE_SLEEP {
        let epoch = inner.epoch.load(Ordering::Acquire);
        if epoch != seen {
            return epoch;
        }
        std::hint::spin_loop();
    }
    let mut lock = inner.lock.lock().unwrap_or_else(|e| e.into_inner());
    inner.sleepers.fetch_add(1, Ordering::SeqCst);
    loop {
        let epoch = inner.epoch.load(Ordering::SeqCst);
        if epoch != seen {
            inner.sleepers.fetch_sub(1, Ordering::SeqCst);
            return epoch;
        }
        lock = inner.wake.wait(lock).unwrap_or_else(|e| e.into_inner());
    }
}

impl Drop for Threads {
    fn drop(&mut self) {
        self.inner.shutdown.store(true, Ordering::SeqCst);
        self.inner.epoch.fetch_add(1, Ordering::SeqCst);
        {
            let _lock = self.inner.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.inner.wake.notify_all();
        }
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_every_task_exactly_once() {
        let threads = Threads::new(3);
        for tasks_count in [0, 1, 2, 7, 1000] {
            let hits: Vec<AtomicUsize> = (0..tasks_count).map(|_| AtomicUsize::new(0)).collect();
            threads.run(tasks_count, &|i, worker| {
                assert!(worker < 3);
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn reraises_a_worker_panic_and_keeps_working() {
        let threads = Threads::new(2);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            threads.run(64, &|i, _| assert!(i != 40, "planted"));
        }));
        assert!(result.is_err());
        let count = AtomicUsize::new(0);
        threads.run(10, &|_, _| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 10);
    }

    #[test]
    fn wakes_sleeping_workers() {
        let threads = Threads::new(2);
        std::thread::sleep(std::time::Duration::from_millis(50));
        let count = AtomicUsize::new(0);
        threads.run(100, &|_, _| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 100);
    }
}
