//! Metric names, the Prometheus recorder, and tracing set-up (invariant I9).
//!
//! 1. Every metric is named here. Labels are tenant names (validated
//!    `[A-Za-z0-9_-]` in the policy) and fixed reason codes; never a client
//!    value, never prompt or completion text.
//! 2. Logs are JSON lines on stderr with the request id and tenant. Dependency
//!    crates (hyper, h2, rustls) are capped at `info` whatever `RUST_LOG` says,
//!    because their trace output can carry raw protocol bytes.
//! 3. Engine gauges (queue depth, KV pages by tenant and state, scrubs) are
//!    set from the engine thread's latest snapshot when `/metrics` is scraped.

use crate::engine::stats::SchedulerStats;
use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};
use std::time::Duration;

/// The tenant label of requests that never authenticated.
pub const TENANT_UNKNOWN: &str = "none";

/// Requests that finished, by tenant and finish reason.
pub const REQUESTS_TOTAL: &str = "bulkhead_requests_total";
/// Requests refused with an error, by tenant and error code.
pub const REJECTIONS_TOTAL: &str = "bulkhead_rejections_total";
/// Prompt tokens of finished requests, by tenant.
pub const PROMPT_TOKENS_TOTAL: &str = "bulkhead_prompt_tokens_total";
/// Generated tokens of finished requests, by tenant.
pub const GENERATED_TOKENS_TOTAL: &str = "bulkhead_generated_tokens_total";
/// Seconds from arrival to the first generated text, by tenant.
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "bulkhead_time_to_first_token_seconds";
/// Seconds between successive pieces of generated text, by tenant.
pub const INTER_TOKEN_LATENCY_SECONDS: &str = "bulkhead_inter_token_latency_seconds";
/// Requests waiting in a tenant's queue.
pub const QUEUE_DEPTH: &str = "bulkhead_queue_depth";
/// Running sequences of a tenant.
pub const RUNNING: &str = "bulkhead_running_sequences";
/// Requests that ever entered a tenant's queue.
pub const ENQUEUED_TOTAL: &str = "bulkhead_enqueued_total";
/// KV pages of a tenant by state (owned, released, booked, available).
pub const KV_PAGES: &str = "bulkhead_kv_pages";
/// KV pages ever acquired for a tenant.
pub const KV_PAGES_ACQUIRED_TOTAL: &str = "bulkhead_kv_pages_acquired_total";
/// Pool-wide KV pages by state (total, free).
pub const KV_POOL_PAGES: &str = "bulkhead_kv_pool_pages";
/// KV pages scrubbed since start.
pub const KV_PAGES_SCRUBBED_TOTAL: &str = "bulkhead_kv_pages_scrubbed_total";

/// Connections a listener closed itself, by listener and reason
/// (`peer_limit`, `handshake_timeout`, `idle_timeout`).
pub const CONNECTIONS_CLOSED_TOTAL: &str = "bulkhead_connections_closed_total";

/// Plugin calls, by outcome (`ok`, `fuel`, `deadline`, `memory`, `host_limit`, `trap`).
pub const PLUGIN_CALLS_TOTAL: &str = "bulkhead_plugin_calls_total";
/// Plugins disabled after repeated faults.
pub const PLUGINS_DISABLED_TOTAL: &str = "bulkhead_plugins_disabled_total";

/// Histogram buckets for latencies, in seconds.
const LATENCY_BUCKETS_SECONDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Crates whose logs are capped at `info` (see the module doc).
const DEPENDENCY_LOG_CAPS: &[&str] = &[
    "hyper=info",
    "hyper_util=info",
    "h2=info",
    "rustls=info",
    "tokio_rustls=info",
];

/// Installs the global Prometheus recorder (no listener of its own: the
/// admin listener renders it at `/metrics`).
pub fn install_metrics() -> Result<PrometheusHandle, BuildError> {
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS_SECONDS)?
        .install_recorder()
}

/// JSON lines to stderr; `RUST_LOG` filters (default `info`).
pub fn init_tracing() {
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    for cap in DEPENDENCY_LOG_CAPS {
        if let Ok(directive) = cap.parse() {
            filter = filter.add_directive(directive);
        }
    }
    let _ = tracing_subscriber::fmt()
        .json()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_current_span(true)
        .try_init();
}

/// Counts a refused request.
pub fn count_rejection(tenant: &str, code: &'static str) {
    counter!(REJECTIONS_TOTAL, "tenant" => tenant.to_string(), "reason" => code).increment(1);
}

/// Counts a connection the listener closed itself.
pub fn count_connection_closed(listener: &'static str, reason: &'static str) {
    counter!(CONNECTIONS_CLOSED_TOTAL, "listener" => listener, "reason" => reason).increment(1);
}

/// Counts a plugin call by outcome.
pub fn count_plugin_call(outcome: &'static str) {
    counter!(PLUGIN_CALLS_TOTAL, "outcome" => outcome).increment(1);
}

/// Counts a plugin disabled after repeated faults.
pub fn count_plugin_disabled() {
    counter!(PLUGINS_DISABLED_TOTAL).increment(1);
}

/// Counts a finished request and its tokens.
pub fn count_finished(tenant: &str, reason: &'static str, prompt: u32, generated: u32) {
    counter!(REQUESTS_TOTAL, "tenant" => tenant.to_string(), "reason" => reason).increment(1);
    counter!(PROMPT_TOKENS_TOTAL, "tenant" => tenant.to_string()).increment(u64::from(prompt));
    counter!(GENERATED_TOKENS_TOTAL, "tenant" => tenant.to_string())
        .increment(u64::from(generated));
}

/// Records time to first token.
pub fn observe_first_token(tenant: &str, elapsed: Duration) {
    histogram!(TIME_TO_FIRST_TOKEN_SECONDS, "tenant" => tenant.to_string())
        .record(elapsed.as_secs_f64());
}

/// Records the gap between two pieces of text.
pub fn observe_inter_token(tenant: &str, gap: Duration) {
    histogram!(INTER_TOKEN_LATENCY_SECONDS, "tenant" => tenant.to_string())
        .record(gap.as_secs_f64());
}

/// Tenant names whose engine gauges were last published: a tenant that is
/// gone has its gauges set to zero once, not left at their last values.
static PUBLISHED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Sets the engine gauges from a snapshot; `name_of(id)` is tenant `id`'s
/// name (None for a tenant removed since the snapshot).
pub fn publish_engine_stats(stats: &SchedulerStats, name_of: impl Fn(u32) -> Option<String>) {
    let mut published = Vec::new();
    for t in &stats.tenants {
        let Some(name) = name_of(t.id) else {
            continue;
        };
        gauge!(QUEUE_DEPTH, "tenant" => name.clone()).set(f64::from(t.queued));
        gauge!(RUNNING, "tenant" => name.clone()).set(f64::from(t.running));
        for (state, pages) in [
            ("owned", t.pages_owned),
            ("released", t.pages_released),
            ("booked", t.pages_booked),
            ("available", t.pages_available),
        ] {
            gauge!(KV_PAGES, "tenant" => name.clone(), "state" => state).set(f64::from(pages));
        }
        counter!(ENQUEUED_TOTAL, "tenant" => name.clone()).absolute(t.counts.enqueued_total);
        counter!(KV_PAGES_ACQUIRED_TOTAL, "tenant" => name.clone())
            .absolute(t.counts.pages_acquired_total);
        published.push(name);
    }
    let mut last = PUBLISHED.lock().unwrap_or_else(|p| p.into_inner());
    for gone in last.iter().filter(|n| !published.contains(n)) {
        gauge!(QUEUE_DEPTH, "tenant" => gone.clone()).set(0.0);
        gauge!(RUNNING, "tenant" => gone.clone()).set(0.0);
        for state in ["owned", "released", "booked", "available"] {
            gauge!(KV_PAGES, "tenant" => gone.clone(), "state" => state).set(0.0);
        }
    }
    *last = published;
    gauge!(KV_POOL_PAGES, "state" => "total").set(f64::from(stats.pages_count));
    gauge!(KV_POOL_PAGES, "state" => "free").set(f64::from(stats.pages_free));
    counter!(KV_PAGES_SCRUBBED_TOTAL).absolute(stats.pages_scrubbed_total);
}
