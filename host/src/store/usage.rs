//! Usage counters and the request path's audit records, batched in memory and
//! written to the store every `store.usage_flush_ms`.
//!
//! Requests finish far more often than an admin writes, and each durable
//! commit costs an fsync, so the request path only adds to counters here.
//! What a crash can lose is bounded and documented: the usage and refusal
//! records of at most the last flush interval.
//!
//! 1. **Refusals** are listed one record each, up to
//!    `store.audit_refusals_listed_per_interval` per tenant per interval;
//!    past that they are counted by code, and the interval's counts become
//!    one `request.refused_summary` record of that tenant. A flood of refused
//!    requests costs its own tenant a record or two a second, never a flood
//!    of disk writes, and never another tenant's records.
//! 2. **Security events** (`request.output_blocked`, `engine.fault`) are
//!    never dropped: kept apart from refusals, with no cap (each is a blocked
//!    response or an engine restart, bounded by the events themselves), kept
//!    across a failed flush, and they ask for a flush at once.

use super::records::{AuditRecord, UsageRecord};
use super::{Batch, Store, StoreError};
use crate::clock::now_ms;
use crate::engine::request::{FinishReason, RequestId, Usage};
use crate::engine::scheduler::FinishSink;
use crate::store::records::TenantId;
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Refusals listed one record each per tenant per interval, by default.
pub const REFUSALS_LISTED_PER_INTERVAL: u32 = 16;

/// One tenant's refusals in the current interval.
#[derive(Default)]
struct Tally {
    name: String,
    listed: u32,
    /// Refusals past the listed ones, by code.
    counted: BTreeMap<String, u64>,
    from_ms: u64,
    to_ms: u64,
}

/// Counters not yet in the store.
#[derive(Default)]
struct Pending {
    usage: BTreeMap<(TenantId, u64), UsageRecord>,
    refusals: Vec<AuditRecord>,
    tallies: BTreeMap<TenantId, Tally>,
    security: Vec<AuditRecord>,
}

/// The in-memory side of usage accounting.
pub struct UsageBook {
    pending: Mutex<Pending>,
    listed_per_interval: u32,
    /// Wakes the flusher early (a security event is pending).
    flush_now: tokio::sync::Notify,
}

impl Default for UsageBook {
    fn default() -> Self {
        UsageBook::new(REFUSALS_LISTED_PER_INTERVAL)
    }
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
    /// A book listing at most `listed_per_interval` refusals per tenant per
    /// interval.
    pub fn new(listed_per_interval: u32) -> UsageBook {
        UsageBook {
            pending: Mutex::new(Pending::default()),
            listed_per_interval,
            flush_now: tokio::sync::Notify::new(),
        }
    }

    /// Resolves when a security event asks for a flush before the next tick.
    pub async fn flush_asked(&self) {
        self.flush_now.notified().await;
    }

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

    /// Keeps the record of a refused request of `tenant` (named
    /// `tenant_name`) for the next flush: listed, or past the tenant's listed
    /// ones, counted by its `code`.
    pub fn refused(
        &self,
        tenant: TenantId,
        tenant_name: &str,
        code: &str,
        mut record: AuditRecord,
    ) {
        record.detail.insert("tenant_id".into(), tenant.0.into());
        let mut pending = self.pending();
        let tally = pending.tallies.entry(tenant).or_default();
        if tally.listed < self.listed_per_interval {
            tally.listed += 1;
            pending.refusals.push(record);
            return;
        }
        if tally.counted.is_empty() {
            tally.name = tenant_name.to_string();
            tally.from_ms = record.at_ms;
        }
        tally.to_ms = record.at_ms;
        *tally.counted.entry(code.to_string()).or_default() += 1;
    }

    /// Keeps a security event's record for a flush at once; never dropped.
    pub fn security(&self, record: AuditRecord) {
        self.pending().security.push(record);
        self.flush_now.notify_one();
    }

    /// Writes everything pending, durably, in as few commits as the store
    /// takes ([`Store::records_per_commit`]: one on sled; on etcd, as many as
    /// its transaction limit needs). What a failed commit did not write stays
    /// pending for the next try, in front of what arrived meanwhile. Returns
    /// how many refusals were counted in summaries rather than listed since
    /// the last flush.
    pub fn flush(&self, store: &Store) -> Result<u64, StoreError> {
        let taken = std::mem::take(&mut *self.pending());
        let mut items: Vec<Item> = Vec::new();
        items.extend(
            taken
                .usage
                .into_iter()
                .map(|(key, delta)| Item::Usage(key, delta)),
        );
        items.extend(taken.security.into_iter().map(Item::Security));
        items.extend(taken.refusals.into_iter().map(Item::Refusal));
        let mut summarized = 0;
        for (tenant, tally) in &taken.tallies {
            if tally.counted.is_empty() {
                continue;
            }
            let count: u64 = tally.counted.values().sum();
            summarized += count;
            items.push(Item::Summary(*tenant, summary(*tenant, tally, count)));
        }
        let per_commit = store.records_per_commit().max(1);
        let mut written = 0;
        for chunk in items.chunks(per_commit) {
            let mut batch = Batch::default();
            let committed = (|| {
                for item in chunk {
                    match item {
                        Item::Usage((tenant, minute), delta) => {
                            store.add_usage(&mut batch, tenant.0, *minute, delta)?;
                        }
                        Item::Security(record)
                        | Item::Refusal(record)
                        | Item::Summary(_, record) => {
                            batch.audit(record.clone());
                        }
                    }
                }
                store.commit(batch)
            })();
            if let Err(error) = committed {
                self.put_back(items.split_off(written), taken.tallies);
                return Err(error);
            }
            written += chunk.len();
        }
        Ok(summarized)
    }

    /// Puts `unwritten` back in front of what arrived meanwhile; the
    /// interval's listed counts stay (so a failing store does not list
    /// more), and a summary not written goes back to its tally.
    fn put_back(&self, unwritten: Vec<Item>, tallies: BTreeMap<TenantId, Tally>) {
        let mut pending = self.pending();
        let (mut security, mut refusals) = (Vec::new(), Vec::new());
        let mut unsummarized = std::collections::BTreeSet::new();
        for item in unwritten {
            match item {
                Item::Usage(key, delta) => pending.usage.entry(key).or_default().add(&delta),
                Item::Security(record) => security.push(record),
                Item::Refusal(record) => refusals.push(record),
                Item::Summary(tenant, _) => {
                    unsummarized.insert(tenant);
                }
            }
        }
        pending.security.splice(0..0, security);
        pending.refusals.splice(0..0, refusals);
        for (tenant, tally) in tallies {
            let now = pending.tallies.entry(tenant).or_default();
            now.listed = now.listed.max(tally.listed);
            if !unsummarized.contains(&tenant) {
                continue;
            }
            if now.counted.is_empty() {
                now.name = tally.name.clone();
                now.from_ms = tally.from_ms;
                now.to_ms = tally.to_ms;
            }
            now.from_ms = now.from_ms.min(tally.from_ms);
            for (code, n) in tally.counted {
                *now.counted.entry(code).or_default() += n;
            }
        }
    }
}

/// One thing a flush writes.
enum Item {
    Usage((TenantId, u64), UsageRecord),
    Security(AuditRecord),
    Refusal(AuditRecord),
    Summary(TenantId, AuditRecord),
}

/// The record of a tenant's refusals past its listed ones in an interval.
fn summary(tenant: TenantId, tally: &Tally, count: u64) -> AuditRecord {
    let mut detail = BTreeMap::new();
    detail.insert("tenant_id".into(), tenant.0.into());
    detail.insert("refused".into(), count.into());
    detail.insert(
        "codes".into(),
        serde_json::to_value(&tally.counted).unwrap_or_default(),
    );
    detail.insert("from_ms".into(), tally.from_ms.into());
    detail.insert("to_ms".into(), tally.to_ms.into());
    AuditRecord {
        seq: 0,
        at_ms: tally.to_ms,
        actor: "system".into(),
        action: "request.refused_summary".into(),
        target: tally.name.clone(),
        detail,
    }
}
