//! The scheduler driven step by step on a tiny generated model, with a
//! simulated clock: every request ends through one finish path, pages come
//! back, tenants are isolated and share the engine by weight. The pool's
//! invariant checker runs after every tick.

use bulkhead::engine::admission::Admission;
use bulkhead::engine::build::{self, EngineSpec};
use bulkhead::engine::request::{Event, FinishReason, NewRequest, Rejection, RequestId, Usage};
use bulkhead::engine::sampling::SamplingParams;
use bulkhead::engine::scheduler::{BatchLimits, Scheduler, TenantChangeError, TenantLimits};
use bulkhead::tenancy::TenantId;
use bulkhead_kernels::backend::Pick;
use bulkhead_kernels::gguf::Gguf;
use bulkhead_kernels::kv::{KvType, OwnerTag, PoolOptions};
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
    scheduler: Scheduler<bulkhead::engine::build::EngineBackend>,
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
    running_max: u32,
    prefix_cache: bool,
}

fn tenant(id: TenantId, weight: u32, pages_reserved: u32, pages_max: u32) -> Tenant {
    Tenant {
        id,
        weight,
        pages_reserved,
        pages_max,
        queue_depth_max: 64,
        running_max: 16,
        prefix_cache: true,
    }
}

fn sim(tenants: &[Tenant], pool_pages: u32, limits: BatchLimits) -> Sim {
    let gguf = Arc::new(Gguf::from_bytes(tiny_llama(&TinySpec::default())).unwrap());
    let model = Arc::new(Model::load(Arc::clone(&gguf)).unwrap());
    let tokenizer = Arc::new(Tokenizer::from_gguf(&gguf).unwrap());
    let spec = EngineSpec {
        pool_pages,
        page_tokens: PAGE_TOKENS,
        kv_type: KvType::default(),
        threads: 2,
        step_tokens_max: limits.step_tokens_max,
        step_seqs_max: limits.step_seqs_max,
        pool_options: PoolOptions {
            poison_released: true,
            paranoid: true,
        },
        placement: bulkhead::engine::placement::Placement::Cpu,
        cuda: Default::default(),
    };
    let tenant_limits = tenants
        .iter()
        .map(|t| TenantLimits {
            id: t.id,
            name: format!("t{}", t.id.0),
            weight: t.weight,
            queue_depth_max: t.queue_depth_max,
            running_max: t.running_max,
            pages_reserved: t.pages_reserved,
            pages_max: t.pages_max,
            prefix_cache: t.prefix_cache,
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
            cache_salt: None,
            prefill_hint: None,
        };
        (request, rx)
    }

    fn submit(
        &mut self,
        tenant: TenantId,
        prompt: Vec<u32>,
        max_tokens: u32,
    ) -> UnboundedReceiver<Event> {
        self.submit_sampled(tenant, prompt, max_tokens, SamplingParams::default())
    }

    fn submit_sampled(
        &mut self,
        tenant: TenantId,
        prompt: Vec<u32>,
        max_tokens: u32,
        sampling: SamplingParams,
    ) -> UnboundedReceiver<Event> {
        let (mut request, rx) = self.request(tenant, prompt, max_tokens);
        request.sampling = sampling;
        let admitted = self.admission.admit(request).expect("fits");
        self.scheduler.enqueue(admitted).expect("queue has room");
        rx
    }

    fn tick(&mut self) {
        self.now += Duration::from_millis(10);
        self.scheduler.tick(self.now);
        self.scheduler
            .check()
            .expect("pool, page-table and cache invariants after every tick");
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
            Event::Logprob(_) | Event::PromptLogprob(_) => {
                assert!(end.is_none(), "no event after Finished")
            }
            Event::Finished { reason, usage } => end = Some((reason, usage.completion_tokens)),
        }
    }
    (text, end)
}

/// Everything a request's channel received: its text, and its end with usage.
fn outcome(rx: &mut UnboundedReceiver<Event>) -> (String, Option<(FinishReason, Usage)>) {
    let mut text = String::new();
    let mut end = None;
    while let Ok(event) = rx.try_recv() {
        match event {
            Event::Text(t) => text.push_str(&t),
            Event::Logprob(_) | Event::PromptLogprob(_) => {}
            Event::Finished { reason, usage } => end = Some((reason, usage)),
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

/// Alpha and beta, alike: 32 pages reserved of 64 each, on a pool of 64.
fn two_tenants() -> Sim {
    sim(
        &[tenant(ALPHA, 1, 32, 64), tenant(BETA, 1, 32, 64)],
        64,
        LIMITS,
    )
}

/// What beta's 13-token prompt with 10 tokens to generate says with no one else.
fn beta_alone() -> (String, Option<(FinishReason, u32)>) {
    let mut s = two_tenants();
    let mut rx = s.submit(BETA, prompt(3, 13), 10);
    s.run_to_idle();
    drain(&mut rx)
}

#[test]
fn a_request_gets_the_same_tokens_alone_and_among_other_tenants() {
    let solo = beta_alone();
    let mut s = two_tenants();
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

/// With several rows in a step, sampling runs on the backend's two threads
/// (each sequence has its own sampler): seeded draws at temperature 1, with
/// a nucleus, a penalty and logprobs, say in a batch of six exactly what each
/// says alone, where its one row is sampled on the step's own thread.
#[test]
fn seeded_draws_sampled_in_parallel_in_a_batch_say_what_they_say_alone() {
    let sampling = |i: u32| SamplingParams {
        temperature: 1.0,
        top_p: 0.95,
        seed: 7 + u64::from(i),
        frequency_penalty: if i.is_multiple_of(3) { 0.5 } else { 0.0 },
        logprobs: i.is_multiple_of(2).then_some(3),
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let run = |requests: &[u32]| -> Vec<Vec<Event>> {
        let mut s = two_tenants();
        let mut receivers: Vec<_> = requests
            .iter()
            .map(|&i| {
                let tenant = if i % 2 == 0 { ALPHA } else { BETA };
                s.submit_sampled(tenant, prompt(i, 6), 12, sampling(i))
            })
            .collect();
        s.run_to_idle();
        s.assert_all_pages_free();
        receivers
            .iter_mut()
            .map(|rx| std::iter::from_fn(|| rx.try_recv().ok()).collect())
            .collect()
    };
    let batched = run(&[0, 1, 2, 3, 4, 5]);
    for (i, events) in batched.iter().enumerate() {
        let alone = run(&[i as u32]).remove(0);
        assert_eq!(events, &alone, "request {i} in a batch of six");
        let logprobs = events
            .iter()
            .filter(|e| matches!(e, Event::Logprob(_)))
            .count();
        assert_eq!(logprobs, if i % 2 == 0 { 12 } else { 0 }, "request {i}");
        assert!(matches!(
            events.last(),
            Some(Event::Finished {
                reason: FinishReason::Length,
                ..
            })
        ));
    }
    let distinct: std::collections::HashSet<String> =
        batched.iter().map(|events| format!("{events:?}")).collect();
    assert_eq!(distinct.len(), 6, "six seeds, six completions");
}

/// A step the backend refuses because of one sequence (a token id past the
/// embedding, which start-up checks make unreachable from the API) fails that
/// request alone: the other tenant's request in the same batch steps again
/// and says exactly what it says alone. Before, the whole batch failed.
#[test]
fn a_step_error_fails_only_the_sequence_it_concerns() {
    let solo = beta_alone();
    let mut s = two_tenants();
    let mut bad_prompt = prompt(1, 6);
    bad_prompt[4] = 999_999;
    let mut bad = s.submit(ALPHA, bad_prompt, 6);
    let mut good = s.submit(BETA, prompt(3, 13), 10);
    s.tick();
    let (text, end) = drain(&mut bad);
    assert_eq!((text.as_str(), end), ("", Some((FinishReason::Error, 0))));
    s.run_to_idle();
    assert_eq!(drain(&mut good), solo);
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
        alpha.pages_owned + alpha.pages_shared,
        24,
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
        beta_stats.pages_owned + beta_stats.pages_shared,
        6,
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
    s.scheduler.check().unwrap();
}

/// A flooding tenant's prompts fill whole steps only while it is the only
/// active tenant; another tenant's first chunk gets a step without them, and
/// while both are active the flooder takes its weighted share of each step.
#[test]
fn a_flooding_tenants_prompts_never_hold_anothers_first_token_for_long() {
    let limits = BatchLimits {
        step_tokens_max: 64,
        step_seqs_max: 8,
    };
    let mut s = sim(
        &[tenant(ALPHA, 2, 128, 256), tenant(BETA, 1, 128, 256)],
        512,
        limits,
    );
    let step = |s: &mut Sim| {
        let (a, b) = (
            s.scheduler.tokens_processed(ALPHA),
            s.scheduler.tokens_processed(BETA),
        );
        s.tick();
        (
            s.scheduler.tokens_processed(ALPHA) - a,
            s.scheduler.tokens_processed(BETA) - b,
        )
    };
    // Beta alone: its prompts fill every step.
    let _b: Vec<_> = (0..4)
        .map(|i| s.submit(BETA, prompt(10 + i, 200), 4))
        .collect();
    assert_eq!(step(&mut s), (0, 64));
    assert_eq!(step(&mut s), (0, 64));
    // Alpha's prompt arrives: its first chunk's step carries none of beta's
    // prompt tokens, and it has its first token after that one step.
    let mut alpha = s.submit(ALPHA, prompt(1, 40), 8);
    assert_eq!(step(&mut s), (40, 0));
    assert!(
        alpha.try_recv().is_ok(),
        "alpha's first token comes from its first step"
    );
    // Both active: beta takes its third of a step (21 tokens) beside alpha's
    // decode token, until alpha has been idle for a while.
    for _ in 0..4 {
        assert_eq!(step(&mut s), (1, 21));
    }
    s.run_to_idle();
    assert_eq!(drain(&mut alpha).1.map(|e| e.1), Some(8));
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
    s.scheduler.check().unwrap();
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
        prefix_cache: true,
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

// Prefix cache and reclaim (invariants I7, I8).

/// What a request produces alone on a fresh engine: the reference for outputs
/// under caching and preemption (greedy, so it must be exactly the same).
fn solo(prompt: Vec<u32>, max_tokens: u32) -> (String, FinishReason, u32) {
    let mut s = sim(&[tenant(ALPHA, 1, 64, 64)], 64, LIMITS);
    let mut rx = s.submit(ALPHA, prompt, max_tokens);
    s.run_to_idle();
    let (text, end) = outcome(&mut rx);
    let (reason, usage) = end.expect("finished");
    (text, reason, usage.completion_tokens)
}

fn text_end(rx: &mut UnboundedReceiver<Event>) -> ((String, FinishReason, u32), Usage) {
    let (text, end) = outcome(rx);
    let (reason, usage) = end.expect("finished");
    ((text, reason, usage.completion_tokens), usage)
}

/// The starvation case of the issue, scaled down: beta floods the burst region
/// with requests that fit its maximum; alpha's full-context request, within
/// its contract, must start within a bounded number of ticks.
#[test]
fn a_within_contract_request_reclaims_the_burst_region_from_a_flooding_tenant() {
    // 64 pages of 4 tokens; alpha 4 reserved / 32 max, beta 4 / 60; 8 slots.
    let mut s = sim(
        &[tenant(ALPHA, 1, 4, 32), tenant(BETA, 1, 4, 60)],
        64,
        LIMITS,
    );
    // Beta: 7 pages each (16 + 12 tokens), far more than fit: it holds every slot
    // and 56 pages, and takes each page as it frees.
    let beta_prompt = |i: u32| prompt(100 + i, 16);
    let mut beta: Vec<_> = (0..24)
        .map(|i| s.submit(BETA, beta_prompt(i), 12))
        .collect();
    for _ in 0..3 {
        s.tick();
    }
    assert_eq!(s.scheduler.running(BETA), 8, "beta holds every slot");
    // Alpha: 40 + 24 tokens, 16 pages; its reservation is 4.
    let alpha_prompt = prompt(7, 40);
    let mut alpha = s.submit(ALPHA, alpha_prompt.clone(), 24);
    let mut waited = 0;
    let mut preempted = 0;
    while s.scheduler.running(ALPHA) == 0 {
        // Beta keeps flooding meanwhile.
        beta.push(s.submit(BETA, beta_prompt(1000 + waited), 12));
        s.now += Duration::from_millis(10);
        preempted += s.scheduler.tick(s.now).preempted;
        s.scheduler.check().unwrap();
        waited += 1;
        assert!(
            waited <= 2,
            "alpha's request still waits after {waited} ticks"
        );
    }
    assert!(preempted > 0, "beta's youngest sequences were preempted");
    let beta_held = s
        .scheduler
        .pool()
        .partition_stats(OwnerTag(BETA.0))
        .unwrap();
    assert!(
        beta_held.pages_owned + beta_held.pages_shared >= 4,
        "beta keeps at least its reservation"
    );
    s.run_to_idle();
    // Alpha's output is what it is alone; every one of beta's requests (some of
    // them preempted and recomputed) finishes with exactly its solo output.
    let (alpha_out, _) = text_end(&mut alpha);
    assert_eq!(alpha_out, solo(alpha_prompt, 24));
    for (i, rx) in beta.iter_mut().enumerate().take(10) {
        let i = i as u32;
        let (out, _) = text_end(rx);
        assert_eq!(out, solo(beta_prompt(i), 12), "beta request {i}");
    }
    for rx in beta.iter_mut().skip(10) {
        let (_, end) = outcome(rx);
        assert!(matches!(
            end.map(|e| e.0),
            Some(FinishReason::Length | FinishReason::Stop)
        ));
    }
    s.assert_all_pages_free();
}

/// Preempted in the middle of its generation, a sequence resumes (its KV
/// recomputed from its tokens) and produces exactly what it would have.
#[test]
fn a_preempted_sequence_resumes_with_exactly_its_unpreempted_tokens() {
    let mut s = sim(
        &[tenant(ALPHA, 1, 4, 32), tenant(BETA, 1, 4, 60)],
        64,
        LIMITS,
    );
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| prompt(300 + i, 14)).collect();
    let mut beta: Vec<_> = prompts
        .iter()
        .map(|p| s.submit(BETA, p.clone(), 40))
        .collect();
    // 14 + 40 tokens: 14 pages each; four run (56 pages), four wait.
    for _ in 0..6 {
        s.tick();
    }
    let mut alpha = s.submit(ALPHA, prompt(8, 30), 30);
    s.now += Duration::from_millis(10);
    let report = s.scheduler.tick(s.now);
    s.scheduler.check().unwrap();
    assert!(report.preempted >= 1, "{report:?}");
    assert_eq!(s.scheduler.running(ALPHA), 1);
    s.run_to_idle();
    for (p, rx) in prompts.into_iter().zip(&mut beta) {
        let (out, _) = text_end(rx);
        assert_eq!(out, solo(p, 40), "a preempted request's output changed");
    }
    assert_eq!(text_end(&mut alpha).0, solo(prompt(8, 30), 30));
    s.assert_all_pages_free();
}

/// A tenant under its slot share starts at once when another holds every slot.
#[test]
fn each_tenant_is_guaranteed_its_share_of_sequence_slots() {
    let mut s = sim(
        &[tenant(ALPHA, 1, 16, 16), tenant(BETA, 1, 16, 48)],
        64,
        LIMITS,
    );
    let _beta: Vec<_> = (0..20).map(|i| s.submit(BETA, prompt(i, 5), 6)).collect();
    s.tick();
    assert_eq!(s.scheduler.running(BETA), 8, "beta took every slot");
    let mut alpha: Vec<_> = (0..4)
        .map(|i| s.submit(ALPHA, prompt(50 + i, 5), 6))
        .collect();
    s.tick();
    // Two tenants, eight slots: four are alpha's whenever it wants them.
    assert_eq!(s.scheduler.running(ALPHA), 4);
    assert_eq!(s.scheduler.running(BETA), 4);
    s.run_to_idle();
    for (i, rx) in alpha.iter_mut().enumerate() {
        assert_eq!(text_end(rx).0, solo(prompt(50 + i as u32, 5), 6));
    }
}

/// Slot guarantees follow the weights: one slot each, the rest of
/// `step_seqs_max` by weight. Alpha (weight 3) and beta (weight 1) both
/// flooding eight slots: alpha is owed 1 + 6·3/4 = 5, beta 1 + 6/4 = 2, and
/// the spare slot is lent; so alpha's share of the tokens follows its weight
/// while both are saturated, not an equal split.
#[test]
fn under_contention_slots_and_tokens_follow_the_weights() {
    let mut s = sim(
        &[tenant(ALPHA, 3, 16, 32), tenant(BETA, 1, 16, 32)],
        64,
        LIMITS,
    );
    let mut beta: Vec<_> = (0..24).map(|i| s.submit(BETA, prompt(i, 5), 6)).collect();
    s.tick();
    assert_eq!(s.scheduler.running(BETA), 8, "beta took every slot");
    let mut alpha: Vec<_> = (0..24)
        .map(|i| s.submit(ALPHA, prompt(50 + i, 5), 12))
        .collect();
    s.tick();
    assert_eq!(
        s.scheduler.running(ALPHA),
        5,
        "alpha reclaims its weighted share"
    );
    assert_eq!(s.scheduler.running(BETA), 3);
    // While both have queued work, alpha gets about 5/8 of the tokens (its
    // five slots; a slot emptied by a finish refills at the next tick).
    let (a0, b0) = (
        s.scheduler.tokens_processed(ALPHA),
        s.scheduler.tokens_processed(BETA),
    );
    while s.scheduler.queued(ALPHA) > 0 && s.scheduler.queued(BETA) > 0 {
        s.tick();
    }
    let alpha_tokens = s.scheduler.tokens_processed(ALPHA) - a0;
    let beta_tokens = s.scheduler.tokens_processed(BETA) - b0;
    let share = alpha_tokens as f64 / (alpha_tokens + beta_tokens) as f64;
    assert!(
        share >= 0.6,
        "alpha's share {share:.2} below its weight's 5/8"
    );
    s.run_to_idle();
    for rx in alpha.iter_mut().chain(beta.iter_mut()) {
        assert!(matches!(
            drain(rx).1,
            Some((FinishReason::Length | FinishReason::Stop, _))
        ));
    }
    s.assert_all_pages_free();
}

/// Three sequences of one tenant share a cached prefix; it outlives any one of
/// them, the pages are never written, and every output is what it is uncached.
#[test]
fn a_prefix_shared_by_three_sequences_survives_the_end_of_any_one() {
    let mut s = sim(&[tenant(ALPHA, 1, 48, 64)], 64, LIMITS);
    let system = prompt(1, 20); // five full pages
    let with = |suffix: u32| {
        let mut p = system.clone();
        p.extend(prompt(suffix, 3));
        p
    };
    let mut first = s.submit(ALPHA, with(11), 30);
    for _ in 0..2 {
        s.tick();
    }
    assert_eq!(
        s.scheduler.cached_pages(ALPHA),
        5,
        "the prompt's full pages"
    );
    let mut second = s.submit(ALPHA, with(12), 6);
    let mut third = s.submit(ALPHA, with(13), 30);
    s.tick();
    // The first goes away; the others keep reading the shared pages.
    first.close();
    let _ = outcome(&mut first);
    drop(first);
    for _ in 0..12 {
        s.tick();
    }
    assert_eq!(s.scheduler.cached_pages(ALPHA), 5);
    s.run_to_idle();
    let (second_out, second_usage) = text_end(&mut second);
    let (third_out, third_usage) = text_end(&mut third);
    assert_eq!(second_usage.cached_tokens, 20);
    assert_eq!(third_usage.cached_tokens, 20);
    assert_eq!(second_out, solo(with(12), 6));
    assert_eq!(third_out, solo(with(13), 30));
    // All three are gone; the cache is idle within alpha's reservation, and a
    // fourth request still finds it.
    let mut fourth = s.submit(ALPHA, with(14), 4);
    s.run_to_idle();
    let (out, usage) = text_end(&mut fourth);
    assert_eq!(usage.cached_tokens, 20);
    assert_eq!(out, solo(with(14), 4));
    let stats = s.scheduler.pool().stats();
    assert_eq!((stats.pages_owned, stats.pages_released), (0, 0));
    assert_eq!(stats.pages_shared, 5, "kept idle, within the reservation");
}

/// The cache is per tenant: the same prompt from another tenant finds nothing,
/// and one tenant's pressure evicts only its own cached pages.
#[test]
fn a_cache_is_never_shared_across_tenants_and_eviction_stays_within_one() {
    let mut s = sim(
        &[tenant(ALPHA, 1, 16, 16), tenant(BETA, 1, 16, 48)],
        64,
        LIMITS,
    );
    let shared_prompt = prompt(5, 33); // eight full pages
    let mut a = s.submit(ALPHA, shared_prompt.clone(), 4);
    s.run_to_idle();
    assert_eq!(text_end(&mut a).1.cached_tokens, 0);
    assert_eq!(s.scheduler.cached_pages(ALPHA), 8);
    let mut b = s.submit(BETA, shared_prompt.clone(), 4);
    s.run_to_idle();
    let (b_out, b_usage) = text_end(&mut b);
    assert_eq!(b_usage.cached_tokens, 0, "beta never sees alpha's cache");
    assert_eq!(b_out, solo(shared_prompt.clone(), 4));
    // Beta fills its whole partition over and over with new prompts: its own
    // idle cache goes, alpha's stays.
    let mut flood: Vec<_> = (0..12)
        .map(|i| s.submit(BETA, prompt(40 + i, 33), 12))
        .collect();
    s.run_to_idle();
    for rx in &mut flood {
        assert!(outcome(rx).1.is_some());
    }
    assert_eq!(
        s.scheduler.cached_pages(ALPHA),
        8,
        "alpha's cache untouched"
    );
    let mut again = s.submit(ALPHA, shared_prompt.clone(), 4);
    s.run_to_idle();
    assert_eq!(text_end(&mut again).1.cached_tokens, 32);
}

/// Off for a tenant: nothing is kept, and nothing is found.
#[test]
fn a_tenant_with_the_cache_off_neither_keeps_nor_finds_pages() {
    let mut off = tenant(ALPHA, 1, 32, 32);
    off.prefix_cache = false;
    let mut s = sim(&[off], 64, LIMITS);
    for _ in 0..2 {
        let mut rx = s.submit(ALPHA, prompt(2, 30), 4);
        s.run_to_idle();
        assert_eq!(text_end(&mut rx).1.cached_tokens, 0);
        assert_eq!(s.scheduler.cached_pages(ALPHA), 0);
    }
    assert_eq!(s.scheduler.pool().stats().pages_shared, 0);
}

/// Idle cached pages never hold the burst region: a tenant without a
/// reservation keeps none once its requests end.
#[test]
fn idle_cached_pages_stay_within_the_tenants_reservation() {
    let mut s = sim(
        &[tenant(ALPHA, 1, 0, 32), tenant(BETA, 1, 8, 32)],
        64,
        LIMITS,
    );
    let mut a = s.submit(ALPHA, prompt(3, 30), 4);
    let mut b = s.submit(BETA, prompt(4, 60), 4);
    s.run_to_idle();
    assert!(outcome(&mut a).1.is_some() && outcome(&mut b).1.is_some());
    assert_eq!(
        s.scheduler.cached_pages(ALPHA),
        0,
        "no reservation: none kept"
    );
    assert_eq!(
        s.scheduler.cached_pages(BETA),
        8,
        "up to its 8 reserved pages"
    );
    s.assert_all_pages_free();
}

/// A request's cache salt keeps one tenant's users apart: only requests with
/// the same salt (or both without one) share cached pages.
#[test]
fn a_cache_salt_shares_pages_only_between_equal_salts() {
    let mut s = sim(&[tenant(ALPHA, 1, 48, 64)], 64, LIMITS);
    let p = prompt(9, 21); // five full pages, all cacheable (21 > 20)
    let mut run = |salt: Option<&str>| {
        let (mut request, mut rx) = s.request(ALPHA, p.clone(), 3);
        request.cache_salt = salt.map(str::to_string);
        let admitted = s.admission.admit(request).unwrap();
        s.scheduler.enqueue(admitted).unwrap();
        s.run_to_idle();
        text_end(&mut rx)
    };
    let (plain, usage) = run(None);
    assert_eq!(usage.cached_tokens, 0);
    let (salted, usage) = run(Some("user-1"));
    assert_eq!(usage.cached_tokens, 0, "another salt finds nothing");
    assert_eq!(salted, plain);
    assert_eq!(run(Some("user-1")).1.cached_tokens, 20);
    assert_eq!(run(None).1.cached_tokens, 20);
    assert_eq!(run(Some("user-2")).1.cached_tokens, 0);
}

/// Random traffic from three tenants whose prompts share prefixes within and
/// across tenants, with clients that go away, against every check after every
/// tick (no page in two tenants' tables, cached pages only ever their own
/// tenant's, reference counts exact). Then alpha goes quiet: however the
/// others press on the pool, its idle cache stays exactly as it was.
#[test]
fn random_traffic_keeps_every_cache_and_table_its_tenants_own() {
    const GAMMA_ID: TenantId = TenantId(2);
    let ids = [ALPHA, BETA, GAMMA_ID];
    let mut s = sim(
        &[
            tenant(ALPHA, 1, 12, 40),
            tenant(BETA, 2, 8, 48),
            tenant(GAMMA_ID, 1, 0, 24),
        ],
        64,
        LIMITS,
    );
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    // Three shared prefixes, used by every tenant.
    let prefixes: Vec<Vec<u32>> = (0..3).map(|i| prompt(60 + i, 8 + 4 * i as usize)).collect();
    let mut live: Vec<UnboundedReceiver<Event>> = Vec::new();
    let mut alpha_quiet: Option<usize> = None;
    for round in 0..600 {
        let senders: &[TenantId] = if round < 300 { &ids } else { &ids[1..] };
        for _ in 0..next(3) {
            let tenant = senders[next(senders.len() as u64) as usize];
            let mut p = prefixes[next(3) as usize].clone();
            p.extend(prompt(next(1000) as u32, 1 + next(9) as usize));
            let (request, rx) = s.request(tenant, p, 1 + next(12) as u32);
            let admitted = s.admission.admit(request).unwrap();
            if s.scheduler.enqueue(admitted).is_ok() {
                live.push(rx);
            }
        }
        if !live.is_empty() && next(4) == 0 {
            let gone = next(live.len() as u64) as usize;
            live.swap_remove(gone);
        }
        s.tick();
        live.retain_mut(|rx| outcome(rx).1.is_none());
        let alpha_idle = s.scheduler.queued(ALPHA) == 0 && s.scheduler.running(ALPHA) == 0;
        match alpha_quiet {
            None if round >= 300 && alpha_idle => {
                alpha_quiet = Some(s.scheduler.cached_pages(ALPHA));
            }
            Some(cached) => assert_eq!(
                s.scheduler.cached_pages(ALPHA),
                cached,
                "alpha's idle cache changed under the others' load (round {round})"
            ),
            None => {}
        }
    }
    let kept = alpha_quiet.expect("alpha went quiet");
    assert!(
        kept > 0 && kept <= 12,
        "alpha kept {kept} pages, within its 12"
    );
    s.run_to_idle();
    s.assert_all_pages_free();
}

/// Reclaiming from a tenant whose sequences' prompt pages are in its cache:
/// a preempted sequence's shared prompt pages stay cached (idle), so they are
/// trimmed to its reservation as part of the reclaim, and a sequence preempted
/// in a tick does not start again in that tick. Before both, alpha took
/// beta's sequences off and beta put them back (from its cache) for ever,
/// inside one tick.
#[test]
fn reclaiming_from_cached_prompts_ends_and_alpha_starts() {
    // A step takes every prompt whole.
    let limits = BatchLimits {
        step_tokens_max: 256,
        step_seqs_max: 8,
    };
    let mut s = sim(
        &[tenant(ALPHA, 1, 4, 60), tenant(BETA, 1, 4, 60)],
        64,
        limits,
    );
    // Beta: 28-token prompts (seven full pages, shared once prefilled) + 4
    // tokens = 8 pages; seven run (56 pages, 49 of them shared), more wait.
    let beta_prompt = |i: u32| prompt(500 + i, 28);
    let mut beta: Vec<_> = (0..20).map(|i| s.submit(BETA, beta_prompt(i), 4)).collect();
    s.tick();
    // Alpha: 44 + 20 tokens = 16 pages, more than it can book now plus all of
    // beta's unshared pages: some of beta's cached prompt pages must go.
    let pool = s.scheduler.pool();
    let available = pool
        .partition_stats(OwnerTag(ALPHA.0))
        .unwrap()
        .pages_available;
    let beta_stats = pool.partition_stats(OwnerTag(BETA.0)).unwrap();
    assert!(
        s.scheduler.running(BETA) >= 6,
        "beta fills the burst region"
    );
    assert!(
        available + beta_stats.pages_owned < 16,
        "{available} available, {beta_stats:?}"
    );
    let mut alpha = s.submit(ALPHA, prompt(9, 44), 20);
    s.tick();
    assert_eq!(s.scheduler.running(ALPHA), 1, "alpha starts at once");
    s.run_to_idle();
    for (i, rx) in beta.iter_mut().enumerate() {
        assert_eq!(text_end(rx).0, solo(beta_prompt(i as u32), 4), "beta {i}");
    }
    assert_eq!(text_end(&mut alpha).0, solo(prompt(9, 44), 20));
}

#[test]
fn steps_and_each_tenants_sampling_time_are_counted() {
    let mut s = two_tenants();
    let sampling = SamplingParams {
        temperature: 1.0,
        seed: 3,
        logprobs: Some(5),
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let mut rx = s.submit_sampled(ALPHA, prompt(1, 9), 6, sampling);
    s.run_to_idle();
    let (_, end) = outcome(&mut rx);
    let (reason, usage) = end.expect("it finished");
    assert_eq!((reason, usage.completion_tokens), (FinishReason::Length, 6));
    let stats = s.scheduler.stats();
    let counts = |id: TenantId| {
        stats
            .tenants
            .iter()
            .find(|t| t.id == id.0)
            .expect("a tenant of the sim")
            .counts
    };
    // The prompt in one step, then the first five generated tokens fed back
    // one step each (the sixth is never fed back).
    assert_eq!(stats.steps.steps_total, 6, "{stats:?}");
    assert_eq!(stats.steps.tokens_total, 9 + 5, "{stats:?}");
    assert!(stats.steps.forward_nanos_total > 0, "{stats:?}");
    // Alpha's sampling is charged to alpha, none to beta; one row a step,
    // so its rows' time is within the steps' sampling time.
    let alpha = counts(ALPHA).sampling_nanos_total;
    assert!(alpha > 0, "{stats:?}");
    assert!(alpha <= stats.steps.sampling_nanos_total, "{stats:?}");
    assert_eq!(counts(BETA).sampling_nanos_total, 0, "{stats:?}");
}

#[test]
fn a_requests_choices_are_queued_all_together_or_not_at_all() {
    let mut s = sim(
        &[Tenant {
            queue_depth_max: 3,
            ..tenant(ALPHA, 1, 32, 64)
        }],
        64,
        LIMITS,
    );
    let choices = |s: &mut Sim, n: usize| {
        let mut receivers = Vec::new();
        let admitted: Vec<_> = (0..n)
            .map(|_| {
                let (request, rx) = s.request(ALPHA, prompt(1, 5), 3);
                receivers.push(rx);
                s.admission.admit(request).expect("fits")
            })
            .collect();
        (s.scheduler.enqueue_all(vec![admitted]), receivers)
    };
    // Four cannot fit a queue of three: none of them is queued.
    let (refused, _) = choices(&mut s, 4);
    assert_eq!(refused, Err(Rejection::QueueFull));
    assert_eq!(s.scheduler.in_flight(), 0);
    // Two fit; then two more do not (one place is left), and the two run.
    let (queued, mut receivers) = choices(&mut s, 2);
    assert_eq!(queued, Ok(()));
    let (refused, _) = choices(&mut s, 2);
    assert_eq!(refused, Err(Rejection::QueueFull));
    assert_eq!(s.scheduler.in_flight(), 2);
    s.run_to_idle();
    for rx in &mut receivers {
        let (_, end) = drain(rx);
        assert!(end.is_some(), "each queued choice ran");
    }
    s.assert_all_pages_free();
}

#[test]
fn a_requests_choices_after_the_first_find_its_prompt_in_the_prefix_cache() {
    let mut s = sim(&[tenant(ALPHA, 1, 32, 64)], 64, LIMITS);
    let mut receivers = Vec::new();
    // A batch of two prompts: three choices of one, two of the other.
    let prompts: Vec<Vec<_>> = [(7, 30, 3), (8, 45, 2)]
        .into_iter()
        .map(|(seed, len, n)| {
            (0..n)
                .map(|_| {
                    let (request, rx) = s.request(ALPHA, prompt(seed, len), 3);
                    receivers.push(rx);
                    s.admission.admit(request).expect("fits")
                })
                .collect()
        })
        .collect();
    s.scheduler.enqueue_all(prompts).expect("queued");
    s.run_to_idle();
    let cached: Vec<u32> = receivers
        .iter_mut()
        .map(|rx| {
            let mut cached = None;
            while let Ok(event) = rx.try_recv() {
                if let Event::Finished { usage, .. } = event {
                    cached = Some(usage.cached_tokens);
                }
            }
            cached.expect("each choice ran")
        })
        .collect();
    // Each prompt's first choice computes it; its others start once it is
    // in KV and attach its full pages (every page but the one the last
    // token needs) — their own prompt's, not the batch's first prompt's.
    let full = |len: u32| (len - 1) / PAGE_TOKENS * PAGE_TOKENS;
    assert_eq!(cached, [0, full(30), full(30), 0, full(45)]);
    s.assert_all_pages_free();
    // Without the tenant's prefix cache each computes its own.
    let mut off = tenant(ALPHA, 1, 32, 64);
    off.prefix_cache = false;
    let mut s = sim(&[off], 64, LIMITS);
    let mut receivers = Vec::new();
    let admitted: Vec<_> = (0..3)
        .map(|_| {
            let (request, rx) = s.request(ALPHA, prompt(7, 30), 3);
            receivers.push(rx);
            s.admission.admit(request).expect("fits")
        })
        .collect();
    s.scheduler.enqueue_all(vec![admitted]).expect("queued");
    s.run_to_idle();
    for rx in &mut receivers {
        let (_, end) = drain(rx);
        assert!(end.is_some(), "each choice ran");
    }
    s.assert_all_pages_free();
}

/// Every event of a request, in order.
fn events(rx: &mut UnboundedReceiver<Event>) -> Vec<Event> {
    std::iter::from_fn(|| rx.try_recv().ok()).collect()
}

#[test]
fn a_scored_prompt_leaves_a_row_of_logits_for_each_other_sequence_in_its_step() {
    // Steps of 96 tokens and 8 + 64 rows: a scored 100-token prompt could
    // take every row of the first step, and the short prompt queued behind
    // it, which needs one row for its first token, would wait a step.
    let limits = BatchLimits {
        step_tokens_max: 96,
        step_seqs_max: 8,
    };
    let mut s = sim(&[tenant(ALPHA, 1, 64, 128)], 128, limits);
    let scoring = SamplingParams {
        prompt_logprobs: Some(0),
        ..SamplingParams::default()
    };
    let mut scored = s.submit_sampled(ALPHA, prompt(3, 100), 0, scoring.clone());
    let mut short = s.submit(ALPHA, prompt(4, 5), 2);
    s.tick();
    // One step: the short prompt's first token, and the scored prompt's
    // entries for what the step left it (72 rows, less the short one's).
    let first: Vec<Event> = std::iter::from_fn(|| short.try_recv().ok()).collect();
    assert!(
        first.iter().any(|e| matches!(e, Event::Text(_))),
        "no first token after one step: {first:?}"
    );
    let entries = std::iter::from_fn(|| scored.try_recv().ok())
        .filter(|e| matches!(e, Event::PromptLogprob(_)))
        .count();
    assert_eq!(entries, 72 - 1);
    s.run_to_idle();
    let (_, end) = drain(&mut scored);
    assert!(end.is_some());
    s.assert_all_pages_free();
    // Alone, it takes every row: none is kept for sequences that are not
    // there.
    let mut alone = s.submit_sampled(ALPHA, prompt(5, 100), 0, scoring);
    s.tick();
    let entries = std::iter::from_fn(|| alone.try_recv().ok())
        .filter(|e| matches!(e, Event::PromptLogprob(_)))
        .count();
    assert_eq!(entries, 72);
    s.run_to_idle();
}

#[test]
fn a_prompts_log_probabilities_are_each_prefixs_next_token_distribution() {
    // Steps of at most 32 tokens and 8 + 64 rows of logits: a 50-token
    // prompt is scored over two chunks, beside another tenant's work.
    let mut s = sim(
        &[tenant(ALPHA, 1, 32, 64), tenant(BETA, 1, 32, 64)],
        64,
        LIMITS,
    );
    let text = prompt(5, 50);
    // A first request puts the prompt's pages in alpha's cache; the scored
    // one must compute them all the same.
    let mut warm = s.submit(ALPHA, text.clone(), 1);
    s.run_to_idle();
    assert!(matches!(
        outcome(&mut warm).1,
        Some((FinishReason::Length, _))
    ));
    let top = 3u8;
    let scoring = |max_tokens_logprobs: Option<u8>| SamplingParams {
        prompt_logprobs: Some(top),
        logprobs: max_tokens_logprobs,
        ..SamplingParams::default()
    };
    let mut busy = s.submit(BETA, prompt(9, 40), 6);
    let mut scored = s.submit_sampled(ALPHA, text.clone(), 0, scoring(None));
    let mut scored_and_generated = s.submit_sampled(ALPHA, text.clone(), 4, scoring(Some(top)));
    let mut plain = s.submit(ALPHA, text.clone(), 4);
    s.run_to_idle();
    assert!(matches!(
        outcome(&mut busy).1,
        Some((FinishReason::Length, _))
    ));

    // Nothing generated: one entry per prompt token from the second on, and
    // the end; none of its pages came from the cache.
    let got = events(&mut scored);
    let (entries, rest) = got.split_at(text.len() - 1);
    let entries: Vec<_> = entries
        .iter()
        .map(|e| match e {
            Event::PromptLogprob(entry) => entry.clone(),
            other => panic!("a prompt log probability, not {other:?}"),
        })
        .collect();
    match rest {
        [Event::Finished { reason, usage }] => {
            assert_eq!(*reason, FinishReason::Length);
            assert_eq!(usage.completion_tokens, 0);
            assert_eq!(usage.prompt_tokens, text.len() as u32);
            assert_eq!(usage.cached_tokens, 0);
        }
        other => panic!("only the end after the entries: {other:?}"),
    }
    // Each entry is the token's own bytes, with `top` alternatives most
    // likely first, and the same numbers the next-token distribution after
    // that prefix gives a request that generates from it (exactly: the CPU
    // backend computes a position alike in any chunk and batch).
    for (i, entry) in entries.iter().enumerate() {
        assert_eq!(entry.bytes, vec![text[i + 1] as u8], "entry {i}");
        assert_eq!(entry.top.len(), usize::from(top));
        assert!(entry.top.windows(2).all(|w| w[0].1 >= w[1].1));
        assert!(entry.logprob <= 0.0 && entry.logprob.is_finite());
        let oracle_params = SamplingParams {
            logprobs: Some(top),
            ..SamplingParams::default()
        };
        let mut oracle = s.submit_sampled(BETA, text[..=i].to_vec(), 1, oracle_params);
        s.run_to_idle();
        let generated = events(&mut oracle)
            .into_iter()
            .find_map(|e| match e {
                Event::Logprob(entry) => Some(entry),
                _ => None,
            })
            .expect("the oracle's generated token has log probabilities");
        assert_eq!(
            entry.top,
            generated.top,
            "alternatives after {} tokens",
            i + 1
        );
        if let Some(&(_, logprob)) = generated.top.iter().find(|(b, _)| *b == entry.bytes) {
            assert_eq!(entry.logprob, logprob, "entry {i}");
        }
    }

    // With tokens to generate: every prompt entry first, then the same
    // greedy text a request that scores nothing gets.
    let got = events(&mut scored_and_generated);
    let first_generated = got
        .iter()
        .position(|e| !matches!(e, Event::PromptLogprob(_)))
        .unwrap();
    assert_eq!(first_generated, text.len() - 1);
    assert!(!got[first_generated..]
        .iter()
        .any(|e| matches!(e, Event::PromptLogprob(_))));
    let prompt_entries: Vec<_> = got[..first_generated]
        .iter()
        .map(|e| match e {
            Event::PromptLogprob(entry) => entry.clone(),
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(
        prompt_entries, entries,
        "the same scores with or without generation"
    );
    let text_of = |events: &[Event]| -> String {
        events
            .iter()
            .filter_map(|e| match e {
                Event::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect()
    };
    let (plain_text, plain_end) = outcome(&mut plain);
    assert_eq!(text_of(&got), plain_text);
    assert!(matches!(
        got.last(),
        Some(Event::Finished { reason: FinishReason::Length, usage }) if usage.completion_tokens == 4
    ));
    assert!(matches!(plain_end, Some((FinishReason::Length, u)) if u.cached_tokens > 0));
    s.assert_all_pages_free();

    // Without scoring, 0 tokens to generate is refused as before.
    let (request, _rx) = s.request(ALPHA, text.clone(), 0);
    assert_eq!(
        s.admission.admit(request).err(),
        Some(Rejection::ZeroMaxTokens)
    );
}

/// The CPU backend giving each row wanted for its token (greedy or drawn)
/// as that token alone, and each prompt row wanted for its score as that
/// score alone, as the CUDA backend does (`on`), or every row in full.
struct Picking {
    inner: bulkhead_kernels::backend::cpu::CpuBackend,
    on: bool,
    values: Vec<f32>,
    picks: Vec<(u32, u32)>,
    picked: usize,
    /// Prompt rows given as their scores alone.
    prompt_scored: usize,
    candidates: Vec<(u32, f32)>,
    /// A picked row, adjusted as its step says.
    adjusted: Vec<f32>,
    scored: Vec<(u32, bulkhead_kernels::backend::Logprobs)>,
}

impl bulkhead_kernels::backend::Backend for Picking {
    fn name(&self) -> String {
        "picking".into()
    }

    fn step_tokens_max(&self) -> usize {
        self.inner.step_tokens_max()
    }

    fn step_logits_max(&self) -> usize {
        self.inner.step_logits_max()
    }

    fn step(
        &mut self,
        steps: &[bulkhead_kernels::backend::SeqStep<'_>],
        pool: &mut bulkhead_kernels::kv::Pool,
    ) -> Result<bulkhead_kernels::backend::Logits<'_>, bulkhead_kernels::backend::StepError> {
        let logits = self.inner.step(steps, pool)?;
        let vocab_len = logits.vocab_len;
        let prompt_scored_before = self.prompt_scored;
        self.values.clear();
        self.picks.clear();
        self.scored.clear();
        let mut row = 0;
        for step in steps {
            for r in 0..step.logits {
                let i = row + r;
                if let Some(&target) = step.scores.targets.get(r).filter(|_| self.on) {
                    let top = usize::from(step.scores.top);
                    let scored =
                        bulkhead_kernels::backend::Logprobs::of(logits.row(i), target, top);
                    self.picks.push((i as u32, target));
                    self.scored.push((i as u32, scored));
                    self.prompt_scored += 1;
                    continue;
                }
                // As a GPU picks: the row adjusted where it lies, then its
                // argmax or draw.
                let row = &mut self.adjusted;
                row.clear();
                row.extend_from_slice(logits.row(i));
                bulkhead_kernels::backend::adjust::adjust(row, step.adjust);
                let id = match step.pick {
                    Pick::Row => None,
                    Pick::Argmax => Some(bulkhead_kernels::backend::argmax(row)),
                    Pick::Draw(draw) => Some(draw.pick(row, &mut self.candidates)),
                };
                if let Some(id) = id.filter(|_| self.on && r + 1 == step.logits) {
                    self.picks.push((i as u32, id));
                    // Its log probabilities where asked, of the row as it was.
                    if let Some(top) = step.logprobs {
                        let scored = bulkhead_kernels::backend::Logprobs::of(
                            logits.row(i),
                            id,
                            usize::from(top),
                        );
                        self.scored.push((i as u32, scored));
                    }
                } else {
                    self.values.extend_from_slice(logits.row(i));
                }
            }
            row += step.logits;
        }
        self.picked += self.picks.len() - (self.prompt_scored - prompt_scored_before);
        Ok(bulkhead_kernels::backend::Logits {
            values: &self.values,
            vocab_len,
            picks: &self.picks,
            scored: &self.scored,
        })
    }
}

#[test]
fn rows_given_as_their_tokens_say_what_full_rows_say() {
    let gguf = Arc::new(Gguf::from_bytes(tiny_llama(&TinySpec::default())).unwrap());
    let model = Arc::new(Model::load(Arc::clone(&gguf)).unwrap());
    let tokenizer = Arc::new(Tokenizer::from_gguf(&gguf).unwrap());
    // Greedy and drawn ones a backend may pick, adjusted or not (a bias, a
    // penalty, `min_tokens`, a draw with a repetition penalty), one asking
    // for its tokens' log probabilities (given with the token), and two
    // scoring their prompts (rows apart from the sampled one), one of them
    // drawn under a penalty with its tokens' log probabilities.
    let requests: Vec<SamplingParams> = vec![
        SamplingParams::default(),
        SamplingParams {
            logprobs: Some(2),
            ..SamplingParams::default()
        },
        SamplingParams {
            prompt_logprobs: Some(1),
            ..SamplingParams::default()
        },
        SamplingParams {
            prompt_logprobs: Some(3),
            logprobs: Some(1),
            frequency_penalty: 0.5,
            temperature: 0.7,
            seed: 9,
            ..SamplingParams::default()
        },
        SamplingParams {
            logit_bias: vec![(100, 2.0)],
            ..SamplingParams::default()
        },
        SamplingParams {
            presence_penalty: 0.7,
            ..SamplingParams::default()
        },
        SamplingParams {
            min_tokens: 4,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 0.8,
            seed: 3,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 1.2,
            top_k: 30,
            top_p: 0.9,
            min_p: 0.02,
            seed: 5,
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 0.9,
            repetition_penalty: 1.2,
            seed: 6,
            ..SamplingParams::default()
        },
        SamplingParams::default(),
    ];
    let run = |on: bool| -> (Vec<Vec<Event>>, usize, usize) {
        let spec = EngineSpec {
            pool_pages: 64,
            page_tokens: PAGE_TOKENS,
            kv_type: KvType::default(),
            threads: 1,
            step_tokens_max: LIMITS.step_tokens_max,
            step_seqs_max: LIMITS.step_seqs_max,
            pool_options: PoolOptions {
                poison_released: true,
                paranoid: true,
            },
            placement: bulkhead::engine::placement::Placement::Cpu,
            cuda: Default::default(),
        };
        let backend = Picking {
            inner: build::backend(&model, &spec),
            on,
            values: Vec::new(),
            picks: Vec::new(),
            picked: 0,
            prompt_scored: 0,
            candidates: Vec::new(),
            adjusted: Vec::new(),
            scored: Vec::new(),
        };
        let pool = build::pool(&model, &spec).unwrap();
        let tenants = vec![TenantLimits {
            id: ALPHA,
            name: "alpha".into(),
            weight: 1,
            queue_depth_max: 16,
            running_max: 16,
            pages_reserved: 64,
            pages_max: 64,
            prefix_cache: true,
        }];
        let mut scheduler =
            Scheduler::new(backend, pool, Arc::clone(&tokenizer), LIMITS, tenants).unwrap();
        let admission = scheduler.admission(model.config.context_len as u32);
        let mut now = Instant::now();
        let mut receivers = Vec::new();
        for (i, sampling) in requests.iter().enumerate() {
            let (events, rx) = unbounded_channel();
            let request = NewRequest {
                id: RequestId(i as u64 + 1),
                tenant: ALPHA,
                prompt: prompt(i as u32, 5 + i),
                max_tokens: 10,
                sampling: sampling.clone(),
                stop: Vec::new(),
                deadline: now + Duration::from_secs(60),
                events,
                cache_salt: None,
                prefill_hint: None,
            };
            scheduler
                .enqueue(admission.admit(request).expect("fits"))
                .expect("queue has room");
            receivers.push(rx);
        }
        for _ in 0..10_000 {
            if scheduler.in_flight() == 0 {
                break;
            }
            now += Duration::from_millis(10);
            scheduler.tick(now);
            scheduler.check().expect("invariants after every tick");
        }
        assert_eq!(scheduler.in_flight(), 0, "drained");
        let events = receivers
            .iter_mut()
            .map(|rx| std::iter::from_fn(|| rx.try_recv().ok()).collect())
            .collect();
        let backend = scheduler.backend();
        (events, backend.picked, backend.prompt_scored)
    };
    let (rows, none, none_scored) = run(false);
    let (picked, picks, prompt_scored) = run(true);
    assert_eq!((none, none_scored), (0, 0));
    assert_eq!(picked, rows, "the same events, token for token");
    for events in &rows {
        assert!(matches!(
            events.last(),
            Some(Event::Finished {
                reason: FinishReason::Length,
                ..
            })
        ));
    }
    // Every token of every request: the adjusted ones' too, their
    // adjustments made where the row lies, and the one asking for log
    // probabilities, which come with its tokens.
    assert_eq!(picks, 11 * 10, "tokens picked by the backend");
    // And the two prompts scored (7 and 8 tokens: 6 and 7 rows, each
    // scoring the token after it), by the backend alone.
    assert_eq!(prompt_scored, 6 + 7, "prompt rows scored by the backend");
    let prompt_logprobs = |events: &[Event]| {
        events
            .iter()
            .filter(|e| matches!(e, Event::PromptLogprob(_)))
            .count()
    };
    assert_eq!(prompt_logprobs(&picked[2]), 6);
    assert_eq!(prompt_logprobs(&picked[3]), 7);
}
