//! Observability: a snapshot of counts that the engine thread publishes after
//! each tick, so the API layer can render gauges without touching the scheduler.

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
    /// Clean pages on the free list.
    pub pages_free: u32,
    /// Pages scrubbed since start.
    pub pages_scrubbed_total: u64,
    /// Tokens sampled since start.
    pub tokens_generated_total: u64,
}
