//! The scheduler on its own thread, and the handle the async side talks to.
//!
//! Model compute never runs on the async runtime's workers: the scheduler and
//! its backend live on one dedicated thread (plus the backend's compute pool),
//! stepping at their own pace. The API layer submits an [`Admitted`] request
//! and gets a synchronous answer — queued, or refused with a [`Rejection`] —
//! then reads the request's events from its channel.
//!
//! 1. [`EngineService::start`] moves the scheduler onto its thread.
//! 2. [`EngineHandle::submit`] enqueues (bounded per tenant) and answers at once.
//!    The command channel itself has no bound of its own: the API layer sends
//!    while holding one of the tenant's `pending_max` permits and keeps it until
//!    the answer, so the channel holds at most Σ `pending_max` submissions, and
//!    one tenant's burst can never fill another's share.
//! 3. [`EngineHandle::change_tenant`] adds, changes or removes a tenant between
//!    two steps and answers once it is applied; [`EngineHandle::audit`] audits
//!    the KV pool between two steps (the pool lives on this thread) and
//!    answers with what it found.
//! 4. The thread ticks while anything is in flight and sleeps on its command
//!    channel when idle (waking for new work or shutdown).
//! 5. [`EngineService::shutdown`] stops accepting, lets in-flight requests run
//!    until the drain deadline, then finishes the rest (their pages released
//!    through the scheduler's one finish path) and joins the thread.
//! 6. **Supervision.** A panic on the engine thread, or in a compute task
//!    (re-raised there), is caught: the engine stops accepting at once (so
//!    readiness turns false), ends every request in flight through the one
//!    finish path with `engine_fault`, and drops the scheduler with its pool
//!    and backend (a new pool is allocated zeroed). With a [`Supervision`] it
//!    then rebuilds them for the same tenants after a backoff and accepts
//!    again; after [`RestartPolicy::restarts_max`] faults in a row it stays
//!    down. Each fault is logged (never the panic's message), counted
//!    (`bulkhead_engine_faults_total`, `bulkhead_engine_restarts_total`) and
//!    reported to the finish sink for the audit log. Builds with feature
//!    `fault-injection` (tests only, never a release) can plant such a panic
//!    between two steps (`EngineHandle::inject_panic`, with the `fault-injection` feature).

use super::admission::Admitted;
use super::handoff::Transferred;
use super::request::{FinishReason, Rejection, RequestId};
use super::scheduler::{EngineFault, Scheduler, TenantChangeError, TenantLimits, TickReport};
use super::stats::{PoolAudit, SchedulerStats};
use crate::tenancy::TenantId;
use bulkhead_kernels::backend::Backend;
use bulkhead_kernels::kv::PoolId;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// How long past its drain deadline a stopping engine thread may take.
pub const ENGINE_STOP_GRACE: Duration = Duration::from_secs(10);
/// How often a shutdown looks whether the engine thread has stopped.
const ENGINE_STOP_POLL: Duration = Duration::from_millis(5);
/// How long an idle engine thread sleeps before looking again.
const IDLE_WAIT: Duration = Duration::from_millis(100);
/// How long a stalled engine thread (work queued, none runnable) sleeps.
const STALLED_WAIT: Duration = Duration::from_millis(5);

enum Command {
    /// A request's choices, queued together or refused together.
    Submit(Vec<Vec<Admitted>>, oneshot::Sender<Result<(), Rejection>>),
    Tenant(
        TenantChange,
        oneshot::Sender<Result<u32, TenantChangeError>>,
    ),
    Audit(oneshot::Sender<PoolAudit>),
    /// Decode role: a transfer came back; the verdict goes to the link.
    Transferred {
        request: RequestId,
        job: u64,
        result: Transferred,
        verdict: oneshot::Sender<Result<(), &'static str>>,
    },
    /// Panics the engine thread when taken (tests: the fault path end to end).
    #[cfg(feature = "fault-injection")]
    Panic,
    Shutdown {
        drain_until: Instant,
        reason: FinishReason,
    },
}

/// A change to the engine's tenant set, applied between steps.
#[derive(Clone, Debug)]
pub enum TenantChange {
    /// A new tenant and its partition.
    Add(TenantLimits),
    /// New limits and partition for a tenant.
    Update(TenantLimits),
    /// Ends the tenant's requests (`tenant_removed`), scrubs, frees its partition.
    Remove(TenantId),
}

/// Why a tenant change did not apply. Nothing changed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChangeError {
    /// The scheduler or its pool refused it.
    #[error(transparent)]
    Refused(#[from] TenantChangeError),
    /// The engine is shutting down or has stopped.
    #[error("the engine is not running")]
    Unavailable,
}

/// Why a submission did not reach the scheduler.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SubmitError {
    /// The scheduler refused it (queue full).
    #[error(transparent)]
    Rejected(#[from] Rejection),
    /// The engine is shutting down or has stopped.
    #[error("the engine is not accepting requests")]
    Unavailable,
}

/// The engine is not running: shutting down, stopped, or between a panic and
/// its restart.
#[derive(Clone, Copy, Debug, thiserror::Error, PartialEq, Eq)]
#[error("the engine is not running")]
pub struct EngineUnavailable;

/// How a supervised engine restarts after a panic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RestartPolicy {
    /// Faults in a row after which the engine stays down (not ready).
    pub restarts_max: u32,
    /// The wait before the first restart; it doubles for each fault in a row.
    pub backoff_initial: Duration,
    /// The longest wait.
    pub backoff_max: Duration,
    /// An engine that has run this long since its last restart starts a new
    /// count of faults in a row.
    pub stable_after: Duration,
}

impl Default for RestartPolicy {
    fn default() -> RestartPolicy {
        RestartPolicy {
            restarts_max: 5,
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(30),
            stable_after: Duration::from_secs(300),
        }
    }
}

impl RestartPolicy {
    /// The wait before restarting after the `in_a_row`-th fault in a row, or
    /// `None` to stay down.
    pub fn backoff(&self, in_a_row: u32) -> Option<Duration> {
        if in_a_row > self.restarts_max {
            return None;
        }
        let doublings = in_a_row.saturating_sub(1).min(16);
        Some((self.backoff_initial * 2u32.pow(doublings)).min(self.backoff_max))
    }
}

/// Builds a fresh scheduler (pool, backend) for the given tenants; the error
/// is logged.
pub type Rebuild<B> = Box<dyn FnMut(Vec<TenantLimits>) -> Result<Scheduler<B>, String> + Send>;

/// What an engine needs to restart itself after a panic.
pub struct Supervision<B: Backend> {
    /// Its model's id (logs, metrics, audit).
    pub model: String,
    /// When and how often it restarts.
    pub policy: RestartPolicy,
    /// Builds its replacement.
    pub rebuild: Rebuild<B>,
}

/// A cloneable handle for submitting requests.
#[derive(Clone)]
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
    accepting: Arc<AtomicBool>,
    /// Published by the engine thread after every loop turn.
    stats: Arc<Mutex<SchedulerStats>>,
    /// Panics and restarts since the model was loaded.
    faults: Arc<Faults>,
}

/// A model's engine panics and restarts since it was loaded (the operator
/// console's "engine restarts").
#[derive(Debug, Default)]
pub struct Faults {
    /// Panics of the engine thread.
    pub panics: AtomicU64,
    /// Engines rebuilt after one.
    pub restarts: AtomicU64,
}

impl EngineHandle {
    /// Queues `admitted`; the answer comes once the engine thread has looked at it.
    pub async fn submit(&self, admitted: Admitted) -> Result<(), SubmitError> {
        self.submit_all(vec![vec![admitted]]).await
    }

    /// Queues a request's sequences (one tenant's, for this engine's pool)
    /// together: for each of its prompts, that prompt's choices. All of
    /// them, or, when its queue has no room for all, none.
    pub async fn submit_all(&self, prompts: Vec<Vec<Admitted>>) -> Result<(), SubmitError> {
        if !self.accepting.load(Ordering::SeqCst) {
            return Err(SubmitError::Unavailable);
        }
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::Submit(prompts, reply))
            .map_err(|_| SubmitError::Unavailable)?;
        match answer.await {
            Ok(result) => result.map_err(SubmitError::Rejected),
            Err(_) => Err(SubmitError::Unavailable),
        }
    }

    /// Applies `change` between two steps and waits for it; for a removal,
    /// answers how many requests it ended.
    pub async fn change_tenant(&self, change: TenantChange) -> Result<u32, ChangeError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::Tenant(change, reply))
            .map_err(|_| ChangeError::Unavailable)?;
        match answer.await {
            Ok(result) => Ok(result?),
            Err(_) => Err(ChangeError::Unavailable),
        }
    }

    /// Decode role: hands a transfer (or its failure) to the sequence that
    /// asked for it, between two steps, and answers the page book's verdict
    /// (`Err` with a reason label when refused or nobody waits for it).
    pub async fn transferred(
        &self,
        request: RequestId,
        job: u64,
        result: Transferred,
    ) -> Result<(), &'static str> {
        let (verdict, answer) = oneshot::channel();
        self.commands
            .send(Command::Transferred {
                request,
                job,
                result,
                verdict,
            })
            .map_err(|_| "engine_unavailable")?;
        answer.await.unwrap_or(Err("engine_unavailable"))
    }

    /// Audits the KV pool between two steps ([`Scheduler::audit`]) and waits
    /// for the answer. The engine thread stalls for the scan, one pass over
    /// the free pages' bytes: for operators and tests, not a scrape loop.
    pub async fn audit(&self) -> Result<PoolAudit, EngineUnavailable> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::Audit(reply))
            .map_err(|_| EngineUnavailable)?;
        // A stopped engine, or one waiting to restart, drops the reply.
        answer.await.map_err(|_| EngineUnavailable)
    }

    /// Makes the engine thread panic ("injected engine fault") when it takes
    /// this command, between two steps, with whatever is in flight: the
    /// supervisor then ends those requests with `engine_fault`, drops the
    /// pool and rebuilds, as for any panic. Refused while the engine does not
    /// accept (down, or waiting to restart), where nothing would take it.
    /// Only with feature `fault-injection`: never in a release build.
    #[cfg(feature = "fault-injection")]
    pub fn inject_panic(&self) -> Result<(), EngineUnavailable> {
        if !self.is_accepting() {
            return Err(EngineUnavailable);
        }
        self.commands
            .send(Command::Panic)
            .map_err(|_| EngineUnavailable)
    }

    /// Whether new requests are accepted (for readiness).
    pub fn is_accepting(&self) -> bool {
        self.accepting.load(Ordering::SeqCst)
    }

    /// Panics and restarts of this model's engine since it was loaded.
    pub fn faults(&self) -> (u64, u64) {
        (
            self.faults.panics.load(Ordering::Relaxed),
            self.faults.restarts.load(Ordering::Relaxed),
        )
    }

    /// The latest counts the engine thread published (for metrics).
    pub fn stats(&self) -> SchedulerStats {
        // A poisoned lock means the engine thread panicked mid-publish; the
        // snapshot is plain data, still the best numbers there are.
        self.stats
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }
}

/// The engine thread's view of its service's flags.
struct Flags {
    /// New requests are taken (readiness).
    accepting: Arc<AtomicBool>,
    /// A shutdown has begun.
    stopping: Arc<AtomicBool>,
    /// Panics and restarts, counted as they happen.
    faults: Arc<Faults>,
}

/// Clears `accepting` when dropped: held by the engine thread for its life.
struct StopsAccepting(Arc<AtomicBool>);

impl Drop for StopsAccepting {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// The running engine thread.
pub struct EngineService {
    handle: EngineHandle,
    /// Set by [`EngineService::shutdown`]: a restart must not accept again.
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<u32>>,
}

impl EngineService {
    /// Starts the engine thread with `scheduler`, unsupervised: a panic ends
    /// the requests in flight and the engine stays down.
    pub fn start<B: Backend + 'static>(scheduler: Scheduler<B>) -> std::io::Result<EngineService> {
        EngineService::start_with(scheduler, None)
    }

    /// Starts the engine thread with `scheduler`, restarted after a panic as
    /// `supervision` says.
    pub fn start_supervised<B: Backend + 'static>(
        scheduler: Scheduler<B>,
        supervision: Supervision<B>,
    ) -> std::io::Result<EngineService> {
        EngineService::start_with(scheduler, Some(supervision))
    }

    fn start_with<B: Backend + 'static>(
        scheduler: Scheduler<B>,
        supervision: Option<Supervision<B>>,
    ) -> std::io::Result<EngineService> {
        let (commands, inbox) = mpsc::channel();
        let accepting = Arc::new(AtomicBool::new(true));
        let stats = Arc::new(Mutex::new(scheduler.stats()));
        let published = Arc::clone(&stats);
        let stops_accepting = StopsAccepting(Arc::clone(&accepting));
        let stopping = Arc::new(AtomicBool::new(false));
        let faults = Arc::new(Faults::default());
        let flags = Flags {
            accepting: Arc::clone(&accepting),
            stopping: Arc::clone(&stopping),
            faults: Arc::clone(&faults),
        };
        let thread = std::thread::Builder::new()
            .name("bulkhead-engine".into())
            .spawn(move || {
                // However the thread ends (a shutdown, or a panic unwinding),
                // the engine stops taking requests and readiness says so.
                let _stops_accepting = stops_accepting;
                supervise(scheduler, supervision, &inbox, &published, &flags)
            })?;
        Ok(EngineService {
            handle: EngineHandle {
                commands,
                accepting,
                stats,
                faults,
            },
            stopping,
            thread: Some(thread),
        })
    }

    /// A handle for the API layer.
    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    /// Stops accepting, lets in-flight requests finish until `drain`, then ends
    /// the rest with `reason` and joins the thread. The scheduler — its pool,
    /// backend and model — is dropped with the thread. Returns how many
    /// requests were still in flight at the deadline.
    ///
    /// A thread that has not stopped [`ENGINE_STOP_GRACE`] after the deadline
    /// (stuck in a step or a loop: a bug) is left behind with an error in the
    /// log, so a shutdown or an unload always returns.
    pub fn shutdown(mut self, drain: Duration, reason: FinishReason) -> u32 {
        self.stopping.store(true, Ordering::SeqCst);
        self.handle.accepting.store(false, Ordering::SeqCst);
        let drain_until = Instant::now() + drain;
        let _ = self.handle.commands.send(Command::Shutdown {
            drain_until,
            reason,
        });
        let Some(thread) = self.thread.take() else {
            return 0;
        };
        let give_up = drain_until + ENGINE_STOP_GRACE;
        while !thread.is_finished() {
            if Instant::now() >= give_up {
                tracing::error!(
                    grace_ms = ENGINE_STOP_GRACE.as_millis() as u64,
                    "the engine thread did not stop by its drain deadline; left behind"
                );
                return 0;
            }
            std::thread::sleep(ENGINE_STOP_POLL);
        }
        // A panicked engine thread ended everything it held by unwinding.
        thread.join().unwrap_or(0)
    }
}

/// Runs the engine, and after each panic ends its requests, drops it and
/// (supervised) rebuilds it; returns how many requests the drain deadline
/// ended.
fn supervise<B: Backend>(
    scheduler: Scheduler<B>,
    mut supervision: Option<Supervision<B>>,
    inbox: &mpsc::Receiver<Command>,
    stats: &Mutex<SchedulerStats>,
    flags: &Flags,
) -> u32 {
    // Requests are admitted for the pool the model's first engine had; a
    // rebuilt engine has a new pool (a new id, fresh generations) and takes
    // those, and only those, as its own.
    let first_pool = scheduler.pool().id();
    let model = supervision
        .as_ref()
        .map_or_else(|| "unsupervised".to_string(), |s| s.model.clone());
    let mut scheduler = Some(scheduler);
    let mut drain_until: Option<(Instant, FinishReason)> = None;
    let mut in_a_row = 0u32;
    let mut started = Instant::now();
    loop {
        let Some(current) = scheduler.as_mut() else {
            return 0;
        };
        let run = catch_unwind(AssertUnwindSafe(|| {
            engine_loop(current, first_pool, inbox, stats, &mut drain_until)
        }));
        // The panic's payload is dropped unread: it may quote request text.
        if let Ok(ended) = run {
            return ended;
        }
        flags.accepting.store(false, Ordering::SeqCst);
        let broken = scheduler.take().expect("it was running");
        let sink = broken.finish_sink();
        let tenants = broken.tenant_limits();
        let mut totals = broken.totals();
        // The one finish path for everything in flight; if even that panics,
        // dropping the scheduler closes the requests' channels (a 5xx too).
        let ended = catch_unwind(AssertUnwindSafe(|| {
            let mut broken = broken;
            let ended = broken.finish_everything(FinishReason::EngineFault);
            totals = broken.totals();
            ended
        }))
        .unwrap_or(0);
        if started.elapsed()
            >= supervision
                .as_ref()
                .map_or(Duration::MAX, |s| s.policy.stable_after)
        {
            in_a_row = 0;
        }
        in_a_row += 1;
        let restart_in = match (&supervision, drain_until) {
            (Some(s), None) => s.policy.backoff(in_a_row),
            _ => None,
        };
        tracing::error!(
            model = %model,
            requests_ended = ended,
            in_a_row,
            restart_in_ms = restart_in.map(|d| d.as_millis() as u64),
            "the engine panicked; its requests in flight ended with engine_fault and its KV pool was dropped"
        );
        crate::telemetry::count_engine_fault(&model, ended);
        flags.faults.panics.fetch_add(1, Ordering::Relaxed);
        if let Some(sink) = &sink {
            sink.engine_fault(&EngineFault {
                model: &model,
                requests_ended: ended,
                in_a_row,
                restart_in,
            });
        }
        let (Some(wait), Some(s)) = (restart_in, supervision.as_mut()) else {
            // Unsupervised, shutting down, or too many faults in a row.
            return idle_down(inbox, drain_until.is_some());
        };
        if !wait_down(inbox, wait) {
            return 0;
        }
        match (s.rebuild)(tenants) {
            Ok(mut rebuilt) => {
                if let Some(sink) = sink {
                    rebuilt.set_finish_sink(sink);
                }
                rebuilt.carry_totals(&totals);
                publish(&rebuilt, stats);
                scheduler = Some(rebuilt);
                started = Instant::now();
                crate::telemetry::count_engine_restart(&model);
                flags.faults.restarts.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(model = %model, in_a_row, "the engine restarted");
                // Accepting again unless a shutdown began meanwhile (it sets
                // `stopping` before clearing `accepting`, so one of the two
                // stores below comes last either way).
                flags.accepting.store(true, Ordering::SeqCst);
                if flags.stopping.load(Ordering::SeqCst) {
                    flags.accepting.store(false, Ordering::SeqCst);
                }
            }
            Err(error) => {
                tracing::error!(model = %model, %error, "the engine could not be rebuilt; it stays down");
                return idle_down(inbox, false);
            }
        }
    }
}

/// A stopped engine's thread: refuses every submission, tenant change and
/// audit (by dropping its reply: `Unavailable`) until a shutdown, or at once when one
/// was already asked for.
fn idle_down(inbox: &mpsc::Receiver<Command>, shutting_down: bool) -> u32 {
    if shutting_down {
        return 0;
    }
    while let Ok(command) = inbox.recv() {
        if let Command::Shutdown { .. } = command {
            return 0;
        }
    }
    0
}

/// Waits `wait` before a restart, refusing commands as [`idle_down`] does;
/// false when a shutdown came meanwhile.
fn wait_down(inbox: &mpsc::Receiver<Command>, wait: Duration) -> bool {
    let until = Instant::now() + wait;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return true;
        }
        match inbox.recv_timeout(left) {
            Ok(Command::Shutdown { .. }) | Err(RecvTimeoutError::Disconnected) => return false,
            Ok(_) | Err(RecvTimeoutError::Timeout) => {}
        }
    }
}

/// Runs until shut down; returns how many requests the drain deadline ended.
/// `drain_until` outlives a panic, so a shutdown asked for before one holds.
fn engine_loop<B: Backend>(
    scheduler: &mut Scheduler<B>,
    first_pool: PoolId,
    inbox: &mpsc::Receiver<Command>,
    stats: &Mutex<SchedulerStats>,
    drain_until: &mut Option<(Instant, FinishReason)>,
) -> u32 {
    let mut stalled = false;
    loop {
        publish(scheduler, stats);
        let empty = scheduler.in_flight() == 0;
        if empty && drain_until.is_some() {
            return 0;
        }
        // Idle (nothing in flight, or the last tick could do nothing, e.g. every
        // queued request waits on a limit): block for work, briefly when stalled
        // so deadlines still expire. Busy: take what has arrived and step.
        let wait = if empty {
            Some(IDLE_WAIT)
        } else if stalled {
            Some(STALLED_WAIT)
        } else {
            None
        };
        let first = if let Some(wait) = wait {
            match inbox.recv_timeout(wait) {
                Ok(command) => Some(command),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return 0,
            }
        } else {
            inbox.try_recv().ok()
        };
        for command in first
            .into_iter()
            .chain(std::iter::from_fn(|| inbox.try_recv().ok()))
        {
            match command {
                Command::Submit(mut prompts, reply) => {
                    for admitted in prompts.iter_mut().flatten() {
                        if admitted.pool == first_pool {
                            admitted.pool = scheduler.pool().id();
                        }
                    }
                    let _ = reply.send(scheduler.enqueue_all(prompts));
                }
                Command::Tenant(change, reply) => {
                    let result = match change {
                        TenantChange::Add(limits) => scheduler.add_tenant(limits).map(|()| 0),
                        TenantChange::Update(limits) => scheduler.update_tenant(limits).map(|()| 0),
                        TenantChange::Remove(id) => scheduler.remove_tenant(id),
                    };
                    let _ = reply.send(result);
                }
                Command::Audit(reply) => {
                    let _ = reply.send(scheduler.audit());
                }
                Command::Transferred {
                    request,
                    job,
                    result,
                    verdict,
                } => {
                    let _ = verdict.send(scheduler.transferred(request, job, result));
                }
                #[cfg(feature = "fault-injection")]
                Command::Panic => panic!("injected engine fault"),
                Command::Shutdown {
                    drain_until: until,
                    reason,
                } => *drain_until = Some((until, reason)),
            }
        }
        let now = Instant::now();
        if let Some((until, reason)) = *drain_until {
            if now >= until {
                let ended = scheduler.finish_everything(reason);
                publish(scheduler, stats);
                return ended;
            }
        }
        stalled = scheduler.in_flight() > 0 && scheduler.tick(now) == TickReport::default();
    }
}

fn publish<B: Backend>(scheduler: &Scheduler<B>, stats: &Mutex<SchedulerStats>) {
    let snapshot = scheduler.stats();
    *stats
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner()) = snapshot;
}
