//! The scheduler on its own thread: submissions from async code are answered
//! at once, requests stream to completion, and shutdown drains then stops.

use bulkhead::engine::admission::Admission;
use bulkhead::engine::build::{self, EngineSpec};
use bulkhead::engine::request::Usage;
use bulkhead::engine::request::{Event, FinishReason, NewRequest, Rejection, RequestId};
use bulkhead::engine::sampling::SamplingParams;
use bulkhead::engine::scheduler::{BatchLimits, EngineFault, FinishSink, Scheduler, TenantLimits};
use bulkhead::engine::service::{
    EngineService, EngineUnavailable, RestartPolicy, SubmitError, Supervision,
};
use bulkhead::tenancy::TenantId;
use bulkhead_kernels::gguf::Gguf;
use bulkhead_kernels::kv::{KvType, PageId, PoolOptions};
use bulkhead_kernels::model::Model;
use bulkhead_kernels::testing::{tiny_llama, TinySpec};
use bulkhead_kernels::tokenizer::Tokenizer;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The tiny model of `spec` and its tokenizer.
fn tiny(spec: &TinySpec) -> (Arc<Model>, Arc<Tokenizer>) {
    let gguf = Arc::new(Gguf::from_bytes(tiny_llama(spec)).unwrap());
    let model = Arc::new(Model::load(Arc::clone(&gguf)).unwrap());
    (model, Arc::new(Tokenizer::from_gguf(&gguf).unwrap()))
}

/// The tests' engine: 8 pages of 8 tokens, steps of up to 64 tokens and 4
/// sequences, on `threads` threads.
fn engine_spec(threads: usize) -> EngineSpec {
    EngineSpec {
        pool_pages: 8,
        page_tokens: 8,
        kv_type: KvType::default(),
        threads,
        step_tokens_max: 64,
        step_seqs_max: 4,
        pool_options: PoolOptions::default(),
        placement: bulkhead::engine::placement::Placement::Cpu,
        cuda: Default::default(),
    }
}

fn service(queue_depth_max: u32, running_max: u32) -> (EngineService, Admission) {
    let (model, tokenizer) = tiny(&TinySpec::default());
    let spec = engine_spec(2);
    let tenants = vec![TenantLimits {
        id: TenantId(0),
        name: "alpha".into(),
        weight: 1,
        queue_depth_max,
        running_max,
        pages_reserved: 8,
        pages_max: 8,
        prefix_cache: true,
    }];
    let scheduler = build::scheduler(&model, &tokenizer, &spec, tenants).unwrap();
    let admission = scheduler.admission(64);
    (EngineService::start(scheduler).unwrap(), admission)
}

fn request(id: u64, max_tokens: u32) -> (NewRequest, tokio::sync::mpsc::UnboundedReceiver<Event>) {
    let (events, rx) = tokio::sync::mpsc::unbounded_channel();
    let request = NewRequest {
        id: RequestId(id),
        tenant: TenantId(0),
        prompt: vec![104, 101, 108, 108, 111],
        max_tokens,
        sampling: SamplingParams::default(),
        stop: Vec::new(),
        deadline: Instant::now() + Duration::from_secs(30),
        events,
        cache_salt: None,
        prefill_hint: None,
    };
    (request, rx)
}

async fn finished(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Event>) -> FinishReason {
    while let Some(event) = rx.recv().await {
        if let Event::Finished { reason, .. } = event {
            return reason;
        }
    }
    panic!("the channel closed without a Finished event");
}

#[test]
fn streams_requests_to_completion() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (service, admission) = service(4, 4);
    let handle = service.handle();
    runtime.block_on(async {
        let (r1, mut rx1) = request(1, 20);
        let (r2, mut rx2) = request(2, 20);
        handle.submit(admission.admit(r1).unwrap()).await.unwrap();
        handle.submit(admission.admit(r2).unwrap()).await.unwrap();
        assert!(matches!(
            finished(&mut rx1).await,
            FinishReason::Length | FinishReason::Stop
        ));
        assert!(matches!(
            finished(&mut rx2).await,
            FinishReason::Length | FinishReason::Stop
        ));
    });
    service.shutdown(Duration::from_secs(1), FinishReason::Shutdown);
}

/// The audit reads every free page's values whatever the pool's options: a
/// planted dirty free page is reported (and the pool is then not at its
/// baseline) where the invariant check, not paranoid, sees nothing.
#[test]
fn an_audit_reports_a_dirty_free_page_outside_paranoid_mode() {
    let (model, tokenizer) = tiny(&TinySpec::default());
    let spec = engine_spec(1);
    assert!(!spec.pool_options.paranoid);
    let mut scheduler = build::scheduler(&model, &tokenizer, &spec, vec![alpha()]).unwrap();
    let audit = scheduler.audit();
    assert!(audit.at_baseline(), "{audit:?}");
    assert_eq!((audit.pages_count, audit.free_pages_checked), (8, 8));
    scheduler.pool_mut().plant_fault_dirty_free(PageId(3));
    let audit = scheduler.audit();
    assert_eq!(audit.free_pages_dirty, vec![PageId(3)]);
    assert_eq!(audit.invariants, Ok(()));
    assert!(!audit.at_baseline());
}

/// An audit runs on the engine thread between steps: after a request ends,
/// its pages are scrubbed and the pool is back at its baseline; a stopped
/// engine answers `EngineUnavailable`.
#[test]
fn an_audit_through_the_engine_thread_finds_the_pool_back_at_baseline() {
    let runtime = runtime();
    let (service, admission) = service(4, 4);
    let handle = service.handle();
    runtime.block_on(async {
        let fresh = handle.audit().await.unwrap();
        assert!(fresh.at_baseline(), "{fresh:?}");
        assert_eq!(fresh.pages_scrubbed_total, 0);
        let (r, mut rx) = request(1, 20);
        handle.submit(admission.admit(r).unwrap()).await.unwrap();
        finished(&mut rx).await;
        // The tick that ended it scrubbed its pages before the engine took
        // the next command.
        let after = handle.audit().await.unwrap();
        assert!(after.at_baseline(), "{after:?}");
        assert!(after.pages_scrubbed_total > 0, "{after:?}");
        assert_eq!(after.pool_id, fresh.pool_id);
        assert_eq!(after.tenants.len(), 1);
    });
    service.shutdown(Duration::from_secs(1), FinishReason::Shutdown);
    assert_eq!(runtime.block_on(handle.audit()), Err(EngineUnavailable));
}

#[test]
fn a_full_queue_is_refused_at_submit_and_shutdown_ends_the_queued() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // No sequence may run, so the queue fills deterministically.
    let (service, admission) = service(1, 0);
    let handle = service.handle();
    let (r1, mut rx1) = request(1, 8);
    let (r2, _rx2) = request(2, 8);
    runtime.block_on(async {
        handle.submit(admission.admit(r1).unwrap()).await.unwrap();
        let second = handle.submit(admission.admit(r2).unwrap()).await;
        assert_eq!(second, Err(SubmitError::Rejected(Rejection::QueueFull)));
    });
    service.shutdown(Duration::ZERO, FinishReason::Shutdown);
    runtime.block_on(async { assert_eq!(finished(&mut rx1).await, FinishReason::Shutdown) });
}

#[test]
fn shutdown_stops_accepting_and_ends_what_is_left_after_the_drain() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (service, admission) = service(4, 4);
    let handle = service.handle();
    let (r1, mut rx1) = request(1, 59);
    runtime.block_on(async { handle.submit(admission.admit(r1).unwrap()).await.unwrap() });
    service.shutdown(Duration::ZERO, FinishReason::Shutdown);
    runtime.block_on(async {
        let reason = finished(&mut rx1).await;
        assert!(
            matches!(
                reason,
                FinishReason::Shutdown | FinishReason::Length | FinishReason::Stop
            ),
            "{reason:?}"
        );
        let (r2, _rx2) = request(2, 4);
        assert_eq!(
            handle.submit(admission.admit(r2).unwrap()).await,
            Err(SubmitError::Unavailable)
        );
    });
}

/// A backend with a planted fault in its step: an engine thread stuck in a
/// loop, one whose ownership check panics, or one of whose compute tasks
/// panics (re-raised on the engine thread).
enum Faulty {
    Stuck,
    Panics,
    PanicsInTask(bulkhead_kernels::threads::Threads),
    /// The device is lost mid-step (a sticky CUDA error).
    DeviceLost,
    /// No fault: the CPU backend (what a restart builds).
    Works(Box<bulkhead_kernels::backend::cpu::CpuBackend>),
}

impl bulkhead_kernels::backend::Backend for Faulty {
    fn name(&self) -> String {
        "faulty".into()
    }

    fn step_tokens_max(&self) -> usize {
        64
    }

    fn step_logits_max(&self) -> usize {
        64
    }

    fn step(
        &mut self,
        steps: &[bulkhead_kernels::backend::SeqStep<'_>],
        pool: &mut bulkhead_kernels::kv::Pool,
    ) -> Result<bulkhead_kernels::backend::Logits<'_>, bulkhead_kernels::backend::StepError> {
        match self {
            Faulty::Stuck => loop {
                std::thread::sleep(Duration::from_secs(3600));
            },
            Faulty::Panics => panic!("planted: the step's ownership check failed"),
            Faulty::PanicsInTask(threads) => {
                threads.run(4, &|task, _| {
                    assert_ne!(task, 3, "planted: a compute task's check failed");
                });
                unreachable!("the task's panic is re-raised on the engine thread")
            }
            Faulty::DeviceLost => Err(bulkhead_kernels::backend::StepError::DeviceLost(
                "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered".into(),
            )),
            Faulty::Works(backend) => backend.step(steps, pool),
        }
    }
}

/// The tests' one tenant.
fn alpha() -> TenantLimits {
    TenantLimits {
        id: TenantId(0),
        name: "alpha".into(),
        weight: 1,
        queue_depth_max: 4,
        running_max: 4,
        pages_reserved: 8,
        pages_max: 8,
        prefix_cache: true,
    }
}

/// A scheduler over the tiny model's pool with `backend` and `tenants`.
fn faulty_scheduler(backend: Faulty, tenants: Vec<TenantLimits>) -> Scheduler<Faulty> {
    let (model, tokenizer) = tiny(&TinySpec::default());
    let spec = engine_spec(1);
    let pool = build::pool(&model, &spec).unwrap();
    let limits = BatchLimits {
        step_tokens_max: 64,
        step_seqs_max: 4,
    };
    Scheduler::new(backend, pool, tokenizer, limits, tenants).unwrap()
}

/// An engine over the tiny model's pool with `backend`, one tenant, and one
/// request submitted to it (so the thread enters a step).
fn faulty_engine(
    backend: Faulty,
) -> (
    EngineService,
    Admission,
    tokio::sync::mpsc::UnboundedReceiver<Event>,
) {
    let scheduler = faulty_scheduler(backend, vec![alpha()]);
    let admission = scheduler.admission(64);
    let service = EngineService::start(scheduler).unwrap();
    assert!(service.handle().is_accepting());
    let (r, rx) = request(1, 4);
    runtime()
        .block_on(service.handle().submit(admission.admit(r).unwrap()))
        .unwrap();
    (service, admission, rx)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// A shutdown returns even when the engine thread never stops: it waits the
/// drain deadline plus a grace, then leaves the thread behind (before, it
/// joined for ever and the server never exited).
#[test]
fn shutdown_returns_even_when_the_engine_thread_is_stuck() {
    use bulkhead::engine::service::ENGINE_STOP_GRACE;
    let (service, _admission, _rx) = faulty_engine(Faulty::Stuck);
    // Let the thread enter its step.
    std::thread::sleep(Duration::from_millis(100));
    let started = Instant::now();
    service.shutdown(Duration::ZERO, FinishReason::Shutdown);
    let took = started.elapsed();
    assert!(
        took >= ENGINE_STOP_GRACE,
        "returned before the grace: {took:?}"
    );
    assert!(took < ENGINE_STOP_GRACE * 2, "took {took:?}");
}

/// An unsupervised engine thread that panics ends its requests with
/// `engine_fault` and stops accepting: readiness (which reads the same flag)
/// turns false, and a submission is refused, where before the server kept
/// answering ready.
#[test]
fn an_engine_thread_that_panics_stops_accepting() {
    let (service, admission, mut rx) = faulty_engine(Faulty::Panics);
    let handle = service.handle();
    let runtime = runtime();
    assert_eq!(
        runtime.block_on(finished(&mut rx)),
        FinishReason::EngineFault
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while handle.is_accepting() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        !handle.is_accepting(),
        "still accepting after the engine thread died"
    );
    let (r, _rx) = request(2, 4);
    assert!(matches!(
        runtime.block_on(handle.submit(admission.admit(r).unwrap())),
        Err(SubmitError::Unavailable)
    ));
    service.shutdown(Duration::ZERO, FinishReason::Shutdown);
}

#[test]
fn an_engine_whose_tokenizer_and_embedding_disagree_is_refused_at_build() {
    // Three tokens more than the embedding has rows: every step with one of
    // them would fail, taking the rest of its batch with it. Refused before
    // a pool is allocated or a thread started.
    let spec = TinySpec {
        extra_tokens: 3,
        ..TinySpec::default()
    };
    let (model, tokenizer) = tiny(&spec);
    let rows = model.config.vocab_len;
    assert_eq!(tokenizer.vocab_len(), rows + 3);
    let engine = engine_spec(1);
    let Err(error) = build::scheduler(&model, &tokenizer, &engine, Vec::new()) else {
        panic!("an engine with a mismatched vocabulary was built");
    };
    assert_eq!(
        error.to_string(),
        format!(
            "model: the tokenizer has {} tokens but the embedding table has {rows} rows",
            rows + 3
        )
    );
    // The same file without the extra tokens builds.
    let (model, tokenizer) = tiny(&TinySpec::default());
    assert!(build::scheduler(&model, &tokenizer, &engine, Vec::new()).is_ok());
}

/// What a finish sink heard of engine faults.
#[derive(Default)]
struct Faults(std::sync::Mutex<Vec<(u32, u32, Option<Duration>)>>);

impl FinishSink for Faults {
    fn finished(&self, _: RequestId, _: TenantId, _: FinishReason, _: Usage) {}

    fn engine_fault(&self, fault: &EngineFault<'_>) {
        assert_eq!(fault.model, "tiny");
        self.0
            .lock()
            .unwrap()
            .push((fault.requests_ended, fault.in_a_row, fault.restart_in));
    }
}

/// Waits until the engine accepts (or not), for at most 5 s.
fn await_accepting(handle: &bulkhead::engine::service::EngineHandle, want: bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while handle.is_accepting() != want && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(handle.is_accepting(), want);
}

/// A panic on the engine thread, or in one of its compute tasks, or a step
/// that lost its device (which the engine answers with a panic: nothing
/// more would run on it), ends the request in flight through the finish
/// path (`engine_fault`, a clear 5xx at the API), is reported, and the
/// supervisor rebuilds the engine for the same tenants after its backoff: a
/// request admitted as before is then served.
#[test]
fn a_supervised_engine_that_panics_ends_its_requests_and_restarts() {
    let policy = RestartPolicy {
        restarts_max: 3,
        backoff_initial: Duration::from_millis(50),
        backoff_max: Duration::from_secs(1),
        stable_after: Duration::from_secs(60),
    };
    for planted in [
        Faulty::Panics,
        Faulty::PanicsInTask(bulkhead_kernels::threads::Threads::new(2)),
        Faulty::DeviceLost,
    ] {
        let faults = Arc::new(Faults::default());
        let mut scheduler = faulty_scheduler(planted, vec![alpha()]);
        scheduler.set_finish_sink(Arc::clone(&faults) as Arc<dyn FinishSink>);
        let admission = scheduler.admission(64);
        let rebuilt_for = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = Arc::clone(&rebuilt_for);
        let rebuild = Box::new(move |tenants: Vec<TenantLimits>| {
            seen.lock().unwrap().push(tenants.clone());
            let (model, _) = tiny(&TinySpec::default());
            let backend = Box::new(build::backend(&model, &engine_spec(1)));
            Ok(faulty_scheduler(Faulty::Works(backend), tenants))
        });
        let supervision = Supervision {
            model: "tiny".into(),
            policy,
            rebuild,
        };
        let service = EngineService::start_supervised(scheduler, supervision).unwrap();
        let handle = service.handle();
        let runtime = runtime();
        let (r1, mut rx1) = request(1, 4);
        runtime
            .block_on(handle.submit(admission.admit(r1).unwrap()))
            .unwrap();
        assert_eq!(
            runtime.block_on(finished(&mut rx1)),
            FinishReason::EngineFault
        );
        await_accepting(&handle, true);
        assert_eq!(*rebuilt_for.lock().unwrap(), vec![vec![alpha()]]);
        assert_eq!(
            *faults.0.lock().unwrap(),
            vec![(1, 1, Some(Duration::from_millis(50)))]
        );
        // Admitted for the first engine's pool, as the API layer still does.
        let (r2, mut rx2) = request(2, 4);
        runtime
            .block_on(handle.submit(admission.admit(r2).unwrap()))
            .unwrap();
        let reason = runtime.block_on(finished(&mut rx2));
        assert!(
            matches!(reason, FinishReason::Length | FinishReason::Stop),
            "{reason:?}"
        );
        // The rebuilt engine's counts go on from the broken one's (the
        // metrics recorder keeps a counter's largest value: counts begun
        // again at zero would hold it still). Published after the turn.
        let enqueued = || handle.stats().tenants[0].counts.enqueued_total;
        let deadline = Instant::now() + Duration::from_secs(5);
        while enqueued() < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(enqueued(), 2, "one request in each engine");
        service.shutdown(Duration::ZERO, FinishReason::Shutdown);
    }
}

/// An engine that panics again after every restart stays down after
/// `restarts_max` restarts: not accepting, submissions refused, each fault
/// reported with its count and the last with no restart; shutdown still
/// returns at once.
#[test]
fn an_engine_that_keeps_panicking_stays_down() {
    let policy = RestartPolicy {
        restarts_max: 2,
        backoff_initial: Duration::from_millis(10),
        backoff_max: Duration::from_millis(15),
        stable_after: Duration::from_secs(60),
    };
    let faults = Arc::new(Faults::default());
    let mut scheduler = faulty_scheduler(Faulty::Panics, vec![alpha()]);
    scheduler.set_finish_sink(Arc::clone(&faults) as Arc<dyn FinishSink>);
    let admission = scheduler.admission(64);
    let supervision = Supervision {
        model: "tiny".into(),
        policy,
        rebuild: Box::new(|tenants| Ok(faulty_scheduler(Faulty::Panics, tenants))),
    };
    let service = EngineService::start_supervised(scheduler, supervision).unwrap();
    let handle = service.handle();
    let runtime = runtime();
    for id in 1..=3 {
        await_accepting(&handle, true);
        let (r, mut rx) = request(id, 4);
        runtime
            .block_on(handle.submit(admission.admit(r).unwrap()))
            .unwrap();
        assert_eq!(
            runtime.block_on(finished(&mut rx)),
            FinishReason::EngineFault
        );
    }
    assert!(!handle.is_accepting());
    std::thread::sleep(Duration::from_millis(100));
    assert!(!handle.is_accepting(), "restarted past restarts_max");
    let (r, _rx) = request(9, 4);
    assert_eq!(
        runtime.block_on(handle.submit(admission.admit(r).unwrap())),
        Err(SubmitError::Unavailable)
    );
    assert_eq!(
        *faults.0.lock().unwrap(),
        vec![
            (1, 1, Some(Duration::from_millis(10))),
            (1, 2, Some(Duration::from_millis(15))),
            (1, 3, None),
        ]
    );
    let started = Instant::now();
    service.shutdown(Duration::ZERO, FinishReason::Shutdown);
    assert!(started.elapsed() < Duration::from_secs(2));
}
