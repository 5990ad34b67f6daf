//! Deterministic simulation of the scheduler, its KV pool and its prefix
//! cache, driven by a seeded generator on a simulated clock.
//!
//! Each step: random arrivals across three tenants (shared prompt prefixes,
//! short deadlines now and then, oversized prompts that admission must
//! refuse), clients leaving, a tick — on a backend that now and then refuses
//! a step for one sequence or panics, after which the harness does what the
//! engine's supervisor does (every request in flight ends with
//! `engine_fault`, the pool is dropped, the engine is rebuilt for the same
//! tenants) — and then every checker:
//!
//! - the pool's own (free, released and scrub lists, page states, partition
//!   counts and bounds, reservations, every free page all zeros);
//! - page tables against the pool (owner and sequence of every page, live
//!   leases, no page in two tables) and the prefix cache against both;
//! - every request ends exactly once (the finish sink counts ends by id),
//!   nothing follows a request's end on its channel, and a refused request
//!   never ends at all.
//!
//! At the end the engine drains: every accepted request ended exactly once and
//! no page is owned or waiting for a scrub.
//!
//! CI runs [`SEEDS`] seeds. `BULKHEAD_SIM_SEEDS=N` runs N seeds from the
//! first, `BULKHEAD_SIM_SEED=0x…` replays one, and `BULKHEAD_SIM_STEPS=N`
//! changes the length, e.g. (release build, a few minutes):
//!
//! ```sh
//! BULKHEAD_SIM_SEEDS=500 cargo test --release -p bulkhead --test simulation -- --nocapture
//! ```
//!
//! A failure prints its seed, step and the command that replays it. Planted
//! violations (one per checker) must each be caught, or the suite fails.

use bulkhead::engine::admission::Admission;
use bulkhead::engine::build::{self, EngineSpec};
use bulkhead::engine::request::{Event, FinishReason, NewRequest, Rejection, RequestId, Usage};
use bulkhead::engine::sampling::SamplingParams;
use bulkhead::engine::scheduler::{BatchLimits, FinishSink, Scheduler, TenantLimits};
use bulkhead::tenancy::TenantId;
use bulkhead_kernels::backend::cpu::CpuBackend;
use bulkhead_kernels::backend::{Backend, Logits, SeqStep, StepError};
use bulkhead_kernels::gguf::Gguf;
use bulkhead_kernels::kv::{KvType, OwnerTag, PageId, PageState, Pool, PoolOptions};
use bulkhead_kernels::model::Model;
use bulkhead_kernels::rng::SplitMix64;
use bulkhead_kernels::testing::{tiny_llama, TinySpec};
use bulkhead_kernels::tokenizer::Tokenizer;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// The seeds CI runs.
const SEEDS: u64 = 32;
/// Steps per seed in CI.
const STEPS: u32 = 400;
const FIRST_SEED: u64 = 0x5eed_0000_0000_0001;
const PAGE_TOKENS: u32 = 4;
const POOL_PAGES: u32 = 64;
const CONTEXT: u32 = 64;
const TENANTS: [TenantId; 3] = [TenantId(0), TenantId(1), TenantId(2)];

/// The one source of randomness of a run (the project's SplitMix64).
struct Rng(SplitMix64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(SplitMix64(seed))
    }

    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
}

/// The CPU backend with seeded faults: now and then a step refused for one of
/// its sequences, and (rarer) a panic, as a failed ownership assertion would.
struct Flaky {
    inner: CpuBackend,
    rng: Rng,
    step_errors: u32,
}

/// Per mille of steps the backend refuses for one sequence.
const STEP_ERROR_PER_MILLE: u64 = 15;
/// Per mille of steps that panic.
const PANIC_PER_MILLE: u64 = 8;

impl Backend for Flaky {
    fn name(&self) -> String {
        "flaky".into()
    }

    fn step_tokens_max(&self) -> usize {
        self.inner.step_tokens_max()
    }

    fn step_logits_max(&self) -> usize {
        self.inner.step_logits_max()
    }

    fn step(&mut self, steps: &[SeqStep<'_>], pool: &mut Pool) -> Result<Logits<'_>, StepError> {
        if self.rng.chance(PANIC_PER_MILLE) {
            panic!("planted engine fault");
        }
        if !steps.is_empty() && self.rng.chance(STEP_ERROR_PER_MILLE) {
            self.step_errors += 1;
            return Err(StepError::EmptySequence {
                index: self.rng.below(steps.len() as u64) as usize,
            });
        }
        self.inner.step(steps, pool)
    }

    fn threads(&self) -> Option<std::sync::Arc<bulkhead_kernels::threads::Threads>> {
        self.inner.threads()
    }
}

/// Every request's ends, by id, as the scheduler reports them.
#[derive(Default)]
struct Ends(Mutex<BTreeMap<u64, Vec<FinishReason>>>);

impl FinishSink for Ends {
    fn finished(&self, request: RequestId, _: TenantId, reason: FinishReason, _: Usage) {
        self.0
            .lock()
            .unwrap()
            .entry(request.0)
            .or_default()
            .push(reason);
    }
}

/// A violation planted on purpose, to show a checker sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plant {
    /// A free page written to (a write through a stale pointer), so the next
    /// lease would hand out another's data.
    DirtyFree,
    /// A page released twice.
    DoubleRelease,
    /// An owned page's generation bumped under its table (a stale handle).
    StaleGeneration,
    /// An owned page charged to another tenant.
    WrongOwner,
    /// A request reported ended a second time.
    DoubleEnd,
}

impl Plant {
    const ALL: [Plant; 5] = [
        Plant::DirtyFree,
        Plant::DoubleRelease,
        Plant::StaleGeneration,
        Plant::WrongOwner,
        Plant::DoubleEnd,
    ];
}

/// What a run did (to show the traffic reached every path).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Report {
    accepted: u64,
    refused_oversized: u64,
    refused_queue_full: u64,
    left: u64,
    ends: BTreeMap<&'static str, u64>,
    engine_faults: u64,
    preempted: u64,
    /// A digest of every event every request received, in order.
    trace: u64,
}

#[derive(Debug)]
struct Failure {
    seed: u64,
    step: u32,
    what: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "seed {:#x} failed at step {}: {}\nreplay: BULKHEAD_SIM_SEED={:#x} BULKHEAD_SIM_STEPS={} \
             cargo test -p bulkhead --test simulation fixed_seeds -- --nocapture",
            self.seed,
            self.step,
            self.what,
            self.seed,
            self.step + 1
        )
    }
}

struct Live {
    id: u64,
    rx: UnboundedReceiver<Event>,
    ended: bool,
    /// Prompt log probabilities it must receive before a successful end
    /// (its prompt's length less one where it asked for them, else none).
    prompt_logprobs_owed: usize,
    prompt_logprobs: usize,
    /// A generated token's event came: no prompt's may follow.
    generated: bool,
}

struct World {
    seed: u64,
    rng: Rng,
    now: Instant,
    model: Arc<Model>,
    tokenizer: Arc<Tokenizer>,
    ends: Arc<Ends>,
    scheduler: Scheduler<Flaky>,
    admission: Admission,
    live: Vec<Live>,
    /// Senders kept for the double-end plant.
    senders: BTreeMap<u64, UnboundedSender<Event>>,
    refused: Vec<u64>,
    next_id: u64,
    report: Report,
    preempted_before: u64,
}

fn tenants() -> Vec<TenantLimits> {
    // (weight, reserved, max): alpha and beta borrow above their
    // reservations, gamma lives on loans alone.
    [(1, 16, 40), (2, 12, 48), (1, 0, 24)]
        .iter()
        .zip(TENANTS)
        .map(|(&(weight, reserved, max), id)| TenantLimits {
            id,
            name: format!("t{}", id.0),
            weight,
            queue_depth_max: 6,
            running_max: 4,
            pages_reserved: reserved,
            pages_max: max,
            prefix_cache: id.0 != 2,
        })
        .collect()
}

fn spec() -> EngineSpec {
    EngineSpec {
        pool_pages: POOL_PAGES,
        page_tokens: PAGE_TOKENS,
        kv_type: KvType::default(),
        threads: 1,
        step_tokens_max: 24,
        step_seqs_max: 6,
        pool_options: PoolOptions {
            poison_released: true,
            paranoid: true,
        },
        placement: bulkhead::engine::placement::Placement::Cpu,
        cuda: Default::default(),
    }
}

impl World {
    fn new(seed: u64) -> World {
        let gguf = Arc::new(Gguf::from_bytes(tiny_llama(&TinySpec::default())).unwrap());
        let model = Arc::new(Model::load(Arc::clone(&gguf)).unwrap());
        let tokenizer = Arc::new(Tokenizer::from_gguf(&gguf).unwrap());
        let ends = Arc::new(Ends::default());
        let mut rng = Rng::new(seed);
        let scheduler = build_engine(&model, &tokenizer, &ends, &mut rng, tenants());
        World {
            seed,
            admission: scheduler.admission(CONTEXT),
            scheduler,
            rng,
            now: Instant::now(),
            model,
            tokenizer,
            ends,
            live: Vec::new(),
            senders: BTreeMap::new(),
            refused: Vec::new(),
            next_id: 1,
            report: Report::default(),
            preempted_before: 0,
        }
    }

    fn fail(&self, step: u32, what: impl Into<String>) -> Failure {
        Failure {
            seed: self.seed,
            step,
            what: what.into(),
        }
    }

    /// Random arrivals: shared prefixes, a few short deadlines, a few
    /// oversized prompts (refused by admission, before anything is touched).
    fn arrivals(&mut self, step: u32) -> Result<(), Failure> {
        for _ in 0..self.rng.below(3) {
            let tenant = TENANTS[self.rng.below(3) as usize];
            let oversized = self.rng.chance(50);
            let mut prompt: Vec<u32> = (0..8 + 4 * self.rng.below(3))
                .map(|i| 97 + (i as u32 * 5) % 26)
                .collect();
            let tail = if oversized {
                CONTEXT as u64
            } else {
                1 + self.rng.below(10)
            };
            prompt.extend((0..tail).map(|_| 97 + self.rng.below(26) as u32));
            // Now and then its prompt's log probabilities, with nothing
            // generated at times (chunks cut to the step's rows of logits,
            // prefix cache skipped, restarts after preemption).
            let scores = self.rng.chance(150);
            let mut max_tokens = 1 + self.rng.below(12) as u32;
            if scores && self.rng.chance(300) {
                max_tokens = 0;
            }
            let sampling = SamplingParams {
                prompt_logprobs: scores.then(|| self.rng.below(3) as u8),
                ..SamplingParams::default()
            };
            let prompt_logprobs_owed = if scores { prompt.len() - 1 } else { 0 };
            let deadline = if self.rng.chance(80) {
                self.now + Duration::from_millis(10 * (1 + self.rng.below(20)))
            } else {
                self.now + Duration::from_secs(3600)
            };
            let id = self.next_id;
            self.next_id += 1;
            let (events, rx) = unbounded_channel();
            self.senders.insert(id, events.clone());
            let request = NewRequest {
                id: RequestId(id),
                tenant,
                prompt,
                max_tokens,
                sampling,
                stop: Vec::new(),
                deadline,
                events,
                cache_salt: None,
                prefill_hint: None,
            };
            let admitted = match self.admission.admit(request) {
                Ok(admitted) if !oversized => admitted,
                Err(Rejection::ContextLengthExceeded { .. }) if oversized => {
                    self.report.refused_oversized += 1;
                    self.refused.push(id);
                    continue;
                }
                Ok(_) => return Err(self.fail(step, "an oversized prompt was admitted")),
                Err(e) => return Err(self.fail(step, format!("a fitting prompt was refused: {e}"))),
            };
            match self.scheduler.enqueue(admitted) {
                Ok(()) => {
                    self.report.accepted += 1;
                    self.live.push(Live {
                        id,
                        rx,
                        ended: false,
                        prompt_logprobs_owed,
                        prompt_logprobs: 0,
                        generated: false,
                    });
                }
                Err(Rejection::QueueFull) => {
                    self.report.refused_queue_full += 1;
                    self.refused.push(id);
                }
                Err(e) => return Err(self.fail(step, format!("enqueue refused: {e}"))),
            }
        }
        Ok(())
    }

    /// A tick; a panic is handled as the engine's supervisor handles it.
    fn tick(&mut self) {
        self.now += Duration::from_millis(10);
        let now = self.now;
        let scheduler = &mut self.scheduler;
        if catch_unwind(AssertUnwindSafe(|| scheduler.tick(now))).is_ok() {
            return;
        }
        self.report.engine_faults += 1;
        let tenants = self.scheduler.tenant_limits();
        self.preempted_before += preempted(&self.scheduler);
        let fresh = build_engine(
            &self.model,
            &self.tokenizer,
            &self.ends,
            &mut self.rng,
            tenants,
        );
        let mut broken = std::mem::replace(&mut self.scheduler, fresh);
        let _ = catch_unwind(AssertUnwindSafe(|| {
            broken.finish_everything(FinishReason::EngineFault)
        }));
        drop(broken);
        self.admission = self.scheduler.admission(CONTEXT);
    }

    fn plant(&mut self, plant: Plant) -> bool {
        let pool = self.scheduler.pool_mut();
        match plant {
            Plant::DirtyFree => {
                let free = (0..POOL_PAGES).map(PageId).find(|&p| {
                    pool.page_meta(p)
                        .is_some_and(|m| m.state == PageState::Free)
                });
                free.map(|page| pool.plant_fault_dirty_free(page)).is_some()
            }
            Plant::DoubleRelease | Plant::StaleGeneration | Plant::WrongOwner => {
                let Some(page) = owned_page(pool) else {
                    return false;
                };
                match plant {
                    Plant::DoubleRelease => pool.plant_fault_double_release(page),
                    Plant::StaleGeneration => pool.plant_fault_stale_generation(page),
                    _ => pool.plant_fault_owner(page, OwnerTag(7)),
                }
                true
            }
            Plant::DoubleEnd => {
                let ended = self.ends.0.lock().unwrap().keys().next().copied();
                let Some(id) = ended else { return false };
                self.ends.finished(
                    RequestId(id),
                    TENANTS[0],
                    FinishReason::Stop,
                    Usage::default(),
                );
                true
            }
        }
    }

    /// Every checker.
    fn check(&mut self, step: u32) -> Result<(), Failure> {
        self.scheduler
            .check()
            .map_err(|e| self.fail(step, format!("checker: {e}")))?;
        let ends = self.ends.0.lock().unwrap().clone();
        if let Some((id, reasons)) = ends.iter().find(|(_, r)| r.len() > 1) {
            return Err(self.fail(
                step,
                format!("request {id} ended {} times: {reasons:?}", reasons.len()),
            ));
        }
        if let Some(id) = self.refused.iter().find(|id| ends.contains_key(id)) {
            return Err(self.fail(step, format!("refused request {id} was ended")));
        }
        let mut trace = self.report.trace;
        for live in &mut self.live {
            while let Ok(event) = live.rx.try_recv() {
                if live.ended {
                    return Err(Failure {
                        seed: self.seed,
                        step,
                        what: format!("request {} received {event:?} after its end", live.id),
                    });
                }
                let fail = |what: String| Failure {
                    seed: self.seed,
                    step,
                    what: format!("request {}: {what}", live.id),
                };
                let piece = match &event {
                    Event::Text(text) => {
                        live.generated = true;
                        text.clone()
                    }
                    Event::Logprob(_) => {
                        live.generated = true;
                        "<logprob>".into()
                    }
                    Event::PromptLogprob(_) => {
                        live.prompt_logprobs += 1;
                        if live.generated || live.prompt_logprobs > live.prompt_logprobs_owed {
                            return Err(fail(format!(
                                "prompt log probability {} of {} owed, after a generated token: {}",
                                live.prompt_logprobs, live.prompt_logprobs_owed, live.generated
                            )));
                        }
                        "<prompt logprob>".into()
                    }
                    Event::Finished { reason, .. } => {
                        live.ended = true;
                        let whole = matches!(reason, FinishReason::Stop | FinishReason::Length);
                        if whole && live.prompt_logprobs != live.prompt_logprobs_owed {
                            return Err(fail(format!(
                                "ended {} with {} of {} prompt log probabilities",
                                reason.as_str(),
                                live.prompt_logprobs,
                                live.prompt_logprobs_owed
                            )));
                        }
                        format!("<{}>", reason.as_str())
                    }
                };
                for byte in format!("{}:{piece}", live.id).bytes() {
                    trace = (trace ^ u64::from(byte)).wrapping_mul(0x100_0000_01b3);
                }
            }
        }
        self.report.trace = trace;
        // Clients that leave: their channels close, the scheduler must notice.
        if !self.live.is_empty() && self.rng.chance(60) {
            let at = self.rng.below(self.live.len() as u64) as usize;
            let gone = self.live.swap_remove(at);
            if !gone.ended {
                self.report.left += 1;
            }
            self.senders.remove(&gone.id);
        }
        self.live.retain(|l| !l.ended);
        Ok(())
    }

    fn run(&mut self, steps: u32, plant: Option<(Plant, u32)>) -> Result<(), Failure> {
        let mut planted = false;
        for step in 0..steps {
            self.arrivals(step)?;
            self.tick();
            if let Some((what, at)) = plant {
                if step >= at && !planted {
                    planted = self.plant(what);
                }
            }
            self.check(step)?;
        }
        // Drain: every accepted request ends, exactly once; pages come back.
        let mut step = steps;
        while self.scheduler.in_flight() > 0 {
            if step > steps + 20_000 {
                return Err(self.fail(step, "the engine did not drain"));
            }
            self.tick();
            self.check(step)?;
            step += 1;
        }
        let ends = self.ends.0.lock().unwrap().clone();
        for id in 1..self.next_id {
            let count = ends.get(&id).map_or(0, Vec::len);
            let refused = self.refused.contains(&id);
            if count != usize::from(!refused) {
                return Err(self.fail(step, format!("request {id} ended {count} times")));
            }
        }
        let stats = self.scheduler.pool().stats();
        if stats.pages_owned != 0 || stats.pages_released != 0 {
            return Err(self.fail(
                step,
                format!("pool not at baseline after the drain: {stats:?}"),
            ));
        }
        for reasons in ends.values() {
            *self.report.ends.entry(reasons[0].as_str()).or_default() += 1;
        }
        self.report.preempted = self.preempted_before + preempted(&self.scheduler);
        Ok(())
    }
}

fn preempted(scheduler: &Scheduler<Flaky>) -> u64 {
    scheduler
        .stats()
        .tenants
        .iter()
        .map(|t| t.counts.preempted_total)
        .sum()
}

/// Some page a sequence owns right now (for planting).
fn owned_page(pool: &Pool) -> Option<PageId> {
    (0..POOL_PAGES).map(PageId).find(|&p| {
        pool.page_meta(p)
            .is_some_and(|m| matches!(m.state, PageState::Owned { .. }))
    })
}

fn build_engine(
    model: &Arc<Model>,
    tokenizer: &Arc<Tokenizer>,
    ends: &Arc<Ends>,
    rng: &mut Rng,
    tenants: Vec<TenantLimits>,
) -> Scheduler<Flaky> {
    let spec = spec();
    let pool = build::pool(model, &spec).unwrap();
    let backend = Flaky {
        inner: build::backend(model, &spec),
        rng: Rng::new(rng.next()),
        step_errors: 0,
    };
    let limits = BatchLimits {
        step_tokens_max: spec.step_tokens_max,
        step_seqs_max: spec.step_seqs_max,
    };
    let mut scheduler =
        Scheduler::new(backend, pool, Arc::clone(tokenizer), limits, tenants).unwrap();
    scheduler.set_finish_sink(Arc::clone(ends) as Arc<dyn FinishSink>);
    scheduler
}

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    let parsed = match value.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => value.parse(),
    };
    Some(parsed.unwrap_or_else(|_| panic!("{name}={value} is not a number")))
}

/// Runs `seed` for `steps`; the report, or the failure.
fn simulate(seed: u64, steps: u32, plant: Option<(Plant, u32)>) -> Result<Report, Failure> {
    // The planted engine faults panic on purpose: keep their messages out of
    // the test's output (a real failure still reports through `Failure`).
    let mut world = World::new(seed);
    world.run(steps, plant)?;
    Ok(world.report)
}

fn quiet_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let planted = info
            .payload()
            .downcast_ref::<&str>()
            .is_some_and(|m| *m == "planted engine fault");
        if !planted {
            default(info);
        }
    }));
}

#[test]
fn fixed_seeds_keep_every_invariant() {
    quiet_panics();
    let steps = env_u64("BULKHEAD_SIM_STEPS").map_or(STEPS, |s| s as u32);
    let seeds: Vec<u64> = match (env_u64("BULKHEAD_SIM_SEED"), env_u64("BULKHEAD_SIM_SEEDS")) {
        (Some(seed), _) => vec![seed],
        (None, count) => (0..count.unwrap_or(SEEDS))
            .map(|i| FIRST_SEED + i)
            .collect(),
    };
    let mut total = Report::default();
    for &seed in &seeds {
        let report = simulate(seed, steps, None).unwrap_or_else(|failure| panic!("{failure}"));
        println!("seed {seed:#x}: {report:?}");
        total.accepted += report.accepted;
        total.refused_oversized += report.refused_oversized;
        total.refused_queue_full += report.refused_queue_full;
        total.left += report.left;
        total.engine_faults += report.engine_faults;
        total.preempted += report.preempted;
        for (reason, n) in report.ends {
            *total.ends.entry(reason).or_default() += n;
        }
    }
    println!("{} seeds, {steps} steps each: {total:?}", seeds.len());
    // The traffic reached every path the simulation claims to cover.
    if seeds.len() as u64 >= SEEDS {
        for (what, n) in [
            ("oversized refusals", total.refused_oversized),
            ("full queues", total.refused_queue_full),
            ("clients leaving", total.left),
            ("engine faults", total.engine_faults),
            ("preemptions", total.preempted),
        ] {
            assert!(n > 0, "no {what} in {} seeds: {total:?}", seeds.len());
        }
        // (Not "stop": the tiny model's greedy text never reaches its end
        // token; stops are covered in scheduler_sim.rs and end to end.)
        for reason in ["length", "cancelled", "timeout", "error", "engine_fault"] {
            assert!(
                total.ends.get(reason).is_some_and(|&n| n > 0),
                "no request ended with {reason}: {total:?}"
            );
        }
    }
}

#[test]
fn a_seed_replays_exactly() {
    quiet_panics();
    let a = simulate(FIRST_SEED + 3, 120, None).unwrap_or_else(|f| panic!("{f}"));
    let b = simulate(FIRST_SEED + 3, 120, None).unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(a, b, "the same seed ran differently");
    let c = simulate(FIRST_SEED + 4, 120, None).unwrap_or_else(|f| panic!("{f}"));
    assert_ne!(a.trace, c.trace, "two seeds ran the same traffic");
}

/// Each planted violation is caught by a checker, at the step it was planted;
/// a plant that goes unnoticed fails the suite.
#[test]
fn planted_violations_are_caught() {
    quiet_panics();
    for plant in Plant::ALL {
        let caught = simulate(FIRST_SEED, STEPS, Some((plant, 40)));
        let failure = match caught {
            Err(failure) => failure,
            Ok(report) => panic!("planted {plant:?} was not caught: {report:?}"),
        };
        let expected = match plant {
            Plant::DirtyFree => "not scrubbed",
            Plant::DoubleRelease => "released list",
            Plant::StaleGeneration => "stale handle",
            Plant::WrongOwner => "owner",
            Plant::DoubleEnd => "ended 2 times",
        };
        assert!(
            failure.what.contains(expected),
            "planted {plant:?}, caught as something else: {failure}"
        );
        println!("planted {plant:?}: {}", failure.what);
    }
}
