//! Observability: a snapshot of counts that the engine thread publishes after
//! each tick, so the API layer can render gauges without touching the scheduler;
//! and a [`PoolAudit`], computed on the engine thread only when asked for.

use bulkhead_kernels::kv::{PageId, PoolId};

/// Cumulative per-tenant counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TenantCounts {
    /// Requests that entered the tenant's queue.
    pub enqueued_total: u64,
    /// Pages acquired for the tenant's sequences.
    pub pages_acquired_total: u64,
    /// Prompt tokens found in the tenant's prefix cache.
    pub cached_tokens_total: u64,
    /// Its sequences preempted to give pages or slots back.
    pub preempted_total: u64,
    /// Time spent sampling its sequences' tokens, in nanoseconds, summed
    /// over the threads that sampled them: what its sampling options
    /// (JSON mode, logprobs, biases) cost every tenant's steps.
    pub sampling_nanos_total: u64,
}

impl TenantCounts {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &TenantCounts) {
        self.enqueued_total += other.enqueued_total;
        self.pages_acquired_total += other.pages_acquired_total;
        self.cached_tokens_total += other.cached_tokens_total;
        self.preempted_total += other.preempted_total;
        self.sampling_nanos_total += other.sampling_nanos_total;
    }
}

/// One tenant's scheduler and KV partition counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TenantStats {
    /// The tenant.
    pub id: u32,
    /// Requests waiting in its queue.
    pub queued: u32,
    /// Its running sequences.
    pub running: u32,
    /// Pages only it may use.
    pub pages_reserved: u32,
    /// The most pages it may hold.
    pub pages_max: u32,
    /// Pages leased to its sequences.
    pub pages_owned: u32,
    /// Pages it released that await scrubbing.
    pub pages_released: u32,
    /// Pages booked by its live reservations.
    pub pages_booked: u32,
    /// Pages a reservation could book now.
    pub pages_available: u32,
    /// Pages of its prefix cache (in use or idle).
    pub pages_shared: u32,
    /// Cumulative counts.
    pub counts: TenantCounts,
}

/// A snapshot of the scheduler and its pool.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Per tenant, in id order.
    pub tenants: Vec<TenantStats>,
    /// Pages in the pool.
    pub pages_count: u32,
    /// Token positions a page holds.
    pub page_tokens: u32,
    /// Clean pages on the free list.
    pub pages_free: u32,
    /// Prefix-cache pages no sequence holds: each tenant's to evict when it
    /// needs pages.
    pub pages_cached_idle: u32,
    /// Pages scrubbed since the model was loaded (see [`EngineTotals`]).
    pub pages_scrubbed_total: u64,
    /// Tokens sampled since the model was loaded.
    pub tokens_generated_total: u64,
    /// The steps run since the model was loaded.
    pub steps: StepCounts,
}

impl SchedulerStats {
    /// The cumulative counts in this snapshot.
    pub fn totals(&self) -> EngineTotals {
        EngineTotals {
            pages_scrubbed: self.pages_scrubbed_total,
            tokens_generated: self.tokens_generated_total,
            steps: self.steps,
            tenants: self.tenants.iter().map(|t| (t.id, t.counts)).collect(),
        }
    }
}

/// Cumulative counts of an engine's steps: with their rates, an operator
/// reads the mean step time, its split between the forward pass and
/// sampling, and the mean tokens a step carries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepCounts {
    /// Steps the backend ran.
    pub steps_total: u64,
    /// Tokens those steps carried (prompt chunks and decoded tokens).
    pub tokens_total: u64,
    /// Their time in the backend's forward pass, in nanoseconds.
    pub forward_nanos_total: u64,
    /// Their time sampling, in nanoseconds (wall time: a step's rows are
    /// sampled in parallel where the backend lends its threads).
    pub sampling_nanos_total: u64,
}

impl StepCounts {
    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &StepCounts) {
        self.steps_total += other.steps_total;
        self.tokens_total += other.tokens_total;
        self.forward_nanos_total += other.forward_nanos_total;
        self.sampling_nanos_total += other.sampling_nanos_total;
    }
}

/// An engine's cumulative counts. The engine rebuilt after a panic, or
/// built when a model is loaded again under the same id, starts from its
/// predecessor's, so that no total a model reports goes back: the metrics
/// recorder keeps the largest value a counter was set to, and would hold a
/// model's counters still until a new engine's counts passed the old.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineTotals {
    /// Pages scrubbed.
    pub pages_scrubbed: u64,
    /// Tokens sampled.
    pub tokens_generated: u64,
    /// Steps run.
    pub steps: StepCounts,
    /// Per tenant, by id.
    pub tenants: Vec<(u32, TenantCounts)>,
}

/// One tenant's pages, as an audit counts them (from its partition).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TenantPages {
    /// The tenant.
    pub id: u32,
    /// Pages leased to its sequences.
    pub pages_owned: u32,
    /// Pages it released that await scrubbing.
    pub pages_released: u32,
    /// Pages booked by its live reservations, not yet leased.
    pub pages_booked: u32,
    /// Pages of its prefix cache (in use or idle).
    pub pages_shared: u32,
}

/// What [`Scheduler::audit`](super::scheduler::Scheduler::audit) found,
/// between two steps: the pool's counts, every free page's values, and every
/// invariant check there is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolAudit {
    /// The pool (a rebuilt engine has a new one).
    pub pool_id: PoolId,
    /// Requests queued plus running.
    pub in_flight: u32,
    /// Pages in the pool.
    pub pages_count: u32,
    /// Pages on the free list.
    pub pages_free: u32,
    /// Pages leased to a sequence.
    pub pages_owned: u32,
    /// Dirty pages waiting for scrub.
    pub pages_released: u32,
    /// Prefix-cache pages.
    pub pages_shared: u32,
    /// Pages booked by live reservations, not yet acquired.
    pub pages_booked: u32,
    /// Free pages whose values were scanned (all of them).
    pub free_pages_checked: u32,
    /// Of those, the pages not all zeros, in free-list order: a scrub missed
    /// them, so the next sequence would read another's KV. Must be empty.
    pub free_pages_dirty: Vec<PageId>,
    /// Pages scrubbed since this engine (pool) started.
    pub pages_scrubbed_total: u64,
    /// `Scheduler::check`: the first broken invariant, as its message.
    pub invariants: Result<(), String>,
    /// Per tenant, in id order.
    pub tenants: Vec<TenantPages>,
}

impl PoolAudit {
    /// Whether the pool is as an idle engine leaves it: nothing in flight,
    /// nothing leased, booked or waiting for scrub, every free page zero,
    /// every invariant holding, and every page free or in a prefix cache.
    pub fn at_baseline(&self) -> bool {
        self.in_flight == 0
            && self.pages_owned == 0
            && self.pages_released == 0
            && self.pages_booked == 0
            && self.free_pages_dirty.is_empty()
            && self.invariants.is_ok()
            && u64::from(self.pages_free) + u64::from(self.pages_shared)
                == u64::from(self.pages_count)
    }
}
