//! Plugin calls on threads of their own, waited for with a bound (I10).
//!
//! Fuel and the epoch deadline stop a plugin that runs WebAssembly too long,
//! but neither reaches a call that is inside a host function: were a host
//! function ever to block (a store write on a stalled disk, a lock held by a
//! stuck thread), the thread running the call would block with it. So no
//! request-path thread runs a plugin call itself:
//!
//! 1. [`Calls::run`] hands the call to an idle worker (starting one when none
//!    is idle, up to `workers_max` live workers) and waits for its answer
//!    until the call's deadline plus [`ABANDON_GRACE`].
//! 2. A call that ends in time gives its value back; its worker goes back to
//!    idle.
//! 3. A call still running then is **abandoned**: the caller gets
//!    [`CallLost::Abandoned`] at once (its request fails closed, and the fault
//!    counts against the plugin). The worker is written off — it is never given
//!    another call and exits when (if ever) its call returns — and the next
//!    call that finds no idle worker starts a new one in its place.
//! 4. A tenant with [`STUCK_PER_TENANT_MAX`] written-off workers still stuck
//!    gets no more calls until one of them returns ([`CallLost::TenantStuck`]:
//!    its requests fail closed), so one tenant holds at most that many threads
//!    and plugin instance slots, whatever its plugins do.
//! 5. A call still queued at its deadline (every worker busy) is withdrawn:
//!    it never runs ([`CallLost::NoWorker`]).
//!
//! ```text
//!  queued ──► running ──► done ──► (worker idle again)
//!    │           └─ deadline + grace ─► abandoned ──► (worker exits when the call returns)
//!    └─ deadline + grace ─► withdrawn
//! ```

use crate::tenancy::TenantId;
use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long past a call's deadline its caller still waits before abandoning
/// it. Running WebAssembly is stopped at the deadline by the epoch (to within
/// a tick), so a call still running this much later is stuck in a host call,
/// or its thread gets no CPU.
pub const ABANDON_GRACE: Duration = Duration::from_millis(100);
/// Written-off workers one tenant may have stuck at once; past it, its plugin
/// calls fail closed until one returns.
pub const STUCK_PER_TENANT_MAX: u32 = 2;
/// How long a caller spins for its answer, and a worker for its next call,
/// before sleeping: a thread put to sleep and woken again costs tens of
/// microseconds on a virtual machine, more than most plugin calls.
const SPIN: Duration = Duration::from_micros(50);

/// Why a call gave no answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallLost {
    /// Still running past its deadline and the grace: abandoned.
    Abandoned,
    /// Its tenant already has [`STUCK_PER_TENANT_MAX`] abandoned calls stuck.
    TenantStuck,
    /// No worker took it before its deadline.
    NoWorker,
    /// It panicked (the host's bug, caught on its worker).
    Panicked,
}

const QUEUED: u8 = 0;
const RUNNING: u8 = 1;
const DONE: u8 = 2;
const ABANDONED: u8 = 3;
const WITHDRAWN: u8 = 4;

/// A call's work; it returns how to hand its answer over, which the worker
/// does only once it counts itself idle again (so a caller that follows at
/// once finds it, rather than starting another worker).
type Job = Box<dyn FnOnce() -> Box<dyn FnOnce() + Send> + Send>;

struct Envelope {
    tenant: TenantId,
    state: Arc<AtomicU8>,
    job: Job,
}

#[derive(Default)]
struct State {
    jobs: VecDeque<Envelope>,
    /// Live workers (written-off ones excluded) and how many wait for a job.
    workers: usize,
    idle: usize,
    /// Written-off workers still stuck in their call, by tenant.
    stuck: HashMap<TenantId, u32>,
    stopping: bool,
}

struct Shared {
    state: Mutex<State>,
    ready: Condvar,
    workers_max: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Jobs run outside the lock; the state is consistent at every unlock.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The workers plugin calls run on.
pub struct Calls {
    shared: Arc<Shared>,
}

impl Calls {
    /// No worker yet: they start on demand, at most `workers_max` live at once.
    pub fn new(workers_max: usize) -> Calls {
        Calls {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                ready: Condvar::new(),
                workers_max: workers_max.max(1),
            }),
        }
    }

    /// Runs `job` for `tenant` on a worker and waits for it until `deadline`
    /// plus [`ABANDON_GRACE`] (blocking the calling thread, never longer).
    pub fn run<R: Send + 'static>(
        &self,
        tenant: TenantId,
        deadline: Instant,
        job: impl FnOnce() -> R + Send + 'static,
    ) -> Result<R, CallLost> {
        let (answer, answered) = mpsc::sync_channel(1);
        let state = Arc::new(AtomicU8::new(QUEUED));
        {
            let mut s = self.shared.lock();
            if s.stuck.get(&tenant).copied().unwrap_or(0) >= STUCK_PER_TENANT_MAX {
                return Err(CallLost::TenantStuck);
            }
            s.jobs.push_back(Envelope {
                tenant,
                state: Arc::clone(&state),
                job: Box::new(move || {
                    let value = job();
                    Box::new(move || {
                        let _ = answer.send(value);
                    })
                }),
            });
            if s.idle == 0 && s.workers < self.shared.workers_max && self.start_worker() {
                s.workers += 1;
            }
        }
        self.shared.ready.notify_one();
        // Most calls answer in microseconds: blocking at once would put this
        // thread to sleep, and waking it costs more than the call (tens of
        // microseconds on a virtual machine). So spin a little first.
        let spin_until = Instant::now() + SPIN;
        loop {
            match answered.try_recv() {
                Ok(value) => return Ok(value),
                Err(TryRecvError::Disconnected) => return Err(CallLost::Panicked),
                Err(TryRecvError::Empty) if Instant::now() < spin_until => {
                    std::hint::spin_loop();
                }
                Err(TryRecvError::Empty) => break,
            }
        }
        let wait = (deadline + ABANDON_GRACE).saturating_duration_since(Instant::now());
        match answered.recv_timeout(wait) {
            Ok(value) => Ok(value),
            Err(RecvTimeoutError::Disconnected) => Err(CallLost::Panicked),
            Err(RecvTimeoutError::Timeout) => self.give_up(tenant, &state, &answered),
        }
    }

    /// The call's deadline passed: withdraw it if it never started, abandon it
    /// if it is still running, or take the answer it gave just now.
    fn give_up<R>(
        &self,
        tenant: TenantId,
        state: &AtomicU8,
        answered: &mpsc::Receiver<R>,
    ) -> Result<R, CallLost> {
        if let Ok(value) = answered.try_recv() {
            return Ok(value);
        }
        let swap = |from, to| {
            state
                .compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        };
        if swap(QUEUED, WITHDRAWN) {
            return Err(CallLost::NoWorker);
        }
        if swap(RUNNING, ABANDONED) {
            let mut s = self.shared.lock();
            *s.stuck.entry(tenant).or_insert(0) += 1;
            // Written off: it no longer counts as live, so a new worker may start.
            s.workers -= 1;
            crate::telemetry::set_plugin_workers_stuck(s.stuck.values().sum());
            return Err(CallLost::Abandoned);
        }
        // Done (the answer is in the channel), or it panicked.
        answered.recv().map_err(|_| CallLost::Panicked)
    }

    fn start_worker(&self) -> bool {
        let shared = Arc::clone(&self.shared);
        let started = std::thread::Builder::new()
            .name("bulkhead-plugin".into())
            .spawn(move || work(&shared));
        if let Err(error) = &started {
            tracing::error!(%error, "could not start a plugin worker");
        }
        started.is_ok()
    }

    /// Written-off workers still stuck, all tenants together.
    pub fn stuck(&self) -> u32 {
        self.shared.lock().stuck.values().sum()
    }
}

impl Drop for Calls {
    fn drop(&mut self) {
        // Idle workers exit; stuck ones exit when their call returns.
        self.shared.lock().stopping = true;
        self.shared.ready.notify_all();
    }
}

/// A worker: calls until the pool stops, or until the call in hand was
/// abandoned (then the worker leaves: its caller wrote it off).
fn work(shared: &Shared) {
    // Whether this worker already counts itself idle (it does from the end
    // of a call, before its answer is handed over).
    let mut counted = false;
    loop {
        let envelope = {
            let mut spun = false;
            let mut s = shared.lock();
            if !counted {
                s.idle += 1;
            }
            loop {
                if s.stopping {
                    s.idle -= 1;
                    s.workers -= 1;
                    return;
                }
                if let Some(envelope) = s.jobs.pop_front() {
                    s.idle -= 1;
                    break envelope;
                }
                if !spun {
                    // Fresh from a call: look for the next one a little
                    // before sleeping (see `SPIN`).
                    spun = true;
                    drop(s);
                    let spin_until = Instant::now() + SPIN;
                    while Instant::now() < spin_until && shared.lock().jobs.is_empty() {
                        std::hint::spin_loop();
                    }
                    s = shared.lock();
                    continue;
                }
                s = shared.ready.wait(s).unwrap_or_else(|p| p.into_inner());
            }
        };
        counted = false;
        let Envelope { tenant, state, job } = envelope;
        if state
            .compare_exchange(QUEUED, RUNNING, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            // Withdrawn by its caller: dropped unrun.
            continue;
        }
        // A panic drops the answer's sender: the caller sees `Panicked`. The
        // payload is dropped unread.
        let answer = std::panic::catch_unwind(AssertUnwindSafe(job));
        if answer.is_err() {
            tracing::error!("a plugin call panicked on the host's side; its request fails");
        }
        if state
            .compare_exchange(RUNNING, DONE, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            let mut s = shared.lock();
            if let Some(stuck) = s.stuck.get_mut(&tenant) {
                *stuck -= 1;
                if *stuck == 0 {
                    s.stuck.remove(&tenant);
                }
            }
            crate::telemetry::set_plugin_workers_stuck(s.stuck.values().sum());
            tracing::warn!(
                tenant = tenant.0,
                "an abandoned plugin call returned; its worker exits"
            );
            return;
        }
        shared.lock().idle += 1;
        counted = true;
        if let Ok(answer) = answer {
            answer();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    fn soon(ms: u64) -> Instant {
        Instant::now() + Duration::from_millis(ms)
    }

    #[test]
    fn calls_answer_and_workers_are_reused() {
        let calls = Calls::new(4);
        for i in 0..20u32 {
            assert_eq!(calls.run(TenantId(1), soon(1000), move || i * 2), Ok(i * 2));
        }
        assert!(
            calls.shared.lock().workers <= 1,
            "one at a time needs one worker"
        );
    }

    #[test]
    fn a_call_stuck_past_its_deadline_is_abandoned_and_others_are_served() {
        let calls = Calls::new(4);
        let release = Arc::new(AtomicBool::new(false));
        let stuck = |release: &Arc<AtomicBool>| {
            let release = Arc::clone(release);
            move || {
                while !release.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                1
            }
        };
        let started = Instant::now();
        assert_eq!(
            calls.run(TenantId(1), soon(20), stuck(&release)),
            Err(CallLost::Abandoned)
        );
        let waited = started.elapsed();
        assert!(waited < Duration::from_secs(2), "bounded wait: {waited:?}");
        assert!(waited >= Duration::from_millis(20) + ABANDON_GRACE);
        assert_eq!(calls.stuck(), 1);
        // Another tenant, and the same one, are still served.
        assert_eq!(calls.run(TenantId(2), soon(1000), || 7), Ok(7));
        assert_eq!(calls.run(TenantId(1), soon(1000), || 8), Ok(8));
        // A second stuck call, then the tenant is refused without running.
        assert_eq!(
            calls.run(TenantId(1), soon(20), stuck(&release)),
            Err(CallLost::Abandoned)
        );
        let ran = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&ran);
        assert_eq!(
            calls.run(TenantId(1), soon(1000), move || flag
                .store(true, Ordering::SeqCst)),
            Err(CallLost::TenantStuck)
        );
        assert!(!ran.load(Ordering::SeqCst));
        assert_eq!(calls.run(TenantId(2), soon(1000), || 9), Ok(9));
        // Once the stuck calls return, their workers leave and the tenant is served again.
        release.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_secs(5);
        while calls.stuck() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(calls.stuck(), 0);
        assert_eq!(calls.run(TenantId(1), soon(1000), || 10), Ok(10));
    }

    #[test]
    fn a_call_no_worker_takes_in_time_is_withdrawn_and_never_runs() {
        let calls = Arc::new(Calls::new(1));
        let release = Arc::new(AtomicBool::new(false));
        let holder = {
            let (calls, release) = (Arc::clone(&calls), Arc::clone(&release));
            std::thread::spawn(move || {
                calls.run(TenantId(1), soon(5000), move || {
                    while !release.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                })
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        let ran = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&ran);
        assert_eq!(
            calls.run(TenantId(2), soon(10), move || flag
                .store(true, Ordering::SeqCst)),
            Err(CallLost::NoWorker)
        );
        release.store(true, Ordering::SeqCst);
        assert_eq!(holder.join().unwrap(), Ok(()));
        assert_eq!(calls.run(TenantId(2), soon(1000), || 3), Ok(3));
        assert!(!ran.load(Ordering::SeqCst), "a withdrawn call never runs");
    }

    #[test]
    fn a_panicking_call_fails_its_caller_and_the_worker_lives_on() {
        let calls = Calls::new(1);
        assert_eq!(
            calls.run(TenantId(1), soon(1000), || -> u32 { panic!("secret text") }),
            Err(CallLost::Panicked)
        );
        assert_eq!(calls.run(TenantId(1), soon(1000), || 4), Ok(4));
    }
}
