//! The scheduler: iteration-level continuous batching across tenants, and the
//! typed lifecycle of a request (invariants I1, I6, I8).
//!
//! 1. **Admit** ([`Admission::admit`](super::admission::Admission::admit)): the prompt and `max_tokens` are checked
//!    against the capacity contract before anything shared is touched. The
//!    result is an [`Admitted`] (the only way in) or a terminal [`Rejection`].
//! 2. **Queue**: an `Admitted` waits in its tenant's bounded queue.
//! 3. **Reserve**: when the tenant's turn comes, its partition books the
//!    request's worst case (`prompt + max_tokens` tokens of pages); only then are
//!    pages acquired, into the sequence's own page table. Worst-case booking means
//!    a running sequence never runs out of pages, so no tenant is ever preempted
//!    for another; a request that cannot be booked yet stays queued.
//! 4. **Step**: every [`Scheduler::tick`] builds one batch — a decode token for
//!    each running sequence that has one, then prefill chunks — within
//!    `step_tokens_max` tokens and `step_seqs_max` sequences, in weighted-fair
//!    order of tenants (least virtual time first; a tenant's virtual time grows
//!    by tokens processed divided by its weight).
//! 5. **Finish** ([`Scheduler::finish`]): every exit — stop, length, cancel
//!    (the client went away), timeout, engine error, the tenant's removal —
//!    goes through this one function, which releases the pages; the pool
//!    scrubs them before the next step. A step is synchronous, so no write into
//!    those pages is in flight. A request that ends before it started holds no
//!    page and ends in `finish_queued`.
//! 6. **Tenants** come and go between steps ([`Scheduler::add_tenant`],
//!    [`Scheduler::update_tenant`], [`Scheduler::remove_tenant`]), keyed by
//!    their registry id, never by a position in a list.
//!
//! ```text
//!  NewRequest ──admit──► Admitted ──queue──► (reserve) ──► Sequence ──step*──► finish(reason)
//!      │                    │                                   │                  │
//!      └──► Rejection       └──► finish(timeout | cancelled)    └──────────────────┴─► pages released
//! ```

use super::admission::{Admission, Admitted};
use super::request::{Event, FinishReason, Rejection, RequestId, Usage};
use super::sampling::Sampler;
use super::stats::{SchedulerStats, TenantCounts, TenantStats};
use super::stop::{Scan, StopMatcher};
use crate::tenancy::TenantId;
use bulkhead_kernels::backend::{Backend, SeqStep};
use bulkhead_kernels::kv::{
    OwnerTag, PageTable, PartitionConfig, PartitionError, Pool, ReserveError, SeqId,
};
use bulkhead_kernels::tokenizer::{DecodeOptions, Detokenizer, Tokenizer};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// A tenant's scheduling parameters and KV partition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantLimits {
    /// Its id, from the tenant registry (also its pool owner tag).
    pub id: TenantId,
    /// Its name, for logs.
    pub name: String,
    /// Fair-share weight.
    pub weight: u32,
    /// Most requests queued.
    pub queue_depth_max: u32,
    /// Most sequences running.
    pub running_max: u32,
    /// KV pages only this tenant may use.
    pub pages_reserved: u32,
    /// The most KV pages it may hold.
    pub pages_max: u32,
}

impl TenantLimits {
    fn partition(&self) -> PartitionConfig {
        PartitionConfig {
            owner: OwnerTag(self.id.0),
            pages_reserved: self.pages_reserved,
            pages_max: self.pages_max,
        }
    }
}

/// Why a change to the tenant set was refused. Nothing changed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum TenantChangeError {
    /// Adding a tenant the scheduler has.
    #[error("tenant {0:?} exists already")]
    Exists(TenantId),
    /// Changing or removing a tenant the scheduler does not have.
    #[error("no tenant {0:?}")]
    Unknown(TenantId),
    /// The pool refused the partition (see the message).
    #[error(transparent)]
    Partition(#[from] PartitionError),
}

/// Where every request's end is reported, whatever the exit and whether or
/// not its client is still there: usage accounting.
pub trait FinishSink: Send + Sync {
    /// `tenant`'s request `request` ended with `reason`, having used `usage`.
    fn finished(&self, request: RequestId, tenant: TenantId, reason: FinishReason, usage: Usage);
}

type Sink = Option<Arc<dyn FinishSink>>;

/// Batch limits.
#[derive(Clone, Copy, Debug)]
pub struct BatchLimits {
    /// Most tokens in one step.
    pub step_tokens_max: u32,
    /// Most sequences in one step (and running at once).
    pub step_seqs_max: u32,
}

struct TenantState {
    limits: TenantLimits,
    queue: VecDeque<Admitted>,
    running: u32,
    /// Tokens processed divided by weight: the fair-share clock.
    virtual_time: f64,
    /// Tokens fed to the backend for this tenant.
    tokens_processed: u64,
    /// Requests ever queued, and pages ever acquired (observability).
    counts: TenantCounts,
}

/// A running request: its pages and its progress.
struct Sequence {
    id: RequestId,
    tenant: TenantId,
    table: PageTable,
    prompt: Vec<u32>,
    /// Prompt tokens already in KV.
    prefilled: usize,
    /// Generated tokens; all but the last are in KV.
    generated: u32,
    /// The last sampled token, not yet fed back.
    next: Option<u32>,
    max_tokens: u32,
    sampler: Sampler,
    detokenizer: Detokenizer<Arc<Tokenizer>>,
    stop: StopMatcher,
    /// A stop sequence ended the text: nothing after it is sent.
    text_closed: bool,
    deadline: Instant,
    events: UnboundedSender<Event>,
}

impl Sequence {
    /// Tokens already written into the sequence's pages.
    fn kv_len(&self) -> usize {
        self.prefilled + self.generated.saturating_sub(1) as usize
    }

    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt.len() as u32,
            completion_tokens: self.generated,
        }
    }
}

/// What one tick did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TickReport {
    /// Tokens fed to the backend.
    pub tokens: u32,
    /// Sequences in the step.
    pub seqs: u32,
    /// Requests that finished (any reason).
    pub finished: u32,
}

/// The scheduler: owns the pool, the backend and every request in flight.
pub struct Scheduler<B: Backend> {
    backend: B,
    pool: Pool,
    tokenizer: Arc<Tokenizer>,
    limits: BatchLimits,
    tenants: BTreeMap<TenantId, TenantState>,
    running: Vec<Sequence>,
    tokens_generated: u64,
    /// Pages scrubbed so far (observability).
    pages_scrubbed: u64,
    /// Where ends are reported.
    sink: Sink,
}

/// How one batch entry maps back to its sequence.
struct Planned {
    seq_index: usize,
    tokens: Vec<u32>,
    pos_start: usize,
    wants_logits: bool,
}

impl<B: Backend> Scheduler<B> {
    /// A scheduler over `pool`, with a partition in it for each of `tenants`
    /// (the pool comes without partitions, or with none of theirs).
    pub fn new(
        backend: B,
        pool: Pool,
        tokenizer: Arc<Tokenizer>,
        limits: BatchLimits,
        tenants: Vec<TenantLimits>,
    ) -> Result<Scheduler<B>, TenantChangeError> {
        let mut scheduler = Scheduler {
            backend,
            pool,
            tokenizer,
            limits,
            tenants: BTreeMap::new(),
            running: Vec::new(),
            tokens_generated: 0,
            pages_scrubbed: 0,
            sink: None,
        };
        for tenant in tenants {
            scheduler.add_tenant(tenant)?;
        }
        Ok(scheduler)
    }

    /// The static admission check of this scheduler's model, promising
    /// `context_tokens`: its requests, and no other scheduler's, are queued here.
    pub fn admission(&self, context_tokens: u32) -> Admission {
        Admission {
            context_tokens,
            page_tokens: self.pool.layout().geometry().page_tokens,
            pool: self.pool.id(),
        }
    }

    /// Adds a tenant and its partition (between steps).
    pub fn add_tenant(&mut self, limits: TenantLimits) -> Result<(), TenantChangeError> {
        if self.tenants.contains_key(&limits.id) {
            return Err(TenantChangeError::Exists(limits.id));
        }
        self.pool.add_partition(limits.partition())?;
        // A new tenant starts at the busy tenants' clock, like one back from idle.
        let virtual_time = self.busy_virtual_time_min().unwrap_or(0.0);
        tracing::info!(tenant = %limits.name, tenant_id = limits.id.0, "tenant added");
        self.tenants.insert(
            limits.id,
            TenantState {
                limits,
                queue: VecDeque::new(),
                running: 0,
                virtual_time,
                tokens_processed: 0,
                counts: TenantCounts::default(),
            },
        );
        Ok(())
    }

    /// Changes a tenant's limits and partition; the next admission and booking
    /// follow them (queued and running requests keep their places).
    pub fn update_tenant(&mut self, limits: TenantLimits) -> Result<(), TenantChangeError> {
        let Some(tenant) = self.tenants.get_mut(&limits.id) else {
            return Err(TenantChangeError::Unknown(limits.id));
        };
        self.pool.set_partition(limits.partition())?;
        tracing::info!(tenant = %limits.name, tenant_id = limits.id.0, "tenant limits changed");
        tenant.limits = limits;
        Ok(())
    }

    /// Removes a tenant: its queued and running requests end with reason
    /// `TenantRemoved` through the one finish path, their pages are released
    /// and scrubbed, and only then is its partition freed. Returns how many
    /// requests ended.
    pub fn remove_tenant(&mut self, id: TenantId) -> Result<u32, TenantChangeError> {
        let Some(tenant) = self.tenants.get_mut(&id) else {
            return Err(TenantChangeError::Unknown(id));
        };
        let reason = FinishReason::TenantRemoved;
        let mut ended = 0;
        for admitted in std::mem::take(&mut tenant.queue) {
            finish_queued(&self.sink, admitted, &tenant.limits.name, reason);
            ended += 1;
        }
        while let Some(index) = self.running.iter().rposition(|s| s.tenant == id) {
            self.finish(index, reason);
            ended += 1;
        }
        self.pages_scrubbed += u64::from(self.pool.scrub_released());
        // Every sequence of the tenant has finished and its pages are scrubbed;
        // bookings never outlive `try_start`: the partition holds no page.
        self.pool
            .remove_partition(OwnerTag(id.0))
            .expect("a tenant without sequences or dirty pages holds no page");
        let tenant = self.tenants.remove(&id).expect("looked up above");
        tracing::info!(tenant = %tenant.limits.name, tenant_id = id.0, requests_ended = ended, "tenant removed");
        Ok(ended)
    }

    /// The pool, for stats and invariant checks.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Reports every request's end to `sink` from now on.
    pub fn set_finish_sink(&mut self, sink: Arc<dyn FinishSink>) {
        self.sink = Some(sink);
    }

    /// Requests queued plus running.
    pub fn in_flight(&self) -> usize {
        self.running.len() + self.tenants.values().map(|t| t.queue.len()).sum::<usize>()
    }

    /// Queued requests of a tenant.
    pub fn queued(&self, tenant: TenantId) -> usize {
        self.tenants.get(&tenant).map_or(0, |t| t.queue.len())
    }

    /// Tokens sampled so far, over all requests.
    pub fn tokens_generated(&self) -> u64 {
        self.tokens_generated
    }

    /// Tokens fed to the backend for `tenant` so far.
    pub fn tokens_processed(&self, tenant: TenantId) -> u64 {
        self.tenants.get(&tenant).map_or(0, |t| t.tokens_processed)
    }

    /// The least virtual time among tenants with work, if any has.
    fn busy_virtual_time_min(&self) -> Option<f64> {
        self.tenants
            .values()
            .filter(|t| !t.queue.is_empty() || t.running > 0)
            .map(|t| t.virtual_time)
            .min_by(f64::total_cmp)
    }

    /// Queues an admitted request, or refuses it when its tenant's queue is
    /// full or its tenant is gone (removed between authentication and here);
    /// the request is dropped with the rejection, nothing was touched.
    pub fn enqueue(&mut self, admitted: Admitted) -> Result<(), Rejection> {
        if admitted.pool != self.pool.id() {
            return Err(Rejection::ForeignPool);
        }
        let id = admitted.tenant();
        let busy_min = self.busy_virtual_time_min();
        let Some(tenant) = self.tenants.get_mut(&id) else {
            return Err(Rejection::TenantRemoved);
        };
        if tenant.queue.len() >= tenant.limits.queue_depth_max as usize {
            return Err(Rejection::QueueFull);
        }
        // A tenant that was idle joins at the busy tenants' clock: time spent
        // idle is not credit to spend later at the others' expense.
        if tenant.queue.is_empty() && tenant.running == 0 {
            if let Some(busy_min) = busy_min {
                tenant.virtual_time = tenant.virtual_time.max(busy_min);
            }
        }
        // Higher priority first, arrival order among equals.
        let at = tenant
            .queue
            .iter()
            .position(|queued| queued.priority < admitted.priority)
            .unwrap_or(tenant.queue.len());
        tenant.queue.insert(at, admitted);
        tenant.counts.enqueued_total += 1;
        Ok(())
    }

    /// One iteration: expire, start, step, apply. `now` is the clock (a
    /// parameter so simulations are deterministic).
    pub fn tick(&mut self, now: Instant) -> TickReport {
        let mut report = TickReport {
            finished: self.expire_queued(now) + self.expire_running(now),
            ..TickReport::default()
        };
        self.start_sequences();
        let plan = self.plan_batch();
        if !plan.is_empty() {
            report.tokens = plan.iter().map(|p| p.tokens.len() as u32).sum();
            report.seqs = plan.len() as u32;
            report.finished += self.run_batch(&plan);
        }
        self.pages_scrubbed += u64::from(self.pool.scrub_released());
        report
    }

    /// Ends every queued and running request with `reason` (a shutdown or an
    /// unload, after its drain deadline); running ones release their pages
    /// through [`Scheduler::finish`]. Returns how many it ended.
    pub fn finish_everything(&mut self, reason: FinishReason) -> u32 {
        let mut ended = 0u32;
        for tenant in self.tenants.values_mut() {
            for admitted in tenant.queue.drain(..) {
                finish_queued(&self.sink, admitted, &tenant.limits.name, reason);
                ended = ended.saturating_add(1);
            }
        }
        while !self.running.is_empty() {
            self.finish(self.running.len() - 1, reason);
            ended = ended.saturating_add(1);
        }
        self.pages_scrubbed += u64::from(self.pool.scrub_released());
        ended
    }

    /// Drops queued requests whose client left or whose deadline passed.
    fn expire_queued(&mut self, now: Instant) -> u32 {
        let mut finished = 0;
        for tenant in self.tenants.values_mut() {
            let (kept, expired): (VecDeque<Admitted>, VecDeque<Admitted>) =
                std::mem::take(&mut tenant.queue)
                    .into_iter()
                    .partition(|a| !a.request.events.is_closed() && now < a.request.deadline);
            tenant.queue = kept;
            for admitted in expired {
                let reason = if admitted.request.events.is_closed() {
                    FinishReason::Cancelled
                } else {
                    FinishReason::Timeout
                };
                finish_queued(&self.sink, admitted, &tenant.limits.name, reason);
                finished += 1;
            }
        }
        finished
    }

    /// Finishes running sequences whose client left or whose deadline passed.
    fn expire_running(&mut self, now: Instant) -> u32 {
        let mut finished = 0;
        let mut i = 0;
        while i < self.running.len() {
            let s = &self.running[i];
            let reason = if s.events.is_closed() {
                Some(FinishReason::Cancelled)
            } else if now >= s.deadline {
                Some(FinishReason::Timeout)
            } else {
                None
            };
            match reason {
                Some(reason) => {
                    self.finish(i, reason);
                    finished += 1;
                }
                None => i += 1,
            }
        }
        finished
    }

    /// Tenants, least virtual time first (ties: lower id).
    fn fair_order(&self) -> Vec<TenantId> {
        let mut order: Vec<(f64, TenantId)> = self
            .tenants
            .values()
            .map(|t| (t.virtual_time, t.limits.id))
            .collect();
        order.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        order.into_iter().map(|(_, id)| id).collect()
    }

    /// Moves queued requests to running, in fair order, while sequences and
    /// pages allow: each start books its worst case in its tenant's partition.
    fn start_sequences(&mut self) {
        let seqs_max = self.limits.step_seqs_max as usize;
        loop {
            let mut started = false;
            for id in self.fair_order() {
                if self.running.len() >= seqs_max {
                    return;
                }
                let tenant = &self.tenants[&id];
                if tenant.running >= tenant.limits.running_max || tenant.queue.is_empty() {
                    continue;
                }
                started |= self.try_start(id);
            }
            if !started {
                return;
            }
        }
    }

    /// Books and acquires pages for the head of tenant `id`'s queue.
    fn try_start(&mut self, id: TenantId) -> bool {
        let tenant = self.tenants.get_mut(&id).expect("in the fair order");
        let pages = tenant
            .queue
            .front()
            .expect("checked non-empty")
            .pages_needed;
        let owner = OwnerTag(tenant.limits.id.0);
        let pages_max = self
            .pool
            .partition_stats(owner)
            .map_or(0, |p| p.config.pages_max);
        let mut reservation = match self.pool.reserve(owner, pages) {
            Ok(reservation) => reservation,
            // Not now: pages this tenant holds, or the burst region, are in use; it
            // waits for its own sequences to finish.
            Err(ReserveError::Exhausted { .. } | ReserveError::AboveMax { .. })
                if pages <= pages_max =>
            {
                return false
            }
            Err(other) => {
                // The capacity contract (I2) makes this unreachable for admitted
                // requests; fail the request rather than the process.
                let admitted = tenant.queue.pop_front().expect("checked non-empty");
                tracing::error!(request_id = admitted.id().0, error = %other, "reservation refused");
                finish_queued(
                    &self.sink,
                    admitted,
                    &tenant.limits.name,
                    FinishReason::Error,
                );
                return false;
            }
        };
        let admitted = tenant.queue.pop_front().expect("checked non-empty");
        let request = admitted.request;
        let mut table = self.pool.page_table(&reservation, SeqId(request.id.0));
        for _ in 0..pages {
            self.pool
                .acquire(&mut reservation, &mut table)
                .expect("a reservation of n pages acquires n pages");
        }
        self.pool.release_reservation(reservation);
        tenant.running += 1;
        tenant.counts.pages_acquired_total += u64::from(pages);
        tracing::debug!(request_id = request.id.0, tenant = %tenant.limits.name, pages, "started");
        self.running.push(Sequence {
            id: request.id,
            tenant: id,
            table,
            prompt: request.prompt,
            prefilled: 0,
            generated: 0,
            next: None,
            max_tokens: request.max_tokens,
            sampler: Sampler::new(request.sampling),
            detokenizer: Detokenizer::new(
                Arc::clone(&self.tokenizer),
                DecodeOptions { skip_special: true },
            ),
            stop: StopMatcher::new(request.stop),
            text_closed: false,
            deadline: request.deadline,
            events: request.events,
        });
        true
    }

    /// Chooses this step's work: decode tokens first (each running sequence with
    /// a pending token), then prefill chunks, tenants in fair order.
    fn plan_batch(&self) -> Vec<Planned> {
        let mut budget = self.limits.step_tokens_max as usize;
        let mut plan = Vec::new();
        let order = self.fair_order();
        for decode in [true, false] {
            for &tenant in &order {
                for (seq_index, s) in self.running.iter().enumerate() {
                    if s.tenant != tenant
                        || budget == 0
                        || plan.len() >= self.limits.step_seqs_max as usize
                    {
                        continue;
                    }
                    let entry = match (decode, s.next) {
                        (true, Some(token)) => Planned {
                            seq_index,
                            tokens: vec![token],
                            pos_start: s.kv_len(),
                            wants_logits: true,
                        },
                        (false, None) if s.prefilled < s.prompt.len() => {
                            let n = (s.prompt.len() - s.prefilled).min(budget);
                            Planned {
                                seq_index,
                                tokens: s.prompt[s.prefilled..s.prefilled + n].to_vec(),
                                pos_start: s.prefilled,
                                wants_logits: s.prefilled + n == s.prompt.len(),
                            }
                        }
                        _ => continue,
                    };
                    budget -= entry.tokens.len();
                    plan.push(entry);
                }
            }
        }
        plan
    }

    /// Runs one step and applies its outputs; returns how many finished.
    fn run_batch(&mut self, plan: &[Planned]) -> u32 {
        let steps: Vec<SeqStep> = plan
            .iter()
            .map(|p| SeqStep {
                pages: &self.running[p.seq_index].table,
                pos_start: p.pos_start,
                tokens: &p.tokens,
                wants_logits: p.wants_logits,
            })
            .collect();
        let sampled: Vec<u32> = match self.backend.step(&steps, &mut self.pool) {
            Ok(logits) => {
                let mut out = Vec::new();
                for (row, p) in plan.iter().filter(|p| p.wants_logits).enumerate() {
                    out.push(self.running[p.seq_index].sampler.sample(logits.row(row)));
                }
                out
            }
            Err(error) => {
                tracing::error!(%error, "step refused; failing its sequences");
                return self.finish_all(
                    plan.iter().map(|p| p.seq_index).collect(),
                    FinishReason::Error,
                );
            }
        };
        let mut finishing = Vec::new();
        let mut next_sample = sampled.into_iter();
        for p in plan {
            let s = &mut self.running[p.seq_index];
            let tenant = self
                .tenants
                .get_mut(&s.tenant)
                .expect("a running sequence's tenant exists");
            tenant.virtual_time += p.tokens.len() as f64 / f64::from(tenant.limits.weight);
            tenant.tokens_processed += p.tokens.len() as u64;
            if s.next.is_none() {
                s.prefilled += p.tokens.len();
            }
            if !p.wants_logits {
                continue;
            }
            let token = next_sample
                .next()
                .expect("one sample per entry that wants logits");
            self.tokens_generated += 1;
            if let Some(reason) = self.accept(p.seq_index, token) {
                finishing.push((p.seq_index, reason));
            }
        }
        let finished = finishing.len() as u32;
        // Finish from the highest index down so earlier indices stay valid.
        finishing.sort_by_key(|&(seq_index, _)| std::cmp::Reverse(seq_index));
        for (seq_index, reason) in finishing {
            self.finish(seq_index, reason);
        }
        finished
    }

    /// Takes a sampled token: streams its text, or says why the sequence ends.
    fn accept(&mut self, seq_index: usize, token: u32) -> Option<FinishReason> {
        let is_eog = self.tokenizer.is_eog(token);
        let s = &mut self.running[seq_index];
        if is_eog {
            return Some(FinishReason::Stop);
        }
        s.generated += 1;
        let text = match s.detokenizer.push(token) {
            Ok(text) => text,
            Err(error) => {
                tracing::error!(request_id = s.id.0, %error, "detokenization failed");
                return Some(FinishReason::Error);
            }
        };
        match s.stop.push(&text) {
            Scan::Stopped(text) => {
                if !text.is_empty() {
                    let _ = s.events.send(Event::Text(text));
                }
                s.text_closed = true;
                return Some(FinishReason::Stop);
            }
            Scan::Text(text) if !text.is_empty() => {
                let _ = s.events.send(Event::Text(text));
            }
            Scan::Text(_) => {}
        }
        if s.generated >= s.max_tokens {
            return Some(FinishReason::Length);
        }
        s.next = Some(token);
        None
    }

    fn finish_all(&mut self, mut indices: Vec<usize>, reason: FinishReason) -> u32 {
        indices.sort_unstable_by(|a, b| b.cmp(a));
        indices.dedup();
        let count = indices.len() as u32;
        for i in indices {
            self.finish(i, reason);
        }
        count
    }

    /// The one exit (I6): releases the sequence's pages (scrubbed before the
    /// next step), flushes held text, reports usage, logs without content.
    fn finish(&mut self, seq_index: usize, reason: FinishReason) {
        let mut s = self.running.swap_remove(seq_index);
        let pages = self.pool.release(&mut s.table);
        let tenant = self
            .tenants
            .get_mut(&s.tenant)
            .expect("a running sequence's tenant exists");
        assert!(tenant.running > 0, "a running sequence is counted");
        tenant.running -= 1;
        let usage = s.usage();
        if !s.text_closed && matches!(reason, FinishReason::Stop | FinishReason::Length) {
            // Bytes of an incomplete character and text held for a possible stop
            // sequence belong to the completion after all.
            let tail = s.detokenizer.finish();
            let rest = match s.stop.push(&tail) {
                Scan::Stopped(text) => text,
                Scan::Text(text) => text + &s.stop.finish(),
            };
            if !rest.is_empty() {
                let _ = s.events.send(Event::Text(rest));
            }
        }
        let _ = s.events.send(Event::Finished { reason, usage });
        if let Some(sink) = &self.sink {
            sink.finished(s.id, s.tenant, reason, usage);
        }
        tracing::info!(
            request_id = s.id.0,
            tenant = %tenant.limits.name,
            reason = reason.as_str(),
            prompt_tokens = usage.prompt_tokens,
            completion_tokens = usage.completion_tokens,
            pages,
            "finished"
        );
    }
}

/// Ends a request that never started: it holds no page, so there is nothing
/// to release; its client hears why, with the prompt it sent and nothing
/// generated.
fn finish_queued(sink: &Sink, admitted: Admitted, tenant: &str, reason: FinishReason) {
    let request = admitted.request;
    let usage = Usage {
        prompt_tokens: request.prompt.len() as u32,
        completion_tokens: 0,
    };
    let _ = request.events.send(Event::Finished { reason, usage });
    if let Some(sink) = sink {
        sink.finished(request.id, request.tenant, reason, usage);
    }
    tracing::info!(
        request_id = request.id.0,
        tenant,
        reason = reason.as_str(),
        "finished while queued"
    );
}

impl<B: Backend> Scheduler<B> {
    /// The current counts (cheap: a few numbers per tenant).
    pub fn stats(&self) -> SchedulerStats {
        let pool = self.pool.stats();
        let tenants = self
            .tenants
            .values()
            .map(|t| {
                let p = self.pool.partition_stats(OwnerTag(t.limits.id.0));
                TenantStats {
                    id: t.limits.id.0,
                    queued: t.queue.len() as u32,
                    running: t.running,
                    pages_reserved: t.limits.pages_reserved,
                    pages_max: t.limits.pages_max,
                    pages_owned: p.map_or(0, |p| p.pages_owned),
                    pages_released: p.map_or(0, |p| p.pages_released),
                    pages_booked: p.map_or(0, |p| p.pages_booked),
                    pages_available: p.map_or(0, |p| p.pages_available),
                    counts: t.counts,
                }
            })
            .collect();
        SchedulerStats {
            tenants,
            pages_count: pool.pages_count,
            pages_free: pool.pages_free,
            pages_scrubbed_total: self.pages_scrubbed,
            tokens_generated_total: self.tokens_generated,
        }
    }
}
