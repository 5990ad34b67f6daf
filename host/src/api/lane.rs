//! The tokenization lane: CPU work before admission, shared fairly among
//! tenants.
//!
//! Tokenizing a prompt costs CPU before any queue limit applies, and on a CPU
//! host that CPU is the engine's too. So it does not run on an unbounded
//! blocking pool, one thread per request: a fixed set of threads takes jobs from
//! per-tenant queues, tenants in turn.
//!
//! 1. [`Lane::run`] queues a job under its tenant and awaits its result.
//! 2. A worker takes the tenant at the front of the turn order, runs that
//!    tenant's oldest job, and sends the tenant to the back of the order if it
//!    has more. A tenant's job therefore waits for at most one job of each other
//!    tenant ahead of it, however many that tenant queued.
//! 3. Each queue is bounded by its tenant's `pending_max` (a request holds one
//!    of its tenant's permits while its job is queued), so the lane holds at
//!    most Σ `pending_max` jobs.
//! 4. A job that panics fails only its own request; the worker lives on, and
//!    the panic's message (which may quote the request's text) is not logged.
//! 5. Dropping the lane stops its workers after the jobs in hand; queued jobs
//!    are dropped and their callers get [`LaneStopped`].

use crate::tenancy::TenantId;
use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use tokio::sync::oneshot;

/// Most lane threads, whatever the policy says.
pub const LANE_THREADS_MAX: usize = 64;

/// The lane stopped, or the job panicked, before the job's result came back.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("the tokenization lane did not finish the job")]
pub struct LaneStopped;

type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct State {
    queues: HashMap<TenantId, VecDeque<Job>>,
    /// Tenants with queued jobs, in the order they get their next turn.
    turn: VecDeque<TenantId>,
    stopping: bool,
}

struct Shared {
    state: Mutex<State>,
    ready: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Jobs run outside the lock, so a poisoned lock means a bug in this
        // file; the state is still consistent at every unlock.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A fixed pool of threads running jobs in per-tenant turns.
pub struct Lane {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Lane {
    /// Starts `threads_count` workers (at least one, at most [`LANE_THREADS_MAX`]).
    pub fn new(threads_count: usize) -> std::io::Result<Lane> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            ready: Condvar::new(),
        });
        let threads = (0..threads_count.clamp(1, LANE_THREADS_MAX))
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("bulkhead-lane-{i}"))
                    .spawn(move || work(&shared))
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Lane { shared, threads })
    }

    /// Runs `job` in `tenant`'s turn and returns its result. The job runs in
    /// the caller's tracing span (a request's, with its id).
    pub async fn run<T: Send + 'static>(
        &self,
        tenant: TenantId,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, LaneStopped> {
        let (reply, result) = oneshot::channel();
        let span = tracing::Span::current();
        let job: Job = Box::new(move || {
            let _entered = span.enter();
            let _ = reply.send(job());
        });
        {
            let mut state = self.shared.lock();
            if state.stopping {
                return Err(LaneStopped);
            }
            let queue = state.queues.entry(tenant).or_default();
            queue.push_back(job);
            if queue.len() == 1 {
                state.turn.push_back(tenant);
            }
        }
        self.shared.ready.notify_one();
        result.await.map_err(|_| LaneStopped)
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        self.shared.lock().stopping = true;
        self.shared.ready.notify_all();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// A worker: the next tenant's oldest job, until the lane stops.
fn work(shared: &Shared) {
    loop {
        let job = {
            let mut state = shared.lock();
            loop {
                if state.stopping {
                    // Queued jobs drop here: their callers see LaneStopped.
                    state.queues.clear();
                    state.turn.clear();
                    return;
                }
                if let Some(tenant) = state.turn.pop_front() {
                    let queue = state
                        .queues
                        .get_mut(&tenant)
                        .expect("a tenant in the turn order has a queue");
                    let job = queue.pop_front().expect("its queue is not empty");
                    if queue.is_empty() {
                        state.queues.remove(&tenant);
                    } else {
                        state.turn.push_back(tenant);
                    }
                    break job;
                }
                state = shared.ready.wait(state).unwrap_or_else(|p| p.into_inner());
            }
        };
        // A panic drops the job's reply sender: its caller sees LaneStopped.
        // The payload is dropped unread (it may quote request text).
        if std::panic::catch_unwind(AssertUnwindSafe(job)).is_err() {
            tracing::error!("a tokenization job panicked; its request fails");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn tenants_take_turns_however_many_jobs_one_queued() {
        let lane = Arc::new(Lane::new(1).unwrap());
        let order = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new(AtomicBool::new(false));
        runtime().block_on(async {
            // Hold the one worker so that every job below queues first.
            let held = {
                let gate = Arc::clone(&gate);
                let lane = Arc::clone(&lane);
                tokio::spawn(async move {
                    lane.run(TenantId(9), move || {
                        while !gate.load(Ordering::SeqCst) {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    })
                    .await
                })
            };
            tokio::time::sleep(Duration::from_millis(50)).await;
            let mut jobs = Vec::new();
            for (tenant, n) in [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1)] {
                let order = Arc::clone(&order);
                let lane = Arc::clone(&lane);
                jobs.push(tokio::spawn(async move {
                    lane.run(TenantId(tenant), move || {
                        order.lock().unwrap().push((tenant, n))
                    })
                    .await
                }));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            gate.store(true, Ordering::SeqCst);
            held.await.unwrap().unwrap();
            for job in jobs {
                job.await.unwrap().unwrap();
            }
        });
        // Tenant 2 queued behind four jobs of tenant 1, yet runs second.
        assert_eq!(
            *order.lock().unwrap(),
            vec![(1, 0), (2, 0), (1, 1), (2, 1), (1, 2), (1, 3)]
        );
    }

    #[test]
    fn a_panicking_job_fails_only_its_caller_and_the_worker_lives_on() {
        let lane = Lane::new(1).unwrap();
        runtime().block_on(async {
            let failed = lane
                .run(TenantId(1), || -> u32 { panic!("secret prompt text") })
                .await;
            assert_eq!(failed, Err(LaneStopped));
            assert_eq!(lane.run(TenantId(2), || 7).await, Ok(7));
        });
    }
}
