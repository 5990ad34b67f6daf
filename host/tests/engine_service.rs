//! The scheduler on its own thread: submissions from async code are answered
//! at once, requests stream to completion, and shutdown drains then stops.

use bulkhead::engine::admission::Admission;
use bulkhead::engine::build::{self, EngineSpec};
use bulkhead::engine::request::{Event, FinishReason, NewRequest, Rejection, RequestId};
use bulkhead::engine::sampling::SamplingParams;
use bulkhead::engine::scheduler::TenantLimits;
use bulkhead::engine::service::{EngineService, SubmitError};
use bulkhead::tenancy::TenantId;
use bulkhead_kernels::gguf::Gguf;
use bulkhead_kernels::kv::{KvType, PoolOptions};
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
/// loop, or one whose ownership check panics.
enum Faulty {
    Stuck,
    Panics,
}

impl bulkhead_kernels::backend::Backend for Faulty {
    fn name(&self) -> String {
        "faulty".into()
    }

    fn step_tokens_max(&self) -> usize {
        64
    }

    fn step(
        &mut self,
        _steps: &[bulkhead_kernels::backend::SeqStep<'_>],
        _pool: &mut bulkhead_kernels::kv::Pool,
    ) -> Result<bulkhead_kernels::backend::Logits<'_>, bulkhead_kernels::backend::StepError> {
        match self {
            Faulty::Stuck => loop {
                std::thread::sleep(Duration::from_secs(3600));
            },
            Faulty::Panics => panic!("planted: the step's ownership check failed"),
        }
    }
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
    use bulkhead::engine::scheduler::{BatchLimits, Scheduler};
    let (model, tokenizer) = tiny(&TinySpec::default());
    let spec = engine_spec(1);
    let pool = build::pool(&model, &spec).unwrap();
    let limits = BatchLimits {
        step_tokens_max: 64,
        step_seqs_max: 4,
    };
    let tenant = TenantLimits {
        id: TenantId(0),
        name: "alpha".into(),
        weight: 1,
        queue_depth_max: 4,
        running_max: 4,
        pages_reserved: 8,
        pages_max: 8,
        prefix_cache: true,
    };
    let scheduler = Scheduler::new(backend, pool, tokenizer, limits, vec![tenant]).unwrap();
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

/// An engine thread that panics stops accepting at once: readiness (which
/// reads the same flag) turns false, and a submission is refused, where
/// before the server kept answering ready.
#[test]
fn an_engine_thread_that_panics_stops_accepting() {
    let (service, admission, mut rx) = faulty_engine(Faulty::Panics);
    let handle = service.handle();
    let runtime = runtime();
    // The request's channel closes with the thread (its sender is dropped in
    // the unwind), and the engine says it is not accepting.
    runtime.block_on(async { while rx.recv().await.is_some() {} });
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
