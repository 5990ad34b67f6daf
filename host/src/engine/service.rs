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
//!    two steps and answers once it is applied.
//! 4. The thread ticks while anything is in flight and sleeps on its command
//!    channel when idle (waking for new work or shutdown).
//! 5. [`EngineService::shutdown`] stops accepting, lets in-flight requests run
//!    until the drain deadline, then finishes the rest (their pages released
//!    through the scheduler's one finish path) and joins the thread.

use super::admission::Admitted;
use super::request::{FinishReason, Rejection};
use super::scheduler::{Scheduler, TenantChangeError, TenantLimits, TickReport};
use super::stats::SchedulerStats;
use crate::tenancy::TenantId;
use bulkhead_kernels::backend::Backend;
use std::sync::atomic::{AtomicBool, Ordering};
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
    Submit(Admitted, oneshot::Sender<Result<(), Rejection>>),
    Tenant(
        TenantChange,
        oneshot::Sender<Result<u32, TenantChangeError>>,
    ),
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

/// A cloneable handle for submitting requests.
#[derive(Clone)]
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
    accepting: Arc<AtomicBool>,
    /// Published by the engine thread after every loop turn.
    stats: Arc<Mutex<SchedulerStats>>,
}

impl EngineHandle {
    /// Queues `admitted`; the answer comes once the engine thread has looked at it.
    pub async fn submit(&self, admitted: Admitted) -> Result<(), SubmitError> {
        if !self.accepting.load(Ordering::SeqCst) {
            return Err(SubmitError::Unavailable);
        }
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::Submit(admitted, reply))
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

    /// Whether new requests are accepted (for readiness).
    pub fn is_accepting(&self) -> bool {
        self.accepting.load(Ordering::SeqCst)
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
    thread: Option<JoinHandle<u32>>,
}

impl EngineService {
    /// Starts the engine thread with `scheduler`.
    pub fn start<B: Backend + 'static>(scheduler: Scheduler<B>) -> std::io::Result<EngineService> {
        let (commands, inbox) = mpsc::channel();
        let accepting = Arc::new(AtomicBool::new(true));
        let stats = Arc::new(Mutex::new(scheduler.stats()));
        let published = Arc::clone(&stats);
        let stops_accepting = StopsAccepting(Arc::clone(&accepting));
        let thread = std::thread::Builder::new()
            .name("bulkhead-engine".into())
            .spawn(move || {
                // However the thread ends (a shutdown, or a panic unwinding),
                // the engine stops taking requests and readiness says so.
                let _stops_accepting = stops_accepting;
                engine_loop(scheduler, inbox, &published)
            })?;
        Ok(EngineService {
            handle: EngineHandle {
                commands,
                accepting,
                stats,
            },
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

/// Runs until shut down; returns how many requests the drain deadline ended.
fn engine_loop<B: Backend>(
    mut scheduler: Scheduler<B>,
    inbox: mpsc::Receiver<Command>,
    stats: &Mutex<SchedulerStats>,
) -> u32 {
    let mut drain_until: Option<(Instant, FinishReason)> = None;
    let mut stalled = false;
    loop {
        publish(&scheduler, stats);
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
                Command::Submit(admitted, reply) => {
                    let _ = reply.send(scheduler.enqueue(admitted));
                }
                Command::Tenant(change, reply) => {
                    let result = match change {
                        TenantChange::Add(limits) => scheduler.add_tenant(limits).map(|()| 0),
                        TenantChange::Update(limits) => scheduler.update_tenant(limits).map(|()| 0),
                        TenantChange::Remove(id) => scheduler.remove_tenant(id),
                    };
                    let _ = reply.send(result);
                }
                Command::Shutdown {
                    drain_until: until,
                    reason,
                } => drain_until = Some((until, reason)),
            }
        }
        let now = Instant::now();
        if let Some((until, reason)) = drain_until {
            if now >= until {
                let ended = scheduler.finish_everything(reason);
                publish(&scheduler, stats);
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
