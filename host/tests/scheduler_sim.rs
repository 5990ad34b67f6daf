//! The scheduler driven step by step on a tiny generated model, with a
//! simulated clock: every request ends through one finish path, pages come
//! back, tenants are isolated and share the engine by weight. The pool's
//! invariant checker runs after every tick.

use bulkhead::engine::admission::Admission;
use bulkhead::engine::build::{self, EngineSpec};
use bulkhead::engine::request::{Event, FinishReason, NewRequest, Rejection, RequestId};
use bulkhead::engine::sampling::SamplingParams;
use bulkhead::engine::scheduler::{BatchLimits, Scheduler, TenantChangeError, TenantLimits};
use bulkhead::tenancy::TenantId;
use bulkhead_kernels::backend::cpu::CpuBackend;
use bulkhead_kernels::gguf::Gguf;
use bulkhead_kernels::kv::{OwnerTag, PoolOptions};
use bulkhead_kernels::model::Model;
use bulkhead_kernels::testing::{tiny_llama, TinySpec};
use bulkhead_kernels::tokenizer::Tokenizer;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

const PAGE_TOKENS: u32 = 4;
const ALPHA: TenantId = TenantId(0);
const BETA: TenantId = TenantId(1);

struct Sim {
    scheduler: Scheduler<CpuBackend>,
    admission: Admission,
    now: Instant,
    next_id: u64,
}

struct Tenant {
    id: TenantId,
    weight: u32,
    pages_reserved: u32,
    pages_max: u32,
    queue_depth_max: u32,
}

fn tenant(id: TenantId, weight: u32, pages_reserved: u32, pages_max: u32) -> Tenant {
    Tenant {
        id,
        weight,
        pages_reserved,
        pages_max,
        queue_depth_max: 64,
    }
}

fn sim(tenants: &[Tenant], pool_pages: u32, limits: BatchLimits) -> Sim {
    let gguf = Arc::new(Gguf::from_bytes(tiny_llama(&TinySpec::default())).unwrap());
    let model = Arc::new(Model::load(Arc::clone(&gguf)).unwrap());
    let tokenizer = Arc::new(Tokenizer::from_gguf(&gguf).unwrap());
    let spec = EngineSpec {
        pool_pages,
        page_tokens: PAGE_TOKENS,
        threads: 2,
        step_tokens_max: limits.step_tokens_max,
        step_seqs_max: limits.step_seqs_max,
        pool_options: PoolOptions {
            poison_released: true,
            paranoid: true,
        },
    };
    let tenant_limits = tenants
        .iter()
        .map(|t| TenantLimits {
            id: t.id,
            name: format!("t{}", t.id.0),
            weight: t.weight,
            queue_depth_max: t.queue_depth_max,
            running_max: 16,
            pages_reserved: t.pages_reserved,
            pages_max: t.pages_max,
        })
        .collect();
    let scheduler = build::scheduler(&model, &tokenizer, &spec, tenant_limits).unwrap();
    Sim {
        admission: scheduler.admission(model.config.context_len as u32),
        scheduler,
        now: Instant::now(),
        next_id: 1,
    }
}

const LIMITS: BatchLimits = BatchLimits {
    step_tokens_max: 32,
    step_seqs_max: 8,
};

impl Sim {
    fn request(
        &mut self,
        tenant: TenantId,
        prompt: Vec<u32>,
        max_tokens: u32,
    ) -> (NewRequest, UnboundedReceiver<Event>) {
        let (tx, rx) = unbounded_channel();
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let request = NewRequest {
            id,
            tenant,
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            deadline: self.now + Duration::from_secs(60),
            events: tx,
        };
        (request, rx)
    }

    fn submit(
        &mut self,
        tenant: TenantId,
        prompt: Vec<u32>,
        max_tokens: u32,
    ) -> UnboundedReceiver<Event> {
        let (request, rx) = self.request(tenant, prompt, max_tokens);
        let admitted = self.admission.admit(request).expect("fits");
        self.scheduler.enqueue(admitted).expect("queue has room");
        rx
    }

    fn tick(&mut self) {
        self.now += Duration::from_millis(10);
        self.scheduler.tick(self.now);
        self.scheduler
            .pool()
            .check_invariants()
            .expect("pool invariants after every tick");
    }

    fn run_to_idle(&mut self) {
        for _ in 0..10_000 {
            if self.scheduler.in_flight() == 0 {
                return;
            }
            self.tick();
        }
        panic!("the scheduler did not drain");
    }

    fn assert_all_pages_free(&self) {
        let stats = self.scheduler.pool().stats();
        assert_eq!(stats.pages_owned, 0, "{stats:?}");
        assert_eq!(stats.pages_released, 0, "{stats:?}");
    }
}

/// Everything a request's channel received: its text and how it ended.
fn drain(rx: &mut UnboundedReceiver<Event>) -> (String, Option<(FinishReason, u32)>) {
    let mut text = String::new();
    let mut end = None;
    while let Ok(event) = rx.try_recv() {
        match event {
            Event::Text(t) => {
                assert!(end.is_none(), "no event after Finished");
                text.push_str(&t);
            }
            Event::Finished { reason, usage } => end = Some((reason, usage.completion_tokens)),
        }
    }
    (text, end)
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 97 + (seed * 7 + i * 3) % 26)
        .collect()
}

#[test]
fn serves_every_request_and_returns_every_page() {
    let mut s = sim(
        &[tenant(ALPHA, 1, 32, 64), tenant(BETA, 1, 32, 64)],
        64,
        LIMITS,
    );
    let mut receivers: Vec<_> = (0..10)
        .map(|i| {
            let t = if i % 2 == 0 { ALPHA } else { BETA };
            s.submit(t, prompt(i, 5 + i as usize * 3), 6)
        })
        .collect();
    s.run_to_idle();
    for rx in &mut receivers {
        let (text, end) = drain(rx);
        let (reason, completion) = end.expect("every request finishes");
        assert!(
            matches!(reason, FinishReason::Length | FinishReason::Stop),
            "{reason:?}"
        );
        assert!(completion <= 6);
        if reason == FinishReason::Length {
            assert_eq!(completion, 6);
            assert!(!text.is_empty());
        }
    }
    s.assert_all_pages_free();
}

#[test]
fn a_request_gets_the_same_tokens_alone_and_among_other_tenants() {
    let solo = {
        let mut s = sim(
            &[tenant(ALPHA, 1, 32, 64), tenant(BETA, 1, 32, 64)],
            64,
            LIMITS,
        );
        let mut rx = s.submit(BETA, prompt(3, 13), 10);
        s.run_to_idle();
        drain(&mut rx)
    };
    let mut s = sim(
        &[tenant(ALPHA, 1, 32, 64), tenant(BETA, 1, 32, 64)],
        64,
        LIMITS,
    );
    let mut noise: Vec<_> = (0..4)
        .map(|i| s.submit(ALPHA, prompt(10 + i, 20), 12))
        .collect();
    let mut rx = s.submit(BETA, prompt(3, 13), 10);
    s.run_to_idle();
    assert_eq!(
        drain(&mut rx),
        solo,
        "batching with another tenant changed the output"
    );
    for rx in &mut noise {
        assert!(drain(rx).1.is_some());
    }
    s.assert_all_pages_free();
}

#[test]
fn rejects_what_cannot_fit_before_touching_anything() {
    let mut s = sim(&[tenant(ALPHA, 1, 32, 64)], 64, LIMITS);
    let before = s.scheduler.pool().stats();
    let (r, _rx) = s.request(ALPHA, prompt(1, 200), 57);
    assert!(matches!(
        s.admission.admit(r),
        Err(Rejection::ContextLengthExceeded { .. })
    ));
    let (r, _rx) = s.request(ALPHA, Vec::new(), 5);
    assert!(matches!(s.admission.admit(r), Err(Rejection::EmptyPrompt)));
    let (r, _rx) = s.request(ALPHA, prompt(1, 3), 0);
    assert!(matches!(
        s.admission.admit(r),
        Err(Rejection::ZeroMaxTokens)
    ));
    assert_eq!(s.scheduler.pool().stats(), before);
    assert_eq!(s.scheduler.in_flight(), 0);
}

#[test]
fn a_full_queue_refuses_and_others_are_unaffected() {
    let mut a = tenant(ALPHA, 1, 8, 8);
    a.queue_depth_max = 2;
    let mut s = sim(&[a, tenant(BETA, 1, 8, 8)], 16, LIMITS);
    let _r1 = s.submit(ALPHA, prompt(1, 4), 4);
    let _r2 = s.submit(ALPHA, prompt(2, 4), 4);
    let (third, _rx) = s.request(ALPHA, prompt(3, 4), 4);
    let admitted = s.admission.admit(third).unwrap();
    assert_eq!(
        s.scheduler.enqueue(admitted).err(),
        Some(Rejection::QueueFull)
    );
    let mut beta = s.submit(BETA, prompt(4, 4), 4);
    s.run_to_idle();
    assert!(drain(&mut beta).1.is_some());
}

#[test]
fn a_client_that_goes_away_frees_its_pages_within_one_step() {
    let mut s = sim(&[tenant(ALPHA, 1, 32, 64)], 64, LIMITS);
    let rx = s.submit(ALPHA, prompt(1, 40), 20);
    s.tick();
    s.tick();
    assert!(s.scheduler.pool().stats().pages_owned > 0);
    drop(rx);
    s.tick();
    s.assert_all_pages_free();
    assert_eq!(s.scheduler.in_flight(), 0);
}

#[test]
fn deadlines_end_queued_and_running_requests() {
    let mut s = sim(&[tenant(ALPHA, 1, 16, 16)], 16, LIMITS);
    let mut running = s.submit(ALPHA, prompt(1, 30), 30); // 15 pages: all of them
    let mut queued = s.submit(ALPHA, prompt(2, 30), 30);
    s.tick();
    assert_eq!(s.scheduler.queued(ALPHA), 1, "the second waits for pages");
    s.now += Duration::from_secs(61);
    s.tick();
    assert_eq!(
        drain(&mut running).1.map(|e| e.0),
        Some(FinishReason::Timeout)
    );
    assert_eq!(
        drain(&mut queued).1.map(|e| e.0),
        Some(FinishReason::Timeout)
    );
    s.assert_all_pages_free();
}

#[test]
fn one_tenant_flooding_cannot_take_anothers_reserved_pages() {
    let mut s = sim(
        &[tenant(ALPHA, 1, 8, 24), tenant(BETA, 1, 8, 24)],
        32,
        LIMITS,
    );
    let _flood: Vec<_> = (0..12)
        .map(|i| s.submit(ALPHA, prompt(i, 12), 12))
        .collect();
    s.tick();
    let alpha = s
        .scheduler
        .pool()
        .partition_stats(OwnerTag(ALPHA.0))
        .unwrap();
    assert_eq!(
        alpha.pages_owned, 24,
        "alpha uses its reservation and the burst region, up to its max"
    );
    let mut beta = s.submit(BETA, prompt(99, 12), 12);
    s.tick();
    let beta_stats = s
        .scheduler
        .pool()
        .partition_stats(OwnerTag(BETA.0))
        .unwrap();
    assert_eq!(
        beta_stats.pages_owned, 6,
        "beta starts at once in its reserved pages"
    );
    s.run_to_idle();
    assert_eq!(drain(&mut beta).1.map(|e| e.1), Some(12));
    s.assert_all_pages_free();
}

#[test]
fn tenants_share_steps_by_weight() {
    let limits = BatchLimits {
        step_tokens_max: 16,
        step_seqs_max: 4,
    };
    let mut s = sim(
        &[tenant(ALPHA, 3, 256, 256), tenant(BETA, 1, 256, 256)],
        512,
        limits,
    );
    // Long prompts keep both tenants in prefill, where the token budget binds:
    // each step's 16 tokens go to the tenant with the least virtual time.
    let _a: Vec<_> = (0..4).map(|i| s.submit(ALPHA, prompt(i, 200), 1)).collect();
    let _b: Vec<_> = (0..2)
        .map(|i| s.submit(BETA, prompt(10 + i, 200), 1))
        .collect();
    for _ in 0..32 {
        s.tick();
    }
    let a = s.scheduler.tokens_processed(ALPHA) as f64;
    let b = s.scheduler.tokens_processed(BETA) as f64;
    // Weight 3:1 over 32 one-tenant steps: 24:8, give or take one step.
    assert!(
        (23.0 * 16.0..=25.0 * 16.0).contains(&a),
        "alpha:beta tokens = {a}:{b}"
    );
    assert_eq!(a + b, 32.0 * 16.0);
}

#[test]
fn a_request_admitted_for_another_models_pool_is_refused_and_costs_nothing() {
    // Two engines of the same model and geometry: pages_needed means the same
    // thing in both, yet an admission of one is refused by the other.
    let mut ours = sim(&[tenant(ALPHA, 1, 16, 16)], 16, LIMITS);
    let mut theirs = sim(&[tenant(ALPHA, 1, 16, 16)], 16, LIMITS);
    let (request, _rx) = theirs.request(ALPHA, prompt(1, 8), 8);
    let admitted = theirs.admission.admit(request).unwrap();
    assert_eq!(
        ours.scheduler.enqueue(admitted).err(),
        Some(Rejection::ForeignPool)
    );
    assert_eq!(ours.scheduler.in_flight(), 0);
    let stats = ours.scheduler.stats();
    assert_eq!(stats.tenants[0].counts.enqueued_total, 0);
    // Its own admission still works.
    let mut rx = ours.submit(ALPHA, prompt(2, 8), 4);
    ours.run_to_idle();
    assert!(drain(&mut rx).1.is_some());
}

#[test]
fn shutdown_ends_queued_and_running_requests_and_frees_every_page() {
    let mut s = sim(&[tenant(ALPHA, 1, 16, 16)], 16, LIMITS);
    let mut running = s.submit(ALPHA, prompt(1, 30), 30);
    let mut queued = s.submit(ALPHA, prompt(2, 30), 30);
    s.tick();
    assert_eq!(s.scheduler.finish_everything(FinishReason::Shutdown), 2);
    assert_eq!(
        drain(&mut running).1.map(|e| e.0),
        Some(FinishReason::Shutdown)
    );
    assert_eq!(
        drain(&mut queued).1.map(|e| e.0),
        Some(FinishReason::Shutdown)
    );
    assert_eq!(s.scheduler.in_flight(), 0);
    s.assert_all_pages_free();
    s.scheduler.pool().check_invariants().unwrap();
}

#[test]
fn a_tenant_back_from_idle_does_not_starve_the_busy_one() {
    let limits = BatchLimits {
        step_tokens_max: 16,
        step_seqs_max: 4,
    };
    let mut s = sim(
        &[tenant(ALPHA, 1, 256, 256), tenant(BETA, 1, 256, 256)],
        512,
        limits,
    );
    // Alpha works alone for 20 steps, building up virtual time.
    let _a: Vec<_> = (0..2).map(|i| s.submit(ALPHA, prompt(i, 200), 1)).collect();
    for _ in 0..20 {
        s.tick();
    }
    let alpha_before = s.scheduler.tokens_processed(ALPHA);
    // Beta arrives: with equal weights the next steps alternate, instead of beta
    // taking every step until its clock catches up with alpha's 20 steps.
    let _b: Vec<_> = (0..2)
        .map(|i| s.submit(BETA, prompt(10 + i, 200), 1))
        .collect();
    for _ in 0..10 {
        s.tick();
    }
    let alpha = s.scheduler.tokens_processed(ALPHA) - alpha_before;
    let beta = s.scheduler.tokens_processed(BETA);
    assert!(
        alpha >= 4 * 16 && beta >= 4 * 16,
        "alpha {alpha}, beta {beta} tokens in 10 shared steps"
    );
}

const GAMMA: TenantId = TenantId(7);

#[test]
fn removing_a_tenant_ends_its_requests_frees_its_partition_and_spares_the_others() {
    let mut s = sim(
        &[tenant(ALPHA, 1, 16, 32), tenant(BETA, 1, 16, 32)],
        64,
        LIMITS,
    );
    // Alpha: two running (running_max is 16, but the pages allow two of these),
    // one queued behind them; beta: one running.
    let mut alpha: Vec<_> = (0..3).map(|i| s.submit(ALPHA, prompt(i, 40), 20)).collect();
    let mut beta = s.submit(BETA, prompt(9, 8), 12);
    s.tick();
    s.tick();
    assert!(
        s.scheduler.queued(ALPHA) >= 1,
        "one of alpha's waits for pages"
    );
    let owner = OwnerTag(ALPHA.0);
    assert!(
        s.scheduler
            .pool()
            .partition_stats(owner)
            .unwrap()
            .pages_owned
            > 0
    );

    let ended = s.scheduler.remove_tenant(ALPHA).unwrap();
    assert_eq!(ended, 3);
    s.scheduler.pool().check_invariants().unwrap();
    assert!(
        s.scheduler.pool().partition_stats(owner).is_none(),
        "the partition is gone"
    );
    for rx in &mut alpha {
        let (_, end) = drain(rx);
        assert_eq!(end.map(|e| e.0), Some(FinishReason::TenantRemoved));
    }
    // The pages alpha held are clean and free again; beta runs on untouched.
    assert_eq!(
        s.scheduler.pool().stats().pages_released,
        0,
        "scrubbed before the partition went"
    );
    s.run_to_idle();
    let (_, end) = drain(&mut beta);
    assert!(matches!(
        end.map(|e| e.0),
        Some(FinishReason::Length | FinishReason::Stop)
    ));
    s.assert_all_pages_free();
    // A request of the removed tenant still on its way in is refused, not a panic.
    let (request, _rx) = s.request(ALPHA, prompt(1, 4), 2);
    let admitted = s.admission.admit(request).unwrap();
    assert_eq!(
        s.scheduler.enqueue(admitted).err(),
        Some(Rejection::TenantRemoved)
    );
    assert!(matches!(
        s.scheduler.remove_tenant(ALPHA),
        Err(TenantChangeError::Unknown(_))
    ));
}

#[test]
fn a_tenant_added_while_serving_is_served_and_its_limits_change_between_steps() {
    let mut s = sim(&[tenant(ALPHA, 1, 16, 32)], 64, LIMITS);
    let mut busy = s.submit(ALPHA, prompt(1, 20), 30);
    s.tick();
    let mut gamma = TenantLimits {
        id: GAMMA,
        name: "gamma".into(),
        weight: 1,
        queue_depth_max: 1,
        running_max: 1,
        pages_reserved: 16,
        pages_max: 16,
    };
    s.scheduler.add_tenant(gamma.clone()).unwrap();
    assert!(matches!(
        s.scheduler.add_tenant(gamma.clone()),
        Err(TenantChangeError::Exists(_))
    ));
    let mut first = s.submit(GAMMA, prompt(2, 6), 4);
    s.tick();
    // running_max 1 and queue_depth_max 1: the second waits, the third is refused.
    let _second = s.submit(GAMMA, prompt(3, 6), 4);
    let (request, _rx) = s.request(GAMMA, prompt(4, 6), 4);
    let admitted = s.admission.admit(request).unwrap();
    assert_eq!(
        s.scheduler.enqueue(admitted).err(),
        Some(Rejection::QueueFull)
    );
    // A larger queue governs the next admission.
    gamma.queue_depth_max = 4;
    s.scheduler.update_tenant(gamma.clone()).unwrap();
    let _third = s.submit(GAMMA, prompt(4, 6), 4);
    // A maximum below what gamma holds now is refused, changing nothing.
    s.tick();
    gamma.pages_max = 0;
    gamma.pages_reserved = 0;
    assert!(s.scheduler.update_tenant(gamma).is_err());
    s.run_to_idle();
    for rx in [&mut busy, &mut first] {
        let (_, end) = drain(rx);
        assert!(matches!(
            end.map(|e| e.0),
            Some(FinishReason::Length | FinishReason::Stop)
        ));
    }
    s.assert_all_pages_free();
}
