//! The scheduler: iteration-level continuous batching across tenants, and the
//! typed lifecycle of a request (invariants I1, I6, I8).
//!
//! 1. **Admit** ([`Admission::admit`](super::admission::Admission::admit)): the prompt and `max_tokens` are checked
//!    against the capacity contract before anything shared is touched. The
//!    result is an [`Admitted`] (the only way in) or a terminal [`Rejection`].
//! 2. **Queue**: an `Admitted` waits in its tenant's bounded queue.
//! 3. **Reserve**: when the tenant's turn comes, its partition books the
//!    request's worst case (`prompt + max_tokens` tokens of pages, less the
//!    prompt pages found in the tenant's own prefix cache, which are attached
//!    read-only: `engine::prefix`); only then are pages acquired, into the
//!    sequence's own page table. Worst-case booking means a running sequence
//!    never runs out of pages; a request that cannot be booked yet stays queued.
//! 4. **Reclaim** (I8): pages above a tenant's reservation, and sequence slots
//!    above its guaranteed share (one each, the rest of `step_seqs_max` by
//!    weight), are on loan. When a request cannot book because
//!    others hold the burst region, or cannot start because others hold the
//!    slots, the lenders' youngest sequences are preempted: their pages are
//!    released and scrubbed, they wait at the head of their own tenant's queue,
//!    and when they start again their KV is recomputed from their tokens (the
//!    engine is batch-invariant, so the output is the same bits). Victims are
//!    only ever tenants above their own reservation (or slot share), and only
//!    while they hold more burst than the claimant would after its booking: the
//!    sum of squared loans falls with every reclaim, so two tenants can never
//!    take pages back and forth for ever.
//! 5. **Step**: every [`Scheduler::tick`] builds one batch — a decode token for
//!    each running sequence that has one, then prefill chunks — within
//!    `step_tokens_max` tokens and `step_seqs_max` sequences, in weighted-fair
//!    order of tenants (least virtual time first; a tenant's virtual time grows
//!    by tokens processed divided by its weight). While several tenants are
//!    active each takes at most its weighted share of a step's prompt tokens,
//!    and a lightly loaded tenant's first chunk gets a step without the
//!    others' prompts (the rules of `plan_batch`): a step cannot be
//!    interrupted, so its length bounds another tenant's time to first token.
//! 6. **Finish** (`Scheduler::end`): every exit of a started sequence,
//!    running or preempted — stop, length, cancel (the client went away),
//!    timeout, engine error, the tenant's removal — goes through this one
//!    function, which releases the pages (cached ones stay cached); the pool
//!    scrubs them before the next step. A step is synchronous, so no write into
//!    those pages is in flight. A request that ends before it started holds no
//!    page and ends in `finish_queued`.
//! 7. **Tenants** come and go between steps ([`Scheduler::add_tenant`],
//!    [`Scheduler::update_tenant`], [`Scheduler::remove_tenant`]), keyed by
//!    their registry id, never by a position in a list.
//!
//! ```text
//!  NewRequest ──admit──► Admitted ──queue──► (reserve) ──► Sequence ──step*──► finish(reason)
//!      │                    │                     ▲             │                  │
//!      └──► Rejection       │                     └─ preempted ◄┘ (pages released) │
//!                           └──► finish(timeout | cancelled)    └──────────────────┴─► pages released
//! ```

use super::admission::{Admission, Admitted};
use super::handoff::{ExportTo, PrefillRequest, RemotePrefill, Transferred};
use super::prefix::PrefixCache;
use super::request::{Event, FinishReason, Rejection, RequestId, TokenLogprob, Usage};
use super::sampling::{sample_rows, score_rows, Logprobs, Sampled, Sampler};
use super::stats::{
    EngineTotals, PoolAudit, SchedulerStats, StepCounts, TenantCounts, TenantPages, TenantStats,
};
use super::stop::{Scan, StopMatcher};
use crate::tenancy::TenantId;
use bulkhead_kernels::backend::{Backend, Pick, PromptScores, SeqStep, StepError};
use bulkhead_kernels::kv::{
    tokens_digest, OwnerTag, PageHandle, PageTable, PartitionConfig, PartitionError, Pool,
    Reservation, ReserveError, SeqId, TransferIdentity, Violation,
};
use bulkhead_kernels::tokenizer::{DecodeOptions, Detokenizer, Tokenizer};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
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
    /// Whether its full prompt pages are cached for its later requests.
    pub prefix_cache: bool,
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

/// What [`Scheduler::check`] found.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The pool or a page table.
    #[error(transparent)]
    Pool(#[from] Violation),
    /// The prefix cache disagrees with the pool.
    #[error("prefix cache: {0}")]
    Cache(String),
}

/// Where every request's end is reported, whatever the exit and whether or
/// not its client is still there: usage accounting.
pub trait FinishSink: Send + Sync {
    /// `tenant`'s request `request` ended with `reason`, having used `usage`.
    fn finished(&self, request: RequestId, tenant: TenantId, reason: FinishReason, usage: Usage);

    /// The engine of `fault.model` panicked (see [`super::service`]): for the
    /// audit log. Its requests' ends were reported one by one before.
    fn engine_fault(&self, fault: &EngineFault<'_>) {
        let _ = fault;
    }
}

/// An engine panic, as reported to a [`FinishSink`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineFault<'a> {
    /// The engine's model.
    pub model: &'a str,
    /// Requests in flight that ended with `engine_fault`.
    pub requests_ended: u32,
    /// Faults in a row, this one included (reset once an engine has run a
    /// while without one).
    pub in_a_row: u32,
    /// When the engine restarts; `None`: it stays down (too many faults in a
    /// row), not ready, until the model is unloaded and loaded again.
    pub restart_in: Option<std::time::Duration>,
}

/// Where a request's end goes: the finish sink, and the process's token
/// counters under the model's id.
#[derive(Default)]
struct Ends {
    sink: Option<Arc<dyn FinishSink>>,
    /// The model's id in metrics; `None` (tests, benches, `bulkhead
    /// generate`) counts nothing.
    model: Option<Arc<str>>,
}

impl Ends {
    /// Ends `tenant`'s request `request` (the tenant named `name`) with
    /// `reason`: counts its tokens, tells its client through `events`, and
    /// reports it to the sink. The tokens are counted here, where every end
    /// passes, before the client can hear of it and whether or not it is
    /// still there (the API layer counts a request whose client left as
    /// `cancelled`, knowing none of its tokens); the usage store counts the
    /// same tokens from the sink.
    fn report(
        &self,
        (request, tenant, name): (RequestId, TenantId, &str),
        events: &UnboundedSender<Event>,
        reason: FinishReason,
        usage: Usage,
    ) {
        if let Some(model) = &self.model {
            crate::telemetry::count_tokens(
                model,
                name,
                usage.prompt_tokens,
                usage.completion_tokens,
            );
        }
        let _ = events.send(Event::Finished { reason, usage });
        if let Some(sink) = &self.sink {
            sink.finished(request, tenant, reason, usage);
        }
    }
}

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
    /// Its sequences preempted to give pages or slots back, oldest first: they
    /// start again before anything in `queue`.
    preempted: VecDeque<Sequence>,
    running: u32,
    /// Tokens processed divided by weight: the fair-share clock.
    virtual_time: f64,
    /// Tokens fed to the backend for this tenant.
    tokens_processed: u64,
    /// Requests ever queued, and pages ever acquired (observability).
    counts: TenantCounts,
    /// The last tick at which it had work: a tenant between two requests
    /// still counts as active for [`RECENTLY_ACTIVE`].
    active_at: Option<Instant>,
}

/// How long after its last work a tenant still takes its weighted share of
/// each step's prompt tokens: a client that sends its next request as soon as
/// the last one ends is never idle to the scheduler.
const RECENTLY_ACTIVE: Duration = Duration::from_secs(2);

impl TenantState {
    fn has_work(&self) -> bool {
        !self.queue.is_empty() || !self.preempted.is_empty() || self.running > 0
    }
}

/// Where a started sequence is (see [`super::handoff`] for the diagram). Its
/// KV state is `table` (or, in `Transfer`, the import that holds it); the
/// client-output state (sampler, detokenizer, stop matcher) is apart.
enum Phase {
    /// Its prompt's KV is computed here (after an import: its last token).
    Prefill,
    /// Waiting for a prefill peer's KV: its pages are reserved and held by
    /// the import, which nothing can step; only the page book's check turns
    /// it back into a table. Dropping `abandon` stops the job.
    Transfer {
        import: bulkhead_kernels::kv::Import,
        abandon: tokio::sync::oneshot::Sender<()>,
    },
    /// Its prompt is in KV; one token per step.
    Decode,
    /// Prefill role: its prompt's KV was exported; its pages are held until
    /// the link drops `held` (the peer's verdict is in, or the link failed).
    Exported {
        held: tokio::sync::oneshot::Sender<()>,
    },
}

impl Phase {
    fn steps(&self) -> bool {
        matches!(self, Phase::Prefill | Phase::Decode)
    }
}

/// A started request: its pages and its progress. A preempted one keeps
/// everything but its pages.
struct Sequence {
    id: RequestId,
    tenant: TenantId,
    phase: Phase,
    /// Decode role: its prompt's KV is to come from a prefill peer (cleared
    /// once preempted: a restart recomputes here).
    remote: bool,
    /// Prefill role: where its prompt's KV goes.
    export: Option<ExportTo>,
    table: PageTable,
    /// The prompt, then every generated token that continues the sequence; the
    /// last one sampled is not in KV yet.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens of `tokens` whose K and V are in the pages.
    kv_len: usize,
    /// Generated tokens (an end-of-generation token is not counted).
    generated: u32,
    /// Pages its worst case needs.
    pages_needed: u32,
    /// When it first started (a scheduler counter): the youngest are preempted first.
    started: u64,
    /// The tick it was last preempted in: it starts again in a later one, so
    /// one tick's starts always end (a start never undoes one of its own tick).
    preempted_in: Option<u64>,
    /// Keys of the prompt's full pages; empty when its tenant's cache is off.
    chain: Vec<u64>,
    /// Its request's cache salt.
    cache_salt: Option<String>,
    /// The prefill peer a gateway chose for it (decode role).
    prefill_hint: Option<String>,
    /// Prompt pages found in the cache or shared into it so far.
    pages_published: usize,
    /// Prompt tokens found in the cache at its first start.
    cached_tokens: u32,
    max_tokens: u32,
    sampler: Sampler,
    detokenizer: Detokenizer<Arc<Tokenizer>>,
    stop: StopMatcher,
    /// A stop sequence ended the text: nothing after it is sent.
    text_closed: bool,
    /// Where the request asks for its prompt's log probabilities.
    scoring: Option<Scoring>,
    deadline: Instant,
    events: UnboundedSender<Event>,
}

impl Sequence {
    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_len as u32,
            completion_tokens: self.generated,
            cached_tokens: self.cached_tokens,
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
    /// Sequences preempted to give pages or slots back.
    pub preempted: u32,
}

/// The scheduler: owns the pool, the backend and every request in flight.
pub struct Scheduler<B: Backend> {
    backend: B,
    pool: Pool,
    tokenizer: Arc<Tokenizer>,
    limits: BatchLimits,
    tenants: BTreeMap<TenantId, TenantState>,
    running: Vec<Sequence>,
    cache: PrefixCache,
    /// Sequences started so far (their `started` order).
    starts: u64,
    /// Sequences preempted in the current tick.
    preempted_in_tick: u32,
    /// Ticks so far.
    ticks: u64,
    tokens_generated: u64,
    /// The steps run so far (observability).
    steps: StepCounts,
    /// Pages scrubbed so far (observability).
    pages_scrubbed: u64,
    /// Where ends are reported.
    ends: Ends,
    /// Decode role: where prompts' KV comes from.
    remote: Option<RemotePrefill>,
}

/// A prompt's log probabilities on their way: each position's logits
/// score the token after it.
#[derive(Clone, Copy, Debug)]
struct Scoring {
    /// Alternatives per token.
    top: u8,
    /// The next position whose logits score a prompt token (positions
    /// before it were scored, also by a run that was since preempted).
    next: usize,
}

/// How one batch entry maps back to its sequence.
struct Planned {
    seq_index: usize,
    tokens: Vec<u32>,
    pos_start: usize,
    /// Rows of logits asked for.
    rows: Rows,
}

impl Sequence {
    /// What `p`'s first rows (its scored prompt positions) ask: each one's
    /// score of the prompt's token after it.
    fn prompt_scores(&self, p: &Planned) -> PromptScores<'_> {
        let Some(scoring) = self.scoring.filter(|_| p.rows.scored > 0) else {
            return PromptScores::NONE;
        };
        let first = p.pos_start + p.tokens.len() - p.rows.logits;
        PromptScores {
            targets: &self.tokens[first + 1..first + 1 + p.rows.scored],
            top: scoring.top,
        }
    }

    /// The rows of logits a chunk of `n` tokens from `kv_len` asks for (the
    /// chunk's last positions): the prompt positions it scores first, then
    /// the prompt's last position when the chunk holds it, sampled from
    /// (the next token) or, with nothing to generate, left unused.
    fn rows_of(&self, n: usize) -> Rows {
        let end = self.kv_len + n;
        let samples = end == self.tokens.len() && self.export.is_none() && self.max_tokens > 0;
        let (logits, scored) = match self.scoring {
            Some(sc) if sc.next.max(self.kv_len) < end.min(self.prompt_len - 1) => {
                let from = sc.next.max(self.kv_len);
                let scored = end.min(self.prompt_len - 1) - from;
                (end - from, scored)
            }
            _ => (usize::from(samples), 0),
        };
        Rows {
            logits,
            scored,
            samples,
        }
    }
}

/// What a chunk asks of a step's logits.
#[derive(Clone, Copy, Debug)]
struct Rows {
    /// Rows, one for each of the chunk's last positions.
    logits: usize,
    /// The first rows, that score the prompt's tokens after them.
    scored: usize,
    /// The last row is sampled from.
    samples: bool,
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
        let cache = PrefixCache::new(pool.id(), pool.layout().geometry().page_tokens);
        let mut scheduler = Scheduler {
            backend,
            pool,
            tokenizer,
            limits,
            tenants: BTreeMap::new(),
            running: Vec::new(),
            cache,
            starts: 0,
            preempted_in_tick: 0,
            ticks: 0,
            tokens_generated: 0,
            steps: StepCounts::default(),
            pages_scrubbed: 0,
            ends: Ends::default(),
            remote: None,
        };
        for tenant in tenants {
            scheduler.add_tenant(tenant)?;
        }
        Ok(scheduler)
    }

    /// Decode role: every prompt of two tokens or more gets its KV (all but
    /// its last token) from a prefill peer through `remote`.
    pub fn set_remote_prefill(&mut self, remote: RemotePrefill) {
        self.remote = Some(remote);
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
                preempted: VecDeque::new(),
                running: 0,
                virtual_time,
                tokens_processed: 0,
                counts: TenantCounts::default(),
                active_at: None,
            },
        );
        Ok(())
    }

    /// Changes a tenant's limits and partition; the next admission and booking
    /// follow them (queued and running requests keep their places).
    pub fn update_tenant(&mut self, limits: TenantLimits) -> Result<(), TenantChangeError> {
        if !self.tenants.contains_key(&limits.id) {
            return Err(TenantChangeError::Unknown(limits.id));
        }
        // Its idle cache would count against a smaller maximum: let it go.
        self.cache
            .evict_idle(&mut self.pool, limits.id, usize::MAX, &[]);
        self.pages_scrubbed += u64::from(self.pool.scrub_released());
        let tenant = self.tenants.get_mut(&limits.id).expect("checked above");
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
            finish_queued(&self.ends, admitted, &tenant.limits.name, reason);
            ended += 1;
        }
        for s in std::mem::take(&mut tenant.preempted) {
            self.end(s, reason);
            ended += 1;
        }
        while let Some(index) = self.running.iter().rposition(|s| s.tenant == id) {
            self.finish(index, reason);
            ended += 1;
        }
        // No sequence holds its cached pages any more: all of them go.
        self.cache.evict_idle(&mut self.pool, id, usize::MAX, &[]);
        self.pages_scrubbed += u64::from(self.pool.scrub_released());
        // Every sequence of the tenant has finished and its pages are scrubbed;
        // bookings never outlive `try_start`: the partition holds no page.
        self.pool
            .remove_partition(OwnerTag(id.0))
            .expect("a tenant without sequences or dirty pages holds no page");
        let tenant = self.tenants.remove(&id).expect("looked up above");
        tracing::info!(tenant = %tenant.limits.name, tenant_id = id.0, requests_ended = ended, "tenant's partition removed from this model");
        Ok(ended)
    }

    /// The pool, for stats and invariant checks.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The pool, mutably: for planting faults the checkers must catch.
    #[cfg(feature = "fault-injection")]
    #[doc(hidden)]
    pub fn pool_mut(&mut self) -> &mut Pool {
        &mut self.pool
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Reports every request's end to `sink` from now on.
    pub fn set_finish_sink(&mut self, sink: Arc<dyn FinishSink>) {
        self.ends.sink = Some(sink);
    }

    /// Counts every request's tokens in the process's metrics, and in the
    /// console's series, under the model id `model` from now on.
    pub fn set_model_id(&mut self, model: &str) {
        self.ends.model = Some(Arc::from(model));
    }

    /// Where request ends are reported, if anywhere.
    pub fn finish_sink(&self) -> Option<Arc<dyn FinishSink>> {
        self.ends.sink.clone()
    }

    /// The engine's cumulative counts: what a rebuilt engine starts from.
    pub fn totals(&self) -> EngineTotals {
        EngineTotals {
            pages_scrubbed: self.pages_scrubbed,
            tokens_generated: self.tokens_generated,
            steps: self.steps,
            tenants: self
                .tenants
                .iter()
                .map(|(id, t)| (id.0, t.counts))
                .collect(),
        }
    }

    /// Adds a broken engine's `totals` to this one's counts (a tenant since
    /// removed has no counts to carry).
    pub fn carry_totals(&mut self, totals: &EngineTotals) {
        self.pages_scrubbed += totals.pages_scrubbed;
        self.tokens_generated += totals.tokens_generated;
        self.steps.add(&totals.steps);
        for (id, counts) in &totals.tenants {
            if let Some(tenant) = self.tenants.get_mut(&TenantId(*id)) {
                tenant.counts.add(counts);
            }
        }
    }

    /// Every tenant's limits, in id order: what a rebuilt engine starts with.
    pub fn tenant_limits(&self) -> Vec<TenantLimits> {
        self.tenants.values().map(|t| t.limits.clone()).collect()
    }

    /// Requests queued plus running.
    pub fn in_flight(&self) -> usize {
        self.running.len()
            + self
                .tenants
                .values()
                .map(|t| t.queue.len() + t.preempted.len())
                .sum::<usize>()
    }

    /// Queued requests of a tenant (preempted ones included).
    pub fn queued(&self, tenant: TenantId) -> usize {
        self.tenants
            .get(&tenant)
            .map_or(0, |t| t.queue.len() + t.preempted.len())
    }

    /// Running sequences of a tenant.
    pub fn running(&self, tenant: TenantId) -> u32 {
        self.tenants.get(&tenant).map_or(0, |t| t.running)
    }

    /// Every check there is, for tests and a paranoid mode: the pool's
    /// invariants, every sequence's page table against the pool (no page in two
    /// tenants' tables, shared pages only of the table's own tenant, reference
    /// counts exact), and the prefix cache against the pool.
    pub fn check(&self) -> Result<(), CheckError> {
        let sequences = || {
            self.running
                .iter()
                .chain(self.tenants.values().flat_map(|t| t.preempted.iter()))
        };
        let tables: Vec<&PageTable> = sequences().map(|s| &s.table).collect();
        let imports: Vec<&bulkhead_kernels::kv::Import> = sequences()
            .filter_map(|s| match &s.phase {
                Phase::Transfer { import, .. } => Some(import),
                _ => None,
            })
            .collect();
        self.pool.check_page_tables_with(&tables, &imports)?;
        for &id in self.tenants.keys() {
            let shared = self
                .pool
                .partition_stats(OwnerTag(id.0))
                .map_or(0, |p| p.pages_shared);
            if shared as usize != self.cache.pages(id) {
                return Err(CheckError::Cache(format!(
                    "tenant {id:?} has {shared} shared pages and {} cached",
                    self.cache.pages(id)
                )));
            }
        }
        self.cache.check(&self.pool).map_err(CheckError::Cache)
    }

    /// Pages in a tenant's prefix cache (idle or in use).
    pub fn cached_pages(&self, tenant: TenantId) -> usize {
        self.cache.pages(tenant)
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
            .filter(|t| t.has_work())
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
        if !tenant.has_work() {
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

    /// Queues a request's sequences (all of one tenant) together: for each
    /// of its prompts, that prompt's choices. All of them, or, when the
    /// tenant's queue has no room for all, none ([`Rejection::QueueFull`]);
    /// otherwise as [`Scheduler::enqueue`] refuses one. A prompt's first
    /// choice starts as any request does; its others once that one's prompt
    /// is in KV (`Admitted::after`), so that they find the prompt's full
    /// pages in the tenant's prefix cache and compute only what is past them.
    pub fn enqueue_all(&mut self, mut prompts: Vec<Vec<Admitted>>) -> Result<(), Rejection> {
        let Some(first) = prompts.iter().flatten().next() else {
            return Ok(());
        };
        let id = first.tenant();
        let mut count = 0;
        for c in prompts.iter().flatten() {
            if c.pool != self.pool.id() || c.tenant() != id {
                return Err(Rejection::ForeignPool);
            }
            count += 1;
        }
        let Some(tenant) = self.tenants.get(&id) else {
            return Err(Rejection::TenantRemoved);
        };
        if tenant.queue.len() + count > tenant.limits.queue_depth_max as usize {
            return Err(Rejection::QueueFull);
        }
        for choices in &mut prompts {
            let Some(leader) = choices.first().map(|c| c.request.id) else {
                continue;
            };
            for sibling in choices.iter_mut().skip(1) {
                sibling.after = Some(leader);
            }
        }
        // Each passes `enqueue`'s checks: those just made.
        prompts
            .into_iter()
            .flatten()
            .try_for_each(|c| self.enqueue(c))
    }

    /// Whether a queued choice waits for its first sibling's prompt: while
    /// that one computes its prompt here (it was queued ahead, so it is
    /// running or gone by the time this one heads the queue), and only where
    /// the tenant's prefix cache would hand the pages over (not for a prompt
    /// that comes from a prefill peer).
    fn waits_for_sibling(&self, admitted: &Admitted, remote: bool) -> bool {
        let Some(leader) = admitted.after else {
            return false;
        };
        let tenant = &self.tenants[&admitted.tenant()];
        let scores = admitted.request.sampling.prompt_logprobs.is_some();
        if !tenant.limits.prefix_cache || remote || scores {
            return false;
        }
        self.running
            .iter()
            .any(|s| s.id == leader && matches!(s.phase, Phase::Prefill) && s.kv_len < s.prompt_len)
    }

    /// One iteration: expire, start, step, apply. `now` is the clock (a
    /// parameter so simulations are deterministic).
    pub fn tick(&mut self, now: Instant) -> TickReport {
        self.preempted_in_tick = 0;
        self.ticks += 1;
        let mut report = TickReport {
            finished: self.expire_queued(now) + self.expire_running(now),
            ..TickReport::default()
        };
        self.start_sequences();
        for tenant in self.tenants.values_mut() {
            if tenant.has_work() {
                tenant.active_at = Some(now);
            }
        }
        let plan = self.plan_batch(now);
        if !plan.is_empty() {
            report.tokens = plan.iter().map(|p| p.tokens.len() as u32).sum();
            report.seqs = plan.len() as u32;
            report.finished += self.run_batch(&plan);
        }
        self.trim_caches();
        self.pages_scrubbed += u64::from(self.pool.scrub_released());
        report.preempted = self.preempted_in_tick;
        report
    }

    /// Ends every queued and running request with `reason` (a shutdown or an
    /// unload, after its drain deadline); running ones release their pages
    /// through `Scheduler::finish`. Returns how many it ended.
    pub fn finish_everything(&mut self, reason: FinishReason) -> u32 {
        let mut ended = 0u32;
        let mut preempted = Vec::new();
        for tenant in self.tenants.values_mut() {
            for admitted in tenant.queue.drain(..) {
                finish_queued(&self.ends, admitted, &tenant.limits.name, reason);
                ended = ended.saturating_add(1);
            }
            preempted.extend(tenant.preempted.drain(..));
        }
        for s in preempted {
            self.end(s, reason);
            ended = ended.saturating_add(1);
        }
        while !self.running.is_empty() {
            self.finish(self.running.len() - 1, reason);
            ended = ended.saturating_add(1);
        }
        self.pages_scrubbed += u64::from(self.pool.scrub_released());
        ended
    }

    /// Drops queued requests (and preempted sequences) whose client left or
    /// whose deadline passed.
    fn expire_queued(&mut self, now: Instant) -> u32 {
        let mut finished = 0;
        let mut expired_preempted = Vec::new();
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
                finish_queued(&self.ends, admitted, &tenant.limits.name, reason);
                finished += 1;
            }
            let (kept, expired): (VecDeque<Sequence>, VecDeque<Sequence>) =
                std::mem::take(&mut tenant.preempted)
                    .into_iter()
                    .partition(|s| s.expiry(now).is_none());
            tenant.preempted = kept;
            expired_preempted.extend(expired);
        }
        for s in expired_preempted {
            let reason = s.expiry(now).expect("partitioned as expired");
            self.end(s, reason);
            finished += 1;
        }
        finished
    }

    /// Finishes running sequences whose client left or whose deadline passed.
    fn expire_running(&mut self, now: Instant) -> u32 {
        let mut finished = 0;
        let mut i = 0;
        while i < self.running.len() {
            match self.running[i].expiry(now) {
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

    /// The sequence slots tenant `id` is guaranteed, at most its
    /// `running_max`: one each (the capacity contract keeps `step_seqs_max` at
    /// least the tenant count), and the rest of `step_seqs_max` by weight,
    /// rounded down (so the guarantees never add up to more than the slots).
    /// Under contention each tenant's share of running sequences, and so of
    /// decode tokens, follows its weight; slots nobody claims are lent.
    fn slots_guaranteed(&self, id: TenantId) -> u32 {
        let tenants = self.tenants.len().max(1) as u64;
        let rest = u64::from(self.limits.step_seqs_max).saturating_sub(tenants);
        let weights: u64 = self
            .tenants
            .values()
            .map(|t| u64::from(t.limits.weight))
            .sum();
        let limits = &self.tenants[&id].limits;
        let share = 1 + rest * u64::from(limits.weight) / weights.max(1);
        (share as u32).min(limits.running_max)
    }

    /// Moves preempted and queued work to running while sequences and pages
    /// allow, one start at a time, each to the tenant with work that runs the
    /// fewest sequences for its weight (ties: least virtual time, then id):
    /// so slots nobody is guaranteed, lent ones included, are split by weight
    /// too, not in turns. Each start books its worst case in its tenant's
    /// partition.
    fn start_sequences(&mut self) {
        // Sequences that ended since the last step may have left idle cached
        // pages above their tenant's reservation: not a loan anyone reclaims.
        self.trim_caches();
        self.pages_scrubbed += u64::from(self.pool.scrub_released());
        loop {
            let mut order: Vec<(f64, f64, TenantId)> = self
                .tenants
                .values()
                .filter(|t| {
                    t.running < t.limits.running_max
                        && !(t.queue.is_empty() && t.preempted.is_empty())
                })
                .map(|t| {
                    let per_weight = f64::from(t.running) / f64::from(t.limits.weight.max(1));
                    (per_weight, t.virtual_time, t.limits.id)
                })
                .collect();
            order.sort_by(|a, b| {
                a.0.total_cmp(&b.0)
                    .then(a.1.total_cmp(&b.1))
                    .then(a.2.cmp(&b.2))
            });
            if !order.into_iter().any(|(_, _, id)| self.try_start(id)) {
                return;
            }
        }
    }

    /// Starts the head of tenant `id`'s work (a preempted sequence, else its
    /// queue's head): finds its prompt's cached pages, books the rest of its
    /// worst case, and takes a slot, reclaiming loaned pages and slots when it
    /// is owed them. Returns whether it started.
    fn try_start(&mut self, id: TenantId) -> bool {
        let seqs_max = self.limits.step_seqs_max as usize;
        let slots_full = self.running.len() >= seqs_max;
        if slots_full && self.tenants[&id].running >= self.slots_guaranteed(id) {
            return false;
        }
        let page_tokens = self.page_tokens();
        let tenant = &self.tenants[&id];
        if tenant.preempted.front().and_then(|s| s.preempted_in) == Some(self.ticks) {
            return false;
        }
        let (pages_needed, tokens, prompt_len, salt, remote, scores) =
            match tenant.preempted.front() {
                Some(s) => (
                    s.pages_needed,
                    &s.tokens,
                    s.prompt_len,
                    &s.cache_salt,
                    false,
                    s.scoring.is_some(),
                ),
                None => {
                    let admitted = tenant.queue.front().expect("has work");
                    let request = &admitted.request;
                    let prompt = &request.prompt;
                    let scores = request.sampling.prompt_logprobs.is_some();
                    let remote = self.remote.is_some()
                        && admitted.export.is_none()
                        && prompt.len() >= 2
                        && !scores;
                    if self.waits_for_sibling(admitted, remote) {
                        return false;
                    }
                    (
                        admitted.pages_needed,
                        prompt,
                        prompt.len(),
                        &request.cache_salt,
                        remote,
                        scores,
                    )
                }
            };
        // A prompt from a peer arrives whole into pages of its own: no cached
        // page is attached under it (its full pages are published as usual).
        let (chain, cached) = if tenant.limits.prefix_cache && !remote {
            let chain = self.cache.chain(id, salt.as_deref(), &tokens[..prompt_len]);
            // At least one token is computed, for the logits of the next; a
            // prompt whose log probabilities are asked for, every token.
            let pages_max = match scores {
                true => 0,
                false => ((tokens.len() - 1) / page_tokens).min(chain.len()),
            };
            let cached = self
                .cache
                .lookup(id, &chain, &tokens[..prompt_len], pages_max);
            (chain, cached)
        } else {
            (Vec::new(), Vec::new())
        };
        // cached * page_tokens < tokens.len() <= pages_needed * page_tokens.
        let pages = pages_needed - cached.len() as u32;
        let mut reservation = match self.book(id, pages, &cached) {
            Booking::Booked(reservation) => reservation,
            Booking::Wait => return false,
            Booking::Refused(error) => {
                // The capacity contract (I2) makes this unreachable for admitted
                // requests; fail the request rather than the process.
                let tenant = self.tenants.get_mut(&id).expect("exists");
                tracing::error!(tenant = %tenant.limits.name, %error, "reservation refused");
                match tenant.preempted.pop_front() {
                    Some(s) => self.end(s, FinishReason::Error),
                    None => {
                        let admitted = tenant.queue.pop_front().expect("has work");
                        finish_queued(
                            &self.ends,
                            admitted,
                            &tenant.limits.name,
                            FinishReason::Error,
                        );
                    }
                }
                return false;
            }
        };
        if self.running.len() >= seqs_max && !self.reclaim_slot(id) {
            self.pool.release_reservation(reservation);
            return false;
        }
        self.starts += 1;
        let starts = self.starts;
        let tenant = self.tenants.get_mut(&id).expect("exists");
        let mut s = match tenant.preempted.pop_front() {
            Some(s) => s,
            None => {
                let admitted = tenant.queue.pop_front().expect("has work");
                let pages_needed = admitted.pages_needed;
                let export = admitted.export;
                let request = admitted.request;
                let scoring = request
                    .sampling
                    .prompt_logprobs
                    .map(|top| Scoring { top, next: 0 });
                let sampler =
                    Sampler::for_request(request.sampling, &self.tokenizer, &request.prompt);
                Sequence {
                    id: request.id,
                    tenant: id,
                    phase: Phase::Prefill,
                    remote,
                    export,
                    table: self.pool.page_table(&reservation, SeqId(request.id.0)),
                    prompt_len: request.prompt.len(),
                    tokens: request.prompt,
                    kv_len: 0,
                    generated: 0,
                    pages_needed,
                    started: starts,
                    preempted_in: None,
                    chain: Vec::new(),
                    cache_salt: request.cache_salt,
                    prefill_hint: request.prefill_hint,
                    pages_published: 0,
                    cached_tokens: (cached.len() * page_tokens) as u32,
                    max_tokens: request.max_tokens,
                    sampler,
                    detokenizer: Detokenizer::new(
                        Arc::clone(&self.tokenizer),
                        DecodeOptions { skip_special: true },
                    ),
                    stop: StopMatcher::new(request.stop),
                    text_closed: false,
                    scoring,
                    deadline: request.deadline,
                    events: request.events,
                }
            }
        };
        debug_assert!(s.table.is_empty(), "a sequence starts without pages");
        for &handle in &cached {
            self.pool
                .attach(&mut s.table, handle)
                .expect("a page found in the cache this tick is shared and current");
        }
        for _ in 0..pages {
            self.pool
                .acquire(&mut reservation, &mut s.table)
                .expect("a reservation of n pages acquires n pages");
        }
        if s.remote {
            let remote = self.remote.as_ref().expect("remote sequences need a peer");
            ask_peer(&self.pool, remote, &mut s, &reservation);
        }
        self.pool.release_reservation(reservation);
        s.kv_len = cached.len() * page_tokens;
        s.pages_published = cached.len();
        s.chain = chain;
        tenant.running += 1;
        tenant.counts.pages_acquired_total += u64::from(pages);
        tenant.counts.cached_tokens_total += s.kv_len as u64;
        tracing::debug!(
            request_id = s.id.0,
            tenant = %tenant.limits.name,
            pages,
            pages_cached = cached.len(),
            "started"
        );
        self.running.push(s);
        true
    }

    /// Decode role: a transfer this scheduler asked for came back (or
    /// failed). A verified import makes the sequence decodable — its last
    /// prompt token is computed here, for the logits of the first new one —
    /// and anything else ends it, its pages released and scrubbed. Returns
    /// the verdict for the peer; a transfer nobody waits for (the request
    /// ended, or another job of it) is refused as `abandoned`.
    pub fn transferred(
        &mut self,
        request: RequestId,
        job: u64,
        result: Transferred,
    ) -> Result<(), &'static str> {
        let Some(index) = self.running.iter().position(|s| {
            s.id == request
                && matches!(&s.phase, Phase::Transfer { import, .. } if import.expect().job == job)
        }) else {
            return Err("abandoned");
        };
        let s = &mut self.running[index];
        let Phase::Transfer { import, .. } = std::mem::replace(&mut s.phase, Phase::Prefill) else {
            unreachable!("matched above");
        };
        let tokens = import.expect().tokens as usize;
        let (finish, reason): (FinishReason, &'static str) = match result {
            Transferred::Received(received) => {
                match timed(|| self.pool.import(import, &received)) {
                    (Ok(table), took) => {
                        s.table = table;
                        s.kv_len = tokens;
                        // Writing the pages and comparing each as stored with
                        // the bytes hashed on arrival, on the engine thread
                        // between two steps.
                        tracing::info!(
                            request_id = s.id.0,
                            tokens,
                            verify_us = took.as_micros() as u64,
                            "transfer verified"
                        );
                        return Ok(());
                    }
                    (Err(refused), _) => {
                        s.table = refused.table;
                        tracing::warn!(request_id = s.id.0, reason = refused.error.reason(), error = %refused.error, "transfer refused by the page book");
                        (FinishReason::TransferFailed, refused.error.reason())
                    }
                }
            }
            Transferred::Refused(refusal) => {
                s.table = import.abandon();
                (FinishReason::PrefillRefused(refusal), refusal.code())
            }
            Transferred::Failed(reason) => {
                s.table = import.abandon();
                tracing::warn!(request_id = s.id.0, reason, "transfer failed");
                (FinishReason::TransferFailed, reason)
            }
        };
        self.finish(index, finish);
        // Between steps, and maybe with nothing else in flight to tick for:
        // scrub now, so the pool is at its baseline as soon as this returns.
        self.pages_scrubbed += u64::from(self.pool.scrub_released());
        Err(reason)
    }

    fn page_tokens(&self) -> usize {
        self.pool.layout().geometry().page_tokens as usize
    }

    /// Books `pages` in tenant `id`'s partition. When they are not there, first
    /// evicts the tenant's own idle cached pages (never those in `keep`), then
    /// reclaims pages others borrowed from the burst region.
    fn book(&mut self, id: TenantId, pages: u32, keep: &[PageHandle]) -> Booking {
        let owner = OwnerTag(id.0);
        let mut evicted = false;
        let mut reclaimed = false;
        loop {
            let error = match self.pool.reserve(owner, pages) {
                Ok(reservation) => return Booking::Booked(reservation),
                Err(error) => error,
            };
            let shortfall = match error {
                ReserveError::Exhausted {
                    pages,
                    pages_available,
                    ..
                } => pages - pages_available,
                ReserveError::AboveMax {
                    pages_wanted,
                    pages_max,
                    ..
                } if u64::from(pages) <= u64::from(pages_max) => {
                    (pages_wanted - u64::from(pages_max)) as u32
                }
                // Above its maximum on its own, or no partition: never bookable.
                other => return Booking::Refused(other),
            };
            if !evicted {
                evicted = true;
                let count = shortfall as usize;
                if self.cache.evict_idle(&mut self.pool, id, count, keep) > 0 {
                    self.pages_scrubbed += u64::from(self.pool.scrub_released());
                    continue;
                }
            }
            let exhausted = matches!(error, ReserveError::Exhausted { .. });
            if reclaimed || !exhausted || !self.reclaim_pages(id, pages) {
                // Not now: pages this tenant holds, or pages others hold within
                // what they may keep, are in use; it waits for them.
                return Booking::Wait;
            }
            reclaimed = true;
        }
    }

    /// Pages tenant `id` holds above its reservation after booking `pages` more.
    fn loan_after(&self, id: TenantId, pages: u32) -> u32 {
        let p = self
            .pool
            .partition_stats(OwnerTag(id.0))
            .expect("a tenant has a partition");
        (held(&p) + pages).saturating_sub(p.config.pages_reserved)
    }

    /// Preempts borrowers' youngest sequences until tenant `id` can book
    /// `pages`: only tenants holding more above their reservation than `id`
    /// would after the booking, the largest loan first. Returns false, changing
    /// nothing, when even every such loan would not make room.
    fn reclaim_pages(&mut self, id: TenantId, pages: u32) -> bool {
        let claimant_loan = self.loan_after(id, pages);
        let owner = OwnerTag(id.0);
        let available = |pool: &Pool| {
            pool.partition_stats(owner)
                .expect("a tenant has a partition")
                .pages_available
        };
        let reclaimable: u64 = self
            .tenants
            .keys()
            .filter(|&&t| t != id)
            .map(|&t| u64::from(self.loan_after(t, 0).saturating_sub(claimant_loan)))
            .sum();
        if u64::from(available(&self.pool)) + reclaimable < u64::from(pages) {
            return false;
        }
        while available(&self.pool) < pages {
            let victim = self
                .tenants
                .iter()
                .filter(|&(&t, state)| t != id && state.running > 0)
                .map(|(&t, _)| (self.loan_after(t, 0), t))
                .filter(|&(loan, _)| loan > claimant_loan)
                .max();
            let Some((_, victim)) = victim else {
                return false;
            };
            let index = self
                .youngest(victim)
                .expect("the victim has a running sequence");
            self.preempt(index, "pages");
            // Its prompt pages stay in its cache, idle: above its reservation
            // they are the loan itself, and go.
            self.trim_cache(victim);
            self.pages_scrubbed += u64::from(self.pool.scrub_released());
        }
        true
    }

    /// Frees a slot for tenant `id`, below its guaranteed share while every slot
    /// is taken: preempts the youngest sequence of the tenant furthest above its
    /// own share. Returns whether it freed one.
    fn reclaim_slot(&mut self, id: TenantId) -> bool {
        let victim = self
            .tenants
            .iter()
            .filter(|&(&t, _)| t != id)
            .map(|(&t, state)| (state.running.saturating_sub(self.slots_guaranteed(t)), t))
            .filter(|&(above, _)| above > 0)
            .max();
        let Some(index) = victim.and_then(|(_, t)| self.youngest(t)) else {
            return false;
        };
        self.preempt(index, "slot");
        true
    }

    /// The index of tenant `id`'s most recently first-started running sequence.
    fn youngest(&self, id: TenantId) -> Option<usize> {
        self.running
            .iter()
            .enumerate()
            .filter(|(_, s)| s.tenant == id)
            .max_by_key(|(_, s)| s.started)
            .map(|(index, _)| index)
    }

    /// Takes running sequence `index` off its pages (released: scrubbed before
    /// the next step) and puts it at the head of its tenant's queue; it keeps
    /// its tokens, sampler and stream, and recomputes its KV when it starts
    /// again.
    fn preempt(&mut self, index: usize, reason: &'static str) {
        let mut s = self.take_running(index);
        if matches!(s.phase, Phase::Exported { .. }) {
            // Computed and sent: nothing to recompute; its pages go early.
            self.end(s, FinishReason::Exported);
            return;
        }
        // A transfer in flight is abandoned; the restart computes here.
        s.remote = false;
        let pages = self.release_kv(&mut s);
        s.phase = Phase::Prefill;
        s.kv_len = 0;
        s.pages_published = 0;
        s.preempted_in = Some(self.ticks);
        let tenant = self.tenants.get_mut(&s.tenant).expect("taken above");
        tenant.counts.preempted_total += 1;
        self.preempted_in_tick += 1;
        tracing::info!(
            request_id = s.id.0,
            tenant = %tenant.limits.name,
            pages,
            tokens = s.tokens.len(),
            reason,
            "preempted"
        );
        tenant.preempted.push_front(s);
    }

    /// Keeps each tenant's idle cached pages within its own reservation (a
    /// tenant's cache never holds the burst region another may need), and none
    /// for a tenant whose cache is off: the least recently used go first.
    fn trim_caches(&mut self) {
        let ids: Vec<TenantId> = self.tenants.keys().copied().collect();
        for id in ids {
            self.trim_cache(id);
        }
    }

    /// [`Scheduler::trim_caches`] for one tenant.
    fn trim_cache(&mut self, id: TenantId) {
        if self.cache.pages(id) == 0 {
            return;
        }
        let limits = &self.tenants[&id].limits;
        let excess = if limits.prefix_cache {
            let p = self
                .pool
                .partition_stats(OwnerTag(id.0))
                .expect("a tenant has a partition");
            // Released pages are on their way out already.
            (held(&p) - p.pages_released).saturating_sub(limits.pages_reserved)
        } else {
            u32::MAX
        };
        if excess > 0 {
            self.cache
                .evict_idle(&mut self.pool, id, excess as usize, &[]);
        }
    }

    /// Chooses this step's work: a decode token for each running sequence
    /// that has one, then prefill chunks (prompts, and the tokens of a
    /// preempted sequence being recomputed), tenants in fair order.
    ///
    /// Two rules keep one tenant's prompts from holding another's first token
    /// (a step cannot be interrupted, so its length is the wait of whoever
    /// arrives during it):
    /// - while more than one tenant is active (has work, or had some within
    ///   [`RECENTLY_ACTIVE`]), each takes at most its weighted share of the
    ///   step's prompt tokens, so a flooding tenant's steps stay short;
    /// - a step that carries the first chunk (a prompt whose first token is
    ///   still to come) of a tenant running fewer sequences than its
    ///   guaranteed slots takes no other tenant's prompt tokens after it, so
    ///   that chunk's step is about as short as it would be alone.
    fn plan_batch(&self, now: Instant) -> Vec<Planned> {
        let mut budget = self.limits.step_tokens_max as usize;
        // Rows of logits: one a sampled sequence, the rest for prompts'
        // log probabilities (a scored chunk is cut to the rows left, less
        // one for each sequence that may still join the step).
        let mut rows_left = self.backend.step_logits_max();
        let mut plan = Vec::new();
        let order = self.fair_order();
        let shares = self.prompt_shares(now);
        // Tenants running fewer sequences than their guaranteed slots: their
        // first chunks get a step of their own (under contention, when every
        // tenant runs its share, steps stay full).
        let light: Vec<TenantId> = if shares.is_empty() {
            Vec::new()
        } else {
            order
                .iter()
                .copied()
                .filter(|&id| self.tenants[&id].running < self.slots_guaranteed(id))
                .collect()
        };
        let mut first_chunk_of = None;
        for decode in [true, false] {
            for &tenant in &order {
                if !decode && first_chunk_of.is_some_and(|t| t != tenant) {
                    continue;
                }
                let mut prompt_left = shares.get(&tenant).copied().unwrap_or(budget);
                for (seq_index, s) in self.running.iter().enumerate() {
                    if s.tenant != tenant
                        || !s.phase.steps()
                        || budget == 0
                        || plan.len() >= self.limits.step_seqs_max as usize
                        || (s.kv_len >= s.prompt_len) != decode
                    {
                        continue;
                    }
                    let mut n = (s.tokens.len() - s.kv_len).min(budget);
                    if !decode {
                        n = n.min(prompt_left);
                    }
                    // A row for each running sequence that may still join
                    // the step: a scored chunk never takes the row another's
                    // last prompt chunk needs (each chunk before took at
                    // most what this leaves, so one row is always free).
                    let joinable = (self.limits.step_seqs_max as usize).min(self.running.len());
                    let later = joinable.saturating_sub(plan.len() + 1);
                    let rows_free = rows_left.saturating_sub(later);
                    let mut rows = s.rows_of(n);
                    if rows.logits > rows_free {
                        // A scored chunk's rows are its tokens past `next`.
                        let skipped = s.scoring.map_or(0, |sc| sc.next.saturating_sub(s.kv_len));
                        n = n.min(rows_free + skipped);
                        rows = s.rows_of(n);
                    }
                    if n == 0 || rows.logits > rows_free {
                        continue;
                    }
                    if !decode {
                        prompt_left -= n;
                    }
                    if !decode && s.tokens.len() == s.prompt_len && light.contains(&tenant) {
                        first_chunk_of = Some(tenant);
                    }
                    plan.push(Planned {
                        seq_index,
                        tokens: s.tokens[s.kv_len..s.kv_len + n].to_vec(),
                        pos_start: s.kv_len,
                        rows,
                    });
                    budget -= n;
                    rows_left -= rows.logits;
                }
            }
        }
        plan
    }

    /// Each active tenant's share of a step's prompt tokens, by weight (at
    /// least one page's worth); empty when at most one tenant is active.
    fn prompt_shares(&self, now: Instant) -> BTreeMap<TenantId, usize> {
        let active: Vec<&TenantState> = self
            .tenants
            .values()
            .filter(|t| {
                t.has_work()
                    || t.active_at
                        .is_some_and(|at| now.saturating_duration_since(at) < RECENTLY_ACTIVE)
            })
            .collect();
        if active.len() < 2 {
            return BTreeMap::new();
        }
        let weights: u64 = active.iter().map(|t| u64::from(t.limits.weight)).sum();
        let step = u64::from(self.limits.step_tokens_max);
        active
            .iter()
            .map(|t| {
                let share = step * u64::from(t.limits.weight) / weights.max(1);
                (t.limits.id, share.max(self.page_tokens() as u64) as usize)
            })
            .collect()
    }

    /// Runs one step and applies its outputs; returns how many finished.
    fn run_batch(&mut self, plan: &[Planned]) -> u32 {
        // A row whose token is all that is read of it (greedy or drawn,
        // after its adjustments) is picked on the backend's side where it
        // can (a GPU adjusts the row where it lies and copies the token alone).
        let picks: Vec<Pick> = plan
            .iter()
            .map(|p| match p.rows.samples {
                true => self.running[p.seq_index].sampler.pick(),
                false => Pick::Row,
            })
            .collect();
        let steps: Vec<SeqStep> = plan
            .iter()
            .zip(&picks)
            .map(|(p, &pick)| SeqStep {
                pages: &self.running[p.seq_index].table,
                pos_start: p.pos_start,
                tokens: &p.tokens,
                logits: p.rows.logits,
                pick,
                adjust: match pick.is_token() {
                    true => self.running[p.seq_index].sampler.adjustments(),
                    false => &[],
                },
                logprobs: match pick.is_token() {
                    true => self.running[p.seq_index].sampler.params().logprobs,
                    false => None,
                },
                scores: self.running[p.seq_index].prompt_scores(p),
            })
            .collect();
        let threads = self.backend.threads();
        let started = Instant::now();
        let stepped = match self.backend.step(&steps, &mut self.pool) {
            Ok(logits) => {
                let forward = started.elapsed();
                // Each planned entry's rows: its scored prompt positions',
                // then its sampled one's.
                let mut row = 0;
                let (mut scored_rows, mut sampled_rows) = (Vec::new(), Vec::new());
                for p in plan {
                    let s = &self.running[p.seq_index];
                    let first = p.pos_start + p.tokens.len() - p.rows.logits;
                    let top = s.scoring.map_or(0, |sc| usize::from(sc.top));
                    for i in 0..p.rows.scored {
                        scored_rows.push((row + i, s.tokens[first + i + 1], top));
                    }
                    row += p.rows.logits;
                    if p.rows.samples {
                        sampled_rows.push((p.seq_index, row - 1));
                    }
                }
                let mut scored = score_rows(threads.as_deref(), &scored_rows, &logits).into_iter();
                let scores: Vec<Vec<Logprobs>> = plan
                    .iter()
                    .map(|p| scored.by_ref().take(p.rows.scored).collect())
                    .collect();
                // Each row's sampler, borrowed apart from the others (rows
                // are distinct sequences).
                let mut samplers: Vec<Option<&mut Sampler>> = self
                    .running
                    .iter_mut()
                    .map(|s| Some(&mut s.sampler))
                    .collect();
                let rows: Vec<(&mut Sampler, usize)> = sampled_rows
                    .into_iter()
                    .map(|(seq_index, row)| {
                        let sampler = samplers[seq_index].take().expect("one row a sequence");
                        (sampler, row)
                    })
                    .collect();
                let sampled = sample_rows(threads.as_deref(), rows, &logits);
                let steps = &mut self.steps;
                steps.steps_total += 1;
                steps.tokens_total += plan.iter().map(|p| p.tokens.len() as u64).sum::<u64>();
                steps.forward_nanos_total += nanos(forward);
                steps.sampling_nanos_total += nanos(started.elapsed() - forward);
                (sampled, scores)
            }
            // A lost device runs nothing more in this process: the engine
            // stops, and its supervisor ends the requests in flight.
            Err(error @ StepError::DeviceLost(_)) => panic!("{error}"),
            // A refused step changed nothing. When the backend names the
            // sequence at fault, only that one fails: the others (any
            // tenant's) step again next tick. Otherwise the whole batch fails.
            Err(error) => {
                let at_fault = error.sequence().and_then(|i| plan.get(i));
                let failing: Vec<usize> = match at_fault {
                    Some(p) => vec![p.seq_index],
                    None => plan.iter().map(|p| p.seq_index).collect(),
                };
                for &i in &failing {
                    tracing::error!(request_id = self.running[i].id.0, %error, "step refused; failing the request");
                }
                return self.finish_all(failing, FinishReason::Error);
            }
        };
        let (sampled, scores): (Vec<Sampled>, Vec<Vec<Logprobs>>) = stepped;
        let mut finishing = Vec::new();
        let mut next_sample = sampled.into_iter();
        for (p, scores) in plan.iter().zip(scores) {
            let s = &mut self.running[p.seq_index];
            if let Some(scoring) = &mut s.scoring {
                if !scores.is_empty() {
                    // The rows scored positions from the chunk's last `logits`.
                    let from = p.pos_start + p.tokens.len() - p.rows.logits;
                    scoring.next = from + scores.len();
                }
                for entry in scores {
                    let _ = s
                        .events
                        .send(Event::PromptLogprob(token_logprob(&self.tokenizer, &entry)));
                }
            }
            let tenant = self
                .tenants
                .get_mut(&s.tenant)
                .expect("a running sequence's tenant exists");
            tenant.virtual_time += p.tokens.len() as f64 / f64::from(tenant.limits.weight);
            tenant.tokens_processed += p.tokens.len() as u64;
            s.kv_len += p.tokens.len();
            publish(&mut self.cache, &mut self.pool, s);
            if s.kv_len >= s.prompt_len {
                if let Some(to) = s.export.take() {
                    if let Some(reason) = export(&self.pool, s, to) {
                        finishing.push((p.seq_index, reason));
                    }
                    continue;
                }
                s.phase = Phase::Decode;
                if s.max_tokens == 0 {
                    // Only its prompt's log probabilities were asked for.
                    finishing.push((p.seq_index, FinishReason::Length));
                    continue;
                }
            }
            if !p.rows.samples {
                continue;
            }
            let Sampled {
                token,
                logprobs,
                took,
            } = next_sample
                .next()
                .expect("one sample per entry that wants logits");
            tenant.counts.sampling_nanos_total += nanos(took);
            self.tokens_generated += 1;
            if let Some(reason) = self.accept(p.seq_index, token, logprobs) {
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

    /// Takes a sampled token: streams its log probabilities (when asked for)
    /// and its text, or says why the sequence ends.
    fn accept(
        &mut self,
        seq_index: usize,
        token: u32,
        logprobs: Option<Logprobs>,
    ) -> Option<FinishReason> {
        let is_eog = self.tokenizer.is_eog(token);
        let s = &mut self.running[seq_index];
        // (Under `ignore_eos` an end-of-generation token is one more,
        // showing no text.)
        if s.sampler.ends_output(token, is_eog) {
            return Some(FinishReason::Stop);
        }
        s.generated += 1;
        if let Some(logprobs) = logprobs {
            let _ = s
                .events
                .send(Event::Logprob(token_logprob(&self.tokenizer, &logprobs)));
        }
        let text = match s.detokenizer.push(token) {
            Ok(text) => text,
            Err(error) => {
                tracing::error!(request_id = s.id.0, %error, "detokenization failed");
                return Some(FinishReason::Error);
            }
        };
        let scan = if s.sampler.looks_for_stops() {
            s.stop.push(&text)
        } else {
            Scan::Text(text)
        };
        match scan {
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
        s.tokens.push(token);
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

    /// Ends running sequence `seq_index` (see [`Scheduler::end`]).
    fn finish(&mut self, seq_index: usize, reason: FinishReason) {
        let s = self.take_running(seq_index);
        self.end(s, reason);
    }

    /// Takes running sequence `index` out of the running set (its pages stay
    /// in its table).
    fn take_running(&mut self, index: usize) -> Sequence {
        let s = self.running.swap_remove(index);
        let tenant = self
            .tenants
            .get_mut(&s.tenant)
            .expect("a running sequence's tenant exists");
        assert!(tenant.running > 0, "a running sequence is counted");
        tenant.running -= 1;
        s
    }

    /// The one exit of a started sequence, running or preempted (I6): releases
    /// its pages (scrubbed before the next step; cached ones stay with the
    /// tenant's cache), flushes held text, reports usage, logs without content.
    fn end(&mut self, mut s: Sequence, reason: FinishReason) {
        let pages = self.release_kv(&mut s);
        let tenant = self
            .tenants
            .get(&s.tenant)
            .expect("a started sequence's tenant exists");
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
        let whose = (s.id, s.tenant, tenant.limits.name.as_str());
        self.ends.report(whose, &s.events, reason, usage);
        tracing::info!(
            request_id = s.id.0,
            tenant = %tenant.limits.name,
            reason = reason.as_str(),
            prompt_tokens = usage.prompt_tokens,
            completion_tokens = usage.completion_tokens,
            cached_tokens = usage.cached_tokens,
            pages,
            "finished"
        );
    }
}

impl<B: Backend> Scheduler<B> {
    /// Releases `s`'s pages, an import's too (dropping its `abandon` stops
    /// the job); the pool scrubs them before the next step.
    fn release_kv(&mut self, s: &mut Sequence) -> u32 {
        let mut pages = 0;
        if let Phase::Transfer { import, .. } = std::mem::replace(&mut s.phase, Phase::Prefill) {
            pages += self.pool.release(&mut import.abandon());
        }
        pages + self.pool.release(&mut s.table)
    }
}

/// `f`'s value and how long it took.
fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let started = Instant::now();
    let value = f();
    (value, started.elapsed())
}

/// Decode role: moves `s`'s freshly acquired pages into an import for
/// the KV of its prompt but the last token, and sends the job to the
/// link. The sequence is in `Transfer` until `Scheduler::transferred`.
fn ask_peer(pool: &Pool, remote: &RemotePrefill, s: &mut Sequence, reservation: &Reservation) {
    let kv_tokens = &s.tokens[..s.prompt_len - 1];
    let job = getrandom::u64().expect("the OS's random source");
    let identity = TransferIdentity {
        request: s.id.0,
        job,
        owner: OwnerTag(s.tenant.0),
        model: remote.model,
        tokens: kv_tokens.len() as u32,
        tokens_digest: tokens_digest(kv_tokens),
    };
    let (abandon, abandoned) = tokio::sync::oneshot::channel();
    let sent = remote.jobs.send(PrefillRequest {
        identity,
        tokens: kv_tokens.to_vec(),
        max_tokens: s.max_tokens,
        deadline: s.deadline,
        prefill_hint: s.prefill_hint.clone(),
        abandoned,
    });
    let empty = pool.page_table(reservation, SeqId(s.id.0));
    let table = std::mem::replace(&mut s.table, empty);
    let import = pool.begin_import(table, identity);
    s.phase = Phase::Transfer { import, abandon };
    if sent.is_err() {
        // The link is gone (shutting down): the job fails at once; the
        // next tick finds it abandoned.
        tracing::warn!(request_id = s.id.0, "the transfer link is closed");
    }
}

/// Prefill role: copies `s`'s prompt KV out to its decode peer and holds the
/// pages until the link lets them go; a reason to end it now otherwise.
fn export(pool: &Pool, s: &mut Sequence, to: ExportTo) -> Option<FinishReason> {
    let identity = TransferIdentity {
        request: to.request,
        job: to.job,
        owner: OwnerTag(s.tenant.0),
        model: to.model,
        tokens: s.prompt_len as u32,
        tokens_digest: tokens_digest(&s.tokens[..s.prompt_len]),
    };
    match pool.export(&s.table, identity) {
        Ok(export) => {
            if to.export.send(export).is_err() {
                return Some(FinishReason::Cancelled);
            }
            s.phase = Phase::Exported { held: to.held };
            None
        }
        Err(error) => {
            tracing::error!(request_id = s.id.0, %error, "export refused");
            Some(FinishReason::Error)
        }
    }
}

/// What booking a start's pages came to.
enum Booking {
    Booked(Reservation),
    /// Not now; it stays at the head of its queue.
    Wait,
    /// Never: the request fails.
    Refused(ReserveError),
}

/// Pages an owner keeps from others (its reservation aside).
fn held(p: &bulkhead_kernels::kv::PartitionStats) -> u32 {
    p.pages_booked + p.pages_owned + p.pages_shared + p.pages_released
}

/// A token's log probabilities as its client sees them: bytes, not ids.
fn token_logprob(tokenizer: &Tokenizer, logprobs: &Logprobs) -> TokenLogprob {
    let bytes = |id| {
        tokenizer
            .token_to_piece_bytes(id)
            .map_or_else(|_| Vec::new(), <[u8]>::to_vec)
    };
    TokenLogprob {
        bytes: bytes(logprobs.token),
        logprob: logprobs.logprob,
        top: logprobs
            .top
            .iter()
            .map(|&(id, logprob)| (bytes(id), logprob))
            .collect(),
    }
}

/// Shares `s`'s prompt pages that are now full and final into its tenant's
/// cache (none when the tenant's cache is off). A page whose key another
/// sequence cached first stays the sequence's own.
fn publish(cache: &mut PrefixCache, pool: &mut Pool, s: &mut Sequence) {
    let page_tokens = pool.layout().geometry().page_tokens as usize;
    let full = s.kv_len.min(s.prompt_len) / page_tokens;
    while s.pages_published < full.min(s.chain.len()) {
        let index = s.pages_published;
        s.pages_published += 1;
        if cache.contains(s.tenant, s.chain[index]) {
            continue;
        }
        let handle = pool.share(&s.table, index);
        let tokens = &s.tokens[index * page_tokens..(index + 1) * page_tokens];
        cache.insert(s.tenant, &s.chain, index, tokens, handle);
    }
}

impl Sequence {
    /// Why it must end now, if it must: its client left or its deadline passed.
    fn expiry(&self, now: Instant) -> Option<FinishReason> {
        if let Phase::Exported { held } = &self.phase {
            if held.is_closed() {
                return Some(FinishReason::Exported);
            }
        }
        if let Phase::Transfer { abandon, .. } = &self.phase {
            // The link dropped its end without delivering: it is gone.
            if abandon.is_closed() {
                return Some(FinishReason::TransferFailed);
            }
        }
        if self.events.is_closed() {
            Some(FinishReason::Cancelled)
        } else if now >= self.deadline {
            Some(FinishReason::Timeout)
        } else {
            None
        }
    }
}

/// Ends a request that never started: it holds no page, so there is nothing
/// to release; its client hears why, with the prompt it sent and nothing
/// generated.
fn finish_queued(ends: &Ends, admitted: Admitted, tenant: &str, reason: FinishReason) {
    let request = admitted.request;
    let usage = Usage {
        prompt_tokens: request.prompt.len() as u32,
        ..Usage::default()
    };
    let whose = (request.id, request.tenant, tenant);
    ends.report(whose, &request.events, reason, usage);
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
                    queued: (t.queue.len() + t.preempted.len()) as u32,
                    running: t.running,
                    pages_reserved: t.limits.pages_reserved,
                    pages_max: t.limits.pages_max,
                    pages_owned: p.map_or(0, |p| p.pages_owned),
                    pages_released: p.map_or(0, |p| p.pages_released),
                    pages_booked: p.map_or(0, |p| p.pages_booked),
                    pages_available: p.map_or(0, |p| p.pages_available),
                    pages_shared: p.map_or(0, |p| p.pages_shared),
                    counts: t.counts,
                }
            })
            .collect();
        SchedulerStats {
            tenants,
            pages_count: pool.pages_count,
            page_tokens: self.pool.layout().geometry().page_tokens,
            pages_free: pool.pages_free,
            pages_cached_idle: pool.pages_shared_idle,
            pages_scrubbed_total: self.pages_scrubbed,
            tokens_generated_total: self.tokens_generated,
            steps: self.steps,
        }
    }

    /// Audits the pool between two steps: its counts, every free page's
    /// values (zero, whatever the pool's options) and [`Scheduler::check`].
    /// Not cheap: one pass over the free pages' bytes plus the checker's
    /// recount, O(pages); for an operator's or a test's question, never per
    /// step.
    pub fn audit(&self) -> PoolAudit {
        let pool = self.pool.stats();
        let tenants = self
            .tenants
            .keys()
            .map(|&id| {
                let p = self.pool.partition_stats(OwnerTag(id.0));
                TenantPages {
                    id: id.0,
                    pages_owned: p.map_or(0, |p| p.pages_owned),
                    pages_released: p.map_or(0, |p| p.pages_released),
                    pages_booked: p.map_or(0, |p| p.pages_booked),
                    pages_shared: p.map_or(0, |p| p.pages_shared),
                }
            })
            .collect();
        PoolAudit {
            pool_id: self.pool.id(),
            // At most the tenants' queue and slot limits: far below u32::MAX.
            in_flight: self.in_flight() as u32,
            pages_count: pool.pages_count,
            pages_free: pool.pages_free,
            pages_owned: pool.pages_owned,
            pages_released: pool.pages_released,
            pages_shared: pool.pages_shared,
            pages_booked: pool.pages_booked,
            free_pages_checked: pool.pages_free,
            free_pages_dirty: self.pool.free_pages_dirty(),
            pages_scrubbed_total: self.pages_scrubbed,
            invariants: self.check().map_err(|error| error.to_string()),
            tenants,
        }
    }
}

/// `d` in whole nanoseconds (saturating: 584 years).
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
