//! Lanes: fixed sets of threads that run CPU work for tenants, tenants in turn.
//!
//! Work a tenant causes before any queue limit applies — parsing its
//! requests (their JSON, their schemas and patterns), tokenizing its
//! prompts, running its plugins, telling its plugins how requests ended —
//! costs CPU that is the engine's too on a CPU host. So it does not run on an
//! unbounded blocking pool, one thread per request: a lane's threads take jobs
//! from per-tenant queues, tenants in turn. The server has two lanes: the
//! request lane (parsing, tokenization, `route`, `admit`) and the completion lane
//! (`on-complete`).
//!
//! 1. [`Lane::run`] queues a job under its tenant and awaits its result;
//!    [`Lane::spawn`] queues one whose result nobody awaits.
//! 2. A worker takes the tenant at the front of the turn order, runs that
//!    tenant's oldest job, and sends the tenant to the back of the order if it
//!    has more. A tenant's job therefore waits for at most one job of each other
//!    tenant ahead of it, however many that tenant queued.
//! 3. Each tenant's queue is bounded: by its `pending_max` permits on the
//!    request lane (a request holds one while its job is queued or running),
//!    and by the lane's `queue_per_tenant_max` (a job past it is refused).
//! 4. Work goes with its request: dropping the future of [`Lane::run`] takes a
//!    queued job out of its queue at once (dropping what it holds, its
//!    request's permit among them), and sets the [`Cancel`] flag a running job
//!    checks at its next step (the plugin chain between plugins, tokenizing
//!    after each word). A job that ran to its end while nobody waited
//!    hands its result to its `unclaimed` hook.
//! 5. A job that panics fails only its own request; the worker lives on, and
//!    the panic's message (which may quote the request's text) is not logged.
//! 6. Dropping the lane stops its workers after the jobs in hand; queued jobs
//!    are dropped and their callers get [`LaneStopped`].
//! 7. Each job is counted for its tenant, with the time it ran:
//!    `bulkhead_lane_jobs_total{lane,tenant_id}` and
//!    `bulkhead_lane_busy_microseconds_total{lane,tenant_id}` (`lane` is
//!    `request` or `completion`), so an operator sees which tenant keeps a
//!    lane busy, and how busy (microseconds a second over the lane's threads).

use crate::tenancy::TenantId;
use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;
use tokio::sync::oneshot;

/// Most threads of a lane, whatever the policy says.
pub const LANE_THREADS_MAX: usize = 64;

/// The lane stopped, or the job panicked, before the job's result came back.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("the lane did not finish the job")]
pub struct LaneStopped;

/// A job was refused: its tenant's queue on this lane is full (or the lane stopped).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("the tenant's queue on the lane is full")]
pub struct LaneFull;

/// Set once nobody waits for a job any more: a running job checks it between
/// its steps and stops early.
#[derive(Clone, Debug, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    /// Whether the job's caller is gone.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

type Job = Box<dyn FnOnce() + Send>;

struct Queued {
    /// Unique within the lane: how a dropped caller finds its job.
    serial: u64,
    job: Job,
}

#[derive(Default)]
struct State {
    queues: HashMap<TenantId, VecDeque<Queued>>,
    /// Tenants with queued jobs, in the order they get their next turn.
    turn: VecDeque<TenantId>,
    serial_next: u64,
    stopping: bool,
}

impl State {
    /// Takes the job `serial` of `tenant` out of its queue, if still there.
    fn withdraw(&mut self, tenant: TenantId, serial: u64) -> Option<Queued> {
        let queue = self.queues.get_mut(&tenant)?;
        let at = queue.iter().position(|q| q.serial == serial)?;
        let queued = queue.remove(at);
        if queue.is_empty() {
            self.queues.remove(&tenant);
            self.turn.retain(|&t| t != tenant);
        }
        queued
    }
}

struct Shared {
    state: Mutex<State>,
    ready: Condvar,
    queue_per_tenant_max: usize,
    /// The lane's `lane` label in metrics.
    label: &'static str,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Jobs run (and drop) outside the lock, so a poisoned lock means a bug
        // in this file; the state is still consistent at every unlock.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `job` under `tenant`; its serial.
    fn push(&self, tenant: TenantId, job: Job) -> Result<u64, LaneFull> {
        let serial = {
            let mut state = self.lock();
            let serial = state.serial_next;
            state.serial_next += 1;
            if state.stopping {
                return Err(LaneFull);
            }
            let max = self.queue_per_tenant_max;
            let queue = state.queues.entry(tenant).or_default();
            if queue.len() >= max {
                return Err(LaneFull);
            }
            queue.push_back(Queued { serial, job });
            if queue.len() == 1 {
                state.turn.push_back(tenant);
            }
            serial
        };
        self.ready.notify_one();
        Ok(serial)
    }
}

/// A fixed pool of threads running jobs in per-tenant turns.
pub struct Lane {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

/// A queued job's caller: dropped before the job starts, it withdraws the job;
/// dropped while the job runs, it cancels it.
struct Waiting {
    shared: Arc<Shared>,
    tenant: TenantId,
    serial: u64,
    cancel: Cancel,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.cancel.cancel();
        let withdrawn = self.shared.lock().withdraw(self.tenant, self.serial);
        // Dropped outside the lock: the job may hold a permit, a prompt.
        drop(withdrawn);
    }
}

impl Lane {
    /// Starts `threads_count` workers (at least one, at most
    /// [`LANE_THREADS_MAX`]) named `name-N`, counted in metrics as `label`;
    /// each tenant may have at most `queue_per_tenant_max` jobs queued.
    pub fn new(
        name: &str,
        label: &'static str,
        threads_count: usize,
        queue_per_tenant_max: usize,
    ) -> std::io::Result<Lane> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            ready: Condvar::new(),
            queue_per_tenant_max: queue_per_tenant_max.max(1),
            label,
        });
        let threads = (0..threads_count.clamp(1, LANE_THREADS_MAX))
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("{name}-{i}"))
                    .spawn(move || work(&shared))
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Lane { shared, threads })
    }

    /// Runs `job` in `tenant`'s turn and returns its result. The job runs in
    /// the caller's tracing span (a request's, with its id) and gets the
    /// [`Cancel`] that is set when this future is dropped.
    pub async fn run<T: Send + 'static>(
        &self,
        tenant: TenantId,
        job: impl FnOnce(&Cancel) -> T + Send + 'static,
    ) -> Result<T, LaneStopped> {
        self.run_or(tenant, job, drop).await
    }

    /// [`Lane::run`], and when the job ran to its end after this future was
    /// dropped, its result goes to `unclaimed` (on the lane's thread), so
    /// whatever the result holds can be given back.
    pub async fn run_or<T: Send + 'static>(
        &self,
        tenant: TenantId,
        job: impl FnOnce(&Cancel) -> T + Send + 'static,
        unclaimed: impl FnOnce(T) + Send + 'static,
    ) -> Result<T, LaneStopped> {
        let (reply, result) = oneshot::channel();
        let span = tracing::Span::current();
        let cancel = Cancel::default();
        let job_cancel = cancel.clone();
        let job: Job = Box::new(move || {
            let _entered = span.enter();
            if let Err(value) = reply.send(job(&job_cancel)) {
                unclaimed(value);
            }
        });
        let serial = self.shared.push(tenant, job).map_err(|_| LaneStopped)?;
        let _waiting = Waiting {
            shared: Arc::clone(&self.shared),
            tenant,
            serial,
            cancel,
        };
        result.await.map_err(|_| LaneStopped)
    }

    /// Queues `job` in `tenant`'s turn with nobody awaiting it; refused when
    /// the tenant already has `queue_per_tenant_max` jobs queued here.
    pub fn spawn(
        &self,
        tenant: TenantId,
        job: impl FnOnce() + Send + 'static,
    ) -> Result<(), LaneFull> {
        self.shared.push(tenant, Box::new(job)).map(drop)
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        self.shared.lock().stopping = true;
        self.shared.ready.notify_all();
        // The last owner of a lane can be one of its own jobs (the
        // completion lane's jobs hold the plugin runtime, which owns the
        // lane): that worker is not joined, it returns when its job ends.
        let current = std::thread::current().id();
        for thread in self.threads.drain(..) {
            if thread.thread().id() != current {
                let _ = thread.join();
            }
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
                    let queues = std::mem::take(&mut state.queues);
                    state.turn.clear();
                    drop(state);
                    drop(queues);
                    return;
                }
                if let Some(tenant) = state.turn.pop_front() {
                    let queue = state
                        .queues
                        .get_mut(&tenant)
                        .expect("a tenant in the turn order has a queue");
                    let queued = queue.pop_front().expect("its queue is not empty");
                    if queue.is_empty() {
                        state.queues.remove(&tenant);
                    } else {
                        state.turn.push_back(tenant);
                    }
                    break (tenant, queued.job);
                }
                state = shared.ready.wait(state).unwrap_or_else(|p| p.into_inner());
            }
        };
        let (tenant, job) = job;
        // Counted before it runs (whoever sees its result sees it counted),
        // its time after.
        let labels = [
            ("lane", shared.label.to_string()),
            ("tenant_id", tenant.0.to_string()),
        ];
        metrics::counter!("bulkhead_lane_jobs_total", &labels).increment(1);
        let started = Instant::now();
        // A panic drops the job's reply sender: its caller sees LaneStopped.
        // The payload is dropped unread (it may quote request text).
        if std::panic::catch_unwind(AssertUnwindSafe(job)).is_err() {
            tracing::error!("a lane job panicked; its request fails");
        }
        let busy = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        metrics::counter!("bulkhead_lane_busy_microseconds_total", &labels).increment(busy);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;
    use std::time::Duration;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// Holds the lane's one worker until the returned flag is set.
    fn hold(
        lane: &Arc<Lane>,
    ) -> (
        Arc<AtomicBool>,
        tokio::task::JoinHandle<Result<(), LaneStopped>>,
    ) {
        let gate = Arc::new(AtomicBool::new(false));
        let held = {
            let gate = Arc::clone(&gate);
            let lane = Arc::clone(lane);
            tokio::spawn(async move {
                lane.run(TenantId(9), move |_| {
                    while !gate.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                })
                .await
            })
        };
        (gate, held)
    }

    #[test]
    fn a_lane_whose_last_owner_is_one_of_its_jobs_stops_without_joining_itself() {
        // Seen at the end of `bulkhead bench plugins`: the completion lane's
        // last owner was one of its own jobs, whose worker then tried to
        // join itself ("failed to join thread: Resource deadlock avoided").
        let lane = Arc::new(Lane::new("test-lane", "test", 2, 64).unwrap());
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let (done, finished) = std::sync::mpsc::channel();
        let owner = Arc::clone(&lane);
        lane.spawn(TenantId(1), move || {
            wait.recv().unwrap();
            drop(owner);
            done.send(()).unwrap();
        })
        .unwrap();
        drop(lane);
        go.send(()).unwrap();
        finished
            .recv_timeout(Duration::from_secs(10))
            .expect("the job dropped the lane and went on");
    }

    #[test]
    fn tenants_take_turns_however_many_jobs_one_queued() {
        let lane = Arc::new(Lane::new("test-lane", "test", 1, 64).unwrap());
        let order = Arc::new(Mutex::new(Vec::new()));
        runtime().block_on(async {
            // Hold the one worker so that every job below queues first.
            let (gate, held) = hold(&lane);
            tokio::time::sleep(Duration::from_millis(50)).await;
            let mut jobs = Vec::new();
            for (tenant, n) in [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1)] {
                let order = Arc::clone(&order);
                let lane = Arc::clone(&lane);
                jobs.push(tokio::spawn(async move {
                    lane.run(TenantId(tenant), move |_| {
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
        let lane = Lane::new("test-lane", "test", 1, 64).unwrap();
        runtime().block_on(async {
            let failed = lane
                .run(TenantId(1), |_| -> u32 { panic!("secret prompt text") })
                .await;
            assert_eq!(failed, Err(LaneStopped));
            assert_eq!(lane.run(TenantId(2), |_| 7).await, Ok(7));
        });
    }

    /// Counts its drops: what a queued job holds (a permit, a prompt).
    struct Held(Arc<AtomicU32>);
    impl Drop for Held {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_dropped_caller_takes_its_queued_job_out_and_what_it_holds_with_it() {
        let lane = Arc::new(Lane::new("test-lane", "test", 1, 64).unwrap());
        let (ran, dropped) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        runtime().block_on(async {
            let (gate, held) = hold(&lane);
            tokio::time::sleep(Duration::from_millis(20)).await;
            for _ in 0..3 {
                let (ran, holding) = (Arc::clone(&ran), Held(Arc::clone(&dropped)));
                let waiting = lane.run(TenantId(1), move |_| {
                    let _holding = holding;
                    ran.fetch_add(1, Ordering::SeqCst);
                });
                // Queued, then the caller goes away.
                let _ = tokio::time::timeout(Duration::from_millis(5), waiting).await;
            }
            assert_eq!(dropped.load(Ordering::SeqCst), 3, "withdrawn at once");
            gate.store(true, Ordering::SeqCst);
            held.await.unwrap().unwrap();
            assert_eq!(lane.run(TenantId(1), |_| 5).await, Ok(5));
        });
        assert_eq!(ran.load(Ordering::SeqCst), 0, "no withdrawn job ran");
    }

    #[test]
    fn a_running_job_sees_its_caller_leave_and_its_result_goes_to_unclaimed() {
        let lane = Arc::new(Lane::new("test-lane", "test", 1, 64).unwrap());
        let (started, seen) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let (claimed_by_hook, hook) = std::sync::mpsc::channel();
        runtime().block_on(async {
            let job = {
                let (started, seen) = (Arc::clone(&started), Arc::clone(&seen));
                move |cancel: &Cancel| {
                    started.store(true, Ordering::SeqCst);
                    while !cancel.is_cancelled() {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    seen.store(true, Ordering::SeqCst);
                    42
                }
            };
            let waiting = lane.run_or(TenantId(1), job, move |v| {
                let _ = claimed_by_hook.send(v);
            });
            tokio::pin!(waiting);
            while !started.load(Ordering::SeqCst) {
                let _ = tokio::time::timeout(Duration::from_millis(1), waiting.as_mut()).await;
            }
        });
        assert_eq!(hook.recv_timeout(Duration::from_secs(5)), Ok(42));
        assert!(seen.load(Ordering::SeqCst), "the job saw the cancel");
    }

    #[test]
    fn spawned_jobs_are_refused_past_the_tenants_queue_cap_and_others_are_not() {
        let lane = Arc::new(Lane::new("test-lane", "test", 1, 2).unwrap());
        let ran = Arc::new(AtomicU32::new(0));
        runtime().block_on(async {
            let (gate, held) = hold(&lane);
            tokio::time::sleep(Duration::from_millis(20)).await;
            let job = |ran: &Arc<AtomicU32>| {
                let ran = Arc::clone(ran);
                move || {
                    ran.fetch_add(1, Ordering::SeqCst);
                }
            };
            assert_eq!(lane.spawn(TenantId(1), job(&ran)), Ok(()));
            assert_eq!(lane.spawn(TenantId(1), job(&ran)), Ok(()));
            assert_eq!(lane.spawn(TenantId(1), job(&ran)), Err(LaneFull));
            assert_eq!(lane.spawn(TenantId(2), job(&ran)), Ok(()));
            gate.store(true, Ordering::SeqCst);
            held.await.unwrap().unwrap();
            while ran.load(Ordering::SeqCst) < 3 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            // The queue drained: room again.
            assert_eq!(lane.spawn(TenantId(1), job(&ran)), Ok(()));
        });
    }
}
