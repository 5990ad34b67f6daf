//! Usage counters and refusal audit records, batched in memory and written to
//! the store every `store.usage_flush_ms`.
//!
//! Requests finish far more often than an admin writes, and each durable
//! commit costs an fsync, so the request path only adds to counters here.
//! What a crash can lose is bounded and documented: the usage and refusal
//! records of at most the last flush interval. Refusal records beyond
//! [`REFUSALS_PENDING_MAX`] per interval are counted, not kept (a flood of
//! refused requests must not become a flood of disk writes).

use super::records::{AuditRecord, UsageRecord};
use super::{Batch, Store, StoreError};
use crate::engine::request::{FinishReason, RequestId, Usage};
use crate::engine::scheduler::FinishSink;
use crate::tenancy::control::now_ms;
use crate::tenancy::TenantId;
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Most refusal audit records kept per flush interval.
pub const REFUSALS_PENDING_MAX: usize = 1024;

/// Counters not yet in the store.
#[derive(Default)]
struct Pending {
    usage: BTreeMap<(TenantId, u64), UsageRecord>,
    refusals: Vec<AuditRecord>,
    refusals_dropped: u64,
}

/// The in-memory side of usage accounting.
#[derive(Default)]
pub struct UsageBook {
    pending: Mutex<Pending>,
}

impl FinishSink for UsageBook {
    fn finished(&self, _request: RequestId, tenant: TenantId, reason: FinishReason, usage: Usage) {
        self.record(
            tenant,
            now_ms(),
            reason.as_str(),
            usage.prompt_tokens,
            usage.completion_tokens,
        );
    }
}

/// The minute (since the Unix epoch) of a Unix-milliseconds time.
pub fn minute_of(unix_ms: u64) -> u64 {
    unix_ms / 60_000
}

impl UsageBook {
    fn pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one request of `tenant` that ended at `unix_ms` with `outcome`
    /// (a finish reason or an error code).
    pub fn record(
        &self,
        tenant: TenantId,
        unix_ms: u64,
        outcome: &str,
        prompt_tokens: u32,
        completion_tokens: u32,
    ) {
        let mut pending = self.pending();
        let usage = pending
            .usage
            .entry((tenant, minute_of(unix_ms)))
            .or_default();
        usage.requests += 1;
        usage.prompt_tokens += u64::from(prompt_tokens);
        usage.completion_tokens += u64::from(completion_tokens);
        *usage.outcomes.entry(outcome.to_string()).or_default() += 1;
    }

    /// Keeps an audit record of the request path (a refusal, an engine
    /// fault) for the next flush, or counts it as dropped past
    /// [`REFUSALS_PENDING_MAX`].
    pub fn audit(&self, record: AuditRecord) {
        let mut pending = self.pending();
        if pending.refusals.len() < REFUSALS_PENDING_MAX {
            pending.refusals.push(record);
        } else {
            pending.refusals_dropped += 1;
        }
    }

    /// Writes everything pending in one durable commit; on failure it stays
    /// pending for the next try. Returns how many refusal records were dropped
    /// since the last flush.
    pub fn flush(&self, store: &Store) -> Result<u64, StoreError> {
        let taken = std::mem::take(&mut *self.pending());
        let mut batch = Batch::default();
        let result = (|| {
            for ((tenant, minute), delta) in &taken.usage {
                let mut total = store.usage_minute(tenant.0, *minute)?;
                total.add(delta);
                batch.put_usage(tenant.0, *minute, &total);
            }
            for record in &taken.refusals {
                batch.audit(record.clone());
            }
            store.commit(batch)
        })();
        match result {
            Ok(()) => Ok(taken.refusals_dropped),
            Err(error) => {
                // Put it back in front of whatever arrived meanwhile.
                let mut pending = self.pending();
                for (key, delta) in taken.usage {
                    pending.usage.entry(key).or_default().add(&delta);
                }
                let room = REFUSALS_PENDING_MAX.saturating_sub(pending.refusals.len());
                let kept: Vec<AuditRecord> = taken.refusals.into_iter().take(room).collect();
                pending.refusals.splice(0..0, kept);
                pending.refusals_dropped += taken.refusals_dropped;
                Err(error)
            }
        }
    }
}
